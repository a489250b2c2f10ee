#include "layers/activation.hpp"

#include <Kokkos_Core.hpp>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "framework/core/activation_storage.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/fast_math.hpp"
#include "framework/core/host_chunks.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "layers/inference.hpp"
#include "layers/sixteen_bit_passes.hpp"

namespace meshtrain {
namespace {

// The formulas live once, in framework/core/activation_math.hpp (the GEMM epilogues use them
// too); this file runs them as the layers' own passes.
using activation_math::Sigmoids;
using activation_math::sigmoids;
using activation_math::swiglu_gradients;
using activation_math::swiglu_value;
using activation_math::SwigluGradients;

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

// out = f(z) for one row of `cols` values on host memory (out may be z), compiled per
// instruction set without FMA contraction: activation_math's formulas, the same bits as
// map_flat's loop (the training step's forward runs it too).
template <class Op>
MESHTRAIN_INLINE void forward_row(const float* z, float* out, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) out[j] = Op::value(z[j]);
}

MESHTRAIN_HOST_CLONES_EXACT
void forward_row_host(Activation activation, const float* z, float* out, int64_t cols) {
  switch (activation) {
    case Activation::relu:
      return forward_row<activation_math::Relu>(z, out, cols);
    case Activation::tanh:
      return forward_row<activation_math::Tanh>(z, out, cols);
    case Activation::gelu:
      return forward_row<activation_math::GeluTanh>(z, out, cols);
    case Activation::gelu_erf:
      return forward_row<activation_math::GeluErf>(z, out, cols);
    case Activation::silu:
      return forward_row<activation_math::Silu>(z, out, cols);
    case Activation::sigmoid:
      return forward_row<activation_math::Sigmoid>(z, out, cols);
    case Activation::none:
      return forward_row<activation_math::Identity>(z, out, cols);
  }
}

// The label of activation_forward's kernel for `activation` (not none), host or not.
const std::string& forward_label(Activation activation) {
  switch (activation) {
    case Activation::relu:
      return MESHTRAIN_LABEL("meshtrain::relu_forward");
    case Activation::tanh:
      return MESHTRAIN_LABEL("meshtrain::tanh_forward");
    case Activation::gelu:
      return MESHTRAIN_LABEL("meshtrain::gelu_forward");
    case Activation::gelu_erf:
      return MESHTRAIN_LABEL("meshtrain::gelu_erf_forward");
    case Activation::silu:
      return MESHTRAIN_LABEL("meshtrain::silu_forward");
    case Activation::sigmoid:
      return MESHTRAIN_LABEL("meshtrain::sigmoid_forward");
    case Activation::none:
      break;
  }
  return MESHTRAIN_LABEL("meshtrain::identity_forward");
}

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

// f'(x) of each activation, for the tangent kernels: the backward's formula at g = 1
// (framework/core/activation_math.hpp), except sigmoid's and silu's below.
template <class Op>
struct SlopeOf {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const { return Op::gradient(x, 1.0f); }
};
using ReluSlope = SlopeOf<activation_math::Relu>;
using GeluErfSlope = SlopeOf<activation_math::GeluErf>;
// sigmoid(x) and 1 - sigmoid(x) with one division (the slopes' hot loop): e = exp(-|x|),
// r = 1 / (1 + e); sigmoid(|x|) = r, sigmoid(-|x|) = e r, neither a difference.
KOKKOS_INLINE_FUNCTION Sigmoids sigmoids_one_division(float x) {
  const float e = fast_math::exp(-kmath::fabs(x));
  const float r = 1.0f / (1.0f + e);
  return x >= 0.0f ? Sigmoids{r, e * r} : Sigmoids{e * r, r};
}
struct SiluSlope {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    const Sigmoids s = sigmoids_one_division(x);
    return s.of_x * (1.0f + x * s.of_minus);
  }
};
struct SigmoidSlope {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    const Sigmoids s = sigmoids_one_division(x);
    return s.of_x * s.of_minus;
  }
};
// The slope functor of an activation_math struct: SlopeOf, except silu's and sigmoid's above.
// With activation_math::with_activation, the one place an Activation picks its slope.
template <class Op>
struct SlopeFor {
  using type = SlopeOf<Op>;
};
template <>
struct SlopeFor<activation_math::Silu> {
  using type = SiluSlope;
};
template <>
struct SlopeFor<activation_math::Sigmoid> {
  using type = SigmoidSlope;
};
template <class Op>
using SlopeFunctor = typename SlopeFor<Op>::type;

// One value row i of scale_tangents below: the slopes of z's row into the block's first output
// row, then every row of the block is that times dz (the first one last).
template <class Slope>
KOKKOS_FORCEINLINE_FUNCTION void scale_block(const float* KOKKOS_RESTRICT zi, const float* d_data,
                                             int64_t d_stride, float* o_data, int64_t o_stride,
                                             int64_t i, int64_t k, int64_t cols, Slope slope) {
  float* KOKKOS_RESTRICT slopes = o_data + i * k * o_stride;
  for (int64_t j = 0; j < cols; ++j) slopes[j] = slope(zi[j]);
  for (int64_t d = k; d-- > 1;) {
    float* KOKKOS_RESTRICT o = o_data + (i * k + d) * o_stride;
    const float* KOKKOS_RESTRICT g = d_data + (i * k + d) * d_stride;
    for (int64_t j = 0; j < cols; ++j) o[j] = slopes[j] * g[j];
  }
  const float* KOKKOS_RESTRICT g = d_data + i * k * d_stride;
  for (int64_t j = 0; j < cols; ++j) slopes[j] *= g[j];
}

// scale_block on host memory, compiled per instruction set (framework/core/host_clones.hpp)
// without FMA contraction: the same arithmetic, so the same bits, 16 lanes wide on AVX-512 where
// the build's SSE2 runs 4 (the silu slope's polynomial exp and division included).
// The body given to with_activation: a functor whose call is forced inline (a lambda's could
// be left out of line, outside the clone).
struct ScaleBlock {
  const float* zi;
  const float* d_data;
  int64_t d_stride;
  float* o_data;
  int64_t o_stride, i, k, cols;
  template <class Op>
  MESHTRAIN_INLINE void operator()(Op) const {
    scale_block(zi, d_data, d_stride, o_data, o_stride, i, k, cols, SlopeFunctor<Op>{});
  }
};
MESHTRAIN_HOST_CLONES_EXACT
void scale_block_host(Activation activation, const float* zi, const float* d_data, int64_t d_stride,
                      float* o_data, int64_t o_stride, int64_t i, int64_t k, int64_t cols) {
  activation_math::with_activation(activation,
                                   ScaleBlock{zi, d_data, d_stride, o_data, o_stride, i, k, cols});
}

// out(t, j) = slope(z(t / k, j)) * dz(t, j) for the k rows t of each value row, each slope
// computed once for its k rows (scale_block). out must not be dz (check_tangent_shapes).
struct TangentRows {
  int64_t rows, cols, k, z_stride, d_stride, o_stride;
  const float* z_data;
  const float* d_data;
  float* o_data;
};
TangentRows tangent_rows(const MatrixView& z, const MatrixView& dz, const MatrixView& out) {
  const int64_t rows = static_cast<int64_t>(z.extent(0));
  return {rows,
          static_cast<int64_t>(z.extent(1)),
          rows > 0 ? static_cast<int64_t>(dz.extent(0)) / rows : 0,
          static_cast<int64_t>(z.stride(0)),
          static_cast<int64_t>(dz.stride(0)),
          static_cast<int64_t>(out.stride(0)),
          z.data(),
          dz.data(),
          out.data()};
}

// On the default execution space: plain pointer loops over a row's columns (views may be
// row-strided), which the compiler vectorizes.
template <class Slope>
void scale_tangents(const std::string& label, const TangentRows& t, Slope slope) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<>(device_space(), 0, t.rows), KOKKOS_LAMBDA(const int64_t i) {
        scale_block(t.z_data + i * t.z_stride, t.d_data, t.d_stride, t.o_data, t.o_stride, i, t.k,
                    t.cols, slope);
      });
}

// On the host (inference::layers_run_host_kernels()): scale_block_host, which picks the slope.
void scale_tangents_host(const std::string& label, Activation activation, const TangentRows& t) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, t.rows),
      [=](const int64_t i) {
        scale_block_host(activation, t.z_data + i * t.z_stride, t.d_data, t.d_stride, t.o_data,
                         t.o_stride, i, t.k, t.cols);
      });
  inference::fence_after_host_kernel(label);
}

// The derivative forward's activation (LayerPass::derivative_forward): f(z) into out and f'(z)
// into slopes for one row of host memory, one visit of z. The same formulas as forward_row and
// scale_block's slopes, compiled without FMA contraction, so both are the bits those give (the
// compiler computes silu's and sigmoid's exp(-|z|) once for the two).
template <class Op, class Slope>
MESHTRAIN_INLINE void forward_slope_row(const float* __restrict z, float* __restrict out,
                                        float* __restrict slopes, int64_t cols, Slope slope) {
  for (int64_t j = 0; j < cols; ++j) {
    out[j] = Op::value(z[j]);
    slopes[j] = slope(z[j]);
  }
}

struct ForwardSlopeRow {  // with_activation's body, as ScaleBlock
  const float* z;
  float* out;
  float* slopes;
  int64_t cols;
  template <class Op>
  MESHTRAIN_INLINE void operator()(Op) const {
    forward_slope_row<Op>(z, out, slopes, cols, SlopeFunctor<Op>{});
  }
};
MESHTRAIN_HOST_CLONES_EXACT
void forward_slope_row_host(Activation activation, const float* z, float* out, float* slopes,
                            int64_t cols) {
  activation_math::with_activation(activation, ForwardSlopeRow{z, out, slopes, cols});
}

// out(t, :) = slopes(i, :) * dz(t, :) for the k rows t = i k .. i k + k - 1 of value row i: the
// products scale_block forms, from the kept slopes (the same floats), so the same bits.
MESHTRAIN_HOST_CLONES_EXACT
void kept_slope_block_host(const float* __restrict slopes, const float* d_data, int64_t d_stride,
                           float* o_data, int64_t o_stride, int64_t i, int64_t k, int64_t cols) {
  for (int64_t d = 0; d < k; ++d) {
    const float* __restrict g = d_data + (i * k + d) * d_stride;
    float* __restrict o = o_data + (i * k + d) * o_stride;
    for (int64_t j = 0; j < cols; ++j) o[j] = slopes[j] * g[j];
  }
}

// f''(x) of each activation, for training on derivatives (activation_curvature_add); relu's and
// the identity's are 0 and never computed. In float32 from the same sigmoids and tanh as f':
//   tanh      -2 t (1 - t^2), t = tanh(x)
//   gelu      (1 - t^2) (u' - x t u'^2 + x u'' / 2), u = c (x + a x^3), t = tanh(u),
//             u' = c (1 + 3 a x^2), u'' = 6 a c x
//   gelu_erf  phi(x) (2 - x^2)
//   silu      s (1 - s) (2 + x (1 - 2 s)), s = sigmoid(x)
//   sigmoid   s (1 - s) (1 - 2 s)
struct TanhCurvature {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    const float t = fast_math::tanh(x);
    return -2.0f * t * (1.0f - t * t);
  }
};
struct GeluCurvature {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    using activation_math::kGeluCubic;
    using activation_math::kSqrt2OverPi;
    const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float t = fast_math::tanh(u);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    const float ddu = 6.0f * kGeluCubic * kSqrt2OverPi * x;
    return (1.0f - t * t) * (du - x * t * du * du + 0.5f * x * ddu);
  }
};
struct GeluErfCurvature {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    return activation_math::kInvSqrt2Pi * kmath::exp(-0.5f * x * x) * (2.0f - x * x);
  }
};
struct SiluCurvature {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    const Sigmoids s = sigmoids_one_division(x);
    return s.of_x * s.of_minus * (2.0f + x * (s.of_minus - s.of_x));
  }
};
struct SigmoidCurvature {
  KOKKOS_INLINE_FUNCTION float operator()(const float x) const {
    const Sigmoids s = sigmoids_one_division(x);
    return s.of_x * s.of_minus * (s.of_minus - s.of_x);
  }
};

// grad(i, j) += curvature(z(i, j)) * sum over the k rows t of value row i of
// t_in(t, j) * dt(t, j).
template <class Curvature>
void add_curvature(const MatrixView& z, const MatrixView& t_in, const MatrixView& dt,
                   const MatrixView& grad, Curvature curvature) {
  const int64_t rows = static_cast<int64_t>(z.extent(0));
  const int64_t cols = static_cast<int64_t>(z.extent(1));
  const int64_t k = rows > 0 ? static_cast<int64_t>(dt.extent(0)) / rows : 0;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::activation_curvature_add"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          float sum = 0.0f;
          for (int64_t d = 0; d < k; ++d) sum += t_in(i * k + d, j) * dt(i * k + d, j);
          grad(i, j) += curvature(z(i, j)) * sum;
        }
      });
}

// f', f'' and f''' of each activation at once, for the forward Laplacian (second-order streams)
// and the exact backward through it. f' and f'' as the slopes and curvatures above; f''':
//   relu, none  0 (relu's kink has no second or third derivative, as backward takes it)
//   tanh      (6 t^2 - 2) (1 - t^2)
//   gelu      0.5 (3 h'' + x h'''), h = 1 + tanh(u): h'' = S (u'' - 2 t u'^2),
//             h''' = S (u''' - 6 t u' u'' + (4 t^2 - 2 S) u'^3), S = 1 - t^2, u''' = 6 a c
//   gelu_erf  x phi(x) (x^2 - 4)
//   silu      3 p (1 - 2 s) + x p (1 - 6 p), p = s (1 - s)
//   sigmoid   p (1 - 6 p)
struct Derivatives3 {
  float d1, d2, d3;
};
struct ReluDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float x) const {
    return {ReluSlope{}(x), 0.0f, 0.0f};
  }
};
struct IdentityDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float) const { return {1.0f, 0.0f, 0.0f}; }
};
struct TanhDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float x) const {
    return of_value(fast_math::tanh(x));
  }
  // From t = tanh(x), the forward's output (Derives3FromValue).
  KOKKOS_INLINE_FUNCTION Derivatives3 of_value(const float t) const {
    const float sech2 = 1.0f - t * t;
    return {sech2, -2.0f * t * sech2, (6.0f * t * t - 2.0f) * sech2};
  }
};
struct GeluDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float x) const {
    using activation_math::kGeluCubic;
    using activation_math::kSqrt2OverPi;
    const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float t = fast_math::tanh(u);
    const float sech2 = 1.0f - t * t;
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    const float ddu = 6.0f * kGeluCubic * kSqrt2OverPi * x;
    const float dddu = 6.0f * kGeluCubic * kSqrt2OverPi;
    const float h1 = sech2 * du;
    const float h2 = sech2 * (ddu - 2.0f * t * du * du);
    const float h3 =
        sech2 * (dddu - 6.0f * t * du * ddu + (4.0f * t * t - 2.0f * sech2) * du * du * du);
    return {0.5f * (1.0f + t) + 0.5f * x * h1, 0.5f * (2.0f * h1 + x * h2),
            0.5f * (3.0f * h2 + x * h3)};
  }
};
struct GeluErfDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float x) const {
    const float phi = activation_math::kInvSqrt2Pi * kmath::exp(-0.5f * x * x);
    return {GeluErfSlope{}(x), phi * (2.0f - x * x), x * phi * (x * x - 4.0f)};
  }
};
struct SiluDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float x) const {
    const Sigmoids s = sigmoids_one_division(x);
    const float p = s.of_x * s.of_minus;
    const float one_minus_2s = s.of_minus - s.of_x;
    return {s.of_x * (1.0f + x * s.of_minus), p * (2.0f + x * one_minus_2s),
            3.0f * p * one_minus_2s + x * p * (1.0f - 6.0f * p)};
  }
};
struct SigmoidDerivatives3 {
  KOKKOS_INLINE_FUNCTION Derivatives3 operator()(const float x) const {
    const Sigmoids s = sigmoids_one_division(x);
    const float p = s.of_x * s.of_minus;
    return {p, p * (s.of_minus - s.of_x), p * (1.0f - 6.0f * p)};
  }
};

// Whether a Derivatives3 functor has of_value(f(z)): its derivatives from the forward's output,
// which the forward Laplacian's kernels then read instead of computing f again.
template <class Derivatives>
struct Derives3FromValue {
  static constexpr bool value = false;
};
template <>
struct Derives3FromValue<TanhDerivatives3> {
  static constexpr bool value = true;
};

// f', f'' and f''' at element (i, j): from the forward's output where the functor can and the
// output is given (the same float f(z), so the same results), else from z.
template <class Derivatives>
KOKKOS_INLINE_FUNCTION Derivatives3 derivatives_at(const Derivatives& derivatives,
                                                   const MatrixView& z, const MatrixView& value,
                                                   bool use_value, int64_t i, int64_t j) {
  if constexpr (Derives3FromValue<Derivatives>::value) {
    if (use_value) return derivatives.of_value(value(i, j));
  }
  return derivatives(z(i, j));
}

// Runs body(functor) with the activation's Derivatives3 functor.
template <class Body>
void with_derivatives3(Activation activation, Body body) {
  switch (activation) {
    case Activation::relu:
      return body(ReluDerivatives3{});
    case Activation::tanh:
      return body(TanhDerivatives3{});
    case Activation::gelu:
      return body(GeluDerivatives3{});
    case Activation::gelu_erf:
      return body(GeluErfDerivatives3{});
    case Activation::silu:
      return body(SiluDerivatives3{});
    case Activation::sigmoid:
      return body(SigmoidDerivatives3{});
    case Activation::none:
      return body(IdentityDerivatives3{});
  }
}

// Columns per chunk of the second-order kernels: a row's f', f'', f''' for a chunk go into
// arrays first, then each stream runs over the chunk's columns in a loop of its own, which the
// compiler vectorizes (a loop over a row's k streams inside the column loop does not). Each
// element's arithmetic, and the order of its sums over the streams, are those of one loop.
constexpr int64_t kSecondOrderChunk = 64;

// The second-order streams' forward through an activation with derivatives f (Derivatives3):
// per row i, k tangents t then k second derivatives s; t' = f' t, s' = f' s + f'' t^2. A
// function of its own (not a lambda inside with_derivatives3's generic lambda): nvcc cannot
// define a device lambda there.
template <class Derivatives>
void second_order_streams(const MatrixView& z, const MatrixView& value, const MatrixView& streams,
                          const MatrixView& out, int64_t k, Derivatives derivatives) {
  const int64_t rows = static_cast<int64_t>(z.extent(0));
  const int64_t cols = static_cast<int64_t>(z.extent(1));
  const bool use_value = value.data() != nullptr;
  const int64_t in_stride = static_cast<int64_t>(streams.stride(0));
  const int64_t out_stride = static_cast<int64_t>(out.stride(0));
  const float* in_data = streams.data();
  float* out_data = out.data();
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::activation_second_order"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        const int64_t t0 = i * 2 * k, s0 = t0 + k;
        float d1[kSecondOrderChunk], d2[kSecondOrderChunk];
        for (int64_t j0 = 0; j0 < cols; j0 += kSecondOrderChunk) {
          const int64_t n = cols - j0 < kSecondOrderChunk ? cols - j0 : kSecondOrderChunk;
          for (int64_t c = 0; c < n; ++c) {
            const Derivatives3 f = derivatives_at(derivatives, z, value, use_value, i, j0 + c);
            d1[c] = f.d1;
            d2[c] = f.d2;
          }
          for (int64_t d = 0; d < k; ++d) {
            const float* KOKKOS_RESTRICT t = in_data + (t0 + d) * in_stride + j0;
            const float* KOKKOS_RESTRICT s = in_data + (s0 + d) * in_stride + j0;
            float* KOKKOS_RESTRICT ot = out_data + (t0 + d) * out_stride + j0;
            float* KOKKOS_RESTRICT os = out_data + (s0 + d) * out_stride + j0;
            for (int64_t c = 0; c < n; ++c) {
              ot[c] = d1[c] * t[c];
              os[c] = d1[c] * s[c] + d2[c] * t[c] * t[c];
            }
          }
        }
      });
}

// Its exact backward (the same layout), f''' included.
template <class Derivatives>
void second_order_streams_backward(const MatrixView& z, const MatrixView& value,
                                   const MatrixView& streams, const MatrixView& grad,
                                   const MatrixView& stream_grad, const MatrixView& stream_grad_in,
                                   int64_t k, Derivatives derivatives) {
  const int64_t rows = static_cast<int64_t>(z.extent(0));
  const int64_t cols = static_cast<int64_t>(z.extent(1));
  const bool use_value = value.data() != nullptr;
  const int64_t s_stride = static_cast<int64_t>(streams.stride(0));
  const int64_t g_stride = static_cast<int64_t>(stream_grad.stride(0));
  const int64_t o_stride = static_cast<int64_t>(stream_grad_in.stride(0));
  const float* s_data = streams.data();
  const float* g_data = stream_grad.data();
  float* o_data = stream_grad_in.data();
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::activation_second_order_backward"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        const int64_t t0 = i * 2 * k, s0 = t0 + k;
        float d1[kSecondOrderChunk], d2[kSecondOrderChunk], d3[kSecondOrderChunk];
        float curvature[kSecondOrderChunk], third[kSecondOrderChunk];
        for (int64_t j0 = 0; j0 < cols; j0 += kSecondOrderChunk) {
          const int64_t n = cols - j0 < kSecondOrderChunk ? cols - j0 : kSecondOrderChunk;
          for (int64_t c = 0; c < n; ++c) {
            const Derivatives3 f = derivatives_at(derivatives, z, value, use_value, i, j0 + c);
            d1[c] = f.d1;
            d2[c] = f.d2;
            d3[c] = f.d3;
            curvature[c] = 0.0f;
            third[c] = 0.0f;
          }
          // Forward: t' = f' t, s' = f' s + f'' t^2 per direction d.
          for (int64_t d = 0; d < k; ++d) {
            const float* KOKKOS_RESTRICT t = s_data + (t0 + d) * s_stride + j0;
            const float* KOKKOS_RESTRICT s = s_data + (s0 + d) * s_stride + j0;
            const float* KOKKOS_RESTRICT gt = g_data + (t0 + d) * g_stride + j0;
            const float* KOKKOS_RESTRICT gs = g_data + (s0 + d) * g_stride + j0;
            float* KOKKOS_RESTRICT ot = o_data + (t0 + d) * o_stride + j0;
            float* KOKKOS_RESTRICT os = o_data + (s0 + d) * o_stride + j0;
            for (int64_t c = 0; c < n; ++c) {
              curvature[c] += t[c] * gt[c] + s[c] * gs[c];
              third[c] += t[c] * t[c] * gs[c];
              ot[c] = d1[c] * gt[c] + 2.0f * d2[c] * t[c] * gs[c];
              os[c] = d1[c] * gs[c];
            }
          }
          for (int64_t c = 0; c < n; ++c) {
            const int64_t j = j0 + c;
            grad(i, j) = d1[c] * grad(i, j) + d2[c] * curvature[c] + d3[c] * third[c];
          }
        }
      });
}

void check_tangent_shapes(const char* who, const MatrixView& z, const MatrixView& dz,
                          const MatrixView& out) {
  MESHTRAIN_REQUIRE(z.extent(1) == dz.extent(1) && dz.extent(0) == out.extent(0) &&
                        dz.extent(1) == out.extent(1) &&
                        (z.extent(0) == 0 ? dz.extent(0) == 0 : dz.extent(0) % z.extent(0) == 0),
                    who, ": values [", z.extent(0), ", ", z.extent(1), "], tangents [",
                    dz.extent(0), ", ", dz.extent(1), "] into [", out.extent(0), ", ",
                    out.extent(1), "]");
  MESHTRAIN_REQUIRE(out.extent(0) == 0 || out.data() != dz.data(), who,
                    ": the output may not be the input's memory");
}

// activation_forward's host kernel, also writing f'(z) into slopes [rows, width].
void activation_forward_keeping_slopes(Activation activation, MatrixView z, MatrixView out,
                                       MatrixView slopes) {
  MESHTRAIN_REQUIRE(z.extent(0) == out.extent(0) && z.extent(1) == out.extent(1) &&
                        slopes.extent(0) == out.extent(0) && slopes.extent(1) == out.extent(1),
                    "activation_forward_keeping_slopes: shapes differ");
  const std::string& label = forward_label(activation);  // the kernel it replaces
  const float* z_data = z.data();
  float* o_data = out.data();
  float* s_data = slopes.data();
  const auto z_stride = static_cast<int64_t>(z.stride(0));
  const auto o_stride = static_cast<int64_t>(out.stride(0));
  const auto s_stride = static_cast<int64_t>(slopes.stride(0));
  const auto cols = static_cast<int64_t>(z.extent(1));
  Kokkos::parallel_for(label,
                       Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(
                           host_space(), 0, static_cast<int64_t>(z.extent(0))),
                       [=](const int64_t i) {
                         forward_slope_row_host(activation, z_data + i * z_stride,
                                                o_data + i * o_stride, s_data + i * s_stride, cols);
                       });
  inference::fence_after_host_kernel(label);
}

// activation_tangent from kept slopes [rows, width] (host memory): out(t, j) = slopes(t / k, j)
// dz(t, j).
void tangent_from_slopes(MatrixView slopes, MatrixView dz, MatrixView out) {
  check_tangent_shapes("tangent_from_slopes", slopes, dz, out);
  const std::string& label = MESHTRAIN_LABEL("meshtrain::activation_tangent");
  const TangentRows t = tangent_rows(slopes, dz, out);
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, t.rows),
      [=](const int64_t i) {
        kept_slope_block_host(t.z_data + i * t.z_stride, t.d_data, t.d_stride, t.o_data, t.o_stride,
                              i, t.k, t.cols);
      });
  inference::fence_after_host_kernel(label);
}

}  // namespace

void activation_tangent(Activation activation, MatrixView z, MatrixView dz, MatrixView out) {
  check_tangent_shapes("activation_tangent", z, dz, out);
  const std::string& label = MESHTRAIN_LABEL("meshtrain::activation_tangent");
  const TangentRows t = tangent_rows(z, dz, out);
  if (inference::layers_run_host_kernels()) return scale_tangents_host(label, activation, t);
  activation_math::with_activation(
      activation, [&](auto op) { scale_tangents(label, t, SlopeFunctor<decltype(op)>{}); });
}

void activation_curvature_add(Activation activation, MatrixView z, MatrixView t_in, MatrixView dt,
                              MatrixView grad) {
  check_tangent_shapes("activation_curvature_add", z, t_in, dt);
  MESHTRAIN_REQUIRE(grad.extent(0) == z.extent(0) && grad.extent(1) == z.extent(1),
                    "activation_curvature_add: values [", z.extent(0), ", ", z.extent(1),
                    "], gradient [", grad.extent(0), ", ", grad.extent(1), "]");
  switch (activation) {
    case Activation::relu:  // f'' = 0 (the kink has no second derivative either)
    case Activation::none:
      return;
    case Activation::tanh:
      return add_curvature(z, t_in, dt, grad, TanhCurvature{});
    case Activation::gelu:
      return add_curvature(z, t_in, dt, grad, GeluCurvature{});
    case Activation::gelu_erf:
      return add_curvature(z, t_in, dt, grad, GeluErfCurvature{});
    case Activation::silu:
      return add_curvature(z, t_in, dt, grad, SiluCurvature{});
    case Activation::sigmoid:
      return add_curvature(z, t_in, dt, grad, SigmoidCurvature{});
  }
}

void activation_second_order(Activation activation, MatrixView z, MatrixView streams,
                             MatrixView out, MatrixView value) {
  check_tangent_shapes("activation_second_order", z, streams, out);
  MESHTRAIN_REQUIRE(
      value.data() == nullptr || (value.extent(0) == z.extent(0) && value.extent(1) == z.extent(1)),
      "activation_second_order: values [", z.extent(0), ", ", z.extent(1), "], outputs [",
      value.extent(0), ", ", value.extent(1), "]");
  const int64_t rows = static_cast<int64_t>(z.extent(0));
  const int64_t per_row = rows > 0 ? static_cast<int64_t>(streams.extent(0)) / rows : 0;
  MESHTRAIN_REQUIRE(per_row % 2 == 0, "activation_second_order: ", per_row,
                    " streams per row, expected 2k (k tangents, k second derivatives)");
  const int64_t k = per_row / 2;
  with_derivatives3(activation, [&](auto derivatives) {
    second_order_streams(z, value, streams, out, k, derivatives);
  });
}

void activation_second_order_backward(Activation activation, MatrixView z, MatrixView streams,
                                      MatrixView grad, MatrixView stream_grad,
                                      MatrixView stream_grad_in, MatrixView value) {
  MESHTRAIN_REQUIRE(
      value.data() == nullptr || (value.extent(0) == z.extent(0) && value.extent(1) == z.extent(1)),
      "activation_second_order_backward: values [", z.extent(0), ", ", z.extent(1), "], outputs [",
      value.extent(0), ", ", value.extent(1), "]");
  check_tangent_shapes("activation_second_order_backward", z, streams, stream_grad);
  check_tangent_shapes("activation_second_order_backward", z, stream_grad, stream_grad_in);
  MESHTRAIN_REQUIRE(grad.extent(0) == z.extent(0) && grad.extent(1) == z.extent(1),
                    "activation_second_order_backward: values [", z.extent(0), ", ", z.extent(1),
                    "], gradient [", grad.extent(0), ", ", grad.extent(1), "]");
  const int64_t rows = static_cast<int64_t>(z.extent(0));
  const int64_t per_row = rows > 0 ? static_cast<int64_t>(streams.extent(0)) / rows : 0;
  MESHTRAIN_REQUIRE(per_row % 2 == 0, "activation_second_order_backward: ", per_row,
                    " streams per row, expected 2k");
  const int64_t k = per_row / 2;
  with_derivatives3(activation, [&](auto derivatives) {
    second_order_streams_backward(z, value, streams, grad, stream_grad, stream_grad_in, k,
                                  derivatives);
  });
}

void swiglu_tangent(MatrixView gate, MatrixView value, MatrixView dgate, MatrixView dvalue,
                    MatrixView out) {
  check_tangent_shapes("swiglu_tangent", gate, dgate, out);
  MESHTRAIN_REQUIRE(value.extent(0) == gate.extent(0) && value.extent(1) == gate.extent(1) &&
                        dvalue.extent(0) == dgate.extent(0) &&
                        dvalue.extent(1) == dgate.extent(1) && out.data() != dvalue.data(),
                    "swiglu_tangent: gate and value differ in shape, or out is dvalue");
  const int64_t rows = static_cast<int64_t>(gate.extent(0));
  const int64_t cols = static_cast<int64_t>(gate.extent(1));
  const int64_t k = rows > 0 ? static_cast<int64_t>(dgate.extent(0)) / rows : 0;
  // sigmoid(g) once per value element, kept in the block's first output row (as scale_tangents).
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_tangent"), Kokkos::RangePolicy<>(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const int64_t first = i * k;
        for (int64_t j = 0; j < cols; ++j) out(first, j) = sigmoids(gate(i, j)).of_x;
        for (int64_t d = k; d-- > 0;) {
          for (int64_t j = 0; j < cols; ++j) {
            const float g = gate(i, j), s = out(first, j);
            out(first + d, j) = s * (1.0f + g * (1.0f - s)) * value(i, j) * dgate(first + d, j) +
                                g * s * dvalue(first + d, j);
          }
        }
      });
}

void swiglu_cotangent(MatrixView gate, MatrixView value, MatrixView dy, MatrixView dgate,
                      MatrixView dvalue) {
  check_tangent_shapes("swiglu_cotangent", gate, dy, dgate);
  MESHTRAIN_REQUIRE(value.extent(0) == gate.extent(0) && value.extent(1) == gate.extent(1) &&
                        dvalue.extent(0) == dy.extent(0) && dvalue.extent(1) == dy.extent(1) &&
                        dvalue.data() != dy.data() && dvalue.data() != dgate.data(),
                    "swiglu_cotangent: shapes differ, or outputs share memory");
  const int64_t rows = static_cast<int64_t>(gate.extent(0));
  const int64_t cols = static_cast<int64_t>(gate.extent(1));
  const int64_t k = rows > 0 ? static_cast<int64_t>(dy.extent(0)) / rows : 0;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_cotangent"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        const int64_t first = i * k;
        for (int64_t j = 0; j < cols; ++j) dgate(first, j) = sigmoids(gate(i, j)).of_x;
        for (int64_t d = k; d-- > 0;) {
          for (int64_t j = 0; j < cols; ++j) {
            const float g = gate(i, j), s = dgate(first, j), y = dy(first + d, j);
            dvalue(first + d, j) = y * g * s;
            dgate(first + d, j) = y * value(i, j) * s * (1.0f + g * (1.0f - s));
          }
        }
      });
}

void activation_forward(Activation activation, MatrixView z, MatrixView out, Dtype dtype) {
  MESHTRAIN_REQUIRE(z.extent(0) == out.extent(0) && z.extent(1) == out.extent(1),
                    "activation_forward: shapes differ");
  if (dtype == Dtype::fp32 && activation != Activation::none &&
      inference::layers_run_host_kernels()) {
    const std::string& label = forward_label(activation);  // the kernel it replaces
    const float* z_data = z.data();
    float* o_data = out.data();
    const auto z_stride = static_cast<int64_t>(z.stride(0));
    const auto o_stride = static_cast<int64_t>(out.stride(0));
    const auto cols = static_cast<int64_t>(z.extent(1));
    Kokkos::parallel_for(label,
                         Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(
                             host_space(), 0, static_cast<int64_t>(z.extent(0))),
                         [=](const int64_t i) {
                           forward_row_host(activation, z_data + i * z_stride,
                                            o_data + i * o_stride, cols);
                         });
    inference::fence_after_host_kernel(label);
    return;
  }
  switch (activation) {
    case Activation::relu:
      map_elements(
          forward_label(Activation::relu), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Relu::value(x); });
      return;
    case Activation::tanh:
      map_elements(
          forward_label(Activation::tanh), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Tanh::value(x); });
      return;
    case Activation::gelu:
      map_elements(
          forward_label(Activation::gelu), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::GeluTanh::value(x); });
      return;
    case Activation::gelu_erf:
      map_elements(
          forward_label(Activation::gelu_erf), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::GeluErf::value(x); });
      return;
    case Activation::silu:
      map_elements(
          forward_label(Activation::silu), z, out, dtype,
          KOKKOS_LAMBDA(const float x) { return activation_math::Silu::value(x); });
      return;
    case Activation::sigmoid:
      map_elements(
          forward_label(Activation::sigmoid), z, out, dtype,
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

namespace {

// The kernels of the two 16-bit passes below for one activation's formulas (Op: those of
// activation_forward and activation_backward, framework/core/activation_math.hpp). Function
// templates, not generic lambdas: CUDA's device lambdas cannot live in a generic lambda.
template <class Op>
void forward_keeping(float* values, uint16_t* kept_z, uint16_t* kept_out, int64_t n, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::activation_forward_keeping_16bit"),
      Kokkos::RangePolicy<>(device_space(), 0, n), KOKKOS_LAMBDA(const int64_t k) {
        const float x = values[k];  // a 16-bit value already: its bits are exact
        const uint16_t out = to_16bit(Op::value(x), dtype);
        kept_z[k] = to_16bit(x, dtype);
        kept_out[k] = out;
        values[k] = from_16bit(out, dtype);
      });
}

// The same without z (activation_keeps_16bit_input false: relu, the identity).
template <class Op>
void forward_keeping_output(float* values, uint16_t* kept_out, int64_t n, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::activation_forward_keeping_16bit"),
      Kokkos::RangePolicy<>(device_space(), 0, n), KOKKOS_LAMBDA(const int64_t k) {
        const uint16_t out = to_16bit(Op::value(values[k]), dtype);
        kept_out[k] = out;
        values[k] = from_16bit(out, dtype);
      });
}

template <class Op>
void backward_from(const uint16_t* kept_z, float* grads, int64_t n, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::activation_backward_from_16bit"),
      Kokkos::RangePolicy<>(device_space(), 0, n), KOKKOS_LAMBDA(const int64_t k) {
        grads[k] = round_to(Op::gradient(from_16bit(kept_z[k], dtype), grads[k]), dtype);
      });
}

// The same passes on host memory (sixteen_bit_passes.hpp): a chunk of elements per call,
// compiled per instruction set without FMA contraction, the format a template argument (no
// dtype test per element), so the same IEEE operations per element as the kernels above, 16
// lanes at a time on AVX-512. values and the kept arrays are of different types and kept_z and
// kept_out distinct buffers (__restrict): no run-time overlap check in the vector loop.
template <class Op, Dtype dtype>
MESHTRAIN_INLINE void forward_keeping_span(float* __restrict values, uint16_t* __restrict kept_z,
                                           uint16_t* __restrict kept_out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float x = values[k];
    const uint16_t out = to_16bit_as<dtype>(Op::value(x));
    kept_z[k] = to_16bit_as<dtype>(x);
    kept_out[k] = out;
    values[k] = from_16bit_as<dtype>(out);
  }
}
template <class Op, Dtype dtype>
MESHTRAIN_INLINE void forward_keeping_output_span(float* __restrict values,
                                                  uint16_t* __restrict kept_out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const uint16_t out = to_16bit_as<dtype>(Op::value(values[k]));
    kept_out[k] = out;
    values[k] = from_16bit_as<dtype>(out);
  }
}
template <class Op, Dtype dtype>
MESHTRAIN_INLINE void backward_from_span(const uint16_t* __restrict kept, float* __restrict grads,
                                         int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    grads[k] = round_as<dtype>(Op::gradient(from_16bit_as<dtype>(kept[k]), grads[k]));
  }
}

// with_activation's bodies (functors whose calls are forced inline, so inside the clone; as
// ScaleBlock above). kept_z null: the output only (relu, the identity).
struct ForwardKeepingSpan {
  float* values;
  uint16_t* kept_z;
  uint16_t* kept_out;
  int64_t n;
  bool bf16;
  template <class Op>
  MESHTRAIN_INLINE void operator()(Op) const {
    if (kept_z == nullptr) {
      if (bf16) return forward_keeping_output_span<Op, Dtype::bf16>(values, kept_out, n);
      return forward_keeping_output_span<Op, Dtype::fp16>(values, kept_out, n);
    }
    if (bf16) return forward_keeping_span<Op, Dtype::bf16>(values, kept_z, kept_out, n);
    forward_keeping_span<Op, Dtype::fp16>(values, kept_z, kept_out, n);
  }
};
struct BackwardFromSpan {
  const uint16_t* kept;
  float* grads;
  int64_t n;
  bool bf16;
  template <class Op>
  MESHTRAIN_INLINE void operator()(Op) const {
    if (bf16) return backward_from_span<Op, Dtype::bf16>(kept, grads, n);
    backward_from_span<Op, Dtype::fp16>(kept, grads, n);
  }
};

MESHTRAIN_HOST_CLONES_EXACT
void forward_keeping_16bit_host(Activation activation, float* values, uint16_t* kept_z,
                                uint16_t* kept_out, int64_t n, bool bf16) {
  activation_math::with_activation(activation,
                                   ForwardKeepingSpan{values, kept_z, kept_out, n, bf16});
}

MESHTRAIN_HOST_CLONES_EXACT
void backward_from_16bit_host(Activation activation, const uint16_t* kept, float* grads, int64_t n,
                              bool bf16) {
  activation_math::with_activation(activation, BackwardFromSpan{kept, grads, n, bf16});
}

// activation_keeps_16bit_input false (relu, the identity): no z kept.
void forward_keeping_kernel(Activation activation, float* v, uint16_t* kz, uint16_t* ko, int64_t n,
                            Dtype dtype) {
  if (kz == nullptr) {
    if (activation == Activation::relu) {
      return forward_keeping_output<activation_math::Relu>(v, ko, n, dtype);
    }
    return forward_keeping_output<activation_math::Identity>(v, ko, n, dtype);
  }
  switch (activation) {
    case Activation::relu:  // keeps no z
    case Activation::none:
      MESHTRAIN_FAIL("activation_forward_keeping_16bit: ", to_string(activation),
                     " keeps no z, handled before the switch");
    case Activation::tanh:
      return forward_keeping<activation_math::Tanh>(v, kz, ko, n, dtype);
    case Activation::gelu:
      return forward_keeping<activation_math::GeluTanh>(v, kz, ko, n, dtype);
    case Activation::gelu_erf:
      return forward_keeping<activation_math::GeluErf>(v, kz, ko, n, dtype);
    case Activation::silu:
      return forward_keeping<activation_math::Silu>(v, kz, ko, n, dtype);
    case Activation::sigmoid:
      return forward_keeping<activation_math::Sigmoid>(v, kz, ko, n, dtype);
  }
}

void backward_from_kernel(Activation activation, const uint16_t* kz, float* g, int64_t n,
                          Dtype dtype) {
  switch (activation) {
    case Activation::relu:
      return backward_from<activation_math::Relu>(kz, g, n, dtype);
    case Activation::tanh:
      return backward_from<activation_math::Tanh>(kz, g, n, dtype);
    case Activation::gelu:
      return backward_from<activation_math::GeluTanh>(kz, g, n, dtype);
    case Activation::gelu_erf:
      return backward_from<activation_math::GeluErf>(kz, g, n, dtype);
    case Activation::silu:
      return backward_from<activation_math::Silu>(kz, g, n, dtype);
    case Activation::sigmoid:
      return backward_from<activation_math::Sigmoid>(kz, g, n, dtype);
    case Activation::none:
      return backward_from<activation_math::Identity>(kz, g, n, dtype);
  }
}

}  // namespace

namespace sixteen_bit_passes {

Path step_path() {
  return inference::layers_run_host_kernels() ? Path::host : Path::kernel;
}

void require_host(const char* who) {
  MESHTRAIN_REQUIRE(inference::layers_run_host_kernels(), who,
                    ": the host loop on a build whose layers run no host kernels");
}

void activation_forward_keeping(Path path, Activation activation, float* values, uint16_t* kept_z,
                                uint16_t* kept_out, int64_t n, Dtype dtype) {
  const bool keeps_z = activation_keeps_16bit_input(activation);
  MESHTRAIN_REQUIRE(
      dtype != Dtype::fp32 && (keeps_z ? kept_z != nullptr || n == 0 : kept_z == nullptr),
      "activation_forward_keeping_16bit: a 16-bit dtype, and a kept z exactly where ",
      to_string(activation), "'s backward reads it");
  if (path == Path::kernel)
    return forward_keeping_kernel(activation, values, kept_z, kept_out, n, dtype);
  require_host("activation_forward_keeping_16bit");
  const bool bf16 = dtype == Dtype::bf16;
  for_host_chunks(MESHTRAIN_LABEL("meshtrain::activation_forward_keeping_16bit"), n,
                  [=](int64_t begin, int64_t end) {
                    forward_keeping_16bit_host(activation, values + begin,
                                               kept_z == nullptr ? nullptr : kept_z + begin,
                                               kept_out + begin, end - begin, bf16);
                  });
}

void activation_backward_from(Path path, Activation activation, const uint16_t* kept, float* grads,
                              int64_t n, Dtype dtype) {
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32,
                    "activation_backward_from_16bit: a 16-bit dtype is needed");
  if (path == Path::kernel) return backward_from_kernel(activation, kept, grads, n, dtype);
  require_host("activation_backward_from_16bit");
  const bool bf16 = dtype == Dtype::bf16;
  for_host_chunks(MESHTRAIN_LABEL("meshtrain::activation_backward_from_16bit"), n,
                  [=](int64_t begin, int64_t end) {
                    backward_from_16bit_host(activation, kept + begin, grads + begin, end - begin,
                                             bf16);
                  });
}

}  // namespace sixteen_bit_passes

void activation_forward_keeping_16bit(Activation activation, MatrixView z, HalfMatrixView kept_z,
                                      HalfMatrixView kept_out, Dtype dtype) {
  const auto n = static_cast<int64_t>(z.extent(0) * z.extent(1));
  const bool keeps_z = activation_keeps_16bit_input(activation);
  MESHTRAIN_REQUIRE(
      dtype != Dtype::fp32 && z.span_is_contiguous() &&
          (!keeps_z || (kept_z.extent(0) == z.extent(0) && kept_z.extent(1) == z.extent(1))) &&
          kept_out.extent(0) == z.extent(0) && kept_out.extent(1) == z.extent(1),
      "activation_forward_keeping_16bit: a 16-bit dtype and contiguous views of "
      "the same extents are needed");
  // relu's and the identity's backward read f(z) (framework/core/activation_storage.hpp): a
  // kept_z would be left unwritten.
  MESHTRAIN_REQUIRE(keeps_z || kept_z.size() == 0,
                    "activation_forward_keeping_16bit: ", to_string(activation),
                    " keeps no z (its backward reads the kept output): "
                    "kept_z must be empty");
  sixteen_bit_passes::activation_forward_keeping(sixteen_bit_passes::step_path(), activation,
                                                 z.data(), keeps_z ? kept_z.data() : nullptr,
                                                 kept_out.data(), n, dtype);
}

void activation_backward_from_16bit(Activation activation, ConstHalfMatrixView kept,
                                    MatrixView grad, Dtype dtype) {
  const auto n = static_cast<int64_t>(grad.extent(0) * grad.extent(1));
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32 && grad.span_is_contiguous() &&
                        kept.extent(0) == grad.extent(0) && kept.extent(1) == grad.extent(1),
                    "activation_backward_from_16bit: a 16-bit dtype and contiguous views of "
                    "the same extents are needed");
  // z, or f(z) for relu and the identity (activation_keeps_16bit_input false): relu's gradient
  // reads only the sign of its argument, which f(z) = max(z, 0) gives exactly (f(z) > 0 exactly
  // where z > 0); the identity's reads nothing.
  sixteen_bit_passes::activation_backward_from(sixteen_bit_passes::step_path(), activation,
                                               kept.data(), grad.data(), n, dtype);
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
          out(i, j) = round_to(swiglu_value(gate(i, j), value(i, j)), dtype);
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
          const SwigluGradients grad = swiglu_gradients(gate(i, j), value(i, j), dy(i, j));
          dgate(i, j) = round_to(grad.gate, dtype);
          dvalue(i, j) = round_to(grad.value, dtype);  // may be dy itself: read first
        }
      });
}

ActivationLayer::ActivationLayer(Activation activation, const std::string& name, int64_t rows,
                                 int64_t width, FeatureLayout layout, int64_t offset, Dtype dtype,
                                 bool keeps_16bit)
    : activation_(activation),
      layout_(layout),
      offset_(offset),
      dtype_(dtype),
      rows_(rows),
      width_(width),
      name_(name) {
  MESHTRAIN_REQUIRE(!keeps_16bit || dtype != Dtype::fp32, "activation '", name,
                    "': 16-bit storage needs a 16-bit compute dtype");
  if (keeps_16bit) {
    // z only where the derivative needs it (framework/core/activation_storage.hpp; the memory
    // plan counts the same): relu's and the identity's backward read f(z).
    if (activation_keeps_16bit_input(activation)) {
      kept_input_ = HalfMatrix(name + "/input_16bit", rows, width);
    }
    kept_output_ = HalfMatrix(name + "/output_16bit", rows, width);
  } else {
    out_ = Matrix(name, rows, width);
    output_ = out_;
  }
}

MatrixView ActivationLayer::forward(MatrixView x, const LayerPass& pass) {
  if (kept_output_.data() != nullptr) {
    // In place in the model's working buffer; z (where backward needs it) and f(z) kept as
    // 16-bit copies, one pass.
    activation_forward_keeping_16bit(activation_, x, kept_input_, kept_output_, dtype_);
    slopes_kept_ = false;
    output_ = x;
    return x;
  }
  z_ = x;
  slopes_kept_ = pass.derivative_forward && slopes_.extent(0) != 0;
  if (slopes_kept_) {
    activation_forward_keeping_slopes(activation_, x, out_, slopes_);
  } else {
    activation_forward(activation_, x, out_, dtype_);
  }
  return out_;
}

MatrixView ActivationLayer::backward(MatrixView dy, bool need_input_grad, const LayerPass&) {
  if (!need_input_grad) return MatrixView();
  if (kept_output_.data() != nullptr) {
    // From z, or from f(z) where that gives the same bits (relu, the identity). Under tensor
    // parallelism the next Linear below may write its dY's 16 bits over f(z) after this
    // (layers/mlp.cpp): f(z) is read here for the last time.
    activation_backward_from_16bit(
        activation_, kept_input_.data() != nullptr ? kept_input_ : kept_output_, dy, dtype_);
  } else {
    activation_backward(activation_, z_, dy, dtype_);
  }
  return dy;
}

MatrixView ActivationLayer::forward_tangents(MatrixView dx, const LayerPass& pass) {
  const int64_t rows = rows_;
  const int64_t k = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows, name_);
  const MatrixView out = leading_rows(tangents_, rows * k);
  if (pass.second_order) {
    MESHTRAIN_REQUIRE(dtype_ == Dtype::fp32, name_, ": the forward Laplacian is fp32 only");
    activation_second_order(activation_, z_, dx, out, output_);  // f(z) as forward left it
  } else if (slopes_kept_) {
    tangent_from_slopes(slopes_, dx, out);
  } else {
    activation_tangent(activation_, z_, dx, out);
  }
  tangent_in_ = dx;  // for backward_with_tangents
  second_order_ = pass.second_order;
  return out;
}

MatrixView ActivationLayer::backward_with_tangents(MatrixView dy, MatrixView dt,
                                                   bool need_input_grad, const LayerPass& pass,
                                                   MatrixView* dt_in) {
  MESHTRAIN_REQUIRE(dtype_ == Dtype::fp32, name_, ": training on derivatives is fp32 only");
  if (!need_input_grad) return MatrixView();
  MESHTRAIN_REQUIRE(tangent_in_.extent(0) == dt.extent(0) && tangent_in_.extent(1) == dt.extent(1),
                    name_, ": tangent gradient is [", dt.extent(0), ", ", dt.extent(1),
                    "], the last tangent pass [", tangent_in_.extent(0), ", ",
                    tangent_in_.extent(1), "]");
  MESHTRAIN_REQUIRE(second_order_ == pass.second_order, name_,
                    ": the backward's streams are not of the kind the last tangent pass had");
  if (second_order_) {
    const int64_t k = cotangent_directions(static_cast<int64_t>(dt.extent(0)), rows_, name_);
    const MatrixView out = leading_rows(cotangents_, rows_ * k);
    activation_second_order_backward(activation_, z_, tangent_in_, dy, dt, out, output_);
    *dt_in = out;
    return dy;
  }
  // t_out = f'(z) t_in: g_z = dy f'(z) + f''(z) sum_d t_in g_t, and g_t_in = f'(z) g_t.
  activation_backward(activation_, z_, dy, dtype_);
  activation_curvature_add(activation_, z_, tangent_in_, dt, dy);
  *dt_in = backward_cotangents(dt, pass);
  return dy;
}

void ActivationLayer::reserve_tangent_backward(int64_t directions) {
  reserve_tangents(directions);
  reserve_cotangents(directions);
}

void ActivationLayer::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  tangents_ = Matrix(name_ + "/tangents", rows_ * directions, width_);
  tangent_capacity_ = directions;
}

MatrixView ActivationLayer::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  const RowBlock block = cotangent_block_rows(pass, rows_, name_);
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), block.rows, name_);
  const MatrixView out = leading_rows(cotangents_, block.rows * k);
  // A diagonal Jacobian: the same product, with the block's slopes (kept by the derivative
  // forward) or pre-activations.
  if (slopes_kept_) {
    tangent_from_slopes(row_block(slopes_, block.first, block.rows), dy, out);
  } else {
    activation_tangent(activation_, row_block(z_, block.first, block.rows), dy, out);
  }
  return out;
}

void ActivationLayer::reserve_derivative_forward(bool /*for_cotangents*/) {
  // Both passes read the slopes.
  // The slopes' host kernels: fp32 on host kernels (kept_output_: 16-bit storage has no fp32 z).
  if (slopes_.extent(0) != 0 || dtype_ != Dtype::fp32 || kept_output_.data() != nullptr ||
      !inference::layers_run_host_kernels()) {
    return;
  }
  slopes_ = Matrix(name_ + "/slopes", rows_, width_);
}

void ActivationLayer::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  cotangents_ = Matrix(name_ + "/cotangents", rows_ * directions, width_);
  cotangent_capacity_ = directions;
}

}  // namespace meshtrain
