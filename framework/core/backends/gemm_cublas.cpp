// Built only when Kokkos has CUDA (framework/CMakeLists.txt).
#include <cublas_v2.h>

#include <Kokkos_Core.hpp>

#include "base/error.hpp"
#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"

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

// The 16-bit copies of A and B for a mixed-precision GEMM: grown on first use and kept
// (no allocation once a step's shapes have been seen); released before Kokkos::finalize.
HalfBits the_16bit_a, the_16bit_b;

uint16_t* grown(HalfBits& buffer, std::size_t count) {
  static bool released_at_finalize = false;
  if (!released_at_finalize) {
    released_at_finalize = true;
    Kokkos::push_finalize_hook([] {
      the_16bit_a = HalfBits();
      the_16bit_b = HalfBits();
    });
  }
  if (buffer.extent(0) < count) {
    buffer = HalfBits();
    buffer =
        HalfBits(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::gemm_16bit"), count);
  }
  return buffer.data();
}

// A stored row-major matrix [rows, cols] with row stride ld, as contiguous 16-bit elements
// (row stride cols).
const uint16_t* to_16bit_copy(const float* data, int rows, int cols, int ld, Dtype dtype,
                              HalfBits& buffer) {
  uint16_t* out = grown(buffer, static_cast<std::size_t>(rows) * cols);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::gemm_to_16bit"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(device_space(), {0, 0}, {rows, cols}),
      KOKKOS_LAMBDA(const int r, const int c) {
        out[static_cast<std::size_t>(r) * cols + c] =
            to_16bit(data[static_cast<std::size_t>(r) * ld + c], dtype);
      });
  return out;
}

}  // namespace

void cuda_gemm(const RowMajorGemm& call) {
  if (call.inputs != Dtype::fp32) {
    // Stored shapes: op(A) [m, k], op(B) [k, n].
    const int a_rows = call.transpose_a ? call.k : call.m,
              a_cols = call.transpose_a ? call.m : call.k;
    const int b_rows = call.transpose_b ? call.n : call.k,
              b_cols = call.transpose_b ? call.k : call.n;
    const uint16_t* a = to_16bit_copy(call.a, a_rows, a_cols, call.lda, call.inputs, the_16bit_a);
    const uint16_t* b = to_16bit_copy(call.b, b_rows, b_cols, call.ldb, call.inputs, the_16bit_b);
    const cudaDataType_t type = call.inputs == Dtype::bf16 ? CUDA_R_16BF : CUDA_R_16F;
    const float alpha = 1.0f;
    check_cublas(cublasGemmEx(handle(), call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                              call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, call.n, call.m, call.k,
                              &alpha, b, type, b_cols, a, type, a_cols, &call.beta, call.c,
                              CUDA_R_32F, call.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx (16-bit inputs)");
    return;
  }
  // cuBLAS is column-major: row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ,
  // and a row-major matrix read column-major is its transpose, so B goes first with the
  // same flags and m, n swap.
  const float alpha = 1.0f;
  const cublasComputeType_t compute =
      call.precision == MatmulPrecision::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  check_cublas(cublasGemmEx(handle(), call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                            call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, call.n, call.m, call.k,
                            &alpha, call.b, CUDA_R_32F, call.ldb, call.a, CUDA_R_32F, call.lda,
                            &call.beta, call.c, CUDA_R_32F, call.ldc, compute, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

}  // namespace meshtrain::gemm_backend
