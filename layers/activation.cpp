#include "layers/activation.hpp"

#include <Kokkos_Core.hpp>

#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "partition/error.hpp"

namespace meshtrain {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

Range2 range_of(const MatrixView& m) {
  return Range2({0, 0}, {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))});
}

}  // namespace

void activation_forward(Activation activation, MatrixView z, MatrixView out) {
  MESHTRAIN_REQUIRE(z.extent(0) == out.extent(0) && z.extent(1) == out.extent(1),
                    "activation_forward: shapes differ");
  switch (activation) {
    case Activation::relu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::relu_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            out(i, j) = z(i, j) > 0.0f ? z(i, j) : 0.0f;
          });
      return;
    case Activation::tanh:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::tanh_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) { out(i, j) = kmath::tanh(z(i, j)); });
      return;
    case Activation::gelu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::gelu_forward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float x = z(i, j);
            const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
            out(i, j) = 0.5f * x * (1.0f + kmath::tanh(inner));
          });
      return;
    case Activation::none:
      if (out.data() != z.data()) Kokkos::deep_copy(out, z);
      return;
  }
}

void activation_backward(Activation activation, MatrixView z, MatrixView grad) {
  MESHTRAIN_REQUIRE(z.extent(0) == grad.extent(0) && z.extent(1) == grad.extent(1),
                    "activation_backward: shapes differ");
  switch (activation) {
    case Activation::relu:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::relu_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            if (!(z(i, j) > 0.0f)) grad(i, j) = 0.0f;
          });
      return;
    case Activation::tanh:
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::tanh_backward"), range_of(z),
          KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
            const float t = kmath::tanh(z(i, j));
            grad(i, j) *= 1.0f - t * t;
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
            grad(i, j) *= 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * d_inner;
          });
      return;
    case Activation::none:
      return;
  }
}

}  // namespace meshtrain
