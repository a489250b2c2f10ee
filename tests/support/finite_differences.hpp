#pragma once
// Central differences in float64, for checking the hand-derived backward of a test's float64
// reference against its own forward: the one way such a reference's gradient is shown to be
// the derivative of the function it claims to differentiate.
//
//   numeric[k][i] = (loss(values + h e_ki) - loss(values - h e_ki)) / (2 h)
//
// Its error is truncation, h^2 / 6 * |loss'''|, plus the float64 rounding of the two losses,
// about eps * sum|terms of the loss| / h (eps = 2^-53 ~ 1.1e-16): with h = 1e-5 and losses
// that are sums of a few hundred terms of O(1) with third derivatives of O(10), both are
// below 1e-8. Each test states its step and tolerance at its call.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace meshtrain::testing {

using Tensors = std::vector<std::vector<double>>;

// d loss / d values[k][i] by central differences with step h, for every `stride`-th element of
// each tensor (the others NaN: not checked).
inline Tensors central_differences(Tensors values,
                                   const std::function<double(const Tensors&)>& loss, double h,
                                   size_t stride = 1) {
  Tensors numeric;
  for (size_t k = 0; k < values.size(); ++k) {
    numeric.emplace_back(values[k].size(), std::numeric_limits<double>::quiet_NaN());
    for (size_t i = 0; i < values[k].size(); i += stride) {
      const double v = values[k][i];
      values[k][i] = v + h;
      const double plus = loss(values);
      values[k][i] = v - h;
      const double minus = loss(values);
      values[k][i] = v;
      numeric[k][i] = (plus - minus) / (2 * h);
    }
  }
  return numeric;
}

// The largest |numeric - analytic| / (1 + |analytic|) over the elements numeric holds.
inline double largest_difference(const Tensors& numeric, const Tensors& analytic) {
  double worst = 0.0;
  for (size_t k = 0; k < numeric.size() && k < analytic.size(); ++k) {
    for (size_t i = 0; i < numeric[k].size() && i < analytic[k].size(); ++i) {
      if (std::isnan(numeric[k][i])) continue;
      worst = std::max(worst,
                       std::abs(numeric[k][i] - analytic[k][i]) / (1.0 + std::abs(analytic[k][i])));
    }
  }
  return worst;
}

// Expects every checked element within tolerance * (1 + |analytic|), naming the tensor
// (names[k]) and element of the first few that are not; returns largest_difference.
inline double expect_matches_central_differences(const Tensors& numeric, const Tensors& analytic,
                                                 double tolerance,
                                                 const std::vector<std::string>& names) {
  EXPECT_EQ(numeric.size(), analytic.size());
  for (size_t k = 0; k < numeric.size() && k < analytic.size(); ++k) {
    EXPECT_EQ(numeric[k].size(), analytic[k].size()) << names.at(k);
    int reported = 0;
    for (size_t i = 0; i < numeric[k].size() && i < analytic[k].size(); ++i) {
      if (std::isnan(numeric[k][i])) continue;
      const double d = std::abs(numeric[k][i] - analytic[k][i]);
      if (d > tolerance * (1.0 + std::abs(analytic[k][i])) && reported++ < 5) {
        ADD_FAILURE() << names.at(k) << "[" << i << "]: reference gradient " << analytic[k][i]
                      << ", central difference " << numeric[k][i];
      }
    }
  }
  return largest_difference(numeric, analytic);
}

}  // namespace meshtrain::testing
