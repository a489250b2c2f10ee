// ResidualBlock (layers/residual_block.hpp), y = x + f(x) with f(x) = tanh(x W1 + b1) W2 + b2
// (up and down projection, W1 [8, 16], W2 [16, 8]), between an input projection [8, 8] and an
// output projection [8, 4], driven as Mlp drives its sequence, on every mesh of np 1, 2 and 4
// (dp, fsdp, tp; at 4 also fsdp x tp and dp x tp), overlap off and on (FSDP prefetch across the
// block, DP buckets), against a float64 reference computed here from the same values: the
// output and every parameter gradient (the block's input gradient reaches the input
// projection's), for a backward that reduces at once, one that leaves the gradients partial
// (completed by the model's GradientReductionPlan) and, with overlap, one through the DP
// buckets. The loss is sum(R * out) over the global batch (8 rows) for a fixed R, so dOut = R
// and every gradient is a sum over ranks that equals the single-rank one.
// Tolerance: |got - ref| <= 1e-5 (1 + |ref|) (float32 sums of at most 16 terms of O(1)).
// The reference's backward is checked against central differences of its forward.
// Also: the steps allocate nothing (the bucketed one only where MPI is not staged through host
// memory, see there), and a block whose layers do not end in its input's layout is refused.

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
#include "tests/support/backend.hpp"
#include "tests/support/expect_close.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/layer_test_data.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/reference_linear.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;

constexpr int64_t kRows = 8, kIn = 8, kWidth = 8, kHidden = 16, kOut = 4;
constexpr double kTolerance = 1e-5;

// Every value as float, so that the reference sees exactly what the layers see.
double parameter_value(int k, int64_t i, int64_t j) {
  return static_cast<float>(testing::parameter_wave(k, i, j));
}
double input_value(int64_t r, int64_t c) {
  return static_cast<float>(std::cos(0.37 * r + 0.91 * c));
}
using testing::loss_weight;

// The model's parameters, in order: input [I, W], [W]; the block's up [W, H], [H] and down
// [H, W], [W]; output [W, O], [O].
std::vector<ParameterShape> model_shapes() {
  return {{"input/weight", {kIn, kWidth}},
          {"input/bias", {kWidth}},
          {"blocks/0/up/weight", {kWidth, kHidden}},
          {"blocks/0/up/bias", {kHidden}},
          {"blocks/0/down/weight", {kHidden, kWidth}},
          {"blocks/0/down/bias", {kWidth}},
          {"output/weight", {kWidth, kOut}},
          {"output/bias", {kOut}}};
}

void fill(ShardedTensor& t, int k) {
  const int64_t cols = t.global_shape.back();
  const bool matrix = t.global_shape.size() == 2;
  testing::fill_global(t, [&](int64_t flat) {
    return matrix ? parameter_value(k, flat / cols, flat % cols) : parameter_value(k, 0, flat);
  });
}

// Parameter k in full: [rows, cols], a vector as rows = 1.
Tensor full_parameter(int k, int64_t rows, int64_t cols) {
  Tensor t(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[i * cols + j] = parameter_value(k, rows == 1 ? 0 : i, j);
  return t;
}

using testing::affine;
using testing::affine_backward;

// The model input -> input projection -> u + f(u), f(u) = tanh(u W1 + b1) W2 + b2 -> output
// projection, in double; loss sum(R * out): dOut = R.
struct Reference {
  Tensor out;                  // [R, O]
  std::vector<Tensor> grad;    // per parameter, in model_shapes() order
  std::vector<Tensor> values;  // the parameters it was computed with, in the same order

  // sum(R * out), whose gradient `grad` is.
  double loss() const { return testing::weighted_loss(out, kRows); }
};

// For the parameters parameter_value gives, or for `values` (in model_shapes() order).
Reference reference(const std::vector<Tensor>* values = nullptr) {
  const std::vector<ParameterShape> shapes = model_shapes();
  std::vector<Tensor> p;
  Reference r;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const std::vector<int64_t>& s = shapes[k].shape;
    if (values) {
      p.push_back((*values)[k]);
    } else {
      p.push_back(s.size() == 2 ? full_parameter(static_cast<int>(k), s[0], s[1])
                                : full_parameter(static_cast<int>(k), 1, s[0]));
    }
    r.grad.emplace_back(p.back().size(), 0.0);
  }
  r.values = p;
  r.out.assign(kRows * kOut, 0.0);
  for (int64_t i = 0; i < kRows; ++i) {
    std::vector<double> x(kIn), dout(kOut);
    for (int64_t c = 0; c < kIn; ++c) x[c] = input_value(i, c);
    for (int64_t o = 0; o < kOut; ++o) dout[o] = loss_weight(i, o);
    const std::vector<double> u = affine(x, p[0], p[1]);
    std::vector<double> a = affine(u, p[2], p[3]);
    for (double& v : a) v = std::tanh(v);
    std::vector<double> y = affine(a, p[4], p[5]);
    for (int64_t c = 0; c < kWidth; ++c) y[c] += u[c];  // the residual
    const std::vector<double> out = affine(y, p[6], p[7]);
    for (int64_t o = 0; o < kOut; ++o) r.out[i * kOut + o] = out[o];
    const std::vector<double> dy = affine_backward(y, p[6], r.grad[6], r.grad[7], dout);
    std::vector<double> dh = affine_backward(a, p[4], r.grad[4], r.grad[5], dy);
    for (int64_t h = 0; h < kHidden; ++h) dh[h] *= 1.0 - a[h] * a[h];
    std::vector<double> du = affine_backward(u, p[2], r.grad[2], r.grad[3], dh);
    for (int64_t c = 0; c < kWidth; ++c) du[c] += dy[c];  // the residual's part
    affine_backward(x, p[0], r.grad[0], r.grad[1], du);
  }
  return r;
}

void expect_close(const Tensor& got, const Tensor& ref, const std::string& what) {
  testing::expect_close_to_reference(got, ref, kTolerance, what);
}

using testing::MeshCase;

// dp, fsdp, tp; at np 4 also fsdp x tp and dp x tp.
std::vector<MeshCase> mesh_cases() {
  return testing::layer_meshes(world_size());
}

// The reference's hand-derived backward (tanh, and the residual add: the block's input gradient
// is its layers' plus dY) is the derivative of its forward: every parameter gradient against
// central differences in float64 of sum(R * out). Step h = 1e-5 (parameters of O(0.3)):
// truncation and rounding (|L| ~ 5) are each below 1e-9 (measured largest difference
// printed); tolerance 1e-7 (1 + |g|), far below a missing term (the residual's dY moves the
// input projection's gradients by O(1)). The reference does not depend on the ranks: checked
// once, at np 1.
TEST(ResidualBlock, ReferenceGradientsMatchCentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "the float64 reference alone: checked at np 1";
  constexpr double kStep = 1e-5, kFdTolerance = 1e-7;
  const Reference ref = reference();
  std::vector<std::string> names;
  for (const ParameterShape& p : model_shapes()) names.push_back(p.name);
  const testing::Tensors numeric = testing::central_differences(
      ref.values, [](const testing::Tensors& v) { return reference(&v).loss(); }, kStep);
  const double worst =
      testing::expect_matches_central_differences(numeric, ref.grad, kFdTolerance, names);
  std::printf(
      "[ residual_block ] reference gradients vs central differences: largest "
      "|fd - g| / (1 + |g|) %.2e (tolerance %.0e)\n",
      worst, kFdTolerance);
}

// input Linear, the block, output Linear, driven as Mlp drives its sequence (prefetch with
// overlap, the reduction plan, the buckets), with the block in the middle: under tp the
// input projection hands it split features, and the output projection takes them split.
TEST(ResidualBlock, EqualsTheFloat64ReferenceOnEveryMesh) {
  const int n = world_size();
  const Reference ref = reference();
  for (const MeshCase& c : mesh_cases()) {
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(c.preset + " at np " + std::to_string(n) + (overlap ? ", overlap" : ""));
      const Mesh mesh = Mesh::create(c.axes, n);
      MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
      ParallelContext context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional,
                              overlap);
      const ShardingPlan plan =
          make_plan(model_shapes(), mesh, preset_rules(c.preset), PlanOptions{0});
      std::vector<ShardedTensor> params, grads;
      for (const ParameterShape& p : model_shapes()) {
        const PartitionSpec spec = plan.find(p.name).spec;
        params.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
        grads.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
      }
      for (size_t k = 0; k < params.size(); ++k) fill(params[k], static_cast<int>(k));
      auto ref_of = [&](size_t k) { return ParameterRef{&params[k], &grads[k]}; };

      const int64_t rows = kRows / context.batch_parallel(), row0 = context.batch_index() * rows;
      Linear input(ref_of(0), ref_of(1), FeatureLayout::replicated, rows, context);
      const FeatureLayout layout = input.output_layout();
      EXPECT_EQ(layout == FeatureLayout::split, context.feature_parallel() > 1);
      std::vector<std::unique_ptr<Layer>> f;
      auto up = std::make_unique<Linear>(ref_of(2), ref_of(3), layout, rows, context);
      auto activation = std::make_unique<ActivationLayer>(
          Activation::tanh, "blocks/0/activation", rows, up->output_width(), up->output_layout(),
          up->output_offset(), Dtype::fp32);
      auto down =
          std::make_unique<Linear>(ref_of(4), ref_of(5), up->output_layout(), rows, context);
      f.push_back(std::move(up));
      f.push_back(std::move(activation));
      f.push_back(std::move(down));
      ResidualBlock block("blocks/0", std::move(f), layout, input.output_offset(), rows,
                          input.output_width(), Dtype::fp32);
      Linear output(ref_of(6), ref_of(7), block.output_layout(), rows, context);
      EXPECT_EQ(block.parameter_count(), 4u);
      EXPECT_NE(block.describe().find("blocks/0/down"), std::string::npos) << block.describe();

      // As Mlp: the model's reduction plan, the buckets, the prefetch of the next layer with
      // parameters (the block passes it on to its own layers; it is not prefetched itself).
      std::vector<Layer*> sequence = {&input, &block, &output};
      const GradientReductionPlan reductions(sequence);
      // A DP block leaves its gradients partial, as the Linears around it do.
      EXPECT_EQ(reductions.layer_group(1) != nullptr, c.preset == "dp" && n > 1);
      EXPECT_EQ(reductions.layer_group(1), reductions.layer_group(0));
      GradientBuckets buckets;
      if (overlap) buckets = GradientBuckets(reductions.bucket_gradients(), /*bucket_mb=*/1e-4);
      Layer* forward_prefetch[3] = {nullptr, output.can_prefetch_weight() ? &output : nullptr,
                                    nullptr};
      Layer* backward_prefetch[3] = {nullptr, input.can_prefetch_weight() ? &input : nullptr,
                                     nullptr};
      if (!overlap) forward_prefetch[1] = backward_prefetch[1] = nullptr;
      EXPECT_EQ(overlap && c.preset.find("fsdp") != std::string::npos && n > 1,
                forward_prefetch[1] != nullptr);
      LayerScratchNeeds needs;
      for (Layer* layer : sequence) needs.merge(layer->scratch_needs());
      LayerScratch scratch(needs, forward_prefetch[1] || backward_prefetch[1]);

      Matrix x("x", rows, kIn), dout("dout", rows, output.output_width());
      auto xh = Kokkos::create_mirror_view(x);
      auto douth = Kokkos::create_mirror_view(dout);
      const int64_t out_cols = output.output_width(), out0 = output.output_offset();
      Tensor out_ref(rows * out_cols);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < kIn; ++j) xh(i, j) = static_cast<float>(input_value(row0 + i, j));
        for (int64_t j = 0; j < out_cols; ++j) {
          douth(i, j) = static_cast<float>(loss_weight(row0 + i, out0 + j));
          out_ref[i * out_cols + j] = ref.out[(row0 + i) * kOut + out0 + j];
        }
      }
      Kokkos::deep_copy(x, xh);

      for (DeferredReduction mode :
           {DeferredReduction::now, DeferredReduction::later, DeferredReduction::in_buckets}) {
        if (mode == DeferredReduction::in_buckets && buckets.empty()) continue;
        SCOPED_TRACE("backward mode " + std::to_string(static_cast<int>(mode)));
        MatrixView out;
        auto step = [&] {
          Kokkos::deep_copy(dout, douth);
          MatrixView h = x;
          for (size_t k = 0; k < sequence.size(); ++k) {
            h = sequence[k]->forward(h, {&scratch, forward_prefetch[k]});
          }
          out = h;
          MatrixView g = dout;
          for (size_t k = sequence.size(); k-- > 0;) {
            const LayerPass pass{
                &scratch, backward_prefetch[k], reductions.for_layer(k, mode), &buckets, k, 1.0f};
            g = sequence[k]->backward(g, /*need_input_grad=*/k > 0, pass);
          }
          if (mode == DeferredReduction::in_buckets) buckets.wait_all();
          if (mode == DeferredReduction::later) reductions.all_reduce_deferred();
        };
        step();  // warm-up, then the counted one
        testing::KokkosAllocationCounter allocations;
        step();
        allocations.stop();
        // Also where MPI is staged through host buffers (device memory, or its emulation)
        // and the buckets are in flight: each bucket reserves its request slot (with its
        // staging) when the buckets are built, whatever order they complete in.
        EXPECT_EQ(allocations.count(), 0)
            << "Kokkos allocations in forward and backward:" << allocations.described();

        expect_close(testing::host_matrix(out), out_ref, "output");
        for (size_t k = 0; k < grads.size(); ++k) {
          expect_close(testing::gather_full(grads[k], mesh, context.rank()), ref.grad[k],
                       grads[k].name + " gradient");
        }
      }
    }
  }
}

TEST(ResidualBlock, LayersThatDoNotEndInTheInputsLayoutAreRefused) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a feature axis of size > 1";
  const Mesh mesh = Mesh::create({{"tp", n}}, n);
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional);
  // The up projection tensor parallel, the down one replicated: f ends with all features.
  const std::vector<std::string> specs = {"P(tp, None)", "P(tp)", "P()", "P()"};
  std::vector<ShardedTensor> params, grads;
  const std::vector<ParameterShape> all = model_shapes();
  const std::vector<ParameterShape> shapes(all.begin() + 2, all.begin() + 6);  // up, down
  for (size_t k = 0; k < shapes.size(); ++k) {
    const PartitionSpec spec = PartitionSpec::parse(specs[k]);
    params.push_back(
        ShardedTensor::allocate(shapes[k].name, shapes[k].shape, spec, mesh, context.rank()));
    grads.push_back(
        ShardedTensor::allocate(shapes[k].name, shapes[k].shape, spec, mesh, context.rank()));
  }
  const int64_t rows = kRows, width = kWidth / n, col0 = context.feature_index() * width;
  std::vector<std::unique_ptr<Layer>> f;  // fed split features
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
