#pragma once
// Dropout's mask as the float64 references of the layer tests hold it: what training pass
// (seed, step 0, micro-batch 0) multiplies element (global row, feature) of hidden layer or
// block `layer` by, from layers/dropout.hpp's key (never the layer's kernels).

#include <cstdint>

#include "layers/dropout.hpp"

namespace meshtrain::testing {

// 0 or the layer's float scale; 1 without dropout (rate 0).
inline double dropout_factor(uint64_t seed, double rate, int64_t row, int64_t feature,
                             int64_t layer) {
  if (rate == 0.0) return 1.0;
  return dropout_bits(seed, 0, 0, row, feature, layer) >= dropout_threshold(rate)
             ? static_cast<double>(dropout_scale(rate))
             : 0.0;
}

}  // namespace meshtrain::testing
