// The run config's schema (config_schema.hpp): the table of every key, then the keys whose
// values have a shape of their own and the rules between keys. What each type of value does
// (read, write, check) is config_values.cpp.

#include "framework/train/config_schema.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <regex>
#include <sstream>
#include <type_traits>

#include "base/error.hpp"
#include "base/text.hpp"
#include "partition/logical_axes.hpp"
#include "partition/mesh.hpp"
#include "partition/moe_limits.hpp"
#include "partition/rules.hpp"

namespace meshtrain {
namespace {

// ---------------------------------------------------------------------------------------
// The keys whose values have a shape of their own (declared here, defined below the table).

std::optional<KeyProblem> read_mesh_axis(const ConfigKey&, const toml::node&, RunConfig&);
void write_mesh_axis(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_mesh_axis(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_activation(const ConfigKey&, const toml::node&, RunConfig&);
void write_activation(const ConfigKey&, const RunConfig&, toml::table&);
std::vector<std::string> activation_names();
std::optional<KeyProblem> check_activation(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_sizes(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_moe_layers(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_top_k(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dropout(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_loss_weights(const ConfigKey&, const toml::node&, RunConfig&);
void write_loss_weights(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_loss_weights(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_rules(const ConfigKey&, const toml::node&, RunConfig&);
void write_rules(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_rules(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_logical_axes(const ConfigKey&, const toml::node&, RunConfig&);
void write_logical_axes(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_logical_axes(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_path(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_shuffle(const ConfigKey&, const toml::node&, RunConfig&);
void write_shuffle(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_dataset_key(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dy_key(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dy_inputs(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_normalize_targets(const ConfigKey&, const RunConfig&,
                                                  const KeyNames&);
std::optional<KeyProblem> check_min_lr(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_held_out_rows(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_steps(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_eval_every(const ConfigKey&, const toml::node&, RunConfig&);
void write_eval_every(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_eval_every(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_early_stopping(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_keep_best(const ConfigKey&, const toml::node&, RunConfig&);
void write_keep_best(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_keep_best(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_comm_thread(const ConfigKey&, const toml::node&, RunConfig&);
void write_comm_thread(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> read_trace_steps(const ConfigKey&, const toml::node&, RunConfig&);
void write_trace_steps(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_trace_steps(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_reduce_dtype(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dlrm_bottom(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dlrm_top(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> read_tables(const ConfigKey&, const toml::node&, RunConfig&);
void write_tables(const ConfigKey&, const RunConfig&, toml::table&);
std::optional<KeyProblem> check_tables(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_table_dtype(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_sparse_key(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dlrm_loss(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_dlrm_source(const ConfigKey&, const RunConfig&, const KeyNames&);
std::optional<KeyProblem> check_preset(const ConfigKey&, const RunConfig&, const KeyNames&);

// Keys of one model kind (ConfigKey::not_for).
const char* unless_residual(const RunConfig& c) {
  return c.model.kind == ModelKind::residual_mlp
             ? nullptr
             : "is a key of kind = \"residual_mlp\"; kind = \"mlp\" gives its widths in sizes";
}
const char* unless_mlp(const RunConfig& c) {
  if (c.model.kind == ModelKind::dlrm) {
    return "is a key of kind = \"mlp\"; kind = \"dlrm\" takes bottom, top and tables instead";
  }
  return c.model.kind == ModelKind::mlp ? nullptr
                                        : "is a key of kind = \"mlp\"; kind = \"residual_mlp\" "
                                          "takes inputs, outputs, width, hidden and depth instead";
}
const char* unless_dlrm(const RunConfig& c) {
  return c.model.kind == ModelKind::dlrm ? nullptr : "is a key of kind = \"dlrm\" (docs/recsys.md)";
}

// Keys of the regression losses (ConfigKey::not_for). An unset loss (a run made in code,
// resolved from its data) may still become one.
const char* unless_huber(const RunConfig& c) {
  return c.model.loss == LossKind::huber ? nullptr
                                         : "is huber's delta; it needs model.loss = \"huber\"";
}
const char* unless_regression(const RunConfig& c) {
  return c.model.loss == LossKind::cross_entropy
             ? "weighs the outputs of a loss with float targets (mse, huber, mae, "
               "binary_cross_entropy); model.loss = \"cross_entropy\" has none to weigh"
             : nullptr;
}

// The [stream] keys (ConfigKey::not_for).
const char* unless_stream(const RunConfig& c) {
  return c.data.source == DataSource::stream
             ? nullptr
             : "is a key of data.source = \"stream\" (rows sent by a running simulation)";
}

std::vector<std::string> preset_choices() {
  return preset_names();
}

ConfigKey make_key(const char* section, const char* name, ValueRef (*at)(RunConfig&), Range range,
                   CommandSet set_by, const char* doc) {
  ConfigKey k;
  k.section = section;
  k.name = name;
  k.at = at;
  k.range = range;
  k.set_by = set_by;
  k.doc = doc;
  return k;
}
// A key that reads and writes itself.
ConfigKey shaped(const char* section, const char* name, Range range, CommandSet set_by,
                 const char* doc) {
  return make_key(section, name, nullptr, range, set_by, doc);
}

}  // namespace

// Where a key's value lives: `FIELD(optimizer.lr)`; an enum with the table of its names:
// `NAMED(optimizer.kind, optimizer_kind_choices())`.
#define FIELD(member) [](RunConfig& c) -> ValueRef { return &c.member; }
#define NAMED(member, ...) [](RunConfig& c) -> ValueRef { return choice(c.member, __VA_ARGS__); }

const std::vector<ConfigSection>& config_sections() {
  static const std::vector<ConfigSection> sections = {
      {"run", "[running.md](running.md#model-flops-and-utilization)"},
      {"mesh", "[design.md](design.md#mesh)"},
      {"model", "[models.md](models.md), [moe.md](moe.md)"},
      {"partition",
       "[Writing partition rules](#writing-partition-rules), "
       "[Logical axes](#logical-axes); `auto`: [cost_model.md](cost_model.md)"},
      {"data",
       "[data.md](data.md), "
       "[below](#learning-rate-accumulation-and-evaluation-batch)"},
      {"stream", "[online.md](online.md)"},
      {"optimizer",
       "[below](#learning-rate-accumulation-and-evaluation-batch); `zero_stage`: "
       "[training_modes.md](training_modes.md#optimizer-state-split-over-dp-zero-1)"},
      {"train", "[below](#how-long-a-run-is-and-when-it-evaluates)"},
      {"checkpoint", "[checkpoints.md](checkpoints.md#fine-tuning-checkpointinit_from)"},
      {"runtime",
       "[gpu.md](gpu.md#the-runtime-section), [communication.md](communication.md), "
       "[running.md](running.md#where-a-steps-time-goes-traces), "
       "[running.md](running.md#when-a-run-hangs-the-flight-recorder)"},
      {"mixed_precision", "[mixed_precision.md](mixed_precision.md)"},
  };
  return sections;
}

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = [] {
    const CommandSet predict = command_bit(ConfigCommand::predict);
    static const std::string fashion_mnist_default =
        std::string("fashion_mnist: `") + kFashionMnistDefaultPath + "`";
    std::vector<ConfigKey> k;
    // --- [run] ---------------------------------------------------------------------------
    k.push_back(make_key("run", "name", FIELD(run.name), not_empty(), kFileCommands,
                         "the run's name (`run.output_dir`'s default)"));
    k.push_back(make_key("run", "seed", FIELD(run.seed), non_negative(), kFileCommands,
                         "parameters, shuffling and synthetic data derive from it"));
    k.push_back(make_key("run", "output_dir", FIELD(run.output_dir), any_value(), kFileCommands,
                         "where metrics, traces, flight records and checkpoints go")
                    .shown_as("a directory")
                    .unset_when_empty()
                    .defaults_to("`runs/<run.name>`"));
    k.push_back(make_key("run", "peak_tflops", FIELD(run.peak_tflops), non_negative("unknown"),
                         kFileCommands, "one rank's peak dense TFLOP/s, for the MFU in the log"));
    // --- [mesh] --------------------------------------------------------------------------
    for (const char* axis : {"dp", "fsdp", "ep", "tp", "sp"}) {
      k.push_back(shaped("mesh", axis, any_value(), kEveryCommand,
                         "ranks on this axis; their product is the number of ranks")
                      .reads(read_mesh_axis, write_mesh_axis, "integer")
                      .checked_by(check_mesh_axis)
                      .shown_as(">= 1, or -1 (what is left of the world; one axis at most)")
                      .defaults_to("`1`"));
    }
    // --- [model] -------------------------------------------------------------------------
    k.push_back(make_key("model", "kind", NAMED(model.kind, model_kind_choices()), any_value(),
                         kFileCommands,
                         "a stack of layers, pre-norm residual blocks, or a click model of dense "
                         "features and embedding tables (dlrm)"));
    k.push_back(make_key("model", "sizes", FIELD(model.sizes), at_least(1), kFileCommands,
                         "mlp: input width, hidden widths..., outputs")
                    .only_when(unless_mlp, "is required, e.g. sizes = [784, 512, 512, 10]")
                    .checked_by(check_sizes, "at least 2 entries")
                    .defaults_to("required (mlp)"));
    const auto residual_width = [](const char* name, ValueRef (*at)(RunConfig&), const char* doc) {
      return make_key("model", name, at, at_least(1), kFileCommands, doc)
          .only_when(unless_residual, "is required with kind = \"residual_mlp\"")
          .defaults_to("required (residual_mlp)");
    };
    k.push_back(residual_width("inputs", FIELD(model.inputs), "residual_mlp: input features"));
    k.push_back(residual_width("outputs", FIELD(model.outputs),
                               "residual_mlp: classes or regression targets"));
    k.push_back(
        residual_width("width", FIELD(model.width), "residual_mlp: the residual stream's width"));
    k.push_back(
        residual_width("hidden", FIELD(model.hidden), "residual_mlp: each block's inner width"));
    k.push_back(residual_width("depth", FIELD(model.depth), "residual_mlp: the number of blocks"));
    k.push_back(make_key("model", "bottom", FIELD(model.bottom), at_least(1), kFileCommands,
                         "dlrm: the bottom MLP's sizes, dense features first, its last the "
                         "width d the interaction takes ([recsys.md](recsys.md#the-model))")
                    .only_when(unless_dlrm, "is required with kind = \"dlrm\", e.g. [13, 64, 16]")
                    .checked_by(check_dlrm_bottom, "at least 2 entries")
                    .defaults_to("required (dlrm)"));
    k.push_back(shaped("model", "tables", any_value(), kFileCommands,
                       "dlrm: the embedding tables, `[[model.tables]]` with name, rows and "
                       "optionally dim (default: bottom's last size) and pooling (sum | mean)")
                    .reads(read_tables, write_tables, "array of tables")
                    .only_when(unless_dlrm, "is required with kind = \"dlrm\"")
                    .checked_by(check_tables,
                                "at least one; names unique; dot: every dim bottom's last size")
                    .defaults_to("required (dlrm)"));
    k.push_back(make_key("model", "interaction",
                         NAMED(model.interaction, dlrm_interaction_choices()), any_value(),
                         kFileCommands,
                         "dlrm: dot (pairwise dot products of the features, DLRM's) or cat "
                         "(the features side by side)")
                    .only_when(unless_dlrm));
    k.push_back(make_key("model", "table_dtype", NAMED(model.table_dtype, table_dtype_choices()),
                         any_value(), kFileCommands,
                         "dlrm: how the tables are stored: fp32, or bf16 (2 bytes an element, "
                         "updated with stochastic rounding by a sparse `optimizer.embeddings`; "
                         "[recsys.md](recsys.md#bf16-tables))")
                    .only_when(unless_dlrm)
                    .checked_by(check_table_dtype, "bf16: a sparse optimizer.embeddings"));
    k.push_back(make_key("model", "top", FIELD(model.top), at_least(1), kFileCommands,
                         "dlrm: the top MLP's sizes, the interaction's width first, 1 last")
                    .only_when(unless_dlrm, "is required with kind = \"dlrm\", e.g. [367, 64, 1]")
                    .checked_by(check_dlrm_top, "first the interaction's width, last 1")
                    .defaults_to("required (dlrm)"));
    k.push_back(make_key("model", "norm", NAMED(model.norm, model_norm_choices()), any_value(),
                         kFileCommands, "residual_mlp: the blocks' and the output's norm")
                    .only_when(unless_residual));
    k.push_back(shaped("model", "activation", any_value(), kFileCommands,
                       "after every hidden layer; gelu is the tanh form, gelu_erf the exact "
                       "one, swiglu a gated block ([model_math.md](model_math.md#activations))")
                    .reads(read_activation, write_activation, "name")
                    .one_of(activation_names)
                    .checked_by(check_activation, "swiglu: residual_mlp only"));
    k.push_back(make_key("model", "init", NAMED(model.init, init_scheme_choices()), any_value(),
                         kFileCommands, "how the weights start"));
    k.push_back(make_key("model", "loss", NAMED(model.loss, loss_kind_choices(), "auto"),
                         any_value(), kFileCommands,
                         "auto: mse for synthetic data, cross_entropy otherwise; mse, huber and "
                         "mae are regression losses; binary_cross_entropy: one yes/no per "
                         "output, float targets in [0, 1] "
                         "([model_math.md](model_math.md#losses-and-metrics))")
                    .checked_by(check_dlrm_loss, "binary_cross_entropy with kind = \"dlrm\""));
    k.push_back(make_key("model", "huber_delta", FIELD(model.huber_delta), positive(),
                         kFileCommands,
                         "huber: where the loss turns from quadratic to linear, in the "
                         "(normalized, with data.normalize_targets) targets' units")
                    .only_when(unless_huber)
                    .left_out_at_default());
    k.push_back(shaped("model", "loss_weights", any_value(), kFileCommands,
                       "mse, huber, mae, binary_cross_entropy: each output's weight in the loss, "
                       "one per output")
                    .reads(read_loss_weights, write_loss_weights, "array of floats")
                    .only_when(unless_regression)
                    .checked_by(check_loss_weights, "one per output, not all 0")
                    .shown_as("finite, >= 0")
                    .defaults_to("all 1"));
    k.push_back(make_key("model", "moe_layers", FIELD(model.moe_layers), any_value(), kFileCommands,
                         "the mixture-of-experts layers: mlp hidden layer indices, residual_mlp "
                         "block indices ([moe.md](moe.md))")
                    .checked_by(check_moe_layers,
                                "each once; mlp: 0 to len(sizes) - 3; "
                                "residual_mlp: 0 to depth - 1")
                    .left_out_at_default()
                    .defaults_to("none"));
    k.push_back(make_key("model", "experts", FIELD(model.experts), at_least(1), kFileCommands,
                         "experts of each MoE layer")
                    .left_out_at_default());
    k.push_back(make_key("model", "top_k", FIELD(model.top_k), at_least(1), kFileCommands,
                         "experts each row goes to")
                    .checked_by(check_top_k, "at most experts and 16")
                    .left_out_at_default());
    k.push_back(make_key("model", "aux_loss_coef", FIELD(model.aux_loss_coef), non_negative(),
                         kFileCommands, "the MoE load-balancing loss's weight")
                    .left_out_at_default());
    k.push_back(make_key("model", "dropout", FIELD(model.dropout),
                         between(0, 1, true, "no dropout"), kFileCommands,
                         "inverted dropout after every hidden activation in training steps, the "
                         "same mask on every mesh ([model_math.md](model_math.md#dropout))")
                    .checked_by(check_dropout, "0 with MoE blocks")
                    .left_out_at_default());
    k.push_back(
        make_key("model", "derivative_loss_weight", FIELD(model.derivative_loss_weight), positive(),
                 kFileCommands,
                 "data.dy_key: lambda, the derivative term's weight in the loss (unused without)")
            .left_out_at_default());
    // --- [partition] ---------------------------------------------------------------------
    k.push_back(make_key("partition", "preset", FIELD(partition.preset), any_value(), kEveryCommand,
                         "the rules of a training mode "
                         "([training_modes.md](training_modes.md); dlrm: the tables row-wise, "
                         "[recsys.md](recsys.md#the-dlrm-preset))")
                    .one_of(preset_choices)
                    .checked_by(check_preset, "\"dlrm\" with kind = \"dlrm\"")
                    .unset_when_empty()
                    .defaults_to("none"));
    k.push_back(make_key("partition", "min_sharding_size", FIELD(partition.min_sharding_size),
                         non_negative(), kEveryCommand,
                         "tensors with fewer elements are replicated"));
    k.push_back(shaped("partition", "rules", any_value(), kEveryCommand,
                       "`[[regex, spec], ...]`, tried before the preset's rules")
                    .reads(read_rules, write_rules, "array")
                    .checked_by(check_rules)
                    .shown_as("regexes that compile; specs of mesh axes, each axis once")
                    .defaults_to("none"));
    k.push_back(shaped("partition", "logical_axes", any_value(), kEveryCommand,
                       "`{ batch = [\"fsdp\", \"dp\"] }`: logical axis -> mesh axes")
                    .reads(read_logical_axes, write_logical_axes, "table")
                    .checked_by(check_logical_axes)
                    .shown_as("batch, sequence, hidden, mlp_intermediate, expert -> mesh axes")
                    .with_members()
                    .defaults_to("see [Logical axes](#logical-axes)"));
    k.push_back(make_key("partition", "collective_matmul",
                         NAMED(partition.collective_matmul, collective_matmul_choices()),
                         any_value(), kEveryCommand, "the tensor-parallel matmuls' algorithm"));
    // --- [data] --------------------------------------------------------------------------
    k.push_back(make_key("data", "source", NAMED(data.source, data_source_choices()), any_value(),
                         kFileCommands, "where the rows come from")
                    .checked_by(check_dlrm_source, "hdf5 with kind = \"dlrm\""));
    k.push_back(
        make_key("data", "path", FIELD(data.path), any_value(), kFileCommands | predict,
                 "fashion_mnist: its directory; hdf5: the training files (globs, in order); "
                 "relative to the working directory")
            .shown_as("files or globs")
            .checked_by(check_path, "fashion_mnist: one directory; hdf5: required")
            .defaults_to(fashion_mnist_default.c_str()));
    k.push_back(make_key("data", "test_path", FIELD(data.test_path), any_value(),
                         kFileCommands | predict, "hdf5: the test files, as `path`")
                    .shown_as("files or globs")
                    .defaults_to("none"));
    k.push_back(make_key("data", "batch_size", FIELD(data.batch_size), at_least(1), kEveryCommand,
                         "rows of one micro-batch over all ranks"));
    k.push_back(make_key("data", "eval_batch_size", FIELD(data.eval_batch_size), at_least(1),
                         kEveryCommand, "rows of one evaluation batch over all ranks")
                    .defaults_to("`data.batch_size`"));
    k.push_back(shaped("data", "shuffle", any_value(), kFileCommands,
                       "the order of an epoch's rows: as stored, shuffled, or shuffled blocks")
                    .reads(read_shuffle, write_shuffle, "boolean or name")
                    .shown_as("true | false | `\"blocks\"`"));
    k.push_back(make_key("data", "block_rows", FIELD(data.block_rows), at_least(1), kFileCommands,
                         "shuffle = \"blocks\": rows of one contiguous block"));
    k.push_back(make_key("data", "shuffle_window", FIELD(data.shuffle_window), at_least(1),
                         kFileCommands,
                         "shuffle = \"blocks\": blocks whose rows are shuffled together"));
    k.push_back(make_key("data", "prefetch", FIELD(data.prefetch), non_negative("read in the step"),
                         kEveryCommand, "batches read ahead by a background thread"));
    k.push_back(make_key("data", "synthetic_samples", FIELD(data.synthetic_samples), at_least(1),
                         kFileCommands, "synthetic: rows of the training split"));
    k.push_back(make_key("data", "x_key", FIELD(data.x_key), any_value(), kEveryCommand,
                         "hdf5: the inputs' dataset in every file (`x` is `/x`)")
                    .checked_by(check_dataset_key)
                    .shown_as("a dataset name")
                    .left_out_at_default());
    k.push_back(make_key("data", "y_key", FIELD(data.y_key), any_value(), kEveryCommand,
                         "hdf5: the labels' or targets' dataset")
                    .checked_by(check_dataset_key)
                    .shown_as("a dataset name other than x_key")
                    .left_out_at_default());
    k.push_back(
        make_key("data", "sparse_key", FIELD(data.sparse_key), any_value(), kEveryCommand,
                 "dlrm: the group of the sparse features, <sparse_key>/<table>/values "
                 "and offsets, or ids ([recsys.md](recsys.md#data-scriptsmake_recsys_data))")
            .only_when(unless_dlrm)
            .checked_by(check_sparse_key, "a group other than x_key and y_key")
            .left_out_at_default());
    k.push_back(make_key("data", "dy_key", FIELD(data.dy_key), any_value(), kFileCommands,
                         "hdf5: the targets' derivatives w.r.t. the inputs, float [N, outputs, "
                         "k], for Sobolev training ([derivatives.md](derivatives.md))")
                    .checked_by(check_dy_key,
                                "hdf5, an fp32 mlp or residual_mlp (MoE layers and "
                                "dropout allowed), a regression loss")
                    .shown_as("a dataset name")
                    .unset_when_empty()
                    .defaults_to("none"));
    k.push_back(make_key("data", "dy_inputs", FIELD(data.dy_inputs), any_value(), kFileCommands,
                         "dy_key: the input columns its last axis holds, in its order")
                    .checked_by(check_dy_inputs, "each once, 0 to inputs - 1")
                    .left_out_at_default()
                    .defaults_to("all inputs"));
    k.push_back(make_key("data", "normalize_inputs",
                         NAMED(data.normalize_inputs, normalize_choices()), any_value(),
                         kFileCommands,
                         "standard: (x - mean) / std per feature, statistics kept in checkpoints")
                    .left_out_at_default());
    k.push_back(make_key("data", "normalize_targets",
                         NAMED(data.normalize_targets, normalize_choices()), any_value(),
                         kFileCommands, "standard: the same for regression targets")
                    .checked_by(check_normalize_targets, "standard: regression only")
                    .left_out_at_default());
    // --- [stream] ------------------------------------------------------------------------
    k.push_back(make_key("stream", "name", FIELD(stream.name), not_empty(), kFileCommands,
                         "the stream the producers connect to")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "buffer_rows", FIELD(stream.buffer_rows), at_least(1),
                         kFileCommands, "rows each trainer rank keeps: its memory bound")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "policy", NAMED(stream.policy, stream_policy_choices()),
                         any_value(), kFileCommands,
                         "window: the newest rows; reservoir: a uniform sample of every row seen")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "min_rows", FIELD(stream.min_rows), non_negative("one batch"),
                         kFileCommands, "rows every trainer rank holds before the first step")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "order", NAMED(stream.order, stream_order_choices()),
                         any_value(), kFileCommands,
                         "a batch's rows: hashed from the buffer, or in the order they came")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "merge", NAMED(stream.merge, stream_merge_choices()),
                         any_value(), kFileCommands,
                         "several producers' rows into one batch group: as they come, or round "
                         "robin by producer rank and message index (the same order in every run; "
                         "a slow producer holds back the others)")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "dtype", NAMED(stream.dtype, stream_row_type_choices()),
                         any_value(), kFileCommands, "the rows' type as the producers send them")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "until", NAMED(stream.until, stream_until_choices()),
                         any_value(), kFileCommands,
                         "closed: the run also ends once every producer has closed")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "publish_every", FIELD(stream.publish_every),
                         non_negative("never"), kFileCommands,
                         "steps between publishes of the parameters to the producers' LiveModel")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "test_fraction", FIELD(stream.test_fraction),
                         between(0, 1, true, "none held out"), kFileCommands,
                         "rows held out for evaluation, by a hash of producer rank and row number")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "held_out_rows", FIELD(stream.held_out_rows),
                         non_negative("ceil(buffer_rows x test_fraction)"), kFileCommands,
                         "rows each trainer rank keeps of the held-out rows (the newest): the "
                         "test set's bound")
                    .checked_by(check_held_out_rows, "with test_fraction > 0")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "checkpoint_buffer", FIELD(stream.checkpoint_buffer),
                         any_value(), kFileCommands,
                         "checkpoints hold the buffers, and a resumed run continues with them")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "producer_timeout", FIELD(stream.producer_timeout),
                         non_negative("wait for ever"), kFileCommands,
                         "seconds a producer that has sent rows may send nothing, unclosed, before "
                         "it is taken for gone (named in a warning; the others go on); under merge "
                         "= round_robin also one that has sent nothing, from the rendezvous, while "
                         "the merge waits at its turn")
                    .only_when(unless_stream));
    k.push_back(make_key("stream", "last_word_timeout", FIELD(stream.last_word_timeout),
                         positive("s"), kFileCommands,
                         "seconds the trainer's end waits, once every producer closed, for its "
                         "last words and publishes to be taken (a producer whose close() gave up "
                         "never takes them)")
                    .only_when(unless_stream));
    // --- [optimizer] ---------------------------------------------------------------------
    k.push_back(make_key("optimizer", "kind", NAMED(optimizer.kind, optimizer_kind_choices()),
                         any_value(), kFileCommands, "the update rule"));
    k.push_back(make_key("optimizer", "lr", FIELD(optimizer.lr), positive(), kFileCommands,
                         "the (peak) learning rate"));
    k.push_back(make_key("optimizer", "momentum", FIELD(optimizer.momentum), between(0, 1, true),
                         kFileCommands, "sgd's momentum"));
    k.push_back(make_key("optimizer", "betas", FIELD(optimizer.betas), between(0, 1, true),
                         kFileCommands, "adamw's `[beta1, beta2]`"));
    k.push_back(make_key("optimizer", "eps", FIELD(optimizer.eps), positive(), kFileCommands,
                         "adamw's epsilon"));
    k.push_back(make_key("optimizer", "weight_decay", FIELD(optimizer.weight_decay), non_negative(),
                         kFileCommands, "decoupled weight decay"));
    k.push_back(make_key("optimizer", "clip_norm", FIELD(optimizer.clip_norm), non_negative("off"),
                         kFileCommands, "global gradient-norm clipping"));
    k.push_back(make_key("optimizer", "schedule", NAMED(optimizer.schedule, lr_schedule_choices()),
                         any_value(), kFileCommands, "the rate after the warm-up"));
    k.push_back(make_key("optimizer", "warmup_steps", FIELD(optimizer.warmup_steps), non_negative(),
                         kFileCommands, "steps of linear warm-up"));
    k.push_back(make_key("optimizer", "min_lr", FIELD(optimizer.min_lr), non_negative(),
                         kFileCommands, "where linear and cosine end")
                    .checked_by(check_min_lr, "at most optimizer.lr"));
    k.push_back(make_key(
        "optimizer", "zero_stage", FIELD(optimizer.zero_stage),
        between(0, 1, false, "optimizer state replicated over dp; 1: split over dp (ZeRO-1)"),
        kFileCommands, "whether the optimizer state is split over dp"));
    k.push_back(make_key("optimizer", "embeddings",
                         NAMED(optimizer.embeddings, embedding_optimizer_choices()), any_value(),
                         kFileCommands,
                         "dlrm: how the tables are updated: dense (`kind` over every row), or "
                         "only the rows a step touched by rowwise_adagrad (TorchRec's fused "
                         "default) or sparse_adamw (lazy moments, `betas`, `weight_decay`; "
                         "[recsys.md](recsys.md#sparse-updates))")
                    .only_when(unless_dlrm));
    k.push_back(make_key("optimizer", "embeddings_lr", FIELD(optimizer.embeddings_lr),
                         non_negative("optimizer.lr"), kFileCommands,
                         "dlrm: the tables' rate with sparse updates (on `lr`'s schedule)")
                    .only_when(unless_dlrm));
    k.push_back(make_key("optimizer", "embeddings_eps", FIELD(optimizer.embeddings_eps), positive(),
                         kFileCommands, "dlrm: the sparse updates' epsilon")
                    .only_when(unless_dlrm));
    // --- [train] -------------------------------------------------------------------------
    k.push_back(make_key("train", "epochs", FIELD(train.epochs), at_least(1), kFileCommands,
                         "the run's length in epochs (exactly one of epochs and steps to train)")
                    .defaults_to("unset"));
    k.push_back(make_key("train", "steps", FIELD(train.steps), at_least(1), kFileCommands,
                         "the run's length in optimizer steps; `--set train.steps` replaces the "
                         "file's epochs")
                    .checked_by(check_steps, "not with epochs")
                    .defaults_to("unset"));
    k.push_back(make_key("train", "log_every", FIELD(train.log_every), at_least(1), kFileCommands,
                         "steps between progress lines"));
    k.push_back(shaped("train", "eval_every", any_value(), kFileCommands,
                       "steps between evaluations, or \"epoch\": at the end of every epoch")
                    .reads(read_eval_every, write_eval_every, "integer or `\"epoch\"`")
                    .checked_by(check_eval_every)
                    .shown_as(">= 0 (0: only at the end), or `\"epoch\"`"));
    k.push_back(make_key("train", "accumulation_steps", FIELD(train.accumulation_steps),
                         at_least(1), kFileCommands, "micro-batches per optimizer step"));
    k.push_back(make_key("train", "early_stopping", FIELD(train.early_stopping),
                         non_negative("off"), kFileCommands,
                         "stop after this many evaluations in a row without improvement (of "
                         "`checkpoint.keep_best`'s metric, else the test loss)")
                    .checked_by(check_early_stopping, "needs eval_every"));
    // --- [checkpoint] --------------------------------------------------------------------
    k.push_back(make_key("checkpoint", "every_steps", FIELD(checkpoint.every_steps),
                         non_negative("only at the end"), kFileCommands, "steps between saves"));
    k.push_back(make_key("checkpoint", "keep", FIELD(checkpoint.keep), at_least(1), kFileCommands,
                         "checkpoints kept (`best` apart)"));
    k.push_back(make_key("checkpoint", "resume", FIELD(checkpoint.resume), any_value(),
                         kFileCommands, "continue from the newest checkpoint in `dir`"));
    k.push_back(make_key("checkpoint", "dir", FIELD(checkpoint.dir), any_value(), kFileCommands,
                         "where checkpoints go")
                    .shown_as("a directory")
                    .unset_when_empty()
                    .defaults_to("`<run.output_dir>/checkpoints`"));
    k.push_back(make_key("checkpoint", "async", FIELD(checkpoint.async), any_value(), kFileCommands,
                         "write checkpoints in the background"));
    k.push_back(shaped("checkpoint", "keep_best", any_value(), kFileCommands,
                       "keep the best evaluation's checkpoint as `best`, by this metric "
                       "([running.md](running.md#what-the-output-means)); higher is better for "
                       "the accuracies and R^2, lower for the rest")
                    .reads(read_keep_best, write_keep_best, "name")
                    .checked_by(check_keep_best, "fits the loss; j < the outputs")
                    .shown_as("test_loss | test_accuracy | test_top5_accuracy | test_mse | "
                              "test_mae | test_r2 | test_rel_l2, or one output's: test_mse[j] | "
                              "test_mae[j] | test_r2[j] | test_rel_l2[j]")
                    .defaults_to("unset (off)"));
    k.push_back(make_key("checkpoint", "init_from", FIELD(checkpoint.init_from), any_value(),
                         kFileCommands,
                         "start at step 0 from this checkpoint's parameters and normalization (a "
                         "file, `latest`/`best` pointer or directory); one to resume from wins")
                    .shown_as("a checkpoint")
                    .unset_when_empty()
                    .defaults_to("unset"));
    // --- [runtime] -----------------------------------------------------------------------
    k.push_back(make_key("runtime", "backend", NAMED(runtime.backend, comm_backend_choices()),
                         any_value(), kEveryCommand,
                         "who moves tensors between ranks (auto: nccl with CUDA and NCCL)"));
    k.push_back(make_key("runtime", "matmul_precision",
                         NAMED(runtime.matmul_precision, matmul_precision_choices()), any_value(),
                         kEveryCommand, "how float GEMMs may round (tf32: cuBLAS only)"));
    k.push_back(make_key("runtime", "overlap", FIELD(runtime.overlap), any_value(), kEveryCommand,
                         "start communication early, under computation"));
    k.push_back(make_key("runtime", "bucket_mb", FIELD(runtime.bucket_mb), positive("MiB"),
                         kEveryCommand,
                         "overlap: the cap of a DP gradient bucket (DLRM's linear layers are "
                         "bucketed with or without overlap)"));
    k.push_back(shaped("runtime", "comm_thread", any_value(), kEveryCommand,
                       "a thread that progresses started communication (auto: with overlap "
                       "where a core is free)")
                    .reads(read_comm_thread, write_comm_thread, "boolean or name")
                    .shown_as("`\"auto\"` | true | false"));
    k.push_back(make_key("runtime", "reductions",
                         NAMED(runtime.reductions, reduction_algorithm_choices()), any_value(),
                         kEveryCommand, "the MPI backend's reduce-scatters and all-reduces"));
    k.push_back(make_key("runtime", "cuda_graphs",
                         NAMED(runtime.cuda_graphs, cuda_graphs_choices()), any_value(),
                         kEveryCommand,
                         "capture the training step as a CUDA graph and replay it (auto: where "
                         "legal; the run says which and why)"));
    k.push_back(shaped("runtime", "trace_steps", any_value(), kEveryCommand,
                       "steps to record as a trace in `<run.output_dir>/trace/`")
                    .reads(read_trace_steps, write_trace_steps, "[integer, integer]")
                    .checked_by(check_trace_steps)
                    .shown_as("`[FIRST, LAST]`, 1 <= FIRST <= LAST")
                    .defaults_to("none"));
    k.push_back(make_key("runtime", "flight_records", FIELD(runtime.flight_records),
                         between(0, RuntimeSection::kMaxFlightRecords, false, "off"), kEveryCommand,
                         "collectives each rank's flight recorder keeps"));
    // --- [mixed_precision] ---------------------------------------------------------------
    k.push_back(make_key("mixed_precision", "param_dtype",
                         NAMED(mixed_precision.param_dtype, dtype_choices()), any_value(),
                         kEveryCommand, "what layers compute in and gather weights in"));
    k.push_back(make_key("mixed_precision", "reduce_dtype",
                         NAMED(mixed_precision.reduce_dtype, dtype_choices()), any_value(),
                         kEveryCommand, "what gradients are reduced in")
                    .checked_by(check_reduce_dtype, "one 16-bit format with param_dtype"));
    return k;
  }();
  return keys;
}

#undef FIELD
#undef NAMED

std::vector<std::string> config_section_names() {
  std::vector<std::string> names;
  for (const ConfigSection& section : config_sections()) names.push_back(section.name);
  return names;
}

std::vector<std::string> config_key_names(const std::string& section) {
  std::vector<std::string> names;
  for (const ConfigKey& k : config_keys()) {
    if (section == k.section) names.push_back(k.name);
  }
  return names;
}

const ConfigKey* find_config_key(const std::string& section, const std::string& name) {
  for (const ConfigKey& k : config_keys()) {
    if (section == k.section && name == k.name) return &k;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------
// The keys whose values have a shape of their own, and the rules between keys.

namespace {

// [mesh]: the axes in mesh order; an axis the config does not list has size 1.
std::optional<KeyProblem> read_mesh_axis(const ConfigKey& key, const toml::node& node,
                                         RunConfig& c) {
  if (!node.is_integer()) return wrong_type(node, "an integer");
  const int64_t size = node.as_integer()->get();
  if (size < INT_MIN || size > INT_MAX) return problem("is too large, got ", size);
  for (auto& [axis, axis_size] : c.mesh.axes) {
    if (axis == key.name) {
      axis_size = static_cast<int>(size);
      return std::nullopt;
    }
  }
  c.mesh.axes.emplace_back(key.name, static_cast<int>(size));
  return std::nullopt;
}

void write_mesh_axis(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  for (const auto& [axis, size] : c.mesh.axes) {
    if (axis == key.name) section.insert(axis, size);
  }
}

// Sizes are checked by Mesh's own rule, to name the key; the world size that completes the
// check is known only when the mesh is resolved.
std::optional<KeyProblem> check_mesh_axis(const ConfigKey& key, const RunConfig& c,
                                          const KeyNames&) {
  std::string inferred;  // an earlier axis of size -1
  for (const auto& [axis, size] : c.mesh.axes) {
    if (axis == key.name) {
      const std::string words = mesh_axis_size_problem(size, inferred);
      if (!words.empty()) return problem(words);
      return std::nullopt;
    }
    if (size == -1) inferred = axis;
  }
  return std::nullopt;
}

// model.activation: a name of activation_choices(), or "swiglu" with kind = "residual_mlp"
// (activation silu, and the blocks get a gate projection).
std::vector<std::string> activation_names() {
  std::vector<std::string> names = choice_names(activation_choices());
  names.push_back("swiglu");
  return names;
}

std::optional<KeyProblem> read_activation(const ConfigKey&, const toml::node& node, RunConfig& c) {
  if (!node.is_string()) return wrong_type(node, "a string");
  const std::string& name = node.as_string()->get();
  if (c.model.kind == ModelKind::residual_mlp && name == "swiglu") {
    c.model.swiglu = true;
    c.model.activation = Activation::silu;
    return std::nullopt;
  }
  for (const auto& [option, value] : activation_choices()) {
    if (option == name) {
      c.model.swiglu = false;
      c.model.activation = value;
      return std::nullopt;
    }
  }
  std::vector<std::string> names = choice_names(activation_choices());
  if (c.model.kind == ModelKind::residual_mlp) names.push_back("swiglu");
  return problem("must be one of ", join(names, " | "), ", got \"", name, "\"");
}

void write_activation(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  section.insert(key.name, c.model.activation_name());
}

std::optional<KeyProblem> check_activation(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.model.swiglu && c.model.kind != ModelKind::residual_mlp) {
    return problem("= \"swiglu\" needs kind = \"residual_mlp\"");
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_sizes(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.model.sizes.size() >= 2) return std::nullopt;
  toml::array sizes;
  for (int64_t size : c.model.sizes) sizes.push_back(size);
  return problem("needs at least 2 entries (input and output width), got ", render_node(sizes));
}

// Each entry a hidden layer (kind mlp: the layers followed by an activation) or a block
// (kind residual_mlp), and none twice.
std::optional<KeyProblem> check_moe_layers(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  const ModelSection& model = c.model;
  if (model.kind == ModelKind::dlrm && !model.moe_layers.empty()) {
    return problem("must be empty with kind = \"dlrm\" (it has no MoE layers)");
  }
  const int64_t hidden = static_cast<int64_t>(model.sizes.size()) - 2;  // layers 0 .. hidden-1
  toml::array sizes;
  for (int64_t size : model.sizes) sizes.push_back(size);
  const bool residual = model.kind == ModelKind::residual_mlp;
  for (size_t i = 0; i < model.moe_layers.size(); ++i) {
    const int64_t layer = model.moe_layers[i];
    std::optional<KeyProblem> found;
    if (residual && (layer < 0 || layer >= model.depth)) {
      found =
          problem("entry ", layer, " is not a block: kind = \"residual_mlp\" names blocks 0 to ",
                  model.depth - 1, " for depth = ", model.depth);
    } else if (!residual && (layer < 0 || layer >= hidden)) {
      found = problem("entry ", layer,
                      " is not a hidden layer: the layers followed by an activation are ",
                      hidden > 0 ? "0 to " + std::to_string(hidden - 1) : std::string("none"),
                      " for sizes ", render_node(sizes));
    }
    for (size_t j = 0; j < i && !found; ++j) {
      if (model.moe_layers[j] == layer) found = problem("lists layer ", layer, " twice");
    }
    if (found) {
      found->index = i;
      return found;
    }
  }
  return std::nullopt;
}

// model.bottom (kind dlrm): at least the dense features and d.
std::optional<KeyProblem> check_dlrm_bottom(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.model.bottom.size() >= 2) return std::nullopt;
  return problem(
      "needs at least 2 entries (the dense features and the width d the interaction "
      "takes), got ",
      c.model.bottom.size());
}

// model.top (kind dlrm): the interaction's width first, one logit last.
std::optional<KeyProblem> check_dlrm_top(const ConfigKey&, const RunConfig& c,
                                         const KeyNames& names) {
  const std::vector<int64_t>& top = c.model.top;
  if (top.size() < 2) {
    return problem("needs at least 2 entries (the interaction's width and 1), got ", top.size());
  }
  if (top.back() != 1) {
    return problem("must end in 1 (one click logit per row), got ", top.back());
  }
  if (c.model.bottom.size() < 2 || c.model.tables.empty()) return std::nullopt;  // said there
  const DlrmShape shape = c.model.dlrm();
  const int64_t width = dlrm_interaction_width(shape);
  if (top.front() == width) return std::nullopt;
  const int64_t d = shape.bottom.back(), tables = static_cast<int64_t>(shape.tables.size());
  return problem("starts with ", top.front(), " but ", names("model.interaction"), " = \"",
                 to_string(shape.interaction), "\" of d = ", d, " and ", tables, " tables gives ",
                 width, " features (",
                 shape.interaction == DlrmInteraction::dot
                     ? "d + T (T + 1) / 2 = " + std::to_string(d) + " + " + std::to_string(tables) +
                           " x " + std::to_string(tables + 1) + " / 2"
                     : std::string("d plus the tables' dims"),
                 "): top = [", width, ", ...]");
}

// model.tables: [[model.tables]] name, rows, dim (optional), pooling (optional).
std::optional<KeyProblem> read_tables(const ConfigKey&, const toml::node& node, RunConfig& c) {
  const toml::array* array = node.as_array();
  if (!array) return wrong_type(node, "an array of tables ([[model.tables]] name, rows, dim)");
  c.model.tables.clear();
  for (size_t i = 0; i < array->size(); ++i) {
    auto entry_problem = [i](auto&&... parts) {
      KeyProblem p = problem("entry ", i, " ", parts...);
      p.index = i;
      return p;
    };
    const toml::table* t = (*array)[i].as_table();
    if (!t)
      return entry_problem("must be a table {name, rows, dim, pooling}, got ",
                           render_node((*array)[i]));
    DlrmTable table;
    for (const auto& [member, value] : *t) {
      const std::string name(member.str());
      if (name == "name" && value.is_string()) {
        table.name = value.as_string()->get();
      } else if ((name == "rows" || name == "dim") && value.is_integer()) {
        const int64_t v = value.as_integer()->get();
        if (v < 1) return entry_problem(name, " must be >= 1, got ", v);
        (name == "rows" ? table.rows : table.dim) = v;
      } else if (name == "pooling" && value.is_string()) {
        const std::string pooling = value.as_string()->get();
        if (pooling != "sum" && pooling != "mean") {
          return entry_problem("pooling must be \"sum\" or \"mean\", got \"", pooling, "\"");
        }
        table.pooling = pooling == "sum" ? EmbeddingPooling::sum : EmbeddingPooling::mean;
      } else if (name == "name" || name == "rows" || name == "dim" || name == "pooling") {
        return entry_problem(name, " has the wrong type: ", render_node(value));
      } else {
        return entry_problem("has an unknown member '", name,
                             "' (a table has name, rows, dim and pooling)");
      }
    }
    if (table.name.empty()) return entry_problem("needs a name");
    if (table.rows == 0) return entry_problem("('", table.name, "') needs rows");
    c.model.tables.push_back(table);
  }
  return std::nullopt;
}

void write_tables(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  toml::array tables;
  for (const DlrmTable& t : c.model.tables) {
    toml::table entry{{"name", t.name}, {"rows", t.rows}};
    if (t.dim != 0) entry.insert("dim", t.dim);
    entry.insert("pooling", to_string(t.pooling));
    tables.push_back(std::move(entry));
  }
  section.insert(key.name, std::move(tables));
}

// The tables, and what kind = "dlrm" needs of the other keys.
// model.table_dtype = "bf16" (kind dlrm): the tables are written by a sparse optimizer only (a
// dense one updates fp32 blocks).
std::optional<KeyProblem> check_table_dtype(const ConfigKey&, const RunConfig& c,
                                            const KeyNames& names) {
  if (c.model.table_dtype != Dtype::bf16) return std::nullopt;
  if (c.optimizer.embeddings != EmbeddingOptimizer::dense) return std::nullopt;
  return problem("= \"bf16\" needs a sparse ", names("optimizer.embeddings"),
                 " (\"rowwise_adagrad\" or \"sparse_adamw\"), which rounds the tables' updates to "
                 "bf16; it is \"dense\"");
}

std::optional<KeyProblem> check_tables(const ConfigKey&, const RunConfig& c,
                                       const KeyNames& names) {
  const ModelSection& m = c.model;
  if (m.tables.empty()) return problem("needs at least one table");
  for (size_t i = 0; i < m.tables.size(); ++i) {
    const DlrmTable& t = m.tables[i];
    std::optional<KeyProblem> found;
    if (t.name.find('/') != std::string::npos) {
      found = problem("entry ", i, " name \"", t.name, "\" must not contain '/'");
    }
    for (size_t j = 0; j < i && !found; ++j) {
      if (m.tables[j].name == t.name) found = problem("names table \"", t.name, "\" twice");
    }
    if (!found && m.interaction == DlrmInteraction::dot && t.dim != 0 && !m.bottom.empty() &&
        t.dim != m.bottom.back()) {
      found = problem("entry ", i, " (\"", t.name, "\") has dim = ", t.dim, " but ",
                      names("model.interaction"), " = \"dot\" needs every table's dim equal to ",
                      names("model.bottom"), "'s last size, ", m.bottom.back());
    }
    if (found) {
      found->index = i;
      return found;
    }
  }
  return std::nullopt;
}

// partition.preset = "dlrm" with kind = "dlrm" only (its rules are about embedding tables).
std::optional<KeyProblem> check_preset(const ConfigKey&, const RunConfig& c,
                                       const KeyNames& names) {
  if (c.partition.preset != "dlrm" || c.model.kind == ModelKind::dlrm) return std::nullopt;
  return problem("\"dlrm\" is the preset of ", names("model.kind"),
                 " = \"dlrm\" (its embedding tables row-wise), not of \"", to_string(c.model.kind),
                 "\"; \"dp\" replicates every parameter");
}

// model.loss and data.source with kind = "dlrm": a click model on HDF5 files.
std::optional<KeyProblem> check_dlrm_loss(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.model.kind != ModelKind::dlrm || !c.model.loss ||
      *c.model.loss == LossKind::binary_cross_entropy) {
    return std::nullopt;
  }
  return problem("must be \"binary_cross_entropy\" with kind = \"dlrm\" (a click model), got \"",
                 to_string(*c.model.loss), "\"");
}
std::optional<KeyProblem> check_dlrm_source(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.model.kind != ModelKind::dlrm || c.data.source == DataSource::hdf5) return std::nullopt;
  return problem(
      "must be \"hdf5\" with kind = \"dlrm\" (dense, labels and sparse features from "
      "HDF5 files), got \"",
      to_string(c.data.source), "\"");
}

// data.sparse_key (canonical by complete_config): a group, not the dense or label dataset.
std::optional<KeyProblem> check_sparse_key(const ConfigKey&, const RunConfig& c,
                                           const KeyNames& names) {
  if (c.data.sparse_key.empty()) return problem("must name a group, e.g. \"/sparse\"");
  for (const char* key : {"data.x_key", "data.y_key"}) {
    const std::string& other = std::string(key) == "data.x_key" ? c.data.x_key : c.data.y_key;
    if (c.data.sparse_key == other) {
      return problem("names the same dataset as ", names(key), " (", other, ")");
    }
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_top_k(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.model.top_k > c.model.experts || c.model.top_k > kMoeMaxTopK) {
    return problem("= ", c.model.top_k, " must not exceed experts = ", c.model.experts, " (nor ",
                   kMoeMaxTopK, ")");
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_dropout(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  const ModelSection& m = c.model;
  if (m.kind == ModelKind::dlrm && m.dropout > 0) {
    return problem("= ", m.dropout,
                   " is not supported with kind = \"dlrm\" (it has no dropout "
                   "layers); set dropout = 0");
  }
  if (m.kind == ModelKind::residual_mlp && !m.moe_layers.empty() && m.dropout > 0) {
    return problem("= ", m.dropout, " is not supported with moe_layers in ",
                   "kind = \"residual_mlp\" (the experts' hidden activations have no dropout); "
                   "set dropout = 0 or remove moe_layers");
  }
  return std::nullopt;
}

// [partition] rules: [[regex, spec], ...], a spec as an array (one entry per dimension: "" for
// None, an axis, or an array of axes) or as text ("P(fsdp, tp)").
KeyProblem rule_problem(size_t index, std::string message) {
  KeyProblem p{std::move(message), index, {}, "rule " + std::to_string(index)};
  return p;
}

std::optional<KeyProblem> read_spec_entry(size_t index, const toml::node& node, SpecEntry& entry) {
  if (node.is_string()) {
    const std::string& text = node.as_string()->get();
    if (text.find('@') != std::string::npos) {
      // A table-wise entry, "fsdp@table" or "fsdp@1": read as the text form reads it.
      try {
        const PartitionSpec one = PartitionSpec::parse("P(" + text + ")");
        if (one.size() != 1) return rule_problem(index, "'" + text + "' is not one spec entry");
        entry = one.entries[0];
      } catch (const Error& e) {
        return rule_problem(index, e.what());
      }
      return std::nullopt;
    }
    if (!text.empty()) entry.axes.push_back(text);
    return std::nullopt;
  }
  if (node.is_array()) {
    for (const toml::node& inner : *node.as_array()) {
      if (!inner.is_string() || inner.as_string()->get().empty()) {
        return rule_problem(index,
                            "a tuple entry must list mesh axis names, got " + render_node(node));
      }
      entry.axes.push_back(inner.as_string()->get());
    }
    return std::nullopt;
  }
  return rule_problem(
      index, "a spec entry must be \"\" (None), an axis name or an array of axis names, got " +
                 render_node(node));
}

std::optional<KeyProblem> read_rule(size_t index, const toml::node& node, PartitionRuleText& rule) {
  const toml::array* pair = node.as_array();
  if (!pair || pair->size() != 2 || !(*pair)[0].is_string()) {
    return rule_problem(index, "must be [regex, spec], got " + render_node(node));
  }
  rule.pattern = (*pair)[0].as_string()->get();
  const toml::node& spec = (*pair)[1];
  if (spec.is_string()) {
    try {
      rule.spec = PartitionSpec::parse(spec.as_string()->get());
    } catch (const Error& e) {
      return rule_problem(index, e.what());
    }
  } else if (spec.is_array()) {
    for (const toml::node& entry : *spec.as_array()) {
      rule.spec.entries.emplace_back();
      if (auto p = read_spec_entry(index, entry, rule.spec.entries.back())) return p;
    }
  } else {
    return rule_problem(index,
                        "the spec must be an array like [\"fsdp\", \"tp\"] or a string like "
                        "\"P(fsdp, tp)\", got " +
                            render_node(spec));
  }
  return std::nullopt;
}

std::optional<KeyProblem> read_rules(const ConfigKey&, const toml::node& node, RunConfig& c) {
  if (!node.is_array()) return wrong_type(node, "an array of [regex, spec] pairs");
  const toml::array& array = *node.as_array();
  c.partition.rules.clear();
  for (size_t i = 0; i < array.size(); ++i) {
    c.partition.rules.emplace_back();
    if (auto p = read_rule(i, array[i], c.partition.rules.back())) return p;
  }
  return std::nullopt;
}

void write_rules(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  toml::array rules;
  for (const PartitionRuleText& rule : c.partition.rules) {
    rules.push_back(toml::array{rule.pattern, rule.spec.to_string()});
  }
  section.insert(key.name, std::move(rules));
}

// "" when every axis of `spec` is a mesh axis, named once; else what is wrong, after `what`.
std::string spec_axes_problem(const PartitionSpec& spec, const std::string& what) {
  for (const std::string& axis : spec.axes()) {
    if (!contains(Mesh::known_axes(), axis)) {
      return what + " names unknown mesh axis '" + axis +
             "' (known axes: " + join(Mesh::known_axes()) + ")";
    }
  }
  const std::string repeated = spec.repeated_axis();
  if (!repeated.empty()) {
    return what + " names mesh axis '" + repeated +
           "' more than once; an axis may split only one dimension";
  }
  return "";
}

std::optional<KeyProblem> check_rules(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  const std::vector<PartitionRuleText>& rules = c.partition.rules;
  for (size_t i = 0; i < rules.size(); ++i) {
    try {
      std::regex compiled(rules[i].pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return rule_problem(i,
                          "regex '" + rules[i].pattern + "' does not compile (" + e.what() + ")");
    }
    const std::string words = spec_axes_problem(rules[i].spec, "spec " + rules[i].spec.to_string());
    if (!words.empty()) return rule_problem(i, words);
  }
  return std::nullopt;
}

// [partition] logical_axes = { batch = ["fsdp", "dp"], hidden = "tp" }.
KeyProblem logical_axis_problem(const std::string& name, std::string subject, std::string message) {
  return KeyProblem{std::move(message), {}, name, std::move(subject)};
}

std::optional<KeyProblem> read_logical_axes(const ConfigKey&, const toml::node& node,
                                            RunConfig& c) {
  if (!node.is_table()) return wrong_type(node, "a table like { batch = [\"fsdp\", \"dp\"] }");
  c.partition.logical_axes.clear();
  for (const auto& [key, value] : *node.as_table()) {
    const std::string name(key.str());
    std::vector<std::string> mesh_axes;
    bool fits = value.is_string() || value.is_array();
    if (value.is_string() && !value.as_string()->get().empty()) {
      mesh_axes.push_back(value.as_string()->get());
    }
    if (value.is_array()) {
      for (const toml::node& inner : *value.as_array()) {
        fits = fits && inner.is_string() && !inner.as_string()->get().empty();
        if (fits) mesh_axes.push_back(inner.as_string()->get());
      }
    }
    if (!fits) {
      return logical_axis_problem(
          name, "logical_axes." + name,
          "must be a mesh axis name or an array of them, got " + render_node(value));
    }
    c.partition.logical_axes[name] = mesh_axes;
  }
  return std::nullopt;
}

void write_logical_axes(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  toml::table axes;
  for (const auto& [name, mesh_axes] : c.partition.logical_axes) {
    toml::array array;
    for (const std::string& axis : mesh_axes) array.push_back(axis);
    axes.insert(name, std::move(array));
  }
  section.insert(key.name, std::move(axes));
}

std::optional<KeyProblem> check_logical_axes(const ConfigKey&, const RunConfig& c,
                                             const KeyNames&) {
  for (const auto& [name, mesh_axes] : c.partition.logical_axes) {
    if (!contains(LogicalAxes::names(), name)) {
      return logical_axis_problem(
          name, "logical_axes",
          "unknown logical axis '" + name + "' (known: " + join(LogicalAxes::names()) + ")");
    }
    toml::array axes;
    for (const std::string& axis : mesh_axes) axes.push_back(axis);
    const std::string words =
        spec_axes_problem(PartitionSpec({SpecEntry{mesh_axes}}), "mesh axes " + render_node(axes));
    if (!words.empty()) return logical_axis_problem(name, "logical_axes." + name, words);
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_path(const ConfigKey&, const RunConfig& c, const KeyNames& names) {
  if (c.data.source == DataSource::fashion_mnist && c.data.path.size() > 1) {
    return problem("must be one directory when ", names("data.source"), " = \"fashion_mnist\"");
  }
  if (c.data.source == DataSource::hdf5 && c.data.path.empty()) {
    return problem("is required when ", names("data.source"), " = \"hdf5\" (the training file)");
  }
  return std::nullopt;
}

// data.shuffle: true (rows), false (none) or "blocks".
std::optional<KeyProblem> read_shuffle(const ConfigKey&, const toml::node& node, RunConfig& c) {
  if (node.is_boolean()) {
    c.data.shuffle = node.as_boolean()->get() ? ShuffleMode::rows : ShuffleMode::none;
  } else if (node.is_string() && node.as_string()->get() == "blocks") {
    c.data.shuffle = ShuffleMode::blocks;
  } else {
    return problem("must be true, false or \"blocks\", got ", render_node(node));
  }
  return std::nullopt;
}

void write_shuffle(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  if (c.data.shuffle == ShuffleMode::blocks) {
    section.insert(key.name, "blocks");
  } else {
    section.insert(key.name, c.data.shuffle == ShuffleMode::rows);
  }
}

// data.x_key and y_key (canonical by complete_config): a dataset each, not the same one.
std::optional<KeyProblem> check_dataset_key(const ConfigKey& key, const RunConfig& c,
                                            const KeyNames& names) {
  const bool x = std::string(key.name) == "x_key";
  const std::string& value = x ? c.data.x_key : c.data.y_key;
  if (value.empty()) return problem("must name a dataset, e.g. \"/x\"");
  if (!x && c.data.y_key == c.data.x_key) {
    return problem("names the same dataset as ", names("data.x_key"), " (", c.data.x_key, ")");
  }
  return std::nullopt;
}

// data.dy_key (Sobolev training): what the derivative path is built for
// (Mlp::reserve_tangent_backward): an hdf5 source, an fp32 mlp or residual_mlp (MoE layers and
// dropout included: routing and the training pass's mask are held fixed), a regression loss.
std::optional<KeyProblem> check_dy_key(const ConfigKey&, const RunConfig& c,
                                       const KeyNames& names) {
  const std::string& dy = c.data.dy_key;
  if (dy.empty()) return std::nullopt;
  if (dy == c.data.x_key || dy == c.data.y_key) {
    return problem("names the same dataset as ",
                   names(dy == c.data.x_key ? "data.x_key" : "data.y_key"), " (", dy, ")");
  }
  if (c.data.source != DataSource::hdf5) {
    return problem("needs ", names("data.source"),
                   " = \"hdf5\" (the derivative targets are read "
                   "from the files beside x and y)");
  }
  if (c.mixed_precision.param_dtype != Dtype::fp32) {
    return problem("is not supported with ", names("mixed_precision.param_dtype"),
                   " other than \"fp32\" (derivatives are trained in fp32)");
  }
  if (c.model.kind != ModelKind::mlp && c.model.kind != ModelKind::residual_mlp) {
    return problem("is not supported with ", names("model.kind"), " = \"", to_string(c.model.kind),
                   "\" (Sobolev training is built for kind = \"mlp\" and \"residual_mlp\")");
  }
  if (c.model.loss && !is_regression(*c.model.loss)) {
    return problem("needs a regression loss, but ", names("model.loss"), " is \"",
                   to_string(*c.model.loss), "\"; set it to \"mse\", \"huber\" or \"mae\"");
  }
  return std::nullopt;
}

// data.dy_inputs: input columns, each once, within the model's inputs; only with dy_key.
std::optional<KeyProblem> check_dy_inputs(const ConfigKey&, const RunConfig& c,
                                          const KeyNames& names) {
  const std::vector<int64_t>& columns = c.data.dy_inputs;
  if (columns.empty()) return std::nullopt;
  if (c.data.dy_key.empty()) {
    return problem("chooses the columns of ", names("data.dy_key"), ", which is not set");
  }
  const int64_t inputs = c.model.input_width();
  for (size_t i = 0; i < columns.size(); ++i) {
    std::optional<KeyProblem> found;
    if (columns[i] < 0 || (inputs > 0 && columns[i] >= inputs)) {
      found = problem("entry ", columns[i], " is not an input column: the model has ", inputs,
                      " inputs (0 to ", inputs - 1, "); ", names("data.dy_key"), " needs them");
    }
    for (size_t j = 0; j < i && !found; ++j) {
      if (columns[j] == columns[i]) found = problem("lists input ", columns[i], " twice");
    }
    if (found) {
      found->index = i;
      return found;
    }
  }
  return std::nullopt;
}

// model.loss_weights: an array of numbers.
std::optional<KeyProblem> read_loss_weights(const ConfigKey&, const toml::node& node,
                                            RunConfig& c) {
  const toml::array* array = node.as_array();
  if (!array) return wrong_type(node, "an array of floats, one per output");
  c.model.loss_weights.clear();
  for (size_t i = 0; i < array->size(); ++i) {
    const toml::node& entry = (*array)[i];
    if (!entry.is_integer() && !entry.is_floating_point()) {
      KeyProblem p = problem("entries must be numbers, got ", render_node(entry), " at index ", i);
      p.index = i;
      return p;
    }
    c.model.loss_weights.push_back(entry.is_integer()
                                       ? static_cast<double>(entry.as_integer()->get())
                                       : entry.as_floating_point()->get());
  }
  return std::nullopt;
}

void write_loss_weights(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  if (c.model.loss_weights.empty()) return;
  toml::array array;
  for (double w : c.model.loss_weights) array.push_back(w);
  section.insert(key.name, std::move(array));
}

// One finite, non-negative weight per output, not all 0 (a loss of nothing).
std::optional<KeyProblem> check_loss_weights(const ConfigKey&, const RunConfig& c,
                                             const KeyNames& names) {
  const std::vector<double>& w = c.model.loss_weights;
  if (w.empty()) return std::nullopt;
  for (size_t i = 0; i < w.size(); ++i) {
    if (!(std::isfinite(w[i]) && w[i] >= 0)) {
      KeyProblem p =
          problem("entries must be finite and non-negative, got ", w[i], " at index ", i);
      p.index = i;
      return p;
    }
  }
  if (std::all_of(w.begin(), w.end(), [](double x) { return x == 0; })) {
    return problem("are all 0; give at least one output a positive weight");
  }
  const bool residual = c.model.kind == ModelKind::residual_mlp;
  const int64_t outputs = c.model.output_width();
  if (outputs > 0 && static_cast<int64_t>(w.size()) != outputs) {
    return problem("has ", w.size(), " entries, but the model has ", outputs, " outputs (",
                   names(residual ? "model.outputs" : "model.sizes"), residual ? "" : "[-1]",
                   "); give one weight per output");
  }
  return std::nullopt;
}

// Targets are standardized for regression only: class labels and 0/1 targets are not numbers
// to scale.
std::optional<KeyProblem> check_normalize_targets(const ConfigKey&, const RunConfig& c,
                                                  const KeyNames& names) {
  if (c.data.normalize_targets == Normalize::standard && c.model.loss &&
      !is_regression(*c.model.loss)) {
    const bool labels = c.model.loss == LossKind::cross_entropy;
    return problem("= \"standard\" needs regression targets (model.loss = \"mse\", \"huber\" or ",
                   "\"mae\"), but model.loss = \"", to_string(*c.model.loss), "\" reads ",
                   labels ? "class labels" : "0/1 targets", "; set ",
                   names("data.normalize_targets"), " = \"none\"");
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_min_lr(const ConfigKey&, const RunConfig& c,
                                       const KeyNames& names) {
  const OptimizerSection& opt = c.optimizer;
  if (!(opt.min_lr >= 0 && opt.min_lr <= opt.lr)) {
    return problem("must be in [0, ", names("optimizer.lr"), " = ", opt.lr, "], got ", opt.min_lr);
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_held_out_rows(const ConfigKey&, const RunConfig& c,
                                              const KeyNames& names) {
  if (c.stream.held_out_rows > 0 && !(c.stream.test_fraction > 0.0)) {
    return problem("= ", c.stream.held_out_rows, " sizes a held-out window, but ",
                   names("stream.test_fraction"), " = ", c.stream.test_fraction,
                   " holds no row out; set test_fraction > 0, or leave held_out_rows out");
  }
  return std::nullopt;
}

// Neither epochs nor steps is fine until the run trains (training_steps says so then):
// planning does not need a training length.
std::optional<KeyProblem> check_steps(const ConfigKey&, const RunConfig& c, const KeyNames& names) {
  if (c.train.epochs && c.train.steps) {
    return problem("and ", names("train.epochs"), " are both set; give exactly one of them");
  }
  return std::nullopt;
}

// train.eval_every: a number of steps (0: only at the end), or "epoch".
std::optional<KeyProblem> read_eval_every(const ConfigKey&, const toml::node& node, RunConfig& c) {
  if (node.is_integer()) {
    c.train.eval_every = node.as_integer()->get();
    c.train.eval_each_epoch = false;
  } else if (node.is_string() && node.as_string()->get() == "epoch") {
    c.train.eval_every = 0;
    c.train.eval_each_epoch = true;
  } else {
    return wrong_type(node, "a number of steps (an integer) or \"epoch\"");
  }
  return std::nullopt;
}

void write_eval_every(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  if (c.train.eval_each_epoch) {
    section.insert(key.name, "epoch");
  } else {
    section.insert(key.name, c.train.eval_every);
  }
}

std::optional<KeyProblem> check_eval_every(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  if (c.train.eval_every < 0) {
    return problem("must be non-negative (0: only at the end) or \"epoch\", got ",
                   c.train.eval_every);
  }
  if (c.train.eval_each_epoch && c.train.eval_every != 0) {
    return problem("= ", c.train.eval_every,
                   " and eval_each_epoch are both set; give a number of steps or \"epoch\"");
  }
  return std::nullopt;
}

std::optional<KeyProblem> check_early_stopping(const ConfigKey&, const RunConfig& c,
                                               const KeyNames&) {
  if (c.train.early_stopping > 0 && !c.train.evaluates_during_run()) {
    return problem("needs evaluations during the run: set train.eval_every");
  }
  return std::nullopt;
}

// checkpoint.keep_best: a metric's name, "test_r2[2]" for one output's.
std::optional<KeyProblem> read_keep_best(const ConfigKey&, const toml::node& node, RunConfig& c) {
  if (!node.is_string()) return wrong_type(node, "a metric's name");
  const std::string& name = node.as_string()->get();
  const std::optional<EvalMetric> metric = find_eval_metric(name);
  if (!metric) {
    return problem("must be one of ", eval_metric_choices_text(), ", got \"", name, "\"");
  }
  c.checkpoint.keep_best = metric;
  return std::nullopt;
}

void write_keep_best(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  if (c.checkpoint.keep_best) section.insert(key.name, to_string(*c.checkpoint.keep_best));
}

// A metric the model's loss reports (once the loss is known: EvalMetric::reported_for), and one
// output's of an output the model has.
std::optional<KeyProblem> check_keep_best(const ConfigKey&, const RunConfig& c,
                                          const KeyNames& names) {
  if (!c.checkpoint.keep_best) return std::nullopt;
  const EvalMetric& metric = *c.checkpoint.keep_best;
  const std::string name = to_string(metric);
  if (c.model.loss && !metric.reported_for(*c.model.loss)) {
    const LossKind loss = *c.model.loss;
    const char* kind = metric.classification() ? "a classification metric"
                       : metric.binary()       ? "a binary_cross_entropy model's metric"
                                               : "a regression metric";
    return problem("= \"", name, "\" is ", kind, ", but ", names("model.loss"), " = \"",
                   to_string(loss), "\" does not report it; use ", reported_metrics_text(loss));
  }
  const bool residual = c.model.kind == ModelKind::residual_mlp;
  const int64_t outputs = c.model.output_width();
  if (metric.output >= 0 && outputs > 0 && metric.output >= outputs) {
    return problem("= \"", name, "\" names output ", metric.output, ", but the model has ", outputs,
                   " outputs (", names(residual ? "model.outputs" : "model.sizes"),
                   residual ? "" : "[-1]", "), 0 to ", outputs - 1);
  }
  return std::nullopt;
}

// runtime.comm_thread: true, false or "auto".
std::optional<KeyProblem> read_comm_thread(const ConfigKey&, const toml::node& node, RunConfig& c) {
  if (node.is_boolean()) {
    c.runtime.comm_thread = node.as_boolean()->get() ? CommThreadChoice::on : CommThreadChoice::off;
  } else if (node.is_string() && node.as_string()->get() == "auto") {
    c.runtime.comm_thread = CommThreadChoice::automatic;
  } else {
    return problem("must be true, false or \"auto\", got ", render_node(node));
  }
  return std::nullopt;
}

void write_comm_thread(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  if (c.runtime.comm_thread == CommThreadChoice::automatic) {
    section.insert(key.name, "auto");
  } else {
    section.insert(key.name, c.runtime.comm_thread == CommThreadChoice::on);
  }
}

// runtime.trace_steps = [FIRST, LAST]: 1-based step numbers, FIRST <= LAST.
std::optional<KeyProblem> read_trace_steps(const ConfigKey&, const toml::node& node, RunConfig& c) {
  const toml::array* array = node.as_array();
  if (!array || array->size() != 2 || !(*array)[0].is_integer() || !(*array)[1].is_integer()) {
    return problem("must be [FIRST, LAST], two step numbers, got ", render_node(node));
  }
  c.runtime.trace_first = (*array)[0].as_integer()->get();
  c.runtime.trace_last = (*array)[1].as_integer()->get();
  if (c.runtime.trace_first == 0 && c.runtime.trace_last == 0) {
    return problem("must be [FIRST, LAST] with 1 <= FIRST <= LAST, got ", render_node(node));
  }
  return std::nullopt;
}

void write_trace_steps(const ConfigKey& key, const RunConfig& c, toml::table& section) {
  if (c.runtime.traces()) {
    section.insert(key.name, toml::array{c.runtime.trace_first, c.runtime.trace_last});
  }
}

std::optional<KeyProblem> check_trace_steps(const ConfigKey&, const RunConfig& c, const KeyNames&) {
  const RuntimeSection& rt = c.runtime;
  if ((rt.trace_first != 0 || rt.trace_last != 0) &&
      (rt.trace_first < 1 || rt.trace_last < rt.trace_first)) {
    return problem("must be [FIRST, LAST] with 1 <= FIRST <= LAST, got [ ", rt.trace_first, ", ",
                   rt.trace_last, " ]");
  }
  return std::nullopt;
}

// One 16-bit format per run: a bf16 gradient reduced in fp16 would overflow where bf16 does
// not, and an fp16 one reduced in bf16 loses the mantissa loss scaling protects.
std::optional<KeyProblem> check_reduce_dtype(const ConfigKey&, const RunConfig& c,
                                             const KeyNames& names) {
  const MixedPrecisionSection& mp = c.mixed_precision;
  const bool mixes = (mp.param_dtype == Dtype::bf16 && mp.reduce_dtype == Dtype::fp16) ||
                     (mp.param_dtype == Dtype::fp16 && mp.reduce_dtype == Dtype::bf16);
  if (mixes) {
    return problem("= \"", to_string(mp.reduce_dtype), "\" does not go with ",
                   names("mixed_precision.param_dtype"), " = \"", to_string(mp.param_dtype),
                   "\": use one 16-bit format (or fp32) for both");
  }
  return std::nullopt;
}

}  // namespace
}  // namespace meshtrain
