// The NCCL backend's operations: each checks its buffers, orders itself after Kokkos'
// stream, enqueues on the NCCL stream and completes under the deadline (the rules are in
// nccl_state.hpp; set-up in nccl_bootstrap.cpp, started operations in nccl_requests.cpp).

#include <cstdint>
#include <memory>
#include <string>

#include "framework/comm/backends/nccl_state.hpp"

namespace meshtrain {

using nccl_detail::check_cuda;
using nccl_detail::Clock;
using nccl_detail::cuda_text;
using nccl_detail::deadline_after;
using nccl_detail::start_with_event;
using State = NcclCommunicator::State;

namespace {

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

// Before enqueuing: the communicator is usable, its device is current, and what is queued
// on its stream next starts after the kernels queued on Kokkos' stream so far (ordering
// rule 1, nccl_state.hpp; no fence).
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

// As raw_start_all_gather: ncclAllReduce in place on the NCCL stream, then an event the
// Request polls. (Compiled wherever CUDA and NCCL are found; not yet run on a GPU.)
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

// As raw_all_to_all (compiled wherever CUDA and NCCL are found; not yet run on a GPU): one
// group of point-to-point calls, a send to rank j of send_counts[j] elements and a receive
// from it of recv_counts[j]. A zero count posts nothing: the counts agree pairwise (send_counts[j] here
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

// Slots hold only their event (made on first use, not a host allocation of the step's):
// made now, so that the pool does not grow in a step.
void NcclCommunicator::raw_reserve_requests(std::size_t count, std::size_t /*send_bytes*/,
                                            std::size_t /*recv_bytes*/) {
  state_->request_slots.reserve(
      count, [&] { return std::make_unique<nccl_detail::NcclRequestSlot>(*state_); },
      [](nccl_detail::NcclRequestSlot&) {});
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
