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
  return wait_all_until(requests, count, timeout, [op](int code) { check_mpi(code, op); });
}

void detail::pause_between_polls(double waited) {
  if (waited > 0.5) {
    const timespec pause{0, 200000};
    nanosleep(&pause, nullptr);
  } else {
    sched_yield();
  }
}

}  // namespace meshtrain
