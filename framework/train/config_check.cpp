// check_config: the checks of load_config for a RunConfig made in code, the schema's
// (config_schema.hpp) as the TOML reader makes them, naming "section.key" instead of a line;
// and the products of config integers that must fit 64 bits, which both make.

#include <algorithm>
#include <cstring>
#include <string>

#include "base/error.hpp"
#include "framework/train/config_schema.hpp"

namespace meshtrain {

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
  complete_config(config, /*from_file=*/false);
  const RunConfig defaults;
  for (const ConfigKey& key : config_keys()) {
    // A config made in code gives a key when its value is not the default.
    const bool given = !same_value(key, config, defaults);
    const KeyNames names{key.section, /*in_file=*/false};
    const std::optional<KeyProblem> problem = check_key(key, config, given, names);
    if (!problem) continue;
    const std::string full = std::string(key.section) + "." + key.name;
    if (problem->subject.empty()) {
      MESHTRAIN_BAD_INPUT(config.file, ": ", full, " ", problem->message);
    }
    // "partition.rules rule 1: ...", but "partition.logical_axes.batch: ..."
    const bool names_key = problem->subject.compare(0, std::strlen(key.name), key.name) == 0;
    MESHTRAIN_BAD_INPUT(config.file, ": ",
                        names_key ? std::string(key.section) + "." + problem->subject
                                  : full + " " + problem->subject,
                        ": ", problem->message);
  }
  check_config_products(config);
}

}  // namespace meshtrain
