#pragma once
// The one GEMM of meshtrain: C = beta * C + op(A) @ op(B) on views in the default memory
// space, with transposes as flags (never materialized), and an optional epilogue (bias,
// activation; for backward the activation's derivative and the bias gradient) fused into
// the GEMM where the library can. The implementation follows the memory space and the build:
//   host memory   oneDNN matmul with post-ops, the default wherever the build has it
//                 (MESHTRAIN_CPU_GEMM=auto or onednn); or CBLAS (OpenBLAS) and one pass for the
//                 epilogue, without oneDNN or set at run time MESHTRAIN_CPU_GEMM=openblas;
//                 docs/design.md, GEMM
//   CUDA memory   cuBLAS, and cuBLASLt with its epilogues when there is one (one handle
//                 each, on the stream of Kokkos' default execution space, made on first
//                 use and destroyed by Kokkos::finalize)
// gemm_kernels() names what this process uses (the library, oneDNN's ISA, the threads).
// The host library is chosen at the first gemm() (MESHTRAIN_CPU_GEMM) or by
// gemm_backend::select_host_library (tests, benchmarks), and must be chosen only while no thread
// is multiplying: the choice and its cached answers (gemm_reads_16bit's, per library) are plain
// process-wide state, so a selection while another thread is inside gemm() (or two threads making
// the first call at once) races. Choose it before starting threads that multiply, and do not
// change it once a model is built: the model's weight scratch is sized by
// gemm_kernel_reads_16bit()'s answer for the library then selected (layers/sharded_parameter.cpp).
//
//   gemm(plain(x), plain(w), 0.0f, y);                       // y = x @ w
//   gemm(transposed(x), plain(dy), 0.0f, dw);                // dw = xᵀ @ dy
//   gemm(plain(x), plain(w), 0.0f, a, Dtype::fp32,
//        GemmEpilogue::forward(b, Activation::gelu));        // a = gelu(x @ w + b)
//   gemm(plain(dy), transposed(w), 0.0f, dz, Dtype::fp32,
//        GemmEpilogue::backward(Activation::gelu, z, db));   // dz = (dy @ wᵀ) * gelu'(z),
//                                                            // db = column sums of dz
//
// Views may be row-strided (a column block of a wider matrix); any extents are accepted,
// empty ones included. Shapes that do not chain are bad_input naming them.

#include <cstddef>
#include <string>

#include "base/dtype.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/views.hpp"

namespace meshtrain {

// A GEMM operand as stored, and whether the GEMM uses its transpose: fp32 elements, or 16-bit
// ones (the bits of a bf16 or fp16 value, which gemm()'s `inputs` names) read as they are,
// without a widened fp32 copy (docs/mixed_precision.md, "Compute and memory on this build"):
//   gemm(plain(x_16bit), plain(w), 0.0f, y, Dtype::bf16);   // y = x @ w, x kept as bf16
struct GemmOperand {
  ConstMatrixView matrix;  // fp32 elements, unless sixteen_bit
  bool transpose = false;
  ConstHalfMatrixView half;  // 16-bit elements, when sixteen_bit
  bool sixteen_bit = false;

  std::size_t extent(int dim) const { return sixteen_bit ? half.extent(dim) : matrix.extent(dim); }
  std::size_t row_stride() const { return sixteen_bit ? half.stride(0) : matrix.stride(0); }
};
inline GemmOperand plain(ConstMatrixView m) {
  GemmOperand x;
  x.matrix = m;
  return x;
}
inline GemmOperand transposed(ConstMatrixView m) {
  GemmOperand x = plain(m);
  x.transpose = true;
  return x;
}
inline GemmOperand plain(ConstHalfMatrixView m) {
  GemmOperand x;
  x.half = m;
  x.sixteen_bit = true;
  return x;
}
inline GemmOperand transposed(ConstHalfMatrixView m) {
  GemmOperand x = plain(m);
  x.transpose = true;
  return x;
}
// Rows (dim 0) and columns (dim 1) of op(X).
inline std::size_t op_rows(const GemmOperand& x) {
  return x.extent(x.transpose ? 1 : 0);
}
inline std::size_t op_cols(const GemmOperand& x) {
  return x.extent(x.transpose ? 0 : 1);
}

// How float GEMMs may round (MatmulPrecision, framework/core/choices.hpp), as
// torch.backends.cuda.matmul.allow_tf32: fp32 computes in full float precision (the
// default, as in PyTorch); tf32 lets cuBLAS use TF32 tensor cores (10-bit mantissa
// inputs, float accumulation). On host memory both compute in fp32.
// Process-wide, like PyTorch's setting: every later gemm() uses it.
void set_matmul_precision(MatmulPrecision precision);
MatmulPrecision matmul_precision();

// What gemm() does to C after the product: plain data, whose default does nothing.
//   forward   C = f(beta C + op(A) op(B) + bias), bias [N] added to every row (optional),
//             f = `activation` (none: the identity)
//   backward  G = beta C + op(A) op(B); C = G * f'(z) elementwise, z = `activation_input`
//             [M, N] (the activation's input saved by the forward pass; for relu anything
//             with the sign of z, its output included); with `bias_gradient` [N], also
//             bias_gradient[j] = sum over i of C[i, j] (overwritten), accumulated in fp32
//             over the rows in order. activation none and no z: C = G and the column sums.
// The activations and their derivatives are those of layers/activation.hpp
// (framework/core/activation_math.hpp): a pass after the GEMM computes them with those very
// formulas (OpenBLAS, the backward pass on oneDNN, what cuBLASLt lacks); a fused oneDNN or
// cuBLASLt epilogue uses the library's own (within a few ulps: docs/design.md, GEMM).
struct GemmEpilogue {
  ConstVectorView bias;                      // forward: [N], or empty for none
  Activation activation = Activation::none;  // forward f, or backward f'
  ConstMatrixView activation_input;          // backward: z [M, N]
  VectorView bias_gradient;                  // backward: [N], or empty for none
  bool is_backward = false;                  // set by backward()

  static GemmEpilogue forward(ConstVectorView bias, Activation activation = Activation::none) {
    GemmEpilogue e;
    e.bias = bias;
    e.activation = activation;
    return e;
  }
  static GemmEpilogue forward(Activation activation) { return forward({}, activation); }
  static GemmEpilogue backward(Activation activation, ConstMatrixView activation_input,
                               VectorView bias_gradient = {}) {
    GemmEpilogue e;
    e.activation = activation;
    e.activation_input = activation_input;
    e.bias_gradient = bias_gradient;
    e.is_backward = true;
    return e;
  }
  // Backward without an activation: C = G, and its column sums into bias_gradient.
  static GemmEpilogue bias_gradient_only(VectorView bias_gradient) {
    return backward(Activation::none, {}, bias_gradient);
  }
  bool has_bias() const { return bias.data() != nullptr; }
  bool has_bias_gradient() const { return bias_gradient.data() != nullptr; }
  bool is_none() const { return !is_backward && !has_bias() && activation == Activation::none; }
};

// `inputs`: the dtype the operands' values hold (mixed precision, docs/mixed_precision.md).
// Each operand is an fp32 buffer (holding `inputs` values) or, for bf16 and fp16, a 16-bit one
// (plain/transposed of a ConstHalfMatrixView: bf16 or fp16 bits as `inputs` says); C is fp32.
//   oneDNN      bf16: a bf16 matmul (fp32 accumulation and C) where the CPU has AVX512_BF16
//               (or AMX): 16-bit operands read as stored, fp32 ones copied to bf16 scratch
//               kept between calls. Elsewhere, and for fp16 (oneDNN 2.6 has no fp16 matmul
//               on CPUs), the fp32 matmul of the same values: their products are exact in
//               fp32, so only the order of the fp32 additions differs (slower than bf16
//               hardware, never wrong).
//   OpenBLAS    cblas_sgemm on the values as they are (Debian's OpenBLAS has no sbgemm).
//   CUDA        CUDA_R_16BF/16F inputs, CUBLAS_COMPUTE_32F (tensor cores, fp32 accumulation,
//               C in fp32): 16-bit operands as stored, fp32 ones copied to 16 bits (scratch).
// Where the kernel is an fp32 one (OpenBLAS, oneDNN's fp32 matmul), a 16-bit operand is first
// widened, exactly, into fp32 scratch that gemm() keeps between calls (made at the first such
// call, grown when a larger one comes): one pass over the operand, so the result is the fp32
// GEMM's of the same values, bit for bit. gemm_reads_16bit() says when that pass is not needed;
// a layer that has an fp32 working buffer of its own widens into it where it is.
void gemm(GemmOperand a, GemmOperand b, float beta, MatrixView c, Dtype inputs = Dtype::fp32,
          const GemmEpilogue& epilogue = {});
// gemm() for a call whose rows change from step to step: M of x @ W and dY @ Wᵀ, K of Xᵀ @ dY,
// as an MoE expert's share of the batch (layers/moe.cpp). The same results within the same
// bounds; what differs is the kernel: gemm() runs oneDNN's bf16 matmul as a primitive made for
// the call's whole shape at its first call (brgemm, AMX: faster), which a varying call would make
// anew inside its steps, so this one always runs the primitive whose M, K and row strides are
// given at run time (oneDNN's gemm kernel). Which of the two runs is a function of the call
// alone (its shape, epilogue, dtype and entry point), never of the calls before it: a call gives
// the same bits in a sweep's later config, in a resumed run and in `meshtrain evaluate` as in a
// run of its own. The two kernels' bits may differ where K is large (they do at K = 4096). On
// every other library and dtype, the same as gemm().
void gemm_varying_rows(GemmOperand a, GemmOperand b, float beta, MatrixView c,
                       Dtype inputs = Dtype::fp32, const GemmEpilogue& epilogue = {});
// gemm() with a 16-bit C: C = op(A) @ op(B), each element the fp32 result rounded to nearest even
// into `inputs`' 16-bit format (bf16 or fp16; C holds its bits), as gemm() into an fp32 C followed
// by round_to() would give, without that fp32 C (a weight gradient written straight into what its
// 16-bit reduction sends: layers/gradient_buckets.hpp). No beta (C is overwritten), no epilogue.
//   oneDNN      bf16 where gemm_kernel_writes_16bit(bf16): the bf16 matmul with a bf16 dst (its
//               f32 -> bf16 conversion rounds to nearest even; the same primitive choice as
//               gemm(), and the bits of gemm()'s fp32 C rounded, bit for bit but for fp32 sums
//               below 2^-126, which become zeros of their sign: tests/core/gemm_test.cpp checks
//               them on the 784-4096-4096-10 step's weight-gradient shapes and on tiny products).
//   CUDA        for now the fp32 path below (cublasGemmEx with C in CUDA_R_16BF / CUDA_R_16F is
//               written but not taken until a GPU test compares its rounding and overflow).
//   elsewhere   (OpenBLAS; oneDNN's fp32 kernel: fp16, or bf16 without AVX512_BF16) the fp32 GEMM
//               into fp32 scratch that gemm() keeps between calls (made at the first such call,
//               grown when a larger one comes), then one rounding pass into C: no memory saved
//               there, the same bits. gemm_kernel_writes_16bit() says which.
void gemm_to_16bit(GemmOperand a, GemmOperand b, HalfMatrixView c, Dtype inputs);
// Whether gemm_to_16bit() with `inputs` has its kernel write the 16-bit C (no fp32 scratch):
// gemm_kernel_reads_16bit(inputs) on host builds, false on CUDA builds (above).
bool gemm_kernel_writes_16bit(Dtype inputs);
// Whether gemm() with `inputs` reads 16-bit operands as stored (oneDNN's bf16 matmul on a CPU
// with AVX512_BF16 or AMX, unless a test forces the fp32 kernel; cuBLAS), rather than widening
// them into fp32 scratch first. The environment's MESHTRAIN_GEMM_16BIT_OPERANDS=always makes it
// true for 16-bit inputs whatever the kernel, so that the layers take their 16-bit operand paths
// on any CPU (tests: tests/layers.cmake's operands16 registrations); gemm() then widens those
// operands itself where its kernel reads fp32, with the same results.
bool gemm_reads_16bit(Dtype inputs);
// gemm_reads_16bit(inputs) without MESHTRAIN_GEMM_16BIT_OPERANDS=always: whether gemm()'s kernel
// itself reads 16-bit operands as stored. Where it does, a weight with a 16-bit copy needs no fp32
// buffer: the shared weight scratch is sized by this (layers/sharded_parameter.cpp,
// framework/train/memory_plan.cpp; partition/sixteen_bit_storage.hpp, weight_scratch_floats).
bool gemm_kernel_reads_16bit(Dtype inputs);

// gemm() for inference (Predictor, layers/inference.hpp), in fp32: on host memory through oneDNN
// wherever the build has it (as gemm() by default), even where a test or benchmark selects
// another library for gemm(), since its matmul fuses the bias and the activation and runs an
// inference's shapes faster (bench/predictor_vs_onnxruntime.sh); the environment's
// MESHTRAIN_CPU_GEMM, when set, chooses for both. Elsewhere the same as gemm().
void inference_gemm(GemmOperand a, GemmOperand b, float beta, MatrixView c,
                    const GemmEpilogue& epilogue = {});
// Whether inference_gemm() runs a forward epilogue inside the GEMM (oneDNN's post-ops) rather
// than as a pass over C after it.
bool inference_gemm_fuses_forward_epilogues();
// The kernels inference_gemm() runs, as gemm_kernels() says them.
std::string inference_gemm_kernels();

// The kernels gemm() runs in this process, for the run's opening lines, e.g.
//   "oneDNN 2.6.3 avx512_core_vnni (bf16 inputs: fp32 kernel, no AVX512_BF16), 1 thread"
//   "OpenBLAS 0.3.21 SkylakeX, 1 thread"
//   "cuBLAS 13.1 (cuBLASLt epilogues: ...)" in a CUDA build. Call after Kokkos::initialize.
std::string gemm_kernels();

}  // namespace meshtrain
