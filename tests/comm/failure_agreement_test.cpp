// run_agreed: every rank ends a phase with the lowest failing rank's error, and a rank
// that never joins the agreement turns into an error on the others, not a hang.

#include <gtest/gtest.h>
#include <mpi.h>

#include <functional>
#include <stdexcept>
#include <string>

#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

TEST(RunAgreed, SuccessOnEveryRankIsNullopt) {
  int calls = 0;
  EXPECT_FALSE(run_agreed(MPI_COMM_WORLD, [&] { ++calls; }).has_value());
  EXPECT_EQ(calls, 1);
}

TEST(RunAgreed, EveryRankGetsTheLowestFailingRanksError) {
  const int n = world_size();
  const int rank = world_rank();
  // Ranks n-1 and (when n > 2) 1 fail with different kinds and messages; the lowest wins.
  const int lowest = n > 2 ? 1 : n - 1;
  auto error = run_agreed(MPI_COMM_WORLD, [&] {
    if (rank == n - 1) MESHTRAIN_BAD_INPUT("rank ", rank, " found a bad key 'model.width'");
    if (n > 2 && rank == 1) MESHTRAIN_FAIL("rank ", rank, " could not write 'part-1.h5'");
  });
  ASSERT_TRUE(error.has_value());
  const bool bad_input = lowest == n - 1;
  EXPECT_EQ(error->kind(), bad_input ? ErrorKind::bad_input : ErrorKind::runtime);
  const std::string want = bad_input
                               ? "rank " + std::to_string(lowest) + " found a bad key 'model.width'"
                               : "rank " + std::to_string(lowest) + " could not write 'part-1.h5'";
  EXPECT_EQ(std::string(error->what()), want);
}

TEST(RunAgreed, OtherExceptionsBecomeUnexpectedRuntimeFailures) {
  auto error = run_agreed(MPI_COMM_WORLD, [] {
    if (world_rank() == 0) throw std::out_of_range("map::at");
  });
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->kind(), ErrorKind::runtime);
  EXPECT_EQ(std::string(error->what()), "unexpected failure: map::at");
  // The agreed error can be thrown as is.
  expect_error([&] { throw *error; }, ErrorKind::runtime, {"unexpected failure", "map::at"});
}

// The last rank never joins: every other rank gets a runtime Error naming the agreement
// within the timeout. The agreement runs on a private communicator, which is left behind
// (its abandoned request may never complete), so the world stays usable.
TEST(RunAgreed, ARankThatNeverJoinsTimesOut) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a rank that does not join";
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  if (world_rank() != n - 1) {
    const double start = MPI_Wtime();
    expect_error(
        [&] {
          run_agreed(
              comm, [] {}, /*timeout_seconds=*/0.5);
        },
        ErrorKind::runtime, {"agreeing on a phase's outcome", "did not complete within 0.5 s"});
    EXPECT_LT(MPI_Wtime() - start, 30.0);
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

// The checkpoint's and resume's broadcasts and gathers wait under the collective timeout
// (issue 20, bug 8): a rank that joins late is reported instead of waited for forever.
TEST(WaitCollective, ARankThatJoinsLateTimesOut) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a rank that joins late";
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  setenv("MESHTRAIN_COLLECTIVE_TIMEOUT", "0.5", 1);
  int value = world_rank() == n - 1 ? 42 : 0;  // the late rank is the root: nothing arrives early
  MPI_Request request = MPI_REQUEST_NULL;
  if (world_rank() == n - 1) {
    // Late: after the others gave up waiting.
    const double start = MPI_Wtime();
    while (MPI_Wtime() - start < 2.0) detail::pause_between_polls(1.0);
  }
  check_mpi(MPI_Ibcast(&value, 1, MPI_INT, n - 1, comm, &request), "MPI_Ibcast");
  if (world_rank() != n - 1) {
    expect_error([&] { wait_collective(&request, 1, "MPI_Ibcast (a test's value)"); },
                 ErrorKind::runtime,
                 {"MPI_Ibcast (a test's value)", "did not complete within 0.5 s",
                  "MESHTRAIN_COLLECTIVE_TIMEOUT"});
    EXPECT_NE(request, MPI_REQUEST_NULL);  // still pending: the caller may go on waiting
  }
  unsetenv("MESHTRAIN_COLLECTIVE_TIMEOUT");
  wait_collective(&request, 1, "MPI_Ibcast (a test's value)");
  EXPECT_EQ(value, 42);
  check_mpi(MPI_Comm_free(&comm), "MPI_Comm_free");
}

// A collective outside a Communicator that timed out gives its buffers up (issue 25): the
// late rank's transfer completes into them, never into the caller's memory, which is the
// caller's again once the call has thrown. Here the caller writes 7 into its variable after
// the timeout and drives MPI's progress (a barrier the late rank joins after its part of the
// collective); the variable must still hold 7.
void expect_late_transfer_not_written(
    const std::function<void(int& value, MPI_Comm comm)>& collective, const char* op) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a rank that joins late";
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  const bool late = world_rank() == n - 1;
  setenv("MESHTRAIN_COLLECTIVE_TIMEOUT", late ? "60" : "0.5", 1);
  int value = late ? 42 : 0;
  if (late) {
    const double start = MPI_Wtime();
    while (MPI_Wtime() - start < 2.0) detail::pause_between_polls(1.0);  // the others give up
    collective(value, comm);
  } else {
    expect_error([&] { collective(value, comm); }, ErrorKind::runtime,
                 {op, "did not complete within 0.5 s"});
    value = 7;  // the caller's memory again
  }
  check_mpi(MPI_Barrier(comm), "MPI_Barrier");  // the late rank has sent its part by now
  if (!late) EXPECT_EQ(value, 7) << "a transfer given up wrote into the caller's memory";
  unsetenv("MESHTRAIN_COLLECTIVE_TIMEOUT");
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

TEST(WaitCollective, ATimedOutBroadcastGivesItsBufferUp) {
  expect_late_transfer_not_written(
      [](int& value, MPI_Comm comm) {
        broadcast_collective(&value, 1, MPI_INT, world_size() - 1, comm, "a test's broadcast");
      },
      "a test's broadcast");
}

TEST(WaitCollective, ATimedOutAllReduceGivesItsBufferUp) {
  expect_late_transfer_not_written(
      [](int& value, MPI_Comm comm) {
        all_reduce_collective(&value, 1, MPI_INT, MPI_MAX, comm, "a test's all-reduce");
      },
      "a test's all-reduce");
}

TEST(WaitCollective, BroadcastAndAllReduceAgreeWithMpi) {
  int value = world_rank() == 0 ? 5 : 0;
  broadcast_collective(&value, 1, MPI_INT, 0, MPI_COMM_WORLD, "a test's broadcast");
  EXPECT_EQ(value, 5);
  long long ranks[2] = {world_rank(), -world_rank()};
  all_reduce_collective(ranks, 2, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD, "a test's all-reduce");
  EXPECT_EQ(ranks[0], 0);
  EXPECT_EQ(ranks[1], -(world_size() - 1));
  std::string text = world_rank() == 0 ? "a path/with some length" : "";
  broadcast_string(text, 0, MPI_COMM_WORLD, "a test's string");
  EXPECT_EQ(text, "a path/with some length");
}

}  // namespace
}  // namespace meshtrain::testing
