// ResidualBlock (layers/residual_block.hpp): y = x + f(x) with f(x) = tanh(x W1 + b1) W2 + b2
// (up and down projection, W1 [8, 16], W2 [16, 8]; 8 rows), on every mesh of np 1, 2 and 4 (dp,
// fsdp, tp; at 4 also fsdp x tp and dp x tp), against a float64 reference computed here from the
// same values: the forward output, the input gradient and every parameter gradient, for a backward
// that reduces at once, one that leaves the gradients partial (completed by the model's
// GradientReductionPlan) and one through the DP gradient buckets. The loss is
// sum(R * y) over the global batch for a fixed R, so dY = R and every gradient is a sum
// over ranks that equals the single-rank one.
// Tolerance: |got - ref| <= 1e-5 (1 + |ref|) (float32 sums of at most 16 terms of O(1)).
// Also: the step allocates nothing, and a block whose layers do not end in its input's
// layout is refused.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "layers/activation.hpp"
#include "layers/context.hpp"
#include "layers/gradient_buckets.hpp"
#include "layers/gradient_reduction.hpp"
#include "layers/linear.hpp"
#include "layers/residual_block.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/layers/full_tensor.hpp"
#include "tests/test_support.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;

constexpr int64_t kRows = 8, kWidth = 8, kHidden = 16;
constexpr double kTolerance = 1e-5;

// Every value as float, so that the reference sees exactly what the layers see.
double parameter_value(int k, int64_t i, int64_t j) {
  return static_cast<float>(0.3 * std::sin(0.7 * i + 1.1 * j + 0.5 * k));
}
double input_value(int64_t r, int64_t c) {
  return static_cast<float>(std::cos(0.37 * r + 0.91 * c));
}
double loss_weight(int64_t r, int64_t c) {
  return static_cast<float>(std::sin(0.53 * r - 0.29 * c + 0.1));
}

int64_t g_allocations = 0;
void count_allocation(const Kokkos_Profiling_SpaceHandle, const char*, const void*,
                      const uint64_t) {
  ++g_allocations;
}

// The block's parameters: up [W, H], [H]; down [H, W], [W].
std::vector<ParameterShape> block_shapes() {
  return {{"blocks/0/up/weight", {kWidth, kHidden}},
          {"blocks/0/up/bias", {kHidden}},
          {"blocks/0/down/weight", {kHidden, kWidth}},
          {"blocks/0/down/bias", {kWidth}}};
}

void fill(ShardedTensor& t, int k) {
  auto h = Kokkos::create_mirror_view(t.local);
  const bool matrix = t.global_shape.size() == 2;
  const int64_t cols = matrix ? t.box.extent[1] : 1;
  for (int64_t l = 0; l < static_cast<int64_t>(h.extent(0)); ++l) {
    h(l) = matrix ? static_cast<float>(
                        parameter_value(k, t.box.offset[0] + l / cols, t.box.offset[1] + l % cols))
                  : static_cast<float>(parameter_value(k, 0, t.box.offset[0] + l));
  }
  Kokkos::deep_copy(t.local, h);
}

Tensor full_parameter(int k, int64_t rows, int64_t cols) {
  Tensor t(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      t[i * cols + j] = rows == 1 ? parameter_value(k, 0, j) : parameter_value(k, i, j);
  return t;
}

struct Reference {
  Tensor y, dx, dw1, db1, dw2, db2;  // [R, W], [R, W], [W, H], [H], [H, W], [W]
};

Reference reference() {
  const Tensor w1 = full_parameter(0, kWidth, kHidden), b1 = full_parameter(1, 1, kHidden);
  const Tensor w2 = full_parameter(2, kHidden, kWidth), b2 = full_parameter(3, 1, kWidth);
  Reference r;
  r.y.assign(kRows * kWidth, 0.0);
  r.dx.assign(kRows * kWidth, 0.0);
  r.dw1.assign(kWidth * kHidden, 0.0);
  r.db1.assign(kHidden, 0.0);
  r.dw2.assign(kHidden * kWidth, 0.0);
  r.db2.assign(kWidth, 0.0);
  for (int64_t i = 0; i < kRows; ++i) {
    std::vector<double> a(kHidden), dh(kHidden);
    for (int64_t h = 0; h < kHidden; ++h) {
      double z = b1[h];
      for (int64_t c = 0; c < kWidth; ++c) z += input_value(i, c) * w1[c * kHidden + h];
      a[h] = std::tanh(z);
    }
    for (int64_t c = 0; c < kWidth; ++c) {
      double f = b2[c];
      for (int64_t h = 0; h < kHidden; ++h) f += a[h] * w2[h * kWidth + c];
      r.y[i * kWidth + c] = input_value(i, c) + f;
      const double g = loss_weight(i, c);  // dY
      r.db2[c] += g;
      for (int64_t h = 0; h < kHidden; ++h) r.dw2[h * kWidth + c] += a[h] * g;
    }
    for (int64_t h = 0; h < kHidden; ++h) {
      double da = 0.0;
      for (int64_t c = 0; c < kWidth; ++c) da += loss_weight(i, c) * w2[h * kWidth + c];
      dh[h] = da * (1.0 - a[h] * a[h]);
      r.db1[h] += dh[h];
      for (int64_t c = 0; c < kWidth; ++c) r.dw1[c * kHidden + h] += input_value(i, c) * dh[h];
    }
    for (int64_t c = 0; c < kWidth; ++c) {
      double dx = loss_weight(i, c);  // the residual's part
      for (int64_t h = 0; h < kHidden; ++h) dx += dh[h] * w1[c * kHidden + h];
      r.dx[i * kWidth + c] = dx;
    }
  }
  return r;
}

void expect_close(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - ref[i]) > kTolerance * (1.0 + std::abs(ref[i])) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << ", reference " << ref[i];
    }
  }
}

// This rank's block [rows, width] of a global [R, W] matrix from its first row and column.
Tensor local_block(const Tensor& full, int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
  Tensor t(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[i * cols + j] = full[(row0 + i) * kWidth + col0 + j];
  return t;
}

Tensor host(MatrixView m) {
  Matrix copy("copy", m.extent(0), m.extent(1));
  Kokkos::deep_copy(copy, m);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), copy);
  return Tensor(h.data(), h.data() + h.span());
}

struct MeshCase {
  std::vector<std::pair<std::string, int>> axes;
  std::string preset;
};

std::vector<MeshCase> mesh_cases() {
  const int n = world_size();
  std::vector<MeshCase> cases = {{{{"dp", n}}, "dp"}, {{{"fsdp", n}}, "fsdp"}, {{{"tp", n}}, "tp"}};
  if (n == 4) {
    cases.push_back({{{"fsdp", 2}, {"tp", 2}}, "fsdp_tp"});
    cases.push_back({{{"dp", 2}, {"tp", 2}}, "dp_tp"});
  }
  return cases;
}

TEST(ResidualBlock, EqualsTheFloat64ReferenceOnEveryMesh) {
  const int n = world_size();
  const Reference ref = reference();
  for (const MeshCase& c : mesh_cases()) {
    SCOPED_TRACE(c.preset + " at np " + std::to_string(n));
    const Mesh mesh = Mesh::create(c.axes, n);
    MeshCommunicators comms(mesh);
    ParallelContext context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional);
    const ShardingPlan plan =
        make_plan(block_shapes(), mesh, preset_rules(c.preset), PlanOptions{0});
    std::vector<ShardedTensor> params, grads;
    for (const ParameterShape& p : block_shapes()) {
      const PartitionSpec spec = plan.find(p.name).spec;
      params.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
      grads.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
    }
    for (size_t k = 0; k < params.size(); ++k) fill(params[k], static_cast<int>(k));
    auto ref_of = [&](size_t k) { return ParameterRef{&params[k], &grads[k]}; };

    // Under tp the block is fed split features: both projections are tensor parallel.
    const int tp = context.feature_parallel();
    const FeatureLayout layout = tp > 1 ? FeatureLayout::split : FeatureLayout::replicated;
    const int64_t width = kWidth / tp, col0 = context.feature_index() * width;
    const int64_t rows = kRows / context.batch_parallel(), row0 = context.batch_index() * rows;
    std::vector<std::unique_ptr<Layer>> f;
    auto up = std::make_unique<Linear>(ref_of(0), ref_of(1), layout, rows, context);
    f.push_back(std::make_unique<ActivationLayer>(Activation::tanh, "blocks/0/activation", rows,
                                                  up->output_width(), up->output_layout(),
                                                  up->output_offset(), Dtype::fp32));
    auto down = std::make_unique<Linear>(ref_of(2), ref_of(3), up->output_layout(), rows, context);
    f.insert(f.begin(), std::move(up));
    f.push_back(std::move(down));
    ResidualBlock block("blocks/0", std::move(f), layout, col0, rows, width, Dtype::fp32);
    EXPECT_EQ(block.parameter_count(), 4u);
    EXPECT_NE(block.describe().find("blocks/0/down"), std::string::npos) << block.describe();

    // The model's decision, as for any layer: a DP block leaves its gradients partial.
    std::vector<Layer*> sequence = {&block};
    const GradientReductionPlan reductions(sequence);
    EXPECT_EQ(reductions.layer_group(0) != nullptr, c.preset == "dp" && n > 1);
    GradientBuckets buckets(reductions.bucket_gradients(), /*bucket_mb=*/1e-4);  // several
    LayerScratch scratch(block.scratch_needs());

    Matrix x("x", rows, width), dy("dy", rows, width);
    auto xh = Kokkos::create_mirror_view(x);
    auto dyh = Kokkos::create_mirror_view(dy);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < width; ++j) {
        xh(i, j) = static_cast<float>(input_value(row0 + i, col0 + j));
        dyh(i, j) = static_cast<float>(loss_weight(row0 + i, col0 + j));
      }
    }
    Kokkos::deep_copy(x, xh);
    const Tensor y_ref = local_block(ref.y, row0, rows, col0, width);
    const Tensor dx_ref = local_block(ref.dx, row0, rows, col0, width);

    for (DeferredReduction mode :
         {DeferredReduction::now, DeferredReduction::later, DeferredReduction::in_buckets}) {
      const DeferredReduction deferred =
          buckets.empty() ? DeferredReduction::now : reductions.for_layer(0, mode);
      SCOPED_TRACE("backward mode " + std::to_string(static_cast<int>(mode)));
      MatrixView y, dx;
      auto step = [&] {
        Kokkos::deep_copy(dy, dyh);
        y = block.forward(x, {&scratch});
        dx = block.backward(dy, /*need_input_grad=*/true,
                            {&scratch, nullptr, deferred, &buckets, 0, 1.0f});
        if (deferred == DeferredReduction::in_buckets) buckets.wait_all();
        if (deferred == DeferredReduction::later) reductions.all_reduce_deferred();
      };
      step();  // warm-up, then the counted one
      g_allocations = 0;
      Kokkos::Tools::Experimental::set_allocate_data_callback(count_allocation);
      step();
      Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
      EXPECT_EQ(g_allocations, 0) << "Kokkos allocations in the block's forward and backward";

      expect_close(host(y), y_ref, "y");
      expect_close(host(dx), dx_ref, "dX");
      expect_close(testing::gather_full(grads[0], mesh, context.rank()), ref.dw1, "dW1");
      expect_close(testing::gather_full(grads[1], mesh, context.rank()), ref.db1, "db1");
      expect_close(testing::gather_full(grads[2], mesh, context.rank()), ref.dw2, "dW2");
      expect_close(testing::gather_full(grads[3], mesh, context.rank()), ref.db2, "db2");
    }
  }
}

TEST(ResidualBlock, LayersThatDoNotEndInTheInputsLayoutAreRefused) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a feature axis of size > 1";
  const Mesh mesh = Mesh::create({{"tp", n}}, n);
  MeshCommunicators comms(mesh);
  ParallelContext context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional);
  // The up projection tensor parallel, the down one replicated: f ends with all features.
  const std::vector<std::string> specs = {"P(tp, None)", "P(tp)", "P()", "P()"};
  std::vector<ShardedTensor> params, grads;
  const std::vector<ParameterShape> shapes = block_shapes();
  for (size_t k = 0; k < shapes.size(); ++k) {
    const PartitionSpec spec = PartitionSpec::parse(specs[k]);
    params.push_back(
        ShardedTensor::allocate(shapes[k].name, shapes[k].shape, spec, mesh, context.rank()));
    grads.push_back(
        ShardedTensor::allocate(shapes[k].name, shapes[k].shape, spec, mesh, context.rank()));
  }
  const int64_t rows = kRows, width = kWidth / n, col0 = context.feature_index() * width;
  std::vector<std::unique_ptr<Layer>> f;
  f.push_back(std::make_unique<Linear>(ParameterRef{&params[0], &grads[0]},
                                       ParameterRef{&params[1], &grads[1]}, FeatureLayout::split,
                                       rows, context));
  f.push_back(std::make_unique<Linear>(ParameterRef{&params[2], &grads[2]},
                                       ParameterRef{&params[3], &grads[3]},
                                       f.front()->output_layout(), rows, context));
  EXPECT_EQ(f.back()->output_layout(), FeatureLayout::replicated);
  testing::expect_bad_input(
      [&] {
        ResidualBlock("blocks/0", std::move(f), FeatureLayout::split, col0, rows, width,
                      Dtype::fp32);
      },
      {"residual block 'blocks/0'", "x + f(x)", "replicated", "split"});
}

}  // namespace
}  // namespace meshtrain
