#pragma once
// The meshes the multi-rank tests run on, each with the partition preset of its name: dp, fsdp
// and tp over every rank, and fsdp x tp where the world size is even. Tests add their own
// (a 2 x 4 mesh at np 8, dp x tp, sp, ep).

#include <string>
#include <utility>
#include <vector>

#include "partition/linear_layout.hpp"  // FeatureLayout

namespace meshtrain::testing {

using Axes = std::vector<std::pair<std::string, int>>;

struct MeshCase {
  std::string preset;  // partition.preset
  Axes axes;           // mesh.axes
};

// dp, fsdp and tp, each over all n ranks.
inline std::vector<MeshCase> one_axis_meshes(int n) {
  return {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}};
}

// one_axis_meshes, and fsdp (n / 2) x tp 2 where n is even.
inline std::vector<MeshCase> every_mesh(int n) {
  std::vector<MeshCase> cases = one_axis_meshes(n);
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
  return cases;
}

// one_axis_meshes, and at n = 4 fsdp 2 x tp 2 and dp 2 x tp 2 (the layer tests' meshes).
inline std::vector<MeshCase> layer_meshes(int n) {
  std::vector<MeshCase> cases = one_axis_meshes(n);
  if (n == 4) {
    cases.push_back({"fsdp_tp", {{"fsdp", 2}, {"tp", 2}}});
    cases.push_back({"dp_tp", {{"dp", 2}, {"tp", 2}}});
  }
  return cases;
}

// The meshes of the tests of what reads a model's outputs (loss, evaluation metrics), with how
// the outputs arrive: dp, fsdp, tp with the outputs split and replicated over all n ranks, and
// fsdp (n / 2) x tp 2 split where n is even and above 2.
struct OutputMeshCase {
  std::string name;
  Axes axes;
  FeatureLayout layout;
};
inline std::vector<OutputMeshCase> output_meshes(int n) {
  std::vector<OutputMeshCase> cases = {{"dp", {{"dp", n}}, FeatureLayout::replicated},
                                       {"fsdp", {{"fsdp", n}}, FeatureLayout::replicated},
                                       {"tp split", {{"tp", n}}, FeatureLayout::split},
                                       {"tp replicated", {{"tp", n}}, FeatureLayout::replicated}};
  if (n % 2 == 0 && n > 2) {
    cases.push_back({"fsdp x tp split", {{"fsdp", n / 2}, {"tp", 2}}, FeatureLayout::split});
  }
  return cases;
}

// "fsdp_tp fsdp=2 tp=2": for SCOPED_TRACE.
inline std::string describe(const MeshCase& c) {
  std::string name = c.preset;
  for (const auto& [axis, size] : c.axes) name += " " + axis + "=" + std::to_string(size);
  return name;
}

}  // namespace meshtrain::testing
