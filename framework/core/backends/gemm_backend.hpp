#pragma once
// The library calls behind gemm() (framework/core/gemm.hpp). gemm() checks the shapes and
// the int ranges and hands over one row-major call; each backend maps it onto its library,
// fuses what it can of the epilogue and says what it left, which gemm() applies in one pass
// after it (apply_epilogue_left, gemm.cpp).
//
// Backends, by file:
//   gemm_cblas.cpp    cblas_sgemm (OpenBLAS) on host memory; no epilogue
//   gemm_onednn.cpp   oneDNN matmul on host memory (built when MESHTRAIN_GEMM_ONEDNN):
//                     bias and activation as post-ops; backward epilogues left
//   gemm_cublas.cpp   cuBLAS and cuBLASLt on CUDA memory (built with a CUDA Kokkos)
// Tests and benchmarks call a host backend directly to compare them in one process.

#include <cstdint>
#include <string>

#include "framework/core/gemm.hpp"

namespace meshtrain::gemm_backend {

// Row-major C [m, n] = beta * C + op(A) @ op(B), op(A) [m, k], op(B) [k, n]; lda, ldb, ldc
// are the row strides of the matrices as stored. m, n, k are positive. A and B are fp32 (a, b)
// or, for 16-bit inputs, 16-bit elements (a16, b16, their bits in `inputs`' dtype; a or b null
// then): a backend gets 16-bit operands only where gemm_reads_16bit(inputs), gemm() widening
// them into fp32 scratch elsewhere. Then the epilogue (GemmEpilogue, gemm.hpp): null pointers
// for what is absent.
struct RowMajorGemm {
  bool transpose_a = false;
  bool transpose_b = false;
  int m = 0, n = 0, k = 0;
  const float* a = nullptr;
  int lda = 0;
  const float* b = nullptr;
  int ldb = 0;
  const uint16_t* a16 = nullptr;  // A as 16-bit elements (row stride lda), instead of a
  const uint16_t* b16 = nullptr;  // B as 16-bit elements (row stride ldb), instead of b
  float beta = 0.0f;
  float* c = nullptr;
  int ldc = 0;
  // C as 16-bit elements of `inputs`' dtype (row stride ldc), instead of c: gemm_to_16bit(), beta
  // 0 and no epilogue. A backend gets it only where gemm_kernel_writes_16bit(inputs); gemm() runs
  // the fp32 kernel into fp32 scratch and rounds elsewhere.
  uint16_t* c16 = nullptr;
  MatmulPrecision precision = MatmulPrecision::fp32;
  Dtype inputs = Dtype::fp32;  // what A's and B's values hold
  bool rows_vary = false;      // gemm_varying_rows(): M or K change from call to call

  // The epilogue.
  bool backward = false;
  Activation activation = Activation::none;
  const float* bias = nullptr;              // forward: [n]
  const float* activation_input = nullptr;  // backward: z [m, n], row stride ld_activation_input
  int ld_activation_input = 0;
  float* bias_gradient = nullptr;  // backward: [n]
};

// What a backend left of the epilogue, for gemm() to apply after it: the bias and the
// activation of a forward epilogue (C = f(C + bias)), or the whole backward epilogue.
struct EpilogueLeft {
  bool bias = false;
  Activation activation = Activation::none;
  bool backward = false;
  bool nothing() const { return !bias && activation == Activation::none && !backward; }
};
// Everything of `call`'s epilogue (a backend that fuses nothing).
EpilogueLeft whole_epilogue(const RowMajorGemm& call);

// cblas_sgemm on host memory (gemm_cblas.cpp); leaves the whole epilogue.
EpilogueLeft cblas_gemm(const RowMajorGemm& call);
// "OpenBLAS 0.3.21 SkylakeX, 1 thread".
std::string cblas_description();

// Which kernel a bf16 GEMM runs on oneDNN: automatic takes the bf16 matmul where the CPU
// has bf16 instructions (AVX512_BF16, AMX) and the fp32 matmul of the same values elsewhere;
// the others force one (tests, benchmarks: oneDNN emulates bf16 on plain AVX-512, slowly).
enum class Bf16Kernel { automatic, bf16, fp32 };

// The library gemm() calls on host memory: the build's (MESHTRAIN_CPU_GEMM: oneDNN where found)
// or the environment's MESHTRAIN_CPU_GEMM, unless a test or benchmark selects another to compare
// them in one process. Process-wide, not thread-safe: select before the GEMMs. onednn exists
// only where MESHTRAIN_GEMM_ONEDNN is defined.
enum class HostLibrary { openblas, onednn };
void select_host_library(HostLibrary library, Bf16Kernel bf16_kernel = Bf16Kernel::automatic);
HostLibrary selected_host_library();
// The build's choice.
HostLibrary default_host_library();

#if defined(MESHTRAIN_GEMM_ONEDNN)
// oneDNN matmul on host memory (gemm_onednn.cpp): primitives made on the first call of each
// shape, strides, dtypes and epilogue and kept (one engine and stream for the process);
// fuses a forward epilogue, leaves a backward one.
EpilogueLeft onednn_gemm(const RowMajorGemm& call, Bf16Kernel bf16_kernel = Bf16Kernel::automatic);
// "oneDNN 2.6.3 avx512_core_vnni (bf16 inputs: fp32 kernel, no AVX512_BF16), 1 thread".
std::string onednn_description();
// The matmul executions onednn_gemm() has run in this process (gemm() and inference_gemm() on
// oneDNN), for the tests that bound oneDNN's allocations per call.
int64_t onednn_executions();
// Those of onednn_executions() that ran a primitive made for the call's whole shape (bf16 calls
// whose rows are stable); the others ran the runtime-dimension primitive (gemm_onednn.cpp,
// primitive_for). For the tests that check which kernel a call ran.
int64_t onednn_fixed_shape_executions();
// Drops every primitive made so far, so that the next calls find the table as a new process
// does (tests that check a call's kernel does not depend on the calls before it).
void onednn_drop_primitives();
// "oneDNN 2.6.3 avx512_core_vnni": the version and the ISA of the kernels it picks.
std::string onednn_name();
// Whether the CPU has bf16 instructions (AVX512_BF16, AMX): an automatic bf16 GEMM then runs
// oneDNN's bf16 matmul.
bool onednn_has_native_bf16();
// Whether oneDNN makes a bf16 matmul on this CPU at all (natively or emulated on AVX-512).
bool onednn_has_bf16_matmul();
// Whether onednn_gemm() runs its bf16 matmul for `inputs` under `bf16_kernel` (bad_input where
// the bf16 kernel is forced and oneDNN has none): it then reads 16-bit operands as stored.
bool onednn_runs_bf16(Dtype inputs, Bf16Kernel bf16_kernel);
#endif

#if defined(KOKKOS_ENABLE_CUDA)
// cublasGemmEx on CUDA memory, or cublasLtMatmul with an epilogue, on the default execution
// space's stream (gemm_cublas.cpp).
EpilogueLeft cuda_gemm(const RowMajorGemm& call);
std::string cuda_description();
#endif

}  // namespace meshtrain::gemm_backend
