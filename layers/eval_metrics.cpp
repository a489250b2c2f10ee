#include "layers/eval_metrics.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/view_ops.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kTopK = 5;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Per row: the label's rank among the logits (how many are larger, or equal at a lower
// index); counts rows, hits (rank 0) and top-5 hits per true class. (Free functions: nvcc's
// device lambdas cannot live in private member functions.)
void count_label_ranks(MatrixView logits, LabelView labels, int64_t valid, int64_t width,
                       const Kokkos::View<int64_t*>& counts) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::eval_class_counts"),
      Kokkos::RangePolicy<>(device_space(), 0, valid), KOKKOS_LAMBDA(const int64_t i) {
        const int64_t label = labels(i);
        if (label < 0 || label >= width) return;  // a row this rank could not read
        const float mine = logits(i, label);
        int64_t rank = 0;
        for (int64_t j = 0; j < width; ++j) {
          const float l = logits(i, j);
          rank += (l > mine || (l == mine && j < label)) ? 1 : 0;
        }
        Kokkos::atomic_add(&counts(label), int64_t{1});
        if (rank == 0) Kokkos::atomic_add(&counts(width + label), int64_t{1});
        if (rank < kTopK) Kokkos::atomic_add(&counts(2 * width + label), int64_t{1});
      });
}

// reduced[j] = the sum of target column j over the valid rows (0 where the feature rank does
// not count them), reduced[4 width] = the rows counted.
void sum_target_columns(MatrixView targets, int64_t valid, int64_t width, bool counts_here,
                        const Kokkos::View<double*>& reduced) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::eval_target_shift_sums"),
      Kokkos::RangePolicy<>(device_space(), 0, width), KOKKOS_LAMBDA(const int64_t j) {
        double sum = 0.0;
        if (counts_here) {
          for (int64_t i = 0; i < valid; ++i) sum += static_cast<double>(targets(i, j));
        }
        reduced(j) = sum;
        if (j == 0) reduced(4 * width) = counts_here ? static_cast<double>(valid) : 0.0;
      });
}

// shift[j] = the mean of column j from sum_target_columns' reduced sums.
void set_shift(const Kokkos::View<double*>& reduced, int64_t width,
               const Kokkos::View<double*>& shift) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::eval_target_shift"),
      Kokkos::RangePolicy<>(device_space(), 0, width), KOKKOS_LAMBDA(const int64_t j) {
        const double n = reduced(4 * width);
        shift(j) = n > 0 ? reduced(j) / n : 0.0;
      });
}

// One thread per output column (global column offset + local), its rows in order, so the
// sums are the same on every run: sums[j] += d^2, sums[width + j] += |d|, sums[2 width + j]
// += t - c, sums[3 width + j] += (t - c)^2 with d = y - t and c = shift[j].
void add_output_sums(MatrixView output, MatrixView targets, int64_t valid, int64_t width,
                     int64_t offset, const Kokkos::View<double*>& shift,
                     const Kokkos::View<double*>& sums) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::eval_output_sums"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(output.extent(1))),
      KOKKOS_LAMBDA(const int64_t local) {
        const int64_t j = offset + local;
        const double c = shift(j);
        double squared = 0.0, absolute = 0.0, shifted = 0.0, shifted_squared = 0.0;
        for (int64_t i = 0; i < valid; ++i) {
          const double t = static_cast<double>(targets(i, j));
          const double d = static_cast<double>(output(i, local)) - t;
          squared += d * d;
          absolute += kmath::fabs(d);
          shifted += t - c;
          shifted_squared += (t - c) * (t - c);
        }
        sums(j) += squared;
        sums(width + j) += absolute;
        sums(2 * width + j) += shifted;
        sums(3 * width + j) += shifted_squared;
      });
}

// binary_cross_entropy, one thread per output column (its rows in order, so the sums are the
// same on every run): sums[j] += log(1 + e^z) - z t, sums[width + j] += 1 where the logit's
// side (z > 0) is the target's (t >= 0.5); and the row counted in bin b of the logit,
// counts[(2 j) bins + b] for a positive target (t >= 0.5), counts[(2 j + 1) bins + b] for a
// negative one, b = floor((z + kAucLogitRange) / (2 kAucLogitRange) bins), clamped.
constexpr double kAucLogitRange = 16.0;

void add_binary_sums(MatrixView output, MatrixView targets, int64_t valid, int64_t width,
                     int64_t offset, int64_t bins, const Kokkos::View<double*>& sums,
                     const Kokkos::View<int64_t*>& counts) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::eval_binary_sums"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(output.extent(1))),
      KOKKOS_LAMBDA(const int64_t local) {
        const int64_t j = offset + local;
        double log_loss = 0.0, hits = 0.0;
        for (int64_t i = 0; i < valid; ++i) {
          const double z = static_cast<double>(output(i, local));
          const double t = static_cast<double>(targets(i, j));
          log_loss += (z > 0.0 ? z : 0.0) - z * t + kmath::log1p(kmath::exp(-kmath::fabs(z)));
          const bool positive = t >= 0.5;
          hits += ((z > 0.0) == positive) ? 1.0 : 0.0;
          double at = (z + kAucLogitRange) / (2.0 * kAucLogitRange) * static_cast<double>(bins);
          at = at < 0.0 ? 0.0
                        : (at > static_cast<double>(bins - 1) ? static_cast<double>(bins - 1) : at);
          const int64_t bin = z != z ? 0 : static_cast<int64_t>(at);
          counts((2 * j + (positive ? 0 : 1)) * bins + bin) += 1;
        }
        sums(j) += log_loss;
        sums(width + j) += hits;
      });
}

// The area under the ROC curve of one output from its binned counts: the probability that a
// positive row's logit is above a negative row's, a pair in one bin counting one half.
double binned_auc(const double* positives, const double* negatives, int64_t bins) {
  double above = 0.0, area = 0.0, total_positive = 0.0, total_negative = 0.0;
  for (int64_t b = bins - 1; b >= 0; --b) {
    area += negatives[b] * (above + 0.5 * positives[b]);
    above += positives[b];
    total_positive += positives[b];
    total_negative += negatives[b];
  }
  return total_positive > 0 && total_negative > 0 ? area / (total_positive * total_negative) : kNaN;
}

// The class counts as doubles, for the all-reduce.
void counts_to_double(const Kokkos::View<int64_t*>& counts, const Kokkos::View<double*>& out) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::eval_counts_to_double"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(counts.extent(0))),
      KOKKOS_LAMBDA(const int64_t k) { out(k) = static_cast<double>(counts(k)); });
}

}  // namespace

EvalMetrics::EvalMetrics(LossKind kind, ParallelContext& context, int64_t rows, int64_t width,
                         FeatureLayout layout)
    : kind_(kind), rows_(rows), width_(width) {
  const int tp = context.feature_parallel();
  feature_index_ = context.feature_index();
  const ParallelContext::OutputColumns columns =
      context.output_columns("evaluation", width_, layout);
  split_ = columns.split;
  local_width_ = columns.local_width;
  offset_ = columns.offset;
  // The same groups as Loss's, asked for in the same order on every rank.
  std::vector<std::string> scalar_axes = context.active(context.batch_axes());
  if (tp > 1) scalar_axes.push_back(context.feature_axis());
  if (split_) tp_comm_ = context.comm({context.feature_axis()});
  scalar_comm_ = context.comm(scalar_axes);

  if (kind_ == LossKind::cross_entropy) {
    if (split_) {
      gathered_ = Matrix("meshtrain::eval_gathered_logits", rows_, width_);
      tp_comm_->reserve_scratch(static_cast<size_t>(rows_ * width_));
    }
    class_counts_ = Kokkos::View<int64_t*>("meshtrain::eval_class_counts", 3 * width_);
    reduced_ = Kokkos::View<double*>("meshtrain::eval_reduced", 3 * width_);
  } else if (kind_ == LossKind::binary_cross_entropy) {
    auc_bins_ =
        std::clamp<int64_t>(kAucBinsTotal / std::max<int64_t>(width_, 1), kAucBinsMin, kAucBinsMax);
    output_sums_ = Kokkos::View<double*>("meshtrain::eval_output_sums", 2 * width_);
    class_counts_ = Kokkos::View<int64_t*>("meshtrain::eval_auc_counts", 2 * auc_bins_ * width_);
    reduced_ =
        Kokkos::View<double*>("meshtrain::eval_reduced", 2 * width_ + 2 * auc_bins_ * width_);
  } else {
    output_sums_ = Kokkos::View<double*>("meshtrain::eval_output_sums", 4 * width_);
    shift_ = Kokkos::View<double*>("meshtrain::eval_target_shift", width_);
    shift_host_ = Kokkos::create_mirror_view(shift_);
    reduced_ = Kokkos::View<double*>("meshtrain::eval_reduced", 4 * width_ + 1);
  }
  reduced_host_ = Kokkos::create_mirror_view(reduced_);
}

void EvalMetrics::reset() {
  loss_sum_ = 0.0;
  loss_correct_ = 0;
  loss_count_ = 0;
  batches_ = 0;
  if (class_counts_.extent(0) > 0) fill_view(class_counts_, int64_t{0});
  if (output_sums_.extent(0) > 0) fill_view(output_sums_, 0.0);
}

void EvalMetrics::add(MatrixView output, LabelView labels, MatrixView targets, int64_t valid_rows,
                      const LossResult& loss) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(output.extent(0)) == rows_ &&
                        static_cast<int64_t>(output.extent(1)) == local_width_,
                    "EvalMetrics: outputs are [", output.extent(0), ", ", output.extent(1),
                    "], expected [", rows_, ", ", local_width_, "]");
  const int64_t valid = valid_rows < 0 ? rows_ : std::min(valid_rows, rows_);
  // The order evaluate() always added them in: the test loss does not change by a bit.
  loss_sum_ += loss.loss_sum;
  loss_correct_ += loss.correct;
  loss_count_ += loss.count;
  if (kind_ == LossKind::cross_entropy) {
    add_classification(output, labels, valid);
  } else if (kind_ == LossKind::binary_cross_entropy) {
    add_binary(output, targets, valid);
  } else {
    add_regression(output, targets, valid);
  }
  ++batches_;
}

void EvalMetrics::add_classification(MatrixView output, LabelView labels, int64_t valid) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(labels.extent(0)) >= rows_,
                    "EvalMetrics: ", labels.extent(0), " labels for ", rows_, " rows");
  MatrixView logits = output;
  if (split_) {
    tp_comm_->all_gather(ConstMatrixView(output), MatrixView(gathered_), 1);
    logits = MatrixView(gathered_);
  }
  // Every feature rank now holds the same whole rows: feature rank 0 counts them.
  if (feature_index_ != 0) return;
  count_label_ranks(logits, labels, valid, width_, class_counts_);
}

// The targets' shift c: the mean of the first batch's targets over every rank's rows, so that
// the sums of (t - c)^2 do not cancel for targets far from 0.
void EvalMetrics::agree_on_shift(MatrixView targets, int64_t valid) {
  fill_view(reduced_, 0.0);
  sum_target_columns(targets, valid, width_, feature_index_ == 0, reduced_);
  if (scalar_comm_) scalar_comm_->all_reduce(DoubleVectorView(reduced_.data(), reduced_.extent(0)));
  set_shift(reduced_, width_, shift_);
}

void EvalMetrics::add_regression(MatrixView output, MatrixView targets, int64_t valid) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(targets.extent(0)) >= rows_ &&
                        static_cast<int64_t>(targets.extent(1)) == width_,
                    "EvalMetrics: targets are [", targets.extent(0), ", ", targets.extent(1),
                    "], expected [", rows_, ", ", width_, "]");
  if (batches_ == 0) agree_on_shift(targets, valid);
  // Split outputs: each feature rank sums its own columns; replicated ones: feature rank 0.
  if (!split_ && feature_index_ != 0) return;
  add_output_sums(output, targets, valid, width_, offset_, shift_, output_sums_);
}

void EvalMetrics::add_binary(MatrixView output, MatrixView targets, int64_t valid) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(targets.extent(0)) >= rows_ &&
                        static_cast<int64_t>(targets.extent(1)) == width_,
                    "EvalMetrics: targets are [", targets.extent(0), ", ", targets.extent(1),
                    "], expected [", rows_, ", ", width_, "]");
  // Split outputs: each feature rank counts its own columns; replicated ones: feature rank 0.
  if (!split_ && feature_index_ != 0) return;
  add_binary_sums(output, targets, valid, width_, offset_, auc_bins_, output_sums_, class_counts_);
}

void EvalMetrics::finish_binary(EvalEvent& event) {
  const int64_t width = width_, bins = auc_bins_, n = loss_count_;
  copy_view(Kokkos::subview(reduced_, Kokkos::make_pair(int64_t{0}, 2 * width)), output_sums_);
  counts_to_double(
      class_counts_,
      Kokkos::subview(reduced_, Kokkos::make_pair(2 * width, 2 * width + 2 * bins * width)));
  if (scalar_comm_) scalar_comm_->all_reduce(DoubleVectorView(reduced_.data(), reduced_.extent(0)));
  copy_view(reduced_host_, reduced_);
  const auto& r = reduced_host_;
  const double* counts = reduced_host_.data() + 2 * width;
  double log_loss_all = 0.0, hits_all = 0.0, auc_sum = 0.0;
  int64_t auc_outputs = 0;
  for (int64_t j = 0; j < width; ++j) {
    const double auc = binned_auc(counts + 2 * j * bins, counts + (2 * j + 1) * bins, bins);
    event.test_log_loss_per_output.push_back(n ? r(j) / static_cast<double>(n) : kNaN);
    event.test_auc_per_output.push_back(auc);
    log_loss_all += r(j);
    hits_all += r(width + j);
    if (!std::isnan(auc)) {
      auc_sum += auc;
      ++auc_outputs;
    }
  }
  const double elements = static_cast<double>(n) * static_cast<double>(width);
  event.test_log_loss = n ? log_loss_all / elements : kNaN;
  event.test_accuracy = n ? hits_all / elements : kNaN;
  event.test_auc = auc_outputs ? auc_sum / static_cast<double>(auc_outputs) : kNaN;
}

void EvalMetrics::finish(EvalEvent& event, const Normalization* normalization) {
  const bool classification = kind_ == LossKind::cross_entropy;
  const int64_t width = width_;
  event.test_auc = event.test_log_loss = kNaN;
  event.test_auc_per_output.clear();
  event.test_log_loss_per_output.clear();
  if (kind_ == LossKind::binary_cross_entropy) {
    const int64_t n = loss_count_;
    event.test_rows = n;
    event.test_loss = n ? loss_sum_ / static_cast<double>(n) : kNaN;
    event.test_top5_accuracy = event.test_mse = event.test_mae = event.test_r2 = event.test_rel_l2 =
        kNaN;
    event.test_class_accuracy.clear();
    event.test_class_rows.clear();
    event.test_mse_per_output.clear();
    event.test_mae_per_output.clear();
    event.test_r2_per_output.clear();
    event.test_rel_l2_per_output.clear();
    finish_binary(event);
    return;
  }
  if (classification) {
    counts_to_double(class_counts_, reduced_);
  } else {
    copy_view(Kokkos::subview(reduced_, Kokkos::make_pair(int64_t{0}, 4 * width)), output_sums_);
    fill_view(Kokkos::subview(reduced_, 4 * width), 0.0);
  }
  if (scalar_comm_) scalar_comm_->all_reduce(DoubleVectorView(reduced_.data(), reduced_.extent(0)));
  copy_view(reduced_host_, reduced_);
  const auto& r = reduced_host_;

  const int64_t n = loss_count_;
  event.test_rows = n;
  event.test_loss = n ? loss_sum_ / static_cast<double>(n) : kNaN;
  event.test_accuracy =
      classification && n ? static_cast<double>(loss_correct_) / static_cast<double>(n) : kNaN;
  event.test_top5_accuracy = kNaN;
  event.test_class_accuracy.clear();
  event.test_class_rows.clear();
  event.test_mse = event.test_mae = event.test_r2 = event.test_rel_l2 = kNaN;
  event.test_mse_per_output.clear();
  event.test_mae_per_output.clear();
  event.test_r2_per_output.clear();
  event.test_rel_l2_per_output.clear();
  if (classification) {
    int64_t top5 = 0;
    for (int64_t c = 0; c < width; ++c) {
      const int64_t rows = std::llround(r(c));
      const int64_t hits = std::llround(r(width + c));
      top5 += std::llround(r(2 * width + c));
      event.test_class_rows.push_back(rows);
      event.test_class_accuracy.push_back(rows ? static_cast<double>(hits) / rows : kNaN);
    }
    if (width > kTopK && n) event.test_top5_accuracy = static_cast<double>(top5) / n;
    return;
  }
  const bool denormalize = normalization && normalization->targets();
  if (denormalize) {
    MESHTRAIN_REQUIRE(static_cast<int64_t>(normalization->target_std.size()) == width,
                      "EvalMetrics: ", normalization->target_std.size(), " target statistics for ",
                      width, " outputs");
  }
  copy_view(shift_host_, shift_);
  double squared_all = 0.0, absolute_all = 0.0, r2_all = 0.0, target_squared_all = 0.0;
  for (int64_t j = 0; j < width; ++j) {
    const double scale = denormalize ? normalization->target_std[j] : 1.0;
    const double mean = denormalize ? normalization->target_mean[j] : 0.0;
    const double squared = r(j) * scale * scale;
    const double absolute = r(width + j) * scale;
    const double shifted = r(2 * width + j), shifted_squared = r(3 * width + j);
    const double total = n ? shifted_squared - shifted * shifted / static_cast<double>(n) : 0.0;
    const double r2 = total > 0 ? 1.0 - r(j) / total : kNaN;  // scale-free: normalized units
    event.test_mse_per_output.push_back(n ? squared / n : kNaN);
    event.test_mae_per_output.push_back(n ? absolute / n : kNaN);
    event.test_r2_per_output.push_back(r2);
    // sum t^2 in the user's units: t = u + a with u = scale (t' - c), a = scale c + mean.
    const double a = scale * shift_host_(j) + mean;
    const double target_squared = scale * scale * shifted_squared + 2.0 * a * scale * shifted +
                                  static_cast<double>(n) * a * a;
    event.test_rel_l2_per_output.push_back(
        n && target_squared > 0 ? std::sqrt(squared / target_squared) : kNaN);
    target_squared_all += target_squared;
    squared_all += squared;
    absolute_all += absolute;
    r2_all += r2;
  }
  const double elements = static_cast<double>(n) * static_cast<double>(width);
  event.test_mse = n ? squared_all / elements : kNaN;
  event.test_mae = n ? absolute_all / elements : kNaN;
  event.test_r2 = r2_all / static_cast<double>(width);
  event.test_rel_l2 =
      n && target_squared_all > 0 ? std::sqrt(squared_all / target_squared_all) : kNaN;
}

}  // namespace meshtrain
