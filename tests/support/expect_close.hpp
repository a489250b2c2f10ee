#pragma once
// Comparing a result with a float64 reference element by element: every |got - ref| within
// what the test allows for that element, the first few failures named
// (expect_each_within); the common bound tolerance * (1 + |ref|), returning the largest
// difference so that tests can print it beside their tolerance (expect_close_to_reference).

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

}  // namespace meshtrain::testing
