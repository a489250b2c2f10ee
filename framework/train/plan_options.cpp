// What a run config means for the planner: its partition rules and PlanOptions. Apart from
// config.cpp because it asks the optimizer (a Kokkos header) which slots it allocates, and
// config.cpp, the TOML reader, is compiled by the host compiler alone in CUDA builds.

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/train/config.hpp"
#include "framework/train/optimizer.hpp"
#include "partition/linear_layout.hpp"
#include "partition/logical_axes.hpp"

namespace meshtrain {

namespace {

// The layers' axes under the config's partition.logical_axes (what the planner and the preset
// both read).
LayerAxes config_layer_axes(const RunConfig& config) {
  return layer_axes(LogicalAxes::with_overrides(config.partition.logical_axes),
                    config.model.moe().any());
}

// The "dlrm" preset's table axes: the layers' batch axes (partition.logical_axes.batch, then the
// `sequence` axes that layer_axes appends: every layer splits the batch over them too) that the
// config's [mesh] names with a size other than 1 (-1 included: it may take several ranks, and
// at world 1 it leaves a size-1 axis in the rule), in that order. An axis of size 1 splits
// nothing and would only lengthen the rule.
std::vector<std::string> dlrm_table_axes(const RunConfig& config) {
  const LayerAxes axes = config_layer_axes(config);
  std::vector<std::string> out;
  for (const std::string& axis : axes.batch) {
    for (const auto& [name, size] : config.mesh.axes) {
      if (name == axis && size != 1) out.push_back(axis);
    }
  }
  return out;
}

}  // namespace

std::vector<PartitionRule> partition_rules(const RunConfig& config) {
  std::vector<PartitionRule> rules;
  for (const PartitionRuleText& rule : config.partition.rules) {
    rules.push_back(PartitionRule{rule.pattern, rule.spec, false});
  }
  if (!config.partition.preset.empty()) {
    for (PartitionRule& rule :
         preset_rules(config.partition.preset, config.model.moe().any(), config.model.has_norms(),
                      config.model.kind == ModelKind::residual_mlp, dlrm_table_axes(config)))
      rules.push_back(std::move(rule));
  }
  if (rules.empty()) {
    MESHTRAIN_BAD_INPUT(
        config.file, ": [partition] has neither a preset nor rules; set preset = ", "\"dp\" (or ",
        join(preset_names(), ", "), ") or rules = [[regex, spec], ...]");
  }
  return rules;
}

PlanOptions plan_options(const RunConfig& config) {
  PlanOptions options;
  options.min_sharding_size = config.partition.min_sharding_size;
  options.bytes_per_element = 4;
  options.table_bytes_per_element = config.model.kind == ModelKind::dlrm
                                        ? static_cast<int64_t>(bytes_of(config.model.table_dtype))
                                        : 4;
  // The slots the optimizer allocates, from the one function that decides them.
  OptimizerSettings settings;
  settings.kind = config.optimizer.kind;
  settings.momentum = static_cast<float>(config.optimizer.momentum);
  options.optimizer_slots = static_cast<int>(optimizer_slot_names(settings).size());
  options.zero_stage = static_cast<int>(config.optimizer.zero_stage);
  options.sparse_tables = config.model.kind == ModelKind::dlrm &&
                          config.optimizer.embeddings != EmbeddingOptimizer::dense;
  const LayerAxes axes = config_layer_axes(config);
  options.batch_axes = axes.batch;
  options.feature_axis = axes.feature;
  options.global_batch = config.data.batch_size;
  options.accumulation_steps = config.train.accumulation_steps;
  options.overlap = config.runtime.overlap;
  // A DLRM buckets its linear layers' gradients whatever runtime.overlap says (layers/dlrm.cpp).
  if (config.model.kind == ModelKind::dlrm) options.gradient_bucket_mb = config.runtime.bucket_mb;
  options.eval_global_batch = config.data.eval_batch_size.value_or(0);
  options.precision = config.mixed_precision.policy();
  options.activation = config.model.activation_name();
  options.dropout = config.model.dropout;
  return options;
}

}  // namespace meshtrain
