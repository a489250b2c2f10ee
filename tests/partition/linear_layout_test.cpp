// The layout decision of a Linear layer (partition/linear_layout.hpp) and the collectives
// the planner reports per training step, with bytes per rank checked against hand
// computations for 784-512-512-10 at a global batch of 128 (float32):
//   ring model: all-gather / reduce-scatter of S bytes over n ranks: S (n-1)/n per rank,
//   all-reduce: 2 S (n-1)/n.
#include "partition/linear_layout.hpp"

#include <gtest/gtest.h>

#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

const std::vector<int64_t> kMnist = {784, 512, 512, 10};
constexpr int64_t kBatch = 128;

Mesh mesh_of(std::vector<std::pair<std::string, int>> axes) {
  int world = 1;
  for (const auto& a : axes) world *= a.second;
  return Mesh::create(axes, world);
}

ShardingPlan mnist_plan(const Mesh& mesh, const std::string& preset, int64_t batch = kBatch) {
  PlanOptions options;
  options.min_sharding_size = 0;
  options.global_batch = batch;
  return make_plan(mlp_parameter_shapes(kMnist), mesh, preset_rules(preset), options,
                   mlp_linear_layers(kMnist));
}

LinearParameter param(const std::string& name, std::vector<int64_t> shape,
                      const std::string& spec) {
  return LinearParameter{name, std::move(shape), PartitionSpec::parse(spec)};
}

bool has_note(const std::vector<std::string>& notes, const std::string& fragment) {
  for (const auto& n : notes) {
    if (n.find(fragment) != std::string::npos) return true;
  }
  return false;
}

TEST(CollectiveCost, RingModel) {
  EXPECT_EQ(collective_bytes_per_rank(CollectiveKind::all_gather, 4096, 4), 3072);
  EXPECT_EQ(collective_bytes_per_rank(CollectiveKind::reduce_scatter, 4096, 4), 3072);
  EXPECT_EQ(collective_bytes_per_rank(CollectiveKind::all_reduce, 4096, 4), 6144);
  EXPECT_EQ(collective_bytes_per_rank(CollectiveKind::all_reduce, 4096, 1), 0);
  EXPECT_EQ(collective_bytes_per_rank(CollectiveKind::all_reduce, 40, 3), 53);  // rounded down
}

TEST(LinearLayout, NamesAndAxes) {
  EXPECT_EQ(linear_layer_name("layers/3/weight"), "layers/3");
  EXPECT_EQ(linear_layer_name("proj"), "proj");
  const Mesh mesh = mesh_of({{"dp", 2}, {"tp", 2}});
  // Axes the mesh lacks are dropped (they are of size 1).
  const LayerAxes axes = layer_axes_on(mesh, {{"fsdp", "dp", "nosuch"}, "tp"});
  EXPECT_EQ(axes.batch, (std::vector<std::string>{"dp"}));
  EXPECT_EQ(axes.feature, "tp");
  expect_bad_input(
      [&] {
        layer_axes_on(mesh, {{"tp"}, "tp"});
      },
      {"'tp'", "both the batch and the features"});
  EXPECT_NO_THROW(layer_axes_on(mesh_of({{"dp", 2}}), {{"tp"}, "tp"}));  // tp of size 1
  LogicalAxes logical;
  EXPECT_EQ(layer_axes(logical).feature, "tp");
  logical.mapping["hidden"] = {"tp", "sp"};
  expect_bad_input([&] { layer_axes(logical); }, {"'hidden'", "2 mesh axes"});
}

TEST(LinearLayout, TensorParallelDecision) {
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"tp", 4}});
  const LayerAxes axes{{"fsdp", "dp"}, "tp"};
  // Dim 0 starts with tp: TP; fsdp on dim 1 is storage; out divides: split output.
  LinearLayout l = decide_linear_layout(
      "layers/0", param("layers/0/weight", {784, 512}, "P(tp, fsdp)"),
      param("layers/0/bias", {512}, "P(tp)"), mesh, axes, FeatureLayout::replicated);
  EXPECT_TRUE(l.tensor_parallel);
  EXPECT_TRUE(l.split_output);
  EXPECT_EQ(l.in_compute, 196);
  EXPECT_EQ(l.out_local, 128);
  EXPECT_EQ(l.stored_rows, 196);
  EXPECT_EQ(l.stored_cols, 256);
  EXPECT_TRUE(l.weight_gather_dim0.empty());
  EXPECT_EQ(l.weight_gather_dim1, (std::vector<std::string>{"fsdp"}));
  EXPECT_TRUE(l.weight_allreduce.empty());  // fsdp is a batch axis: the reduce-scatter sums
  EXPECT_EQ(l.nonbatch_replication, 1);
  EXPECT_TRUE(l.bias_gather.empty());
  EXPECT_TRUE(l.bias_gather_sliced);
  EXPECT_EQ(l.bias_reduce, (std::vector<std::string>{"fsdp", "tp"}));
  EXPECT_TRUE(l.slices_input());
  EXPECT_EQ(describe_linear_layout(l),
            "TP in 784 -> out 512 (split 128), weight gathered over (fsdp) on dim 1");
  EXPECT_TRUE(l.notes.empty());

  // 10 outputs over tp=4: all-reduced and replicated, and the notes say so.
  l = decide_linear_layout("layers/2", param("layers/2/weight", {512, 10}, "P(tp, None)"),
                           param("layers/2/bias", {10}, "P()"), mesh, axes, FeatureLayout::split);
  EXPECT_TRUE(l.tensor_parallel);
  EXPECT_FALSE(l.split_output);
  EXPECT_EQ(l.output_layout(), FeatureLayout::replicated);
  EXPECT_EQ(l.out_local, 10);
  EXPECT_EQ(l.weight_allreduce, (std::vector<std::string>{"fsdp"}));
  EXPECT_EQ(l.bias_reduce, (std::vector<std::string>{"fsdp"}));
  EXPECT_EQ(describe_linear_layout(l),
            "TP in 512 (split 128) -> out 10 (all-reduced, replicated: 10 % 4 != 0), grads "
            "all-reduced over (fsdp)");
  EXPECT_TRUE(has_note(l.notes, "output features 10 do not divide by tp=4"));
  EXPECT_TRUE(has_note(l.notes, "all-reduces its output over tp and keeps it replicated"));

  // tp second in the dim-0 tuple: storage, not TP; a split input is gathered; tp is not a
  // batch axis, so its copies divide the gradient.
  l = decide_linear_layout("x", param("x/weight", {512, 64}, "P((fsdp, tp), None)"),
                           param("x/bias", {64}, "P(fsdp)"), mesh, axes, FeatureLayout::split);
  EXPECT_FALSE(l.tensor_parallel);
  EXPECT_TRUE(l.gathers_input());
  EXPECT_EQ(l.weight_gather_dim0, (std::vector<std::string>{"fsdp", "tp"}));
  EXPECT_EQ(l.nonbatch_replication, 4);
  EXPECT_EQ(l.bias_gather, (std::vector<std::string>{"fsdp"}));
  EXPECT_FALSE(l.bias_gather_sliced);
  EXPECT_TRUE(has_note(l.notes, "not tensor parallel"));
}

TEST(LinearLayout, BadInputNamesTheLayer) {
  const Mesh mesh = mesh_of({{"tp", 4}});
  const LayerAxes axes{{"fsdp", "dp"}, "tp"};
  expect_bad_input(
      [&] {
        decide_linear_layout("layers/0", param("layers/0/weight", {8, 4}, "P()"),
                             param("layers/0/bias", {4, 1}, "P()"), mesh, axes,
                             FeatureLayout::replicated);
      },
      {"linear layer 'layers/0'", "'layers/0/bias' of rank 2"});
  expect_bad_input(
      [&] {
        decide_linear_layout("layers/1", param("layers/1/weight", {10, 8}, "P(tp, None)"),
                             param("layers/1/bias", {8}, "P()"), mesh, axes,
                             FeatureLayout::replicated);
      },
      {"linear layer 'layers/1'", "10 input features", "'tp' of size 4"});
}

// dp=2: every parameter replicated; each gradient all-reduced over dp (2 S (n-1)/n = S).
TEST(PlannerCollectives, DataParallelAllReducesEveryGradient) {
  const ShardingPlan plan = mnist_plan(mesh_of({{"dp", 2}}), "dp");
  EXPECT_EQ(plan.local_batch_rows, 64);
  ASSERT_EQ(plan.layers.size(), 3u);
  for (const auto& l : plan.layers) {
    ASSERT_EQ(l.collectives.size(), 2u) << l.name;
    EXPECT_EQ(l.collectives[0].operand, "weight gradient");
    EXPECT_EQ(l.collectives[0].kind, CollectiveKind::all_reduce);
    EXPECT_EQ(l.collectives[0].axes, (std::vector<std::string>{"dp"}));
    EXPECT_EQ(l.collectives[1].operand, "bias gradient");
    EXPECT_EQ(l.compute.find("replicated in"), 0u) << l.compute;
    EXPECT_TRUE(l.notes.empty());
  }
  EXPECT_EQ(plan.layers[0].collectives[0].bytes_per_rank, 784 * 512 * 4);
  EXPECT_EQ(plan.layers[2].collectives[1].bytes_per_rank, 10 * 4);
  // 669706 parameters of 4 bytes.
  EXPECT_EQ(plan.totals.collective_bytes_per_step, 669706 * 4);
}

// fsdp=4: each weight gathered in forward and again in backward, its gradient
// reduce-scattered: 3 x S x 3/4; biases of 512 gathered (S x 3/4) and their gradients
// all-reduced (2 S x 3/4); the 10-bias does not divide by 4: replicated, only all-reduced.
TEST(PlannerCollectives, FsdpGathersAndReduceScatters) {
  const ShardingPlan plan = mnist_plan(mesh_of({{"fsdp", 4}}), "fsdp");
  EXPECT_EQ(plan.local_batch_rows, 32);
  const LayerPlan& l0 = plan.layers[0];
  ASSERT_EQ(l0.collectives.size(), 5u);
  EXPECT_EQ(l0.collectives[0].phase, "forward");
  EXPECT_EQ(l0.collectives[0].kind, CollectiveKind::all_gather);
  EXPECT_EQ(l0.collectives[0].shape, (std::vector<int64_t>{784, 512}));
  EXPECT_EQ(l0.collectives[0].bytes_per_rank, 784 * 512 * 4 * 3 / 4);  // 1204224
  EXPECT_EQ(l0.collectives[1].operand, "bias");
  EXPECT_EQ(l0.collectives[2].phase, "backward");
  EXPECT_EQ(l0.collectives[2].operand, "weight");
  EXPECT_EQ(l0.collectives[3].kind, CollectiveKind::reduce_scatter);
  EXPECT_EQ(l0.collectives[4].operand, "bias gradient");
  EXPECT_EQ(l0.collective_bytes_per_step, 3 * 1204224 + 1536 + 3072);             // 3617280
  EXPECT_EQ(plan.layers[1].collective_bytes_per_step, 3 * 786432 + 1536 + 3072);  // 2363904
  EXPECT_EQ(plan.layers[2].collective_bytes_per_step, 3 * 15360 + 60);            // 46140
  EXPECT_EQ(plan.totals.collective_bytes_per_step, 3617280 + 2363904 + 46140);
}

// tp=4, 128 rows on every rank. Layer 0 (input replicated, first layer: no input
// gradient): reduce-scatter of the output [128, 512] (262144 B x 3/4 = 196608), all-gather
// of dY for the weight gradient (196608), bias-gradient all-reduce over tp (2 x 2048 x 3/4
// = 3072). Layer 1: the same plus dY gathered again for the input gradient. Layer 2 (10
// outputs): only the all-reduce of its output [128, 10] (2 x 5120 x 3/4 = 7680).
TEST(PlannerCollectives, TensorParallelWithAllReduceFallback) {
  const ShardingPlan plan = mnist_plan(mesh_of({{"tp", 4}}), "tp");
  EXPECT_EQ(plan.local_batch_rows, 128);
  EXPECT_EQ(plan.layers[0].compute, "TP in 784 -> out 512 (split 128)");
  EXPECT_EQ(plan.layers[0].collective_bytes_per_step, 2 * 196608 + 3072);
  EXPECT_EQ(plan.layers[1].compute, "TP in 512 (split 128) -> out 512 (split 128)");
  EXPECT_EQ(plan.layers[1].collective_bytes_per_step, 3 * 196608 + 3072);
  const LayerPlan& last = plan.layers[2];
  EXPECT_EQ(last.compute, "TP in 512 (split 128) -> out 10 (all-reduced, replicated: 10 % 4 != 0)");
  ASSERT_EQ(last.collectives.size(), 1u);
  EXPECT_EQ(last.collectives[0].kind, CollectiveKind::all_reduce);
  EXPECT_EQ(last.collectives[0].operand, "output");
  EXPECT_EQ(last.collectives[0].shape, (std::vector<int64_t>{128, 10}));
  EXPECT_EQ(last.collectives[0].bytes_per_rank, 7680);
  EXPECT_TRUE(has_note(last.notes, "do not divide by tp=4"));
  EXPECT_TRUE(has_note(last.notes, "keeps it replicated"));
  EXPECT_EQ(plan.totals.collective_bytes_per_step, 396288 + 592896 + 7680);  // 996864
}

// Without a global batch, or with one that does not divide, the activation collectives are
// left out (and the plan says why in the second case); parameter collectives stay.
TEST(PlannerCollectives, UnknownOrIndivisibleBatch) {
  const Mesh mesh = mesh_of({{"tp", 4}});
  const ShardingPlan unknown = mnist_plan(mesh, "tp", 0);
  EXPECT_EQ(unknown.local_batch_rows, 0);
  EXPECT_TRUE(unknown.notes.empty());
  EXPECT_EQ(unknown.totals.collective_bytes_per_step, 2 * 3072);  // the two bias gradients
  const ShardingPlan odd = mnist_plan(mesh_of({{"dp", 3}}), "dp", 100);
  EXPECT_EQ(odd.local_batch_rows, 0);
  ASSERT_EQ(odd.notes.size(), 1u);
  EXPECT_NE(odd.notes[0].find("global batch 100 does not divide by the 3 batch shards"),
            std::string::npos)
      << odd.notes[0];
  // Without layers the planner reports none (and does not judge the batch).
  PlanOptions options;
  options.global_batch = 100;
  const ShardingPlan none =
      make_plan(mlp_parameter_shapes(kMnist), mesh_of({{"dp", 3}}), preset_rules("dp"), options);
  EXPECT_TRUE(none.layers.empty());
  EXPECT_EQ(none.totals.collective_bytes_per_step, 0);
}

TEST(PlannerCollectives, BadLayerList) {
  const Mesh mesh = mesh_of({{"tp", 2}});
  PlanOptions options;
  expect_bad_input(
      [&] {
        make_plan(mlp_parameter_shapes(kMnist), mesh, preset_rules("tp"), options,
                  {{"layers/0/weight", "layers/9/bias"}});
      },
      {"layer 'layers/0'", "'layers/9/bias'"});
  options.global_batch = -1;
  expect_bad_input(
      [&] { make_plan(mlp_parameter_shapes(kMnist), mesh, preset_rules("tp"), options); },
      {"global batch", "-1"});
  // The feature axis may not split the batch too.
  options.global_batch = 0;
  options.batch_axes = {"tp"};
  expect_bad_input(
      [&] {
        make_plan(mlp_parameter_shapes(kMnist), mesh, preset_rules("tp"), options,
                  mlp_linear_layers(kMnist));
      },
      {"'tp'", "both the batch and the features"});
}

}  // namespace
}  // namespace meshtrain

namespace meshtrain {
namespace {

// The plan counts what the trainer allocates besides parameters, gradients and optimizer
// state for issue 12's options: the gradient sum of accumulation_steps > 1 (the size of the
// gradients), and an evaluation batch of its own size (inputs and labels, and each layer's
// output columns on this rank), nothing for an evaluation batch of the training size.
TEST(PlannerMemory, CountsAccumulationAndEvaluationBuffers) {
  PlanOptions options;
  options.min_sharding_size = 0;
  options.global_batch = kBatch;
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"tp", 2}});
  auto plan_with = [&](int64_t accumulation, int64_t eval_batch) {
    PlanOptions o = options;
    o.accumulation_steps = accumulation;
    o.eval_global_batch = eval_batch;
    return make_plan(mlp_parameter_shapes(kMnist), mesh, preset_rules("fsdp_tp"), o,
                     mlp_linear_layers(kMnist));
  };
  const ShardingPlan plain = plan_with(1, 0);
  EXPECT_EQ(plain.totals.accumulation_bytes, 0);
  EXPECT_EQ(plain.totals.evaluation_bytes, 0);
  EXPECT_EQ(plan_with(1, kBatch).totals.evaluation_bytes, 0);  // shares the training buffers
  const ShardingPlan accumulated = plan_with(4, 0);
  EXPECT_EQ(accumulated.totals.accumulation_bytes, plain.totals.gradient_bytes);
  EXPECT_EQ(accumulated.totals.bytes_per_rank(),
            plain.totals.bytes_per_rank() + plain.totals.gradient_bytes);
  // 1000 rows over fsdp = 2: 500 rows of 784 inputs + 1 label, and the outputs of the three
  // tensor-parallel layers on this rank: 512 / 2, 512 / 2 and 10 / 2 columns.
  const ShardingPlan evaluated = plan_with(1, 1000);
  EXPECT_EQ(evaluated.totals.evaluation_bytes, 4 * 500 * (784 + 1 + 256 + 256 + 5));
  EXPECT_EQ(evaluated.totals.bytes_per_rank(),
            plain.totals.bytes_per_rank() + evaluated.totals.evaluation_bytes);
}

}  // namespace
}  // namespace meshtrain

namespace meshtrain {
namespace {

// residual_mlp under the tp presets (Megatron's pair): inputs 64, width 256, hidden 1024, one
// SwiGLU block (or relu, gated = false) with rmsnorm, outputs 10, global batch 128.
ShardingPlan residual_plan(const Mesh& mesh, const std::string& preset, bool gated = true) {
  ResidualMlpShape s;
  s.inputs = 64;
  s.outputs = 10;
  s.width = 256;
  s.hidden = 1024;
  s.depth = 1;
  s.gated = gated;
  PlanOptions options;
  options.min_sharding_size = 0;
  options.global_batch = kBatch;
  return make_plan(residual_mlp_parameter_shapes(s), mesh,
                   preset_rules(preset, false, true, /*residual=*/true), options,
                   residual_mlp_linear_layers(s));
}

const LayerPlan& layer_named(const ShardingPlan& plan, const std::string& name) {
  for (const auto& l : plan.layers) {
    if (l.name == name) return l;
  }
  ADD_FAILURE() << "no layer " << name;
  return plan.layers.front();
}

TEST(ColumnParallel, ResidualBlockUnderTp) {
  const ShardingPlan plan = residual_plan(mesh_of({{"tp", 4}}), "tp");
  // SwiGLU: gate and up share one gather of the block's split input. Each is decided as fed
  // the gathered (replicated) input with a partial input gradient; the gate carries the
  // gather [128, 256] in forward and the reduce-scatter of the summed input gradient in
  // backward, each 128 * 256 * 4 * 3/4 bytes. No batch axis: the bias gradients stay local.
  for (const std::string name : {"blocks/0/gate", "blocks/0/up"}) {
    SCOPED_TRACE(name);
    const LayerPlan& l = layer_named(plan, name);
    EXPECT_TRUE(l.layout.column_parallel);
    EXPECT_FALSE(l.layout.tensor_parallel);
    EXPECT_TRUE(l.layout.bias_direct);
    EXPECT_TRUE(l.layout.input_grad_partial);
    EXPECT_FALSE(l.layout.runs_collective_matmuls());
    EXPECT_EQ(l.compute,
              "column-parallel TP in 256 (shares its SwiGLU's one gather) -> out 1024 (split 256)");
  }
  const LayerPlan& gate = layer_named(plan, "blocks/0/gate");
  ASSERT_EQ(gate.collectives.size(), 2u);
  EXPECT_EQ(gate.collectives[0].phase, "forward");
  EXPECT_EQ(gate.collectives[0].kind, CollectiveKind::all_gather);
  EXPECT_EQ(gate.collectives[0].operand, "input");
  EXPECT_EQ(gate.collectives[1].phase, "backward");
  EXPECT_EQ(gate.collectives[1].kind, CollectiveKind::reduce_scatter);
  EXPECT_EQ(gate.collectives[1].operand, "input gradient");
  for (const auto& c : gate.collectives) {
    EXPECT_EQ(c.shape, (std::vector<int64_t>{128, 256}));
    EXPECT_EQ(c.dim, 1);
    EXPECT_EQ(c.bytes_per_rank, 98304);
  }
  EXPECT_TRUE(layer_named(plan, "blocks/0/up").collectives.empty());
  // down: row-parallel as before, its split input the gate/up output.
  const LayerPlan& down = layer_named(plan, "blocks/0/down");
  EXPECT_TRUE(down.layout.tensor_parallel);
  EXPECT_FALSE(down.layout.column_parallel);
  EXPECT_EQ(down.compute, "TP in 1024 (split 256) -> out 256 (split 64)");
  // output reduce-scatter + dY gathered twice (98304 each), bias gradient over tp (2 KiB x 3/4).
  EXPECT_EQ(down.collective_bytes_per_step, 3 * 98304 + 1536);
  // The input projection and the output head as the plain presets have them.
  EXPECT_EQ(layer_named(plan, "input").compute, "TP in 64 -> out 256 (split 64)");
  EXPECT_FALSE(layer_named(plan, "output").layout.column_parallel);
}

TEST(ColumnParallel, WithoutSwigluUpGathersInItsCollectiveMatmuls) {
  const ShardingPlan plan = residual_plan(mesh_of({{"tp", 4}}), "tp", /*gated=*/false);
  const LayerPlan& l = layer_named(plan, "blocks/0/up");
  EXPECT_TRUE(l.layout.column_parallel);
  EXPECT_FALSE(l.layout.input_grad_partial);
  EXPECT_TRUE(l.layout.runs_collective_matmuls());
  EXPECT_EQ(l.compute, "column-parallel TP in 256 (split 64) all-gathered -> out 1024 (split 256)");
  // The input [128, 256] all-gathered in forward and again in backward (for dW), dX
  // reduce-scattered: 98304 bytes each.
  ASSERT_EQ(l.collectives.size(), 3u);
  EXPECT_EQ(l.collectives[0].operand, "input");
  EXPECT_EQ(l.collectives[0].phase, "forward");
  EXPECT_EQ(l.collectives[1].operand, "input");
  EXPECT_EQ(l.collectives[1].phase, "backward");
  EXPECT_EQ(l.collectives[2].operand, "input gradient");
  EXPECT_EQ(l.collectives[2].kind, CollectiveKind::reduce_scatter);
  EXPECT_EQ(l.collective_bytes_per_step, 3 * 98304);
}

TEST(ColumnParallel, FsdpTimesTpGathersTheWeightOverFsdp) {
  const ShardingPlan plan = residual_plan(mesh_of({{"fsdp", 2}, {"tp", 2}}), "fsdp_tp");
  const LayerPlan& up = layer_named(plan, "blocks/0/up");
  const LinearLayout& l = up.layout;
  EXPECT_TRUE(l.column_parallel);
  EXPECT_EQ(l.in_compute, 256);
  EXPECT_EQ(l.out_local, 512);
  EXPECT_EQ(l.stored_rows, 128);
  EXPECT_EQ(l.stored_cols, 512);
  EXPECT_EQ(l.weight_gather_dim0, (std::vector<std::string>{"fsdp"}));
  EXPECT_TRUE(l.weight_gather_dim1.empty());
  EXPECT_TRUE(l.weight_allreduce.empty());
  EXPECT_EQ(l.bias_reduce, (std::vector<std::string>{"fsdp"}));  // batch axes only
  EXPECT_FALSE(l.defers_reduction());
  EXPECT_EQ(up.compute,
            "column-parallel TP in 256 (shares its SwiGLU's one gather) -> out 1024 (split 512), "
            "weight gathered over (fsdp) on dim 0");
  // Weight [256, 512] gathered over fsdp forward and backward and its gradient
  // reduce-scattered: 262144 bytes each; bias gradient [512] all-reduced over fsdp: 2048. The
  // input's gather and reduce-scatter ([64, 256] over tp, 32768 bytes each) are the gate's.
  EXPECT_EQ(up.collective_bytes_per_step, 3 * 262144 + 2048);
  EXPECT_EQ(layer_named(plan, "blocks/0/gate").collective_bytes_per_step,
            3 * 262144 + 2048 + 2 * 32768);
}

TEST(ColumnParallel, DpTimesTpDefersItsGradients) {
  const ShardingPlan plan = residual_plan(mesh_of({{"dp", 2}, {"tp", 2}}), "dp_tp");
  const LinearLayout& l = layer_named(plan, "blocks/0/gate").layout;
  EXPECT_TRUE(l.column_parallel);
  EXPECT_EQ(l.weight_allreduce, (std::vector<std::string>{"dp"}));
  EXPECT_EQ(l.bias_reduce, (std::vector<std::string>{"dp"}));
  EXPECT_TRUE(l.defers_reduction());  // one all-reduce over dp each, like DP storage
}

TEST(ColumnParallel, ReplicatedInputAllReducesTheInputGradient) {
  const Mesh mesh = mesh_of({{"tp", 4}});
  const LayerAxes axes{{"fsdp", "dp"}, "tp"};
  const LinearLayout l =
      decide_linear_layout("x", param("x/weight", {64, 128}, "P(None, tp)"),
                           param("x/bias", {128}, "P()"), mesh, axes, FeatureLayout::replicated);
  EXPECT_TRUE(l.column_parallel);
  EXPECT_FALSE(l.runs_collective_matmuls());
  EXPECT_FALSE(l.bias_direct);  // the bias stored whole: its gradient summed over tp
  EXPECT_EQ(l.bias_reduce, (std::vector<std::string>{"tp"}));
  const auto c = linear_step_collectives(l, mesh, 32, /*input_grad=*/true, 4);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].kind, CollectiveKind::all_reduce);
  EXPECT_EQ(c[0].operand, "input gradient");
  EXPECT_EQ(c[0].bytes_per_rank, 2 * 32 * 64 * 4 * 3 / 4);
  EXPECT_EQ(c[1].operand, "bias gradient");
  EXPECT_EQ(c[1].shape, (std::vector<int64_t>{128}));
}

TEST(ColumnParallel, IndivisibleOutputNamesTheParameter) {
  expect_bad_input(
      [] {
        decide_linear_layout("head", param("head/weight", {64, 10}, "P(None, tp)"),
                             param("head/bias", {10}, "P()"), mesh_of({{"tp", 4}}),
                             LayerAxes{{"dp"}, "tp"}, FeatureLayout::replicated);
      },
      {"linear layer 'head'", "'head/weight'", "10 output features", "size 4"});
}

}  // namespace
}  // namespace meshtrain
