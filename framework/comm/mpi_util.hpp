#pragma once
// Checked MPI calls: every MPI return code goes through check_mpi, and every wait on a
// non-blocking MPI operation goes through wait_all_until, so no wait is without a deadline.

#include <mpi.h>

#include <cstdint>

#include <string>
#include <utility>
#include <vector>

namespace meshtrain {

namespace detail {
// sched_yield() for the first half second of a wait, then 200 us sleeps.
void pause_between_polls(double waited);
}  // namespace detail

// Throws a runtime Error "<what> failed: <MPI_Error_string>" when code is not MPI_SUCCESS.
void check_mpi(int code, const char* what);

// This rank's place among the ranks of `comm` on its node (those sharing memory with it,
// MPI_COMM_TYPE_SHARED): its index there and how many they are. Collective over `comm`.
struct NodePlace {
  int local_rank = 0;
  int local_size = 1;
};
NodePlace node_place(MPI_Comm comm);

// Rank 0's steady clock minus this rank's, in nanoseconds, estimated from one barrier: each
// rank reads its clock when the barrier lets it go (the error is the barrier's exit skew,
// microseconds on a node). For trace timestamps on one clock. Collective over `comm`.
int64_t clock_offset_to_rank0_ns(MPI_Comm comm);

// The ranks of `comm` as ranks of MPI_COMM_WORLD, in `comm`'s rank order (the flight
// recorder names ranks by them). Local: no communication.
std::vector<int> world_ranks_of(MPI_Comm comm);

// Polls `requests` until all complete (true) or `timeout` seconds pass (false; the
// requests still pending are left in the array). MPI_Testall also drives MPI's progress
// (non-blocking collectives advance only inside MPI calls), so it is called back to back,
// yielding the core in between as Open MPI's mpi_yield_when_idle does: short waits stay
// fast and oversubscribed ranks share cores. After half a second of waiting (a rank is
// late, latency no longer matters) it sleeps 200 us between polls. When MPI_Testall fails,
// `on_failure(code)` is called and must throw; the plain form throws through check_mpi,
// naming `op`. A timeout of 0 tests once.
template <class OnFailure>
bool wait_all_until(MPI_Request* requests, int count, double timeout, OnFailure&& on_failure) {
  const double start = MPI_Wtime();
  for (;;) {
    int done = 0;
    const int code = MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) on_failure(code);
    if (done) return true;
    const double waited = MPI_Wtime() - start;
    if (waited >= timeout) return false;
    detail::pause_between_polls(waited);
  }
}
bool wait_all_until(MPI_Request* requests, int count, double timeout, const char* op);

// Waits for `requests` under the collective timeout (MESHTRAIN_COLLECTIVE_TIMEOUT, default
// 300 s): a runtime Error naming `op` when they do not complete in time (a rank is dead or
// stalled; the job should then be aborted), or when MPI fails. The requests still pending
// stay in the array. What a blocking collective outside a Communicator (checkpoint
// agreement, broadcasts of a path) waits with.
void wait_collective(MPI_Request* requests, int count, const char* op);

// wait_collective for an operation on buffers that the caller's frame owns (vectors, a
// unique_ptr to a job holding them). When the wait throws (a rank is dead or late) MPI may
// still read or write them after that frame is gone (a late rank completes the transfer),
// so `owners` are moved to the heap and given up (leaked on purpose) before the error goes
// on. Moving a vector or a unique_ptr keeps its storage where MPI was told it is.
template <class... Owners>
void wait_collective_or_give_up(MPI_Request* requests, int count, const char* op,
                                Owners&... owners) {
  try {
    wait_collective(requests, count, op);
  } catch (...) {
    (static_cast<void>(new Owners(std::move(owners))), ...);
    throw;
  }
}

// Collectives outside a Communicator (agreements at set-up, broadcasts of a path or of
// offsets), each waited for under the collective timeout through a heap copy of `data` that
// is given up when the wait fails: a dead or stalled rank can neither hang them nor write
// into the caller's memory once they have thrown.
// MPI_Ibcast of `count` items of `type` from `root`.
void broadcast_collective(void* data, int count, MPI_Datatype type, int root, MPI_Comm comm,
                          const char* op);
// MPI_Iallreduce of `count` items of `type` with `reduction`, in place. `buffer`, when
// given, is the heap copy: kept by the caller and grown only when too small, so a reduction
// repeated in a loop allocates nothing after the first.
void all_reduce_collective(void* data, int count, MPI_Datatype type, MPI_Op reduction,
                           MPI_Comm comm, const char* op);
void all_reduce_collective(void* data, int count, MPI_Datatype type, MPI_Op reduction,
                           MPI_Comm comm, const char* op, std::vector<char>& buffer);
// `root`'s text on every rank of `comm` (its length, then its bytes).
void broadcast_string(std::string& text, int root, MPI_Comm comm, const char* op);

}  // namespace meshtrain
