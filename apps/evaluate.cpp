// `meshtrain evaluate`: a TrainingRun of a checkpoint's config on other data, its parameters
// loaded, one evaluation (see evaluate.hpp).

#include "apps/evaluate.hpp"
#include "apps/checkpoint_mesh.hpp"
#include "apps/command.hpp"

#include <mpi.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/io/metrics.hpp"
#include "framework/io/output_file.hpp"
#include "framework/train/config.hpp"
#include "run/dlrm_run.hpp"
#include "run/training_run.hpp"

namespace meshtrain {
namespace {

// The checkpoint file and its stored config, read on rank 0 and the same on every rank.
struct Checkpoint {
  std::string file;
  std::string config_text;
  CheckpointInfo info;
};

Checkpoint read_checkpoint(const std::string& argument, int rank) {
  Checkpoint c;
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (rank != 0) return;
    c.file = resolve_checkpoint_path(argument);
    c.info = list_checkpoint(c.file).info;
    c.config_text = c.info.config_text;
    if (c.config_text.empty()) {
      MESHTRAIN_BAD_INPUT("checkpoint '", c.file, "' stores no config: it cannot be evaluated");
    }
  });
  broadcast_string(c.file, 0, MPI_COMM_WORLD, "MPI_Ibcast (the checkpoint's path)");
  broadcast_string(c.config_text, 0, MPI_COMM_WORLD, "MPI_Ibcast (the checkpoint's config)");
  broadcast_string(c.info.mesh, 0, MPI_COMM_WORLD, "MPI_Ibcast (the checkpoint's mesh)");
  long long step = c.info.train_state.step;
  broadcast_collective(&step, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD,
                       "MPI_Ibcast (the checkpoint's step)");
  c.info.train_state.step = step;
  return c;
}

// The --data files against the checkpoint's model, with messages that name the file, the
// dataset and both widths (the run's own checks name config keys the user did not write).
// Returns the data's rows.
int64_t check_data(const RunConfig& config, const std::string& checkpoint) {
  const std::vector<std::string> files = expand_data_paths(config.data.path, "--data");
  const int64_t inputs = config.model.input_width();
  const int64_t outputs = config.model.output_width();
  const bool residual = config.model.kind == ModelKind::residual_mlp;
  Hdf5SourceOptions options;
  options.x_name = config.data.x_key;
  options.y_name = config.data.y_key;
  const std::unique_ptr<RowSource> source = open_hdf5_source(files, outputs, options);
  const DataShape& shape = source->shape();
  const std::string where = "--data '" + files.front() + "'";
  const std::string model = "the model of checkpoint '" + checkpoint + "'";
  const std::string x = canonical_dataset_key(config.data.x_key);
  const std::string y = canonical_dataset_key(config.data.y_key);
  if (shape.num_samples == 0) MESHTRAIN_BAD_INPUT(where, ": dataset '", x, "' has no rows");
  if (shape.features != inputs) {
    MESHTRAIN_BAD_INPUT(where, ": dataset '", x, "' has ", shape.features,
                        " features per row, but ", model, " takes ", inputs, " (",
                        residual ? "model.inputs" : "model.sizes[0]", ")");
  }
  if (config.model.loss == LossKind::cross_entropy && !shape.classification()) {
    MESHTRAIN_BAD_INPUT(where, ": dataset '", y, "' holds floats (targets of width ",
                        shape.target_width, "), but ", model, " is a classifier of ", outputs,
                        " classes (model.loss = \"cross_entropy\"): store class labels as "
                        "integers");
  }
  if (config.model.loss && takes_targets(*config.model.loss) && shape.classification()) {
    MESHTRAIN_BAD_INPUT(where, ": dataset '", y, "' holds integer class labels, but ", model,
                        " predicts ", outputs, " float targets (model.loss = \"",
                        to_string(*config.model.loss), "\")",
                        config.model.loss == LossKind::binary_cross_entropy
                            ? ": store the 0/1 targets as floats [rows, outputs]"
                            : "");
  }
  if (!shape.classification() && shape.target_width != outputs) {
    MESHTRAIN_BAD_INPUT(where, ": dataset '", y, "' has ", shape.target_width,
                        " targets per row, but ", model, " predicts ", outputs, " (",
                        residual ? "model.outputs" : "model.sizes[-1]", ")");
  }
  return shape.num_samples;
}

// The run's config: the checkpoint's, on --data, initialized from the checkpoint (nothing
// resumed). The evaluation batch stays
// the checkpoint config's; the training batch too, unless the data has fewer rows (the run
// schedules a training set of the data's rows): then one row per batch shard.
RunConfig evaluation_config(const Checkpoint& checkpoint, const EvaluateArgs& args, int world) {
  RunConfig config = parse_config(checkpoint.config_text, checkpoint.file, args.overrides);
  config.data.source = DataSource::hdf5;
  // An online run's [stream] keys describe its stream, not --data: back to their defaults, or
  // the check of the config refuses them as keys given without data.source = "stream". No
  // `--set stream.*` is lost here: check_evaluate_overrides refused them before (every
  // stream key is one evaluate does not take), in one sentence naming the key.
  config.stream = StreamSection{};
  config.data.path = args.data;
  config.data.test_path = args.data;
  config.data.shuffle = ShuffleMode::none;  // the training order is never used
  config.checkpoint.resume = false;
  // The run starts from the checkpoint's parameters and normalization statistics
  // (TrainingRun::load_model at set-up): no statistics pass over --data, and a stored
  // init_from (the run it was fine-tuned from, perhaps gone by now) is not read.
  config.checkpoint.init_from = checkpoint.file;
  config.train.accumulation_steps = 1;
  // Nothing goes into the training run's folder (the config's run.output_dir): its flight
  // records are what a hung run leaves behind, and the recorder would remove them at start
  // and overwrite them on a timeout. Records go to --flight-dir, or none are kept; and the
  // run, which takes no step, traces none.
  if (args.flight_dir.empty()) {
    config.runtime.flight_records = 0;
  } else {
    config.run.output_dir = args.flight_dir;
  }
  config.runtime.trace_first = config.runtime.trace_last = 0;
  const Mesh mesh = resolve_checkpoint_mesh(config.mesh, world, "evaluate uses");
  const int64_t rows = check_data(config, checkpoint.file);
  if (rows < config.data.batch_size) {
    std::vector<std::string> axes;
    for (const std::string& axis : plan_options(config).batch_axes) {
      if (mesh.has_axis(axis)) axes.push_back(axis);
    }
    const int64_t shards = mesh.size_of(axes);
    if (rows < shards) {
      MESHTRAIN_BAD_INPUT("--data has ", rows, " rows, fewer than the ", shards,
                          " batch shards of mesh ", mesh.short_description(),
                          ": evaluate on fewer ranks or another mesh (--set mesh.*)");
    }
    if (config.model.kind == ModelKind::dlrm) {
      // A DLRM evaluates with its training batch (DlrmRun): the largest whole number of shards.
      config.data.batch_size = rows / shards * shards;
      config.data.eval_batch_size = config.data.batch_size;
    } else {
      config.data.eval_batch_size = config.data.eval_batch_size.value_or(config.data.batch_size);
      config.data.batch_size = shards;
    }
  }
  return config;
}

// --json FILE is renamed over FILE at the end: never over the checkpoint or a --data file.
void check_json_output(const EvaluateArgs& args) {
  if (args.json.empty() || args.json == "-") return;
  std::vector<ReadFile> read =
      checkpoint_files_read(args.checkpoint, "the checkpoint being evaluated");
  for (const std::string& file : expand_data_paths(args.data, "--data")) {
    read.push_back({file, "a --data file"});
  }
  refuse_output_that_is_read(args.json, "--json", read);
}

// --json FILE: written as FILE.tmp and renamed, so a failed evaluation leaves no file that
// looks whole; opened before the evaluation so an unwritable path fails at once.
class JsonOutput {
 public:
  explicit JsonOutput(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    if (path_.empty() || path_ == "-") return;
    file_ = std::fopen(tmp_.c_str(), "w");
    if (!file_) {
      MESHTRAIN_BAD_INPUT("cannot write the --json file '", path_, "': ", std::strerror(errno));
    }
  }
  ~JsonOutput() {
    if (!file_) return;
    std::fclose(file_);
    std::remove(tmp_.c_str());  // not committed: no partial output
  }
  JsonOutput(const JsonOutput&) = delete;
  JsonOutput& operator=(const JsonOutput&) = delete;

  void write(const std::string& json) {
    if (path_.empty()) return;
    if (path_ == "-") {
      std::printf("%s\n", json.c_str());
      std::fflush(stdout);
      return;
    }
    const bool written = std::fputs(json.c_str(), file_) != EOF && std::fputc('\n', file_) != EOF;
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    if (!written || !closed || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const std::string reason = std::strerror(errno);
      std::remove(tmp_.c_str());
      MESHTRAIN_FAIL("cannot write the --json file '", path_, "': ", reason);
    }
  }

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
};

std::string format_value(double value, const char* format) {
  if (std::isnan(value)) return "n/a";
  char text[48];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

// The human-readable report (rank 0).
// What the test loss of a model trained with a loss on float targets is, in words.
std::string loss_description(LossKind loss, bool weighted) {
  const char* term = loss == LossKind::binary_cross_entropy ? "binary cross entropy"
                     : loss == LossKind::huber              ? "Huber loss"
                     : loss == LossKind::mae                ? "absolute error"
                                                            : "squared error";
  return std::string("mean over rows of the ") + (weighted ? "weighted " : "") +
         "sum over outputs of the " + term +
         (is_regression(loss) ? ", in the units the model was trained in" : "");
}

// `data`: the test data's description; `mesh`: the run's mesh.
void print_report(std::FILE* out, const Checkpoint& checkpoint, const RunConfig& config,
                  const std::string& data, const Mesh& mesh, const EvalEvent& e) {
  std::fprintf(out, "meshtrain evaluate %s (step %lld, saved on %s)\n", checkpoint.file.c_str(),
               static_cast<long long>(checkpoint.info.train_state.step),
               checkpoint.info.mesh.c_str());
  std::fprintf(
      out, "  data: %s, %lld rows; mesh %s, eval batch %lld\n", data.c_str(),
      static_cast<long long>(e.test_rows), mesh.short_description().c_str(),
      static_cast<long long>(config.data.eval_batch_size.value_or(config.data.batch_size)));
  const bool classification = !e.test_class_accuracy.empty();
  const LossKind loss = config.model.loss.value_or(LossKind::cross_entropy);
  const bool binary = loss == LossKind::binary_cross_entropy;
  std::fprintf(out, "test loss %.6g (as trained: %s)\n", e.test_loss,
               classification ? "cross entropy, mean over rows"
                              : loss_description(loss, !config.model.loss_weights.empty()).c_str());
  if (binary) {
    std::fprintf(out,
                 "AUC %s  log loss %.6g  accuracy %.4f (over all outputs; t >= 0.5 is a yes)\n",
                 format_value(e.test_auc, "%.4f").c_str(), e.test_log_loss, e.test_accuracy);
    for (size_t j = 0; e.test_auc_per_output.size() > 1 && j < e.test_auc_per_output.size(); ++j) {
      std::fprintf(out, "  output %zu: AUC %s  log loss %.6g\n", j,
                   format_value(e.test_auc_per_output[j], "%.4f").c_str(),
                   e.test_log_loss_per_output[j]);
    }
  } else if (classification) {
    std::fprintf(out, "accuracy %.4f", e.test_accuracy);
    if (!std::isnan(e.test_top5_accuracy)) std::fprintf(out, "  top-5 %.4f", e.test_top5_accuracy);
    std::fprintf(out, "\nper class (accuracy, rows):");
    for (size_t c = 0; c < e.test_class_accuracy.size(); ++c) {
      std::fprintf(out, "%s %zu: %s (%lld)", c % 5 == 0 ? "\n " : "", c,
                   format_value(e.test_class_accuracy[c], "%.4f").c_str(),
                   static_cast<long long>(e.test_class_rows[c]));
    }
    std::fprintf(out, "\n");
  } else {
    std::fprintf(out,
                 "MSE %.6g  MAE %.6g  R^2 %s  rel L2 %s (over all outputs, in the data's units)\n",
                 e.test_mse, e.test_mae, format_value(e.test_r2, "%.4f").c_str(),
                 format_value(e.test_rel_l2, "%.4g").c_str());
    for (size_t j = 0; j < e.test_mse_per_output.size(); ++j) {
      std::fprintf(out, "  output %zu: MSE %.6g  MAE %.6g  R^2 %s  rel L2 %s\n", j,
                   e.test_mse_per_output[j], e.test_mae_per_output[j],
                   format_value(e.test_r2_per_output[j], "%.4f").c_str(),
                   format_value(e.test_rel_l2_per_output[j], "%.4g").c_str());
    }
  }
  std::fflush(out);
}

}  // namespace

void check_evaluate_overrides(const std::vector<std::string>& overrides) {
  check_overrides(overrides, ConfigCommand::evaluate);  // the schema says which keys
}

int evaluate_command(const EvaluateArgs& args) try {
  int rank = 0, world = 1;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
  std::optional<JsonOutput> json;
  on_every_rank(MPI_COMM_WORLD, [&] {
    check_evaluate_overrides(args.overrides);
    if (rank == 0) json.emplace(args.json);
  });
  const Checkpoint checkpoint = read_checkpoint(args.checkpoint, rank);
  std::optional<RunConfig> config;
  on_every_rank(MPI_COMM_WORLD, [&] {
    config = evaluation_config(checkpoint, args, world);
    if (rank == 0) check_json_output(args);
  });

  // The run of the checkpoint's kind (docs/recsys.md: a DLRM's), its parameters loaded.
  auto evaluate_with = [&](auto& run, const std::string& data) {
    EvalEvent event = run.evaluate();
    event.step = checkpoint.info.train_state.step;  // the model's step (the run did none)
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (rank != 0) return;
      // With the JSON on standard output the report goes to standard error.
      print_report(args.json == "-" ? stderr : stdout, checkpoint, run.config(), data, run.mesh(),
                   event);
      json->write(eval_event_json(event));
    });
  };
  if (config->model.kind == ModelKind::dlrm) {
    DlrmRun run(*config);
    evaluate_with(run, run.test_shape().description);
  } else {
    TrainingRun run(*config);
    evaluate_with(run, run.test_data().shape().description);
  }
  return 0;
} catch (const AgreedError& error) {
  return report_agreed_error(error);  // every rank holds it
}

}  // namespace meshtrain
