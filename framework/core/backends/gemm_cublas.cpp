// gemm() on CUDA memory. Built only when Kokkos has CUDA (framework/CMakeLists.txt).
//
// A GEMM without an epilogue is one cublasGemmEx (as before cuBLASLt came in: the fp32
// numerics of a plain GEMM do not change). A GEMM with an epilogue goes to cublasLtMatmul
// with the epilogue cuBLASLt has for it:
//   forward   bias                  CUBLASLT_EPILOGUE_BIAS
//             relu (+ bias)         CUBLASLT_EPILOGUE_RELU(_BIAS)
//             gelu, the tanh form   CUBLASLT_EPILOGUE_GELU(_BIAS)
//             (D = f(alpha op(A) op(B) + beta C + bias), as gemm() defines it)
//             gelu_erf, silu, tanh, sigmoid: no cuBLASLt epilogue; BIAS when there is a bias,
//             then gemm()'s pass applies f (one pass over C)
//   backward  gelu                  CUBLASLT_EPILOGUE_DGELU(_BGRAD): aux = z (the GELU input,
//                                   fp32 like D, row stride a multiple of 8), beta 0
//             others                cublasGemmEx, then gemm()'s backward pass (derivative and
//                                   bias gradient in one pass). relu has DRELU_BGRAD, but its
//                                   aux is the bit mask a forward RELU_AUX(_BIAS) writes, not z;
//                                   it comes with a forward epilogue that keeps that mask
//                                   (issue 37, when the layers use the epilogues).
// When cuBLASLt offers no algorithm for a call (alignment, sizes), the call falls back to
// cublasGemmEx and the pass.
//
// Handles (cuBLAS, cuBLASLt), the workspace and the 16-bit copies of mixed-precision operands
// are made on first use and kept; each cuBLASLt configuration (shapes, strides, transposes,
// types, epilogue, pointer alignments) is described and its algorithm chosen once, at its
// first call, and kept in a table on the heap, so a repeated call sets two pointers and runs.
// All of it is released before Kokkos::finalize.

#include <cublasLt.h>
#include <cublas_v2.h>

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "base/error.hpp"
#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/step_graph.hpp"

namespace meshtrain::gemm_backend {

namespace {

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    MESHTRAIN_FAIL("gemm: ", call, " failed: ", cublasGetStatusString(status));
  }
}

// The stream of Kokkos' default execution space: GEMMs are ordered with meshtrain's kernels
// without a fence.
cudaStream_t kokkos_stream() {
  return device_space().cuda_stream();
}

// One cuBLAS handle for the process, bound to Kokkos' stream. Made on first use (outside the
// steady state of a training step); Kokkos::finalize destroys it.
cublasHandle_t the_handle = nullptr;

// cuBLASLt's workspace (below), given to cuBLAS too.
void share_lt_workspace(cublasHandle_t handle);

cublasHandle_t handle() {
  if (the_handle == nullptr) {
    cublasHandle_t made = nullptr;
    check_cublas(cublasCreate(&made), "cublasCreate");
    const cublasStatus_t bound = cublasSetStream(made, kokkos_stream());
    if (bound != CUBLAS_STATUS_SUCCESS) cublasDestroy(made);
    check_cublas(bound, "cublasSetStream");
    // Without a workspace of its own cuBLAS allocates one on its first calls, which a graph
    // capture forbids. cuBLASLt's is shared: both run on Kokkos' one stream, one after the
    // other. lt() registers its finalize hook first, so the handle is destroyed before it.
    try {
      share_lt_workspace(made);
    } catch (...) {
      cublasDestroy(made);
      throw;
    }
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
    // A graph captured before holds the old address: StepGraph refuses to replay it.
    if (buffer.extent(0) > 0) note_device_scratch_regrown();
    buffer = HalfBits();
    buffer = HalfBits(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("meshtrain::gemm_16bit")),
        count);
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

// The operands as the library reads them: the caller's fp32 matrices; for 16-bit inputs the
// caller's 16-bit matrices, or 16-bit copies of its fp32 ones.
struct Operands {
  const void* a = nullptr;
  const void* b = nullptr;
  int lda = 0, ldb = 0;
  cudaDataType_t type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
};

Operands operands_of(const RowMajorGemm& call) {
  Operands o;
  if (call.inputs == Dtype::fp32) {
    o.a = call.a;
    o.b = call.b;
    o.lda = call.lda;
    o.ldb = call.ldb;
    o.compute =
        call.precision == MatmulPrecision::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    return o;
  }
  // Stored shapes: op(A) [m, k], op(B) [k, n].
  const int a_rows = call.transpose_a ? call.k : call.m,
            a_cols = call.transpose_a ? call.m : call.k;
  const int b_rows = call.transpose_b ? call.n : call.k,
            b_cols = call.transpose_b ? call.k : call.n;
  // 16-bit operands as stored (no copy); fp32 ones holding 16-bit values copied to 16 bits.
  if (call.a16 != nullptr) {
    o.a = call.a16;
    o.lda = call.lda;
  } else {
    o.a = to_16bit_copy(call.a, a_rows, a_cols, call.lda, call.inputs, the_16bit_a);
    o.lda = a_cols;
  }
  if (call.b16 != nullptr) {
    o.b = call.b16;
    o.ldb = call.ldb;
  } else {
    o.b = to_16bit_copy(call.b, b_rows, b_cols, call.ldb, call.inputs, the_16bit_b);
    o.ldb = b_cols;
  }
  o.type = call.inputs == Dtype::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  return o;
}

// --- cuBLASLt ------------------------------------------------------------------------------

// Workspace of cublasLtMatmul: NVIDIA's libraries use 32 MiB on Hopper, 4 MiB before.
constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

// The largest power of two (at most 256, cuBLASLt's default requirement) dividing an address.
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// What a cuBLASLt configuration is made for: everything but the buffers' addresses (their
// alignments are in: cuBLASLt picks algorithms by them).
struct LtKey {
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, ld_aux = 0;
  bool transpose_a = false, transpose_b = false;
  int type = 0, compute = 0;
  uint32_t epilogue = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_bias = 0, align_aux = 0;

  // Compared and hashed as bytes: every key is zeroed first (run_cublaslt), padding included.
  bool operator==(const LtKey& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
struct LtKeyHash {
  std::size_t operator()(const LtKey& key) const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(&key);
    std::size_t h = 1469598103934665603ull;  // FNV-1a over the key's bytes
    for (std::size_t i = 0; i < sizeof key; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
    return h;
  }
};

// A described cuBLASLt matmul and its algorithm (found: false where cuBLASLt has none).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  ~LtPlan() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

using Workspace = Kokkos::View<unsigned char*, Kokkos::DefaultExecutionSpace::memory_space>;

struct CublasLt {
  cublasLtHandle_t handle = nullptr;
  Workspace workspace;
  std::unordered_map<LtKey, std::unique_ptr<LtPlan>, LtKeyHash> plans;
  ~CublasLt() {
    plans.clear();
    if (handle != nullptr) cublasLtDestroy(handle);
  }
};
CublasLt* the_lt = nullptr;

CublasLt& lt() {
  if (the_lt == nullptr) {
    auto made = std::make_unique<CublasLt>();
    check_cublas(cublasLtCreate(&made->handle), "cublasLtCreate");
    made->workspace =
        Workspace(Kokkos::view_alloc(Kokkos::WithoutInitializing,
                                     std::string("meshtrain::gemm_cublaslt_workspace")),
                  kWorkspaceBytes);
    the_lt = made.release();
    Kokkos::push_finalize_hook([] {
      delete the_lt;
      the_lt = nullptr;
    });
  }
  return *the_lt;
}

void share_lt_workspace(cublasHandle_t handle) {
  Workspace& workspace = lt().workspace;
  check_cublas(cublasSetWorkspace(handle, workspace.data(), workspace.extent(0)),
               "cublasSetWorkspace");
}

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value,
              const char* what) {
  check_cublas(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof value), what);
}

// Points a descriptor at a call's bias (or bias gradient) and activation input: attributes
// are plain stores, nothing is allocated, so a cached plan serves every call of its shape.
void point_at_vectors(cublasLtMatmulDesc_t desc, const RowMajorGemm& call) {
  if (call.bias != nullptr) {
    set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, call.bias, "BIAS_POINTER");
  }
  if (call.bias_gradient != nullptr) {
    set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, call.bias_gradient, "BIAS_POINTER");
  }
  if (call.activation_input != nullptr) {
    set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, call.activation_input,
             "EPILOGUE_AUX_POINTER");
  }
}

// The cuBLASLt epilogue for `call` and what it leaves to gemm()'s pass; false when cuBLASLt
// has nothing to fuse here (the caller then runs cublasGemmEx and the whole pass).
bool lt_epilogue_of(const RowMajorGemm& call, cublasLtEpilogue_t& epilogue, EpilogueLeft& left) {
  left = EpilogueLeft();
  const bool bias = call.bias != nullptr;
  if (!call.backward) {
    switch (call.activation) {
      case Activation::relu:
        epilogue = bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
        return true;
      case Activation::gelu:  // cuBLASLt's GELU is the tanh form
        epilogue = bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
        return true;
      default:
        if (!bias) return false;
        epilogue = CUBLASLT_EPILOGUE_BIAS;
        left.activation = call.activation;  // gelu_erf, silu, tanh, sigmoid, none
        return true;
    }
  }
  // DGELU's aux is z read as a column-major [n, m] matrix: its row stride must be a
  // multiple of 8 elements. Only with beta 0: cuBLASLt does not say whether the gradient
  // applies to beta C + AB or to AB alone.
  if (call.activation == Activation::gelu && call.ld_activation_input % 8 == 0 &&
      call.beta == 0.0f) {
    epilogue =
        call.bias_gradient != nullptr ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
    return true;
  }
  return false;
}

// The plan of `key` (made at its first call); nullptr where cuBLASLt has no algorithm.
LtPlan* plan_for(CublasLt& state, const LtKey& key, const RowMajorGemm& call,
                 const Operands& operands, cublasLtEpilogue_t epilogue) {
  auto found = state.plans.find(key);
  if (found != state.plans.end()) return found->second->found ? found->second.get() : nullptr;
  auto plan = std::make_unique<LtPlan>();
  // Column-major, as cublasGemmEx below: D = Cᵀ [n, m] = op(B)ᵀ [n, k] op(A)ᵀ [k, m], B first.
  const cublasOperation_t op_b = call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_cublas(cublasLtMatmulDescCreate(&plan->desc, static_cast<cublasComputeType_t>(key.compute),
                                        CUDA_R_32F),
               "cublasLtMatmulDescCreate");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, op_b, "cublasLtMatmulDescSetAttribute(TRANSA)");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, op_a, "cublasLtMatmulDescSetAttribute(TRANSB)");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue,
           "cublasLtMatmulDescSetAttribute(EPILOGUE)");
  if (call.bias != nullptr || call.bias_gradient != nullptr) {  // fp32 vectors, as D
    const int32_t vector_type = CUDA_R_32F;
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, vector_type, "BIAS_DATA_TYPE");
  }
  const auto type = static_cast<cudaDataType_t>(key.type);
  // The stored matrices read column-major: B [k, n] row-major is [n, k] column-major.
  const uint64_t b_rows = call.transpose_b ? call.k : call.n,
                 b_cols = call.transpose_b ? call.n : call.k;
  const uint64_t a_rows = call.transpose_a ? call.m : call.k,
                 a_cols = call.transpose_a ? call.k : call.m;
  check_cublas(cublasLtMatrixLayoutCreate(&plan->a, type, b_rows, b_cols, operands.ldb),
               "cublasLtMatrixLayoutCreate(A)");
  check_cublas(cublasLtMatrixLayoutCreate(&plan->b, type, a_rows, a_cols, operands.lda),
               "cublasLtMatrixLayoutCreate(B)");
  check_cublas(cublasLtMatrixLayoutCreate(&plan->c, CUDA_R_32F, call.n, call.m, call.ldc),
               "cublasLtMatrixLayoutCreate(C)");
  // This call's pointers: cuBLASLt's heuristic reads their alignment.
  point_at_vectors(plan->desc, call);
  if (call.activation_input != nullptr) {
    const int64_t ld_aux = key.ld_aux;
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld_aux, "EPILOGUE_AUX_LD");
  }
  cublasLtMatmulPreference_t preference = nullptr;
  check_cublas(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  const auto set_preference = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
    return cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof value);
  };
  cublasStatus_t status = set_preference(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, kWorkspaceBytes);
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(state.handle, plan->desc, plan->a, plan->b, plan->c,
                                            plan->c, preference, 1, &result, &returned);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  // No algorithm (NOT_SUPPORTED, or none returned) is not an error: the caller falls back.
  plan->found =
      status == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  if (plan->found) plan->algo = result.algo;
  LtPlan* made = plan->found ? plan.get() : nullptr;
  state.plans.emplace(key, std::move(plan));
  return made;
}

// cublasLtMatmul with the epilogue of `call`; false when it did not run (no epilogue for
// this call, or no algorithm), and then nothing was written.
bool run_cublaslt(const RowMajorGemm& call, const Operands& operands, EpilogueLeft& left) {
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (!lt_epilogue_of(call, epilogue, left)) return false;
  CublasLt& state = lt();
  LtKey key;
  std::memset(&key, 0, sizeof key);  // the bytes between the bools and `type` too
  key.m = call.m;
  key.n = call.n;
  key.k = call.k;
  key.lda = operands.lda;
  key.ldb = operands.ldb;
  key.ldc = call.ldc;
  key.ld_aux = call.activation_input != nullptr ? call.ld_activation_input : 0;
  key.transpose_a = call.transpose_a;
  key.transpose_b = call.transpose_b;
  key.type = operands.type;
  key.compute = operands.compute;
  key.epilogue = epilogue;
  key.align_a = alignment_of(operands.a);
  key.align_b = alignment_of(operands.b);
  key.align_c = alignment_of(call.c);
  const void* vector =
      call.bias != nullptr ? static_cast<const void*>(call.bias) : call.bias_gradient;
  key.align_bias = vector != nullptr ? alignment_of(vector) : 0;
  key.align_aux = call.activation_input != nullptr ? alignment_of(call.activation_input) : 0;
  LtPlan* plan = plan_for(state, key, call, operands, epilogue);
  if (plan == nullptr) return false;
  point_at_vectors(plan->desc, call);
  const float alpha = 1.0f;
  check_cublas(cublasLtMatmul(state.handle, plan->desc, &alpha, operands.b, plan->a, operands.a,
                              plan->b, &call.beta, call.c, plan->c, call.c, plan->c, &plan->algo,
                              state.workspace.data(), kWorkspaceBytes, kokkos_stream()),
               "cublasLtMatmul");
  return true;
}

}  // namespace

EpilogueLeft cuda_gemm(const RowMajorGemm& call) {
  const Operands operands = operands_of(call);
  const EpilogueLeft whole = whole_epilogue(call);
  // A 16-bit C (gemm_to_16bit(): 16-bit inputs, beta 0, no epilogue) is cublasGemmEx's C in the
  // inputs' type (CUDA_R_16BF / CUDA_R_16F), accumulated in fp32 (operands.compute). Not reached
  // yet: gemm() sends no c16 on CUDA builds (gemm_kernel_writes_16bit() is false there) until a GPU
  // test compares this C's rounding and overflow with the fp32 C rounded.
  if (!whole.nothing()) {
    EpilogueLeft left;
    if (run_cublaslt(call, operands, left)) return left;
  }
  // cuBLAS is column-major: row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ,
  // and a row-major matrix read column-major is its transpose, so B goes first with the
  // same flags and m, n swap.
  const float alpha = 1.0f;
  check_cublas(
      cublasGemmEx(handle(), call.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                   call.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, call.n, call.m, call.k, &alpha,
                   operands.b, operands.type, operands.ldb, operands.a, operands.type, operands.lda,
                   &call.beta, call.c16 != nullptr ? static_cast<void*>(call.c16) : call.c,
                   call.c16 != nullptr ? operands.type : CUDA_R_32F, call.ldc, operands.compute,
                   CUBLAS_GEMM_DEFAULT),
      call.inputs == Dtype::fp32 ? "cublasGemmEx" : "cublasGemmEx (16-bit inputs)");
  return whole;
}

std::string cuda_description() {
  int version = 0;
  check_cublas(cublasGetVersion(handle(), &version), "cublasGetVersion");
  return "cuBLAS " + std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) +
         " (cuBLASLt epilogues: bias, relu, gelu; dgelu and its bias gradient)";
}

}  // namespace meshtrain::gemm_backend
