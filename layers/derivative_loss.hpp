#pragma once
// The derivative term of Sobolev training (docs/derivatives.md, "Training on derivatives"):
// with the model's Jacobian in the user's units, dy_pred[r, o, d] = d y[r, o] / d x[r, i_d]
// (normalization included: target_std_o J'[o, i_d] / input_std_i_d, J' the normalized model's
// Jacobian) for the chosen input columns i_0 .. i_{k-1},
//
//   loss = weight * mean over (global rows, outputs, k) of (dy_pred - dy_target)^2
//
// and its gradient w.r.t. the output tangents of Mlp::forward_tangents(seeds()), for
// Mlp::backward_with_tangents. seeds() are the k input directions e_{i_d} / input_std_{i_d} per
// row, so the output tangents are dy_pred / target_std_o (the normalized outputs' units).
// The tangents may be replicated over the feature axis or split over it (column block t on
// feature rank t), as Loss's outputs; the sum is reduced in double over the batch axes and the
// feature axis once per call (a replicated sum counted on feature rank 0).

#include <cstdint>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"

namespace meshtrain {

struct DerivativeLossSettings {
  std::vector<int64_t> inputs;     // the chosen input columns, in order (k of them, distinct)
  double weight = 1.0;             // lambda (model.derivative_loss_weight), >= 0
  std::vector<double> input_std;   // per input column (all inputs); empty: every 1
  std::vector<double> target_std;  // per output; empty: every 1
};

struct DerivativeLossResult {
  double mse = 0.0;   // mean over (global rows, outputs, k) of (dy_pred - dy_target)^2
  double loss = 0.0;  // weight * mse: what joins the training loss
};

class DerivativeLoss {
 public:
  // rows: local batch rows; inputs, outputs: the model's global widths; layout: how its outputs
  // (and their tangents) arrive (Mlp::output_layout()). Throws bad_input for a chosen column
  // outside [0, inputs) or repeated, no column, a negative weight, or stds of the wrong count or
  // not positive. Collective (communicators).
  DerivativeLoss(const DerivativeLossSettings& settings, ParallelContext& context, int64_t rows,
                 int64_t inputs, int64_t outputs, FeatureLayout layout);

  int64_t directions() const { return directions_; }  // k
  // [rows * k, inputs]: row r * k + d is e_{i_d} / input_std_{i_d} (Mlp::forward_tangents).
  MatrixView seeds() const { return seeds_; }
  // tangents: Mlp::forward_tangents(seeds()) [rows * k, local output width]; targets: this
  // rank's rows [rows, outputs * k], row r holding dy_target[r, o, d] at column o * k + d (the
  // HDF5 dataset [rows, outputs, k] row-major). When with_gradient, gradient() holds dLoss /
  // dTangents afterwards (already divided by the global count). Collective; allocates nothing.
  DerivativeLossResult evaluate(MatrixView tangents, MatrixView targets, bool with_gradient = true);
  MatrixView gradient() const { return gradient_; }
  double weight() const { return weight_; }

 private:
  int64_t rows_, outputs_, directions_;
  int64_t local_width_ = 0, offset_ = 0;
  bool split_ = false;
  int feature_index_ = 0;
  double weight_ = 1.0;
  int64_t global_rows_ = 0;
  Communicator* scalar_comm_ = nullptr;  // batch axes + feature axis
  Matrix seeds_;                         // [rows * k, inputs]
  Vector target_std_;                    // [outputs]
  Matrix gradient_;                      // [rows * k, local width]
  Kokkos::View<double*, Kokkos::LayoutRight> sum_;
  Kokkos::View<double*, Kokkos::LayoutRight>::HostMirror sum_host_;
};

}  // namespace meshtrain
