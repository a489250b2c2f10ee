#pragma once
// The layout of a norm over the feature dimension (LayerNorm, RMSNorm: layers/norm.hpp) and the
// collectives it runs per training step, decided from its parameters' specs alone, as
// decide_linear_layout does for a Linear: layers/norm.cpp builds its communicators and buffers
// from this decision, and a planner can report it, so the two cannot disagree.
//
// The decision (feature axis of size T, batch axes B; "active" = in the mesh, size > 1):
//   Features: split when T > 1 and the input arrives split (rank t has the column block t of
//     width / T), else whole. Split features need the row statistics summed over the feature
//     axis: one all-reduce of [rows] (pass 1) and, for LayerNorm, one of [rows, 2] (pass 2) in
//     forward, one of [rows, 2] (LayerNorm) or [rows] (RMSNorm) in backward; always fp32.
//   Parameters (scale, bias [width]): all-gathered over the active axes of their spec, except
//     that split features whose spec starts with the feature axis gather only the rest (the
//     gathered vector is then the compute block). Gathered in forward and again in backward.
//   Gradients: direct when no parameter is gathered and each stored block is the compute
//     block (stored whole with whole features, or P(feature axis) with split features): the
//     column sums go into the stored gradients, all-reduced over B; that all-reduce can be
//     deferred (gradient accumulation, ZeRO-1, DP buckets). Otherwise full: one all-reduce of
//     the full-width [scale | bias] gradients over B (and the feature axis when split), of
//     which each rank keeps its stored blocks, in every backward.

#include <cstdint>
#include <string>
#include <vector>

#include "partition/linear_layout.hpp"  // FeatureLayout, LayerAxes, LinearParameter, collectives
#include "partition/mesh.hpp"

namespace meshtrain {

enum class NormKind { layernorm, rmsnorm };

// The norms' eps (layers/norm.hpp says why these), here so that the export uses the same.
constexpr float kLayerNormEps = 1e-5f;            // torch.nn.LayerNorm's default
constexpr float kRmsNormEps = 1.1920928955e-07f;  // 2^-23, torch.finfo(torch.float32).eps
const char* to_string(NormKind kind);  // "layernorm", "rmsnorm"

struct NormParameterLayout {
  std::string name;
  int64_t stored = 0;               // local elements
  std::vector<std::string> gather;  // active axes all-gathered before use
  bool gather_sliced = false;       // the gathered vector is the compute block
  int64_t gathered = 0;             // elements after the gather (stored when none)
};

struct NormLayout {
  std::string layer;  // "blocks/0/norm"
  NormKind kind = NormKind::layernorm;
  int64_t width = 0;        // global features
  int64_t local_width = 0;  // features on a rank
  std::string feature_axis;
  int tp = 1;
  FeatureLayout layout = FeatureLayout::replicated;  // of the input and the output
  std::vector<NormParameterLayout> params;           // scale, then bias (LayerNorm)
  std::vector<std::string> stats_axes;               // the feature axis when split, else none
  std::vector<std::string> batch;                    // active batch axes
  bool direct = false;
  // The gradients' all-reduce axes: direct: batch; full: batch (+ the feature axis if split).
  std::vector<std::string> grad_reduce;
  bool defers_reduction() const { return direct && !batch.empty(); }
};

// Decides the layout of norm `layer` with parameters `params` (scale, and bias for LayerNorm,
// each [width]) whose input features arrive as `input_layout` (taken as replicated when the
// feature axis has size 1). Throws bad_input when the parameters are not vectors of one width,
// when their count does not fit the kind, when split features do not divide by the feature
// axis, or when the feature axis also splits the batch.
NormLayout decide_norm_layout(const std::string& layer, NormKind kind,
                              const std::vector<LinearParameter>& params, const Mesh& mesh,
                              const LayerAxes& axes, FeatureLayout input_layout);

// "layernorm 256 features (split 64 over tp), statistics all-reduced over (tp), parameters
// gathered over (fsdp), grads all-reduced over (dp)" (without the layer name).
std::string describe_norm_layout(const NormLayout& layout);

// The collectives one training step (forward, then backward) of the norm runs, in order; as
// linear_step_collectives: rows = 0 leaves out the [rows]-sized ones, input_grad says whether
// backward computes the input gradient, parameters move as precision.param and gradients as
// precision.reduce (2 bytes for 16 bits), the statistics always as fp32 (bytes_per_element).
std::vector<LayerCollective> norm_step_collectives(const NormLayout& layout, const Mesh& mesh,
                                                   int64_t rows, bool input_grad,
                                                   int64_t bytes_per_element,
                                                   const MixedPrecision& precision = {});

}  // namespace meshtrain
