#pragma once
// The trainer's side of a stream (docs/online.md): a RowSource whose rows are the slots of
// this rank's StreamBuffer, filled from the producers' messages by pull(), which the training
// thread calls before each micro-batch (collective over the trainer's ranks). The rows of a
// batch are batch_slots(seq): hashed from the buffer or in slot order ([stream] order).
//
// Set-up (the constructor) takes part in the rendezvous over MPI_COMM_WORLD: a mismatch with
// the producers is a bad_input Error naming the stream and both shapes, the same sentence the
// producers get. The destructor receives (and drops) what the producers still send until
// every producer has closed; trainer rank 0 answers every producer's close with its last word
// (stream_protocol::LastWord: done, or the stop of a run that failed before it took it).

#include <mpi.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/io/data_config.hpp"
#include "framework/io/normalization.hpp"
#include "framework/stream/stream_buffer.hpp"
#include "framework/stream/stream_protocol.hpp"

namespace meshtrain {

// Sums over the trainer's batch groups (each group's rows counted once), as of the last pull.
struct StreamCounters {
  int64_t rows_received = 0;     // rows taken into the buffers
  int64_t rows_overwritten = 0;  // replaced, or not kept by the reservoir
  int64_t buffer_rows = 0;       // rows the buffers hold
  int64_t rows_held_out = 0;     // stream.test_fraction: rows taken into the held-out windows
  // Publishes (stream.publish_every), as trainer rank 0 counts them (0 on the other ranks).
  int64_t publishes = 0;           // made: the version of the newest
  int64_t publishes_sent = 0;      // handed to MPI toward producer 0
  int64_t publishes_replaced = 0;  // overtaken by a newer one before they could be sent
};

// Where this trainer rank's pulls spent their time (bench/online_ingest.sh's accounting of the
// copies per byte), this rank's own, not agreed; a few clock reads per pull and per message:
struct StreamCopyTimes {
  int64_t pulls = 0;
  double pull_s = 0.0;     // in pull() (the first one's wait for min_rows included)
  double wire_s = 0.0;     // in the MPI_Recv and MPI_Mrecv of rows: MPI's copy into this rank
  double receive_s = 0.0;  // the rest of receive(): probes, matched probes, headers' receives
  double agree_s = 0.0;    // the two MPI_Allreduce of each pull (messages, counters)
  double take_s = 0.0;     // taking rows into the buffers, wire_s excluded: the staging copy
  // Rows received by MPI straight into the buffer's slots (no staging copy: docs/online.md).
  int64_t rows_direct = 0;
};

// What the trainer publishes (stream.publish_every > 0), told to the producers at the
// rendezvous so that their LiveModel is built before the first publish.
struct StreamModel {
  std::string config_text;       // the run's TOML text (what its checkpoints store)
  int64_t parameter_floats = 0;  // every parameter's elements, whole
  bool input_stats = false, target_stats = false;  // the normalization a publish carries
};

// A trainer whose run failed before its stream's rendezvous (a bad config, say) calls this on
// each of its ranks (collective over `parent` with the producers' connect), so that the
// producers' connect throws a bad_input Error saying why instead of waiting. Only before the
// rendezvous: compare stream_rendezvous_count() before and after building the run.
void stream_trainer_failed(const std::string& sentence, MPI_Comm parent = MPI_COMM_WORLD);
// The stream rendezvous this process took part in so far.
int64_t stream_rendezvous_count();

// Whether row `row` of producer `producer` is held out for evaluation at `fraction`: a hash of
// the two (no seed: the same rows in every run) below fraction.
bool stream_row_held_out(int64_t producer, int64_t row, double fraction);

class StreamSource : public RowSource {
 public:
  // `slice`: this rank's batch slice (its group over the batch axes); `min_rows` resolved
  // (> 0). Collective over MPI_COMM_WORLD (the rendezvous) and `trainer_comm`.
  // `model`: what a publish carries (read with section.publish_every > 0).
  StreamSource(const StreamSection& section, MPI_Comm trainer_comm, const BatchSlice& slice,
               int64_t features, int64_t outputs, int64_t min_rows, uint64_t seed,
               const StreamModel& model = {});
  ~StreamSource() override;
  StreamSource(const StreamSource&) = delete;
  StreamSource& operator=(const StreamSource&) = delete;

  // `rows` are buffer slots.
  void read(const int64_t* rows, int64_t count, const RowBuffers& out) override;
  int64_t resident_bytes() const override;

  // Collective over the trainer: receives what has come (never waiting for a producer), takes
  // the messages every rank of this group has into the buffer, and agrees on the counters.
  // The first call waits until every rank holds min_rows rows; bad_input (the same on every
  // rank) when the producers all closed before that.
  void pull();
  // The slots of this rank's `rows` rows of micro-batch `seq` (BatchSamples).
  int64_t batch_slots(int64_t seq, int64_t rows, int64_t* out) const;
  const StreamCounters& counters() const { return counters_; }
  const StreamCopyTimes& copy_times() const { return copy_times_; }
  // Every producer had closed (or was gone: stream.producer_timeout), on every rank, at the
  // last pull.
  bool ended() const { return ended_; }
  // Producer p was taken for gone (sent nothing for stream.producer_timeout seconds without
  // closing); the same on every trainer rank.
  bool producer_gone(int64_t p) const { return gone_[static_cast<size_t>(p)] != 0; }
  const StreamBuffer& buffer() const { return buffer_; }
  // The held-out rows (stream.test_fraction > 0): a window of this rank's newest, which
  // held_out_source() reads (the run's test set).
  const StreamBuffer& held_out() const { return held_out_; }
  // A RowSource over the held-out window (its slots), for the run to own as its test set;
  // it reads this source's window, so it must not outlive it.
  std::unique_ptr<RowSource> make_held_out_source() const;
  // This rank's slots of evaluation batch `batch` of `rows` rows: [batch x rows, +valid) of
  // the held-out window; returns valid (the rest padding).
  int64_t held_out_slots(int64_t batch, int64_t rows, int64_t* out) const;
  int64_t producers() const { return static_cast<int64_t>(producers_.size()); }

  // Checkpoints (stream.checkpoint_buffer, docs/online.md). Made once, not collective: this
  // rank's training buffer and (with test_fraction) held-out window as tensors of the trainer's
  // `mesh` (rank `rank`), "x", "y", "held_out_x", "held_out_y" of shape [groups, rows, width],
  // split over `batch_axes` (the ranks of a group hold the same bits, so one of them writes).
  // They view the buffers' own memory where the host can read the tensors' (else copies made
  // by checkpoint_state() and read back by restore()).
  const std::vector<ShardedTensor>& prepare_checkpoint(const Mesh& mesh,
                                                       const std::vector<std::string>& batch_axes,
                                                       int rank);
  // Collective over the trainer, before a save (`into.tensors` being prepare_checkpoint's):
  // the tensors current, and into rank 0's `rows_seen` every group's rows seen by its buffer
  // and its window ([groups x 2]).
  void checkpoint_state(StreamCheckpoint& into);
  // After load_checkpoint filled the tensors: the buffers continue from `rows_seen` (every
  // group's, as checkpoint_state() gave rank 0). bad_input when it does not fit them.
  void restore(const std::vector<int64_t>& rows_seen);
  int64_t groups() const { return groups_; }
  bool group_lead() const { return group_lead_; }

  // Normalization "standard" on a stream (docs/online.md): the first `rows` rows this rank's
  // training buffer takes are also kept aside, with their producer and row number, for the
  // statistics. Not collective; call before the first pull (allocates them).
  void keep_first_rows(int64_t rows);
  // Those kept so far, ordered by producer rank, then row number, into x [count, features]
  // and y [count, outputs]; returns count.
  int64_t first_rows(std::vector<float>& x, std::vector<float>& y) const;

  // Publishes (docs/online.md). Collective over the trainer, once before the first publish:
  // the gather of `params` (sharded on the trainer's `mesh`, its ranks those of trainer_comm)
  // and every buffer a publish uses, so that publish() allocates nothing.
  void prepare_publish(const std::vector<ShardedTensor>& params, const Mesh& mesh);
  // Collective over the trainer: the whole parameters gathered on rank 0 (every rank's block,
  // MPI_Gatherv) and, with `stats`, sent to producer 0 without waiting: when the previous
  // publish is still in flight (producer 0 has not taken it), this one waits in rank 0's
  // message until that send completes (tested at every pull), a newer one replacing it.
  // Nothing after producer 0 closed.
  void publish(const std::vector<ShardedTensor>& params, const Normalization& stats, int64_t step);
  bool publishing() const { return publish_every_ > 0; }

  // The run failed after the rendezvous (any error: a non-finite loss, a config refused after
  // set-up): trainer rank 0 tells every producer whose close it has not taken, on its own tag,
  // `why` (the error's sentence) as their last word, so that their sends drop their rows from
  // then on and the simulation finishes with one warning (docs/online.md). Not collective; once
  // (later calls do nothing). A source destroyed before finish() stops the producers by itself
  // (with a sentence that only says so); the run calls this first to give its reason.
  void stop_producers(const std::string& why);
  bool stopped_producers() const { return stop_sent_; }
  // The run completed its training (its last step, early stopping, every producer closed):
  // destroyed after this, the source ends the stream with "done" to every producer rather than
  // a stop. Without it (an error the caller caught, a caller that stops stepping early) the
  // destructor stops the producers.
  void finish() { finished_ = true; }
  // Outside pull() (the run's evaluation, its saves, the end of train()): trainer rank 0
  // answers with done every close that has come, so that a simulation closing while the
  // trainer does something else than a step returns at once instead of at its close_timeout
  // (docs/online.md). Never waits, not collective, never throws (what it cannot answer the
  // destructor does). Before finish() only rank 0 acts, and only the closes a free staging slot
  // receives are answered (the rows before them stay staged for the next pull); after it, every
  // rank receives and drops the rows no step will take (split messages' payloads included, whose
  // sends complete only then) until each producer's close, and rank 0 answers.
  void answer_closes();
  // What the run's user should be told, on trainer rank 0 (one sentence each, no "warning: "
  // prefix): a producer taken for gone (stream.producer_timeout), also from the destructor.
  // The library prints nothing itself; `meshtrain train` prints them (RunEvents::on_warning).
  void set_on_warning(std::function<void(const std::string&)> on_warning) {
    on_warning_ = std::move(on_warning);
  }

 private:
  void receive();
  void pull_once();
  void take(int64_t producer, const unsigned char* message);
  // Takes producer p's oldest staged message (rows or its close).
  void take_next(size_t p);
  // A split message (stream_protocol::kPayloadTag): its two matched payloads received straight
  // into the buffer's slots where they fit (float32, nothing held out, consecutive slots), else
  // into its staging slot after the header, then taken as a whole message is.
  void take_split(size_t p, unsigned char* message, MPI_Message* payloads);
  // Matches (MPI_Improbe, never waiting) the payloads still owed to producer p's newest header
  // into `payloads`; true once both are.
  bool match_payloads(size_t p, MPI_Message* payloads);
  // The destructor's and drain_to_closes' (after finish(): nothing is taken any more): receives
  // and drops every payload matched or owed but not taken, so that the producers' sends
  // complete (never throws; allocates nothing).
  void discard_payloads();
  void take_round_robin();  // stream.merge = "round_robin"
  // `held_back`: a producer the merge held back at that pull (its staging full), or -1.
  void warn_producer_gone(size_t producer, int64_t still_open, int64_t held_back = -1) const;
  // Rank 0: starts the send of the waiting publish once the previous one completed, and the
  // end once producer 0 closed (never waits).
  void progress_publish();
  // Rank 0, in the destructor: whether the end was sent and every publish send completed
  // (never throws: an MPI error ends the wait).
  bool publish_finished();

  StreamSection section_;
  MPI_Comm trainer_comm_ = MPI_COMM_NULL;  // the caller's
  MPI_Comm group_comm_ = MPI_COMM_NULL;    // the ranks of this rank's batch group
  MPI_Comm stream_comm_ = MPI_COMM_NULL;   // the stream's (a dup of MPI_COMM_WORLD)
  bool group_lead_ = false;
  int trainer_size_ = 1;
  int64_t group_ = 0;
  int64_t groups_ = 1;
  std::vector<ShardedTensor> checkpoint_tensors_;  // prepare_checkpoint's
  // keep_first_rows: the first rows taken, their (producer, row number), how many so far.
  int64_t first_wanted_ = 0, first_kept_ = 0;
  std::vector<float> first_x_, first_y_;
  std::vector<std::pair<int64_t, int64_t>> first_ids_;
  int64_t min_rows_ = 1;
  uint64_t seed_ = 0;
  int64_t dtype_ = 0;
  int64_t message_bytes_ = 0;
  std::vector<int> producers_;  // stream-communicator ranks
  StreamBuffer buffer_;
  StreamBuffer held_out_;
  // Each producer's received messages not yet taken: a FIFO of kStagingSlots slots.
  std::vector<std::vector<std::vector<unsigned char>>> staging_;
  std::vector<int64_t> staged_head_, staged_count_;
  // A split message's two payloads, matched but not received, per staging slot; and the
  // payloads producer p's newest header (received into the slot after its staged ones, not yet
  // counted as staged) still waits for (0: none).
  std::vector<std::vector<std::array<MPI_Message, 2>>> payloads_;
  std::vector<int> unmatched_;
  std::vector<int64_t> received_, taken_;  // messages, cumulative
  std::vector<int64_t> agreed_;            // the group's minimum of received_
  std::vector<char> closed_;               // its close was taken
  // stream.merge = "round_robin": whether producer p sends rows to this group, and whose turn
  // it is (the producer whose next message the merge waits for).
  std::vector<char> feeds_group_;
  size_t merge_turn_ = 0;
  // This rank's merge waited at producer p's turn at this pull (sent in the vote), and whether
  // any rank's did at the last one (agreed): a producer that has sent nothing is then on the
  // producer_timeout clock from the rendezvous.
  std::vector<int64_t> merge_waits_at_;
  std::vector<char> blocks_merge_;
  // stream.producer_timeout: a producer none of the trainer's ranks heard from for that long,
  // unclosed, is gone (every rank votes at each pull, on the totals agreed at the one before,
  // and the unanimous vote decides, so every rank decides at the same pull). `reduced_`: the
  // pull's counters, then each producer's messages (summed), its votes, the ranks holding it
  // back (its staging full) and the ranks whose merge waits at its turn.
  std::vector<int64_t> reduced_;
  std::vector<int64_t> heard_total_;  // the messages agreed at the last change
  std::vector<std::chrono::steady_clock::time_point> heard_at_;  // when that changed
  // Whether producer p's silence counts toward producer_timeout: it has sent (agreed), or a
  // merge waits at its turn.
  bool on_clock(size_t p) const { return heard_total_[p] > 0 || blocks_merge_[p]; }
  std::vector<char> gone_;
  std::vector<float> row_scratch_;  // a float64 row converted
  bool started_ = false;
  bool ended_ = false;
  StreamCounters counters_;
  StreamCopyTimes copy_times_;

  // Publishes. Every rank: its blocks packed (pack_); rank 0: every rank's blocks (gathered_,
  // at displs_), each rank's boxes, the message being made or waiting (waiting_) and the one
  // in flight (in_flight_), swapped rather than copied.
  int trainer_rank_ = 0;
  int64_t publish_every_ = 0, publish_floats_ = 0;
  bool input_stats_ = false, target_stats_ = false;
  bool publish_prepared_ = false;
  std::vector<float> pack_, gathered_;
  std::vector<int> counts_, displs_;
  std::vector<std::vector<ShardBox>> boxes_;         // [rank][parameter]
  std::vector<std::vector<int64_t>> global_shapes_;  // [parameter]
  std::vector<int64_t> whole_offsets_;               // [parameter]: floats into the message
  std::vector<unsigned char> waiting_, in_flight_;
  MPI_Request in_flight_request_ = MPI_REQUEST_NULL;
  bool waiting_ready_ = false;  // waiting_ holds a publish not yet sent
  bool end_owed_ = false;       // producer 0 closed: send the end, publish nothing more
  bool end_sent_ = false;
  // Lives until its send completes (on the heap: a send given up on at the end leaks it).
  std::unique_ptr<stream_protocol::PublishHeader> end_message_ =
      std::make_unique<stream_protocol::PublishHeader>();
  MPI_Request end_request_ = MPI_REQUEST_NULL;

  // Rank 0: sends producer p its last word (done; the stop is stop_producers') once its close
  // was taken, unless it had one.
  void send_done(size_t producer);
  // Whether a close is among the producer's staged messages (not yet taken by a pull).
  bool has_staged_close(size_t producer) const;

  // The last words (stream_protocol::LastWord): rank 0 sends every producer exactly one, its
  // stop (stop_producers) or done (send_done); both messages live until the destructor, which
  // waits for their sends (the requests reserved at construction: a pull allocates nothing).
  bool finished_ = false;  // finish(): the run completed
  bool stop_sent_ = false;
  stream_protocol::LastWord stop_message_;
  stream_protocol::LastWord done_message_;
  std::vector<char> last_word_sent_;  // [producer]
  // answer_closes() after finish(): the producers whose close it received past the staging
  // (their rows dropped), and where it receives them (reserved at construction).
  std::vector<char> close_drained_;
  std::vector<unsigned char> drain_scratch_;
  void drain_to_closes();
  std::vector<MPI_Request> last_word_requests_;
  std::function<void(const std::string&)> on_warning_;
};

}  // namespace meshtrain
