#pragma once
// Which weights keep a 16-bit compute copy under mixed precision's 16-bit storage
// (docs/mixed_precision.md, "Compute and memory on this build"): the one condition the model
// (layers/mlp.cpp) and the memory plan (framework/train/memory_plan.cpp) share.

#include "partition/linear_layout.hpp"

namespace meshtrain {

// A weight gathered over exactly one group of axes (FSDP): its 16-bit copy, written by the
// optimizer, is what the gather moves (blocking or prefetched). A weight stored whole (DP, one
// rank) is rounded from its master into the fp32 buffer the GEMM reads, as its copy would be
// widened into it, so a copy would cost 2 bytes a parameter and save no pass (until a GEMM reads
// 16 bits); a weight gathered over two groups is gathered from its master.
inline bool keeps_16bit_weight_copy(const LinearLayout& layout) {
  return layout.weight_gather_dim0.empty() != layout.weight_gather_dim1.empty();
}

}  // namespace meshtrain
