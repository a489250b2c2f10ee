// `meshtrain plan` output: the text table and the JSON document of a small config.
#include "framework/train/plan_report.hpp"

#include <gtest/gtest.h>

#include <map>
#include <sstream>

#include "framework/train/config.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/idx_files.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

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
  expect_contains(text, "parameters                   655.02 KiB");
  expect_contains(text, "optimizer state              1.28 MiB");
  expect_contains(text, "unsharded model                2.55 MiB");
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

// The layers section: each layer's compute layout and collectives per training step with
// bytes per rank. fsdp=2 x tp=2, global batch 128 (64 rows per rank): layer 0 gathers its
// weight block [392, 512] over fsdp (802816 B x 1/2 = 392 KiB) and reduce-scatters its output
// [64, 512] over tp (131072 B x 1/2 = 64 KiB). With tp=4 the 10-output layer all-reduces.
TEST(PlanPrint, TextHasLayersWithCollectives) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  const std::string text = plan_text(config, 4, false);
  expect_contains(text, "global batch 128 = 64 rows per rank");
  expect_contains(text,
                  "layers/0: TP in 784 -> out 512 (split 256), weight gathered over (fsdp) on "
                  "dim 1\n");
  expect_contains(
      text, "forward   all-gather      weight           [392, 512]  fsdp=2        392.00 KiB");
  expect_contains(text,
                  "forward   reduce-scatter  output           [64, 512]   tp=2          64.00 KiB");
  expect_contains(text,
                  "backward  all-reduce      bias gradient    [512]       (fsdp, tp)=4  3.00 KiB");
  // 2343740 B in all (see JsonDocument).
  expect_contains(text, "collectives per rank per step: 2.24 MiB");

  const RunConfig tp4 = parse_config(kConfig, "tp.toml", {"partition.preset=tp", "mesh.tp=4"});
  const std::string tp_text = plan_text(tp4, 4, false);
  expect_contains(
      tp_text,
      "layers/2: TP in 512 (split 128) -> out 10 (all-reduced, replicated: 10 % 4 != 0)\n"
      "  note: output features 10 do not divide by tp=4: the layer all-reduces "
      "its output over tp and keeps it replicated\n");
  // 2 x (128 x 10 x 4 B) x 3/4.
  expect_contains(tp_text, "forward  all-reduce  output   [128, 10]  tp=4   7.50 KiB");
}

TEST(PlanPrint, TextNotesFallbacksAndSkipsPicturesOnLargeMeshes) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  const std::string text = plan_text(config, 4096, false);
  expect_contains(text, "mesh: 2048x2 (fsdp=2048, tp=2)");
  expect_contains(text, "dim 1 (512) does not divide by fsdp=2048: replicated");
  expect_contains(text, "no sharding pictures");
  EXPECT_EQ(text.find("+---"), std::string::npos);
  // 128 rows do not split over 2048 batch shards: the plan still answers, and says so.
  expect_contains(text,
                  "note: global batch 128 does not divide by the 2048 batch shards (mesh axes "
                  "fsdp, dp, sp): activation collectives left out");
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
  // The layers: compute layout, collectives with bytes per rank, and the total per step.
  EXPECT_EQ(doc["options"]["batch_axes"], nlohmann::json({"fsdp", "dp", "sp"}));
  EXPECT_EQ(doc["options"]["feature_axis"], "tp");
  EXPECT_EQ(doc["options"]["global_batch"], 128);
  EXPECT_EQ(doc["local_batch_rows"], 64);
  ASSERT_EQ(doc["layers"].size(), 3u);
  const auto& l2 = doc["layers"][2];
  EXPECT_EQ(l2["name"], "layers/2");
  EXPECT_EQ(l2["compute"],
            "TP in 512 (split 256) -> out 10 (split 5), weight gathered over (fsdp) on dim 1");
  EXPECT_EQ(l2["tensor_parallel"], true);
  EXPECT_EQ(l2["input_layout"], "split");
  EXPECT_EQ(l2["output_layout"], "split");
  ASSERT_EQ(l2["collectives"].size(), 7u);
  const auto& rs = l2["collectives"][1];
  EXPECT_EQ(rs["phase"], "forward");
  EXPECT_EQ(rs["kind"], "reduce-scatter");
  EXPECT_EQ(rs["operand"], "output");
  EXPECT_EQ(rs["axes"], nlohmann::json({"tp"}));
  EXPECT_EQ(rs["ranks"], 2);
  EXPECT_EQ(rs["shape"], nlohmann::json({64, 10}));
  EXPECT_EQ(rs["bytes_per_rank"], 64 * 10 * 4 / 2);
  // Layer 2: weight [256, 10] over fsdp 3 x 5120, activations [64, 10] over tp 3 x 1280,
  // bias gradient 2 x 40 x 3/4 = 60.
  EXPECT_EQ(l2["collective_bytes_per_step"], 19260);
  // Layers 0 and 1: 3 x 401408 + 2 x 65536 + 3072 and 3 x 262144 + 3 x 65536 + 3072.
  EXPECT_EQ(doc["layers"][0]["collective_bytes_per_step"], 1338368);
  EXPECT_EQ(doc["layers"][1]["collective_bytes_per_step"], 986112);
  EXPECT_EQ(doc["totals"]["collective_bytes_per_step"], 1338368 + 986112 + 19260);
  EXPECT_TRUE(doc["notes"].empty());
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

// A table-wise entry is its text as a string in the JSON, over one axis or several
// (docs/recsys.md, "Table-wise placement"), while the other tuple entries are arrays: on fsdp
// 2 x dp 2, big (256 B) on member 0 of (fsdp, dp), small (96 B) on member 1 of fsdp.
TEST(PlanPrint, TableWiseSpecIsItsTextInJson) {
  const char* dlrm = R"toml(
[mesh]
fsdp = 2
dp = 2
[partition]
min_sharding_size = 0
rules = [["embeddings/big/weight", "P((fsdp, dp)@table)"], ["embeddings/small/weight", "P(fsdp@1)"],
         ["bottom/0/weight", [["fsdp", "dp"], ""]], [".*", "P()"]]
[model]
kind = "dlrm"
bottom = [4, 4]
top = [7, 1]                  # 4 + 2 * 3 / 2
[[model.tables]]
name = "big"
rows = 16
[[model.tables]]
name = "small"
rows = 6
[data]
source = "hdf5"
path = "data/train.h5"
x_key = "/dense"
y_key = "/label"
batch_size = 8
)toml";
  const RunConfig config = parse_config(dlrm, "dlrm.toml");
  const auto doc = nlohmann::json::parse(plan_text(config, 4, true));
  std::map<std::string, nlohmann::json> specs;
  for (const auto& p : doc["parameters"]) specs[p["name"].get<std::string>()] = p["spec"];
  EXPECT_EQ(specs["embeddings/big/weight"], nlohmann::json::parse(R"(["(fsdp, dp)@0"])"));
  EXPECT_EQ(specs["embeddings/small/weight"], nlohmann::json::parse(R"(["fsdp@1"])"));
  EXPECT_EQ(specs["bottom/0/weight"], nlohmann::json::parse(R"([["fsdp", "dp"], null])"));
}

// plan_options takes the layers' axes from [partition] logical_axes and the batch from
// data.batch_size.
TEST(PlanPrint, LogicalAxesAndBatchSizeReachTheLayers) {
  const RunConfig config = parse_config(
      kConfig, "axes.toml", {R"(partition.logical_axes.batch=["dp"])", "data.batch_size=32"});
  const auto doc = nlohmann::json::parse(plan_text(config, 4, true));
  EXPECT_EQ(doc["options"]["batch_axes"], nlohmann::json({"dp", "sp"}));  // sequence: sp
  EXPECT_EQ(doc["options"]["global_batch"], 32);
  EXPECT_EQ(doc["local_batch_rows"], 32);  // dp has size 1: every rank has the whole batch
  // fsdp is now pure storage: its gathers stay, nothing is all-reduced over it.
  EXPECT_EQ(doc["layers"][0]["collectives"][5]["operand"], "bias gradient");
  EXPECT_EQ(doc["layers"][0]["collectives"][5]["axes"], nlohmann::json({"tp"}));
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

// The cost model's section: predicted step time and parts on a given profile, the collective
// matmul algorithms auto chose per layer and direction, and the scaling table.
TEST(PlanPrint, PredictsStepTimeWithAHardwareProfile) {
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  HardwareProfile hw = default_hardware_profile();
  hw.source = "hw.toml";
  std::ostringstream out;
  print_plan(config, 4, false, out, &hw);
  const std::string text = out.str();
  expect_contains(text, "step time (cost model, partition/cost_model.hpp; hardware: hw.toml)");
  expect_contains(text, "  predicted ");
  // Layer 0 forward: the GEMM [64 x 392 x 512] and the output reduce-scatter fused.
  expect_contains(text, "x @ W reduce-scattered [64 x 392 x 512]");
  expect_contains(text, "collective matmul algorithms (partition.collective_matmul = auto):");
  expect_contains(text, "  layers/0: forward ");
  expect_contains(text, "scaling (cost model; fsdp grows, 64 rows per rank fixed");
  expect_contains(text, "  64     32x2 (fsdp=32, tp=2)");
  expect_contains(text, "  1024   512x2 (fsdp=512, tp=2)");
  // Without a profile: the defaults, named.
  expect_contains(plan_text(config, 4, false), "hardware: defaults");
  // JSON: the same prediction.
  std::ostringstream json_out;
  print_plan(config, 4, true, json_out, &hw);
  const auto doc = nlohmann::json::parse(json_out.str());
  EXPECT_EQ(doc["cost"]["hardware"], "hw.toml");
  EXPECT_GT(doc["cost"]["step_s"].get<double>(), 0.0);
  EXPECT_EQ(doc["scaling"].size(), 3u);
  EXPECT_EQ(doc["scaling"][2]["global_batch"], 64 * 512);
  // With 2 micro-batches per step a step has twice the rows (issue 20, bug 3).
  std::ostringstream accumulated;
  const RunConfig twice = parse_config(kConfig, "fsdp_tp.toml", {"train.accumulation_steps=2"});
  print_plan(twice, 4, true, accumulated, &hw);
  EXPECT_EQ(nlohmann::json::parse(accumulated.str())["scaling"][2]["global_batch"], 2 * 64 * 512);
}

// The data path's host memory per rank, in the total: Fashion-MNIST in memory (both splits
// of its files as bytes and int32 labels), an HDF5 stream's scratch (which does not depend
// on the file) and chunk caches (which do not depend on the number of shards), and the
// staging slots of the prefetch depth; the cost model charges the read prefetch does not hide.
TEST(PlanPrint, CountsTheDataPathPerRank) {
  // Fashion-MNIST's sizes come from its files: a small pair of IDX files here.
  testing::TempDir idx;
  testing::write_idx_pair(idx.path(), "train", 28, 0x803, 30, 30 * 784, 0x801,
                          std::vector<unsigned char>(30, 1));
  testing::write_idx_pair(idx.path(), "t10k", 28, 0x803, 7, 7 * 784, 0x801,
                          std::vector<unsigned char>(7, 2));
  RunConfig config = parse_config(kConfig, "fsdp_tp.toml",
                                  {"data.source=\"fashion_mnist\"", "model.loss=\"cross_entropy\"",
                                   "data.path=\"" + idx.path() + "\""});
  auto totals = nlohmann::json::parse(plan_text(config, 4, true))["totals"];
  EXPECT_EQ(totals["data_source_bytes"], (30 + 7) * (784 + 4));
  // 64 train and 64 eval rows per rank, 2 slots: x (4 x 784), a label (4), a sample index (8).
  EXPECT_EQ(totals["data_staging_bytes"], 2 * (64 + 64) * (4 * 784 + 4 + 8));
  // The total is the model's bytes and the data's: the same model for every data source.
  const auto model_bytes = [](const nlohmann::json& t) {
    return t["bytes_per_rank"].get<int64_t>() - t["checkpoint_staging_bytes"].get<int64_t>() -
           t["data_source_bytes"].get<int64_t>() - t["data_staging_bytes"].get<int64_t>() -
           t["data_chunk_cache_bytes"].get<int64_t>() - t["batch_buffer_bytes"].get<int64_t>();
  };  // (the batch buffers hold labels or targets, as the data has)
  const int64_t model = model_bytes(totals);
  EXPECT_EQ(model, model_bytes(nlohmann::json::parse(
                       plan_text(parse_config(kConfig, "fsdp_tp.toml"), 4, true))["totals"]));
  // Files that cannot be read are not counted, and the plan says so.
  config.data.path = {idx.file("none")};
  EXPECT_EQ(nlohmann::json::parse(plan_text(config, 4, true))["totals"]["data_source_bytes"], 0);
  expect_contains(plan_text(config, 4, false), "not counted: ");
  config.data.path.clear();

  config = parse_config(kConfig, "fsdp_tp.toml",
                        {"data.source=\"hdf5\"", "data.path=\"big.h5\"",
                         "model.loss=\"cross_entropy\"", "data.prefetch=3"});
  totals = nlohmann::json::parse(plan_text(config, 4, true))["totals"];
  // No test file: the training stream's scratch alone (order 8, x, a label widened to 8).
  EXPECT_EQ(totals["data_source_bytes"], 64 * (8 + 4 * 784 + 8));
  EXPECT_EQ(totals["data_staging_bytes"], 3 * (64 + 64) * (4 * 784 + 4 + 8));
  EXPECT_EQ(totals["data_chunk_cache_bytes"], 1 << 20);  // however many shards
  EXPECT_EQ(model_bytes(totals), model);                 // the caches are in the total
  config.data.test_path = {"test.h5"};                   // a second source, with its own caches
  EXPECT_EQ(nlohmann::json::parse(plan_text(config, 4, true))["totals"]["data_chunk_cache_bytes"],
            2 << 20);
  config.data.test_path.clear();
  const std::string text = plan_text(config, 4, false);
  expect_contains(text, "streamed from HDF5");
  expect_contains(text, "(3 batches of train and eval)");
  expect_contains(text, "not hidden (of ");

  // Without prefetch the read adds to the step.
  HardwareProfile hw = default_hardware_profile();
  std::ostringstream ahead, inline_read;
  print_plan(config, 4, true, ahead, &hw);
  config.data.prefetch = 0;
  print_plan(config, 4, true, inline_read, &hw);
  const auto a = nlohmann::json::parse(ahead.str())["cost"];
  const auto b = nlohmann::json::parse(inline_read.str())["cost"];
  EXPECT_DOUBLE_EQ(a["data_read_s"].get<double>(), b["data_read_s"].get<double>());
  EXPECT_LT(a["data_exposed_s"].get<double>(), b["data_exposed_s"].get<double>());
  EXPECT_DOUBLE_EQ(b["data_exposed_s"].get<double>(), b["data_read_s"].get<double>());
}

// ZeRO-1's own buffers are counted (issue 20, bug 9): this rank's gradient chunks (half
// of every tensor's rows at dp = 2), the largest chunk (the parameters' send buffer) and,
// where the rows do not divide, a padded block of dp chunks.
TEST(PlanPrint, CountsZeroOneBuffers) {
  const char* dp_config =
      "[mesh]\ndp = 2\n[partition]\npreset = \"dp\"\n[optimizer]\n"
      "zero_stage = 1\n[data]\nsource = \"synthetic\"\n[train]\nsteps = 1\n";
  const auto totals_of = [&](const std::string& sizes) {
    const RunConfig config = parse_config(dp_config, "zero1.toml", {"model.sizes=" + sizes});
    return nlohmann::json::parse(plan_text(config, 2, true))["totals"];
  };
  // [784, 512, 10]: weight chunks 392 x 512 and 256 x 10, bias chunks 256 and 5 (floats);
  // the largest chunk is the first weight's; every row count divides by 2.
  const int64_t chunks = 4 * (392 * 512 + 256 + 256 * 10 + 5);
  EXPECT_EQ(totals_of("[784, 512, 10]")["zero1_buffer_bytes"], chunks + 4 * 392 * 512);
  // [785, 512, 10]: 785 rows split as 393 + 392, padded to 2 x 393 rows for the collectives.
  const int64_t odd = 4 * (393 * 512 + 256 + 256 * 10 + 5);
  EXPECT_EQ(totals_of("[785, 512, 10]")["zero1_buffer_bytes"],
            odd + 4 * 393 * 512 + 2 * 4 * 393 * 512);
}

// An MoE model ([64, 128, 128, 10], layer 1 with 8 experts, top-2) on ep = 2, fsdp preset:
// batch 128 over ep (64 rows per rank), 4 experts per rank.
const char* kMoeConfig = R"(
[mesh]
ep = -1

[partition]
preset = "fsdp"
min_sharding_size = 0

[model]
sizes = [64, 128, 128, 10]
moe_layers = [1]
experts = 8
top_k = 2

[data]
source = "synthetic"

[train]
steps = 1
)";

TEST(PlanPrint, MoeLayerText) {
  const RunConfig config = parse_config(kMoeConfig, "moe.toml");
  const std::string text = plan_text(config, 2, false);
  // 3-D experts, per-rank bytes E/ep * in * out * 4 = 256 KiB.
  expect_contains(text,
                  "layers/1/experts/weight  [8, 128, 128]  1     P(ep, fsdp, None)  [4, 128, 128]  "
                  "256.00 KiB");
  expect_contains(text, "layers/1/router/weight   [128, 8]       0     P()");
  expect_contains(text,
                  "layers/1: MoE in 128 -> out 128, 8 experts top-2, 4 per rank over (ep) by "
                  "all-to-all");
  expect_contains(text,
                  "  experts per rank: 4 of 8 (split over ep, 2 ranks); stored per rank: expert "
                  "weights 256.00 KiB, expert biases 2.00 KiB, router 4.00 KiB\n");
  expect_contains(text, "  dispatch buffers: ");
  // R*k = 128 rows of 128 floats sent, half of them leave: 32 KiB.
  expect_contains(text,
                  "forward   all-to-all  dispatched rows           [128, 128]   ep=2   32.00 KiB "
                  "at uniform routing\n");
  expect_contains(text, "  MoE buffers      ");
  expect_contains(text, "worst case: all rows to one rank; allocated once at construction");
  // The experts drawn as [E, in x out]: 4 experts on each rank.
  expect_contains(text,
                  "layers/1/experts/weight [8, 128, 128] P(ep, fsdp, None) (drawn as [8, 128 x "
                  "128])\n+---+\n| 0 |\n+---+\n| 1 |\n+---+\n");
  // The cost model's items for it.
  expect_contains(text, "experts x @ W 4 x [32 x 128 x 128] (uniform routing)");
  expect_contains(text, "all-to-all dispatched rows");
  EXPECT_EQ(text.find("splits no parameter"), std::string::npos);
}

TEST(PlanPrint, MoeLayerJson) {
  const RunConfig config = parse_config(kMoeConfig, "moe.toml");
  const auto doc = nlohmann::json::parse(plan_text(config, 2, true));
  EXPECT_EQ(doc["options"]["batch_axes"], nlohmann::json({"fsdp", "dp", "sp", "ep"}));
  EXPECT_EQ(doc["local_batch_rows"], 64);
  ASSERT_EQ(doc["layers"].size(), 3u);
  EXPECT_EQ(doc["layers"][0]["moe"], false);
  EXPECT_FALSE(doc["layers"][0].contains("moe_layout"));
  const auto& l = doc["layers"][1];
  EXPECT_EQ(l["name"], "layers/1");
  EXPECT_EQ(l["moe"], true);
  EXPECT_EQ(l["output_layout"], "replicated");
  const auto& m = l["moe_layout"];
  EXPECT_EQ(m["experts"], 8);
  EXPECT_EQ(m["top_k"], 2);
  EXPECT_EQ(m["experts_per_rank"], 4);
  EXPECT_EQ(m["expert_axes"], nlohmann::json({"ep"}));
  EXPECT_EQ(m["ep"], 2);
  EXPECT_EQ(m["experts_weight"]["name"], "layers/1/experts/weight");
  EXPECT_EQ(m["experts_weight"]["bytes_per_rank"], 4 * 128 * 128 * 4);
  EXPECT_EQ(m["experts_weight"]["compute_shape"], nlohmann::json({4, 128, 128}));
  EXPECT_EQ(m["router"]["gradient_allreduce_axes"], nlohmann::json({"ep"}));
  EXPECT_GT(m["buffer_bytes_per_rank"].get<int64_t>(), 0);
  EXPECT_EQ(doc["totals"]["moe_buffer_bytes"], m["buffer_bytes_per_rank"]);
  int all_to_alls = 0;
  for (const auto& c : l["collectives"]) {
    if (c["kind"] != "all-to-all") {
      EXPECT_FALSE(c.contains("at_uniform_routing"));
      continue;
    }
    ++all_to_alls;
    EXPECT_EQ(c["at_uniform_routing"], true);
    EXPECT_EQ(c["axes"], nlohmann::json({"ep"}));
    EXPECT_EQ(c["bytes_per_rank"], 64 * 2 * 128 * 4 / 2);
  }
  EXPECT_EQ(all_to_alls, 4);
  const auto& parameters = doc["parameters"];
  ASSERT_EQ(parameters.size(), 7u);
  EXPECT_EQ(parameters[3]["local_shape"], nlohmann::json({4, 128, 128}));
  EXPECT_EQ(parameters[3]["spec"], nlohmann::json::parse(R"(["ep", "fsdp", null])"));
  EXPECT_GT(doc["cost"]["step_s"].get<double>(), 0.0);
}

// A mesh axis that splits nothing is a note of the plan: ep without MoE layers.
TEST(PlanPrint, NotesAxesThatSplitNothing) {
  const RunConfig ep = parse_config(kConfig, "ep.toml", {"mesh.tp=1", "mesh.ep=2"});
  expect_contains(plan_text(ep, 4, false),
                  "note: mesh axis 'ep' (size 2) splits no parameter and no batch rows: every ep "
                  "rank computes the same thing (compute replicated over ep)\n");
  const auto doc = nlohmann::json::parse(plan_text(ep, 4, true));
  ASSERT_EQ(doc["notes"].size(), 1u);
  EXPECT_NE(doc["notes"][0].get<std::string>().find("mesh axis 'ep'"), std::string::npos);
  // sp splits an MLP's rows (its tokens), as a batch axis does: no note.
  const RunConfig sp = parse_config(kConfig, "sp.toml", {"mesh.tp=1", "mesh.sp=2"});
  EXPECT_EQ(plan_text(sp, 4, false).find("splits no parameter"), std::string::npos);
  EXPECT_EQ(plan_text(parse_config(kConfig, "fsdp_tp.toml"), 4, false).find("splits no parameter"),
            std::string::npos);
}

TEST(PlanPrint, ScalingEfficiencyCountsRanksThatShareRows) {
  // Links that cost nothing: growing fsdp keeps a rank's GEMMs (its rows, its tp half of
  // each layer) and shrinks its optimizer shard (from half the model at fsdp = 2 to 1/32),
  // so samples/s per rank stay at or above the config's own mesh, where tp = 2 ranks share
  // every row (counting rows per rank instead would halve the figure).
  const RunConfig config = parse_config(kConfig, "fsdp_tp.toml");
  HardwareProfile hw = default_hardware_profile();
  for (auto& [axis, link] : hw.links) {
    link = LinkProfile{1e30, 0.0, 1e30, 1e30, 1e30, 1e30, 1e30};
  }
  std::ostringstream out;
  print_plan(config, 4, false, out, &hw);
  std::istringstream lines(out.str());
  std::string line;
  int efficiency = -1;
  while (std::getline(lines, line)) {
    if (line.rfind("  64     32x2", 0) != 0) continue;
    efficiency = std::stoi(line.substr(line.find_last_of(' ') + 1));
  }
  EXPECT_GE(efficiency, 95) << out.str();
  EXPECT_LE(efficiency, 130) << out.str();
}

}  // namespace
}  // namespace meshtrain
