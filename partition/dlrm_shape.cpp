#include "partition/dlrm_shape.hpp"

#include <set>

#include "base/error.hpp"

namespace meshtrain {

DlrmInteraction parse_dlrm_interaction(const std::string& name, const std::string& key) {
  if (name == "dot") return DlrmInteraction::dot;
  if (name == "cat") return DlrmInteraction::cat;
  MESHTRAIN_BAD_INPUT(key, " = '", name, "' is not an interaction: use 'dot' or 'cat'");
}

const char* to_string(DlrmInteraction interaction) {
  return interaction == DlrmInteraction::dot ? "dot" : "cat";
}

int64_t dlrm_interaction_width(const DlrmShape& shape) {
  const int64_t d = shape.bottom.empty() ? 0 : shape.bottom.back();
  const int64_t tables = static_cast<int64_t>(shape.tables.size());
  if (shape.interaction == DlrmInteraction::dot) return d + tables * (tables + 1) / 2;
  int64_t width = d;
  for (const DlrmTable& t : shape.tables) width += t.dim;
  return width;
}

namespace {
void check_sizes(const std::vector<int64_t>& sizes, const std::string& key) {
  if (sizes.size() < 2) {
    MESHTRAIN_BAD_INPUT(key, " has ", sizes.size(),
                        " sizes; it needs at least two (inputs, ..., outputs)");
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 1) MESHTRAIN_BAD_INPUT(key, "[", i, "] = ", sizes[i], " is not a size >= 1");
  }
}
}  // namespace

void check_dlrm_shape(const DlrmShape& shape, const std::string& where) {
  check_sizes(shape.bottom, where + ".bottom");
  check_sizes(shape.top, where + ".top");
  if (shape.tables.empty()) MESHTRAIN_BAD_INPUT(where, ".tables is empty; dlrm needs a table");
  std::set<std::string> names;
  const int64_t d = shape.bottom.back();
  for (size_t i = 0; i < shape.tables.size(); ++i) {
    const DlrmTable& t = shape.tables[i];
    const std::string key = where + ".tables[" + std::to_string(i) + "]";
    if (t.name.empty() || t.name.find('/') != std::string::npos) {
      MESHTRAIN_BAD_INPUT(key, ".name = '", t.name, "' is not a table name (non-empty, no '/')");
    }
    if (!names.insert(t.name).second) {
      MESHTRAIN_BAD_INPUT(key, ".name = '", t.name, "' names a table twice");
    }
    if (t.rows < 1) MESHTRAIN_BAD_INPUT(key, ".rows = ", t.rows, " is not a size >= 1");
    if (t.dim < 1) MESHTRAIN_BAD_INPUT(key, ".dim = ", t.dim, " is not a size >= 1");
    if (shape.interaction == DlrmInteraction::dot && t.dim != d) {
      MESHTRAIN_BAD_INPUT(key, " '", t.name, "' has dim ", t.dim, " but interaction = 'dot' needs ",
                          "every table's dim equal to bottom's last size, ", d);
    }
  }
  const int64_t width = dlrm_interaction_width(shape);
  if (shape.top.front() != width) {
    MESHTRAIN_BAD_INPUT(where, ".top[0] = ", shape.top.front(), " but interaction = '",
                        to_string(shape.interaction), "' of bottom's ", d, " features and ",
                        shape.tables.size(), " tables gives ", width, " features",
                        shape.interaction == DlrmInteraction::dot
                            ? " (d + T (T + 1) / 2)"
                            : " (bottom's last size plus the tables' dims)");
  }
  if (shape.top.back() != 1) {
    MESHTRAIN_BAD_INPUT(where, ".top ends in ", shape.top.back(),
                        "; dlrm's top MLP ends in 1 (one click logit per row)");
  }
}

std::vector<ParameterShape> dlrm_parameter_shapes(const DlrmShape& shape) {
  std::vector<ParameterShape> shapes;
  auto mlp = [&](const std::string& prefix, const std::vector<int64_t>& sizes) {
    for (size_t i = 0; i + 1 < sizes.size(); ++i) {
      const std::string layer = prefix + "/" + std::to_string(i);
      shapes.push_back({layer + "/weight", {sizes[i], sizes[i + 1]}});
      shapes.push_back({layer + "/bias", {sizes[i + 1]}});
    }
  };
  mlp("bottom", shape.bottom);
  for (const DlrmTable& t : shape.tables) {
    shapes.push_back({embedding_weight_name(t.name), {t.rows, t.dim}});
  }
  mlp("top", shape.top);
  return shapes;
}

std::vector<LinearLayerParameters> dlrm_linear_layers(const DlrmShape& shape) {
  std::vector<LinearLayerParameters> layers;
  for (const char* prefix : {"bottom", "top"}) {
    const std::vector<int64_t>& sizes = std::string(prefix) == "bottom" ? shape.bottom : shape.top;
    for (size_t i = 0; i + 1 < sizes.size(); ++i) {
      const std::string layer = std::string(prefix) + "/" + std::to_string(i);
      layers.push_back({layer + "/weight", layer + "/bias"});
    }
  }
  if (!layers.empty()) layers.back().output_op = LayerOutputOp::none;
  return layers;
}

}  // namespace meshtrain
