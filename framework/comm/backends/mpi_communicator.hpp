#pragma once
// The MPI backend of Communicator. Every operation is non-blocking MPI (MPI_Iallgather,
// MPI_Iallreduce, ...) completed by polling MPI_Testall against the communicator's
// deadline, so a rank that never joins turns into an Error instead of a hang. Errors carry
// MPI_Error_string; the communicator is set to MPI_ERRORS_RETURN. While the communication
// thread runs ([runtime] comm_thread, framework/comm/progress_thread.hpp), the started
// operations (shift, start_all_gather, start_all_reduce) are tested by it until their wait().
//
// After a timeout the communicator is broken: the abandoned MPI request may still write
// into the caller's buffer when the late rank arrives, so every later operation on it
// throws. The same holds when a shift's send fails to start and its already posted
// receive cannot be cancelled within the timeout. The usual reaction to the Error is to
// abort the job (framework/comm/exit_policy.hpp).
//
// Memory: MPI gets the caller's buffers when Kokkos' memory is host memory. With device
// memory (a CUDA Kokkos) every operation stages through pinned host buffers
// (host_staging.hpp), because the MPI meshtrain is built with need not be CUDA-aware; so
// several ranks can share one GPU with this backend.

#include <mpi.h>

#include <memory>
#include <string>

#include "framework/comm/communicator.hpp"

namespace meshtrain {

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` when it returns (freed when the last user is gone; never
  // MPI_COMM_WORLD or MPI_COMM_SELF, which are not freed); when it throws, `comm` is still
  // the caller's. `description` names the group in errors.
  static MpiCommunicator adopt(MPI_Comm comm, std::string description);
  // A private duplicate of `comm` (so its traffic never mixes with the caller's).
  static MpiCommunicator duplicate(MPI_Comm comm, std::string description);

  MpiCommunicator(MpiCommunicator&&) = default;
  MpiCommunicator& operator=(MpiCommunicator&&) = default;
  ~MpiCommunicator() override = default;

  // Shared with pending requests: the MPI_Comm, its name, a broken flag, and the pool of
  // shift requests (reused, so shifts allocate nothing in steady state).
  struct State;

 protected:
  void raw_all_gather(const void* send, void* recv, std::size_t count_per_rank, Dtype dtype,
                      const char* op) override;
  void raw_reduce_scatter_sum(const void* send, void* recv, std::size_t count_per_rank, Dtype dtype,
                              const char* op) override;
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
  void raw_reserve_staging(std::size_t send_bytes, std::size_t recv_bytes) override;
  void raw_reserve_requests(std::size_t count, std::size_t send_bytes,
                            std::size_t recv_bytes) override;
  void raw_reserve_reductions(std::size_t elements, Dtype dtype) override;
  void raw_reserve_started_all_reduces(std::size_t count, std::size_t elements,
                                       Dtype dtype) override;

 private:
  MpiCommunicator(std::shared_ptr<State> state, int size, int rank, std::string description);
  // Waits for `request` until the timeout; throws naming `op` and breaks the communicator
  // on a timeout or a failed completion.
  void complete(MPI_Request request, const char* op);
  // The shape of every blocking operation: check the communicator is usable, let pending
  // kernels finish, start one non-blocking MPI call (`start` gets the request to fill and
  // returns the MPI code of `call`), then wait for it under the timeout.
  template <class Start>
  void run(const char* op, const char* call, Start&& start);
  // An in-place sum in pieces whose counts each fit an int (any total count).
  template <class T>
  void all_reduce_in_pieces(T* data, std::size_t count, MPI_Datatype type, MPI_Op sum,
                            const char* op);

  // Whether a started all-reduce of `count` elements of `dtype` runs the ring (the reduction
  // choice's all_reduce_ring_from, as for the blocking all-reduce).
  bool uses_started_ring(std::size_t count, Dtype dtype) const;

  std::shared_ptr<State> state_;
};

// The MPI backend as a CommunicatorFactory (mesh_communicators.hpp): adopts `group`.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm group, const std::string& description);

}  // namespace meshtrain
