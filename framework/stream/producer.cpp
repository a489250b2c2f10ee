#include "framework/stream/producer.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "base/error.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/stream/stream_protocol.hpp"

namespace meshtrain {

namespace sp = stream_protocol;

StreamProducer::~StreamProducer() {
  if (!connected()) return;
  try {
    close();
  } catch (...) {
    // A destructor does not throw: close() reports what went wrong. The staging buffers are
    // freed all the same (close() may have thrown before it freed them).
    release_staging();
  }
}

void StreamProducer::connect(MPI_Comm comm, const std::string& name, int64_t inputs,
                             int64_t outputs, StreamDtype dtype,
                             const StreamProducerOptions& options) {
  MESHTRAIN_REQUIRE(!connected(), "StreamProducer::connect: already connected to stream \"", name_,
                    "\"");
  if (name.empty() || name.size() >= static_cast<size_t>(sp::kNameBytes)) {
    MESHTRAIN_BAD_INPUT("a stream's name must have 1 to ", sp::kNameBytes - 1,
                        " characters, got \"", name, "\"");
  }
  if (options.split_bytes < 0) {
    MESHTRAIN_BAD_INPUT("stream \"", name, "\": split_bytes must be 0 (every message split) or a ",
                        "positive number of bytes, got ", options.split_bytes);
  }
  if (options.direct_sends && options.backpressure != StreamBackpressure::block) {
    MESHTRAIN_BAD_INPUT("stream \"", name, "\": direct_sends needs backpressure block (a direct ",
                        "send waits until the trainer took its rows), but backpressure is drop");
  }
  if (options.direct_sends && options.share_messages) {
    MESHTRAIN_BAD_INPUT("stream \"", name, "\": direct_sends and share_messages exclude each ",
                        "other (a shared message gathers several sends' rows in the ring)");
  }
  if (inputs < 1 || outputs < 1 || options.message_rows < 1 || options.ring_rows < 1) {
    MESHTRAIN_BAD_INPUT("stream \"", name, "\": inputs (", inputs, "), outputs (", outputs,
                        "), message_rows (", options.message_rows, ") and ring_rows (",
                        options.ring_rows, ") must be positive");
  }
  // NaN compares false: refused with the negatives (it would otherwise wait for ever).
  if (!(options.close_timeout >= 0.0)) {
    MESHTRAIN_BAD_INPUT("stream \"", name, "\": close_timeout must be 0 (wait for ever) or a ",
                        "positive number of seconds, got ", options.close_timeout);
  }
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  sp::Hello hello;
  hello.role = sp::kProducer;
  hello.local_rank = rank;
  hello.inputs = inputs;
  hello.outputs = outputs;
  hello.dtype = dtype == StreamDtype::float64 ? sp::kFloat64 : sp::kFloat32;
  hello.message_rows = options.message_rows;
  std::memcpy(hello.name, name.data(), name.size());
  MPI_Comm stream_comm = MPI_COMM_NULL;
  sp::Rendezvous r = sp::rendezvous(options.parent, hello, &stream_comm);
  if (!r.problem.empty()) {
    check_mpi(MPI_Comm_free(&stream_comm), "MPI_Comm_free (a refused stream)");
    MESHTRAIN_BAD_INPUT(r.problem);
  }
  stream_comm_ = stream_comm;
  comm_ = comm;
  rank_ = rank;
  name_ = name;
  producer_index_ = rank;
  producers_ = size;
  groups_ = r.batch_count;
  group_ranks_ = r.group_ranks;
  trainers_ = r.trainers;
  inputs_ = inputs;
  outputs_ = outputs;
  element_bytes_ = sp::dtype_bytes(hello.dtype);
  message_rows_ = options.message_rows;
  backpressure_ = options.backpressure;
  share_messages_ = options.share_messages;
  split_bytes_ = options.split_bytes;
  direct_sends_ = options.direct_sends;
  open_slot_ = -1;
  open_rows_ = 0;
  const int64_t slots =
      std::max<int64_t>(1, (options.ring_rows + message_rows_ - 1) / message_rows_);
  slots_.assign(static_cast<size_t>(slots),
                std::vector<unsigned char>(static_cast<size_t>(
                    sp::message_bytes(message_rows_, inputs, outputs, hello.dtype))));
  // Each trainer rank of a group: a message's header and, when it splits, its x and y rows
  // (three requests only where a message of message_rows rows reaches split_bytes).
  const bool may_split = message_rows_ * (inputs + outputs) * element_bytes_ >= split_bytes_;
  const size_t per_rank = may_split ? 3 : 1;
  slot_width_ = 1;
  for (const auto& group : group_ranks_)
    slot_width_ = std::max(slot_width_, per_rank * group.size());
  requests_.assign(static_cast<size_t>(slots) * slot_width_, MPI_REQUEST_NULL);
  direct_slot_.assign(static_cast<size_t>(slots), 0);
  completed_.assign(requests_.size(), 0);
  in_flight_ = 0;
  last_stop_check_ = {};
  // View sends' staging, where device memory is separate (views in it are copied to the host a
  // message at a time); only with Kokkos running (a C or Fortran producer may not start it).
  // The execution space instance and the labels the view sends use are made here, so that a
  // first send allocates nothing (even without meshtrain::Runtime, which makes the instance).
  if (Kokkos::is_initialized()) {
    device_space();
    gather_label();
    staged_fence_label();
    written_fence_label();
  }
  if (device_memory_is_separate() && Kokkos::is_initialized()) {
    const auto staging_bytes =
        static_cast<size_t>(message_rows_ * std::max(inputs, outputs) * element_bytes_);
    host_staging_ = Kokkos::View<unsigned char*, HostStagingSpace>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::stream_host_staging"),
        staging_bytes);
    device_staging_ = Kokkos::View<unsigned char*, Kokkos::DefaultExecutionSpace::memory_space>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::stream_device_staging"),
        staging_bytes);
  }
  stopped_ = false;
  last_word_received_ = false;
  last_word_ = sp::LastWord{};
  close_timeout_ = options.close_timeout;
  on_warning_ = options.on_warning;
  publish_every_ = r.publish_every;
  latest_version_ = 0;
  publish_ended_ = false;
  if (publish_every_ > 0) {
    publish_floats_ = r.publish_floats;
    input_stats_ = r.input_stats;
    target_stats_ = r.target_stats;
    model_text_ = r.model_text;
    publisher_ = r.trainers.front();
    const auto bytes = static_cast<size_t>(
        sp::publish_bytes(publish_floats_, inputs, outputs, input_stats_, target_stats_));
    latest_.assign(bytes, 0);
    if (rank_ == 0) incoming_.assign(bytes, 0);
  }
}

// Receives the next publish message (waiting for it): the newest publish is kept in latest_.
void StreamProducer::receive_publish() {
  check_mpi(MPI_Recv(incoming_.data(), static_cast<int>(incoming_.size()), MPI_BYTE, publisher_,
                     sp::kPublishTag, stream_comm_, MPI_STATUS_IGNORE),
            "MPI_Recv (a publish)");
  sp::PublishHeader header;
  std::memcpy(&header, incoming_.data(), sizeof header);
  if (header.kind == sp::kPublishEnd) {
    publish_ended_ = true;
  } else if (header.version > latest_version_) {
    std::swap(incoming_, latest_);  // the newest kept, no copy
    latest_version_ = header.version;
  }
}

int64_t StreamProducer::take_publishes() {
  if (!connected() || publish_every_ <= 0 || rank_ != 0) return latest_version_;
  bool came = true;
  while (came && !publish_ended_) {
    int flag = 0;
    check_mpi(MPI_Iprobe(publisher_, sp::kPublishTag, stream_comm_, &flag, MPI_STATUS_IGNORE),
              "MPI_Iprobe (a publish)");
    came = flag != 0;
    if (came) receive_publish();
  }
  return latest_version_;
}

void StreamProducer::warn(const std::string& sentence) const {
  if (on_warning_) on_warning_(sentence);
}

bool StreamProducer::check_stop() {
  if (last_word_received_ || !connected()) return stopped_;
  int flag = 0;
  check_mpi(MPI_Iprobe(trainers_.front(), sp::kLastWordTag, stream_comm_, &flag, MPI_STATUS_IGNORE),
            "MPI_Iprobe (the trainer's last word)");
  if (!flag) return false;
  check_mpi(MPI_Recv(&last_word_, sizeof last_word_, MPI_BYTE, trainers_.front(), sp::kLastWordTag,
                     stream_comm_, MPI_STATUS_IGNORE),
            "MPI_Recv (the trainer's last word)");
  last_word_received_ = true;
  last_word_.note[sp::kNoteBytes - 1] = '\0';
  if (last_word_.kind != sp::kStop) return false;  // done: the trainer took this rank's close
  stopped_ = true;
  // One warning for the simulation, from its rank 0 (each rank takes the stop on its own).
  if (rank_ == 0) {
    warn(detail::concat("stream \"", name_, "\": the trainer stopped: ", last_word_.note,
                        "; the simulation goes on without it, its rows dropped from now on "
                        "(rows_dropped)"));
  }
  return true;
}

void StreamProducer::send(const float* x, const float* y, int64_t rows) {
  if (element_bytes_ != 4) {
    MESHTRAIN_BAD_INPUT("stream \"", name_, "\": send got float rows, but the stream was ",
                        "connected with float64 rows");
  }
  send_bytes(x, y, rows, 4);
}

void StreamProducer::send(const double* x, const double* y, int64_t rows) {
  if (element_bytes_ != 8) {
    MESHTRAIN_BAD_INPUT("stream \"", name_, "\": send got double rows, but the stream was ",
                        "connected with float32 rows");
  }
  send_bytes(x, y, rows, 8);
}

bool StreamProducer::slot_free(size_t slot) const {
  const MPI_Request* requests = &requests_[slot * slot_width_];
  return std::all_of(requests, requests + slot_width_,
                     [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
}

// Every send in flight tested at once (one MPI_Testsome: the completed ones become
// MPI_REQUEST_NULL, freeing their slots). A test enters MPI's progress engine, which moves the
// sends' data (a message longer than the shared-memory transport's eager limit needs the
// sender's progress) and yields the core when nothing progressed under mpi_yield_when_idle
// (Open MPI's default on an oversubscribed node), so a send tests once: a test per message and
// a stop check per send made a send of two messages cost up to three yields, milliseconds on
// loaded cores (docs/online.md, "Figures").
void StreamProducer::test_ring() {
  if (in_flight_ == 0) return;  // nothing to test: no scan of the ring, no progress call
  int completed = 0;
  check_mpi(MPI_Testsome(static_cast<int>(requests_.size()), requests_.data(), &completed,
                         completed_.data(), MPI_STATUSES_IGNORE),
            "MPI_Testsome (a stream's ring)");
  if (completed != MPI_UNDEFINED) in_flight_ -= completed;
}

void StreamProducer::wait_slot(size_t slot, const char* what) {
  MPI_Request* requests = &requests_[slot * slot_width_];
  in_flight_ -= std::count_if(requests, requests + slot_width_,
                              [](MPI_Request r) { return r != MPI_REQUEST_NULL; });
  check_mpi(MPI_Waitall(static_cast<int>(slot_width_), requests, MPI_STATUSES_IGNORE), what);
}

// A slot whose sends have all completed, in ring order; with backpressure drop, -1 when the
// next slot's sends are still in flight (as the send's test_ring left them).
int StreamProducer::take_free_slot() {
  const size_t slot = static_cast<size_t>(next_slot_);
  if (in_flight_ > 0 && !slot_free(slot)) {
    if (backpressure_ != StreamBackpressure::block) return -1;
    wait_slot(slot, "MPI_Waitall (a stream's ring)");
  }
  next_slot_ = (next_slot_ + 1) % static_cast<int64_t>(slots_.size());
  return static_cast<int>(slot);
}

void StreamProducer::send_bytes(const void* x, const void* y, int64_t rows, int64_t element_bytes) {
  if (direct_sends_) {
    send_direct(static_cast<const unsigned char*>(x), static_cast<const unsigned char*>(y), rows);
    return;
  }
  struct Context {
    const unsigned char *x, *y;
    int64_t x_row, y_row;  // bytes
  } context{static_cast<const unsigned char*>(x), static_cast<const unsigned char*>(y),
            inputs_ * element_bytes, outputs_ * element_bytes};
  send_packed(
      rows,
      [](void* c, int64_t first, int64_t count, unsigned char* x_out, unsigned char* y_out) {
        const auto* ctx = static_cast<const Context*>(c);
        std::memcpy(x_out, ctx->x + first * ctx->x_row, static_cast<size_t>(count * ctx->x_row));
        std::memcpy(y_out, ctx->y + first * ctx->y_row, static_cast<size_t>(count * ctx->y_row));
      },
      &context);
}

bool StreamProducer::begin_send(int64_t rows) {
  MESHTRAIN_REQUIRE(connected(), "StreamProducer::send before connect (or after close)");
  MESHTRAIN_REQUIRE(rows >= 0, "StreamProducer::send: negative rows (", rows, ")");
  if (check_stop_now_and_then()) {  // the trainer failed: nobody trains on these rows
    rows_dropped_ += rows;
    next_row_ += rows;
    return false;
  }
  test_ring();
  return true;
}

void StreamProducer::send_direct(const unsigned char* x, const unsigned char* y, int64_t rows) {
  if (!begin_send(rows)) return;
  const int64_t x_row = inputs_ * element_bytes_, y_row = outputs_ * element_bytes_;
  bool direct = false;
  for (int64_t done = 0; done < rows;) {
    const int64_t count = std::min(message_rows_, rows - done);
    const int slot = take_free_slot();  // block: waits for the oldest slot when none is free
    direct_slot_[static_cast<size_t>(slot)] = 0;  // its earlier sends completed
    open_slot_ = slot;
    open_rows_ = count;
    open_first_row_ = next_row_;
    unsigned char* bytes = slots_[static_cast<size_t>(slot)].data();
    if (count * (x_row + y_row) < split_bytes_) {  // small: packed into the ring, sent whole
      const auto pack_start = std::chrono::steady_clock::now();
      std::memcpy(bytes + sizeof(sp::Header), x + done * x_row, static_cast<size_t>(count * x_row));
      std::memcpy(bytes + sizeof(sp::Header) + count * x_row, y + done * y_row,
                  static_cast<size_t>(count * y_row));
      pack_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - pack_start).count();
      start_open();
    } else {  // the header from the ring, the rows from the caller's arrays
      start_open(x + done * x_row, y + done * y_row);
      direct_slot_[static_cast<size_t>(slot)] = 1;
      direct = true;
    }
    next_row_ += count;
    done += count;
  }
  if (!direct) return;
  // The caller's rows are read by the direct sends until they complete: waited for here.
  for (size_t slot = 0; slot < direct_slot_.size(); ++slot) {
    if (!direct_slot_[slot]) continue;
    direct_slot_[slot] = 0;
    wait_slot(slot, "MPI_Waitall (a stream's direct sends)");
  }
}

void StreamProducer::check_view_send(int64_t element_bytes, int64_t x_rows, int64_t x_columns,
                                     int64_t y_rows, int64_t y_columns, int64_t rows,
                                     bool all) const {
  MESHTRAIN_REQUIRE(connected(), "StreamProducer::send before connect (or after close)");
  if (element_bytes != element_bytes_) {
    MESHTRAIN_BAD_INPUT("stream \"", name_, "\": send got views of ",
                        element_bytes == 8 ? "double" : "float", ", but the stream was connected ",
                        "with ", element_bytes_ == 8 ? "float64" : "float32", " rows");
  }
  if (x_columns != inputs_ || y_columns != outputs_ || rows < 0 || rows > x_rows || rows > y_rows ||
      (all && x_rows != y_rows)) {
    const std::string sent = all ? std::string("all of them") : detail::concat("the first ", rows);
    MESHTRAIN_BAD_INPUT("stream \"", name_, "\": send got views x of shape [", x_rows, ", ",
                        x_columns, "] and y of shape [", y_rows, ", ", y_columns,
                        "] (rows sent: ", sent, "), but the stream takes x [rows, ", inputs_,
                        "] and y [rows, ", outputs_, "] with the rows sent in both");
  }
}

void StreamProducer::pack_host_rows(const HostRows& from, int64_t first, int64_t count,
                                    int64_t width, int64_t element_bytes, unsigned char* out) {
  const int64_t row_bytes = width * element_bytes;
  for (int64_t r = 0; r < count; ++r) {
    const unsigned char* row = from.base + (first + r) * from.row_stride * element_bytes;
    unsigned char* to = out + r * row_bytes;
    if (from.column_stride == 1 || width == 1) {
      std::memcpy(to, row, static_cast<size_t>(row_bytes));
    } else {
      const int64_t step = from.column_stride * element_bytes;
      for (int64_t c = 0; c < width; ++c) {
        std::memcpy(to + c * element_bytes, row + c * step, static_cast<size_t>(element_bytes));
      }
    }
  }
}

const std::string& StreamProducer::gather_label() {
  static const std::string label("meshtrain::stream_gather_rows");
  return label;
}

const std::string& StreamProducer::staged_fence_label() {
  static const std::string label("meshtrain::stream_staged_rows");
  return label;
}

const std::string& StreamProducer::written_fence_label() {
  static const std::string label("meshtrain::stream_device_written_rows");
  return label;
}

void StreamProducer::check_staging(bool staged) const {
  if (staged && host_staging_.data() == nullptr) {
    MESHTRAIN_BAD_INPUT("stream \"", name_, "\": send got a view in device memory, but Kokkos ",
                        "was not initialized when connect ran (connect makes the staging "
                        "buffer such views are copied through): initialize Kokkos first");
  }
}

void StreamProducer::release_staging() {
  if (host_staging_.data() == nullptr && device_staging_.data() == nullptr) return;
  if (Kokkos::is_initialized()) {
    host_staging_ = {};
    device_staging_ = {};
  } else {
    // Closed after Kokkos::finalize (it should not be): freeing now would call into a Kokkos
    // that has ended, so the two buffers are left to the process's end.
    static_cast<void>(new decltype(host_staging_)(std::move(host_staging_)));
    static_cast<void>(new decltype(device_staging_)(std::move(device_staging_)));
  }
}

void StreamProducer::send_packed(int64_t rows, PackRows pack, void* context) {
  if (!begin_send(rows)) return;
  const int64_t x_row = inputs_ * element_bytes_, y_row = outputs_ * element_bytes_;
  for (int64_t done = 0; done < rows;) {
    if (open_slot_ < 0) {
      const int slot = take_free_slot();
      if (slot < 0) {
        const int64_t count = std::min(message_rows_, rows - done);
        rows_dropped_ += count;
        next_row_ += count;
        done += count;
        continue;
      }
      open_slot_ = slot;
      open_rows_ = 0;
      open_first_row_ = next_row_;
    }
    const int64_t count = std::min(message_rows_ - open_rows_, rows - done);
    unsigned char* payload = slots_[static_cast<size_t>(open_slot_)].data() + sizeof(sp::Header);
    // A shared message's y rows go after message_rows_ x rows (moved down by start_open); an
    // unshared one's straight after its x rows, where the wire has them.
    unsigned char* y_out = share_messages_ ? payload + message_rows_ * x_row + open_rows_ * y_row
                                           : payload + count * x_row;
    const auto pack_start = std::chrono::steady_clock::now();
    pack(context, done, count, payload + open_rows_ * x_row, y_out);
    pack_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - pack_start).count();
    open_rows_ += count;
    next_row_ += count;
    done += count;
    if (!share_messages_ || open_rows_ == message_rows_) start_open();
  }
}

void StreamProducer::start_open(const unsigned char* caller_x, const unsigned char* caller_y) {
  const int64_t x_row = inputs_ * element_bytes_, y_row = outputs_ * element_bytes_;
  unsigned char* bytes = slots_[static_cast<size_t>(open_slot_)].data();
  sp::Header header;
  header.kind = sp::kRows;
  header.rows = open_rows_;
  header.first_row = open_first_row_;
  const int64_t rows_bytes = open_rows_ * (x_row + y_row);
  const bool split = caller_x != nullptr || rows_bytes >= split_bytes_;
  header.split = split ? 1 : 0;
  std::memcpy(bytes, &header, sizeof header);
  unsigned char* payload = bytes + sizeof header;
  const int64_t group = sp::group_of_message(producer_index_, messages_, producers_, groups_);
  MPI_Request* requests = &requests_[static_cast<size_t>(open_slot_) * slot_width_];
  if (split) {
    // The header alone, then x and y as they lie in the slot (a shared message's y rows where
    // they were written: no move).
    const unsigned char* x_rows = caller_x ? caller_x : payload;
    const unsigned char* y_rows = caller_y          ? caller_y
                                  : share_messages_ ? payload + message_rows_ * x_row
                                                    : payload + open_rows_ * x_row;
    for (int trainer : group_ranks_[static_cast<size_t>(group)]) {
      check_mpi(MPI_Isend(bytes, static_cast<int>(sizeof header), MPI_BYTE, trainer, sp::kTag,
                          stream_comm_, requests++),
                "MPI_Isend (a stream's rows header)");
      check_mpi(MPI_Isend(x_rows, static_cast<int>(open_rows_ * x_row), MPI_BYTE, trainer,
                          sp::kPayloadTag, stream_comm_, requests++),
                "MPI_Isend (a stream's x rows)");
      check_mpi(MPI_Isend(y_rows, static_cast<int>(open_rows_ * y_row), MPI_BYTE, trainer,
                          sp::kPayloadTag, stream_comm_, requests++),
                "MPI_Isend (a stream's y rows)");
      in_flight_ += 3;
    }
  } else {
    if (share_messages_ && open_rows_ < message_rows_) {  // y follows the x rows on the wire
      std::memmove(payload + open_rows_ * x_row, payload + message_rows_ * x_row,
                   static_cast<size_t>(open_rows_ * y_row));
    }
    const int message_bytes = static_cast<int>(sizeof header + rows_bytes);
    for (int trainer : group_ranks_[static_cast<size_t>(group)]) {
      check_mpi(
          MPI_Isend(bytes, message_bytes, MPI_BYTE, trainer, sp::kTag, stream_comm_, requests++),
          "MPI_Isend (a stream's rows)");
      ++in_flight_;
    }
  }
  ++messages_;
  rows_sent_ += open_rows_;
  open_slot_ = -1;
  open_rows_ = 0;
}

// The trainer's stop looked for once a millisecond at most (send, flush): its MPI_Iprobe enters
// MPI's progress engine (see test_ring), and a stop noticed a millisecond late costs nothing.
bool StreamProducer::check_stop_now_and_then() {
  if (stopped_) return true;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_stop_check_ >= std::chrono::milliseconds(1)) {
    last_stop_check_ = now;
    check_stop();
  }
  return stopped_;
}

void StreamProducer::flush() {
  flush_open(false);
}

void StreamProducer::flush_open(bool check_stop_always) {
  if (open_slot_ < 0) return;
  // close() looks for the stop every time; flush(), called as often as send, once a millisecond.
  if (check_stop_always ? check_stop() : check_stop_now_and_then()) {
    // the trainer failed: the rows waiting are dropped
    rows_dropped_ += open_rows_;
    open_slot_ = -1;
    open_rows_ = 0;
    return;
  }
  start_open();
}

void StreamProducer::close() {
  if (!connected()) return;
  flush_open(true);
  // The close goes to every trainer rank, after this rank's rows (one tag: MPI keeps the
  // order); its header lives in the object until the sends complete.
  std::vector<MPI_Request> requests;
  for (MPI_Request& r : requests_) {
    if (r != MPI_REQUEST_NULL) requests.push_back(r);
    r = MPI_REQUEST_NULL;
  }
  in_flight_ = 0;
  static_assert(sizeof(sp::Header) == 4 * sizeof(int64_t));
  sp::Header header;
  header.kind = sp::kClose;
  header.first_row = next_row_;
  std::vector<sp::Header> closes(trainers_.size(), header);
  for (size_t t = 0; t < trainers_.size(); ++t) {
    requests.emplace_back();
    check_mpi(MPI_Isend(&closes[t], sizeof(sp::Header), MPI_BYTE, trainers_[t], sp::kTag,
                        stream_comm_, &requests.back()),
              "MPI_Isend (a stream's close)");
  }
  check_mpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
            "MPI_Waitall (a stream's close)");
  release_staging();
  wait_for_last_word();
  check_mpi(MPI_Comm_free(&stream_comm_), "MPI_Comm_free (a stream's communicator)");
  stream_comm_ = MPI_COMM_NULL;
}

// The handshake's end (docs/online.md): trainer rank 0 sends every producer rank one last word,
// its stop (it failed before it took this close) or done (it took it), so that nothing it sent
// is left unreceived. Producer 0 also takes the publishes until their end, which the trainer
// sends once it took that close and its publish in flight completed.
void StreamProducer::wait_for_last_word() {
  const bool publishes = publish_every_ > 0 && rank_ == 0;
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    check_stop();
    if (publishes) take_publishes();
    if (last_word_received_ && (!publishes || publish_ended_)) return;
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (close_timeout_ > 0.0 && waited > close_timeout_) {
      warn(detail::concat("stream \"", name_, "\": producer rank ", rank_,
                          ": the trainer did not answer its close within ", close_timeout_, " s (",
                          last_word_received_ ? "the publishes' end" : "its last word",
                          " never came: did the trainer end without taking the close?); close() "
                          "returns without it"));
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace meshtrain
