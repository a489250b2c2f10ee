#include "framework/stream/stream_source.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "base/error.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/stream/stream_protocol.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

namespace sp = stream_protocol;

bool stream_row_held_out(int64_t producer, int64_t row, double fraction) {
  if (fraction <= 0.0) return false;
  const uint64_t h = stream_hash(stream_hash(static_cast<uint64_t>(producer)) ^
                                 stream_hash(static_cast<uint64_t>(row) + 0x5eed));
  return static_cast<double>(h >> 11) * 0x1.0p-53 < fraction;
}

namespace {

// The held-out window as a RowSource: the run's test set.
class HeldOutSource : public RowSource {
 public:
  HeldOutSource(const StreamBuffer& rows, const std::string& name) : rows_(rows) {
    shape_.description = "the rows held out of stream \"" + name + "\"";
    shape_.num_samples = rows.capacity();
    shape_.features = rows.features();
    shape_.target_width = rows.outputs();
  }
  void read(const int64_t* slots, int64_t count, const RowBuffers& out) override {
    const int64_t f = rows_.features(), w = rows_.outputs();
    for (int64_t i = 0; i < count; ++i) {
      std::memcpy(out.x + i * f, rows_.x(slots[i]), static_cast<size_t>(f) * sizeof(float));
      if (out.targets) {
        std::memcpy(out.targets + i * w, rows_.y(slots[i]), static_cast<size_t>(w) * sizeof(float));
      }
    }
  }
  int64_t resident_bytes() const override { return 0; }  // counted by the StreamSource

 private:
  const StreamBuffer& rows_;
};

// The counters every pull sums over the trainer, before the producers' messages and votes.
constexpr size_t kCounterSums = 6;

int64_t held_out_capacity(const StreamSection& section) {
  return std::max<int64_t>(1, stream_held_out_rows(section));  // 1: unused
}

}  // namespace

int64_t stream_rendezvous_count() {
  return sp::rendezvous_count();
}

void stream_trainer_failed(const std::string& sentence, MPI_Comm parent) {
  sp::Hello hello;
  hello.role = sp::kFailedTrainer;
  std::memcpy(hello.note, sentence.data(), std::min(sentence.size(), sizeof hello.note - 1));
  MPI_Comm stream_comm = MPI_COMM_NULL;
  sp::rendezvous(parent, hello, &stream_comm);
  check_mpi(MPI_Comm_free(&stream_comm), "MPI_Comm_free (a failed trainer's stream)");
}

StreamSource::StreamSource(const StreamSection& section, MPI_Comm trainer_comm,
                           const BatchSlice& slice, int64_t features, int64_t outputs,
                           int64_t min_rows, uint64_t seed, const StreamModel& model)
    : section_(section),
      trainer_comm_(trainer_comm),
      group_(slice.index),
      groups_(slice.count),
      min_rows_(min_rows),
      seed_(seed),
      buffer_(section.buffer_rows, features, outputs, section.policy, seed, slice.index),
      held_out_(held_out_capacity(section), features, outputs, StreamPolicy::window, seed,
                slice.index) {
  // The config checks it too (stream.last_word_timeout); here for library users, before the
  // rendezvous (a trainer failing there says why to the producers: stream_trainer_failed).
  // NaN compares false: refused with the rest.
  if (!(section.last_word_timeout > 0.0)) {
    MESHTRAIN_BAD_INPUT("stream \"", section.name, "\": last_word_timeout must be a positive ",
                        "number of seconds, got ", section.last_word_timeout);
  }
  if (section.held_out_rows < 0) {
    MESHTRAIN_BAD_INPUT("stream \"", section.name, "\": held_out_rows must be 0 (the default ",
                        "window) or a positive number of rows, got ", section.held_out_rows);
  }
  shape_.description = "stream \"" + section.name + "\"";
  shape_.num_samples = section.buffer_rows;
  shape_.features = features;
  shape_.target_width = outputs;
  int rank = 0;
  check_mpi(MPI_Comm_rank(trainer_comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(trainer_comm, &trainer_size_), "MPI_Comm_size");
  trainer_rank_ = rank;

  sp::Hello hello;
  hello.role = sp::kTrainer;
  hello.local_rank = rank;
  hello.inputs = features;
  hello.outputs = outputs;
  hello.dtype = section.dtype == StreamRowType::float64 ? sp::kFloat64 : sp::kFloat32;
  hello.batch_index = slice.index;
  hello.batch_count = slice.count;
  hello.publish_every = section.publish_every;
  hello.publish_floats = model.parameter_floats;
  hello.input_stats = model.input_stats ? 1 : 0;
  hello.target_stats = model.target_stats ? 1 : 0;
  const std::string& name = section.name;
  std::memcpy(hello.name, name.data(),
              std::min<size_t>(name.size(), static_cast<size_t>(sp::kNameBytes - 1)));
  const sp::Rendezvous r = sp::rendezvous(MPI_COMM_WORLD, hello, &stream_comm_,
                                          section.publish_every > 0 ? model.config_text : "");
  if (!r.problem.empty()) {
    check_mpi(MPI_Comm_free(&stream_comm_), "MPI_Comm_free (a refused stream)");
    MESHTRAIN_BAD_INPUT(r.problem);
  }
  dtype_ = r.dtype;
  producers_ = r.producers;
  message_bytes_ = sp::message_bytes(r.max_message_rows, features, outputs, dtype_);
  check_mpi(MPI_Comm_split(trainer_comm, static_cast<int>(group_), rank, &group_comm_),
            "MPI_Comm_split (a stream's batch group)");
  int group_rank = 0;
  check_mpi(MPI_Comm_rank(group_comm_, &group_rank), "MPI_Comm_rank");
  group_lead_ = group_rank == 0;

  const size_t producers = producers_.size();
  staging_.assign(producers, std::vector<std::vector<unsigned char>>(
                                 sp::kStagingSlots,
                                 std::vector<unsigned char>(static_cast<size_t>(message_bytes_))));
  payloads_.assign(producers, std::vector<std::array<MPI_Message, 2>>(
                                  sp::kStagingSlots, {MPI_MESSAGE_NULL, MPI_MESSAGE_NULL}));
  unmatched_.assign(producers, 0);
  staged_head_.assign(producers, 0);
  staged_count_.assign(producers, 0);
  received_.assign(producers, 0);
  taken_.assign(producers, 0);
  agreed_.assign(producers, 0);
  closed_.assign(producers, 0);
  reduced_.assign(kCounterSums + 4 * producers, 0);
  heard_total_.assign(producers, 0);
  heard_at_.assign(producers, std::chrono::steady_clock::now());
  gone_.assign(producers, 0);
  merge_waits_at_.assign(producers, 0);
  blocks_merge_.assign(producers, 0);
  row_scratch_.assign(static_cast<size_t>(features + outputs), 0.0f);
  // Producer p sends message m to group group_of_message(p, m): whether any reaches this one.
  feeds_group_.assign(producers, 0);
  for (size_t p = 0; p < producers; ++p) {
    for (int64_t m = 0; m < groups_; ++m) {
      if (sp::group_of_message(static_cast<int64_t>(p), m, static_cast<int64_t>(producers),
                               groups_) == group_) {
        feeds_group_[p] = 1;
      }
    }
  }
  publish_every_ = section.publish_every;
  publish_floats_ = model.parameter_floats;
  input_stats_ = model.input_stats;
  target_stats_ = model.target_stats;
  last_word_sent_.assign(producers, 0);
  last_word_requests_.reserve(producers);
  close_drained_.assign(producers, 0);
  drain_scratch_.assign(static_cast<size_t>(message_bytes_), 0);
  done_message_.kind = sp::kDone;
}

void StreamSource::stop_producers(const std::string& why) {
  if (stop_sent_) return;
  stop_sent_ = true;
  if (trainer_rank_ != 0) return;
  stop_message_ = sp::LastWord{};
  stop_message_.kind = sp::kStop;
  std::memcpy(stop_message_.note, why.data(),
              std::min<size_t>(why.size(), static_cast<size_t>(sp::kNoteBytes - 1)));
  for (size_t p = 0; p < producers_.size(); ++p) {
    // A closed producer had its done; a gone one would never take it (its last word is left
    // out, as its close is not waited for).
    if (last_word_sent_[p] || closed_[p] || gone_[p]) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    // On a failure path: an MPI error here must not hide the run's own error.
    if (MPI_Isend(&stop_message_, sizeof stop_message_, MPI_BYTE, producers_[p], sp::kLastWordTag,
                  stream_comm_, &request) == MPI_SUCCESS) {
      last_word_requests_.push_back(request);
    }
    last_word_sent_[p] = 1;
  }
}

void StreamSource::send_done(size_t producer) {
  if (trainer_rank_ != 0 || last_word_sent_[producer]) return;
  last_word_sent_[producer] = 1;
  MPI_Request request = MPI_REQUEST_NULL;
  // Also called by the destructor, which does not throw: an MPI error leaves the producer's
  // close() to its timeout.
  if (MPI_Isend(&done_message_, sizeof done_message_, MPI_BYTE, producers_[producer],
                sp::kLastWordTag, stream_comm_, &request) == MPI_SUCCESS) {
    last_word_requests_.push_back(request);
  }
}

bool StreamSource::has_staged_close(size_t producer) const {
  for (int64_t i = 0; i < staged_count_[producer]; ++i) {
    sp::Header header;
    std::memcpy(
        &header,
        staging_[producer][static_cast<size_t>((staged_head_[producer] + i) % sp::kStagingSlots)]
            .data(),
        sizeof header);
    if (header.kind == sp::kClose) return true;
  }
  return false;
}

void StreamSource::answer_closes() {
  if (producers_.empty()) return;
  // After finish() every trainer rank drains: the split messages staged on any rank keep their
  // producers' sends (and so their close()) incomplete until their payloads are received. The
  // last words are rank 0's alone (send_done sends nothing elsewhere).
  if (trainer_rank_ != 0 && !finished_) return;
  try {
    if (finished_) {
      drain_to_closes();
    } else {
      receive();  // into the free staging slots, as a pull would (its group takes them later)
    }
    if (trainer_rank_ != 0) return;
    for (size_t p = 0; p < producers_.size(); ++p) {
      if (last_word_sent_[p] || gone_[p]) continue;
      if (!has_staged_close(p)) continue;
      send_done(p);  // the pull that takes this close later sends nothing more
      if (p == 0) end_owed_ = true;
    }
    if (publish_every_ > 0) progress_publish();
  } catch (const Error&) {
    // An early answer only: the destructor answers what is left (or the producer's
    // close_timeout ends its wait); the run's own work goes on.
  }
}

// After finish(): no step takes the rows any more. Each producer whose close is not staged and
// whose staging is full has its further messages received and dropped up to its close (kept in
// close_drained_ for the destructor).
void StreamSource::drain_to_closes() {
  receive();
  // The split messages staged will not be taken: their payloads received and dropped now, so
  // that the producers' sends complete and a close() waiting for them returns.
  discard_payloads();
  for (size_t p = 0; p < producers_.size(); ++p) {
    if (closed_[p] || gone_[p] || close_drained_[p] || last_word_sent_[p]) continue;
    if (staged_count_[p] < sp::kStagingSlots) continue;  // all that came is staged
    const bool staged_close = has_staged_close(p);
    while (!staged_close && !close_drained_[p]) {
      int flag = 0;
      check_mpi(MPI_Iprobe(producers_[p], sp::kTag, stream_comm_, &flag, MPI_STATUS_IGNORE),
                "MPI_Iprobe (a stream's rows after training)");
      if (!flag) break;
      check_mpi(MPI_Recv(drain_scratch_.data(), static_cast<int>(drain_scratch_.size()), MPI_BYTE,
                         producers_[p], sp::kTag, stream_comm_, MPI_STATUS_IGNORE),
                "MPI_Recv (a stream's rows after training)");
      sp::Header header;
      std::memcpy(&header, drain_scratch_.data(), sizeof header);
      // A split message's payloads follow its header (the staging is full: no payload of this
      // producer is owed to a staged header).
      for (int k = 0; header.kind == sp::kRows && header.split != 0 && k < 2; ++k) {
        check_mpi(MPI_Recv(drain_scratch_.data(), static_cast<int>(drain_scratch_.size()), MPI_BYTE,
                           producers_[p], sp::kPayloadTag, stream_comm_, MPI_STATUS_IGNORE),
                  "MPI_Recv (a stream's rows after training)");
      }
      if (header.kind == sp::kClose) {
        close_drained_[p] = 1;
        send_done(p);
        if (p == 0) end_owed_ = true;
      }
    }
  }
}

StreamSource::~StreamSource() {
  // Destroyed before the run completed (finish(): not after an error, in set-up or training,
  // whether the caller caught it or not, nor when a caller stepping by hand stopped early): the
  // producers are told to stop sending, unless the run already told them why.
  if (!finished_) {
    stop_producers(
        "the trainer's run ended before it finished (on an error, or stopped early by its "
        "program: the trainer's output says which)");
  }
  // What the producers still send is received and dropped until every one has closed, so
  // that their sends complete (a producer's close waits for them).
  // A producer taken for gone is not waited for (nor, when it is producer 0, the publishes it
  // would take: their sends are left to MPI).
  std::vector<char> closed = closed_;
  for (size_t p = 0; p < producers_.size(); ++p) {
    closed[p] = closed[p] || gone_[p] || close_drained_[p];
  }
  if (!gone_.empty() && gone_[0]) publish_every_ = 0;
  for (size_t p = 0; p < producers_.size(); ++p) {
    if (!has_staged_close(p)) continue;
    closed[p] = 1;
    send_done(p);
  }
  // The payloads of split messages staged and never taken (or still owed to a header).
  try {
    discard_payloads();
  } catch (const Error&) {
    return;  // a destructor does not throw
  }
  std::vector<unsigned char> scratch(static_cast<size_t>(message_bytes_));
  // Producer 0's close ends the publishes; its close() takes them until the end comes.
  if (!closed.empty() && closed[0]) end_owed_ = true;
  // A run that ends by its steps before a silent producer's timeout came due still applies it
  // here, on each rank's own clock (nothing is agreed any more), counting what this drain takes.
  std::vector<std::chrono::steady_clock::time_point> heard_at = heard_at_;
  std::vector<char> has_sent(producers_.size(), 0);
  for (size_t p = 0; p < producers_.size(); ++p) {
    has_sent[p] = on_clock(p);  // as in the pulls
  }
  const double timeout = section_.producer_timeout;
  // Once every producer closed, the publishes' end is waited for at most
  // stream.last_word_timeout seconds: a producer 0 whose close() gave up waiting (its
  // close_timeout) never takes them.
  const double last_word_timeout = section_.last_word_timeout;
  std::optional<std::chrono::steady_clock::time_point> all_closed_at;
  while (true) {
    if (std::find(closed.begin(), closed.end(), 0) == closed.end()) {
      if (publish_finished()) break;
      const auto now = std::chrono::steady_clock::now();
      if (!all_closed_at) all_closed_at = now;
      if (std::chrono::duration<double>(now - *all_closed_at).count() > last_word_timeout) {
        // Left to MPI. A producer 0 still inside close() could yet receive them, so their
        // buffers outlive this object: deliberately leaked (once, at the end of a run).
        if (in_flight_request_ != MPI_REQUEST_NULL) {
          MPI_Request_free(&in_flight_request_);
          static_cast<void>(new std::vector<unsigned char>(std::move(in_flight_)));  // same buffer
        }
        if (end_request_ != MPI_REQUEST_NULL) {
          MPI_Request_free(&end_request_);
          end_message_.release();
        }
        break;
      }
    }
    bool got = false;
    for (size_t p = 0; p < producers_.size(); ++p) {
      if (closed[p]) continue;
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(producers_[p], sp::kTag, stream_comm_, &flag, &status) != MPI_SUCCESS) {
        return;  // a destructor does not throw
      }
      const auto now = std::chrono::steady_clock::now();
      if (!flag) {
        if (timeout > 0.0 && has_sent[p] &&
            std::chrono::duration<double>(now - heard_at[p]).count() > timeout) {
          closed[p] = 1;
          if (p == 0) publish_every_ = 0;  // nobody takes the publishes
          int64_t open = 0;
          for (size_t q = 0; q < producers_.size(); ++q) open += closed[q] ? 0 : 1;
          warn_producer_gone(p, open);
        }
        continue;
      }
      MPI_Recv(scratch.data(), static_cast<int>(scratch.size()), MPI_BYTE, producers_[p], sp::kTag,
               stream_comm_, MPI_STATUS_IGNORE);
      heard_at[p] = now;
      has_sent[p] = 1;
      sp::Header header;
      std::memcpy(&header, scratch.data(), sizeof header);
      for (int k = 0; header.kind == sp::kRows && header.split != 0 && k < 2; ++k) {
        MPI_Recv(scratch.data(), static_cast<int>(scratch.size()), MPI_BYTE, producers_[p],
                 sp::kPayloadTag, stream_comm_, MPI_STATUS_IGNORE);  // its payloads
      }
      if (header.kind == sp::kClose) {
        closed[p] = 1;
        send_done(p);
        if (p == 0) end_owed_ = true;
      }
      got = true;
    }
    if (!got) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Every last word sent is taken by its producer's close(), which waits for it (a producer
  // taken for gone had none). A bound all the same (stream.last_word_timeout): a producer whose
  // close() gave up waiting (its close_timeout) never takes it, and the message is then left to
  // MPI.
  const auto sent_at = std::chrono::steady_clock::now();
  while (!last_word_requests_.empty()) {
    int done = 0;
    if (MPI_Testall(static_cast<int>(last_word_requests_.size()), last_word_requests_.data(), &done,
                    MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
        done) {
      break;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - sent_at).count() >
        last_word_timeout) {
      for (MPI_Request& request : last_word_requests_) {
        if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  MPI_Comm_free(&group_comm_);
  MPI_Comm_free(&stream_comm_);
}

// On trainer rank 0 only, through on_warning_ (set by the run): it may come from the
// destructor, after the run's last event.
void StreamSource::warn_producer_gone(size_t producer, int64_t still_open,
                                      int64_t held_back) const {
  if (trainer_rank_ != 0 || !on_warning_) return;
  const double timeout = section_.producer_timeout;
  // Under round_robin a producer waiting for another in its own exchange (a halo, a collective)
  // while the merge waits at its turn looks the same from here: said, as a possible cause.
  const std::string held =
      held_back < 0 ? std::string()
                    : detail::concat("; the merge waited at its turn and held back producer ",
                                     held_back, " meanwhile (producers that wait for each other ",
                                     "must send as many messages per step under stream.merge = ",
                                     "round_robin: docs/online.md)");
  on_warning_(detail::concat(
      "stream \"", section_.name, "\": producer ", producer, " (world rank ", producers_[producer],
      ") sent nothing for ", timeout, " s and has not closed (did it end without close()?); the ",
      "trainer goes on with the ", still_open, " producers still open and no longer waits for it ",
      "(stream.producer_timeout = ", timeout, ")", held));
}

void StreamSource::read(const int64_t* rows, int64_t count, const RowBuffers& out) {
  const int64_t f = buffer_.features(), w = buffer_.outputs();
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(out.x + i * f, buffer_.x(rows[i]), static_cast<size_t>(f) * sizeof(float));
    if (out.targets) {
      std::memcpy(out.targets + i * w, buffer_.y(rows[i]), static_cast<size_t>(w) * sizeof(float));
    }
  }
}

int64_t StreamSource::resident_bytes() const {
  return buffer_.bytes() + (section_.test_fraction > 0.0 ? held_out_.bytes() : 0) +
         static_cast<int64_t>(producers_.size()) * sp::kStagingSlots * message_bytes_;
}

// Every producer's messages that have come, while it has a free staging slot: never waits
// for a producer (MPI_Recv of a message MPI_Iprobe found only copies it).
// A split message (a large one: stream_protocol::kPayloadTag) is staged as its header and its
// two payloads matched, not received: they are received when the message is taken.
void StreamSource::receive() {
  for (size_t p = 0; p < producers_.size(); ++p) {
    while (true) {
      const auto tail =
          static_cast<size_t>((staged_head_[p] + staged_count_[p]) % sp::kStagingSlots);
      if (unmatched_[p] > 0) {  // the newest header's payloads, as they come
        if (!match_payloads(p, payloads_[p][tail].data())) break;
        ++staged_count_[p];
        ++received_[p];
        continue;
      }
      if (staged_count_[p] >= sp::kStagingSlots) break;
      int flag = 0;
      check_mpi(MPI_Iprobe(producers_[p], sp::kTag, stream_comm_, &flag, MPI_STATUS_IGNORE),
                "MPI_Iprobe (a stream's rows)");
      if (!flag) break;
      auto& slot = staging_[p][tail];
      const auto wire_start = std::chrono::steady_clock::now();
      check_mpi(MPI_Recv(slot.data(), static_cast<int>(slot.size()), MPI_BYTE, producers_[p],
                         sp::kTag, stream_comm_, MPI_STATUS_IGNORE),
                "MPI_Recv (a stream's rows)");
      copy_times_.wire_s +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - wire_start).count();
      sp::Header header;
      std::memcpy(&header, slot.data(), sizeof header);
      if (header.kind == sp::kRows && header.split != 0) {
        unmatched_[p] = 2;
        continue;
      }
      ++staged_count_[p];
      ++received_[p];
    }
  }
}

bool StreamSource::match_payloads(size_t p, MPI_Message* payloads) {
  while (unmatched_[p] > 0) {
    int flag = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    check_mpi(MPI_Improbe(producers_[p], sp::kPayloadTag, stream_comm_, &flag, &message,
                          MPI_STATUS_IGNORE),
              "MPI_Improbe (a stream's rows)");
    if (!flag) return false;
    payloads[2 - unmatched_[p]] = message;
    --unmatched_[p];
  }
  return true;
}

void StreamSource::take_split(size_t p, unsigned char* message, MPI_Message* payloads) {
  sp::Header header;
  std::memcpy(&header, message, sizeof header);
  const int64_t f = buffer_.features(), w = buffer_.outputs();
  const int64_t element = sp::dtype_bytes(dtype_);
  const int64_t rows = header.rows;
  const int64_t first =
      dtype_ == sp::kFloat32 && section_.test_fraction <= 0.0 ? buffer_.run_slot(rows) : -1;
  // The x rows' and the y rows' payloads into x_to and y_to, timed as the wire's.
  const auto receive = [&](void* x_to, void* y_to) {
    const auto wire_start = std::chrono::steady_clock::now();
    check_mpi(MPI_Mrecv(x_to, static_cast<int>(rows * f * element), MPI_BYTE, &payloads[0],
                        MPI_STATUS_IGNORE),
              "MPI_Mrecv (a stream's x rows)");
    check_mpi(MPI_Mrecv(y_to, static_cast<int>(rows * w * element), MPI_BYTE, &payloads[1],
                        MPI_STATUS_IGNORE),
              "MPI_Mrecv (a stream's y rows)");
    copy_times_.wire_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wire_start).count();
  };
  if (first >= 0) {
    // Straight into the slots the rows would be copied to one by one: the same bits.
    receive(buffer_.x_data() + first * f, buffer_.y_data() + first * w);
    buffer_.add_run(rows);
    for (int64_t r = 0; r < rows && first_kept_ < first_wanted_; ++r) {
      const float* x = buffer_.x(first + r);
      const float* y = buffer_.y(first + r);
      std::copy(x, x + f, first_x_.begin() + first_kept_ * f);
      std::copy(y, y + w, first_y_.begin() + first_kept_ * w);
      first_ids_[static_cast<size_t>(first_kept_++)] = {static_cast<int64_t>(p),
                                                        header.first_row + r};
    }
    copy_times_.rows_direct += rows;
    return;
  }
  // As a whole message: x then y after the header, in the slot sized for one.
  unsigned char* payload = message + sizeof header;
  receive(payload, payload + rows * f * element);
  take(static_cast<int64_t>(p), message);
}

void StreamSource::discard_payloads() {
  std::vector<unsigned char>& scratch = drain_scratch_;  // reserved at construction
  for (size_t p = 0; p < producers_.size(); ++p) {
    // A producer taken for gone may never send what it owes: not waited for (its sends are
    // left to MPI, as its close is).
    if (gone_[p]) continue;
    for (int64_t i = 0; i <= staged_count_[p] && i < sp::kStagingSlots; ++i) {
      // The staged slots, then the newest header's (matched in part) after them.
      auto& payloads = payloads_[p][static_cast<size_t>((staged_head_[p] + i) % sp::kStagingSlots)];
      for (MPI_Message& message : payloads) {
        if (message == MPI_MESSAGE_NULL) continue;
        // MPI_Mrecv sets message to MPI_MESSAGE_NULL; on an error too, so none is received twice.
        const int rc = MPI_Mrecv(scratch.data(), static_cast<int>(scratch.size()), MPI_BYTE,
                                 &message, MPI_STATUS_IGNORE);
        message = MPI_MESSAGE_NULL;
        check_mpi(rc, "MPI_Mrecv (a stream's rows no step takes)");
      }
    }
    while (unmatched_[p] > 0) {  // sent with their header: they come
      --unmatched_[p];
      check_mpi(MPI_Recv(scratch.data(), static_cast<int>(scratch.size()), MPI_BYTE, producers_[p],
                         sp::kPayloadTag, stream_comm_, MPI_STATUS_IGNORE),
                "MPI_Recv (a stream's rows no step takes)");
    }
  }
}

void StreamSource::take(int64_t producer, const unsigned char* message) {
  sp::Header header;
  std::memcpy(&header, message, sizeof header);
  const unsigned char* payload = message + sizeof header;
  const int64_t f = buffer_.features(), w = buffer_.outputs();
  const double fraction = section_.test_fraction;
  // Row r of the message is the producer's row first_row + r: held out or trained on.
  const auto keep = [&](int64_t r, const float* x, const float* y) {
    if (stream_row_held_out(producer, header.first_row + r, fraction)) {
      held_out_.add(x, y);
      return;
    }
    buffer_.add(x, y);
    if (first_kept_ < first_wanted_) {
      std::copy(x, x + f, first_x_.begin() + first_kept_ * f);
      std::copy(y, y + w, first_y_.begin() + first_kept_ * w);
      first_ids_[static_cast<size_t>(first_kept_++)] = {producer, header.first_row + r};
    }
  };
  if (dtype_ == sp::kFloat32) {
    const auto* x = reinterpret_cast<const float*>(payload);
    const float* y = x + header.rows * f;
    for (int64_t r = 0; r < header.rows; ++r) keep(r, x + r * f, y + r * w);
    return;
  }
  const auto* x = reinterpret_cast<const double*>(payload);
  const double* y = x + header.rows * f;
  for (int64_t r = 0; r < header.rows; ++r) {
    for (int64_t j = 0; j < f; ++j)
      row_scratch_[static_cast<size_t>(j)] = static_cast<float>(x[r * f + j]);
    for (int64_t j = 0; j < w; ++j) {
      row_scratch_[static_cast<size_t>(f + j)] = static_cast<float>(y[r * w + j]);
    }
    keep(r, row_scratch_.data(), row_scratch_.data() + f);
  }
}

void StreamSource::take_next(size_t p) {
  auto& slot = staging_[p][static_cast<size_t>(staged_head_[p])];
  sp::Header header;
  std::memcpy(&header, slot.data(), sizeof header);
  if (header.kind == sp::kClose) {
    closed_[p] = 1;
    send_done(p);                  // the handshake: this producer's close() waits for it
    if (p == 0) end_owed_ = true;  // no publish after producer 0's close
  } else if (header.split != 0) {
    take_split(p, slot.data(), payloads_[p][static_cast<size_t>(staged_head_[p])].data());
  } else {
    take(static_cast<int64_t>(p), slot.data());
  }
  staged_head_[p] = (staged_head_[p] + 1) % sp::kStagingSlots;
  --staged_count_[p];
  ++taken_[p];
}

// stream.merge = "round_robin": this group's messages in the sequence (producer q_0's first,
// q_1's first, ..., q_0's second, ...) over the producers that feed it, a producer leaving the
// turn once its close is taken (or it is gone); the longest prefix of that sequence that every
// rank of the group has (agreed_) is taken. The turn (merge_turn_) carries over to the next
// pull. Producers that feed no row to this group send it only their close, taken as it comes.
void StreamSource::take_round_robin() {
  const size_t producers = producers_.size();
  std::fill(merge_waits_at_.begin(), merge_waits_at_.end(), 0);
  for (size_t p = 0; p < producers; ++p) {
    // A producer taken for gone only leaves the turn: what it still sends is taken as it comes
    // (else its staging stays full, its sends never complete and its close() never returns).
    if (!feeds_group_[p] || gone_[p]) {
      while (taken_[p] < agreed_[p] && !closed_[p]) take_next(p);
    }
  }
  while (true) {
    size_t p = merge_turn_;
    size_t looked = 0;
    for (; looked < producers; ++looked, p = (p + 1) % producers) {
      if (feeds_group_[p] && !closed_[p] && !gone_[p]) break;
    }
    if (looked == producers) return;  // every producer of this group closed (or gone)
    if (taken_[p] >= agreed_[p]) {
      merge_turn_ = p;  // its next message has not come to every rank: wait
      merge_waits_at_[p] = 1;
      return;
    }
    take_next(p);
    merge_turn_ = (p + 1) % producers;
  }
}

void StreamSource::pull_once() {
  using Clock = std::chrono::steady_clock;
  const auto seconds = [](Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  };
  const auto receive_start = Clock::now();
  const double wire_before = copy_times_.wire_s;
  receive();
  const auto receive_end = Clock::now();
  copy_times_.receive_s += seconds(receive_start, receive_end) - (copy_times_.wire_s - wire_before);
  // The ranks of a group take the same messages, producer by producer: the same buffer bits.
  std::copy(received_.begin(), received_.end(), agreed_.begin());
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, agreed_.data(), static_cast<int>(agreed_.size()),
                          MPI_INT64_T, MPI_MIN, group_comm_),
            "MPI_Allreduce (a stream's messages)");
  const auto take_start = Clock::now();
  copy_times_.agree_s += seconds(receive_end, take_start);
  const double wire_taking = copy_times_.wire_s;
  if (section_.merge == StreamMerge::round_robin) {
    take_round_robin();
  } else {
    for (size_t p = 0; p < producers_.size(); ++p) {
      while (taken_[p] < agreed_[p]) take_next(p);
    }
  }
  const auto take_end = Clock::now();
  copy_times_.take_s += seconds(take_start, take_end) - (copy_times_.wire_s - wire_taking);
  // The publish in flight tested, the waiting one or the end started (never waits).
  if (publish_every_ > 0 && trainer_rank_ == 0) progress_publish();
  bool all_closed = true;
  for (size_t p = 0; p < producers_.size(); ++p)
    all_closed = all_closed && (closed_[p] || gone_[p]);
  const size_t producers = producers_.size();
  const auto now = std::chrono::steady_clock::now();
  const double timeout = section_.producer_timeout;
  int64_t* sums = reduced_.data();
  sums[0] = group_lead_ ? buffer_.seen() + held_out_.seen() : 0;
  sums[1] = group_lead_ ? buffer_.overwritten() : 0;
  sums[2] = group_lead_ ? buffer_.filled() : 0;
  sums[3] = buffer_.filled() < min_rows_ ? 1 : 0;
  sums[4] = all_closed ? 1 : 0;
  sums[5] = group_lead_ ? held_out_.seen() : 0;
  for (size_t p = 0; p < producers; ++p) {
    sums[kCounterSums + p] = received_[p];
    // The clock starts at a producer's first rows: a simulation's set-up may take longer than
    // the timeout (one that dies before it sends anything is waited for). Under round_robin a
    // producer that has sent nothing while a merge waits at its turn is on the clock from the
    // rendezvous: else one that died before its first rows would hold the run for ever.
    // A producer whose staging is full is held back by this rank (the merge waits at another
    // producer's turn), not silent: no vote.
    const bool held = staged_count_[p] == sp::kStagingSlots;
    const bool silent = timeout > 0.0 && !closed_[p] && !gone_[p] && !held && on_clock(p) &&
                        std::chrono::duration<double>(now - heard_at_[p]).count() > timeout;
    sums[kCounterSums + producers + p] = silent ? 1 : 0;
    sums[kCounterSums + 2 * producers + p] = held ? 1 : 0;
    sums[kCounterSums + 3 * producers + p] = merge_waits_at_[p];
  }
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, sums, static_cast<int>(reduced_.size()), MPI_INT64_T,
                          MPI_SUM, trainer_comm_),
            "MPI_Allreduce (a stream's counters)");
  copy_times_.agree_s += seconds(take_end, Clock::now());
  for (size_t p = 0; p < producers; ++p) {
    // Held back by some rank: its clock restarts (the silence is the trainer's, not its own),
    // so that it is not voted gone the pull after the merge lets it go.
    if (sums[kCounterSums + p] != heard_total_[p] || sums[kCounterSums + 2 * producers + p] > 0) {
      heard_total_[p] = sums[kCounterSums + p];
      heard_at_[p] = now;
    }
    blocks_merge_[p] = sums[kCounterSums + 3 * producers + p] > 0 ? 1 : 0;
    if (sums[kCounterSums + producers + p] == trainer_size_ && !gone_[p]) {
      gone_[p] = 1;
      if (p == 0) end_owed_ = true;  // nobody takes a publish any more
      int64_t open = 0, held_back = -1;
      for (size_t q = 0; q < producers; ++q) {
        open += closed_[q] || gone_[q] ? 0 : 1;
        const bool held = sums[kCounterSums + 2 * producers + q] > 0;
        if (held && held_back < 0 && blocks_merge_[p]) {
          held_back = static_cast<int64_t>(q);
        }
      }
      warn_producer_gone(p, open, held_back);
    }
  }
  counters_.rows_received = sums[0];
  counters_.rows_held_out = sums[5];
  counters_.rows_overwritten = sums[1];
  counters_.buffer_rows = sums[2];
  ended_ = sums[4] == trainer_size_;
  if (!started_) {
    started_ = sums[3] == 0;
    if (!started_ && ended_) {
      MESHTRAIN_BAD_INPUT("stream \"", section_.name, "\": every producer closed after ",
                          counters_.rows_received, " rows, before every trainer rank held ",
                          "stream.min_rows = ", min_rows_, " rows (0: one batch's rows)");
    }
  }
}

void StreamSource::pull() {
  // After finish() rank 0 may have dropped rows to reach closes (drain_to_closes): a pull would
  // line its slots up with the other ranks' wrongly. finish() is set alike on every rank.
  MESHTRAIN_REQUIRE(!finished_, "stream '", section_.name,
                    "': a pull after the run finished (no step takes rows any more)");
  const auto start = std::chrono::steady_clock::now();
  pull_once();
  while (!started_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    pull_once();
  }
  ++copy_times_.pulls;
  copy_times_.pull_s +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void StreamSource::prepare_publish(const std::vector<ShardedTensor>& params, const Mesh& mesh) {
  if (publish_every_ <= 0 || publish_prepared_) return;
  publish_prepared_ = true;
  int64_t local = 0, whole = 0;
  for (const ShardedTensor& t : params) {
    local += t.box.elements();
    whole_offsets_.push_back(whole);
    int64_t elements = 1;
    for (int64_t d : t.global_shape) elements *= d;
    whole += elements;
    global_shapes_.push_back(t.global_shape);
  }
  MESHTRAIN_REQUIRE(whole == publish_floats_, "stream \"", section_.name, "\": the model has ",
                    whole, " parameters, but the rendezvous announced ", publish_floats_);
  pack_.assign(static_cast<size_t>(local), 0.0f);
  if (trainer_rank_ != 0) return;
  counts_.assign(static_cast<size_t>(trainer_size_), 0);
  displs_.assign(static_cast<size_t>(trainer_size_), 0);
  boxes_.assign(static_cast<size_t>(trainer_size_), {});
  int64_t total = 0;
  for (int r = 0; r < trainer_size_; ++r) {
    int64_t count = 0;
    for (const ShardedTensor& t : params) {
      boxes_[static_cast<size_t>(r)].push_back(shard_box(t.global_shape, t.spec, mesh, r));
      count += boxes_[static_cast<size_t>(r)].back().elements();
    }
    counts_[static_cast<size_t>(r)] = static_cast<int>(count);
    displs_[static_cast<size_t>(r)] = static_cast<int>(total);
    total += count;
  }
  gathered_.assign(static_cast<size_t>(total), 0.0f);
  const int64_t inputs = buffer_.features(), outputs = buffer_.outputs();
  const auto bytes = static_cast<size_t>(
      sp::publish_bytes(publish_floats_, inputs, outputs, input_stats_, target_stats_));
  waiting_.assign(bytes, 0);
  in_flight_.assign(bytes, 0);
}

namespace {

// Copies a block (row-major over box.extent) into its place in the whole tensor (row-major
// over shape), one run of the last dimension at a time.
void place_block(const float* block, const ShardBox& box, const std::vector<int64_t>& shape,
                 float* whole) {
  const size_t dims = shape.size();
  if (dims == 0) {
    whole[0] = block[0];
    return;
  }
  const int64_t run = box.extent[dims - 1];
  int64_t runs = 1;
  for (size_t d = 0; d + 1 < dims; ++d) runs *= box.extent[d];
  for (int64_t k = 0; k < runs; ++k) {
    // k's index over the leading dimensions of the box, to the whole tensor's offset.
    int64_t rest = k, offset = 0, stride = 1;
    for (size_t d = dims; d-- > 0;) {
      const int64_t index = d + 1 == dims ? 0 : rest % box.extent[d];
      if (d + 1 != dims) rest /= box.extent[d];
      offset += (box.offset[d] + index) * stride;
      stride *= shape[d];
    }
    std::memcpy(whole + offset, block + k * run, static_cast<size_t>(run) * sizeof(float));
  }
}

}  // namespace

void StreamSource::publish(const std::vector<ShardedTensor>& params, const Normalization& stats,
                           int64_t step) {
  if (publish_every_ <= 0) return;
  MESHTRAIN_REQUIRE(publish_prepared_, "StreamSource::publish before prepare_publish");
  // This rank's blocks, from the memory they live in (a device's) to the host.
  int64_t at = 0;
  for (const ShardedTensor& t : params) {
    const auto n = static_cast<size_t>(t.box.elements());
    Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(
        pack_.data() + at, n);
    Kokkos::deep_copy(host, t.local);
    at += static_cast<int64_t>(n);
  }
  check_mpi(MPI_Gatherv(pack_.data(), static_cast<int>(pack_.size()), MPI_FLOAT,
                        trainer_rank_ == 0 ? gathered_.data() : nullptr,
                        trainer_rank_ == 0 ? counts_.data() : nullptr,
                        trainer_rank_ == 0 ? displs_.data() : nullptr, MPI_FLOAT, 0, trainer_comm_),
            "MPI_Gatherv (a publish's parameters)");
  if (trainer_rank_ != 0) return;
  ++counters_.publishes;
  if (end_owed_ || end_sent_) return;                  // producer 0 closed: nobody takes it
  if (waiting_ready_) ++counters_.publishes_replaced;  // never sent: this one replaces it
  sp::PublishHeader header;
  header.kind = sp::kPublish;
  header.version = counters_.publishes;
  header.step = step;
  header.floats = publish_floats_;
  header.input_stats = input_stats_ ? 1 : 0;
  header.target_stats = target_stats_ ? 1 : 0;
  header.published_at =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  unsigned char* bytes = waiting_.data();
  std::memcpy(bytes, &header, sizeof header);
  auto* doubles = reinterpret_cast<double*>(bytes + sizeof header);
  const auto put = [&](const std::vector<double>& values, size_t n) {
    for (size_t i = 0; i < n; ++i) *doubles++ = i < values.size() ? values[i] : 0.0;
  };
  if (input_stats_) {
    put(stats.input_mean, static_cast<size_t>(buffer_.features()));
    put(stats.input_std, static_cast<size_t>(buffer_.features()));
  }
  if (target_stats_) {
    put(stats.target_mean, static_cast<size_t>(buffer_.outputs()));
    put(stats.target_std, static_cast<size_t>(buffer_.outputs()));
  }
  float* whole = reinterpret_cast<float*>(doubles);
  // Every rank's blocks in rank order: the replicas of a block hold the same bits.
  for (int r = 0; r < trainer_size_; ++r) {
    const float* block = gathered_.data() + displs_[static_cast<size_t>(r)];
    for (size_t i = 0; i < params.size(); ++i) {
      const ShardBox& box = boxes_[static_cast<size_t>(r)][i];
      place_block(block, box, global_shapes_[i], whole + whole_offsets_[i]);
      block += box.elements();
    }
  }
  waiting_ready_ = true;
  progress_publish();
}

void StreamSource::progress_publish() {
  if (producers_.empty()) return;
  if (in_flight_request_ != MPI_REQUEST_NULL) {
    int done = 0;
    check_mpi(MPI_Test(&in_flight_request_, &done, MPI_STATUS_IGNORE),
              "MPI_Test (a publish in flight)");
    if (!done) return;
  }
  if (waiting_ready_ && !end_sent_) {
    std::swap(waiting_, in_flight_);  // no copy, no allocation
    waiting_ready_ = false;
    check_mpi(MPI_Isend(in_flight_.data(), static_cast<int>(in_flight_.size()), MPI_BYTE,
                        producers_[0], sp::kPublishTag, stream_comm_, &in_flight_request_),
              "MPI_Isend (a publish)");
    ++counters_.publishes_sent;
    return;  // the end follows once this one completed
  }
  if (end_owed_ && !end_sent_) {
    *end_message_ = sp::PublishHeader{};
    end_message_->kind = sp::kPublishEnd;
    end_message_->version = counters_.publishes;
    check_mpi(MPI_Isend(end_message_.get(), sizeof *end_message_, MPI_BYTE, producers_[0],
                        sp::kPublishTag, stream_comm_, &end_request_),
              "MPI_Isend (the publishes' end)");
    end_sent_ = true;
  }
}

bool StreamSource::publish_finished() {
  if (publish_every_ <= 0 || trainer_rank_ != 0 || producers_.empty()) return true;
  try {
    progress_publish();
  } catch (const Error&) {
    return true;  // called by the destructor, which does not throw: stop waiting
  }
  if (!end_sent_ || in_flight_request_ != MPI_REQUEST_NULL) return false;
  int done = 0;
  if (MPI_Test(&end_request_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return true;
  return done != 0;
}

std::unique_ptr<RowSource> StreamSource::make_held_out_source() const {
  return std::make_unique<HeldOutSource>(held_out_, section_.name);
}

int64_t StreamSource::held_out_slots(int64_t batch, int64_t rows, int64_t* out) const {
  const int64_t first = batch * rows;
  const int64_t valid = std::clamp<int64_t>(held_out_.filled() - first, 0, rows);
  for (int64_t i = 0; i < valid; ++i) out[i] = first + i;
  return valid;
}

int64_t StreamSource::batch_slots(int64_t seq, int64_t rows, int64_t* out) const {
  const int64_t filled = std::max<int64_t>(buffer_.filled(), 1);
  for (int64_t i = 0; i < rows; ++i) {
    if (section_.order == StreamOrder::arrival) {
      out[i] = (seq * rows + i) % filled;
    } else {
      const uint64_t h =
          stream_hash(seed_ ^ stream_hash(static_cast<uint64_t>(seq) ^
                                          stream_hash(static_cast<uint64_t>(group_) ^
                                                      stream_hash(static_cast<uint64_t>(i)))));
      out[i] = static_cast<int64_t>(h % static_cast<uint64_t>(filled));
    }
  }
  return rows;
}

void StreamSource::keep_first_rows(int64_t rows) {
  first_wanted_ = rows;
  first_x_.assign(static_cast<size_t>(rows * buffer_.features()), 0.0f);
  first_y_.assign(static_cast<size_t>(rows * buffer_.outputs()), 0.0f);
  first_ids_.assign(static_cast<size_t>(rows), {0, 0});
}

int64_t StreamSource::first_rows(std::vector<float>& x, std::vector<float>& y) const {
  const int64_t f = buffer_.features(), w = buffer_.outputs();
  std::vector<int64_t> order(static_cast<size_t>(first_kept_));
  for (int64_t i = 0; i < first_kept_; ++i) order[static_cast<size_t>(i)] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return first_ids_[static_cast<size_t>(a)] < first_ids_[static_cast<size_t>(b)];
  });
  x.resize(static_cast<size_t>(first_kept_ * f));
  y.resize(static_cast<size_t>(first_kept_ * w));
  for (int64_t i = 0; i < first_kept_; ++i) {
    const int64_t from = order[static_cast<size_t>(i)];
    std::copy(first_x_.begin() + from * f, first_x_.begin() + (from + 1) * f, x.begin() + i * f);
    std::copy(first_y_.begin() + from * w, first_y_.begin() + (from + 1) * w, y.begin() + i * w);
  }
  return first_kept_;
}

// --- checkpoints ---------------------------------------------------------------------------

const std::vector<ShardedTensor>& StreamSource::prepare_checkpoint(
    const Mesh& mesh, const std::vector<std::string>& batch_axes, int rank) {
  if (!checkpoint_tensors_.empty()) return checkpoint_tensors_;
  // Dimension 0 (the group) split over the batch axes the mesh has, as make_batch_slice
  // numbers the groups; the other axes (tp) hold copies.
  SpecEntry groups;
  for (const std::string& axis : batch_axes) {
    if (mesh.has_axis(axis)) groups.axes.push_back(axis);
  }
  const PartitionSpec spec({groups, SpecEntry{}, SpecEntry{}});
  const auto add = [&](const char* name, StreamBuffer& rows, bool inputs) {
    const int64_t width = inputs ? rows.features() : rows.outputs();
    ShardedTensor t;
    t.name = name;
    t.global_shape = {groups_, rows.capacity(), width};
    t.spec = spec;
    t.box = shard_box(t.global_shape, spec, mesh, rank);
    MESHTRAIN_REQUIRE(t.box.offset[0] == group_ && t.box.extent[0] == 1, "stream \"", section_.name,
                      "\": the checkpoint block of ", name, " is not batch group ", group_, "'s");
    const size_t elements = static_cast<size_t>(rows.capacity() * width);
    if (device_memory_is_separate()) {
      t.local =
          Vector(std::string(name), elements);  // copied to and from the buffer (checkpoint_state)
    } else {
      t.local = Vector(inputs ? rows.x_data() : rows.y_data(), elements);  // the buffer itself
    }
    checkpoint_tensors_.push_back(std::move(t));
  };
  add("x", buffer_, true);
  add("y", buffer_, false);
  if (section_.test_fraction > 0.0) {
    add("held_out_x", held_out_, true);
    add("held_out_y", held_out_, false);
  }
  return checkpoint_tensors_;
}

namespace {
// The buffer a checkpoint tensor (in prepare_checkpoint's order) holds: x, y, held-out x, y.
float* tensor_rows(size_t index, StreamBuffer& buffer, StreamBuffer& held_out) {
  StreamBuffer& rows = index < 2 ? buffer : held_out;
  return index % 2 == 0 ? rows.x_data() : rows.y_data();
}
}  // namespace

void StreamSource::checkpoint_state(StreamCheckpoint& into) {
  if (device_memory_is_separate()) {
    for (size_t i = 0; i < checkpoint_tensors_.size(); ++i) {
      ShardedTensor& t = checkpoint_tensors_[i];
      Kokkos::deep_copy(t.local, Kokkos::View<const float*, Kokkos::HostSpace>(
                                     tensor_rows(i, buffer_, held_out_), t.local.extent(0)));
    }
  }
  // Every group's counts, from its lead (the other ranks of a group hold the same).
  std::vector<int64_t> seen(static_cast<size_t>(groups_ * 2), 0);
  if (group_lead_) {
    seen[static_cast<size_t>(group_ * 2)] = buffer_.seen();
    seen[static_cast<size_t>(group_ * 2 + 1)] = held_out_.seen();
  }
  into.rows_seen.assign(seen.size(), 0);
  check_mpi(MPI_Reduce(seen.data(), into.rows_seen.data(), static_cast<int>(seen.size()),
                       MPI_INT64_T, MPI_SUM, 0, trainer_comm_),
            "MPI_Reduce (a stream's rows for a checkpoint)");
  if (trainer_rank_ != 0) into.rows_seen.clear();
}

void StreamSource::restore(const std::vector<int64_t>& rows_seen) {
  if (rows_seen.size() != static_cast<size_t>(groups_ * 2)) {
    MESHTRAIN_BAD_INPUT("stream \"", section_.name, "\": the checkpoint counts the rows of ",
                        rows_seen.size() / 2, " batch groups, but this trainer has ", groups_);
  }
  if (device_memory_is_separate()) {
    for (size_t i = 0; i < checkpoint_tensors_.size(); ++i) {
      const ShardedTensor& t = checkpoint_tensors_[i];
      Kokkos::deep_copy(Kokkos::View<float*, Kokkos::HostSpace>(tensor_rows(i, buffer_, held_out_),
                                                                t.local.extent(0)),
                        t.local);
    }
  }
  buffer_.restore_seen(rows_seen[static_cast<size_t>(group_ * 2)]);
  // Without test_fraction the window is not saved (nor used): it starts empty.
  if (section_.test_fraction > 0.0) {
    held_out_.restore_seen(rows_seen[static_cast<size_t>(group_ * 2 + 1)]);
  }
  // The counters as a pull would agree on them (the first pull after the resume recounts).
  counters_.rows_received = 0;
  counters_.rows_overwritten = 0;
  counters_.buffer_rows = 0;
  counters_.rows_held_out = 0;
  for (int64_t g = 0; g < groups_; ++g) {
    const int64_t seen = rows_seen[static_cast<size_t>(g * 2)];
    const int64_t held =
        section_.test_fraction > 0.0 ? rows_seen[static_cast<size_t>(g * 2 + 1)] : 0;
    counters_.rows_received += seen + held;
    counters_.rows_held_out += held;
    counters_.rows_overwritten += std::max<int64_t>(0, seen - buffer_.capacity());
    counters_.buffer_rows += std::min(seen, buffer_.capacity());
  }
}

}  // namespace meshtrain
