#pragma once
// Process-wide set-up: MPI, then Kokkos; torn down in reverse.
//
//   int main(int argc, char** argv) {
//     meshtrain::Runtime runtime(argc, argv);
//     ...  // everything that uses MPI or Kokkos is destroyed before runtime
//   }

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>

#include "framework/comm/communicator.hpp"
#include "framework/core/choices.hpp"

namespace meshtrain {

// What must hold on a rank before Kokkos starts there; throws an Error that says what is
// missing. Called with the rank's index in MPI_COMM_WORLD.
using StartupCheck = std::function<void(int world_rank)>;

// The default check: a CUDA build needs a usable GPU, and says so in one sentence where there
// is none (a login node without the NVIDIA driver) instead of failing inside Kokkos. Nothing
// to check in a host build.
void require_usable_device(int world_rank);

// Throws a runtime Error naming both levels when MPI_Init_thread `provided` less thread
// support than `required` (e.g. MPI_THREAD_SINGLE for MPI_THREAD_FUNNELED).
void require_thread_level(int provided, int required);

// Whether this process runs the communication thread (framework/comm/progress_thread.hpp)
// for a job on `comm` configured with `choice` (the config key `key`, for messages):
// - off: no.
// - on: yes; a bad_input Error naming `key` when MPI provides less than MPI_THREAD_MULTIPLE.
// - automatic: yes when `overlap` is on (only started operations use the thread), comm has
//   more than one rank, and a core is free for it: this rank may run on more cores than
//   Kokkos' host threads, and the node has more cores than its ranks' host threads. When
//   all of that holds but MPI provides less than MPI_THREAD_MULTIPLE, no, and `note` gets
//   one sentence saying why.
// Collective over `comm` (automatic counts the ranks of each node).
bool want_comm_thread(CommThreadChoice choice, bool overlap, MPI_Comm comm, const std::string& key,
                      std::string& note);

class Runtime {
 public:
  // MPI_Init_thread (asks for MPI_THREAD_MULTIPLE, which the communication thread needs; a
  // runtime Error when MPI provides less than MPI_THREAD_FUNNELED), `check`,
  // then Kokkos::initialize. Either initialization is skipped when already done by someone
  // else, who then also owns the matching finalize.
  // When it throws after MPI_Init, MPI stays initialized: finalizing on this rank alone would
  // wait for the ranks still running, and they would wait for this one. The caller ends the
  // job instead (start_runtime_or_abort in framework/comm/exit_policy.hpp does).
  explicit Runtime(int& argc, char**& argv, const StartupCheck& check = require_usable_device);
  // Stops the communication thread, then Kokkos::finalize, then MPI_Finalize (only what
  // this object initialized).
  ~Runtime();
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
