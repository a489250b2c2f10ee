#pragma once
// The layer interface: what every layer of a model implements (Linear, MoeLayer,
// ActivationLayer; norms and blocks of layers later), and what a pass hands each layer.
//
// A layer is built once, for a fixed local batch. It holds its parameters as ParameterRefs
// (the tensors and their gradients are owned by the model, in parameters() order), mostly
// through a ShardedParameter each (layers/sharded_parameter.hpp: the compute copy with its
// gather and prefetch, the gradient and its reduction), asks the
// ParallelContext for the communicators it needs at construction only (collective, see
// context.hpp; a norm over split features asks for the feature axis's), and owns what it
// keeps for backward and its input gradient. forward() and backward() allocate nothing.
// Gathered weights and gradient staging live in one LayerScratch shared by all layers of a
// model: each layer says what it needs of it (scratch_needs()), the model allocates the
// maximum.
//
// The model (layers/mlp.hpp) is a sequence of Layer*: forward runs it front to back,
// backward back to front, with no dispatch on the kind of layer.
//
// Gradient reduction. A layer reduces its gradients in backward, except when the model's
// GradientReductionPlan (layers/gradient_reduction.hpp, the one place that decides which
// gradients may be left as partial sums over the batch axes: DP storage, one all-reduce per
// tensor) says it leaves them partial. Who completes those is a GradientReduction, chosen
// once by whoever drives the model (run/training_run.cpp); the model turns both into each
// backward pass's DeferredReduction (Mlp::backward), and the layer only obeys.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/comm/collective_matmul.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/gradient_buckets.hpp"

namespace meshtrain {

// Who completes the gradients a layer leaves partial (GradientReductionPlan::layer_group()).
enum class GradientReduction {
  in_backward,  // the layer, in every backward (in buckets under context.overlap())
  per_step,     // Mlp::reduce_gradients(), once per step after the micro-batches are summed
  zero1,        // ZeRO-1's reduce-scatter over dp (framework/train/zero1.hpp), once per step
};

// What one backward pass does with those gradients.
enum class DeferredReduction {
  now,         // all-reduced by the layer before its backward returns
  in_buckets,  // reported to LayerPass::buckets, whose all-reduces overlap the layers below
  later,       // left partial (GradientReduction::per_step or zero1)
};

// A parameter as a layer holds it: the model's tensor and its gradient (owned by the model).
struct ParameterRef {
  ShardedTensor* value = nullptr;
  ShardedTensor* grad = nullptr;
};

// Floats of shared scratch a layer needs; a model allocates the maximum over its layers.
struct LayerScratchNeeds {
  size_t weight = 0;  // compute block, floats; half d1*d2 where the GEMMs read it as 16 bits
  size_t grad = 0;    // compute block of a weight gradient (written as 16 bits: half d1*d2)
  size_t stage = 0;   // between the two gathers / reduce-scatters of a 2-D storage split
  size_t bias = 0;    // gathered bias / full-width bias gradient
  size_t matmul = 0;  // collective matmul workspace (bytes)
  // The fp32 landing of a prefetched weight: as `weight`, for the weights without a 16-bit copy.
  size_t prefetch = 0;
  // The 16-bit landing of a weight prefetched from its 16-bit compute copy, put from there into
  // `weight`, widened or as 16 bits (16-bit elements).
  size_t weight_16bit = 0;
  void merge(const LayerScratchNeeds& o);
};

// Shared by all layers of a model; one layer uses it at a time (a prefetch excepted).
struct LayerScratch {
  Vector weight;
  // The next layer's weight as its gather lands (rank-ordered blocks); empty without
  // prefetch. At most one layer is prefetched at a time.
  Vector prefetch;
  Vector grad;
  Vector stage;
  Vector bias;
  // A weight prefetched from its 16-bit compute copy lands here (as 16 bits; a blocking gather
  // lands in `grad`'s bytes, or dim-0 blocks read as 16 bits in `weight` itself) and goes into
  // `weight`, widened or as 16 bits; empty without prefetch.
  // `landing_busy` while a prefetch is in flight into it.
  HalfBits weight_16bit;
  bool landing_busy = false;
  CollectiveMatmulWorkspace matmul;
  explicit LayerScratch(const LayerScratchNeeds& needs = {}, bool with_prefetch = false);
};

class Layer;
class ShardedParameter;

// Where a training forward pass is in the run: what a layer with randomness of its own
// (dropout, layers/dropout.hpp) keys it on, so that it is the same on every mesh and after a
// resume. The driver (run/training_run.cpp) fills it for each micro-batch; evaluation and
// prediction pass none.
struct TrainingPass {
  uint64_t seed = 0;        // run.seed
  int64_t step = 0;         // optimizer steps done before this one (the run's counter)
  int64_t micro_batch = 0;  // index of the micro-batch in the step (gradient accumulation)
  int64_t first_row = 0;    // global row, in the micro-batch, of this rank's first row
};

// What the model hands a layer for one forward or backward.
struct LayerPass {
  LayerScratch* scratch = nullptr;
  // The layer whose weight gather may start while this one computes (FSDP overlap; nullptr:
  // none). The model names it only when it can_prefetch_weight(); a layer that does not
  // start it leaves that layer to gather when it runs.
  Layer* prefetch = nullptr;
  // Backward only. `deferred` is `now` for a layer whose gradients the plan does not defer.
  DeferredReduction deferred = DeferredReduction::now;
  GradientBuckets* buckets = nullptr;  // with DeferredReduction::in_buckets
  size_t index = 0;                    // this layer's place in the model (its bucket entry)
  float loss_scale = 1.0f;             // dY arrives times it; gradients a layer adds must be too
  // Forward only: set in a training pass, nullptr in evaluation and prediction.
  const TrainingPass* training = nullptr;
  // Forward only: a prediction's forward that derivative passes follow (Mlp::forward_for_
  // derivatives): a Linear layer may fill C with its bias first, as infer() does (GEMM beta 1).
  bool inference_gemms = false;
  // Forward only, in the same pass (Mlp::forward_for_derivatives): layers that made room for it
  // (reserve_derivative_forward) keep what their derivative passes would otherwise recompute
  // (an activation's slopes f'(z), a norm's normalized values), computed in the forward's own
  // visit of each row.
  bool derivative_forward = false;
  // Tangent passes (forward_tangents, backward_with_tangents): the forward Laplacian's streams
  // (docs/derivatives.md, "Physics losses"): each value row's 2k tangent rows are k first
  // derivatives then k diagonal second derivatives. Linear maps them as any tangents; an
  // activation adds f''(z) t_d^2 to the second-order ones (and differentiates that backward).
  bool second_order = false;
  // Cotangent passes only (backward_cotangents): dy's rows belong to the forward's value rows
  // [cotangent_first_row, cotangent_first_row + cotangent_rows) alone (the reverse pass blocked
  // over row blocks that stay in cache, Mlp::backward_cotangents(dy, first_row, rows)); 0 rows:
  // all of them. Only layers whose cotangents_by_rows() is true take a block; every
  // backward_cotangents reads it through Layer::cotangent_block_rows, which refuses the rest.
  int64_t cotangent_first_row = 0;
  int64_t cotangent_rows = 0;
};

class Layer {
 public:
  virtual ~Layer() = default;

  // x [rows, input width] (valid until backward) -> the output, owned by the layer (valid
  // until the next forward).
  virtual MatrixView forward(MatrixView x, const LayerPass& pass) = 0;
  // Inference (Mlp::infer, layers/inference.hpp): the output of forward(x) in a pass that
  // backward and the derivative passes never follow, so nothing is kept for them and the
  // output may be computed by faster kernels (equal to forward's within rounding). Valid until
  // the next forward or infer. The default is forward(x).
  virtual MatrixView infer(MatrixView x, const LayerPass& pass) { return forward(x, pass); }
  // dY [rows, output_width()] -> writes the layer's gradients (overwriting them) and, when
  // need_input_grad, returns dX [rows, input width]; otherwise an empty view. A layer may
  // write dX into dY's memory (an elementwise layer: dY is the next layer's input gradient).
  virtual MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) = 0;

  // How many of the model's parameters the layer holds (consecutive, in parameters() order).
  virtual size_t parameter_count() const { return 0; }
  // Those parameters, in that order (every parameter is a ShardedParameter).
  virtual std::vector<ShardedParameter*> sharded_parameters() { return {}; }
  // Whether backward can leave its gradients as partial sums (DeferredReduction other than
  // `now`) when all of them are deferrable (GradientReductionPlan decides).
  virtual bool can_leave_gradients_partial() const { return false; }

  // FSDP prefetch: whether start_weight_prefetch can run, starting it, letting it progress.
  virtual bool can_prefetch_weight() const { return false; }
  virtual void start_weight_prefetch(LayerScratch&) {}
  virtual void poll_weight_prefetch() {}
  virtual LayerScratchNeeds scratch_needs() const { return {}; }

  // A loss term of the last forward, times its coefficient (MoE load balancing), else 0.
  virtual double aux_loss() const { return 0.0; }

  // Forward-mode derivatives (docs/derivatives.md). After forward(x) on `rows` rows: dx
  // [rows * k, input width] holds k tangent directions per row, sample-major (row r * k + d is
  // the derivative of input row r along direction d); returns the derivative of the output
  // along each, [rows * k, output_width()], owned by the layer and valid until its next
  // tangent pass. The same GEMMs and collectives as forward, on k times the rows, without the
  // biases; piecewise-constant choices (relu's kink, MoE routing) are those of the forward.
  // Needs reserve_tangents(k') with k' >= k first; collective where forward is; allocates
  // nothing. After a forward given a TrainingPass (dropout on) it is the derivative of that
  // pass, its mask held fixed.
  virtual MatrixView forward_tangents(MatrixView dx, const LayerPass& pass);
  // Allocates what forward_tangents needs for up to `directions` per row (once; a call with no
  // more directions than before does nothing). Not collective.
  virtual void reserve_tangents(int64_t directions);
  // The directions reserve_tangents made room for (0: none).
  int64_t tangent_capacity() const { return tangent_capacity_; }

  // Reverse mode (docs/derivatives.md). After forward(x) on `rows` rows: dy [rows * k,
  // output_width()] holds k cotangents per row, sample-major (row r * k + d: direction d of
  // output row r); returns each times the layer's Jacobian, [rows * k, input width], owned by
  // the layer and valid until its next cotangent pass: the input gradients of k functions of
  // the output at once. The same GEMMs and collectives as backward's input gradient, on k times
  // the rows, with what forward kept (activations' slopes computed once for the k); no
  // parameter gradient is touched and no loss term of a layer's own (MoE load balancing) joins.
  // Needs reserve_cotangents(k') with k' >= k first; collective where backward is; allocates
  // nothing. dy is read, never written: a pass blocked over rows hands every block the same
  // seed rows (run/predictor.cpp), and a residual block adds its dy after its layers' passes.
  virtual MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass);
  // Allocates what backward_cotangents needs for up to `directions` per row (as
  // reserve_tangents).
  virtual void reserve_cotangents(int64_t directions);
  int64_t cotangent_capacity() const { return cotangent_capacity_; }
  // Whether backward_cotangents takes a block of the value rows (LayerPass::cotangent_first_row
  // and cotangent_rows) without a collective: each block's cotangents alone, the same values a
  // pass over every row gives those rows. The default: no.
  virtual bool cotangents_by_rows() const { return false; }
  // Allocates what a forward with LayerPass::derivative_forward keeps for the tangent and
  // cotangent passes after it (once; Predictor::prepare_jacobian). for_cotangents: whether
  // cotangent passes (reverse mode) will follow, not only tangent ones; what only those read (a
  // norm's x_hat) is kept only then. A layer with nothing to keep, or whose passes would not read
  // it (off host kernels, 16-bit, tp), allocates nothing: the default. Not collective.
  virtual void reserve_derivative_forward(bool /*for_cotangents*/) {}

  // Training on derivatives (Sobolev training, docs/derivatives.md): backward through the value
  // pass and the tangent pass at once (reverse over forward). After forward(x) and
  // forward_tangents(dx) with k directions: dy [rows, output_width()] is the loss's gradient
  // w.r.t. the output, dt [rows * k, output_width()] w.r.t. the output's tangents. Writes the
  // parameter gradients of both terms (overwriting them; reduced as backward's are, by
  // pass.deferred, which may not be in_buckets) and returns dX as backward does; when
  // need_input_grad, *dt_in is the gradient w.r.t. the input tangents, [rows * k, input width],
  // owned by the layer. dy may be overwritten (as backward's). Needs
  // reserve_tangent_backward(k') with k' >= k first; fp32; collective where backward is;
  // allocates nothing. The default throws: the layer is not built for it.
  virtual MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                            const LayerPass& pass, MatrixView* dt_in);
  // Allocates what forward_tangents and backward_with_tangents need for up to `directions`
  // (once). Not collective. The default throws, as backward_with_tangents.
  virtual void reserve_tangent_backward(int64_t directions);
  // Whether forward_tangents and backward_with_tangents handle the forward Laplacian's
  // second-order streams (LayerPass::second_order) exactly. Mlp::reserve_laplacian refuses a
  // model with a layer that does not (MoE); a layer's own answer, not a list of kinds.
  virtual bool supports_laplacian() const { return false; }
  // Whether backward_with_tangents handles first-order tangents (Sobolev training) exactly.
  // Mlp::reserve_tangent_backward refuses a model with a layer that does not. A layer whose
  // Laplacian backward is exact has it: the first-order backward is that backward's
  // first-order part (the second-order streams and their gradients zero), so the default
  // answer is supports_laplacian().
  virtual bool supports_tangent_backward() const { return supports_laplacian(); }

  virtual MatrixView output() const = 0;
  virtual FeatureLayout output_layout() const = 0;
  virtual int64_t output_width() const = 0;   // local output columns
  virtual int64_t output_offset() const = 0;  // first global output column held here
  // One line for logs ("" for a layer without parameters).
  virtual std::string describe() const = 0;

 protected:
  // k of a tangent (cotangent) input of `tangent_rows` rows for a layer of `rows` rows (bad
  // internal use when it is not a multiple of rows within the reserved directions); `who`
  // names the layer.
  int64_t tangent_directions(int64_t tangent_rows, int64_t rows, const std::string& who) const;
  int64_t cotangent_directions(int64_t cotangent_rows, int64_t rows, const std::string& who) const;
  // The value rows [first, first + rows) a cotangent pass is of: the pass's block
  // (LayerPass::cotangent_first_row, cotangent_rows), or all `rows` of the forward when the
  // pass's cotangent_rows is 0. Fails (internal use, `who` names the layer) for a block where
  // cotangents_by_rows() is false, or one outside [0, rows). Every backward_cotangents (and a
  // norm's cotangents_adding) starts with it, so a layer that takes no block refuses one.
  struct RowBlock {
    int64_t first = 0, rows = 0;
  };
  RowBlock cotangent_block_rows(const LayerPass& pass, int64_t rows, const std::string& who) const;
  int64_t tangent_capacity_ = 0, cotangent_capacity_ = 0;
};

// Rows [0, count) of a row-major matrix, as a view (the prefix a pass of fewer tangent
// directions than reserved uses).
inline MatrixView leading_rows(const Matrix& m, int64_t count) {
  return MatrixView(m.data(), count, m.extent(1));
}

// Rows [first, first + count) of a row-major matrix, as a view (a block of the value rows).
inline MatrixView row_block(MatrixView m, int64_t first, int64_t count) {
  return MatrixView(m.data() + first * static_cast<int64_t>(m.extent(1)), count, m.extent(1));
}

}  // namespace meshtrain
