#include "partition/moe_layout.hpp"

#include <algorithm>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {
namespace {

// The storage of a parameter seen as [d0, d1, d2] with d0 split over `split_dim0` (the
// expert axes, or none) and the spec entries `entry1`, `entry2` on d1 and d2.
MoeParameterStorage storage(const std::string& name, const std::vector<int64_t>& dims,
                            int split_dim0, const std::vector<std::string>& entry1,
                            const std::vector<std::string>& entry2,
                            const std::vector<std::string>& reduced_batch, const Mesh& mesh,
                            const std::vector<std::string>& batch) {
  MoeParameterStorage s;
  s.name = name;
  s.gather_dim1 = mesh.active_axes(entry1);
  s.gather_dim2 = mesh.active_axes(entry2);
  const int64_t d0 = dims[0] / split_dim0;
  s.compute = {d0, dims[1], dims[2]};
  s.stored = {d0, dims[1] / mesh.size_of(s.gather_dim1), dims[2] / mesh.size_of(s.gather_dim2)};
  for (const auto& a : s.gather()) {
    if (!contains(batch, a)) s.nonbatch_replication *= mesh.axis_size(a);
  }
  for (const auto& a : reduced_batch) {
    if (!contains(s.gather_dim1, a) && !contains(s.gather_dim2, a)) s.allreduce.push_back(a);
  }
  return s;
}

}  // namespace

bool MoeSettings::is_moe(int64_t layer) const {
  return std::count(layers.begin(), layers.end(), layer) > 0;
}

std::vector<std::string> MoeParameterStorage::gather() const {
  std::vector<std::string> axes = gather_dim1;
  axes.insert(axes.end(), gather_dim2.begin(), gather_dim2.end());
  return axes;
}

std::string moe_router_name(const std::string& layer) {
  return layer + "/router/weight";
}
std::string moe_experts_weight_name(const std::string& layer) {
  return layer + "/experts/weight";
}
std::string moe_experts_bias_name(const std::string& layer) {
  return layer + "/experts/bias";
}
std::string moe_layer_name(const std::string& router_name) {
  return router_name.substr(0, router_name.rfind("/router"));
}

MoeLayout decide_moe_layout(const std::string& layer, const LinearParameter& router,
                            const LinearParameter& experts_weight,
                            const LinearParameter& experts_bias, int64_t top_k, const Mesh& mesh,
                            const LayerAxes& requested_axes, FeatureLayout input_layout) {
  const auto& rs = router.shape;
  const auto& ws = experts_weight.shape;
  const auto& bs = experts_bias.shape;
  if (rs.size() != 2 || ws.size() != 3 || bs.size() != 2 || rs[1] != ws[0] || ws[0] != bs[0] ||
      rs[0] != ws[1] || ws[2] != bs[1]) {
    MESHTRAIN_BAD_INPUT("MoE layer '", layer, "' needs '", router.name, "' [in, experts], '",
                        experts_weight.name, "' [experts, in, out] and '", experts_bias.name,
                        "' [experts, out]; got ", format_shape(rs), ", ", format_shape(ws), " and ",
                        format_shape(bs));
  }
  const LayerAxes axes = layer_axes_on(mesh, requested_axes);
  MoeLayout l;
  l.layer = layer;
  l.in = ws[1];
  l.out = ws[2];
  l.experts = ws[0];
  l.top_k = top_k;
  if (top_k < 1 || top_k > l.experts) {
    MESHTRAIN_BAD_INPUT("MoE layer '", layer, "': top_k = ", top_k, " must be between 1 and its ",
                        l.experts, " experts");
  }
  l.batch_axes = mesh.active_axes(axes.batch);
  l.feature_axis = axes.feature;
  l.tp = axes.feature.empty() ? 1 : mesh.axis_size(axes.feature);
  l.input_layout = l.tp > 1 ? input_layout : FeatureLayout::replicated;
  if (l.gathers_input() && l.in % l.tp != 0) {
    MESHTRAIN_BAD_INPUT("MoE layer '", layer, "': its ", l.in,
                        " input features do not split over mesh axis '", l.feature_axis,
                        "' of size ", l.tp);
  }

  const PartitionSpec wspec = experts_weight.spec.with_rank(3);
  const PartitionSpec bspec = experts_bias.spec.with_rank(2);
  const PartitionSpec rspec = router.spec.with_rank(2);
  l.expert_axes = mesh.active_axes(wspec.entries[0].axes);
  const std::vector<std::string> bias_experts = mesh.active_axes(bspec.entries[0].axes);
  if (!bias_experts.empty() && bias_experts != l.expert_axes) {
    MESHTRAIN_BAD_INPUT(
        "MoE layer '", layer, "': '", experts_bias.name, "' splits its experts over ",
        tuple_text(mesh.active_axes(bspec.entries[0].axes)), " but '", experts_weight.name,
        "' over ", tuple_text(l.expert_axes), "; give both the same dim-0 axes");
  }
  for (const auto& a : l.expert_axes) {
    if (!contains(l.batch_axes, a)) {
      MESHTRAIN_BAD_INPUT("MoE layer '", layer, "': '", experts_weight.name,
                          "' splits its experts over mesh axis '", a,
                          "', which does not split the batch; split experts over ep (or "
                          "another batch axis)");
    }
  }
  l.ep = mesh.size_of(l.expert_axes);
  if (l.experts % l.ep != 0) fail_experts_do_not_divide(l.experts, l.ep, l.expert_axes, layer);
  l.experts_local = l.experts / l.ep;

  std::vector<std::string> expert_batch;  // batch axes that do not split the experts
  for (const auto& a : l.batch_axes) {
    if (!contains(l.expert_axes, a)) expert_batch.push_back(a);
  }
  l.router = storage(router.name, {1, l.in, l.experts}, 1, rspec.entries[0].axes,
                     rspec.entries[1].axes, l.batch_axes, mesh, l.batch_axes);
  l.experts_weight =
      storage(experts_weight.name, {l.experts, l.in, l.out}, l.ep, wspec.entries[1].axes,
              wspec.entries[2].axes, expert_batch, mesh, l.batch_axes);
  const bool bias_whole = bias_experts.empty() && l.ep > 1;
  l.experts_bias =
      storage(experts_bias.name, {l.experts, 1, l.out}, bias_whole ? 1 : l.ep, {},
              bspec.entries[1].axes, bias_whole ? l.batch_axes : expert_batch, mesh, l.batch_axes);
  l.experts_bias.all_experts = bias_whole;
  if (l.tp > 1) {
    l.notes.push_back("not tensor parallel: every " + l.feature_axis +
                      " rank computes the whole MoE layer");
  }
  return l;
}

std::vector<const MoeParameterStorage*> MoeLayout::storages() const {
  std::vector<const MoeParameterStorage*> all = {&router};
  if (gated) {
    all.push_back(&experts_gate_weight);
    all.push_back(&experts_gate_bias);
  }
  all.push_back(&experts_weight);
  all.push_back(&experts_bias);
  if (feed_forward()) {
    all.push_back(&experts_down_weight);
    all.push_back(&experts_down_bias);
  }
  return all;
}

std::string moe_expert_projection(const std::string& block, const std::string& projection,
                                  const std::string& what) {
  return block + "/experts/" + projection + "/" + what;
}

MoeLayout decide_moe_feed_forward_layout(
    const std::string& layer, const LinearParameter& router, const LinearParameter& gate_weight,
    const LinearParameter& gate_bias, const LinearParameter& up_weight,
    const LinearParameter& up_bias, const LinearParameter& down_weight,
    const LinearParameter& down_bias, int64_t top_k, const Mesh& mesh,
    const LayerAxes& requested_axes, FeatureLayout input_layout) {
  // Router and up projection as one linear MoE layer in -> hidden, then the rest.
  MoeLayout l = decide_moe_layout(layer, router, up_weight, up_bias, top_k, mesh, requested_axes,
                                  input_layout);
  l.hidden = l.out;
  l.gated = !gate_weight.name.empty();
  const int64_t experts = l.experts, in = l.in, hidden = l.hidden;
  const auto& dw = down_weight.shape;
  const auto& db = down_bias.shape;
  if (dw.size() != 3 || db.size() != 2 || dw[0] != experts || dw[1] != hidden || db[0] != experts ||
      db[1] != dw[2]) {
    MESHTRAIN_BAD_INPUT("MoE block '", layer, "' needs '", down_weight.name, "' [", experts, ", ",
                        hidden, ", out] and '", down_bias.name, "' [", experts, ", out]; got ",
                        format_shape(dw), " and ", format_shape(db));
  }
  l.out = dw[2];
  if (l.gated && (gate_weight.shape != up_weight.shape || gate_bias.shape != up_bias.shape)) {
    MESHTRAIN_BAD_INPUT("MoE block '", layer, "': '", gate_weight.name, "' ",
                        format_shape(gate_weight.shape), " and '", gate_bias.name, "' ",
                        format_shape(gate_bias.shape), " must have the shapes of '", up_weight.name,
                        "' ", format_shape(up_weight.shape), " and '", up_bias.name, "' ",
                        format_shape(up_bias.shape));
  }
  if (l.splits_output() && l.out % l.tp != 0) {
    MESHTRAIN_BAD_INPUT("MoE block '", layer, "': its ", l.out,
                        " output features do not split over mesh axis '", l.feature_axis,
                        "' of size ", l.tp);
  }
  std::vector<std::string> expert_batch;  // batch axes that do not split the experts
  for (const auto& a : l.batch_axes) {
    if (!contains(l.expert_axes, a)) expert_batch.push_back(a);
  }
  // A projection's weight [E, d1, d2] and bias [E, d2], split and reduced as the up
  // projection's (decide_moe_layout).
  auto projection = [&](const LinearParameter& weight, const LinearParameter& bias, int64_t d1,
                        int64_t d2, MoeParameterStorage& w, MoeParameterStorage& b) {
    const PartitionSpec wspec = weight.spec.with_rank(3);
    const PartitionSpec bspec = bias.spec.with_rank(2);
    const std::vector<std::string> weight_experts = mesh.active_axes(wspec.entries[0].axes);
    const std::vector<std::string> bias_experts = mesh.active_axes(bspec.entries[0].axes);
    for (const auto* p : {&weight_experts, &bias_experts}) {
      if (*p == l.expert_axes || (p == &bias_experts && p->empty())) continue;
      MESHTRAIN_BAD_INPUT("MoE block '", layer, "': '",
                          p == &bias_experts ? bias.name : weight.name,
                          "' splits its experts over ", tuple_text(*p), " but '", up_weight.name,
                          "' over ", tuple_text(l.expert_axes), "; give all the same dim-0 axes");
    }
    w = storage(weight.name, {experts, d1, d2}, l.ep, wspec.entries[1].axes, wspec.entries[2].axes,
                expert_batch, mesh, l.batch_axes);
    const bool bias_whole = bias_experts.empty() && l.ep > 1;
    b = storage(bias.name, {experts, 1, d2}, bias_whole ? 1 : l.ep, {}, bspec.entries[1].axes,
                bias_whole ? l.batch_axes : expert_batch, mesh, l.batch_axes);
    b.all_experts = bias_whole;
  };
  if (l.gated) {
    projection(gate_weight, gate_bias, in, hidden, l.experts_gate_weight, l.experts_gate_bias);
  }
  projection(down_weight, down_bias, hidden, l.out, l.experts_down_weight, l.experts_down_bias);
  return l;
}

void fail_experts_do_not_divide(int64_t experts, int ranks, const std::vector<std::string>& axes,
                                const std::string& layer, const std::string& parameter) {
  MESHTRAIN_BAD_INPUT("model.experts = ", experts, " does not divide by the ", ranks,
                      " ranks of the expert axes ", tuple_text(axes), " (layer '", layer, "'",
                      parameter.empty() ? "" : ", parameter '" + parameter + "'", ")");
}

int64_t moe_dispatch_capacity(const MoeLayout& l, int64_t rows) {
  return l.ep * rows * std::min(l.top_k, l.experts_local);
}

std::string describe_moe_layout(const MoeLayout& l) {
  std::ostringstream s;
  s << "MoE in " << l.in;
  if (l.gathers_input()) s << " (split " << l.input_width() << ", gathered)";
  if (l.feed_forward()) {
    s << " -> " << (l.gated ? "swiglu " : "") << "hidden " << l.hidden;
  }
  s << " -> out " << l.out;
  if (l.splits_output()) s << " (split " << l.output_width() << ")";
  s << ", " << l.experts << " experts top-" << l.top_k;
  if (l.ep > 1) {
    s << ", " << l.experts_local << " per rank over " << tuple_text(l.expert_axes)
      << " by all-to-all";
  }
  if (!l.experts_weight.gather().empty()) {
    s << ", experts gathered over " << tuple_text(l.experts_weight.gather());
  }
  if (!l.experts_weight.allreduce.empty()) {
    s << ", expert grads all-reduced over " << tuple_text(l.experts_weight.allreduce);
  }
  if (!l.router.gather().empty()) s << ", router gathered over " << tuple_text(l.router.gather());
  if (!l.router.allreduce.empty()) {
    s << ", router grads all-reduced over " << tuple_text(l.router.allreduce);
  }
  return s.str();
}

std::vector<LayerCollective> moe_step_collectives(const MoeLayout& l, const Mesh& mesh,
                                                  int64_t rows, bool input_grad,
                                                  int64_t bytes_per_element,
                                                  const MixedPrecision& precision) {
  StepCollectives steps(mesh, rows, bytes_per_element);
  const Dtype param = precision.param, reduce = precision.reduce;
  const std::vector<std::string> features =
      l.tp > 1 ? std::vector<std::string>{l.feature_axis} : std::vector<std::string>{};
  auto gather = [&](const char* phase, const char* operand, const MoeParameterStorage& p) {
    steps.add(phase, CollectiveKind::all_gather, operand, p.gather(), p.compute, param);
  };
  auto reduce_gradient = [&](const char* operand, const MoeParameterStorage& p) {
    steps.add("backward", CollectiveKind::reduce_scatter, operand, p.gather(), p.compute, reduce);
    steps.add("backward", CollectiveKind::all_reduce, operand, p.allreduce, p.stored, reduce);
  };
  const bool activations = rows > 0;
  const int64_t assignments = rows * l.top_k;  // (row, expert) pairs a rank dispatches

  if (activations && l.gathers_input()) {
    steps.add("forward", CollectiveKind::all_gather, "input", features, {rows, l.in}, param, 1);
  }
  gather("forward", "router", l.router);
  steps.add("forward", CollectiveKind::all_gather, "expert counts", l.expert_axes,
            {l.ep, l.experts}, Dtype::fp32);
  // The routing statistics of the load-balancing loss: per expert, rows and probability sums
  // (doubles).
  steps.add_bytes("forward", CollectiveKind::all_reduce, "routing statistics", l.batch_axes,
                  {2, l.experts}, 8);
  if (activations) {
    steps.add("forward", CollectiveKind::all_to_all, "dispatched rows", l.expert_axes,
              {assignments, l.in}, param);
  }
  if (l.gated) {
    gather("forward", "expert gate weights", l.experts_gate_weight);
    gather("forward", "expert gate biases", l.experts_gate_bias);
  }
  gather("forward", "expert weights", l.experts_weight);
  gather("forward", "expert biases", l.experts_bias);
  if (l.feed_forward()) {
    gather("forward", "expert down weights", l.experts_down_weight);
    gather("forward", "expert down biases", l.experts_down_bias);
  }
  if (activations) {
    steps.add("forward", CollectiveKind::all_to_all, "expert outputs", l.expert_axes,
              {assignments, l.out}, param);
    if (l.splits_output()) {
      steps.add("backward", CollectiveKind::all_gather, "output gradient", features, {rows, l.out},
                param, 1);
    }
    steps.add("backward", CollectiveKind::all_to_all, "expert output gradients", l.expert_axes,
              {assignments, l.out}, param);
  }
  // Feed-forward experts need the down projection for every gradient below it.
  if (l.feed_forward()) gather("backward", "expert down weights", l.experts_down_weight);
  if (input_grad) {  // only the input gradient needs the weights again
    if (l.gated) gather("backward", "expert gate weights", l.experts_gate_weight);
    gather("backward", "expert weights", l.experts_weight);
    if (activations) {
      steps.add("backward", CollectiveKind::all_to_all, "dispatched row gradients", l.expert_axes,
                {assignments, l.in}, param);
    }
    gather("backward", "router", l.router);
  }
  if (l.feed_forward()) {
    reduce_gradient("expert down weight gradient", l.experts_down_weight);
    reduce_gradient("expert down bias gradient", l.experts_down_bias);
  }
  reduce_gradient("expert weight gradient", l.experts_weight);
  reduce_gradient("expert bias gradient", l.experts_bias);
  if (l.gated) {
    reduce_gradient("expert gate weight gradient", l.experts_gate_weight);
    reduce_gradient("expert gate bias gradient", l.experts_gate_bias);
  }
  reduce_gradient("router gradient", l.router);
  return steps.list;
}

}  // namespace meshtrain
