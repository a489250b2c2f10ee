#pragma once
// A multi-layer perceptron of any depth: sizes [in, hidden..., out] give layers
// i = 0 .. n-2 with parameters "layers/<i>/weight" [sizes[i], sizes[i+1]] and
// "layers/<i>/bias" [sizes[i+1]]; the activation runs between layers, none after the last.
// The model is a sequence of Layer* (layers/layer.hpp): Linear or MoeLayer i, then an
// ActivationLayer, ..., the last Linear; forward and backward walk it without asking what
// kind each layer is.
// The layers listed in `moe` are mixture-of-experts layers (layers/moe.hpp) instead, with
// "layers/<i>/router/weight", "layers/<i>/experts/weight" and "layers/<i>/experts/bias";
// their load-balancing loss (aux_loss()) is part of the training loss, and backward()
// adds its gradient.
//
// Dropout (`dropout` P > 0, layers/dropout.hpp): a DropoutLayer after each activation
// (after every hidden layer's activation, never after the output layer), keyed by that hidden
// layer's index i; it acts only in a forward given a TrainingPass (training steps) and is the
// identity otherwise. P = 0: no dropout layer at all.
//
// Mixed precision (context.precision(), docs/mixed_precision.md): the input, every
// activation and every activation gradient are rounded to the compute dtype; the output
// gradient is multiplied by the loss scale and rounded to it before backward starts.
//
// With context.overlap(), each layer whose weight is gathered over one group (FSDP) has
// that gather started while the layer with parameters before it computes, in forward and in
// backward (Layer::start_weight_prefetch); the first layer of each pass gathers when it runs.
// And the layers that defer their reduction (DP storage) have their gradients all-reduced
// in buckets of at most context.bucket_mb() MiB (gradient_buckets.hpp), each started as soon
// as backward has computed its gradients; backward() waits for all of them before it
// returns. Not with reduce = false (GradientReduction::per_step or zero1): those gradients are
// reduced once per step by reduce_gradients() or ZeRO-1, as without overlap. Mlp::backward is
// the one place that turns the caller's choice and the model's GradientReductionPlan (which
// gradients can be left partial, layers/gradient_reduction.hpp) into what each layer does
// (LayerPass::deferred).
//
// The model owns its parameters and gradients (ShardedTensors under the specs given),
// every activation kept for backward, and the scratch shared by its layers, all allocated
// at construction for a fixed local batch: forward() and backward() allocate nothing.
//
// kind = "residual_mlp" (the second constructor; docs/models.md): the sequence is the input
// Linear "input", ResidualBlocks "blocks/<i>" (each: norm, up, activation, down; or norm, a
// SwiGlu of gate and up, down; a block listed in shape.moe.layers: norm and an MoeLayer of
// feed-forward experts, layers/moe.hpp), the output norm "output_norm" and the output Linear
// "output", with parameters in residual_mlp_parameter_shapes' order. Nothing else differs:
// the passes, the reduction plan, the buckets, the prefetch and mixed precision treat its
// layers as they treat Linear and ActivationLayer. (Dropout, when it comes, is one more layer
// in the sequence after each activation.)
//
// Driving it (llm.c style; see apps/train.cpp):
//   Mlp model(sizes, activation, spec_of, context, local_rows);
//   model.initialize(InitScheme::he_normal, seed);
//   Loss loss(LossKind::cross_entropy, context, local_rows, sizes.back(), model.output_layout());
//   Optimizer opt(settings, model.parameters());
//   GradientClipper clipper(mesh, rank, model.gradients());
//   each step:
//     MatrixView logits = model.forward(x);          // x [local_rows, sizes[0]]
//     LossResult r = loss.cross_entropy(logits, labels);   // or loss.regression(logits, targets)
//     model.backward(loss.gradient());
//     clipper.clip(model.gradients(), clip_norm, world);   // optional
//     opt.step(model.parameters(), model.gradients(), lr);

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "framework/train/init.hpp"
#include "layers/activation.hpp"
#include "layers/context.hpp"
#include "layers/dropout.hpp"
#include "layers/gradient_reduction.hpp"
#include "layers/inference.hpp"
#include "layers/linear.hpp"
#include "layers/moe.hpp"
#include "layers/norm.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

using SpecLookup = std::function<PartitionSpec(const std::string& parameter)>;
// The specs of a plan (ShardingPlan::find; bad_input for a name the plan lacks).
SpecLookup specs_from_plan(const ShardingPlan& plan);

struct ModelSection;

class Mlp;
// The model a run config's [model] section describes, kind mlp or residual_mlp (collective;
// bad_input for kind dlrm, which is a meshtrain::Dlrm).
// `shares_parameters_of`: a model of the same [model] and specs whose parameters and gradients
// this one uses (shallow Views) instead of allocating its own: a forward-only copy for other
// rows (the evaluation batch) that never holds a second copy of the model, not even while it
// is built.
std::unique_ptr<Mlp> make_model(const ModelSection& model, const SpecLookup& spec_of,
                                ParallelContext& context, int64_t local_rows,
                                const Mlp* shares_parameters_of = nullptr);

class Mlp {
 public:
  // Throws bad_input for fewer than two sizes, a size below 1, or specs whose splits do
  // not divide. Collective: every rank must construct the same model. `dropout`: a rate in
  // [0, 1), model.dropout's range, which the config checks (check_config).
  Mlp(const std::vector<int64_t>& sizes, Activation activation, const SpecLookup& spec_of,
      ParallelContext& context, int64_t local_rows, const MoeSettings& moe = {},
      double dropout = 0.0, const Mlp* shares_parameters_of = nullptr);
  // A residual_mlp of `shape` (partition/planner.hpp); `activation` inside the blocks (silu
  // for a gated shape; the experts' too in MoE blocks); `dropout` after each block's
  // activation (or SwiGLU). Throws as the first constructor does; MoE blocks have no dropout
  // (the config refuses dropout beside them).
  Mlp(const ResidualMlpShape& shape, Activation activation, const SpecLookup& spec_of,
      ParallelContext& context, int64_t local_rows, double dropout = 0.0,
      const Mlp* shares_parameters_of = nullptr);
  Mlp(const Mlp&) = delete;
  Mlp& operator=(const Mlp&) = delete;

  // Fills every parameter's local block (framework/train/init.hpp): same global weights on any
  // mesh for the same seed. Norms: scale 1, bias 0 (FeatureNorm::initialize_parameters).
  void initialize(InitScheme scheme, uint64_t seed);

  // x: this rank's rows with all input features [local_rows, sizes[0]]; it must stay
  // valid until backward(). Returns the output [local_rows, output_width()] (owned by the
  // model, valid until the next forward). `training`: the pass's place in the run (a
  // training step; dropout acts), or nullptr (evaluation, prediction: dropout is off).
  MatrixView forward(MatrixView x, const TrainingPass* training = nullptr);
  // The output of forward(x) for prediction (Predictor::predict): no backward, tangent or
  // cotangent pass may follow it, which lets the layers skip what those keep and fuse their
  // elementwise work into the GEMMs' passes (layers/inference.hpp; equal to forward within
  // rounding). forward() itself where the model computes in 16 bits or on a GPU. Allocates
  // nothing.
  MatrixView infer(MatrixView x);
  // forward(x) for the derivative passes of prediction (Predictor::jacobian): keeps what the
  // tangent and cotangent passes read, as forward() does; each Linear layer's C starts as its
  // bias and the GEMM adds the product (no zeroing pass, no bias pass; LayerPass's
  // inference_gemms). Equal to forward within rounding; forward() itself off host memory.
  // After reserve_derivative_forward() the layers also keep their slopes and normalized values
  // for the derivative passes (LayerPass::derivative_forward).
  MatrixView forward_for_derivatives(MatrixView x);
  // dLoss/dOutput [local_rows, output_width()]: overwrites every gradient. With reduce =
  // false the layers that defer their reduction (gradient_reductions(), DP storage) leave
  // this rank's partial gradients, for reduce_gradients() after accumulating
  // micro-batches, or ZeRO-1. loss_scale: output_grad is multiplied by it first (fp16 loss
  // scaling; the gradients come out scaled by it too).
  void backward(MatrixView output_grad, bool reduce = true, float loss_scale = 1.0f);
  // The same, reducing in backward exactly when `reduction` is GradientReduction::in_backward.
  void backward(MatrixView output_grad, GradientReduction reduction, float loss_scale = 1.0f) {
    backward(output_grad, reduction == GradientReduction::in_backward, loss_scale);
  }
  // The reductions backward(..., false) left out, on the gradients as they are now.
  void reduce_gradients();

  // Derivatives with respect to the input (docs/derivatives.md), of the last forward(x), for k
  // directions per row stacked sample-major (row r * k + d: row r's direction d), through every
  // layer's tangent or cotangent pass. fp32 models only (bad_input under mixed precision).
  // Collective, as forward; allocate nothing. Parameters and their gradients are not touched.
  // Forward mode: dx [local_rows * k, sizes[0]] -> the output's derivative along each,
  // [local_rows * k, output_width()] (owned by the last layer, valid until the next tangent
  // pass). Needs reserve_tangents(k') with k' >= k first.
  MatrixView forward_tangents(MatrixView dx);
  // Reverse mode: dy [local_rows * k, output_width()] (cotangents of the output) -> dy times
  // the model's Jacobian, [local_rows * k, sizes[0]]: the input gradients of k functions of
  // each row's output (owned by the first layer, valid until the next cotangent pass). Needs
  // reserve_cotangents(k') with k' >= k first.
  MatrixView backward_cotangents(MatrixView dy);
  // The same for the value rows [first_row, first_row + rows) alone: dy [rows * k,
  // output_width()] -> [rows * k, sizes[0]], the rows backward_cotangents(dy of every row) gives
  // them. A reverse pass blocked over row blocks (each block through every layer before the
  // next) keeps a block's cotangents and the forward's values it reads in cache. [0,
  // local_rows) is the pass over every row, backward_cotangents(dy) (collective where layers
  // are); a smaller block needs cotangents_by_rows() and has no collective. bad_input for rows
  // <= 0, first_row < 0, first_row + rows > local_rows, or a block where !cotangents_by_rows().
  // dy is only read (every block may be handed the same seed rows).
  MatrixView backward_cotangents(MatrixView dy, int64_t first_row, int64_t rows);
  // Whether every layer takes a block of rows in its cotangent pass (no tp, no gathered
  // parameter, no MoE or SwiGLU layer, the norms' one-pass cotangents: host memory). It
  // depends on the last forward through the layers (not infer's host path): a dropout layer
  // takes blocks after one outside training (forward_for_derivatives, as the Predictor runs)
  // and not after a training one, whose mask it keeps (DropoutLayer::cotangents_by_rows); ask
  // after the forward the cotangents are of.
  bool cotangents_by_rows() const;
  // Allocate every layer's buffers for up to `directions` per row, and the shared scratch's
  // collective-matmul workspace for them. Not collective.
  void reserve_tangents(int64_t directions);
  void reserve_cotangents(int64_t directions);
  // Every layer's reserve_derivative_forward: room for what forward_for_derivatives keeps for
  // the derivative passes (activations' slopes; norms' normalized values, only for_cotangents:
  // only the cotangent passes read them; docs/derivatives.md). Not collective.
  void reserve_derivative_forward(bool for_cotangents);
  // Training on derivatives (Sobolev training, docs/derivatives.md): after forward(x) and
  // forward_tangents(dx) with k directions, the gradients of a loss of the output (output_grad
  // [local_rows, output_width()]) and of its tangents (tangent_grad [local_rows * k,
  // output_width()]) w.r.t. every parameter, by backpropagating through the tangent pass as
  // well as the value pass (reverse over forward): overwrites every gradient, reduced as
  // backward(output_grad, reduce) reduces them (without buckets: a layer that would bucket its
  // all-reduce does it itself). The input tangents are constants (no gradient). Collective;
  // allocates nothing; needs reserve_tangent_backward(k') with k' >= k first (before the
  // forward_tangents it follows). An mlp or a residual_mlp (LayerNorm, RMSNorm or none; SwiGLU
  // or an activation; dropout, its mask that of the forward's TrainingPass) in fp32:
  // reserve_tangent_backward throws bad_input for 16-bit parameters (MoE layers included: each
  // layer's supports_tangent_backward()).
  void backward_with_tangents(MatrixView output_grad, MatrixView tangent_grad, bool reduce = true);
  void reserve_tangent_backward(int64_t directions);
  // Physics losses (the forward Laplacian, docs/derivatives.md): after forward(x), streams
  // [local_rows * 2k, sizes[0]] hold per row r, at rows 2k r .. 2k r + 2k - 1, k seed
  // directions v_d then k zero rows; the result [local_rows * 2k, output_width()] holds per row
  // the output's first derivatives along v_d, then its second derivatives v_dᵀ H v_d (H the
  // Hessian of each output by the input). backward_with_laplacian backpropagates a loss of the
  // output (output_grad) and of those streams (stream_grad, [local_rows * 2k, output_width()])
  // to every parameter, as backward_with_tangents does. reserve_laplacian(k) reserves
  // everything for k directions (each layer's reserve_tangent_backward(2k)). An mlp or a
  // residual_mlp (LayerNorm, RMSNorm or none; SwiGLU or an activation; dropout; MoE layers of
  // linear, activation or SwiGLU experts) in fp32: bad_input for 16-bit parameters (and any
  // layer whose supports_laplacian() is false).
  // Collective, as forward; allocate nothing.
  MatrixView forward_laplacian(MatrixView streams);
  void backward_with_laplacian(MatrixView output_grad, MatrixView stream_grad, bool reduce = true);
  void reserve_laplacian(int64_t directions);
  // Reserves the buffers of the blocking gradient reductions that `reduction` will run
  // (Communicator::reserve_reductions: the MPI ring's partial sums), so that the first step
  // does not grow them: every reduce-scatter, and the all-reduces of the gradients that are
  // neither in DP buckets (in_backward under overlap: they reserve their own) nor left to
  // ZeRO-1. Called once by the driver after it chose `reduction`.
  void reserve_reductions(GradientReduction reduction) const;
  // Stores as 16 bits (ShardedTensor::storage, 2 bytes an element, no fp32 buffer) the weight
  // gradients that would hold only 16-bit values: those of a plain MLP's Linear layers whose
  // weight is not gathered and whose product writes each element once (one GEMM, or a naive or
  // ring all-gather-matmul: DP, tensor-parallel and one-rank layouts) when the model computes in
  // bf16 and reduces over a bf16 wire, where gemm()'s kernel writes 16 bits
  // (partition/gradient_storage.hpp has the rule). Their backward then writes the GEMM's C rounded
  // to nearest even there, the all-reduce sums it in place (under overlap: the stored gradient
  // is its range of the DP buckets' 16-bit buffer) and the optimizer and the clipper's norm
  // widen it as they read it. Only for a driver that reduces the gradients in backward
  // (GradientReduction::in_backward) and neither scales nor accumulates them (no clipping, no
  // loss scaling, no micro-batches); call once, before reserve_reductions(). Returns how many
  // gradients it stored so.
  std::size_t store_gradients_16bit(const ParallelContext& context);

  // weight, bias of layer 0, then of layer 1, ... (an MoE layer: router, experts weight,
  // experts bias; names as in the class comment). The layers hold pointers to these
  // elements: assign them (sharing another model's memory), never resize the vectors.
  // Whoever takes the parameters to write may change the masters: the weights' 16-bit compute
  // copies (16-bit storage) are then cast again at their next use, unless the optimizer writes
  // them first (framework/train/optimizer.hpp). Read through the const overload.
  std::vector<ShardedTensor>& parameters() {
    masters_written();
    return params_;
  }
  // The masters were written through views taken earlier (a checkpoint's): the same.
  void masters_written() {
    for (ShardedTensor& p : params_) {
      if (p.copy_16bit) p.copy_16bit->current = false;
    }
  }
  const std::vector<ShardedTensor>& parameters() const { return params_; }
  std::vector<ShardedTensor>& gradients() { return grads_; }
  const std::vector<ShardedTensor>& gradients() const { return grads_; }

  // model.sizes; a residual_mlp: {inputs, outputs}.
  const std::vector<int64_t>& sizes() const { return sizes_; }
  int64_t local_rows() const { return rows_; }
  FeatureLayout output_layout() const { return sequence_.back()->output_layout(); }
  int64_t output_width() const { return sequence_.back()->output_width(); }  // local columns
  int64_t output_offset() const { return sequence_.back()->output_offset(); }
  // The model: every layer in order, activations included.
  const std::vector<Layer*>& sequence() const { return sequence_; }
  // The linear layers, in order (MoE layers are in moe_layers()); a residual_mlp's (its MoE
  // blocks' MoeLayers too) are inside its sequence's blocks, not here.
  const std::vector<Linear>& layers() const { return linear_; }
  const std::vector<MoeLayer>& moe_layers() const { return moe_; }
  // The MoE layers' load-balancing losses of the last forward, summed (0 without MoE).
  double aux_loss() const;
  // Which gradients a backward with reduce = false leaves partial, over which group (per
  // layer of sequence(), and per parameter in parameters() order: what ZeRO-1 reads).
  const GradientReductionPlan& gradient_reductions() const { return reductions_; }
  // One line per layer with parameters (Layer::describe).
  std::vector<std::string> describe() const;
  // Whether the activations kept for backward live in 16-bit buffers (the plain constructor: all
  // of them; a residual_mlp: its blocks' hidden activations).
  bool keeps_16bit_activations() const { return keeps_16bit_ || hidden_16bit_; }
  // Whether a residual_mlp also keeps its residual stream and its norms' inputs and outputs as
  // 16 bits (the residual constructor).
  bool keeps_16bit_residual_stream() const { return stream_16bit_; }
  // The DP gradient buckets (empty when overlap is off or no layer has DP storage).
  const GradientBuckets& gradient_buckets() const { return buckets_; }

 private:
  MatrixView forward_pass(MatrixView x, const TrainingPass* training, bool for_derivatives);
  // forward_tangents / backward_with_tangents, the streams second-order (LayerPass) or not.
  MatrixView tangent_pass(MatrixView dx, bool second_order);
  // bad_input, one sentence, unless every layer supports the forward Laplacian.
  void require_laplacian_layers() const;
  void reserve_layers_tangent_backward(int64_t streams);
  void backward_through_tangents(MatrixView output_grad, MatrixView tangent_grad, bool reduce,
                                 bool second_order);
  std::vector<int64_t> sizes_;
  Activation activation_;
  int64_t rows_;
  int64_t laplacian_directions_ = 0;  // reserve_laplacian's k (0: not reserved)
  std::vector<ShardedTensor> params_;
  std::vector<ShardedTensor> grads_;
  // The layers, owned per kind (reserved at construction: the pointers below stay valid)...
  std::vector<Linear> linear_;
  std::vector<MoeLayer> moe_;
  std::vector<ActivationLayer> activations_;
  std::vector<DropoutLayer> dropouts_;  // the plain MLP's; empty without dropout
  // A residual_mlp's layers (the input and output Linear, the blocks, the output norm), and
  // its norms (initialized to scale 1, bias 0).
  std::vector<std::unique_ptr<Layer>> owned_;
  std::vector<FeatureNorm*> norms_;
  // ...and the model as the passes see it.
  std::vector<Layer*> sequence_;
  std::vector<std::string> trace_names_;  // trace_name(): made on the first traced step
  const char* trace_name(size_t k);
  // Per layer: the layer whose weight gather starts while it computes, in forward and in
  // backward (nullptr: none; all nullptr without overlap).
  std::vector<Layer*> forward_prefetch_;
  std::vector<Layer*> backward_prefetch_;
  // Parameters and gradients under their specs (those of `shares` when given); checks rows.
  void allocate(const std::vector<ParameterShape>& shapes, const SpecLookup& spec_of,
                ParallelContext& context, const Mlp* shares);
  // After sequence_ is built: prefetch, scratch, buffers, the reduction plan, the buckets.
  void finish(ParallelContext& context);
  Dtype compute_dtype_ = Dtype::fp32;  // context.precision().param
  Matrix input_;  // the input cast to the compute dtype (empty in fp32 and with 16-bit storage)
  // 16-bit storage (the plain constructor explains it): the two fp32 working buffers
  // [rows, widest local input or output], and the input kept for the first layer's backward
  // (empty under a feature axis: the first layer keeps its slice of the raw batch); under a
  // feature axis where gemm() reads 16 bits, the last layer's dY as 16 bits [rows, out_local]
  // (the hidden layers pack theirs over their activation's kept output).
  bool keeps_16bit_ = false;
  Matrix work_[2];
  HalfMatrix input_16bit_;
  HalfMatrix output_grad_16bit_;
  MatrixView work_view(size_t buffer, int64_t width) const;  // work_[buffer] as [rows, width]
  // A residual_mlp's 16-bit storage of its blocks' hidden activations (the residual constructor
  // explains it): the one fp32 working buffer [rows, hidden] its blocks share, and a second one
  // for SwiGLU blocks' gate projections.
  bool hidden_16bit_ = false;
  Matrix hidden_work_, gate_work_;
  // And with norms, its residual stream (the residual constructor explains it): the stream, the
  // norms' outputs and the down projections' outputs, and the input-gradient stream, fp32
  // [rows, width] each, shared by every block.
  bool stream_16bit_ = false;
  Matrix stream_, norm_work_, stream_grad_;
  Matrix output_grad_;  // the output gradient, scaled and cast (empty in plain fp32)
  LayerScratch scratch_;
  inference::Sequence inference_;  // sequence_ as infer() runs it
  GradientReductionPlan reductions_;
  GradientBuckets buckets_;  // empty unless overlap is on and some layer defers its reduction
};

}  // namespace meshtrain
