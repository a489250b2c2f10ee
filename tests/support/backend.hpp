#pragma once
// The communication backend the multi-rank tests build their meshes with: env
// MESHTRAIN_TEST_BACKEND = mpi (default) | nccl | auto, so that scripts/gpu-check runs the
// same equivalence tests over NCCL on a GPU machine. Collective over MPI_COMM_WORLD.
// And the [runtime] reductions of the training tests: env MESHTRAIN_TEST_REDUCTIONS = auto |
// mpi | ring | measure, unset keeps the config's (a ctest variant runs them on the ring).

#include <mpi.h>

#include <cstdlib>

#include "framework/comm/backend.hpp"

namespace meshtrain::testing {

inline CommBackendChoice test_backend_choice() {
  const char* name = std::getenv("MESHTRAIN_TEST_BACKEND");
  return parse_comm_backend(name && *name ? name : "mpi");
}

inline ReductionAlgorithm test_reductions(ReductionAlgorithm unset) {
  const char* name = std::getenv("MESHTRAIN_TEST_REDUCTIONS");
  return name && *name ? parse_reduction_algorithm(name) : unset;
}

inline CommunicatorFactory test_communicator_factory() {
  const CommBackend backend = resolve_comm_backend(test_backend_choice(), MPI_COMM_WORLD);
  return prepare_comm_backend(backend, MPI_COMM_WORLD);
}

}  // namespace meshtrain::testing
