// The NCCL backend's started operations (shift, start_all_gather, start_all_reduce): a
// pooled Request::Impl per operation in flight, completed through an event on the NCCL
// stream (ordering rule 3, nccl_state.hpp).

#include "framework/comm/backends/nccl_state.hpp"

namespace meshtrain {
namespace nccl_detail {

NcclRequestSlot::~NcclRequestSlot() {
  if (event_ != nullptr) cudaEventDestroy(event_);  // the state has made its device current
}

void NcclRequestSlot::start(std::shared_ptr<State> state, double timeout, const char* op) {
  if (event_ == nullptr) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), op, owner_.description,
               "cudaEventCreateWithFlags");
  }
  state_ = std::move(state);
  timeout_ = timeout;
  op_ = op;
  done_ = false;
}

bool NcclRequestSlot::test() {
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

void NcclRequestSlot::wait() {
  if (done_) return;
  owner_.require_usable(op_);
  check_cuda(cudaSetDevice(owner_.device), op_, owner_.description, "cudaSetDevice");
  owner_.wait_for(event_, op_, deadline_after(timeout_), timeout_);
  owner_.order_kokkos_after(event_, op_);  // before the caller touches the buffers
  done_ = true;
}

void NcclRequestSlot::release() noexcept {
  owner_.request_slots.release(*this);  // keeps its event for the next operation
  // Last: when this was the last reference to the state, the state (and this slot) go.
  std::shared_ptr<State> keep = std::move(state_);
}

NcclRequestSlot& acquire_request_slot(const std::shared_ptr<State>& state, double timeout,
                                      const char* op) {
  NcclRequestSlot& slot = state->request_slots.acquire(
      SlotCapacity{}, [&] { return std::make_unique<NcclRequestSlot>(*state); });
  try {
    slot.start(state, timeout, op);  // may throw (no event): the slot goes back
  } catch (...) {
    state->request_slots.release(slot);
    throw;
  }
  return slot;
}

}  // namespace nccl_detail
}  // namespace meshtrain
