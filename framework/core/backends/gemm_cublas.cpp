// Built only when Kokkos has CUDA (framework/CMakeLists.txt).
#include <cublas_v2.h>

#include <Kokkos_Core.hpp>

#include "framework/core/backends/gemm_backend.hpp"
#include "partition/error.hpp"

namespace meshtrain::gemm_backend {

namespace {

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    MESHTRAIN_FAIL("gemm: ", call, " failed: ", cublasGetStatusString(status));
  }
}

// One handle for the process, bound to the stream of Kokkos' default execution space so
// GEMMs are ordered with meshtrain's kernels without a fence. Made on first use (outside
// the steady state of a training step); Kokkos::finalize destroys it.
cublasHandle_t the_handle = nullptr;

cublasHandle_t handle() {
  if (the_handle == nullptr) {
    cublasHandle_t made = nullptr;
    check_cublas(cublasCreate(&made), "cublasCreate");
    const cublasStatus_t bound =
        cublasSetStream(made, Kokkos::DefaultExecutionSpace().cuda_stream());
    if (bound != CUBLAS_STATUS_SUCCESS) cublasDestroy(made);
    check_cublas(bound, "cublasSetStream");
    the_handle = made;
    Kokkos::push_finalize_hook([] {
      cublasDestroy(the_handle);
      the_handle = nullptr;
    });
  }
  return the_handle;
}

}  // namespace

void cuda_gemm(const RowMajorGemm& call) {
  // cuBLAS is column-major: row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ,
  // and a row-major matrix read column-major is its transpose, so B goes first with the
  // same flags and m, n swap.
  const float alpha = 1.0f;
  const cublasComputeType_t compute = call.precision == MatmulPrecision::tf32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  check_cublas(cublasGemmEx(handle(), call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                            call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, call.n, call.m, call.k,
                            &alpha, call.b, CUDA_R_32F, call.ldb, call.a, CUDA_R_32F, call.lda,
                            &call.beta, call.c, CUDA_R_32F, call.ldc, compute,
                            CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

}  // namespace meshtrain::gemm_backend
