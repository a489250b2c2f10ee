#pragma once
// Logical axes (docs/design.md, "Partition rules", `PartitionAxis` in the reference): model-level
// axis names mapped onto mesh axes, so layers say "this dim is the batch" and the config says which
// mesh axes the batch is split over.
//
// Defaults: batch -> (fsdp, dp), sequence / query_sequence / key_sequence -> sp,
// hidden / mlp_intermediate / head / vocab -> tp, expert -> ep, and attention_dim /
// expert_gate -> not split.

#include <map>
#include <string>
#include <vector>

#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

struct LogicalAxes {
  // logical name -> mesh axes (major to minor); empty = not split.
  std::map<std::string, std::vector<std::string>> mapping;

  LogicalAxes();  // the defaults above

  // The defaults with `overrides` applied. Throws bad_input naming `source` and the key for
  // an unknown logical name, an unknown mesh axis, or a mesh axis listed twice.
  static LogicalAxes with_overrides(
      const std::map<std::string, std::vector<std::string>>& overrides,
      const std::string& source = "[partition.logical_axes]");

  // Logical names known, in a stable order.
  static const std::vector<std::string>& names();

  // Mesh axes of `logical`; throws bad_input for an unknown logical name.
  std::vector<std::string> axes_of(const std::string& logical) const;

  // A spec with one entry per logical dim ("" or "None" = not split). Throws bad_input for
  // unknown names and when two dims would use the same mesh axis.
  PartitionSpec spec(const std::vector<std::string>& logical_dims) const;
};

}  // namespace meshtrain
