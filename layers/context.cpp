#include "layers/context.hpp"

#include <algorithm>

#include "partition/error.hpp"

namespace meshtrain {

const char* to_string(FeatureLayout layout) {
  return layout == FeatureLayout::split ? "split" : "replicated";
}

ParallelContext::ParallelContext(MeshCommunicators& comms, std::vector<std::string> batch_axes,
                                 std::string feature_axis, CollectiveMatmulAlgorithm matmul)
    : comms_(&comms),
      batch_axes_(std::move(batch_axes)),
      feature_axis_(std::move(feature_axis)),
      matmul_(matmul) {
  // An axis the mesh does not have is of size 1: it splits nothing.
  std::vector<std::string> present;
  for (const auto& axis : batch_axes_) {
    if (mesh().has_axis(axis)) present.push_back(axis);
  }
  batch_axes_ = present;
  if (!feature_axis_.empty() && !mesh().has_axis(feature_axis_)) feature_axis_.clear();
  if (feature_parallel() > 1 && is_batch_axis(feature_axis_)) {
    MESHTRAIN_BAD_INPUT("mesh axis '", feature_axis_,
                        "' cannot split both the batch and the features");
  }
}

ParallelContext ParallelContext::from_logical_axes(MeshCommunicators& comms,
                                                   const LogicalAxes& logical,
                                                   CollectiveMatmulAlgorithm matmul) {
  const std::vector<std::string> hidden = logical.axes_of("hidden");
  if (hidden.size() > 1) {
    MESHTRAIN_BAD_INPUT("logical axis 'hidden' maps to ", hidden.size(),
                        " mesh axes; the MLP layers split features over at most one");
  }
  return ParallelContext(comms, logical.axes_of("batch"), hidden.empty() ? "" : hidden[0], matmul);
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

bool ParallelContext::is_batch_axis(const std::string& axis) const {
  return std::find(batch_axes_.begin(), batch_axes_.end(), axis) != batch_axes_.end();
}

std::vector<std::string> ParallelContext::active(const std::vector<std::string>& axes) const {
  std::vector<std::string> out;
  for (const auto& a : axes) {
    if (mesh().axis_size(a) > 1) out.push_back(a);
  }
  return out;
}

Communicator* ParallelContext::comm(const std::vector<std::string>& axes) {
  const std::vector<std::string> used = active(axes);
  if (used.empty()) return nullptr;
  return &comms_->get(used);
}

}  // namespace meshtrain
