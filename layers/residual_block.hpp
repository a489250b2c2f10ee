#pragma once
// A residual block: a sequence of layers f and the sum of its input and their output,
// y = x + f(x) (the building block of ResMLP-style models; pre-norm blocks are a norm, the
// up projection, the activation and the down projection as f).
//
// x + f(x) is elementwise, so the block's layers must end where they started: the last
// layer's output has the block input's feature layout, width and offset (under tp: a block
// fed the split features whose up and down projections are both tensor parallel; checked at
// construction, bad_input otherwise). Backward: dX = dY + (f's input gradient).
//
// To the model the block is one Layer: its parameters are its layers' in order; its
// gradients can be left partial (GradientReductionPlan) when every layer's can, over one
// group. In a backward whose gradients go to the DP buckets, the block's layers leave theirs
// partial and the block reports them ready once all are computed (its one bucket entry,
// LayerPass::index). The FSDP prefetch the model asks of the block is passed on to the
// block's last layer with parameters in the pass's direction; the block's own layers gather
// their weights when they run (can_prefetch_weight() is false).
//
// Mixed precision: the sum and the input gradient are rounded to the compute dtype.
// Buffers: the output and the input gradient, allocated at construction; or, under 16-bit
// storage (ResidualSharedBuffers, a residual_mlp computing in 16 bits with norms, layers/mlp.cpp),
// the model's residual stream, which the sum overwrites in place (the block's norm keeps its
// input as 16 bits), and the model's input-gradient stream, which the blocks pass down and add
// into in place (the block's layers only read their dY there).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "layers/inference.hpp"
#include "layers/layer.hpp"

namespace meshtrain {

// 16-bit storage's shared fp32 buffers [rows, width] (see above).
struct ResidualSharedBuffers {
  MatrixView output;      // the residual stream: forward's input, the sum written over it
  MatrixView input_grad;  // the gradient stream: backward's dY (from the block above) and dX
};

class ResidualBlock : public Layer {
 public:
  // `layers` f, in order (owned by the block from here on); the input: [rows, width] in
  // `input_layout`, its first column `input_offset` of the global features. Throws
  // bad_input when f does not end in the input's layout, width and offset. `shared`: 16-bit
  // storage (above).
  ResidualBlock(std::string name, std::vector<std::unique_ptr<Layer>> layers,
                FeatureLayout input_layout, int64_t input_offset, int64_t rows, int64_t width,
                Dtype dtype, const ResidualSharedBuffers* shared = nullptr);

  MatrixView forward(MatrixView x, const LayerPass& pass) override;
  // x + f(x), the sum inside f's last GEMM where that is a Linear layer (layers/inference.hpp).
  MatrixView infer(MatrixView x, const LayerPass& pass) override;
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // dx + (f's tangents of dx), for k directions per row.
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // dy + (f's cotangents of dy), for k directions per row.
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  void reserve_derivative_forward(bool for_cotangents) override;  // its layers'
  bool cotangents_by_rows() const override;                       // where every layer of f does
  // The tangents' backward, first-order (Sobolev training) or the forward Laplacian's: dy + f's
  // input gradient, dt + f's streams' input gradient; the streams' result lives in the
  // cotangents' buffer. Whether it is exact is its layers' answer (supports_laplacian,
  // supports_tangent_backward).
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_laplacian() const override;
  bool supports_tangent_backward() const override;

  size_t parameter_count() const override;
  std::vector<ShardedParameter*> sharded_parameters() override;
  bool can_leave_gradients_partial() const override;
  LayerScratchNeeds scratch_needs() const override;
  double aux_loss() const override;

  MatrixView output() const override { return out_; }
  FeatureLayout output_layout() const override { return layout_; }
  int64_t output_width() const override { return static_cast<int64_t>(out_.extent(1)); }
  int64_t output_offset() const override { return offset_; }
  // "<name>: x + f(x), f = <its layers' lines, '; '-separated>".
  std::string describe() const override;

  const std::vector<std::unique_ptr<Layer>>& layers() const { return layers_; }

 private:
  std::string name_;
  std::vector<std::unique_ptr<Layer>> layers_;
  FeatureLayout layout_;
  int64_t offset_ = 0;
  Dtype dtype_ = Dtype::fp32;
  // The first and last layer with parameters (layers_.size(): none): where the model's
  // prefetch goes in backward and in forward.
  size_t first_with_parameters_ = 0, last_with_parameters_ = 0;
  MatrixView out_;  // [rows, width]: own_out_, or the shared stream
  MatrixView dx_;   // [rows, width]: own_dx_, or the shared gradient stream
  Matrix own_out_, own_dx_;
  inference::Sequence inference_;  // layers_ as infer() runs them
  int64_t rows_ = 0;
  Matrix tangents_, cotangents_;  // [rows * k, width]
};

}  // namespace meshtrain
