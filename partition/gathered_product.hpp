#pragma once
// Which all-gather-matmul algorithms write a 16-bit C, each element by one GEMM into a dense C with
// no fp32 scratch of C's size: the one rule that the collective matmul
// (framework/comm/collective_matmul_16bit.hpp: all_gather_matmul_writes_16bit, which
// all_gather_matmul_to_16bit checks) and a Linear's weight-gradient storage
// (partition/gradient_storage.hpp: weight_gradient_product_writes_16bit, which the model, the
// driver and the memory plan ask) both call, so that they cannot disagree.

#include "partition/collective_matmul_algorithm.hpp"

namespace meshtrain {

// The dim of the product C = op(A) @ op(B) that an all-gather-matmul's gathered blocks split: on
// the left (the gathered operand is op(A)) M (row blocks of C) or K, on the right (op(B)) K or N
// (column blocks of C).
enum class GatheredProductDim { m, n, k };

// Whether `algorithm` writes a 16-bit C with each element one GEMM's (its fp32 sum rounded to
// nearest even), into a dense C, with no fp32 scratch of C's size:
//   - never where the gathered dim is K: its blocks' products accumulate in C (in fp32);
//   - M (row blocks of C, contiguous): naive and ring, each block one GEMM;
//   - N (column blocks of C): naive alone, its blocks laid side by side into one dense operand and
//     one GEMM into the whole C. Ring would write each block by its own GEMM into a row-strided
//     16-bit dst, which oneDNN 2.6 serves with its gemm:jit kernel and an fp32 accumulator of the
//     block in its scratchpad (as large as what the 16 bits save).
// Bidirectional's halves split K; automatic must be resolved first (false).
inline bool gathered_product_writes_16bit(GatheredProductDim gathered,
                                          CollectiveMatmulAlgorithm algorithm) {
  switch (gathered) {
    case GatheredProductDim::m:
      return algorithm == CollectiveMatmulAlgorithm::naive ||
             algorithm == CollectiveMatmulAlgorithm::ring;
    case GatheredProductDim::n:
      return algorithm == CollectiveMatmulAlgorithm::naive;
    case GatheredProductDim::k:
      return false;
  }
  return false;
}

}  // namespace meshtrain
