#include "layers/gradient_reduction.hpp"

#include "base/error.hpp"
#include "layers/sharded_parameter.hpp"

namespace meshtrain {

Communicator* partial_gradients_group(Layer& layer) {
  if (!layer.can_leave_gradients_partial()) return nullptr;
  const std::vector<ShardedParameter*> parameters = layer.sharded_parameters();
  Communicator* group = nullptr;
  for (size_t i = 0; i < parameters.size(); ++i) {
    Communicator* own = parameters[i]->deferrable_group();
    if (own == nullptr || (i > 0 && own != group)) return nullptr;
    group = own;
  }
  return group;
}

GradientReductionPlan::GradientReductionPlan(const std::vector<Layer*>& sequence) {
  for (Layer* layer : sequence) {
    std::vector<ShardedParameter*> parameters = layer->sharded_parameters();
    MESHTRAIN_REQUIRE(parameters.size() == layer->parameter_count(), "layer '", layer->describe(),
                      "' holds ", layer->parameter_count(), " parameters, of which ",
                      parameters.size(), " as ShardedParameters");
    Communicator* group = partial_gradients_group(*layer);
    layer_groups_.push_back(group);
    parameter_groups_.insert(parameter_groups_.end(), parameters.size(), group);
    parameters_.push_back(std::move(parameters));
  }
}

std::vector<LayerGradients> GradientReductionPlan::bucket_gradients() const {
  std::vector<LayerGradients> layers(parameters_.size());
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (layer_groups_[k] == nullptr) continue;
    layers[k].group = layer_groups_[k];
    for (const ShardedParameter* p : parameters_[k]) {
      const ShardedTensor& g = p->grad();
      // A gradient stored as 16 bits (Mlp::store_gradients_16bit) lives in the buckets' 16-bit
      // buffer only: a view without data, of its elements.
      layers[k].gradients.push_back(g.stored_16bit()
                                        ? VectorView(nullptr, static_cast<size_t>(g.box.elements()))
                                        : VectorView(g.local.data(), g.local.extent(0)));
    }
  }
  return layers;
}

void GradientReductionPlan::all_reduce_deferred() const {
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (layer_groups_[k] == nullptr) continue;
    for (ShardedParameter* p : parameters_[k]) p->all_reduce_deferred();
  }
}

}  // namespace meshtrain
