// The run config's entry points: parse_config parses the TOML, applies the --set overrides
// (config_overrides.cpp) and reads every key (config_reader.cpp), all by the schema
// (config_schema.hpp); load_config reads the file.

#include "framework/train/config.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/error.hpp"
#include "framework/train/config_schema.hpp"

namespace meshtrain {
namespace {

// Parses TOML text, turning a syntax error into one sentence with file, line and column.
toml::table parse_toml(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& begin = e.source().begin;
    MESHTRAIN_BAD_INPUT(source, ":", begin.line, ":", begin.column,
                        ": invalid TOML: ", e.description());
  }
}

}  // namespace

int64_t ModelSection::input_width() const {
  if (kind == ModelKind::residual_mlp) return inputs;
  if (kind == ModelKind::dlrm) return bottom.empty() ? 0 : bottom.front();
  return sizes.empty() ? 0 : sizes.front();
}

int64_t ModelSection::output_width() const {
  if (kind == ModelKind::residual_mlp) return outputs;
  if (kind == ModelKind::dlrm) return 1;
  return sizes.empty() ? 0 : sizes.back();
}

ResidualMlpShape ModelSection::residual() const {
  ResidualMlpShape shape;
  shape.inputs = inputs;
  shape.outputs = outputs;
  shape.width = width;
  shape.hidden = hidden;
  shape.depth = depth;
  shape.norm = norm != ModelNorm::none;
  shape.norm_kind = norm == ModelNorm::layernorm ? NormKind::layernorm : NormKind::rmsnorm;
  shape.gated = swiglu;
  shape.moe = moe();
  return shape;
}

DlrmShape ModelSection::dlrm() const {
  DlrmShape shape;
  shape.bottom = bottom;
  shape.top = top;
  shape.tables = tables;
  for (DlrmTable& t : shape.tables) {
    if (t.dim == 0 && !bottom.empty()) t.dim = bottom.back();
  }
  shape.interaction = interaction;
  shape.table_dtype = table_dtype;
  return shape;
}

std::string ModelSection::activation_name() const {
  return swiglu ? "swiglu" : to_string(activation);
}

std::vector<ParameterShape> model_parameter_shapes(const ModelSection& model) {
  if (model.kind == ModelKind::residual_mlp) return residual_mlp_parameter_shapes(model.residual());
  if (model.kind == ModelKind::dlrm) return dlrm_parameter_shapes(model.dlrm());
  return mlp_parameter_shapes(model.sizes, model.moe());
}

std::vector<NormLayerParameters> model_norm_layers(const ModelSection& model) {
  if (model.kind == ModelKind::residual_mlp) return residual_mlp_norm_layers(model.residual());
  return {};
}

std::vector<LinearLayerParameters> model_linear_layers(const ModelSection& model) {
  if (model.kind == ModelKind::residual_mlp) return residual_mlp_linear_layers(model.residual());
  if (model.kind == ModelKind::dlrm) return dlrm_linear_layers(model.dlrm());
  return mlp_linear_layers(model.sizes, model.moe());
}

Mesh MeshSection::resolve(int world_size) const {
  return Mesh::create(axes, world_size, source);
}

RunConfig parse_config(const std::string& text, const std::string& file,
                       const std::vector<std::string>& overrides) {
  toml::table root = parse_toml(text, file);
  std::vector<std::string> notes = apply_overrides(root, overrides, file);
  RunConfig config = read_config(root, file);
  config.notes = std::move(notes);
  return config;
}

int64_t training_steps(const RunConfig& config, int64_t steps_per_epoch) {
  int64_t steps = 0;
  std::string length;
  if (config.train.steps) {
    steps = *config.train.steps;
    length = "train.steps = " + std::to_string(steps);
  } else if (config.train.epochs) {
    length = "train.epochs = " + std::to_string(*config.train.epochs);
    if (__builtin_mul_overflow(*config.train.epochs, steps_per_epoch, &steps)) {
      MESHTRAIN_BAD_INPUT(config.file, ": ", length, " x ", steps_per_epoch,
                          " steps per epoch is too many steps (it overflows 64-bit integers)");
    }
  }
  // Batches are numbered step x train.accumulation_steps + micro-batch.
  int64_t batches = 0;
  if (!length.empty() && __builtin_mul_overflow(steps, config.train.accumulation_steps, &batches)) {
    MESHTRAIN_BAD_INPUT(config.file, ": ", length,
                        " x train.accumulation_steps = ", config.train.accumulation_steps,
                        " is too many micro-batches (it overflows 64-bit integers)");
  }
  if (!length.empty()) return steps;
  MESHTRAIN_BAD_INPUT(config.file,
                      ": [train] needs exactly one of epochs and steps to train, got neither");
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    MESHTRAIN_BAD_INPUT("config file '", path, "' does not exist");
  }
  if (std::filesystem::is_directory(path, ec)) {
    MESHTRAIN_BAD_INPUT("config file '", path, "' is a directory, not a TOML file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) MESHTRAIN_BAD_INPUT("cannot open config file '", path, "': ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) MESHTRAIN_BAD_INPUT("cannot read config file '", path, "': ", std::strerror(errno));
  return parse_config(text.str(), path, overrides);
}

}  // namespace meshtrain
