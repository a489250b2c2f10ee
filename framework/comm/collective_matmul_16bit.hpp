#pragma once
// all_gather_matmul with a 16-bit C (framework/comm/collective_matmul.hpp has the operands, the
// sides and the algorithms): C = op(A_full) @ op(B) or op(A) @ op(B_full) written as 16 bits of
// `wire` (bf16 or fp16) by gemm_to_16bit, each element its fp32 sum rounded to nearest even. Where
// the gathered operand is on the left, each row block of C is the GEMM all_gather_matmul runs for
// it, with a 16-bit dst; on the right (naive) one GEMM writes all of C where all_gather_matmul runs
// one per column block. The bits are those of all_gather_matmul's fp32 C rounded only where the
// 16-bit-dst GEMM sums K in the same order as the fp32-dst one: tests/comm/collective_matmul_test
// .cpp finds them equal for K <= 16 (every side and algorithm) and at K 512 and 777 on the right;
// at K 2048 (on this build machine's oneDNN 2.6 bf16 matmul: from K 1536 once N >= 128, one GEMM
// alike) 1 or 2 elements in 24576 differ by one ulp, within the bound of two fp32 sums of the same
// products in different orders, which that test checks. C must be contiguous (a layer's whole
// weight gradient), and each element is written by one GEMM with no fp32 scratch of C's size, which
// all_gather_matmul_writes_16bit() tells, from the gathered dim of the product
// (partition/gathered_product.hpp's rule, which a Linear's weight-gradient storage shares):
//   - never where the gathered dim is K (its blocks accumulate in C);
//   - the gathered operand on the left (its blocks are row blocks of C, contiguous): naive and
//     ring, as all_gather_matmul runs them;
//   - on the right (column blocks of C): naive alone, the blocks gathered and laid side by side
//     into one dense operand in the workspace (2n blocks where all_gather_matmul's naive holds n)
//     and one GEMM into the whole C. Written block by block, each GEMM's dst would be a row-strided
//     block, for which oneDNN 2.6 takes its gemm:jit kernel with an fp32 accumulator of the block
//     in its scratchpad; ring writes such blocks, bidirectional splits K.
// Elsewhere MESHTRAIN_FAIL. A separate header so that the layers' headers, which include
// collective_matmul.hpp, do not change with it.

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
