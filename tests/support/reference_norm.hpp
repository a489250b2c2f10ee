#pragma once
// LayerNorm and RMSNorm in float64, one row at a time, as docs/models.md writes them (PyTorch's
// formulas: two-pass statistics, biased variance): y = x_hat * scale (+ bias), with
// x_hat = (x - mean) * rstd for LayerNorm (eps kLayerNormEps) and x * rstd for RMSNorm
// (eps kRmsNormEps, no mean, no bias). The backward returns dx and adds the scale's and the
// bias's gradients.

#include <cmath>
#include <cstddef>

#include "partition/norm_layout.hpp"
#include "tests/support/reference_linear.hpp"

namespace meshtrain::testing {

// What the backward needs from the forward.
struct NormCache {
  Vec x_hat;
  double rstd = 0.0;
};

// LayerNorm when bias is given, RMSNorm when it is null.
inline Vec norm_forward(const Vec& x, const ReferenceParam& scale, const ReferenceParam* bias,
                        NormCache& c) {
  const double n = static_cast<double>(x.size());
  double mean = 0.0;
  if (bias) {
    for (double v : x) mean += v / n;
  }
  double second = 0.0;
  for (double v : x) second += (v - mean) * (v - mean);
  c.rstd = 1.0 / std::sqrt(second / n + (bias ? kLayerNormEps : kRmsNormEps));
  c.x_hat.assign(x.size(), 0.0);
  Vec y(x.size());
  for (size_t j = 0; j < x.size(); ++j) {
    c.x_hat[j] = (x[j] - mean) * c.rstd;
    y[j] = c.x_hat[j] * scale.value[j] + (bias ? bias->value[j] : 0.0);
  }
  return y;
}

inline Vec norm_backward(const NormCache& c, ReferenceParam& scale, ReferenceParam* bias,
                         const Vec& dy) {
  const double n = static_cast<double>(dy.size());
  Vec g(dy.size());
  double sum_g = 0.0, sum_gx = 0.0;
  for (size_t j = 0; j < dy.size(); ++j) {
    g[j] = dy[j] * scale.value[j];
    sum_g += g[j];
    sum_gx += g[j] * c.x_hat[j];
    scale.grad[j] += dy[j] * c.x_hat[j];
    if (bias) bias->grad[j] += dy[j];
  }
  Vec dx(dy.size());
  for (size_t j = 0; j < dy.size(); ++j) {
    dx[j] = c.rstd * (g[j] - (bias ? sum_g / n : 0.0) - c.x_hat[j] * sum_gx / n);
  }
  return dx;
}

}  // namespace meshtrain::testing
