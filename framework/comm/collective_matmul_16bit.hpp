#pragma once
// all_gather_matmul with a 16-bit C (framework/comm/collective_matmul.hpp has the operands, the
// sides and the algorithms): C = op(A_full) @ op(B) or op(A) @ op(B_full) written as 16 bits of
// `wire` (bf16 or fp16) by gemm_to_16bit (each element its fp32 sum rounded to nearest even: the
// bits of all_gather_matmul's fp32 C rounded, where the same GEMM kernel runs). C must be
// contiguous (a layer's whole weight gradient), and each element is written by one GEMM with no
// fp32 scratch of C's size, which all_gather_matmul_writes_16bit() tells:
//   - never where the gathered dim is K (its blocks accumulate in C);
//   - the gathered operand on the left (its blocks are row blocks of C, contiguous): naive and
//     ring, as all_gather_matmul runs them;
//   - on the right (column blocks of C): naive alone, the blocks gathered and laid side by side
//     into one dense operand in the workspace (2n blocks where all_gather_matmul's naive holds n)
//     and one GEMM into the whole C. Written block by block, each GEMM's dst would be a row-strided
//     block, for which oneDNN 2.6 takes its gemm:jit kernel with an fp32 accumulator of the block
//     in its scratchpad; ring writes such blocks, bidirectional splits K.
// Elsewhere MESHTRAIN_FAIL. A separate header so that the layers' headers, which include
// collective_matmul.hpp, do not change with it. The rule of partition/gradient_storage.hpp
// (weight_gradient_product_writes_16bit) says the same for a Linear's weight gradient.

#include "framework/comm/collective_matmul.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {

bool all_gather_matmul_writes_16bit(GatherSide side, int gather_dim, bool gathered_transposed,
                                    CollectiveMatmulAlgorithm algorithm);

void all_gather_matmul_to_16bit(Communicator& comm, GatherSide side, int gather_dim, GemmOperand a,
                                GemmOperand b, HalfMatrixView c,
                                CollectiveMatmulAlgorithm algorithm,
                                CollectiveMatmulWorkspace& workspace, Dtype wire);

}  // namespace meshtrain
