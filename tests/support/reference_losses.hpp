#pragma once
// The losses in float64 over a batch of model outputs y [rows, width] (row-major), as
// docs/model_math.md writes them: the mean over rows of the squared error summed over the
// outputs (mse, against targets [rows, width]) or of softmax cross-entropy (against integer
// labels [rows]), and the gradient d loss / dy: 2 (y - t) / rows, or (softmax(y) - onehot) /
// rows. What the tests' references end in.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "framework/core/choices.hpp"

namespace meshtrain::testing {

// The loss; fills dy (resized to y's size).
inline double mean_loss_and_gradient(LossKind kind, const std::vector<double>& y, int64_t rows,
                                     int64_t width, const std::vector<double>& targets,
                                     const std::vector<int32_t>& labels, std::vector<double>& dy) {
  dy.assign(y.size(), 0.0);
  double loss = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (kind == LossKind::mse) {
      for (int64_t j = 0; j < width; ++j) {
        const double d = y[i * width + j] - targets[i * width + j];
        loss += d * d;
        dy[i * width + j] = 2 * d / rows;
      }
    } else {
      double mx = y[i * width];
      for (int64_t j = 1; j < width; ++j) mx = std::max(mx, y[i * width + j]);
      double s = 0;
      for (int64_t j = 0; j < width; ++j) s += std::exp(y[i * width + j] - mx);
      loss += std::log(s) + mx - y[i * width + labels[i]];
      for (int64_t j = 0; j < width; ++j) {
        dy[i * width + j] = (std::exp(y[i * width + j] - mx) / s - (j == labels[i])) / rows;
      }
    }
  }
  return loss / rows;
}

// A loss with float targets (mse, huber, mae, binary_cross_entropy) as docs/model_math.md
// writes it: the mean over rows of the sum over outputs of weights[j] * term, term = d^2,
// huber's 0.5 d^2 (|d| <= delta) or delta (|d| - 0.5 delta), |d|, or log(1 + e^y) - y t;
// dy = weights[j] * term' / rows, with huber's term' = clamp(d, -delta, delta), mae's sign(d)
// (0 at d = 0) and binary cross-entropy's sigmoid(y) - t. d = y - t. Empty weights: all 1.
inline double regression_loss_and_gradient(LossKind kind, const std::vector<double>& y,
                                           int64_t rows, int64_t width,
                                           const std::vector<double>& targets, double delta,
                                           const std::vector<double>& weights,
                                           std::vector<double>& dy) {
  dy.assign(y.size(), 0.0);
  double loss = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const double w = weights.empty() ? 1.0 : weights[j];
      const double d = y[i * width + j] - targets[i * width + j];
      const double a = std::abs(d);
      double term = 0, slope = 0;
      if (kind == LossKind::mse) {
        term = d * d;
        slope = 2 * d;
      } else if (kind == LossKind::huber) {
        term = a <= delta ? 0.5 * d * d : delta * (a - 0.5 * delta);
        slope = std::clamp(d, -delta, delta);
      } else if (kind == LossKind::mae) {
        term = a;
        slope = d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0);
      } else {  // binary_cross_entropy
        const double z = y[i * width + j], t = targets[i * width + j];
        term = std::log1p(std::exp(-std::abs(z))) + std::max(z, 0.0) - z * t;
        slope = 1.0 / (1.0 + std::exp(-z)) - t;
      }
      loss += w * term;
      dy[i * width + j] = w * slope / rows;
    }
  }
  return loss / rows;
}

}  // namespace meshtrain::testing
