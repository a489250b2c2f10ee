#pragma once
// Who reduces which gradient: one decision per model, made here and read by everyone who
// acts on it.
//
// A gradient whose only communication is one all-reduce over the batch axes its storage
// does not split (ShardedParameter::deferrable_group: DP storage) can be left as this rank's
// partial sum and all-reduced once, later. A layer leaves its gradients partial when its
// backward can (Layer::can_leave_gradients_partial) and every parameter it holds is
// deferrable over the same group (partial_gradients_group); every other layer reduces its
// gradients in every backward (FSDP's reduce-scatters, TP's bias over the feature axis, the
// MoE layer). GradientReductionPlan records that decision once, when the model is built
// (layers/mlp.cpp), and is what the others read:
//   the layers         each backward's LayerPass::deferred (for_layer: `now` for a layer that
//                      does not defer)
//   the DP buckets     which gradients they hold, in which group (bucket_gradients())
//   reduce_gradients   the all-reduces a backward with DeferredReduction::later skipped
//                      (all_reduce_deferred())
//   ZeRO-1             which gradients arrive partial over which group (parameter_groups();
//                      framework/train/zero1.hpp)
// When the deferred gradients are completed (GradientReduction: by the layers in every
// backward, once per step, or by ZeRO-1) is chosen by whoever drives the model
// (run/training_run.cpp).

#include <cstddef>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "layers/gradient_buckets.hpp"
#include "layers/layer.hpp"

namespace meshtrain {

class ShardedParameter;

// The rule: the group over which `layer` leaves all its gradients partial, or nullptr when it
// reduces them itself in every backward.
Communicator* partial_gradients_group(Layer& layer);

class GradientReductionPlan {
 public:
  GradientReductionPlan() = default;
  // The model's layers in order; their parameters follow each other in the model's
  // parameters() order. Borrows the layers (owned by the model, which owns the plan).
  explicit GradientReductionPlan(const std::vector<Layer*>& sequence);

  // The group over which layer k of the sequence leaves its gradients partial (nullptr: it
  // reduces them itself).
  Communicator* layer_group(size_t k) const { return layer_groups_.at(k); }
  // Per parameter, in parameters() order: its layer's group (nullptr: reduced by the layer).
  const std::vector<Communicator*>& parameter_groups() const { return parameter_groups_; }
  // What layer k does in a backward that treats the deferrable gradients as `deferred`.
  DeferredReduction for_layer(size_t k, DeferredReduction deferred) const {
    return layer_groups_[k] ? deferred : DeferredReduction::now;
  }
  // One entry per layer of the sequence, for GradientBuckets (group nullptr: not bucketed).
  std::vector<LayerGradients> bucket_gradients() const;
  // The all-reduces a backward with DeferredReduction::later left out, layer by layer in
  // sequence order, each layer's parameters in order.
  void all_reduce_deferred() const;

 private:
  std::vector<std::vector<ShardedParameter*>> parameters_;  // per layer
  std::vector<Communicator*> layer_groups_;
  std::vector<Communicator*> parameter_groups_;
};

}  // namespace meshtrain
