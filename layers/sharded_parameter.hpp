#pragma once
// One parameter of a layer as it lives sharded, the logic every layer with parameters shares:
//   storage    the model's tensor and its gradient (ParameterRef; owned by the model);
//   compute    the compute copy in the compute dtype: gathered from the stored block when
//              the storage splits it further than the layer computes (FSDP), a rounded copy
//              in 16-bit compute, or the stored block itself; with the FSDP prefetch of the
//              gather (start it while the layer before computes, wait for it when used);
//   gradient   where backward writes the compute copy's gradient, and its way back to
//              storage: reduce-scatter over the gathered axes (summed over the batch ones;
//              the non-batch ones hold equal copies, hence the divide), then all-reduce over
//              the batch axes the storage does not split. That all-reduce alone can be left
//              for later (DeferredReduction::later: gradient accumulation, ZeRO-1) when it is
//              the only communication (reduce(..., false), then all_reduce_deferred()).
//
// The compute block is [d0, d1, d2] (a matrix [in, out] is [1, in, out]), gathered over the
// axes of gather_dim1 (on d1) and gather_dim2 (on d2). Three ways to gather it and reduce its
// gradient, as the layer chooses:
//   by_dims    a matrix [d1, d2] (d0 = 1) gathered dim by dim, one collective per group,
//              into the model's shared LayerScratch (weight, grad, stage, prefetch): Linear's
//              weight. Prefetchable when exactly one group gathers.
//   as_blocks  one collective over both groups into buffers of the parameter's own, each
//              member's block then put in place (d0 may be > 1): the MoE layer's parameters,
//              which are in use together.
//   full_width_sum  a vector [width] (a bias) whose gradient is a column sum written at full
//              width: every global element, zero where this rank computed none. The compute
//              block [compute_offset, + d2) is read from the stored block, or from the
//              vector gathered in one collective over gather_dim2 into scratch.bias (it
//              starts at gathered_offset). The gradient is all-reduced at full width over
//              `allreduce` (every axis whose ranks add different parts to it: the batch
//              axes, and the feature axis when ranks compute different columns), then this
//              rank's stored block kept; nothing is reduce-scattered or divided. Only a
//              vector stored whole can leave that all-reduce for later. Variants (the
//              norms' parameters): `direct` when the stored block is the compute block, the
//              gradient then written straight into the stored gradient and all-reduced
//              there (deferrable); the gather into a buffer of the parameter's own; the
//              full-width gradient in a view the layer gives, several of which side by side
//              are all-reduced in one collective (reduce_side_by_side).
// Mixed precision: gathered (or rounded) in the compute dtype; the gradient moves and sums in
// the reduce dtype and is stored in fp32. In fp32 none of this does anything.
// A by_dims parameter whose tensor has a 16-bit compute copy (ShardedTensor::copy_16bit: a plain
// MLP's weights gathered over one group in 16-bit storage, or stored whole where gemm() reads 16
// bits, docs/mixed_precision.md) computes from
// it: the optimizer wrote
// it, so no cast pass runs; stored whole it is widened into scratch.weight, gathered (over one
// group) its 16-bit elements travel as they are, blocking into the bytes of scratch.grad (free
// until backward computes the gradient there) or prefetched into scratch.weight_16bit, and are
// widened into scratch.weight (or put there as 16 bits: compute_matrix_16bit, scratch_needs; a
// blocking gather of dim-0 blocks read as 16 bits lands in scratch.weight itself).
// A copy that is not current (the master was written some other way) is cast from it first.
// Everything is allocated at construction: nothing in compute(), gradient() or reduce().

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/layer.hpp"

namespace meshtrain {

namespace detail {
// as_blocks: element i of the gathered blocks -> its place in the compute copy
// (sharded_parameter.cpp). At namespace scope, not a private member: CUDA's extended
// lambdas cannot capture a private type.
struct GatheredBlocks;
}  // namespace detail

// How a stored block becomes the compute block (from the layer's layout).
struct ParameterGathers {
  std::vector<int64_t> compute;                       // [d0, d1, d2]
  std::vector<int64_t> stored;                        // [d0, d1 local, d2 local]
  std::vector<std::string> gather_dim1, gather_dim2;  // active axes
  std::vector<std::string> allreduce;                 // the gradient's all-reduce after those
  int nonbatch_replication = 1;                       // gradient divisor
  // full_width_sum only: the global width, where the gathered (or, without a gather, the
  // stored) vector starts in it, and where the compute block [d2] starts.
  int64_t width = 0, gathered_offset = 0, compute_offset = 0;
  bool direct = false;             // the stored block is the compute block (see above)
  bool own_gather_buffer = false;  // gathered into the parameter's buffer, not scratch.bias
  VectorView full_gradient;        // [width] where the gradient is written; empty: scratch.bias
};

enum class GatherMethod { by_dims, as_blocks, full_width_sum };

class ShardedParameter {
 public:
  ShardedParameter() = default;
  // Asks the context for the communicators (collective, see context.hpp).
  ShardedParameter(ParameterRef ref, const ParameterGathers& gathers, GatherMethod method,
                   ParallelContext& context);

  ShardedTensor& value() const { return *ref_.value; }
  ShardedTensor& grad() const { return *ref_.grad; }
  // True when the storage splits more than the compute block (FSDP).
  bool gathered() const { return gather1_ != nullptr || gather2_ != nullptr; }

  // The compute block: as_blocks flat [d0 d1 d2], by_dims the matrix [d1, d2]. Valid until
  // the layer's next use of the scratch. compute_matrix() is not for a weight with a 16-bit copy
  // where gemm()'s kernel reads 16 bits (gemm_kernel_reads_16bit): the weight scratch is then
  // sized for its 16 bits (scratch_needs) and it fails, naming the parameter.
  ConstVectorView compute(LayerScratch& scratch);
  MatrixView compute_matrix(LayerScratch& scratch);
  // With a 16-bit compute copy (has_16bit_copy(): 16-bit storage, a weight gathered over one
  // group or stored whole where gemm() reads 16 bits), for a GEMM that reads 16 bits
  // (gemm_reads_16bit): the compute block [d1, d2] as 16-bit elements, not widened: the copy itself
  // when not gathered, else the gathered blocks in the bytes of scratch.weight (landed there by a
  // blocking dim-0 gather; else put in place by one pass writing 2 bytes an element). Valid as
  // compute_matrix()'s.
  ConstHalfMatrixView compute_matrix_16bit(LayerScratch& scratch);
  bool has_16bit_copy() const { return copy_ != nullptr; }
  // by_dims with exactly one gathering group.
  bool can_prefetch() const {
    return method_ == GatherMethod::by_dims && (gather1_ != nullptr) != (gather2_ != nullptr);
  }
  // Starts gathering into scratch.prefetch; the next compute_matrix() completes it.
  void start_prefetch(LayerScratch& scratch);
  // What start_prefetch starts (can_prefetch() only): a start_all_gather over `group` of
  // `send_elements` per rank in `wire`, for the model to reserve (Communicator::
  // reserve_started_all_gathers).
  struct PrefetchGather {
    Communicator* group = nullptr;
    std::size_t send_elements = 0;
    Dtype wire = Dtype::fp32;
    bool sixteen_bit_copy = false;  // start_all_gather_16bit of the copy (no wire slot)
  };
  PrefetchGather prefetch_gather() const;
  void poll_prefetch() { prefetch_.test(); }

  // Where backward writes the compute block's gradient: the stored gradient itself when
  // nothing is gathered, else a buffer (the scratch's or the parameter's); full_width_sum:
  // the full-width vector [width] in scratch.bias.
  VectorView gradient(LayerScratch& scratch);
  MatrixView gradient_matrix(LayerScratch& scratch);  // by_dims
  // The gradient written at gradient() back to storage; all_reduce = false leaves out the
  // final all-reduce (for all_reduce_deferred()). Where the producer wrote it as 16 bits
  // (writes_16bit_gradient(all_reduce)), from gradient_matrix_16bit() instead.
  void reduce(LayerScratch& scratch, bool all_reduce = true);
  // A gradient written as 16 bits (docs/mixed_precision.md, cast point 8): a by_dims gradient
  // whose reduction sends it first, as it is, in a 16-bit wire of the compute dtype (gathered:
  // the reduce-scatter; else the blocking all-reduce of an unscaled gradient) can be written by
  // its producer as those 16 bits (gemm_to_16bit: the fp32 result rounded to nearest even, the
  // bits the packing gives), so that no fp32 gradient is written nor packed. Where gemm_to_16bit's
  // kernel writes 16 bits (gemm_kernel_writes_16bit) and the context lets it
  // (ParallelContext::writes_16bit_weight_gradients), the layer whose one GEMM writes the gradient
  // asks for it when it is built (take_16bit_gradient(), before scratch_needs()); then a gathered
  // gradient is written as 16 bits into the bytes of scratch.grad (2 bytes an element:
  // scratch_needs), an ungathered one into its all-reduce's 16-bit buffer, whenever
  // writes_16bit_gradient(all_reduce) (a gathered one always; an ungathered one when reduce()
  // all-reduces it: not left partial for later, not in DP buckets, which have their own).
  bool can_take_16bit_gradient() const;
  void take_16bit_gradient();
  // Never for a gradient stored as 16 bits (partition/gradient_storage.hpp): backward writes
  // that storage and reduce() sums it in place.
  bool writes_16bit_gradient(bool all_reduce) const {
    return grad_16bit_ && !grad().stored_16bit() && (gathered() || all_reduce);
  }
  // Where the producer writes it then (valid until reduce()); once a reduction (ungathered: the
  // all-reduce's 16-bit buffer is handed out once, reduce() sums it from there).
  HalfMatrixView gradient_matrix_16bit(LayerScratch& scratch);
  // How many reduce() calls took the gradient as 16 bits (tests: the path is taken).
  std::size_t gradients_reduced_from_16bit() const { return reduced_from_16bit_; }
  // True when reduce(scratch, all_reduce) moves the gradient at gradient_matrix() through a
  // 16-bit wire of `dtype` before anything else reads it (a reduce-scatter, or the all-reduce
  // of an ungathered, unscaled gradient): packing rounds every element to `dtype`, as
  // round_in_place would, so the caller's rounding pass is redundant (by_dims only).
  bool reduce_rounds_to(Dtype dtype, bool all_reduce) const;
  void all_reduce_deferred();
  // full_width_sum parameters whose full_gradient views lie side by side in this order, over
  // one group: their gradients reduced as reduce() does, with one all-reduce for all.
  static void reduce_side_by_side(const std::vector<ShardedParameter*>& parameters,
                                  bool all_reduce);
  // The group of the final all-reduce (nullptr: none).
  Communicator* allreduce_group() const { return allreduce_; }
  // That group when the all-reduce is the gradient's only communication (nothing gathered,
  // reduce-scattered or divided; full_width_sum: stored whole), so that partial gradients
  // may be summed first and all-reduced once (all_reduce_deferred()); else nullptr.
  Communicator* deferrable_group() const;

  // Reserves the communicators' buffers of this gradient's blocking reductions
  // (Communicator::reserve_reductions: the MPI ring's partial sums), its reduce-scatters and,
  // unless `all_reduce_in_buckets` (DP buckets started under overlap, which reserve their
  // own), its all-reduce. Called when the model is built.
  void reserve_reductions(bool all_reduce_in_buckets) const;

  // What this parameter needs of the shared scratch (by_dims only).
  LayerScratchNeeds scratch_needs() const;

 private:
  detail::GatheredBlocks blocks() const;
  // The 16-bit compute copy's bits, cast from the master first when not current.
  const uint16_t* current_copy();
  // The landed gathered blocks (see above) widened into scratch.weight as [d1, d2].
  MatrixView widen_landed(LayerScratch& scratch);
  // The same as 16-bit elements, put in place in the bytes of scratch.weight.
  ConstHalfMatrixView place_landed(LayerScratch& scratch);

  ParameterRef ref_;
  ParameterGathers g_;
  GatherMethod method_ = GatherMethod::by_dims;
  Dtype compute_ = Dtype::fp32, reduce_ = Dtype::fp32;
  // by_dims: one communicator per gathered dim; as_blocks: gather1_ over both groups.
  Communicator* gather1_ = nullptr;
  Communicator* gather2_ = nullptr;
  Communicator* allreduce_ = nullptr;
  int group2_ = 1;      // as_blocks: size of gather_dim2 (the minor part of the group)
  float scale_ = 1.0f;  // 1 / nonbatch_replication
  // by_dims prefetch: the started gather, and whether its result is still to be used (a poll
  // that finds the request complete empties it).
  Request prefetch_;
  bool prefetch_started_ = false;
  // as_blocks buffers: the compute block (gathered or rounded), its gradient, the group's
  // blocks in rank order.
  Vector block_, grad_, stage_;
  // by_dims: the tensor's 16-bit compute copy when the parameter computes from it (see above).
  std::shared_ptr<SixteenBitCopy> copy_;
  // by_dims: the gradient written as 16 bits (take_16bit_gradient), whether the context lets it,
  // and the count of reductions that took it so.
  bool grad_16bit_ = false;
  bool may_write_16bit_ = false;
  // An ungathered one: its all-reduce's 16-bit buffer as gradient_matrix_16bit handed it to the
  // producer, summed from there by reduce() (all_reduce_from_wire checks it is still valid).
  HalfMatrixView wire_written_;
  std::size_t reduced_from_16bit_ = 0;
};

}  // namespace meshtrain
