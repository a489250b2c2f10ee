#pragma once
// Comparing a result with a float64 reference element by element: every |got - ref| within
// what the test allows for that element, the first few failures named
// (expect_each_within); the common bound tolerance * (1 + |ref|), returning the largest
// difference so that tests can print it beside their tolerance (expect_close_to_reference);
// or tolerance * max |ref| over the tensor (expect_close_scaled).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace meshtrain::testing {

// Expects |got[i] - ref[i]| <= allowed(i) for every i (NaN fails) and the sizes equal; returns
// whether the sizes were.
template <class Allowed>
bool expect_each_within(const std::vector<double>& got, const std::vector<double>& ref,
                        Allowed&& allowed, const std::string& what) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  if (got.size() != ref.size()) return false;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = allowed(i);
    if (!(std::abs(got[i] - ref[i]) <= bound) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << ", reference " << ref[i]
                    << " (allowed difference " << bound << ")";
    }
  }
  return true;
}

// |got - ref| <= tolerance * (1 + |ref|) for every element. Returns the largest
// |got - ref| / (1 + |ref|) (infinity when the sizes differ).
inline double expect_close_to_reference(const std::vector<double>& got,
                                        const std::vector<double>& ref, double tolerance,
                                        const std::string& what) {
  const auto scale = [&](size_t i) { return 1.0 + std::abs(ref[i]); };
  if (!expect_each_within(
          got, ref, [&](size_t i) { return tolerance * scale(i); }, what)) {
    return INFINITY;
  }
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - ref[i]) / scale(i));
  }
  return worst;
}

// max |got - ref| / max |ref| over the elements both have, the scale at least `floor`.
inline double scaled_difference(const std::vector<double>& got, const std::vector<double>& ref,
                                double floor = 1e-30) {
  double scale = floor, worst = 0.0;
  for (double v : ref) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    worst = std::max(worst, std::abs(got[i] - ref[i]) / scale);
  }
  return worst;
}

// |got - ref| <= tolerance * max |ref| elementwise, the sizes equal; returns the largest such
// ratio (scaled_difference). floor: the least scale (for a reference that is 0 throughout, as
// relu's d2u). The derivative tests' comparison (layers/sobolev*_test, physics*_test).
inline double expect_close_scaled(const std::vector<double>& got, const std::vector<double>& ref,
                                  double tolerance, const std::string& what, double floor = 1e-30) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  const double worst = scaled_difference(got, ref, floor);
  EXPECT_LE(worst, tolerance) << what << ": largest |got - ref| / max |ref| " << worst;
  return worst;
}

}  // namespace meshtrain::testing
