// Config loading: every key parsed, every kind of bad input named by file, line and key,
// --set overrides, and every shipped config in configs/ loads.

#include "framework/train/config.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include <toml++/toml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <utility>

#include "framework/train/config_schema.hpp"
#include "tests/source_dir.hpp"
#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

const char* const kFile = "t.toml";

// Lines 1-4; a test's extra sections start at line 5.
std::string minimal(const std::string& extra = "") {
  return "[model]\n"
         "sizes = [4, 3]\n"
         "[train]\n"
         "steps = 5\n" +
         extra;
}

// A small config of kind = "dlrm" (docs/recsys.md), for the keys only it takes.
std::string minimal_dlrm() {
  return "[model]\nkind = \"dlrm\"\nbottom = [13, 8]\ntop = [9, 1]\n"
         "[[model.tables]]\nname = \"t00\"\nrows = 10\n"
         "[data]\nsource = \"hdf5\"\npath = \"data/train.h5\"\nx_key = \"/dense\"\n"
         "y_key = \"/label\"\n[train]\nsteps = 5\n";
}

RunConfig parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_config(text, kFile, overrides);
}

void expect_config_error(const std::string& text, std::initializer_list<std::string> fragments,
                         const std::vector<std::string>& overrides = {}) {
  SCOPED_TRACE(text);
  expect_bad_input([&] { parse(text, overrides); }, fragments);
}

// Every key of the schema, each with a value other than its default.
const char* const kEveryKey = R"toml([run]
name = "every"
seed = 42
output_dir = "out/every"
peak_tflops = 989.5
[mesh]
dp = 2
fsdp = -1
ep = 1
tp = 4
sp = 1
[model]
kind = "mlp"
sizes = [10, 20, 5]
activation = "gelu"
init = "xavier_uniform"
loss = "mse"
loss_weights = [1.0, 2.0, 0.5, 1, 3]
dropout = 0.25
[partition]
preset = "fsdp_tp"
min_sharding_size = 7
rules = [["layers/0/weight", ["fsdp", "tp"]], ["bias$", [["fsdp", "dp"], ""]], ["x", []], ["y", "P(tp, None)"]]
logical_axes = { batch = ["fsdp", "dp"], hidden = "tp" }
collective_matmul = "ring"
[data]
source = "hdf5"
path = "train.h5"
test_path = "test.h5"
batch_size = 64
eval_batch_size = 96
shuffle = false
synthetic_samples = 100
x_key = "inputs"
y_key = "/targets"
[optimizer]
kind = "sgd"
lr = 0.5
momentum = 0.8
betas = [0.5, 0.6]
eps = 1e-6
weight_decay = 0.01
clip_norm = 1
schedule = "cosine"
warmup_steps = 4
min_lr = 0.05
[train]
epochs = 3
log_every = 7
eval_every = 9
accumulation_steps = 3
[checkpoint]
every_steps = 11
keep = 3
resume = true
dir = "ckpt"
async = false
keep_best = "test_r2[4]"
[runtime]
backend = "mpi"
matmul_precision = "tf32"
overlap = true
bucket_mb = 4.5
)toml";

TEST(Config, ReadsEveryKey) {
  const std::string text = kEveryKey;
  const RunConfig c = parse(text);
  EXPECT_EQ(c.file, kFile);
  EXPECT_EQ(c.run.name, "every");
  EXPECT_EQ(c.run.seed, 42u);
  EXPECT_EQ(c.run.output_dir, "out/every");
  const std::vector<std::pair<std::string, int>> axes = {
      {"dp", 2}, {"fsdp", -1}, {"ep", 1}, {"tp", 4}, {"sp", 1}};
  EXPECT_EQ(c.mesh.axes, axes);
  EXPECT_EQ(c.mesh.resolve(16).axis_size("fsdp"), 2);
  EXPECT_EQ(c.model.kind, ModelKind::mlp);
  EXPECT_EQ(c.model.sizes, (std::vector<int64_t>{10, 20, 5}));
  EXPECT_EQ(c.model.activation, Activation::gelu);
  EXPECT_EQ(c.model.init, InitScheme::xavier_uniform);
  EXPECT_EQ(c.model.loss, LossKind::mse);
  EXPECT_EQ(c.model.loss_weights, (std::vector<double>{1.0, 2.0, 0.5, 1.0, 3.0}));
  EXPECT_EQ(c.model.dropout, 0.25);
  EXPECT_EQ(c.partition.preset, "fsdp_tp");
  EXPECT_EQ(c.partition.min_sharding_size, 7);
  ASSERT_EQ(c.partition.rules.size(), 4u);
  EXPECT_EQ(c.partition.rules[0].pattern, "layers/0/weight");
  EXPECT_EQ(c.partition.rules[0].spec, PartitionSpec::parse("P(fsdp, tp)"));
  EXPECT_EQ(c.partition.rules[1].spec, PartitionSpec::parse("P((fsdp, dp), None)"));
  EXPECT_EQ(c.partition.rules[2].spec, PartitionSpec::parse("P()"));
  EXPECT_EQ(c.partition.rules[3].spec, PartitionSpec::parse("P(tp, None)"));
  EXPECT_EQ(c.partition.logical_axes.at("batch"), (std::vector<std::string>{"fsdp", "dp"}));
  EXPECT_EQ(c.partition.logical_axes.at("hidden"), (std::vector<std::string>{"tp"}));
  EXPECT_EQ(c.partition.collective_matmul, CollectiveMatmulAlgorithm::ring);
  EXPECT_EQ(c.data.source, DataSource::hdf5);
  EXPECT_EQ(c.data.path, std::vector<std::string>{"train.h5"});
  EXPECT_EQ(c.data.test_path, std::vector<std::string>{"test.h5"});
  EXPECT_EQ(c.data.batch_size, 64);
  EXPECT_EQ(c.data.shuffle, ShuffleMode::none);
  EXPECT_EQ(c.data.synthetic_samples, 100);
  EXPECT_EQ(c.optimizer.kind, OptimizerKind::sgd);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.5);
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.betas.first, 0.5);
  EXPECT_DOUBLE_EQ(c.optimizer.betas.second, 0.6);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(c.optimizer.clip_norm, 1.0);
  EXPECT_EQ(c.optimizer.schedule, LrScheduleKind::cosine);
  EXPECT_EQ(c.optimizer.warmup_steps, 4);
  EXPECT_DOUBLE_EQ(c.optimizer.min_lr, 0.05);
  EXPECT_EQ(c.train.accumulation_steps, 3);
  EXPECT_EQ(c.data.eval_batch_size, std::optional<int64_t>(96));
  EXPECT_DOUBLE_EQ(c.run.peak_tflops, 989.5);
  EXPECT_EQ(c.train.epochs, std::optional<int64_t>(3));
  EXPECT_FALSE(c.train.steps.has_value());
  EXPECT_EQ(c.train.log_every, 7);
  EXPECT_EQ(c.train.eval_every, 9);
  EXPECT_EQ(c.checkpoint.every_steps, 11);
  EXPECT_EQ(c.checkpoint.keep, 3);
  EXPECT_TRUE(c.checkpoint.resume);
  EXPECT_EQ(c.checkpoint.dir, "ckpt");
  EXPECT_FALSE(c.checkpoint.async);
  EXPECT_EQ(c.checkpoint.keep_best, (EvalMetric{EvalMetric::Kind::r2, 4}));
  EXPECT_EQ(c.runtime.backend, CommBackendChoice::mpi);
  EXPECT_EQ(c.runtime.matmul_precision, MatmulPrecision::tf32);
  EXPECT_TRUE(c.runtime.overlap);
  EXPECT_EQ(c.runtime.bucket_mb, 4.5);

  // User rules come first, then the preset's; plan options follow the config.
  const std::vector<PartitionRule> rules = partition_rules(c);
  ASSERT_GT(rules.size(), 4u);
  EXPECT_EQ(rules[0].pattern, "layers/0/weight");
  EXPECT_FALSE(rules[0].replicate_if_indivisible);
  EXPECT_EQ(rules[3].spec, PartitionSpec::parse("P(tp, None)"));
  const std::vector<PartitionRule> preset = preset_rules("fsdp_tp");
  EXPECT_EQ(rules.size(), 4 + preset.size());
  EXPECT_EQ(rules[4].pattern, preset[0].pattern);
  const PlanOptions options = plan_options(c);
  EXPECT_EQ(options.min_sharding_size, 7);
  EXPECT_EQ(options.optimizer_slots, 1);  // sgd with momentum
  EXPECT_EQ(options.bytes_per_element, 4);
}

// config_to_toml writes every key so that reading it back gives the same values (a run
// made in code stores this text in its checkpoints).
TEST(Config, ConfigToTomlReadsBackTheSameValues) {
  const RunConfig a = parse(kEveryKey);
  const RunConfig b = parse(config_to_toml(a));
  EXPECT_EQ(b.run.name, a.run.name);
  EXPECT_EQ(b.run.seed, a.run.seed);
  EXPECT_EQ(b.run.output_dir, a.run.output_dir);
  EXPECT_EQ(b.mesh.axes, a.mesh.axes);
  EXPECT_EQ(b.model.sizes, a.model.sizes);
  EXPECT_EQ(b.model.activation, a.model.activation);
  EXPECT_EQ(b.model.init, a.model.init);
  EXPECT_EQ(b.model.loss, a.model.loss);
  EXPECT_EQ(b.model.loss_weights, a.model.loss_weights);
  EXPECT_EQ(b.model.dropout, a.model.dropout);
  EXPECT_EQ(b.partition.preset, a.partition.preset);
  EXPECT_EQ(b.partition.min_sharding_size, a.partition.min_sharding_size);
  ASSERT_EQ(b.partition.rules.size(), a.partition.rules.size());
  for (size_t i = 0; i < a.partition.rules.size(); ++i) {
    EXPECT_EQ(b.partition.rules[i].pattern, a.partition.rules[i].pattern);
    EXPECT_EQ(b.partition.rules[i].spec, a.partition.rules[i].spec);
  }
  EXPECT_EQ(b.partition.logical_axes, a.partition.logical_axes);
  EXPECT_EQ(b.partition.collective_matmul, a.partition.collective_matmul);
  EXPECT_EQ(b.data.source, a.data.source);
  EXPECT_EQ(b.data.path, a.data.path);
  EXPECT_EQ(b.data.test_path, a.data.test_path);
  EXPECT_EQ(b.data.x_key, a.data.x_key);
  EXPECT_EQ(b.data.y_key, a.data.y_key);
  EXPECT_EQ(b.data.batch_size, a.data.batch_size);
  EXPECT_EQ(b.data.shuffle, a.data.shuffle);
  EXPECT_EQ(b.data.synthetic_samples, a.data.synthetic_samples);
  EXPECT_EQ(b.optimizer.kind, a.optimizer.kind);
  EXPECT_EQ(b.optimizer.lr, a.optimizer.lr);
  EXPECT_EQ(b.optimizer.momentum, a.optimizer.momentum);
  EXPECT_EQ(b.optimizer.betas, a.optimizer.betas);
  EXPECT_EQ(b.optimizer.eps, a.optimizer.eps);
  EXPECT_EQ(b.optimizer.weight_decay, a.optimizer.weight_decay);
  EXPECT_EQ(b.optimizer.clip_norm, a.optimizer.clip_norm);
  EXPECT_EQ(b.optimizer.schedule, a.optimizer.schedule);
  EXPECT_EQ(b.optimizer.warmup_steps, a.optimizer.warmup_steps);
  EXPECT_EQ(b.optimizer.min_lr, a.optimizer.min_lr);
  EXPECT_EQ(b.train.accumulation_steps, a.train.accumulation_steps);
  EXPECT_EQ(b.data.eval_batch_size, a.data.eval_batch_size);
  EXPECT_EQ(b.run.peak_tflops, a.run.peak_tflops);
  EXPECT_EQ(a.optimizer.schedule,
            LrScheduleKind::cosine);  // the round trip is of non-default values
  EXPECT_EQ(a.train.accumulation_steps, 3);
  EXPECT_EQ(b.train.epochs, a.train.epochs);
  EXPECT_EQ(b.train.steps, a.train.steps);
  EXPECT_EQ(b.train.log_every, a.train.log_every);
  EXPECT_EQ(b.train.eval_every, a.train.eval_every);
  EXPECT_EQ(b.checkpoint.every_steps, a.checkpoint.every_steps);
  EXPECT_EQ(b.checkpoint.keep, a.checkpoint.keep);
  EXPECT_EQ(b.checkpoint.resume, a.checkpoint.resume);
  EXPECT_EQ(b.checkpoint.async, a.checkpoint.async);
  EXPECT_EQ(b.checkpoint.dir, a.checkpoint.dir);
  EXPECT_EQ(b.checkpoint.keep_best, a.checkpoint.keep_best);
  EXPECT_EQ(b.runtime.backend, a.runtime.backend);
  EXPECT_EQ(b.runtime.matmul_precision, a.runtime.matmul_precision);
  EXPECT_EQ(b.runtime.overlap, a.runtime.overlap);
  EXPECT_EQ(b.runtime.bucket_mb, a.runtime.bucket_mb);
}

TEST(Config, Defaults) {
  const RunConfig c = parse(minimal());
  EXPECT_EQ(c.run.name, "run");
  EXPECT_EQ(c.run.output_dir, "runs/run");
  EXPECT_EQ(c.checkpoint.dir, "runs/run/checkpoints");
  EXPECT_EQ(c.data.source, DataSource::fashion_mnist);
  EXPECT_EQ(c.data.path, std::vector<std::string>{"/usr/share/datasets/fashion-mnist"});
  EXPECT_EQ(c.model.loss, LossKind::cross_entropy);  // auto, for classification data
  EXPECT_EQ(c.mesh.axes.size(), 5u);
  EXPECT_EQ(c.mesh.resolve(1), Mesh::single());
  EXPECT_EQ(c.train.steps, std::optional<int64_t>(5));
  EXPECT_EQ(c.train.log_every, 50);
  EXPECT_EQ(c.train.accumulation_steps, 1);
  EXPECT_EQ(c.optimizer.schedule, LrScheduleKind::constant);
  EXPECT_EQ(c.optimizer.warmup_steps, 0);
  EXPECT_EQ(c.optimizer.min_lr, 0.0);
  EXPECT_FALSE(c.data.eval_batch_size.has_value());  // the training batch
  EXPECT_EQ(c.run.peak_tflops, 0.0);                 // unknown: no MFU
  EXPECT_EQ(c.partition.min_sharding_size, 16384);
  EXPECT_EQ(c.partition.collective_matmul, CollectiveMatmulAlgorithm::automatic);
  EXPECT_EQ(c.runtime.backend, CommBackendChoice::automatic);
  EXPECT_EQ(c.runtime.matmul_precision, MatmulPrecision::fp32);
  EXPECT_FALSE(c.runtime.overlap);
  EXPECT_EQ(c.runtime.bucket_mb, 25.0);           // PyTorch DDP's bucket_cap_mb
  EXPECT_EQ(plan_options(c).optimizer_slots, 2);  // adamw

  const RunConfig named = parse(minimal("[run]\nname = \"abc\"\n[data]\nsource = \"synthetic\"\n"));
  EXPECT_EQ(named.run.output_dir, "runs/abc");
  EXPECT_EQ(named.checkpoint.dir, "runs/abc/checkpoints");
  EXPECT_EQ(named.model.loss, LossKind::mse);  // auto, for synthetic regression data
  EXPECT_TRUE(named.data.path.empty());

  const RunConfig plain_sgd = parse(minimal("[optimizer]\nkind = \"sgd\"\nmomentum = 0\nlr = 1\n"));
  EXPECT_EQ(plan_options(plain_sgd).optimizer_slots, 0);
  EXPECT_DOUBLE_EQ(plain_sgd.optimizer.lr, 1.0);  // an integer is a number too
}

TEST(Config, RuntimeSectionAndItsOverrides) {
  const RunConfig c = parse(minimal("[runtime]\nbackend = \"mpi\"\nmatmul_precision = \"tf32\"\n"));
  EXPECT_EQ(c.runtime.backend, CommBackendChoice::mpi);
  EXPECT_EQ(c.runtime.matmul_precision, MatmulPrecision::tf32);
  const RunConfig set = parse(minimal(), {"runtime.backend=nccl", "runtime.matmul_precision=fp32"});
  EXPECT_EQ(set.runtime.backend, CommBackendChoice::nccl);
  EXPECT_EQ(set.runtime.matmul_precision, MatmulPrecision::fp32);
  const RunConfig buckets = parse(minimal(), {"runtime.overlap=true", "runtime.bucket_mb=0.5"});
  EXPECT_TRUE(buckets.runtime.overlap);
  EXPECT_EQ(buckets.runtime.bucket_mb, 0.5);
  EXPECT_EQ(parse(minimal(), {"runtime.bucket_mb=2"}).runtime.bucket_mb, 2.0);  // an integer
  // flight_records: 64 by default, any count, 0 turns the recorder off; written back the same.
  EXPECT_EQ(parse(minimal()).runtime.flight_records, 64);
  EXPECT_EQ(parse(minimal(), {"runtime.flight_records=0"}).runtime.flight_records, 0);
  const RunConfig flight = parse(minimal("[runtime]\nflight_records = 200\n"));
  EXPECT_EQ(flight.runtime.flight_records, 200);
  EXPECT_EQ(parse(config_to_toml(flight)).runtime.flight_records, 200);
  // comm_thread: "auto" (the default), true or false; written back and read again the same.
  EXPECT_EQ(parse(minimal()).runtime.comm_thread, CommThreadChoice::automatic);
  for (const auto& [text, want] :
       {std::pair<std::string, CommThreadChoice>{"true", CommThreadChoice::on},
        {"false", CommThreadChoice::off},
        {"\"auto\"", CommThreadChoice::automatic}}) {
    const RunConfig thread = parse(minimal("[runtime]\ncomm_thread = " + text + "\n"));
    EXPECT_EQ(thread.runtime.comm_thread, want) << text;
    EXPECT_EQ(parse(config_to_toml(thread)).runtime.comm_thread, want) << text;
  }
  EXPECT_EQ(parse(minimal(), {"runtime.comm_thread=true"}).runtime.comm_thread,
            CommThreadChoice::on);
  expect_config_error(minimal("[runtime]\ncomm_thread = \"yes\"\n"),
                      {"t.toml", "comm_thread", "true, false or \"auto\", got"});
  expect_config_error(minimal("[runtime]\ncomm_thread = 1\n"),
                      {"t.toml", "comm_thread", "true, false or \"auto\", got"});
  // cuda_graphs: "auto" (the default) or "off"; written back and read again the same.
  EXPECT_EQ(parse(minimal()).runtime.cuda_graphs, CudaGraphsChoice::automatic);
  const RunConfig graphs_off = parse(minimal(), {"runtime.cuda_graphs=off"});
  EXPECT_EQ(graphs_off.runtime.cuda_graphs, CudaGraphsChoice::off);
  EXPECT_EQ(parse(config_to_toml(graphs_off)).runtime.cuda_graphs, CudaGraphsChoice::off);
}

// [data] x_key / y_key: the HDF5 datasets' names, "/" added when missing; written back only
// when not the defaults; an empty key or the same dataset twice is bad input naming the key.
TEST(Config, DatasetKeys) {
  const RunConfig defaults = parse(minimal());
  EXPECT_EQ(defaults.data.x_key, "/x");
  EXPECT_EQ(defaults.data.y_key, "/y");
  EXPECT_EQ(config_to_toml(defaults).find("x_key"), std::string::npos);
  const RunConfig named = parse(minimal("[data]\nx_key = \"inputs\"\ny_key = \"/a/targets\"\n"));
  EXPECT_EQ(named.data.x_key, "/inputs");
  EXPECT_EQ(named.data.y_key, "/a/targets");
  const RunConfig again = parse(config_to_toml(named));
  EXPECT_EQ(again.data.x_key, "/inputs");
  EXPECT_EQ(again.data.y_key, "/a/targets");
  expect_config_error(minimal("[data]\nx_key = \"\"\n"),
                      {"t.toml:6", "[data] x_key", "must name a dataset"});
  expect_config_error(minimal("[data]\ny_key = \"x\"\n"), {"t.toml:6", "[data] y_key", "/x"});
  RunConfig in_code = parse(minimal());
  in_code.data.x_key = "features";
  check_config(in_code);
  EXPECT_EQ(in_code.data.x_key, "/features");
  in_code.data.y_key = "/";
  expect_bad_input([&] { check_config(in_code); }, {"data.y_key", "must name a dataset"});
}

TEST(Config, NoRulesAndNoPresetIsAnErrorOfThePartitionSection) {
  const RunConfig c = parse(minimal());
  expect_bad_input([&] { partition_rules(c); }, {kFile, "[partition]", "preset", "rules"});
  const RunConfig rules_only = parse(minimal("[partition]\nrules = [[\".*\", []]]\n"));
  ASSERT_EQ(partition_rules(rules_only).size(), 1u);
  EXPECT_FALSE(partition_rules(rules_only)[0].replicate_if_indivisible);
}

TEST(Config, StructureErrorsNameFileLineAndKey) {
  expect_config_error(minimal("[optimiser]\nlr = 1\n"),
                      {"t.toml:5", "[optimiser]", "unknown section"});
  expect_config_error(minimal("[optimizer]\nlrr = 1\n"),
                      {"t.toml:6", "[optimizer]", "'lrr'", "lr, momentum"});
  expect_config_error("seed = 1\n" + minimal(), {"t.toml:1", "'seed'", "inside a section"});
  expect_config_error("run = 3\n" + minimal(), {"t.toml:1", "'run'", "section [run]"});
}

TEST(Config, TypeErrorsNameFileLineAndKey) {
  expect_config_error(minimal("[optimizer]\nlr = \"fast\"\n"),
                      {"t.toml:6", "[optimizer] lr", "a number", "'fast'"});
  expect_config_error(minimal("[data]\nbatch_size = 1.5\n"),
                      {"t.toml:6", "[data] batch_size", "an integer"});
  expect_config_error(minimal("[data]\nshuffle = \"yes\"\n"),
                      {"t.toml:6", "[data] shuffle", "true, false or \"blocks\""});
  expect_config_error(minimal("[run]\nname = 3\n"), {"t.toml:6", "[run] name", "a string"});
  expect_config_error(minimal("[mesh]\ntp = \"2\"\n"), {"t.toml:6", "[mesh] tp", "an integer"});
  expect_config_error("[model]\nsizes = 784\n[train]\nsteps = 1\n",
                      {"t.toml:2", "[model] sizes", "an array"});
  expect_config_error("[model]\nsizes = [784, \"10\"]\n[train]\nsteps = 1\n",
                      {"t.toml:2", "[model] sizes", "positive integers", "index 1"});
  expect_config_error(minimal("[partition]\nrules = \"dp\"\n"),
                      {"t.toml:6", "[partition] rules", "[regex, spec]"});
  expect_config_error(minimal("[partition]\nlogical_axes = [\"tp\"]\n"),
                      {"t.toml:6", "[partition] logical_axes", "a table"});
}

TEST(Config, AccumulationStepsMustBePositive) {
  expect_config_error("[model]\nsizes = [4, 3]\n[train]\nsteps = 5\naccumulation_steps = 0\n",
                      {"t.toml:5", "[train] accumulation_steps", "at least 1", "0"});
}

TEST(Config, RangeErrorsNameFileLineKeyAndValue) {
  struct Case {
    std::string extra;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"[optimizer]\nlr = -0.1\n", {"t.toml:6: [optimizer] lr must be positive, got -0.1"}},
      {"[optimizer]\nschedule = \"step\"\n",
       {"t.toml:6", "[optimizer] schedule", "constant | linear | cosine", "\"step\""}},
      {"[optimizer]\nwarmup_steps = -1\n", {"t.toml:6", "[optimizer] warmup_steps", "-1"}},
      {"[optimizer]\nlr = 0.1\nmin_lr = 0.2\n", {"t.toml:7", "[optimizer] min_lr", "[0, lr"}},
      {"[optimizer]\nmin_lr = -1\n", {"t.toml:6", "[optimizer] min_lr"}},
      {"[data]\neval_batch_size = 0\n", {"t.toml:6", "[data] eval_batch_size", "at least 1"}},
      {"[run]\npeak_tflops = -3\n", {"t.toml:6", "[run] peak_tflops", "non-negative"}},
      {"[optimizer]\nlr = 0\n", {"t.toml:6", "[optimizer] lr", "positive"}},
      {"[optimizer]\nmomentum = 1.0\n", {"t.toml:6", "[optimizer] momentum", "[0, 1)"}},
      {"[optimizer]\nbetas = [0.9, 1.0]\n", {"t.toml:6", "[optimizer] betas", "[0, 1)"}},
      {"[optimizer]\nbetas = [0.9]\n", {"t.toml:6", "[optimizer] betas", "two numbers"}},
      {"[optimizer]\nbetas = [-0.1, 0.9]\n", {"t.toml:6", "[optimizer] betas"}},
      {"[optimizer]\neps = 0\n", {"t.toml:6", "[optimizer] eps", "positive"}},
      {"[optimizer]\nweight_decay = -1\n", {"t.toml:6", "[optimizer] weight_decay", "-1"}},
      {"[optimizer]\nclip_norm = -1\n", {"t.toml:6", "[optimizer] clip_norm"}},
      {"[optimizer]\nzero_stage = 2\n", {"t.toml:6", "[optimizer] zero_stage", "got 2"}},
      {"[optimizer]\nzero_stage = \"1\"\n", {"t.toml:6", "[optimizer] zero_stage"}},
      {"[optimizer]\nkind = \"adam\"\n",
       {"t.toml:6", "[optimizer] kind", "sgd | adamw", "\"adam\""}},
      {"[data]\nbatch_size = 0\n", {"t.toml:6", "[data] batch_size", "at least 1", "got 0"}},
      {"[data]\nsynthetic_samples = -5\n", {"t.toml:6", "[data] synthetic_samples"}},
      {"[data]\nsource = \"csv\"\n", {"t.toml:6", "[data] source", "\"csv\""}},
      {"[runtime]\nbackend = \"gloo\"\n",
       {"t.toml:6", "[runtime] backend", "auto | mpi | nccl", "\"gloo\""}},
      {"[runtime]\nmatmul_precision = \"bf16\"\n",
       {"t.toml:6", "[runtime] matmul_precision", "fp32 | tf32", "\"bf16\""}},
      {"[runtime]\ncuda_graphs = \"on\"\n",
       {"t.toml:6", "[runtime] cuda_graphs", "auto | off", "\"on\""}},
      {"[runtime]\ncuda_graphs = true\n", {"t.toml:6", "[runtime] cuda_graphs"}},
      {"[runtime]\nbucket_mb = 0\n", {"t.toml:6", "[runtime] bucket_mb", "positive", "got 0"}},
      {"[runtime]\nflight_records = -1\n",
       {"t.toml:6", "[runtime] flight_records", "non-negative", "got -1"}},
      {"[runtime]\nflight_records = 2000000\n",
       {"t.toml:6", "[runtime] flight_records", "at most 1048576", "got 2000000"}},
      {"[runtime]\nflight_records = 1.5\n", {"t.toml:6", "[runtime] flight_records", "an integer"}},
      {"[runtime]\nbucket_mb = -2.5\n", {"t.toml:6", "[runtime] bucket_mb", "-2.5"}},
      {"[runtime]\nbucket_mb = \"big\"\n", {"t.toml:6", "[runtime] bucket_mb", "a number"}},
      {"[runtime]\nbucket_mb = nan\n", {"t.toml:6", "[runtime] bucket_mb", "finite"}},
      {"[runtime]\noverlap = 1\n", {"t.toml:6", "[runtime] overlap", "true or false"}},
      {"[data]\nsource = \"hdf5\"\n", {"[data] path", "hdf5"}},
      {"[run]\nseed = -1\n", {"t.toml:6", "[run] seed", "non-negative"}},
      {"[run]\nname = \"\"\n", {"t.toml:6", "[run] name", "empty"}},
      {"[mesh]\ntp = 0\n", {"t.toml:6", "[mesh] tp", "got 0"}},
      {"[mesh]\ndp = -2\n", {"t.toml:6", "[mesh] dp", "got -2"}},
      {"[mesh]\ndp = -1\ntp = -1\n", {"t.toml:7", "[mesh] tp", "dp", "only one"}},
      {"[partition]\npreset = \"zero3\"\n",
       {"t.toml:6", "[partition] preset", "\"zero3\"", "fsdp_tp"}},
      {"[partition]\nmin_sharding_size = -1\n", {"t.toml:6", "[partition] min_sharding_size"}},
      {"[partition]\ncollective_matmul = \"tree\"\n",
       {"t.toml:6", "[partition] collective_matmul", "naive | ring | bidirectional | auto",
        "\"tree\""}},
      {"[checkpoint]\nkeep = 0\n", {"t.toml:6", "[checkpoint] keep", "at least 1"}},
      {"[checkpoint]\nevery_steps = -1\n", {"t.toml:6", "[checkpoint] every_steps"}},
      {"[checkpoint]\nresume = 1\n", {"t.toml:6", "[checkpoint] resume"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.extra);
    try {
      parse(minimal(c.extra));
      ADD_FAILURE() << "no error for " << c.extra;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::bad_input);
      for (const std::string& fragment : c.fragments) {
        EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
            << "expected '" << fragment << "' in: " << e.what();
      }
    }
  }
}

// Each activation by its name, in a file and as an override (gelu is the tanh form,
// gelu_erf the exact one: two values).
TEST(Config, ReadsEveryActivationName) {
  const std::vector<std::pair<std::string, Activation>> names = {
      {"relu", Activation::relu}, {"tanh", Activation::tanh},
      {"gelu", Activation::gelu}, {"gelu_erf", Activation::gelu_erf},
      {"silu", Activation::silu}, {"sigmoid", Activation::sigmoid},
      {"none", Activation::none}};
  for (const auto& [name, value] : names) {
    SCOPED_TRACE(name);
    EXPECT_EQ(parse("[model]\nsizes = [4, 3]\nactivation = \"" + name + "\"\n[train]\nsteps = 5\n")
                  .model.activation,
              value);
    EXPECT_EQ(parse(minimal(), {"model.activation=\"" + name + "\""}).model.activation, value);
  }
  EXPECT_NE(Activation::gelu, Activation::gelu_erf);
}

TEST(Config, ModelErrors) {
  const std::string train = "[train]\nsteps = 1\n";
  expect_config_error("[model]\nsizes = [784]\n" + train,
                      {"t.toml:2", "[model] sizes", "at least 2"});
  expect_config_error("[model]\nsizes = [784, 0, 10]\n" + train,
                      {"t.toml:2", "[model] sizes", "got 0"});
  expect_config_error("[model]\nactivation = \"relu\"\n" + train,
                      {"t.toml", "[model] sizes", "required"});
  expect_config_error(train, {"t.toml", "[model] sizes", "required"});
  // A misspelt name: the key, the value and every choice.
  expect_config_error("[model]\nsizes = [4, 2]\nactivation = \"slu\"\n" + train,
                      {"t.toml:3", "[model] activation", "\"slu\"",
                       "relu | tanh | gelu | gelu_erf | silu | sigmoid | none"});
  expect_config_error("[model]\nsizes = [4, 2]\ninit = \"ones\"\n" + train,
                      {"t.toml:3", "[model] init", "\"ones\"", "zeros"});
  expect_config_error("[model]\nsizes = [4, 2]\nloss = \"hinge\"\n" + train,
                      {"t.toml:3", "[model] loss", "\"hinge\""});
  expect_config_error("[model]\nsizes = [4, 2]\nkind = \"cnn\"\n" + train,
                      {"t.toml:3", "[model] kind", "\"cnn\""});
}

// The regression losses' keys (issue 40, item 3): huber and its delta, per-output weights,
// and checkpoint.keep_best's metrics, each refused in one sentence naming the key.
TEST(Config, LossKeysAndTheirRefusals) {
  const std::string train = "[train]\nsteps = 1\n";
  const RunConfig huber = parse(
      "[model]\nsizes = [4, 3]\nloss = \"huber\"\nhuber_delta = 0.25\n"
      "loss_weights = [1, 0.5, 0]\n" +
      train);
  EXPECT_EQ(huber.model.loss, LossKind::huber);
  EXPECT_EQ(huber.model.huber_delta, 0.25);
  EXPECT_EQ(huber.model.loss_weights, (std::vector<double>{1.0, 0.5, 0.0}));
  EXPECT_EQ(parse("[model]\nsizes = [4, 3]\nloss = \"mae\"\n" + train).model.loss, LossKind::mae);
  // Written and read back the same.
  const RunConfig again = parse(config_to_toml(huber));
  EXPECT_EQ(again.model.huber_delta, 0.25);
  EXPECT_EQ(again.model.loss_weights, huber.model.loss_weights);
  // Defaults: delta 1, no weights, not written.
  const RunConfig mse = parse("[model]\nsizes = [4, 3]\nloss = \"mse\"\n" + train);
  EXPECT_EQ(mse.model.huber_delta, 1.0);
  EXPECT_TRUE(mse.model.loss_weights.empty());
  EXPECT_EQ(config_to_toml(mse).find("huber_delta"), std::string::npos);
  EXPECT_EQ(config_to_toml(mse).find("loss_weights"), std::string::npos);

  // huber_delta: huber's only (even at its default value), and positive.
  expect_config_error("[model]\nsizes = [4, 3]\nloss = \"mse\"\nhuber_delta = 1.0\n" + train,
                      {"t.toml:4", "[model] huber_delta", "loss = \"huber\""});
  expect_config_error("[model]\nsizes = [4, 3]\nhuber_delta = 0.5\n" + train,
                      {"t.toml:3", "[model] huber_delta", "huber"});
  expect_config_error("[model]\nsizes = [4, 3]\nloss = \"huber\"\nhuber_delta = 0\n" + train,
                      {"t.toml:4", "[model] huber_delta", "positive", "got 0"});
  // loss_weights: regression only, one per output, finite, non-negative, not all 0.
  expect_config_error(
      "[model]\nsizes = [4, 3]\nloss = \"cross_entropy\"\nloss_weights = [1, 1, 1]\n" + train,
      {"t.toml:4", "[model] loss_weights", "cross_entropy"});
  expect_config_error("[model]\nsizes = [4, 3]\nloss = \"mse\"\nloss_weights = [1, 2]\n" + train,
                      {"t.toml:4", "[model] loss_weights", "2 entries", "3 outputs", "sizes[-1]"});
  expect_config_error(
      "[model]\nsizes = [4, 3]\nloss = \"mse\"\nloss_weights = [1, -0.5, 1]\n" + train,
      {"t.toml:4", "[model] loss_weights", "non-negative", "-0.5", "index 1"});
  expect_config_error(
      "[model]\nsizes = [4, 3]\nloss = \"huber\"\nloss_weights = [1, nan, 1]\n" + train,
      {"t.toml:4", "[model] loss_weights", "finite", "index 1"});
  expect_config_error("[model]\nsizes = [4, 3]\nloss = \"mae\"\nloss_weights = [0, 0, 0]\n" + train,
                      {"t.toml:4", "[model] loss_weights", "all 0"});
  expect_config_error(
      "[model]\nsizes = [4, 3]\nloss = \"mae\"\nloss_weights = [1, \"a\", 1]\n" + train,
      {"t.toml:4", "[model] loss_weights", "numbers", "index 1"});
  // The same checks for a config made in code.
  RunConfig in_code = mse;
  in_code.model.loss_weights = {1.0, 2.0};
  expect_bad_input([&] { check_config(in_code); }, {"model.loss_weights", "2 entries", "3"});
  in_code.model.loss_weights.clear();
  in_code.model.huber_delta = 0.5;
  expect_bad_input([&] { check_config(in_code); }, {"model.huber_delta", "huber"});
}

TEST(Config, KeepBestTakesAnyMetricEvaluateReports) {
  const std::string train = "[train]\nsteps = 1\n";
  const auto with = [&](const std::string& loss, const std::string& metric) {
    return "[model]\nsizes = [4, 3]\nloss = \"" + loss + "\"\n" + train +
           "[checkpoint]\nkeep_best = \"" + metric + "\"\n";
  };
  using Kind = EvalMetric::Kind;
  const std::vector<std::pair<std::string, EvalMetric>> regression = {
      {"test_loss", {Kind::loss, -1}},      {"test_mse", {Kind::mse, -1}},
      {"test_mae", {Kind::mae, -1}},        {"test_r2", {Kind::r2, -1}},
      {"test_rel_l2", {Kind::rel_l2, -1}},  {"test_r2[2]", {Kind::r2, 2}},
      {"test_mse[0]", {Kind::mse, 0}},      {"test_mae[1]", {Kind::mae, 1}},
      {"test_rel_l2[2]", {Kind::rel_l2, 2}}};
  for (const auto& [name, metric] : regression) {
    SCOPED_TRACE(name);
    const RunConfig c = parse(with("huber", name));
    EXPECT_EQ(c.checkpoint.keep_best, metric);
    EXPECT_EQ(to_string(*c.checkpoint.keep_best), name);
    EXPECT_EQ(parse(config_to_toml(c)).checkpoint.keep_best, metric);
  }
  for (const char* name : {"test_loss", "test_accuracy", "test_top5_accuracy"}) {
    EXPECT_EQ(to_string(*parse(with("cross_entropy", name)).checkpoint.keep_best), name);
  }
  // binary_cross_entropy: its accuracy, AUC and log loss, overall or of one output.
  const std::vector<std::pair<std::string, EvalMetric>> binary = {
      {"test_accuracy", {Kind::accuracy, -1}},
      {"test_auc", {Kind::auc, -1}},
      {"test_auc[2]", {Kind::auc, 2}},
      {"test_log_loss", {Kind::log_loss, -1}},
      {"test_log_loss[0]", {Kind::log_loss, 0}}};
  for (const auto& [name, metric] : binary) {
    SCOPED_TRACE(name);
    const RunConfig c = parse(with("binary_cross_entropy", name));
    EXPECT_EQ(c.checkpoint.keep_best, metric);
    EXPECT_EQ(parse(config_to_toml(c)).checkpoint.keep_best, metric);
  }
  EXPECT_TRUE((EvalMetric{Kind::auc, -1}).higher_is_better());
  EXPECT_FALSE((EvalMetric{Kind::log_loss, 0}).higher_is_better());
  expect_config_error(with("mse", "test_auc"), {"t.toml:7", "[checkpoint] keep_best",
                                                "binary_cross_entropy model's metric", "\"mse\""});
  expect_config_error(with("cross_entropy", "test_log_loss[1]"),
                      {"[checkpoint] keep_best", "test_top5_accuracy"});
  expect_config_error(with("binary_cross_entropy", "test_r2"),
                      {"[checkpoint] keep_best", "regression metric", "test_auc"});
  expect_config_error(with("binary_cross_entropy", "test_top5_accuracy"),
                      {"[checkpoint] keep_best", "classification metric", "test_log_loss"});
  // The sentence's list is the metrics reported_for() accepts, in their documented order.
  EXPECT_EQ(reported_metrics_text(LossKind::cross_entropy),
            "test_loss, test_accuracy or test_top5_accuracy");
  EXPECT_EQ(reported_metrics_text(LossKind::binary_cross_entropy),
            "test_loss, test_accuracy, test_auc or test_log_loss");
  for (LossKind loss : {LossKind::mse, LossKind::huber, LossKind::mae}) {
    EXPECT_EQ(reported_metrics_text(loss), "test_loss, test_mse, test_mae, test_r2 or test_rel_l2");
  }
  // Direction: higher is better for the accuracies and R^2 only.
  EXPECT_TRUE((EvalMetric{Kind::r2, 2}).higher_is_better());
  EXPECT_TRUE(EvalMetric::test_accuracy.higher_is_better());
  EXPECT_TRUE((EvalMetric{Kind::top5_accuracy, -1}).higher_is_better());
  for (Kind k : {Kind::loss, Kind::mse, Kind::mae, Kind::rel_l2}) {
    EXPECT_FALSE((EvalMetric{k, -1}).higher_is_better());
  }
  // Refusals: an unknown name, an index on a metric without outputs or past the outputs, a
  // metric of the other kind of model.
  expect_config_error(with("mse", "test_foo"),
                      {"t.toml:7", "[checkpoint] keep_best", "\"test_foo\"", "test_rel_l2[j]"});
  expect_config_error(with("mse", "test_loss[0]"), {"[checkpoint] keep_best", "\"test_loss[0]\""});
  expect_config_error(with("mse", "test_r2[x]"), {"[checkpoint] keep_best", "\"test_r2[x]\""});
  expect_config_error(with("mse", "test_r2[3]"),
                      {"t.toml:7", "[checkpoint] keep_best", "output 3", "3 outputs"});
  expect_config_error(with("mse", "test_accuracy"),
                      {"t.toml:7", "[checkpoint] keep_best", "classification metric", "\"mse\""});
  expect_config_error(with("mae", "test_top5_accuracy"),
                      {"[checkpoint] keep_best", "classification metric"});
  expect_config_error(with("cross_entropy", "test_r2[0]"),
                      {"t.toml:7", "[checkpoint] keep_best", "regression metric"});
  expect_config_error(with("mse", "test_mse[9]"), {"[checkpoint] keep_best", "output 9"},
                      {"checkpoint.keep_best=\"test_mse[9]\""});
}

TEST(Config, TrainNeedsExactlyOneOfEpochsAndSteps) {
  expect_config_error("[model]\nsizes = [4, 2]\n[train]\nepochs = 1\nsteps = 2\n",
                      {"t.toml:5", "[train] steps", "epochs", "exactly one"});
  // Neither loads (`meshtrain plan` needs no training length); training_steps() refuses.
  for (const char* text :
       {"[model]\nsizes = [4, 2]\n[train]\nlog_every = 2\n", "[model]\nsizes = [4, 2]\n"}) {
    SCOPED_TRACE(text);
    const RunConfig c = parse(text);
    EXPECT_FALSE(c.train.epochs.has_value() || c.train.steps.has_value());
    expect_bad_input([&] { training_steps(c, 10); }, {"t.toml", "[train]", "epochs", "neither"});
  }
  EXPECT_EQ(training_steps(parse(minimal("")), 10), 5);  // train.steps = 5
  EXPECT_EQ(training_steps(parse("[model]\nsizes = [4, 2]\n[train]\nepochs = 3\n"), 10), 30);
  expect_config_error("[model]\nsizes = [4, 2]\n[train]\nepochs = 0\n",
                      {"t.toml:4", "[train] epochs", "got 0"});
  expect_config_error("[model]\nsizes = [4, 2]\n[train]\nsteps = -5\n",
                      {"t.toml:4", "[train] steps", "got -5"});
  expect_config_error("[model]\nsizes = [4, 2]\n[train]\nsteps = 5\nlog_every = 0\n",
                      {"t.toml:5", "[train] log_every", "at least 1"});
  expect_config_error("[model]\nsizes = [4, 2]\n[train]\nsteps = 5\neval_every = -1\n",
                      {"t.toml:5", "[train] eval_every", "non-negative"});
}

TEST(Config, PartitionRuleErrorsNameFileLineAndRule) {
  // Line 6 holds the rules array; the bad rule is on line 7 or 8.
  expect_config_error(
      minimal("[partition]\nrules = [\n  [\"a\", []],\n  [\"weight\", [\"fsdp\", \"fsdp\"]],\n]\n"),
      {"t.toml:8", "[partition] rule 1", "'fsdp'", "more than once"});
  expect_config_error(
      minimal("[partition]\nrules = [\n  [\"weight\", [[\"fsdp\", \"tp\"], \"tp\"]],\n]\n"),
      {"t.toml:7", "[partition] rule 0", "'tp'", "more than once"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"weight\", \"P(tp, tp)\"],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "tp"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"weight\", [\"model\"]],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "unknown mesh axis 'model'"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"layers/(\", []],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "regex 'layers/('", "does not compile"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"weight\"],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "[regex, spec]"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"weight\", 3],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "spec"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"weight\", [3]],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "spec entry"});
  expect_config_error(minimal("[partition]\nrules = [\n  [\"weight\", \"Q(tp\"],\n]\n"),
                      {"t.toml:7", "[partition] rule 0", "Q(tp"});
  expect_config_error(minimal("[partition]\nlogical_axes = { batch = [\"fsdp\", \"fsdp\"] }\n"),
                      {"t.toml:6", "logical_axes.batch", "more than once"});
  expect_config_error(minimal("[partition]\nlogical_axes = { batch = \"model\" }\n"),
                      {"t.toml:6", "logical_axes.batch", "unknown mesh axis 'model'"});
  expect_config_error(minimal("[partition]\nlogical_axes = { batchh = \"dp\" }\n"),
                      {"t.toml:6", "logical_axes", "'batchh'"});
}

TEST(Config, MalformedTomlIsOneSentenceWithLineAndColumn) {
  try {
    parse("[model]\nsizes = [4, 3\n[train]\n");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    EXPECT_EQ(message.rfind("t.toml:", 0), 0u) << message;
    EXPECT_NE(message.find("invalid TOML"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  expect_config_error("[model]\nsizes = = 3\n", {"t.toml:2:", "invalid TOML"});
}

TEST(Config, MeshErrorsNameTheFile) {
  const RunConfig c = parse(minimal("[mesh]\ndp = 2\ntp = 4\n"));
  EXPECT_EQ(c.mesh.resolve(8).axis_size("tp"), 4);
  expect_bad_input([&] { c.mesh.resolve(7); }, {"t.toml [mesh]", "7"});
}

TEST(Config, OverridesReadTomlValues) {
  const RunConfig c =
      parse(minimal(),
            {"train.steps=20", "model.sizes=[784, 256, 10]", "run.output_dir=\"runs/a\"",
             "data.shuffle=false", "optimizer.lr=0.25", "partition.logical_axes.batch=[\"dp\"]",
             "partition.rules=[[\"bias$\", \"P(tp)\"]]"});
  EXPECT_EQ(c.train.steps, std::optional<int64_t>(20));
  EXPECT_EQ(c.model.sizes, (std::vector<int64_t>{784, 256, 10}));
  EXPECT_EQ(c.run.output_dir, "runs/a");
  EXPECT_EQ(c.data.shuffle, ShuffleMode::none);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.25);
  EXPECT_EQ(c.partition.logical_axes.at("batch"), std::vector<std::string>{"dp"});
  ASSERT_EQ(c.partition.rules.size(), 1u);
  EXPECT_EQ(c.partition.rules[0].spec, PartitionSpec::parse("P(tp)"));

  // The effective text holds the overrides and reads back to the same config.
  EXPECT_NE(c.text.find("runs/a"), std::string::npos) << c.text;
  const RunConfig again = parse_config(c.text, "again.toml");
  EXPECT_EQ(again.train.steps, c.train.steps);
  EXPECT_EQ(again.model.sizes, c.model.sizes);
  EXPECT_EQ(again.run.output_dir, c.run.output_dir);
  EXPECT_EQ(again.partition.rules[0].spec, c.partition.rules[0].spec);
}

TEST(Config, OverrideBareWordIsAString) {
  const RunConfig c = parse(minimal(), {"run.output_dir=runs/a", "run.name = my-run"});
  EXPECT_EQ(c.run.output_dir, "runs/a");
  EXPECT_EQ(c.run.name, "my-run");
  const RunConfig spec = parse(minimal(), {"partition.rules=[[\"w\", \"P(fsdp, tp)\"]]"});
  EXPECT_EQ(spec.partition.rules[0].spec, PartitionSpec::parse("P(fsdp, tp)"));
}

TEST(Config, OverrideOfStepsReplacesEpochs) {
  const std::string text = "[model]\nsizes = [4, 2]\n[train]\nepochs = 3\n";
  const RunConfig steps = parse(text, {"train.steps=20"});
  EXPECT_EQ(steps.train.steps, std::optional<int64_t>(20));
  EXPECT_FALSE(steps.train.epochs.has_value());
  const RunConfig epochs = parse(minimal(), {"train.epochs=2"});
  EXPECT_EQ(epochs.train.epochs, std::optional<int64_t>(2));
  EXPECT_FALSE(epochs.train.steps.has_value());
  expect_config_error(text, {"[train] steps", "exactly one"}, {"train.steps=1", "train.epochs=1"});
}

TEST(Config, OverrideErrorsNameTheOverride) {
  expect_config_error(minimal(), {"'optimizer.lrr=1'", "unknown key", "lr"}, {"optimizer.lrr=1"});
  expect_config_error(minimal(), {"'optimiser.lr=1'", "section"}, {"optimiser.lr=1"});
  expect_config_error(minimal(), {"'lr=1'"}, {"lr=1"});
  expect_config_error(minimal(), {"'train.steps'", "section.key=value"}, {"train.steps"});
  expect_config_error(minimal(), {"'train.steps.x=1'", "unknown key"}, {"train.steps.x=1"});
  // A value out of range names the override it came from.
  expect_config_error(minimal(), {"t.toml (--set train.steps=-3)", "[train] steps", "got -3"},
                      {"train.steps=-3"});
  expect_config_error(minimal(), {"t.toml (--set model.sizes=[4, 0])", "[model] sizes"},
                      {"model.sizes=[4, 0]"});
  expect_config_error(minimal(),
                      {"--set data.batch_size=many", "[data] batch_size", "an integer", "'many'"},
                      {"data.batch_size=many"});
}

std::string source_dir() {
  return MESHTRAIN_SOURCE_DIR;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Config, LoadConfigReadsFilesAndNamesMissingOnes) {
  expect_bad_input([] { load_config("/nonexistent/x.toml"); },
                   {"/nonexistent/x.toml", "does not exist"});
  expect_bad_input([] { load_config(source_dir()); }, {"directory"});
}

TEST(Config, EveryShippedConfigLoads) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(source_dir() + "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    SCOPED_TRACE(entry.path().string());
    ++count;
    const RunConfig c = load_config(entry.path().string());
    EXPECT_EQ(c.run.name, entry.path().stem().string());
    EXPECT_FALSE(partition_rules(c).empty());
    EXPECT_NO_THROW(c.mesh.resolve(8));
  }
  EXPECT_GE(count, 5);
}

TEST(Config, FashionMnistConfigsDifferOnlyInRunMeshAndPartition) {
  std::string reference;
  for (const char* layout : {"dp", "fsdp", "tp", "fsdp_tp"}) {
    SCOPED_TRACE(layout);
    const std::string path = source_dir() + "/configs/fashion_mnist_" + layout + ".toml";
    toml::table table = toml::parse(read_file(path), path);
    for (const char* section : {"run", "mesh", "partition"}) table.erase(section);
    std::ostringstream rest;
    rest << table;
    if (reference.empty()) reference = rest.str();
    EXPECT_EQ(rest.str(), reference);

    const RunConfig c = load_config(path);
    EXPECT_EQ(c.partition.preset, layout);
    EXPECT_EQ(c.partition.min_sharding_size, 0);
    EXPECT_EQ(c.model.sizes, (std::vector<int64_t>{784, 512, 512, 10}));
    EXPECT_EQ(c.optimizer.kind, OptimizerKind::adamw);
    EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
    EXPECT_EQ(c.data.batch_size, 128);
  }
  const RunConfig fsdp_tp = load_config(source_dir() + "/configs/fashion_mnist_fsdp_tp.toml");
  const Mesh mesh = fsdp_tp.mesh.resolve(8);
  EXPECT_EQ(mesh.axis_size("fsdp"), 4);
  EXPECT_EQ(mesh.axis_size("tp"), 2);
  EXPECT_EQ(
      load_config(source_dir() + "/configs/fashion_mnist_tp.toml").mesh.resolve(4).axis_size("tp"),
      4);
}

// Products of config integers that overflow 64 bits are bad input naming the keys (issue
// 20, bug 4), not a negative step count or a made-up batch size.
TEST(Config, ProductsThatOverflowNameTheirKeys) {
  const std::string big = "9223372036854775807";
  expect_config_error(minimal("[data]\nbatch_size = 64\n"),
                      {"data.batch_size = 64", "train.accumulation_steps = " + big, "overflows"},
                      {"train.accumulation_steps=" + big});
  expect_config_error("[model]\nsizes = [4294967296, 4294967296]\n[train]\nsteps = 1\n",
                      {"model.sizes[0] = 4294967296", "model.sizes[1]", "overflows"});
  expect_config_error(minimal(), {"data.block_rows", "data.shuffle_window", "overflows"},
                      {"data.block_rows=" + big});

  RunConfig epochs = parse(minimal(), {"train.epochs=" + big});
  expect_bad_input([&] { training_steps(epochs, 468); },
                   {"train.epochs = " + big, "468 steps per epoch", "overflows"});
  RunConfig steps = parse(minimal(), {"train.steps=" + big, "train.accumulation_steps=2"});
  expect_bad_input([&] { training_steps(steps, 468); },
                   {"train.steps = " + big, "train.accumulation_steps = 2", "overflows"});
  EXPECT_EQ(training_steps(parse(minimal(), {"train.epochs=3"}), 468), 3 * 468);
}

// model.dropout: 0 (the default) to below 1; another value is refused at its line.
TEST(Config, DropoutOutsideItsRangeIsRefusedAtTheKey) {
  EXPECT_EQ(parse(minimal()).model.dropout, 0.0);
  EXPECT_EQ(parse(minimal(), {"model.dropout=0.5"}).model.dropout, 0.5);
  for (const char* value : {"1.0", "-0.1", "2"}) {
    expect_config_error(
        "[model]\nsizes = [4, 3]\ndropout = " + std::string(value) + "\n[train]\nsteps = 5\n",
        {"t.toml", "dropout", "must be in [0, 1)"});
  }
  expect_config_error(minimal(), {"model.dropout", "must be in [0, 1)"}, {"model.dropout=1"});
}

// Every config in configs/ written with config_to_toml reads back to the same value of every
// key of the schema (what a run made in code stores in its checkpoints).
TEST(Config, EveryShippedConfigWritesAndReadsBackEqual) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(source_dir() + "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    SCOPED_TRACE(entry.path().string());
    ++count;
    const RunConfig loaded = load_config(entry.path().string());
    const std::string written = config_to_toml(loaded);
    const RunConfig again = parse_config(written, "written.toml");
    for (const ConfigKey& key : config_keys()) {
      EXPECT_TRUE(same_value(key, loaded, again))
          << key.section << "." << key.name << " differs after writing:\n"
          << written;
    }
    EXPECT_EQ(config_to_toml(again), written);
  }
  EXPECT_GE(count, 5);
}

// same_value tells a key's value from its default for every key kEveryKey sets (so the round
// trip above compares every key).
TEST(Config, SameValueTellsEveryKeyFromItsDefault) {
  const RunConfig every = parse(kEveryKey);
  const toml::table file = toml::parse(kEveryKey);
  int compared = 0;
  for (const ConfigKey& key : config_keys()) {
    const std::string name = std::string(key.section) + "." + key.name;
    if (!file[key.section][key.name]) continue;
    // kEveryKey writes these at their defaults.
    if (name == "model.kind" || name == "mesh.ep" || name == "mesh.sp") continue;
    ++compared;
    EXPECT_FALSE(same_value(key, every, RunConfig{})) << name;
  }
  EXPECT_GE(compared, 45);
}

// A config made in code gets the reader's checks: every number key refuses infinity and NaN,
// from a file and from code alike (check_config once let a non-finite eps or weight decay
// through that the reader refused).
TEST(Config, NonFiniteNumbersAreRefusedFromFilesAndFromCode) {
  int numbers = 0;
  for (const ConfigKey& key : config_keys()) {
    RunConfig probe;
    if (!key.at || !std::holds_alternative<double*>(key.at(probe))) continue;
    ++numbers;
    const std::string name = std::string(key.section) + "." + key.name;
    for (const double bad :
         {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      SCOPED_TRACE(name + " = " + std::to_string(bad));
      const std::string text = std::isnan(bad) ? "nan" : "inf";
      // loss = "huber": every number key applies (model.huber_delta is huber's); the [stream]
      // keys apply with data.source = "stream"; the keys of kind = "dlrm" in a dlrm config.
      const bool stream = std::string(key.section) == "stream";
      RunConfig mlp = parse(minimal());
      mlp.model.loss = LossKind::huber;
      const char* reason = key.not_for ? key.not_for(mlp) : nullptr;
      const bool dlrm = reason && std::string(reason).find("dlrm") != std::string::npos;
      const std::string base = dlrm ? minimal_dlrm() : minimal();
      std::vector<std::string> overrides = {name + "=" + text};
      if (!dlrm) overrides.push_back("model.loss=\"huber\"");
      if (stream) overrides.push_back("data.source=\"stream\"");
      expect_config_error(base, {"[" + std::string(key.section) + "] " + key.name, "finite"},
                          overrides);
      RunConfig in_code = parse(base);
      if (!dlrm) in_code.model.loss = LossKind::huber;
      if (stream) in_code.data.source = DataSource::stream;
      *std::get<double*>(key.at(in_code)) = bad;
      expect_bad_input([&] { check_config(in_code); }, {name, "finite"});
    }
  }
  EXPECT_GE(numbers, 10);
}

// train.eval_every takes steps or "epoch" (issue 36, defect 21); the writer gives it back.
TEST(Config, EvalEveryTakesEpoch) {
  const RunConfig steps = parse(minimal("eval_every = 7\n"));
  EXPECT_EQ(steps.train.eval_every, 7);
  EXPECT_FALSE(steps.train.eval_each_epoch);
  EXPECT_EQ(steps.train.eval_interval(100), 7);
  const RunConfig epoch = parse(minimal("eval_every = \"epoch\"\n"));
  EXPECT_TRUE(epoch.train.eval_each_epoch);
  EXPECT_EQ(epoch.train.eval_every, 0);
  EXPECT_EQ(epoch.train.eval_interval(100), 100);
  EXPECT_TRUE(parse_config(config_to_toml(epoch), "again.toml").train.eval_each_epoch);
  EXPECT_TRUE(parse(minimal(), {"train.eval_every=epoch"}).train.eval_each_epoch);
  // Early stopping needs evaluations during the run: "epoch" gives them.
  EXPECT_EQ(parse(minimal("eval_every = \"epoch\"\nearly_stopping = 2\n")).train.early_stopping, 2);
  expect_config_error(minimal("eval_every = \"epochs\"\n"),
                      {"t.toml:5", "[train] eval_every", "\"epoch\"", "epochs"});
  expect_config_error(minimal("eval_every = 1.5\n"), {"t.toml:5", "[train] eval_every"});
}

// An override of train.steps that replaces the file's epochs says so (issue 36, defect 21).
TEST(Config, AnOverrideThatReplacesEpochsLeavesANote) {
  const std::string text = "[model]\nsizes = [4, 2]\n[train]\nepochs = 3\n";
  const RunConfig steps = parse(text, {"train.steps=20"});
  ASSERT_EQ(steps.notes.size(), 1u);
  EXPECT_EQ(steps.notes[0], "--set train.steps = 20 replaces train.epochs = 3 of t.toml");
  const RunConfig epochs = parse(minimal(), {"train.epochs = 2"});
  ASSERT_EQ(epochs.notes.size(), 1u);
  EXPECT_EQ(epochs.notes[0], "--set train.epochs = 2 replaces train.steps = 5 of t.toml");
  EXPECT_TRUE(parse(minimal(), {"train.steps=9"}).notes.empty());  // nothing replaced
  EXPECT_TRUE(parse(text).notes.empty());
}

// One override parser for every command (issue 36, defect 13): spaces around the key and the
// value are accepted by the config and by the check of each command's keys alike; predict and
// evaluate refuse keys that would change the checkpoint's model, naming the key.
TEST(Config, EveryCommandParsesOverridesTheSameWay) {
  const std::vector<std::string> spaced = {"data.batch_size = 8", " mesh.tp =2",
                                           "partition.logical_axes.batch = [\"dp\"]"};
  for (ConfigCommand command : {ConfigCommand::train, ConfigCommand::plan, ConfigCommand::calibrate,
                                ConfigCommand::predict, ConfigCommand::evaluate}) {
    SCOPED_TRACE(to_string(command));
    EXPECT_NO_THROW(check_overrides(spaced, command));
  }
  const RunConfig c = parse(minimal(), spaced);
  EXPECT_EQ(c.data.batch_size, 8);
  EXPECT_EQ(c.mesh.resolve(2).axis_size("tp"), 2);
  EXPECT_EQ(override_key("  data.batch_size = 8"), "data.batch_size");
  EXPECT_EQ(override_key("partition . logical_axes.batch=[]"), "partition.logical_axes.batch");
  EXPECT_EQ(override_key("no equals sign"), "");

  expect_bad_input([] { check_overrides({"model.sizes = [4, 2]"}, ConfigCommand::evaluate); },
                   {"--set model.sizes is not allowed with evaluate", "mesh.*", "data.batch_size"});
  expect_bad_input([] { check_overrides({"model.sizes=[4, 2]"}, ConfigCommand::predict); },
                   {"--set model.sizes", "cannot be changed", "data.path"});
  // data.path: predict reads its inputs from it, evaluate takes them from --data.
  EXPECT_NO_THROW(check_overrides({"data.path = a.h5"}, ConfigCommand::predict));
  expect_bad_input([] { check_overrides({"data.path = a.h5"}, ConfigCommand::evaluate); },
                   {"--set data.path is not allowed with evaluate"});
  EXPECT_NO_THROW(check_overrides({"model.sizes=[4, 2]"}, ConfigCommand::train));
  // Malformed overrides and unknown keys are parse_config's to name, with the file.
  EXPECT_NO_THROW(check_overrides({"lr", "optimizer.lrr=1"}, ConfigCommand::evaluate));
}

// Every key has a one-line meaning, and the keys of a section are listed once.
TEST(ConfigSchema, EveryKeyIsDescribedOnce) {
  std::set<std::string> names;
  for (const ConfigKey& key : config_keys()) {
    const std::string name = std::string(key.section) + "." + key.name;
    EXPECT_TRUE(names.insert(name).second) << name << " is listed twice";
    EXPECT_NE(std::string(key.doc), "") << name;
    EXPECT_TRUE(key.at || (key.read && key.write)) << name << ": no way to read it";
    const std::vector<std::string> sections = config_section_names();
    EXPECT_NE(std::find(sections.begin(), sections.end(), key.section), sections.end()) << name;
  }
}

// The key table of docs/configs.md is the schema's (config_keys_markdown). With
// MESHTRAIN_UPDATE_DOCS=1 the test writes the table into the page instead.
TEST(ConfigDocs, TheKeyTableOfConfigsMdIsTheSchemas) {
  const std::string path = source_dir() + "/docs/configs.md";
  const std::string page = read_file(path);
  const std::string begin_mark = "<!-- config keys: begin";
  const std::string end_mark = "<!-- config keys: end -->";
  const size_t begin = page.find(begin_mark);
  const size_t end = page.find(end_mark);
  ASSERT_NE(begin, std::string::npos) << path << " has no '" << begin_mark << "' line";
  ASSERT_NE(end, std::string::npos) << path << " has no '" << end_mark << "' line";
  const size_t table_begin = page.find('\n', begin) + 1;
  const std::string table = page.substr(table_begin, end - table_begin);
  const std::string schema = config_keys_markdown() + "\n";
  const char* update = std::getenv("MESHTRAIN_UPDATE_DOCS");
  if (update && std::string(update) == "1" && table != schema) {
    std::ofstream out(path, std::ios::trunc);
    out << page.substr(0, table_begin) << schema << page.substr(end);
    ASSERT_TRUE(out.good()) << "cannot write " << path;
    std::cout << "rewrote the key table of " << path << "\n";
    return;
  }
  if (table == schema) return;
  // The first line that differs, not two pages of table.
  std::istringstream page_lines(table), schema_lines(schema);
  std::string in_page, in_schema;
  int line = 0;
  while (std::getline(page_lines, in_page) && std::getline(schema_lines, in_schema) &&
         in_page == in_schema) {
    ++line;
  }
  ADD_FAILURE() << "docs/configs.md's key table differs from the schema at its line " << line + 1
                << ":\n  page:   " << in_page << "\n  schema: " << in_schema
                << "\nrewrite it with MESHTRAIN_UPDATE_DOCS=1 build/bin/config_test "
                   "--gtest_filter='ConfigDocs.*'";
}

}  // namespace
}  // namespace meshtrain
