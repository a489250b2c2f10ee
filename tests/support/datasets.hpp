#pragma once
// Small in-memory datasets whose values tell the row (framework/io/data.hpp's Dataset), for the
// data, training and prediction tests: classification sets and a regression set.

#include <cstdint>

#include "framework/io/data.hpp"

namespace meshtrain::testing {

// A classification set whose values tell the row: x[s, c] = s + c / 64 (exact in float32
// for s < 2^17), label a hash of s mod classes.
inline Dataset numbered_classes(int64_t n, int64_t features, int64_t classes) {
  Dataset d;
  d.description = "numbered classification set";
  d.num_samples = n;
  d.features = features;
  d.num_classes = classes;
  d.inputs.resize(static_cast<size_t>(n * features));
  d.labels.resize(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t c = 0; c < features; ++c) {
      d.inputs[s * features + c] = static_cast<float>(s) + static_cast<float>(c) / 64.0f;
    }
    d.labels[s] = static_cast<int32_t>(((s * 2654435761u) >> 7) % classes);
  }
  return d;
}

// Inputs that look like real data (in [0, 1), varied), for training runs.
inline Dataset varied_classes(int64_t n, int64_t features, int64_t classes) {
  Dataset d = numbered_classes(n, features, classes);
  d.description = "varied classification set";
  for (size_t i = 0; i < d.inputs.size(); ++i) {
    d.inputs[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
  }
  return d;
}

// A regression set: x as numbered_classes, targets[s, o] = s / 8 - o.
inline Dataset numbered_targets(int64_t n, int64_t features, int64_t width) {
  Dataset d = numbered_classes(n, features, 1);
  d.description = "numbered regression set";
  d.num_classes = 0;
  d.labels.clear();
  d.target_width = width;
  d.targets.resize(static_cast<size_t>(n * width));
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t o = 0; o < width; ++o) {
      d.targets[s * width + o] = static_cast<float>(s) / 8.0f - static_cast<float>(o);
    }
  }
  return d;
}

}  // namespace meshtrain::testing
