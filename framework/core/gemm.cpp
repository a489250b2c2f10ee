#include "framework/core/gemm.hpp"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/step_graph.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/observe/trace.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#define MESHTRAIN_GEMM_HAS_CUDA true
#else
#define MESHTRAIN_GEMM_HAS_CUDA false
#endif

namespace meshtrain {

namespace {

MatmulPrecision g_matmul_precision = MatmulPrecision::fp32;
// The host library (gemm_backend::select_host_library); unset until the first use.
bool g_host_library_set = false;
gemm_backend::HostLibrary g_host_library = gemm_backend::HostLibrary::openblas;
gemm_backend::Bf16Kernel g_bf16_kernel = gemm_backend::Bf16Kernel::automatic;
// reads_16bit()'s answers for the selected kernels, per host library and 16-bit dtype (bf16,
// fp16): -1 until asked, then 0 or 1. Asked 3-4 times per layer pass (Linear::reads_kept_input),
// while oneDNN's answer takes its lock (and makes a primitive the first time): decided once per
// selection, forgotten by select_host_library. Atomic: evaluation and the step may ask from two
// threads.
std::atomic<int> g_reads_16bit[2][2] = {{{-1}, {-1}}, {{-1}, {-1}}};

void forget_reads_16bit() {
  for (auto& library : g_reads_16bit) {
    for (auto& answer : library) answer.store(-1, std::memory_order_relaxed);
  }
}

gemm_backend::HostLibrary host_library() {
  if (!g_host_library_set) {
    gemm_backend::select_host_library(gemm_backend::default_host_library());
  }
  return g_host_library;
}

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

// The epilogue's kernels (gemm.hpp's GemmEpilogue), for what a backend left: one pass over C
// each. Their labels are made in these plain functions, once for every instantiation below.
const std::string& forward_epilogue_label() {
  return MESHTRAIN_LABEL("meshtrain::gemm_epilogue_forward");
}
const std::string& backward_epilogue_label() {
  return MESHTRAIN_LABEL("meshtrain::gemm_epilogue_backward");
}

// C = f(C + bias) (no bias: f(C)), one row per iteration.
template <class Op>
void forward_pass(float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias) {
  Kokkos::parallel_for(
      forward_epilogue_label(), Kokkos::RangePolicy<>(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        float* row = c + i * ldc;
        if (bias != nullptr) {
          for (int64_t j = 0; j < cols; ++j) row[j] = Op::value(row[j] + bias[j]);
        } else {
          for (int64_t j = 0; j < cols; ++j) row[j] = Op::value(row[j]);
        }
      });
}

// Columns per iteration of the backward pass: on the host a block of 64 (each row's part
// is contiguous, and the compiler vectorizes the inner loop), on a GPU one column per thread
// (neighbouring threads read neighbouring elements).
constexpr int64_t kBackwardColumns =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace,
                               Kokkos::DefaultExecutionSpace::memory_space>::accessible
        ? 64
        : 1;

// C = f'(z) * C elementwise and, with bias_gradient, its column sums: each iteration takes a
// block of columns down all rows, summing in fp32 in row order (as the layers' bias gradient,
// layers/linear.cpp). z = C itself for the identity (which does not read it).
template <class Op>
void backward_pass(float* c, int64_t ldc, int64_t rows, int64_t cols, const float* z, int64_t ldz,
                   float* bias_gradient) {
  constexpr int64_t width = kBackwardColumns;
  Kokkos::parallel_for(
      backward_epilogue_label(),
      Kokkos::RangePolicy<>(device_space(), 0, (cols + width - 1) / width),
      KOKKOS_LAMBDA(const int64_t block) {
        const int64_t first = block * width;
        const int64_t count = cols - first < width ? cols - first : width;
        float sums[width];
        for (int64_t j = 0; j < width; ++j) sums[j] = 0.0f;
        for (int64_t i = 0; i < rows; ++i) {
          float* row = c + i * ldc + first;
          const float* z_row = z + i * ldz + first;
          for (int64_t j = 0; j < count; ++j) {
            const float g = Op::gradient(z_row[j], row[j]);
            row[j] = g;
            sums[j] += g;
          }
        }
        if (bias_gradient != nullptr) {
          for (int64_t j = 0; j < count; ++j) bias_gradient[first + j] = sums[j];
        }
      });
}

// Applies what the backend left of the epilogue of `call`.
void apply_epilogue_left(const gemm_backend::RowMajorGemm& call,
                         const gemm_backend::EpilogueLeft& left) {
  if (left.nothing()) return;
  if (left.backward) {
    const bool identity = call.activation == Activation::none;
    const float* z = identity ? call.c : call.activation_input;
    const int64_t ldz = identity ? call.ldc : call.ld_activation_input;
    activation_math::with_activation(call.activation, [&](auto op) {
      backward_pass<decltype(op)>(call.c, call.ldc, call.m, call.n, z, ldz, call.bias_gradient);
    });
    return;
  }
  activation_math::with_activation(left.activation, [&](auto op) {
    forward_pass<decltype(op)>(call.c, call.ldc, call.m, call.n, left.bias ? call.bias : nullptr);
  });
}

// bad_input unless the epilogue fits C [m, n].
void check_epilogue(const GemmEpilogue& e, std::size_t m, std::size_t n) {
  if (e.has_bias() && e.bias.extent(0) != n) {
    MESHTRAIN_BAD_INPUT("gemm: the bias has ", e.bias.extent(0), " elements and C has ", n,
                        " columns; the epilogue adds bias[j] to column j");
  }
  if (!e.is_backward) {
    if (e.activation_input.data() != nullptr || e.has_bias_gradient()) {
      MESHTRAIN_BAD_INPUT("gemm: a forward epilogue takes no activation input or bias gradient ",
                          "(use GemmEpilogue::backward)");
    }
    return;
  }
  if (e.has_bias()) {
    MESHTRAIN_BAD_INPUT("gemm: a backward epilogue adds no bias (it computes the bias gradient)");
  }
  const bool has_input = e.activation_input.data() != nullptr;
  if (e.activation != Activation::none && !has_input) {
    MESHTRAIN_BAD_INPUT("gemm: the backward epilogue of ", to_string(e.activation),
                        " needs the activation's input z [", m, ", ", n, "]");
  }
  if (e.activation == Activation::none && has_input) {
    MESHTRAIN_BAD_INPUT("gemm: a backward epilogue without an activation takes no activation ",
                        "input");
  }
  if (has_input && (e.activation_input.extent(0) != m || e.activation_input.extent(1) != n)) {
    MESHTRAIN_BAD_INPUT("gemm: the activation input is [", e.activation_input.extent(0), ", ",
                        e.activation_input.extent(1), "] and C is [", m, ", ", n,
                        "]; they must be the same shape");
  }
  if (e.has_bias_gradient() && e.bias_gradient.extent(0) != n) {
    MESHTRAIN_BAD_INPUT("gemm: the bias gradient has ", e.bias_gradient.extent(0),
                        " elements and C has ", n, " columns");
  }
}

// The fp32 scratch gemm() widens 16-bit operands into where the kernel reads fp32 (gemm.hpp):
// one per operand, made at the first such call and grown when a larger one comes, kept until
// Kokkos::finalize.
struct WideningScratch {
  Matrix a, b;
  Matrix c;  // gemm_to_16bit()'s fp32 C where the kernel writes fp32
};
WideningScratch* the_widening_scratch = nullptr;

WideningScratch& widening_scratch() {
  if (the_widening_scratch == nullptr) {
    the_widening_scratch = new WideningScratch();
    Kokkos::push_finalize_hook([] {
      delete the_widening_scratch;
      the_widening_scratch = nullptr;
    });
  }
  return *the_widening_scratch;
}

// The stored 16-bit matrix `x` widened (exactly) into `buffer` (grown to hold it), contiguous.
ConstMatrixView widened(ConstHalfMatrixView x, Dtype dtype, Matrix& buffer, const char* label) {
  const std::size_t rows = x.extent(0), cols = x.extent(1);
  if (buffer.span() < rows * cols) {
    buffer = Matrix();
    buffer =
        Matrix(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), rows, cols);
  }
  const MatrixView out(buffer.data(), rows, cols);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::gemm_widen_16bit"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0}, {static_cast<int64_t>(rows), static_cast<int64_t>(cols)}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t col) {
        out(r, col) = from_16bit(x(r, col), dtype);
      });
  return out;
}

}  // namespace

namespace gemm_backend {
HostLibrary default_host_library() {
  // The environment's MESHTRAIN_CPU_GEMM overrides the build's choice in a build with oneDNN:
  // to run a program or the tests through another library without rebuilding.
  if (const char* text = std::getenv("MESHTRAIN_CPU_GEMM"); text != nullptr && *text != '\0') {
    const std::string name(text);
#if defined(MESHTRAIN_GEMM_ONEDNN)
    if (name == "auto" || name == "onednn") return HostLibrary::onednn;
#else
    if (name == "auto") return HostLibrary::openblas;
#endif
    if (name == "openblas") return HostLibrary::openblas;
#if defined(MESHTRAIN_GEMM_ONEDNN)
    MESHTRAIN_BAD_INPUT("the environment's MESHTRAIN_CPU_GEMM = '", name,
                        "' is not one of auto | onednn | openblas");
#else
    MESHTRAIN_BAD_INPUT("the environment's MESHTRAIN_CPU_GEMM = '", name,
                        "': this build has OpenBLAS only (no oneDNN found, or "
                        "-DMESHTRAIN_CPU_GEMM=openblas)");
#endif
  }
  // oneDNN wherever the build has it (-DMESHTRAIN_CPU_GEMM=auto or onednn; issue 37): fp32 as fast
  // as OpenBLAS or faster here, its bf16 matmul on CPUs with AVX512_BF16 or AMX, fused forward
  // epilogues. Each execution allocates inside oneDNN, freed before it returns: on the heap its
  // execution context and argument map (operator new), and with posix_memalign the call's memory
  // objects and its gemm kernel's workspace (docs/design.md, GEMM; docs/limits.md).
#if defined(MESHTRAIN_GEMM_ONEDNN)
  return HostLibrary::onednn;
#else
  return HostLibrary::openblas;
#endif
}

void select_host_library(HostLibrary library, Bf16Kernel bf16_kernel) {
#if !defined(MESHTRAIN_GEMM_ONEDNN)
  MESHTRAIN_REQUIRE(library == HostLibrary::openblas,
                    "gemm: this build has no oneDNN (MESHTRAIN_CPU_GEMM=openblas or not found)");
#endif
  g_host_library = library;
  g_bf16_kernel = bf16_kernel;
  g_host_library_set = true;
  forget_reads_16bit();
}

HostLibrary selected_host_library() {
  return host_library();
}

EpilogueLeft whole_epilogue(const RowMajorGemm& call) {
  EpilogueLeft left;
  left.backward = call.backward;
  if (!call.backward) {
    left.bias = call.bias != nullptr;
    left.activation = call.activation;
  }
  return left;
}
}  // namespace gemm_backend

void set_matmul_precision(MatmulPrecision precision) {
  g_matmul_precision = precision;
}

MatmulPrecision matmul_precision() {
  return g_matmul_precision;
}

namespace {

// The host library inference_gemm() runs: oneDNN where the build has it (its fused
// epilogues), unless the environment's MESHTRAIN_CPU_GEMM names one; gemm()'s otherwise.
gemm_backend::HostLibrary inference_host_library() {
#if defined(MESHTRAIN_GEMM_ONEDNN)
  static const gemm_backend::HostLibrary library = [] {
    const char* text = std::getenv("MESHTRAIN_CPU_GEMM");
    return text != nullptr && *text != '\0' ? gemm_backend::default_host_library()
                                            : gemm_backend::HostLibrary::onednn;
  }();
  return library;
#else
  return host_library();
#endif
}

void gemm_on(gemm_backend::HostLibrary library, GemmOperand a, GemmOperand b, float beta,
             MatrixView c, Dtype inputs, const GemmEpilogue& epilogue, bool rows_vary = false,
             HalfMatrixView c16 = {}, bool sixteen_bit_c = false);

// gemm_reads_16bit() for `library` (host memory) or CUDA, asked of the library.
bool library_reads_16bit(gemm_backend::HostLibrary library, Dtype inputs) {
  (void)library;
  if (inputs == Dtype::fp32) return false;
  if constexpr (kDeviceMemoryIsHostInaccessible) return true;  // cuBLAS
#if defined(MESHTRAIN_GEMM_ONEDNN)
  if (library == gemm_backend::HostLibrary::onednn) {
    return gemm_backend::onednn_runs_bf16(inputs, g_bf16_kernel);
  }
#endif
  return false;
}

// The same, asked once per selection (g_reads_16bit).
bool reads_16bit(gemm_backend::HostLibrary library, Dtype inputs) {
  if (inputs == Dtype::fp32) return false;
  std::atomic<int>& known = g_reads_16bit[library == gemm_backend::HostLibrary::onednn ? 1 : 0]
                                         [inputs == Dtype::bf16 ? 0 : 1];
  int answer = known.load(std::memory_order_relaxed);
  if (answer < 0) {
    answer = library_reads_16bit(library, inputs) ? 1 : 0;
    known.store(answer, std::memory_order_relaxed);
  }
  return answer == 1;
}

}  // namespace

bool gemm_reads_16bit(Dtype inputs) {
  // MESHTRAIN_GEMM_16BIT_OPERANDS=always (gemm.hpp): the layers hand 16-bit operands whatever the
  // kernel; gemm() widens them where it reads fp32 (reads_16bit, not this, decides that).
  static const bool always = [] {
    const char* text = std::getenv("MESHTRAIN_GEMM_16BIT_OPERANDS");
    if (text == nullptr || *text == '\0' || std::string(text) == "auto") return false;
    if (std::string(text) == "always") return true;
    MESHTRAIN_BAD_INPUT("the environment's MESHTRAIN_GEMM_16BIT_OPERANDS = '", text,
                        "' is not one of auto | always");
  }();
  return (always && inputs != Dtype::fp32) || gemm_kernel_reads_16bit(inputs);
}

bool gemm_kernel_reads_16bit(Dtype inputs) {
  return reads_16bit(host_library(), inputs);
}

void gemm(GemmOperand a, GemmOperand b, float beta, MatrixView c, Dtype inputs,
          const GemmEpilogue& epilogue) {
  gemm_on(host_library(), a, b, beta, c, inputs, epilogue);
}

void gemm_varying_rows(GemmOperand a, GemmOperand b, float beta, MatrixView c, Dtype inputs,
                       const GemmEpilogue& epilogue) {
  gemm_on(host_library(), a, b, beta, c, inputs, epilogue, /*rows_vary=*/true);
}

void gemm_to_16bit(GemmOperand a, GemmOperand b, HalfMatrixView c, Dtype inputs) {
  if (inputs == Dtype::fp32) {
    MESHTRAIN_BAD_INPUT(
        "gemm_to_16bit: C's 16 bits need inputs bf16 or fp16 (which its bits are), ", "got fp32");
  }
  gemm_on(host_library(), a, b, 0.0f, MatrixView(), inputs, GemmEpilogue{}, /*rows_vary=*/false, c,
          /*sixteen_bit_c=*/true);
}

bool gemm_kernel_writes_16bit(Dtype inputs) {
  // The kernel that reads 16-bit operands as stored writes a 16-bit C as well (oneDNN's bf16
  // matmul), so the answer is gemm_kernel_reads_16bit()'s, but for CUDA builds: cuBLAS's
  // algorithm with a 16-bit C, its fp32 -> 16-bit rounding and its overflow to inf are not yet
  // compared with gemm()'s fp32 C rounded on a GPU, so there gemm_to_16bit() takes the fp32
  // kernel and the rounding pass (gemm_on), and the layers keep the fp32 gradient and its packing.
  return !kDeviceMemoryIsHostInaccessible && gemm_kernel_reads_16bit(inputs);
}

void inference_gemm(GemmOperand a, GemmOperand b, float beta, MatrixView c,
                    const GemmEpilogue& epilogue) {
  gemm_on(inference_host_library(), a, b, beta, c, Dtype::fp32, epilogue);
}

bool inference_gemm_fuses_forward_epilogues() {
  if constexpr (kDeviceMemoryIsHostInaccessible) return false;
  return inference_host_library() == gemm_backend::HostLibrary::onednn;
}

namespace {

// The rounding pass of gemm_to_16bit() where the kernel wrote fp32 scratch: c16 = RNE(wide).
void round_into_16bit(ConstMatrixView wide, HalfMatrixView c16, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::gemm_round_c_16bit"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0},
          {static_cast<int64_t>(c16.extent(0)), static_cast<int64_t>(c16.extent(1))}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t col) {
        c16(r, col) = to_16bit(wide(r, col), dtype);
      });
}

void gemm_on(gemm_backend::HostLibrary library, GemmOperand a, GemmOperand b, float beta,
             MatrixView c, Dtype inputs, const GemmEpilogue& epilogue, bool rows_vary,
             HalfMatrixView c16, bool sixteen_bit_c) {
  const std::size_t c_rows = sixteen_bit_c ? c16.extent(0) : c.extent(0),
                    c_cols = sixteen_bit_c ? c16.extent(1) : c.extent(1);
  const std::size_t m = op_rows(a), k = op_cols(a), n = op_cols(b);
  if (op_rows(b) != k || c_rows != m || c_cols != n) {
    MESHTRAIN_BAD_INPUT("gemm: op(A) is [", m, ", ", k, "], op(B) is [", op_rows(b), ", ", n,
                        "] and C is [", c_rows, ", ", c_cols,
                        "]; expected op(A) [M, K] @ op(B) [K, N] = C [M, N]");
  }
  check_epilogue(epilogue, m, n);
  if ((a.sixteen_bit || b.sixteen_bit) && inputs == Dtype::fp32) {
    MESHTRAIN_BAD_INPUT("gemm: a 16-bit operand needs inputs bf16 or fp16 (which its bits are), ",
                        "got fp32");
  }
  if (n == 0) return;
  if (m == 0) {  // no rows: an empty bias gradient is a sum of nothing
    if (epilogue.has_bias_gradient()) fill_view(epilogue.bias_gradient, 0.0f);
    return;
  }
  TraceSpan span("gemm", TraceKind::gemm);
  span.shape(static_cast<int64_t>(m), static_cast<int64_t>(n), static_cast<int64_t>(k))
      .detail(to_string(inputs));
  gemm_backend::RowMajorGemm call;
  call.transpose_a = a.transpose;
  call.transpose_b = b.transpose;
  call.m = blas_int(m, "M");
  call.n = blas_int(n, "N");
  call.k = blas_int(k, "K");
  call.a = a.sixteen_bit ? nullptr : a.matrix.data();
  call.a16 = a.sixteen_bit ? a.half.data() : nullptr;
  call.lda = leading_dimension(a.row_stride(), a.extent(1), "the leading dimension of A");
  call.b = b.sixteen_bit ? nullptr : b.matrix.data();
  call.b16 = b.sixteen_bit ? b.half.data() : nullptr;
  call.ldb = leading_dimension(b.row_stride(), b.extent(1), "the leading dimension of B");
  call.beta = beta;
  call.c = c.data();
  call.ldc = sixteen_bit_c ? leading_dimension(c16.stride(0), n, "the leading dimension of C")
                           : leading_dimension(c.stride(0), n, "the leading dimension of C");
  call.precision = g_matmul_precision;
  call.inputs = inputs;
  call.rows_vary = rows_vary;
  call.backward = epilogue.is_backward;
  call.activation = epilogue.activation;
  call.bias = epilogue.bias.data();
  call.activation_input = epilogue.activation_input.data();
  if (call.activation_input != nullptr) {
    call.ld_activation_input =
        leading_dimension(epilogue.activation_input.stride(0), n, "the activation input's rows");
  }
  call.bias_gradient = epilogue.bias_gradient.data();
  if (sixteen_bit_c && k == 0) {          // an empty sum: C = 0
    Kokkos::deep_copy(c16, uint16_t{0});  // +0 in both 16-bit formats
    return;
  }
  if (k == 0) {  // an empty sum: C = beta * C, then the epilogue
    scale(c, beta);
    apply_epilogue_left(call, gemm_backend::whole_epilogue(call));
    return;
  }
  if ((a.sixteen_bit || b.sixteen_bit) && !reads_16bit(library, inputs)) {
    // An fp32 kernel: the 16-bit operands widened into fp32 scratch first (gemm.hpp).
    WideningScratch& scratch = widening_scratch();
    if (a.sixteen_bit) {
      call.a = widened(a.half, inputs, scratch.a, "meshtrain::gemm_widened_a").data();
      call.a16 = nullptr;
      call.lda = leading_dimension(a.extent(1), a.extent(1), "the leading dimension of A");
    }
    if (b.sixteen_bit) {
      call.b = widened(b.half, inputs, scratch.b, "meshtrain::gemm_widened_b").data();
      call.b16 = nullptr;
      call.ldb = leading_dimension(b.extent(1), b.extent(1), "the leading dimension of B");
    }
  }
  // gemm_to_16bit(): the kernel writes C's 16 bits, or the fp32 kernel writes scratch and one
  // pass rounds it into C (gemm.hpp).
  MatrixView wide_c;
  if (sixteen_bit_c) {
    if (!kDeviceMemoryIsHostInaccessible &&
        reads_16bit(library, inputs)) {  // gemm_kernel_writes_16bit()
      call.c16 = c16.data();
    } else {
      Matrix& buffer = widening_scratch().c;
      if (buffer.span() < m * n) {
        buffer = Matrix();
        buffer = Matrix(
            Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("meshtrain::gemm_wide_c")),
            m, n);
      }
      wide_c = MatrixView(buffer.data(), m, n);
      call.c = wide_c.data();
      call.ldc = leading_dimension(n, n, "the leading dimension of C");
    }
  }
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<MatrixView::memory_space, Kokkos::CudaSpace>) {
    apply_epilogue_left(call, gemm_backend::cuda_gemm(call));
    if (wide_c.data() != nullptr) round_into_16bit(wide_c, c16, inputs);
    return;
  }
#endif
  static_assert(!kDeviceMemoryIsHostInaccessible || MESHTRAIN_GEMM_HAS_CUDA,
                "gemm has backends for host memory and CUDA memory only");
  // The library reads memory written by Kokkos kernels on the host execution space: wait
  // for them (a no-op on Serial). Not a fence of a CUDA build's step (cuBLAS is ordered on the
  // stream), so StepGraph's host checker does not count it.
  {
    const HostLibraryFence host_library_only;
    fence_device(MESHTRAIN_LABEL("meshtrain::gemm"));
  }
#if defined(MESHTRAIN_GEMM_ONEDNN)
  if (library == gemm_backend::HostLibrary::onednn) {
    apply_epilogue_left(call, gemm_backend::onednn_gemm(call, g_bf16_kernel));
    if (wide_c.data() != nullptr) round_into_16bit(wide_c, c16, inputs);
    return;
  }
#endif
  apply_epilogue_left(call, gemm_backend::cblas_gemm(call));
  if (wide_c.data() != nullptr) round_into_16bit(wide_c, c16, inputs);
}

}  // namespace

std::string gemm_kernels() {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<MatrixView::memory_space, Kokkos::CudaSpace>) {
    return gemm_backend::cuda_description();
  }
#endif
#if defined(MESHTRAIN_GEMM_ONEDNN)
  const gemm_backend::HostLibrary library = host_library();
  if (library == gemm_backend::HostLibrary::onednn) {
    return gemm_backend::onednn_description();
  }
#endif
  return gemm_backend::cblas_description();
}

std::string inference_gemm_kernels() {
#if defined(MESHTRAIN_GEMM_ONEDNN)
  if (inference_gemm_fuses_forward_epilogues()) return gemm_backend::onednn_description();
#endif
  return gemm_kernels();
}

}  // namespace meshtrain
