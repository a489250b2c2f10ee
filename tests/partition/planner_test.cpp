#include "partition/planner.hpp"

#include <gtest/gtest.h>

#include "partition/rules.hpp"
#include "tests/test_support.hpp"

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
  auto specs = [](const std::string& preset) {
    std::vector<std::string> out;
    for (const auto& r : preset_rules(preset)) {
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

TEST(Format, BytesAndShapes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(2678824), "2.55 MiB");
  EXPECT_EQ(format_bytes(3LL << 30), "3.00 GiB");
  EXPECT_EQ(format_shape({784, 512}), "[784, 512]");
  EXPECT_EQ(format_shape({}), "[]");
}

}  // namespace
}  // namespace meshtrain
