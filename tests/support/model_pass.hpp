#pragma once
// A model's training pass as the layer tests run it (layers/mlp.hpp's Mlp): forward, then
// backward reducing the gradients itself, or leaving the deferrable ones partial for
// reduce_gradients() to complete.

#include "framework/core/views.hpp"

namespace meshtrain::testing {

// Returns the forward's output.
template <class Model>
MatrixView forward_backward(Model& model, const Matrix& x, const Matrix& dout, bool reduce) {
  const MatrixView out = model.forward(x);
  model.backward(dout, reduce);
  if (!reduce) model.reduce_gradients();
  return out;
}

}  // namespace meshtrain::testing
