// `meshtrain plan` output: the text table and the JSON document of a small config.
#include "apps/plan.hpp"

#include <gtest/gtest.h>

#include <sstream>

#include "framework/config.hpp"
#include "tests/test_support.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

const char* kConfig = R"(
[mesh]
fsdp = -1
tp = 2

[partition]
preset = "fsdp_tp"
min_sharding_size = 0

[model]
sizes = [784, 512, 512, 10]

[data]
source = "synthetic"

[train]
steps = 1
)";

std::string plan_text(const RunConfig& config, int world, bool json) {
  std::ostringstream out;
  print_plan(config, world, json, out);
  return out.str();
}

void expect_contains(const std::string& text, const std::string& fragment) {
  EXPECT_NE(text.find(fragment), std::string::npos) << "missing '" << fragment << "' in:\n" << text;
}

TEST(PlanPrint, TextHasHeaderTableTotalsAndPictures) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  const std::string text = plan_text(config, 4, false);
  expect_contains(text, "plan of fsdp_tp.toml for 4 ranks");
  expect_contains(text, "mesh: 2x2 (fsdp=2, tp=2)");
  expect_contains(text, "rule 0 'weight$' -> P(tp, fsdp)");
  // The table: name, global shape, rule, spec, local shape, bytes per rank.
  expect_contains(text, "layers/0/weight  [784, 512]  0     P(tp, fsdp)  [392, 256]");
  expect_contains(text, "layers/2/bias    [10]        1     P(tp)        [5]");
  // (100352 + 256 + 65536 + 256 + 1280 + 5) * 4 bytes = 670740 B = 655.02 KiB.
  expect_contains(text, "parameters       655.02 KiB");
  expect_contains(text, "optimizer state  1.28 MiB");
  expect_contains(text, "unsharded model    2.55 MiB");
  expect_contains(text, "rule 2 '.*' -> P()");  // unused
  // Pictures: w0 rows over tp (neighbours 0,1), columns over fsdp (0, 2).
  expect_contains(text,
                  "layers/0/weight [784, 512] P(tp, fsdp)\n"
                  "+---+---+\n"
                  "| 0 | 2 |\n"
                  "+---+---+\n"
                  "| 1 | 3 |\n"
                  "+---+---+\n");
}

TEST(PlanPrint, TextNotesFallbacksAndSkipsPicturesOnLargeMeshes) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  const std::string text = plan_text(config, 4096, false);
  expect_contains(text, "mesh: 2048x2 (fsdp=2048, tp=2)");
  expect_contains(text, "dim 1 (512) does not divide by fsdp=2048: replicated");
  expect_contains(text, "no sharding pictures");
  EXPECT_EQ(text.find("+---"), std::string::npos);
}

TEST(PlanPrint, JsonDocument) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  const auto doc = nlohmann::json::parse(plan_text(config, 4, true));
  EXPECT_EQ(doc["mesh"]["world_size"], 4);
  EXPECT_EQ(doc["mesh"]["axes"]["fsdp"], 2);
  EXPECT_EQ(doc["mesh"]["axes"]["tp"], 2);
  ASSERT_EQ(doc["parameters"].size(), 6u);
  const auto& w0 = doc["parameters"][0];
  EXPECT_EQ(w0["name"], "layers/0/weight");
  EXPECT_EQ(w0["shape"], nlohmann::json({784, 512}));
  EXPECT_EQ(w0["rule"], 0);
  EXPECT_EQ(w0["spec"], nlohmann::json({"tp", "fsdp"}));
  EXPECT_EQ(w0["local_shape"], nlohmann::json({392, 256}));
  EXPECT_EQ(w0["bytes_per_rank"], 392 * 256 * 4);
  EXPECT_TRUE(w0["notes"].empty());
  EXPECT_EQ(doc["totals"]["parameter_bytes"], 670740);
  EXPECT_EQ(doc["totals"]["optimizer_bytes"], 2 * 670740);
  EXPECT_EQ(doc["totals"]["global_parameter_bytes"], 669706 * 4);
  EXPECT_EQ(doc["unused_rules"], nlohmann::json({2}));
  // Mesh axes keep mesh order; None entries are null, tuples are lists.
  const auto ordered = nlohmann::ordered_json::parse(plan_text(config, 4, true));
  std::vector<std::string> axes;
  for (const auto& item : ordered["mesh"]["axes"].items()) axes.push_back(item.key());
  EXPECT_EQ(axes, (std::vector<std::string>{"dp", "fsdp", "ep", "tp", "sp"}));
  const RunConfig batch = parse_config(
      std::string(kConfig) + "\n", "batch.toml",
      {"partition.preset=dp", R"(partition.rules=[["weight", [["fsdp", "tp"], ""]]])"});
  const auto doc2 = nlohmann::json::parse(plan_text(batch, 4, true));
  EXPECT_EQ(doc2["parameters"][0]["spec"], nlohmann::json::parse(R"([["fsdp", "tp"], null])"));
}

TEST(PlanPrint, BadInputNamesTheProblem) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  expect_bad_input([&] { plan_text(config, 3, false); }, {"[mesh]", "tp"});
  const RunConfig ep_rule =
      parse_config(kConfig, "axis.toml", {R"(partition.rules=[["bias", ["ep"]]])", "mesh.tp=1"});
  // ep is in the mesh (size 1): fine. A spec that does not divide is an error for user rules.
  const RunConfig indivisible = parse_config(
      kConfig, "div.toml", {R"(partition.rules=[["layers/2/bias", ["tp"]]])", "mesh.tp=4"});
  expect_bad_input([&] { plan_text(indivisible, 8, false); },
                   {"'layers/2/bias'", "dim 0", "size 10", "tp=4"});
  EXPECT_NO_THROW(plan_text(ep_rule, 2, false));
}

}  // namespace
}  // namespace meshtrain
