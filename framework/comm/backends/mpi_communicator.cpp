#include "framework/comm/backends/mpi_communicator.hpp"

#include <sched.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

#include "framework/comm/backends/host_staging.hpp"
#include "framework/comm/backends/mpi_ring.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/comm/slot_pool.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/precision_sums.hpp"
#include "framework/observe/flight_recorder.hpp"

namespace meshtrain {

namespace {
class MpiRequestSlot;
class MpiRingSlot;
}  // namespace

// Tags of the started ring all-reduces: kStartedRingTagBase + (number started mod
// kStartedRingTags), apart from the shifts' [1000, 31000) and the blocking ring's 31001 and
// 31002 (MPI guarantees tags up to 32767). Every rank starts the operations of a communicator
// in the same order, so they agree on each operation's tag. Two operations in flight on one
// rank never share a tag: when a start's tag is still held by an earlier operation that has
// not completed on this rank (State::ring_tag_holders), the start first completes that one
// (every rank started it, so it completes; a rank that never joins fails by the timeout).
// No rank decides anything alone: every rank waits for the same operation at the same start,
// and none refuses (see raw_start_all_reduce_sum; the tags of operation k and k + 1024 then
// never have messages in flight together on any rank, so MPI's in-order matching keeps them
// apart).
constexpr int kStartedRingTagBase = 31100;
constexpr int kStartedRingTags = 1024;

struct MpiCommunicator::State {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string description;
  std::string broken;  // non-empty after a timeout or a failed completion: why it is unusable
  // Requests given up on after a timeout. They cannot be freed (MPI forbids freeing a
  // collective's request), so they are kept and tested once more when the state goes.
  std::vector<MPI_Request> abandoned;
  // The pool of started operations (shifts, all-gathers, all-reduces), best fit by their
  // host staging (slot_pool.hpp). A slot in use holds a reference to this state, so the
  // state (and the slot) outlive the communicator while a Request is pending.
  SlotPool<MpiRequestSlot> request_slots;
  // Host copies for the blocking operations when Kokkos' memory is device memory.
  HostStaging staging;
  // The blocking ring reductions' partial sums and requests (mpi_ring.hpp), reserved by
  // reserve_reductions (when the layers are built) or grown on first use, kept.
  RingScratch ring;
  // The started ring all-reduces (start_all_reduce where the reduction choice picks the ring):
  // their pool (best fit by partial sums and host staging), those in flight now (linked
  // through the slots, so that a wait also advances the others this thread owns), and the
  // count of those started so far, which numbers their tags.
  SlotPool<MpiRingSlot> ring_slots;
  MpiRingSlot* rings_in_flight = nullptr;
  uint64_t rings_started = 0;
  // By tag - kStartedRingTagBase: the started ring all-reduce that holds the tag (in flight,
  // not yet released), or null.
  std::array<MpiRingSlot*, kStartedRingTags> ring_tag_holders{};
  // MPI_Ialltoallv's int send counts, send displacements, receive counts and receive
  // displacements, one per rank each (sized when the communicator is made: no call allocates).
  std::vector<int> alltoallv_layout;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State();

  void require_usable(const char* op) const {
    if (!broken.empty()) {
      MESHTRAIN_FAIL(op, " on ", description, " refused: the communicator is unusable after ",
                     broken);
    }
  }

  // Throws "<op> on <group>: <call> failed: <MPI_Error_string>" unless code is MPI_SUCCESS.
  // The text is built only on failure: the success path allocates nothing.
  void check(int code, const char* op, const char* call) const {
    if (code != MPI_SUCCESS) fail_call(code, op, call);
  }
  [[noreturn]] void fail_call(int code, const char* op, const char* call) const;
};

namespace {

// Hands the requests still live in `requests` to `state.abandoned` (they may yet write into
// the caller's buffers, and MPI forbids freeing a collective's request) and marks the
// communicator unusable for the reason `why`.
void abandon(MpiCommunicator::State& state, MPI_Request* requests, int count,
             const std::string& why) {
  for (int k = 0; k < count; ++k) {
    if (requests[k] == MPI_REQUEST_NULL) continue;
    state.abandoned.push_back(requests[k]);
    requests[k] = MPI_REQUEST_NULL;  // owned by state.abandoned from here on
  }
  if (state.broken.empty()) state.broken = why;
}

// wait_all_until (mpi_util.hpp) on this communicator's requests: a failed MPI_Testall
// abandons the live requests (as a timeout does) before it is thrown, so no request is
// dropped and the communicator is not used again. A timeout of 0 tests once.
bool wait_all_until(MpiCommunicator::State& state, MPI_Request* requests, int count, double timeout,
                    const char* op) {
  return meshtrain::wait_all_until(requests, count, timeout, [&](int code) {
    abandon(state, requests, count, std::string("a failed ") + op);
    state.fail_call(code, op, "MPI_Testall");
  });
}

std::string timeout_text(double seconds) {
  std::ostringstream out;
  out << seconds;
  return out.str();
}

[[noreturn]] void throw_timeout(MpiCommunicator::State& state, MPI_Request* requests, int count,
                                double timeout, const char* op) {
  const std::string message = std::string(op) + " on " + state.description +
                              " did not complete within " + timeout_text(timeout) +
                              " s: a rank did not join";
  abandon(state, requests, count, "an earlier timeout (" + message + ")");
  FlightRecorder::mark_timeout();  // the Communicator adds what the flight records say
  MESHTRAIN_FAIL(message);
}

// One shift's two MPI requests (receive, send), or a started all-gather's or all-reduce's
// one (in the receive slot), completed against the deadline taken at wait(). Pooled in
// MpiCommunicator::State: acquire_request_slot() takes a free slot (or makes one when every slot is
// in flight), Request::Impl::release() puts it back.
//
// With the communication thread running (progress_thread.hpp), a started operation is handed
// to it (hand_to_progress): the thread tests the MPI requests while the caller computes, and
// only the thread touches them until it finishes them or the caller takes them back.
// wait() takes them back first (so a wait that times out, and the abandoned requests, are
// exactly as without the thread); test() only reads the thread's finished flag.
class MpiRequestSlot final : public Request::Impl, public ProgressTask {
 public:
  explicit MpiRequestSlot(MpiCommunicator::State& owner) : owner_(owner) {}
  ~MpiRequestSlot() override = default;

  // Readies a free slot for one shift; `state` is the owner, kept alive while in use.
  void start(std::shared_ptr<MpiCommunicator::State> state, double timeout, const char* op) {
    state_ = std::move(state);
    timeout_ = timeout;
    op_ = op;
    requests_[0] = requests_[1] = MPI_REQUEST_NULL;
    recv_ = nullptr;
    bytes_ = 0;
  }
  // MPI's buffers for this shift (host copies when memory is on the device); the received
  // data reaches `recv` when the shift completes. copy_in: an in-place operation (a started
  // all-reduce) whose host copy starts as `recv`.
  const char* send_buffer(const char* send, std::size_t bytes) {
    return staging_.send_buffer(send, bytes);
  }
  char* receive_buffer(char* recv, std::size_t bytes, bool copy_in = false) {
    recv_ = recv;
    bytes_ = bytes;
    return staging_.receive_buffer(recv, bytes, copy_in);
  }
  // Grows this slot's staging now (no-op without staging): slot_pool.hpp's reserve.
  void reserve_staging(std::size_t send_bytes, std::size_t recv_bytes) {
    staging_.reserve(send_bytes, recv_bytes);
  }
  // What this slot's staging holds, in bytes (for the pool's best fit; 0 without staging).
  SlotCapacity capacity() const { return {staging_.send_capacity(), staging_.receive_capacity()}; }
  MPI_Request& receive() { return requests_[0]; }
  MPI_Request& send() { return requests_[1]; }

  // After the operation started: lets the communication thread progress it, when one runs.
  void hand_to_progress() {
    progress_ = running_comm_progress();
    if (progress_ == nullptr) return;
    failed_code_ = MPI_SUCCESS;
    progress_->submit(*this);
  }

  // The communication thread's step (under its mutex; see progress_thread.hpp).
  bool step() noexcept override {
    int done = 0;
    const int code = MPI_Testall(2, requests_, &done, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      failed_code_ = code;  // reported by the caller's test() or wait()
      return true;
    }
    return done != 0;
  }

  bool test() override {
    if (progress_ != nullptr) {
      if (!finished() && progress_->running()) return false;  // no MPI call on this thread
      if (take_back()) {
        finish_from_thread();
        return true;
      }
    }
    const bool done = wait_all_until(owner_, requests_, 2, 0.0, op_);
    if (done) staging_.finish_receive(recv_, bytes_);
    return done;
  }
  void wait() override {
    if (take_back()) {
      finish_from_thread();
      return;
    }
    if (!wait_all_until(owner_, requests_, 2, timeout_, op_)) {
      throw_timeout(owner_, requests_, 2, timeout_, op_);
    }
    staging_.finish_receive(recv_, bytes_);
  }
  void release() noexcept override {
    take_back();  // the thread must not test requests that are abandoned below
    // A request still live here (a failed MPI_Testall) may yet write into the caller's
    // buffer: keep it for the state's destructor and refuse further use.
    for (MPI_Request& r : requests_) {
      if (r == MPI_REQUEST_NULL) continue;
      try {
        owner_.abandoned.push_back(r);
        if (owner_.broken.empty()) owner_.broken = "a shift that failed while in flight";
      } catch (...) {
      }
      r = MPI_REQUEST_NULL;
    }
    owner_.request_slots.release(*this);
    // Last: when this was the last reference to the state, the state (and this slot) go.
    std::shared_ptr<MpiCommunicator::State> keep = std::move(state_);
  }

 private:
  // Takes the operation back from the communication thread, if it was handed over: true when
  // the thread had finished it (completed, or failed with failed_code_), false when it is
  // still pending (and now this thread's alone) or was never handed over.
  bool take_back() noexcept {
    if (progress_ == nullptr) return false;
    ProgressThread* thread = progress_;
    progress_ = nullptr;
    return !thread->reclaim(*this);
  }
  // Completes an operation the thread finished: a failed MPI_Testall there is reported as
  // wait_all_until reports one (the live requests abandoned, then the MPI error thrown).
  void finish_from_thread() {
    if (failed_code_ != MPI_SUCCESS) {
      abandon(owner_, requests_, 2, std::string("a failed ") + op_);
      owner_.fail_call(failed_code_, op_, "MPI_Testall");
    }
    staging_.finish_receive(recv_, bytes_);
  }

  MpiCommunicator::State& owner_;
  std::shared_ptr<MpiCommunicator::State> state_;  // set while in use
  ProgressThread* progress_ = nullptr;  // the thread that owns requests_, while handed over
  int failed_code_ = MPI_SUCCESS;       // written by the thread's step(), read after it
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  HostStaging staging_;   // each slot its own: several shifts may be in flight
  char* recv_ = nullptr;  // the caller's buffer, and its size in bytes
  std::size_t bytes_ = 0;
  double timeout_ = 0.0;
  const char* op_ = "shift";
};

int rank_of(MPI_Comm comm) {
  int rank = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  return rank;
}

int size_of(MPI_Comm comm) {
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  return size;
}

// MPI has no 16-bit float type: bf16 and fp16 travel as MPI_UINT16_T, and their sum is a
// user operation that adds in fp32 and rounds the result to 16 bits, once per application
// (each partial sum MPI's algorithm forms), as NCCL's 16-bit sums do. MPI, a C library, calls
// it: an exception must not leave it, so it calls the non-throwing add_bf16 / add_fp16.
template <Dtype dtype>
void sum_16bit(void* in, void* inout, int* len, MPI_Datatype*) noexcept {
  static_assert(dtype == Dtype::bf16 || dtype == Dtype::fp16, "a 16-bit dtype");
  uint16_t* sum = static_cast<uint16_t*>(inout);
  const auto* arrived = static_cast<const uint16_t*>(in);
  const auto count = static_cast<std::size_t>(*len);
  if constexpr (dtype == Dtype::bf16) {
    add_bf16(sum, arrived, sum, count);
  } else {
    add_fp16(sum, arrived, sum, count);
  }
}

MPI_Op make_sum_op(MPI_User_function* function) {
  MPI_Op op = MPI_OP_NULL;
  check_mpi(MPI_Op_create(function, /*commute=*/1, &op), "MPI_Op_create");
  return op;  // kept for the process (MPI_Finalize frees it)
}

MPI_Datatype mpi_type(Dtype dtype) {
  return dtype == Dtype::fp32 ? MPI_FLOAT : MPI_UINT16_T;
}

MPI_Op mpi_sum(Dtype dtype) {
  static const MPI_Op bf16_sum = make_sum_op(&sum_16bit<Dtype::bf16>);
  static const MPI_Op fp16_sum = make_sum_op(&sum_16bit<Dtype::fp16>);
  switch (dtype) {
    case Dtype::bf16:
      return bf16_sum;
    case Dtype::fp16:
      return fp16_sum;
    default:
      return MPI_SUM;
  }
}

// Elements of `dtype` as bytes, for the host staging (which copies bytes).
const char* bytes(const void* data) {
  return static_cast<const char*>(data);
}
char* bytes(void* data) {
  return static_cast<char*>(data);
}

// Tag of the shift messages: by offset, so shifts in opposite directions on rings larger
// than 2 never match each other. (On 2 ranks both directions reach the same peer with the
// same tag; MPI's in-order matching keeps them apart as long as every rank starts its
// shifts in the same order, which the Communicator contract requires.)
constexpr int kShiftTagBase = 1000;

// A free slot of the pool (best fit by its host staging, slot_pool.hpp; without staging
// the slot freed last), readied for one operation moving `send_bytes` and `recv_bytes`.
MpiRequestSlot& acquire_request_slot(const std::shared_ptr<MpiCommunicator::State>& state,
                                     double timeout, const char* op, std::size_t send_bytes,
                                     std::size_t recv_bytes) {
  const SlotCapacity need =
      HostStaging::stages() ? SlotCapacity{send_bytes, recv_bytes} : SlotCapacity{};
  MpiRequestSlot& slot =
      state->request_slots.acquire(need, [&] { return std::make_unique<MpiRequestSlot>(*state); });
  slot.start(state, timeout, op);
  return slot;
}

// The ring's failures on this communicator's state: as a timed-out or failed library call,
// the live requests are abandoned and the communicator becomes unusable.
class RingFailureOnState final : public RingFailure {
 public:
  RingFailureOnState(MpiCommunicator::State& state, double timeout, const char* op)
      : state_(state), timeout_(timeout), op_(op) {}
  [[noreturn]] void timed_out(MPI_Request* live, int count) override {
    throw_timeout(state_, live, count, timeout_, op_);
  }
  [[noreturn]] void failed(int code, const char* call, MPI_Request* live, int count) override {
    abandon(state_, live, count, std::string("a failed ") + op_);
    state_.fail_call(code, op_, call);
  }

 private:
  MpiCommunicator::State& state_;
  double timeout_;
  const char* op_;
};

// A started ring all-reduce (mpi_ring.hpp's StartedRingAllReduce) as a Request: pooled in
// MpiCommunicator::State::ring_slots, its partial sums and host staging kept between uses.
// It advances whenever it is tested or waited for, or a wait of another started ring
// all-reduce of the communicator polls (which advances every one this thread owns, as
// MPI_Testall advances every MPI operation), and, while the communication thread runs, on
// that thread (handed over as MpiRequestSlot is: the thread steps it until it is done or the
// caller takes it back; only one thread touches it at a time). wait() takes it back and polls
// against the deadline taken there; on a timeout or an MPI failure its live requests are
// abandoned into the state and the communicator is unusable, as for the library's requests.
class MpiRingSlot final : public Request::Impl, public ProgressTask {
 public:
  explicit MpiRingSlot(MpiCommunicator::State& owner) : owner_(owner) {}
  ~MpiRingSlot() override = default;

  // Grows the partial sums and staging now (slot_pool.hpp's reserve).
  void reserve(std::size_t count, Dtype dtype, int size) {
    ring_.reserve(count, dtype, size);
    staging_.reserve(0, count * bytes_of(dtype));
  }
  // Partial-sum bytes and host staging bytes held (the pool's best fit).
  SlotCapacity capacity() const { return {ring_.partial_capacity(), staging_.receive_capacity()}; }

  // Begins the all-reduce of `count` elements of `dtype` in place in `data` (`comm` as the
  // state's) with `tag`; posts its first step. Throws (the slot released) when MPI fails.
  void start(std::shared_ptr<MpiCommunicator::State> state, double timeout, const char* op,
             int size, int rank, int tag, void* data, std::size_t count, Dtype dtype) {
    state_ = std::move(state);
    timeout_ = timeout;
    op_ = op;
    data_ = static_cast<char*>(data);
    bytes_ = count * bytes_of(dtype);
    failed_code_ = MPI_SUCCESS;
    done_ = abandoned_ = false;
    try {  // may grow the buffers (never once reserved)
      char* host = staging_.receive_buffer(data_, bytes_, /*copy_in=*/true);
      ring_.start(owner_.comm, size, rank, tag, host, count, dtype);
    } catch (...) {
      owner_.ring_slots.release(*this);
      state_.reset();
      throw;
    }
    // In flight from here: linked first, so that release() finds it.
    next_ = owner_.rings_in_flight;
    prev_ = nullptr;
    if (next_ != nullptr) next_->prev_ = this;
    owner_.rings_in_flight = this;
    tag_index_ = tag - kStartedRingTagBase;
    owner_.ring_tag_holders[tag_index_] = this;
    advance();
    if (failed_code_ != MPI_SUCCESS) {
      const int code = failed_code_;
      const char* call = ring_.failed_call();
      release();  // abandons what the failed step left live
      owner_.fail_call(code, op, call);
    }
  }

  // After start: lets the communication thread advance it, when one runs.
  void hand_to_progress() {
    if (done_) return;
    progress_ = running_comm_progress();
    if (progress_ != nullptr) progress_->submit(*this);
  }

  // The communication thread's step (under its mutex).
  bool step() noexcept override { return advance(); }

  bool test() override {
    if (progress_ != nullptr && !finished() && progress_->running()) return false;
    take_back();
    advance_all();
    if (!done_) return false;
    finish();
    return true;
  }

  void wait() override {
    take_back();
    const double start = MPI_Wtime();
    for (;;) {
      advance_all();
      if (done_) {
        finish();
        return;
      }
      const double waited = MPI_Wtime() - start;
      if (waited >= timeout_) {
        throw_timeout(owner_, ring_.live_requests(), ring_.live_count(), timeout_, op_);
      }
      detail::pause_between_polls(waited);
    }
  }

  void release() noexcept override {
    take_back();  // the thread must not step requests that are abandoned below
    MPI_Request* live = ring_.live_requests();
    for (int k = 0; k < ring_.live_count(); ++k) {
      if (live[k] == MPI_REQUEST_NULL) continue;
      try {
        owner_.abandoned.push_back(live[k]);
        if (owner_.broken.empty()) owner_.broken = "a started ring all_reduce that failed";
      } catch (...) {
      }
      live[k] = MPI_REQUEST_NULL;
    }
    if (prev_ != nullptr) {
      prev_->next_ = next_;
    } else {
      owner_.rings_in_flight = next_;
    }
    if (next_ != nullptr) next_->prev_ = prev_;
    prev_ = next_ = nullptr;
    give_up_tag();
    owner_.ring_slots.release(*this);
    // Last: when this was the last reference to the state, the state (and this slot) go.
    std::shared_ptr<MpiCommunicator::State> keep = std::move(state_);
  }

  // A later start needs this operation's tag: completes it on this rank first (taken back from
  // the communication thread, advanced with the others this thread owns, against the
  // communicator's timeout) and gives the tag up. The caller's Request still holds it; its
  // wait() or test() then finds it done and hands over the result. A timeout or an MPI failure
  // abandons its live requests (the communicator is then unusable) and throws; the Request
  // reports it again when it is waited for.
  void complete_before_tag_reuse() {
    take_back();
    const double start = MPI_Wtime();
    for (;;) {
      advance_all();
      if (done_) break;
      const double waited = MPI_Wtime() - start;
      if (waited >= timeout_) {
        abandoned_ = done_ = true;  // never advanced again
        throw_timeout(owner_, ring_.live_requests(), ring_.live_count(), timeout_, op_);
      }
      detail::pause_between_polls(waited);
    }
    if (failed_code_ != MPI_SUCCESS) {
      abandon(owner_, ring_.live_requests(), ring_.live_count(), std::string("a failed ") + op_);
      owner_.fail_call(failed_code_, op_, ring_.failed_call());
    }
    give_up_tag();
  }

 private:
  // Frees this operation's entry in State::ring_tag_holders (if it still holds one).
  void give_up_tag() noexcept {
    if (tag_index_ >= 0 && owner_.ring_tag_holders[tag_index_] == this) {
      owner_.ring_tag_holders[tag_index_] = nullptr;
    }
    tag_index_ = -1;
  }

  // Advances this operation on the calling thread: true once it needs no more steps
  // (done_, or failed with failed_code_).
  bool advance() noexcept {
    if (done_) return true;
    const int code = ring_.progress();
    if (code != MPI_SUCCESS) {
      failed_code_ = code;
      done_ = true;
    } else {
      done_ = ring_.complete();
    }
    return done_;
  }
  // This one, then every other started ring of the communicator that this thread owns (not
  // handed to a running communication thread): ranks may wait for them in different orders.
  void advance_all() {
    advance();
    for (MpiRingSlot* other = owner_.rings_in_flight; other != nullptr; other = other->next_) {
      if (other == this) continue;
      if (other->progress_ != nullptr) {
        if (other->progress_->running()) continue;  // the thread's
        other->take_back();
      }
      other->advance();
    }
  }
  // Takes the operation back from the communication thread, if it was handed over; afterwards
  // done_ and failed_code_ hold what the thread's steps left.
  void take_back() noexcept {
    if (progress_ == nullptr) return;
    ProgressThread* thread = progress_;
    progress_ = nullptr;
    thread->reclaim(*this);
  }
  // Completes a finished operation: a failed MPI call is reported as the library path's (the
  // live requests abandoned, then the MPI error thrown); else the result to the caller.
  void finish() {
    if (abandoned_) {
      MESHTRAIN_FAIL(op_, " on ", owner_.description,
                     " failed: the communicator is unusable after ", owner_.broken);
    }
    if (failed_code_ != MPI_SUCCESS) {
      abandon(owner_, ring_.live_requests(), ring_.live_count(), std::string("a failed ") + op_);
      owner_.fail_call(failed_code_, op_, ring_.failed_call());
    }
    staging_.finish_receive(data_, bytes_);
  }

  MpiCommunicator::State& owner_;
  std::shared_ptr<MpiCommunicator::State> state_;  // set while in use
  StartedRingAllReduce ring_;
  HostStaging staging_;
  ProgressThread* progress_ = nullptr;  // the thread that owns the operation, while handed over
  MpiRingSlot* prev_ = nullptr;         // State::rings_in_flight, while in use
  MpiRingSlot* next_ = nullptr;
  double timeout_ = 0.0;
  const char* op_ = "all_reduce";
  char* data_ = nullptr;  // the caller's buffer, and its size in bytes
  std::size_t bytes_ = 0;
  int failed_code_ = MPI_SUCCESS;  // written by advance(), on whichever thread owns it
  bool done_ = false;
  bool abandoned_ = false;  // its requests abandoned by complete_before_tag_reuse's timeout
  int tag_index_ = -1;      // its tag in State::ring_tag_holders while it holds it
};

// A free ring slot (best fit, slot_pool.hpp) for an all-reduce of `count` elements of `dtype`.
MpiRingSlot& acquire_ring_slot(MpiCommunicator::State& state, std::size_t count, Dtype dtype,
                               int size) {
  const std::size_t n = static_cast<std::size_t>(size);
  const std::size_t block_bytes = (count / n + (count % n != 0 ? 1 : 0)) * bytes_of(dtype);
  const SlotCapacity need{block_bytes, HostStaging::stages() ? count * bytes_of(dtype) : 0};
  return state.ring_slots.acquire(need, [&] { return std::make_unique<MpiRingSlot>(state); });
}

}  // namespace

MpiCommunicator::State::~State() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Request& r : abandoned) {
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
  }
  if (comm != MPI_COMM_NULL && comm != MPI_COMM_WORLD && comm != MPI_COMM_SELF) {
    MPI_Comm_free(&comm);  // deferred by MPI until pending operations finish
  }
}

void MpiCommunicator::State::fail_call(int code, const char* op, const char* call) const {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    MESHTRAIN_FAIL(op, " on ", description, ": ", call, " failed with MPI error code ", code);
  }
  MESHTRAIN_FAIL(op, " on ", description, ": ", call,
                 " failed: ", std::string(text, static_cast<std::size_t>(length)));
}

MpiCommunicator::MpiCommunicator(std::shared_ptr<State> state, int size, int rank,
                                 std::string description)
    : Communicator(size, rank, std::move(description)), state_(std::move(state)) {}

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm group,
                                                    const std::string& description) {
  return std::make_unique<MpiCommunicator>(MpiCommunicator::adopt(group, description));
}

MpiCommunicator MpiCommunicator::adopt(MPI_Comm comm, std::string description) {
  MESHTRAIN_REQUIRE(comm != MPI_COMM_NULL, "cannot build a communicator for ", description,
                    " from MPI_COMM_NULL");
  // Everything that can fail comes first: `comm` is owned only once the state holds it.
  check_mpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  const int size = size_of(comm);
  const int rank = rank_of(comm);
  auto state = std::make_shared<State>();
  state->description = description;
  state->alltoallv_layout.resize(4 * static_cast<std::size_t>(size));
  const std::vector<int> world_ranks = world_ranks_of(comm);  // for the flight recorder
  state->comm = comm;
  MpiCommunicator made(std::move(state), size, rank, std::move(description));
  made.set_flight_world_ranks(world_ranks);
  return made;
}

MpiCommunicator MpiCommunicator::duplicate(MPI_Comm comm, std::string description) {
  MPI_Comm copy = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm, &copy), "MPI_Comm_dup");
  try {
    return adopt(copy, std::move(description));
  } catch (...) {
    MPI_Comm_free(&copy);
    throw;
  }
}

void MpiCommunicator::complete(MPI_Request request, const char* op) {
  if (!wait_all_until(*state_, &request, 1, timeout_seconds(), op)) {
    throw_timeout(*state_, &request, 1, timeout_seconds(), op);
  }
}

template <class Start>
void MpiCommunicator::run(const char* op, const char* call, Start&& start) {
  state_->require_usable(op);
  fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::run"));
  MPI_Request request = MPI_REQUEST_NULL;
  state_->check(start(&request), op, call);
  complete(request, op);
}

void MpiCommunicator::raw_all_gather(const void* send, void* recv, std::size_t count_per_rank,
                                     Dtype dtype, const char* op) {
  const int count = checked_int(count_per_rank, "all_gather count per rank");
  const std::size_t element = bytes_of(dtype);
  const std::size_t total = count_per_rank * static_cast<std::size_t>(size());
  const MPI_Datatype type = mpi_type(dtype);
  HostStaging& staging = state_->staging;
  run(op, "MPI_Iallgather", [&](MPI_Request* request) {
    return MPI_Iallgather(staging.send_buffer(bytes(send), count_per_rank * element), count, type,
                          staging.receive_buffer(bytes(recv), total * element, false), count, type,
                          state_->comm, request);
  });
  staging.finish_receive(bytes(recv), total * element);
}

void MpiCommunicator::raw_reduce_scatter_sum(const void* send, void* recv,
                                             std::size_t count_per_rank, Dtype dtype,
                                             const char* op) {
  const std::size_t send_bytes =
      count_per_rank * static_cast<std::size_t>(size()) * bytes_of(dtype);
  if (size() > 1 && send_bytes >= reduction_choice().reduce_scatter_ring_from) {
    state_->require_usable(op);
    fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::raw_reduce_scatter_sum"));
    HostStaging& staging = state_->staging;
    const std::size_t recv_bytes = count_per_rank * bytes_of(dtype);
    RingFailureOnState failure(*state_, timeout_seconds(), op);
    const RingLink link{state_->comm, size(), rank(), timeout_seconds(), state_->ring, failure};
    ring_reduce_scatter(link, staging.send_buffer(bytes(send), send_bytes),
                        staging.receive_buffer(bytes(recv), recv_bytes, false), count_per_rank,
                        dtype);
    staging.finish_receive(bytes(recv), recv_bytes);
    return;
  }
  const int count = checked_int(count_per_rank, "reduce_scatter count per rank");
  const std::size_t element = bytes_of(dtype);
  const std::size_t total = count_per_rank * static_cast<std::size_t>(size());
  HostStaging& staging = state_->staging;
  run(op, "MPI_Ireduce_scatter_block", [&](MPI_Request* request) {
    return MPI_Ireduce_scatter_block(
        staging.send_buffer(bytes(send), total * element),
        staging.receive_buffer(bytes(recv), count_per_rank * element, false), count,
        mpi_type(dtype), mpi_sum(dtype), state_->comm, request);
  });
  staging.finish_receive(bytes(recv), count_per_rank * element);
}

// In pieces of 4 MiB: Open MPI's non-blocking collectives allocate a temporary as large as
// the message on every call, which for a DP gradient (tens of MiB) means fresh pages, and
// page faults, at every step. Pieces keep that temporary small and reused by malloc, and
// each piece's count fits an int however large `count` is. With device memory each piece
// is staged through the host (host_staging.hpp).
template <class T>
void MpiCommunicator::all_reduce_in_pieces(T* data, std::size_t count, MPI_Datatype type,
                                           MPI_Op sum, const char* op) {
  constexpr std::size_t kPieceBytes = std::size_t{4} << 20;
  constexpr std::size_t kPiece = kPieceBytes / sizeof(T);
  HostStaging& staging = state_->staging;
  for (std::size_t offset = 0; offset < count; offset += kPiece) {
    const std::size_t piece = std::min(kPiece, count - offset);
    const int n = static_cast<int>(piece);
    run(op, "MPI_Iallreduce", [&](MPI_Request* request) {
      return MPI_Iallreduce(MPI_IN_PLACE, staging.receive_buffer(data + offset, piece, true), n,
                            type, sum, state_->comm, request);
    });
    staging.finish_receive(data + offset, piece);
  }
}

void MpiCommunicator::raw_all_reduce_sum(void* data, std::size_t count, Dtype dtype,
                                         const char* op) {
  const std::size_t data_bytes = count * bytes_of(dtype);
  if (size() > 1 && data_bytes >= reduction_choice().all_reduce_ring_from) {
    state_->require_usable(op);
    fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::raw_all_reduce_sum"));
    HostStaging& staging = state_->staging;
    RingFailureOnState failure(*state_, timeout_seconds(), op);
    const RingLink link{state_->comm, size(), rank(), timeout_seconds(), state_->ring, failure};
    ring_all_reduce(link, staging.receive_buffer(bytes(data), data_bytes, true), count, dtype);
    staging.finish_receive(bytes(data), data_bytes);
    return;
  }
  if (dtype == Dtype::fp32) {
    all_reduce_in_pieces(static_cast<float*>(data), count, MPI_FLOAT, MPI_SUM, op);
  } else {
    all_reduce_in_pieces(static_cast<uint16_t*>(data), count, MPI_UINT16_T, mpi_sum(dtype), op);
  }
}

void MpiCommunicator::raw_all_reduce_sum_f64(double* data, std::size_t count, const char* op) {
  all_reduce_in_pieces(data, count, MPI_DOUBLE, MPI_SUM, op);
}

void MpiCommunicator::raw_broadcast(float* data, std::size_t count, int root, const char* op) {
  const int n = checked_int(count, "broadcast count");
  HostStaging& staging = state_->staging;
  const bool sends = rank() == root;
  run(op, "MPI_Ibcast", [&](MPI_Request* request) {
    return MPI_Ibcast(staging.receive_buffer(data, count, /*copy_in=*/sends), n, MPI_FLOAT, root,
                      state_->comm, request);
  });
  if (!sends) staging.finish_receive(data, count);
}

Request MpiCommunicator::raw_shift(const void* send, void* recv, std::size_t count, Dtype dtype,
                                   int offset, const char* op) {
  state_->require_usable(op);
  const int n = checked_int(count, "shift count");
  const int size = this->size();
  const int k = ((offset % size) + size) % size;
  const int to = (rank() + k) % size;
  const int from = (rank() - k + size) % size;
  const int tag = kShiftTagBase + k % 30000;
  fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::raw_shift"));
  const std::size_t message_bytes = count * bytes_of(dtype);
  const MPI_Datatype type = mpi_type(dtype);
  MpiRequestSlot& slot =
      acquire_request_slot(state_, timeout_seconds(), op, message_bytes, message_bytes);
  const char* send_mpi = slot.send_buffer(bytes(send), message_bytes);
  const int received = MPI_Irecv(slot.receive_buffer(bytes(recv), message_bytes), n, type, from,
                                 tag, state_->comm, &slot.receive());
  if (received != MPI_SUCCESS) {
    slot.receive() = MPI_REQUEST_NULL;  // nothing was posted
    slot.release();
    state_->fail_call(received, op, "MPI_Irecv");
  }
  const int sent = MPI_Isend(send_mpi, n, type, to, tag, state_->comm, &slot.send());
  if (sent != MPI_SUCCESS) {
    // The receive is already posted into the caller's buffer: cancel it and wait until
    // MPI lets go of the buffer. If it does not within the timeout, the slot keeps it as
    // abandoned and the communicator is unusable from here on (see release()).
    slot.send() = MPI_REQUEST_NULL;
    if (MPI_Cancel(&slot.receive()) == MPI_SUCCESS) {
      const double start = MPI_Wtime();
      int done = 0;
      while (MPI_Test(&slot.receive(), &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done &&
             MPI_Wtime() - start < timeout_seconds()) {
        sched_yield();
      }
      if (done) slot.receive() = MPI_REQUEST_NULL;
    }
    slot.release();
    state_->fail_call(sent, op, "MPI_Isend");
  }
  slot.hand_to_progress();
  return Request(&slot);
}

Request MpiCommunicator::raw_start_all_gather(const void* send, void* recv,
                                              std::size_t count_per_rank, Dtype dtype,
                                              const char* op) {
  state_->require_usable(op);
  const int count = checked_int(count_per_rank, "all_gather count per rank");
  const std::size_t element = bytes_of(dtype);
  const std::size_t total = count_per_rank * static_cast<std::size_t>(size());
  const MPI_Datatype type = mpi_type(dtype);
  fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::raw_start_all_gather"));
  MpiRequestSlot& slot = acquire_request_slot(state_, timeout_seconds(), op,
                                              count_per_rank * element, total * element);
  const char* send_mpi = slot.send_buffer(bytes(send), count_per_rank * element);
  const int started =
      MPI_Iallgather(send_mpi, count, type, slot.receive_buffer(bytes(recv), total * element),
                     count, type, state_->comm, &slot.receive());
  if (started != MPI_SUCCESS) {
    slot.receive() = MPI_REQUEST_NULL;  // nothing was started
    slot.release();
    state_->fail_call(started, op, "MPI_Iallgather");
  }
  slot.hand_to_progress();
  return Request(&slot);
}

// Where the reduction choice picks the ring for this size (as the blocking all-reduce does),
// a started ring all-reduce (MpiRingSlot). Else one MPI_Iallreduce in place on a pooled slot
// (its own staging: several may be in flight). Unlike the blocking all-reduce it is not split
// into pieces: the caller (a DP gradient bucket) chooses the size, and a count beyond an int
// is refused.
Request MpiCommunicator::raw_start_all_reduce_sum(void* data, std::size_t count, Dtype dtype,
                                                  const char* op) {
  state_->require_usable(op);
  if (uses_started_ring(count, dtype)) {
    const auto tag_index = static_cast<int>(state_->rings_started % kStartedRingTags);
    // The operation begun kStartedRingTags starts ago may still hold the tag here (on this
    // rank; on another it may be done and released): it is completed first, on every rank
    // alike, so that the two never share the tag (see kStartedRingTagBase).
    if (MpiRingSlot* holder = state_->ring_tag_holders[tag_index]) {
      holder->complete_before_tag_reuse();
    }
    fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::raw_start_all_reduce_sum"));
    ++state_->rings_started;
    const int tag = kStartedRingTagBase + tag_index;
    MpiRingSlot& slot = acquire_ring_slot(*state_, count, dtype, size());
    slot.start(state_, timeout_seconds(), op, size(), rank(), tag, data, count, dtype);
    slot.hand_to_progress();
    return Request(&slot);
  }
  const int n = checked_int(count, "started all_reduce count");
  fence_all(MESHTRAIN_LABEL("meshtrain::MpiCommunicator::raw_start_all_reduce_sum"));
  MpiRequestSlot& slot =
      acquire_request_slot(state_, timeout_seconds(), op, 0, count * bytes_of(dtype));
  const int started =
      MPI_Iallreduce(MPI_IN_PLACE, slot.receive_buffer(bytes(data), count * bytes_of(dtype), true),
                     n, mpi_type(dtype), mpi_sum(dtype), state_->comm, &slot.receive());
  if (started != MPI_SUCCESS) {
    slot.receive() = MPI_REQUEST_NULL;  // nothing was started
    slot.release();
    state_->fail_call(started, op, "MPI_Iallreduce");
  }
  slot.hand_to_progress();
  return Request(&slot);
}

void MpiCommunicator::raw_all_to_all(const float* send, float* recv, std::size_t count_per_rank,
                                     const char* op) {
  const int count = checked_int(count_per_rank, "all_to_all count per rank");
  const std::size_t total = count_per_rank * static_cast<std::size_t>(size());
  HostStaging& staging = state_->staging;
  run(op, "MPI_Ialltoall", [&](MPI_Request* request) {
    return MPI_Ialltoall(staging.send_buffer(send, total), count, MPI_FLOAT,
                         staging.receive_buffer(recv, total, false), count, MPI_FLOAT, state_->comm,
                         request);
  });
  staging.finish_receive(recv, total);
}

void MpiCommunicator::raw_all_to_all_v(const void* send, const std::size_t* send_counts,
                                       const std::size_t* send_offsets, void* recv,
                                       const std::size_t* recv_counts,
                                       const std::size_t* recv_offsets, Dtype dtype,
                                       const char* op) {
  const std::size_t n = static_cast<std::size_t>(size());
  std::vector<int>& layout = state_->alltoallv_layout;
  if (layout.size() != 4 * n) layout.resize(4 * n);  // sized in adopt(); never here
  int* send_n = layout.data();
  int* send_at = send_n + n;
  int* recv_n = send_at + n;
  int* recv_at = recv_n + n;
  // The extents MPI touches (in elements), for the host staging: the end of the last block.
  // Receive blocks with gaps between them (never from Communicator, which packs them) copy the
  // caller's data in first, so the gaps come back unchanged.
  std::size_t send_end = 0, recv_end = 0, recv_total = 0;
  for (std::size_t j = 0; j < n; ++j) {
    recv_total += recv_counts[j];
    send_n[j] = checked_int(send_counts[j], "all_to_all_v send count");
    send_at[j] = checked_int(send_offsets[j], "all_to_all_v send displacement");
    recv_n[j] = checked_int(recv_counts[j], "all_to_all_v receive count");
    recv_at[j] = checked_int(recv_offsets[j], "all_to_all_v receive displacement");
    if (send_counts[j] > 0) send_end = std::max(send_end, send_offsets[j] + send_counts[j]);
    if (recv_counts[j] > 0) recv_end = std::max(recv_end, recv_offsets[j] + recv_counts[j]);
  }
  const bool gaps = recv_total != recv_end;
  const std::size_t element = bytes_of(dtype);
  const MPI_Datatype type = mpi_type(dtype);
  HostStaging& staging = state_->staging;
  run(op, "MPI_Ialltoallv", [&](MPI_Request* request) {
    return MPI_Ialltoallv(staging.send_buffer(bytes(send), send_end * element), send_n, send_at,
                          type, staging.receive_buffer(bytes(recv), recv_end * element, gaps),
                          recv_n, recv_at, type, state_->comm, request);
  });
  staging.finish_receive(bytes(recv), recv_end * element);
}

void MpiCommunicator::raw_reserve_requests(std::size_t count, std::size_t send_bytes,
                                           std::size_t recv_bytes) {
  state_->request_slots.reserve(
      count, [&] { return std::make_unique<MpiRequestSlot>(*state_); },
      [&](MpiRequestSlot& slot) { slot.reserve_staging(send_bytes, recv_bytes); });
}

bool MpiCommunicator::uses_started_ring(std::size_t count, Dtype dtype) const {
  return size() > 1 && count * bytes_of(dtype) >= reduction_choice().all_reduce_ring_from;
}

void MpiCommunicator::raw_reserve_reductions(std::size_t elements, Dtype dtype) {
  if (size() < 2) return;
  const ReductionChoice& choice = reduction_choice();
  const std::size_t bytes = elements * bytes_of(dtype);
  if (bytes < std::min(choice.reduce_scatter_ring_from, choice.all_reduce_ring_from)) return;
  const std::size_t n = static_cast<std::size_t>(size());
  const std::size_t block = (elements / n + (elements % n != 0 ? 1 : 0)) * bytes_of(dtype);
  state_->ring.reserve(block, size() == 2 ? 1 : 2);
}

void MpiCommunicator::raw_reserve_started_all_reduces(std::size_t count, std::size_t elements,
                                                      Dtype dtype) {
  if (!uses_started_ring(elements, dtype)) {
    raw_reserve_requests(count, 0, elements * bytes_of(dtype));
    return;
  }
  state_->ring_slots.reserve(
      count, [&] { return std::make_unique<MpiRingSlot>(*state_); },
      [&](MpiRingSlot& slot) { slot.reserve(elements, dtype, size()); });
}

void MpiCommunicator::raw_reserve_staging(std::size_t send_bytes, std::size_t recv_bytes) {
  state_->staging.reserve(send_bytes, recv_bytes);
}

void MpiCommunicator::raw_barrier(const char* op) {
  run(op, "MPI_Ibarrier",
      [&](MPI_Request* request) { return MPI_Ibarrier(state_->comm, request); });
}

}  // namespace meshtrain
