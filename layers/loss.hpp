#pragma once
// Losses over the model output (logits), a mean over the GLOBAL batch, with the gradient
// w.r.t. the local logits (already divided by the global batch, so layer gradients summed
// over the batch ranks equal the single-rank ones).
//
//   cross_entropy  softmax cross-entropy with integer labels: mean over rows of
//                  logsumexp(l) - l[label]; also counts argmax hits (accuracy).
//   mse            as the reference notebook: mean over rows of the sum over outputs of
//                  (y - t)^2; gradient 2 (y - t) / N.
//   huber          mean over rows of the sum over outputs of 0.5 d^2 where |d| <= delta, else
//                  delta (|d| - 0.5 delta), d = y - t; gradient clamp(d, -delta, delta) / N.
//   mae            mean over rows of the sum over outputs of |d|; gradient sign(d) / N with
//                  sign(0) = 0 (PyTorch's L1 subgradient).
//   binary_cross_entropy  PyTorch's BCEWithLogitsLoss (reduction mean over rows, summed over
//                  outputs): log(1 + e^z) - z t per output, computed as max(z, 0) - z t +
//                  log1p(e^-|z|); gradient (sigmoid(z) - t) / N. Targets belong in [0, 1]:
//                  LossResult::targets_outside counts those outside (NaN included) over the
//                  batch.
// The regression losses multiply output j's term (and its gradient) by weights[j] when
// weights are given (model.loss_weights); without them the kernels are the unweighted ones,
// so an mse without weights rounds exactly as before weights existed.
// The logits may be replicated over the feature axis or split over it (column block t on
// feature rank t): a split softmax finds the row maximum with an all-gather over the
// feature axis and sums exp / label logit / argmax hit with one all-reduce over it.
// The scalars (loss sum, hits, rows) are then all-reduced in double over the batch axes
// and the feature axis, once per call (feature rank 0 counts a sum every feature rank
// holds; a split mse sums its columns over the feature axis).
//
// Labels and targets are given for this rank's rows with all columns (targets [rows,
// width]); a split loss reads its own columns. Rows at or after `valid_rows` are padding
// (evaluation): they add nothing, and the mean divides by the global count of valid rows.
// The gradient assumes every row is valid (training).

#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/choices.hpp"  // LossKind, its names
#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"

namespace meshtrain {

struct LossResult {
  double loss = 0.0;            // mean over the valid rows of the global batch
  double loss_sum = 0.0;        // sum over the valid rows of the global batch
  int64_t correct = 0;          // cross_entropy: rows whose argmax is the label (global)
  int64_t targets_outside = 0;  // binary_cross_entropy: targets outside [0, 1] (global)
  int64_t count = 0;            // valid rows (global)
};

using LabelView = Kokkos::View<const int32_t*>;

// The settings of the losses with float targets (model.huber_delta, model.loss_weights).
struct LossOptions {
  double huber_delta = 1.0;     // huber only; > 0
  std::vector<double> weights;  // one per output, finite, >= 0; empty: every output 1
};

class Loss {
 public:
  // rows: local batch rows; width: global number of outputs; layout/offset: how the logits
  // arrive (Mlp::output_layout(), Mlp::output_offset()). Collective (communicators).
  Loss(LossKind kind, ParallelContext& context, int64_t rows, int64_t width, FeatureLayout layout,
       const LossOptions& options = {});

  // Loss of the local logits [rows, local width]; when with_gradient, gradient() holds
  // dLoss/dLogits afterwards. Labels: [rows] in [0, width) (cross_entropy only).
  LossResult cross_entropy(MatrixView logits, LabelView labels, bool with_gradient = true,
                           int64_t valid_rows = -1);
  // cross_entropy in two parts (a training step captured as a CUDA graph, run/training_run.cpp):
  // the kernels (and a split loss's collectives), which leave the sums in device scalars and
  // read nothing on the host, then the read-back and reduction over the ranks. The same result.
  void cross_entropy_kernels(MatrixView logits, LabelView labels, bool with_gradient = true,
                             int64_t valid_rows = -1);
  LossResult cross_entropy_result(int64_t valid_rows = -1);
  // A loss with float targets (mse, huber, mae, binary_cross_entropy) of the local outputs.
  // Targets: [rows, width].
  LossResult regression(MatrixView logits, MatrixView targets, bool with_gradient = true,
                        int64_t valid_rows = -1);

  // This rank could not load its rows (a bad file): the next call's reduced loss sum is NaN
  // on every rank it is reduced over (the batch axes and the feature axis), so they all stop
  // at the same step and can agree on why (TrainingRun). Costs no extra collective.
  void poison_next_reduction() { poisoned_ = true; }

  MatrixView gradient() const { return gradient_; }
  LossKind kind() const { return kind_; }
  int64_t local_width() const { return local_width_; }

 private:
  // Reduces the three scalars; `local_counted` is what the kind counts (argmax hits or targets
  // outside [0, 1]) and lands in the LossResult field of that meaning.
  LossResult finish(double local_sum, double local_counted, double local_count);

  LossKind kind_;
  int64_t rows_, width_, local_width_, offset_ = 0;
  int64_t global_rows_ = 0;
  float huber_delta_ = 1.0f;
  Vector weights_;  // [width] (every column; a split loss reads its own); empty: unweighted
  bool split_ = false;
  bool poisoned_ = false;
  // A scalar every feature rank computes whole counts on feature rank 0 only (not x * 0:
  // an infinite loss stays infinite, not NaN). A poisoned sum is NaN whatever this gives.
  double share(double x) const { return feature_index_ == 0 ? x : 0.0; }

  int tp_ = 1, tp_index_ = 0;
  int feature_index_ = 0;  // this rank's index on the feature axis (split or not)
  Communicator* tp_comm_ = nullptr;
  Communicator* scalar_comm_ = nullptr;  // batch axes + feature axis
  Matrix gradient_;                      // [rows, local width]
  Matrix row_max_local_, row_max_all_;   // [rows, 1], [rows, tp]
  Matrix row_stats_;                     // [rows, 3]: sum exp, label logit, hit
  Vector row_loss_;                      // [rows]
  // 3 doubles: loss sum, hits, rows (exact counts; the sum is not rounded to float)
  Kokkos::View<double*, Kokkos::LayoutRight> scalars_;
  Kokkos::View<double*, Kokkos::LayoutRight>::HostMirror scalars_host_;
};

}  // namespace meshtrain
