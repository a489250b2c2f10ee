#pragma once

#include <cstdint>

namespace meshtrain {

// The largest top_k an MoE layer takes: its gate kernels keep k values per row in registers
// (layers/moe.cpp refuses more); the config refuses more too (model.top_k,
// framework/train/config_schema.cpp). Here, below both, so that they share it.
constexpr int64_t kMoeMaxTopK = 16;

}  // namespace meshtrain
