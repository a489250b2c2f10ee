#include "framework/core/gemm.hpp"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <type_traits>

#include "base/error.hpp"
#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/observe/trace.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#define MESHTRAIN_GEMM_HAS_CUDA true
#else
#define MESHTRAIN_GEMM_HAS_CUDA false
#endif

namespace meshtrain {

namespace {

MatmulPrecision g_matmul_precision = MatmulPrecision::fp32;

// BLAS takes int extents and leading dimensions.
int blas_int(std::size_t value, const char* what) {
  if (value > static_cast<std::size_t>(INT_MAX)) {
    MESHTRAIN_FAIL("gemm: ", what, " is ", value, ", more than BLAS takes (", INT_MAX, ")");
  }
  return static_cast<int>(value);
}

// The leading dimension of a stored matrix: its row stride, at least its row length and 1
// (BLAS rejects 0 even for a single row).
int leading_dimension(std::size_t stride, std::size_t columns, const char* what) {
  return blas_int(std::max<std::size_t>({stride, columns, 1}), what);
}

void scale(MatrixView c, float beta) {
  if (beta == 1.0f) return;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::gemm_scale"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0},
          {static_cast<int64_t>(c.extent(0)), static_cast<int64_t>(c.extent(1))}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t col) {
        // beta == 0 overwrites (NaN * 0 would stay NaN), as BLAS does.
        c(r, col) = beta == 0.0f ? 0.0f : beta * c(r, col);
      });
}

}  // namespace

void set_matmul_precision(MatmulPrecision precision) {
  g_matmul_precision = precision;
}

MatmulPrecision matmul_precision() {
  return g_matmul_precision;
}

void gemm(GemmOperand a, GemmOperand b, float beta, MatrixView c, Dtype inputs) {
  const std::size_t m = op_rows(a), k = op_cols(a), n = op_cols(b);
  if (op_rows(b) != k || c.extent(0) != m || c.extent(1) != n) {
    MESHTRAIN_BAD_INPUT("gemm: op(A) is [", m, ", ", k, "], op(B) is [", op_rows(b), ", ", n,
                        "] and C is [", c.extent(0), ", ", c.extent(1),
                        "]; expected op(A) [M, K] @ op(B) [K, N] = C [M, N]");
  }
  if (m == 0 || n == 0) return;
  TraceSpan span("gemm", TraceKind::gemm);
  span.shape(static_cast<int64_t>(m), static_cast<int64_t>(n), static_cast<int64_t>(k))
      .detail(to_string(inputs));
  if (k == 0) {  // an empty sum: C = beta * C
    scale(c, beta);
    return;
  }
  gemm_backend::RowMajorGemm call;
  call.transpose_a = a.transpose;
  call.transpose_b = b.transpose;
  call.m = blas_int(m, "M");
  call.n = blas_int(n, "N");
  call.k = blas_int(k, "K");
  call.a = a.matrix.data();
  call.lda =
      leading_dimension(a.matrix.stride(0), a.matrix.extent(1), "the leading dimension of A");
  call.b = b.matrix.data();
  call.ldb =
      leading_dimension(b.matrix.stride(0), b.matrix.extent(1), "the leading dimension of B");
  call.beta = beta;
  call.c = c.data();
  call.ldc = leading_dimension(c.stride(0), c.extent(1), "the leading dimension of C");
  call.precision = g_matmul_precision;
  call.inputs = inputs;
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<MatrixView::memory_space, Kokkos::CudaSpace>) {
    gemm_backend::cuda_gemm(call);
    return;
  }
#endif
  static_assert(!kDeviceMemoryIsHostInaccessible || MESHTRAIN_GEMM_HAS_CUDA,
                "gemm has backends for host memory and CUDA memory only");
  // The BLAS reads memory written by Kokkos kernels on the host execution space: wait
  // for them (a no-op on Serial).
  fence_device(MESHTRAIN_LABEL("meshtrain::gemm"));
  gemm_backend::host_gemm(call);
}

}  // namespace meshtrain
