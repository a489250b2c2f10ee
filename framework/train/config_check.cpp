// check_config: the value checks of load_config for a RunConfig made in code. The TOML
// reader (config_reader.cpp) checks the same values as it reads them, naming the line; the
// checks both make (moe_settings_problem) live here. The options are enums: a config made
// in code cannot name an unknown one.

#include <cmath>
#include <regex>
#include <sstream>
#include <string>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {
std::optional<ModelKeyProblem> moe_settings_problem(const ModelSection& model) {
  const auto problem = [](std::string key, std::optional<size_t> entry, const auto&... parts) {
    std::ostringstream message;
    (message << ... << parts);
    return ModelKeyProblem{std::move(key), entry, message.str()};
  };
  const int64_t hidden = static_cast<int64_t>(model.sizes.size()) - 2;  // layers 0 .. hidden-1
  std::string sizes;  // as toml++ writes the array: "[ 784, 512, 10 ]"
  for (int64_t size : model.sizes) sizes += (sizes.empty() ? "[ " : ", ") + std::to_string(size);
  sizes += " ]";
  const bool residual = model.kind == ModelKind::residual_mlp;
  for (size_t i = 0; i < model.moe_layers.size(); ++i) {
    const int64_t layer = model.moe_layers[i];
    if (residual && (layer < 0 || layer >= model.depth)) {
      return problem("moe_layers", i, "entry ", layer,
                     " is not a block: kind = \"residual_mlp\" names blocks 0 to ", model.depth - 1,
                     " for depth = ", model.depth);
    }
    if (!residual && (layer < 0 || layer >= hidden)) {
      return problem("moe_layers", i, "entry ", layer,
                     " is not a hidden layer: the layers followed by an activation are ",
                     hidden > 0 ? "0 to " + std::to_string(hidden - 1) : std::string("none"),
                     " for sizes ", sizes);
    }
    for (size_t j = 0; j < i; ++j) {
      if (model.moe_layers[j] == layer)
        return problem("moe_layers", i, "lists layer ", layer, " twice");
    }
  }
  if (model.experts < 1) return problem("experts", {}, "must be at least 1, got ", model.experts);
  if (model.top_k < 1) return problem("top_k", {}, "must be at least 1, got ", model.top_k);
  if (model.top_k > model.experts || model.top_k > 16) {
    return problem("top_k", {}, "= ", model.top_k, " must not exceed experts = ", model.experts,
                   " (nor 16)");
  }
  if (!(model.aux_loss_coef >= 0) || !std::isfinite(model.aux_loss_coef)) {
    return problem("aux_loss_coef", {}, "must be non-negative, got ", model.aux_loss_coef);
  }
  if (!(model.dropout >= 0 && model.dropout < 1)) {
    return problem("dropout", {}, "must be in [0, 1) (the probability of dropping a hidden ",
                   "activation; 0 = no dropout), got ", model.dropout);
  }
  if (residual && !model.moe_layers.empty() && model.dropout > 0) {
    return problem("dropout", {}, "= ", model.dropout, " is not supported with moe_layers in ",
                   "kind = \"residual_mlp\" (the experts' hidden activations have no dropout); "
                   "set dropout = 0 or remove moe_layers");
  }
  return std::nullopt;
}

void check_config_products(const RunConfig& config) {
  const std::string& where = config.file.empty() ? std::string("the run config") : config.file;
  // a x b, or bad input naming both keys when it does not fit in 64 bits (`margin`: a factor
  // the product is used with later, such as bytes per element and optimizer slots).
  const auto product = [&](int64_t a, const std::string& a_key, int64_t b, const std::string& b_key,
                           int64_t margin = 1) {
    int64_t out = 0;
    if (__builtin_mul_overflow(a, b, &out) || __builtin_mul_overflow(out, margin, &out)) {
      MESHTRAIN_BAD_INPUT(where, ": ", a_key, " = ", a, " x ", b_key, " = ", b,
                          " is too large (it overflows 64-bit integers)");
    }
    return out;
  };
  product(config.data.batch_size, "data.batch_size", config.train.accumulation_steps,
          "train.accumulation_steps");
  const std::vector<int64_t>& sizes = config.model.sizes;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    // A weight's elements, times 4 bytes and up to 4 copies (parameter, gradient, 2 slots).
    product(sizes[i], "model.sizes[" + std::to_string(i) + "]", sizes[i + 1],
            "model.sizes[" + std::to_string(i + 1) + "]", 16);
  }
  for (int64_t layer : config.model.moe_layers) {
    if (layer < 0 || layer + 1 >= static_cast<int64_t>(sizes.size())) continue;  // check_config
    // An expert weight's elements, with the same margin as a dense weight.
    const size_t i = static_cast<size_t>(layer);
    const int64_t experts_in = product(config.model.experts, "model.experts", sizes[i],
                                       "model.sizes[" + std::to_string(i) + "]");
    product(experts_in, "model.experts x model.sizes[" + std::to_string(i) + "]", sizes[i + 1],
            "model.sizes[" + std::to_string(i + 1) + "]", 16);
  }
  if (config.model.kind == ModelKind::residual_mlp) {
    const ModelSection& m = config.model;
    product(m.inputs, "model.inputs", m.width, "model.width", 16);
    product(m.width, "model.width", m.hidden, "model.hidden", 16 * 3);
    product(m.width, "model.width", m.outputs, "model.outputs", 16);
    product(m.width * m.hidden, "model.width x model.hidden", m.depth, "model.depth", 16 * 3);
    if (!m.moe_layers.empty()) {  // an MoE block's experts
      product(m.width * m.hidden, "model.width x model.hidden", m.experts, "model.experts", 16 * 3);
    }
  }
  const int64_t row_bytes =
      std::max<int64_t>(4, 4 * (config.model.input_width() + config.model.output_width()));
  product(config.data.block_rows, "data.block_rows", config.data.shuffle_window,
          "data.shuffle_window", row_bytes);
}

void check_config(RunConfig& config) {
  if (config.file.empty()) config.file = "the run config";
  const std::string& where = config.file;
  auto fail = [&](const std::string& key, const auto&... parts) {
    MESHTRAIN_BAD_INPUT(where, ": ", key, " ", parts...);
  };

  if (config.run.name.empty()) fail("run.name", "must not be empty");
  if (!(config.run.peak_tflops >= 0) || !std::isfinite(config.run.peak_tflops)) {
    fail("run.peak_tflops", "must be non-negative (0 = unknown), got ", config.run.peak_tflops);
  }
  if (config.run.output_dir.empty()) config.run.output_dir = "runs/" + config.run.name;
  if (config.checkpoint.dir.empty()) config.checkpoint.dir = config.run.output_dir + "/checkpoints";

  if (config.model.kind == ModelKind::residual_mlp) {
    if (!config.model.sizes.empty()) {
      fail("model.sizes",
           "is a key of kind = \"mlp\"; kind = \"residual_mlp\" takes inputs, "
           "outputs, width, hidden and depth instead");
    }
    for (const auto& [key, value] : {std::pair<const char*, int64_t>{"inputs", config.model.inputs},
                                     {"outputs", config.model.outputs},
                                     {"width", config.model.width},
                                     {"hidden", config.model.hidden},
                                     {"depth", config.model.depth}}) {
      if (value < 1) fail(std::string("model.") + key, "must be at least 1, got ", value);
    }
  } else if (config.model.swiglu) {
    fail("model.activation", "= \"swiglu\" needs kind = \"residual_mlp\"");
  } else if (config.model.sizes.size() < 2) {
    fail("model.sizes", "needs at least 2 entries (input and output width), got ",
         config.model.sizes.size());
  }
  for (size_t i = 0; i < config.model.sizes.size(); ++i) {
    if (config.model.sizes[i] < 1) {
      fail("model.sizes", "entries must be positive integers, got ", config.model.sizes[i],
           " at index ", i);
    }
  }
  if (const std::optional<ModelKeyProblem> problem = moe_settings_problem(config.model)) {
    fail("model." + problem->key, problem->message);
  }

  if (config.partition.min_sharding_size < 0) {
    fail("partition.min_sharding_size", "must be non-negative, got ",
         config.partition.min_sharding_size);
  }
  for (size_t i = 0; i < config.partition.rules.size(); ++i) {
    const PartitionRuleText& rule = config.partition.rules[i];
    try {
      std::regex compiled(rule.pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      fail("partition.rules", "rule ", i, ": regex '", rule.pattern, "' does not compile (",
           e.what(), ")");
    }
    for (const std::string& axis : rule.spec.axes()) {
      if (!contains(Mesh::known_axes(), axis)) {
        fail("partition.rules", "rule ", i, ": spec ", rule.spec.to_string(),
             " names unknown mesh axis '", axis, "' (known axes: ", join(Mesh::known_axes()), ")");
      }
    }
    if (!rule.spec.repeated_axis().empty()) {
      fail("partition.rules", "rule ", i, ": spec ", rule.spec.to_string(), " names mesh axis '",
           rule.spec.repeated_axis(), "' more than once");
    }
  }

  if (config.data.batch_size < 1) fail("data.batch_size", "must be at least 1");
  if (config.data.eval_batch_size && *config.data.eval_batch_size < 1) {
    fail("data.eval_batch_size", "must be at least 1, got ", *config.data.eval_batch_size);
  }
  if (config.data.synthetic_samples < 1) fail("data.synthetic_samples", "must be at least 1");
  for (auto [key, value] :
       {std::pair{"data.x_key", &config.data.x_key}, std::pair{"data.y_key", &config.data.y_key}}) {
    *value = canonical_dataset_key(*value);
    if (value->empty()) fail(key, "must name a dataset, e.g. \"/x\"");
  }
  if (config.data.x_key == config.data.y_key) {
    fail("data.y_key", "names the same dataset as data.x_key (" + config.data.x_key + ")");
  }
  if (config.data.normalize_targets == Normalize::standard &&
      config.model.loss == LossKind::cross_entropy) {
    fail("data.normalize_targets",
         "= \"standard\" needs regression targets (model.loss = \"mse\"), but model.loss = "
         "\"cross_entropy\" reads class labels; set data.normalize_targets = \"none\"");
  }
  if (config.data.block_rows < 1) fail("data.block_rows", "must be at least 1");
  if (config.data.shuffle_window < 1) fail("data.shuffle_window", "must be at least 1");
  if (config.data.prefetch < 0) fail("data.prefetch", "must be non-negative (0: no reader thread)");
  if (config.data.source == DataSource::fashion_mnist && config.data.path.size() > 1) {
    fail("data.path", "must be one directory when data.source = \"fashion_mnist\"");
  }

  const OptimizerSection& opt = config.optimizer;
  if (!(opt.lr > 0) || !std::isfinite(opt.lr))
    fail("optimizer.lr", "must be positive, got ", opt.lr);
  if (!(opt.momentum >= 0 && opt.momentum < 1)) {
    fail("optimizer.momentum", "must be in [0, 1), got ", opt.momentum);
  }
  for (double beta : {opt.betas.first, opt.betas.second}) {
    if (!(beta >= 0 && beta < 1)) fail("optimizer.betas", "must each be in [0, 1), got ", beta);
  }
  if (!(opt.eps > 0)) fail("optimizer.eps", "must be positive, got ", opt.eps);
  if (!(opt.weight_decay >= 0)) {
    fail("optimizer.weight_decay", "must be non-negative, got ", opt.weight_decay);
  }
  if (!(opt.clip_norm >= 0))
    fail("optimizer.clip_norm", "must be non-negative, got ", opt.clip_norm);
  if (opt.warmup_steps < 0) fail("optimizer.warmup_steps", "must be non-negative");
  if (!(opt.min_lr >= 0 && opt.min_lr <= opt.lr)) {
    fail("optimizer.min_lr", "must be in [0, optimizer.lr = ", opt.lr, "], got ", opt.min_lr);
  }
  if (opt.zero_stage != 0 && opt.zero_stage != 1) {
    fail("optimizer.zero_stage", "must be 0 or 1, got ", opt.zero_stage);
  }

  const TrainSection& train = config.train;
  // Neither is fine until the run trains (training_steps says so then): planning does not
  // need a training length.
  if (train.epochs && train.steps) {
    fail("train.steps", "and train.epochs are both set: give exactly one of them");
  }
  if (train.epochs && *train.epochs < 1) fail("train.epochs", "must be at least 1");
  if (train.steps && *train.steps < 1) fail("train.steps", "must be at least 1");
  if (train.log_every < 1) fail("train.log_every", "must be at least 1");
  if (train.eval_every < 0) fail("train.eval_every", "must be non-negative");
  if (train.accumulation_steps < 1) fail("train.accumulation_steps", "must be at least 1");
  if (train.early_stopping < 0) fail("train.early_stopping", "must be non-negative (0: off)");
  if (train.early_stopping > 0 && train.eval_every == 0) {
    fail("train.early_stopping", "needs evaluations during the run: set train.eval_every");
  }

  if (config.checkpoint.every_steps < 0) fail("checkpoint.every_steps", "must be non-negative");
  if (config.checkpoint.keep < 1) fail("checkpoint.keep", "must be at least 1");
  if (!(config.runtime.bucket_mb > 0) || !std::isfinite(config.runtime.bucket_mb)) {
    fail("runtime.bucket_mb", "must be a positive number of MiB, got ", config.runtime.bucket_mb);
  }
  const RuntimeSection& rt = config.runtime;
  if (rt.flight_records < 0 || rt.flight_records > RuntimeSection::kMaxFlightRecords) {
    fail("runtime.flight_records", "must be between 0 (off) and ",
         RuntimeSection::kMaxFlightRecords, ", got ", rt.flight_records);
  }
  if ((rt.trace_first != 0 || rt.trace_last != 0) &&
      (rt.trace_first < 1 || rt.trace_last < rt.trace_first)) {
    fail("runtime.trace_steps", "must be [FIRST, LAST] with 1 <= FIRST <= LAST, got [",
         rt.trace_first, ", ", rt.trace_last, "]");
  }
  check_config_products(config);
}

}  // namespace meshtrain
