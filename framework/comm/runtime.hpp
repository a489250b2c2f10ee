#pragma once
// Process-wide set-up: MPI, then Kokkos; torn down in reverse.
//
//   int main(int argc, char** argv) {
//     meshtrain::Runtime runtime(argc, argv);
//     ...  // everything that uses MPI or Kokkos is destroyed before runtime
//   }

#include <memory>

#include "framework/comm/communicator.hpp"

namespace meshtrain {

// Throws a runtime Error naming both levels when MPI_Init_thread `provided` less thread
// support than `required` (e.g. MPI_THREAD_SINGLE for MPI_THREAD_FUNNELED).
void require_thread_level(int provided, int required);

class Runtime {
 public:
  // MPI_Init_thread (MPI_THREAD_FUNNELED; a runtime Error when MPI provides less) then
  // Kokkos::initialize. Either step is skipped when already done by someone else, who then
  // also owns the matching finalize.
  Runtime(int& argc, char**& argv);
  ~Runtime();  // Kokkos::finalize, then MPI_Finalize (only what this object initialized)
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // All ranks (a private duplicate of MPI_COMM_WORLD), described as "world". Collective
  // on first use.
  Communicator& world();

 private:
  bool owns_mpi_ = false;
  bool owns_kokkos_ = false;
  int world_rank_ = 0;
  int world_size_ = 1;
  std::unique_ptr<Communicator> world_;
};

}  // namespace meshtrain
