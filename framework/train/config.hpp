#pragma once
// A run, as described by a TOML file (docs/design.md, "Configuration (TOML)"). Plain data:
// load_config() parses and checks every key, so the rest of the program can trust these values.
// Every named option is an enum of framework/core/choices.hpp, read from its name once, by the
// reader. Every key is described once, in the schema (framework/train/config_schema.cpp: its
// type, range or choices, meaning and which commands may --set it); the TOML reader
// (config_reader.cpp), the checks of a config made in code (config_check.cpp), the writer
// (config_writer.cpp), the --set overrides (config_overrides.cpp) and docs/configs.md's key
// table all come from it. A key is added there, beside its field in the sections below.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.hpp"
#include "framework/core/choices.hpp"
#include "framework/io/data_config.hpp"
#include "partition/dlrm_shape.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"

namespace meshtrain {

struct RunSection {
  std::string name = "run";
  uint64_t seed = 0;
  std::string output_dir;  // default: "runs/<name>"
  // Peak dense TFLOP/s of one rank's device; when positive, the progress line and
  // metrics.jsonl give the model FLOPs utilization (MFU) against it. 0 = unknown.
  double peak_tflops = 0.0;
};

struct MeshSection {
  // (axis, size) in mesh order dp, fsdp, ep, tp, sp; absent axes are 1; one may be -1.
  std::vector<std::pair<std::string, int>> axes;
  Mesh resolve(int world_size) const;  // Mesh::create with "[mesh]" as the source
  std::string source = "[mesh]";       // "<file> [mesh]" once loaded, for messages
};

struct ModelSection {
  ModelKind kind = ModelKind::mlp;
  std::vector<int64_t> sizes;  // kind mlp: [in, hidden..., out], at least two, all positive
  // kind residual_mlp (docs/models.md): input features, outputs, the residual stream's width,
  // the blocks' inner width, the number of blocks (all >= 1), their norm.
  int64_t inputs = 0, outputs = 0, width = 0, hidden = 0, depth = 0;
  ModelNorm norm = ModelNorm::rmsnorm;
  // "swiglu" (residual_mlp only): activation is silu and swiglu is true; the blocks then
  // have a gate projection beside up (blocks/<i>/gate), inner silu(gate) * up.
  bool swiglu = false;
  Activation activation = Activation::relu;
  InitScheme init = InitScheme::he_normal;
  // Unset: "auto" in TOML, resolved by load_config to mse for synthetic data and to
  // cross_entropy otherwise; a run made in code resolves it from the data it loads.
  std::optional<LossKind> loss;
  // huber's delta (model.loss = "huber" only), in the units of the model's targets (normalized
  // ones when data.normalize_targets = "standard").
  double huber_delta = 1.0;
  // A regression loss's weight of each output's term, one per output; empty: all 1.
  std::vector<double> loss_weights;
  // Mixture of experts (layers/moe.hpp): the layers (kind mlp: indices into the n-1 layers,
  // each followed by an activation, so not the last; kind residual_mlp: block indices 0 to
  // depth-1, whose feed-forward becomes a mixture of expert feed-forwards) that are MoE
  // layers, their experts, the experts per row and the load-balancing loss's coefficient.
  std::vector<int64_t> moe_layers;
  int64_t experts = 8;
  int64_t top_k = 2;
  double aux_loss_coef = 0.01;
  // Inverted dropout on the hidden activations in training steps (layers/dropout.hpp), in
  // [0, 1); 0: none.
  double dropout = 0.0;
  // Sobolev training (data.dy_key set): lambda, the derivative term's weight in the loss.
  double derivative_loss_weight = 1.0;
  // kind dlrm (docs/recsys.md): the bottom MLP's sizes [dense features, ..., d], the top MLP's
  // [interaction width, ..., 1], the tables (a dim of 0: bottom's last size, d) and the
  // interaction.
  std::vector<int64_t> bottom, top;
  std::vector<DlrmTable> tables;
  DlrmInteraction interaction = DlrmInteraction::dot;
  // kind dlrm: how the tables are stored (fp32 | bf16; docs/recsys.md, "bf16 tables").
  Dtype table_dtype = Dtype::fp32;
  MoeSettings moe() const { return {moe_layers, experts, top_k, aux_loss_coef}; }
  // kind dlrm's shape, every table's dim resolved (partition/dlrm_shape.hpp).
  DlrmShape dlrm() const;
  // (A model.dropout key for both kinds goes here; see docs/models.md.)

  int64_t input_width() const;   // features of a row: sizes[0], inputs, or bottom[0] (dense)
  int64_t output_width() const;  // classes / targets: sizes[-1], outputs, or 1 (dlrm)
  bool has_norms() const { return kind == ModelKind::residual_mlp && norm != ModelNorm::none; }
  // kind residual_mlp's shape (partition/planner.hpp).
  ResidualMlpShape residual() const;
  // "relu", ..., or "swiglu".
  std::string activation_name() const;
};

// The model's parameters and its linear layers, in the order the model takes them, for
// either kind (mlp_parameter_shapes / residual_mlp_parameter_shapes).
std::vector<ParameterShape> model_parameter_shapes(const ModelSection& model);
std::vector<LinearLayerParameters> model_linear_layers(const ModelSection& model);
std::vector<NormLayerParameters> model_norm_layers(const ModelSection& model);  // mlp: none

struct PartitionRuleText {
  std::string pattern;
  PartitionSpec spec;
};

struct PartitionSection {
  std::string preset;  // "" | dp | fsdp | tp | fsdp_tp | dp_tp | dp_fsdp | replicated | dlrm
  int64_t min_sharding_size = 16384;                             // the reference's default
  std::vector<PartitionRuleText> rules;                          // tried before the preset's rules
  std::map<std::string, std::vector<std::string>> logical_axes;  // overrides
  CollectiveMatmulAlgorithm collective_matmul = CollectiveMatmulAlgorithm::automatic;
};

// DataSection ([data]): framework/io/data_config.hpp.

struct OptimizerSection {
  OptimizerKind kind = OptimizerKind::adamw;
  double lr = 1e-3;
  double momentum = 0.9;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  double clip_norm = 0.0;  // global-norm clipping; 0 = off
  // The rate of each step (framework/train/lr_schedule.hpp): constant, linear or cosine,
  // after warmup_steps of linear warm-up; linear and cosine decay from lr to min_lr.
  LrScheduleKind schedule = LrScheduleKind::constant;
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
  // 0: every dp replica keeps the whole optimizer state; 1 (ZeRO-1): the state and the
  // update are split over dp (gradients reduce-scattered, parameters all-gathered). With
  // dp = 1 the two are the same.
  int64_t zero_stage = 0;
  // A dlrm's tables (docs/recsys.md, "Sparse updates"): dense (kind over every row), or only
  // the touched rows by rowwise_adagrad or sparse_adamw (betas and weight_decay as above), at
  // embeddings_lr (0: lr) on lr's schedule, with embeddings_eps.
  EmbeddingOptimizer embeddings = EmbeddingOptimizer::dense;
  double embeddings_lr = 0.0;
  double embeddings_eps = 1e-8;
};

struct TrainSection {
  std::optional<int64_t> epochs;  // at most one of epochs and steps (train needs one)
  std::optional<int64_t> steps;
  int64_t log_every = 50;
  int64_t eval_every = 0;  // 0 = only at the end
  // train.eval_every = "epoch": evaluate at the end of every epoch (eval_every is then 0).
  bool eval_each_epoch = false;
  // Micro-batches of data.batch_size per optimizer step: the global batch of a step is
  // accumulation_steps x data.batch_size.
  int64_t accumulation_steps = 1;
  // Stop after this many evaluations in a row without improvement (of checkpoint.keep_best's
  // metric, else the test loss); 0 = never. Needs train.eval_every.
  int64_t early_stopping = 0;

  // Steps between evaluations during the run (0: none before the end).
  int64_t eval_interval(int64_t steps_per_epoch) const {
    return eval_each_epoch ? steps_per_epoch : eval_every;
  }
  bool evaluates_during_run() const { return eval_each_epoch || eval_every > 0; }
};

struct CheckpointSection {
  int64_t every_steps = 0;  // 0 = only at the end of the run
  int64_t keep = 2;
  bool resume = false;
  std::string dir;  // default: "<output_dir>/checkpoints"
  // Write in the background: each save copies this rank's blocks into a staging buffer
  // (allocated once, counted by the plan) and training goes on while it is written.
  bool async = true;
  // Keep the checkpoint of the best evaluation by this metric as `best` (saved when an
  // evaluation improves on every earlier one; never removed by `keep`). Unset: off.
  std::optional<EvalMetric> keep_best;
  // A new run (step 0, fresh optimizer state) starts from this checkpoint's parameters and
  // normalization statistics: a .h5 file, a latest/best pointer file or a checkpoint
  // directory (its latest). Empty: from the initializer. A checkpoint to resume from in `dir`
  // (resume = true) wins over it.
  std::string init_from;
};

struct RuntimeSection {
  // Who moves tensors between ranks: mpi, nccl or automatic (nccl when the build has CUDA
  // Kokkos and NCCL, mpi otherwise). MPI stays the control plane either way.
  CommBackendChoice backend = CommBackendChoice::automatic;
  MatmulPrecision matmul_precision = MatmulPrecision::fp32;  // tf32: cuBLAS only (core/gemm.hpp)
  // Start communication early and let it run under computation: FSDP gathers the next
  // layer's weight while the current one computes; DP all-reduces its gradients in buckets
  // started while backward continues (layers/mlp.hpp).
  bool overlap = false;
  // Size cap of a DP gradient bucket under overlap, in MiB (PyTorch DDP's bucket_cap_mb).
  double bucket_mb = 25.0;
  // The MPI backend's blocking reduce-scatters and all-reduces: the MPI library's, meshtrain's
  // own ring, per group and size the faster of the two by the hardware file (auto; without
  // one the ring from 64 KiB), or as measured at start (measure). NCCL keeps its own
  // (docs/communication.md).
  ReductionAlgorithm reductions = ReductionAlgorithm::automatic;
  // A thread that progresses the started operations while the main thread computes
  // (framework/comm/progress_thread.hpp): true, false, or automatic (on with overlap where a
  // core is free for it; want_comm_thread in framework/comm/runtime.hpp).
  CommThreadChoice comm_thread = CommThreadChoice::automatic;
  // CUDA graphs for the training step (framework/core/step_graph.hpp, docs/gpu.md): automatic
  // captures the step once and replays it where every collective of the step runs on the
  // device stream (NCCL, or one rank) and the step reads nothing on the host; off never.
  CudaGraphsChoice cuda_graphs = CudaGraphsChoice::automatic;
  // Steps [first, last] (1-based, inclusive) to record on every rank as a Chrome/Perfetto
  // trace in <output_dir>/trace/ (framework/observe/trace.hpp); {0, 0}: none.
  int64_t trace_first = 0;
  int64_t trace_last = 0;
  bool traces() const { return trace_first > 0; }
  // The collectives each rank's flight recorder keeps (framework/observe/flight_recorder.hpp),
  // written to <output_dir>/flight/ on a timeout, a failure, SIGUSR1 or SIGTERM; 0: off.
  // At most kMaxFlightRecords (a million entries are about 80 MiB a rank: more is a typo).
  static constexpr int64_t kMaxFlightRecords = int64_t{1} << 20;
  int64_t flight_records = 64;
};

// FSDP2's MixedPrecisionPolicy (docs/mixed_precision.md): what layers compute with, gather
// weights and move activations in (param_dtype) and what gradients are reduced in
// (reduce_dtype). fp32/fp32 is the plain fp32 run. bf16 and fp16 do not mix.
struct MixedPrecisionSection {
  Dtype param_dtype = Dtype::fp32;
  Dtype reduce_dtype = Dtype::fp32;
  MixedPrecision policy() const { return {param_dtype, reduce_dtype}; }
};

struct RunConfig {
  std::string file;  // where it was read from (for messages); empty when made in code
  std::string text;  // the TOML text after --set overrides (stored in checkpoints)
  // What loading decided that the user should hear about, one line each: an override of
  // train.steps that replaced the file's train.epochs (or the other way round).
  std::vector<std::string> notes;
  RunSection run;
  MeshSection mesh;
  ModelSection model;
  PartitionSection partition;
  DataSection data;
  StreamSection stream;  // data.source = "stream"
  OptimizerSection optimizer;
  TrainSection train;
  CheckpointSection checkpoint;
  RuntimeSection runtime;
  MixedPrecisionSection mixed_precision;
};

// Reads `path`, applies `overrides` ("section.key=value", value read as a TOML value, or
// as a string when it is a bare word that is not one), and checks every key. Throws a
// bad_input Error naming the file, line and key for unknown keys, wrong types and
// out-of-range values, and for TOML syntax errors.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from TOML text; `file` is only used in messages.
RunConfig parse_config(const std::string& text, const std::string& file,
                       const std::vector<std::string>& overrides = {});

// The TOML text of `config` (every key of the schema that has a value), such that
// parse_config(config_to_toml(c)) reads the same values back. A run made in code stores it
// in its checkpoints, as a run from a file stores that file's text.
std::string config_to_toml(const RunConfig& config);

// A string as a TOML value, quoted and escaped: the value of a --set of a path.
std::string toml_string_value(const std::string& text);

// The key "section.key=value" names ("data.batch_size"; three parts for a table member),
// parsed as every command parses an override; throws bad_input "<file>: override '<text>' ..."
// for text that names no key of the schema. For code that cannot include toml++ (nvcc).
std::string override_key_path(const std::string& override_text, const std::string& file);

// After loading, model.loss is set: "auto" is resolved to mse for synthetic data and to
// cross_entropy otherwise. model.sizes has at least two entries and train has at most one
// of epochs and steps (planning needs neither; training_steps() asks for one). An override
// of train.steps drops the file's train.epochs (and the other way round) unless both are
// overridden; config.notes then says so.

// The length of the training run in optimizer steps: train.steps, or train.epochs times
// `steps_per_epoch`. Only training needs it: bad_input naming the file and [train] when
// neither is set.
int64_t training_steps(const RunConfig& config, int64_t steps_per_epoch);

// The checks load_config makes, for a RunConfig filled in code (the C++ API): every value
// in range, at most one of train.epochs and train.steps, every partition rule's regex compiles and
// its spec names known mesh axes. Empty run.output_dir and checkpoint.dir get load_config's
// defaults
// ("runs/<run.name>", "<output_dir>/checkpoints"). Throws bad_input naming the key
// ("<config.file>: model.sizes ..."; config.file defaults to "the run config").
void check_config(RunConfig& config);
// The products of config integers the run computes (the global rows of a step, each
// weight's bytes, a shuffle window's bytes): bad_input naming both keys when one overflows
// 64-bit integers. Part of check_config and of load_config / parse_config.
void check_config_products(const RunConfig& config);

// The commands that read a run config. Which keys each may change with --set is part of the
// schema: train, plan and calibrate any; predict and evaluate, which read a checkpoint's
// config, only those that leave the checkpoint's model and the meaning of its data alone.
enum class ConfigCommand { train, plan, calibrate, predict, evaluate };
const char* to_string(ConfigCommand command);

// The key an override "section.key=value" names ("section.key", or "section.key.member" for a
// member of a table key), spaces around it trimmed: what --set was given, for every command
// the same way. "" when the text has no '='.
std::string override_key(const std::string& override_text);

// The keys `command` may change with --set, whole sections as "mesh.*": "mesh.*, partition.*,
// data.batch_size, ..." (the commands' help and messages).
std::string overridable_keys(ConfigCommand command);

// Throws bad_input naming the first override whose key `command` may not change, and the keys
// it may. Malformed overrides and unknown keys are left to parse_config, which names the file.
void check_overrides(const std::vector<std::string>& overrides, ConfigCommand command);

// The key table of docs/configs.md (Markdown), from the schema; config_test compares the page
// with it.
std::string config_keys_markdown();

// The rules of a run: the user's [partition] rules first (replicate_if_indivisible=false),
// then the preset's rules (if any). No rules and no preset: bad_input naming [partition]
// of the file.
std::vector<PartitionRule> partition_rules(const RunConfig& config);

// min_sharding_size from [partition]; optimizer_slots from [optimizer] (adamw 2, sgd with
// momentum 1, plain sgd 0); 4-byte floats; the layers' batch and feature axes from the
// logical axes `batch` and `hidden` (with [partition] logical_axes applied; bad_input when
// `hidden` maps to more than one mesh axis); global_batch = data.batch_size (one
// micro-batch); accumulation_steps and eval_global_batch from train.accumulation_steps and
// data.eval_batch_size.
PlanOptions plan_options(const RunConfig& config);

}  // namespace meshtrain
