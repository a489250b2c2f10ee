// A small MPI program for the crash tests (tests/checkpoint/crash_test.sh):
//   checkpoint_fault_tool save DIR STEP   saves the test contents of STEP (fsdp = world),
//                                         honouring MESHTRAIN_FAULT_INJECT
//   checkpoint_fault_tool check DIR STEP  loads DIR's latest onto tp = world and exits 0
//                                         when it is STEP's checkpoint with exact values
// Exit status: 0 success, 1 mismatch or error (message on stderr).

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <string>

#include "framework/io/checkpoint.hpp"
#include "tests/checkpoint/checkpoint_test_data.hpp"

namespace {

int run(const std::string& command, const std::string& dir, int64_t step) {
  using namespace meshtrain;
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (command == "save") {
    const Mesh mesh = Mesh::create({{"fsdp", size}}, size);
    save_checkpoint(testing::test_contents(mesh, rank, "fsdp", step, true), dir, 2, MPI_COMM_WORLD);
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
    return 0;
  }
  std::fprintf(stderr, "usage: checkpoint_fault_tool save|check DIR STEP\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int status = 1;
  if (argc == 4) {
    try {
      status = run(argv[1], argv[2], std::stoll(argv[3]));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      status = 1;
    }
  } else {
    std::fprintf(stderr, "usage: checkpoint_fault_tool save|check DIR STEP\n");
  }
  int any = 0;
  MPI_Allreduce(&status, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  Kokkos::finalize();
  MPI_Finalize();
  return any;
}
