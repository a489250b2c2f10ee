// Initialization gives the same global tensor on every mesh: each rank's block under a
// spec equals, exactly (bit for bit), the same block of the tensor generated unsharded.
// Runs at NP 1, 2, 4, 8 over every mesh of that size below.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "framework/train/init.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

std::vector<Mesh> meshes_for(int n) {
  std::vector<std::vector<std::pair<std::string, int>>> shapes = {
      {{"dp", n}},
      {{"fsdp", n}},
      {{"tp", n}},
      {{"fsdp", -1}, {"tp", 2}},
      {{"dp", 2}, {"fsdp", -1}},
      {{"dp", 2}, {"tp", -1}},
      {{"dp", 2}, {"fsdp", 2}, {"tp", -1}}};
  std::vector<Mesh> out;
  for (const auto& s : shapes) {
    int fixed = 1;
    for (const auto& a : s) fixed *= a.second > 0 ? a.second : 1;
    if (n % fixed != 0) continue;
    out.push_back(Mesh::create(s, n));
  }
  return out;
}

// Every spec below whose split dims divide for the mesh.
const std::vector<std::string> kWeightSpecs = {
    "P()",         "P(fsdp, None)",      "P(tp, None)", "P(tp, fsdp)",
    "P(None, tp)", "P((fsdp,dp), None)", "P(dp, tp)",   "P((tp,fsdp), dp)"};
const std::vector<std::string> kBiasSpecs = {"P()", "P(tp)", "P(fsdp)", "P((fsdp,tp))", "P(dp)"};

bool divides(const std::vector<int64_t>& shape, const PartitionSpec& spec, const Mesh& mesh) {
  for (size_t d = 0; d < spec.size(); ++d) {
    if (shape[d] % mesh.size_of(spec.entries[d].axes) != 0) return false;
  }
  return true;
}

void expect_block_of_full(const std::string& name, const std::vector<int64_t>& shape,
                          const std::string& spec_text, const Mesh& mesh, InitScheme scheme) {
  const PartitionSpec spec = PartitionSpec::parse(spec_text);
  for (const auto& axis : spec.axes()) {
    if (!mesh.has_axis(axis)) return;
  }
  if (!divides(shape, spec, mesh)) return;
  const int rank = world_rank();
  ShardedTensor full = ShardedTensor::allocate(name, shape, PartitionSpec(), mesh, rank);
  ShardedTensor shard = ShardedTensor::allocate(name, shape, spec, mesh, rank);
  initialize(full, scheme, 1234);
  initialize(shard, scheme, 1234);
  auto f = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), full.local);
  auto s = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), shard.local);
  const int64_t cols = shape.size() == 2 ? shape[1] : 1;
  const int64_t local_cols = shape.size() == 2 ? shard.box.extent[1] : 1;
  const int64_t col_offset = shape.size() == 2 ? shard.box.offset[1] : 0;
  int64_t mismatches = 0;
  for (int64_t i = 0; i < shard.box.elements(); ++i) {
    const int64_t r = shape.size() == 2 ? i / local_cols + shard.box.offset[0] : 0;
    const int64_t c = shape.size() == 2 ? i % local_cols + col_offset : i + shard.box.offset[0];
    const float expected = f(r * cols + c);
    if (s(i) != expected) ++mismatches;  // exact: the same function of the same index
  }
  EXPECT_EQ(mismatches, 0) << name << " " << spec_text << " on " << mesh.describe() << " ("
                           << to_string(scheme) << ")";
}

TEST(Init, ShardsAreBlocksOfTheUnshardedTensor) {
  for (const Mesh& mesh : meshes_for(world_size())) {
    // normal draws (he_normal differs only by the scale) and uniform draws.
    for (InitScheme scheme : {InitScheme::normal, InitScheme::xavier_uniform}) {
      for (const auto& spec : kWeightSpecs) {
        expect_block_of_full("layers/0/weight", {784, 128}, spec, mesh, scheme);
        expect_block_of_full("layers/1/weight", {64, 8}, spec, mesh, scheme);
      }
      for (const auto& spec : kBiasSpecs) {
        expect_block_of_full("layers/0/bias", {128}, spec, mesh, scheme);
      }
    }
  }
}

// Statistics of the schemes, on one unsharded tensor (tolerances: 3% of the target std,
// mean within 3 standard errors and a bit).
TEST(Init, SchemesHaveTheDocumentedDistribution) {
  const Mesh mesh = Mesh::single();
  auto stats = [&](InitScheme scheme, const std::string& name, std::vector<int64_t> shape) {
    ShardedTensor t = ShardedTensor::allocate(name, shape, PartitionSpec(), mesh, 0);
    initialize(t, scheme, 7);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.local);
    double sum = 0, sq = 0, lo = 1e30, hi = -1e30;
    const int64_t n = static_cast<int64_t>(h.extent(0));
    for (int64_t i = 0; i < n; ++i) {
      sum += h(i);
      sq += double(h(i)) * h(i);
      lo = std::min(lo, double(h(i)));
      hi = std::max(hi, double(h(i)));
    }
    const double mean = sum / n;
    return std::vector<double>{mean, std::sqrt(sq / n - mean * mean), lo, hi};
  };
  auto he = stats(InitScheme::he_normal, "w", {784, 128});
  EXPECT_NEAR(he[1], std::sqrt(2.0 / 784), 0.03 * std::sqrt(2.0 / 784));
  EXPECT_NEAR(he[0], 0.0, 4 * std::sqrt(2.0 / 784) / std::sqrt(784.0 * 128));
  auto normal = stats(InitScheme::normal, "w", {784, 128});
  EXPECT_NEAR(normal[1], 1.0 / 28.0, 0.03 / 28.0);
  auto xavier = stats(InitScheme::xavier_uniform, "w", {784, 128});
  const double a = std::sqrt(6.0 / (784 + 128));
  EXPECT_GE(xavier[2], -a);
  EXPECT_LE(xavier[3], a);
  EXPECT_NEAR(xavier[1], a / std::sqrt(3.0), 0.03 * a / std::sqrt(3.0));
  auto he_bias = stats(InitScheme::he_normal, "b", {128});
  EXPECT_EQ(he_bias[2], 0.0);
  EXPECT_EQ(he_bias[3], 0.0);
  auto normal_bias = stats(InitScheme::normal, "b", {4096});
  EXPECT_NEAR(normal_bias[1], 1.0, 0.05);
  // Different names give different tensors; the same name and seed the same one.
  EXPECT_NE(counter_normal(1, name_stream("a"), 0), counter_normal(1, name_stream("b"), 0));
  EXPECT_NE(counter_normal(1, name_stream("a"), 0), counter_normal(2, name_stream("a"), 0));
  EXPECT_EQ(counter_normal(1, name_stream("a"), 5), counter_normal(1, name_stream("a"), 5));
}

TEST(Init, UnknownSchemeIsBadInput) {
  testing::expect_bad_input([] { parse_init_scheme("kaiming", "model.init"); },
                            {"model.init", "kaiming"});
  EXPECT_EQ(parse_init_scheme("xavier_uniform"), InitScheme::xavier_uniform);
}

}  // namespace
}  // namespace meshtrain
