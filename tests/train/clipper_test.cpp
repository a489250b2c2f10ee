// Global-norm gradient clipping when a gradient is not finite (issue 9, bug 4): a NaN
// norm used to pass the clipper (`norm > max_norm` is false for NaN, and the norm was
// returned as 0) and an infinite one scaled every gradient by 0 (inf * 0 = NaN). Now the
// norm comes back NaN / infinite, nothing is scaled, and every rank names the same
// gradient. An FSDP model on a mesh of the whole world, one element poisoned on the last
// rank; the finite case is checked against the single-rank reference (all ones: the norm
// is the square root of the number of global elements).

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/precision.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/mlp.hpp"
#include "partition/logical_axes.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

const std::vector<int64_t> kSizes = {8, 16, 4};

void fill(std::vector<ShardedTensor>& tensors, float value) {
  for (auto& t : tensors) Kokkos::deep_copy(t.local, value);
}

void expect_all(const ShardedTensor& t, float value) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.local);
  for (size_t i = 0; i < host.extent(0); ++i) {
    ASSERT_EQ(host(i), value) << t.name << "[" << i << "] was scaled";
  }
}

class ClipperTest : public ::testing::TestWithParam<float> {};

TEST_P(ClipperTest, NonFiniteNormIsReturnedNamedAndNotScaled) {
  const float poison = GetParam();
  const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
  PlanOptions options;
  options.min_sharding_size = 0;
  const ShardingPlan plan =
      make_plan(mlp_parameter_shapes(kSizes), mesh, preset_rules("fsdp"), options);
  MeshCommunicators comms(mesh);
  ParallelContext context = ParallelContext::from_logical_axes(comms, LogicalAxes());
  Mlp model(kSizes, Activation::relu, specs_from_plan(plan), context, 4);
  std::vector<ShardedTensor>& grads = model.gradients();
  GradientClipper clipper(mesh, world_rank(), grads);
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");

  // Finite: every element 1, so the norm is sqrt(global elements) as on one rank.
  int64_t elements = 0;
  for (const auto& g : grads) {
    int64_t n = 1;
    for (int64_t d : g.global_shape) n *= d;
    elements += n;
  }
  fill(grads, 1.0f);
  EXPECT_NEAR(clipper.clip(grads, 1e9, world), std::sqrt(static_cast<double>(elements)), 1e-9);
  EXPECT_EQ(clipper.non_finite_gradient(), "");

  // One element of the second layer's weight, on the last rank only.
  const size_t poisoned = 2;
  ASSERT_EQ(grads[poisoned].name, "layers/1/weight");
  if (world_rank() == world_size() - 1) {
    ASSERT_GT(grads[poisoned].local.extent(0), 0u);
    Kokkos::deep_copy(Kokkos::subview(grads[poisoned].local, std::make_pair(0, 1)), poison);
  }
  const double norm = clipper.clip(grads, 1.0, world);
  EXPECT_FALSE(std::isfinite(norm)) << "norm " << norm;
  EXPECT_EQ(std::isnan(norm), std::isnan(poison)) << "norm " << norm;
  EXPECT_EQ(clipper.non_finite_gradient(), "layers/1/weight");
  expect_all(grads[0], 1.0f);  // not scaled by max_norm / norm

  // A finite norm afterwards clears the name.
  fill(grads, 1.0f);
  EXPECT_TRUE(std::isfinite(clipper.clip(grads, 1e9, world)));
  EXPECT_EQ(clipper.non_finite_gradient(), "");
}

// A gradient stored as 16 bits (Mlp::store_gradients_16bit): the norm reads it widened, the same
// double sum as of an fp32 gradient holding the same (bf16) values, on every rank; scaling it
// would leave values bf16 does not hold, so clip() refuses (runs that clip keep fp32 gradients).
TEST(Clipper, ReadsA16BitStoredGradientWidenedAndRefusesToScaleIt) {
  const Mesh mesh = Mesh::create({{"dp", world_size()}}, world_size());
  const int64_t rows = 7, cols = 5;
  std::vector<ShardedTensor> fp32 = {
      ShardedTensor::allocate("w", {rows, cols}, PartitionSpec(), mesh, world_rank())};
  std::vector<ShardedTensor> sixteen = {
      ShardedTensor::allocate("w", {rows, cols}, PartitionSpec(), mesh, world_rank(), Dtype::bf16)};
  // Multiples of 1/8 in [-2, 2]: bf16 values, so packing is exact.
  auto host = Kokkos::create_mirror_view(fp32[0].local);
  for (int64_t i = 0; i < rows * cols; ++i) host(i) = static_cast<float>(i % 33 - 16) / 8.0f;
  Kokkos::deep_copy(fp32[0].local, host);
  pack_16bit(fp32[0].local.data(), sixteen[0].bits.data(), rows * cols, Dtype::bf16);
  Kokkos::fence();
  MpiCommunicator world = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  GradientClipper clip_fp32(mesh, world_rank(), fp32), clip_16(mesh, world_rank(), sixteen);
  const double expected = clip_fp32.global_norm(fp32, world);
  EXPECT_GT(expected, 0.0);
  EXPECT_EQ(clip_16.global_norm(sixteen, world), expected);
  EXPECT_EQ(clip_16.clip(sixteen, 2.0 * expected, world), expected);  // below: nothing scaled
  EXPECT_THROW(clip_16.clip(sixteen, 0.5 * expected, world), Error);
}

INSTANTIATE_TEST_SUITE_P(Poison, ClipperTest,
                         ::testing::Values(std::numeric_limits<float>::quiet_NaN(),
                                           std::numeric_limits<float>::infinity()),
                         [](const auto& info) { return std::isnan(info.param) ? "nan" : "inf"; });

}  // namespace
}  // namespace meshtrain
