#pragma once
// The compute layout of a fully connected layer y = x W + b (W [in, out], b [out]) and the
// collectives it runs per training step, decided from the parameters' specs alone
// (docs/design.md, "Training modes"). Pure arithmetic, no MPI or Kokkos: layers/linear.cpp builds
// its buffers and communicators from this decision, and the planner reports it, so the two cannot
// disagree.
//
// The decision (feature axis of size T, batch axes B; "active" = in the mesh, size > 1):
//   TP when T > 1 and the weight's dim-0 entry starts with the feature axis: the layer
//     works on the feature block of its input (in/T columns) and the matching weight rows.
//     Its output is reduce-scattered over the features (split, out/T columns) when out
//     divides by T; otherwise all-reduced and kept replicated (the note says so).
//   column-parallel (Megatron's column split) when T > 1, the weight's dim-1 entry starts
//     with the feature axis and its dim-0 entry does not hold it: the layer computes its
//     output columns block t, Y_t = X_full @ W[:, block t] (+ bias block t), out/T columns,
//     split over the features with no reduction. A split input is all-gathered over the
//     features (an all-gather-matmul: the K blocks of X accumulate); a replicated one is used
//     as it is. Backward: dX = dY_t @ W_tᵀ is a partial sum over the feature ranks,
//     reduce-scattered over them (a matmul-reduce-scatter) when the input arrived split,
//     all-reduced when replicated; dW_t = X_fullᵀ @ dY_t, X_full gathered again (an
//     all-gather-matmul, as Megatron's sequence parallelism does: the layer keeps only its
//     input block, not [rows, in] per layer, and the gather overlaps the GEMM). Out not
//     divisible by T is bad_input naming the weight (the presets' planner replicates such a
//     dim instead, and the layer is then replicated).
//   replicated otherwise: full input (gathered over the feature axis when it arrives
//     split), full weight, replicated output.
//   Storage: the remaining active axes of the weight's dim-0 entry and those of its dim-1
//     entry are gathered before use (forward and again backward) and the gradient is
//     reduce-scattered over them; the gradient is divided by the size of the gathered axes
//     that are not batch axes (replicated compute: identical contributions). Batch axes
//     the gathers do not cover get a weight-gradient all-reduce.
//   Bias: gathered over its active axes, except that a split output whose bias entry
//     starts with the feature axis gathers only the rest (its block is then the compute
//     block); its gradient is one all-reduce of the full-width vector over the batch axes
//     (and the feature axis when the output is split). A column-parallel layer whose bias is
//     stored as exactly its compute block (P(tp)) writes its gradient straight into the
//     stored block and all-reduces it over the batch axes only (bias_direct).

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "partition/collectives.hpp"
#include "partition/logical_axes.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

// How the feature (column) dimension of an activation is laid out over the feature axis:
// every rank has all features, or rank t of the feature axis has the column block t.
enum class FeatureLayout { replicated, split };
const char* to_string(FeatureLayout layout);

// The mesh axes layers split the batch rows over and the one they split features over.
struct LayerAxes {
  std::vector<std::string> batch;  // major to minor
  std::string feature;             // "" = none
};
// From the logical axes: batch = axes_of("batch"), then axes_of("sequence"), feature =
// axes_of("hidden"), which must be at most one mesh axis (bad_input otherwise). An MLP's rows
// are its tokens, so sequence parallelism (`sp`) splits them like the batch axes (as
// Megatron's sequence parallelism splits tokens outside the tensor-parallel regions).
// with_experts (a model with MoE layers): the axes of `expert` are batch axes too, appended
// (minor) where not already listed: outside its experts an MoE model splits rows over them
// like over the other batch axes.
LayerAxes layer_axes(const LogicalAxes& logical, bool with_experts = false);
// `axes` on `mesh`: axes the mesh lacks dropped (they are of size 1). Throws bad_input when
// the feature axis (size > 1) also splits the batch.
LayerAxes layer_axes_on(const Mesh& mesh, LayerAxes axes);

// A parameter as the layout sees it.
struct LinearParameter {
  std::string name;
  std::vector<int64_t> shape;
  PartitionSpec spec;
};

struct LinearLayout {
  std::string layer;  // "layers/0"
  int64_t in = 0, out = 0;
  std::string feature_axis;      // "" when the mesh has none
  int tp = 1;                    // size of the feature axis
  bool tensor_parallel = false;  // row-parallel: the weight's dim 0 split over the feature axis
  bool column_parallel = false;  // the weight's dim 1 split over the feature axis (see above)
  bool split_output = false;     // (TP and out % tp == 0) or column-parallel
  FeatureLayout input_layout = FeatureLayout::replicated;
  int64_t in_compute = 0;  // rows of the weight's compute block (columns of the input used)
  int64_t out_local = 0;   // columns of the output
  int64_t stored_rows = 0, stored_cols = 0;  // the weight's local block

  // Weight storage -> compute block: gathers over these active axes, dim 0 then dim 1.
  std::vector<std::string> weight_gather_dim0, weight_gather_dim1;
  // Batch axes the gathers do not cover: the weight gradient is all-reduced over them.
  std::vector<std::string> weight_allreduce;
  // Product of the sizes of the gathered axes that are not batch axes (gradient divisor).
  int nonbatch_replication = 1;

  // Bias: all-gathered over bias_gather; with bias_gather_sliced the gathered vector is the
  // compute block (it starts at the output offset), otherwise the full vector.
  std::vector<std::string> bias_gather;
  bool bias_gather_sliced = false;
  int64_t bias_stored = 0;               // local bias elements
  std::vector<std::string> bias_reduce;  // the bias gradient's all-reduce axes
  // SwiGLU's gate and up fed the same split input, both column-parallel, share one gather:
  // the SwiGLU all-gathers the input once (each is decided as fed a replicated input) and
  // reduce-scatters the sum of their input gradients once, which each leaves as this rank's
  // partial sum (set by the builder, see shares_input_gather).
  bool input_grad_partial = false;
  bool bias_direct = false;  // column-parallel, bias stored as its compute block: the gradient
                             // is reduced in place at out_local elements, over the batch axes

  std::vector<std::string> notes;  // for the plan: the all-reduce fallback, replicated compute

  // A TP layer fed a replicated input slices its block locally (and all-gathers the input
  // gradient back); a replicated layer fed a split input all-gathers it first.
  // A column-parallel layer fed a split input all-gathers it inside its collective matmuls
  // (column_gathers_input), not through gathers_input's separate all-gather.
  bool slices_input() const { return tensor_parallel && input_layout == FeatureLayout::replicated; }
  bool gathers_input() const {
    return !tensor_parallel && !column_parallel && input_layout == FeatureLayout::split;
  }
  bool column_gathers_input() const {
    return column_parallel && input_layout == FeatureLayout::split;
  }
  // Whether forward and backward run the collective matmuls (layer_matmul_algorithms).
  bool runs_collective_matmuls() const {
    return column_parallel ? column_gathers_input() : split_output;
  }
  // Columns of the weight's compute block (out, or out/T when column-parallel).
  int64_t compute_cols() const { return column_parallel ? out_local : out; }
  // The weight is stored split and gathered for compute (FSDP storage).
  bool gathers_weight() const { return !weight_gather_dim0.empty() || !weight_gather_dim1.empty(); }
  // DP storage: nothing gathered or replicated besides the batch, the bias reduced over the
  // weight's axes and stored whole. Such a layer can leave its gradients as this rank's
  // partial sums and all-reduce them later (Linear::backward with reduce = false): what
  // gradient accumulation and ZeRO-1 defer, and the cost model charges once per step.
  bool defers_reduction() const {
    return !weight_allreduce.empty() && !gathers_weight() && nonbatch_replication == 1 &&
           bias_reduce == weight_allreduce && (bias_stored == out || bias_direct);
  }
  int64_t input_width() const { return input_layout == FeatureLayout::split ? in / tp : in; }
  FeatureLayout output_layout() const {
    return split_output ? FeatureLayout::split : FeatureLayout::replicated;
  }
};

// The layer name of a weight: "layers/0/weight" -> "layers/0" (other names unchanged).
std::string linear_layer_name(const std::string& weight_name);

// Decides the layout of layer `layer` (see the top of this file). `input_layout` is how
// the input's features arrive (taken as replicated when the feature axis has size 1).
// Throws bad_input when the weight is not [in, out] with a bias [out], when the input
// features do not split over the feature axis but must, or when the feature axis also
// splits the batch. The specs must name only axes of the mesh (checked by the planner).
LinearLayout decide_linear_layout(const std::string& layer, const LinearParameter& weight,
                                  const LinearParameter& bias, const Mesh& mesh,
                                  const LayerAxes& axes, FeatureLayout input_layout);

// Whether a SwiGLU's gate and up, decided with the input as it arrives, share one gather of it
// (both column-parallel fed a split input): they are then decided again with a replicated
// input and input_grad_partial set.
bool shares_input_gather(const LinearLayout& gate, const LinearLayout& up);
// "TP in 784 (split 196) -> out 128 (split 32), weight gathered over (fsdp) on dim 1,
// grads all-reduced over (dp)" (without the layer name).
std::string describe_linear_layout(const LinearLayout& layout);

// The collectives one training step (forward, then backward) of the layer runs, in order.
// `rows`: the local batch rows; 0 = unknown, the activation-sized ones (input, output and
// their gradients) are then left out. `input_grad`: whether backward computes the input
// gradient (not for the first layer of a model). `bytes_per_element`: of fp32 data;
// with mixed precision the weights, biases and activations move as `precision.param` and
// the gradient reductions as `precision.reduce` (2 bytes for 16 bits).
std::vector<LayerCollective> linear_step_collectives(const LinearLayout& layout, const Mesh& mesh,
                                                     int64_t rows, bool input_grad,
                                                     int64_t bytes_per_element,
                                                     const MixedPrecision& precision = {});

// The shared gather's collectives: the input [rows, in] all-gathered along its features in
// forward and the summed input gradient reduce-scattered back in backward (`layout`: either
// projection's; nothing when rows is 0; no backward one without input_grad).
std::vector<LayerCollective> shared_gather_collectives(const LinearLayout& layout, const Mesh& mesh,
                                                       int64_t rows, bool input_grad,
                                                       int64_t bytes_per_element,
                                                       const MixedPrecision& precision = {});

}  // namespace meshtrain
