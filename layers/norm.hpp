#pragma once
// Normalization over the feature dimension, as layers: LayerNorm (scale and bias) and RMSNorm
// (scale), PyTorch's nn.LayerNorm and nn.RMSNorm over the last dimension (N features):
//
//   LayerNorm  y = (x - mean) / sqrt(var + eps) * scale + bias,  var biased (divided by N),
//              eps = 1e-5 (PyTorch's default).
//   RMSNorm    y = x / sqrt(mean(x^2) + eps) * scale,
//              eps = 2^-23 = 1.1920929e-07 = torch.finfo(torch.float32).eps: PyTorch's default
//              (eps=None) is finfo(input dtype).eps, and the statistics here are always fp32
//              (also for bf16/fp16 inputs), so the fp32 value is the one that belongs to them.
//              (PyTorch on a bf16 tensor would take 2^-7; pass eps to match such a model.)
//
// Features whole or split. The input's features arrive replicated (every rank has all N) or
// split over the feature axis (tp, rank t has the column block t of N / tp). Split, the row
// statistics are sums over tp: one all-reduce of [rows] or [rows, 2] fp32 values per pass
// over the feature axis (never in 16 bits). The output keeps the input's layout.
//
// Statistics (fp32, also under mixed precision), per row:
//   LayerNorm, two passes: m0 = sum(x) / N; then with d = x - m0: a = sum(d), b = sum(d^2);
//              delta = a / N (what the fp32 m0 missed), var = max(b / N - delta^2, 0),
//              rstd = 1 / sqrt(var + eps); x_hat = ((x - m0) - delta) * rstd. x - m0 is
//              exact where x is near the mean, so rows with a large mean offset
//              (x ~ 1e3 + N(0, 1)) keep their variance (no E[x^2] - E[x]^2 cancellation).
//   RMSNorm, one pass: ss = sum(x^2); rstd = 1 / sqrt(ss / N + eps); x_hat = x * rstd.
// Backward (exact), with g = dy * scale and row sums again all-reduced over tp when split:
//   LayerNorm  dx = rstd * (g - sum(g) / N - x_hat * sum(g * x_hat) / N)   ([rows, 2] sums)
//   RMSNorm    dx = rstd * (g - x_hat * sum(g * x_hat) / N)                ([rows] sums)
//   dscale = column sums over the rows of dy * x_hat, dbias = column sums of dy.
//
// What is split, gathered and reduced where is decided by decide_norm_layout
// (partition/norm_layout.hpp) from the parameters' specs; norm_step_collectives lists the
// step's collectives from the same decision (for a plan).
// Parameters: scale [N] and bias [N], named by the caller (e.g. "blocks/<i>/norm/scale"),
// stored under any 1-D spec (whole, split over tp like the features, over fsdp, ...). The
// compute block (the layer's columns) comes as Linear's bias does: all-gathered over the
// spec's active axes, except that split features whose spec starts with the feature axis
// gather only the rest (their stored block is then part of the compute block). Gradients:
//   direct   the stored block is the compute block (stored whole with whole features, or
//            split exactly like the features, P(tp)): column sums straight into the stored
//            gradient, all-reduced over the batch axes. That all-reduce is the layer's only
//            communication, so it defers like a DP Linear's (GradientReductionPlan:
//            gradient accumulation, ZeRO-1, DP buckets).
//   full     otherwise: column sums into a full-width vector (zeros outside the layer's
//            columns), all-reduced over the batch axes (and the feature axis when split),
//            this rank's stored block kept; done in every backward, as Linear's bias.
// Initialization: scale = 1, bias = 0 (initialize_parameters(); the generic
// framework/train/init.hpp schemes would zero a rank-1 "scale").
//
// Mixed precision (context.precision(), docs/mixed_precision.md): the input arrives in the
// compute dtype; the statistics, x_hat and the backward row sums are fp32; scale and bias
// are cast to the compute dtype (gathered in it); the output is rounded once to the compute
// dtype; so are the input gradient and the parameter gradients (fp32 column sums, then
// rounded), which are reduced in the reduce dtype and stored in fp32.
//
// Buffers (output, input gradient, statistics, gathered parameters, full-width gradients)
// are allocated at construction; forward() and backward() allocate nothing.
//
// 16-bit storage (NormSharedBuffers; a residual_mlp computing in 16 bits, layers/mlp.cpp): the
// layer keeps its input and its output as 16-bit copies (written in the passes that read the
// input and write the output: the values are already 16-bit values, so the copies are exact),
// writes its fp32 output into a buffer the model shares, and computes its input gradient in
// place over dY. Backward widens the kept input into another shared fp32 buffer and runs the
// same kernels on it: bit for bit the values of fp32 buffers holding the same 16-bit values.

#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/precision.hpp"  // HalfMatrix (16-bit storage)
#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/layer.hpp"
#include "layers/sharded_parameter.hpp"
#include "partition/norm_layout.hpp"  // NormKind, NormLayout (the decision, also for the plan)
#include "partition/planner.hpp"      // ParameterShape

namespace meshtrain {

// The parameters of a norm named `prefix`: prefix/scale [width], and prefix/bias [width] for
// LayerNorm, in that order (the order the layer takes them).
std::vector<ParameterShape> norm_parameter_shapes(NormKind kind, const std::string& prefix,
                                                  int64_t width);

// 16-bit storage's shared fp32 buffers [rows, local width] (see the top of this file): where
// forward writes its output, and where backward widens the kept 16-bit input (free then: the
// model's residual stream, which backward does not read).
struct NormSharedBuffers {
  MatrixView output;
  MatrixView input_work;
};

// LayerNorm and RMSNorm share this implementation.
class FeatureNorm : public Layer {
 public:
  // `name` labels the layer's buffers and its describe() line; `scale` (and `bias` for
  // LayerNorm; an empty ParameterRef for RMSNorm) [width] as allocated; `layout`: how the
  // input's features arrive (taken as replicated when the feature axis has size 1); `rows`:
  // the local batch. Asks the context for its communicators (collective, see context.hpp).
  // Throws bad_input when the parameters are not [width] vectors of the same width, or when
  // split features do not divide by the feature axis.
  // `shared` (a 16-bit compute dtype, features whole on this rank): 16-bit storage.
  FeatureNorm(NormKind kind, const std::string& name, ParameterRef scale, ParameterRef bias,
              FeatureLayout layout, int64_t rows, ParallelContext& context, float eps,
              const NormSharedBuffers* shared = nullptr);

  // x [rows, output_width()] (kept for backward) -> y, owned by the layer. pass.prefetch (FSDP
  // overlap): the layer whose weight gather starts once this one's parameters are in place.
  MatrixView forward(MatrixView x, const LayerPass& pass) override;
  // The same output in one pass over each row (layers/inference.hpp) where the row is whole on
  // this rank and the norm computes in fp32 on host memory; forward() elsewhere.
  MatrixView infer(MatrixView x, const LayerPass& pass) override;
  // dy [rows, output_width()] -> the scale (and bias) gradients, and dx when need_input_grad
  // (owned by the layer). pass.deferred applies to direct gradients the model defers;
  // pass.prefetch's gather is started first.
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // The norm's derivative along k directions per row (docs/derivatives.md), with the row
  // statistics of the last forward:
  //   LayerNorm  dy = scale * rstd * (dx - sum(dx) / N - x_hat * sum(x_hat dx) / N)
  //   RMSNorm    dy = scale * rstd * (dx - x_hat * sum(x_hat dx) / N)
  // the two row sums over all N features (one all-reduce of [rows * k, 2] over tp when split).
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // backward's input gradient for k cotangents per row (the same formula: the norm's Jacobian
  // is symmetric but for the scale, applied first here, last in the tangents), no parameter
  // gradient.
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  // Whether the cotangents go in one pass per row (host memory, fp32, the whole row on this
  // rank: no tp), which cotangents_adding needs.
  bool cotangents_in_one_pass() const;
  // By row blocks in that one pass, the scale not gathered (FSDP).
  bool cotangents_by_rows() const override;
  // [rows, local_width] for x_hat, which a derivative forward (LayerPass::derivative_forward)
  // writes, with the statistics, in one host pass over each row (inference::layernorm_keeping)
  // and the one-pass cotangents then read instead of computing it again; only where those run
  // (cotangents_in_one_pass(), no 16-bit storage) and for_cotangents (the tangents'
  // norm_jacobian does not read it); elsewhere nothing.
  void reserve_derivative_forward(bool for_cotangents) override;
  // out = add + backward_cotangents(dy) in that pass (add [rows * k, local_width] or empty: a
  // residual block's stream, added without a pass of its own); out [rows * k, local_width],
  // neither dy's memory nor add's (a row block's first output row holds x-hat before add's rows
  // are read). After forward; allocates nothing.
  void cotangents_adding(MatrixView dy, MatrixView add, MatrixView out, const LayerPass& pass);
  // The forward Laplacian (pass.second_order, docs/derivatives.md "LayerNorm and RMSNorm, second
  // order"): forward_tangents takes each row's k tangents t_d and k second-order streams q_d and
  // returns scale * (J t_d) and scale * (J q_d - 2 rstd a_d J t_d - rstd^2 (m2_d - a_d^2) x_hat),
  // a_d = mean(x_hat t_d), m2_d = mean((t_d - mean(t_d))^2) (RMSNorm: no centring), one
  // all-reduce of [rows * 2k, 3] row sums over tp when split. backward_with_tangents is its
  // exact backward (the scale's and bias's gradients, the value's and the streams' input
  // gradients; two all-reduces of row sums over tp). First-order tangents (Sobolev training)
  // take the same passes without the second-order streams, once reserve_tangent_backward made
  // room for them (forward_tangents then keeps what the backward reads).
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_laplacian() const override { return true; }

  size_t parameter_count() const override { return layout_.params.size(); }
  std::vector<ShardedParameter*> sharded_parameters() override;
  // Only direct gradients can be left partial (the full-width ones are reduced in every
  // backward, as the layout says and norm_step_collectives charges).
  bool can_leave_gradients_partial() const override { return layout_.direct; }
  LayerScratchNeeds scratch_needs() const override;

  // scale = 1, bias = 0 in this rank's blocks (the same global tensors on every mesh).
  void initialize_parameters();

  NormKind kind() const { return layout_.kind; }
  float eps() const { return eps_; }
  int64_t width() const { return layout_.width; }  // global features
  const NormLayout& layout() const { return layout_; }
  // Whether the gradients go straight into their stored blocks (see the top of this file).
  bool direct_gradients() const { return layout_.direct; }

  MatrixView output() const override { return y_; }
  // 16-bit storage: the last forward's output as 16-bit bits of the compute dtype (what the next
  // Linear keeps as its input); empty otherwise.
  ConstHalfMatrixView kept_output() const { return kept_output_; }
  bool keeps_16bit() const { return kept_input_.data() != nullptr; }
  FeatureLayout output_layout() const override { return layout_.layout; }
  int64_t output_width() const override { return layout_.local_width; }
  int64_t output_offset() const override { return offset_; }
  // "blocks/0/norm: layernorm 256 features (split 64 over tp), statistics all-reduced over
  // (tp), parameters gathered over (fsdp), grads all-reduced over (fsdp, dp)".
  std::string describe() const override;

  // forward_tangents of second-order streams (LayerPass::second_order). Public only because
  // nvcc refuses device lambdas inside a private or protected member function.
  MatrixView laplacian_forward(MatrixView streams, const LayerPass& pass);

 private:
  // One parameter as a ShardedParameter (GatherMethod::full_width_sum, see make_param).
  ShardedParameter make_param(ParameterRef ref, const NormParameterLayout& layout, int64_t index,
                              ParallelContext& context);
  void parameter_gradients(MatrixView dy, const LayerPass& pass);

  NormLayout layout_;  // decide_norm_layout: what is split, gathered and reduced where
  std::string name_;
  float eps_;
  int64_t offset_ = 0, rows_ = 0;
  Dtype compute_dtype_ = Dtype::fp32;
  Dtype reduce_dtype_ = Dtype::fp32;
  std::vector<ShardedParameter> params_;       // scale, then bias (LayerNorm)
  std::vector<ShardedParameter*> parameters_;  // the same, for sharded_parameters()

  Communicator* tp_comm_ = nullptr;    // the statistics' all-reduces (split features)
  Communicator* grad_comm_ = nullptr;  // the gradients' all-reduce (layout_.grad_reduce)

  MatrixView x_;                              // the input of the last forward
  Vector row_sum_;                            // [rows]     first pass (sum x, or sum x^2)
  Matrix row_sums2_;                          // [rows, 2]  second pass / backward sums
  Matrix stats_;                              // [rows, 3]  m0, delta, rstd
  bool one_pass_derivative_forward_ = false;  // reserve_derivative_forward found it possible
  Matrix kept_x_hat_;        // [rows, local_width] x_hat of a derivative forward (or empty)
  bool x_hat_kept_ = false;  // whether the last forward wrote kept_x_hat_
  Matrix out_;               // [rows, local_width] (none under 16-bit storage)
  Matrix dx_;                // [rows, local_width] (none under 16-bit storage: dX over dY)
  MatrixView y_;             // where forward writes: out_, or the shared output
  // 16-bit storage: the shared buffer the kept input is widened into, the kept input and output.
  MatrixView input_work_;
  HalfMatrix kept_input_, kept_output_;  // [rows, local_width]
  Vector full_grad_;                     // [params * width] (full gradients only)

  // Tangents (reserve_tangents): per tangent row sum dx and sum x_hat dx [rows * k, 2], and
  // the output's [rows * k, local_width]; cotangents (reserve_cotangents) alike.
  Matrix tangent_sums_, tangents_;
  Matrix cotangent_sums_, cotangents_;

  // The forward Laplacian (reserve_tangent_backward, for up to laplacian_rows_ stream rows per
  // value row): the streams of the last second-order pass (kept for the backward), x_hat
  // [rows, local_width], the streams before the scale [rows * 2k, local_width] (J t_d and the
  // second derivatives of x_hat), the forward's row sums [rows * 2k, 3] and per-direction
  // statistics [rows * k, 5] (mean t, a, b, m2, mean q), the backward's row sums
  // [rows * k, 7] and [rows, 2], the rstd adjoint [rows], the streams' input gradient.
  // (First-order tangents use them too, k stream rows per value row: streams_second_order_ false.)
  int64_t laplacian_rows_ = 0;
  MatrixView streams_in_;
  bool streams_second_order_ = false;
  Matrix x_hat_, hat_streams_, laplacian_sums_, laplacian_stats_;
  Matrix laplacian_back_sums_, laplacian_value_sums_, stream_grad_;
  Vector rstd_adjoint_;
};

class LayerNorm : public FeatureNorm {
 public:
  LayerNorm(const std::string& name, ParameterRef scale, ParameterRef bias, FeatureLayout layout,
            int64_t rows, ParallelContext& context, float eps = kLayerNormEps,
            const NormSharedBuffers* shared = nullptr)
      : FeatureNorm(NormKind::layernorm, name, scale, bias, layout, rows, context, eps, shared) {}
};

class RMSNorm : public FeatureNorm {
 public:
  RMSNorm(const std::string& name, ParameterRef scale, FeatureLayout layout, int64_t rows,
          ParallelContext& context, float eps = kRmsNormEps,
          const NormSharedBuffers* shared = nullptr)
      : FeatureNorm(NormKind::rmsnorm, name, scale, ParameterRef{}, layout, rows, context, eps,
                    shared) {}
};

}  // namespace meshtrain
