#pragma once
// The NCCL backend of Communicator (compiled only when CUDA and NCCL are found, with
// MESHTRAIN_HAVE_NCCL=1; include this header only under `#if MESHTRAIN_HAVE_NCCL`).
//
// One NcclCommunicator is one NCCL communicator over the ranks of an MPI group, on the
// CUDA device that is current when it is built (select_cuda_device picks one per local
// rank). Every operation is enqueued on the NCCL stream of that device (one CUDA stream
// shared by all NCCL communicators of the process) and then polled (cudaStreamQuery /
// cudaEventQuery and ncclCommGetAsyncError) until it completes or timeout_seconds() pass;
// on a timeout or an asynchronous NCCL error the NCCL communicator is aborted
// (ncclCommAbort) and an Error naming the operation and the group is thrown; every later
// operation on it throws. The communicator is created in NCCL's non-blocking mode, so its
// set-up and every NCCL call are bounded by the same deadline instead of hanging on a rank
// that never joins.
//
// Memory: NCCL moves device memory only. The View operations of Communicator pass
// their Views' pointers straight to NCCL, so they work when Kokkos' default memory space
// is CUDA device (or managed) memory, i.e. with a CUDA-enabled Kokkos. With a host-only
// Kokkos (Debian's Serial build) every View operation fails with a bad_input Error saying
// that the NCCL backend needs device memory; nothing is staged through host copies
// behind the caller's back. Code that owns CUDA buffers calls the *_device functions
// below with device pointers; they work with any Kokkos.
//
// Ordering (the rules are at the top of nccl_state.hpp): an operation starts after
// the kernels already queued on Kokkos' stream (a CUDA event, no fence: operations other
// communicators have started keep running) and, since the stream is a blocking CUDA
// stream, after work already queued on the legacy default stream. A Request's completion
// (wait() or a true test()) also orders Kokkos' stream after the transfer. Work on other
// non-blocking streams that writes a send buffer must be synchronized by the caller.
// Operations of all communicators of a device run one after another on the shared NCCL
// stream, in the order this process issued them: NCCL's kernels of two groups are never in
// flight together, which NCCL documents as a deadlock risk; every rank of a group must issue
// the group's operations in the same order (the SPMD program does), as with MPI.

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>

#include "framework/comm/communicator.hpp"

namespace meshtrain {

// Number of usable CUDA devices; 0 (with the reason in `why`, when given) without a driver or
// a device. Never throws.
int cuda_device_count(std::string* why = nullptr);

// True when at least one CUDA device can be used (cudaGetDeviceCount > 0). Never throws:
// without a driver or a device it returns false.
bool nccl_device_available() noexcept;

// Collective over `comm` (MPI_COMM_WORLD in a program): the ranks of `comm` on one node
// are numbered 0, 1, ... and local rank l makes device (l % device count) current. With a
// CUDA-enabled Kokkos already initialized it makes Kokkos' device current instead, so
// Views live on the communicator's device. Returns the device. Throws a runtime Error
// when no CUDA device can be used. Call it once per process, after Kokkos::initialize and
// before building NCCL communicators.
int select_cuda_device(MPI_Comm comm);

// The factory for MeshCommunicators (a CommunicatorFactory): an NcclCommunicator over
// `group` on the current CUDA device. Takes ownership of `group` when it returns (freed
// once NCCL is set up; never MPI_COMM_WORLD or MPI_COMM_SELF); when it throws, `group` is
// still the caller's. Collective over `group`.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group,
                                                     const std::string& description);

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `group`: rank 0 of the group calls ncclGetUniqueId, MPI broadcasts
  // it, every rank joins ncclCommInitRankConfig on the current CUDA device. `group` is only
  // used here (not owned, not kept). `description` names the group in errors. Throws a
  // runtime Error when there is no CUDA device or NCCL set-up fails or times out.
  static NcclCommunicator create(MPI_Comm group, std::string description);

  NcclCommunicator(NcclCommunicator&&) = default;
  NcclCommunicator& operator=(NcclCommunicator&&) = default;
  // Finalizes and destroys the NCCL communicator (aborting it if that does not finish
  // within the timeout) and destroys the stream. A pending shift keeps them alive.
  ~NcclCommunicator() override;

  int device() const;           // the CUDA device of this communicator
  // The stream every operation runs on: the NCCL stream of device(), shared by every NCCL
  // communicator of the process on that device (not owned by this one).
  cudaStream_t stream() const;

  // --- device-buffer operations: the same semantics as the View operations of the same
  // name on flat buffers, for pointers to CUDA device (or managed) memory of device().
  // Host pointers are a bad_input Error. Each returns when the result can be read.
  void all_gather_device(const float* send, float* recv, std::size_t count_per_rank);
  void reduce_scatter_device(const float* send, float* recv, std::size_t count_per_rank);
  // In place; mean is NCCL's ncclAvg.
  void all_reduce_device(float* data, std::size_t count, ReduceOp op = ReduceOp::sum);
  void broadcast_device(float* data, std::size_t count, int root);
  // Non-blocking: the Request completes when both the send and the receive are done.
  Request shift_device(const float* send, float* recv, std::size_t count, int offset);
  // send and recv hold size() blocks of count_per_rank floats each.
  void all_to_all_device(const float* send, float* recv, std::size_t count_per_rank);

  // Shared with pending requests: comm, stream, device, broken flag, and the pool of started
  // operations and their events (reused, so they allocate nothing in steady state).
  // Defined in nccl_state.hpp.
  struct State;

 protected:
  void raw_all_gather(const void* send, void* recv, std::size_t count_per_rank, Dtype dtype,
                      const char* op) override;
  void raw_reduce_scatter_sum(const void* send, void* recv, std::size_t count_per_rank,
                              Dtype dtype, const char* op) override;
  void raw_all_reduce_sum(void* data, std::size_t count, Dtype dtype, const char* op) override;
  void raw_all_reduce_sum_f64(double* data, std::size_t count, const char* op) override;
  void raw_broadcast(float* data, std::size_t count, int root, const char* op) override;
  Request raw_shift(const void* send, void* recv, std::size_t count, Dtype dtype, int offset,
                    const char* op) override;
  Request raw_start_all_gather(const void* send, void* recv, std::size_t count_per_rank,
                               Dtype dtype, const char* op) override;
  Request raw_start_all_reduce_sum(void* data, std::size_t count, Dtype dtype,
                                   const char* op) override;
  void raw_all_to_all(const float* send, float* recv, std::size_t count_per_rank,
                      const char* op) override;
  void raw_all_to_all_v(const void* send, const std::size_t* send_counts,
                        const std::size_t* send_offsets, void* recv, const std::size_t* recv_counts,
                        const std::size_t* recv_offsets, Dtype dtype, const char* op) override;
  void raw_barrier(const char* op) override;
  void raw_reserve_requests(std::size_t count, std::size_t send_bytes,
                            std::size_t recv_bytes) override;

 private:
  NcclCommunicator(std::shared_ptr<State> state, int size, int rank, std::string description);
  void all_reduce_with(void* data, std::size_t count, Dtype dtype, ncclRedOp_t reduce,
                       const char* op);

  std::shared_ptr<State> state_;
};

}  // namespace meshtrain
