#pragma once
// Whether gemm()'s kernel itself reads 16-bit operands as stored (framework/core/gemm.hpp): a
// header of its own so that the few places that size buffers by it (layers/sharded_parameter.cpp,
// framework/train/memory_plan.cpp) do not make every user of gemm.hpp depend on it.

#include "base/dtype.hpp"

namespace meshtrain {

// gemm_reads_16bit(inputs) without MESHTRAIN_GEMM_16BIT_OPERANDS=always, under which an fp32
// kernel is handed 16-bit operands and gemm() widens them into its own fp32 scratch. Where the
// kernel reads them as stored (oneDNN's bf16 matmul on a CPU with AVX512_BF16 or AMX; cuBLAS), a
// 16-bit operand needs no fp32 buffer anywhere: the shared weight scratch of a model whose
// weights have 16-bit copies is 2 bytes an element (docs/mixed_precision.md).
bool gemm_kernel_reads_16bit(Dtype inputs);

}  // namespace meshtrain
