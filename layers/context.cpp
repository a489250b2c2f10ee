#include "layers/context.hpp"

#include <algorithm>

#include "base/error.hpp"

namespace meshtrain {

ParallelContext::ParallelContext(MeshCommunicators& comms, std::vector<std::string> batch_axes,
                                 std::string feature_axis, CollectiveMatmulAlgorithm matmul,
                                 bool overlap, double bucket_mb)
    : comms_(&comms),
      batch_axes_(std::move(batch_axes)),
      feature_axis_(std::move(feature_axis)),
      matmul_(matmul),
      overlap_(overlap),
      bucket_mb_(bucket_mb) {
  const LayerAxes axes = layer_axes_on(mesh(), {batch_axes_, feature_axis_});
  batch_axes_ = axes.batch;
  feature_axis_ = axes.feature;
}

ParallelContext ParallelContext::from_logical_axes(MeshCommunicators& comms,
                                                   const LogicalAxes& logical,
                                                   CollectiveMatmulAlgorithm matmul, bool overlap,
                                                   double bucket_mb) {
  LayerAxes axes = layer_axes(logical);
  return ParallelContext(comms, std::move(axes.batch), std::move(axes.feature), matmul, overlap,
                         bucket_mb);
}

int ParallelContext::feature_parallel() const {
  return feature_axis_.empty() ? 1 : mesh().axis_size(feature_axis_);
}

int ParallelContext::feature_index() const {
  return feature_axis_.empty() ? 0 : mesh().coordinate(rank(), feature_axis_);
}

int ParallelContext::batch_parallel() const {
  return mesh().size_of(batch_axes_);
}

int ParallelContext::batch_index() const {
  return batch_axes_.empty() ? 0 : mesh().group_index(rank(), batch_axes_);
}

ParallelContext::OutputColumns ParallelContext::output_columns(const char* who, int64_t width,
                                                               FeatureLayout layout) const {
  const int tp = feature_parallel();
  OutputColumns columns;
  columns.split = tp > 1 && layout == FeatureLayout::split;
  if (columns.split && width % tp != 0) {
    MESHTRAIN_BAD_INPUT("the ", who, " cannot split ", width, " outputs over mesh axis '",
                        feature_axis(), "' of size ", tp);
  }
  columns.local_width = columns.split ? width / tp : width;
  columns.offset = columns.split ? feature_index() * columns.local_width : 0;
  return columns;
}

std::vector<std::string> ParallelContext::active(const std::vector<std::string>& axes) const {
  return mesh().active_axes(axes);
}

Communicator* ParallelContext::comm(const std::vector<std::string>& axes) {
  const std::vector<std::string> used = active(axes);
  if (used.empty()) return nullptr;
  return &comms_->get(used);
}

}  // namespace meshtrain
