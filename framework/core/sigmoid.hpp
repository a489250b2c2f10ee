#pragma once
// The click probability of a logit, sigmoid(z), evaluated in double without overflow
// (exp(-|z|) <= 1) and rounded once to float: what `meshtrain predict` writes as a DLRM's
// /prediction (apps/predict.cpp) and meshtrain::DlrmPredictor returns
// (run/dlrm_predictor.cpp), in host code and in kernels alike.

#include <Kokkos_Core.hpp>

#include "framework/core/kokkos_math.hpp"

namespace meshtrain {

KOKKOS_INLINE_FUNCTION float stable_sigmoid(double z) {
  const double e = kmath::exp(-(z < 0 ? -z : z));
  return static_cast<float>(z >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
}

}  // namespace meshtrain
