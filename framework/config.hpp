#pragma once
// A run, as described by a TOML file (DESIGN.md section 9). Plain data: load_config()
// parses and checks every key, so the rest of the program can trust these values.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"

namespace meshtrain {

struct RunSection {
  std::string name = "run";
  uint64_t seed = 0;
  std::string output_dir;  // default: "runs/<name>"
};

struct MeshSection {
  // (axis, size) in mesh order dp, fsdp, ep, tp, sp; absent axes are 1; one may be -1.
  std::vector<std::pair<std::string, int>> axes;
  Mesh resolve(int world_size) const;  // Mesh::create with "[mesh]" as the source
  std::string source = "[mesh]";       // "<file> [mesh]" once loaded, for messages
};

struct ModelSection {
  std::string kind = "mlp";
  std::vector<int64_t> sizes;       // [in, hidden..., out], at least two, all positive
  std::string activation = "relu";  // relu | tanh | gelu
  std::string init = "he_normal";   // he_normal | xavier_uniform | normal
  std::string loss = "auto";        // auto | cross_entropy | mse (auto: mse for synthetic)
};

struct PartitionRuleText {
  std::string pattern;
  PartitionSpec spec;
};

struct PartitionSection {
  std::string preset;                    // "" | dp | fsdp | tp | fsdp_tp | dp_tp | dp_fsdp
  int64_t min_sharding_size = 16384;     // the reference's default
  std::vector<PartitionRuleText> rules;  // tried before the preset's rules
  std::map<std::string, std::vector<std::string>> logical_axes;  // overrides
  std::string collective_matmul = "auto";  // naive | ring | bidirectional | auto
};

struct DataSection {
  std::string source = "fashion_mnist";  // fashion_mnist | synthetic | hdf5
  std::string path;          // fashion_mnist: directory of IDX files; hdf5: training file
  std::string test_path;     // hdf5: test file (optional)
  int64_t batch_size = 128;  // global
  bool shuffle = true;
  int64_t synthetic_samples = 4096;
};

struct OptimizerSection {
  std::string kind = "adamw";  // sgd | adamw
  double lr = 1e-3;
  double momentum = 0.9;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  double clip_norm = 0.0;  // global-norm clipping; 0 = off
};

struct TrainSection {
  std::optional<int64_t> epochs;  // exactly one of epochs and steps
  std::optional<int64_t> steps;
  int64_t log_every = 50;
  int64_t eval_every = 0;  // 0 = only at the end
};

struct CheckpointSection {
  int64_t every_steps = 0;  // 0 = only at the end of the run
  int64_t keep = 2;
  bool resume = false;
  std::string dir;  // default: "<output_dir>/checkpoints"
  // Write in the background: each save copies this rank's blocks into a staging buffer
  // (allocated once, counted by the plan) and training goes on while it is written.
  bool async = true;
};

struct RunConfig {
  std::string file;  // where it was read from (for messages)
  std::string text;  // the TOML text after --set overrides (stored in checkpoints)
  RunSection run;
  MeshSection mesh;
  ModelSection model;
  PartitionSection partition;
  DataSection data;
  OptimizerSection optimizer;
  TrainSection train;
  CheckpointSection checkpoint;
};

// Reads `path`, applies `overrides` ("section.key=value", value read as a TOML value, or
// as a string when it is a bare word that is not one), and checks every key. Throws a
// bad_input Error naming the file, line and key for unknown keys, wrong types and
// out-of-range values, and for TOML syntax errors.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from TOML text; `file` is only used in messages.
RunConfig parse_config(const std::string& text, const std::string& file,
                       const std::vector<std::string>& overrides = {});

// After loading, model.loss is never "auto": it is resolved to mse for synthetic data and to
// cross_entropy otherwise. model.sizes has at least two entries and train has exactly one
// of epochs and steps. An override of train.steps drops the file's train.epochs (and the
// other way round) unless both are overridden.

// The rules of a run: the user's [partition] rules first (replicate_if_indivisible=false),
// then the preset's rules (if any). No rules and no preset: bad_input naming [partition]
// of the file.
std::vector<PartitionRule> partition_rules(const RunConfig& config);

// min_sharding_size from [partition]; optimizer_slots from [optimizer] (adamw 2, sgd with
// momentum 1, plain sgd 0); 4-byte floats; the layers' batch and feature axes from the
// logical axes `batch` and `hidden` (with [partition] logical_axes applied; bad_input when
// `hidden` maps to more than one mesh axis); global_batch = data.batch_size.
PlanOptions plan_options(const RunConfig& config);

}  // namespace meshtrain
