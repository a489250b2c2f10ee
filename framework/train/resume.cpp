#include "framework/train/resume.hpp"

#include <cmath>
#include <iomanip>
#include <sstream>
#include <string>

#include "base/error.hpp"
#include "framework/io/data.hpp"
#include "framework/train/lr_schedule.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {
namespace {

std::string value_text(const std::string& value) {
  return "\"" + value + "\"";
}
std::string value_text(bool value) {
  return value ? "true" : "false";
}
std::string value_text(int64_t value) {
  return std::to_string(value);
}
std::string value_text(uint64_t value) {
  return std::to_string(value);
}
std::string value_text(const std::vector<int64_t>& value) {
  return format_shape(value);
}
std::string value_text(DataSource value) {
  return value_text(std::string(to_string(value)));
}
std::string value_text(ShuffleMode value) {
  return value == ShuffleMode::blocks ? "\"blocks\""
         : value == ShuffleMode::rows ? "true"
                                      : "false";
}
std::string value_text(ModelKind value) {
  return value_text(std::string(to_string(value)));
}
std::string value_text(ModelNorm value) {
  return value_text(std::string(to_string(value)));
}
std::string value_text(Normalize value) {
  return value_text(std::string(to_string(value)));
}
std::string value_text(const std::vector<std::string>& value) {
  if (value.size() == 1) return value_text(value.front());
  std::string text = "[";
  for (const std::string& v : value) text += (text.size() > 1 ? ", " : "") + value_text(v);
  return text + "]";
}

// bad_input unless the saved run and this one agree on `key`.
template <class T>
void require_same(const char* key, const T& saved, const T& now, const CheckpointInfo& info,
                  const RunConfig& config, const char* consequence) {
  if (saved == now) return;
  MESHTRAIN_BAD_INPUT("checkpoint '", info.path, "' was saved by a run with ", key, " = ",
                      value_text(saved), " but ", config.file, " has ", key, " = ", value_text(now),
                      ": resuming ", consequence, "; resume with ", key, " = ", value_text(saved),
                      " or use another checkpoint.dir");
}

// What the data is read from: fashion_mnist's default directory when data.path is empty.
std::vector<std::string> data_path(const DataSection& data) {
  if (data.source == DataSource::fashion_mnist && data.path.empty())
    return {default_fashion_mnist_dir()};
  return data.path;
}

// The config the checkpoint's run was made with.
RunConfig stored_config(const CheckpointInfo& saved) {
  try {
    return parse_config(saved.config_text, "the config stored in '" + saved.path + "'");
  } catch (const Error& e) {
    MESHTRAIN_BAD_INPUT("cannot check that checkpoint '", saved.path,
                        "' fits this run: its stored config does not load: ", e.what());
  }
}

LrSchedule schedule_of(const RunConfig& config, int64_t total_steps) {
  const OptimizerSection& opt = config.optimizer;
  return LrSchedule{opt.schedule, opt.lr, opt.min_lr, opt.warmup_steps, total_steps};
}

std::string length_text(const RunConfig& config) {
  return config.train.steps ? "train.steps = " + std::to_string(*config.train.steps)
                            : "train.epochs = " + std::to_string(config.train.epochs.value_or(0));
}

}  // namespace

void check_resume_compatible(const RunConfig& config, const CheckpointInfo& saved,
                             int64_t total_steps, const std::string& data_order) {
  const char* order = "would change the data order";
  require_same("run.seed", saved.train_state.seed, config.run.seed, saved, config, order);

  const RunConfig before = stored_config(saved);
  const DataSection& was = before.data;
  const DataSection& is = config.data;
  const char* other_data = "would train on other data";
  require_same("data.source", was.source, is.source, saved, config, other_data);
  require_same("data.path", data_path(was), data_path(is), saved, config, other_data);
  if (is.source == DataSource::hdf5) {
    require_same("data.x_key", was.x_key, is.x_key, saved, config, other_data);
    require_same("data.y_key", was.y_key, is.y_key, saved, config, other_data);
  }
  if (is.source == DataSource::synthetic) {
    require_same("data.synthetic_samples", was.synthetic_samples, is.synthetic_samples, saved,
                 config, other_data);
  }
  // The statistics in the checkpoint are the run's: a resumed run keeps them, and cannot
  // start or stop normalizing half-way.
  const char* other_inputs = "would change what the model was trained to see";
  require_same("data.normalize_inputs", was.normalize_inputs, is.normalize_inputs, saved, config,
               other_inputs);
  require_same("data.normalize_targets", was.normalize_targets, is.normalize_targets, saved, config,
               other_inputs);
  require_same("data.batch_size", was.batch_size, is.batch_size, saved, config, order);
  require_same("data.shuffle", was.shuffle, is.shuffle, saved, config, order);
  if (is.shuffle == ShuffleMode::blocks) {
    require_same("data.block_rows", was.block_rows, is.block_rows, saved, config, order);
    require_same("data.shuffle_window", was.shuffle_window, is.shuffle_window, saved, config,
                 order);
  }
  const std::string& saved_order = saved.train_state.data_order;
  if (saved_order.empty() && is.shuffle != ShuffleMode::none) {
    MESHTRAIN_BAD_INPUT("checkpoint '", saved.path,
                        "' records no data order: it was saved when data.shuffle = true meant a "
                        "shuffled table of every row, which this meshtrain no longer builds, so "
                        "resuming would change the data order; resume it with the meshtrain that "
                        "saved it, or use another checkpoint.dir");
  }
  if (!saved_order.empty() && saved_order != data_order) {
    MESHTRAIN_BAD_INPUT("checkpoint '", saved.path, "' was saved with the data order '",
                        saved_order, "' but ", config.file, " gives '", data_order,
                        "' (data.shuffle and the training rows decide it): resuming would change "
                        "the data order; use the same data and data.shuffle, or another "
                        "checkpoint.dir");
  }
  require_same("train.accumulation_steps", before.train.accumulation_steps,
               config.train.accumulation_steps, saved, config, order);
  const char* shapes = "would not fit the saved parameters";
  require_same("model.kind", before.model.kind, config.model.kind, saved, config, shapes);
  require_same("model.sizes", before.model.sizes, config.model.sizes, saved, config, shapes);
  if (config.model.kind == ModelKind::residual_mlp) {
    const ModelSection &a = before.model, &b = config.model;
    require_same("model.inputs", a.inputs, b.inputs, saved, config, shapes);
    require_same("model.outputs", a.outputs, b.outputs, saved, config, shapes);
    require_same("model.width", a.width, b.width, saved, config, shapes);
    require_same("model.hidden", a.hidden, b.hidden, saved, config, shapes);
    require_same("model.depth", a.depth, b.depth, saved, config, shapes);
    require_same("model.norm", a.norm, b.norm, saved, config, shapes);
    require_same("model.activation", a.activation_name(), b.activation_name(), saved, config,
                 shapes);
  }

  if (saved.train_state.step > total_steps) {
    const std::string length = length_text(config);
    MESHTRAIN_BAD_INPUT("checkpoint '", saved.path, "' is at step ", saved.train_state.step,
                        ", past the last step ", total_steps, " of ", config.file, " (", length,
                        "): raise ", length.substr(0, length.find(' ')),
                        " to train on, or use another checkpoint.dir");
  }
}

ResumedBest resumed_best(const TrainState& saved, EvalMetric metric) {
  ResumedBest best;
  const std::string name = to_string(metric);
  if (saved.best_metric_name == name) {
    best.metric = saved.best_metric;
    best.evals_since = saved.evals_since_best;
    return best;
  }
  // Nothing was evaluated yet: nothing to drop.
  if (std::isnan(saved.best_metric) && saved.evals_since_best == 0) return best;
  std::ostringstream out;
  out << std::setprecision(5) << "the best " << name << " starts afresh: the checkpoint's best ("
      << saved.best_metric << ") ";
  if (saved.best_metric_name.empty()) {
    out << "does not record which metric it measured (saved by an older meshtrain)";
  } else {
    out << "is a " << saved.best_metric_name << " (checkpoint.keep_best changed)";
  }
  best.note = out.str();
  return best;
}

std::string learning_rate_change_warning(const RunConfig& config, const CheckpointInfo& saved,
                                         int64_t total_steps, int64_t steps_per_epoch) {
  const RunConfig before = stored_config(saved);
  if (!before.train.steps && !before.train.epochs) return "";
  const int64_t saved_total = training_steps(before, steps_per_epoch);
  if (saved_total == total_steps) return "";
  const int64_t step = saved.train_state.step;
  const double was = schedule_of(before, saved_total).at(step);
  const double is = schedule_of(config, total_steps).at(step);
  if (std::abs(is - was) <= 1e-6 * std::abs(was)) return "";  // constant: the length is free
  std::ostringstream out;
  out << std::setprecision(2) << std::scientific << "the run that saved '" << saved.path << "' had "
      << length_text(before) << " (" << saved_total << " steps), this one " << length_text(config)
      << " (" << total_steps << "): optimizer.schedule = \"" << to_string(config.optimizer.schedule)
      << "\" spans the whole run, so the learning rate"
      << " of step " << step + 1 << " becomes " << is << " instead of " << was
      << " (the schedule is stretched, not continued); resume with " << length_text(before)
      << " to continue it";
  return out.str();
}

}  // namespace meshtrain
