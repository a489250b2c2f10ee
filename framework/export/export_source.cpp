// What an export reads from a checkpoint (framework/export/export_source.hpp).

#include "framework/export/export_source.hpp"

#include <cmath>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/core/choices.hpp"
#include "partition/dlrm_shape.hpp"

namespace meshtrain {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// The parameters the config's model has, with their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> expected_parameters(
    const ModelSection& model) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  const MoeSettings settings = model.moe();
  for (size_t i = 0; i + 1 < model.sizes.size(); ++i) {
    const std::string p = "layers/" + std::to_string(i);
    const int64_t in = model.sizes[i], out = model.sizes[i + 1];
    if (settings.is_moe(static_cast<int64_t>(i))) {
      expected.push_back({p + "/router/weight", {in, model.experts}});
      expected.push_back({p + "/experts/weight", {model.experts, in, out}});
      expected.push_back({p + "/experts/bias", {model.experts, out}});
    } else {
      expected.push_back({p + "/weight", {in, out}});
      expected.push_back({p + "/bias", {out}});
    }
  }
  return expected;
}

void check_parameters(const ExportSource& s) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  if (s.config.model.kind == ModelKind::residual_mlp) {
    for (const ParameterShape& p : model_parameter_shapes(s.config.model)) {
      expected.push_back({p.name, p.shape});
    }
  } else if (s.config.model.kind == ModelKind::dlrm) {
    for (const ParameterShape& p : dlrm_parameter_shapes(s.config.model.dlrm())) {
      expected.push_back({p.name, p.shape});
    }
  } else {
    expected = expected_parameters(s.config.model);
  }
  std::set<std::string> names;
  for (const auto& [name, shape] : expected) {
    names.insert(name);
    const auto found = s.params.find(name);
    if (found == s.params.end()) {
      MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "' has no parameter '", name,
                          "', which its config's model has (shape ", shape_text(shape), ")");
    }
    if (found->second.shape != shape) {
      MESHTRAIN_BAD_INPUT("parameter '", name, "' has shape ", shape_text(found->second.shape),
                          " in checkpoint '", s.path, "' but ", shape_text(shape),
                          " in its config's model");
    }
  }
  for (const auto& [name, array] : s.params) {
    if (!names.count(name)) {
      MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "' has parameter '", name, "' (shape ",
                          shape_text(array.shape),
                          ") that its config's model does not have (model.kind = \"",
                          to_string(s.config.model.kind), "\")");
    }
  }
}

// Every exported value is finite: a NaN or infinity in a checkpoint is a broken run's.
void check_finite(const ExportSource& s) {
  for (const auto& [name, array] : s.params) {
    for (size_t i = 0; i < array.values.size(); ++i) {
      if (!std::isfinite(array.values[i])) {
        MESHTRAIN_BAD_INPUT("parameter '", name, "' in checkpoint '", s.path,
                            "' holds a non-finite value (", array.values[i], ") at element ", i);
      }
    }
  }
}

void check_normalization(const ExportSource& s) {
  const ModelSection& model = s.config.model;
  const Normalization& n = s.normalization;
  if (model.kind == ModelKind::dlrm && (n.inputs() || n.targets())) {
    // DlrmRun trains without statistics (it refuses [data] normalization), so a DLRM
    // checkpoint holding some was not written by meshtrain as it is.
    MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "' has /normalization statistics, which a ",
                        "model.kind = \"dlrm\" model does not use");
  }
  if (n.inputs() && static_cast<int64_t>(n.input_mean.size()) != model.input_width()) {
    MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "': /normalization/input_mean has ",
                        n.input_mean.size(), " values but the model has ", model.input_width(),
                        " inputs");
  }
  if (n.targets()) {
    if (!model.loss || !is_regression(*model.loss)) {
      MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "' has /normalization/target_mean, but its ",
                          "model is not a regression (model.loss = ",
                          model.loss ? to_string(*model.loss) : std::string("unset"), ")");
    }
    if (static_cast<int64_t>(n.target_mean.size()) != model.output_width()) {
      MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "': /normalization/target_mean has ",
                          n.target_mean.size(), " values but the model has ", model.output_width(),
                          " outputs");
    }
  }
}
}  // namespace

ExportSource read_export_source(const std::string& checkpoint) {
  ExportSource s;
  s.path = resolve_checkpoint_path(checkpoint);
  s.info = list_checkpoint(s.path).info;
  s.config = parse_config(s.info.config_text, "the config stored in checkpoint '" + s.path + "'");
  if (s.config.model.kind != ModelKind::mlp && s.config.model.kind != ModelKind::residual_mlp &&
      s.config.model.kind != ModelKind::dlrm) {
    MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "': export does not support model.kind = \"",
                        to_string(s.config.model.kind), "\"");
  }
  if (!s.config.model.loss) {
    MESHTRAIN_BAD_INPUT("checkpoint '", s.path, "': its config leaves model.loss to \"auto\"; ",
                        "export needs to know whether the model classifies");
  }
  for (auto& array : read_checkpoint_arrays(s.path, "/params")) {
    std::string name = array.name;
    s.params.emplace(std::move(name), std::move(array));
  }
  s.normalization = read_normalization(s.path);
  check_parameters(s);
  check_finite(s);
  check_normalization(s);
  return s;
}

}  // namespace meshtrain
