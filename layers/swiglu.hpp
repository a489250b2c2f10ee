#pragma once
// A SwiGLU projection, as one layer: two linear layers on the same input, gate and up, and
// y = silu(x W_gate + b_gate) * (x W_up + b_up) (swiglu_forward, layers/activation.hpp).
// In a residual_mlp block it stands where up and the activation stand otherwise
// (docs/models.md): parameters "blocks/<i>/gate/{weight,bias}" beside "blocks/<i>/up/...".
//
// Tensor parallel: gate and up are two parameters, each split over tp by the same rule, so
// rank t computes gate and value columns of the same global block t of the hidden features:
// they belong together by construction (no interleaved fused weight to split). Checked at
// construction: both Linears end in the same layout, width and offset (bad_input otherwise).
//
// Backward: dgate and dvalue elementwise, then both Linears' backward; dX is the sum of their
// input gradients (rounded to the compute dtype). Gradient reduction: as ResidualBlock, in a
// backward whose gradients go to the DP buckets the two Linears leave theirs partial and the
// layer reports them ready once both are computed (its one bucket entry). FSDP prefetch: the
// model's prefetch goes to up in forward and to gate in backward (the Linear that runs last).
// Buffers (output, dgate, dvalue, dX) are allocated at construction.
//
// Mixed precision's 16-bit storage (keeps_16bit; Mlp's residual constructor,
// docs/mixed_precision.md, "Compute and memory on this build"): gate and up write their outputs
// into the model's shared fp32 working buffers (LinearSharedBuffers::output); forward keeps the
// gate's and up's outputs and the SwiGLU's output as 16 bits in one pass, which also writes the
// output in place over up's output (the down projection reads it there and keeps the 16-bit copy,
// kept_output()). Backward reads the 16-bit copies, writes dvalue in place over dY and dgate over
// gate's output buffer (free after forward), and adds gate's input gradient into up's in place: the
// layer owns no fp32 buffer. The values are those of the fp32 buffers (16-bit values, exact).

#include <memory>
#include <string>
#include <vector>

#include "framework/core/precision.hpp"  // HalfMatrix
#include "layers/layer.hpp"
#include "layers/linear.hpp"

namespace meshtrain {

class SwiGlu final : public Layer {
 public:
  // `gate` and `up` take the same input; the layer owns them from here on. `dtype`: the
  // compute dtype. Throws bad_input when their outputs differ in layout, width or offset.
  // shared_gather (the feature axis' communicator, or nullptr): gate and up were built
  // column-parallel on a replicated input with partial input gradients (shares_input_gather);
  // the SwiGLU's input arrives split over it, is all-gathered once for both (kept for their
  // weight gradients), and the sum of their input gradients is reduce-scattered once.
  // keeps_16bit (a 16-bit dtype, no shared gather; else it throws): 16-bit storage (above);
  // gate's and up's output buffers must be distinct (the model's shared working buffers).
  SwiGlu(std::string name, std::unique_ptr<Linear> gate, std::unique_ptr<Linear> up, int64_t rows,
         Dtype dtype, Communicator* shared_gather = nullptr, bool keeps_16bit = false);

  MatrixView forward(MatrixView x, const LayerPass& pass) override;
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // Gate's and up's tangents of the same dx (one shared gather of it), then
  // silu'(gate) * value * dgate + silu(gate) * dvalue (swiglu_tangent).
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // swiglu_cotangent, then gate's and up's cotangents summed (and reduce-scattered once under
  // a shared gather), as backward's input gradient.
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  // The forward Laplacian (LayerPass::second_order, docs/derivatives.md): forward_tangents
  // carries each row's k tangents and k second-order streams through the product,
  // t_a = h1 t_g u + h t_u, s_a = (h1 s_g + h2 t_g^2) u + 2 h1 t_g t_u + h s_u (h = silu of
  // the gate g, h1 and h2 its derivatives, u the up projection); backward_with_tangents is its
  // exact backward, through gate's and up's; after first-order tangents (Sobolev training) the
  // same kernel's first-order part.
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_laplacian() const override { return true; }

  size_t parameter_count() const override { return 4; }  // gate weight, bias, up weight, bias
  std::vector<ShardedParameter*> sharded_parameters() override;
  bool can_leave_gradients_partial() const override { return true; }
  LayerScratchNeeds scratch_needs() const override;

  MatrixView output() const override { return output_; }
  FeatureLayout output_layout() const override { return up_->output_layout(); }
  int64_t output_width() const override { return up_->output_width(); }
  int64_t output_offset() const override { return up_->output_offset(); }
  // "<gate's line>; <up's line>".
  std::string describe() const override;

  const Linear& gate() const { return *gate_; }
  const Linear& up() const { return *up_; }
  // keeps_16bit: the last forward's output as 16-bit bits of the compute dtype (what the down
  // projection keeps of its input); else empty.
  ConstHalfMatrixView kept_output() const { return kept_output_; }

  // The second-order streams of gate * value (the forward Laplacian's product rule). Public
  // only because nvcc refuses device lambdas inside a private or protected member function.
  void swiglu_second_order(MatrixView gate, MatrixView value, MatrixView dgate, MatrixView dvalue,
                           MatrixView out) const;

 private:
  bool keeps_16bit() const { return kept_output_.data() != nullptr; }
  // Throws (internal) under 16-bit storage: the tangent passes read gate's and up's outputs.
  void require_fp32_buffers(const char* what) const;

  std::string name_;
  std::unique_ptr<Linear> gate_, up_;
  Dtype dtype_ = Dtype::fp32;
  Matrix out_;         // [rows, hidden local] (empty under 16-bit storage)
  MatrixView output_;  // out_, or under 16-bit storage up's output buffer
  // 16-bit storage: gate's and up's outputs and the SwiGLU's, [rows, hidden local] each.
  HalfMatrix kept_gate_, kept_value_, kept_output_;
  Matrix dgate_;   // [rows, hidden local] (empty under 16-bit storage, as the next two)
  Matrix dvalue_;  // [rows, hidden local]
  Matrix dx_;      // [rows, input width]
  Communicator* shared_gather_ = nullptr;
  Matrix x_full_;   // shared gather: the gathered input [rows, in]
  Matrix dx_full_;  // shared gather: the summed partial input gradient [rows, in]
  int64_t rows_ = 0;
  Matrix tangent_x_full_;  // shared gather: the gathered tangents [rows * k, in]
  Matrix tangents_;        // [rows * k, hidden local]
  // Cotangents: of gate and up [rows * k, hidden local] x 2, of the input [rows * k, input
  // width], and under a shared gather its full-width partial sum [rows * k, in].
  Matrix cotangent_gate_, cotangent_value_, cotangents_, cotangent_full_;
  // The last tangent pass: whether it was second order, and gate's and up's streams (their
  // layers' buffers, kept for backward_with_tangents).
  bool second_order_ = false;
  MatrixView stream_gate_, stream_value_;
};

}  // namespace meshtrain
