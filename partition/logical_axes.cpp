#include "partition/logical_axes.hpp"

#include <algorithm>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {

LogicalAxes::LogicalAxes()
    : mapping{{"batch", {"fsdp", "dp"}}, {"sequence", {"sp"}}, {"query_sequence", {"sp"}},
              {"key_sequence", {"sp"}},  {"hidden", {"tp"}},   {"mlp_intermediate", {"tp"}},
              {"head", {"tp"}},          {"vocab", {"tp"}},    {"expert", {"ep"}},
              {"expert_gate", {}},       {"attention_dim", {}}} {}

const std::vector<std::string>& LogicalAxes::names() {
  static const std::vector<std::string> names = {
      "batch", "sequence", "query_sequence", "key_sequence", "hidden",       "mlp_intermediate",
      "head",  "vocab",    "expert",         "expert_gate",  "attention_dim"};
  return names;
}

LogicalAxes LogicalAxes::with_overrides(
    const std::map<std::string, std::vector<std::string>>& overrides, const std::string& source) {
  LogicalAxes axes;
  for (const auto& [logical, mesh_axes] : overrides) {
    if (!contains(names(), logical)) {
      MESHTRAIN_BAD_INPUT(source, ": unknown logical axis '", logical,
                          "' (known logical axes: ", join(names()), ")");
    }
    std::vector<std::string> seen;
    for (const auto& axis : mesh_axes) {
      if (!contains(Mesh::known_axes(), axis)) {
        MESHTRAIN_BAD_INPUT(source, ": logical axis '", logical, "' maps to unknown mesh axis '",
                            axis, "' (known mesh axes: ", join(Mesh::known_axes()), ")");
      }
      if (contains(seen, axis)) {
        MESHTRAIN_BAD_INPUT(source, ": logical axis '", logical, "' lists mesh axis '", axis,
                            "' twice");
      }
      seen.push_back(axis);
    }
    axes.mapping[logical] = mesh_axes;
  }
  return axes;
}

std::vector<std::string> LogicalAxes::axes_of(const std::string& logical) const {
  auto it = mapping.find(logical);
  if (it == mapping.end()) {
    MESHTRAIN_BAD_INPUT("unknown logical axis '", logical, "' (known logical axes: ", join(names()),
                        ")");
  }
  return it->second;
}

PartitionSpec LogicalAxes::spec(const std::vector<std::string>& logical_dims) const {
  PartitionSpec spec;
  std::vector<std::string> used;
  for (const auto& logical : logical_dims) {
    SpecEntry entry;
    if (!logical.empty() && logical != "None") entry.axes = axes_of(logical);
    for (const auto& axis : entry.axes) {
      if (contains(used, axis)) {
        MESHTRAIN_BAD_INPUT("logical axes (", join(logical_dims), ") use mesh axis '", axis,
                            "' twice ('", logical, "' maps to it too)");
      }
      used.push_back(axis);
    }
    spec.entries.push_back(entry);
  }
  return spec;
}

}  // namespace meshtrain
