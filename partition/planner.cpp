#include "partition/planner.hpp"

#include <cstdio>
#include <set>

#include "partition/error.hpp"

namespace meshtrain {

namespace {

// Element count of `shape`; bad_input for negative sizes or an int64 overflow.
int64_t element_count(const std::vector<int64_t>& shape, const std::string& name) {
  int64_t n = 1;
  for (int64_t size : shape) {
    if (size < 0) {
      MESHTRAIN_BAD_INPUT("parameter '", name, "' has a negative size in its shape ",
                          format_shape(shape));
    }
    if (__builtin_mul_overflow(n, size, &n)) {
      MESHTRAIN_BAD_INPUT("parameter '", name, "' ", format_shape(shape),
                          " has more elements than fit in 64 bits");
    }
  }
  return n;
}

void check_options(const PlanOptions& options) {
  if (options.min_sharding_size < 0) {
    MESHTRAIN_BAD_INPUT("min_sharding_size must be 0 or more, got ", options.min_sharding_size);
  }
  if (options.bytes_per_element < 1) {
    MESHTRAIN_BAD_INPUT("bytes_per_element must be at least 1, got ", options.bytes_per_element);
  }
  if (options.optimizer_slots < 0) {
    MESHTRAIN_BAD_INPUT("optimizer_slots must be 0 or more, got ", options.optimizer_slots);
  }
}

// The rule's spec must only name axes the mesh has, each once.
void check_rule_axes(const PartitionSpec& spec, const Mesh& mesh, const std::string& parameter,
                     const std::vector<PartitionRule>& rules, int rule) {
  const std::string problem = spec.axes_problem(mesh);
  if (!problem.empty()) {
    MESHTRAIN_BAD_INPUT("parameter '", parameter, "' matched ", describe_rule(rules, rule),
                        ", whose spec ", problem);
  }
}

int64_t checked_add(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) {
    MESHTRAIN_BAD_INPUT("the model's byte count does not fit in 64 bits");
  }
  return sum;
}

int64_t checked_mul(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    MESHTRAIN_BAD_INPUT("the model's byte count does not fit in 64 bits");
  }
  return product;
}

}  // namespace

std::vector<ParameterShape> mlp_parameter_shapes(const std::vector<int64_t>& sizes) {
  if (sizes.size() < 2) {
    MESHTRAIN_BAD_INPUT("model.sizes needs at least two sizes (input and output), got ",
                        sizes.size());
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 1) {
      MESHTRAIN_BAD_INPUT("model.sizes[", i, "] is ", sizes[i], "; every size must be positive");
    }
  }
  std::vector<ParameterShape> shapes;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    const std::string prefix = "layers/" + std::to_string(i) + "/";
    shapes.push_back({prefix + "weight", {sizes[i], sizes[i + 1]}});
    shapes.push_back({prefix + "bias", {sizes[i + 1]}});
  }
  return shapes;
}

const ParameterPlan& ShardingPlan::find(const std::string& name) const {
  for (const auto& p : parameters) {
    if (p.name == name) return p;
  }
  MESHTRAIN_BAD_INPUT("the sharding plan has no parameter '", name, "'");
}

ShardingPlan make_plan(const std::vector<ParameterShape>& parameters, const Mesh& mesh,
                       const std::vector<PartitionRule>& rules, const PlanOptions& options) {
  check_options(options);
  const std::vector<std::regex> compiled = compile_rules(rules);

  ShardingPlan plan;
  plan.mesh = mesh;
  std::vector<bool> used(rules.size(), false);
  std::set<std::string> names;
  for (const auto& parameter : parameters) {
    if (!names.insert(parameter.name).second) {
      MESHTRAIN_BAD_INPUT("parameter '", parameter.name, "' appears twice in the model");
    }
    ParameterPlan p;
    p.name = parameter.name;
    p.shape = parameter.shape;
    const int64_t elements = element_count(p.shape, p.name);

    if (!p.shape.empty()) {
      p.rule = first_matching_rule(compiled, p.name);
      if (p.rule < 0) {
        MESHTRAIN_BAD_INPUT("no partition rule matches parameter '", p.name, "' ",
                            format_shape(p.shape), "; rules: ", describe_rules(rules),
                            " (add a catch-all rule '.*' -> P() to replicate the rest)");
      }
      used[p.rule] = true;
      const PartitionRule& rule = rules[p.rule];
      check_rule_axes(rule.spec, mesh, p.name, rules, p.rule);
      p.spec = rule.spec;

      if (elements < options.min_sharding_size && !p.spec.is_replicated()) {
        p.notes.push_back(std::to_string(elements) + " elements < min_sharding_size " +
                          std::to_string(options.min_sharding_size) + ": replicated instead of " +
                          p.spec.to_string());
        p.spec = PartitionSpec();
      }
      if (p.spec.size() > p.shape.size()) {
        const PartitionSpec trimmed = p.spec.with_rank(p.shape.size());
        p.notes.push_back("spec " + p.spec.to_string() + " is longer than rank " +
                          std::to_string(p.shape.size()) + ": trimmed to " + trimmed.to_string());
        p.spec = trimmed;
      }
      // Each dim that does not divide is an error, or replicated (dims in increasing order).
      for (int d; (d = first_indivisible_dim(p.shape, p.spec, mesh)) >= 0;) {
        if (!rule.replicate_if_indivisible) {
          MESHTRAIN_BAD_INPUT("parameter '", p.name, "' ", format_shape(p.shape), ": ",
                              indivisible_dim_text(p.shape, p.spec, mesh, d), " of ",
                              describe_rule(rules, p.rule));
        }
        SpecEntry& entry = p.spec.entries[static_cast<size_t>(d)];
        p.notes.push_back("dim " + std::to_string(d) + " (" + std::to_string(p.shape[d]) +
                          ") does not divide by " + axis_product_text(entry, mesh) +
                          ": replicated");
        entry.axes.clear();
      }
    }

    // Local shape and replication, without touching individual ranks.
    p.local_shape = p.shape;
    int64_t split = 1;
    for (size_t d = 0; d < p.spec.size(); ++d) {
      if (p.spec.entries[d].is_none()) continue;
      const int64_t k = mesh.size_of(p.spec.entries[d].axes);
      p.local_shape[d] /= k;
      split *= k;
    }
    p.replicas = mesh.world_size() / split;
    int64_t local_elements = 1;
    for (int64_t size : p.local_shape) local_elements *= size;
    p.bytes_per_rank = checked_mul(local_elements, options.bytes_per_element);

    plan.totals.parameter_bytes = checked_add(plan.totals.parameter_bytes, p.bytes_per_rank);
    plan.totals.global_parameter_bytes = checked_add(
        plan.totals.global_parameter_bytes, checked_mul(elements, options.bytes_per_element));
    plan.parameters.push_back(std::move(p));
  }
  plan.totals.gradient_bytes = plan.totals.parameter_bytes;
  plan.totals.optimizer_bytes = checked_mul(plan.totals.parameter_bytes, options.optimizer_slots);
  for (size_t i = 0; i < rules.size(); ++i) {
    if (!used[i]) plan.unused_rules.push_back(static_cast<int>(i));
  }
  return plan;
}

std::string format_bytes(int64_t bytes) {
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024 && bytes > -1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = -1;
  while ((value >= 1024.0 || value <= -1024.0) && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char text[64];
  std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  return text;
}

}  // namespace meshtrain
