#include "layers/linear.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>

#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "base/error.hpp"

namespace meshtrain {
namespace {

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

// dst = src[:, offset : offset + dst.cols]
void copy_columns(MatrixView src, int64_t offset, MatrixView dst) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_take_columns"),
      Range2({0, 0}, {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { dst(i, j) = src(i, offset + j); });
}

// full[j] = sum over rows of dy(:, j - offset) for the columns dy covers, 0 elsewhere,
// rounded to `dtype` (the bias gradient as a 16-bit autograd leaves it).
void sum_columns_into(MatrixView dy, int64_t offset, VectorView full, Dtype dtype) {
  const int64_t rows = static_cast<int64_t>(dy.extent(0));
  const int64_t cols = static_cast<int64_t>(dy.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_bias_grad"),
      Kokkos::RangePolicy<>(0, static_cast<int64_t>(full.extent(0))),
      KOKKOS_LAMBDA(const int64_t j) {
        float sum = 0.0f;
        if (j >= offset && j < offset + cols) {
          for (int64_t i = 0; i < rows; ++i) sum += dy(i, j - offset);
        }
        full(j) = round_to(sum, dtype);
      });
}

// block = full[offset : offset + block.extent(0)]
void copy_block(VectorView full, int64_t offset, Vector block) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_bias_grad_block"),
      Kokkos::RangePolicy<>(0, static_cast<int64_t>(block.extent(0))),
      KOKKOS_LAMBDA(const int64_t j) { block(j) = full(offset + j); });
}

void scale_matrix(MatrixView m, float factor) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_scale_grad"),
      Range2({0, 0}, {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { m(i, j) *= factor; });
}

}  // namespace

Linear::Linear(ParameterRef weight_ref, ParameterRef bias_ref, FeatureLayout input_layout,
               int64_t rows, ParallelContext& context)
    : layout_(decide_linear_layout(
          linear_layer_name(weight_ref.value->name),
          {weight_ref.value->name, weight_ref.value->global_shape, weight_ref.value->spec},
          {bias_ref.value->name, bias_ref.value->global_shape, bias_ref.value->spec},
          context.mesh(), {context.batch_axes(), context.feature_axis()}, input_layout)),
      weight_(weight_ref),
      bias_(bias_ref),
      rows_(rows),
      tp_index_(context.feature_index()),
      compute_dtype_(context.precision().param),
      reduce_dtype_(context.precision().reduce),
      matmuls_(layer_matmul_algorithms(layout_, rows, context.matmul_algorithm(),
                                       collective_matmul_hardware(), context.precision().param)) {
  const LinearLayout& l = layout_;
  const std::string& name = l.layer;
  const ShardedTensor& weight = *weight_.value;
  const ShardedTensor& bias = *bias_.value;
  MESHTRAIN_REQUIRE(weight.box.extent[0] == l.stored_rows && weight.box.extent[1] == l.stored_cols,
                    "linear layer '", name, "': the block of '", weight.name,
                    "' does not tile its compute block");
  nonbatch_scale_ = 1.0f / static_cast<float>(l.nonbatch_replication);

  // Bias: the gathered block starts at the compute offset when only the rest is gathered.
  const int64_t compute_offset = output_offset();
  bias_gathered_offset_ = l.bias_gather_sliced ? compute_offset : 0;
  bias_stored_offset_ = bias.box.offset[0];
  MESHTRAIN_REQUIRE(
      bias.box.extent[0] == l.bias_stored && bias_gathered_offset_ <= compute_offset &&
          compute_offset + l.out_local <=
              bias_gathered_offset_ + l.bias_stored * context.mesh().size_of(l.bias_gather),
      "linear layer '", name, "': the gathered bias does not cover its block");

  // Communicators (collective on first use: the same calls in the same order everywhere).
  if (l.tp > 1) tp_comm_ = context.comm({l.feature_axis});
  gather0_comm_ = context.comm(l.weight_gather_dim0);
  gather1_comm_ = context.comm(l.weight_gather_dim1);
  weight_allreduce_comm_ = context.comm(l.weight_allreduce);
  bias_gather_comm_ = context.comm(l.bias_gather);
  bias_reduce_comm_ = context.comm(l.bias_reduce);
  defers_reduction_ = l.defers_reduction();  // the bias is stored whole: offset 0

  // Buffers.
  const int64_t in_c = l.in_compute, out = l.out;
  if (l.slices_input() || l.gathers_input()) x_c_ = Matrix(name + "/input", rows_, in_c);
  output_ = Matrix(name + "/output", rows_, l.out_local);
  dx_c_ = Matrix(name + "/input_grad_compute", rows_, in_c);
  if (l.slices_input() || l.gathers_input()) {
    dx_ = Matrix(name + "/input_grad", rows_, input_width());
  }

  const bool gathers = gather0_comm_ != nullptr || gather1_comm_ != nullptr;
  if (gathers) {
    needs_.weight = static_cast<size_t>(in_c * out);
    needs_.grad = static_cast<size_t>(in_c * out);
  } else if (compute_dtype_ != Dtype::fp32) {
    needs_.weight = static_cast<size_t>(in_c * out);  // the rounded copy of the stored weight
  }
  if (gather0_comm_ && gather1_comm_) {
    needs_.stage = static_cast<size_t>(std::max(in_c * l.stored_cols, l.stored_rows * out));
  }
  needs_.bias = static_cast<size_t>(out);
  if (l.tensor_parallel) needs_.matmul = static_cast<size_t>(3 * rows_ * out) * sizeof(float);
  if (gather1_comm_) gather1_comm_->reserve_scratch(static_cast<size_t>(in_c * out));
  if (tp_comm_) tp_comm_->reserve_scratch(static_cast<size_t>(rows_ * std::max(l.in, out)));
}

int64_t Linear::output_offset() const {
  return layout_.split_output ? tp_index_ * layout_.out_local : 0;
}

MatrixView Linear::compute_weight(LayerScratch& scratch) {
  MatrixView stored = weight_.value->matrix();
  MatrixView full(scratch.weight.data(), layout_.in_compute, layout_.out);
  if (!gather0_comm_ && !gather1_comm_) {
    if (compute_dtype_ == Dtype::fp32) return stored;
    round_copy(stored, full, compute_dtype_);  // the fp32 master cast to the compute dtype
    return full;
  }
  // Gathered in the compute dtype: the blocks are rounded as they are packed.
  if (prefetch_started_) {
    // Started while the layer before computed: the blocks are landing in scratch.prefetch.
    // (A poll may have completed the request already; then wait() returns at once.)
    prefetch_started_ = false;
    prefetch_.wait();
    if (gather0_comm_) {
      // Dim 0 blocks in rank order are the weight itself: the landing buffer becomes the
      // weight buffer, and the old weight buffer (free: its layer is done) the landing one.
      std::swap(scratch.weight, scratch.prefetch);
      return MatrixView(scratch.weight.data(), layout_.in_compute, layout_.out);
    }
    place_gathered_columns(ConstVectorView(scratch.prefetch.data(), full.span()), full,
                           gather1_comm_->size());
    return full;
  }
  if (gather0_comm_ && gather1_comm_) {
    MatrixView stage(scratch.stage.data(), layout_.in_compute, layout_.stored_cols);
    gather0_comm_->all_gather(stored, stage, 0, compute_dtype_);
    gather1_comm_->all_gather(stage, full, 1, compute_dtype_);
  } else if (gather0_comm_) {
    gather0_comm_->all_gather(stored, full, 0, compute_dtype_);
  } else {
    gather1_comm_->all_gather(stored, full, 1, compute_dtype_);
  }
  return full;
}

void Linear::start_weight_prefetch(LayerScratch& scratch) {
  const size_t gathered = static_cast<size_t>(layout_.in_compute * layout_.out);
  MESHTRAIN_REQUIRE(
      can_prefetch_weight() && !prefetch_started_ && scratch.prefetch.extent(0) >= gathered,
      "linear layer '", layout_.layer,
      "': its weight cannot be prefetched (gathered over two groups, already "
      "started, or a scratch made without prefetch)");
  Communicator& group = gather0_comm_ ? *gather0_comm_ : *gather1_comm_;
  const Vector& stored = weight_.value->local;
  prefetch_ = group.start_all_gather(ConstVectorView(stored.data(), stored.extent(0)),
                                     VectorView(scratch.prefetch.data(), gathered), compute_dtype_);
  prefetch_started_ = true;
}

const float* Linear::compute_bias(LayerScratch& scratch) {
  const ShardedTensor& bias = *bias_.value;
  const float* gathered = bias.local.data();
  if (bias_gather_comm_) {
    const size_t n = static_cast<size_t>(layout_.bias_stored) * bias_gather_comm_->size();
    bias_gather_comm_->all_gather(ConstVectorView(bias.local.data(), layout_.bias_stored),
                                  VectorView(scratch.bias.data(), n), compute_dtype_);
    gathered = scratch.bias.data();
  }
  return gathered + (output_offset() - bias_gathered_offset_);
}

MatrixView Linear::forward(MatrixView x, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  Layer* next = pass.prefetch;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == input_width(),
                    "linear layer '", layout_.layer, "': input is [", x.extent(0), ", ",
                    x.extent(1), "], expected [", rows_, ", ", input_width(), "]");
  if (layout_.slices_input()) {
    copy_columns(x, tp_index_ * layout_.in_compute, x_c_);
    x_used_ = x_c_;
  } else if (layout_.gathers_input()) {
    tp_comm_->all_gather(x, x_c_, 1, compute_dtype_);
    x_used_ = x_c_;
  } else {
    x_used_ = x;
  }
  MatrixView w = compute_weight(scratch);
  if (next) next->start_weight_prefetch(scratch);
  MatrixView y = output_;
  if (layout_.split_output) {
    matmul_reduce_scatter(*tp_comm_, 1, plain(x_used_), plain(w), y, matmuls_.forward,
                          scratch.matmul, compute_dtype_);
  } else {
    gemm(plain(x_used_), plain(w), 0.0f, y, compute_dtype_);
    if (layout_.tensor_parallel) tp_comm_->all_reduce(y, ReduceOp::sum, compute_dtype_);
  }
  if (next) next->poll_weight_prefetch();
  // The product in the compute dtype, plus the bias (cast to it), rounded again: two
  // roundings, as docs/mixed_precision.md lists them (none in fp32).
  const float* b = compute_bias(scratch);
  const Dtype dtype = compute_dtype_;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_add_bias"),
      Range2({0, 0}, {static_cast<int64_t>(y.extent(0)), static_cast<int64_t>(y.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        y(i, j) = round_to(round_to(y(i, j), dtype) + round_to(b[j], dtype), dtype);
      });
  return y;
}

MatrixView Linear::backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  Layer* next = pass.prefetch;
  ShardedTensor& weight_grad = *weight_.grad;
  ShardedTensor& bias_grad = *bias_.grad;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == layout_.out_local,
                    "linear layer '", layout_.layer, "': output gradient is [", dy.extent(0), ", ",
                    dy.extent(1), "], expected [", rows_, ", ", layout_.out_local, "]");
  // Gathered again, not kept from forward.
  MatrixView w = compute_weight(scratch);
  if (next) next->start_weight_prefetch(scratch);

  // Weight gradient, compute block: X_cᵀ @ dY (dY all-gathered over features when split).
  const bool direct = !gather0_comm_ && !gather1_comm_;
  MatrixView g = direct ? weight_grad.matrix()
                        : MatrixView(scratch.grad.data(), layout_.in_compute, layout_.out);
  if (layout_.split_output) {
    all_gather_matmul(*tp_comm_, GatherSide::right, 1, transposed(x_used_), plain(dy), g,
                      matmuls_.weight_grad, scratch.matmul, compute_dtype_);
  } else {
    gemm(transposed(x_used_), plain(dy), 0.0f, g, compute_dtype_);
  }
  round_in_place(g, compute_dtype_);  // the weight's gradient in its compute dtype
  if (next) next->poll_weight_prefetch();
  // DP overlap: both gradients are final here (no gathers, no scale); hand them to the
  // buckets, whose all-reduce runs while dX is computed.
  const bool bucketed = defers_reduction_ && pass.deferred == DeferredReduction::in_buckets;
  if (bucketed) {
    bias_gradient(dy, bias_grad, scratch, /*all_reduce=*/false);
    pass.buckets->layer_ready(pass.index);
  }

  // Input gradient: dY @ W_cᵀ, then back to the input's layout.
  MatrixView dx;
  if (need_input_grad) {
    if (layout_.split_output) {
      all_gather_matmul(*tp_comm_, GatherSide::left, 1, plain(dy), transposed(w), dx_c_,
                        matmuls_.input_grad, scratch.matmul, compute_dtype_);
    } else {
      gemm(plain(dy), transposed(w), 0.0f, dx_c_, compute_dtype_);
    }
    round_in_place(MatrixView(dx_c_), compute_dtype_);
    if (layout_.slices_input()) {
      tp_comm_->all_gather(MatrixView(dx_c_), dx_, 1, compute_dtype_);
      dx = dx_;
    } else if (layout_.gathers_input()) {
      copy_columns(dx_c_, tp_index_ * layout_.input_width(), dx_);
      dx = dx_;
    } else {
      dx = dx_c_;
    }
  }
  if (bucketed) {
    pass.buckets->poll();
    return dx;
  }

  // Weight gradient back to storage: reduce-scatter over the gathered axes (sum over the
  // batch ones; non-batch ones hold equal copies, hence the scale), then all-reduce over
  // the batch axes the storage does not split. Summed in the reduce dtype; stored in fp32.
  MatrixView dst = weight_grad.matrix();
  const Dtype wire = reduce_dtype_;
  if (gather0_comm_ && gather1_comm_) {
    MatrixView stage(scratch.stage.data(), layout_.stored_rows, layout_.out);
    gather0_comm_->reduce_scatter(g, stage, 0, wire);
    gather1_comm_->reduce_scatter(stage, dst, 1, wire);
  } else if (gather0_comm_) {
    gather0_comm_->reduce_scatter(g, dst, 0, wire);
  } else if (gather1_comm_) {
    gather1_comm_->reduce_scatter(g, dst, 1, wire);
  }
  if (nonbatch_scale_ != 1.0f) scale_matrix(dst, nonbatch_scale_);
  const bool defer = defers_reduction_ && pass.deferred == DeferredReduction::later;
  if (weight_allreduce_comm_ && !defer)
    weight_allreduce_comm_->all_reduce(dst, ReduceOp::sum, wire);
  bias_gradient(dy, bias_grad, scratch, !defer);
  return dx;
}

void Linear::bias_gradient(MatrixView dy, ShardedTensor& bias_grad, LayerScratch& scratch,
                           bool all_reduce) {
  // Bias gradient: column sums of dY into the full-width vector, summed over the batch
  // axes (and the feature axis when the output is split), then this rank's block.
  VectorView full(scratch.bias.data(), static_cast<size_t>(layout_.out));
  sum_columns_into(dy, output_offset(), full, compute_dtype_);
  if (bias_reduce_comm_ && all_reduce)
    bias_reduce_comm_->all_reduce(full, ReduceOp::sum, reduce_dtype_);
  copy_block(full, bias_stored_offset_, bias_grad.local);
}

void Linear::reduce_gradients() {
  if (!defers_reduction_) return;
  ShardedTensor& weight_grad = *weight_.grad;
  ShardedTensor& bias_grad = *bias_.grad;
  weight_allreduce_comm_->all_reduce(weight_grad.matrix(), ReduceOp::sum, reduce_dtype_);
  bias_reduce_comm_->all_reduce(VectorView(bias_grad.local.data(), bias_grad.local.extent(0)),
                                ReduceOp::sum, reduce_dtype_);
}

LayerGradients Linear::bucket_gradients() const {
  const Vector& w = weight_.grad->local;
  const Vector& b = bias_.grad->local;
  return {VectorView(w.data(), w.extent(0)), VectorView(b.data(), b.extent(0)),
          deferred_reduction_group()};
}

std::string Linear::describe() const {
  return layout_.layer + ": " + describe_linear_layout(layout_);
}

}  // namespace meshtrain
