#include "partition/planner.hpp"
#include "partition/zero1_layout.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "base/error.hpp"
#include "base/text.hpp"
#include "partition/embedding_layout.hpp"

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
  if (options.global_batch < 0) {
    MESHTRAIN_BAD_INPUT("the global batch must be 0 (unknown) or more, got ", options.global_batch);
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

int64_t checked_mul(int64_t a, int64_t b);

// A table-wise entry (axis@table, docs/recsys.md) only on an embedding table's rows: the
// parameter embeddings/<t>/weight [rows, dim], the entry first, no other split, a pinned member
// inside the axis group. bad_input naming the parameter, the rule and its spec otherwise.
void check_table_wise(const PartitionSpec& spec, const std::vector<int64_t>& shape,
                      const Mesh& mesh, const std::string& parameter,
                      const std::vector<PartitionRule>& rules, int rule) {
  const int d = spec.table_entry();
  if (d < 0) return;
  const auto refuse = [&](const std::string& why) {
    MESHTRAIN_BAD_INPUT("parameter '", parameter, "' matched ", describe_rule(rules, rule),
                        ", whose table-wise placement ", why);
  };
  if (!is_embedding_weight_name(parameter) || shape.size() != 2) {
    refuse(
        "applies to embedding tables only (embeddings/<table>/weight [rows, dim]), not to this " +
        format_shape(shape) + " parameter");
  }
  if (d != 0) {
    refuse("must be on dimension 0 (the rows: P(axis@table)), not on dimension " +
           std::to_string(d));
  }
  for (size_t e = 1; e < spec.size(); ++e) {
    if (!spec.entries[e].is_none()) {
      refuse("cannot be combined with a split of dimension " + std::to_string(e) +
             " (table-wise tables are whole: P(axis@table))");
    }
  }
  const int members = mesh.size_of(spec.entries[0].axes);
  if (spec.entries[0].member >= members) {
    refuse("names member " + std::to_string(spec.entries[0].member) + " of " +
           axis_product_text(spec.entries[0], mesh) + ", which has members 0 to " +
           std::to_string(members - 1));
  }
}

// Places every table-wise tensor not yet placed on one member of its axis group: per group of
// axes, the pinned tensors' bytes count first, then the others in decreasing bytes (input order
// among equals) each go to the least loaded member (the lowest index among equals). Pure
// arithmetic on the plan: the same on every rank.
void place_tables(ShardingPlan& plan, int64_t bytes_per_element) {
  std::map<std::vector<std::string>, std::vector<int64_t>> load;
  std::vector<ParameterPlan*> waiting;
  for (ParameterPlan& p : plan.parameters) {
    const int d = p.spec.table_entry();
    if (d < 0) continue;
    SpecEntry& entry = p.spec.entries[static_cast<size_t>(d)];
    std::vector<int64_t>& members = load[entry.axes];
    members.resize(static_cast<size_t>(plan.mesh.size_of(entry.axes)), 0);
    if (entry.member >= 0) {
      members[static_cast<size_t>(entry.member)] +=
          checked_mul(element_count(p.shape, p.name), bytes_per_element);
      p.notes.push_back("table-wise: whole on member " + std::to_string(entry.member) + " of " +
                        axis_product_text(entry, plan.mesh) + " (pinned by its rule)");
    } else {
      waiting.push_back(&p);
    }
  }
  std::stable_sort(waiting.begin(), waiting.end(),
                   [](const ParameterPlan* a, const ParameterPlan* b) {
                     return element_count(a->shape, a->name) > element_count(b->shape, b->name);
                   });
  for (ParameterPlan* p : waiting) {
    SpecEntry& entry = p->spec.entries[static_cast<size_t>(p->spec.table_entry())];
    std::vector<int64_t>& members = load[entry.axes];
    const auto least = std::min_element(members.begin(), members.end());
    entry.member = static_cast<int>(least - members.begin());
    *least += checked_mul(element_count(p->shape, p->name), bytes_per_element);
    p->notes.push_back("table-wise: whole on member " + std::to_string(entry.member) + " of " +
                       axis_product_text(entry, plan.mesh) + " (balanced by bytes)");
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

// An MoE layer of the chain (partition/moe_layout.hpp): its layout, the stand-in linear
// layout the chain reads (input as given, output replicated), collectives and buffers.
template <typename Lookup>
LayerPlan plan_moe_layer(const ShardingPlan& plan, const LinearLayerParameters& parameters,
                         const Lookup& parameter, const Mesh& mesh, const LayerAxes& axes,
                         FeatureLayout input, bool input_grad, const PlanOptions& options) {
  LayerPlan l;
  l.name = moe_layer_name(parameters.router);
  l.moe = true;
  const bool gated = !parameters.gate_weight.empty();
  const MoeLayout& m = l.moe_layout =
      parameters.down_weight.empty()
          ? decide_moe_layout(
                l.name, parameter(parameters.router, l.name), parameter(parameters.weight, l.name),
                parameter(parameters.bias, l.name), parameters.top_k, mesh, axes, input)
          : decide_moe_feed_forward_layout(
                l.name, parameter(parameters.router, l.name),
                gated ? parameter(parameters.gate_weight, l.name) : LinearParameter{},
                gated ? parameter(parameters.gate_bias, l.name) : LinearParameter{},
                parameter(parameters.weight, l.name), parameter(parameters.bias, l.name),
                parameter(parameters.down_weight, l.name), parameter(parameters.down_bias, l.name),
                parameters.top_k, mesh, axes, input);
  LinearLayout& s = l.layout;
  s.layer = l.name;
  s.in = m.in;
  s.out = m.out;
  s.feature_axis = m.feature_axis;
  s.tp = m.tp;
  s.input_layout = m.input_layout;
  s.in_compute = m.in;
  s.out_local = m.output_width();
  s.split_output = m.splits_output();
  l.compute = describe_moe_layout(m);
  l.collectives = moe_step_collectives(m, mesh, plan.local_batch_rows, input_grad,
                                       options.bytes_per_element, options.precision);
  for (const auto& c : l.collectives) {
    l.collective_bytes_per_step = checked_add(l.collective_bytes_per_step, c.bytes_per_rank);
  }
  l.notes = m.notes;
  l.moe_buffer_bytes = moe_buffer_bytes(m, plan.local_batch_rows, options.precision);
  return l;
}

// Each layer's layout and collectives, chained like Mlp: the first layer's input has all
// features and computes no input gradient; each next input is the previous output.
void plan_layers(ShardingPlan& plan, const std::vector<LinearLayerParameters>& layers,
                 const PlanOptions& options) {
  if (layers.empty()) return;
  const Mesh& mesh = plan.mesh;
  const LayerAxes axes = layer_axes_on(mesh, {options.batch_axes, options.feature_axis});
  if (options.global_batch > 0) {
    // A batch that does not divide is the trainer's error; the plan still answers (for
    // what-if meshes) without the activation collectives, and says why.
    const int shards = mesh.size_of(axes.batch);
    if (options.global_batch % shards == 0) {
      plan.local_batch_rows = options.global_batch / shards;
    } else {
      plan.notes.push_back("global batch " + std::to_string(options.global_batch) +
                           " does not divide by the " + std::to_string(shards) +
                           " batch shards (mesh axes " + join(axes.batch) +
                           "): activation collectives left out");
    }
  }
  auto parameter = [&plan](const std::string& name, const std::string& layer) {
    for (const auto& p : plan.parameters) {
      if (p.name == name) return LinearParameter{p.name, p.shape, p.spec};
    }
    MESHTRAIN_BAD_INPUT("layer '", layer, "' uses parameter '", name,
                        "', which the model does not have");
  };
  FeatureLayout input = FeatureLayout::replicated, previous_input = input;
  bool shared_gather = false;  // layer i-1 and i: a SwiGLU's gate and up sharing one gather
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].same_input_as_previous) input = previous_input;
    previous_input = input;
    // A SwiGLU's gate (i) and up (i + 1) both column-parallel on a split input share one
    // gather (layers/swiglu.hpp): decided as fed a replicated input, their input gradients
    // partial, the gather's collectives charged with the gate.
    const bool pair_starts = !layers[i].moe() && i + 1 < layers.size() &&
                             layers[i + 1].same_input_as_previous && !layers[i + 1].moe();
    bool gate_of_shared_pair = false;
    if (pair_starts) {
      auto decide = [&](size_t k) {
        const std::string name = linear_layer_name(layers[k].weight);
        return decide_linear_layout(name, parameter(layers[k].weight, name),
                                    parameter(layers[k].bias, name), mesh, axes, input);
      };
      gate_of_shared_pair = shares_input_gather(decide(i), decide(i + 1));
      shared_gather = gate_of_shared_pair;
    } else if (!layers[i].same_input_as_previous) {
      shared_gather = false;
    }
    const bool in_shared_pair =
        shared_gather && (gate_of_shared_pair || layers[i].same_input_as_previous);
    if (layers[i].moe()) {
      LayerPlan l = plan_moe_layer(plan, layers[i], parameter, mesh, axes, input, i > 0, options);
      plan.totals.collective_bytes_per_step =
          checked_add(plan.totals.collective_bytes_per_step, l.collective_bytes_per_step);
      plan.totals.moe_buffer_bytes = checked_add(plan.totals.moe_buffer_bytes, l.moe_buffer_bytes);
      input = l.layout.output_layout();  // replicated
      l.output_op = layers[i].output_op;
      l.ends_residual_block = layers[i].ends_residual_block;
      plan.layers.push_back(std::move(l));
      continue;
    }
    LayerPlan l;
    l.name = linear_layer_name(layers[i].weight);
    l.layout = decide_linear_layout(l.name, parameter(layers[i].weight, l.name),
                                    parameter(layers[i].bias, l.name), mesh, axes,
                                    in_shared_pair ? FeatureLayout::replicated : input);
    l.layout.input_grad_partial = in_shared_pair;
    l.compute = describe_linear_layout(l.layout);
    l.collectives = linear_step_collectives(l.layout, mesh, plan.local_batch_rows, i > 0,
                                            options.bytes_per_element, options.precision);
    if (gate_of_shared_pair) {
      // The SwiGLU's one gather before the gate's own collectives, its reduce-scatter after.
      for (LayerCollective& c :
           shared_gather_collectives(l.layout, mesh, plan.local_batch_rows, i > 0,
                                     options.bytes_per_element, options.precision)) {
        if (c.phase == "forward") {
          l.collectives.insert(l.collectives.begin(), std::move(c));
        } else {
          l.collectives.push_back(std::move(c));
        }
      }
    }
    for (const auto& c : l.collectives) {
      l.collective_bytes_per_step = checked_add(l.collective_bytes_per_step, c.bytes_per_rank);
    }
    l.notes = l.layout.notes;
    plan.totals.collective_bytes_per_step =
        checked_add(plan.totals.collective_bytes_per_step, l.collective_bytes_per_step);
    input = l.layout.output_layout();
    l.output_op = layers[i].output_op;
    l.ends_residual_block = layers[i].ends_residual_block;
    plan.layers.push_back(std::move(l));
  }
  const int64_t eval_batch = options.eval_global_batch;
  const int shards = mesh.size_of(axes.batch);
  if (eval_batch > 0 && eval_batch != options.global_batch && eval_batch % shards == 0) {
    const int64_t rows = eval_batch / shards;
    int64_t elements = rows * (plan.layers.front().layout.in + 1);  // inputs and labels
    // Each layer's output: out_local columns (an MoE layer's stand-in: its whole output).
    for (const LayerPlan& l : plan.layers) {
      elements = checked_add(elements, checked_mul(rows, l.layout.out_local));
    }
    plan.totals.evaluation_bytes = checked_mul(elements, options.bytes_per_element);
  }
}

// An MoE layer's experts (dim 0 of its experts' weight or bias) that do not divide by the
// axes splitting them: decide_moe_layout's error, naming the parameter too.
void check_experts_divide(const ParameterPlan& p, int dim, const Mesh& mesh,
                          const std::vector<LinearLayerParameters>& layers) {
  if (dim != 0) return;
  for (const LinearLayerParameters& l : layers) {
    const bool expert = p.name == l.weight || p.name == l.bias || p.name == l.gate_weight ||
                        p.name == l.gate_bias || p.name == l.down_weight || p.name == l.down_bias;
    if (!l.moe() || !expert) continue;
    fail_experts_do_not_divide(p.shape[0], mesh.size_of(p.spec.entries[0].axes),
                               mesh.active_axes(p.spec.entries[0].axes), moe_layer_name(l.router),
                               p.name);
  }
}

// The mesh axes of size > 1 that split nothing (see make_plan), with their notes.
void note_replicated_axes(ShardingPlan& plan, const PlanOptions& options) {
  std::set<std::string> used;
  for (const ParameterPlan& p : plan.parameters) {
    for (const SpecEntry& entry : p.spec.entries) used.insert(entry.axes.begin(), entry.axes.end());
  }
  bool tensor_parallel = false;
  for (const LayerPlan& l : plan.layers) {
    tensor_parallel = tensor_parallel || l.layout.tensor_parallel;
  }
  for (const auto& axis : plan.mesh.axes()) {
    if (axis.size <= 1 || used.count(axis.name) > 0) continue;
    if (std::find(options.batch_axes.begin(), options.batch_axes.end(), axis.name) !=
        options.batch_axes.end()) {
      continue;
    }
    if (tensor_parallel && axis.name == options.feature_axis) continue;
    plan.replicated_axes.push_back(axis.name);
    plan.notes.push_back(replicated_axis_note(axis.name, axis.size));
  }
}

// The residual block a layer ends: "blocks/0/down" -> "blocks/0"; an MoE block's layer is
// named after the block already ("blocks/1").
std::string residual_block_name(const LayerPlan& layer) {
  if (layer.moe) return layer.name;
  const size_t slash = layer.name.rfind('/');
  return slash == std::string::npos ? layer.name : layer.name.substr(0, slash);
}

ParameterPlan& parameter_plan(ShardingPlan& plan, const std::string& name) {
  return const_cast<ParameterPlan&>(static_cast<const ShardingPlan&>(plan).find(name));
}

// A residual model's stream (docs/models.md): the input projection (layer 0) writes it, and
// each block adds its feed-forward's output to its input, so every block must end in the
// feature layout the stream has. Preset rules decide each parameter alone (min_sharding_size
// and an indivisible dim replicate it), which can split the blocks' down projections over the
// feature axis while the input projection stays whole, or the reverse. Under a preset the
// stream follows the blocks' down projections (a model's large tensors): where they leave it
// whole, the input projection is kept whole over the feature axis (its other axes stay); where
// they leave it split, the input projection becomes column-parallel, P(None, feature axis)
// with its bias P(feature axis), which splits its output with no collective. Parameters the
// user's own rules placed are never changed: a mismatch left is refused by
// check_residual_stream, naming the block.
void align_residual_stream(ShardingPlan& plan, const std::vector<LinearLayerParameters>& layers,
                           const std::vector<PartitionRule>& rules, const PlanOptions& options) {
  const std::string& feature = options.feature_axis;
  if (layers.empty() || feature.empty() || !plan.mesh.has_axis(feature) ||
      plan.mesh.axis_size(feature) <= 1) {
    return;
  }
  const bool residual = std::any_of(layers.begin(), layers.end(),
                                    [](const auto& l) { return l.ends_residual_block; });
  if (!residual || layers.front().moe()) return;
  ShardingPlan trial;  // the layers as the specs stand
  trial.mesh = plan.mesh;
  trial.parameters = plan.parameters;
  plan_layers(trial, layers, options);
  const FeatureLayout stream = trial.layers.front().layout.output_layout();
  bool found = false;
  FeatureLayout blocks = stream;  // what the dense blocks' down projections leave
  for (size_t i = 1; i < layers.size(); ++i) {
    if (!layers[i].ends_residual_block || layers[i].moe()) continue;
    const FeatureLayout out = trial.layers[i].layout.output_layout();
    if (found && out != blocks) return;  // the blocks disagree: check_residual_stream says so
    blocks = out;
    found = true;
  }
  if (!found || blocks == stream) return;
  ParameterPlan& weight = parameter_plan(plan, layers.front().weight);
  ParameterPlan& bias = parameter_plan(plan, layers.front().bias);
  auto from_preset = [&rules](const ParameterPlan& p) {
    return p.rule >= 0 && rules[static_cast<size_t>(p.rule)].replicate_if_indivisible;
  };
  if (!from_preset(weight) || !from_preset(bias) || weight.shape.size() != 2) return;
  const std::string why = blocks == FeatureLayout::replicated
                              ? "the residual blocks' down projections leave the stream whole"
                              : "the residual blocks' down projections leave the stream split";
  if (blocks == FeatureLayout::replicated) {
    for (ParameterPlan* p : {&weight, &bias}) {
      PartitionSpec kept = p->spec;
      for (SpecEntry& entry : kept.entries) {
        entry.axes.erase(std::remove(entry.axes.begin(), entry.axes.end(), feature),
                         entry.axes.end());
      }
      if (kept.is_replicated()) kept = PartitionSpec();  // P(), not P(None, None)
      if (kept == p->spec) continue;
      p->notes.push_back("not split over " + feature + ": " + why + " over " + feature +
                         " (one layout for the stream): " + kept.to_string() + " instead of " +
                         p->spec.to_string());
      p->spec = kept;
    }
  } else {
    // The bias keeps its spec: whole (below min_sharding_size) or P(feature axis), a
    // column-parallel layer takes either.
    const PartitionSpec column({SpecEntry{}, SpecEntry{{feature}}});
    if (first_indivisible_dim(weight.shape, column, plan.mesh) >= 0) return;
    weight.notes.push_back("column-parallel " + column.to_string() + ": " + why + " over " +
                           feature + " (one layout for the stream), instead of " +
                           weight.spec.to_string());
    weight.spec = column;
  }
  plan.notes.push_back("residual stream: " + why + " over " + feature + "; " +
                       linear_layer_name(layers.front().weight) + " follows them");
}

// Every residual block ends in the layout its input arrives in (the residual add is
// elementwise); otherwise bad_input naming the block, what both are and what to change.
void check_residual_stream(const ShardingPlan& plan,
                           const std::vector<LinearLayerParameters>& layers,
                           const PlanOptions& options) {
  if (plan.layers.empty()) return;
  FeatureLayout block_input = plan.layers.front().layout.output_layout();
  for (size_t i = 1; i < plan.layers.size(); ++i) {
    const LayerPlan& l = plan.layers[i];
    if (!layers[i].ends_residual_block) continue;
    if (l.layout.output_layout() == block_input) continue;
    MESHTRAIN_BAD_INPUT("residual block '", residual_block_name(l), "': its layers end in ",
                        to_string(l.layout.output_layout()), " features over ",
                        options.feature_axis, " (layer '", l.name, "') but its input arrives ",
                        to_string(block_input), " (as layer '", plan.layers.front().name,
                        "' leaves the stream), and x + f(x) needs one "
                        "layout: split the input projection and the blocks' down projections over ",
                        options.feature_axis,
                        " alike in partition.rules, or lower partition.min_sharding_size (",
                        options.min_sharding_size, ": smaller tensors are replicated)");
  }
}

}  // namespace

std::string replicated_axis_note(const std::string& axis, int size) {
  return "mesh axis '" + axis + "' (size " + std::to_string(size) +
         ") splits no parameter and no batch rows: every " + axis +
         " rank computes the same thing (compute replicated over " + axis + ")";
}

int64_t moe_buffer_bytes(const MoeLayout& m, int64_t rows, const MixedPrecision& precision) {
  if (rows <= 0) return 0;
  constexpr int64_t kFloat = 4;
  constexpr int64_t kRoutedRow = 4 + 4 + 8;         // gate, expert, send position
  constexpr int64_t kReceivedRow = 8 + 4;           // its expert-major row, its local expert
  const int64_t sent = checked_mul(rows, m.top_k);  // A = R*k
  // C = ep * R * min(k, experts per rank): a row's experts are distinct.
  const int64_t capacity = moe_dispatch_capacity(m, rows);
  const int64_t two = checked_mul(capacity, 2);
  // Forward: send buffer, received and expert-major inputs, expert outputs (expert-major and
  // in source order), returned outputs.
  int64_t floats = checked_mul(sent, m.in);
  floats = checked_add(floats, checked_mul(two, m.in));
  floats = checked_add(floats, checked_mul(two, m.out));
  floats = checked_add(floats, checked_mul(sent, m.out));
  // Backward: output gradients to send, the experts' input gradients.
  floats = checked_add(floats, checked_mul(sent, m.out));
  floats = checked_add(floats, checked_mul(capacity, m.in));
  // Routing: logits, probabilities, their gradient.
  floats = checked_add(floats, checked_mul(checked_mul(rows, 3), m.experts));
  // Feed-forward experts: up pre-activations, activations and their gradient (and the gate's
  // pre-activations and gradient) of C rows; the whole output and its gradient under tp.
  if (m.feed_forward()) {
    floats = checked_add(floats, checked_mul(checked_mul(capacity, m.gated ? 5 : 3), m.hidden));
    if (m.splits_output()) floats = checked_add(floats, checked_mul(checked_mul(rows, 2), m.out));
  }
  int64_t bytes = checked_add(checked_mul(floats, kFloat), checked_mul(sent, kRoutedRow));
  bytes = checked_add(bytes, checked_mul(capacity, kReceivedRow));
  // 16-bit dispatches: the communicator's send and receive buffers of C rows of the widest.
  if (precision.param != Dtype::fp32 && m.ep > 1) {
    bytes = checked_add(bytes, checked_mul(checked_mul(capacity, std::max(m.in, m.out)), 2 * 2));
  }
  return bytes;
}

std::vector<LinearLayerParameters> mlp_linear_layers(const std::vector<int64_t>& sizes,
                                                     const MoeSettings& moe) {
  std::vector<LinearLayerParameters> layers;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    const std::string layer = "layers/" + std::to_string(i);
    if (moe.is_moe(static_cast<int64_t>(i))) {
      layers.push_back({moe_experts_weight_name(layer), moe_experts_bias_name(layer),
                        moe_router_name(layer), moe.top_k});
    } else {
      layers.push_back({layer + "/weight", layer + "/bias"});
    }
  }
  if (!layers.empty()) layers.back().output_op = LayerOutputOp::none;
  return layers;
}

std::vector<ParameterShape> mlp_parameter_shapes(const std::vector<int64_t>& sizes,
                                                 const MoeSettings& moe) {
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
    const std::string layer = "layers/" + std::to_string(i);
    if (moe.is_moe(static_cast<int64_t>(i))) {
      shapes.push_back({moe_router_name(layer), {sizes[i], moe.experts}});
      shapes.push_back({moe_experts_weight_name(layer), {moe.experts, sizes[i], sizes[i + 1]}});
      shapes.push_back({moe_experts_bias_name(layer), {moe.experts, sizes[i + 1]}});
      continue;
    }
    shapes.push_back({layer + "/weight", {sizes[i], sizes[i + 1]}});
    shapes.push_back({layer + "/bias", {sizes[i + 1]}});
  }
  return shapes;
}

std::vector<ParameterShape> residual_mlp_parameter_shapes(const ResidualMlpShape& m) {
  const std::pair<const char*, int64_t> sizes[] = {{"inputs", m.inputs},
                                                   {"outputs", m.outputs},
                                                   {"width", m.width},
                                                   {"hidden", m.hidden},
                                                   {"depth", m.depth}};
  for (const auto& [key, value] : sizes) {
    if (value < 1) MESHTRAIN_BAD_INPUT("model.", key, " must be at least 1, got ", value);
  }
  std::vector<ParameterShape> shapes;
  auto linear = [&shapes](const std::string& layer, int64_t in, int64_t out) {
    shapes.push_back({layer + "/weight", {in, out}});
    shapes.push_back({layer + "/bias", {out}});
  };
  auto norm = [&shapes, &m](const std::string& layer) {
    if (!m.norm) return;
    shapes.push_back({layer + "/scale", {m.width}});
    if (m.norm_kind == NormKind::layernorm) shapes.push_back({layer + "/bias", {m.width}});
  };
  for (size_t k = 0; k < m.moe.layers.size(); ++k) {
    const int64_t block = m.moe.layers[k];
    if (block < 0 || block >= m.depth) {
      MESHTRAIN_BAD_INPUT("model.moe_layers entry ", block, " is not a block of a residual_mlp of ",
                          "depth ", m.depth, " (blocks 0 to ", m.depth - 1, ")");
    }
  }
  // An MoE block's projection [E, in, out] and its bias [E, out].
  auto experts = [&shapes, &m](const std::string& layer, int64_t in, int64_t out) {
    shapes.push_back({layer + "/weight", {m.moe.experts, in, out}});
    shapes.push_back({layer + "/bias", {m.moe.experts, out}});
  };
  linear("input", m.inputs, m.width);
  for (int64_t i = 0; i < m.depth; ++i) {
    const std::string block = "blocks/" + std::to_string(i);
    norm(block + "/norm");
    if (m.moe.is_moe(i)) {
      shapes.push_back({moe_router_name(block), {m.width, m.moe.experts}});
      if (m.gated) experts(block + "/experts/gate", m.width, m.hidden);
      experts(block + "/experts/up", m.width, m.hidden);
      experts(block + "/experts/down", m.hidden, m.width);
      continue;
    }
    if (m.gated) linear(block + "/gate", m.width, m.hidden);
    linear(block + "/up", m.width, m.hidden);
    linear(block + "/down", m.hidden, m.width);
  }
  norm("output_norm");
  linear("output", m.width, m.outputs);
  return shapes;
}

std::vector<LinearLayerParameters> residual_mlp_linear_layers(const ResidualMlpShape& m) {
  std::vector<LinearLayerParameters> layers;
  auto linear = [&layers](const std::string& layer, LayerOutputOp op) {
    layers.push_back({layer + "/weight", layer + "/bias"});
    layers.back().output_op = op;
  };
  linear("input", LayerOutputOp::none);
  for (int64_t i = 0; i < m.depth; ++i) {
    const std::string block = "blocks/" + std::to_string(i);
    if (m.moe.is_moe(i)) {
      LinearLayerParameters l;
      l.weight = moe_expert_projection(block, "up", "weight");
      l.bias = moe_expert_projection(block, "up", "bias");
      l.router = moe_router_name(block);
      l.top_k = m.moe.top_k;
      if (m.gated) {
        l.gate_weight = moe_expert_projection(block, "gate", "weight");
        l.gate_bias = moe_expert_projection(block, "gate", "bias");
      }
      l.down_weight = moe_expert_projection(block, "down", "weight");
      l.down_bias = moe_expert_projection(block, "down", "bias");
      l.output_op = LayerOutputOp::none;  // the block's own feed-forward ends in its down
      l.ends_residual_block = true;
      layers.push_back(l);
      continue;
    }
    if (m.gated) {
      linear(block + "/gate", LayerOutputOp::none);  // SwiGLU runs after up, over both
      linear(block + "/up", LayerOutputOp::swiglu);
      layers.back().same_input_as_previous = true;
    } else {
      linear(block + "/up", LayerOutputOp::activation);
    }
    linear(block + "/down", LayerOutputOp::none);
    layers.back().ends_residual_block = true;
  }
  linear("output", LayerOutputOp::none);
  return layers;
}

const ParameterPlan& ShardingPlan::find(const std::string& name) const {
  for (const auto& p : parameters) {
    if (p.name == name) return p;
  }
  MESHTRAIN_BAD_INPUT("the sharding plan has no parameter '", name, "'");
}

std::vector<NormLayerParameters> residual_mlp_norm_layers(const ResidualMlpShape& m) {
  std::vector<NormLayerParameters> norms;
  if (!m.norm) return norms;
  const bool ln = m.norm_kind == NormKind::layernorm;
  auto norm = [&](const std::string& name, size_t after) {
    norms.push_back({name, m.norm_kind, name + "/scale", ln ? name + "/bias" : "", after});
  };
  // Each block's norm reads what the layer before the block leaves: the input projection
  // (layer 0) or the previous block's last layer.
  size_t last = 0;
  for (int64_t i = 0; i < m.depth; ++i) {
    norm("blocks/" + std::to_string(i) + "/norm", last);
    last += m.moe.is_moe(i) ? 1 : m.gated ? 3 : 2;  // the experts, or (gate,) up, down
  }
  norm("output_norm", last);
  return norms;
}

// Each norm's layout and collectives (the layers are planned: their output layouts are known).
void plan_norms(ShardingPlan& plan, const std::vector<NormLayerParameters>& norms,
                const PlanOptions& options) {
  const LayerAxes axes = layer_axes_on(plan.mesh, {options.batch_axes, options.feature_axis});
  for (const NormLayerParameters& n : norms) {
    MESHTRAIN_REQUIRE(n.after < plan.layers.size(), "norm '", n.name, "' after layer ", n.after,
                      " of ", plan.layers.size());
    std::vector<LinearParameter> params;
    for (const std::string& name : {n.scale, n.bias}) {
      if (name.empty()) continue;
      const ParameterPlan& p = plan.find(name);
      params.push_back(LinearParameter{p.name, p.shape, p.spec});
    }
    NormPlan np;
    np.name = n.name;
    np.after = n.after;
    np.layout = decide_norm_layout(n.name, n.kind, params, plan.mesh, axes,
                                   plan.layers[n.after].layout.output_layout());
    np.compute = describe_norm_layout(np.layout);
    np.collectives = norm_step_collectives(np.layout, plan.mesh, plan.local_batch_rows, true,
                                           options.bytes_per_element, options.precision);
    for (const auto& c : np.collectives) {
      np.collective_bytes_per_step = checked_add(np.collective_bytes_per_step, c.bytes_per_rank);
    }
    plan.totals.collective_bytes_per_step =
        checked_add(plan.totals.collective_bytes_per_step, np.collective_bytes_per_step);
    plan.norms.push_back(std::move(np));
  }
}

ShardingPlan make_plan(const std::vector<ParameterShape>& parameters, const Mesh& mesh,
                       const std::vector<PartitionRule>& rules, const PlanOptions& options,
                       const std::vector<LinearLayerParameters>& layers,
                       const std::vector<NormLayerParameters>& norms) {
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
      check_table_wise(rule.spec, p.shape, mesh, p.name, rules, p.rule);
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
          check_experts_divide(p, d, mesh, layers);
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
    plan.parameters.push_back(std::move(p));
  }
  // Under preset rules a residual model's stream keeps one layout (may change the input
  // projection's specs; before the local shapes and bytes are counted).
  align_residual_stream(plan, layers, rules, options);
  // Table-wise tensors onto members of their axes (balanced by bytes).
  place_tables(plan, options.table_bytes_per_element);
  // Table-wise tensors' bytes per member of each group of axes: the totals count the most
  // loaded member of each group (a rank's worst case; the others hold less).
  std::map<std::vector<std::string>, std::vector<int64_t>> table_load;
  for (ParameterPlan& p : plan.parameters) {
    const int64_t elements = element_count(p.shape, p.name);
    // Local shape and replication, without touching individual ranks.
    p.local_shape = p.shape;
    int64_t split = 1;
    for (size_t d = 0; d < p.spec.size(); ++d) {
      if (p.spec.entries[d].is_none()) continue;
      const int64_t k = mesh.size_of(p.spec.entries[d].axes);
      if (p.spec.entries[d].splits()) p.local_shape[d] /= k;
      split *= k;  // table-wise: one member of k holds it
    }
    p.replicas = mesh.world_size() / split;
    int64_t local_elements = 1;
    for (int64_t size : p.local_shape) local_elements *= size;
    // Table-wise: the holder's bytes (its members' ranks; the others hold 0).
    const int64_t element_bytes = is_embedding_weight_name(p.name) ? options.table_bytes_per_element
                                                                   : options.bytes_per_element;
    p.bytes_per_rank = checked_mul(local_elements, element_bytes);

    const int t = p.spec.table_entry();
    if (t >= 0) {
      const SpecEntry& entry = p.spec.entries[static_cast<size_t>(t)];
      std::vector<int64_t>& members = table_load[entry.axes];
      members.resize(static_cast<size_t>(mesh.size_of(entry.axes)), 0);
      members[static_cast<size_t>(entry.member)] += p.bytes_per_rank;
    } else {
      plan.totals.parameter_bytes = checked_add(plan.totals.parameter_bytes, p.bytes_per_rank);
    }
    plan.totals.global_parameter_bytes =
        checked_add(plan.totals.global_parameter_bytes, checked_mul(elements, element_bytes));
  }
  for (const auto& group : table_load) {
    plan.totals.parameter_bytes = checked_add(
        plan.totals.parameter_bytes, *std::max_element(group.second.begin(), group.second.end()));
  }
  plan.totals.gradient_bytes = plan.totals.parameter_bytes;
  plan.totals.optimizer_bytes = checked_mul(plan.totals.parameter_bytes, options.optimizer_slots);
  if (options.zero_stage == 1) {
    // ZeRO-1: the state of dp rank 0 (the largest chunk) of each tensor replicated over dp.
    const int64_t dp = mesh.has_axis(kZeroAxis) ? mesh.size_of({kZeroAxis}) : 1;
    // Table-wise tensors are not split (zero1_splits): the most loaded member of each group,
    // as above, not every table's holder bytes on every rank.
    int64_t state = 0, grad_chunks = 0, send = 0, padded = 0;
    for (const auto& group : table_load) {
      state = checked_add(state, *std::max_element(group.second.begin(), group.second.end()));
    }
    for (const ParameterPlan& p : plan.parameters) {
      if (p.spec.table_entry() >= 0) continue;
      int64_t bytes = p.bytes_per_rank;
      if (zero1_splits(p.local_shape.size(), p.spec, dp) && p.local_shape[0] > 0) {
        const int64_t rows = p.local_shape[0];
        bytes = bytes / rows * zero1_chunk_rows(rows, dp);
        grad_chunks = checked_add(grad_chunks, bytes);
        send = std::max(send, bytes);
        if (rows % dp != 0) padded = std::max(padded, checked_mul(bytes, dp));
      }
      state = checked_add(state, bytes);
    }
    plan.totals.optimizer_bytes = checked_mul(state, options.optimizer_slots);
    if (dp > 1) plan.totals.zero1_buffer_bytes = grad_chunks + send + padded;
    if (dp > 1) plan.notes.push_back("optimizer state split over dp (optimizer.zero_stage = 1)");
  }
  if (options.accumulation_steps > 1) plan.totals.accumulation_bytes = plan.totals.gradient_bytes;
  for (size_t i = 0; i < rules.size(); ++i) {
    if (!used[i]) plan.unused_rules.push_back(static_cast<int>(i));
  }
  plan_layers(plan, layers, options);
  check_residual_stream(plan, layers, options);
  plan_norms(plan, norms, options);
  note_replicated_axes(plan, options);
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
