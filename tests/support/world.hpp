#pragma once
// This process's place in MPI_COMM_WORLD, as every test sees it (the shared test main,
// tests/mpi_test_main.cpp, has initialized MPI).

#include <mpi.h>

namespace meshtrain {

// In namespace meshtrain so that tests in meshtrain and in meshtrain::testing both call them
// unqualified.
inline int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
inline int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

}  // namespace meshtrain
