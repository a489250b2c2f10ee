#include "layers/whole_output_rows.hpp"

#include "base/error.hpp"

namespace meshtrain {

WholeOutputRows::WholeOutputRows(ParallelContext& context, int64_t rows, int64_t width,
                                 FeatureLayout layout)
    : rows_(rows), width_(width), local_width_(width) {
  const int tp = context.feature_parallel();
  if (tp <= 1 || layout != FeatureLayout::split) return;
  if (width % tp != 0) {
    MESHTRAIN_BAD_INPUT("cannot gather ", width, " outputs split over mesh axis '",
                        context.feature_axis(), "' of size ", tp, ": it does not divide them");
  }
  local_width_ = width / tp;
  comm_ = context.comm({context.feature_axis()});
  whole_ = Matrix("meshtrain::whole_output_rows", rows, width);
  comm_->reserve_scratch(static_cast<size_t>(rows * width));
}

MatrixView WholeOutputRows::gather(MatrixView output) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(output.extent(0)) == rows_ &&
                        static_cast<int64_t>(output.extent(1)) == local_width_,
                    "WholeOutputRows::gather: output [", output.extent(0), ", ", output.extent(1),
                    "], expected [", rows_, ", ", local_width_, "]");
  if (!comm_) return output;
  comm_->all_gather(ConstMatrixView(output), MatrixView(whole_), 1);
  return whole_;
}

}  // namespace meshtrain
