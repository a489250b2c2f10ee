#include "layers/activation.hpp"

#include <Kokkos_Core.hpp>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {
namespace {

// The formulas live once, in framework/core/activation_math.hpp (the GEMM epilogues use them
// too); this file runs them as the layers' own passes.
using activation_math::Sigmoids;
using activation_math::sigmoids;

// The elementwise kernels run one flat loop over all elements where the views are contiguous
// (the usual case: a simple loop the compiler vectorizes, where the Serial backend's 2-D
// MDRange calls the functor element by element through its tiles), else one loop over rows.
// Each element is computed by the same expression either way: the results are identical.

// out = f(z) elementwise; out may be z itself.
template <class F>
void map_flat(const std::string& label, const MatrixView& z, const MatrixView& out, F f) {
  const auto rows = static_cast<int64_t>(z.extent(0));
  const auto cols = static_cast<int64_t>(z.extent(1));
  if (z.span_is_contiguous() && out.span_is_contiguous()) {
    const VectorView flat_z(z.data(), rows * cols), flat_out(out.data(), rows * cols);
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<>(device_space(), 0, rows * cols),
        KOKKOS_LAMBDA(const int64_t k) { flat_out(k) = f(flat_z(k)); });
    return;
  }
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) out(i, j) = f(z(i, j));
      });
}

// grad = f(z, grad) elementwise.
template <class F>
void update_flat(const std::string& label, const MatrixView& z, const MatrixView& grad, F f) {
  const auto rows = static_cast<int64_t>(z.extent(0));
  const auto cols = static_cast<int64_t>(z.extent(1));
  if (z.span_is_contiguous() && grad.span_is_contiguous()) {
    const VectorView flat_z(z.data(), rows * cols), flat_grad(grad.data(), rows * cols);
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<>(device_space(), 0, rows * cols),
        KOKKOS_LAMBDA(const int64_t k) { flat_grad(k) = f(flat_z(k), flat_grad(k)); });
    return;
  }
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) grad(i, j) = f(z(i, j), grad(i, j));
      });
}

// f's value rounded to a 16-bit compute dtype.
template <class F>
struct Rounded {
  F f;
  Dtype dtype;
  template <class... Args>
  KOKKOS_INLINE_FUNCTION float operator()(Args... args) const {
    return round_to(f(args...), dtype);
  }
};

// out = round_to(f(z), dtype) and grad = round_to(f(z, grad), dtype) elementwise. fp32 runs f
// alone (round_to is the identity there): no test of the dtype per element, so the loop has
// no branch and vectorizes.
template <class F>
void map_elements(const std::string& label, const MatrixView& z, const MatrixView& out, Dtype dtype,
                  F f) {
  if (dtype == Dtype::fp32) {
    map_flat(label, z, out, f);
  } else {
    map_flat(label, z, out, Rounded<F>{f, dtype});
  }
}

template <class F>
void update_elements(const std::string& label, const MatrixView& z, const MatrixView& grad,
                     Dtype dtype, F f) {
  if (dtype == Dtype::fp32) {
    update_flat(label, z, grad, f);
  } else {
    update_flat(label, z, grad, Rounded<F>{f, dtype});
  }
}

}  // namespace

void activation_forward(Activation activation, MatrixView z, MatrixView out, Dtype dtype) {
  MESHTRAIN_REQUIRE(z.extent(0) == out.extent(0) && z.extent(1) == out.extent(1),
                    "activation_forward: shapes differ");
  switch (activation) {
    case Activation::relu:
      map_elements(
          MESHTRAIN_LABEL("meshtrain::relu_forward"), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Relu::value(x); });
      return;
    case Activation::tanh:
      map_elements(
          MESHTRAIN_LABEL("meshtrain::tanh_forward"), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Tanh::value(x); });
      return;
    case Activation::gelu:
      map_elements(
          MESHTRAIN_LABEL("meshtrain::gelu_forward"), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::GeluTanh::value(x); });
      return;
    case Activation::gelu_erf:
      map_elements(
          MESHTRAIN_LABEL("meshtrain::gelu_erf_forward"), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::GeluErf::value(x); });
      return;
    case Activation::silu:
      map_elements(
          MESHTRAIN_LABEL("meshtrain::silu_forward"), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Silu::value(x); });
      return;
    case Activation::sigmoid:
      map_elements(
          MESHTRAIN_LABEL("meshtrain::sigmoid_forward"), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Sigmoid::value(x); });
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
      update_elements(
          MESHTRAIN_LABEL("meshtrain::relu_backward"), z, grad, dtype,
          KOKKOS_LAMBDA(const float x, const float g) {
            return activation_math::Relu::gradient(x, g);
          });
      return;
    case Activation::tanh:
      update_elements(
          MESHTRAIN_LABEL("meshtrain::tanh_backward"), z, grad, dtype,
          KOKKOS_LAMBDA(const float x, const float g) {
            return activation_math::Tanh::gradient(x, g);
          });
      return;
    case Activation::gelu:
      update_elements(
          MESHTRAIN_LABEL("meshtrain::gelu_backward"), z, grad, dtype,
          KOKKOS_LAMBDA(const float x, const float g) {
            return activation_math::GeluTanh::gradient(x, g);
          });
      return;
    case Activation::gelu_erf:  // Phi(x) + x phi(x); exp(-x^2 / 2) underflows to 0, never overflows
      update_elements(
          MESHTRAIN_LABEL("meshtrain::gelu_erf_backward"), z, grad, dtype,
          KOKKOS_LAMBDA(const float x, const float g) {
            return activation_math::GeluErf::gradient(x, g);
          });
      return;
    case Activation::silu:  // s + x s (1 - s) = s (1 + x (1 - s)), s = sigmoid(x)
      update_elements(
          MESHTRAIN_LABEL("meshtrain::silu_backward"), z, grad, dtype,
          KOKKOS_LAMBDA(const float x, const float g) {
            return activation_math::Silu::gradient(x, g);
          });
      return;
    case Activation::sigmoid:  // s (1 - s)
      update_elements(
          MESHTRAIN_LABEL("meshtrain::sigmoid_backward"), z, grad, dtype,
          KOKKOS_LAMBDA(const float x, const float g) {
            return activation_math::Sigmoid::gradient(x, g);
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
  const int64_t cols = static_cast<int64_t>(out.extent(1));
  Kokkos::parallel_for(  // one row per iteration, as the other elementwise kernels
      MESHTRAIN_LABEL("meshtrain::swiglu_forward"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(out.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          const float g = gate(i, j);
          out(i, j) = round_to(g * sigmoids(g).of_x * value(i, j), dtype);
        }
      });
}

void swiglu_backward(MatrixView gate, MatrixView value, MatrixView dy, MatrixView dgate,
                     MatrixView dvalue, Dtype dtype) {
  MESHTRAIN_REQUIRE(gate.extent(0) == dy.extent(0) && gate.extent(1) == dy.extent(1) &&
                        value.extent(0) == dy.extent(0) && value.extent(1) == dy.extent(1) &&
                        dgate.extent(0) == dy.extent(0) && dgate.extent(1) == dy.extent(1) &&
                        dvalue.extent(0) == dy.extent(0) && dvalue.extent(1) == dy.extent(1),
                    "swiglu_backward: shapes differ");
  const int64_t cols = static_cast<int64_t>(dy.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_backward"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(dy.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          const float g = gate(i, j), d = dy(i, j);
          const Sigmoids s = sigmoids(g);
          dgate(i, j) = round_to(d * value(i, j) * (s.of_x * (1.0f + g * s.of_minus)), dtype);
          dvalue(i, j) = round_to(d * g * s.of_x, dtype);  // may be dy itself: read first
        }
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
