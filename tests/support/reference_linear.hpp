#pragma once
// A Linear layer in float64, one row at a time: y = x W + b for W [in, out] (row-major) and its
// backward, which returns dx = W dy and adds x ⊗ dy and dy to the weight's and the bias's
// gradients. With ReferenceParam, the value and the gradient of one parameter of a test's
// float64 reference (the layer tests' references are written with these, never layer code).

#include <cstddef>
#include <cstdint>
#include <vector>

namespace meshtrain::testing {

using Vec = std::vector<double>;

// One parameter of a float64 reference: its values and the gradient backward accumulates.
struct ReferenceParam {
  std::vector<double> value, grad;
};

// y = x W + b for W [x.size(), out] at w; b may be null (no bias).
inline Vec affine(const Vec& x, const double* w, const double* b, int64_t out) {
  Vec y(static_cast<size_t>(out), 0.0);
  for (int64_t j = 0; j < out; ++j) y[j] = b ? b[j] : 0.0;
  for (size_t c = 0; c < x.size(); ++c)
    for (int64_t j = 0; j < out; ++j) y[j] += x[c] * w[c * out + j];
  return y;
}
// The same for whole parameters: out = b.size().
inline Vec affine(const Vec& x, const std::vector<double>& w, const std::vector<double>& b) {
  return affine(x, w.data(), b.data(), static_cast<int64_t>(b.size()));
}
inline Vec affine(const Vec& x, const ReferenceParam& w, const ReferenceParam& b) {
  return affine(x, w.value, b.value);
}

// Adds x ⊗ dy to gw and dy to gb (when not null); returns dx = W dy.
inline Vec affine_backward(const Vec& x, const double* w, double* gw, double* gb, const Vec& dy) {
  const size_t out = dy.size();
  Vec dx(x.size(), 0.0);
  for (size_t c = 0; c < x.size(); ++c) {
    for (size_t j = 0; j < out; ++j) {
      dx[c] += dy[j] * w[c * out + j];
      gw[c * out + j] += x[c] * dy[j];
    }
  }
  if (gb) {
    for (size_t j = 0; j < out; ++j) gb[j] += dy[j];
  }
  return dx;
}
inline Vec affine_backward(const Vec& x, const std::vector<double>& w, std::vector<double>& gw,
                           std::vector<double>& gb, const Vec& dy) {
  return affine_backward(x, w.data(), gw.data(), gb.data(), dy);
}
inline Vec affine_backward(const Vec& x, ReferenceParam& w, ReferenceParam& b, const Vec& dy) {
  return affine_backward(x, w.value, w.grad, b.grad, dy);
}

}  // namespace meshtrain::testing
