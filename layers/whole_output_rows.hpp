#pragma once
// A model's output rows with every column on every rank. The last layer may leave its
// output split over the feature axis (tensor parallelism: feature rank t holds columns
// [t * width / tp, (t + 1) * width / tp)); prediction and metrics want whole rows. gather()
// all-gathers the column blocks over the feature axis into a buffer of its own (allocated,
// with the communicator's staging, at construction: gather() allocates nothing); a
// replicated output is returned as it is.
//
//   WholeOutputRows whole(context, model.local_rows(), model.sizes().back(),
//                         model.output_layout());
//   MatrixView rows = whole.gather(model.forward(x));   // [local_rows, outputs]
//
// Collective: construction asks the context for the feature axis's communicator, and
// gather() is collective over the feature axis (every feature rank calls it, in step).

#include <cstdint>

#include "framework/core/views.hpp"
#include "layers/context.hpp"

namespace meshtrain {

class WholeOutputRows {
 public:
  // rows: the model's local rows; width: its global outputs; layout: Mlp::output_layout().
  // Throws bad_input when a split output's width does not divide over the feature axis.
  WholeOutputRows(ParallelContext& context, int64_t rows, int64_t width, FeatureLayout layout);

  // output [rows, local width] (contiguous, as Mlp::forward returns it) -> [rows, width],
  // valid until the next gather (the output itself when it is not split).
  MatrixView gather(MatrixView output);

  bool split() const { return comm_ != nullptr; }
  int64_t width() const { return width_; }

 private:
  int64_t rows_ = 0, width_ = 0, local_width_ = 0;
  Communicator* comm_ = nullptr;  // the feature axis's, when the output is split over it
  Matrix whole_;                  // [rows, width] when split
};

}  // namespace meshtrain
