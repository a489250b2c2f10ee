// run_agreed (every rank ends a phase with the lowest failing rank's error), all_reduce in
// double (exact where float rounds), pooled shift requests (reused; a pending one outlives
// its communicator), and a factory that throws on MeshCommunicators::get.

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/core/runtime.hpp"
#include "tests/test_support.hpp"

namespace meshtrain::testing {
namespace {

using HostDoubles = Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::HostSpace>;

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

TEST(AllReduceDouble, SumsExactlyWhereFloatRounds) {
  MpiCommunicator comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const int n = comm.size();
  const int rank = comm.rank();
  // 2^24 + rank + 1/3: float holds neither the value nor the sum.
  HostDoubles data("data", 3);
  data(0) = 16777216.0 + rank;
  data(1) = 1.0 / 3.0;
  data(2) = 1e-12 * (rank + 1);
  comm.all_reduce(DoubleVectorView(data.data(), 3));
  const double ranks = static_cast<double>(n);
  EXPECT_EQ(data(0), 16777216.0 * ranks + ranks * (ranks - 1) / 2);
  EXPECT_NEAR(data(1), ranks / 3.0, 1e-15 * ranks);
  EXPECT_NEAR(data(2), 1e-12 * ranks * (ranks + 1) / 2, 1e-26 * ranks);

  HostDoubles mean("mean", 1);
  mean(0) = 1.0 + rank;
  comm.all_reduce(DoubleVectorView(mean.data(), 1), ReduceOp::mean);
  EXPECT_DOUBLE_EQ(mean(0), (ranks + 1) / 2);
}

// Many shifts in flight at once and in sequence: every one delivers, whichever pool slot
// it gets.
TEST(ShiftRequests, PooledRequestsDeliverEveryShift) {
  MpiCommunicator comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const int n = comm.size();
  const int rank = comm.rank();
  constexpr int kInFlight = 3;
  std::vector<float> send(kInFlight), recv(kInFlight);
  for (int round = 0; round < 5; ++round) {
    std::vector<Request> requests(kInFlight);
    for (int k = 0; k < kInFlight; ++k) {
      send[k] = static_cast<float>(100 * round + 10 * k + rank);
      recv[k] = -1.0f;
      requests[k] = comm.shift(ConstVectorView(&send[k], 1), VectorView(&recv[k], 1), k + 1);
    }
    // Complete them out of order: test() until done for the last, wait() for the others,
    // one by assigning over it.
    while (!requests[kInFlight - 1].test()) {
    }
    requests[0].wait();
    requests[1] = Request();
    for (int k = 0; k < kInFlight; ++k) {
      const int from = ((rank - (k + 1)) % n + n) % n;
      EXPECT_EQ(recv[k], static_cast<float>(100 * round + 10 * k + from))
          << "round " << round << ", shift by " << k + 1;
    }
  }
}

// A pending request keeps its communicator's state: it completes after the communicator
// object is gone.
TEST(ShiftRequests, PendingRequestOutlivesItsCommunicator) {
  const int n = world_size();
  const int rank = world_rank();
  float send = static_cast<float>(rank), recv = -1.0f;
  Request request;
  {
    MpiCommunicator comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
    request = comm.shift(ConstVectorView(&send, 1), VectorView(&recv, 1), 1);
  }
  request.wait();
  EXPECT_FALSE(request.pending());
  EXPECT_EQ(recv, static_cast<float>((rank - 1 + n) % n));
}

// A factory that throws leaves MeshCommunicators usable (the split group is freed, the
// error comes through unchanged).
TEST(MeshCommunicators, FactoryFailureComesThroughAndLeavesTheMeshUsable) {
  const int n = world_size();
  int built = 0;
  MeshCommunicators comms(Mesh::create({{"dp", n}}, n), MPI_COMM_WORLD,
                          [&](MPI_Comm group, const std::string& description) {
                            if (++built == 1) MESHTRAIN_FAIL("no backend for ", description);
                            return make_mpi_communicator(group, description);
                          });
  expect_error([&] { comms.get({"dp"}); }, ErrorKind::runtime, {"no backend for axis (dp)"});
  EXPECT_FALSE(comms.has({"dp"}));
  Communicator& dp = comms.get({"dp"});
  EXPECT_EQ(dp.size(), n);
}

// Runtime refuses an MPI that provides less thread support than it asked for (issue 9,
// bug 8: MPI_Init_thread's `provided` was ignored). The levels are MPI's own constants.
TEST(Runtime, RequireThreadLevelNamesBothLevels) {
  expect_error([] { require_thread_level(MPI_THREAD_SINGLE, MPI_THREAD_FUNNELED); },
               ErrorKind::runtime, {"provides MPI_THREAD_SINGLE", "needs MPI_THREAD_FUNNELED"});
  EXPECT_NO_THROW(require_thread_level(MPI_THREAD_FUNNELED, MPI_THREAD_FUNNELED));
  EXPECT_NO_THROW(require_thread_level(MPI_THREAD_MULTIPLE, MPI_THREAD_FUNNELED));
}

}  // namespace
}  // namespace meshtrain::testing
