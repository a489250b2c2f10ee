#include "framework/train/resume.hpp"

#include <string>

#include "framework/io/data.hpp"
#include "partition/error.hpp"
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

// The directory the data is read from: fashion_mnist's default when data.path is empty.
std::string data_path(const DataSection& data) {
  if (data.source == "fashion_mnist" && data.path.empty()) return default_fashion_mnist_dir();
  return data.path;
}

}  // namespace

void check_resume_compatible(const RunConfig& config, const CheckpointInfo& saved,
                             int64_t total_steps) {
  const char* order = "would change the data order";
  require_same("run.seed", saved.train_state.seed, config.run.seed, saved, config, order);

  RunConfig before;
  try {
    before = parse_config(saved.config_text, "the config stored in '" + saved.path + "'");
  } catch (const Error& e) {
    MESHTRAIN_BAD_INPUT("cannot check that checkpoint '", saved.path,
                        "' fits this run: its stored config does not load: ", e.what());
  }
  const DataSection& was = before.data;
  const DataSection& is = config.data;
  const char* other_data = "would train on other data";
  require_same("data.source", was.source, is.source, saved, config, other_data);
  require_same("data.path", data_path(was), data_path(is), saved, config, other_data);
  if (is.source == "synthetic") {
    require_same("data.synthetic_samples", was.synthetic_samples, is.synthetic_samples, saved,
                 config, other_data);
  }
  require_same("data.batch_size", was.batch_size, is.batch_size, saved, config, order);
  require_same("data.shuffle", was.shuffle, is.shuffle, saved, config, order);
  require_same("train.accumulation_steps", before.train.accumulation_steps,
               config.train.accumulation_steps, saved, config, order);
  require_same("model.sizes", before.model.sizes, config.model.sizes, saved, config,
               "would not fit the saved parameters");

  if (saved.train_state.step > total_steps) {
    const std::string length = config.train.steps
                                   ? "train.steps = " + std::to_string(*config.train.steps)
                                   : "train.epochs = " + std::to_string(*config.train.epochs);
    MESHTRAIN_BAD_INPUT("checkpoint '", saved.path, "' is at step ", saved.train_state.step,
                        ", past the last step ", total_steps, " of ", config.file, " (", length,
                        "): raise ", length.substr(0, length.find(' ')),
                        " to train on, or use another checkpoint.dir");
  }
}

}  // namespace meshtrain
