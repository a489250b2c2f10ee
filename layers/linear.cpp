#include "layers/linear.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>

#include "base/error.hpp"
#include "framework/comm/collective_matmul_16bit.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "layers/gradient_reduction.hpp"
#include "layers/inference.hpp"
#include "layers/sixteen_bit_passes.hpp"
#include "partition/gradient_storage.hpp"
#include "partition/sixteen_bit_storage.hpp"

namespace meshtrain {
namespace {

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

// dst = src[:, offset : offset + dst.cols]
void copy_columns(MatrixView src, int64_t offset, MatrixView dst) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_take_columns"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { dst(i, j) = src(i, offset + j); });
}

// dst = src[:, offset : offset + dst.cols] rounded to `dtype` (a sliced input under 16-bit
// storage, where the model hands over its raw batch).
void copy_columns_rounded(MatrixView src, int64_t offset, MatrixView dst, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_take_columns_rounded"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        dst(i, j) = round_to(src(i, offset + j), dtype);
      });
}

// dst = the 16 bits of src[:, offset : offset + dst.cols] rounded to `dtype` (a sliced input kept
// as 16 bits: the model's raw batch under 16-bit storage).
void copy_columns_to_16bit(MatrixView src, int64_t offset, HalfMatrixView dst, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_take_columns_16bit"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        dst(i, j) = to_16bit(src(i, offset + j), dtype);
      });
}

// full[j] = sum over rows of dy(:, j - offset) for the columns dy covers, 0 elsewhere,
// rounded to `dtype` (the bias gradient as a 16-bit autograd leaves it).
// The host kernel's columns per iteration (a row's run of them is 4 AVX-512 vectors).
constexpr int64_t kColumnSumChunk = 64;

// out[c] = sum over rows of dy[i * stride + c] for the n columns from dy's first, added row
// after row, then rounded to the 16-bit format (bf16 or fp16; fp32: not rounded): each column's
// sum is the same additions in the same order as the kernel below (0, then rows 0, 1, ...) and
// the same rounding, so the same bits, but a row's columns are read together and added 16 lanes
// wide (compiled per instruction set without FMA contraction) where the kernel walks each column
// down the rows.
template <Dtype dtype>
MESHTRAIN_INLINE void column_sums(const float* dy, int64_t stride, int64_t rows, int64_t n,
                                  float* out) {
  float sums[kColumnSumChunk];
  for (int64_t c = 0; c < n; ++c) sums[c] = 0.0f;
  for (int64_t i = 0; i < rows; ++i) {
    const float* __restrict row = dy + i * stride;
    for (int64_t c = 0; c < n; ++c) sums[c] += row[c];
  }
  if constexpr (dtype == Dtype::fp32) {
    for (int64_t c = 0; c < n; ++c) out[c] = sums[c];
  } else {
    for (int64_t c = 0; c < n; ++c) out[c] = round_as<dtype>(sums[c]);
  }
}

MESHTRAIN_HOST_CLONES_EXACT
void column_sums_host(const float* dy, int64_t stride, int64_t rows, int64_t n, float* out,
                      Dtype dtype) {
  switch (dtype) {
    case Dtype::fp32:
      return column_sums<Dtype::fp32>(dy, stride, rows, n, out);
    case Dtype::bf16:
      return column_sums<Dtype::bf16>(dy, stride, rows, n, out);
    case Dtype::fp16:
      return column_sums<Dtype::fp16>(dy, stride, rows, n, out);
  }
}

// y(i, j) = round(round(y(i, j)) + round(bias[j])) for one row of `cols` (Linear::forward's
// bias in a 16-bit compute dtype): the kernel's operations per element, 16 lanes at a time.
template <Dtype dtype>
MESHTRAIN_INLINE void add_bias_16bit_row(float* __restrict row, const float* __restrict bias,
                                         int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    row[j] = round_as<dtype>(round_as<dtype>(row[j]) + round_as<dtype>(bias[j]));
  }
}

MESHTRAIN_HOST_CLONES_EXACT
void add_bias_16bit_host(float* row, const float* bias, int64_t cols, bool bf16) {
  if (bf16) return add_bias_16bit_row<Dtype::bf16>(row, bias, cols);
  add_bias_16bit_row<Dtype::fp16>(row, bias, cols);
}

void sum_columns_into(MatrixView dy, int64_t offset, VectorView full, Dtype dtype) {
  sixteen_bit_passes::linear_bias_gradient(sixteen_bit_passes::step_path(), dy, offset, full,
                                           dtype);
}

// dst += src (a free function: nvcc's device lambdas cannot live in private member functions).
void add_into(MatrixView src, MatrixView dst) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_add_tangent_weight_grad"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { dst(i, j) += src(i, j); });
}

// Under 16-bit storage where gemm() reads 16 bits, the weight reaches the GEMMs as 16 bits: a
// weight with a 16-bit copy through ShardedParameter::compute_matrix_16bit (a plain MLP's weights
// gathered over one group, or stored whole: the copy itself, no pass), and a weight stored whole
// with no copy (a residual_mlp's, DP or one rank) as its master rounded to 16 bits in the bytes of
// the shared weight scratch (the values compute_matrix() rounds into it as floats, in one
// pass writing half the bytes; no bf16 copy inside the GEMM): nothing allocated, nothing more to
// count.
bool packs_weight_16bit(const ShardedParameter& weight) {
  return !weight.gathered() && !weight.has_16bit_copy();
}
ConstHalfMatrixView packed_weight(const ShardedParameter& weight, LayerScratch& scratch,
                                  Dtype dtype) {
  const MatrixView stored = weight.value().matrix();
  MESHTRAIN_REQUIRE(stored.span_is_contiguous() && scratch.weight.span() >= stored.span(),
                    "parameter '", weight.value().name,
                    "': a contiguous weight and a weight scratch to hold it are needed");
  uint16_t* bits = reinterpret_cast<uint16_t*>(scratch.weight.data());
  pack_16bit(stored.data(), bits, stored.span(), dtype);
  return ConstHalfMatrixView(bits, stored.extent(0), stored.extent(1));
}

// The weight as a layer's GEMMs read it: where the layer reads 16-bit weights (reads_16bit_weight:
// its kept 16-bit input, or a tensor-parallel weight's copy where gemm() reads 16 bits) and the
// weight has 16 bits to give (its optimizer-written copy, or, with a kept input, its master packed
// into the weight scratch), those 16 bits, which the collective matmuls take as they are too; else
// the fp32 compute matrix (gathered, or rounded at use).
struct WeightForGemm {
  ConstHalfMatrixView bits;  // empty unless the GEMMs read 16 bits
  MatrixView floats;         // empty when they do
  GemmOperand operand(bool transpose) const {
    if (bits.data() != nullptr) return transpose ? transposed(bits) : plain(bits);
    return transpose ? transposed(floats) : plain(floats);
  }
};
WeightForGemm weight_for_gemm(ShardedParameter& weight, bool reads_16bit, LayerScratch& scratch,
                              Dtype dtype) {
  WeightForGemm w;
  if (reads_16bit && weight.has_16bit_copy()) {
    w.bits = weight.compute_matrix_16bit(scratch);
  } else if (reads_16bit && packs_weight_16bit(weight)) {
    w.bits = packed_weight(weight, scratch, dtype);
  } else {
    w.floats = weight.compute_matrix(scratch);
  }
  return w;
}

}  // namespace

namespace sixteen_bit_passes {

void linear_bias_gradient(Path path, MatrixView dy, int64_t offset, VectorView full, Dtype dtype) {
  const int64_t rows = static_cast<int64_t>(dy.extent(0));
  const int64_t cols = static_cast<int64_t>(dy.extent(1));
  const std::string& label = MESHTRAIN_LABEL("meshtrain::linear_bias_grad");
  if (path == Path::host) {
    require_host("linear_bias_gradient");
    const int64_t width = static_cast<int64_t>(full.extent(0));
    const int64_t chunks = (width + kColumnSumChunk - 1) / kColumnSumChunk;
    const float* d_data = dy.data();
    const int64_t d_stride = static_cast<int64_t>(dy.stride(0));
    float* f_data = full.data();
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, chunks),
        [=](const int64_t chunk) {
          // Columns [j0, j1) of full; those dy covers are [lo, hi), the others 0.
          const int64_t j0 = chunk * kColumnSumChunk;
          const int64_t j1 = std::min(width, j0 + kColumnSumChunk);
          const int64_t lo = std::max(j0, offset), hi = std::min(j1, offset + cols);
          for (int64_t j = j0; j < j1; ++j) {
            if (j < lo || j >= hi) f_data[j] = 0.0f;
          }
          if (lo < hi)
            column_sums_host(d_data + (lo - offset), d_stride, rows, hi - lo, f_data + lo, dtype);
        });
    inference::fence_after_host_kernel(label);
    return;
  }
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(full.extent(0))),
      KOKKOS_LAMBDA(const int64_t j) {
        float sum = 0.0f;
        if (j >= offset && j < offset + cols) {
          for (int64_t i = 0; i < rows; ++i) sum += dy(i, j - offset);
        }
        full(j) = round_to(sum, dtype);
      });
}

void linear_add_bias(Path path, MatrixView y, const float* b, Dtype dtype) {
  const std::string& label = MESHTRAIN_LABEL("meshtrain::linear_add_bias");
  if (path == Path::host) {
    MESHTRAIN_REQUIRE(
        dtype != Dtype::fp32 && inference::layers_run_host_kernels(),
        "linear_add_bias: the host loop is for a 16-bit dtype on a build whose layers "
        "run host kernels");
    float* data = y.data();
    const int64_t ld = static_cast<int64_t>(y.stride(0));
    const int64_t cols = static_cast<int64_t>(y.extent(1));
    const bool bf16 = dtype == Dtype::bf16;
    Kokkos::parallel_for(
        label,
        Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0,
                                                               static_cast<int64_t>(y.extent(0))),
        [=](const int64_t i) { add_bias_16bit_host(data + i * ld, b, cols, bf16); });
    inference::fence_after_host_kernel(label);
    return;
  }
  Kokkos::parallel_for(
      label,
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(y.extent(0)), static_cast<int64_t>(y.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        y(i, j) = round_to(round_to(y(i, j), dtype) + round_to(b[j], dtype), dtype);
      });
}

}  // namespace sixteen_bit_passes

Linear::Linear(ParameterRef weight_ref, ParameterRef bias_ref, FeatureLayout input_layout,
               int64_t rows, ParallelContext& context, bool input_grad_partial,
               const LinearSharedBuffers* shared)
    : layout_(decide_linear_layout(
          linear_layer_name(weight_ref.value->name),
          {weight_ref.value->name, weight_ref.value->global_shape, weight_ref.value->spec},
          {bias_ref.value->name, bias_ref.value->global_shape, bias_ref.value->spec},
          context.mesh(), {context.batch_axes(), context.feature_axis()}, input_layout)),
      rows_(rows),
      tp_index_(context.feature_index()),
      compute_dtype_(context.precision().param),
      matmuls_(layer_matmul_algorithms(layout_, rows, context.matmul_algorithm(),
                                       collective_matmul_hardware(), context.precision().param)) {
  if (input_grad_partial) {
    MESHTRAIN_REQUIRE(layout_.column_parallel && layout_.input_layout == FeatureLayout::replicated,
                      "linear layer '", layout_.layer,
                      "': only a column-parallel layer fed a replicated input leaves its input "
                      "gradient partial");
    layout_.input_grad_partial = true;
  }
  const LinearLayout& l = layout_;
  const std::string& name = l.layer;
  const ShardedTensor& weight = *weight_ref.value;
  const ShardedTensor& bias = *bias_ref.value;
  MESHTRAIN_REQUIRE(weight.box.extent[0] == l.stored_rows && weight.box.extent[1] == l.stored_cols,
                    "linear layer '", name, "': the block of '", weight.name,
                    "' does not tile its compute block");

  // Bias: the gathered block starts at the compute offset when only the rest is gathered.
  const int64_t compute_offset = output_offset();
  const int64_t bias_gathered_offset = l.bias_gather_sliced ? compute_offset : 0;
  MESHTRAIN_REQUIRE(
      bias.box.extent[0] == l.bias_stored && bias_gathered_offset <= compute_offset &&
          compute_offset + l.out_local <=
              bias_gathered_offset + l.bias_stored * context.mesh().size_of(l.bias_gather),
      "linear layer '", name, "': the gathered bias does not cover its block");

  // Communicators (collective on first use: the same calls in the same order everywhere).
  if (l.tp > 1) tp_comm_ = context.comm({l.feature_axis});
  // The weight [in, out] is the compute block [1, in_compute, out], gathered dim by dim.
  weight_ = ShardedParameter(weight_ref,
                             {{1, l.in_compute, l.compute_cols()},
                              {1, l.stored_rows, l.stored_cols},
                              l.weight_gather_dim0,
                              l.weight_gather_dim1,
                              l.weight_allreduce,
                              l.nonbatch_replication},
                             GatherMethod::by_dims, context);
  // The bias's gradient is the column sum of dY at full width, reduced over the batch axes
  // (and the feature axis when the output is split), this rank's block kept.
  ParameterGathers bias_gathers;
  bias_gathers.compute = {1, 1, l.out_local};
  bias_gathers.stored = {1, 1, l.bias_stored};
  bias_gathers.gather_dim2 = l.bias_gather;
  bias_gathers.allreduce = l.bias_reduce;
  bias_gathers.width = l.out;
  bias_gathers.gathered_offset = bias_gathered_offset;
  bias_gathers.compute_offset = compute_offset;
  bias_gathers.direct = l.bias_direct;  // stored block = compute block: reduced in place
  bias_ = ShardedParameter(bias_ref, bias_gathers, GatherMethod::full_width_sum, context);
  // Which gradients a layer leaves partial is decided by one rule, from its parameters
  // (layers/gradient_reduction.hpp; Linear is final, so the rule sees its overrides here);
  // the cost model charges the layout's decision, so the two must agree.
  MESHTRAIN_REQUIRE((partial_gradients_group(*this) != nullptr) == l.defers_reduction(),
                    "linear layer '", name,
                    "': its parameters and its layout disagree on whether its gradients can be "
                    "left partial");

  // Buffers.
  const int64_t in_c = l.in_compute, out = l.out;
  if (shared) {
    // No feature axis (replicated, not gathering a split input), or row-parallel.
    MESHTRAIN_REQUIRE(compute_dtype_ != Dtype::fp32 && !l.column_parallel && !l.gathers_input(),
                      "linear layer '", name,
                      "': shared buffers need a 16-bit compute dtype and no feature axis or a "
                      "row-parallel layout");
    const auto fits = [&](auto view, int64_t cols) {
      return static_cast<int64_t>(view.extent(0)) == rows_ &&
             static_cast<int64_t>(view.extent(1)) == cols;
    };
    // Each may be empty (the layer's own buffer, forward's input kept as it is), but a kept
    // 16-bit input needs a working buffer to be widened into.
    const bool kept = shared->kept_input.data() != nullptr;
    const bool work = shared->work.data() != nullptr;
    // A sliced input is kept by the layer itself (its slice), not given; dY's shared 16 bits are
    // used only where the output is split.
    const HalfMatrixView dy_bits = shared->output_grad_16bit;
    MESHTRAIN_REQUIRE(
        (shared->output.data() == nullptr || fits(shared->output, l.out_local)) &&
            (!work || fits(shared->work, in_c)) &&
            (!kept || (work && !l.slices_input() && fits(shared->kept_input, in_c))) &&
            (dy_bits.data() == nullptr || !l.split_output ||
             (static_cast<int64_t>(dy_bits.extent(0)) == rows_ &&
              static_cast<int64_t>(dy_bits.extent(1)) >= l.out_local)),
        "linear layer '", name, "': shared buffers of the wrong extents");
    output_view_ = shared->output;
    dx_c_view_ = shared->work;
    kept_input_ = shared->kept_input;
    input_grad_ = shared->input_grad;
    if (dy_bits.data() != nullptr && l.split_output) {
      dy_16bit_view_ = HalfMatrixView(dy_bits.data(), rows_, l.out_local);
    }
  }
  // Under 16-bit storage a sliced input is kept as 16 bits where gemm()'s kernel reads them
  // (partition/sixteen_bit_storage.hpp; framework/train/memory_plan.cpp sizes it alike).
  rounds_sliced_input_ = shared && l.slices_input();
  if (keeps_16bit_sliced_input(shared != nullptr, l.slices_input(),
                               gemm_kernel_reads_16bit(compute_dtype_))) {
    x_c_16bit_ = HalfMatrix(name + "/input_16bit", rows_, in_c);
    kept_input_ = x_c_16bit_;
  } else if (l.slices_input() || l.gathers_input()) {
    x_c_ = Matrix(name + "/input", rows_, in_c);
  }
  if (output_view_.data() == nullptr) {
    output_ = Matrix(name + "/output", rows_, l.out_local);
    output_view_ = output_;
  }
  if (l.column_gathers_input()) {
    // dY @ Wᵀ is reduce-scattered straight into the input's layout.
    dx_ = Matrix(name + "/input_grad", rows_, input_width());
  } else if (dx_c_view_.data() == nullptr) {
    dx_c_ = Matrix(name + "/input_grad_compute", rows_, in_c);
    dx_c_view_ = dx_c_;
  }
  if ((l.slices_input() || l.gathers_input()) && input_grad_) {
    dx_ = Matrix(name + "/input_grad", rows_, input_width());
  }
  // Under tensor parallelism (a split output, row-parallel) reading a 16-bit weight: dY's 16 bits
  // for backward's two all-gather-matmuls, in the model's shared buffer where it gives one
  // (framework/train/memory_plan.cpp counts it alike).
  if (l.split_output && !l.column_parallel && reads_16bit_weight() &&
      dy_16bit_view_.data() == nullptr) {
    dy_16bit_ = HalfMatrix(name + "/output_grad_16bit", rows_, l.out_local);
    dy_16bit_view_ = dy_16bit_;
  }
  if (!(l.split_output && !l.column_parallel && reads_16bit_weight())) {
    dy_16bit_view_ = HalfMatrixView();
  }

  // FSDP with a 16-bit wire of the compute dtype: backward's one weight-gradient GEMM writes the
  // gathered gradient as the 16 bits its reduce-scatter sends (gemm_to_16bit, where its kernel
  // writes them), in half the gradient scratch (partition/sixteen_bit_storage.hpp; the memory
  // plan counts it alike).
  // DP (a weight stored whole) likewise into its blocking all-reduce's 16-bit buffer, whenever
  // backward all-reduces it there (not in buckets, not left partial for later).
  const bool wire_is_compute = context.precision().reduce == compute_dtype_;
  const bool one_gemm = !l.runs_collective_matmuls();
  if ((writes_16bit_gathered_gradient(l, wire_is_compute,
                                      gemm_kernel_writes_16bit(compute_dtype_)) ||
       (!l.gathers_weight() && one_gemm)) &&
      weight_.can_take_16bit_gradient()) {
    weight_.take_16bit_gradient();
  }
  needs_ = weight_.scratch_needs();
  needs_.merge(bias_.scratch_needs());
  if (l.tensor_parallel) needs_.matmul = static_cast<size_t>(3 * rows_ * out) * sizeof(float);
  // Column-parallel: the collective matmuls move [rows, in/T] blocks (naive: all n of them).
  if (l.column_gathers_input()) {
    needs_.matmul = static_cast<size_t>(3 * rows_ * l.in) * sizeof(float);
  }
  if (tp_comm_) {
    tp_comm_->reserve_scratch(static_cast<size_t>(rows_ * std::max(l.in, out)));
    // The output's and the input gradient's sums over the feature axis.
    tp_comm_->reserve_reductions(static_cast<size_t>(rows_ * std::max(l.in, out)), compute_dtype_);
  }
}

int64_t Linear::output_offset() const {
  return layout_.split_output ? tp_index_ * layout_.out_local : 0;
}

void Linear::start_weight_prefetch(LayerScratch& scratch) {
  weight_.start_prefetch(scratch);
}

MatrixView Linear::forward(MatrixView x, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  Layer* next = pass.prefetch;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == input_width(),
                    "linear layer '", layout_.layer, "': input is [", x.extent(0), ", ",
                    x.extent(1), "], expected [", rows_, ", ", input_width(), "]");
  if (x_c_16bit_.data() != nullptr) {
    // 16-bit storage: the slice kept as 16 bits only, which the product reads (kept_input_).
    copy_columns_to_16bit(x, tp_index_ * layout_.in_compute, x_c_16bit_, compute_dtype_);
    x_used_ = MatrixView();
  } else if (rounds_sliced_input_) {  // 16-bit storage, an fp32 slice: of the raw batch
    copy_columns_rounded(x, tp_index_ * layout_.in_compute, x_c_, compute_dtype_);
    x_used_ = x_c_;
  } else if (layout_.slices_input()) {
    copy_columns(x, tp_index_ * layout_.in_compute, x_c_);
    x_used_ = x_c_;
  } else if (layout_.gathers_input()) {
    tp_comm_->all_gather(x, x_c_, 1, compute_dtype_);
    x_used_ = x_c_;
  } else {
    x_used_ = x;
  }
  const WeightForGemm weight =
      weight_for_gemm(weight_, reads_16bit_weight(), scratch, compute_dtype_);
  const GemmOperand w = weight.operand(false);
  // The input: the producer's (or the slice's) 16-bit copy where gemm() reads 16 bits, the same
  // values as x.
  const GemmOperand x_op = reads_kept_input() ? plain(kept_input_) : plain(x_used_);
  if (next) next->start_weight_prefetch(scratch);
  MatrixView y = output_view_;
  if (pass.inference_gemms && compute_dtype_ == Dtype::fp32 &&
      inference::layers_run_host_kernels() && !layout_.tensor_parallel &&
      !layout_.column_parallel && !reads_kept_input()) {
    // A prediction's forward before its derivative passes: C starts as the bias and the GEMM
    // adds the product (beta = 1), as infer() does on OpenBLAS, where BLAS would zero C first
    // and a pass would add the bias. gemm(), not inference_gemm(): oneDNN's matmul allocates
    // per call, and Predictor::jacobian allocates nothing (tests/predict/jacobian_test.cpp).
    inference::fill_bias(y, bias_.compute(scratch).data(), ConstMatrixView());
    gemm(plain(x_used_), w, 1.0f, y, compute_dtype_);  // fp32 here: w is the fp32 operand
    if (next) next->poll_weight_prefetch();
    return y;
  }
  if (layout_.column_gathers_input()) {
    // Y_t = all_gather(X, features) @ W_t: the K blocks of X arrive and accumulate.
    all_gather_matmul(*tp_comm_, GatherSide::left, 1, x_op, w, y, matmuls_.forward, scratch.matmul,
                      compute_dtype_);
  } else if (layout_.column_parallel) {
    gemm(x_op, w, 0.0f, y, compute_dtype_);  // replicated input, no reduction
  } else if (layout_.split_output) {
    matmul_reduce_scatter(*tp_comm_, 1, x_op, w, y, matmuls_.forward, scratch.matmul,
                          compute_dtype_);
  } else {
    gemm(x_op, w, 0.0f, y, compute_dtype_);
    if (layout_.tensor_parallel) tp_comm_->all_reduce(y, ReduceOp::sum, compute_dtype_);
  }
  if (next) next->poll_weight_prefetch();
  // The product in the compute dtype, plus the bias (cast to it), rounded again: two
  // roundings, as docs/mixed_precision.md lists them (none in fp32).
  const float* b = bias_.compute(scratch).data();
  const Dtype dtype = compute_dtype_;
  if (dtype == Dtype::fp32 && inference::layers_run_host_kernels()) {
    inference::add_bias(y, b);  // per-ISA clones, the same sums
    return y;
  }
  // In 16 bits per-ISA host clones where the layers run host kernels (sixteen_bit_passes.hpp).
  sixteen_bit_passes::linear_add_bias(sixteen_bit_passes::step_path(), y, b, dtype);
  return y;
}

bool Linear::can_infer_fused() const {
  const bool one_gemm =
      !layout_.slices_input() && !layout_.gathers_input() && !layout_.column_gathers_input() &&
      (layout_.column_parallel || (!layout_.split_output && !layout_.tensor_parallel));
  return inference::runs_host_kernels() && compute_dtype_ == Dtype::fp32 && one_gemm;
}

MatrixView Linear::infer(MatrixView x, const LayerPass& pass, Activation activation,
                         ConstMatrixView residual) {
  if (!can_infer_fused()) {
    MESHTRAIN_REQUIRE(inference::runs_host_kernels(), "linear layer '", layout_.layer,
                      "': the inference kernels need host memory");
    const MatrixView y = forward(x, pass);
    if (residual.data() != nullptr) {
      inference::add(residual, y, y, MESHTRAIN_LABEL("meshtrain::infer_residual_add"));
    }
    inference::activate(y, activation);
    return y;
  }
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == input_width(),
                    "linear layer '", layout_.layer, "': input is [", x.extent(0), ", ",
                    x.extent(1), "], expected [", rows_, ", ", input_width(), "]");
  LayerScratch& scratch = *pass.scratch;
  const MatrixView w = weight_.compute_matrix(scratch);
  const MatrixView y = output_view_;
  const ConstVectorView bias = bias_.compute(scratch);
  if (inference_gemm_fuses_forward_epilogues() && residual.data() == nullptr) {
    // oneDNN: the bias and the activation inside the matmul, no pass over C.
    inference_gemm(plain(x), plain(w), 0.0f, y, GemmEpilogue::forward(bias, activation));
    return y;
  }
  // C starts as the bias (and the residual): the GEMM adds the product to it (beta = 1) where
  // BLAS would have zeroed C first, so the bias costs no pass of its own; the activation is
  // then oneDNN's post-op, or one vectorized pass.
  inference::fill_bias(y, bias.data(), residual);
  if (inference_gemm_fuses_forward_epilogues()) {
    inference_gemm(plain(x), plain(w), 1.0f, y, GemmEpilogue::forward(activation));
  } else {
    inference_gemm(plain(x), plain(w), 1.0f, y);
    inference::activate(y, activation);
  }
  return y;
}

MatrixView Linear::backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) {
  return backward_pass(dy, MatrixView(), need_input_grad, pass, nullptr);
}

MatrixView Linear::backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                          const LayerPass& pass, MatrixView* dt_in) {
  MESHTRAIN_REQUIRE(compute_dtype_ == Dtype::fp32, "linear layer '", layout_.layer,
                    "': training on derivatives is fp32 only");
  MESHTRAIN_REQUIRE(pass.deferred != DeferredReduction::in_buckets, "linear layer '", layout_.layer,
                    "': training on derivatives does not reduce in buckets");
  const int64_t k = tangent_directions(static_cast<int64_t>(dt.extent(0)), rows_, layout_.layer);
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dt.extent(1)) == layout_.out_local &&
                        tangent_weight_grad_.extent(0) > 0 &&
                        tangent_x_used_.extent(0) == dt.extent(0),
                    "linear layer '", layout_.layer, "': tangent gradient is [", dt.extent(0), ", ",
                    dt.extent(1), "], expected [", rows_ * k, ", ", layout_.out_local,
                    "] after forward_tangents of as many rows and reserve_tangent_backward");
  return backward_pass(dy, dt, need_input_grad, pass, dt_in);
}

void Linear::reserve_tangent_backward(int64_t directions) {
  reserve_tangents(directions);
  reserve_cotangents(directions);
  if (tangent_weight_grad_.extent(0) == 0) {
    tangent_weight_grad_ =
        Matrix(layout_.layer + "/tangent_weight_grad", layout_.in_compute, layout_.compute_cols());
  }
}

void Linear::weight_gradient_product(GemmOperand x_t, MatrixView dy, MatrixView g,
                                     LayerScratch& scratch, ConstHalfMatrixView dy_16bit) {
  if (layout_.column_gathers_input()) {
    // dW_t = all_gather(X, features)ᵀ @ dY_t: the input gathered again (only its block is
    // kept from forward), the gathered blocks landing on the rows of dW_t.
    all_gather_matmul(*tp_comm_, GatherSide::left, 1, x_t, plain(dy), g, matmuls_.weight_grad,
                      scratch.matmul, compute_dtype_);
  } else if (layout_.column_parallel) {
    gemm(x_t, plain(dy), 0.0f, g, compute_dtype_);
  } else if (layout_.split_output) {
    const GemmOperand gathered = dy_16bit.data() != nullptr ? plain(dy_16bit) : plain(dy);
    all_gather_matmul(*tp_comm_, GatherSide::right, 1, x_t, gathered, g, matmuls_.weight_grad,
                      scratch.matmul, compute_dtype_);
  } else {
    gemm(x_t, plain(dy), 0.0f, g, compute_dtype_);
  }
}

MatrixView Linear::backward_pass(MatrixView dy, MatrixView dt, bool need_input_grad,
                                 const LayerPass& pass, MatrixView* dt_in) {
  LayerScratch& scratch = *pass.scratch;
  Layer* next = pass.prefetch;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == layout_.out_local,
                    "linear layer '", layout_.layer, "': output gradient is [", dy.extent(0), ", ",
                    dy.extent(1), "], expected [", rows_, ", ", layout_.out_local, "]");
  // Gathered again, not kept from forward.
  const WeightForGemm weight =
      weight_for_gemm(weight_, reads_16bit_weight(), scratch, compute_dtype_);
  const GemmOperand w_t = weight.operand(true);
  if (next) next->start_weight_prefetch(scratch);

  // dY as 16 bits for the all-gather-matmuls below (tensor parallelism with a 16-bit weight copy):
  // packed once (it holds 16-bit values: the activation's or the loss's rounded gradient), then
  // gathered as 2-byte blocks, no wire packing per hop nor bf16 copy inside the GEMMs.
  ConstHalfMatrixView dy_16bit;
  if (dy_16bit_view_.data() != nullptr) {
    MESHTRAIN_REQUIRE(dy.span_is_contiguous(), "linear layer '", layout_.layer,
                      "': the output gradient must be contiguous");
    pack_16bit(dy.data(), dy_16bit_view_.data(), dy.span(), compute_dtype_);
    dy_16bit = dy_16bit_view_;
  }
  // Weight gradient, compute block: X_cᵀ @ dY (dY all-gathered over features when split).
  const bool bucketed = pass.deferred == DeferredReduction::in_buckets;
  // The parameter's reduction sends it as 16 bits of the compute dtype, as it is (FSDP's
  // reduce-scatter: take_16bit_gradient above): the GEMM writes those bits (gemm_to_16bit: the
  // fp32 result rounded to nearest even, the bits the wire's packing gives), so no fp32 gradient
  // is written nor packed.
  // (Never for a gradient stored as 16 bits, below: writes_16bit_gradient.)
  const bool written_16bit =
      !bucketed && weight_.writes_16bit_gradient(pass.deferred != DeferredReduction::later);
  MESHTRAIN_REQUIRE(!written_16bit || dt.data() == nullptr, "linear layer '", layout_.layer,
                    "': a tangent term with a 16-bit weight gradient");
  const MatrixView g = written_16bit ? MatrixView() : weight_.gradient_matrix(scratch);
  // DP buckets whose 16-bit wire is the compute dtype, where gemm()'s kernel writes 16 bits: the
  // GEMM writes the gradient as wire bits straight into its place in the buckets' 16-bit buffer
  // (gemm_to_16bit: the fp32 result rounded to nearest even, the bits the buckets' packing gives),
  // so the fp32 gradient is neither written here nor packed (it gets the sum in wait_all()), where
  // the product writes 16 bits, each element one GEMM's into a dense gradient: one GEMM, or an
  // all-gather-matmul whose algorithm does so (all_gather_matmul_to_16bit), as
  // partition/gradient_storage.hpp's rule says; another product's gradient stays fp32.
  const bool product_writes_16bit =
      weight_gradient_product_writes_16bit(layout_, matmuls_.weight_grad);
  uint16_t* wire_home = nullptr;
  if (bucketed && compute_dtype_ != Dtype::fp32 && pass.buckets->wire() == compute_dtype_ &&
      dt.data() == nullptr && product_writes_16bit && gemm_kernel_writes_16bit(compute_dtype_)) {
    // Contiguity matters only where the buckets hold this gradient (they hold it as a vector).
    wire_home = pass.buckets->wire_home(pass.index, 0, g.data(), g.size());
    MESHTRAIN_REQUIRE(wire_home == nullptr || g.span_is_contiguous(), "linear layer '",
                      layout_.layer, "': the weight gradient must be contiguous");
  }
  GemmOperand x_t;
  if (reads_kept_input()) {
    // 16-bit storage where gemm() reads 16 bits: the kept input as it is.
    x_t = transposed(kept_input_);
  } else if (kept_input_.data() != nullptr) {
    // 16-bit storage: the input widened (exactly) into the working buffer that dX then
    // overwrites; the GEMM sees forward's values.
    widen_16bit(kept_input_, dx_c_view_, compute_dtype_);
    x_t = transposed(dx_c_view_);
  } else {
    x_t = transposed(x_used_);
  }
  // A weight gradient stored as 16 bits (partition/gradient_storage.hpp: DP storage, a 16-bit wire
  // of the compute dtype, reduced in backward): the GEMM writes its C rounded to nearest even
  // into that storage, the bits the wire's packing of the fp32 gradient gives; the all-reduce
  // then sums it in place (ShardedParameter::reduce).
  // Under overlap that storage is its range of the buckets' 16-bit buffer (wire_home), the path
  // above.
  const bool stored_16bit = weight_.grad().stored_16bit();
  MESHTRAIN_REQUIRE(
      !stored_16bit || (dt.data() == nullptr && !weight_.gathered() && product_writes_16bit &&
                        weight_.grad().storage == compute_dtype_ &&
                        (!bucketed || wire_home == weight_.grad().bits.data())),
      "linear layer '", layout_.layer,
      "': its weight gradient is stored as 16 bits, which only an ungathered weight "
      "written by one GEMM per element, reduced (if at all) over a wire of the "
      "compute dtype supports");
  // The product of weight_gradient_product written as 16 bits into `c` (product_writes_16bit).
  const auto product_to_16bit = [&](HalfMatrixView c) {
    if (layout_.column_gathers_input()) {
      all_gather_matmul_to_16bit(*tp_comm_, GatherSide::left, 1, x_t, plain(dy), c,
                                 matmuls_.weight_grad, scratch.matmul, compute_dtype_);
    } else if (layout_.split_output && !layout_.column_parallel) {
      const GemmOperand gathered = dy_16bit.data() != nullptr ? plain(dy_16bit) : plain(dy);
      all_gather_matmul_to_16bit(*tp_comm_, GatherSide::right, 1, x_t, gathered, c,
                                 matmuls_.weight_grad, scratch.matmul, compute_dtype_);
    } else {
      gemm_to_16bit(x_t, plain(dy), c, compute_dtype_);
    }
  };
  if (written_16bit) {
    gemm_to_16bit(x_t, plain(dy), weight_.gradient_matrix_16bit(scratch), compute_dtype_);
  } else if (stored_16bit && !bucketed) {
    product_to_16bit(weight_.grad().bits_matrix());
  } else if (wire_home != nullptr) {
    product_to_16bit(HalfMatrixView(wire_home, g.extent(0), g.extent(1)));
  } else {
    weight_gradient_product(x_t, dy, g, scratch, dy_16bit);
  }
  if (dt.data() != nullptr) {
    // The tangents' term: dt_out = dt_in W, so dW += dt_inᵀ g_t, through the same product and
    // collective as the value's term (k times the rows), added before any reduction.
    const MatrixView tangent_g = tangent_weight_grad_;
    weight_gradient_product(transposed(tangent_x_used_), dt, tangent_g, scratch);
    add_into(tangent_g, g);
  }
  MESHTRAIN_REQUIRE(pass.deferred == DeferredReduction::now || defers_reduction(), "linear layer '",
                    layout_.layer,
                    "': asked to leave gradients partial that it must reduce itself");
  // The weight's gradient in its compute dtype. Where the reduction that follows packs it to
  // 16 bits of that dtype (the buckets' all-reduce, or the parameter's own reduction), the
  // packing rounds each element as this pass would (the same bits), so the pass is left out.
  const bool wire_rounds =
      bucketed
          ? pass.buckets->wire() == compute_dtype_
          : weight_.reduce_rounds_to(compute_dtype_, pass.deferred != DeferredReduction::later);
  if (!wire_rounds && !written_16bit && !stored_16bit) round_in_place(g, compute_dtype_);
  if (next) next->poll_weight_prefetch();
  // DP overlap: both gradients are final here (no gathers, no scale); hand them to the
  // buckets, whose all-reduce runs while dX is computed.
  if (bucketed) {
    bias_gradient(dy, scratch, /*all_reduce=*/false);
    pass.buckets->layer_ready(pass.index, wire_home != nullptr ? 1u : 0u);
  }

  // Input gradient: dY @ W_cᵀ, then back to the input's layout.
  MESHTRAIN_REQUIRE(!need_input_grad || input_grad_, "linear layer '", layout_.layer,
                    "': asked for an input gradient it was built without");
  MatrixView dx;
  if (need_input_grad && layout_.column_parallel) {
    // dY_t @ W_tᵀ is this rank's partial sum of dX over the feature ranks.
    if (layout_.column_gathers_input()) {
      matmul_reduce_scatter(*tp_comm_, 1, plain(dy), w_t, dx_, matmuls_.input_grad, scratch.matmul,
                            compute_dtype_);
      round_in_place(MatrixView(dx_), compute_dtype_);
      dx = dx_;
    } else {
      gemm(plain(dy), w_t, 0.0f, dx_c_view_, compute_dtype_);
      if (!layout_.input_grad_partial) {
        tp_comm_->all_reduce(dx_c_view_, ReduceOp::sum, compute_dtype_);
      }
      round_in_place(dx_c_view_, compute_dtype_);
      dx = dx_c_view_;
    }
  } else if (need_input_grad) {
    if (layout_.split_output) {
      const GemmOperand gathered = dy_16bit.data() != nullptr ? plain(dy_16bit) : plain(dy);
      all_gather_matmul(*tp_comm_, GatherSide::left, 1, gathered, w_t, dx_c_view_,
                        matmuls_.input_grad, scratch.matmul, compute_dtype_);
    } else {
      gemm(plain(dy), w_t, 0.0f, dx_c_view_, compute_dtype_);
    }
    round_in_place(dx_c_view_, compute_dtype_);
    if (layout_.slices_input()) {
      tp_comm_->all_gather(dx_c_view_, dx_, 1, compute_dtype_);
      dx = dx_;
    } else if (layout_.gathers_input()) {
      copy_columns(dx_c_view_, tp_index_ * layout_.input_width(), dx_);
      dx = dx_;
    } else {
      dx = dx_c_view_;
    }
  }
  // The input tangents' gradient: g_t Wᵀ, the cotangent pass on k times the rows.
  if (dt.data() != nullptr && need_input_grad) {  // fp32 only: the weight as floats
    *dt_in = cotangent_product(dt, weight.floats, scratch);
  }
  if (bucketed) {
    pass.buckets->poll();
    return dx;
  }

  // Weight gradient back to storage: reduce-scatter over the gathered axes (sum over the
  // batch ones; non-batch ones hold equal copies, hence the scale), then all-reduce over
  // the batch axes the storage does not split. Summed in the reduce dtype; stored in fp32.
  const bool defer = pass.deferred == DeferredReduction::later;
  weight_.reduce(scratch, /*all_reduce=*/!defer);
  bias_gradient(dy, scratch, !defer);
  return dx;
}

MatrixView Linear::forward_tangents(MatrixView dx, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  const int64_t k = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows_, layout_.layer);
  const int64_t rows = rows_ * k;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dx.extent(1)) == input_width(), "linear layer '",
                    layout_.layer, "': tangent input is [", dx.extent(0), ", ", dx.extent(1),
                    "], expected [", rows, ", ", input_width(), "]");
  // The tangents take the value's path: sliced or gathered into the compute layout...
  MatrixView x_used = dx;
  if (layout_.slices_input()) {
    x_used = leading_rows(tangent_x_c_, rows);
    copy_columns(dx, tp_index_ * layout_.in_compute, x_used);
  } else if (layout_.gathers_input()) {
    x_used = leading_rows(tangent_x_c_, rows);
    tp_comm_->all_gather(dx, x_used, 1, compute_dtype_);
  }
  tangent_x_used_ = x_used;  // for backward_with_tangents
  // ...and through the same product and collective (the bias has no derivative).
  MatrixView w = weight_.compute_matrix(scratch);
  MatrixView y = leading_rows(tangent_out_, rows);
  if (layout_.column_gathers_input()) {
    all_gather_matmul(*tp_comm_, GatherSide::left, 1, plain(x_used), plain(w), y, matmuls_.forward,
                      scratch.matmul, compute_dtype_);
  } else if (layout_.column_parallel) {
    gemm(plain(x_used), plain(w), 0.0f, y, compute_dtype_);
  } else if (layout_.split_output) {
    matmul_reduce_scatter(*tp_comm_, 1, plain(x_used), plain(w), y, matmuls_.forward,
                          scratch.matmul, compute_dtype_);
  } else {
    gemm(plain(x_used), plain(w), 0.0f, y, compute_dtype_);
    if (layout_.tensor_parallel) tp_comm_->all_reduce(y, ReduceOp::sum, compute_dtype_);
  }
  return y;
}

void Linear::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  const LinearLayout& l = layout_;
  const int64_t rows = rows_ * directions;
  if (l.slices_input() || l.gathers_input()) {
    tangent_x_c_ = Matrix(l.layer + "/input_tangents", rows, l.in_compute);
  }
  tangent_out_ = Matrix(l.layer + "/tangents", rows, l.out_local);
  reserve_stacked_rows(rows);
  tangent_capacity_ = directions;
}

MatrixView Linear::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  const int64_t rows = cotangent_block_rows(pass, rows_, layout_.layer).rows;
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), rows, layout_.layer);
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(1)) == layout_.out_local, "linear layer '",
                    layout_.layer, "': cotangent input is [", dy.extent(0), ", ", dy.extent(1),
                    "], expected [", rows * k, ", ", layout_.out_local, "]");
  return cotangent_product(dy, weight_.compute_matrix(scratch), scratch);
}

bool Linear::cotangents_by_rows() const {
  return !layout_.tensor_parallel && tp_comm_ == nullptr && !weight_.gathered();
}

MatrixView Linear::cotangent_product(MatrixView dy, MatrixView w, LayerScratch& scratch) {
  const int64_t rows = static_cast<int64_t>(dy.extent(0));
  // backward's input gradient, branch for branch.
  if (layout_.column_parallel) {
    if (layout_.column_gathers_input()) {
      const MatrixView dx = leading_rows(cotangent_dx_, rows);
      matmul_reduce_scatter(*tp_comm_, 1, plain(dy), transposed(w), dx, matmuls_.input_grad,
                            scratch.matmul, compute_dtype_);
      return dx;
    }
    const MatrixView dx = leading_rows(cotangent_dx_c_, rows);
    gemm(plain(dy), transposed(w), 0.0f, dx, compute_dtype_);
    if (!layout_.input_grad_partial) tp_comm_->all_reduce(dx, ReduceOp::sum, compute_dtype_);
    return dx;
  }
  const MatrixView dx_c = leading_rows(cotangent_dx_c_, rows);
  if (layout_.split_output) {
    all_gather_matmul(*tp_comm_, GatherSide::left, 1, plain(dy), transposed(w), dx_c,
                      matmuls_.input_grad, scratch.matmul, compute_dtype_);
  } else {
    gemm(plain(dy), transposed(w), 0.0f, dx_c, compute_dtype_);
  }
  if (layout_.slices_input()) {
    const MatrixView dx = leading_rows(cotangent_dx_, rows);
    tp_comm_->all_gather(dx_c, dx, 1, compute_dtype_);
    return dx;
  }
  if (layout_.gathers_input()) {
    const MatrixView dx = leading_rows(cotangent_dx_, rows);
    copy_columns(dx_c, tp_index_ * layout_.input_width(), dx);
    return dx;
  }
  return dx_c;
}

void Linear::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  const LinearLayout& l = layout_;
  const int64_t rows = rows_ * directions;
  if (!l.column_gathers_input()) {
    cotangent_dx_c_ = Matrix(l.layer + "/input_cotangents_compute", rows, l.in_compute);
  }
  if (l.column_gathers_input() || l.slices_input() || l.gathers_input()) {
    cotangent_dx_ = Matrix(l.layer + "/input_cotangents", rows, input_width());
  }
  reserve_stacked_rows(rows);
  cotangent_capacity_ = directions;
}

void Linear::reserve_stacked_rows(int64_t rows) {
  const LinearLayout& l = layout_;
  if (l.tensor_parallel) {
    needs_.matmul = std::max(needs_.matmul, static_cast<size_t>(3 * rows * l.out) * sizeof(float));
  }
  if (l.column_gathers_input()) {
    needs_.matmul = std::max(needs_.matmul, static_cast<size_t>(3 * rows * l.in) * sizeof(float));
  }
  if (tp_comm_) {
    tp_comm_->reserve_scratch(static_cast<size_t>(rows * std::max(l.in, l.out)));
    tp_comm_->reserve_reductions(static_cast<size_t>(rows * std::max(l.in, l.out)), compute_dtype_);
  }
}

void Linear::bias_gradient(MatrixView dy, LayerScratch& scratch, bool all_reduce) {
  // Column sums of dY into the full-width vector, which the bias reduces to its block.
  // A direct bias gradient is this rank's block itself (its columns start at 0).
  sum_columns_into(dy, layout_.bias_direct ? 0 : output_offset(), bias_.gradient(scratch),
                   compute_dtype_);
  bias_.reduce(scratch, all_reduce);
}

std::vector<ShardedParameter*> Linear::sharded_parameters() {
  return {&weight_, &bias_};
}

std::string Linear::describe() const {
  return layout_.layer + ": " + describe_linear_layout(layout_);
}

}  // namespace meshtrain
