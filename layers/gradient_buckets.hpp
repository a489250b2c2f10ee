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
// With a 16-bit wire (the reduce dtype bf16 or fp16) the buckets own one 16-bit buffer for all
// their gradients instead, laid out in bucket order (each bucket a contiguous range of it, so each
// gradient's pieces follow each other): the all-reduces sum its ranges in place as 16 bits
// (Communicator::start_all_reduce_16bit), and wait_all() widens the sums into the fp32 gradients.
// A layer whose weight-gradient GEMM writes 16 bits (gemm_to_16bit: the compute dtype is the
// wire's) writes that gradient straight into its place there (wire_home) and says so to
// layer_ready, so that its fp32 gradient is neither written in backward nor packed; the others
// are packed (rounded to nearest even, the same bits) at layer_ready. No fp32 bucket buffer, no
// wire slot per bucket.
//
// Ownership: the buckets borrow the gradient buffers and the communicators (both owned by
// the model and its MeshCommunicators, which outlive them).

#include <cstddef>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/core/precision.hpp"
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
  // Bytes of the buffers the buckets own: the fp32 ones of several pieces, the 16-bit wire.
  std::size_t buffer_bytes() const;

  // With a 16-bit wire, where gradient `index` of layer `layer` (LayerGradients order), which is
  // `gradient` [elements], lives as wire() bits until wait_all(), contiguous. Null with an fp32
  // wire, or where that gradient is not `gradient` (a layer outside the buckets).
  uint16_t* wire_home(std::size_t layer, std::size_t index, const float* gradient,
                      std::size_t elements) const;
  // From now on gradient `index` of layer `layer` lives in the 16-bit buffer only (a gradient
  // stored as 16 bits, Mlp::store_gradients_16bit, whose fp32 buffer is gone): its layer must
  // write it there (written_16bit, through wire_home(layer, index, nullptr, elements)), and
  // wait_all() leaves the sum there. Returns where it lives (elements of it). 16-bit wire only;
  // at construction, not in a step.
  uint16_t* keep_in_wire(std::size_t layer, std::size_t index);
  // Layer `layer`'s gradients are final: starts every bucket this completes (in order). Bit i of
  // written_16bit set: the layer wrote gradient i's values rounded to wire() into wire_home
  // itself (its fp32 gradient is stale until wait_all()); the others are packed here. The mask
  // has 32 bits: a layer's gradients from index 32 on are always packed (it cannot mark them).
  void layer_ready(std::size_t layer, unsigned written_16bit = 0);
  // How many gradients layers have reported written as 16 bits (written_16bit's bits) since the
  // buckets were made: what tests check to know the layers took that path.
  std::size_t gradients_written_16bit() const { return gradients_written_16bit_; }
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
    Vector buffer;              // contiguous sum buffer (only with several pieces, fp32 wire)
    std::size_t start = 0;      // where its range of wire16_ begins (16-bit wire)
    Request request;            // a poll may have emptied it: next_start_ says what was started
  };

  std::vector<Bucket> buckets_;
  std::vector<std::vector<std::size_t>> buckets_of_layer_;  // per layer, ascending
  // Per layer, its gradients and where each begins in wire16_ (16-bit wire).
  struct Home {
    VectorView grad;
    std::size_t at = 0;
  };
  std::vector<std::vector<Home>> homes_of_layer_;
  HalfBits wire16_;             // every bucket's 16-bit range, in bucket order (16-bit wire only)
  std::size_t next_start_ = 0;  // buckets before it are started in this backward
  std::size_t gradients_written_16bit_ = 0;
  Dtype wire_ = Dtype::fp32;
};

}  // namespace meshtrain
