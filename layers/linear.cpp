#include "layers/linear.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <sstream>

#include "framework/kernel_label.hpp"
#include "partition/error.hpp"

namespace meshtrain {
namespace {

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

bool contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

std::string tuple_text(const std::vector<std::string>& axes) {
  std::string out = "(";
  for (size_t i = 0; i < axes.size(); ++i) out += (i ? ", " : "") + axes[i];
  return out + ")";
}

// dst = src[:, offset : offset + dst.cols]
void copy_columns(UnmanagedMatrix src, int64_t offset, UnmanagedMatrix dst) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_take_columns"),
      Range2({0, 0}, {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { dst(i, j) = src(i, offset + j); });
}

void scale_matrix(UnmanagedMatrix m, float factor) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_scale_grad"),
      Range2({0, 0}, {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { m(i, j) *= factor; });
}

}  // namespace

void LinearScratchNeeds::merge(const LinearScratchNeeds& o) {
  weight = std::max(weight, o.weight);
  grad = std::max(grad, o.grad);
  stage = std::max(stage, o.stage);
  bias = std::max(bias, o.bias);
  matmul = std::max(matmul, o.matmul);
}

LinearScratch::LinearScratch(const LinearScratchNeeds& needs)
    : weight("meshtrain::scratch_weight", needs.weight),
      grad("meshtrain::scratch_grad", needs.grad),
      stage("meshtrain::scratch_stage", needs.stage),
      bias("meshtrain::scratch_bias", needs.bias) {
  if (needs.matmul > 0) matmul.reserve(needs.matmul);
}

Linear::Linear(const ShardedTensor& weight, const ShardedTensor& bias, FeatureLayout input_layout,
               int64_t rows, ParallelContext& context) {
  name_ = weight.name;
  const std::string suffix = "/weight";
  if (name_.size() > suffix.size() &&
      name_.compare(name_.size() - suffix.size(), suffix.size(), suffix) == 0) {
    name_.resize(name_.size() - suffix.size());
  }
  if (weight.global_shape.size() != 2 || bias.global_shape.size() != 1 ||
      bias.global_shape[0] != weight.global_shape[1]) {
    MESHTRAIN_BAD_INPUT("linear layer '", name_,
                        "' needs a weight [in, out] and a bias [out]; got '", weight.name,
                        "' of rank ", weight.global_shape.size(), " and '", bias.name, "' of rank ",
                        bias.global_shape.size());
  }
  in_ = weight.global_shape[0];
  out_ = weight.global_shape[1];
  rows_ = rows;
  const std::string feature = context.feature_axis();
  tp_ = context.feature_parallel();
  tp_index_ = context.feature_index();
  algorithm_ = context.matmul_algorithm();
  input_layout_ = tp_ > 1 ? input_layout : FeatureLayout::replicated;

  const PartitionSpec wspec = weight.spec.with_rank(2);
  const PartitionSpec bspec = bias.spec.with_rank(1);
  std::vector<std::string> dim0 = context.active(wspec.entries[0].axes);
  const std::vector<std::string> dim1 = context.active(wspec.entries[1].axes);
  compute_tp_ = tp_ > 1 && !dim0.empty() && dim0.front() == feature;
  if (compute_tp_) dim0.erase(dim0.begin());
  if ((compute_tp_ || input_layout_ == FeatureLayout::split) && in_ % tp_ != 0) {
    MESHTRAIN_BAD_INPUT("linear layer '", name_, "': its ", in_,
                        " input features do not split over mesh axis '", feature, "' of size ",
                        tp_);
  }
  split_output_ = compute_tp_ && out_ % tp_ == 0;
  in_c_ = compute_tp_ ? in_ / tp_ : in_;
  out_local_ = split_output_ ? out_ / tp_ : out_;

  // Weight: storage -> compute block.
  gather0_ = dim0;
  gather1_ = dim1;
  stored_rows_ = weight.box.extent[0];
  stored_cols_ = weight.box.extent[1];
  const Mesh& mesh = context.mesh();
  MESHTRAIN_REQUIRE(stored_rows_ * mesh.size_of(gather0_) == in_c_ &&
                        stored_cols_ * mesh.size_of(gather1_) == out_,
                    "linear layer '", name_, "': the block of '", weight.name,
                    "' does not tile its compute block");
  int nonbatch = 1;
  for (const auto& axes : {gather0_, gather1_}) {
    for (const auto& a : axes) {
      if (!context.is_batch_axis(a)) nonbatch *= mesh.axis_size(a);
    }
  }
  nonbatch_scale_ = 1.0f / static_cast<float>(nonbatch);
  for (const auto& a : context.active(context.batch_axes())) {
    if (!contains(gather0_, a) && !contains(gather1_, a)) weight_allreduce_.push_back(a);
  }

  // Bias: storage -> compute block [compute offset, +out_local).
  const std::vector<std::string> bentry = context.active(bspec.entries[0].axes);
  const int64_t compute_offset = split_output_ ? tp_index_ * out_local_ : 0;
  if (split_output_ && !bentry.empty() && bentry.front() == feature) {
    bias_gather_.assign(bentry.begin() + 1, bentry.end());
    bias_gathered_offset_ = compute_offset;
  } else {
    bias_gather_ = bentry;
    bias_gathered_offset_ = 0;
  }
  bias_stored_offset_ = bias.box.offset[0];
  bias_stored_extent_ = bias.box.extent[0];
  MESHTRAIN_REQUIRE(
      bias_gathered_offset_ <= compute_offset &&
          compute_offset + out_local_ <=
              bias_gathered_offset_ + bias_stored_extent_ * mesh.size_of(bias_gather_),
      "linear layer '", name_, "': the gathered bias does not cover its block");
  bias_reduce_ = context.active(context.batch_axes());
  if (split_output_) bias_reduce_.push_back(feature);

  // Communicators (collective on first use: the same calls in the same order everywhere).
  if (tp_ > 1) tp_comm_ = context.comm({feature});
  gather0_comm_ = context.comm(gather0_);
  gather1_comm_ = context.comm(gather1_);
  weight_allreduce_comm_ = context.comm(weight_allreduce_);
  bias_gather_comm_ = context.comm(bias_gather_);
  bias_reduce_comm_ = context.comm(bias_reduce_);

  // Buffers.
  const bool slice_input = compute_tp_ && input_layout_ == FeatureLayout::replicated;
  const bool gather_input = !compute_tp_ && input_layout_ == FeatureLayout::split;
  if (slice_input || gather_input) x_c_ = Matrix(name_ + "/input", rows_, in_c_);
  output_ = Matrix(name_ + "/output", rows_, out_local_);
  dx_c_ = Matrix(name_ + "/input_grad_compute", rows_, in_c_);
  if (slice_input || gather_input) dx_ = Matrix(name_ + "/input_grad", rows_, input_width());

  const bool gathers = gather0_comm_ != nullptr || gather1_comm_ != nullptr;
  if (gathers) {
    needs_.weight = static_cast<size_t>(in_c_ * out_);
    needs_.grad = static_cast<size_t>(in_c_ * out_);
  }
  if (gather0_comm_ && gather1_comm_) {
    needs_.stage = static_cast<size_t>(std::max(in_c_ * stored_cols_, stored_rows_ * out_));
  }
  needs_.bias = static_cast<size_t>(out_);
  if (compute_tp_) needs_.matmul = static_cast<size_t>(3 * rows_ * out_) * sizeof(float);
  if (gather1_comm_) gather1_comm_->reserve_scratch(static_cast<size_t>(in_c_ * out_));
  if (tp_comm_) tp_comm_->reserve_scratch(static_cast<size_t>(rows_ * std::max(in_, out_)));
}

int64_t Linear::input_width() const {
  return input_layout_ == FeatureLayout::split ? in_ / tp_ : in_;
}
int64_t Linear::output_width() const {
  return out_local_;
}
int64_t Linear::output_offset() const {
  return split_output_ ? tp_index_ * out_local_ : 0;
}

UnmanagedMatrix Linear::compute_weight(const ShardedTensor& weight, LinearScratch& scratch) {
  UnmanagedMatrix stored = weight.matrix();
  if (!gather0_comm_ && !gather1_comm_) return stored;
  UnmanagedMatrix full(scratch.weight.data(), in_c_, out_);
  if (gather0_comm_ && gather1_comm_) {
    UnmanagedMatrix stage(scratch.stage.data(), in_c_, stored_cols_);
    gather0_comm_->all_gather(stored, stage, 0);
    gather1_comm_->all_gather(stage, full, 1);
  } else if (gather0_comm_) {
    gather0_comm_->all_gather(stored, full, 0);
  } else {
    gather1_comm_->all_gather(stored, full, 1);
  }
  return full;
}

const float* Linear::compute_bias(const ShardedTensor& bias, LinearScratch& scratch) {
  const float* gathered = bias.local.data();
  if (bias_gather_comm_) {
    const size_t n = static_cast<size_t>(bias_stored_extent_) * bias_gather_comm_->size();
    bias_gather_comm_->all_gather(ConstVectorView(bias.local.data(), bias_stored_extent_),
                                  VectorView(scratch.bias.data(), n));
    gathered = scratch.bias.data();
  }
  return gathered + (output_offset() - bias_gathered_offset_);
}

UnmanagedMatrix Linear::forward(const ShardedTensor& weight, const ShardedTensor& bias,
                                UnmanagedMatrix x, LinearScratch& scratch) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == input_width(),
                    "linear layer '", name_, "': input is [", x.extent(0), ", ", x.extent(1),
                    "], expected [", rows_, ", ", input_width(), "]");
  if (compute_tp_ && input_layout_ == FeatureLayout::replicated) {
    copy_columns(x, tp_index_ * in_c_, x_c_);
    x_used_ = x_c_;
  } else if (!compute_tp_ && input_layout_ == FeatureLayout::split) {
    tp_comm_->all_gather(x, x_c_, 1);
    x_used_ = x_c_;
  } else {
    x_used_ = x;
  }
  UnmanagedMatrix w = compute_weight(weight, scratch);
  UnmanagedMatrix y = output_;
  if (split_output_) {
    matmul_reduce_scatter(*tp_comm_, 1, plain(x_used_), plain(w), y, algorithm_, scratch.matmul);
  } else {
    gemm(plain(x_used_), plain(w), 0.0f, y);
    if (compute_tp_) tp_comm_->all_reduce(y);
  }
  const float* b = compute_bias(bias, scratch);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_add_bias"),
      Range2({0, 0}, {static_cast<int64_t>(y.extent(0)), static_cast<int64_t>(y.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { y(i, j) += b[j]; });
  return y;
}

UnmanagedMatrix Linear::backward(const ShardedTensor& weight, ShardedTensor& weight_grad,
                                 ShardedTensor& bias_grad, UnmanagedMatrix dy, bool need_input_grad,
                                 LinearScratch& scratch) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == out_local_,
                    "linear layer '", name_, "': output gradient is [", dy.extent(0), ", ",
                    dy.extent(1), "], expected [", rows_, ", ", out_local_, "]");
  // Gathered again, not kept from forward.
  UnmanagedMatrix w = compute_weight(weight, scratch);

  // Weight gradient, compute block: X_cᵀ @ dY (dY all-gathered over features when split).
  const bool direct = !gather0_comm_ && !gather1_comm_;
  UnmanagedMatrix g =
      direct ? weight_grad.matrix() : UnmanagedMatrix(scratch.grad.data(), in_c_, out_);
  if (split_output_) {
    all_gather_matmul(*tp_comm_, GatherSide::right, 1, transposed(x_used_), plain(dy), g,
                      algorithm_, scratch.matmul);
  } else {
    gemm(transposed(x_used_), plain(dy), 0.0f, g);
  }

  // Input gradient: dY @ W_cᵀ, then back to the input's layout.
  UnmanagedMatrix dx;
  if (need_input_grad) {
    if (split_output_) {
      all_gather_matmul(*tp_comm_, GatherSide::left, 1, plain(dy), transposed(w), dx_c_, algorithm_,
                        scratch.matmul);
    } else {
      gemm(plain(dy), transposed(w), 0.0f, dx_c_);
    }
    if (compute_tp_ && input_layout_ == FeatureLayout::replicated) {
      tp_comm_->all_gather(UnmanagedMatrix(dx_c_), dx_, 1);
      dx = dx_;
    } else if (!compute_tp_ && input_layout_ == FeatureLayout::split) {
      copy_columns(dx_c_, tp_index_ * (in_ / tp_), dx_);
      dx = dx_;
    } else {
      dx = dx_c_;
    }
  }

  // Weight gradient back to storage: reduce-scatter over the gathered axes (sum over the
  // batch ones; non-batch ones hold equal copies, hence the scale), then all-reduce over
  // the batch axes the storage does not split.
  UnmanagedMatrix dst = weight_grad.matrix();
  if (gather0_comm_ && gather1_comm_) {
    UnmanagedMatrix stage(scratch.stage.data(), stored_rows_, out_);
    gather0_comm_->reduce_scatter(g, stage, 0);
    gather1_comm_->reduce_scatter(stage, dst, 1);
  } else if (gather0_comm_) {
    gather0_comm_->reduce_scatter(g, dst, 0);
  } else if (gather1_comm_) {
    gather1_comm_->reduce_scatter(g, dst, 1);
  }
  if (nonbatch_scale_ != 1.0f) scale_matrix(dst, nonbatch_scale_);
  if (weight_allreduce_comm_) weight_allreduce_comm_->all_reduce(dst);

  // Bias gradient: column sums of dY into the full-width vector, summed over the batch
  // axes (and the feature axis when the output is split), then this rank's block.
  float* full = scratch.bias.data();
  const int64_t width = out_;
  const int64_t offset = output_offset();
  const int64_t rows = rows_;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_bias_grad"), Kokkos::RangePolicy<>(0, width),
      KOKKOS_LAMBDA(const int64_t j) {
        float sum = 0.0f;
        if (j >= offset && j < offset + static_cast<int64_t>(dy.extent(1))) {
          for (int64_t i = 0; i < rows; ++i) sum += dy(i, j - offset);
        }
        full[j] = sum;
      });
  if (bias_reduce_comm_) bias_reduce_comm_->all_reduce(VectorView(full, static_cast<size_t>(out_)));
  Vector bg = bias_grad.local;
  const int64_t stored_offset = bias_stored_offset_;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_bias_grad_block"),
      Kokkos::RangePolicy<>(0, bias_stored_extent_),
      KOKKOS_LAMBDA(const int64_t j) { bg(j) = full[stored_offset + j]; });
  return dx;
}

std::string Linear::describe() const {
  std::ostringstream s;
  s << name_ << ": " << (compute_tp_ ? "TP" : "replicated") << " in " << in_;
  if (input_layout_ == FeatureLayout::split) s << " (split " << in_ / tp_ << ")";
  s << " -> out " << out_;
  if (split_output_) s << " (split " << out_local_ << ")";
  if (compute_tp_ && !split_output_) s << " (all-reduced: " << out_ << " % " << tp_ << " != 0)";
  if (!gather0_.empty()) s << ", weight gathered over " << tuple_text(gather0_) << " on dim 0";
  if (!gather1_.empty()) s << ", weight gathered over " << tuple_text(gather1_) << " on dim 1";
  if (!weight_allreduce_.empty()) s << ", grads all-reduced over " << tuple_text(weight_allreduce_);
  return s.str();
}

}  // namespace meshtrain
