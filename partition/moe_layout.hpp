#pragma once
// The layout of a mixture-of-experts layer (layers/moe.hpp) and the collectives it runs per
// training step, decided from its parameters' specs alone, as linear_layout.hpp does for a
// fully connected layer: layers/moe.cpp builds its buffers and communicators from this
// decision and the planner reports it.
//
// An MoE layer in -> out with E experts, top-k routing:
//   layers/<i>/router/weight  [in, E]        replicated by the presets
//   layers/<i>/experts/weight [E, in, out]   P(ep, ...) by the presets
//   layers/<i>/experts/bias   [E, out]       P(ep, ...)
//
// The decision (batch axes B, which include the expert axes; "active" = size > 1):
//   Expert axes: the active axes of the experts' dim 0 (the same for weight and bias); they
//     must be batch axes. Each rank of that group holds E / ep experts, and every rank sends
//     each of its rows to the ranks holding the row's experts (all-to-all over the expert
//     axes) and gets the results back.
//   Storage: every other active axis of a parameter's spec is gathered before use (forward
//     and again backward) and its gradient reduce-scattered back, divided by the size of
//     the gathered axes that are not batch axes (identical contributions), as a linear
//     layer's FSDP storage. The gradient is all-reduced over the batch axes left: for the
//     router every batch axis (it sees every row), for the experts the batch axes other
//     than the expert axes (an expert sees the rows of its whole expert group already).
//   A bias stored whole (shorter than min_sharding_size) while the experts are split holds
//     every expert's row; its gradient is all-reduced over all batch axes.
//   Input: all features (a split input is all-gathered over the feature axis first; its
//     gradient is sliced back). Output: replicated features. The feature axis computes
//     the layer on every one of its ranks (replicated compute).
//
// Feed-forward experts (decide_moe_feed_forward_layout; a residual_mlp block listed in
// model.moe_layers): each expert is up [in, hidden] (+ gate [in, hidden] for SwiGLU), the
// activation, down [hidden, out], with one router:
//   <block>/router/weight             [in, E]
//   <block>/experts/gate/weight, bias [E, in, hidden], [E, hidden]   (SwiGLU only)
//   <block>/experts/up/weight, bias   [E, in, hidden], [E, hidden]
//   <block>/experts/down/weight, bias [E, hidden, out], [E, out]
// Every expert parameter is stored and reduced as experts_weight / experts_bias above (the
// same expert axes on dim 0). A split input (tp) gives a split output: every tp rank computes
// the whole layer and keeps its own feature block of the output; backward all-gathers the
// output gradient over the feature axis first.

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "partition/linear_layout.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

// The MoE keys of [model] as plain data (framework/train/config.hpp reads them).
struct MoeSettings {
  std::vector<int64_t> layers;  // indices of the layers that are MoE layers
  int64_t experts = 8;
  int64_t top_k = 2;
  double aux_loss_coef = 0.01;
  bool is_moe(int64_t layer) const;
  bool any() const { return !layers.empty(); }
};

// A parameter of an MoE layer viewed as [d0, d1, d2] (router: [1, in, E]; experts weight:
// [E, in, out]; experts bias: [E, 1, out]) and how its local block becomes the compute
// block [d0 local, d1, d2]: gathered over gather_dim1 then gather_dim2 as one group whose
// rank is (index over gather_dim1) * size(gather_dim2) + (index over gather_dim2).
struct MoeParameterStorage {
  std::string name;
  std::vector<int64_t> compute;  // [d0 local, d1, d2]
  std::vector<int64_t> stored;   // [d0 local, d1 local, d2 local]
  std::vector<std::string> gather_dim1, gather_dim2;
  std::vector<std::string> allreduce;  // the gradient's all-reduce after the reduce-scatter
  int nonbatch_replication = 1;        // gradient divisor (gathered axes that are not batch)
  // The experts' bias stored whole (too small to shard) while the experts are split: the
  // compute block holds every expert's row and the layer uses its own experts' rows; the
  // gradient (zero for the others) is all-reduced over every batch axis.
  bool all_experts = false;
  std::vector<std::string> gather() const;  // gather_dim1 then gather_dim2
  int64_t compute_elements() const { return compute[0] * compute[1] * compute[2]; }
  int64_t stored_elements() const { return stored[0] * stored[1] * stored[2]; }
};

struct MoeLayout {
  std::string layer;  // "layers/1"
  int64_t in = 0, out = 0, experts = 0, top_k = 0;
  std::vector<std::string> batch_axes;   // active
  std::vector<std::string> expert_axes;  // active; the all-to-all group
  int ep = 1;                            // its size
  int64_t experts_local = 0;             // E / ep
  std::string feature_axis;              // "" when the mesh has none
  int tp = 1;
  FeatureLayout input_layout = FeatureLayout::replicated;
  // One linear expert: experts_weight [E, in, out], experts_bias [E, out]. Feed-forward
  // experts (hidden > 0): experts_weight / experts_bias are the up projection [E, in, hidden]
  // / [E, hidden]; gate (gated only) and down as named.
  MoeParameterStorage router, experts_weight, experts_bias;
  int64_t hidden = 0;  // feed-forward experts' inner width; 0: one linear per expert
  bool gated = false;  // SwiGLU experts: silu(x Wg + bg) * (x Wu + bu)
  MoeParameterStorage experts_gate_weight, experts_gate_bias;
  MoeParameterStorage experts_down_weight, experts_down_bias;
  std::vector<std::string> notes;

  bool feed_forward() const { return hidden > 0; }
  bool gathers_input() const { return input_layout == FeatureLayout::split; }
  int64_t input_width() const { return gathers_input() ? in / tp : in; }
  // Feed-forward experts with a split input keep the input's layout (residual blocks).
  bool splits_output() const { return feed_forward() && gathers_input(); }
  FeatureLayout output_layout() const {
    return splits_output() ? FeatureLayout::split : FeatureLayout::replicated;
  }
  int64_t output_width() const { return splits_output() ? out / tp : out; }
  // Every expert parameter's storage in the layer's parameter order: router, then
  // (gate weight, gate bias,) weight (up), bias (up)(, down weight, down bias).
  std::vector<const MoeParameterStorage*> storages() const;
};

// The parameter names of MoE layer `layer` ("layers/1").
std::string moe_router_name(const std::string& layer);
std::string moe_experts_weight_name(const std::string& layer);
std::string moe_experts_bias_name(const std::string& layer);
// The layer of a router: "layers/1/router/weight" -> "layers/1".
std::string moe_layer_name(const std::string& router_name);

// Decides the layout (see the top of this file). Throws bad_input naming the parameter when
// the shapes do not agree ([in, E], [E, in, out], [E, out]), top_k is not in [1, E], the
// weight's and bias's dim 0 are split differently, the experts are split over an axis that
// does not split the batch, or E does not divide by the expert axes.
MoeLayout decide_moe_layout(const std::string& layer, const LinearParameter& router,
                            const LinearParameter& experts_weight,
                            const LinearParameter& experts_bias, int64_t top_k, const Mesh& mesh,
                            const LayerAxes& axes, FeatureLayout input_layout);

// The parameter names of a feed-forward MoE block `block` ("blocks/1"): "experts/up",
// "experts/gate", "experts/down" + "/weight" or "/bias".
std::string moe_expert_projection(const std::string& block, const std::string& projection,
                                  const std::string& what);

// Feed-forward experts (see the top of this file): `gate_weight` / `gate_bias` with an empty
// name when not gated. Throws bad_input as decide_moe_layout does, and when the projections'
// shapes do not chain ([E, in, hidden] then [E, hidden, out]) or split their experts over
// other axes than the up projection's.
MoeLayout decide_moe_feed_forward_layout(
    const std::string& layer, const LinearParameter& router, const LinearParameter& gate_weight,
    const LinearParameter& gate_bias, const LinearParameter& up_weight,
    const LinearParameter& up_bias, const LinearParameter& down_weight,
    const LinearParameter& down_bias, int64_t top_k, const Mesh& mesh, const LayerAxes& axes,
    FeatureLayout input_layout);

// The one error for model.experts that do not divide by the `ranks` of the expert axes `axes`
// (active) of MoE layer `layer` ("layers/1"), from decide_moe_layout and from the planner,
// which also names the `parameter` it was placing.
[[noreturn]] void fail_experts_do_not_divide(int64_t experts, int ranks,
                                             const std::vector<std::string>& axes,
                                             const std::string& layer,
                                             const std::string& parameter = "");

// The most (row, expert) pairs one rank can receive in a dispatch: each of the ep group's
// members sends at most min(top_k, experts_local) of each of its `rows` rows here (a row's
// experts are distinct). The layer's dispatch buffers hold this many rows.
int64_t moe_dispatch_capacity(const MoeLayout& layout, int64_t rows);

// "MoE in 512 -> out 512, 8 experts top-2, 4 per rank over (ep) by all-to-all, experts
// gathered over (fsdp), expert grads all-reduced over (dp), router grads all-reduced over
// (fsdp, dp, ep)" (without the layer name).
std::string describe_moe_layout(const MoeLayout& layout);

// The collectives one training step of the layer runs, in order (forward, then backward),
// sized for `rows` local rows (0: the activation-sized ones left out). The all-to-alls are
// counted at uniform routing (each expert gets rows * top_k / experts of a rank's
// assignments; a rank keeps 1/ep of what it dispatches): bytes that leave the rank.
std::vector<LayerCollective> moe_step_collectives(const MoeLayout& layout, const Mesh& mesh,
                                                  int64_t rows, bool input_grad,
                                                  int64_t bytes_per_element,
                                                  const MixedPrecision& precision = {});

}  // namespace meshtrain
