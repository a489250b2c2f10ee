// The NCCL backend: set-up from an MPI group, operations on the communicator's stream,
// completion polled against the deadline, abort on timeout or asynchronous error.
//
// Ordering rules. "Kokkos' stream" is the stream of Kokkos' default CUDA instance, where
// meshtrain's kernels and cuBLAS run. No operation fences the device: a device-wide
// synchronize would also wait for the operations other communicators have started
// (serializing the FSDP prefetch and the DP buckets with everything else) and could hang,
// outside the deadline, on an operation whose peer is gone.
//  1. Inputs and buffer reuse: begin() records the state's event `kokkos_ready` on Kokkos'
//     stream and makes the communicator's stream wait for it (cudaStreamWaitEvent; the host
//     does not wait). Every NCCL call, copy and event record of the operation is queued
//     after that, so it runs after every kernel queued before the operation began: those
//     that wrote its send buffers, and those still reading a buffer it overwrites (the
//     prefetch landing buffer that held the last layer's weight, a ring step's old block).
//  2. Blocking operations return after the host has seen the communicator's stream idle
//     (wait_for polls cudaStreamQuery and NCCL's errors under the deadline): the results
//     are complete, and kernels queued afterwards may read them and reuse the buffers.
//  3. Started operations (Request): an event recorded on the communicator's stream after
//     the operation is polled by test() and waited for under the deadline by wait(); once
//     it has completed, both make Kokkos' stream wait for it before they report completion,
//     so kernels that read the received data or overwrite the buffers are queued after the
//     transfer (the host's observation orders them too; the stream wait keeps the rule
//     local). Until then the caller must not touch the operation's buffers.
//  4. Events are made once: `kokkos_ready` with the communicator, the Requests' events in
//     the state's pool when it grows (reused after). The steady state makes no CUDA object.
//  5. Other streams: the communicator's stream is a blocking stream, so work queued on the
//     legacy default stream before an operation runs before it; work on other non-blocking
//     streams (e.g. the caller's, for the *_device functions) is the caller's to order.
//  6. No CUDA Kokkos (host kernels), or Kokkos on another device than the communicator
//     (only possible through the *_device functions; an event cannot be recorded across
//     devices): begin() fences Kokkos' default instance, never the whole device.
//  7. Operations of different communicators may now be in flight together on one device
//     (that is the overlap). NCCL requires them to be issued in the same order on every
//     rank, which the SPMD training step does.

#include "framework/comm/backends/nccl_communicator.hpp"

#include <sched.h>

#include <chrono>
#include <cstdint>
#include <ctime>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/mpi_util.hpp"

namespace meshtrain {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Spin briefly, then leave the core to others (ranks may share cores with the host code).
void pause_poll(long polls) {
  if (polls > 2000) {
    const timespec pause{0, 20000};  // 20 us
    nanosleep(&pause, nullptr);
  } else {
    sched_yield();
  }
}

std::string seconds_text(double seconds) {
  std::ostringstream out;
  out << seconds;
  return out.str();
}

std::string cuda_text(cudaError_t code) {
  return std::string(cudaGetErrorString(code)) + " (" + cudaGetErrorName(code) + ")";
}

void check_cuda(cudaError_t code, const std::string& what) {
  if (code == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
  MESHTRAIN_FAIL(what, " failed: ", cuda_text(code));
}

// "<op> on <group>: <call> failed: ..." for calls inside operations: the text is built
// only on failure, so the success path allocates nothing.
[[noreturn]] void fail_cuda(cudaError_t code, const char* op, const std::string& group,
                            const char* call) {
  cudaGetLastError();
  MESHTRAIN_FAIL(op, " on ", group, ": ", call, " failed: ", cuda_text(code));
}
void check_cuda(cudaError_t code, const char* op, const std::string& group, const char* call) {
  if (code != cudaSuccess) fail_cuda(code, op, group, call);
}

// NCCL's result string plus its last-error detail, which names the actual cause.
std::string nccl_text(ncclResult_t code, ncclComm_t comm) {
  std::string text = ncclGetErrorString(code);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && *detail != '\0') text += std::string(" (") + detail + ")";
  return text;
}

// count_per_rank x ranks floats, checked so the byte size cannot overflow. NCCL takes
// size_t counts, so no count becomes an int here.
std::size_t checked_total(std::size_t count_per_rank, int ranks, const char* what) {
  const std::size_t n = static_cast<std::size_t>(ranks);
  if (count_per_rank > SIZE_MAX / sizeof(float) / n) {
    MESHTRAIN_FAIL(what, " of ", count_per_rank, " floats x ", ranks,
                   " ranks does not fit in the address space");
  }
  return count_per_rank * n;
}

bool overlaps(const float* a, std::size_t na, const float* b, std::size_t nb) {
  if (na == 0 || nb == 0) return false;
  return a < b + nb && b < a + na;
}

// Kokkos' stream (its default instance's, where meshtrain's kernels and cuBLAS run) when
// Kokkos is initialized, runs on CUDA by default and on `device`; false otherwise.
bool kokkos_stream_on(int device, cudaStream_t* stream) {
#if defined(KOKKOS_ENABLE_DEFAULT_DEVICE_TYPE_CUDA)
  if (!Kokkos::is_initialized()) return false;
  const Kokkos::DefaultExecutionSpace kokkos;
  if (kokkos.cuda_device() != device) return false;
  *stream = kokkos.cuda_stream();
  return true;
#else
  (void)device;
  (void)stream;
  return false;
#endif
}

}  // namespace

// ------------------------------------------------------------------------------ State

class NcclRequestSlot;
// Deletes a slot of the shift pool (defined with the slot, below).
struct NcclRequestSlotDeleter {
  void operator()(NcclRequestSlot* slot) const noexcept;
};

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = -1;
  float* barrier_word = nullptr;  // one device float all-reduced by barrier()
  // Recorded on Kokkos' stream at the start of every operation, then waited for by
  // `stream` (ordering rule 1 at the top of this file). Made once, at set-up.
  cudaEvent_t kokkos_ready = nullptr;
  std::string description;
  std::string broken;  // non-empty after an abort: why the communicator is unusable
  double destroy_timeout = 300.0;
  std::vector<cudaEvent_t> free_events;  // recycled by shift requests
  // The pool of shift requests: every slot ever made (owned here), the free ones as an
  // intrusive list. A slot in use holds a reference to this state, so a pending Request
  // keeps the state alive after the communicator is gone.
  std::vector<std::unique_ptr<NcclRequestSlot, NcclRequestSlotDeleter>> request_slots;
  NcclRequestSlot* free_request_slots = nullptr;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  ~State() {
    if (device >= 0) cudaSetDevice(device);
    if (comm != nullptr) {
      // Finalize (flush and quiesce with the peers), bounded by the timeout; a peer that
      // is gone or an error turns it into an abort. Destructors cannot report.
      bool clean = false;
      ncclResult_t code = ncclCommFinalize(comm);
      if (code == ncclSuccess || code == ncclInProgress) {
        const Clock::time_point deadline = deadline_after(destroy_timeout);
        for (long polls = 0;; ++polls) {
          ncclResult_t state = ncclSuccess;
          if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
          if (state == ncclSuccess) {
            clean = true;
            break;
          }
          if (state != ncclInProgress || Clock::now() > deadline) break;
          pause_poll(polls);
        }
      }
      if (clean) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
      comm = nullptr;
    }
    for (cudaEvent_t event : free_events) cudaEventDestroy(event);
    if (kokkos_ready != nullptr) cudaEventDestroy(kokkos_ready);
    if (barrier_word != nullptr) cudaFree(barrier_word);
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaGetLastError();
  }

  void require_usable(const char* op) const {
    if (!broken.empty()) {
      MESHTRAIN_FAIL(op, " on ", description, " refused: the NCCL communicator is unusable after ",
                     broken);
    }
  }

  // Aborts the NCCL communicator (stopping its kernels) and marks this state unusable.
  // Only called on the way to an Error, which already says what went wrong, so abort's own
  // result is not reported.
  void abort(const std::string& why) {
    if (broken.empty()) broken = why;
    if (comm != nullptr) {
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
  }

  [[noreturn]] void fail_abort(const std::string& message) {
    abort("an earlier error (" + message + ")");
    MESHTRAIN_FAIL(message);
  }

  [[noreturn]] void fail_timeout(const char* op, double timeout) {
    fail_abort(std::string(op) + " on " + description + " did not complete within " +
               seconds_text(timeout) + " s: a rank did not join");
  }

  // Throws (after aborting) when NCCL reports an asynchronous error; true while NCCL is
  // still working on the last call (ncclInProgress).
  bool nccl_in_progress(const char* op) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t code = ncclCommGetAsyncError(comm, &state);
    if (code != ncclSuccess) {
      fail_abort(std::string(op) + " on " + description +
                 ": ncclCommGetAsyncError failed: " + nccl_text(code, comm));
    }
    if (state == ncclSuccess) return false;
    if (state == ncclInProgress) return true;
    fail_abort(std::string(op) + " on " + description + " failed: NCCL reported " +
               nccl_text(state, comm));
  }

  // An NCCL call inside a group (or ncclGroupStart): errors abort and throw.
  void check_call(ncclResult_t code, const char* op, const char* call) {
    if (code == ncclSuccess || code == ncclInProgress) return;
    fail_abort(std::string(op) + " on " + description + ": " + call +
               " failed: " + nccl_text(code, comm));
  }

  // Handles the return code of an NCCL call in non-blocking mode: errors abort and throw;
  // ncclInProgress is polled until NCCL has finished the call (connections to peers are
  // set up here, so the deadline applies).
  void enqueued(ncclResult_t code, const char* op, const char* call, Clock::time_point deadline,
                double timeout) {
    if (code != ncclSuccess && code != ncclInProgress) {
      fail_abort(std::string(op) + " on " + description + ": " + call +
                 " failed: " + nccl_text(code, comm));
    }
    for (long polls = 0; nccl_in_progress(op); ++polls) {
      if (Clock::now() > deadline) fail_timeout(op, timeout);
      pause_poll(polls);
    }
  }

  // Polls until `event` (the whole stream when null) has completed, NCCL reports an error
  // or the deadline passes.
  void wait_for(cudaEvent_t event, const char* op, Clock::time_point deadline, double timeout) {
    for (long polls = 0;; ++polls) {
      const cudaError_t done = event != nullptr ? cudaEventQuery(event) : cudaStreamQuery(stream);
      if (done != cudaSuccess && done != cudaErrorNotReady) {
        cudaGetLastError();
        fail_abort(std::string(op) + " on " + description +
                   ": the CUDA stream failed: " + cuda_text(done));
      }
      nccl_in_progress(op);  // throws on an asynchronous NCCL error
      if (done == cudaSuccess) return;
      if (Clock::now() > deadline) fail_timeout(op, timeout);
      pause_poll(polls);
    }
  }

  cudaEvent_t acquire_event() {
    if (!free_events.empty()) {
      cudaEvent_t event = free_events.back();
      free_events.pop_back();
      return event;
    }
    cudaEvent_t event = nullptr;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "shift", description,
               "cudaEventCreateWithFlags");
    return event;
  }

  void release_event(cudaEvent_t event) { free_events.push_back(event); }

  // Ordering rule 1 (top of this file): what is queued on `stream` next starts after the
  // work queued on Kokkos' stream so far. No host wait. The device must be current.
  void order_after_kokkos(const char* op) {
    cudaStream_t kokkos = nullptr;
    if (!kokkos_stream_on(device, &kokkos)) {
      // Rules 5 and 6: host kernels, or Kokkos on another device (its instance only).
      if (Kokkos::is_initialized()) Kokkos::DefaultExecutionSpace().fence();
      return;
    }
    check_cuda(cudaEventRecord(kokkos_ready, kokkos), op, description,
               "cudaEventRecord on Kokkos' stream");
    check_cuda(cudaStreamWaitEvent(stream, kokkos_ready, 0), op, description,
               "cudaStreamWaitEvent of the NCCL stream");
  }

  // Ordering rule 3: what is queued on Kokkos' stream next starts after `event` (recorded
  // on `stream` after a started operation). The device must be current.
  void order_kokkos_after(cudaEvent_t event, const char* op) {
    cudaStream_t kokkos = nullptr;
    if (!kokkos_stream_on(device, &kokkos)) return;  // the host has seen `event` complete
    check_cuda(cudaStreamWaitEvent(kokkos, event, 0), op, description,
               "cudaStreamWaitEvent of Kokkos' stream");
  }
};

using State = NcclCommunicator::State;

// A pending shift: an event recorded on the stream after its send and receive. Pooled in
// State: acquire_request_slot() takes a free slot (or makes one when all are in flight) and
// an event, Request::Impl::release() gives both back.
class NcclRequestSlot final : public Request::Impl {
 public:
  explicit NcclRequestSlot(State& owner) : owner_(owner) {}
  ~NcclRequestSlot() override = default;

  // Readies a free slot for one shift; `state` is the owner, kept alive while in use.
  void start(std::shared_ptr<State> state, double timeout, const char* op) {
    event_ = owner_.acquire_event();
    state_ = std::move(state);
    timeout_ = timeout;
    op_ = op;
    done_ = false;
  }
  cudaEvent_t event() const { return event_; }
  NcclRequestSlot*& next_free() { return next_free_; }

  bool test() override {
    if (done_) return true;
    owner_.require_usable(op_);
    check_cuda(cudaSetDevice(owner_.device), op_, owner_.description, "cudaSetDevice");
    const cudaError_t code = cudaEventQuery(event_);
    if (code == cudaErrorNotReady) {
      owner_.nccl_in_progress(op_);  // throws on an asynchronous NCCL error
      return false;
    }
    if (code != cudaSuccess) {
      cudaGetLastError();
      owner_.fail_abort(std::string(op_) + " on " + owner_.description +
                        ": the CUDA stream failed: " + cuda_text(code));
    }
    owner_.order_kokkos_after(event_, op_);  // before the caller touches the buffers
    done_ = true;
    return true;
  }

  void wait() override {
    if (done_) return;
    owner_.require_usable(op_);
    check_cuda(cudaSetDevice(owner_.device), op_, owner_.description, "cudaSetDevice");
    owner_.wait_for(event_, op_, deadline_after(timeout_), timeout_);
    owner_.order_kokkos_after(event_, op_);  // before the caller touches the buffers
    done_ = true;
  }

  void release() noexcept override {
    // free_events keeps its capacity, so giving the event back allocates nothing once
    // the pool has grown to the number of shifts in flight.
    if (event_ != nullptr) {
      try {
        owner_.release_event(event_);
      } catch (...) {
        cudaEventDestroy(event_);
      }
      event_ = nullptr;
    }
    next_free_ = owner_.free_request_slots;
    owner_.free_request_slots = this;
    // Last: when this was the last reference to the state, the state (and this slot) go.
    std::shared_ptr<State> keep = std::move(state_);
  }

 private:
  State& owner_;
  std::shared_ptr<State> state_;  // set while in use
  cudaEvent_t event_ = nullptr;
  double timeout_ = 0.0;
  const char* op_ = "shift";
  bool done_ = false;
  NcclRequestSlot* next_free_ = nullptr;
};

void NcclRequestSlotDeleter::operator()(NcclRequestSlot* slot) const noexcept {
  delete slot;
}

namespace {

// A free slot of the pool with a fresh event, ready for one shift.
NcclRequestSlot& acquire_request_slot(const std::shared_ptr<State>& state, double timeout,
                                      const char* op) {
  NcclRequestSlot* slot = state->free_request_slots;
  if (slot == nullptr) {
    state->request_slots.emplace_back(new NcclRequestSlot(*state));
    slot = state->request_slots.back().get();
    slot->next_free() = nullptr;
    state->free_request_slots = slot;
  }
  slot->start(state, timeout, op);  // may throw (no event): the slot stays free
  state->free_request_slots = slot->next_free();
  slot->next_free() = nullptr;
  return *slot;
}

// Device buffers only: a host pointer is bad input with the reason and the remedy.
void require_device_buffer(const State& state, const void* data, const char* op,
                           const char* which) {
  if (data == nullptr) {
    MESHTRAIN_BAD_INPUT(op, " on ", state.description, ": the ", which,
                        " buffer is a null pointer");
  }
  cudaPointerAttributes attributes{};
  const cudaError_t code = cudaPointerGetAttributes(&attributes, data);
  if (code != cudaSuccess) {
    cudaGetLastError();
    MESHTRAIN_FAIL(op, " on ", state.description, ": cudaPointerGetAttributes of the ", which,
                   " buffer failed: ", cuda_text(code));
  }
  if (attributes.type == cudaMemoryTypeManaged) return;
  if (attributes.type == cudaMemoryTypeDevice) {
    if (attributes.device != state.device) {
      MESHTRAIN_BAD_INPUT(op, " on ", state.description, ": the ", which,
                          " buffer is memory of CUDA device ", attributes.device,
                          " but this NCCL communicator runs on device ", state.device);
    }
    return;
  }
  MESHTRAIN_BAD_INPUT(op, " on ", state.description, ": the ", which, " buffer is ",
                      attributes.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory",
                      ", but the NCCL backend needs CUDA device memory: use a CUDA-enabled Kokkos "
                      "(default memory space CudaSpace) for Kokkos Views, or pass device buffers "
                      "to NcclCommunicator::",
                      op, "_device");
}

void require_disjoint(const State& state, const float* a, std::size_t na, const float* b,
                      std::size_t nb, const char* op) {
  if (overlaps(a, na, b, nb)) {
    MESHTRAIN_BAD_INPUT(op, " on ", state.description,
                        ": the send and receive buffers overlap; use separate buffers");
  }
}

// What rank 0 of the group sends to the others: the id, or why it has none.
struct IdMessage {
  ncclUniqueId id;
  int ok;
  char error[256];
};

// A set-up broadcast given up on (timeout or a failed MPI_Test): MPI may still write into
// its buffer and forbids freeing a collective's request, so both are kept, never freed,
// for the rest of the process.
void keep_abandoned(MPI_Request request, std::unique_ptr<IdMessage> buffer) {
  if (request == MPI_REQUEST_NULL) return;  // nothing in flight: the buffer may go
  static auto* kept = new std::vector<std::pair<MPI_Request, IdMessage*>>();
  try {
    kept->emplace_back(request, buffer.get());
  } catch (...) {
  }
  buffer.release();  // deliberately leaked: see above
}

// Rank 0's message on every rank of `comm`: MPI_Ibcast completed by polling against the
// deadline (a rank that never joins the set-up becomes an Error, as in the collectives).
// The message travels in a heap buffer that keep_abandoned() keeps alive when the wait is
// given up, so a late broadcast never writes into a dead stack frame.
IdMessage broadcast_id(const IdMessage& mine, MPI_Comm comm, double timeout,
                       const std::string& description) {
  auto buffer = std::make_unique<IdMessage>(mine);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(
      MPI_Ibcast(buffer.get(), static_cast<int>(sizeof(IdMessage)), MPI_BYTE, 0, comm, &request),
      ("MPI_Ibcast of the NCCL id for " + description).c_str());
  const Clock::time_point deadline = deadline_after(timeout);
  for (long polls = 0;; ++polls) {
    int done = 0;
    const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      keep_abandoned(request, std::move(buffer));
      check_mpi(code, ("MPI_Test of the NCCL id broadcast for " + description).c_str());
    }
    if (done) return *buffer;
    if (Clock::now() > deadline) {
      keep_abandoned(request, std::move(buffer));
      MESHTRAIN_FAIL("NCCL set-up on ", description,
                     ": the broadcast of the NCCL id did not complete within ",
                     seconds_text(timeout), " s: a rank did not join");
    }
    pause_poll(polls);
  }
}

}  // namespace

// ------------------------------------------------------------------- free functions

int cuda_device_count(std::string* why) {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "cudaGetDeviceCount: " + cuda_text(code);
    return 0;
  }
  if (count <= 0 && why) *why = "cudaGetDeviceCount found no device";
  return count > 0 ? count : 0;
}

bool nccl_device_available() noexcept {
  return cuda_device_count(nullptr) > 0;
}

int select_cuda_device(MPI_Comm comm) {
  std::string why;
  const int count = cuda_device_count(&why);
  if (count == 0) MESHTRAIN_FAIL("the NCCL backend needs a CUDA device, but ", why);
#if defined(KOKKOS_ENABLE_CUDA)
  // A CUDA Kokkos has already bound this process to a device; NCCL must use the same one
  // so that Views are memory of the communicator's device.
  if (Kokkos::is_initialized()) {
    const int kokkos_device = Kokkos::Cuda().cuda_device();
    check_cuda(cudaSetDevice(kokkos_device),
               "cudaSetDevice(" + std::to_string(kokkos_device) + ") (Kokkos' device)");
    return kokkos_device;
  }
#endif
  const int device = node_place(comm).local_rank % count;
  check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  return device;
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group,
                                                     const std::string& description) {
  // The factory owns `group` once it returns (see CommunicatorFactory): NCCL does not need
  // it after set-up, so it is freed here; on failure it is still the caller's.
  auto comm = std::make_unique<NcclCommunicator>(NcclCommunicator::create(group, description));
  if (group != MPI_COMM_WORLD && group != MPI_COMM_SELF) {
    check_mpi(MPI_Comm_free(&group), ("MPI_Comm_free of the group of " + description).c_str());
  }
  return comm;
}

// ---------------------------------------------------------------- NcclCommunicator

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state, int size, int rank,
                                   std::string description)
    : Communicator(size, rank, std::move(description)), state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() {
  if (state_) state_->destroy_timeout = timeout_seconds();
}

NcclCommunicator NcclCommunicator::create(MPI_Comm group, std::string description) {
  MESHTRAIN_REQUIRE(group != MPI_COMM_NULL, "cannot build an NCCL communicator for ", description,
                    " from MPI_COMM_NULL");
  const double timeout = collective_timeout_from_env();
  std::string why;
  if (cuda_device_count(&why) == 0) {
    MESHTRAIN_FAIL("the NCCL communicator of ", description, " needs a CUDA device, but ", why);
  }
  int size = 0, rank = 0;
  check_mpi(MPI_Comm_size(group, &size), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(group, &rank), "MPI_Comm_rank");

  auto state = std::make_shared<State>();
  state->description = description;
  state->destroy_timeout = timeout;
  check_cuda(cudaGetDevice(&state->device), "cudaGetDevice for " + description);

  // Rank 0 creates the id; a failure there is sent along so no rank waits for nothing.
  IdMessage message{};
  if (rank == 0) {
    const ncclResult_t code = ncclGetUniqueId(&message.id);
    message.ok = code == ncclSuccess ? 1 : 0;
    if (!message.ok) {
      const std::string text = nccl_text(code, nullptr);
      text.copy(message.error, sizeof(message.error) - 1);
    }
  }
  message = broadcast_id(message, group, timeout, description);
  if (!message.ok) {
    MESHTRAIN_FAIL("NCCL set-up on ", description,
                   ": ncclGetUniqueId failed on rank 0 of the group: ", std::string(message.error));
  }

  check_cuda(cudaStreamCreateWithFlags(&state->stream, cudaStreamDefault),
             "cudaStreamCreateWithFlags for " + description);
  check_cuda(cudaEventCreateWithFlags(&state->kokkos_ready, cudaEventDisableTiming),
             "cudaEventCreateWithFlags for " + description);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&state->barrier_word), sizeof(float)),
             "cudaMalloc of the barrier word for " + description);
  check_cuda(cudaMemset(state->barrier_word, 0, sizeof(float)),
             "cudaMemset of the barrier word for " + description);

  // Non-blocking mode: the set-up (which waits for every rank) is polled, not blocking.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t code = ncclCommInitRankConfig(&state->comm, size, message.id, rank, &config);
  if (code != ncclSuccess && code != ncclInProgress) {
    const std::string text = nccl_text(code, state->comm);
    state->abort("a failed set-up");
    MESHTRAIN_FAIL("NCCL set-up on ", description, ": ncclCommInitRankConfig (rank ", rank, " of ",
                   size, ", CUDA device ", state->device, ") failed: ", text);
  }
  const Clock::time_point deadline = deadline_after(timeout);
  for (long polls = 0; state->nccl_in_progress("NCCL set-up"); ++polls) {
    if (Clock::now() > deadline) state->fail_timeout("NCCL set-up", timeout);
    pause_poll(polls);
  }
  return NcclCommunicator(std::move(state), size, rank, std::move(description));
}

int NcclCommunicator::device() const {
  return state_ ? state_->device : -1;
}

cudaStream_t NcclCommunicator::stream() const {
  return state_ ? state_->stream : nullptr;
}

namespace {

// Before enqueuing: the communicator is usable, its device is current, and what is queued
// on its stream next starts after the kernels queued on Kokkos' stream so far (ordering
// rule 1 at the top of this file; no fence).
State& begin(const std::shared_ptr<State>& state, const char* op) {
  MESHTRAIN_REQUIRE(state != nullptr, op, " on a moved-from NCCL communicator");
  state->require_usable(op);
  check_cuda(cudaSetDevice(state->device), op, state->description, "cudaSetDevice");
  state->order_after_kokkos(op);
  return *state;
}

// NCCL's element type for a wire dtype (its 16-bit sums add in fp32 and round per step).
ncclDataType_t nccl_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::bf16:
      return ncclBfloat16;
    case Dtype::fp16:
      return ncclFloat16;
    default:
      return ncclFloat;
  }
}

}  // namespace

void NcclCommunicator::raw_all_gather(const void* send, void* recv, std::size_t count_per_rank,
                                      Dtype dtype, const char* op) {
  State& s = begin(state_, op);
  if (count_per_rank == 0) return;
  checked_total(count_per_rank, size(), "all_gather receive buffer");
  require_device_buffer(s, send, op, "send");
  require_device_buffer(s, recv, op, "receive");
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.enqueued(ncclAllGather(send, recv, count_per_rank, nccl_type(dtype), s.comm, s.stream), op,
             "ncclAllGather", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

void NcclCommunicator::raw_reduce_scatter_sum(const void* send, void* recv,
                                              std::size_t count_per_rank, Dtype dtype,
                                              const char* op) {
  State& s = begin(state_, op);
  if (count_per_rank == 0) return;
  checked_total(count_per_rank, size(), "reduce_scatter send buffer");
  require_device_buffer(s, send, op, "send");
  require_device_buffer(s, recv, op, "receive");
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.enqueued(ncclReduceScatter(send, recv, count_per_rank, nccl_type(dtype), ncclSum, s.comm,
                               s.stream),
             op, "ncclReduceScatter", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

void NcclCommunicator::all_reduce_with(void* data, std::size_t count, Dtype dtype,
                                       ncclRedOp_t reduce, const char* op) {
  State& s = begin(state_, op);
  if (count == 0) return;
  require_device_buffer(s, data, op, "data");
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.enqueued(ncclAllReduce(data, data, count, nccl_type(dtype), reduce, s.comm, s.stream), op,
             "ncclAllReduce", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

void NcclCommunicator::raw_all_reduce_sum(void* data, std::size_t count, Dtype dtype,
                                          const char* op) {
  all_reduce_with(data, count, dtype, ncclSum, op);
}

void NcclCommunicator::raw_all_reduce_sum_f64(double* data, std::size_t count, const char* op) {
  State& s = begin(state_, op);
  if (count == 0) return;
  require_device_buffer(s, data, op, "data");
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.enqueued(ncclAllReduce(data, data, count, ncclFloat64, ncclSum, s.comm, s.stream), op,
             "ncclAllReduce", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

void NcclCommunicator::raw_broadcast(float* data, std::size_t count, int root, const char* op) {
  State& s = begin(state_, op);
  if (count == 0) return;
  require_device_buffer(s, data, op, "data");
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.enqueued(ncclBroadcast(data, data, count, ncclFloat, root, s.comm, s.stream), op,
             "ncclBroadcast", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

namespace {

// A started collective: the request (and its event) exists before `enqueue(deadline)`
// queues the collective on the stream; the event is recorded after it. A failure gives the
// request back to the pool (after an abort, nothing is left running).
template <class Enqueue>
Request start_with_event(const std::shared_ptr<State>& state, double timeout, const char* op,
                         Enqueue&& enqueue) {
  State& s = *state;
  const Clock::time_point deadline = deadline_after(timeout);
  NcclRequestSlot& pending = acquire_request_slot(state, timeout, op);
  struct GiveBackOnThrow {
    NcclRequestSlot* slot;
    ~GiveBackOnThrow() {
      if (slot != nullptr) slot->release();
    }
  } guard{&pending};
  enqueue(deadline);
  const cudaError_t recorded = cudaEventRecord(pending.event(), s.stream);
  if (recorded != cudaSuccess) {
    cudaGetLastError();
    s.fail_abort(std::string(op) + " on " + s.description +
                 ": cudaEventRecord failed: " + cuda_text(recorded));
  }
  guard.slot = nullptr;
  return Request(&pending);
}

}  // namespace

Request NcclCommunicator::raw_shift(const void* send, void* recv, std::size_t count, Dtype dtype,
                                    int offset, const char* op) {
  State& s = begin(state_, op);
  if (count == 0) return Request();
  checked_total(count, 1, "shift buffer");
  require_device_buffer(s, send, op, "send");
  require_device_buffer(s, recv, op, "receive");
  const int n = size();
  const int k = ((offset % n) + n) % n;
  const int to = (rank() + k) % n;
  const int from = (rank() - k + n) % n;
  return start_with_event(state_, timeout_seconds(), op, [&](Clock::time_point deadline) {
    if (k == 0) {
      check_cuda(
          cudaMemcpyAsync(recv, send, count * bytes_of(dtype), cudaMemcpyDeviceToDevice, s.stream),
          op, s.description, "cudaMemcpyAsync");
      return;
    }
    s.check_call(ncclGroupStart(), op, "ncclGroupStart");
    const ncclDataType_t type = nccl_type(dtype);
    const ncclResult_t sent = ncclSend(send, count, type, to, s.comm, s.stream);
    const ncclResult_t received =
        sent == ncclSuccess ? ncclRecv(recv, count, type, from, s.comm, s.stream) : sent;
    const ncclResult_t ended = ncclGroupEnd();  // closes the group even after an error
    s.check_call(sent, op, "ncclSend");
    s.check_call(received, op, "ncclRecv");
    s.enqueued(ended, op, "ncclGroupEnd", deadline, timeout_seconds());
  });
}

Request NcclCommunicator::raw_start_all_gather(const void* send, void* recv,
                                               std::size_t count_per_rank, Dtype dtype,
                                               const char* op) {
  State& s = begin(state_, op);
  if (count_per_rank == 0) return Request();
  checked_total(count_per_rank, size(), "all_gather receive buffer");
  require_device_buffer(s, send, op, "send");
  require_device_buffer(s, recv, op, "receive");
  const double timeout = timeout_seconds();
  return start_with_event(state_, timeout, op, [&](Clock::time_point deadline) {
    s.enqueued(ncclAllGather(send, recv, count_per_rank, nccl_type(dtype), s.comm, s.stream), op,
               "ncclAllGather", deadline, timeout);
  });
}

// As raw_start_all_gather: ncclAllReduce in place on the communicator's stream, then an
// event the Request polls. (Written by analogy; not compiled or run without CUDA.)
Request NcclCommunicator::raw_start_all_reduce_sum(void* data, std::size_t count, Dtype dtype,
                                                   const char* op) {
  State& s = begin(state_, op);
  if (count == 0) return Request();
  require_device_buffer(s, data, op, "data");
  const double timeout = timeout_seconds();
  return start_with_event(state_, timeout, op, [&](Clock::time_point deadline) {
    s.enqueued(ncclAllReduce(data, data, count, nccl_type(dtype), ncclSum, s.comm, s.stream), op,
               "ncclAllReduce", deadline, timeout);
  });
}

void NcclCommunicator::raw_all_to_all(const float* send, float* recv, std::size_t count_per_rank,
                                      const char* op) {
  State& s = begin(state_, op);
  if (count_per_rank == 0) return;
  checked_total(count_per_rank, size(), "all_to_all buffer");
  require_device_buffer(s, send, op, "send");
  require_device_buffer(s, recv, op, "receive");
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  // Block j of send goes to rank j, block j of recv comes from rank j: one group of
  // point-to-point calls, so NCCL schedules them together without deadlock.
  s.check_call(ncclGroupStart(), op, "ncclGroupStart");
  ncclResult_t failed = ncclSuccess;
  const char* failed_call = "";
  for (int j = 0; j < size() && failed == ncclSuccess; ++j) {
    const std::size_t at = static_cast<std::size_t>(j) * count_per_rank;
    failed = ncclSend(send + at, count_per_rank, ncclFloat, j, s.comm, s.stream);
    failed_call = "ncclSend";
    if (failed == ncclSuccess) {
      failed = ncclRecv(recv + at, count_per_rank, ncclFloat, j, s.comm, s.stream);
      failed_call = "ncclRecv";
    }
  }
  const ncclResult_t ended = ncclGroupEnd();  // closes the group even after an error
  s.check_call(failed, op, failed_call);
  s.enqueued(ended, op, "ncclGroupEnd", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

// Written by analogy with raw_all_to_all (not compiled or run without CUDA): one group of
// point-to-point calls, a send to rank j of send_counts[j] elements and a receive from it of
// recv_counts[j]. A zero count posts nothing: the counts agree pairwise (send_counts[j] here
// is recv_counts[i] on rank j), so the peer posts nothing either.
void NcclCommunicator::raw_all_to_all_v(const void* send, const std::size_t* send_counts,
                                        const std::size_t* send_offsets, void* recv,
                                        const std::size_t* recv_counts,
                                        const std::size_t* recv_offsets, Dtype dtype,
                                        const char* op) {
  State& s = begin(state_, op);
  const int n = size();
  const std::size_t element = bytes_of(dtype);
  bool sends = false, receives = false;
  for (int j = 0; j < n; ++j) {
    sends = sends || send_counts[j] > 0;
    receives = receives || recv_counts[j] > 0;
    // The byte offsets below cannot overflow.
    const std::size_t limit = SIZE_MAX / element;
    if (send_counts[j] > limit || send_offsets[j] > limit - send_counts[j] ||
        recv_counts[j] > limit || recv_offsets[j] > limit - recv_counts[j]) {
      MESHTRAIN_FAIL(op, " on ", s.description, ": the block of rank ", j,
                     " does not fit in the address space");
    }
  }
  if (!sends && !receives) return;
  if (sends) require_device_buffer(s, send, op, "send");
  if (receives) require_device_buffer(s, recv, op, "receive");
  const char* send_bytes = static_cast<const char*>(send);
  char* recv_bytes = static_cast<char*>(recv);
  const ncclDataType_t type = nccl_type(dtype);
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.check_call(ncclGroupStart(), op, "ncclGroupStart");
  ncclResult_t failed = ncclSuccess;
  const char* failed_call = "";
  for (int j = 0; j < n && failed == ncclSuccess; ++j) {
    if (send_counts[j] > 0) {
      failed = ncclSend(send_bytes + send_offsets[j] * element, send_counts[j], type, j, s.comm,
                        s.stream);
      failed_call = "ncclSend";
    }
    if (failed == ncclSuccess && recv_counts[j] > 0) {
      failed = ncclRecv(recv_bytes + recv_offsets[j] * element, recv_counts[j], type, j, s.comm,
                        s.stream);
      failed_call = "ncclRecv";
    }
  }
  const ncclResult_t ended = ncclGroupEnd();  // closes the group even after an error
  s.check_call(failed, op, failed_call);
  s.enqueued(ended, op, "ncclGroupEnd", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

void NcclCommunicator::raw_barrier(const char* op) {
  State& s = begin(state_, op);
  const double timeout = timeout_seconds();
  const Clock::time_point deadline = deadline_after(timeout);
  s.enqueued(ncclAllReduce(s.barrier_word, s.barrier_word, 1, ncclFloat, ncclSum, s.comm, s.stream),
             op, "ncclAllReduce", deadline, timeout);
  s.wait_for(nullptr, op, deadline, timeout);
}

// --------------------------------------------------------- device-buffer operations

void NcclCommunicator::all_gather_device(const float* send, float* recv,
                                         std::size_t count_per_rank) {
  const char* op = "all_gather";
  const std::size_t total = checked_total(count_per_rank, size(), "all_gather receive buffer");
  if (state_) require_disjoint(*state_, send, count_per_rank, recv, total, op);
  raw_all_gather(send, recv, count_per_rank, Dtype::fp32, op);
}

void NcclCommunicator::reduce_scatter_device(const float* send, float* recv,
                                             std::size_t count_per_rank) {
  const char* op = "reduce_scatter";
  const std::size_t total = checked_total(count_per_rank, size(), "reduce_scatter send buffer");
  if (state_) require_disjoint(*state_, send, total, recv, count_per_rank, op);
  raw_reduce_scatter_sum(send, recv, count_per_rank, Dtype::fp32, op);
}

void NcclCommunicator::all_reduce_device(float* data, std::size_t count, ReduceOp op) {
  all_reduce_with(data, count, Dtype::fp32, op == ReduceOp::mean ? ncclAvg : ncclSum,
                  "all_reduce");
}

void NcclCommunicator::broadcast_device(float* data, std::size_t count, int root) {
  if (root < 0 || root >= size()) {
    MESHTRAIN_BAD_INPUT("broadcast on ", description(), ": root ", root, " is not a rank of ",
                        size());
  }
  raw_broadcast(data, count, root, "broadcast");
}

Request NcclCommunicator::shift_device(const float* send, float* recv, std::size_t count,
                                       int offset) {
  const char* op = "shift";
  if (state_) require_disjoint(*state_, send, count, recv, count, op);
  return raw_shift(send, recv, count, Dtype::fp32, offset, op);
}

void NcclCommunicator::all_to_all_device(const float* send, float* recv,
                                         std::size_t count_per_rank) {
  const char* op = "all_to_all";
  const std::size_t total = checked_total(count_per_rank, size(), "all_to_all buffer");
  if (state_) require_disjoint(*state_, send, total, recv, total, op);
  raw_all_to_all(send, recv, count_per_rank, op);
}

}  // namespace meshtrain
