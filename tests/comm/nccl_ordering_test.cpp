// Ordering rule 7 of the NCCL backend (framework/comm/backends/nccl_state.hpp): every NCCL
// communicator of a device enqueues on one stream, so operations of two groups interleaved
// as in the overlapped training step (an FSDP prefetch started on one group, DP buckets
// started and a blocking all-reduce on another, completed in another order than started)
// run one after another in issue order and give the right data.
//
// Runs only in a CUDA build (Views in device memory) with a GPU per rank, or with
// NCCL_HOSTID set per rank (scripts/gpu-check: two ranks sharing one GPU over sockets);
// otherwise skipped with the reason. The decision is the same on every rank.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>
#include <string>

#include "framework/comm/backends/nccl_communicator.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/views.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

// Why the NCCL tests cannot run here (empty: they run). Collective on first use.
const std::string& skip_reason() {
  static const std::string why = [] {
    std::string reason;
    if (!kDeviceMemoryIsHostInaccessible) {
      reason = "Kokkos' memory is host memory: NCCL needs a CUDA build";
    }
    const int devices = cuda_device_count();
    const char* host_id = std::getenv("NCCL_HOSTID");
    const bool own_gpu = devices >= node_place(MPI_COMM_WORLD).local_size ||
                         (devices > 0 && host_id != nullptr && *host_id != '\0');
    int mine = reason.empty() && own_gpu ? 1 : 0, all = 0;
    check_mpi(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
    if (all == 0 && reason.empty()) reason = "no CUDA device of its own on some rank";
    if (all != 0) select_cuda_device(MPI_COMM_WORLD);
    return reason;
  }();
  return why;
}

#define MESHTRAIN_REQUIRE_NCCL_DEVICE()                        \
  do {                                                         \
    if (!skip_reason().empty()) GTEST_SKIP() << skip_reason(); \
  } while (0)

// Every other rank of the world: a group other than the world (singletons on 2 ranks), as
// the dp groups of an fsdp = 2 mesh.
NcclCommunicator alternate_ranks() {
  MPI_Comm group = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &group),
            "MPI_Comm_split");
  NcclCommunicator comm = NcclCommunicator::create(group, "alternate ranks");
  MPI_Comm_free(&group);
  return comm;
}

// `view` filled with `value` (through its host mirror).
void fill(const Vector& view, float value) {
  auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), view);
  Kokkos::deep_copy(host, value);
  Kokkos::deep_copy(view, host);
}

void expect_all(const Vector& view, float want, const char* what) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  for (std::size_t k = 0; k < host.extent(0); ++k) {
    ASSERT_EQ(host(k), want) << what << " at " << k << " on rank " << world_rank();
  }
}

TEST(NcclOrdering, CommunicatorsOfADeviceShareOneStream) {
  MESHTRAIN_REQUIRE_NCCL_DEVICE();
  NcclCommunicator world = NcclCommunicator::create(MPI_COMM_WORLD, "world");
  NcclCommunicator alternate = alternate_ranks();
  EXPECT_EQ(world.device(), alternate.device());
  EXPECT_NE(world.stream(), nullptr);
  EXPECT_EQ(world.stream(), alternate.stream());
}

TEST(NcclOrdering, InterleavedOperationsOfTwoGroupsComplete) {
  MESHTRAIN_REQUIRE_NCCL_DEVICE();
  NcclCommunicator fsdp = NcclCommunicator::create(MPI_COMM_WORLD, "world");
  NcclCommunicator dp = alternate_ranks();
  const int n = fsdp.size(), dp_n = dp.size();
  constexpr std::size_t kCount = 1 << 16;
  Vector shard("shard", kCount), gathered("gathered", kCount * static_cast<std::size_t>(n));
  Vector bucket1("bucket1", kCount), bucket2("bucket2", 3 * kCount), loss("loss", 4);
  for (int step = 0; step < 3; ++step) {
    fill(shard, 1.0f + static_cast<float>(step));
    fill(bucket1, 2.0f);
    fill(bucket2, 0.5f);
    fill(loss, 0.25f);
    Request prefetch = fsdp.start_all_gather(shard, gathered);
    Request first = dp.start_all_reduce(bucket1);
    dp.all_reduce(VectorView(loss.data(), loss.extent(0)));
    Request second = dp.start_all_reduce(bucket2);
    second.wait();
    prefetch.wait();
    first.wait();
    expect_all(gathered, 1.0f + static_cast<float>(step), "gathered shard");
    expect_all(bucket1, 2.0f * static_cast<float>(dp_n), "first bucket");
    expect_all(bucket2, 0.5f * static_cast<float>(dp_n), "second bucket");
    expect_all(loss, 0.25f * static_cast<float>(dp_n), "loss");
  }
}

}  // namespace
}  // namespace meshtrain::testing
