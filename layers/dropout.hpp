#pragma once
// Inverted dropout on hidden activations ([model] dropout = P, docs/model_math.md), with a
// mask that depends on the element's coordinates only, never on the mesh.
//
// In a training pass (LayerPass::training set) element (r, f) of this rank's block, global
// row R = first_row + r of the micro-batch and global feature F = offset + f, is kept iff
//   philox4x32_10(counter = {F, R, step mod 2^32, micro_batch | layer << 16},
//                 key = {seed mod 2^32, seed >> 32}).word[0] >= threshold(P),
// threshold(P) = floor(P * 2^32) (so P(kept) = 1 - threshold / 2^32, within 2^-32 of 1 - P),
// and kept elements are multiplied by scale(P) = float(1 / (1 - P)) and rounded to the
// compute dtype; dropped ones are 0. The same rows and features give the same bits on any
// mesh, world size or split of the features, and after a resume (the step comes from the run).
// Backward recomputes the mask (nothing stored): dX = mask * scale * dY, rounded alike.
// Outside training (LayerPass::training == nullptr: evaluation, predict) the layer is the
// identity and returns its input itself.

#include <cstdint>
#include <string>

#include "framework/core/philox.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "layers/layer.hpp"

namespace meshtrain {

// The parts of the key a dropout layer has (the pass's and its own), for one element.
KOKKOS_INLINE_FUNCTION uint32_t dropout_bits(uint64_t seed, int64_t step, int64_t micro_batch,
                                             int64_t row, int64_t feature, int64_t layer) {
  const Philox4x32Counter counter{
      {static_cast<uint32_t>(feature), static_cast<uint32_t>(row), static_cast<uint32_t>(step),
       static_cast<uint32_t>(micro_batch) | (static_cast<uint32_t>(layer) << 16)}};
  const Philox4x32Key key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
  return philox4x32_10(counter, key).word[0];
}

// floor(rate * 2^32): an element is kept iff dropout_bits(...) >= it. rate in [0, 1).
uint32_t dropout_threshold(double rate);
// float(1 / (1 - rate)), what a kept element is multiplied by.
float dropout_scale(double rate);

// Limits of the key's fields: micro-batches and layers are packed in one 32-bit word, rows
// and features are 32-bit.
constexpr int64_t kDropoutMaxMicroBatches = int64_t{1} << 16;
constexpr int64_t kDropoutMaxLayers = int64_t{1} << 16;

class DropoutLayer : public Layer {
 public:
  // rate P in (0, 1); `layer`: the layer index of the key (the plain MLP: hidden layer i,
  // the dropout after its activation); `name` labels the output buffer [rows, width]; the
  // output keeps the layout, width and offset (first global feature) of the input.
  DropoutLayer(double rate, int64_t layer, const std::string& name, int64_t rows, int64_t width,
               FeatureLayout layout, int64_t offset, Dtype dtype);

  // Training pass: x * mask * scale into the layer's buffer. Otherwise: x itself.
  MatrixView forward(MatrixView x, const LayerPass& pass) override;
  // dY * mask * scale in place in dy, with the mask of the last forward (recomputed);
  // dy itself after a forward outside training.
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // dx times the last forward's mask and scale (its rows' mask for every direction); dx
  // itself after a forward outside training.
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // The same product for cotangents (a diagonal Jacobian).
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  // Outside training (no mask: the identity) only.
  bool cotangents_by_rows() const override { return !has_mask_; }
  // Training on derivatives and the forward Laplacian (docs/derivatives.md): in a training pass
  // the layer is a fixed diagonal map per row (the mask is drawn once per forward), so value,
  // first-order tangents and second-order streams are all multiplied by the same mask and scale
  // (the second derivative of a linear map adds nothing), and backward likewise: dX = mask *
  // scale * dY, the streams' gradients the same product (forward_tangents and
  // backward_cotangents, whatever LayerPass::second_order says). Outside training both are the
  // identity. No parameters.
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_laplacian() const override { return true; }

  MatrixView output() const override { return last_; }
  FeatureLayout output_layout() const override { return layout_; }
  int64_t output_width() const override { return static_cast<int64_t>(out_.extent(1)); }
  int64_t output_offset() const override { return offset_; }
  std::string describe() const override { return ""; }

  double rate() const { return rate_; }
  int64_t layer_index() const { return layer_; }

 private:
  double rate_;
  uint32_t threshold_;
  float scale_;
  int64_t layer_;
  FeatureLayout layout_;
  int64_t offset_ = 0;
  Dtype dtype_ = Dtype::fp32;
  Matrix out_;       // [rows, width]
  MatrixView last_;  // what the last forward returned
  // The key of the last forward (has_mask_: it was a training pass).
  bool has_mask_ = false;
  TrainingPass key_;
  Matrix tangents_, cotangents_;  // [rows * k, width]
};

}  // namespace meshtrain
