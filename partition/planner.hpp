#pragma once
// The planner (DESIGN.md section 5): model shapes + mesh + rules -> for every parameter
// the matched rule, final spec, local shape and bytes per rank, and the totals per rank.
// Pure arithmetic on shapes (no per-rank loops), so a 4096-rank plan is instant.

#include <cstdint>
#include <string>
#include <vector>

#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "partition/rules.hpp"

namespace meshtrain {

struct ParameterShape {
  std::string name;
  std::vector<int64_t> shape;
};

// The MLP's parameters: layers/<i>/weight [in, out] and layers/<i>/bias [out], i = 0..n-2,
// weight before bias. Throws bad_input for fewer than two sizes or a size below 1.
std::vector<ParameterShape> mlp_parameter_shapes(const std::vector<int64_t>& sizes);

struct PlanOptions {
  int64_t min_sharding_size = 16384;  // reference default: smaller tensors are replicated
  int64_t bytes_per_element = 4;      // float32
  int optimizer_slots = 2;            // AdamW m and v
};

struct ParameterPlan {
  std::string name;
  std::vector<int64_t> shape;        // global
  int rule = -1;                     // index of the matched rule; -1 for scalars
  PartitionSpec spec;                // final spec (after replication/trim/fallback)
  std::vector<int64_t> local_shape;  // per rank
  int64_t bytes_per_rank = 0;
  std::vector<std::string> notes;  // why replicated / trimmed / fallback
  int64_t replicas = 1;            // ranks holding each block (world / split product)
};

struct PlanTotals {  // bytes per rank
  int64_t parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  int64_t global_parameter_bytes = 0;  // unsharded model size
};

struct ShardingPlan {
  Mesh mesh;
  std::vector<ParameterPlan> parameters;  // in input order
  PlanTotals totals;
  std::vector<int> unused_rules;  // indices of rules that gave the spec of no parameter
  const ParameterPlan& find(const std::string& name) const;  // throws bad_input if absent
};

// Applies the rules in order (DESIGN.md section 5):
// 1. a scalar is replicated (rule -1);
// 2. the first rule whose regex is found in the name gives the spec; none: bad_input
//    naming the parameter and listing the rules;
// 3. fewer elements than min_sharding_size: replicated (noted);
// 4. a spec longer than the rank is trimmed (noted);
// then a dim that does not divide by its axis product is bad_input naming parameter, dim,
// size and product, or replicated with a note when the rule has replicate_if_indivisible.
// Also bad_input: an invalid regex (all checked up front, naming index and pattern), a
// spec axis the mesh lacks or an axis repeated in a spec (naming parameter and rule),
// duplicate parameter names, negative sizes, and nonsensical options.
ShardingPlan make_plan(const std::vector<ParameterShape>& parameters, const Mesh& mesh,
                       const std::vector<PartitionRule>& rules, const PlanOptions& options);

// format_shape ("[784, 512]") is declared in partition_spec.hpp.
// "512 B", "1.50 KiB", "3.06 MiB", "2.00 GiB" (binary units).
std::string format_bytes(int64_t bytes);

}  // namespace meshtrain
