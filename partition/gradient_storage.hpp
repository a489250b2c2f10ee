#pragma once
// Where a weight gradient is stored as 16 bits (issue 37 item 1, docs/mixed_precision.md "The
// cast points"): the one rule that the model (Mlp::store_gradients_16bit, layers/mlp.hpp), the
// driver (run/run_setup.cpp) and the memory plan (framework/train/memory_plan.cpp) share.
//
// A dense layer's weight gradient holds only 16-bit values when it is written by one GEMM whose
// result the reduction rounds to the wire's 16 bits before anything reads it, and nothing later
// adds to it or scales it. That is a plain MLP's Linear weight with DP storage (not gathered by
// FSDP, not split by tensor parallelism, all-reduced over batch axes of 2 or more ranks) when the
// model computes in bf16 and reduces over a bf16 wire (fp16 needs loss scaling, which scales the
// gradient), the gradients are reduced in backward (no ZeRO-1, no gradient accumulation) and not
// clipped (clipping scales them), where gemm()'s kernel writes 16 bits (gemm_to_16bit without an
// fp32 scratch: the CPU build with AVX512_BF16 or AMX; not the CUDA build yet). Everywhere else
// the gradient stays fp32: at one rank (no reduction: its gradient is rounded to bf16 all the
// same, but this first cut keeps fp32 there), under FSDP (its reduce-scatter's shard), under TP,
// in a residual MLP's blocks, for every bias and norm parameter (small).

#include "base/dtype.hpp"
#include "partition/linear_layout.hpp"

namespace meshtrain {

struct GradientStorageQuery {
  MixedPrecision precision;
  bool kernel_writes_16bit = false;  // gemm_kernel_writes_16bit(precision.param)
  bool reduced_in_backward = false;  // GradientReduction::in_backward
  bool clipped = false;              // optimizer.clip_norm > 0
};

// The run-wide part of the rule: whether any weight gradient may be stored as 16 bits (then the
// format), else fp32.
inline Dtype weight_gradient_storage(const GradientStorageQuery& q) {
  const bool sixteen = q.precision.param == Dtype::bf16 && q.precision.reduce == Dtype::bf16 &&
                       q.kernel_writes_16bit && q.reduced_in_backward && !q.clipped;
  return sixteen ? Dtype::bf16 : Dtype::fp32;
}

// The per-weight part: a plain MLP's dense layer whose weight is stored whole on every rank of
// its DP group (not gathered, neither row- nor column-parallel: Linear's backward writes a 16-bit
// gradient only for a whole, unsplit compute block) and all-reduced over `dp_ranks` >= 2. The
// model (Mlp::store_gradients_16bit) and the plan (memory_plan.cpp) both pass the layer's
// LinearLayout, so they cannot disagree on which flags count.
inline bool stores_weight_gradient_16bit(const LinearLayout& layout, int dp_ranks) {
  return !layout.gathers_weight() && !layout.tensor_parallel && !layout.column_parallel &&
         dp_ranks >= 2;
}

}  // namespace meshtrain
