// The meshtrain command with the checkpoint fault hook installed from the environment
// (tests/support/checkpoint_fault_hook.hpp), for the resume tests that kill a save half-way. The
// production command has no such hook. apps/main.cpp is compiled into this program with its
// main renamed to meshtrain_command_main.

#include <mpi.h>

#include "tests/support/checkpoint_fault_hook.hpp"

int meshtrain_command_main(int argc, char** argv);

int main(int argc, char** argv) {
  // The world rank as the launcher gives it (MPI is initialized later by the command).
  int rank = 0;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* value = std::getenv(name)) {
      rank = std::atoi(value);
      break;
    }
  }
  meshtrain::testing::install_fault_hook_from_environment(rank);
  return meshtrain_command_main(argc, argv);
}
