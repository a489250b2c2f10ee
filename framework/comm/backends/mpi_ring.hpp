#pragma once
// meshtrain's own ring reduce-scatter and all-reduce over MPI point-to-point messages, for
// the MPI backend ([runtime] reductions = "ring", or "auto" where it measured faster; see
// docs/communication.md). Open MPI's reduce-scatter runs several times below what the memory
// allows (issue 29: 52-84 ms for 80 MB on 2 ranks, where a ring takes 13-15 ms).
//
// Algorithm, for a group of n ranks, this rank r, the data split into n blocks:
//   reduce-scatter: n - 1 steps; at step s rank r sends its partial sum of block
//     (r - 1 - s) mod n to rank r + 1 and receives the partial sum of block (r - 2 - s) mod n
//     from rank r - 1, adds its own contribution and passes that on at the next step. After
//     the last step rank r holds the full sum of block r.
//   all-reduce: the reduce-scatter over blocks of ceil/floor(count / n) elements (the first
//     count mod n blocks one longer), then an all-gather of the summed blocks in place (plain
//     copies: every rank ends with the same bits): the library's MPI_Iallgatherv where the
//     byte offsets fit an int (measured faster than a ring of copies on shared memory), else
//     (or with env MESHTRAIN_RING_ALL_GATHER=ring) a ring of n - 1 steps.
// Summation order (deterministic, the same in every run): the sum of block b starts at rank
// (b + 1) mod n and proceeds around the ring: ((x[b+1] + x[b+2]) + x[b+3]) + ... + x[b], each
// addition in fp32. With a 16-bit wire (bf16, fp16) the partial sums travel as 16-bit values
// and each is rounded once per hop, as with MPI's 16-bit user operation and NCCL: a block's
// sum is rounded n - 1 times (for n = 1, never).
// Pipelining: each step's message is cut into segments of kRingSegmentBytes; all of a step's
// receives and sends are posted at once, and segment k is added while segments k + 1, ...
// are still moving. Every MPI count is at most one segment, so any total count (beyond 2^31
// elements too) is safe.
// Memory: the caller's buffers are host memory (the backend stages device memory through the
// host first, as for its other operations). The ring keeps two partial-sum buffers of one
// block each and its MPI requests in RingScratch, reserved when the model is built
// (Communicator::reserve_reductions) or grown on first use, and kept: repeated calls up to the
// same size allocate nothing.
// Waiting: every wait polls the MPI requests (mpi_util.hpp wait_all_until) for at most the
// communicator's timeout; when it passes, or MPI fails, the backend's RingFailure abandons
// the live requests and throws, as the MPI library path does.

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <vector>

#include "base/dtype.hpp"

namespace meshtrain {

// Bytes per message segment (tunable: 1 MiB measured best on a shared-memory node).
constexpr std::size_t kRingSegmentBytes = std::size_t{1} << 20;

// The ring's buffers between calls (owned by the backend's communicator state).
class RingScratch {
 public:
  // Grows `buffers` (1 or 2) partial-sum buffers to `block_bytes` each and the request array
  // to what blocks of that size need, so that later calls up to this size allocate nothing.
  // A group of 2 needs one buffer, larger groups two.
  void reserve(std::size_t block_bytes, int buffers = 2);
  char* partial(int which) { return partial_[which].data(); }
  MPI_Request* requests() { return requests_.data(); }
  std::vector<int>& gather_layout() { return gather_layout_; }
  std::size_t block_capacity() const { return partial_[0].extent(0); }

 private:
  Kokkos::View<char*, Kokkos::HostSpace> partial_[2];
  std::vector<MPI_Request> requests_;
  std::vector<int> gather_layout_;  // MPI_Iallgatherv's counts and displacements
};

// What the ring cannot recover from, handled by the backend that owns the communicator's
// state: both abandon the requests still live in `live` (they may yet touch the buffers) and
// mark the communicator unusable before they throw.
class RingFailure {
 public:
  // A wait passed the timeout (a rank did not join).
  [[noreturn]] virtual void timed_out(MPI_Request* live, int count) = 0;
  // An MPI call returned `code`.
  [[noreturn]] virtual void failed(int code, const char* call, MPI_Request* live, int count) = 0;

 protected:
  ~RingFailure() = default;
};

// The group the ring runs on.
struct RingLink {
  MPI_Comm comm;
  int size;
  int rank;
  double timeout_seconds;  // per wait
  RingScratch& scratch;
  RingFailure& failure;
};

// Tiled reduce-scatter with sum: `send` holds size blocks of `count_per_rank` elements of
// `dtype` (fp32: float; bf16, fp16: their bits), `recv` gets the sum of block `rank`. Host
// memory; send and recv do not overlap.
void ring_reduce_scatter(const RingLink& link, const void* send, void* recv,
                         std::size_t count_per_rank, Dtype dtype);
// In-place sum of `count` elements over the group; every rank ends with the same bits.
void ring_all_reduce(const RingLink& link, void* data, std::size_t count, Dtype dtype);

// A started (non-blocking) ring all-reduce: the blocks, steps, segments and summation order
// of ring_all_reduce, so the same bits, advanced by progress(), which never blocks. The
// all-gather is always the ring of copies: a library collective begun when this rank's
// reduce-scatter happens to finish could be matched against another rank's collectives in
// a different order.
// Steps: [0, n - 1) the reduce-scatter's, [n - 1, 2n - 2) the all-gather's. A step posts all
// its receives and sends at once; progress() adds each arrived segment of a reduce-scatter
// step in order (MPI_Test per segment), and the next step is posted once every request of
// the step has completed (its sends too: the next step reuses their buffers).
// Tags: every message of one operation carries its `tag`; within one operation the steps of
// a rank follow each other, so MPI's in-order matching pairs the segments. Two operations in
// flight on one rank of a communicator need different tags (the backend numbers them, and
// completes the operation holding a tag before it hands the tag out again).
// Memory: the partial-sum buffers and the requests, per operation (two may run at once),
// grown by reserve() (or the first start() of a larger size) and kept.
// Threads: one thread at a time (the caller's, or the communication thread it was handed to).
class StartedRingAllReduce {
 public:
  // Grows the buffers to what an all-reduce of `count` elements of `dtype` on `size` ranks
  // needs (nothing for one rank).
  void reserve(std::size_t count, Dtype dtype, int size);
  // Bytes of one partial-sum buffer held now.
  std::size_t partial_capacity() const { return partial_[0].extent(0); }

  // Readies an all-reduce of `count` elements of `dtype` in place in `data` (host memory) on
  // `comm` (this rank `rank` of `size`); posts nothing yet. Grows the buffers if needed.
  void start(MPI_Comm comm, int size, int rank, int tag, void* data, std::size_t count,
             Dtype dtype);
  // Advances without blocking: posts steps, adds arrived segments. Returns MPI_SUCCESS (then
  // complete() says whether it is done) or the code of the MPI call that failed (named by
  // failed_call()); the requests still live are then in live_requests().
  int progress() noexcept;
  bool complete() const { return step_ == steps_; }
  const char* failed_call() const { return failed_call_; }
  // The current step's requests (MPI_REQUEST_NULL where done): what a timeout or a failure
  // abandons.
  MPI_Request* live_requests() { return requests_.data(); }
  int live_count() const { return posted_ ? total_ : 0; }

 private:
  int post() noexcept;
  void step_buffers(char*& recv_into, std::size_t& recv_bytes, const char*& send_from,
                    std::size_t& send_bytes) const;

  Kokkos::View<char*, Kokkos::HostSpace> partial_[2];
  std::vector<MPI_Request> requests_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int size_ = 1, rank_ = 0, tag_ = 0;
  char* data_ = nullptr;
  std::size_t base_ = 0, extra_ = 0;  // the blocks, as ring_all_reduce's
  Dtype dtype_ = Dtype::fp32;
  int steps_ = 0;  // 2n - 2, or 0 when there is nothing to do
  int step_ = 0;
  bool posted_ = false;  // the current step's messages are posted
  int receives_ = 0, total_ = 0, next_add_ = 0;
  const char* failed_call_ = "";
};

// Env MESHTRAIN_RING_ALL_GATHER: "ring" -> true (the all-reduce's all-gather as a ring of
// copies), unset, empty or "library" -> false (MPI_Iallgatherv); bad_input otherwise. Read at
// every all-reduce (no allocation).
bool ring_all_gather_from_env();

}  // namespace meshtrain
