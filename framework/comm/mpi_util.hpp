#pragma once
// Checked MPI calls: every MPI return code goes through check_mpi, and every wait on a
// non-blocking MPI operation goes through wait_all_until, so no wait is without a deadline.

#include <mpi.h>

namespace meshtrain {

// Throws a runtime Error "<what> failed: <MPI_Error_string>" when code is not MPI_SUCCESS.
void check_mpi(int code, const char* what);

// Polls `requests` until all complete (true) or `timeout` seconds pass (false; the
// requests still pending are left in the array). MPI_Testall also drives MPI's progress
// (non-blocking collectives advance only inside MPI calls), so it is called back to back,
// yielding the core in between as Open MPI's mpi_yield_when_idle does: short waits stay
// fast and oversubscribed ranks share cores. After half a second of waiting (a rank is
// late, latency no longer matters) it sleeps 200 us between polls. Throws (check_mpi,
// naming `op`) when MPI_Testall fails.
bool wait_all_until(MPI_Request* requests, int count, double timeout, const char* op);

}  // namespace meshtrain
