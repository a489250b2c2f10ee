#pragma once
// all_gather_matmul with a 16-bit C (framework/comm/collective_matmul.hpp has the operands, the
// sides and the algorithms): C = op(A_full) @ op(B) or op(A) @ op(B_full) written as 16 bits of
// `wire` (bf16 or fp16), each block of C by one gemm_to_16bit (its fp32 sum rounded to nearest
// even: the bits of all_gather_matmul's fp32 C rounded, where gemm_to_16bit's kernel writes 16
// bits). Only where no block of C accumulates over pieces of K: the naive and ring algorithms
// when the gathered dim is not K (a layer's weight gradient, dW = X_cᵀ @ all_gather(dY) or
// all_gather(X)ᵀ @ dY_t); bidirectional splits K in halves (and `automatic` may choose it), so
// callers pass the resolved algorithm and this throws (MESHTRAIN_FAIL) for bidirectional,
// automatic or a gathered K. A separate header so that the layers' headers, which include
// collective_matmul.hpp, do not change with it.

#include "framework/comm/collective_matmul.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {

void all_gather_matmul_to_16bit(Communicator& comm, GatherSide side, int gather_dim, GemmOperand a,
                                GemmOperand b, HalfMatrixView c,
                                CollectiveMatmulAlgorithm algorithm,
                                CollectiveMatmulWorkspace& workspace, Dtype wire);

}  // namespace meshtrain
