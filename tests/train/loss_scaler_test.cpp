// LossScaler (fp16 dynamic loss scaling, docs/mixed_precision.md "fp16 loss scaling") on its
// own, with PyTorch GradScaler's defaults: the scale starts at 2^16; 2000 clean updates in a
// row double it and restart the count; a non-finite update halves it and restarts the
// count; restore() refuses a scale that is not a positive finite number (bad_input) and a
// negative count; unscale() divides every gradient by the scale (exactly: the scales here
// are powers of two) and answers, on every rank alike, whether every gradient on every rank
// is finite. At np 2 an inf or NaN in rank 1's gradient only must make every rank's
// unscale() return false. The gradients are an FSDP-sharded weight (8 x 4 rows over the
// world) and a replicated bias, as ShardedTensor::allocate makes them.

#include "framework/train/loss_scaler.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// An FSDP weight [8, 4] split by rows over the world and a replicated bias [4].
std::vector<ShardedTensor> make_gradients() {
  const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
  return {ShardedTensor::allocate("layers/0/weight", {8, 4}, PartitionSpec::parse("P(fsdp, None)"),
                                  mesh, world_rank()),
          ShardedTensor::allocate("layers/0/bias", {4}, PartitionSpec(), mesh, world_rank())};
}

// Fills gradient i with (i + 1) * scale * (1 + k / 8) at element k: exact in fp32, and
// exactly (i + 1) * (1 + k / 8) after a division by a power-of-two scale.
void fill_scaled(std::vector<ShardedTensor>& grads, double scale) {
  for (size_t i = 0; i < grads.size(); ++i) {
    auto host = Kokkos::create_mirror_view(grads[i].local);
    for (size_t k = 0; k < host.extent(0); ++k) {
      host(k) = static_cast<float>((i + 1) * scale * (1.0 + static_cast<double>(k) / 8));
    }
    Kokkos::deep_copy(grads[i].local, host);
  }
}

void expect_unscaled(const std::vector<ShardedTensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads[i].local);
    for (size_t k = 0; k < host.extent(0); ++k) {
      ASSERT_EQ(host(k), static_cast<float>((i + 1) * (1.0 + static_cast<double>(k) / 8)))
          << grads[i].name << "[" << k << "]";
    }
  }
}

TEST(LossScaler, StartsAtTwoToTheSixteen) {
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  LossScaler scaler(world);
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.clean_steps(), 0);
}

TEST(LossScaler, GrowsAfter2000CleanStepsAndBacksOffOnANonFiniteOne) {
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  LossScaler scaler(world);
  for (int s = 1; s < 2000; ++s) scaler.update(true);
  EXPECT_EQ(scaler.scale(), 65536.0f);  // 1999 clean steps: not yet
  EXPECT_EQ(scaler.clean_steps(), 1999);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 131072.0f);  // the 2000th doubles it and restarts the count
  EXPECT_EQ(scaler.clean_steps(), 0);

  for (int s = 0; s < 10; ++s) scaler.update(true);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 65536.0f);  // halved, and the 10 clean steps are forgotten
  EXPECT_EQ(scaler.clean_steps(), 0);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 32768.0f);  // halved again: backoffs compound
  EXPECT_EQ(scaler.clean_steps(), 0);

  // After a backoff it takes 2000 clean steps again.
  for (int s = 1; s < 2000; ++s) scaler.update(true);
  EXPECT_EQ(scaler.scale(), 32768.0f);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.clean_steps(), 0);
}

TEST(LossScaler, RestoreKeepsAValidStateAndRefusesABadOne) {
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  LossScaler scaler(world);
  scaler.restore(1024.0, 1998);
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.clean_steps(), 1998);
  scaler.update(true);
  scaler.update(true);  // the restored count goes on: 2000 clean steps
  EXPECT_EQ(scaler.scale(), 2048.0f);
  EXPECT_EQ(scaler.clean_steps(), 0);

  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {0.0, -1.0, -inf, inf, std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE(bad);
    testing::expect_bad_input([&] { scaler.restore(bad, 0); }, {"loss scale"});
  }
  testing::expect_bad_input([&] { scaler.restore(8.0, -1); }, {"loss scale", "-1 clean steps"});
  EXPECT_EQ(scaler.scale(), 2048.0f);  // a refused state changes nothing
  EXPECT_EQ(scaler.clean_steps(), 0);
}

TEST(LossScaler, UnscaleDividesByTheScale) {
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  LossScaler scaler(world);
  std::vector<ShardedTensor> grads = make_gradients();
  fill_scaled(grads, 65536.0);
  EXPECT_TRUE(scaler.unscale(grads));
  expect_unscaled(grads);

  scaler.restore(0.125, 0);  // a scale below 1 multiplies
  fill_scaled(grads, 0.125);
  EXPECT_TRUE(scaler.unscale(grads));
  expect_unscaled(grads);
}

// An inf or NaN in one element of one gradient on the last rank only: every rank's
// unscale() says false (one all-reduce over the world), and the other ranks' gradients are
// still divided.
class LossScalerNonFinite : public ::testing::TestWithParam<float> {};

TEST_P(LossScalerNonFinite, OnOneRankIsSeenByEveryRank) {
  const float poison = GetParam();
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  LossScaler scaler(world);
  std::vector<ShardedTensor> grads = make_gradients();
  const int last = world_size() - 1;
  for (size_t poisoned : {size_t{0}, size_t{1}}) {  // the sharded weight, the replicated bias
    SCOPED_TRACE(grads[poisoned].name);
    fill_scaled(grads, 65536.0);
    if (world_rank() == last) {
      ASSERT_GT(grads[poisoned].local.extent(0), 1u);
      Kokkos::deep_copy(Kokkos::subview(grads[poisoned].local, std::make_pair(1, 2)), poison);
    }
    const bool finite = scaler.unscale(grads);
    EXPECT_FALSE(finite) << "rank " << world_rank() << " missed rank " << last << "'s " << poison;
    // Every rank answers alike.
    int mine = finite ? 1 : 0, high = -1;
    MPI_Allreduce(&mine, &high, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_EQ(high, 0);
    if (world_rank() != last) expect_unscaled(grads);
  }
  // Then a clean one is finite again: the count does not stick.
  fill_scaled(grads, 65536.0);
  EXPECT_TRUE(scaler.unscale(grads));
}

INSTANTIATE_TEST_SUITE_P(InfAndNaN, LossScalerNonFinite,
                         ::testing::Values(std::numeric_limits<float>::infinity(),
                                           -std::numeric_limits<float>::infinity(),
                                           std::numeric_limits<float>::quiet_NaN()));

// A scaled gradient that is finite in fp32 but overflows when divided by a scale below 1
// (3e38 / 0.5 = inf) is found too: the check is on the unscaled values.
TEST(LossScaler, OverflowInTheDivisionIsNonFinite) {
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  LossScaler scaler(world);
  scaler.restore(0.5, 0);
  std::vector<ShardedTensor> grads = make_gradients();
  fill_scaled(grads, 0.5);
  if (world_rank() == world_size() - 1) Kokkos::deep_copy(grads[1].local, 3e38f);
  EXPECT_FALSE(scaler.unscale(grads));
}

}  // namespace
}  // namespace meshtrain
