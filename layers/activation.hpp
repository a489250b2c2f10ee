#pragma once
// Elementwise activations, forward and backward. They work on any layout (a block of an
// activation is activated independently of the others).
//   relu  max(z, 0); derivative 1 for z > 0, else 0
//   tanh  tanh(z);   derivative 1 - tanh(z)^2
//   gelu  the tanh approximation (as jax.nn.gelu(approximate=True) and GELU(approximate=
//         "tanh") in PyTorch): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
//   none  identity

#include <string>

#include "framework/core/choices.hpp"  // Activation, its names
#include "framework/core/sharded_tensor.hpp"

namespace meshtrain {

// out = f(z) rounded to `dtype` (mixed precision's compute dtype; fp32: not rounded); out
// may be z itself.
void activation_forward(Activation activation, MatrixView z, MatrixView out,
                        Dtype dtype = Dtype::fp32);
// grad = grad * f'(z) rounded to `dtype`, in place; `z` is the forward input.
void activation_backward(Activation activation, MatrixView z, MatrixView grad,
                         Dtype dtype = Dtype::fp32);

}  // namespace meshtrain
