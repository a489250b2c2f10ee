#pragma once
// Which activations and weights mixed precision keeps in 16-bit storage (docs/mixed_precision.md,
// "Compute and memory on this build"): the conditions the model (layers/mlp.cpp) and the memory
// plan (framework/train/memory_plan.cpp) share, so the two cannot disagree.

#include <cstdint>
#include <vector>

#include "partition/linear_layout.hpp"

namespace meshtrain {

// A weight gathered over exactly one group of axes (FSDP): its 16-bit copy, written by the
// optimizer, is what the gather moves (blocking or prefetched). A weight stored whole (DP, one
// rank) has one only where the GEMMs read 16-bit operands (`gemm_reads_16bit`: gemm_reads_16bit()
// of the compute dtype, framework/core/gemm.hpp): they then read the copy as it is, instead of the
// master rounded to 16 bits at every use; elsewhere its master is rounded into the fp32 buffer
// the GEMM reads, as a copy would be widened into it, so a copy would cost 2 bytes a parameter
// and save no pass. A weight gathered over two groups is gathered from its master.
inline bool keeps_16bit_weight_copy(const LinearLayout& layout, bool gemm_reads_16bit) {
  const bool dim0 = !layout.weight_gather_dim0.empty(), dim1 = !layout.weight_gather_dim1.empty();
  return dim0 != dim1 || (!dim0 && !dim1 && gemm_reads_16bit);
}

// What a model is, as far as 16-bit activation storage cares.
struct ActivationStorageQuery {
  bool sixteen_bit_compute = false;  // a 16-bit param_dtype (and storage not switched off)
  bool residual = false;             // kind = "residual_mlp" (plain or SwiGLU blocks alike)
  bool norms = false;                // residual_mlp: a norm in each block and at the output
  bool moe = false;                  // any MoE layer
  bool dropout = false;              // model.dropout > 0
  int feature_parallel = 1;          // the size of the mesh's feature axis (1: none)
  // Under a feature axis (feature_parallel > 1): whether every Linear of a plain MLP is
  // tensor-parallel row-parallel (row_parallel_only below), as tp, dp_tp and fsdp_tp lay
  // it out.
  bool row_parallel_layers = false;
};

// Whether every layer of a plain MLP is tensor-parallel and row-parallel (its weight's rows split
// over the feature axis: a sliced or split input, an output split or all-reduced), the layouts a
// plain MLP's 16-bit storage supports under a feature axis (layers/linear.cpp).
inline bool row_parallel_only(const std::vector<LinearLayout>& layouts) {
  if (layouts.empty()) return false;
  for (const LinearLayout& l : layouts) {
    if (!l.tensor_parallel || l.column_parallel) return false;
  }
  return true;
}

// Which activations live in 16-bit buffers.
struct ActivationStorage {
  bool plain = false;            // a plain mlp: the input and every activation kept, shared work
  bool residual_hidden = false;  // a residual_mlp's blocks' hidden activations (SwiGLU's too)
  bool residual_stream = false;  // and its residual stream and norms (needs residual_hidden)
};

// Nothing with MoE layers or dropout. Under a feature axis (the mesh's feature axis has size > 1,
// whether or not the rules split a layer over it) only a plain MLP whose layers are all
// row-parallel (row_parallel_layers: tp, dp_tp, fsdp_tp): elsewhere (a residual_mlp, a layer
// column-parallel or replicated) the layers' buffers stay fp32 holding 16-bit values. The
// residual stream needs the norms, which keep it.
inline ActivationStorage sixteen_bit_activation_storage(const ActivationStorageQuery& q) {
  ActivationStorage s;
  const bool applies = q.sixteen_bit_compute && !q.moe && !q.dropout;
  const bool no_feature_axis = q.feature_parallel == 1;
  s.plain = applies && !q.residual && (no_feature_axis || q.row_parallel_layers);
  s.residual_hidden = applies && no_feature_axis && q.residual;
  s.residual_stream = s.residual_hidden && q.norms;
  return s;
}

// A plain MLP's weight under a feature axis where its activations have no 16-bit storage
// (sixteen_bit_activation_storage's plain is false: dropout, MoE, or a layer column-parallel or
// replicated; they stay fp32 buffers holding 16-bit values) has a 16-bit compute copy, written by
// the optimizer as for DP and FSDP, where the GEMMs read 16-bit operands (`gemm_reads_16bit`) and
// the weight is not gathered (stored as its compute block): the GEMMs and the collective matmuls
// around them (framework/comm/collective_matmul.hpp) read the copy as it is, instead of the master
// rounded to 16 bits at every use; a weight gathered over an FSDP axis as well has none. With
// 16-bit storage (row-parallel: tp, dp_tp, fsdp_tp) the copy is decided by keeps_16bit_weight_copy
// above, as without a feature axis: there fsdp_tp's weight, gathered over the FSDP axis only, has
// one, and its gather moves it.
inline bool keeps_feature_parallel_weight_copy(const ActivationStorageQuery& q,
                                               const LinearLayout& layout, bool gemm_reads_16bit) {
  return q.sixteen_bit_compute && !q.residual && q.feature_parallel > 1 && gemm_reads_16bit &&
         layout.weight_gather_dim0.empty() && layout.weight_gather_dim1.empty();
}

// Floats of the shared weight scratch (scratch.weight) a weight's d1 x d2 compute block needs:
// the block gathered (`gathered`), or its stored block rounded to 16 bits (`sixteen_bit_compute`:
// a 16-bit compute dtype), widened to fp32 for the GEMMs. Where the weight has a 16-bit compute
// copy (`copy`) and gemm()'s kernel reads 16 bits as stored (`kernel_reads_16bit`:
// gemm_kernel_reads_16bit() of the compute dtype, framework/core/gemm.hpp, passed in so that
// partition does not depend on framework), the GEMMs read it only as 16 bits: gathered, its
// blocks put in place in the scratch's bytes, 2 bytes an element (d1 d2 / 2 floats, rounded up);
// stored whole, the copy itself, nothing in the scratch. The model
// (ShardedParameter::scratch_needs) and the memory plan (framework/train/memory_plan.cpp) both
// size it by this.
inline int64_t weight_scratch_floats(int64_t d1, int64_t d2, bool gathered,
                                     bool sixteen_bit_compute, bool copy, bool kernel_reads_16bit) {
  if (copy && kernel_reads_16bit) return gathered ? (d1 * d2 + 1) / 2 : 0;
  return gathered || sixteen_bit_compute ? d1 * d2 : 0;
}

// Whether a Linear's gathered weight gradient (FSDP: `layout` gathers its weight) is written as
// 16 bits by its GEMM (ShardedParameter::take_16bit_gradient; docs/mixed_precision.md, cast
// point 8): its reduce-scatter sends it first, in a wire of the 16-bit compute dtype
// (`wire_is_16bit_compute`: a 16-bit param_dtype and reduce_dtype = param_dtype), one GEMM writes
// it (not tensor parallelism's all-gather-matmuls: runs_collective_matmuls), and
// gemm_to_16bit's kernel writes 16 bits (`kernel_writes_16bit`: gemm_kernel_writes_16bit() of the
// compute dtype, passed in). The layer (layers/linear.cpp) and the memory plan
// (framework/train/memory_plan.cpp) both ask it.
inline bool writes_16bit_gathered_gradient(const LinearLayout& layout, bool wire_is_16bit_compute,
                                           bool kernel_writes_16bit) {
  return layout.gathers_weight() && wire_is_16bit_compute && kernel_writes_16bit &&
         !layout.runs_collective_matmuls();
}

// Floats of the shared gradient scratch (scratch.grad) a weight's d1 x d2 compute block needs:
// none stored whole (its gradient is the stored one), d1 d2 gathered, or, written as 16 bits
// (above), 2 bytes an element (d1 d2 / 2 floats, rounded up; also where a blocking gather of a
// 16-bit copy lands, but dim-0 blocks read as 16 bits, which land in the weight scratch).
// ShardedParameter::scratch_needs and the memory plan size it by this.
inline int64_t gradient_scratch_floats(int64_t d1, int64_t d2, bool gathered, bool written_16bit) {
  if (!gathered) return 0;
  return written_16bit ? (d1 * d2 + 1) / 2 : d1 * d2;
}

// A Linear's copy of its input (its block of a replicated input, `slices_input`: the first layer
// of a row-parallel MLP; or its gathered input): under a plain MLP's 16-bit storage (`storage`)
// a sliced input is kept as 16 bits where gemm()'s kernel reads them as stored
// (`kernel_reads_16bit`: gemm_kernel_reads_16bit() of the compute dtype, as for the weight
// scratch above), where forward's product and the weight gradient read it as it is; elsewhere
// an fp32 buffer as without storage. Whether it is 16-bit, and its bytes: the layer
// (layers/linear.cpp) and the memory plan (framework/train/memory_plan.cpp) both ask these.
inline bool keeps_16bit_sliced_input(bool storage, bool slices_input, bool kernel_reads_16bit) {
  return storage && slices_input && kernel_reads_16bit;
}
inline int64_t sliced_input_bytes(int64_t rows, int64_t cols, bool storage, bool slices_input,
                                  bool kernel_reads_16bit) {
  return rows * cols *
         (keeps_16bit_sliced_input(storage, slices_input, kernel_reads_16bit) ? 2 : 4);
}

}  // namespace meshtrain
