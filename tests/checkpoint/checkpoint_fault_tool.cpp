// A small MPI program for the crash tests (tests/checkpoint/crash_test.sh):
//   checkpoint_fault_tool save DIR STEP [async]  saves the test contents of STEP (fsdp = world);
//                                   with async, through an asynchronous Checkpointer while
//                                   the main thread keeps running MPI "steps"
//   checkpoint_fault_tool check DIR STEP   loads DIR's latest onto tp = world and exits 0 when
//                                   it is STEP's checkpoint with exact values and it verifies
// Fault injection: tests/support/checkpoint_fault_hook.hpp (MESHTRAIN_TEST_FAULT...).
// Exit status: 0 success, 1 mismatch or error (rank 0 prints the error once).

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "framework/io/checkpoint.hpp"
#include "tests/support/checkpoint_contents.hpp"
#include "tests/support/checkpoint_fault_hook.hpp"

namespace {

int run(const std::string& command, const std::string& dir, int64_t step, bool async) {
  using namespace meshtrain;
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (command == "save") {
    const Mesh mesh = Mesh::create({{"fsdp", size}}, size);
    CheckpointContents contents = testing::test_contents(mesh, rank, "fsdp", step, true);
    Checkpointer checkpointer(MPI_COMM_WORLD, async);
    checkpointer.save(contents, dir, 2);
    // Training goes on while the write is in flight: collectives on the world, the snapshot
    // fence before the tensors change, and a poll per step, as the trainer does.
    checkpointer.wait_snapshot();
    for (int i = 0; i < 100000 && checkpointer.in_flight(); ++i) {
      int one = 1, sum = 0;
      MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
      for (auto& t : contents.params) Kokkos::deep_copy(t.local, 0.0f);  // "the optimizer"
      checkpointer.poll();
    }
    checkpointer.wait();
    return 0;
  }
  if (command == "check") {
    const Mesh mesh = Mesh::create({{"tp", size}}, size);
    CheckpointContents into = testing::test_contents(mesh, rank, "tp", 0, false);
    const CheckpointInfo info = load_checkpoint(dir, into, MPI_COMM_WORLD);
    const int64_t wrong = testing::count_all_mismatches(into, step);
    if (info.train_state.step != step || wrong != 0) {
      std::fprintf(stderr,
                   "rank %d: loaded '%s' at step %lld with %lld wrong values; expected step %lld\n",
                   rank, info.path.c_str(), static_cast<long long>(info.train_state.step),
                   static_cast<long long>(wrong), static_cast<long long>(step));
      return 1;
    }
    if (rank == 0) verify_checkpoint(info.path);
    return 0;
  }
  std::fprintf(stderr, "usage: checkpoint_fault_tool save|check DIR STEP [async]\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  meshtrain::testing::install_fault_hook_from_environment(rank);
  int status = 1;
  if (argc == 4 || argc == 5) {
    try {
      status =
          run(argv[1], argv[2], std::stoll(argv[3]), argc == 5 && std::string(argv[4]) == "async");
    } catch (const std::exception& e) {
      // The checkpoint functions throw the same error on every rank: print it once.
      if (rank == 0) std::fprintf(stderr, "error: %s\n", e.what());
      status = 1;
    }
  } else {
    std::fprintf(stderr, "usage: checkpoint_fault_tool save|check DIR STEP [async]\n");
  }
  int any = 0;
  MPI_Allreduce(&status, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  Kokkos::finalize();
  MPI_Finalize();
  return any;
}
