#pragma once
// DP gradient buckets ([runtime] overlap, bucket size [runtime] bucket_mb), as PyTorch DDP
// does them: the gradients whose only communication is one all-reduce over the batch axes
// (the layers GradientReductionPlan defers, DP storage) are laid out in the order backward
// produces them (last layer first; each layer's in its order: weight, then bias) and cut
// into buckets of at most bucket_mb MiB over one communicator each (a tensor larger than
// that is split over several buckets, so every all-reduce count fits an int). Backward calls
// layer_ready(k) once layer k's gradients are computed: each bucket that completes is packed into
// its buffer and its all-reduce started, while backward goes on to the layers below. wait_all()
// completes every started bucket and copies the sums back into the gradients, before they are used.
//
// The layout depends on the model alone, and every rank runs backward over the layers in
// the same order, so every rank starts the same all-reduces in the same order. A bucket of
// one piece is all-reduced in place in the gradient; a bucket of several owns a contiguous
// buffer, allocated here at construction: nothing is allocated in the training step. The
// sums are elementwise, so they equal the per-tensor all-reduce of the same gradients
// (bit for bit with Open MPI, as tests/layers/mlp_test.cpp checks).
//
// Ownership: the buckets borrow the gradient buffers and the communicators (both owned by
// the model and its MeshCommunicators, which outlive them).

#include <cstddef>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/core/views.hpp"

namespace meshtrain {

// One layer's gradients as the buckets see them, in the order the layer holds them; group
// nullptr: the layer reduces its own gradients (FSDP, TP bias) and takes no part
// (GradientReductionPlan::bucket_gradients, layers/gradient_reduction.hpp, decides).
struct LayerGradients {
  std::vector<VectorView> gradients;
  Communicator* group = nullptr;
};

class GradientBuckets {
 public:
  GradientBuckets() = default;
  // layers: in the model's order (layer k at index k: LayerPass::index). bucket_mb: the size cap in
  // MiB (> 0). wire: what the sums move and add in (the reduce dtype of mixed precision).
  GradientBuckets(const std::vector<LayerGradients>& layers, double bucket_mb,
                  Dtype wire = Dtype::fp32);
  GradientBuckets(GradientBuckets&&) = default;
  GradientBuckets& operator=(GradientBuckets&&) = default;

  bool empty() const { return buckets_.empty(); }
  std::size_t size() const { return buckets_.size(); }
  // What the sums move and add in: every bucketed gradient is packed to it (rounded, when it
  // is a 16-bit format) before it is read again.
  Dtype wire() const { return wire_; }
  // Floats in each bucket, in the order they start.
  std::vector<std::size_t> bucket_floats() const;
  // Bytes of the contiguous buffers the buckets own (those of several pieces).
  std::size_t buffer_bytes() const;

  // Layer `layer`'s gradients are final: starts every bucket this completes (in order).
  void layer_ready(std::size_t layer);
  // Lets started all-reduces progress (MPI moves data only inside MPI calls).
  void poll();
  // Completes every started bucket and unpacks it into the gradients; readies the buckets
  // for the next backward. Throws when a layer of a bucket never reported ready.
  void wait_all();

 private:
  // A contiguous part of one gradient, at `at` in the bucket's buffer.
  struct Piece {
    VectorView grad;
    std::size_t at = 0;
  };
  struct Bucket {
    Communicator* group = nullptr;
    std::vector<Piece> pieces;
    std::size_t floats = 0;
    std::size_t layers = 0;     // distinct layers with a piece here
    std::size_t remaining = 0;  // of those, not yet ready in this backward
    Vector buffer;              // contiguous sum buffer (only with several pieces)
    Request request;            // a poll may have emptied it: next_start_ says what was started
  };

  std::vector<Bucket> buckets_;
  std::vector<std::vector<std::size_t>> buckets_of_layer_;  // per layer, ascending
  std::size_t next_start_ = 0;  // buckets before it are started in this backward
  Dtype wire_ = Dtype::fp32;
};

}  // namespace meshtrain
