#pragma once
// Physics losses (issue 40 item 2b, docs/derivatives.md "Physics losses"): a residual written in
// C++ of the model's output u, its first derivatives du/dx and its diagonal second derivatives
// d2u/dx2 at a batch of collocation points, whose squared mean joins the loss:
//
//   loss = weight * mean over (global rows, residuals) of r^2
//
// The derivatives come from the forward Laplacian (Mlp::forward_laplacian(seeds())), in the
// user's units: with normalization x' = (x - input_mean) / input_std, u = y' target_std +
// target_mean, du_o/dx_i = target_std_o dy'_o/dx_i and d2u_o/dx_i^2 = target_std_o
// d2y'_o/dx_i^2 (the seeds e_i / input_std_i carry the inputs' scale).
//
// The callback computes the residuals and their partial derivatives by u, du and d2u (the
// seeds of the exact backward); the loss chains them, (2 weight / N) sum_c r_c dr_c/d(.), down
// to the output and its streams for Mlp::backward_with_laplacian. Everything the callback reads
// and writes is whole rows (an output split over the feature axis is all-gathered first), in
// the default execution space's memory; this rank's rows only.
//
//   PhysicsLoss physics({{0, 1}, 1, 1.0, {}, {}, {}, poisson_residual}, context, rows, 2, 1,
//                       model.output_layout());
//   model.reserve_laplacian(physics.directions());
//   const MatrixView y = model.forward(x);  // x normalized, as the model takes it
//   const PhysicsLossResult p =
//       physics.evaluate(x_user, y, model.forward_laplacian(physics.seeds()));
//   model.backward_with_laplacian(physics.output_gradient(), physics.stream_gradient());

#include <cstdint>
#include <functional>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/whole_output_rows.hpp"

namespace meshtrain {

// What the residual reads: this rank's rows, whole.
struct PhysicsPoints {
  MatrixView x;    // [rows, inputs]: the points as given to evaluate (the user's units)
  MatrixView u;    // [rows, outputs]: the model's output in the user's units
  MatrixView du;   // [rows, outputs * k]: du(r, o * k + d) = d u_o / d x_{i_d}
  MatrixView d2u;  // [rows, outputs * k]: d2u(r, o * k + d) = d^2 u_o / d x_{i_d}^2
};

// What the residual writes (every entry is zero before the call; write only what is not zero).
// c: residual, o: output, d: direction.
struct PhysicsResiduals {
  MatrixView r;        // [rows, residuals]
  MatrixView dr_du;    // [rows, residuals * outputs]: at c * outputs + o
  MatrixView dr_ddu;   // [rows, residuals * outputs * k]: at (c * outputs + o) * k + d
  MatrixView dr_dd2u;  // [rows, residuals * outputs * k]: the same order
};

using PhysicsResidualFunction =
    std::function<void(const PhysicsPoints& points, const PhysicsResiduals& residuals)>;

struct PhysicsLossSettings {
  std::vector<int64_t> inputs;       // the k differentiated input columns i_d (distinct)
  int64_t residuals = 1;             // residual columns per point
  double weight = 1.0;               // >= 0
  std::vector<double> input_std;     // per input column; empty: every 1
  std::vector<double> target_mean;   // per output; empty: every 0
  std::vector<double> target_std;    // per output; empty: every 1
  PhysicsResidualFunction residual;  // required
};

struct PhysicsLossResult {
  double mean_square = 0.0;  // mean over (global rows, residuals) of r^2
  double loss = 0.0;         // weight * mean_square
};

class PhysicsLoss {
 public:
  // rows: local batch rows; inputs, outputs: the model's global widths; layout:
  // Mlp::output_layout(). Throws bad_input for a column outside [0, inputs) or repeated, no
  // column, no residual function, residuals < 1, a negative weight, or statistics of the wrong
  // count (stds not positive). Collective (communicators).
  PhysicsLoss(PhysicsLossSettings settings, ParallelContext& context, int64_t rows, int64_t inputs,
              int64_t outputs, FeatureLayout layout);

  int64_t directions() const { return directions_; }  // k
  // [rows * 2k, inputs]: per row, e_{i_d} / input_std_{i_d} for d < k, then k zero rows
  // (Mlp::forward_laplacian).
  MatrixView seeds() const { return seeds_; }
  // x: the points [>= rows, any columns] handed to the residual as they are; output: the model's
  // forward [rows, local width]; streams: Mlp::forward_laplacian(seeds()). Runs the residual,
  // and when with_gradient fills output_gradient() and stream_gradient(). Collective (one double
  // all-reduce over the batch axes, plus the gathers of a split output); allocates nothing
  // itself (the callback must not either, for an allocation-free step).
  PhysicsLossResult evaluate(MatrixView x, MatrixView output, MatrixView streams,
                             bool with_gradient = true);
  // dLoss/dOutput [rows, local width] and dLoss/dStreams [rows * 2k, local width] of the last
  // evaluate (the model's normalized units).
  MatrixView output_gradient() const { return output_gradient_; }
  MatrixView stream_gradient() const { return stream_gradient_; }
  // into = into_weight * into + output_gradient(): joins another loss's gradient of the same
  // output (a data loss weighted by into_weight).
  void add_output_gradient_to(MatrixView into, float into_weight = 1.0f) const;
  double weight() const { return weight_; }

 private:
  PhysicsResidualFunction residual_;
  int64_t rows_, inputs_, outputs_, directions_, residuals_;
  int64_t local_width_ = 0, offset_ = 0;
  double weight_ = 1.0;
  int64_t global_rows_ = 0;
  Communicator* batch_comm_ = nullptr;
  WholeOutputRows whole_values_, whole_streams_;
  Matrix seeds_;  // [rows * 2k, inputs]
  Vector target_mean_, target_std_;
  Matrix u_, du_, d2u_;                  // what the residual reads
  Matrix r_, dr_du_, dr_ddu_, dr_dd2u_;  // what it writes
  Matrix output_gradient_, stream_gradient_;
  Kokkos::View<double*, Kokkos::LayoutRight> sum_;
  Kokkos::View<double*, Kokkos::LayoutRight>::HostMirror sum_host_;
};

}  // namespace meshtrain
