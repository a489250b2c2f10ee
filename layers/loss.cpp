#include "layers/loss.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <limits>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/step_graph.hpp"
#include "framework/core/view_ops.hpp"

namespace meshtrain {
namespace {

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

// The losses with float targets, row by row: row_loss(i) = the sum over this rank's columns of
// output j's (weighted) term, grad(i, j) its derivative divided by the global rows; padding rows
// add 0. binary_cross_entropy also counts the row's targets outside [0, 1] in bad(i, 0).
// (A free function: nvcc's device lambdas cannot live in private member functions. Plain
// `if`s on the template arguments, folded at compile time: nvcc refuses a device lambda whose
// first use of a captured variable is inside an `if constexpr`.)
template <LossKind Kind, bool Weighted>
void regression_rows(MatrixView logits, MatrixView targets, int64_t rows, int64_t valid,
                     int64_t offset, int64_t global_rows, float delta, const Vector& weights,
                     bool with_gradient, const Matrix& grad, const Vector& row_loss,
                     const Matrix& bad) {
  const int64_t lw = static_cast<int64_t>(logits.extent(1));
  const float scale = 2.0f / static_cast<float>(global_rows);  // mse: d(d^2)/dd = 2 d
  const float inv_n = 1.0f / static_cast<float>(global_rows);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::regression_loss_rows"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        float s = 0.0f, outside = 0.0f;
        for (int64_t j = 0; j < lw; ++j) {
          const float d = logits(i, j) - targets(i, offset + j);
          if (Kind == LossKind::mse && !Weighted) {
            // mse as it always was (the same expressions: fp32 results do not change).
            s += d * d;
            if (with_gradient) grad(i, j) = i < valid ? scale * d : 0.0f;
          } else {
            float term = 0.0f, slope = 0.0f;  // slope: the gradient before the weight
            if (Kind == LossKind::mse) {
              term = d * d;
              slope = scale * d;
            } else if (Kind == LossKind::huber) {
              const float a = kmath::fabs(d);
              term = a <= delta ? 0.5f * d * d : delta * (a - 0.5f * delta);
              const float clipped = d < -delta ? -delta : (d > delta ? delta : d);
              slope = clipped * inv_n;
            } else if (Kind == LossKind::mae) {
              term = kmath::fabs(d);
              slope = (d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f)) * inv_n;
            } else {  // binary_cross_entropy: max(z, 0) - z t + log1p(e^-|z|) = log(1 + e^z) - z t
              const float z = logits(i, j), t = targets(i, offset + j);
              term = (z > 0.0f ? z : 0.0f) - z * t + kmath::log1p(kmath::exp(-kmath::fabs(z)));
              slope = (1.0f / (1.0f + kmath::exp(-z)) - t) * inv_n;
              outside += (t >= 0.0f && t <= 1.0f) ? 0.0f : 1.0f;  // NaN too
            }
            if (Weighted) {
              const float w = weights(offset + j);
              term *= w;
              slope *= w;
            }
            s += term;
            if (with_gradient) grad(i, j) = i < valid ? slope : 0.0f;
          }
        }
        row_loss(i) = i < valid ? s : 0.0f;
        if (Kind == LossKind::binary_cross_entropy) bad(i, 0) = i < valid ? outside : 0.0f;
      });
}

template <LossKind Kind>
void regression_rows(bool weighted, MatrixView logits, MatrixView targets, int64_t rows,
                     int64_t valid, int64_t offset, int64_t global_rows, float delta,
                     const Vector& weights, bool with_gradient, const Matrix& grad,
                     const Vector& row_loss, const Matrix& bad) {
  if (weighted) {
    regression_rows<Kind, true>(logits, targets, rows, valid, offset, global_rows, delta, weights,
                                with_gradient, grad, row_loss, bad);
  } else {
    regression_rows<Kind, false>(logits, targets, rows, valid, offset, global_rows, delta, weights,
                                 with_gradient, grad, row_loss, bad);
  }
}

}  // namespace

Loss::Loss(LossKind kind, ParallelContext& context, int64_t rows, int64_t width,
           FeatureLayout layout, const LossOptions& options)
    : kind_(kind), rows_(rows), width_(width) {
  MESHTRAIN_REQUIRE(options.huber_delta > 0, "Loss: huber delta must be positive, got ",
                    options.huber_delta);
  huber_delta_ = static_cast<float>(options.huber_delta);
  if (!options.weights.empty()) {
    MESHTRAIN_REQUIRE(takes_targets(kind_), "Loss: output weights for a ", to_string(kind_),
                      " loss");
    MESHTRAIN_REQUIRE(static_cast<int64_t>(options.weights.size()) == width_,
                      "Loss: ", options.weights.size(), " output weights for ", width_, " outputs");
    weights_ = Vector("meshtrain::loss_weights", width_);
    auto host = host_mirror(weights_);
    for (int64_t j = 0; j < width_; ++j) host(j) = static_cast<float>(options.weights[j]);
    copy_view(weights_, host);
  }
  tp_ = context.feature_parallel();
  tp_index_ = context.feature_index();
  feature_index_ = tp_index_;
  const ParallelContext::OutputColumns columns = context.output_columns("loss", width_, layout);
  split_ = columns.split;
  local_width_ = columns.local_width;
  offset_ = columns.offset;
  if (!split_) tp_index_ = 0;
  global_rows_ = rows_ * context.batch_parallel();

  // The feature axis joins the scalar reduction whenever it has ranks, so that a rank's
  // poisoned sum (a batch it could not read) reaches its feature partners too, who may
  // have read theirs; each sum is then counted on feature rank 0 only (share), except a
  // split mse's, whose columns are summed over the axis.
  std::vector<std::string> scalar_axes = context.active(context.batch_axes());
  if (tp_ > 1) scalar_axes.push_back(context.feature_axis());
  if (split_) tp_comm_ = context.comm({context.feature_axis()});
  scalar_comm_ = context.comm(scalar_axes);

  gradient_ = Matrix("meshtrain::loss_gradient", rows_, local_width_);
  row_max_local_ = Matrix("meshtrain::loss_row_max", rows_, 1);
  row_max_all_ = Matrix("meshtrain::loss_row_max_all", rows_, split_ ? tp_ : 1);
  row_stats_ = Matrix("meshtrain::loss_row_stats", rows_, 3);
  row_loss_ = Vector("meshtrain::loss_rows", rows_);
  scalars_ = Kokkos::View<double*, Kokkos::LayoutRight>("meshtrain::loss_scalars", 3);
  scalars_host_ = host_mirror(scalars_);
  if (tp_comm_) tp_comm_->reserve_scratch(static_cast<size_t>(rows_ * tp_));
}

LossResult Loss::finish(double local_sum, double local_counted, double local_count) {
  scalars_host_(0) = poisoned_ ? std::numeric_limits<double>::quiet_NaN() : local_sum;
  poisoned_ = false;
  scalars_host_(1) = local_counted;
  scalars_host_(2) = local_count;
  if (scalar_comm_) {
    copy_view(scalars_, scalars_host_);
    scalar_comm_->all_reduce(DoubleVectorView(scalars_.data(), 3));
    copy_view(scalars_host_, scalars_);
  }
  LossResult r;
  r.loss_sum = scalars_host_(0);
  const int64_t counted = static_cast<int64_t>(std::llround(scalars_host_(1)));
  if (kind_ == LossKind::cross_entropy) r.correct = counted;
  if (kind_ == LossKind::binary_cross_entropy) r.targets_outside = counted;
  r.count = static_cast<int64_t>(std::llround(scalars_host_(2)));
  r.loss = r.count > 0 ? r.loss_sum / static_cast<double>(r.count) : 0.0;
  return r;
}

LossResult Loss::cross_entropy(MatrixView logits, LabelView labels, bool with_gradient,
                               int64_t valid_rows) {
  cross_entropy_kernels(logits, labels, with_gradient, valid_rows);
  return cross_entropy_result(valid_rows);
}

void Loss::cross_entropy_kernels(MatrixView logits, LabelView labels, bool with_gradient,
                                 int64_t valid_rows) {
  MESHTRAIN_REQUIRE(kind_ == LossKind::cross_entropy, "Loss::cross_entropy on a ", to_string(kind_),
                    " loss");
  MESHTRAIN_REQUIRE(static_cast<int64_t>(logits.extent(0)) == rows_ &&
                        static_cast<int64_t>(logits.extent(1)) == local_width_ &&
                        static_cast<int64_t>(labels.extent(0)) >= rows_,
                    "cross_entropy: logits are [", logits.extent(0), ", ", logits.extent(1),
                    "], expected [", rows_, ", ", local_width_, "]");
  const int64_t valid = valid_rows < 0 ? rows_ : std::min(valid_rows, rows_);
  const int64_t lw = local_width_;
  const int64_t offset = offset_;
  const int my_index = tp_index_;
  const float inv_n = 1.0f / static_cast<float>(global_rows_);
  auto row_max = row_max_local_;
  auto row_max_all = split_ ? row_max_all_ : row_max_local_;
  auto stats = row_stats_;
  auto row_loss = row_loss_;
  auto grad = gradient_;

  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::cross_entropy_row_max"),
      Kokkos::RangePolicy<>(device_space(), 0, rows_), KOKKOS_LAMBDA(const int64_t i) {
        float m = logits(i, 0);
        for (int64_t j = 1; j < lw; ++j) m = logits(i, j) > m ? logits(i, j) : m;
        row_max(i, 0) = m;
      });
  if (split_) tp_comm_->all_gather(MatrixView(row_max_local_), row_max_all_, 1);
  const int64_t parts = static_cast<int64_t>(row_max_all.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::cross_entropy_row_stats"),
      Kokkos::RangePolicy<>(device_space(), 0, rows_), KOKKOS_LAMBDA(const int64_t i) {
        float m = row_max_all(i, 0);
        int owner = 0;
        for (int64_t t = 1; t < parts; ++t) {
          if (row_max_all(i, t) > m) {
            m = row_max_all(i, t);
            owner = static_cast<int>(t);
          }
        }
        float s = 0.0f;
        for (int64_t j = 0; j < lw; ++j) s += kmath::exp(logits(i, j) - m);
        const int64_t label = labels(i) - offset;
        const float label_logit = (label >= 0 && label < lw) ? logits(i, label) : 0.0f;
        float hit = 0.0f;
        if (owner == my_index) {
          int64_t arg = 0;
          while (arg < lw - 1 && logits(i, arg) != m) ++arg;
          hit = (arg + offset == labels(i)) ? 1.0f : 0.0f;
        }
        stats(i, 0) = s;
        stats(i, 1) = label_logit;
        stats(i, 2) = hit;
        row_max(i, 0) = m;  // the global maximum from here on
      });
  if (split_) tp_comm_->all_reduce(MatrixView(row_stats_));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::cross_entropy_rows"),
      Kokkos::RangePolicy<>(device_space(), 0, rows_), KOKKOS_LAMBDA(const int64_t i) {
        const float m = row_max(i, 0);
        const float s = stats(i, 0);
        row_loss(i) = i < valid ? kmath::log(s) + m - stats(i, 1) : 0.0f;
        if (with_gradient) {
          const int64_t label = labels(i) - offset;
          for (int64_t j = 0; j < lw; ++j) {
            const float p = kmath::exp(logits(i, j) - m) / s;
            grad(i, j) = i < valid ? (p - (j == label ? 1.0f : 0.0f)) * inv_n : 0.0f;
          }
        }
      });
  // Reduced into device scalars without a fence (reduce_into, exec_space.hpp), read back by
  // one copy.
  reduce_into(
      MESHTRAIN_LABEL("meshtrain::cross_entropy_sum"), device_range(0, valid),
      KOKKOS_LAMBDA(const int64_t i, double& acc) { acc += row_loss(i); },
      Kokkos::subview(scalars_, 0));
  reduce_into(
      MESHTRAIN_LABEL("meshtrain::cross_entropy_hits"), device_range(0, valid),
      KOKKOS_LAMBDA(const int64_t i, double& acc) { acc += stats(i, 2); },
      Kokkos::subview(scalars_, 1));
}

LossResult Loss::cross_entropy_result(int64_t valid_rows) {
  MESHTRAIN_REQUIRE(kind_ == LossKind::cross_entropy, "Loss::cross_entropy_result on a ",
                    to_string(kind_), " loss");
  const int64_t valid = valid_rows < 0 ? rows_ : std::min(valid_rows, rows_);
  note_host_read("the loss (Loss::cross_entropy_result)");
  copy_view(scalars_host_, scalars_);
  const double sum = scalars_host_(0), correct = scalars_host_(1);
  return finish(share(sum), share(correct), share(static_cast<double>(valid)));
}

LossResult Loss::regression(MatrixView logits, MatrixView targets, bool with_gradient,
                            int64_t valid_rows) {
  MESHTRAIN_REQUIRE(takes_targets(kind_), "Loss::regression on a ", to_string(kind_), " loss");
  MESHTRAIN_REQUIRE(static_cast<int64_t>(logits.extent(0)) == rows_ &&
                        static_cast<int64_t>(logits.extent(1)) == local_width_ &&
                        static_cast<int64_t>(targets.extent(0)) >= rows_ &&
                        static_cast<int64_t>(targets.extent(1)) == width_,
                    to_string(kind_), ": outputs are [", logits.extent(0), ", ", logits.extent(1),
                    "] and targets [", targets.extent(0), ", ", targets.extent(1), "], expected [",
                    rows_, ", ", local_width_, "] and [", rows_, ", ", width_, "]");
  const int64_t valid = valid_rows < 0 ? rows_ : std::min(valid_rows, rows_);
  auto row_loss = row_loss_;
  const bool weighted = weights_.extent(0) > 0;
  switch (kind_) {
    case LossKind::huber:
      regression_rows<LossKind::huber>(weighted, logits, targets, rows_, valid, offset_,
                                       global_rows_, huber_delta_, weights_, with_gradient,
                                       gradient_, row_loss_, row_stats_);
      break;
    case LossKind::mae:
      regression_rows<LossKind::mae>(weighted, logits, targets, rows_, valid, offset_, global_rows_,
                                     huber_delta_, weights_, with_gradient, gradient_, row_loss_,
                                     row_stats_);
      break;
    case LossKind::binary_cross_entropy:
      regression_rows<LossKind::binary_cross_entropy>(
          weighted, logits, targets, rows_, valid, offset_, global_rows_, huber_delta_, weights_,
          with_gradient, gradient_, row_loss_, row_stats_);
      break;
    default:
      regression_rows<LossKind::mse>(weighted, logits, targets, rows_, valid, offset_, global_rows_,
                                     huber_delta_, weights_, with_gradient, gradient_, row_loss_,
                                     row_stats_);
      break;
  }
  reduce_into(  // into a device scalar, as in cross_entropy
      MESHTRAIN_LABEL("meshtrain::regression_loss_sum"), device_range(0, valid),
      KOKKOS_LAMBDA(const int64_t i, double& acc) { acc += row_loss(i); },
      Kokkos::subview(scalars_, 0));
  double outside = 0.0;
  if (kind_ == LossKind::binary_cross_entropy) {
    auto bad = row_stats_;
    reduce_into(
        MESHTRAIN_LABEL("meshtrain::binary_cross_entropy_bad_targets"), device_range(0, valid),
        KOKKOS_LAMBDA(const int64_t i, double& acc) { acc += bad(i, 0); },
        Kokkos::subview(scalars_, 1));
  }
  note_host_read("the loss (Loss::regression)");
  copy_view(scalars_host_, scalars_);
  const double sum = scalars_host_(0);
  if (kind_ == LossKind::binary_cross_entropy) outside = scalars_host_(1);
  // A split loss sums its columns (and their bad targets) over the feature axis; the rows
  // count on feature rank 0.
  return finish(split_ ? sum : share(sum), split_ ? outside : share(outside),
                share(static_cast<double>(valid)));
}

}  // namespace meshtrain
