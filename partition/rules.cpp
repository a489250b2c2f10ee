#include "partition/rules.hpp"

#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {

namespace {

PartitionRule preset_rule(const std::string& pattern, const std::string& spec) {
  return PartitionRule{pattern, PartitionSpec::parse(spec), true};
}

}  // namespace

const char* const kDlrmTablePattern = "^embeddings/[^/]+/weight$";

std::string dlrm_table_spec(const std::vector<std::string>& table_axes) {
  if (table_axes.empty()) return "P()";
  if (table_axes.size() == 1) return "P(" + table_axes[0] + ", None)";
  return "P((" + join(table_axes) + "), None)";
}

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = {"dp",    "fsdp",    "tp",         "fsdp_tp",
                                                 "dp_tp", "dp_fsdp", "replicated", "dlrm"};
  return names;
}

std::vector<PartitionRule> preset_rules(const std::string& preset, bool moe, bool norms,
                                        bool residual, const std::vector<std::string>& table_axes) {
  // Weights are [in, out] (y = x W + b). A norm's scale [width] (layers/norm.hpp) is stored
  // like a bias (its bias matches "bias$"): under tp split like the features it scales.
  // Data-parallel axes never shard parameters: dp
  // replicates them, so "dp_x" shards like "x" and the batch is split over dp as well.
  std::vector<PartitionRule> rules;
  // MoE layers (partition/moe_layout.hpp): experts [E, in, out] and [E, out] split over ep
  // on dim 0, the rest as the dense weight and bias; the router replicated. Experts that
  // do not divide by ep are an error, not replicated. An MoE block's feed-forward experts
  // (experts/up, experts/gate, experts/down: [E, in, out] and [E, out] each) alike.
  auto experts = [&rules, moe](const std::string& weight, const std::string& bias) {
    if (!moe) return;
    rules.push_back(preset_rule("router/weight$", "P()"));
    rules.push_back(preset_rule("experts/((up|gate|down)/)?weight$", "P(ep, " + weight + ")"));
    rules.push_back(preset_rule("experts/((up|gate|down)/)?bias$", "P(ep, " + bias + ")"));
    rules[rules.size() - 2].replicate_if_indivisible = false;
  };
  // residual_mlp under tp: the blocks' up (and gate) projections column-parallel, their
  // biases split like their output columns; down falls to the row-parallel "weight$" rule.
  auto column_parallel = [&rules](const std::string& weight) {
    rules.push_back(preset_rule("blocks/[0-9]+/(up|gate)/weight$", weight));
    rules.push_back(preset_rule("blocks/[0-9]+/(up|gate)/bias$", "P(tp)"));
  };
  if (preset == "dlrm") {
    // A fixed plan in the spirit of TorchRec's row-wise sharding: every embedding table
    // row-wise over the batch axes (min_sharding_size keeps the small ones replicated, the
    // replicate fallback those whose rows do not divide the axes' whole product: with
    // P((fsdp, dp), None), rows that divide by fsdp but not by fsdp * dp are replicated, not
    // split over fsdp alone), every dense layer data-parallel (the catch-all below).
    rules.push_back(preset_rule(kDlrmTablePattern, dlrm_table_spec(table_axes)));
  } else if (preset == "dp" || preset == "replicated") {
    experts("None, None", "None");
  } else if (preset == "fsdp" || preset == "dp_fsdp") {
    experts("fsdp, None", "fsdp");
    rules.push_back(preset_rule("weight$", "P(fsdp, None)"));
    rules.push_back(preset_rule("bias$", "P(fsdp)"));
    if (norms) rules.push_back(preset_rule("scale$", "P(fsdp)"));
  } else if (preset == "tp" || preset == "dp_tp") {
    experts("tp, None", "tp");
    if (residual) column_parallel("P(None, tp)");
    rules.push_back(preset_rule("weight$", "P(tp, None)"));
    rules.push_back(preset_rule("bias$", "P(tp)"));
    if (norms) rules.push_back(preset_rule("scale$", "P(tp)"));
  } else if (preset == "fsdp_tp") {
    experts("tp, fsdp", "tp");
    if (residual) column_parallel("P(fsdp, tp)");
    rules.push_back(preset_rule("weight$", "P(tp, fsdp)"));
    rules.push_back(preset_rule("bias$", "P(tp)"));
    if (norms) rules.push_back(preset_rule("scale$", "P(tp)"));
  } else {
    MESHTRAIN_BAD_INPUT("unknown partition preset '", preset,
                        "' (known presets: ", join(preset_names()), ")");
  }
  rules.push_back(preset_rule(".*", "P()"));
  return rules;
}

std::vector<std::regex> compile_rules(const std::vector<PartitionRule>& rules) {
  std::vector<std::regex> compiled;
  compiled.reserve(rules.size());
  for (size_t i = 0; i < rules.size(); ++i) {
    try {
      compiled.emplace_back(rules[i].pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      MESHTRAIN_BAD_INPUT("partition rule ", i, " has an invalid regex '", rules[i].pattern,
                          "': ", e.what());
    }
  }
  return compiled;
}

int first_matching_rule(const std::vector<std::regex>& compiled, const std::string& name) {
  for (size_t i = 0; i < compiled.size(); ++i) {
    if (std::regex_search(name, compiled[i])) return static_cast<int>(i);
  }
  return -1;
}

std::string describe_rule(const std::vector<PartitionRule>& rules, int index) {
  const PartitionRule& rule = rules.at(static_cast<size_t>(index));
  std::ostringstream out;
  out << "rule " << index << " '" << rule.pattern << "' -> " << rule.spec.to_string();
  return out.str();
}

std::string describe_rules(const std::vector<PartitionRule>& rules) {
  if (rules.empty()) return "(no rules)";
  std::string out;
  for (size_t i = 0; i < rules.size(); ++i) {
    out += (i ? "; " : "") + describe_rule(rules, static_cast<int>(i));
  }
  return out;
}

}  // namespace meshtrain
