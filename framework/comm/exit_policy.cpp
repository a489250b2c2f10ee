#include "framework/comm/exit_policy.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

#include "base/error.hpp"
#include "framework/observe/flight_recorder.hpp"

namespace meshtrain {

int exit_status_for(const std::exception& error) {
  const auto* e = dynamic_cast<const Error*>(&error);
  return e != nullptr && e->kind() == ErrorKind::bad_input ? 2 : 1;
}

void abort_all_ranks(const std::string& message, int exit_status) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    std::fprintf(stderr, "meshtrain: error: %s\n", message.c_str());
    std::fflush(stderr);
    std::exit(exit_status);
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  flight_recorder().write("failure");  // before MPI_Abort ends this rank (a no-op when off)
  std::fprintf(stderr, "meshtrain: error on rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, exit_status);
  std::exit(exit_status);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

int run_or_abort(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    abort_all_ranks(e.what(), exit_status_for(e));
  }
}

std::unique_ptr<Runtime> start_runtime_or_abort(int& argc, char**& argv,
                                                const StartupCheck& check) {
  try {
    return std::make_unique<Runtime>(argc, argv, check);
  } catch (const std::exception& e) {
    abort_all_ranks(e.what(), exit_status_for(e));
  }
}

}  // namespace meshtrain
