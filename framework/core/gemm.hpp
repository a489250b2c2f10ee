#pragma once
// The one GEMM of meshtrain: C = beta * C + op(A) @ op(B) on views in the default memory
// space, with transposes as flags (never materialized). The implementation follows the
// memory space: CBLAS (OpenBLAS) on host memory, cuBLAS on CUDA memory (one handle, on
// the stream of Kokkos' default execution space, made on first use and destroyed by
// Kokkos::finalize).
//
//   gemm(plain(x), plain(w), 0.0f, y);           // y = x @ w
//   gemm(transposed(x), plain(dy), 0.0f, dw);    // dw = xᵀ @ dy
//
// Views may be row-strided (a column block of a wider matrix); any extents are accepted,
// empty ones included. Shapes that do not chain are bad_input naming them.

#include <cstddef>
#include <string>

#include "framework/core/choices.hpp"
#include "framework/core/views.hpp"
#include "base/dtype.hpp"

namespace meshtrain {

// A GEMM operand as stored, and whether the GEMM uses its transpose.
struct GemmOperand {
  ConstMatrixView matrix;
  bool transpose = false;
};
inline GemmOperand plain(ConstMatrixView m) {
  return {m, false};
}
inline GemmOperand transposed(ConstMatrixView m) {
  return {m, true};
}
// Rows (dim 0) and columns (dim 1) of op(X).
inline std::size_t op_rows(const GemmOperand& x) {
  return x.matrix.extent(x.transpose ? 1 : 0);
}
inline std::size_t op_cols(const GemmOperand& x) {
  return x.matrix.extent(x.transpose ? 0 : 1);
}

// How float GEMMs may round (MatmulPrecision, framework/core/choices.hpp), as
// torch.backends.cuda.matmul.allow_tf32: fp32 computes in full float precision (the
// default, as in PyTorch); tf32 lets cuBLAS use TF32 tensor cores (10-bit mantissa
// inputs, float accumulation). On host memory both compute in fp32.
// Process-wide, like PyTorch's setting: every later gemm() uses it.
void set_matmul_precision(MatmulPrecision precision);
MatmulPrecision matmul_precision();

// `inputs`: the dtype the operands' values hold (mixed precision, docs/mixed_precision.md).
// On CUDA memory bf16/fp16 operands are copied to 16 bits (scratch made on first use and
// kept) and multiplied by cublasGemmEx with 16-bit inputs and CUBLAS_COMPUTE_32F (tensor
// cores, fp32 accumulation, C in fp32). On host memory cblas_sgemm multiplies them as they
// are: fp32 products of the same values (Debian's OpenBLAS has no cblas_sbgemm).
void gemm(GemmOperand a, GemmOperand b, float beta, MatrixView c, Dtype inputs = Dtype::fp32);

}  // namespace meshtrain
