#include "layers/layer.hpp"

#include <algorithm>

namespace meshtrain {

void LayerScratchNeeds::merge(const LayerScratchNeeds& o) {
  weight = std::max(weight, o.weight);
  grad = std::max(grad, o.grad);
  stage = std::max(stage, o.stage);
  bias = std::max(bias, o.bias);
  matmul = std::max(matmul, o.matmul);
}

LayerScratch::LayerScratch(const LayerScratchNeeds& needs, bool with_prefetch)
    : weight("meshtrain::scratch_weight", needs.weight),
      prefetch("meshtrain::scratch_prefetch", with_prefetch ? needs.weight : 0),
      grad("meshtrain::scratch_grad", needs.grad),
      stage("meshtrain::scratch_stage", needs.stage),
      bias("meshtrain::scratch_bias", needs.bias) {
  if (needs.matmul > 0) matmul.reserve(needs.matmul);
}

}  // namespace meshtrain
