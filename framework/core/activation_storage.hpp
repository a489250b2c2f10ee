#pragma once
// What an activation keeps for its backward under 16-bit activation storage
// (docs/mixed_precision.md, "Compute and memory on this build"): the rule the layer
// (layers/activation.cpp, ActivationLayer) and the memory plan (framework/train/memory_plan.cpp)
// share, so that the two cannot disagree. A header of its own, so that the few files that ask it
// are the only ones that include it.

#include "framework/core/choices.hpp"

namespace meshtrain {

// Whether the activation's backward needs its input z as 16 bits beside its output f(z). Not
// for relu, whose derivative at z is read exactly from f(z) (f(z) > 0 exactly where z > 0, and
// f(z) = z there, a 16-bit value already; NaN gives 0 both ways), nor for the identity, whose
// derivative reads nothing: their backward reads the kept output, bit for bit what it computed
// from z. tanh, sigmoid, gelu and silu keep z: their derivatives computed from the rounded output
// would give other bits than the simulated path's, which computes them from z.
inline bool activation_keeps_16bit_input(Activation activation) {
  return activation != Activation::relu && activation != Activation::none;
}

}  // namespace meshtrain
