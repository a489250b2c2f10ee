#include <cblas.h>

#include <string>

#include "framework/core/backends/gemm_backend.hpp"

namespace meshtrain::gemm_backend {

EpilogueLeft cblas_gemm(const RowMajorGemm& call) {
  cblas_sgemm(CblasRowMajor, call.transpose_a ? CblasTrans : CblasNoTrans,
              call.transpose_b ? CblasTrans : CblasNoTrans, call.m, call.n, call.k, 1.0f, call.a,
              call.lda, call.b, call.ldb, call.beta, call.c, call.ldc);
  return whole_epilogue(call);
}

std::string cblas_description() {
  // OpenBLAS's own functions (its cblas.h declares them): the version and build options, the
  // kernels it chose for this CPU (OPENBLAS_CORETYPE) and its thread count.
  std::string config = openblas_get_config();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY ..."
  const std::size_t version_end = config.find(' ', config.find(' ') + 1);
  if (version_end != std::string::npos) config.resize(version_end);
  const int threads = openblas_get_num_threads();
  return config + " " + openblas_get_corename() + ", " + std::to_string(threads) +
         (threads == 1 ? " thread" : " threads");
}

}  // namespace meshtrain::gemm_backend
