// config_to_toml: the TOML text of a RunConfig, every key of the schema that has a value, each
// option by its name (framework/core/choices.hpp). Checkpoints store it for runs made in code.

#include <sstream>

#include <toml++/toml.h>

#include "framework/core/choices.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {

std::string config_to_toml(const RunConfig& config) {
  toml::table run{{"name", config.run.name},
                  {"seed", static_cast<int64_t>(config.run.seed)},
                  {"output_dir", config.run.output_dir},
                  {"peak_tflops", config.run.peak_tflops}};
  toml::table mesh;
  for (const auto& [axis, size] : config.mesh.axes) mesh.insert(axis, size);
  toml::array sizes;
  for (int64_t size : config.model.sizes) sizes.push_back(size);
  toml::table model{{"kind", to_string(config.model.kind)},
                    {"activation", config.model.activation_name()},
                    {"init", to_string(config.model.init)},
                    {"loss", config.model.loss ? to_string(*config.model.loss) : "auto"}};
  if (config.model.dropout > 0) model.insert("dropout", config.model.dropout);
  if (config.model.kind == ModelKind::residual_mlp) {
    model.insert("inputs", config.model.inputs);
    model.insert("outputs", config.model.outputs);
    model.insert("width", config.model.width);
    model.insert("hidden", config.model.hidden);
    model.insert("depth", config.model.depth);
    model.insert("norm", to_string(config.model.norm));
  } else {
    model.insert("sizes", sizes);
  }
  if (!config.model.moe_layers.empty()) {
    toml::array moe_layers;
    for (int64_t layer : config.model.moe_layers) moe_layers.push_back(layer);
    model.insert("moe_layers", moe_layers);
    model.insert("experts", config.model.experts);
    model.insert("top_k", config.model.top_k);
    model.insert("aux_loss_coef", config.model.aux_loss_coef);
  }
  toml::array rules;
  for (const PartitionRuleText& rule : config.partition.rules) {
    rules.push_back(toml::array{rule.pattern, rule.spec.to_string()});
  }
  toml::table logical_axes;
  for (const auto& [name, axes] : config.partition.logical_axes) {
    toml::array mesh_axes;
    for (const std::string& axis : axes) mesh_axes.push_back(axis);
    logical_axes.insert(name, mesh_axes);
  }
  toml::table partition{{"min_sharding_size", config.partition.min_sharding_size},
                        {"rules", rules},
                        {"logical_axes", logical_axes},
                        {"collective_matmul", to_string(config.partition.collective_matmul)}};
  if (!config.partition.preset.empty()) partition.insert("preset", config.partition.preset);
  toml::table data{{"source", to_string(config.data.source)},
                   {"batch_size", config.data.batch_size},
                   {"block_rows", config.data.block_rows},
                   {"shuffle_window", config.data.shuffle_window},
                   {"prefetch", config.data.prefetch},
                   {"synthetic_samples", config.data.synthetic_samples}};
  if (config.data.x_key != DataSection{}.x_key) data.insert("x_key", config.data.x_key);
  if (config.data.y_key != DataSection{}.y_key) data.insert("y_key", config.data.y_key);
  if (config.data.normalize_inputs != Normalize::none) {
    data.insert("normalize_inputs", to_string(config.data.normalize_inputs));
  }
  if (config.data.normalize_targets != Normalize::none) {
    data.insert("normalize_targets", to_string(config.data.normalize_targets));
  }
  if (config.data.shuffle == ShuffleMode::blocks) {
    data.insert("shuffle", "blocks");
  } else {
    data.insert("shuffle", config.data.shuffle == ShuffleMode::rows);
  }
  const auto paths = [](const std::vector<std::string>& files) {
    toml::array array;
    for (const std::string& file : files) array.push_back(file);
    return array;
  };
  if (config.data.path.size() == 1) data.insert("path", config.data.path.front());
  if (config.data.path.size() > 1) data.insert("path", paths(config.data.path));
  if (config.data.test_path.size() == 1) data.insert("test_path", config.data.test_path.front());
  if (config.data.test_path.size() > 1) data.insert("test_path", paths(config.data.test_path));
  if (config.data.eval_batch_size) data.insert("eval_batch_size", *config.data.eval_batch_size);
  const OptimizerSection& opt = config.optimizer;
  toml::table optimizer{{"kind", to_string(opt.kind)},
                        {"lr", opt.lr},
                        {"momentum", opt.momentum},
                        {"betas", toml::array{opt.betas.first, opt.betas.second}},
                        {"eps", opt.eps},
                        {"weight_decay", opt.weight_decay},
                        {"clip_norm", opt.clip_norm},
                        {"schedule", to_string(opt.schedule)},
                        {"warmup_steps", opt.warmup_steps},
                        {"min_lr", opt.min_lr},
                        {"zero_stage", opt.zero_stage}};
  toml::table train{{"log_every", config.train.log_every},
                    {"eval_every", config.train.eval_every},
                    {"accumulation_steps", config.train.accumulation_steps},
                    {"early_stopping", config.train.early_stopping}};
  if (config.train.epochs) train.insert("epochs", *config.train.epochs);
  if (config.train.steps) train.insert("steps", *config.train.steps);
  toml::table checkpoint{{"every_steps", config.checkpoint.every_steps},
                         {"keep", config.checkpoint.keep},
                         {"resume", config.checkpoint.resume},
                         {"async", config.checkpoint.async},
                         {"dir", config.checkpoint.dir}};
  if (config.checkpoint.keep_best) {
    checkpoint.insert("keep_best", to_string(*config.checkpoint.keep_best));
  }
  if (!config.checkpoint.init_from.empty()) {
    checkpoint.insert("init_from", config.checkpoint.init_from);
  }
  toml::table runtime{{"backend", to_string(config.runtime.backend)},
                      {"matmul_precision", to_string(config.runtime.matmul_precision)},
                      {"overlap", config.runtime.overlap},
                      {"bucket_mb", config.runtime.bucket_mb},
                      {"flight_records", config.runtime.flight_records},
                      {"reductions", to_string(config.runtime.reductions)}};
  if (config.runtime.comm_thread == CommThreadChoice::automatic) {
    runtime.insert("comm_thread", "auto");
  } else {
    runtime.insert("comm_thread", config.runtime.comm_thread == CommThreadChoice::on);
  }
  if (config.runtime.traces()) {
    runtime.insert("trace_steps",
                   toml::array{config.runtime.trace_first, config.runtime.trace_last});
  }
  toml::table mixed_precision{{"param_dtype", to_string(config.mixed_precision.param_dtype)},
                              {"reduce_dtype", to_string(config.mixed_precision.reduce_dtype)}};
  toml::table root{{"run", run},         {"mesh", mesh},
                   {"model", model},     {"partition", partition},
                   {"data", data},       {"optimizer", optimizer},
                   {"train", train},     {"checkpoint", checkpoint},
                   {"runtime", runtime}, {"mixed_precision", mixed_precision}};
  std::ostringstream out;
  out << root;
  return out.str();
}

}  // namespace meshtrain
