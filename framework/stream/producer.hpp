#pragma once
// The producer side of a stream (docs/online.md): a simulation's rank sends rows of
// (inputs, targets) to the trainer and goes on. Installed as <meshtrain/stream.hpp>.
//
//   meshtrain::StreamProducer producer;
//   producer.connect(sim_comm, "heat", 5, 1, meshtrain::StreamDtype::float64);  // collective
//   producer.send(x, y, rows);  // copies into the ring and returns
//   producer.close();
//
// connect is collective over the parent communicator (MPI_COMM_WORLD unless options say):
// every process of the job takes part in the rendezvous once (the trainer's ranks as their
// run is built). A shape, dtype or name the trainer does not share throws a bad_input Error,
// the same sentence the trainer reports. send copies the rows into a ring of message slots
// reserved at connect and starts their sends; it never waits for the trainer unless
// backpressure is block: with drop (the default) a message that finds no free slot after the
// sends in flight are tested is dropped and its rows counted in rows_dropped(). Nothing is
// allocated after connect.

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "framework/stream/stream_protocol.hpp"

namespace meshtrain {

enum class StreamDtype { float32, float64 };
enum class StreamBackpressure { drop, block };

struct StreamProducerOptions {
  int64_t ring_rows = 4096;    // rows the ring holds (rounded up to whole messages)
  int64_t message_rows = 256;  // rows of one message at most
  StreamBackpressure backpressure = StreamBackpressure::drop;
  MPI_Comm parent = MPI_COMM_WORLD;  // where the trainer is found
  // Seconds close() waits for the trainer's last word (its stop or its done, docs/online.md)
  // after this rank's sends completed; 0 (or infinity): for ever; negative or NaN: connect
  // refuses it (bad_input). On timeout close() reports one warning (on_warning) and returns,
  // the last word left unreceived.
  double close_timeout = 120.0;
  // What the simulation should be told, one sentence each (no "warning: " prefix): the trainer's
  // stop (on producer rank 0 only: every rank takes it) and a close the trainer did not answer
  // in close_timeout (on that rank). The library prints nothing itself: empty, nothing is
  // reported but stopped() and stop_reason(). The C API (stream.h) passes them to its
  // mt_stream_options.on_warning, else prints them to stderr.
  std::function<void(const std::string&)> on_warning;
};

class StreamProducer {
 public:
  StreamProducer() = default;
  ~StreamProducer();  // closes when connected (errors are swallowed: call close())
  StreamProducer(const StreamProducer&) = delete;
  StreamProducer& operator=(const StreamProducer&) = delete;

  // Collective over `options.parent` (and so over `comm`): finds the trainer of stream
  // `name`, checks the shapes and reserves the ring.
  void connect(MPI_Comm comm, const std::string& name, int64_t inputs, int64_t outputs,
               StreamDtype dtype, const StreamProducerOptions& options = {});
  // `rows` rows of x [rows, inputs] and y [rows, outputs], row-major host memory of the
  // connected dtype (another dtype is a bad_input Error).
  void send(const float* x, const float* y, int64_t rows);
  void send(const double* x, const double* y, int64_t rows);
  // Sends the close after every row, waits for this rank's sends to complete, then for the
  // trainer's last word (its stop, or done once it took this close; options.close_timeout),
  // and on rank 0 with publishes for the publishes' end.
  void close();

  bool connected() const { return stream_comm_ != MPI_COMM_NULL; }
  MPI_Comm comm() const { return comm_; }  // the producers' communicator given to connect

  // The trainer's publishes (stream.publish_every > 0; docs/online.md), which a LiveModel
  // (<meshtrain/stream.hpp>) reads. Only producer rank 0 receives them: take_publishes()
  // receives every publish that has come without waiting, keeping the newest (buffers
  // reserved at connect: nothing allocated); close() takes them until the trainer's end.
  int64_t publish_every() const { return publish_every_; }       // 0: the trainer publishes nothing
  const std::string& model_text() const { return model_text_; }  // the run's config text
  int64_t publish_floats() const { return publish_floats_; }
  bool publish_input_stats() const { return input_stats_; }
  bool publish_target_stats() const { return target_stats_; }
  int64_t publish_bytes() const { return static_cast<int64_t>(latest_.size()); }
  // Rank 0: receives what has come; returns the newest version held (0: none yet).
  int64_t take_publishes();
  int64_t latest_version() const { return latest_version_; }  // rank 0's
  // The newest publish's message (stream_protocol::PublishHeader, then its contents), on every
  // rank publish_bytes() long; only rank 0's is filled by take_publishes.
  unsigned char* latest_publish() { return latest_.data(); }
  int64_t rows_sent() const { return rows_sent_; }        // handed to MPI
  int64_t rows_dropped() const { return rows_dropped_; }  // ring full (drop), or after a stop
  // The trainer failed after the rendezvous and told the producers to stop (docs/online.md):
  // every send since it came dropped its rows (rows_dropped), the simulation goes on. Producer
  // rank 0 reports one warning naming the stream and the trainer's sentence (stop_reason())
  // through options.on_warning. A stop that comes while close() waits counts too.
  bool stopped() const { return stopped_; }
  const char* stop_reason() const { return last_word_.note; }
  const std::string& name() const { return name_; }

 private:
  void send_bytes(const void* x, const void* y, int64_t rows, int64_t element_bytes);
  int take_free_slot();  // -1: none (drop)

  void receive_publish();  // one message into incoming_, the newest kept
  // Takes the trainer's last word when it has come (never waits); true once stopped.
  bool check_stop();
  // close(): waits for the last word (and rank 0's publishes' end) up to close_timeout_.
  void wait_for_last_word();
  void warn(const std::string& sentence) const;

  MPI_Comm stream_comm_ = MPI_COMM_NULL;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  std::string name_;
  int64_t producer_index_ = 0, producers_ = 1, groups_ = 1;
  std::vector<std::vector<int>> group_ranks_;  // stream-communicator ranks of each group
  std::vector<int> trainers_;
  int64_t inputs_ = 0, outputs_ = 0, element_bytes_ = 4, message_rows_ = 0;
  StreamBackpressure backpressure_ = StreamBackpressure::drop;
  // The ring: slots of one message each, every slot's sends (one per rank of its group).
  std::vector<std::vector<unsigned char>> slots_;
  std::vector<std::vector<MPI_Request>> slot_requests_;
  int64_t next_slot_ = 0;
  int64_t messages_ = 0;  // rows messages started (the group of the next is chosen by it)
  int64_t next_row_ = 0;  // the row number of the next row sent
  int64_t rows_sent_ = 0, rows_dropped_ = 0;
  // Publishes: the trainer rank 0 that sends them (stream-communicator rank).
  int64_t publish_every_ = 0, publish_floats_ = 0;
  bool input_stats_ = false, target_stats_ = false;
  std::string model_text_;
  int publisher_ = 0;
  std::vector<unsigned char> incoming_, latest_;  // rank 0: incoming_; every rank: latest_
  int64_t latest_version_ = 0;
  bool publish_ended_ = false;  // the trainer's end came: nothing more will
  // The trainer's last word (stream_protocol::LastWord: its stop or done), received into memory
  // of the object.
  bool stopped_ = false;
  bool last_word_received_ = false;
  stream_protocol::LastWord last_word_;
  double close_timeout_ = 120.0;
  std::function<void(const std::string&)> on_warning_;
};

}  // namespace meshtrain
