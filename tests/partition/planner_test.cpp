#include "partition/planner.hpp"

#include <gtest/gtest.h>

#include <map>

#include "partition/rules.hpp"
#include "partition/zero1_layout.hpp"
#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

PartitionRule rule(const std::string& pattern, const std::string& spec, bool fallback = false) {
  return PartitionRule{pattern, PartitionSpec::parse(spec), fallback};
}

Mesh mesh_of(std::vector<std::pair<std::string, int>> axes) {
  int world = 1;
  for (const auto& a : axes) world *= a.second;
  return Mesh::create(axes, world);
}

PlanOptions no_minimum() {
  PlanOptions options;
  options.min_sharding_size = 0;
  return options;
}

const std::vector<int64_t> kMnist = {784, 512, 512, 10};
// Elements of 784-512-512-10: 401408 + 512 + 262144 + 512 + 5120 + 10.
constexpr int64_t kMnistElements = 669706;

TEST(MlpShapes, WeightsAreInByOut) {
  const auto shapes = mlp_parameter_shapes({4, 3, 2});
  ASSERT_EQ(shapes.size(), 4u);
  EXPECT_EQ(shapes[0].name, "layers/0/weight");
  EXPECT_EQ(shapes[0].shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(shapes[1].name, "layers/0/bias");
  EXPECT_EQ(shapes[1].shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(shapes[2].name, "layers/1/weight");
  EXPECT_EQ(shapes[2].shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(shapes[3].name, "layers/1/bias");
  expect_bad_input([] { mlp_parameter_shapes({4}); }, {"model.sizes", "two"});
  expect_bad_input([] { mlp_parameter_shapes({4, 0, 2}); }, {"model.sizes[1]", "0"});
}

// Rule 1: a scalar is replicated without consulting the rules (none would match).
TEST(Planner, ScalarsAreReplicatedWithoutARule) {
  const auto plan = make_plan({{"step", {}}}, mesh_of({{"tp", 2}}), {}, no_minimum());
  const auto& p = plan.find("step");
  EXPECT_EQ(p.rule, -1);
  EXPECT_EQ(p.spec, PartitionSpec());
  EXPECT_TRUE(p.local_shape.empty());
  EXPECT_EQ(p.bytes_per_rank, 4);
  EXPECT_EQ(p.replicas, 2);
}

// Rule 2: the first rule whose regex is found anywhere in the name wins.
TEST(Planner, FirstRuleFoundAnywhereInTheNameWins) {
  const std::vector<PartitionRule> rules = {
      rule("layers/1/", "P(None, tp)"),  // searched, not anchored: matches mid-name
      rule("weight", "P(tp, None)"),
      rule("(attn|mlp)", "P(tp)"),
      rule(".*", "P()"),
  };
  const auto plan = make_plan({{"layers/0/weight", {8, 8}},
                               {"layers/1/weight", {8, 8}},
                               {"model/mlp/bias", {8}},
                               {"layers/0/bias", {8}}},
                              mesh_of({{"tp", 2}}), rules, no_minimum());
  EXPECT_EQ(plan.find("layers/0/weight").rule, 1);
  EXPECT_EQ(plan.find("layers/0/weight").spec.to_string(), "P(tp, None)");
  EXPECT_EQ(plan.find("layers/1/weight").rule, 0);
  EXPECT_EQ(plan.find("layers/1/weight").local_shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(plan.find("model/mlp/bias").rule, 2);
  EXPECT_EQ(plan.find("layers/0/bias").rule, 3);
  EXPECT_TRUE(plan.find("layers/0/bias").notes.empty());
  EXPECT_TRUE(plan.unused_rules.empty());
  // A rule written as a full match still behaves as a search.
  EXPECT_EQ(make_plan({{"a/weight/b", {4}}}, mesh_of({{"tp", 2}}), {rule("weight", "P(tp)")},
                      no_minimum())
                .find("a/weight/b")
                .spec.to_string(),
            "P(tp)");
}

// Rule 3: small tensors are replicated, after a rule matched, and the plan says so.
TEST(Planner, SmallTensorsAreReplicated) {
  PlanOptions options;  // min_sharding_size 16384
  const auto plan = make_plan({{"big/weight", {128, 128}}, {"small/weight", {127, 128}}},
                              mesh_of({{"fsdp", 2}}), {rule("weight", "P(fsdp, None)")}, options);
  EXPECT_EQ(plan.find("big/weight").spec.to_string(), "P(fsdp, None)");
  EXPECT_TRUE(plan.find("big/weight").notes.empty());
  const auto& small = plan.find("small/weight");
  EXPECT_EQ(small.rule, 0);
  EXPECT_EQ(small.spec, PartitionSpec());
  EXPECT_EQ(small.local_shape, (std::vector<int64_t>{127, 128}));
  ASSERT_EQ(small.notes.size(), 1u);
  EXPECT_NE(small.notes[0].find("16256 elements < min_sharding_size 16384"), std::string::npos)
      << small.notes[0];
  // A small tensor that matches no rule is still an error, as in the reference.
  expect_bad_input(
      [&] {
        make_plan({{"tiny", {2}}}, mesh_of({{"fsdp", 2}}), {rule("weight", "P()")}, options);
      },
      {"'tiny'", "no partition rule"});
}

// Rule 4: a spec longer than the rank is trimmed, and the plan says so.
TEST(Planner, LongSpecsAreTrimmedToTheRank) {
  const auto plan = make_plan({{"layers/0/bias", {8}}}, mesh_of({{"fsdp", 2}, {"tp", 2}}),
                              {rule("", "P(fsdp, tp)")}, no_minimum());
  const auto& p = plan.find("layers/0/bias");
  EXPECT_EQ(p.spec.to_string(), "P(fsdp)");
  EXPECT_EQ(p.local_shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(p.replicas, 2);
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_NE(p.notes[0].find("trimmed to P(fsdp)"), std::string::npos) << p.notes[0];
}

// Rule 5: no rule matching names the parameter and lists the rules.
TEST(Planner, NoMatchingRuleNamesParameterAndRules) {
  expect_bad_input(
      [] {
        make_plan({{"layers/0/weight", {4, 4}}, {"layers/0/bias", {4}}}, mesh_of({{"tp", 2}}),
                  {rule("weight$", "P(tp, None)"), rule("kernel", "P()")}, no_minimum());
      },
      {"'layers/0/bias'", "rule 0 'weight$' -> P(tp, None)", "rule 1 'kernel' -> P()"});
  expect_bad_input(
      [] {
        make_plan({{"w", {4}}}, mesh_of({{"tp", 2}}), {}, no_minimum());
      },
      {"'w'", "(no rules)"});
}

TEST(Planner, InvalidRegexNamesIndexAndPattern) {
  // Checked up front, even though rule 0 would match everything first.
  expect_bad_input(
      [] {
        make_plan({{"w", {4}}}, mesh_of({{"tp", 2}}),
                  {rule(".*", "P()"), rule("layers/[0-9", "P()")}, no_minimum());
      },
      {"rule 1", "'layers/[0-9'", "regex"});
  expect_bad_input([] { compile_rules({rule("(a", "P()")}); }, {"rule 0", "'(a'"});
}

TEST(Planner, ReportsRulesThatGaveNoSpec) {
  const auto plan = make_plan(
      {{"layers/0/weight", {4, 4}}}, mesh_of({{"tp", 2}}),
      {rule("bias", "P(tp)"), rule("weight", "P(tp)"), rule("weight$", "P()"), rule(".*", "P()")},
      no_minimum());
  // Rule 2 matches the name but is shadowed by rule 1: unused all the same.
  EXPECT_EQ(plan.unused_rules, (std::vector<int>{0, 2, 3}));
}

TEST(Planner, SpecAxisMissingFromTheMeshIsAnError) {
  expect_bad_input(
      [] {
        make_plan({{"layers/0/weight", {4, 4}}}, mesh_of({{"dp", 2}, {"tp", 2}}),
                  {rule("weight", "P(fsdp, None)")}, no_minimum());
      },
      {"'layers/0/weight'", "rule 0 'weight'", "'fsdp'", "dp=2 tp=2"});
}

TEST(Planner, RepeatedAxisInASpecIsAnError) {
  PartitionRule repeated{"weight", PartitionSpec({SpecEntry{{"tp"}}, SpecEntry{{"fsdp", "tp"}}})};
  expect_bad_input(
      [&] {
        make_plan({{"layers/0/weight", {4, 4}}}, mesh_of({{"fsdp", 2}, {"tp", 2}}), {repeated},
                  no_minimum());
      },
      {"'layers/0/weight'", "rule 0", "'tp'", "twice"});
}

TEST(Planner, IndivisibleDimIsAnErrorForUserRules) {
  expect_bad_input(
      [] {
        make_plan({{"layers/2/bias", {10}}}, mesh_of({{"tp", 4}}), {rule("bias", "P(tp)")},
                  no_minimum());
      },
      {"'layers/2/bias'", "dim 0", "size 10", "tp=4", "axis product 4"});
  expect_bad_input(
      [] {
        make_plan({{"w", {8, 6}}}, mesh_of({{"dp", 2}, {"fsdp", 2}}),
                  {rule("w", "P(None, (fsdp, dp))")}, no_minimum());
      },
      {"'w'", "dim 1", "size 6", "(fsdp, dp)=4"});
}

TEST(Planner, IndivisibleDimFallsBackForPresetRules) {
  const auto plan = make_plan({{"layers/2/weight", {10, 512}}, {"layers/2/bias", {10}}},
                              mesh_of({{"tp", 4}}), preset_rules("tp"), no_minimum());
  const auto& w = plan.find("layers/2/weight");
  EXPECT_EQ(w.spec.to_string(), "P(None, None)");
  EXPECT_EQ(w.local_shape, (std::vector<int64_t>{10, 512}));
  ASSERT_EQ(w.notes.size(), 1u);
  EXPECT_EQ(w.notes[0], "dim 0 (10) does not divide by tp=4: replicated");
  EXPECT_EQ(plan.find("layers/2/bias").spec.to_string(), "P(None)");
  EXPECT_EQ(plan.find("layers/2/bias").replicas, 4);
}

TEST(Planner, BadOptionsAndShapes) {
  const Mesh mesh = mesh_of({{"dp", 1}});
  PlanOptions options;
  options.min_sharding_size = -1;
  expect_bad_input([&] { make_plan({}, mesh, {}, options); }, {"min_sharding_size", "-1"});
  options = PlanOptions();
  options.bytes_per_element = 0;
  expect_bad_input([&] { make_plan({}, mesh, {}, options); }, {"bytes_per_element", "0"});
  expect_bad_input(
      [&] {
        make_plan({{"w", {4, -2}}}, mesh, {rule(".*", "P()")}, PlanOptions());
      },
      {"'w'", "[4, -2]"});
  expect_bad_input(
      [&] {
        make_plan({{"w", {4}}, {"w", {4}}}, mesh, {rule(".*", "P()")}, PlanOptions());
      },
      {"'w'", "twice"});
  const auto plan = make_plan({{"w", {4}}}, mesh, {rule(".*", "P()")}, PlanOptions());
  expect_bad_input([&] { plan.find("v"); }, {"'v'"});
}

TEST(Presets, RulesOfEveryPreset) {
  auto specs = [](const std::string& preset, const std::vector<std::string>& table_axes = {}) {
    std::vector<std::string> out;
    for (const auto& r : preset_rules(preset, false, false, false, table_axes)) {
      EXPECT_TRUE(r.replicate_if_indivisible) << preset;
      out.push_back(r.pattern + " " + r.spec.to_string());
    }
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(specs("dp"), (V{".* P()"}));
  EXPECT_EQ(specs("replicated"), (V{".* P()"}));
  EXPECT_EQ(specs("fsdp"), (V{"weight$ P(fsdp, None)", "bias$ P(fsdp)", ".* P()"}));
  EXPECT_EQ(specs("dp_fsdp"), specs("fsdp"));
  EXPECT_EQ(specs("tp"), (V{"weight$ P(tp, None)", "bias$ P(tp)", ".* P()"}));
  EXPECT_EQ(specs("dp_tp"), specs("tp"));
  EXPECT_EQ(specs("fsdp_tp"), (V{"weight$ P(tp, fsdp)", "bias$ P(tp)", ".* P()"}));
  // dlrm: the tables row-wise over the table axes it is given (the run's batch axes), the rest
  // replicated.
  EXPECT_EQ(specs("dlrm"), (V{"^embeddings/[^/]+/weight$ P()", ".* P()"}));
  EXPECT_EQ(specs("dlrm", {"fsdp"}), (V{"^embeddings/[^/]+/weight$ P(fsdp, None)", ".* P()"}));
  EXPECT_EQ(specs("dlrm", {"fsdp", "dp"}),
            (V{"^embeddings/[^/]+/weight$ P((fsdp, dp), None)", ".* P()"}));
  for (const auto& name : preset_names()) EXPECT_FALSE(preset_rules(name).empty());
  expect_bad_input([] { preset_rules("zero3"); }, {"'zero3'", "fsdp_tp", "dp_fsdp"});
}

// Hand-computed totals for 784-512-512-10 (float32, AdamW).
TEST(PlannerTotals, DataParallelOnTwoRanks) {
  const auto plan = make_plan(mlp_parameter_shapes(kMnist), mesh_of({{"dp", 2}}),
                              preset_rules("dp"), PlanOptions());
  EXPECT_EQ(plan.totals.global_parameter_bytes, kMnistElements * 4);  // 2678824
  EXPECT_EQ(plan.totals.parameter_bytes, 2678824);
  EXPECT_EQ(plan.totals.gradient_bytes, 2678824);
  EXPECT_EQ(plan.totals.optimizer_bytes, 2 * 2678824);
  for (const auto& p : plan.parameters) {
    EXPECT_EQ(p.rule, 0);
    EXPECT_EQ(p.local_shape, p.shape);
    EXPECT_EQ(p.replicas, 2);
  }
  EXPECT_TRUE(plan.unused_rules.empty());
}

TEST(PlannerTotals, FsdpOnFourRanksWithoutMinimum) {
  const auto plan = make_plan(mlp_parameter_shapes(kMnist), mesh_of({{"fsdp", 4}}),
                              preset_rules("fsdp"), no_minimum());
  // 196x512 + 128 + 128x512 + 128 + 128x10 + 10 (the 10-bias does not divide by 4).
  EXPECT_EQ(plan.totals.parameter_bytes, (100352 + 128 + 65536 + 128 + 1280 + 10) * 4);
  EXPECT_EQ(plan.totals.parameter_bytes, 669736);
  EXPECT_EQ(plan.totals.gradient_bytes, 669736);
  EXPECT_EQ(plan.totals.optimizer_bytes, 2 * 669736);
  EXPECT_EQ(plan.totals.global_parameter_bytes, 2678824);
  EXPECT_EQ(plan.find("layers/0/weight").local_shape, (std::vector<int64_t>{196, 512}));
  EXPECT_EQ(plan.find("layers/2/weight").local_shape, (std::vector<int64_t>{128, 10}));
  EXPECT_EQ(plan.find("layers/2/bias").spec.to_string(), "P(None)");
  EXPECT_EQ(plan.find("layers/2/bias").notes,
            (std::vector<std::string>{"dim 0 (10) does not divide by fsdp=4: replicated"}));
  EXPECT_EQ(plan.unused_rules, (std::vector<int>{2}));  // nothing needed the catch-all
}

TEST(PlannerTotals, FsdpOnFourRanksWithTheDefaultMinimum) {
  const auto plan = make_plan(mlp_parameter_shapes(kMnist), mesh_of({{"fsdp", 4}}),
                              preset_rules("fsdp"), PlanOptions());
  // Biases (512, 10 elements) and the 512x10 weight (5120) are under 16384: replicated.
  EXPECT_EQ(plan.totals.parameter_bytes, (100352 + 512 + 65536 + 512 + 5120 + 10) * 4);
  EXPECT_EQ(plan.find("layers/2/weight").spec, PartitionSpec());
  EXPECT_EQ(plan.find("layers/2/weight").notes.size(), 1u);
}

TEST(PlannerTotals, TensorParallelFallbackForTheTenOutputLayer) {
  const auto plan = make_plan(mlp_parameter_shapes(kMnist), mesh_of({{"tp", 4}}),
                              preset_rules("tp"), no_minimum());
  EXPECT_EQ(plan.find("layers/2/weight").spec.to_string(), "P(tp, None)");  // 512 divides
  EXPECT_EQ(plan.find("layers/2/bias").spec.to_string(), "P(None)");
  EXPECT_EQ(plan.totals.parameter_bytes, 669736);
}

TEST(PlannerTotals, FsdpTpOnEightRanks) {
  PlanOptions options = no_minimum();
  options.optimizer_slots = 1;  // SGD with momentum
  const auto plan = make_plan(mlp_parameter_shapes({784, 512, 10}),
                              mesh_of({{"fsdp", 4}, {"tp", 2}}), preset_rules("fsdp_tp"), options);
  // w0 [784,512] P(tp, fsdp) -> [392, 128]; b0 [512] P(tp) -> 256;
  // w1 [512,10]: 10 does not divide by fsdp=4 -> P(tp, None) -> [256, 10]; b1 [10] -> 5.
  EXPECT_EQ(plan.find("layers/0/weight").local_shape, (std::vector<int64_t>{392, 128}));
  EXPECT_EQ(plan.find("layers/0/weight").replicas, 1);
  EXPECT_EQ(plan.find("layers/0/bias").replicas, 4);
  EXPECT_EQ(plan.find("layers/1/weight").spec.to_string(), "P(tp, None)");
  EXPECT_EQ(plan.find("layers/1/weight").notes,
            (std::vector<std::string>{"dim 1 (10) does not divide by fsdp=4: replicated"}));
  EXPECT_EQ(plan.find("layers/1/bias").local_shape, (std::vector<int64_t>{5}));
  const int64_t bytes = (392 * 128 + 256 + 256 * 10 + 5) * 4;
  EXPECT_EQ(plan.totals.parameter_bytes, bytes);
  EXPECT_EQ(plan.totals.optimizer_bytes, bytes);
  EXPECT_EQ(plan.totals.global_parameter_bytes, (784 * 512 + 512 + 512 * 10 + 10) * 4);
}

// 4096 ranks: the planner never loops over ranks, so this is as fast as the small ones.
TEST(PlannerTotals, LargeMesh) {
  const Mesh mesh = Mesh::create({{"dp", 4}, {"fsdp", -1}, {"tp", 8}}, 4096);
  EXPECT_EQ(mesh.axis_size("fsdp"), 128);
  const auto plan = make_plan(mlp_parameter_shapes({8192, 32768, 32768, 8192}), mesh,
                              preset_rules("fsdp_tp"), PlanOptions());
  // w0 [8192, 32768] P(tp, fsdp) -> [1024, 256], replicated over dp=4.
  EXPECT_EQ(plan.find("layers/0/weight").local_shape, (std::vector<int64_t>{1024, 256}));
  EXPECT_EQ(plan.find("layers/0/weight").replicas, 4);
  EXPECT_EQ(plan.find("layers/1/bias").local_shape, (std::vector<int64_t>{4096}));
  const int64_t global = (8192LL * 32768 * 2 + 32768LL * 32768 + 32768 * 2 + 8192) * 4;
  EXPECT_EQ(plan.totals.global_parameter_bytes, global);
  EXPECT_EQ(plan.totals.parameter_bytes,
            (1024 * 256 + 4096 + 4096 * 256 + 4096 + 4096 * 64 + 8192) * 4);
  // The 8192-element last bias is under min_sharding_size.
  EXPECT_EQ(plan.find("layers/2/bias").spec, PartitionSpec());
}

// ---- Mixture of experts (partition/moe_layout.hpp) -------------------------------------

// [64, 128, 128, 10] with layer 1 an MoE layer of 8 experts, top-2; batch axes with the
// expert axis (layer_axes(..., with_experts)), global batch 64.
const std::vector<int64_t> kMoeSizes = {64, 128, 128, 10};

MoeSettings moe_settings(int64_t experts = 8, int64_t top_k = 2) {
  MoeSettings moe;
  moe.layers = {1};
  moe.experts = experts;
  moe.top_k = top_k;
  return moe;
}

PlanOptions moe_options(int64_t global_batch = 64) {
  PlanOptions options = no_minimum();
  options.batch_axes = {"fsdp", "dp", "ep"};
  options.global_batch = global_batch;
  return options;
}

// Every known axis (dp, fsdp, ep, tp, sp), of size 1 unless given, in mesh order: what a
// config's [mesh] resolves to.
Mesh full_mesh(const std::vector<std::pair<std::string, int>>& sizes) {
  std::vector<std::pair<std::string, int>> axes;
  for (const auto& name : Mesh::known_axes()) {
    int size = 1;
    for (const auto& s : sizes) {
      if (s.first == name) size = s.second;
    }
    axes.push_back({name, size});
  }
  return mesh_of(axes);
}

ShardingPlan moe_plan(const Mesh& mesh, const std::string& preset,
                      const MoeSettings& moe = moe_settings(),
                      const PlanOptions& options = moe_options()) {
  return make_plan(mlp_parameter_shapes(kMoeSizes, moe), mesh, preset_rules(preset, true), options,
                   mlp_linear_layers(kMoeSizes, moe));
}

std::vector<const LayerCollective*> of_kind(const LayerPlan& layer, CollectiveKind kind) {
  std::vector<const LayerCollective*> out;
  for (const auto& c : layer.collectives) {
    if (c.kind == kind) out.push_back(&c);
  }
  return out;
}

const LayerCollective* find_collective(const LayerPlan& layer, const std::string& phase,
                                       CollectiveKind kind, const std::string& operand) {
  for (const auto& c : layer.collectives) {
    if (c.phase == phase && c.kind == kind && c.operand == operand) return &c;
  }
  return nullptr;
}

bool has_note(const std::vector<std::string>& notes, const std::string& fragment) {
  for (const auto& note : notes) {
    if (note.find(fragment) != std::string::npos) return true;
  }
  return false;
}

TEST(MoePlan, ParametersAndLayersOfAnMoeModel) {
  const auto shapes = mlp_parameter_shapes(kMoeSizes, moe_settings());
  ASSERT_EQ(shapes.size(), 7u);
  EXPECT_EQ(shapes[2].name, "layers/1/router/weight");
  EXPECT_EQ(shapes[2].shape, (std::vector<int64_t>{128, 8}));
  EXPECT_EQ(shapes[3].name, "layers/1/experts/weight");
  EXPECT_EQ(shapes[3].shape, (std::vector<int64_t>{8, 128, 128}));
  EXPECT_EQ(shapes[4].name, "layers/1/experts/bias");
  EXPECT_EQ(shapes[4].shape, (std::vector<int64_t>{8, 128}));
  const auto layers = mlp_linear_layers(kMoeSizes, moe_settings());
  ASSERT_EQ(layers.size(), 3u);
  EXPECT_FALSE(layers[0].moe());
  EXPECT_TRUE(layers[1].moe());
  EXPECT_EQ(layers[1].top_k, 2);
}

// ep = 2: the experts split over ep (4 per rank), the router replicated; four all-to-alls of
// R*k rows (R = 32 local rows, k = 2: [64, 128]) that each move half of what a rank sends.
TEST(MoePlan, ExpertParallelOnTwoRanks) {
  const ShardingPlan plan = moe_plan(full_mesh({{"ep", 2}}), "fsdp");
  EXPECT_EQ(plan.local_batch_rows, 32);
  const auto& w = plan.find("layers/1/experts/weight");
  EXPECT_EQ(w.spec.to_string(), "P(ep, fsdp, None)");
  EXPECT_EQ(w.local_shape, (std::vector<int64_t>{4, 128, 128}));
  EXPECT_EQ(w.bytes_per_rank, 8 / 2 * 128 * 128 * 4);  // E/ep * in * out * 4
  EXPECT_EQ(w.replicas, 1);
  EXPECT_EQ(plan.find("layers/1/experts/bias").spec.to_string(), "P(ep, fsdp)");
  EXPECT_EQ(plan.find("layers/1/experts/bias").local_shape, (std::vector<int64_t>{4, 128}));
  EXPECT_EQ(plan.find("layers/1/router/weight").spec.to_string(), "P()");
  EXPECT_EQ(plan.find("layers/1/router/weight").replicas, 2);

  ASSERT_EQ(plan.layers.size(), 3u);
  EXPECT_FALSE(plan.layers[0].moe);
  const LayerPlan& l = plan.layers[1];
  EXPECT_TRUE(l.moe);
  EXPECT_EQ(l.name, "layers/1");
  EXPECT_EQ(l.compute, describe_moe_layout(l.moe_layout));
  EXPECT_EQ(l.compute.rfind("MoE in 128 -> out 128, 8 experts top-2, 4 per rank over (ep) by "
                            "all-to-all",
                            0),
            0u)
      << l.compute;
  EXPECT_EQ(l.moe_layout.ep, 2);
  EXPECT_EQ(l.moe_layout.experts_local, 4);
  EXPECT_EQ(l.moe_layout.expert_axes, (std::vector<std::string>{"ep"}));
  const auto all_to_alls = of_kind(l, CollectiveKind::all_to_all);
  ASSERT_EQ(all_to_alls.size(), 4u);  // dispatch and return, forward and backward
  for (const LayerCollective* c : all_to_alls) {
    EXPECT_EQ(c->axes, (std::vector<std::string>{"ep"}));
    EXPECT_EQ(c->ranks, 2);
    EXPECT_EQ(c->shape, (std::vector<int64_t>{64, 128}));
    EXPECT_EQ(c->bytes_per_rank, 32 * 2 * 128 * 4 * (2 - 1) / 2);  // R*k*in*4*(ep-1)/ep
  }
  EXPECT_EQ(all_to_alls[0]->phase, "forward");
  EXPECT_EQ(all_to_alls[0]->operand, "dispatched rows");
  EXPECT_EQ(all_to_alls[3]->phase, "backward");
  EXPECT_EQ(all_to_alls[3]->operand, "dispatched row gradients");
  int64_t sum = 0;
  for (const auto& c : l.collectives) sum += c.bytes_per_rank;
  EXPECT_EQ(l.collective_bytes_per_step, sum);
  int64_t total = 0;
  for (const auto& layer : plan.layers) total += layer.collective_bytes_per_step;
  EXPECT_EQ(plan.totals.collective_bytes_per_step, total);

  // The chain: the dense layer 0 feeds the MoE layer, whose output is replicated.
  EXPECT_EQ(l.layout.in, 128);
  EXPECT_EQ(l.layout.out_local, 128);
  EXPECT_EQ(l.layout.output_layout(), FeatureLayout::replicated);
  EXPECT_FALSE(l.layout.tensor_parallel);
  EXPECT_EQ(plan.layers[2].layout.input_layout, FeatureLayout::replicated);
  // The dense layers' gradients are all-reduced over ep, a batch axis of an MoE model.
  EXPECT_NE(
      find_collective(plan.layers[0], "backward", CollectiveKind::all_reduce, "weight gradient"),
      nullptr);

  // Dispatch buffers (layers/moe.cpp), worst case (R = 32, k = 2, A = R*k = 64 rows sent,
  // capacity C = ep*A = 128, in = out = 128, E = 8): send A*in, received and expert-major
  // 2*C*in, expert outputs 2*C*out, returned A*out, output gradients to send A*out, the
  // experts' input gradients C*in, routing 3*R*E floats; 16 B per routed row, 12 B per
  // received row.
  const int64_t floats =
      64 * 128 + 2 * 128 * 128 + 2 * 128 * 128 + 64 * 128 + 64 * 128 + 128 * 128 + 3 * 32 * 8;
  const int64_t buffers = 4 * floats + 16 * 64 + 12 * 128;
  EXPECT_EQ(l.moe_buffer_bytes, buffers);
  EXPECT_EQ(plan.totals.moe_buffer_bytes, buffers);
  EXPECT_EQ(plan.totals.bytes_per_rank(), plan.totals.parameter_bytes + plan.totals.gradient_bytes +
                                              plan.totals.optimizer_bytes + buffers);
  EXPECT_TRUE(plan.replicated_axes.empty());
  EXPECT_TRUE(plan.notes.empty()) << plan.notes.front();
}

// ep = 4 x fsdp = 2: each rank stores 2 experts' halves (rows over fsdp), gathers them over
// fsdp before use and reduce-scatters their gradient; the all-to-alls run over ep = 4.
TEST(MoePlan, ExpertsOverEpAndFsdp) {
  const ShardingPlan plan = moe_plan(full_mesh({{"fsdp", 2}, {"ep", 4}}), "fsdp");
  EXPECT_EQ(plan.local_batch_rows, 8);  // 64 rows over (fsdp, ep) = 8
  const auto& w = plan.find("layers/1/experts/weight");
  EXPECT_EQ(w.spec.to_string(), "P(ep, fsdp, None)");
  EXPECT_EQ(w.local_shape, (std::vector<int64_t>{2, 64, 128}));
  EXPECT_EQ(w.bytes_per_rank, 8 / 4 * 128 * 128 * 4 / 2);  // E/ep * in * out * 4, halved
  const LayerPlan& l = plan.layers[1];
  ASSERT_TRUE(l.moe);
  EXPECT_EQ(l.moe_layout.experts_local, 2);
  EXPECT_EQ(l.moe_layout.experts_weight.gather(), (std::vector<std::string>{"fsdp"}));
  const LayerCollective* gather =
      find_collective(l, "forward", CollectiveKind::all_gather, "expert weights");
  ASSERT_NE(gather, nullptr);
  EXPECT_EQ(gather->shape, (std::vector<int64_t>{2, 128, 128}));
  EXPECT_EQ(gather->bytes_per_rank, 2 * 128 * 128 * 4 / 2);
  EXPECT_NE(
      find_collective(l, "backward", CollectiveKind::reduce_scatter, "expert weight gradient"),
      nullptr);
  const auto all_to_alls = of_kind(l, CollectiveKind::all_to_all);
  ASSERT_EQ(all_to_alls.size(), 4u);
  for (const LayerCollective* c : all_to_alls) {
    EXPECT_EQ(c->axes, (std::vector<std::string>{"ep"}));
    EXPECT_EQ(c->ranks, 4);
    EXPECT_EQ(c->bytes_per_rank, 8 * 2 * 128 * 4 * 3 / 4);
  }
  // The router sees every row: its gradient is all-reduced over (fsdp, ep).
  const LayerCollective* router =
      find_collective(l, "backward", CollectiveKind::all_reduce, "router gradient");
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->axes, (std::vector<std::string>{"fsdp", "ep"}));
  // Worst case: all ep * R * min(k, 2 experts here) = 64 rows at one rank (A = R * k = 16
  // sent by each).
  EXPECT_EQ(l.moe_buffer_bytes, 4 * (16 * 128 + 2 * 64 * 128 + 2 * 64 * 128 + 16 * 128 + 16 * 128 +
                                     64 * 128 + 3 * 8 * 8) +
                                    16 * 16 + 12 * 64);
  EXPECT_TRUE(plan.notes.empty());
}

// ep x dp: the experts replicated over dp, so their gradients are all-reduced over dp; the
// router's over (dp, ep).
TEST(MoePlan, ExpertsOverEpWithDataParallel) {
  const ShardingPlan plan = moe_plan(full_mesh({{"dp", 2}, {"ep", 2}}), "dp");
  EXPECT_EQ(plan.local_batch_rows, 16);
  const auto& w = plan.find("layers/1/experts/weight");
  EXPECT_EQ(w.spec.to_string(), "P(ep, None, None)");
  EXPECT_EQ(w.bytes_per_rank, 8 / 2 * 128 * 128 * 4);
  EXPECT_EQ(w.replicas, 2);
  const LayerPlan& l = plan.layers[1];
  const LayerCollective* experts =
      find_collective(l, "backward", CollectiveKind::all_reduce, "expert weight gradient");
  ASSERT_NE(experts, nullptr);
  EXPECT_EQ(experts->axes, (std::vector<std::string>{"dp"}));
  EXPECT_EQ(experts->shape, (std::vector<int64_t>{4, 128, 128}));
  const LayerCollective* router =
      find_collective(l, "backward", CollectiveKind::all_reduce, "router gradient");
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->axes, (std::vector<std::string>{"dp", "ep"}));
  for (const LayerCollective* c : of_kind(l, CollectiveKind::all_to_all)) {
    EXPECT_EQ(c->axes, (std::vector<std::string>{"ep"}));
    EXPECT_EQ(c->bytes_per_rank, 16 * 2 * 128 * 4 / 2);
  }
  EXPECT_EQ(of_kind(l, CollectiveKind::all_gather).size(), 1u);  // the expert counts only
  EXPECT_TRUE(plan.notes.empty());
}

// Without a global batch the activation-sized all-to-alls and the buffers are left out; the
// first layer being MoE computes no input gradient (no return all-to-all backward).
TEST(MoePlan, UnknownBatchAndFirstLayer) {
  const ShardingPlan unknown =
      moe_plan(full_mesh({{"ep", 2}}), "fsdp", moe_settings(), moe_options(0));
  EXPECT_TRUE(of_kind(unknown.layers[1], CollectiveKind::all_to_all).empty());
  EXPECT_EQ(unknown.totals.moe_buffer_bytes, 0);
  MoeSettings first = moe_settings();
  first.layers = {0};
  const ShardingPlan plan =
      make_plan(mlp_parameter_shapes(kMoeSizes, first), full_mesh({{"ep", 2}}),
                preset_rules("fsdp", true), moe_options(), mlp_linear_layers(kMoeSizes, first));
  ASSERT_TRUE(plan.layers[0].moe);
  EXPECT_EQ(of_kind(plan.layers[0], CollectiveKind::all_to_all).size(), 3u);
  EXPECT_EQ(find_collective(plan.layers[0], "backward", CollectiveKind::all_to_all,
                            "dispatched row gradients"),
            nullptr);
  // Experts that do not divide by ep are an error naming the key, the ranks and the layer.
  expect_bad_input(
      [] {
        moe_plan(full_mesh({{"ep", 4}}), "fsdp", moe_settings(6));
      },
      {"model.experts = 6 does not divide by the 4 ranks of the expert axes (ep)", "'layers/1'",
       "'layers/1/experts/weight'"});
  // Without the layers it is the rule's error.
  expect_bad_input(
      [] {
        make_plan(mlp_parameter_shapes(kMoeSizes, moe_settings(6)), full_mesh({{"ep", 4}}),
                  preset_rules("fsdp", true), moe_options());
      },
      {"'layers/1/experts/weight'", "dim 0", "size 6", "ep=4"});
}

// The evaluation batch's buffers count an MoE layer's output like a linear layer's.
TEST(MoePlan, EvaluationBytesIncludeMoeOutputs) {
  PlanOptions options = moe_options();
  options.eval_global_batch = 128;  // 64 rows per rank on ep = 2
  const ShardingPlan plan = moe_plan(full_mesh({{"ep", 2}}), "fsdp", moe_settings(), options);
  EXPECT_EQ(plan.totals.evaluation_bytes, 4 * 64 * (64 + 1 + 128 + 128 + 10));
}

// A mesh axis that splits no parameter and no batch rows repeats the same compute on each of
// its ranks: the plan says so.
TEST(ReplicatedAxes, NotedWhenAnAxisSplitsNothing) {
  const std::string ep_note =
      "mesh axis 'ep' (size 2) splits no parameter and no batch rows: every ep rank computes "
      "the same thing (compute replicated over ep)";
  EXPECT_EQ(replicated_axis_note("ep", 2), ep_note);
  PlanOptions options = no_minimum();
  options.global_batch = 64;
  // ep = 2 without MoE layers: nothing uses ep.
  const ShardingPlan ep =
      make_plan(mlp_parameter_shapes(kMnist), full_mesh({{"fsdp", 2}, {"ep", 2}}),
                preset_rules("fsdp"), options, mlp_linear_layers(kMnist));
  EXPECT_EQ(ep.replicated_axes, (std::vector<std::string>{"ep"}));
  EXPECT_EQ(ep.notes, (std::vector<std::string>{ep_note}));
  // sp is never a batch axis by default.
  const ShardingPlan sp = make_plan(mlp_parameter_shapes(kMnist), full_mesh({{"dp", 2}, {"sp", 2}}),
                                    preset_rules("dp"), options, mlp_linear_layers(kMnist));
  EXPECT_EQ(sp.replicated_axes, (std::vector<std::string>{"sp"}));
  EXPECT_TRUE(has_note(sp.notes, "mesh axis 'sp' (size 2) splits no parameter"));
  // tp with rules that split nothing over it (no layer is tensor parallel).
  const ShardingPlan tp = make_plan(mlp_parameter_shapes(kMnist), full_mesh({{"dp", 2}, {"tp", 2}}),
                                    preset_rules("dp"), options, mlp_linear_layers(kMnist));
  EXPECT_EQ(tp.replicated_axes, (std::vector<std::string>{"tp"}));
  // Normal meshes: nothing to say.
  for (const auto& [mesh, preset] : std::vector<std::pair<Mesh, std::string>>{
           {full_mesh({{"fsdp", 4}}), "fsdp"},
           {full_mesh({{"dp", 4}}), "dp"},
           {full_mesh({{"tp", 4}}), "tp"},
           {full_mesh({{"dp", 2}, {"fsdp", 2}, {"tp", 2}}), "fsdp_tp"}}) {
    const ShardingPlan plan = make_plan(mlp_parameter_shapes(kMnist), mesh, preset_rules(preset),
                                        options, mlp_linear_layers(kMnist));
    EXPECT_TRUE(plan.replicated_axes.empty()) << preset;
    EXPECT_TRUE(plan.notes.empty()) << preset << ": " << plan.notes.front();
  }
  // An MoE model's ep splits the experts and the rows: no note.
  EXPECT_TRUE(moe_plan(full_mesh({{"ep", 2}}), "fsdp").replicated_axes.empty());
}

TEST(Format, BytesAndShapes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(2678824), "2.55 MiB");
  EXPECT_EQ(format_bytes(3LL << 30), "3.00 GiB");
  EXPECT_EQ(format_shape({784, 512}), "[784, 512]");
  EXPECT_EQ(format_shape({}), "[]");
  EXPECT_EQ(format_shape({8, 128, 64}), "[8, 128, 64]");
}

// ---- a residual model's stream under the presets (issue 36) ----------------------------

// The plan of a residual_mlp (depth 2, LayerNorm, SiLU) under `preset` with the default
// min_sharding_size (16384).
ShardingPlan residual_stream_plan(const Mesh& mesh, const std::string& preset, int64_t inputs,
                                  int64_t width, int64_t hidden) {
  ResidualMlpShape s;
  s.inputs = inputs;
  s.outputs = 3;
  s.width = width;
  s.hidden = hidden;
  s.depth = 2;
  s.norm_kind = NormKind::layernorm;
  return make_plan(residual_mlp_parameter_shapes(s), mesh,
                   preset_rules(preset, false, true, /*residual=*/true), PlanOptions{},
                   residual_mlp_linear_layers(s), residual_mlp_norm_layers(s));
}

// Every block's last layer leaves the stream as the input projection does.
void expect_one_stream_layout(const ShardingPlan& plan, FeatureLayout expected) {
  EXPECT_EQ(plan.layers.front().layout.output_layout(), expected) << "the input projection";
  for (const LayerPlan& l : plan.layers) {
    if (l.ends_residual_block) EXPECT_EQ(l.layout.output_layout(), expected) << l.name;
  }
}

// The issue's model: input projection 16 x 128 below min_sharding_size, up and down 128 x 256
// above it. The blocks split the stream over tp, so the input projection becomes
// column-parallel and splits it too (its bias stays whole, below the minimum).
TEST(ResidualStream, SmallInputProjectionTurnsColumnParallelUnderTp) {
  for (const std::string preset : {"tp", "dp_tp", "fsdp_tp"}) {
    SCOPED_TRACE(preset);
    const Mesh mesh = preset == "tp" ? mesh_of({{"tp", 2}}) : mesh_of({{"fsdp", 2}, {"tp", 2}});
    const ShardingPlan plan = residual_stream_plan(mesh, preset, 16, 128, 256);
    const ParameterPlan& weight = plan.find("input/weight");
    EXPECT_EQ(weight.spec.to_string(), "P(None, tp)");
    EXPECT_EQ(weight.local_shape, (std::vector<int64_t>{16, 64}));
    EXPECT_TRUE(has_note(weight.notes, "column-parallel P(None, tp)")) << weight.notes.back();
    EXPECT_EQ(plan.find("input/bias").spec.to_string(), "P()");
    EXPECT_TRUE(plan.layers.front().layout.column_parallel);
    EXPECT_TRUE(has_note(plan.notes, "residual stream"));
    expect_one_stream_layout(plan, FeatureLayout::split);
    // The norms read the split stream.
    for (const NormPlan& n : plan.norms) EXPECT_EQ(n.layout.layout, FeatureLayout::split) << n.name;
  }
}

// The reverse: the input projection (512 x 32) at the minimum, the blocks' projections
// (32 x 64) below it, so the blocks leave the stream whole: the input projection keeps it
// whole too (not split over tp; fsdp_tp keeps its fsdp storage split).
TEST(ResidualStream, SmallBlocksKeepTheInputProjectionWholeOverTp) {
  {
    const ShardingPlan plan = residual_stream_plan(mesh_of({{"tp", 2}}), "tp", 512, 32, 64);
    EXPECT_EQ(plan.find("input/weight").spec.to_string(), "P()");
    EXPECT_TRUE(has_note(plan.find("input/weight").notes, "not split over tp"));
    EXPECT_EQ(plan.find("input/bias").spec.to_string(), "P()");
    expect_one_stream_layout(plan, FeatureLayout::replicated);
  }
  {
    const ShardingPlan plan =
        residual_stream_plan(mesh_of({{"fsdp", 2}, {"tp", 2}}), "fsdp_tp", 512, 32, 64);
    const ParameterPlan& weight = plan.find("input/weight");
    EXPECT_EQ(weight.spec.to_string(), "P(None, fsdp)");
    EXPECT_EQ(weight.local_shape, (std::vector<int64_t>{512, 16}));
    expect_one_stream_layout(plan, FeatureLayout::replicated);
  }
}

// Where the preset's layout is consistent already, nothing changes (the presets' runs stay
// bit for bit): min_sharding_size 0, and a model large enough for the default minimum.
TEST(ResidualStream, ConsistentPresetsAreLeftAlone) {
  ResidualMlpShape s;
  s.inputs = 128;
  s.outputs = 3;
  s.width = 128;
  s.hidden = 256;
  s.depth = 2;
  for (int64_t minimum : {int64_t{0}, int64_t{16384}}) {
    SCOPED_TRACE(minimum);
    PlanOptions options;
    options.min_sharding_size = minimum;
    const ShardingPlan plan =
        make_plan(residual_mlp_parameter_shapes(s), mesh_of({{"tp", 2}}),
                  preset_rules("tp", false, true, true), options, residual_mlp_linear_layers(s));
    EXPECT_EQ(plan.find("input/weight").spec.to_string(), "P(tp, None)");
    EXPECT_FALSE(has_note(plan.notes, "residual stream"));
    expect_one_stream_layout(plan, FeatureLayout::split);
  }
}

// The user's own rules are not changed: a stream they leave in two layouts is refused by the
// plan (not first by the model on every rank), naming the block and what to change.
TEST(ResidualStream, UserRulesThatSplitTheStreamTwoWaysAreRefused) {
  ResidualMlpShape s;
  s.inputs = 16;
  s.outputs = 3;
  s.width = 128;
  s.hidden = 256;
  s.depth = 2;
  const std::vector<PartitionRule> rules = {rule("blocks/[0-9]+/up/weight$", "P(None, tp)"),
                                            rule("blocks/[0-9]+/down/weight$", "P(tp, None)"),
                                            rule(".*", "P()")};
  expect_bad_input(
      [&] {
        make_plan(residual_mlp_parameter_shapes(s), mesh_of({{"tp", 2}}), rules, PlanOptions{},
                  residual_mlp_linear_layers(s));
      },
      {"residual block 'blocks/0'", "split features over tp", "arrives replicated",
       "partition.rules", "partition.min_sharding_size (16384"});
}

// Table-wise placement (docs/recsys.md): P(axis@table) tables balanced by bytes over the axis,
// largest first onto the least loaded member; P(axis@k) pins one.
TEST(Planner, TableWiseTablesAreBalancedByBytes) {
  const std::vector<ParameterShape> params = {
      {"embeddings/a/weight", {10, 4}},   {"embeddings/b/weight", {100, 4}},
      {"embeddings/c/weight", {60, 4}},   {"embeddings/d/weight", {50, 4}},
      {"embeddings/pin/weight", {30, 4}}, {"top/0/weight", {4, 1}}};
  const ShardingPlan plan =
      make_plan(params, mesh_of({{"fsdp", 2}, {"dp", 2}}),
                {rule("embeddings/pin/", "P(fsdp@1)"), rule("embeddings/", "P(fsdp@table, None)"),
                 rule(".*", "P()")},
                no_minimum());
  // Loads (rows x 4 x 4 bytes): pin 30 rows on member 1 first; then b (100) -> 0, c (60) -> 1
  // (30 < 100), d (50) -> 1 (90 < 100), a (10) -> 0 (100 < 140).
  const std::map<std::string, int> expected = {{"embeddings/a/weight", 0},
                                               {"embeddings/b/weight", 0},
                                               {"embeddings/c/weight", 1},
                                               {"embeddings/d/weight", 1},
                                               {"embeddings/pin/weight", 1}};
  for (const auto& [name, member] : expected) {
    const ParameterPlan& p = plan.find(name);
    EXPECT_EQ(p.spec.to_string(), "P(fsdp@" + std::to_string(member) +
                                      (name == "embeddings/pin/weight" ? ")" : ", None)"))
        << name;
    EXPECT_EQ(p.local_shape, p.shape) << name;  // the holder's
    EXPECT_EQ(p.bytes_per_rank, p.shape[0] * 4 * 4) << name;
    EXPECT_EQ(p.replicas, 2) << name;  // the holder's dp copies
    ASSERT_FALSE(p.notes.empty()) << name;
    EXPECT_NE(p.notes.back().find(name == "embeddings/pin/weight" ? "pinned" : "balanced"),
              std::string::npos)
        << p.notes.back();
  }
  // Per rank: the most loaded member (1: 140 rows) plus the replicated top weight.
  EXPECT_EQ(plan.totals.parameter_bytes, 140 * 16 + 4 * 4);
  EXPECT_EQ(plan.totals.global_parameter_bytes, (250 * 4 + 4) * 4);
  // Planning the same inputs a second time in this process places every table the same (no
  // state carried between calls; that other processes agree rests on the placement reading
  // only its inputs, which this does not show).
  const ShardingPlan again =
      make_plan(params, mesh_of({{"fsdp", 2}, {"dp", 2}}),
                {rule("embeddings/pin/", "P(fsdp@1)"), rule("embeddings/", "P(fsdp@table, None)"),
                 rule(".*", "P()")},
                no_minimum());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(again.parameters[i].spec, plan.parameters[i].spec);
  }
}

// ZeRO-1 does not chunk a table-wise tensor over dp (partition/zero1_layout.hpp: dp added to
// `fsdp@1` would name another holder): its holders keep the whole state, and the totals count
// the most loaded member of each group as without ZeRO-1, not every table's holder bytes on
// every rank. The same tables and mesh as above (member 1 holds 140 rows x 4 x 4 bytes).
TEST(Planner, ZeroOneKeepsTableWiseTablesWhole) {
  EXPECT_FALSE(zero1_splits(2, PartitionSpec::parse("P(fsdp@1)"), 2));
  EXPECT_FALSE(zero1_splits(2, PartitionSpec::parse("P(fsdp@table, None)"), 2));
  EXPECT_TRUE(zero1_splits(2, PartitionSpec::parse("P(fsdp, None)"), 2));
  const std::vector<ParameterShape> params = {
      {"embeddings/a/weight", {10, 4}},   {"embeddings/b/weight", {100, 4}},
      {"embeddings/c/weight", {60, 4}},   {"embeddings/d/weight", {50, 4}},
      {"embeddings/pin/weight", {30, 4}}, {"top/0/weight", {4, 1}}};
  PlanOptions options = no_minimum();
  options.zero_stage = 1;
  const ShardingPlan plan =
      make_plan(params, mesh_of({{"fsdp", 2}, {"dp", 2}}),
                {rule("embeddings/pin/", "P(fsdp@1)"), rule("embeddings/", "P(fsdp@table, None)"),
                 rule(".*", "P()")},
                options);
  // State: member 1's tables whole (140 rows x 16 bytes) plus dp rank 0's 2 of the top
  // weight's 4 rows (2 x 4 bytes); 2 slots (AdamW).
  EXPECT_EQ(plan.totals.optimizer_bytes, 2 * (140 * 16 + 2 * 4));
  // ZeRO-1's buffers: the top weight's gradient chunk and its send chunk only (4 rows divide by
  // dp = 2: no padding).
  EXPECT_EQ(plan.totals.zero1_buffer_bytes, 2 * 4 + 2 * 4);
}

TEST(Planner, TableWiseBadFormsNameTheRuleAndSpec) {
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"tp", 2}});
  expect_bad_input(
      [&] {
        make_plan({{"layers/0/weight", {4, 4}}}, mesh, {rule("weight", "P(fsdp@table, None)")},
                  no_minimum());
      },
      {"'layers/0/weight'", "rule 0 'weight' -> P(fsdp@table, None)", "embedding tables only"});
  expect_bad_input(
      [&] {
        make_plan({{"embeddings/a/weight", {4, 4}}}, mesh, {rule("a", "P(None, fsdp@table)")},
                  no_minimum());
      },
      {"'embeddings/a/weight'", "P(None, fsdp@table)", "dimension 0", "not on dimension 1"});
  expect_bad_input(
      [&] {
        make_plan({{"embeddings/a/weight", {4, 4}}}, mesh, {rule("a", "P(fsdp@table, tp)")},
                  no_minimum());
      },
      {"'embeddings/a/weight'", "P(fsdp@table, tp)", "split of dimension 1"});
  expect_bad_input(
      [&] {
        make_plan({{"embeddings/a/weight", {4, 4}}}, mesh, {rule("a", "P(ep@table)")},
                  no_minimum());
      },
      {"'embeddings/a/weight'", "rule 0 'a' -> P(ep@table)", "'ep'", "does not have"});
  expect_bad_input(
      [&] {
        make_plan({{"embeddings/a/weight", {4, 4}}}, mesh, {rule("a", "P(fsdp@2)")}, no_minimum());
      },
      {"'embeddings/a/weight'", "P(fsdp@2)", "member 2 of fsdp=2", "0 to 1"});
}

}  // namespace
}  // namespace meshtrain
