#pragma once
// The size cap of a DP gradient bucket ([runtime] gradient_bucket_mb, PyTorch DDP's
// bucket_cap_mb) in elements: the rule the buckets (layers/gradient_buckets.cpp) and the plan's
// cost of them (partition/cost_model.cpp, gradient_bucket_elements) share, so that the plan
// charges the buckets the step cuts.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "base/error.hpp"

namespace meshtrain {

// At least one element, at most what one MPI call takes; a bucket holds 4-byte elements as
// counted (a 16-bit wire sends half the bytes, the same elements).
inline int64_t gradient_bucket_cap_elements(double bucket_mb) {
  MESHTRAIN_REQUIRE(bucket_mb > 0 && std::isfinite(bucket_mb),
                    "gradient buckets: bucket_mb must be positive, got ", bucket_mb);
  const double cap = std::floor(bucket_mb * 1024.0 * 1024.0 / 4.0);
  return static_cast<int64_t>(std::max(1.0, std::min(cap, static_cast<double>(INT_MAX))));
}

}  // namespace meshtrain
