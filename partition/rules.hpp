#pragma once
// Partition rules (docs/design.md, "Partition rules"): an ordered list of (regex, spec). The first
// rule whose regex is found anywhere in a parameter's '/'-joined name gives its spec.

#include <regex>
#include <string>
#include <vector>

#include "partition/partition_spec.hpp"

namespace meshtrain {

struct PartitionRule {
  std::string pattern;  // ECMAScript regex, searched (not full match)
  PartitionSpec spec;
  bool replicate_if_indivisible = false;  // true for preset rules: a dim that does not divide
                                          // by its axis product is replicated (the plan says
                                          // why) instead of being an error
};

// Rules of a named preset for the MLP: "dp", "fsdp", "tp", "fsdp_tp", "dp_tp", "dp_fsdp"
// (also "replicated"); and "dlrm" for a DLRM (docs/recsys.md, "The dlrm preset"): the tables
// (kDlrmTablePattern) row-wise over `table_axes` (dlrm_table_spec), everything else P(). Every
// preset ends with a catch-all `.*` -> P(). Unknown name: bad_input naming it and listing the known
// ones. With `moe`, rules for MoE layers' parameters come first: router/weight P(), experts/weight
// P(ep, <the dense weight's entries>), experts/bias P(ep, <the dense bias's entry>). With `norms`
// (a model with norms, e.g. residual_mlp), "scale$" is stored as "bias$" is (a norm's bias matches
// "bias$"). With `residual` (kind residual_mlp) and a preset that splits over tp (tp, dp_tp,
// fsdp_tp), the blocks' feed-forward is Megatron's pair (docs/partitioning.md): blocks/<i>/up and
// blocks/<i>/gate weights column-parallel, P(None, tp) (fsdp_tp: P(fsdp, tp)), their biases
// P(tp); blocks/<i>/down row-parallel as every other weight, P(tp, None) (fsdp_tp:
// P(tp, fsdp)). One all-gather into and one reduce-scatter out of each block's feed-forward.
// `table_axes` ("dlrm" only): the batch axes the run's mesh has, major to minor.
std::vector<PartitionRule> preset_rules(const std::string& preset, bool moe = false,
                                        bool norms = false, bool residual = false,
                                        const std::vector<std::string>& table_axes = {});

// The "dlrm" preset's table rule: its pattern, and its spec over `table_axes`: "P(fsdp, None)",
// "P((fsdp, dp), None)", or "P()" when there are none.
extern const char* const kDlrmTablePattern;
std::string dlrm_table_spec(const std::vector<std::string>& table_axes);

// The preset names preset_rules() knows, in a stable order.
const std::vector<std::string>& preset_names();

// Compiles every rule's pattern (ECMAScript). Throws bad_input naming the rule's index, its
// pattern and what std::regex objects to, for the first invalid one.
std::vector<std::regex> compile_rules(const std::vector<PartitionRule>& rules);

// Index of the first rule whose compiled pattern is found in `name`, or -1.
int first_matching_rule(const std::vector<std::regex>& compiled, const std::string& name);

// "rule 1 'bias$' -> P(fsdp)"
std::string describe_rule(const std::vector<PartitionRule>& rules, int index);
// Every rule, "; "-separated, or "(no rules)".
std::string describe_rules(const std::vector<PartitionRule>& rules);

}  // namespace meshtrain
