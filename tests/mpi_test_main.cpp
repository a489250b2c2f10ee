// The one GoogleTest main of meshtrain, for unit and multi-rank tests alike.
// MPI and Kokkos are initialized once around RUN_ALL_TESTS. Only rank 0 prints the usual
// report; other ranks print their failed assertions (prefixed with the rank). The exit
// status is reduced over ranks, so a failure on any rank fails the test on every rank.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>

namespace {

// Prints only the failures of a non-zero rank, so multi-rank output stays readable.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  // MPI_THREAD_MULTIPLE, as meshtrain::Runtime asks: tests may run the communication thread.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Kokkos::initialize(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);

  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }

  int local_failed = 0;
  { local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0; }
  int any_failed = 0;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !local_failed) {
    std::fprintf(stderr, "a test failed on another rank (see its [rank N] lines above)\n");
  }

  Kokkos::finalize();
  MPI_Finalize();
  return any_failed;
}
