#pragma once
// The metrics of an evaluation, made in one place for the training run's evaluations and
// `meshtrain evaluate` (docs/running.md, "What the output means"): batch by batch over the
// model's outputs, sharded like training, then combined over the ranks once.
//
//   loss          the Loss's own sums per batch (LossResult), added in batch order: the
//                 training loss's reduction (cross_entropy: mean over rows of logsumexp -
//                 label logit; mse, huber, mae: mean over rows of the (weighted) sum over
//                 outputs of the error terms, e.g. (y - t)^2), in
//                 the units the model was trained in.
//   classification: accuracy (the Loss's argmax hits), top-5 accuracy (more than 5
//                 classes), per-class accuracy. A row's label rank is the number of classes
//                 whose logit is larger, or equal at a lower index (argmax's tie rule): a hit
//                 is rank 0, a top-5 hit rank < 5. Logits split over the feature axis are
//                 gathered into whole rows first (an all-gather over that axis per batch).
//                 Counts are int64, added with integer atomics: exact in any order.
//   regression:   per output j, float64 sums over the rows of d = y' - t' (the outputs and
//                 targets as the model sees them): d^2, |d|, and of the target shifted by
//                 c_j (the mean of the first batch's targets, the same on every rank), (t' -
//                 c_j) and (t' - c_j)^2; each column summed in row order. With normalized
//                 targets (y = y' * std + mean) the finish scales them to the user's units:
//                 MSE_j = std_j^2 sum d^2 / n, MAE_j = std_j sum |d| / n; R^2 = 1 - SSE/SST
//                 does not change under that affine map (SST = sum (t' - c)^2 - (sum (t' -
//                 c))^2 / n, about the evaluated targets' mean).
//   binary_cross_entropy: per output, the log loss (mean over rows of log(1 + e^z) - z t,
//                 unweighted), the accuracy (the logit's side, z > 0, against t >= 0.5, over
//                 every row and output) and the area under the ROC curve (AUC: the probability
//                 that a positive row's logit is above a negative row's, t >= 0.5 positive),
//                 from counts of the rows in bins of the logit over [-16, 16] (below and above
//                 counted in the end bins): pairs in one bin count one half, so the AUC is
//                 within half the share of such pairs of the exact one (2^20 / outputs bins,
//                 256 to 16,384: at most 1/16,384 of the range for one output, about 0.002 of
//                 a logit). The counts are exact in any order, so the AUC is the same bits on
//                 every mesh. Overall: the log loss and accuracy over every row and output,
//                 the AUC the mean of the outputs' (those with both kinds of rows).
// Each rank keeps its rows' sums; finish() all-reduces them in float64 over the batch axes
// and the feature axis (one call; every rank gets the same bits), counting a value every
// feature rank holds on feature rank 0 only, as Loss does.
//
// Everything is allocated at construction: add() and finish() allocate nothing on the device
// (finish() fills the event's vectors on the host).

#include <cstdint>

#include "framework/core/choices.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "framework/io/metrics.hpp"
#include "framework/io/normalization.hpp"
#include "layers/context.hpp"
#include "layers/loss.hpp"

namespace meshtrain {

class EvalMetrics {
 public:
  // rows: this rank's rows of an evaluation batch; width: the model's outputs (classes or
  // targets); layout: how the outputs arrive (Mlp::output_layout()). Collective
  // (communicators are asked for, as Loss does).
  EvalMetrics(LossKind kind, ParallelContext& context, int64_t rows, int64_t width,
              FeatureLayout layout);

  // Starts an evaluation: forgets the batches added so far.
  void reset();
  // One batch: this rank's outputs [rows, local width], its labels [rows] (cross_entropy) or
  // targets [rows, width] (regression; every column, as Loss takes them); rows at or after
  // `valid_rows` are padding. `loss`: what Loss returned for this batch (global sums).
  // Collective: with split logits an all-gather over the feature axis; the first regression
  // batch after reset() agrees on the targets' shift (one all-reduce). Labels outside
  // [0, width) (rows this rank could not read) are not counted.
  void add(MatrixView output, LabelView labels, MatrixView targets, int64_t valid_rows,
           const LossResult& loss);
  // The metrics of the batches since reset(), combined over the ranks (collective), written
  // into `event` (step untouched). `normalization`: when it has target statistics, the
  // regression metrics are returned to the user's units (see above); nullptr: none.
  void finish(EvalEvent& event, const Normalization* normalization = nullptr);

  LossKind kind() const { return kind_; }
  // The loss sum of the batches since reset(): NaN when a rank could not read its rows (a
  // poisoned Loss reduction), even where no row was counted.
  double loss_sum() const { return loss_sum_; }

 private:
  void add_classification(MatrixView output, LabelView labels, int64_t valid);
  void add_regression(MatrixView output, MatrixView targets, int64_t valid);
  void add_binary(MatrixView output, MatrixView targets, int64_t valid);
  void finish_binary(EvalEvent& event);
  void agree_on_shift(MatrixView targets, int64_t valid);

  LossKind kind_;
  int64_t rows_, width_, local_width_, offset_ = 0;
  bool split_ = false;
  int feature_index_ = 0;
  Communicator* tp_comm_ = nullptr;      // the feature axis, when the outputs are split
  Communicator* scalar_comm_ = nullptr;  // batch axes + feature axis (nullptr: one rank)

  // Host sums of the Loss's results, in batch order (exactly what evaluate() added before).
  double loss_sum_ = 0.0;
  int64_t loss_correct_ = 0, loss_count_ = 0;
  int64_t batches_ = 0;

  // Classification: whole rows of logits (split outputs), and int64 counts [3 * width]:
  // rows of class c, hits of class c, top-5 hits of class c. binary_cross_entropy: the
  // counts are [2 * auc_bins_ * width], positive then negative rows per bin of each output,
  // and output_sums_ [2 * width] the log loss and hits per output.
  static constexpr int64_t kAucBinsTotal = int64_t{1} << 20, kAucBinsMin = 256, kAucBinsMax = 16384;
  int64_t auc_bins_ = 0;
  Matrix gathered_;
  Kokkos::View<int64_t*> class_counts_;
  // Regression: float64 sums [4 * width] (d^2, |d|, t - c, (t - c)^2 per output) and the
  // shift c [width].
  Kokkos::View<double*> output_sums_;
  Kokkos::View<double*> shift_;
  Kokkos::View<double*>::HostMirror shift_host_;  // finish() reads the shift (relative L2)
  // What finish() and the shift all-reduce: [3 * width] counts or [4 * width] sums, as
  // doubles (counts below 2^53 are exact).
  Kokkos::View<double*> reduced_;
  Kokkos::View<double*>::HostMirror reduced_host_;
};

}  // namespace meshtrain
