// The one GoogleTest main of meshtrain, for unit and multi-rank tests alike.
// MPI and Kokkos are initialized once around RUN_ALL_TESTS. Only rank 0 prints the usual
// report; other ranks print their failed assertions (prefixed with the rank). The exit
// status is reduced over ranks, so a failure on any rank fails the test on every rank.
//
// A program whose every test skipped (GTEST_SKIP) on every rank, and none failed, exits with
// kSkippedExitCode, which every registration names as ctest's SKIP_RETURN_CODE
// (cmake/MeshtrainTesting.cmake): ctest counts it as skipped, not passed. Rank 0 prints one
// line "SKIP: <reason>" per distinct reason first, which scripts/test's summary shows. The
// decision is reduced over ranks like the failures, so every rank exits with the same code
// (mpirun reports the first non-zero code of any rank). A program with some cases skipped and
// others run passes as before (gtest's own report lists the skipped cases).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <set>
#include <string>

namespace {

// ctest's SKIP_RETURN_CODE of every test of meshtrain_add_test (cmake/MeshtrainTesting.cmake).
constexpr int kSkippedExitCode = MESHTRAIN_TEST_SKIP_CODE;

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

// The distinct messages of this rank's GTEST_SKIPs, each on one line.
std::set<std::string> skip_reasons() {
  std::set<std::string> reasons;
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const ::testing::TestResult& result = *suite.GetTestInfo(t)->result();
      for (int p = 0; p < result.total_part_count(); ++p) {
        const ::testing::TestPartResult& part = result.GetTestPartResult(p);
        if (!part.skipped()) continue;
        std::string reason = part.message();
        for (char& c : reason)
          if (c == '\n') c = ' ';
        reasons.insert(reason.empty() ? "(GTEST_SKIP without a reason)" : reason);
      }
    }
  }
  return reasons;
}

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
  // Skipped as a whole: tests were selected, and none ran to the end unskipped on any rank.
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  int local_counts[2] = {unit.test_to_run_count(),
                         unit.test_to_run_count() - unit.skipped_test_count()};
  int counts[2] = {0, 0};  // selected, not skipped: over every rank
  MPI_Allreduce(local_counts, counts, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  const bool all_skipped = !any_failed && counts[0] > 0 && counts[1] == 0;
  if (all_skipped && rank == 0) {
    for (const std::string& reason : skip_reasons()) std::printf("SKIP: %s\n", reason.c_str());
    std::fflush(stdout);
  }

  Kokkos::finalize();
  MPI_Finalize();
  return any_failed ? 1 : all_skipped ? kSkippedExitCode : 0;
}
