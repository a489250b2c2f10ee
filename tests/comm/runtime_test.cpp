// all_reduce in double (exact where float rounds), pooled shift requests (reused; a pending
// one outlives its communicator), a factory that throws on MeshCommunicators::get, and the
// choice of the communication backend ([runtime] backend).

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "framework/comm/backend.hpp"
#include "framework/comm/backends/mpi_communicator.hpp"
#if MESHTRAIN_HAVE_NCCL && defined(KOKKOS_ENABLE_CUDA)
#include "framework/comm/backends/nccl_communicator.hpp"
#endif
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/runtime.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

// Communicators take views of Kokkos' default memory space (device memory with a CUDA
// Kokkos): the tests fill and read host mirrors and deep_copy between the two.
using Doubles = Kokkos::View<double*, Kokkos::LayoutRight>;
using Floats = Kokkos::View<float*, Kokkos::LayoutRight>;

TEST(AllReduceDouble, SumsExactlyWhereFloatRounds) {
  MpiCommunicator comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const int n = comm.size();
  const int rank = comm.rank();
  // 2^24 + rank + 1/3: float holds neither the value nor the sum.
  Doubles data("data", 3);
  auto h = Kokkos::create_mirror_view(Kokkos::HostSpace(), data);
  h(0) = 16777216.0 + rank;
  h(1) = 1.0 / 3.0;
  h(2) = 1e-12 * (rank + 1);
  Kokkos::deep_copy(data, h);
  comm.all_reduce(DoubleVectorView(data.data(), 3));
  Kokkos::deep_copy(h, data);
  const double ranks = static_cast<double>(n);
  EXPECT_EQ(h(0), 16777216.0 * ranks + ranks * (ranks - 1) / 2);
  EXPECT_NEAR(h(1), ranks / 3.0, 1e-15 * ranks);
  EXPECT_NEAR(h(2), 1e-12 * ranks * (ranks + 1) / 2, 1e-26 * ranks);

  Doubles mean("mean", 1);
  Kokkos::deep_copy(mean, 1.0 + rank);
  comm.all_reduce(DoubleVectorView(mean.data(), 1), ReduceOp::mean);
  double got_mean = 0.0;
  Kokkos::deep_copy(got_mean, Kokkos::subview(mean, 0));
  EXPECT_DOUBLE_EQ(got_mean, (ranks + 1) / 2);
}

// Many shifts in flight at once and in sequence: every one delivers, whichever pool slot
// it gets.
TEST(ShiftRequests, PooledRequestsDeliverEveryShift) {
  MpiCommunicator comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const int n = comm.size();
  const int rank = comm.rank();
  constexpr int kInFlight = 3;
  Floats send("send", kInFlight), recv("recv", kInFlight);
  auto send_h = Kokkos::create_mirror_view(Kokkos::HostSpace(), send);
  auto recv_h = Kokkos::create_mirror_view(Kokkos::HostSpace(), recv);
  for (int round = 0; round < 5; ++round) {
    for (int k = 0; k < kInFlight; ++k) send_h(k) = static_cast<float>(100 * round + 10 * k + rank);
    Kokkos::deep_copy(send, send_h);
    Kokkos::deep_copy(recv, -1.0f);
    std::vector<Request> requests(kInFlight);
    for (int k = 0; k < kInFlight; ++k) {
      requests[k] =
          comm.shift(ConstVectorView(send.data() + k, 1), VectorView(recv.data() + k, 1), k + 1);
    }
    // Complete them out of order: test() until done for the last, wait() for the others,
    // one by assigning over it.
    while (!requests[kInFlight - 1].test()) {
    }
    requests[0].wait();
    requests[1] = Request();
    Kokkos::deep_copy(recv_h, recv);
    for (int k = 0; k < kInFlight; ++k) {
      const int from = ((rank - (k + 1)) % n + n) % n;
      EXPECT_EQ(recv_h(k), static_cast<float>(100 * round + 10 * k + from))
          << "round " << round << ", shift by " << k + 1;
    }
  }
}

// A pending request keeps its communicator's state: it completes after the communicator
// object is gone.
TEST(ShiftRequests, PendingRequestOutlivesItsCommunicator) {
  const int n = world_size();
  const int rank = world_rank();
  Floats send("send", 1), recv("recv", 1);
  Kokkos::deep_copy(send, static_cast<float>(rank));
  Kokkos::deep_copy(recv, -1.0f);
  Request request;
  {
    MpiCommunicator comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
    request = comm.shift(ConstVectorView(send.data(), 1), VectorView(recv.data(), 1), 1);
  }
  request.wait();
  EXPECT_FALSE(request.pending());
  float got = 0.0f;
  Kokkos::deep_copy(got, Kokkos::subview(recv, 0));
  EXPECT_EQ(got, static_cast<float>((rank - 1 + n) % n));
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

// [runtime] backend: auto resolves by what the build has and whether every rank has a GPU
// of its own; nccl where the build cannot run it, and unknown names, are one sentence naming
// runtime.backend.
TEST(CommBackend, ResolvesForThisBuild) {
  EXPECT_EQ(resolve_comm_backend("mpi", MPI_COMM_WORLD), CommBackend::mpi);
  std::string note;
  const CommBackend automatic =
      resolve_comm_backend(CommBackendChoice::automatic, MPI_COMM_WORLD, &note);
#if MESHTRAIN_HAVE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  // One node here: NCCL when the GPUs go round (or each rank poses as a host of its own).
  const bool own_gpus = world_size() <= cuda_device_count() || std::getenv("NCCL_HOSTID");
  EXPECT_EQ(automatic, own_gpus ? CommBackend::nccl : CommBackend::mpi);
  if (!own_gpus) EXPECT_NE(note.find("NCCL needs one GPU per rank"), std::string::npos) << note;
  EXPECT_EQ(resolve_comm_backend("nccl", MPI_COMM_WORLD), CommBackend::nccl);
#else
  EXPECT_FALSE(build_supports_nccl());
  EXPECT_EQ(automatic, CommBackend::mpi);
  EXPECT_EQ(note, "");
  expect_bad_input([] { resolve_comm_backend("nccl", MPI_COMM_WORLD); },
                   {"runtime.backend = \"nccl\" needs a build", "use runtime.backend = \"mpi\""});
#endif
  expect_bad_input([] { resolve_comm_backend("gloo", MPI_COMM_WORLD); },
                   {"runtime.backend = 'gloo' is not one of auto | mpi | nccl"});
}

// The MPI backend's factory builds working communicators for every mesh group.
TEST(CommBackend, MpiFactoryBuildsTheMeshGroups) {
  const int n = world_size();
  const int tp = n % 2 == 0 ? 2 : 1;
  MeshCommunicators comms(Mesh::create({{"fsdp", n / tp}, {"tp", tp}}, n), MPI_COMM_WORLD,
                          prepare_comm_backend(CommBackend::mpi, MPI_COMM_WORLD));
  Communicator& group = comms.get({"tp"});
  EXPECT_EQ(group.size(), tp);
  Kokkos::View<double*, Kokkos::LayoutRight> ones("ones", 1);
  Kokkos::deep_copy(ones, 1.0);
  group.all_reduce(DoubleVectorView(ones.data(), 1));
  double sum = 0.0;
  Kokkos::deep_copy(sum, Kokkos::subview(ones, 0));
  EXPECT_EQ(sum, static_cast<double>(tp));
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
