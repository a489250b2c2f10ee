#pragma once
// Where a weight gradient is stored as 16 bits (issue 37 item 1, docs/mixed_precision.md "The
// cast points"): the one rule that the model (Mlp::store_gradients_16bit, layers/mlp.hpp), the
// driver (run/run_setup.cpp) and the memory plan (framework/train/memory_plan.cpp) share.
//
// A dense layer's weight gradient holds only 16-bit values when every element is written by one
// GEMM (its fp32 sum rounded to nearest even), nothing later adds to it or scales it, and a
// reduction, where there is one, sums it over a wire of those 16 bits. In a run that computes in
// bf16 and reduces over a bf16 wire (fp16 needs loss scaling, which scales the gradient), reduces
// in backward (no ZeRO-1, no gradient accumulation) and does not clip (clipping scales), where
// gemm()'s kernel writes 16 bits (gemm_to_16bit without an fp32 scratch: the CPU build with
// AVX512_BF16 or AMX; not the CUDA build yet), that is a plain MLP's Linear weight
//   - stored whole on every rank of its DP group (not gathered by FSDP, not replicated over a
//     non-batch axis, which scales it), all-reduced over the batch axes, or over none (one rank,
//     tensor parallelism without a DP axis: backward rounds it and nothing reduces it);
//   - row- or column-parallel alike: a column-parallel layer fed a replicated input and a
//     row-parallel one whose output is all-reduced write it with one GEMM; a column-parallel one
//     that gathers its input (dW_t = all_gather(X)ᵀ @ dY_t) with an all-gather-matmul whose naive
//     and ring algorithms write each row block of it with one GEMM, and a split-output
//     row-parallel layer (dW = X_cᵀ @ all_gather(dY)) with the naive one, as one GEMM on the
//     gathered dY (all_gather_matmul_to_16bit; weight_gradient_product_writes_16bit below).
// Everywhere else the gradient stays fp32: the bidirectional all-gather-matmul (its halves split
// K: each block is the sum of two GEMMs, accumulated in fp32 in the gradient itself, and no other
// fp32 buffer of that size exists), the ring one of a split-output layer (its GEMMs' 16-bit dsts
// would be row-strided column blocks, which oneDNN 2.6 writes through an fp32 accumulator of the
// block in its scratchpad: as large as what the 16 bits save), FSDP (its reduce-scatter's shard),
// a residual MLP's blocks, every bias and norm parameter (small).

#include "base/dtype.hpp"
#include "partition/collective_matmul_algorithm.hpp"
#include "partition/gathered_product.hpp"
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

// Whether a Linear's weight-gradient product writes each element with one GEMM into a dense
// 16-bit gradient, with no fp32 scratch of the gradient's size (`weight_grad`: the resolved
// algorithm of its all-gather-matmul, layer_matmul_algorithms; unused where the product is one
// GEMM). One GEMM: yes. An all-gather-matmul: as partition/gathered_product.hpp's rule says for
// its gathered dim (the rule that all_gather_matmul_to_16bit checks too): a column-parallel layer
// gathering its input, dW_t = all_gather(X)ᵀ @ dY_t, gathers M (row blocks of dW: naive and ring);
// a split-output row-parallel one, dW = X_cᵀ @ all_gather(dY), gathers N (column blocks of dW:
// naive alone). layers/linear.cpp asks this.
inline bool weight_gradient_product_writes_16bit(const LinearLayout& layout,
                                                 CollectiveMatmulAlgorithm weight_grad) {
  if (!layout.runs_collective_matmuls()) return true;
  return gathered_product_writes_16bit(
      layout.column_gathers_input() ? GatheredProductDim::m : GatheredProductDim::n, weight_grad);
}

// The per-weight part: a plain MLP's dense layer whose weight is not gathered nor replicated over
// a non-batch axis, and whose weight-gradient product writes it as 16 bits (above). The model
// (Mlp::store_gradients_16bit) and the plan (memory_plan.cpp) both pass the layer's LinearLayout
// and its algorithm, so they cannot disagree on which flags count.
inline bool stores_weight_gradient_16bit(const LinearLayout& layout,
                                         CollectiveMatmulAlgorithm weight_grad) {
  if (layout.gathers_weight() || layout.nonbatch_replication != 1) return false;
  return weight_gradient_product_writes_16bit(layout, weight_grad);
}

}  // namespace meshtrain
