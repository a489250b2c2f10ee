#include "layers/inference.hpp"

#include <cmath>
#include <cstring>

#include <Kokkos_Core.hpp>
#include <string>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "layers/activation.hpp"
#include "layers/layer.hpp"
#include "layers/linear.hpp"

namespace meshtrain::inference {
namespace {

// exp(x) for x <= 0: Cephes' expf (range reduction by ln 2 in two parts, a degree-6
// polynomial), within 2 ulp of expf; exp(-87) (1.6e-38) for x below -87, where expf is
// subnormal or 0 (an absolute error below 2e-38). Branch-free, so that loops of it vectorize.
MESHTRAIN_INLINE float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) * (int32_t{1} << 23);  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// sigmoid(x) from e = exp(-|x|) as activation_math::sigmoids (no overflow for any x).
MESHTRAIN_INLINE float sigmoid(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float r = 1.0f / (1.0f + e);
  return x >= 0.0f ? r : e * r;
}

// The row kernels: one row of `cols` values each, cloned per instruction set.
MESHTRAIN_HOST_CLONES
void silu_row(float* __restrict row, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) row[j] = row[j] * sigmoid(row[j]);
}

MESHTRAIN_HOST_CLONES
void sigmoid_row(float* __restrict row, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) row[j] = sigmoid(row[j]);
}

MESHTRAIN_HOST_CLONES
void relu_row(float* __restrict row, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) row[j] = row[j] > 0.0f ? row[j] : 0.0f;
}

// The activations without a vectorized form here: activation_math's formulas (fast_math's
// exp and tanh, libm's erfc for gelu_erf).
template <class Op>
void formula_row(float* row, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) row[j] = Op::value(row[j]);
}

MESHTRAIN_HOST_CLONES
void fill_row(float* __restrict row, int64_t cols, const float* __restrict bias,
              const float* __restrict residual) {
  if (residual != nullptr) {
    for (int64_t j = 0; j < cols; ++j) row[j] = residual[j] + bias[j];
  } else {
    for (int64_t j = 0; j < cols; ++j) row[j] = bias[j];
  }
}

MESHTRAIN_HOST_CLONES_EXACT
void add_bias_row(float* __restrict row, int64_t cols, const float* __restrict bias) {
  for (int64_t j = 0; j < cols; ++j) row[j] = row[j] + bias[j];
}

MESHTRAIN_HOST_CLONES_EXACT
void add_row(const float* __restrict a, const float* __restrict b, float* __restrict out,
             int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) out[j] = a[j] + b[j];
}

// Sums of a row in 16 partial sums (a fixed order that vectorizes), then added in order.
constexpr int kLanes = 16;

template <class F>
MESHTRAIN_INLINE float lane_sum(const float* x, int64_t n, F f) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += f(x[j + l]);
  }
  for (int l = 0; j < n; ++j, ++l) lanes[l] += f(x[j]);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// stats (3 floats) and x_hat (cols) each null, or where the derivative forward keeps them: the
// same y either way (x_hat the same product y starts from).
MESHTRAIN_HOST_CLONES
void layernorm_row(const float* __restrict x, float* __restrict y, int64_t cols,
                   const float* __restrict scale, const float* __restrict bias, float eps,
                   float* __restrict stats = nullptr, float* __restrict x_hat = nullptr) {
  const float n = static_cast<float>(cols);
  const float m0 = lane_sum(x, cols, [](float v) { return v; }) / n;
  const float a = lane_sum(x, cols, [m0](float v) { return v - m0; });
  const float b = lane_sum(x, cols, [m0](float v) { return (v - m0) * (v - m0); });
  const float delta = a / n;
  const float var = b / n - delta * delta;
  const float rstd = 1.0f / std::sqrt((var > 0.0f ? var : 0.0f) + eps);
  if (stats != nullptr) {
    stats[0] = m0;
    stats[1] = delta;
    stats[2] = rstd;
  }
  if (x_hat == nullptr) {
    for (int64_t j = 0; j < cols; ++j) y[j] = ((x[j] - m0) - delta) * rstd * scale[j] + bias[j];
    return;
  }
  for (int64_t j = 0; j < cols; ++j) {
    const float h = ((x[j] - m0) - delta) * rstd;
    x_hat[j] = h;
    y[j] = h * scale[j] + bias[j];
  }
}

MESHTRAIN_HOST_CLONES
void rmsnorm_row(const float* __restrict x, float* __restrict y, int64_t cols,
                 const float* __restrict scale, float eps, float* __restrict stats = nullptr,
                 float* __restrict x_hat = nullptr) {
  const float n = static_cast<float>(cols);
  const float ss = lane_sum(x, cols, [](float v) { return v * v; });
  const float rstd = 1.0f / std::sqrt(ss / n + eps);
  if (stats != nullptr) {
    stats[0] = 0.0f;
    stats[1] = 0.0f;
    stats[2] = rstd;
  }
  if (x_hat == nullptr) {
    for (int64_t j = 0; j < cols; ++j) y[j] = x[j] * rstd * scale[j];
    return;
  }
  for (int64_t j = 0; j < cols; ++j) {
    const float h = x[j] * rstd;
    x_hat[j] = h;
    y[j] = h * scale[j];
  }
}

// body(i) for each row i of `rows`, one Kokkos kernel on the host execution space (a plain
// host lambda: these kernels never run on a GPU), labelled so that tools count it as a pass;
// fenced only where the default execution space is another (fence_after_host_kernel).
template <class Body>
void for_rows(const std::string& label, int64_t rows, const Body& body) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, rows), body);
  fence_after_host_kernel(label);
}

int64_t rows_of(ConstMatrixView m) {
  return static_cast<int64_t>(m.extent(0));
}
int64_t cols_of(ConstMatrixView m) {
  return static_cast<int64_t>(m.extent(1));
}
int64_t ld_of(ConstMatrixView m) {
  return static_cast<int64_t>(m.stride(0));
}

void check_same_shape(ConstMatrixView a, ConstMatrixView b, const char* what) {
  MESHTRAIN_REQUIRE(a.extent(0) == b.extent(0) && a.extent(1) == b.extent(1), what, ": [",
                    a.extent(0), ", ", a.extent(1), "] against [", b.extent(0), ", ", b.extent(1),
                    "]");
}

}  // namespace

bool runs_host_kernels() {
  return kHostKernels;
}

bool layers_run_host_kernels() {
  return kHostKernels && kDefaultSpaceIsHost;
}

void fence_after_host_kernel(const std::string& label) {
  if constexpr (!kDefaultSpaceIsHost) fence_space(host_space(), label);
  (void)label;
}

void fill_bias(MatrixView c, const float* bias, ConstMatrixView residual) {
  if (residual.data() != nullptr) check_same_shape(residual, c, "inference::fill_bias");
  float* data = c.data();
  const float* r = residual.data();
  const int64_t ld = ld_of(c), cols = cols_of(c), ldr = r != nullptr ? ld_of(residual) : 0;
  for_rows(MESHTRAIN_LABEL("meshtrain::infer_bias"), rows_of(c), [=](const int64_t i) {
    fill_row(data + i * ld, cols, bias, r != nullptr ? r + i * ldr : nullptr);
  });
}

void add_bias(MatrixView c, const float* bias) {
  float* data = c.data();
  const int64_t ld = ld_of(c), cols = cols_of(c);
  for_rows(MESHTRAIN_LABEL("meshtrain::linear_add_bias"), rows_of(c),
           [=](const int64_t i) { add_bias_row(data + i * ld, cols, bias); });
}

void activate(MatrixView c, Activation activation) {
  float* data = c.data();
  const int64_t ld = ld_of(c), rows = rows_of(c), cols = cols_of(c);
  const std::string& label = MESHTRAIN_LABEL("meshtrain::infer_activation");
  const auto each_row = [&](auto row_kernel) {
    for_rows(label, rows, [=](const int64_t i) { row_kernel(data + i * ld, cols); });
  };
  switch (activation) {
    case Activation::none:
      return;
    case Activation::relu:
      return each_row(relu_row);
    case Activation::silu:
      return each_row(silu_row);
    case Activation::sigmoid:
      return each_row(sigmoid_row);
    case Activation::tanh:
      return each_row(formula_row<activation_math::Tanh>);
    case Activation::gelu:
      return each_row(formula_row<activation_math::GeluTanh>);
    case Activation::gelu_erf:
      return each_row(formula_row<activation_math::GeluErf>);
  }
}

void layernorm(ConstMatrixView x, const float* scale, const float* bias, float eps, MatrixView y) {
  layernorm_keeping(x, scale, bias, eps, y, MatrixView(), MatrixView(),
                    MESHTRAIN_LABEL("meshtrain::infer_layernorm"));
}

void rmsnorm(ConstMatrixView x, const float* scale, float eps, MatrixView y) {
  rmsnorm_keeping(x, scale, eps, y, MatrixView(), MatrixView(),
                  MESHTRAIN_LABEL("meshtrain::infer_rmsnorm"));
}

namespace {
// stats or x_hat empty: not kept (both, in layernorm() and rmsnorm(); x_hat alone, for a
// derivative forward no cotangents follow); null pointers to the row kernels.
void check_kept(ConstMatrixView x, ConstMatrixView y, ConstMatrixView stats, ConstMatrixView x_hat,
                const char* what) {
  check_same_shape(x, y, what);
  if (x_hat.data() != nullptr) check_same_shape(x, x_hat, what);
  if (stats.data() == nullptr) return;
  MESHTRAIN_REQUIRE(stats.extent(0) == x.extent(0) && stats.extent(1) == 3 && stats.stride(1) == 1,
                    what, ": statistics [", stats.extent(0), ", ", stats.extent(1), "] for ",
                    x.extent(0), " rows (3 a row expected)");
}
}  // namespace

void layernorm_keeping(ConstMatrixView x, const float* scale, const float* bias, float eps,
                       MatrixView y, MatrixView stats, MatrixView x_hat, const std::string& label) {
  check_kept(x, y, stats, x_hat, "inference::layernorm");
  const float* in = x.data();
  float* out = y.data();
  float* st = stats.data();
  float* xh = x_hat.data();
  const int64_t ldx = ld_of(x), ldy = ld_of(y), cols = cols_of(x);
  const int64_t lds = st != nullptr ? ld_of(stats) : 0, ldh = xh != nullptr ? ld_of(x_hat) : 0;
  for_rows(label, rows_of(x), [=](const int64_t i) {
    layernorm_row(in + i * ldx, out + i * ldy, cols, scale, bias, eps,
                  st != nullptr ? st + i * lds : nullptr, xh != nullptr ? xh + i * ldh : nullptr);
  });
}

void rmsnorm_keeping(ConstMatrixView x, const float* scale, float eps, MatrixView y,
                     MatrixView stats, MatrixView x_hat, const std::string& label) {
  check_kept(x, y, stats, x_hat, "inference::rmsnorm");
  const float* in = x.data();
  float* out = y.data();
  float* st = stats.data();
  float* xh = x_hat.data();
  const int64_t ldx = ld_of(x), ldy = ld_of(y), cols = cols_of(x);
  const int64_t lds = st != nullptr ? ld_of(stats) : 0, ldh = xh != nullptr ? ld_of(x_hat) : 0;
  for_rows(label, rows_of(x), [=](const int64_t i) {
    rmsnorm_row(in + i * ldx, out + i * ldy, cols, scale, eps,
                st != nullptr ? st + i * lds : nullptr, xh != nullptr ? xh + i * ldh : nullptr);
  });
}

void add(ConstMatrixView a, ConstMatrixView b, MatrixView out, const std::string& label) {
  check_same_shape(a, out, "inference::add");
  check_same_shape(b, out, "inference::add");
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.data();
  const int64_t lda = ld_of(a), ldb = ld_of(b), ldo = ld_of(out), cols = cols_of(out);
  for_rows(label, rows_of(out),
           [=](const int64_t i) { add_row(pa + i * lda, pb + i * ldb, po + i * ldo, cols); });
}

Sequence::Sequence(const std::vector<Layer*>& layers) {
  for (size_t k = 0; k < layers.size(); ++k) {
    Step step;
    step.layer = layers[k];
    auto* linear = dynamic_cast<Linear*>(layers[k]);
    if (linear != nullptr && linear->can_infer_fused()) {
      step.linear = linear;
      auto* next = k + 1 < layers.size() ? dynamic_cast<ActivationLayer*>(layers[k + 1]) : nullptr;
      if (next != nullptr && next->dtype() == Dtype::fp32) {
        step.activation = next->activation();
        ++k;  // the activation runs in the Linear layer's pass
      }
    }
    steps_.push_back(step);
  }
}

MatrixView Sequence::run(MatrixView x, const LayerPass& pass, ConstMatrixView residual,
                         MatrixView sum) const {
  MatrixView h = x;
  for (size_t k = 0; k < steps_.size(); ++k) {
    const Step& step = steps_[k];
    const bool last = k + 1 == steps_.size();
    if (step.linear != nullptr) {
      // The residual joins the GEMM of a last Linear layer without an activation after it.
      const bool takes_residual =
          last && residual.data() != nullptr && step.activation == Activation::none;
      h = step.linear->infer(h, pass, step.activation,
                             takes_residual ? residual : ConstMatrixView());
      if (takes_residual) return h;
    } else {
      h = step.layer->infer(h, pass);
    }
  }
  if (residual.data() == nullptr) return h;
  MESHTRAIN_REQUIRE(sum.data() != nullptr, "inference::Sequence: a residual without a buffer");
  add(residual, h, sum, MESHTRAIN_LABEL("meshtrain::infer_residual_add"));
  return sum;
}

}  // namespace meshtrain::inference
