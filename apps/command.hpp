#pragma once
// How every MPI subcommand of `meshtrain` begins and ends, written once:
//   run_mpi_command: the Runtime (MPI, then Kokkos), then the command; an error that struck
//     only some ranks ends every rank (framework/comm/exit_policy.hpp), so none waits in a
//     collective for a rank that failed.
//   report_agreed_error: an error every rank agreed on (AgreedError: bad input at set-up, a
//     non-finite loss) printed once, by rank 0; its exit status (2 for bad input, 1
//     otherwise) on every rank. Each command's body catches AgreedError with it.

#include <mpi.h>

#include <cstdio>
#include <utility>

#include "framework/comm/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"

namespace meshtrain {

// `comm`: the command's ranks (under MPMD its program's part of MPI_COMM_WORLD).
inline int report_agreed_error(const AgreedError& error, MPI_Comm comm = MPI_COMM_WORLD) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (rank == 0) std::fprintf(stderr, "meshtrain: error: %s\n", error.what());
  return exit_status_for(error);
}

template <class Command>
int run_mpi_command(int& argc, char**& argv, Command&& command) {
  const auto runtime = start_runtime_or_abort(argc, argv);
  return run_or_abort(std::forward<Command>(command));
}

}  // namespace meshtrain
