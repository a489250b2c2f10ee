#pragma once
// The communication backend the multi-rank tests build their meshes with: env
// MESHTRAIN_TEST_BACKEND = mpi (default) | nccl | auto, so that scripts/gpu-check runs the
// same equivalence tests over NCCL on a GPU machine. Collective over MPI_COMM_WORLD.

#include <mpi.h>

#include <cstdlib>

#include "framework/comm/backend.hpp"

namespace meshtrain::testing {

inline CommunicatorFactory test_communicator_factory() {
  const char* name = std::getenv("MESHTRAIN_TEST_BACKEND");
  const CommBackend backend = resolve_comm_backend(name && *name ? name : "mpi");
  return prepare_comm_backend(backend, MPI_COMM_WORLD);
}

}  // namespace meshtrain::testing
