#include "layers/inference.hpp"

#include <cmath>
#include <cstring>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "layers/activation.hpp"
#include "layers/layer.hpp"
#include "layers/linear.hpp"

// One copy of each kernel per instruction set, picked by the loader (GCC; elsewhere the
// baseline only).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__)
#define MESHTRAIN_HOST_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define MESHTRAIN_INLINE inline __attribute__((always_inline))
#else
#define MESHTRAIN_HOST_CLONES
#define MESHTRAIN_INLINE inline
#endif

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

MESHTRAIN_HOST_CLONES
void silu_rows(float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict row = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) row[j] = row[j] * sigmoid(row[j]);
  }
}

MESHTRAIN_HOST_CLONES
void sigmoid_rows(float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict row = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) row[j] = sigmoid(row[j]);
  }
}

MESHTRAIN_HOST_CLONES
void relu_rows(float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict row = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) row[j] = row[j] > 0.0f ? row[j] : 0.0f;
  }
}

// The activations without a vectorized form here: activation_math's formulas (libm).
template <class Op>
void formula_rows(float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) row[j] = Op::value(row[j]);
  }
}

MESHTRAIN_HOST_CLONES
void fill_rows(float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias,
               const float* residual, int64_t ldr) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict row = c + i * ldc;
    if (residual != nullptr) {
      const float* __restrict r = residual + i * ldr;
      for (int64_t j = 0; j < cols; ++j) row[j] = r[j] + bias[j];
    } else {
      for (int64_t j = 0; j < cols; ++j) row[j] = bias[j];
    }
  }
}

MESHTRAIN_HOST_CLONES
void add_rows(const float* a, int64_t lda, const float* b, int64_t ldb, float* out, int64_t ldo,
              int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* __restrict ai = a + i * lda;
    const float* __restrict bi = b + i * ldb;
    float* __restrict oi = out + i * ldo;
    for (int64_t j = 0; j < cols; ++j) oi[j] = ai[j] + bi[j];
  }
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

MESHTRAIN_HOST_CLONES
void layernorm_rows(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows, int64_t cols,
                    const float* scale, const float* bias, float eps) {
  const float n = static_cast<float>(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float* __restrict xi = x + i * ldx;
    float* __restrict yi = y + i * ldy;
    const float m0 = lane_sum(xi, cols, [](float v) { return v; }) / n;
    const float a = lane_sum(xi, cols, [m0](float v) { return v - m0; });
    const float b = lane_sum(xi, cols, [m0](float v) { return (v - m0) * (v - m0); });
    const float delta = a / n;
    const float var = b / n - delta * delta;
    const float rstd = 1.0f / std::sqrt((var > 0.0f ? var : 0.0f) + eps);
    for (int64_t j = 0; j < cols; ++j) {
      yi[j] = ((xi[j] - m0) - delta) * rstd * scale[j] + bias[j];
    }
  }
}

MESHTRAIN_HOST_CLONES
void rmsnorm_rows(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows, int64_t cols,
                  const float* scale, float eps) {
  const float n = static_cast<float>(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float* __restrict xi = x + i * ldx;
    float* __restrict yi = y + i * ldy;
    const float ss = lane_sum(xi, cols, [](float v) { return v * v; });
    const float rstd = 1.0f / std::sqrt(ss / n + eps);
    for (int64_t j = 0; j < cols; ++j) yi[j] = xi[j] * rstd * scale[j];
  }
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

void fill_bias(MatrixView c, const float* bias, ConstMatrixView residual) {
  static_assert(kHostKernels || true, "");
  if (residual.data() != nullptr) check_same_shape(residual, c, "inference::fill_bias");
  fill_rows(c.data(), ld_of(c), rows_of(c), cols_of(c), bias, residual.data(),
            residual.data() != nullptr ? ld_of(residual) : 0);
}

void activate(MatrixView c, Activation activation) {
  float* data = c.data();
  const int64_t ld = ld_of(c), rows = rows_of(c), cols = cols_of(c);
  switch (activation) {
    case Activation::none:
      return;
    case Activation::relu:
      return relu_rows(data, ld, rows, cols);
    case Activation::silu:
      return silu_rows(data, ld, rows, cols);
    case Activation::sigmoid:
      return sigmoid_rows(data, ld, rows, cols);
    case Activation::tanh:
      return formula_rows<activation_math::Tanh>(data, ld, rows, cols);
    case Activation::gelu:
      return formula_rows<activation_math::GeluTanh>(data, ld, rows, cols);
    case Activation::gelu_erf:
      return formula_rows<activation_math::GeluErf>(data, ld, rows, cols);
  }
}

void layernorm(ConstMatrixView x, const float* scale, const float* bias, float eps, MatrixView y) {
  check_same_shape(x, y, "inference::layernorm");
  layernorm_rows(x.data(), ld_of(x), y.data(), ld_of(y), rows_of(x), cols_of(x), scale, bias, eps);
}

void rmsnorm(ConstMatrixView x, const float* scale, float eps, MatrixView y) {
  check_same_shape(x, y, "inference::rmsnorm");
  rmsnorm_rows(x.data(), ld_of(x), y.data(), ld_of(y), rows_of(x), cols_of(x), scale, eps);
}

void add(ConstMatrixView a, ConstMatrixView b, MatrixView out) {
  check_same_shape(a, out, "inference::add");
  check_same_shape(b, out, "inference::add");
  add_rows(a.data(), ld_of(a), b.data(), ld_of(b), out.data(), ld_of(out), rows_of(out),
           cols_of(out));
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
  add(residual, h, sum);
  return sum;
}

}  // namespace meshtrain::inference
