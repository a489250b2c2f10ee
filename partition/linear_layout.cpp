#include "partition/linear_layout.hpp"

#include <algorithm>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {

const char* to_string(FeatureLayout layout) {
  return layout == FeatureLayout::split ? "split" : "replicated";
}

LayerAxes layer_axes(const LogicalAxes& logical, bool with_experts) {
  const std::vector<std::string> hidden = logical.axes_of("hidden");
  if (hidden.size() > 1) {
    MESHTRAIN_BAD_INPUT("logical axis 'hidden' maps to ", hidden.size(),
                        " mesh axes; the MLP layers split features over at most one");
  }
  LayerAxes axes{logical.axes_of("batch"), hidden.empty() ? "" : hidden[0]};
  const auto append_batch_axes = [&](const std::string& logical_name) {
    for (const std::string& axis : logical.axes_of(logical_name)) {
      if (!contains(axes.batch, axis)) axes.batch.push_back(axis);
    }
  };
  append_batch_axes("sequence");
  if (with_experts) append_batch_axes("expert");
  return axes;
}

LayerAxes layer_axes_on(const Mesh& mesh, LayerAxes axes) {
  std::vector<std::string> present;
  for (const auto& axis : axes.batch) {
    if (mesh.has_axis(axis)) present.push_back(axis);
  }
  axes.batch = present;
  if (!axes.feature.empty() && !mesh.has_axis(axes.feature)) axes.feature.clear();
  if (!axes.feature.empty() && mesh.axis_size(axes.feature) > 1 &&
      contains(axes.batch, axes.feature)) {
    MESHTRAIN_BAD_INPUT("mesh axis '", axes.feature,
                        "' cannot split both the batch and the features");
  }
  return axes;
}

std::string linear_layer_name(const std::string& weight_name) {
  const std::string suffix = "/weight";
  if (weight_name.size() > suffix.size() &&
      weight_name.compare(weight_name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return weight_name.substr(0, weight_name.size() - suffix.size());
  }
  return weight_name;
}

LinearLayout decide_linear_layout(const std::string& layer, const LinearParameter& weight,
                                  const LinearParameter& bias, const Mesh& mesh,
                                  const LayerAxes& requested_axes, FeatureLayout input_layout) {
  if (weight.shape.size() != 2 || bias.shape.size() != 1 || bias.shape[0] != weight.shape[1]) {
    MESHTRAIN_BAD_INPUT(
        "linear layer '", layer, "' needs a weight [in, out] and a bias [out]; got '", weight.name,
        "' of rank ", weight.shape.size(), " and '", bias.name, "' of rank ", bias.shape.size());
  }
  const LayerAxes axes = layer_axes_on(mesh, requested_axes);
  const std::string& feature = axes.feature;
  const std::vector<std::string> batch = mesh.active_axes(axes.batch);

  LinearLayout l;
  l.layer = layer;
  l.in = weight.shape[0];
  l.out = weight.shape[1];
  l.feature_axis = feature;
  l.tp = feature.empty() ? 1 : mesh.axis_size(feature);
  l.input_layout = l.tp > 1 ? input_layout : FeatureLayout::replicated;

  const PartitionSpec wspec = weight.spec.with_rank(2);
  const PartitionSpec bspec = bias.spec.with_rank(1);
  std::vector<std::string> dim0 = mesh.active_axes(wspec.entries[0].axes);
  std::vector<std::string> dim1 = mesh.active_axes(wspec.entries[1].axes);
  l.tensor_parallel = l.tp > 1 && !dim0.empty() && dim0.front() == feature;
  l.column_parallel = l.tp > 1 && !l.tensor_parallel && !contains(dim0, feature) && !dim1.empty() &&
                      dim1.front() == feature;
  if (l.tensor_parallel) dim0.erase(dim0.begin());
  if (l.column_parallel) {
    dim1.erase(dim1.begin());
    if (l.out % l.tp != 0) {
      MESHTRAIN_BAD_INPUT("linear layer '", layer, "': parameter '", weight.name,
                          "' is split over mesh axis '", feature,
                          "' on dim 1 (column-parallel), "
                          "but its ",
                          l.out, " output features do not divide by its size ", l.tp);
    }
  }
  if ((l.tensor_parallel || l.input_layout == FeatureLayout::split) && l.in % l.tp != 0) {
    MESHTRAIN_BAD_INPUT("linear layer '", layer, "': its ", l.in,
                        " input features do not split over mesh axis '", feature, "' of size ",
                        l.tp);
  }
  l.split_output = (l.tensor_parallel && l.out % l.tp == 0) || l.column_parallel;
  l.in_compute = l.tensor_parallel ? l.in / l.tp : l.in;
  l.out_local = l.split_output ? l.out / l.tp : l.out;

  // Weight: storage -> compute block.
  l.weight_gather_dim0 = dim0;
  l.weight_gather_dim1 = dim1;
  l.stored_rows = l.in_compute / mesh.size_of(dim0);
  l.stored_cols = l.compute_cols() / mesh.size_of(dim1);
  for (const auto& gathered : {l.weight_gather_dim0, l.weight_gather_dim1}) {
    for (const auto& a : gathered) {
      if (!contains(axes.batch, a)) l.nonbatch_replication *= mesh.axis_size(a);
    }
  }
  for (const auto& a : batch) {
    if (!contains(dim0, a) && !contains(dim1, a)) l.weight_allreduce.push_back(a);
  }

  // Bias: storage -> compute block.
  const std::vector<std::string> bentry = mesh.active_axes(bspec.entries[0].axes);
  l.bias_stored = l.out / mesh.size_of(bentry);
  if (l.split_output && !bentry.empty() && bentry.front() == feature) {
    l.bias_gather.assign(bentry.begin() + 1, bentry.end());
    l.bias_gather_sliced = true;
  } else {
    l.bias_gather = bentry;
  }
  l.bias_reduce = batch;
  l.bias_direct = l.column_parallel && l.bias_gather_sliced && l.bias_gather.empty();
  if (l.split_output && !l.bias_direct) l.bias_reduce.push_back(feature);

  if (l.tensor_parallel && !l.split_output) {
    l.notes.push_back("output features " + std::to_string(l.out) + " do not divide by " + feature +
                      "=" + std::to_string(l.tp) + ": the layer all-reduces its output over " +
                      feature + " and keeps it replicated");
  }
  if (l.tp > 1 && !l.tensor_parallel && !l.column_parallel) {
    l.notes.push_back("not tensor parallel (the weight's dim 0 is not split over " + feature +
                      " first): every " + feature + " rank computes the whole layer");
  }
  return l;
}

std::string describe_linear_layout(const LinearLayout& l) {
  std::ostringstream s;
  s << (l.tensor_parallel   ? "TP"
        : l.column_parallel ? "column-parallel TP"
                            : "replicated")
    << " in " << l.in;
  if (l.input_layout == FeatureLayout::split) s << " (split " << l.in / l.tp << ")";
  if (l.column_gathers_input()) s << " all-gathered";
  if (l.input_grad_partial) s << " (shares its SwiGLU's one gather)";
  s << " -> out " << l.out;
  if (l.split_output) s << " (split " << l.out_local << ")";
  if (l.tensor_parallel && !l.split_output) {
    s << " (all-reduced, replicated: " << l.out << " % " << l.tp << " != 0)";
  }
  if (!l.weight_gather_dim0.empty()) {
    s << ", weight gathered over " << tuple_text(l.weight_gather_dim0) << " on dim 0";
  }
  if (!l.weight_gather_dim1.empty()) {
    s << ", weight gathered over " << tuple_text(l.weight_gather_dim1) << " on dim 1";
  }
  if (!l.weight_allreduce.empty()) {
    s << ", grads all-reduced over " << tuple_text(l.weight_allreduce);
  }
  return s.str();
}

namespace {

// The collectives of a column-parallel layer (see the top of linear_layout.hpp), in the order
// layers/linear.cpp runs them; `add` records one (nothing for an empty group).
template <typename Add>
void column_parallel_collectives(const LinearLayout& l, const Mesh& mesh, int64_t rows,
                                 bool input_grad, const std::vector<std::string>& features,
                                 Add& add) {
  const bool activations = rows > 0;
  const auto& g0 = l.weight_gather_dim0;
  const auto& g1 = l.weight_gather_dim1;
  const int64_t cols = l.compute_cols();
  auto gather_weight = [&](const char* phase) {
    add(phase, CollectiveKind::all_gather, "weight", g0, std::vector<int64_t>{l.in, l.stored_cols},
        0);
    add(phase, CollectiveKind::all_gather, "weight", g1, std::vector<int64_t>{l.in, cols}, 1);
  };
  // Forward: the weight, the input's feature blocks (inside the all-gather-matmul), the bias.
  gather_weight("forward");
  if (activations && l.column_gathers_input()) {
    add("forward", CollectiveKind::all_gather, "input", features, std::vector<int64_t>{rows, l.in},
        1);
  }
  add("forward", CollectiveKind::all_gather, "bias", l.bias_gather,
      std::vector<int64_t>{l.bias_stored * mesh.size_of(l.bias_gather)}, 0);
  // Backward: the weight again, the input again for dW = X_fullᵀ @ dY, the partial input
  // gradient back over the features, the gradients to storage.
  gather_weight("backward");
  if (activations && l.column_gathers_input()) {
    add("backward", CollectiveKind::all_gather, "input", features, std::vector<int64_t>{rows, l.in},
        1);
  }
  if (activations && input_grad && !l.input_grad_partial) {
    add("backward",
        l.column_gathers_input() ? CollectiveKind::reduce_scatter : CollectiveKind::all_reduce,
        "input gradient", features, std::vector<int64_t>{rows, l.in},
        l.column_gathers_input() ? 1 : 0);
  }
  if (!g0.empty()) {
    add("backward", CollectiveKind::reduce_scatter, "weight gradient", g0,
        std::vector<int64_t>{l.in, cols}, 0);
    add("backward", CollectiveKind::reduce_scatter, "weight gradient", g1,
        std::vector<int64_t>{l.stored_rows, cols}, 1);
  } else {
    add("backward", CollectiveKind::reduce_scatter, "weight gradient", g1,
        std::vector<int64_t>{l.in, cols}, 1);
  }
  add("backward", CollectiveKind::all_reduce, "weight gradient", l.weight_allreduce,
      std::vector<int64_t>{l.stored_rows, l.stored_cols}, 0);
  add("backward", CollectiveKind::all_reduce, "bias gradient", l.bias_reduce,
      std::vector<int64_t>{l.bias_direct ? l.out_local : l.out}, 0);
}

}  // namespace

std::vector<LayerCollective> linear_step_collectives(const LinearLayout& l, const Mesh& mesh,
                                                     int64_t rows, bool input_grad,
                                                     int64_t bytes_per_element,
                                                     const MixedPrecision& precision) {
  StepCollectives steps(mesh, rows, bytes_per_element);
  // Gradients move as the reduction dtype, everything else as the parameters' compute dtype.
  auto add = [&](const char* phase, CollectiveKind kind, const std::string& operand,
                 const std::vector<std::string>& axes, std::vector<int64_t> shape, int dim = 0) {
    const bool gradient = operand == "weight gradient" || operand == "bias gradient";
    steps.add(phase, kind, operand, axes, std::move(shape),
              gradient ? precision.reduce : precision.param, dim);
  };
  const bool activations = rows > 0;
  const std::vector<std::string> features =
      l.tp > 1 ? std::vector<std::string>{l.feature_axis} : std::vector<std::string>{};
  const auto& g0 = l.weight_gather_dim0;
  const auto& g1 = l.weight_gather_dim1;
  if (l.column_parallel) {
    column_parallel_collectives(l, mesh, rows, input_grad, features, add);
    return steps.list;
  }
  auto gather_weight = [&](const char* phase) {
    add(phase, CollectiveKind::all_gather, "weight", g0, {l.in_compute, l.stored_cols});
    add(phase, CollectiveKind::all_gather, "weight", g1, {l.in_compute, l.out}, 1);
  };

  // Forward: the input in its compute layout, the weight, the output, the bias.
  if (activations && l.gathers_input()) {
    add("forward", CollectiveKind::all_gather, "input", features, {rows, l.in}, 1);
  }
  gather_weight("forward");
  if (activations && l.tensor_parallel) {
    add("forward", l.split_output ? CollectiveKind::reduce_scatter : CollectiveKind::all_reduce,
        "output", features, {rows, l.out});
  }
  add("forward", CollectiveKind::all_gather, "bias", l.bias_gather,
      {l.bias_stored * mesh.size_of(l.bias_gather)});

  // Backward: the weight again, dY gathered for the weight gradient (and again for the
  // input gradient), the input gradient back to its layout, the gradients to storage.
  gather_weight("backward");
  if (activations && l.split_output) {
    add("backward", CollectiveKind::all_gather, "output gradient", features, {rows, l.out});
  }
  if (activations && input_grad) {
    if (l.split_output) {
      add("backward", CollectiveKind::all_gather, "output gradient", features, {rows, l.out});
    }
    if (l.slices_input()) {
      add("backward", CollectiveKind::all_gather, "input gradient", features, {rows, l.in}, 1);
    }
  }
  if (!g0.empty()) {
    add("backward", CollectiveKind::reduce_scatter, "weight gradient", g0, {l.in_compute, l.out});
    add("backward", CollectiveKind::reduce_scatter, "weight gradient", g1, {l.stored_rows, l.out},
        1);
  } else {
    add("backward", CollectiveKind::reduce_scatter, "weight gradient", g1, {l.in_compute, l.out},
        1);
  }
  add("backward", CollectiveKind::all_reduce, "weight gradient", l.weight_allreduce,
      {l.stored_rows, l.stored_cols});
  add("backward", CollectiveKind::all_reduce, "bias gradient", l.bias_reduce, {l.out});
  return steps.list;
}

bool shares_input_gather(const LinearLayout& gate, const LinearLayout& up) {
  return gate.column_gathers_input() && up.column_gathers_input() && gate.in == up.in;
}

std::vector<LayerCollective> shared_gather_collectives(const LinearLayout& l, const Mesh& mesh,
                                                       int64_t rows, bool input_grad,
                                                       int64_t bytes_per_element,
                                                       const MixedPrecision& precision) {
  StepCollectives steps(mesh, rows, bytes_per_element);
  if (rows <= 0 || l.tp <= 1) return steps.list;
  steps.add("forward", CollectiveKind::all_gather, "input", {l.feature_axis}, {rows, l.in},
            precision.param, 1);
  if (input_grad) {
    steps.add("backward", CollectiveKind::reduce_scatter, "input gradient", {l.feature_axis},
              {rows, l.in}, precision.param, 1);
  }
  return steps.list;
}

}  // namespace meshtrain
