#pragma once
// A fully connected layer y = x W + b with W [in, out], b [out], in every layout of
// docs/design.md, "Training modes", derived from the parameters' specs, never written per
// combination:
//
// The layout (TP or replicated compute, storage gathers, batch all-reduces, the bias, and
// the all-reduce fallback when out does not divide by the feature axis) is decided by
// decide_linear_layout (partition/linear_layout.hpp), which the planner reports too.
//
// Compute layout
//   TP: the layer works on the feature block t of its input, x_c [rows, in/T], and its
//       weight rows W_c [in/T, out]. Forward: matmul_reduce_scatter over the feature axis
//       (scatter dim 1) -> output split [rows, out/T], + the bias block t; or, when out
//       does not divide by T, the partial product all-reduced (output replicated).
//       Backward: dX_c = all_gather(dY, dim 1) @ W_cᵀ and dW_c = X_cᵀ @ all_gather(dY, dim 1)
//       (all_gather_matmul, transposes through the GEMM flags).
//   column-parallel (W split on dim 1 over the feature axis): W_c = W[:, block t] [in, out/T].
//       Forward: Y_t = all_gather(x, dim 1) @ W_c (all_gather_matmul, the K blocks of x
//       accumulating; a replicated x is used as it is), output split [rows, out/T] with no
//       reduction, + the bias block t. Backward: dX = reduce_scatter(dY_t @ W_cᵀ, dim 1)
//       (matmul_reduce_scatter; all-reduced for a replicated x) and dW_c =
//       all_gather(x, dim 1)ᵀ @ dY_t: x gathered again, as only its block is kept. A bias
//       stored P(tp) is its own compute block: its gradient is reduced over the batch axes
//       only, in place.
//   replicated: x_c [rows, in] (a split input is all-gathered over the feature axis
//       first), W_c the full weight, output replicated.
//   A TP layer fed a replicated input (the first layer, or after a non-divisible output)
//   takes its column block locally; its input gradient is all-gathered back.
// Storage: the weight is a ShardedParameter (layers/sharded_parameter.hpp, gathered dim by
//   dim into the shared scratch): gathered right before use, in forward AND again in
//   backward (nothing is kept from forward); the gradient is reduce-scattered back over the
//   same axes, divided by the size of the gathered non-batch axes (identical copies), then
//   all-reduced over the batch axes the storage does not split (DP). The bias is a
//   ShardedParameter too (GatherMethod::full_width_sum): gathered in one collective, its
//   gradient one all-reduce of the full-width vector, then this rank's block is kept.
// The loss is a mean over the global batch, so gradients are sums over ranks, and equal
// the single-rank gradients.
//
// Prefetch (FSDP overlap): a layer whose weight is gathered over one group of axes can
//   start that gather early (start_weight_prefetch) into the scratch's prefetch buffer
//   while the layer before it computes; its next use of the weight then waits for it
//   instead of gathering. A weight gathered over two groups (a 2-D storage split) is
//   gathered when used.
//
// Mixed precision (docs/mixed_precision.md, context.precision()): the weight and bias are
//   cast to the compute dtype before they are gathered (a weight stored whole is rounded
//   into the scratch); the output, the input gradient and the weight and bias gradients are
//   rounded to it; the TP collective matmuls move their blocks in it; the gradients are
//   reduced in the reduce dtype and kept in fp32. In fp32 none of this does anything.
//
// Buffers: the layer owns its activations for backward (input as used, output) and its
// input gradient (with LinearSharedBuffers, a 16-bit plain MLP's, the model owns them: shared
// fp32 working buffers and a 16-bit copy of the input); gathered weights and gradient staging
// live in a LayerScratch shared by all layers of a model. Nothing is allocated in forward() or
// backward().

#include <cstdint>
#include <string>
#include <vector>

#include "framework/comm/collective_matmul.hpp"
#include "framework/core/precision.hpp"  // ConstHalfMatrixView
#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/layer.hpp"
#include "layers/sharded_parameter.hpp"
#include "partition/linear_layout.hpp"

namespace meshtrain {

// Mixed precision's 16-bit storage (Mlp; docs/mixed_precision.md, "Compute and memory on this
// build"), for a layer without a feature axis or a row-parallel (tensor-parallel) one: the fp32
// buffers it computes in are the model's working buffers, shared with the other layers, and what
// backward needs of forward's input is the 16-bit copy its producer kept (a row-parallel layer
// fed a replicated input keeps its slice of it itself: as 16 bits where gemm()'s kernel reads
// them, partition/sixteen_bit_storage.hpp's keeps_16bit_sliced_input).
struct LinearSharedBuffers {
  // [rows, out]: forward's output (empty: the layer's own, as without storage).
  MatrixView output;
  // [rows, in]: where backward widens kept_input for the weight gradient (unless gemm() reads
  // 16-bit operands as stored: gemm_reads_16bit), then writes dX (empty: the layer's own input
  // gradient buffer; then kept_input must be empty too).
  MatrixView work;
  // [rows, in]: forward's input as 16-bit bits of the compute dtype (the same values), written
  // by its producer before forward and valid from each forward to its backward (empty:
  // forward's input itself is kept, as without storage; a residual block's up projection reads
  // its norm's output). Where gemm_reads_16bit, forward's product and backward's weight
  // gradient read it as it is, not the fp32 input.
  ConstHalfMatrixView kept_input;
  // [rows, >= out_local] (tensor parallelism with a split output): where backward packs dY's 16
  // bits for its all-gather-matmuls, free by then (empty: the layer's own where it needs one).
  // Mlp's 16-bit storage hands a hidden layer the following activation's kept output
  // (ActivationLayer::dy_16bit_over_output()), the last layer a buffer of the model's.
  HalfMatrixView output_grad_16bit;
  // false: backward is never asked for dX (the model's first layer), and a sliced input has no
  // buffer for dX in the input's layout.
  bool input_grad = true;
};

class Linear final : public Layer {
 public:
  // `weight` [in, out] and `bias` [out] as allocated (their specs and boxes fix the
  // layout); `input_layout` is how the input's features arrive; `rows` is the local batch.
  // Asks the context for the communicators it needs (collective; see context.hpp).
  // Throws bad_input when the shapes do not agree or a split does not divide.
  // input_grad_partial (a SwiGLU's gate or up sharing its one gather, see
  // shares_input_gather; column-parallel fed a replicated input only): backward leaves dX as
  // this rank's partial sum, for the SwiGLU to add and reduce-scatter.
  // shared (a 16-bit compute dtype, a layout without a feature axis or row-parallel; else
  // bad_input): the buffers above instead of the layer's own output and input gradient.
  Linear(ParameterRef weight, ParameterRef bias, FeatureLayout input_layout, int64_t rows,
         ParallelContext& context, bool input_grad_partial = false,
         const LinearSharedBuffers* shared = nullptr);

  // y = x W + b. x: [rows, input_width()]. Returns the output [rows, output_width()],
  // owned by the layer (valid until the next forward). x must stay valid until backward.
  // pass.prefetch: the layer whose weight gather starts once this one's own weight is in place.
  MatrixView forward(MatrixView x, const LayerPass& pass) override;

  // From dY [rows, output_width()]: writes the weight and bias gradients (overwriting
  // them) and, when need_input_grad, returns dX [rows, input_width()] (owned by the
  // layer); otherwise an empty view. pass.deferred says what happens to the gradients of a
  // layer that defers_reduction() (any other gets `now`): all-reduced now;
  // DeferredReduction::later: left as this rank's partial sums for the model's
  // reduce_gradients() (gradient accumulation communicates once per step) or ZeRO-1;
  // in_buckets (DP overlap): both gradients are computed first, reported to pass.buckets
  // (which may start their all-reduce) and dX computed while that runs; the gradients are
  // final after pass.buckets->wait_all().
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // dY = dX W for k directions per row (docs/derivatives.md): the tangents [rows * k, ...] are
  // k times the rows through forward's layout and collective matmuls (gathered or sliced
  // input, matmul-reduce-scatter, all-gather-matmul, all-reduce), without the bias.
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // dX = dY Wᵀ for k cotangents per row: backward's input gradient (all-gather-matmul,
  // matmul-reduce-scatter, all-reduce, the input's layout) on k times the rows, without the
  // weight and bias gradients.
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  // By row blocks where the product has no collective: no tp, the weight not gathered (FSDP).
  bool cotangents_by_rows() const override;
  // Sobolev training (Layer::backward_with_tangents): backward's weight gradient plus the
  // tangents' term dt_inᵀ g_t through the same product and collective on k times the rows, added
  // before the reduction; the bias gets the value's term only (the tangents have no bias);
  // *dt_in = g_t Wᵀ as backward_cotangents computes it.
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_laplacian() const override { return true; }
  size_t parameter_count() const override { return 2; }  // weight, bias
  std::vector<ShardedParameter*> sharded_parameters() override;
  bool can_leave_gradients_partial() const override { return true; }
  // True when the gradients' only communication is one all-reduce over the batch axes for
  // the weight and the same for the whole stored bias (DP storage): a sum of partial
  // gradients can then be all-reduced once. Reduce-scatters (FSDP) and the feature axis's
  // bias reduction (TP) are done in every backward. The layout's word (what the cost model
  // charges), checked at construction to be GradientReductionPlan's decision.
  bool defers_reduction() const { return layout_.defers_reduction(); }

  // True when the weight is gathered over exactly one group of axes (FSDP storage).
  bool can_prefetch_weight() const override { return weight_.can_prefetch(); }
  // Starts gathering the weight into scratch.prefetch; the next forward() or backward() of
  // this layer completes it. Needs a scratch made with_prefetch and can_prefetch_weight().
  void start_weight_prefetch(LayerScratch& scratch) override;
  // Lets a started prefetch progress (MPI moves data only inside MPI calls).
  void poll_weight_prefetch() override { weight_.poll_prefetch(); }

  int64_t in() const { return layout_.in; }
  int64_t out() const { return layout_.out; }
  FeatureLayout input_layout() const { return layout_.input_layout; }
  FeatureLayout output_layout() const override { return layout_.output_layout(); }
  int64_t input_width() const { return layout_.input_width(); }        // local input columns
  int64_t output_width() const override { return layout_.out_local; }  // local output columns
  int64_t output_offset() const override;  // first global output column held here
  bool tensor_parallel() const { return layout_.tensor_parallel; }
  const LinearLayout& layout() const { return layout_; }
  // The weight as the layer holds it (tests: whether its gradient is written as 16 bits).
  const ShardedParameter& weight_parameter() const { return weight_; }
  // The output of the last forward (the pre-activation, kept for backward).
  MatrixView output() const override { return output_view_; }
  LayerScratchNeeds scratch_needs() const override { return needs_; }
  // One line for logs, "<layer>: " + describe_linear_layout: "layers/0: TP in 784 -> out
  // 128 (split 32), weight gathered over (fsdp) on dim 1, grads all-reduced over (dp)".
  std::string describe() const override;

  // Inference (layers/inference.hpp): f(x W + b + residual) into the layer's output, f =
  // `activation` (none: the identity), residual [rows, output_width()] or empty. Where
  // can_infer_fused(): one GEMM, its C filled with b (+ residual) first, then f in place;
  // elsewhere forward(x), then the residual and f, one pass each.
  MatrixView infer(MatrixView x, const LayerPass& pass, Activation activation,
                   ConstMatrixView residual);
  MatrixView infer(MatrixView x, const LayerPass& pass) override {
    return infer(x, pass, Activation::none, ConstMatrixView());
  }
  // Whether infer() runs as one GEMM on this rank's input as it arrives (no collective
  // around the product: replicated or column-parallel on a replicated input), in fp32 on host
  // memory.
  bool can_infer_fused() const;

 private:
  // Whether forward's product and backward's weight gradient read kept_input_ as 16 bits
  // (LinearSharedBuffers::kept_input; gemm_reads_16bit).
  bool reads_kept_input() const {
    return kept_input_.data() != nullptr && gemm_reads_16bit(compute_dtype_);
  }
  // Whether the GEMMs (and collective matmuls) read the weight as 16 bits: with a kept input, or
  // with a 16-bit copy where gemm() reads 16 bits (a tensor-parallel weight's, which the
  // collective matmuls take as it is: partition/sixteen_bit_storage.hpp).
  bool reads_16bit_weight() const {
    return reads_kept_input() || (weight_.has_16bit_copy() && gemm_reads_16bit(compute_dtype_));
  }
  // Column sums of dy into this rank's block of the bias gradient; all_reduce: summed
  // over the bias's reduction group first.
  void bias_gradient(MatrixView dy, LayerScratch& scratch, bool all_reduce);
  // Tangents and cotangents: the collective matmuls' workspace (needs_) and the feature axis'
  // buffers for `rows` stacked rows.
  void reserve_stacked_rows(int64_t rows);
  // backward's and backward_with_tangents' weight gradient: x_cᵀ @ dy (dy or x all-gathered
  // over the features as the layout needs) into the compute block g.
  // dy_16bit (optional): dy's 16 bits (dy_16bit_), which a gathered dy then travels as.
  // x_t: the input (fp32, or its kept 16 bits), transposed.
  void weight_gradient_product(GemmOperand x_t, MatrixView dy, MatrixView g, LayerScratch& scratch,
                               ConstHalfMatrixView dy_16bit = {});
  // backward_cotangents' product dy @ wᵀ into the input's layout, for dy's rows.
  MatrixView cotangent_product(MatrixView dy, MatrixView w, LayerScratch& scratch);
  // backward; with dt (non-empty) backward_with_tangents.
  MatrixView backward_pass(MatrixView dy, MatrixView dt, bool need_input_grad,
                           const LayerPass& pass, MatrixView* dt_in);

  LinearLayout layout_;
  ShardedParameter weight_;  // gathered, prefetched and reduced as its storage says
  ShardedParameter bias_;    // gathered, and its gradient summed at full width
  int64_t rows_ = 0;
  int tp_index_ = 0;
  // Mixed precision (context.precision()): what the layer computes with and moves
  // activations in (its parameters know how they are gathered and reduced).
  Dtype compute_dtype_ = Dtype::fp32;

  Communicator* tp_comm_ = nullptr;
  // The three collective matmuls' algorithms (auto resolved by the cost model at construction).
  LayerMatmulAlgorithms matmuls_;

  Matrix x_c_;  // the input as used, when it is not the caller's view
  // Under 16-bit storage a sliced input is the model's raw batch (layers/mlp.cpp): forward rounds
  // its slice to the compute dtype as it takes it (into x_c_16bit_ or x_c_).
  bool rounds_sliced_input_ = false;
  MatrixView x_used_;
  Matrix output_;  // [rows, out_local] (empty when shared)
  Matrix dx_c_;    // [rows, in_c] (empty when shared)
  // What forward writes and backward's input gradient goes to: output_ and dx_c_, or the
  // model's shared buffers (LinearSharedBuffers), whose kept_input backward then reads.
  MatrixView output_view_, dx_c_view_;
  ConstHalfMatrixView kept_input_;
  // Under 16-bit storage, a sliced input kept as 16 bits (keeps_16bit_sliced_input): forward
  // writes the slice here (kept_input_ is this), not into x_c_.
  HalfMatrix x_c_16bit_;
  // [rows, out_local] under tensor parallelism with a 16-bit weight copy (reads_16bit_weight) and
  // a split output: backward packs dY into it once, and both all-gather-matmuls (weight and input
  // gradients) gather it as 2-byte blocks that their GEMMs read as they are (dy_16bit_view_: this,
  // or the model's shared buffer, LinearSharedBuffers::output_grad_16bit).
  HalfMatrix dy_16bit_;
  HalfMatrixView dy_16bit_view_;
  bool input_grad_ = true;  // LinearSharedBuffers::input_grad
  Matrix dx_;               // [rows, input_width] when it differs from dx_c_
  // Tangents (reserve_tangents): the input as used [rows * k, in_c] when it is not the
  // caller's, the output [rows * k, out_local].
  Matrix tangent_x_c_, tangent_out_;
  // Cotangents (reserve_cotangents): dY Wᵀ in the compute layout [rows * k, in_c] and in the
  // input's [rows * k, input_width] when that differs, as dx_c_ and dx_.
  Matrix cotangent_dx_c_, cotangent_dx_;
  // Sobolev training: the input tangents as the last forward_tangents used them, and the
  // tangents' term of the weight gradient [in_c, compute cols] (reserve_tangent_backward).
  MatrixView tangent_x_used_;
  Matrix tangent_weight_grad_;
  LayerScratchNeeds needs_;
};

}  // namespace meshtrain
