#pragma once
// The global data of the residual and MoE layer tests (residual_block, residual_mlp, moe_block),
// every value a float so that the float64 reference sees exactly what the layers see: a smooth
// wave for parameters, the inputs, and the loss sum(R * out) for fixed weights R, whose
// gradient with respect to the output is R.

#include <cmath>
#include <cstdint>
#include <vector>

namespace meshtrain::testing {

// 0.3 sin(0.7 i + 1.1 j + 0.5 k): element (i, j) of parameter k (a vector's elements at i = 0),
// before the float rounding the tests apply.
inline double parameter_wave(int k, int64_t i, int64_t j) {
  return 0.3 * std::sin(0.7 * i + 1.1 * j + 0.5 * k);
}

// Input x[r, c]: O(1), varied, offset from zero.
inline double model_input(int64_t r, int64_t c) {
  return static_cast<float>(1.5 * std::cos(0.37 * r + 0.91 * c) + 0.2);
}

// R[r, c], the weight of output (r, c) in the loss.
inline double loss_weight(int64_t r, int64_t c) {
  return static_cast<float>(std::sin(0.53 * r - 0.29 * c + 0.1));
}

// sum(R * out) over a full output [rows, out.size() / rows].
inline double weighted_loss(const std::vector<double>& out, int64_t rows) {
  double l = 0.0;
  const int64_t outputs = static_cast<int64_t>(out.size()) / rows;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < outputs; ++c) l += loss_weight(r, c) * out[r * outputs + c];
  return l;
}

}  // namespace meshtrain::testing
