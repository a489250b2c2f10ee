#include "layers/activation.hpp"

#include <Kokkos_Core.hpp>

#include "base/error.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)

// sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x), both from e = exp(-|x|) <= 1: exp never
// overflows and neither value is a difference of nearly equal numbers, for any x.
struct Sigmoids {
  float of_x;      // sigmoid(x)
  float of_minus;  // sigmoid(-x) = 1 - sigmoid(x)
};
KOKKOS_INLINE_FUNCTION Sigmoids sigmoids(float x) {
  const float e = kmath::exp(-kmath::fabs(x));
  const float big = 1.0f / (1.0f + e);  // sigmoid(|x|)
  const float small = e / (1.0f + e);   // sigmoid(-|x|)
  return x >= 0.0f ? Sigmoids{big, small} : Sigmoids{small, big};
}

// Phi(x) = 0.5 (1 + erf(x / sqrt 2)), the standard normal CDF, written 0.5 erfc(-x / sqrt 2):
// the same value without the cancellation 1 + erf(...) has for x << 0.
KOKKOS_INLINE_FUNCTION float normal_cdf(float x) {
  return 0.5f * kmath::erfc(-x * kInvSqrt2);
}

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

Range2 range_of(const MatrixView& m) {
  return Range2({0, 0}, {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))});
}

}  // namespace

void activation_forward(Activation activation, MatrixView z, MatrixView out, Dtype dtype) {
  MESHTRAIN_REQUIRE(z.extent(0) == out.extent(0) && z.extent(1) == out.extent(1),
                    "activation_forward: shapes differ");
  switch (activation) {
    case Activation::relu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::relu_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            out(i, j) = round_to(z(i, j) > 0.0f ? z(i, j) : 0.0f, dtype);
          });
      return;
    case Activation::tanh:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::tanh_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            out(i, j) = round_to(kmath::tanh(z(i, j)), dtype);
          });
      return;
    case Activation::gelu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::gelu_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
            out(i, j) = round_to(0.5f * x * (1.0f + kmath::tanh(inner)), dtype);
          });
      return;
    case Activation::gelu_erf:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::gelu_erf_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            out(i, j) = round_to(x * normal_cdf(x), dtype);
          });
      return;
    case Activation::silu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::silu_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            out(i, j) = round_to(x * sigmoids(x).of_x, dtype);
          });
      return;
    case Activation::sigmoid:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::sigmoid_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            out(i, j) = round_to(sigmoids(z(i, j)).of_x, dtype);
          });
      return;
    case Activation::none:
      if (out.data() == z.data()) {
        round_in_place(out, dtype);
      } else {
        round_copy(z, out, dtype);
      }
      return;
  }
}

void activation_backward(Activation activation, MatrixView z, MatrixView grad, Dtype dtype) {
  MESHTRAIN_REQUIRE(z.extent(0) == grad.extent(0) && z.extent(1) == grad.extent(1),
                    "activation_backward: shapes differ");
  switch (activation) {
    case Activation::relu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::relu_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            grad(i, j) = z(i, j) > 0.0f ? round_to(grad(i, j), dtype) : 0.0f;
          });
      return;
    case Activation::tanh:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::tanh_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float t = kmath::tanh(z(i, j));
            grad(i, j) = round_to(grad(i, j) * (1.0f - t * t), dtype);
          });
      return;
    case Activation::gelu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::gelu_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
            const float t = kmath::tanh(inner);
            const float d_inner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
            grad(i, j) = round_to(
                grad(i, j) * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * d_inner), dtype);
          });
      return;
    case Activation::gelu_erf:  // Phi(x) + x phi(x); exp(-x^2 / 2) underflows to 0, never overflows
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::gelu_erf_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            const float density = kInvSqrt2Pi * kmath::exp(-0.5f * x * x);
            grad(i, j) = round_to(grad(i, j) * (normal_cdf(x) + x * density), dtype);
          });
      return;
    case Activation::silu:  // s + x s (1 - s) = s (1 + x (1 - s)), s = sigmoid(x)
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::silu_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            const Sigmoids s = sigmoids(x);
            grad(i, j) = round_to(grad(i, j) * (s.of_x * (1.0f + x * s.of_minus)), dtype);
          });
      return;
    case Activation::sigmoid:  // s (1 - s)
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::sigmoid_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const Sigmoids s = sigmoids(z(i, j));
            grad(i, j) = round_to(grad(i, j) * (s.of_x * s.of_minus), dtype);
          });
      return;
    case Activation::none:
      round_in_place(grad, dtype);
      return;
  }
}

void swiglu_forward(MatrixView gate, MatrixView value, MatrixView out, Dtype dtype) {
  MESHTRAIN_REQUIRE(gate.extent(0) == out.extent(0) && gate.extent(1) == out.extent(1) &&
                        value.extent(0) == out.extent(0) && value.extent(1) == out.extent(1),
                    "swiglu_forward: shapes differ");
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_forward"), range_of(out),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const float g = gate(i, j);
        out(i, j) = round_to(g * sigmoids(g).of_x * value(i, j), dtype);
      });
}

void swiglu_backward(MatrixView gate, MatrixView value, MatrixView dy, MatrixView dgate,
                     MatrixView dvalue, Dtype dtype) {
  MESHTRAIN_REQUIRE(gate.extent(0) == dy.extent(0) && gate.extent(1) == dy.extent(1) &&
                        value.extent(0) == dy.extent(0) && value.extent(1) == dy.extent(1) &&
                        dgate.extent(0) == dy.extent(0) && dgate.extent(1) == dy.extent(1) &&
                        dvalue.extent(0) == dy.extent(0) && dvalue.extent(1) == dy.extent(1),
                    "swiglu_backward: shapes differ");
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_backward"), range_of(dy),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const float g = gate(i, j), d = dy(i, j);
        const Sigmoids s = sigmoids(g);
        dgate(i, j) = round_to(d * value(i, j) * (s.of_x * (1.0f + g * s.of_minus)), dtype);
        dvalue(i, j) = round_to(d * g * s.of_x, dtype);  // may be dy itself: read first
      });
}

ActivationLayer::ActivationLayer(Activation activation, const std::string& name, int64_t rows,
                                 int64_t width, FeatureLayout layout, int64_t offset, Dtype dtype)
    : activation_(activation),
      layout_(layout),
      offset_(offset),
      dtype_(dtype),
      out_(name, rows, width) {}

MatrixView ActivationLayer::forward(MatrixView x, const LayerPass&) {
  z_ = x;
  activation_forward(activation_, x, out_, dtype_);
  return out_;
}

MatrixView ActivationLayer::backward(MatrixView dy, bool need_input_grad, const LayerPass&) {
  if (!need_input_grad) return MatrixView();
  activation_backward(activation_, z_, dy, dtype_);
  return dy;
}

}  // namespace meshtrain
