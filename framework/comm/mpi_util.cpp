#include "framework/comm/mpi_util.hpp"

#include <sched.h>

#include <cstddef>
#include <ctime>
#include <string>

#include "partition/error.hpp"

namespace meshtrain {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    MESHTRAIN_FAIL(what, " failed with MPI error code ", code);
  }
  MESHTRAIN_FAIL(what, " failed: ", std::string(text, static_cast<std::size_t>(length)));
}

bool wait_all_until(MPI_Request* requests, int count, double timeout, const char* op) {
  const double start = MPI_Wtime();
  for (;;) {
    int done = 0;
    check_mpi(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), op);
    if (done) return true;
    const double waited = MPI_Wtime() - start;
    if (waited > timeout) return false;
    if (waited > 0.5) {
      const timespec pause{0, 200000};
      nanosleep(&pause, nullptr);
    } else {
      sched_yield();
    }
  }
}

}  // namespace meshtrain
