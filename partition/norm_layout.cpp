#include "partition/norm_layout.hpp"

#include <algorithm>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {

const char* to_string(NormKind kind) {
  return kind == NormKind::layernorm ? "layernorm" : "rmsnorm";
}

NormLayout decide_norm_layout(const std::string& layer, NormKind kind,
                              const std::vector<LinearParameter>& params, const Mesh& mesh,
                              const LayerAxes& requested_axes, FeatureLayout input_layout) {
  const size_t expected = kind == NormKind::layernorm ? 2 : 1;
  if (params.size() != expected) {
    MESHTRAIN_BAD_INPUT("norm '", layer, "': a ", to_string(kind), " has ", expected,
                        " parameters (scale", expected == 2 ? ", bias" : "", "), got ",
                        params.size());
  }
  if (params[0].shape.size() != 1 || params[0].shape[0] < 1) {
    MESHTRAIN_BAD_INPUT("norm '", layer, "': its scale '", params[0].name,
                        "' must be a vector [width], got ", format_shape(params[0].shape));
  }
  NormLayout l;
  l.layer = layer;
  l.kind = kind;
  l.width = params[0].shape[0];
  for (size_t k = 1; k < params.size(); ++k) {
    if (params[k].shape != std::vector<int64_t>{l.width}) {
      MESHTRAIN_BAD_INPUT("norm '", layer, "': its bias '", params[k].name,
                          "' must be a vector of the scale's width ", l.width, ", got ",
                          format_shape(params[k].shape));
    }
  }
  const LayerAxes axes = layer_axes_on(mesh, requested_axes);
  l.feature_axis = axes.feature;
  l.tp = axes.feature.empty() ? 1 : mesh.axis_size(axes.feature);
  l.layout = l.tp > 1 ? input_layout : FeatureLayout::replicated;
  const bool split = l.layout == FeatureLayout::split;
  if (split && l.width % l.tp != 0) {
    MESHTRAIN_BAD_INPUT("norm '", layer, "': its ", l.width,
                        " features do not split over mesh axis '", l.feature_axis, "' of size ",
                        l.tp);
  }
  l.local_width = split ? l.width / l.tp : l.width;
  if (split) l.stats_axes = {l.feature_axis};
  l.batch = mesh.active_axes(axes.batch);

  l.direct = true;
  for (const LinearParameter& p : params) {
    NormParameterLayout q;
    q.name = p.name;
    const std::vector<std::string> entry = mesh.active_axes(p.spec.with_rank(1).entries[0].axes);
    if (l.width % mesh.size_of(entry) != 0) {
      MESHTRAIN_BAD_INPUT("norm '", layer, "': '", p.name, "' of ", l.width,
                          " elements does not split over ", tuple_text(entry), " (",
                          mesh.size_of(entry), " ranks)");
    }
    q.stored = l.width / mesh.size_of(entry);
    q.gather = entry;
    if (split && !entry.empty() && entry.front() == l.feature_axis) {
      q.gather.erase(q.gather.begin());
      q.gather_sliced = true;
    }
    q.gathered = q.stored * mesh.size_of(q.gather);
    l.direct = l.direct && q.gather.empty() && q.stored == l.local_width;
    l.params.push_back(q);
  }
  l.grad_reduce = l.batch;
  if (!l.direct && split) l.grad_reduce.push_back(l.feature_axis);
  return l;
}

std::string describe_norm_layout(const NormLayout& l) {
  std::ostringstream s;
  s << to_string(l.kind) << " " << l.width << " features";
  if (!l.stats_axes.empty()) {
    s << " (split " << l.local_width << " over " << l.feature_axis
      << "), statistics all-reduced over " << tuple_text(l.stats_axes);
  }
  std::vector<std::string> gathered;
  for (const auto& p : l.params) {
    for (const auto& a : p.gather) {
      if (std::find(gathered.begin(), gathered.end(), a) == gathered.end()) gathered.push_back(a);
    }
  }
  if (!gathered.empty()) s << ", parameters gathered over " << tuple_text(gathered);
  if (!l.grad_reduce.empty()) {
    s << (l.direct ? ", grads" : ", full-width grads") << " all-reduced over "
      << tuple_text(l.grad_reduce);
  }
  return s.str();
}

std::vector<LayerCollective> norm_step_collectives(const NormLayout& l, const Mesh& mesh,
                                                   int64_t rows, bool input_grad,
                                                   int64_t bytes_per_element,
                                                   const MixedPrecision& precision) {
  StepCollectives steps(mesh, rows, bytes_per_element);
  const bool activations = rows > 0;
  const bool layernorm = l.kind == NormKind::layernorm;
  auto gather = [&](const char* phase, size_t k) {
    const NormParameterLayout& p = l.params[k];
    steps.add(phase, CollectiveKind::all_gather, k == 0 ? "scale" : "bias", p.gather, {p.gathered},
              precision.param);
  };

  // Forward: the parameters, then the statistics over the feature axis.
  for (size_t k = 0; k < l.params.size(); ++k) gather("forward", k);
  if (activations) {
    steps.add("forward", CollectiveKind::all_reduce, "row sums", l.stats_axes, {rows}, Dtype::fp32);
    if (layernorm) {
      steps.add("forward", CollectiveKind::all_reduce, "centered row sums", l.stats_axes, {rows, 2},
                Dtype::fp32);
    }
  }
  // Backward: the parameter gradients, then (input gradient) the scale again and the row sums.
  if (l.direct) {
    for (size_t k = 0; k < l.params.size(); ++k) {
      steps.add("backward", CollectiveKind::all_reduce, k == 0 ? "scale gradient" : "bias gradient",
                l.grad_reduce, {l.local_width}, precision.reduce);
    }
  } else {
    steps.add("backward", CollectiveKind::all_reduce,
              layernorm ? "scale and bias gradients" : "scale gradient", l.grad_reduce,
              {static_cast<int64_t>(l.params.size()) * l.width}, precision.reduce);
  }
  if (input_grad) {
    gather("backward", 0);
    if (activations) {
      steps.add("backward", CollectiveKind::all_reduce, "gradient row sums", l.stats_axes,
                layernorm ? std::vector<int64_t>{rows, 2} : std::vector<int64_t>{rows},
                Dtype::fp32);
    }
  }
  return steps.list;
}

}  // namespace meshtrain
