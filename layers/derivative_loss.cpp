#include "layers/derivative_loss.hpp"

#include <Kokkos_Core.hpp>
#include <set>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/view_ops.hpp"

namespace meshtrain {

DerivativeLoss::DerivativeLoss(const DerivativeLossSettings& settings, ParallelContext& context,
                               int64_t rows, int64_t inputs, int64_t outputs, FeatureLayout layout)
    : rows_(rows),
      outputs_(outputs),
      directions_(static_cast<int64_t>(settings.inputs.size())),
      weight_(settings.weight) {
  if (directions_ == 0) MESHTRAIN_BAD_INPUT("derivative loss: no input column chosen");
  std::set<int64_t> seen;
  for (const int64_t i : settings.inputs) {
    if (i < 0 || i >= inputs || !seen.insert(i).second) {
      MESHTRAIN_BAD_INPUT("derivative loss: input column ", i, " is outside [0, ", inputs,
                          ") or chosen twice");
    }
  }
  if (!(weight_ >= 0.0)) {
    MESHTRAIN_BAD_INPUT("derivative loss: the weight must be >= 0, got ", weight_);
  }
  auto check_stds = [](const std::vector<double>& stds, int64_t count, const char* what) {
    if (stds.empty()) return;
    if (static_cast<int64_t>(stds.size()) != count) {
      MESHTRAIN_BAD_INPUT("derivative loss: ", stds.size(), " ", what, " standard deviations for ",
                          count, " columns");
    }
    for (const double s : stds) {
      if (!(s > 0.0))
        MESHTRAIN_BAD_INPUT("derivative loss: a ", what, " standard deviation is ", s);
    }
  };
  check_stds(settings.input_std, inputs, "input");
  check_stds(settings.target_std, outputs, "target");

  const ParallelContext::OutputColumns columns =
      context.output_columns("derivative loss", outputs, layout);
  split_ = columns.split;
  local_width_ = columns.local_width;
  offset_ = columns.offset;
  feature_index_ = context.feature_index();
  global_rows_ = rows_ * context.batch_parallel();
  std::vector<std::string> scalar_axes = context.active(context.batch_axes());
  if (context.feature_parallel() > 1) scalar_axes.push_back(context.feature_axis());
  scalar_comm_ = context.comm(scalar_axes);

  const int64_t k = directions_;
  seeds_ = Matrix("meshtrain::derivative_loss_seeds", rows_ * k, inputs);
  auto seeds_host = host_mirror(seeds_);
  for (int64_t r = 0; r < rows_; ++r) {
    for (int64_t d = 0; d < k; ++d) {
      const int64_t i = settings.inputs[d];
      seeds_host(r * k + d, i) =
          static_cast<float>(1.0 / (settings.input_std.empty() ? 1.0 : settings.input_std[i]));
    }
  }
  copy_view(seeds_, seeds_host);
  target_std_ = Vector("meshtrain::derivative_loss_target_std", outputs);
  auto std_host = host_mirror(target_std_);
  for (int64_t o = 0; o < outputs; ++o) {
    std_host(o) = static_cast<float>(settings.target_std.empty() ? 1.0 : settings.target_std[o]);
  }
  copy_view(target_std_, std_host);
  gradient_ = Matrix("meshtrain::derivative_loss_gradient", rows_ * k, local_width_);
  sum_ = Kokkos::View<double*, Kokkos::LayoutRight>("meshtrain::derivative_loss_sum", 1);
  sum_host_ = host_mirror(sum_);
}

DerivativeLossResult DerivativeLoss::evaluate(MatrixView tangents, MatrixView targets,
                                              bool with_gradient) {
  const int64_t k = directions_;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(tangents.extent(0)) == rows_ * k &&
                        static_cast<int64_t>(tangents.extent(1)) == local_width_ &&
                        static_cast<int64_t>(targets.extent(0)) >= rows_ &&
                        static_cast<int64_t>(targets.extent(1)) == outputs_ * k,
                    "derivative loss: tangents [", tangents.extent(0), ", ", tangents.extent(1),
                    "] and targets [", targets.extent(0), ", ", targets.extent(1), "], expected [",
                    rows_ * k, ", ", local_width_, "] and [", rows_, ", ", outputs_ * k, "]");
  const int64_t width = local_width_, offset = offset_;
  const double count = static_cast<double>(global_rows_) * static_cast<double>(outputs_ * k);
  const float scale = static_cast<float>(2.0 * weight_ / count);
  const MatrixView gradient = gradient_;
  const Vector target_std = target_std_;
  // Per value row r: its k tangent rows against its [outputs, k] targets.
  reduce_into(
      MESHTRAIN_LABEL("meshtrain::derivative_loss"), device_range(0, rows_),
      KOKKOS_LAMBDA(const int64_t r, double& acc) {
        for (int64_t d = 0; d < k; ++d) {
          for (int64_t j = 0; j < width; ++j) {
            const int64_t o = offset + j;
            const float s = target_std(o);
            const float diff = s * tangents(r * k + d, j) - targets(r, o * k + d);
            acc += static_cast<double>(diff) * static_cast<double>(diff);
            if (with_gradient) gradient(r * k + d, j) = scale * diff * s;
          }
        }
      },
      Kokkos::subview(sum_, 0));
  copy_view(sum_host_, sum_);
  double sum = sum_host_(0);
  // A replicated sum is counted on feature rank 0 only; a split one sums its columns.
  if (!split_ && feature_index_ != 0) sum = 0.0;
  if (scalar_comm_) {
    sum_host_(0) = sum;
    copy_view(sum_, sum_host_);
    scalar_comm_->all_reduce(DoubleVectorView(sum_.data(), 1));
    copy_view(sum_host_, sum_);
    sum = sum_host_(0);
  }
  DerivativeLossResult result;
  result.mse = sum / count;
  result.loss = weight_ * result.mse;
  return result;
}

}  // namespace meshtrain
