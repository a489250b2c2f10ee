// gemm() on host memory through oneDNN's matmul primitive (built when MESHTRAIN_GEMM_ONEDNN:
// MESHTRAIN_CPU_GEMM=auto or onednn where oneDNN 2.6 or later is found).
//
// One CPU engine and one stream for the process. A primitive is made for each distinct
// (N, transposes, kernel dtype, bias, activation, beta; a fixed-shape one's M, K and row
// strides) at its first call and kept in a table on the heap (as cuBLAS keeps its handle).
// fp32: M, K and the row strides are runtime dimensions (DNNL_RUNTIME_DIM_VAL): one primitive
// serves every batch size and every number of rows an MoE expert receives, and oneDNN 2.6 then
// takes its gemm-based kernel ("gemm:jit"), which runs the GEMMs of a training step as fast as
// OpenBLAS's sgemm or faster here, while its fp32 brgemm kernel, which it takes for fixed
// shapes, copies a plain B into its blocked layout at every call (0.6x of OpenBLAS for x @ W;
// docs/design.md, GEMM). bf16: the other way round, oneDNN's brgemm kernel (AMX) on fixed shapes
// beats its bf16 gemm kernel (2.2x on the weight gradient Xᵀ @ dY, whose K is the batch), so a
// bf16 call whose rows are stable runs a primitive made for its whole shape, and one whose rows
// vary (gemm_varying_rows(): an MoE expert's) the runtime-dimension one, a pure function of the
// call (primitive_for, below; where an operand is row-strided, a block of a wider matrix as
// tensor parallelism's are, oneDNN 2.6 makes even the fixed-shape one gemm:jit). Each call
// describes its operands through oneDNN's C API (memory objects made and destroyed inside
// oneDNN, none of ours) and executes the primitive: oneDNN allocates inside every execution,
// freed before it returns, which no call of its API avoids: a few small operator new blocks (its
// execution context and argument map; tests/support/onednn_allocations.hpp, the allocation tests
// require none kept) and, with posix_memalign, those memory objects and a workspace of its gemm
// kernel. Scratchpads are ours (scratchpad_mode::user): one buffer, grown to the largest
// primitive's need and shared, since calls are serialized; passed only to a primitive that has
// one.
//
// Threads: Debian's libdnnl runs on OpenMP and uses omp_get_max_threads() threads, so one
// thread per rank comes from OMP_NUM_THREADS=1, which scripts/env.sh and the tests set (as
// OPENBLAS_NUM_THREADS=1 for OpenBLAS); onednn_description() says how many it uses.
//
// bf16 (RowMajorGemm::inputs): the operands' values are bf16 numbers, in 16-bit buffers (a16,
// b16) or held in fp32 ones. Where the CPU has bf16 instructions (AVX512_BF16, AMX) the bf16
// matmul (fp32 accumulation, fp32 C) reads 16-bit operands as stored and fp32 ones copied to
// bf16 scratch. Elsewhere oneDNN emulates bf16 on AVX-512 (several times slower than its fp32
// matmul) or has no bf16 matmul at all (AVX2), so the fp32 matmul multiplies the same values
// (gemm() widens 16-bit operands into fp32 scratch first): bf16 products are exact in fp32,
// the results differ only in the order of the fp32 additions. fp16 always takes the fp32
// matmul (oneDNN 2.6 has no fp16 matmul on CPUs); its products are exact in fp32 as well.
// A 16-bit C (gemm_to_16bit(), RowMajorGemm::c16) comes here only on the bf16 matmul: its dst is
// then bf16, which oneDNN converts from its fp32 accumulators rounding to nearest even, the same
// primitive choice as an fp32 dst (the key differs in c16 alone), so the bits are those of the
// fp32 C rounded (tests/core/gemm_test.cpp, SixteenBitCIsTheFp32CRounded), bit for bit but for
// fp32 sums below 2^-126, which become zeros of their sign (the AVX512_BF16 conversion,
// VCVTNEPS2BF16, flushes them; to_16bit() keeps them as subnormal bf16). Measured on an AMX CPU
// (the test's tiny products): the bf16 matmul's fp32 C holds no subnormal either (its fp32
// accumulation flushes them), so both dsts gave the same zeros there.

#include <dlfcn.h>
#include <dnnl.hpp>

#include <Kokkos_Core.hpp>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
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

using DataType = dnnl::memory::data_type;
using Dims = dnnl::memory::dims;

// M, K and the row strides of A, B, C as the matmul reads them (after any bf16 copy): the part
// of a call's shape that a runtime-dimension primitive takes at run time.
struct FixedShape {
  int m = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  bool operator==(const FixedShape& o) const {
    return m == o.m && k == o.k && lda == o.lda && ldb == o.ldb && ldc == o.ldc;
  }
};

// What a primitive is made for: N, the transposes, the kernel dtype and the epilogue; and, for a
// fixed-shape primitive, the rest of the call's shape (`shape`; all zero for a runtime-dimension
// primitive, which serves every M, K and row stride).
struct PrimitiveKey {
  int n = 0;
  bool transpose_a = false, transpose_b = false;
  bool bf16 = false;  // the bf16 matmul on bf16 copies (else fp32)
  bool c16 = false;   // a bf16 dst (gemm_to_16bit(); bf16 matmul only), else fp32
  bool bias = false;
  Activation activation = Activation::none;
  uint32_t beta_bits = 0;  // beta, bit for bit (0: no sum post-op)
  bool fixed = false;      // M, K and the row strides fixed to `shape` (else runtime)
  FixedShape shape;

  bool operator==(const PrimitiveKey& o) const {
    return n == o.n && transpose_a == o.transpose_a && transpose_b == o.transpose_b &&
           bf16 == o.bf16 && c16 == o.c16 && bias == o.bias && activation == o.activation &&
           beta_bits == o.beta_bits && fixed == o.fixed && shape == o.shape;
  }
};

struct PrimitiveKeyHash {
  std::size_t operator()(const PrimitiveKey& key) const {
    std::size_t h = std::hash<int>()(key.n);
    const auto mix = [&h](std::size_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<std::size_t>(key.transpose_a) |
        (static_cast<std::size_t>(key.transpose_b) << 1) |
        (static_cast<std::size_t>(key.bf16) << 2) | (static_cast<std::size_t>(key.bias) << 3) |
        (static_cast<std::size_t>(key.fixed) << 4) |
        (static_cast<std::size_t>(key.activation) << 5) |
        (static_cast<std::size_t>(key.c16) << 13));
    mix(key.beta_bits);
    for (int v : {key.shape.m, key.shape.k, key.shape.lda, key.shape.ldb, key.shape.ldc}) {
      mix(static_cast<std::size_t>(v));
    }
    return h;
  }
};

// A primitive and the memory objects of its fixed-shape arguments.
struct Primitive {
  dnnl::matmul matmul;
  dnnl::memory bias, scratchpad;
  std::size_t scratchpad_bytes = 0;
};

// The fixed-shape primitives kept at most (primitive_for): the least recently used is dropped
// beyond it. A model's GEMMs have a few shapes per layer shape; 256 bounds a process that sees
// many (a sweep over batch sizes) without bounding anything a run needs.
constexpr std::size_t kMaxFixedPrimitives = 256;

constexpr dnnl_dim_t kRuntime = DNNL_RUNTIME_DIM_VAL;

dnnl::algorithm eltwise_of(Activation activation, float& alpha) {
  alpha = 0.0f;
  switch (activation) {
    case Activation::relu:
      return dnnl::algorithm::eltwise_relu;  // alpha 0: no slope below 0
    case Activation::tanh:
      return dnnl::algorithm::eltwise_tanh;
    case Activation::gelu:
      return dnnl::algorithm::eltwise_gelu_tanh;
    case Activation::gelu_erf:
      return dnnl::algorithm::eltwise_gelu_erf;
    case Activation::silu:
      alpha = 1.0f;  // swish: x sigmoid(alpha x)
      return dnnl::algorithm::eltwise_swish;
    case Activation::sigmoid:
      return dnnl::algorithm::eltwise_logistic;
    case Activation::none:
      break;
  }
  MESHTRAIN_FAIL("gemm (oneDNN): no eltwise post-op for activation ", to_string(activation));
}

// The strides of a row-major matrix stored with row stride ld, seen as op(X): its transpose
// swaps them. A plain pair for the calls (dnnl::memory::dims is a std::vector, which would
// allocate at every call); dims_of for making primitives.
struct Strides {
  dnnl_dim_t rows, cols;
};
Strides op_strides(dnnl_dim_t ld, bool transpose) {
  return transpose ? Strides{1, ld} : Strides{ld, 1};
}
Dims dims_of(Strides s) {
  return Dims{s.rows, s.cols};
}

using HostBits = Kokkos::View<uint16_t*, Kokkos::HostSpace>;
using HostBytes = Kokkos::View<unsigned char*, Kokkos::HostSpace>;

// The process's oneDNN state. Made at the first call; Kokkos::finalize destroys it (it holds
// Kokkos views).
struct OneDnn {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // Runtime-dimension primitives (key.fixed false), kept for the process.
  std::unordered_map<PrimitiveKey, std::unique_ptr<Primitive>, PrimitiveKeyHash> primitives;
  // Fixed-shape primitives, most recently used first, at most kMaxFixedPrimitives; a null
  // primitive: oneDNN made none for that shape, the call runs the runtime-dimension one.
  struct Fixed {
    PrimitiveKey key;
    std::unique_ptr<Primitive> primitive;
  };
  std::list<Fixed> fixed;
  std::unordered_map<PrimitiveKey, std::list<Fixed>::iterator, PrimitiveKeyHash> fixed_index;
  HostBytes scratchpad;  // shared by every primitive: calls are serialized by `mutex`
  HostBits a16, b16;     // the bf16 copies of A and B
  std::mutex mutex;
};
OneDnn* the_onednn = nullptr;

OneDnn& onednn() {
  if (the_onednn == nullptr) {
    the_onednn = new OneDnn();
    Kokkos::push_finalize_hook([] {
      delete the_onednn;
      the_onednn = nullptr;
    });
  }
  return *the_onednn;
}

template <class View>
typename View::pointer_type grown(View& buffer, std::size_t count, const char* label) {
  if (buffer.extent(0) < count) {
    buffer = View();
    buffer = View(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), count);
  }
  return buffer.data();
}

// A stored row-major fp32 matrix [rows, cols] (row stride ld) as contiguous bf16 (row stride
// cols). Its values are bf16 numbers: the conversion is exact.
const uint16_t* bf16_copy(const float* data, int rows, int cols, int ld, HostBits& buffer,
                          const char* label) {
  uint16_t* out = grown(buffer, static_cast<std::size_t>(rows) * cols, label);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::gemm_to_bf16"),
      Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t r) {
        const float* in = data + r * static_cast<int64_t>(ld);
        uint16_t* row = out + r * static_cast<int64_t>(cols);
        for (int c = 0; c < cols; ++c) row[c] = float_to_bf16(in[c]);
      });
  {
    const HostLibraryFence host_library_only;  // a host GEMM's (step_graph.hpp)
    fence_space(host_space(), MESHTRAIN_LABEL("meshtrain::gemm_to_bf16"));
  }
  return out;
}

// A primitive for `key`: M, K and the row strides at run time, or fixed to key.shape.
std::unique_ptr<Primitive> make_primitive(OneDnn& state, const PrimitiveKey& key) {
  const DataType operand = key.bf16 ? DataType::bf16 : DataType::f32;
  // N fixed (bias, post-ops); M, K and the row strides at run time or fixed.
  const bool fixed = key.fixed;
  const FixedShape& shape = key.shape;
  const dnnl_dim_t m = fixed ? shape.m : kRuntime, k = fixed ? shape.k : kRuntime;
  const dnnl::memory::desc a_md({m, k}, operand,
                                dims_of(op_strides(fixed ? shape.lda : kRuntime, key.transpose_a)));
  const dnnl::memory::desc b_md({k, key.n}, operand,
                                dims_of(op_strides(fixed ? shape.ldb : kRuntime, key.transpose_b)));
  const dnnl::memory::desc c_md({m, key.n}, key.c16 ? DataType::bf16 : DataType::f32,
                                Dims{fixed ? shape.ldc : kRuntime, 1});
  const dnnl::memory::desc bias_md({1, key.n}, DataType::f32, Dims{key.n, 1});
  dnnl::post_ops post_ops;
  float beta = 0.0f;
  std::memcpy(&beta, &key.beta_bits, sizeof beta);
  if (key.beta_bits != 0) post_ops.append_sum(beta);  // C = product + bias + beta C
  if (key.activation != Activation::none) {
    float alpha = 0.0f;
    const dnnl::algorithm algorithm = eltwise_of(key.activation, alpha);
    post_ops.append_eltwise(1.0f, algorithm, alpha, 0.0f);
  }
  dnnl::primitive_attr attr;
  attr.set_post_ops(post_ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::desc desc = key.bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md)
                                           : dnnl::matmul::desc(a_md, b_md, c_md);
  const dnnl::matmul::primitive_desc pd(desc, attr, state.engine);
  auto made = std::make_unique<Primitive>();
  made->matmul = dnnl::matmul(pd);
  // Memory objects on no buffer yet (DNNL_MEMORY_NONE): each call sets its own.
  if (key.bias) made->bias = dnnl::memory(bias_md, state.engine, DNNL_MEMORY_NONE);
  made->scratchpad_bytes = pd.scratchpad_desc().get_size();
  made->scratchpad = dnnl::memory(pd.scratchpad_desc(), state.engine, DNNL_MEMORY_NONE);
  return made;
}

void check(dnnl_status_t status, const char* call) {
  if (status != dnnl_success) {
    MESHTRAIN_FAIL("gemm (oneDNN): ", call, " failed with status ", static_cast<int>(status));
  }
}

// A memory object of this call's shape on `data`, made and destroyed through the C API (what it
// allocates, oneDNN allocates).
class CallMemory {
 public:
  CallMemory(const OneDnn& state, dnnl_dim_t rows, dnnl_dim_t cols, Strides strides, DataType type,
             const void* data) {
    dnnl_memory_desc_t md;
    const dnnl_dims_t dims = {rows, cols};
    const dnnl_dims_t stride = {strides.rows, strides.cols};
    check(
        dnnl_memory_desc_init_by_strides(&md, 2, dims, static_cast<dnnl_data_type_t>(type), stride),
        "dnnl_memory_desc_init_by_strides");
    check(dnnl_memory_create(&memory_, &md, state.engine.get(), const_cast<void*>(data)),
          "dnnl_memory_create");
  }
  ~CallMemory() { dnnl_memory_destroy(memory_); }
  CallMemory(const CallMemory&) = delete;
  CallMemory& operator=(const CallMemory&) = delete;
  dnnl_memory_t get() const { return memory_; }

 private:
  dnnl_memory_t memory_ = nullptr;
};

void set_buffer(const dnnl::memory& memory, const void* data) {
  check(dnnl_memory_set_data_handle_v2(memory.get(), const_cast<void*>(data), nullptr),
        "dnnl_memory_set_data_handle");
}

dnnl_cpu_isa_t effective_isa() {
  return dnnl_get_effective_cpu_isa();
}

bool has_isa(dnnl_cpu_isa_t isa, dnnl_cpu_isa_t wanted) {
  return (static_cast<unsigned>(isa) & static_cast<unsigned>(wanted)) ==
         static_cast<unsigned>(wanted);
}

const char* isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_mic:
      return "avx512_mic";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_sse41:
      return "sse41";
    default:
      return "an unnamed ISA";
  }
}

// Whether oneDNN makes a bf16 matmul on this CPU at all (emulated or not).
bool bf16_matmul_exists(OneDnn& state) {
  static const bool exists = [&state] {
    try {
      PrimitiveKey key;
      key.n = 16;
      key.bf16 = true;
      make_primitive(state, key);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return exists;
}

// dnnl_primitive_execute calls so far (onednn_executions), and those of them on a fixed-shape
// primitive (onednn_fixed_shape_executions).
std::atomic<int64_t> g_executions{0};
std::atomic<int64_t> g_fixed_executions{0};

// The threads oneDNN's parallel regions use: omp_get_max_threads() of the OpenMP runtime that
// libdnnl loaded (looked up rather than linked, so that nothing else links OpenMP).
int openmp_threads() {
  using MaxThreads = int (*)();
  const auto max_threads = reinterpret_cast<MaxThreads>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  return max_threads != nullptr ? max_threads() : 1;
}

}  // namespace

bool onednn_has_native_bf16() {
  // The ISA oneDNN takes is fixed at its first use (the CPU, ONEDNN_MAX_CPU_ISA).
  static const bool native = has_isa(effective_isa(), dnnl_cpu_isa_avx512_core_bf16);
  return native;
}

bool onednn_has_bf16_matmul() {
  OneDnn& state = onednn();
  const std::lock_guard<std::mutex> lock(state.mutex);
  return bf16_matmul_exists(state);
}

namespace {

// The decision of onednn_runs_bf16, under the state's lock.
bool runs_bf16(OneDnn& state, Dtype inputs, Bf16Kernel bf16_kernel) {
  if (inputs != Dtype::bf16) return false;
  switch (bf16_kernel) {
    case Bf16Kernel::automatic:
      return onednn_has_native_bf16() && bf16_matmul_exists(state);
    case Bf16Kernel::bf16:
      if (!bf16_matmul_exists(state)) {
        MESHTRAIN_FAIL("gemm (oneDNN): this CPU (", isa_name(effective_isa()),
                       ") has no bf16 matmul");
      }
      return true;
    case Bf16Kernel::fp32:
      break;
  }
  return false;
}

}  // namespace

namespace {

// The runtime-dimension primitive for `key`, made at its first use (and the scratchpad grown to
// it) and kept.
Primitive& runtime_primitive(OneDnn& state, const PrimitiveKey& key) {
  auto found = state.primitives.find(key);
  if (found == state.primitives.end()) {
    std::unique_ptr<Primitive> made;
    try {
      made = make_primitive(state, key);
    } catch (const dnnl::error& e) {
      MESHTRAIN_FAIL("gemm (oneDNN): no matmul for op(A) [M, K] @ op(B) [K, ", key.n, "] (",
                     key.bf16 ? "bf16" : "fp32", "): ", e.what());
    }
    grown(state.scratchpad, made->scratchpad_bytes + 64, "meshtrain::gemm_onednn_scratchpad");
    found = state.primitives.emplace(key, std::move(made)).first;
  }
  return *found->second;
}

// The fixed-shape primitive for `key` (key.fixed), made at its first use and kept among the
// kMaxFixedPrimitives most recently used; null where oneDNN makes none for that shape.
Primitive* fixed_primitive(OneDnn& state, const PrimitiveKey& key) {
  const auto found = state.fixed_index.find(key);
  if (found != state.fixed_index.end()) {
    state.fixed.splice(state.fixed.begin(), state.fixed, found->second);  // most recent: first
    return found->second->primitive.get();
  }
  std::unique_ptr<Primitive> made;
  try {
    made = make_primitive(state, key);
    grown(state.scratchpad, made->scratchpad_bytes + 64, "meshtrain::gemm_onednn_scratchpad");
  } catch (const dnnl::error&) {
    made.reset();  // the runtime-dimension primitive takes this shape (primitive_for)
  }
  if (state.fixed.size() >= kMaxFixedPrimitives) {
    state.fixed_index.erase(state.fixed.back().key);
    state.fixed.pop_back();
  }
  state.fixed.push_front(OneDnn::Fixed{key, std::move(made)});
  state.fixed_index.emplace(key, state.fixed.begin());
  return state.fixed.front().primitive.get();
}

// The primitive a call runs: a pure function of the call (its key, shape and whether its rows
// vary), never of the calls before it, so that a call gives the same bits whatever the process
// ran first (a sweep's second config, a resumed run, `meshtrain evaluate`).
//   fp32: the runtime-dimension primitive of `key`, whose gemm kernel ("gemm:jit") is oneDNN
//     2.6's fastest fp32 matmul here.
//   bf16, rows stable (every call but gemm_varying_rows()'s): the primitive of the call's whole
//     shape, on which oneDNN takes its brgemm kernel (AMX or AVX512_BF16; on the shapes of the
//     784-4096-4096-10 step 1.0-1.3x its bf16 gemm kernel on x @ W and dY @ Wᵀ, 1.8-2.2x on the
//     weight gradients Xᵀ @ dY, whose K is the batch: docs/mixed_precision.md, "Where the bf16
//     step's GEMM time went"). Made at the shape's first call and kept (the most recently used
//     kMaxFixedPrimitives of them: one dropped and made again is the same kernel, the same bits).
//     Where oneDNN rejects the fixed shape, the runtime-dimension primitive, for that shape always.
//   bf16, rows varying (gemm_varying_rows(): an MoE expert's share of the batch): the
//     runtime-dimension primitive, made at the first call, so that no step makes one.
// Where an operand is row-strided (a block of a wider matrix, as tensor parallelism's are) oneDNN
// 2.6 makes even the fixed-shape primitive gemm:jit. The two kernels give the same bits on the
// shapes measured with K = 128 and 784 (the 784-4096-4096-10 step's Xᵀ @ dY and first x @ W;
// other small K unmeasured) and not at K = 4096 (the order of the fp32 additions differs; both
// within gemm.hpp's bounds): there a stable call and a varying-rows call of one shape differ.
Primitive& primitive_for(OneDnn& state, PrimitiveKey key, const FixedShape& shape, bool rows_vary,
                         bool& fixed) {
  fixed = false;
  if (key.bf16 && !rows_vary) {
    key.fixed = true;
    key.shape = shape;
    if (Primitive* p = fixed_primitive(state, key)) {
      fixed = true;
      return *p;
    }
    key.fixed = false;
    key.shape = FixedShape{};
  }
  return runtime_primitive(state, key);
}

}  // namespace

bool onednn_runs_bf16(Dtype inputs, Bf16Kernel bf16_kernel) {
  OneDnn& state = onednn();
  const std::lock_guard<std::mutex> lock(state.mutex);
  return runs_bf16(state, inputs, bf16_kernel);
}

EpilogueLeft onednn_gemm(const RowMajorGemm& call, Bf16Kernel bf16_kernel) {
  OneDnn& state = onednn();
  const std::lock_guard<std::mutex> lock(state.mutex);
  const bool bf16 = runs_bf16(state, call.inputs, bf16_kernel);
  MESHTRAIN_REQUIRE(bf16 || (call.a16 == nullptr && call.b16 == nullptr),
                    "gemm (oneDNN): 16-bit operands reach the fp32 matmul (gemm() widens them)");
  MESHTRAIN_REQUIRE(
      call.c16 == nullptr || (bf16 && call.beta == 0.0f && !call.backward && call.bias == nullptr &&
                              call.activation == Activation::none),
      "gemm (oneDNN): a 16-bit C reaches the fp32 matmul or carries an epilogue");

  PrimitiveKey key;
  key.n = call.n;
  key.transpose_a = call.transpose_a;
  key.transpose_b = call.transpose_b;
  key.bf16 = bf16;
  key.c16 = call.c16 != nullptr;
  const bool forward_epilogue = !call.backward;
  key.bias = forward_epilogue && call.bias != nullptr;
  key.activation = forward_epilogue ? call.activation : Activation::none;
  if (call.beta != 0.0f) std::memcpy(&key.beta_bits, &call.beta, sizeof key.beta_bits);

  // Stored shapes: op(A) [m, k], op(B) [k, n]; the bf16 copies are contiguous.
  const int a_rows = call.transpose_a ? call.k : call.m,
            a_cols = call.transpose_a ? call.m : call.k;
  const int b_rows = call.transpose_b ? call.n : call.k,
            b_cols = call.transpose_b ? call.k : call.n;
  const void* a = call.a;
  const void* b = call.b;
  int lda = call.lda, ldb = call.ldb;
  if (bf16) {  // 16-bit operands as stored; fp32 ones (holding bf16 values) copied to bf16
    if (call.a16 != nullptr) {
      a = call.a16;
    } else {
      a = bf16_copy(call.a, a_rows, a_cols, call.lda, state.a16, "meshtrain::gemm_bf16_a");
      lda = a_cols;
    }
    if (call.b16 != nullptr) {
      b = call.b16;
    } else {
      b = bf16_copy(call.b, b_rows, b_cols, call.ldb, state.b16, "meshtrain::gemm_bf16_b");
      ldb = b_cols;
    }
  }

  // A row-strided operand (a block of a wider matrix) runs the runtime-dimension primitive, decided
  // on the operands as the caller stores them, before any bf16 copy: a 16-bit operand read in
  // place and the same values held in fp32 and copied to contiguous bf16 then run the same kernel
  // and give the same bits (tests/comm/collective_matmul_test.cpp, SixteenBitOperandsGiveThe
  // Fp32BuffersBits). oneDNN 2.6 takes gemm:jit on a row-strided operand even when fixed, so no
  // speed is lost.
  const bool row_strided = call.lda != a_cols || call.ldb != b_cols;
  bool fixed = false;
  Primitive& p = primitive_for(state, key, FixedShape{call.m, call.k, lda, ldb, call.ldc},
                               call.rows_vary || row_strided, fixed);
  const DataType operand = bf16 ? DataType::bf16 : DataType::f32;
  const CallMemory a_memory(state, call.m, call.k, op_strides(lda, call.transpose_a), operand, a);
  const CallMemory b_memory(state, call.k, call.n, op_strides(ldb, call.transpose_b), operand, b);
  const CallMemory c_memory(state, call.m, call.n, Strides{call.ldc, 1},
                            key.c16 ? DataType::bf16 : DataType::f32,
                            key.c16 ? static_cast<const void*>(call.c16) : call.c);
  // The scratchpad goes only to a primitive that uses one (its gemm kernel does not).
  dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, a_memory.get()},
                             {DNNL_ARG_WEIGHTS, b_memory.get()},
                             {DNNL_ARG_DST, c_memory.get()}};
  int count = 3;
  if (p.scratchpad_bytes > 0) {
    set_buffer(p.scratchpad, state.scratchpad.data());
    args[count++] = {DNNL_ARG_SCRATCHPAD, p.scratchpad.get()};
  }
  if (key.bias) {
    set_buffer(p.bias, call.bias);
    args[count++] = {DNNL_ARG_BIAS, p.bias.get()};
  }
  check(dnnl_primitive_execute(p.matmul.get(), state.stream.get(), count, args),
        "dnnl_primitive_execute");
  g_executions.fetch_add(1, std::memory_order_relaxed);
  if (fixed) g_fixed_executions.fetch_add(1, std::memory_order_relaxed);
  check(dnnl_stream_wait(state.stream.get()), "dnnl_stream_wait");

  EpilogueLeft left;
  left.backward = call.backward;  // the derivative and the bias gradient: gemm()'s pass
  return left;
}

int64_t onednn_executions() {
  return g_executions.load(std::memory_order_relaxed);
}

int64_t onednn_fixed_shape_executions() {
  return g_fixed_executions.load(std::memory_order_relaxed);
}

void onednn_drop_primitives() {
  OneDnn& state = onednn();
  const std::lock_guard<std::mutex> lock(state.mutex);
  state.primitives.clear();
  state.fixed_index.clear();
  state.fixed.clear();
}

std::string onednn_name() {
  const dnnl_version_t* version = dnnl_version();
  return "oneDNN " + std::to_string(version->major) + "." + std::to_string(version->minor) + "." +
         std::to_string(version->patch) + " " + isa_name(effective_isa());
}

std::string onednn_description() {
  std::string text = onednn_name();
  if (!onednn_has_native_bf16()) text += " (bf16 inputs: fp32 kernel, no AVX512_BF16)";
  const int threads = openmp_threads();
  return text + ", " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
}

}  // namespace meshtrain::gemm_backend
