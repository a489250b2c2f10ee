#pragma once
// The NCCL backend's inside, shared by its four files (built only with MESHTRAIN_HAVE_NCCL):
//   nccl_state.cpp         error state (abort, timeouts, polling) and the ordering rules
//   nccl_requests.cpp      the pool of started operations (Request::Impl) and their events
//   nccl_bootstrap.cpp     devices, the NCCL id, communicator set-up and destruction
//   nccl_communicator.cpp  the operations
// Not part of the public interface: include nccl_communicator.hpp.
//
// Ordering rules. "Kokkos' stream" is the stream of Kokkos' default CUDA instance, where
// meshtrain's kernels and cuBLAS run; "the NCCL stream" is the one CUDA stream per device
// on which every NCCL communicator of this process enqueues (rule 7). No operation fences
// the device: a device-wide synchronize would also wait for the operations started before
// (serializing the FSDP prefetch and the DP buckets with everything else) and could hang,
// outside the deadline, on an operation whose peer is gone.
//  1. Inputs and buffer reuse: begin() records the state's event `kokkos_ready` on Kokkos'
//     stream and makes the NCCL stream wait for it (cudaStreamWaitEvent; the host does not
//     wait). Every NCCL call, copy and event record of the operation is queued after that,
//     so it runs after every kernel queued before the operation began: those that wrote its
//     send buffers, and those still reading a buffer it overwrites (the prefetch landing
//     buffer that held the last layer's weight, a ring step's old block).
//  2. Blocking operations return after the host has seen the NCCL stream idle (wait_for
//     polls cudaStreamQuery and NCCL's errors under the deadline): the results are
//     complete, and kernels queued afterwards may read them and reuse the buffers.
//  3. Started operations (Request): an event recorded on the NCCL stream after the
//     operation is polled by test() and waited for under the deadline by wait(); once it has
//     completed, both make Kokkos' stream wait for it before they report completion, so
//     kernels that read the received data or overwrite the buffers are queued after the
//     transfer. Until then the caller must not touch the operation's buffers.
//  4. CUDA objects are made once: `kokkos_ready` with the communicator, a Request's event
//     with its pooled slot (reused after). The steady state makes no CUDA object.
//  5. Other streams: the NCCL stream is a blocking stream, so work queued on the legacy
//     default stream before an operation runs before it; work on other non-blocking
//     streams (e.g. the caller's, for the *_device functions) is the caller's to order.
//  6. No CUDA Kokkos (host kernels), or Kokkos on another device than the communicator
//     (only possible through the *_device functions; an event cannot be recorded across
//     devices): begin() fences Kokkos' default instance, never the whole device.
//  7. One NCCL stream per device for all communicators. NCCL's kernels block while they
//     wait for their peers, and NCCL documents that operations of different communicators
//     in flight together on one device can deadlock (one kernel occupying what another
//     needs to make progress, or a CUDA call inside NCCL synchronizing the device) unless
//     they are serialized in the same order on every rank. Every communicator of a device
//     therefore enqueues on one shared stream (shared_nccl_stream()): the device runs this
//     process's NCCL operations one after another, in the order the host issued them (the
//     host's order is the stream's: enqueued() returns once a call is on the stream).
//     Why that cannot deadlock: number the communication calls of the program 0, 1, 2,
//     ... (the same numbering on every rank, since every rank runs the same program: the
//     same layers, buckets and prefetches in the same order; a call that moves nothing on
//     one rank, such as an all_to_all_v with nothing to send or receive, enqueues nothing
//     there and nothing waits for it). The kernel of call i waits only for the kernels of
//     earlier calls on its own stream, for Kokkos' kernels queued before it (which wait
//     only for transfers already seen complete, rule 3) and for the kernels of call i on
//     its peers; by induction on i, every kernel completes. What overlaps is communication
//     with computation (Kokkos' stream); an FSDP prefetch and a DP bucket of two groups run
//     one after the other on the links rather than together. What remains the program's
//     duty (as with MPI): every rank of a group issues the group's operations in the same
//     order, from one thread.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "framework/comm/backends/nccl_communicator.hpp"
#include "framework/comm/slot_pool.hpp"

namespace meshtrain {
namespace nccl_detail {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds);
// Spin briefly, then leave the core to others (ranks may share cores with the host code).
void pause_poll(long polls);
std::string seconds_text(double seconds);
std::string cuda_text(cudaError_t code);
// NCCL's result string plus its last-error detail, which names the actual cause.
std::string nccl_text(ncclResult_t code, ncclComm_t comm);

// Set-up calls: throws "<what> failed: <CUDA error>" unless code is cudaSuccess.
void check_cuda(cudaError_t code, const std::string& what);
// Calls inside operations: "<op> on <group>: <call> failed: ...", the text built only on
// failure, so the success path allocates nothing.
void check_cuda(cudaError_t code, const char* op, const std::string& group, const char* call);

// Kokkos' stream (its default instance's, where meshtrain's kernels and cuBLAS run) when
// Kokkos is initialized, runs on CUDA by default and on `device`; false otherwise.
bool kokkos_stream_on(int device, cudaStream_t* stream);

// The NCCL stream of `device` (ordering rule 7): made by the first communicator of the
// device, shared by all of this process's, destroyed with the last. Call with `device`
// current. Throws a runtime Error naming `description` when the stream cannot be made.
std::shared_ptr<CUstream_st> shared_nccl_stream(int device, const std::string& description);

class NcclRequestSlot;

}  // namespace nccl_detail

// One NCCL communicator's state, shared with its pending Requests (which keep it alive
// after the NcclCommunicator is gone): the NCCL communicator, the NCCL stream, the error
// state, and the pool of started operations.
struct NcclCommunicator::State {
  using Clock = nccl_detail::Clock;

  ncclComm_t comm = nullptr;
  std::shared_ptr<CUstream_st> shared_stream;  // the device's NCCL stream (rule 7)
  cudaStream_t stream = nullptr;               // shared_stream.get()
  int device = -1;
  float* barrier_word = nullptr;  // one device float all-reduced by barrier()
  // Recorded on Kokkos' stream at the start of every operation, then waited for by
  // `stream` (ordering rule 1). Made once, at set-up.
  cudaEvent_t kokkos_ready = nullptr;
  std::string description;
  std::string broken;  // non-empty after an abort: why the communicator is unusable
  double destroy_timeout = 300.0;
  // The started operations (nccl_requests.cpp); every slot alike, so the slot freed last is
  // reused. A slot in use holds a reference to this state.
  SlotPool<nccl_detail::NcclRequestSlot> request_slots;

  State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Finalizes the NCCL communicator (aborting it when that does not finish within
  // destroy_timeout) and frees what the state made (nccl_bootstrap.cpp).
  ~State();

  void require_usable(const char* op) const;
  // Aborts the NCCL communicator (stopping its kernels) and marks this state unusable.
  // Only called on the way to an Error, which already says what went wrong, so abort's own
  // result is not reported.
  void abort(const std::string& why);
  [[noreturn]] void fail_abort(const std::string& message);
  [[noreturn]] void fail_timeout(const char* op, double timeout);
  // Throws (after aborting) when NCCL reports an asynchronous error; true while NCCL is
  // still working on the last call (ncclInProgress).
  bool nccl_in_progress(const char* op);
  // An NCCL call inside a group (or ncclGroupStart): errors abort and throw.
  void check_call(ncclResult_t code, const char* op, const char* call);
  // Handles the return code of an NCCL call in non-blocking mode: errors abort and throw;
  // ncclInProgress is polled until NCCL has finished the call (connections to peers are
  // set up here, so the deadline applies). Once it returns, the call is on the stream:
  // the host's issue order is the stream's order (rule 7).
  void enqueued(ncclResult_t code, const char* op, const char* call, Clock::time_point deadline,
                double timeout);
  // Polls until `event` (the whole stream when null) has completed, NCCL reports an error
  // or the deadline passes.
  void wait_for(cudaEvent_t event, const char* op, Clock::time_point deadline, double timeout);
  // Rule 1: what is queued on `stream` next starts after the work queued on Kokkos' stream
  // so far. No host wait. The device must be current.
  void order_after_kokkos(const char* op);
  // Rule 3: what is queued on Kokkos' stream next starts after `event` (recorded on
  // `stream` after a started operation). The device must be current.
  void order_kokkos_after(cudaEvent_t event, const char* op);
};

namespace nccl_detail {

using State = NcclCommunicator::State;

// A started operation: an event recorded on the NCCL stream after it. Pooled in State:
// acquire_request_slot() takes a free slot (or makes one when all are in flight),
// Request::Impl::release() gives it back. The event is made with the slot and kept.
class NcclRequestSlot final : public Request::Impl {
 public:
  explicit NcclRequestSlot(State& owner) : owner_(owner) {}
  ~NcclRequestSlot() override;

  SlotCapacity capacity() const { return {}; }  // no buffers: every slot fits
  // Readies a free slot for one operation (making its event the first time; throws when
  // that fails); `state` is the owner, kept alive while in use.
  void start(std::shared_ptr<State> state, double timeout, const char* op);
  cudaEvent_t event() const { return event_; }

  bool test() override;
  void wait() override;
  void release() noexcept override;

 private:
  State& owner_;
  std::shared_ptr<State> state_;  // set while in use
  cudaEvent_t event_ = nullptr;   // made once, destroyed with the slot
  double timeout_ = 0.0;
  const char* op_ = "shift";
  bool done_ = false;
};

// A free slot of `state`'s pool, started for `op`; on failure the pool is unchanged.
NcclRequestSlot& acquire_request_slot(const std::shared_ptr<State>& state, double timeout,
                                      const char* op);

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

}  // namespace nccl_detail
}  // namespace meshtrain
