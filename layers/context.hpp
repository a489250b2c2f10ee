#pragma once
// What every layer needs to know about the mesh: which mesh axes split the batch rows
// (the logical axis `batch`, default (fsdp, dp)), which one splits the features (the
// logical axis `hidden`, default tp), and the communicators of this rank's groups.
//
// `overlap` ([runtime] overlap) asks layers to start communication early and let it run
// under computation (FSDP: the next layer's weight gather while this one computes; DP: the
// gradient all-reduce in buckets of at most `bucket_mb` MiB, [runtime] bucket_mb, started
// while backward continues).
//
// `precision` ([mixed_precision], docs/mixed_precision.md) is what layers compute and
// communicate in; set it before the layers are built (they read it at construction).
//
// Layers ask for their communicators at construction only. MeshCommunicators::get is
// collective the first time a tuple is asked for, and every rank builds the same layers
// in the same order from the same specs, so the calls line up on every rank.

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/communicator.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "partition/linear_layout.hpp"  // FeatureLayout, LayerAxes
#include "partition/logical_axes.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

class ParallelContext {
 public:
  // batch_axes: mesh axes of the batch rows, major to minor; feature_axis: the mesh axis
  // of the features ("" = none). Axes the mesh lacks are dropped (they are of size 1).
  // Throws bad_input when the feature axis (size > 1) also splits the batch (layer_axes_on).
  ParallelContext(MeshCommunicators& comms, std::vector<std::string> batch_axes,
                  std::string feature_axis,
                  CollectiveMatmulAlgorithm matmul = CollectiveMatmulAlgorithm::automatic,
                  bool overlap = false, double bucket_mb = 25.0);
  // From the logical axes (layer_axes): batch = axes_of("batch"), features =
  // axes_of("hidden") (at most one mesh axis; bad_input otherwise).
  static ParallelContext from_logical_axes(
      MeshCommunicators& comms, const LogicalAxes& logical,
      CollectiveMatmulAlgorithm matmul = CollectiveMatmulAlgorithm::automatic, bool overlap = false,
      double bucket_mb = 25.0);

  const Mesh& mesh() const { return comms_->mesh(); }
  int rank() const { return comms_->rank(); }
  const std::vector<std::string>& batch_axes() const { return batch_axes_; }
  const std::string& feature_axis() const { return feature_axis_; }
  CollectiveMatmulAlgorithm matmul_algorithm() const { return matmul_; }
  bool overlap() const { return overlap_; }
  double bucket_mb() const { return bucket_mb_; }
  const MixedPrecision& precision() const { return precision_; }
  void set_precision(const MixedPrecision& precision) { precision_ = precision; }
  // Whether a plain MLP computing in 16 bits keeps its activations for backward in 16-bit
  // buffers (layers/mlp.hpp; on by default, where it applies). Off only to test that storage
  // changes no value (the simulated path: fp32 buffers holding the same 16-bit values).
  bool stores_16bit_activations() const { return store_16bit_activations_; }
  void set_store_16bit_activations(bool store) { store_16bit_activations_ = store; }
  // Whether a weight gradient whose reduction sends it as 16 bits of the compute dtype is written
  // as 16 bits by its GEMM, where gemm_to_16bit's kernel writes them (FSDP's reduce-scatter, DP's
  // blocking all-reduce: ShardedParameter::writes_16bit_gradient). On by default; off only to
  // test that it changes no value (the fp32 gradient, packed by the reduction).
  bool writes_16bit_weight_gradients() const { return write_16bit_weight_gradients_; }
  void set_write_16bit_weight_gradients(bool write) { write_16bit_weight_gradients_ = write; }

  // Size of the feature axis (1 when there is none) and this rank's index on it.
  int feature_parallel() const;
  int feature_index() const;
  // Product of the batch axes' sizes and this rank's index in that group.
  int batch_parallel() const;
  int batch_index() const;

  // How a layer's `width` output columns lie on this rank: all of them, or (split: the
  // layout is split over a feature axis of size > 1) block feature_index() of them. bad_input
  // naming `who` ("loss", "evaluation") when the width does not divide over the feature axis.
  struct OutputColumns {
    bool split = false;
    int64_t local_width = 0;
    int64_t offset = 0;  // of this rank's first column
  };
  OutputColumns output_columns(const char* who, int64_t width, FeatureLayout layout) const;

  // `axes` without those of size 1 (order kept).
  std::vector<std::string> active(const std::vector<std::string>& axes) const;
  // The communicator over active(axes), or nullptr when that is empty (nothing to do).
  Communicator* comm(const std::vector<std::string>& axes);

 private:
  MeshCommunicators* comms_;
  std::vector<std::string> batch_axes_;
  std::string feature_axis_;
  CollectiveMatmulAlgorithm matmul_;
  bool overlap_ = false;
  double bucket_mb_ = 25.0;
  MixedPrecision precision_;
  bool store_16bit_activations_ = true;
  bool write_16bit_weight_gradients_ = true;
};

}  // namespace meshtrain
