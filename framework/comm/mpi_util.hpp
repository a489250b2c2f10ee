#pragma once
// Checked MPI calls: every MPI return code goes through check_mpi, and every wait on a
// non-blocking MPI operation goes through wait_all_until, so no wait is without a deadline.

#include <mpi.h>

#include <string>

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

// MPI_Ibcast of `count` items of `type` from `root`, waited for with wait_collective: a
// broadcast outside a Communicator that a dead or stalled rank cannot hang.
void broadcast_collective(void* data, int count, MPI_Datatype type, int root, MPI_Comm comm,
                          const char* op);
// `root`'s text on every rank of `comm` (its length, then its bytes), the same way.
void broadcast_string(std::string& text, int root, MPI_Comm comm, const char* op);

}  // namespace meshtrain
