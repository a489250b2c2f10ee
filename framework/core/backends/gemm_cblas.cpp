#include <cblas.h>

#include "framework/core/backends/gemm_backend.hpp"

namespace meshtrain::gemm_backend {

void host_gemm(const RowMajorGemm& call) {
  cblas_sgemm(CblasRowMajor, call.transpose_a ? CblasTrans : CblasNoTrans,
              call.transpose_b ? CblasTrans : CblasNoTrans, call.m, call.n, call.k, 1.0f, call.a,
              call.lda, call.b, call.ldb, call.beta, call.c, call.ldc);
}

}  // namespace meshtrain::gemm_backend
