// The backend-independent half of Communicator: shape checks, dim-1 packing through the
// scratch buffer, and the mean of all_reduce. Backends only move contiguous buffers.

#include "framework/comm/communicator.hpp"

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "framework/comm/column_blocks.hpp"
#include "framework/comm/slot_pool.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/observe/trace.hpp"
#include "partition/collectives.hpp"

namespace meshtrain {

int checked_int(std::size_t value, const char* what) {
  if (value > static_cast<std::size_t>(INT_MAX)) {
    MESHTRAIN_FAIL(what, " is ", value, ", more than a single MPI/NCCL call can take (", INT_MAX,
                   "); split the tensor or use more ranks");
  }
  return static_cast<int>(value);
}

double collective_timeout_from_env() {
  const char* text = std::getenv("MESHTRAIN_COLLECTIVE_TIMEOUT");
  if (text == nullptr || *text == '\0') return 300.0;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds > 0.0)) {
    MESHTRAIN_BAD_INPUT("environment variable MESHTRAIN_COLLECTIVE_TIMEOUT='", text,
                        "' is not a positive number of seconds");
  }
  return seconds;
}

namespace {

// A collective's span: its group, the bytes per rank it moves as the plan counts them (for
// an operand of `elements` in all: the gathered tensor, the reduced one), the operand's
// bytes, and the wire dtype.
void describe_collective(TraceSpan& span, CollectiveKind kind, const std::string& group, int ranks,
                         std::size_t elements, std::size_t element_bytes, const char* detail) {
  if (!span.on()) return;
  const auto operand = static_cast<int64_t>(elements * element_bytes);
  span.group(group).bytes(collective_bytes_per_rank(kind, operand, ranks), operand).detail(detail);
}

void describe_collective(TraceSpan& span, CollectiveKind kind, const std::string& group, int ranks,
                         std::size_t elements, Dtype wire) {
  if (!span.on()) return;
  describe_collective(span, kind, group, ranks, elements, bytes_of(wire), to_string(wire));
}

// A broadcast's or a shift's span: what it sends is what it moves.
void describe_transfer(TraceSpan& span, const std::string& group, std::size_t bytes,
                       const char* detail) {
  if (span.on())
    span.group(group)
        .bytes(static_cast<int64_t>(bytes), static_cast<int64_t>(bytes))
        .detail(detail);
}

}  // namespace

// Gives a started operation's Request its flight recorder entry.
struct RequestFlight {
  static void attach(Request& request, uint64_t serial, double timeout);
};

namespace {

// One collective in the flight recorder: entered (or started) when made, failed unless
// completed() or handed to a Request.
class FlightScope {
 public:
  FlightScope(int group, const char* op, std::size_t bytes, Dtype wire, bool started = false)
      : FlightScope(group, op, bytes, to_string(wire), started) {}
  FlightScope(int group, const char* op, std::size_t bytes, const char* wire, bool started = false)
      : serial_(flight_recorder().enter(group, op, static_cast<int64_t>(bytes), wire, started)) {}
  FlightScope(const FlightScope&) = delete;
  FlightScope& operator=(const FlightScope&) = delete;
  ~FlightScope() { flight_recorder().finish(serial_, FlightState::failed); }

  void completed() {
    flight_recorder().finish(serial_, FlightState::completed);
    serial_ = 0;
  }
  // A started operation: its Request completes the entry.
  Request started(Request request, double timeout) {
    if (request.pending()) {
      RequestFlight::attach(request, serial_, timeout);
    } else {
      flight_recorder().finish(serial_, FlightState::completed);
    }
    serial_ = 0;
    return request;
  }
  uint64_t serial() const { return serial_; }

 private:
  uint64_t serial_;
};

// In a catch block: the entry `serial` failed; rethrows the error being handled, with what
// the flight records say about the collective added when a backend timed out.
[[noreturn]] void rethrow_recorded(uint64_t serial, double timeout) {
  flight_recorder().finish(serial, FlightState::failed);
  const bool timed_out = FlightRecorder::take_timeout();
  if (timed_out && serial != 0) {
    const std::string report = flight_recorder().timeout_report(serial, timeout);
    if (!report.empty()) {
      try {
        throw;
      } catch (const Error& e) {
        throw Error(e.kind(), std::string(e.what()) + ". " + report, e.file(), e.line());
      }
    }
  }
  throw;
}

}  // namespace

void Communicator::set_flight_world_ranks(const std::vector<int>& world_ranks) {
  flight_recorder().set_world_ranks(flight_group_, world_ranks);
}

// The start of a non-blocking operation: a span, and a flow id its Request's wait() shows.
Request Communicator::traced_start(TraceSpan& span, Request request) {
  if (span.on() && request.pending()) {
    const int64_t id = tracer().next_flow();
    span.flow(id);
    request.trace_flow_ = id;
  }
  return request;
}

// ---------------------------------------------------------------------------- Request

void RequestFlight::attach(Request& request, uint64_t serial, double timeout) {
  request.flight_serial_ = serial;
  request.flight_timeout_ = timeout;
}

struct Request::WireSlot {
  HalfBits send, recv;         // grown on first use, kept
  float* unpack_to = nullptr;  // the caller's floats the received elements widen into
  std::size_t count = 0;
  Dtype dtype = Dtype::bf16;
  std::shared_ptr<WirePool> pool;  // set while in use: the pool outlives a pending Request

  SlotCapacity capacity() const { return {send.extent(0), recv.extent(0)}; }  // elements
};

// The slots (slot_pool.hpp: best fit by their buffers' sizes).
//
// 16-bit buffers of an operation that failed are retired, never reused or freed while the
// pool lives: the backend may have given up on a request that still reads or writes them
// (MPI, after a timeout, completes the abandoned request when the late rank arrives). A
// failed slot stays in `slots` but off the free list; the blocking operations' buffers move
// to `retired`, and the next operation allocates new ones. Only failures pay for this; the
// communicator is unusable after a timeout anyway.
struct Request::WirePool {
  SlotPool<WireSlot> slots;
  std::vector<HalfBits> retired;
};

namespace {
// `wire`'s slot, of an operation that failed or was given up on, out of use for good (see
// WirePool); wire becomes null.
void retire_slot(Request::WireSlot*& wire) noexcept {
  if (wire == nullptr) return;
  Request::WireSlot* slot = wire;
  wire = nullptr;
  std::shared_ptr<Request::WirePool> keep = std::move(slot->pool);  // last: may destroy the pool
}
}  // namespace

void Request::complete_wire() {
  if (wire_ == nullptr) return;
  unpack_16bit(wire_->recv.data(), wire_->unpack_to, wire_->count, wire_->dtype);
  fence_device(MESHTRAIN_LABEL("meshtrain::Request::complete_wire"));
  drop_wire();
}

void Request::drop_wire() noexcept {
  if (wire_ == nullptr) return;
  WireSlot* slot = wire_;
  wire_ = nullptr;
  std::shared_ptr<WirePool> keep = std::move(slot->pool);  // last: may destroy the pool
  keep->slots.release(*slot);
}

void Request::finish() noexcept {
  if (impl_ == nullptr) {
    drop_wire();
    return;
  }
  Impl* impl = impl_;
  impl_ = nullptr;
  bool failed = false;
  try {
    impl->wait();
  } catch (...) {
    // A destructor cannot report; the timeout already bounded the wait.
    failed = true;
  }
  impl->release();
  flight_recorder().finish(flight_serial_, failed ? FlightState::failed : FlightState::completed);
  flight_serial_ = 0;
  if (failed) {
    FlightRecorder::take_timeout();  // nobody reports it
    retire_slot(wire_);              // an abandoned transfer may still use its buffers
  } else {
    drop_wire();  // nobody waits for the result
  }
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    finish();
    impl_ = other.impl_;
    wire_ = other.wire_;
    trace_flow_ = other.trace_flow_;
    flight_serial_ = other.flight_serial_;
    flight_timeout_ = other.flight_timeout_;
    other.impl_ = nullptr;
    other.wire_ = nullptr;
    other.trace_flow_ = 0;
    other.flight_serial_ = 0;
  }
  return *this;
}

Request::~Request() {
  finish();
}

void Request::wait() {
  if (impl_ == nullptr) return;
  TraceSpan span("wait", TraceKind::wait);
  span.flow(trace_flow_);
  // Release the request even when waiting throws: it is not waited on twice.
  Impl* impl = impl_;
  impl_ = nullptr;
  const uint64_t serial = flight_serial_;
  flight_serial_ = 0;
  try {
    impl->wait();
  } catch (...) {
    impl->release();
    retire_slot(wire_);  // an abandoned transfer may still use its buffers
    rethrow_recorded(serial, flight_timeout_);
  }
  impl->release();
  flight_recorder().finish(serial, FlightState::completed);
  complete_wire();
}

bool Request::test() {
  if (impl_ == nullptr) return true;
  bool done = false;
  try {
    done = impl_->test();
  } catch (...) {
    retire_slot(wire_);  // as in wait(); the Impl is released by wait() or the destructor
    const uint64_t serial = flight_serial_;
    flight_serial_ = 0;
    rethrow_recorded(serial, flight_timeout_);
  }
  if (!done) return false;
  Impl* impl = impl_;
  impl_ = nullptr;
  impl->release();
  flight_recorder().finish(flight_serial_, FlightState::completed);
  flight_serial_ = 0;
  complete_wire();
  return true;
}

// ----------------------------------------------------------------------- Communicator

namespace {

template <class View>
void require_contiguous(const View& v, const std::string& group, const char* op,
                        const char* which) {
  if (!v.span_is_contiguous()) {
    MESHTRAIN_BAD_INPUT(op, " on ", group, ": the ", which,
                        " view is not contiguous (a column block of a matrix); pass a "
                        "contiguous view");
  }
}

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte (compared as addresses: the
// buffers may be of any element type, fp32 views or 16-bit blocks).
bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// The send and receive buffers of `op`, a_bytes and b_bytes long, apart from each other.
void require_disjoint(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes,
                      const std::string& group, const char* op) {
  if (overlaps(a, a_bytes, b, b_bytes)) {
    MESHTRAIN_BAD_INPUT(op, " on ", group,
                        ": the send and receive views overlap; use separate buffers");
  }
}

// A 1-D all-gather's buffers: recv holds `size` blocks of send's length, apart from send.
void require_gather_lengths(ConstVectorView send, VectorView recv, int size,
                            const std::string& group, const char* op) {
  const std::size_t count = send.extent(0);
  if (recv.extent(0) != count * static_cast<std::size_t>(size)) {
    MESHTRAIN_BAD_INPUT(op, " on ", group, ": receive length ", recv.extent(0), " is not ", size,
                        " x send length ", count);
  }
  require_disjoint(send.data(), count * sizeof(float), recv.data(), recv.extent(0) * sizeof(float),
                   group, op);
}

void require_dim(int dim, const std::string& group, const char* op) {
  if (dim != 0 && dim != 1) {
    MESHTRAIN_BAD_INPUT(op, " on ", group, ": dim must be 0 or 1, got ", dim);
  }
}

}  // namespace

Communicator::Communicator(int size, int rank, std::string description)
    : size_(size),
      rank_(rank),
      description_(std::move(description)),
      timeout_seconds_(collective_timeout_from_env()),
      wire_pool_(std::make_shared<Request::WirePool>()) {
  MESHTRAIN_REQUIRE(size >= 1 && rank >= 0 && rank < size, "communicator ", description_,
                    " has an invalid rank ", rank, " of ", size);
  flight_group_ = flight_recorder().register_group(description_, size_, rank_);
  v_layout_.resize(4 * static_cast<std::size_t>(size));
}

void Communicator::set_timeout_seconds(double seconds) {
  if (!(seconds > 0.0)) {
    MESHTRAIN_BAD_INPUT("collective timeout must be a positive number of seconds, got ", seconds);
  }
  timeout_seconds_ = seconds;
}

void Communicator::reserve_scratch(std::size_t floats) {
  if (scratch_.extent(0) >= floats) return;
  scratch_ = Kokkos::View<float*, Kokkos::LayoutRight>(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::comm_scratch"), floats);
}

float* Communicator::scratch(std::size_t floats) {
  reserve_scratch(floats);
  return scratch_.data();
}

namespace {
uint16_t* grown(HalfBits& buffer, std::size_t count) {
  if (buffer.extent(0) < count) {
    buffer = HalfBits();  // free the old one first
    buffer =
        HalfBits(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::comm_wire"), count);
  }
  return buffer.data();
}
bool is_16bit(Dtype wire) {
  return wire != Dtype::fp32;
}
// After a blocking 16-bit operation threw: its buffers retired (see Request::WirePool).
void retire_buffers(Request::WirePool& pool, std::initializer_list<HalfBits*> buffers) {
  for (HalfBits* buffer : buffers) {
    if (buffer->extent(0) == 0) continue;
    pool.retired.push_back(*buffer);
    *buffer = HalfBits();  // the next operation allocates a new one
  }
}
}  // namespace

void Communicator::reserve_wire(std::size_t send_elements, std::size_t recv_elements) {
  ++wire_uses_;  // may move the buffers
  grown(wire_send_, send_elements);
  grown(wire_recv_, recv_elements);
}

void Communicator::reserve_started_all_reduces(std::size_t count, std::size_t elements,
                                               Dtype wire) {
  raw_reserve_started_all_reduces(count, elements, wire);
  if (!is_16bit(wire)) return;
  wire_pool_->slots.reserve(
      count, [] { return std::make_unique<Request::WireSlot>(); },
      [&](Request::WireSlot& slot) { grown(slot.recv, elements); });
}

void Communicator::reserve_started_all_gathers(std::size_t count, std::size_t send_elements,
                                               Dtype wire) {
  const std::size_t total = send_elements * static_cast<std::size_t>(size_);
  raw_reserve_requests(count, send_elements * bytes_of(wire), total * bytes_of(wire));
  if (!is_16bit(wire)) return;
  wire_pool_->slots.reserve(
      count, [] { return std::make_unique<Request::WireSlot>(); },
      [&](Request::WireSlot& slot) {
        grown(slot.send, send_elements);
        grown(slot.recv, total);
      });
}

void Communicator::reserve_started_16bit_all_gathers(std::size_t count, std::size_t send_elements,
                                                     Dtype dtype) {
  const std::size_t total = send_elements * static_cast<std::size_t>(size_);
  raw_reserve_requests(count, send_elements * bytes_of(dtype), total * bytes_of(dtype));
}

void Communicator::reserve_started_16bit_all_reduces(std::size_t count, std::size_t elements,
                                                     Dtype dtype) {
  MESHTRAIN_REQUIRE(is_16bit(dtype), "started all_reduce of 16-bit elements on ", description_,
                    " given fp32");
  raw_reserve_started_all_reduces(count, elements, dtype);
}

uint16_t* Communicator::wire_send(std::size_t count) {
  ++wire_uses_;
  return grown(wire_send_, count);
}

uint16_t* Communicator::wire_recv(std::size_t count) {
  ++wire_uses_;
  return grown(wire_recv_, count);
}

// A free slot (best fit, slot_pool.hpp) with its buffers grown to `send_count` and
// `recv_count` 16-bit elements.
Request::WireSlot& Communicator::acquire_wire_slot(std::size_t send_count, std::size_t recv_count) {
  Request::WireSlot& slot = wire_pool_->slots.acquire(
      {send_count, recv_count}, [] { return std::make_unique<Request::WireSlot>(); });
  slot.pool = wire_pool_;
  grown(slot.send, send_count);
  grown(slot.recv, recv_count);
  return slot;
}

namespace {
// The fences of through_wire, outside the template so that their labels are made once.
void fence_after_packing() {
  fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::through_wire: packed"));
}
void fence_after_unpacking() {
  fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::through_wire: unpacked"));
}
}  // namespace

// A blocking 16-bit operation: `send_count` floats packed to `wire` elements, `move`
// run on the communicator's 16-bit buffers (move(packed, arrived), one buffer when
// `in_place`), then `recv_count` elements widened into `recv`. When `move` throws, the
// buffers are retired (a late rank may still write into them) and new ones made next time.
template <class Move>
void Communicator::through_wire(const float* send, std::size_t send_count, float* recv,
                                std::size_t recv_count, Dtype wire, bool in_place, Move&& move) {
  uint16_t* arrived = wire_recv(in_place ? send_count : recv_count);
  uint16_t* packed = in_place ? arrived : wire_send(send_count);
  pack_16bit(send, packed, send_count, wire);
  fence_after_packing();
  try {
    move(packed, arrived);
  } catch (...) {
    retire_buffers(*wire_pool_, {&wire_send_, &wire_recv_});
    throw;
  }
  unpack_16bit(arrived, recv, recv_count, wire);
  fence_after_unpacking();
}

// The flat gather of `count` floats per rank into `recv`, moving `wire` elements.
void Communicator::gather_flat(const float* send, float* recv, std::size_t count, Dtype wire,
                               const char* op) {
  TraceSpan span("all-gather", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_gather, description_, size_, count * size_, wire);
  const std::size_t total = count * static_cast<std::size_t>(size_);
  FlightScope flight(flight_group_, op, total * bytes_of(wire), wire);
  try {
    if (!is_16bit(wire)) {
      raw_all_gather(send, recv, count, Dtype::fp32, op);
    } else {
      through_wire(send, count, recv, total, wire, /*in_place=*/false,
                   [&](const uint16_t* packed, uint16_t* arrived) {
                     raw_all_gather(packed, arrived, count, wire, op);
                   });
    }
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

void Communicator::all_gather(ConstVectorView send, VectorView recv, Dtype wire) {
  const char* op = "all_gather";
  require_gather_lengths(send, recv, size_, description_, op);
  gather_flat(send.data(), recv.data(), send.extent(0), wire, op);
}

void Communicator::all_gather(ConstMatrixView send, MatrixView recv, int dim, Dtype wire) {
  const char* op = "all_gather";
  require_dim(dim, description_, op);
  const std::size_t n = static_cast<std::size_t>(size_);
  const std::size_t r = send.extent(0), c = send.extent(1);
  const bool ok = dim == 0 ? (recv.extent(0) == n * r && recv.extent(1) == c)
                           : (recv.extent(0) == r && recv.extent(1) == n * c);
  if (!ok) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, " along dim ", dim, ": receive shape [",
                        recv.extent(0), ", ", recv.extent(1), "] does not match send shape [", r,
                        ", ", c, "] gathered over ", n, " ranks");
  }
  require_contiguous(send, description_, op, "send");
  require_disjoint(send.data(), r * c * sizeof(float), recv.data(), recv.span() * sizeof(float),
                   description_, op);
  if (dim == 0 || n == 1 || r == 1) {
    // Dim 0 (and the degenerate dim-1 cases) is the flat gather.
    require_contiguous(recv, description_, op, "receive");
    gather_flat(send.data(), recv.data(), r * c, wire, op);
    return;
  }
  // Gather [n][r][c] blocks into the scratch buffer, then place block j at columns j*c.
  float* staging = scratch(n * r * c);
  gather_flat(send.data(), staging, r * c, wire, op);
  place_gathered_columns(ConstVectorView(staging, n * r * c), recv, static_cast<int>(n));
}

void place_gathered_columns(ConstVectorView blocks, MatrixView recv, int n) {
  const int64_t r = static_cast<int64_t>(recv.extent(0));
  const int64_t c = static_cast<int64_t>(recv.extent(1)) / n;
  MESHTRAIN_REQUIRE(n >= 1 && c * n == static_cast<int64_t>(recv.extent(1)) &&
                        static_cast<int64_t>(blocks.extent(0)) == r * c * n,
                    "place_gathered_columns: ", blocks.extent(0), " floats are not ", n,
                    " blocks of the [", recv.extent(0), ", ", recv.extent(1) / n, "] columns");
  place_column_blocks(blocks.data(), recv.data(), static_cast<int64_t>(recv.stride(0)),
                      static_cast<int64_t>(n), r, c,
                      MESHTRAIN_LABEL("meshtrain::all_gather_unpack_dim1"));
  fence_device(MESHTRAIN_LABEL("meshtrain::place_gathered_columns"));
}

Request Communicator::start_all_gather(ConstVectorView send, VectorView recv, Dtype wire) {
  const char* op = "all_gather";
  require_gather_lengths(send, recv, size_, description_, op);
  const std::size_t count = send.extent(0);
  TraceSpan span("all-gather", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_gather, description_, size_, count * size_, wire);
  FlightScope flight(flight_group_, op, recv.extent(0) * bytes_of(wire), wire, /*started=*/true);
  try {
    if (!is_16bit(wire)) {
      return flight.started(
          traced_start(span, raw_start_all_gather(send.data(), recv.data(), count, wire, op)),
          timeout_seconds_);
    }
    Request::WireSlot& slot = acquire_wire_slot(count, recv.extent(0));
    pack_16bit(send.data(), slot.send.data(), count, wire);
    return flight.started(traced_start(span, start_on_wire(slot, recv.data(), recv.extent(0), wire,
                                                           [&] {
                                                             return raw_start_all_gather(
                                                                 slot.send.data(), slot.recv.data(),
                                                                 count, wire, op);
                                                           })),
                          timeout_seconds_);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
}

void Communicator::all_gather_16bit(const uint16_t* send, uint16_t* recv, std::size_t count,
                                    Dtype dtype) {
  const char* op = "all_gather";
  MESHTRAIN_REQUIRE(is_16bit(dtype), op, " of 16-bit elements on ", description_, " given fp32");
  const std::size_t total = count * static_cast<std::size_t>(size_);
  TraceSpan span("all-gather", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_gather, description_, size_, total, dtype);
  FlightScope flight(flight_group_, op, total * bytes_of(dtype), dtype);
  try {
    raw_all_gather(send, recv, count, dtype, op);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

Request Communicator::start_all_gather_16bit(const uint16_t* send, uint16_t* recv,
                                             std::size_t count, Dtype dtype) {
  const char* op = "all_gather";
  MESHTRAIN_REQUIRE(is_16bit(dtype), op, " of 16-bit elements on ", description_, " given fp32");
  const std::size_t total = count * static_cast<std::size_t>(size_);
  TraceSpan span("all-gather", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_gather, description_, size_, total, dtype);
  FlightScope flight(flight_group_, op, total * bytes_of(dtype), dtype, /*started=*/true);
  try {
    return flight.started(traced_start(span, raw_start_all_gather(send, recv, count, dtype, op)),
                          timeout_seconds_);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
}

Request Communicator::start_all_reduce(VectorView data, Dtype wire) {
  const char* op = "all_reduce";
  const std::size_t count = data.extent(0);
  checked_int(count, "started all_reduce count");
  TraceSpan span("all-reduce", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_reduce, description_, size_, count, wire);
  FlightScope flight(flight_group_, op, count * bytes_of(wire), wire, /*started=*/true);
  try {
    if (!is_16bit(wire)) {
      return flight.started(
          traced_start(span, raw_start_all_reduce_sum(data.data(), count, wire, op)),
          timeout_seconds_);
    }
    Request::WireSlot& slot = acquire_wire_slot(0, count);
    pack_16bit(data.data(), slot.recv.data(), count, wire);
    return flight.started(traced_start(span, start_on_wire(slot, data.data(), count, wire,
                                                           [&] {
                                                             return raw_start_all_reduce_sum(
                                                                 slot.recv.data(), count, wire, op);
                                                           })),
                          timeout_seconds_);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
}

Request Communicator::start_all_reduce_16bit(uint16_t* data, std::size_t count, Dtype dtype) {
  const char* op = "all_reduce";
  MESHTRAIN_REQUIRE(is_16bit(dtype), op, " of 16-bit elements on ", description_, " given fp32");
  checked_int(count, "started all_reduce count");
  TraceSpan span("all-reduce", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_reduce, description_, size_, count, dtype);
  FlightScope flight(flight_group_, op, count * bytes_of(dtype), dtype, /*started=*/true);
  try {
    return flight.started(traced_start(span, raw_start_all_reduce_sum(data, count, dtype, op)),
                          timeout_seconds_);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
}

// A 16-bit operation on `slot`'s buffers: `start` begins it on the backend; the Request
// returned completes it and widens the slot's received elements into `unpack_to`. When
// `start` throws, the slot is retired (a backend may leave part of a failed start running,
// as the MPI shift's posted receive it cannot cancel). A backend that completes at once
// (an empty Request) has its data unpacked here.
template <class Start>
Request Communicator::start_on_wire(Request::WireSlot& slot, float* unpack_to, std::size_t count,
                                    Dtype wire, Start&& start) {
  slot.unpack_to = unpack_to;
  slot.count = count;
  slot.dtype = wire;
  Request request;
  request.wire_ = &slot;
  // The packed send data is in place.
  fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::start_on_wire"));
  try {
    Request started = start();
    request.impl_ = started.impl_;
    started.impl_ = nullptr;
  } catch (...) {
    retire_slot(request.wire_);
    throw;
  }
  if (request.impl_ == nullptr) request.complete_wire();
  return request;
}

// The flat reduce-scatter of `count` floats per rank, summed in `wire` elements.
void Communicator::reduce_scatter_flat(const float* send, float* recv, std::size_t count,
                                       Dtype wire, const char* op) {
  TraceSpan span("reduce-scatter", TraceKind::collective);
  describe_collective(span, CollectiveKind::reduce_scatter, description_, size_, count * size_,
                      wire);
  const std::size_t total = count * static_cast<std::size_t>(size_);
  FlightScope flight(flight_group_, op, total * bytes_of(wire), wire);
  try {
    if (!is_16bit(wire)) {
      raw_reduce_scatter_sum(send, recv, count, Dtype::fp32, op);
    } else {
      through_wire(send, total, recv, count, wire, /*in_place=*/false,
                   [&](const uint16_t* packed, uint16_t* arrived) {
                     raw_reduce_scatter_sum(packed, arrived, count, wire, op);
                   });
    }
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

void Communicator::reduce_scatter(ConstVectorView send, VectorView recv, Dtype wire) {
  const char* op = "reduce_scatter";
  const std::size_t count = recv.extent(0);
  if (send.extent(0) != count * static_cast<std::size_t>(size_)) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, ": send length ", send.extent(0), " is not ",
                        size_, " x receive length ", count);
  }
  require_disjoint(send.data(), send.extent(0) * sizeof(float), recv.data(), count * sizeof(float),
                   description_, op);
  reduce_scatter_flat(send.data(), recv.data(), count, wire, op);
}

void Communicator::reduce_scatter(ConstMatrixView send, MatrixView recv, int dim, Dtype wire) {
  const char* op = "reduce_scatter";
  require_dim(dim, description_, op);
  const std::size_t n = static_cast<std::size_t>(size_);
  const std::size_t r = recv.extent(0), c = recv.extent(1);
  const bool ok = dim == 0 ? (send.extent(0) == n * r && send.extent(1) == c)
                           : (send.extent(0) == r && send.extent(1) == n * c);
  if (!ok) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, " along dim ", dim, ": send shape [",
                        send.extent(0), ", ", send.extent(1), "] does not match receive shape [", r,
                        ", ", c, "] scattered over ", n, " ranks");
  }
  require_contiguous(recv, description_, op, "receive");
  require_disjoint(send.data(), send.span() * sizeof(float), recv.data(), r * c * sizeof(float),
                   description_, op);
  if (dim == 0 || n == 1 || r == 1) {
    require_contiguous(send, description_, op, "send");
    reduce_scatter_flat(send.data(), recv.data(), r * c, wire, op);
    return;
  }
  // Pack column block j of send into block j of [n][r][c] staging, then scatter flat.
  float* staging = scratch(n * r * c);
  stage_column_blocks(send.data(), static_cast<int64_t>(send.stride(0)), staging,
                      static_cast<int64_t>(n), static_cast<int64_t>(r), static_cast<int64_t>(c),
                      MESHTRAIN_LABEL("meshtrain::reduce_scatter_pack_dim1"));
  fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::reduce_scatter"));
  reduce_scatter_flat(staging, recv.data(), r * c, wire, op);
}

void Communicator::reduce_scatter_16bit(ConstHalfMatrixView send, MatrixView recv, int dim,
                                        Dtype dtype) {
  const char* op = "reduce_scatter";
  MESHTRAIN_REQUIRE(is_16bit(dtype), op, " of 16-bit elements on ", description_, " given fp32");
  require_dim(dim, description_, op);
  const std::size_t n = static_cast<std::size_t>(size_);
  const std::size_t r = recv.extent(0), c = recv.extent(1);
  const bool ok = dim == 0 ? (send.extent(0) == n * r && send.extent(1) == c)
                           : (send.extent(0) == r && send.extent(1) == n * c);
  if (!ok) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, " along dim ", dim, ": send shape [",
                        send.extent(0), ", ", send.extent(1), "] does not match receive shape [", r,
                        ", ", c, "] scattered over ", n, " ranks");
  }
  require_contiguous(send, description_, op, "send");
  require_contiguous(recv, description_, op, "receive");
  const std::size_t count = r * c, total = count * n;
  require_disjoint(send.data(), total * sizeof(uint16_t), recv.data(), count * sizeof(float),
                   description_, op);
  TraceSpan span("reduce-scatter", TraceKind::collective);
  describe_collective(span, CollectiveKind::reduce_scatter, description_, size_, total, dtype);
  FlightScope flight(flight_group_, op, total * bytes_of(dtype), dtype);
  const uint16_t* sent = send.data();
  if (dim == 1 && n > 1 && r > 1) {
    // Column block j of send into block j of [n][r][c], as reduce_scatter's dim-1 staging, in
    // 16-bit elements on the blocking send buffer (what packing would have filled).
    uint16_t* staged = wire_send(total);
    stage_column_blocks(send.data(), static_cast<int64_t>(n * c), staged, static_cast<int64_t>(n),
                        static_cast<int64_t>(r), static_cast<int64_t>(c),
                        MESHTRAIN_LABEL("meshtrain::reduce_scatter_16bit_stage_dim1"));
    sent = staged;
  }
  // The producer's (or the staging's) 16-bit elements are in place.
  fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::reduce_scatter_16bit: written"));
  uint16_t* arrived = wire_recv(count);
  try {
    raw_reduce_scatter_sum(sent, arrived, count, dtype, op);
  } catch (...) {
    retire_buffers(*wire_pool_, {&wire_send_, &wire_recv_});
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  unpack_16bit(arrived, recv.data(), count, dtype);
  fence_after_unpacking();
  flight.completed();
}

uint16_t* Communicator::all_reduce_wire(std::size_t count) {
  MESHTRAIN_REQUIRE(wire_handed_out_at_ != wire_uses_, "all_reduce_wire on ", description_,
                    ": its 16-bit buffer is already handed out and not yet summed "
                    "(all_reduce_from_wire)");
  uint16_t* bits = wire_recv(count);
  wire_handed_out_at_ = wire_uses_;
  return bits;
}

void Communicator::all_reduce_from_wire(ConstHalfMatrixView written, MatrixView data, Dtype dtype) {
  const char* op = "all_reduce";
  MESHTRAIN_REQUIRE(is_16bit(dtype), op, " of 16-bit elements on ", description_, " given fp32");
  require_contiguous(data, description_, op, "data");
  const std::size_t count = data.span();
  MESHTRAIN_REQUIRE(written.extent(0) == data.extent(0) && written.extent(1) == data.extent(1), op,
                    " on ", description_, ": ", written.extent(0), " x ", written.extent(1),
                    " elements written as 16 bits, summed into ", data.extent(0), " x ",
                    data.extent(1));
  MESHTRAIN_REQUIRE(written.data() != nullptr && written.data() == wire_recv_.data() &&
                        wire_recv_.extent(0) >= count,
                    op, " on ", description_,
                    ": the 16-bit elements given are not its 16-bit buffer (all_reduce_wire)");
  MESHTRAIN_REQUIRE(wire_handed_out_at_ == wire_uses_, op, " on ", description_,
                    ": a blocking 16-bit operation ran since all_reduce_wire handed out its "
                    "16-bit buffer (or it was summed already), so the elements written there "
                    "are gone");
  ++wire_uses_;  // this sum is itself one: the buffer is summed once
  TraceSpan span("all-reduce", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_reduce, description_, size_, count, dtype);
  FlightScope flight(flight_group_, op, count * bytes_of(dtype), dtype);
  uint16_t* bits = wire_recv_.data();
  // The producer's 16-bit elements are in place.
  fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::all_reduce_from_wire: written"));
  try {
    raw_all_reduce_sum(bits, count, dtype, op);
  } catch (...) {
    retire_buffers(*wire_pool_, {&wire_send_, &wire_recv_});
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  unpack_16bit(bits, data.data(), count, dtype);
  fence_after_unpacking();
  flight.completed();
}

void Communicator::all_reduce(VectorView data, ReduceOp reduce, Dtype wire) {
  const char* op = "all_reduce";
  const std::size_t count = data.extent(0);
  TraceSpan span("all-reduce", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_reduce, description_, size_, count, wire);
  FlightScope flight(flight_group_, op, count * bytes_of(wire), wire);
  try {
    if (!is_16bit(wire)) {
      raw_all_reduce_sum(data.data(), count, Dtype::fp32, op);
    } else {
      through_wire(
          data.data(), count, data.data(), count, wire, /*in_place=*/true,
          [&](uint16_t* packed, uint16_t*) { raw_all_reduce_sum(packed, count, wire, op); });
    }
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
  if (reduce == ReduceOp::mean && size_ > 1) {
    const float scale = 1.0f / static_cast<float>(size_);
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::all_reduce_mean_scale"), device_range(0, data.extent(0)),
        KOKKOS_LAMBDA(const std::size_t k) { data(k) *= scale; });
    fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::all_reduce: mean"));
  }
}

void Communicator::all_reduce(DoubleVectorView data, ReduceOp reduce) {
  TraceSpan span("all-reduce", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_reduce, description_, size_, data.extent(0),
                      sizeof(double), "f64");
  FlightScope flight(flight_group_, "all_reduce", data.extent(0) * sizeof(double), "f64");
  try {
    raw_all_reduce_sum_f64(data.data(), data.extent(0), "all_reduce");
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
  if (reduce == ReduceOp::mean && size_ > 1) {
    const double scale = 1.0 / static_cast<double>(size_);
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::all_reduce_mean_scale_f64"), device_range(0, data.extent(0)),
        KOKKOS_LAMBDA(const std::size_t k) { data(k) *= scale; });
    fence_device(MESHTRAIN_LABEL("meshtrain::Communicator::all_reduce_f64: mean"));
  }
}

void Communicator::all_reduce(MatrixView data, ReduceOp reduce, Dtype wire) {
  require_contiguous(data, description_, "all_reduce", "data");
  all_reduce(VectorView(data.data(), data.span()), reduce, wire);
}

void Communicator::broadcast(VectorView data, int root) {
  if (root < 0 || root >= size_) {
    MESHTRAIN_BAD_INPUT("broadcast on ", description_, ": root ", root, " is not a rank of ",
                        size_);
  }
  TraceSpan span("broadcast", TraceKind::collective);
  describe_transfer(span, description_, data.extent(0) * sizeof(float), "fp32");
  FlightScope flight(flight_group_, "broadcast", data.extent(0) * sizeof(float), "fp32");
  try {
    raw_broadcast(data.data(), data.extent(0), root, "broadcast");
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

void Communicator::broadcast(MatrixView data, int root) {
  require_contiguous(data, description_, "broadcast", "data");
  broadcast(VectorView(data.data(), data.span()), root);
}

Request Communicator::shift(ConstVectorView send, VectorView recv, int offset, Dtype wire) {
  const char* op = "shift";
  if (send.extent(0) != recv.extent(0)) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, ": send length ", send.extent(0),
                        " differs from receive length ", recv.extent(0));
  }
  require_disjoint(send.data(), send.extent(0) * sizeof(float), recv.data(),
                   recv.extent(0) * sizeof(float), description_, op);
  const std::size_t count = send.extent(0);
  TraceSpan span("shift", TraceKind::collective);
  describe_transfer(span, description_, count * bytes_of(wire), to_string(wire));
  FlightScope flight(flight_group_, op, count * bytes_of(wire), wire, /*started=*/true);
  try {
    if (!is_16bit(wire)) {
      return flight.started(
          traced_start(span, raw_shift(send.data(), recv.data(), count, wire, offset, op)),
          timeout_seconds_);
    }
    Request::WireSlot& slot = acquire_wire_slot(count, count);
    pack_16bit(send.data(), slot.send.data(), count, wire);
    return flight.started(traced_start(span, start_on_wire(slot, recv.data(), count, wire,
                                                           [&] {
                                                             return raw_shift(
                                                                 slot.send.data(), slot.recv.data(),
                                                                 count, wire, offset, op);
                                                           })),
                          timeout_seconds_);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
}

Request Communicator::shift_16bit(const uint16_t* send, uint16_t* recv, std::size_t count,
                                  int offset, Dtype dtype) {
  const char* op = "shift";
  MESHTRAIN_REQUIRE(is_16bit(dtype), op, " of 16-bit elements on ", description_, " given fp32");
  require_disjoint(send, count * sizeof(uint16_t), recv, count * sizeof(uint16_t), description_,
                   op);
  TraceSpan span("shift", TraceKind::collective);
  describe_transfer(span, description_, count * bytes_of(dtype), to_string(dtype));
  FlightScope flight(flight_group_, op, count * bytes_of(dtype), dtype, /*started=*/true);
  try {
    return flight.started(traced_start(span, raw_shift(send, recv, count, dtype, offset, op)),
                          timeout_seconds_);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
}

Request Communicator::shift(ConstMatrixView send, MatrixView recv, int offset, Dtype wire) {
  if (send.extent(0) != recv.extent(0) || send.extent(1) != recv.extent(1)) {
    MESHTRAIN_BAD_INPUT("shift on ", description_, ": send shape [", send.extent(0), ", ",
                        send.extent(1), "] differs from receive shape [", recv.extent(0), ", ",
                        recv.extent(1), "]");
  }
  require_contiguous(send, description_, "shift", "send");
  require_contiguous(recv, description_, "shift", "receive");
  return shift(ConstVectorView(send.data(), send.span()), VectorView(recv.data(), recv.span()),
               offset, wire);
}

void Communicator::all_to_all(ConstMatrixView send, MatrixView recv) {
  const char* op = "all_to_all";
  const std::size_t n = static_cast<std::size_t>(size_);
  if (send.extent(0) != recv.extent(0) || send.extent(1) != recv.extent(1) ||
      send.extent(0) % n != 0) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, ": send [", send.extent(0), ", ", send.extent(1),
                        "] and receive [", recv.extent(0), ", ", recv.extent(1),
                        "] must have the same shape with dim 0 divisible by ", n, " ranks");
  }
  require_contiguous(send, description_, op, "send");
  require_contiguous(recv, description_, op, "receive");
  require_disjoint(send.data(), send.span() * sizeof(float), recv.data(),
                   recv.span() * sizeof(float), description_, op);
  TraceSpan span("all-to-all", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_to_all, description_, size_, send.span(),
                      Dtype::fp32);
  FlightScope flight(flight_group_, op, send.span() * sizeof(float), Dtype::fp32);
  try {
    raw_all_to_all(send.data(), recv.data(), send.span() / n, op);
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

namespace {

// all_to_all_v's row counts `rows` (`which`: "send_rows" or "recv_rows") of a matrix with
// `available` rows of `cols` floats, as element counts and packed element offsets (one per
// rank); returns the packed rows. Throws bad_input for a wrong number of entries, a negative
// count, or counts that add up to more rows than the matrix has.
std::size_t layout_rows(const std::vector<int64_t>& rows, int size, std::size_t available,
                        std::size_t cols, std::size_t* counts, std::size_t* offsets,
                        const std::string& group, const char* op, const char* which,
                        const char* matrix) {
  if (rows.size() != static_cast<std::size_t>(size)) {
    MESHTRAIN_BAD_INPUT(op, " on ", group, ": ", which, " has ", rows.size(),
                        " entries; it needs one per rank of the group (", size, ")");
  }
  uint64_t total = 0;  // saturates instead of wrapping (only for the message)
  for (int j = 0; j < size; ++j) {
    const int64_t r = rows[static_cast<std::size_t>(j)];
    if (r < 0) {
      MESHTRAIN_BAD_INPUT(op, " on ", group, ": ", which, "[", j, "] is ", r,
                          "; row counts must not be negative");
    }
    const uint64_t u = static_cast<uint64_t>(r);
    total = u > UINT64_MAX - total ? UINT64_MAX : total + u;
  }
  if (total > static_cast<uint64_t>(available)) {
    MESHTRAIN_BAD_INPUT(op, " on ", group, ": ", which, " add up to ", total,
                        " rows, more than the ", available, " rows of the ", matrix, " matrix");
  }
  // Every count is at most `available` rows now, so no product below overflows.
  std::size_t at = 0;
  for (int j = 0; j < size; ++j) {
    const std::size_t r = static_cast<std::size_t>(rows[static_cast<std::size_t>(j)]);
    counts[j] = r * cols;
    offsets[j] = at * cols;
    at += r;
  }
  return at;
}

}  // namespace

void Communicator::all_to_all_v(ConstMatrixView send, const std::vector<int64_t>& send_rows,
                                MatrixView recv, const std::vector<int64_t>& recv_rows,
                                Dtype wire) {
  const char* op = "all_to_all_v";
  const std::size_t n = static_cast<std::size_t>(size_);
  const std::size_t cols = send.extent(1);
  if (recv.extent(1) != cols) {
    MESHTRAIN_BAD_INPUT(op, " on ", description_, ": send [", send.extent(0), ", ", cols,
                        "] and receive [", recv.extent(0), ", ", recv.extent(1),
                        "] must have the same number of columns");
  }
  if (v_layout_.size() != 4 * n) v_layout_.resize(4 * n);  // only after a move
  std::size_t* send_counts = v_layout_.data();
  std::size_t* send_offsets = send_counts + n;
  std::size_t* recv_counts = send_offsets + n;
  std::size_t* recv_offsets = recv_counts + n;
  const std::size_t sent_rows = layout_rows(send_rows, size_, send.extent(0), cols, send_counts,
                                            send_offsets, description_, op, "send_rows", "send");
  const std::size_t received_rows =
      layout_rows(recv_rows, size_, recv.extent(0), cols, recv_counts, recv_offsets, description_,
                  op, "recv_rows", "receive");
  require_contiguous(send, description_, op, "send");
  require_contiguous(recv, description_, op, "receive");
  const std::size_t send_count = sent_rows * cols, recv_count = received_rows * cols;
  require_disjoint(send.data(), send_count * sizeof(float), recv.data(), recv_count * sizeof(float),
                   description_, op);
  TraceSpan span("all-to-all", TraceKind::collective);
  describe_collective(span, CollectiveKind::all_to_all, description_, size_, send_count, wire);
  FlightScope flight(flight_group_, op, send_count * bytes_of(wire), wire);
  try {
    if (!is_16bit(wire)) {
      raw_all_to_all_v(send.data(), send_counts, send_offsets, recv.data(), recv_counts,
                       recv_offsets, Dtype::fp32, op);
    } else {
      // Only the packed rows are rounded, moved and widened: rows beyond them stay as they are.
      through_wire(send.data(), send_count, recv.data(), recv_count, wire, /*in_place=*/false,
                   [&](const uint16_t* packed, uint16_t* arrived) {
                     raw_all_to_all_v(packed, send_counts, send_offsets, arrived, recv_counts,
                                      recv_offsets, wire, op);
                   });
    }
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

void Communicator::barrier() {
  TraceSpan span("barrier", TraceKind::collective);
  span.group(description_);
  FlightScope flight(flight_group_, "barrier", 0, "");
  try {
    raw_barrier("barrier");
  } catch (...) {
    rethrow_recorded(flight.serial(), timeout_seconds_);
  }
  flight.completed();
}

}  // namespace meshtrain
