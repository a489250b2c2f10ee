#pragma once
// The activations in float64, from their formulas (docs/model_math.md): value and derivative
// of each Activation, and SwiGLU's silu(g) * u with its two partial derivatives. What the
// layer tests' references compute with (never layer code).

#include <gtest/gtest.h>

#include <cmath>

#include "framework/core/choices.hpp"

namespace meshtrain::testing {

inline double sigmoid(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}
// Phi(z), the standard normal CDF (gelu_erf(z) = z Phi(z)), and its density.
inline double normal_cdf(double z) {
  return 0.5 * std::erfc(-z / std::sqrt(2.0));
}
inline double normal_pdf(double z) {
  return std::exp(-0.5 * z * z) / std::sqrt(2.0 * M_PI);
}

// gelu's tanh form: 0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3))).
inline double gelu_tanh(double z) {
  const double u = std::sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z);
  return 0.5 * z * (1.0 + std::tanh(u));
}

inline double activation(Activation a, double z) {
  switch (a) {
    case Activation::relu:
      return z > 0 ? z : 0;
    case Activation::tanh:
      return std::tanh(z);
    case Activation::gelu:
      return gelu_tanh(z);
    case Activation::gelu_erf:
      return z * normal_cdf(z);
    case Activation::silu:
      return z * sigmoid(z);
    case Activation::sigmoid:
      return sigmoid(z);
    case Activation::none:
      return z;
  }
  ADD_FAILURE() << "no float64 reference for activation " << static_cast<int>(a);
  return 0;
}

// d activation(a, z) / dz (relu's at 0: 0).
inline double activation_derivative(Activation a, double z) {
  switch (a) {
    case Activation::relu:
      return z > 0 ? 1 : 0;
    case Activation::tanh:
      return 1 - std::tanh(z) * std::tanh(z);
    case Activation::gelu: {
      const double c = std::sqrt(2.0 / M_PI);
      const double t = std::tanh(c * (z + 0.044715 * z * z * z));
      return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * z * z);
    }
    case Activation::gelu_erf:
      return normal_cdf(z) + z * normal_pdf(z);
    case Activation::silu:
      return sigmoid(z) * (1 + z * sigmoid(-z));
    case Activation::sigmoid:
      return sigmoid(z) * sigmoid(-z);
    case Activation::none:
      return 1;
  }
  ADD_FAILURE() << "no float64 reference for activation " << static_cast<int>(a);
  return 0;
}

// SwiGLU of a gate g and an up projection u: silu(g) * u.
inline double swiglu(double g, double u) {
  return g * sigmoid(g) * u;
}
// Its partial derivatives times an incoming gradient da: d/dg and d/du.
inline double swiglu_gate_gradient(double g, double u, double da) {
  const double s = sigmoid(g);
  return da * u * s * (1.0 + g * (1.0 - s));
}
inline double swiglu_up_gradient(double g, double da) {
  return da * g * sigmoid(g);
}

}  // namespace meshtrain::testing
