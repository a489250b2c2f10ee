#pragma once
// The BLAS calls behind gemm() (framework/core/gemm.hpp). gemm() checks the shapes and
// the int ranges and hands over one row-major call; each backend maps it onto its library.

#include "framework/core/gemm.hpp"

namespace meshtrain::gemm_backend {

// Row-major C [m, n] = beta * C + op(A) @ op(B), op(A) [m, k], op(B) [k, n]; lda, ldb, ldc
// are the row strides of the matrices as stored. m, n, k are positive.
struct RowMajorGemm {
  bool transpose_a = false;
  bool transpose_b = false;
  int m = 0, n = 0, k = 0;
  const float* a = nullptr;
  int lda = 0;
  const float* b = nullptr;
  int ldb = 0;
  float beta = 0.0f;
  float* c = nullptr;
  int ldc = 0;
  MatmulPrecision precision = MatmulPrecision::fp32;
  Dtype inputs = Dtype::fp32;  // what A's and B's values hold (cuBLAS: 16-bit inputs)
};

// cblas_sgemm on host memory (gemm_cblas.cpp).
void host_gemm(const RowMajorGemm& call);

#if defined(KOKKOS_ENABLE_CUDA)
// cublasGemmEx on CUDA memory, on the default execution space's stream (gemm_cublas.cpp).
void cuda_gemm(const RowMajorGemm& call);
#endif

}  // namespace meshtrain::gemm_backend
