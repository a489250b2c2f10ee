#include "layers/sharded_parameter.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <utility>

#include "base/error.hpp"
#include "framework/comm/column_blocks.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "partition/sixteen_bit_storage.hpp"

namespace meshtrain {
namespace {

using Range = Kokkos::RangePolicy<>;
using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

// block = full[offset : offset + block.extent(0)]
void copy_block(VectorView full, int64_t offset, VectorView block) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::full_width_grad_block"),
      Range(device_space(), 0, static_cast<int64_t>(block.extent(0))),
      KOKKOS_LAMBDA(const int64_t j) { block(j) = full(offset + j); });
}

// A gradient stored as 16 bits (partition/gradient_storage.hpp) summed in place over `group` as
// the 16 bits they are: the 16-bit sum the fp32 gradient's all-reduce runs on its packed copy,
// without the packing and the widening (its request slot reserved when the storage was made:
// nothing allocated here).
void all_reduce_stored_16bit(Communicator& group, ShardedTensor& g) {
  Request sum = group.start_all_reduce_16bit(g.bits.data(), g.bits.extent(0), g.storage);
  sum.wait();
}

void scale_matrix(MatrixView m, float factor) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::linear_scale_grad"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { m(i, j) *= factor; });
}

}  // namespace

// Where element i of the gathered blocks (the group's members' [s0, s1, s2] blocks in rank
// order, member = i1 * group2 + i2) sits in the compute block [s0, d1, d2].
struct detail::GatheredBlocks {
  int64_t d1, d2, s1, s2, block;
  int64_t group2;
  KOKKOS_INLINE_FUNCTION int64_t compute_index(int64_t i) const {
    const int64_t member = i / block, rest = i % block;
    const int64_t e = rest / (s1 * s2), r = (rest / s2) % s1, c = rest % s2;
    const int64_t i1 = member / group2, i2 = member % group2;
    return (e * d1 + i1 * s1 + r) * d2 + i2 * s2 + c;
  }
};

ShardedParameter::ShardedParameter(ParameterRef ref, const ParameterGathers& gathers,
                                   GatherMethod method, ParallelContext& context)
    : ref_(ref),
      g_(gathers),
      method_(method),
      compute_(context.precision().param),
      reduce_(context.precision().reduce) {
  const std::vector<int64_t>& d = g_.compute;
  const int64_t compute_elements = d[0] * d[1] * d[2];
  // Communicators (collective on first use: the same calls in the same order everywhere).
  if (method == GatherMethod::by_dims) {
    MESHTRAIN_REQUIRE(d[0] == 1, "parameter '", value().name, "': gathered by dims, but ", d[0],
                      " blocks");
    gather1_ = context.comm(g_.gather_dim1);
    gather2_ = context.comm(g_.gather_dim2);
  } else if (method == GatherMethod::full_width_sum) {
    MESHTRAIN_REQUIRE(d[0] == 1 && d[1] == 1 && g_.gather_dim1.empty(), "parameter '", value().name,
                      "': a full-width sum is a vector gathered on its one dim");
    gather2_ = context.comm(g_.gather_dim2);
    const int64_t gathered = g_.stored[2] * (gather2_ ? gather2_->size() : 1);
    MESHTRAIN_REQUIRE(!g_.direct || (!gather2_ && g_.stored[2] == d[2] &&
                                     g_.gathered_offset == g_.compute_offset),
                      "parameter '", value().name,
                      "': a direct gradient needs the stored block to be the compute block");
    MESHTRAIN_REQUIRE(g_.full_gradient.extent(0) == 0 ||
                          static_cast<int64_t>(g_.full_gradient.extent(0)) == g_.width,
                      "parameter '", value().name, "': its full-width gradient is not [", g_.width,
                      "]");
    MESHTRAIN_REQUIRE(
        g_.gathered_offset <= g_.compute_offset &&
            g_.compute_offset + d[2] <= g_.gathered_offset + gathered && gathered <= g_.width,
        "parameter '", value().name, "': the gathered vector does not cover the ", "compute block");
  } else {
    std::vector<std::string> both = g_.gather_dim1;
    both.insert(both.end(), g_.gather_dim2.begin(), g_.gather_dim2.end());
    gather1_ = context.comm(both);
    group2_ = context.mesh().size_of(g_.gather_dim2);
  }
  allreduce_ = context.comm(g_.allreduce);
  scale_ = 1.0f / static_cast<float>(g_.nonbatch_replication);
  may_write_16bit_ = context.writes_16bit_weight_gradients();

  if (method == GatherMethod::by_dims) {
    const std::shared_ptr<SixteenBitCopy>& copy = value().copy_16bit;
    if (copy && !(gather1_ && gather2_)) {
      MESHTRAIN_REQUIRE(copy->dtype == compute_ && copy->bits.extent(0) == value().local.extent(0),
                        "parameter '", value().name,
                        "': its 16-bit copy is not of the compute dtype or not of its block");
      copy_ = copy;
      return;  // gathered as 16 bits into the shared scratch: no communicator scratch
    }
    if (gather2_) gather2_->reserve_scratch(static_cast<size_t>(compute_elements));
    return;  // its buffers are the shared scratch's
  }
  if (method == GatherMethod::full_width_sum) {
    // A 16-bit gather's wire staging now rather than on first use.
    const size_t stored = static_cast<size_t>(g_.stored[2]);
    if (gather2_ && compute_ != Dtype::fp32)
      gather2_->reserve_wire(stored, stored * gather2_->size());
    if (gather2_ && g_.own_gather_buffer) {
      block_ =
          Vector(value().name + "/gathered", static_cast<size_t>(g_.stored[2] * gather2_->size()));
    }
    return;  // else scratch.bias
  }
  const size_t n = static_cast<size_t>(compute_elements);
  if (gather1_ || compute_ != Dtype::fp32) block_ = Vector(value().name + "/compute", n);
  if (gather1_) {
    grad_ = Vector(value().name + "/compute_grad", n);
    stage_ = Vector(value().name + "/stage", n);
  }
}

Communicator* ShardedParameter::deferrable_group() const {
  if (method_ == GatherMethod::full_width_sum) {
    return g_.direct || g_.stored[2] == g_.width ? allreduce_ : nullptr;
  }
  return gathered() || g_.nonbatch_replication != 1 ? nullptr : allreduce_;
}

void ShardedParameter::reserve_reductions(bool all_reduce_in_buckets) const {
  const std::size_t compute =
      static_cast<std::size_t>(g_.compute[0] * g_.compute[1] * g_.compute[2]);
  const std::size_t local = grad().local.extent(0);
  if (method_ != GatherMethod::full_width_sum) {
    // The reduce-scatters send the compute block's gradient (by_dims: or less, staged).
    if (gather1_) gather1_->reserve_reductions(compute, reduce_);
    if (gather2_) gather2_->reserve_reductions(compute, reduce_);
  }
  // A gradient stored as 16 bits is summed by a started 16-bit all-reduce, whose request slot
  // Mlp::store_gradients_16bit reserves.
  if (!allreduce_ || all_reduce_in_buckets || grad().stored_16bit()) return;
  const bool full_width = method_ == GatherMethod::full_width_sum && !g_.direct;
  allreduce_->reserve_reductions(full_width ? static_cast<std::size_t>(g_.width) : local, reduce_);
}

LayerScratchNeeds ShardedParameter::scratch_needs() const {
  LayerScratchNeeds needs;
  if (method_ == GatherMethod::full_width_sum) {
    // The gathered vector and the full-width gradient, unless they live elsewhere.
    const bool gathers_there = gather2_ && !g_.own_gather_buffer;
    const bool sums_there = !g_.direct && g_.full_gradient.extent(0) == 0;
    if (gathers_there || sums_there) needs.bias = static_cast<size_t>(g_.width);
    return needs;
  }
  if (method_ != GatherMethod::by_dims) return needs;
  const int64_t d1 = g_.compute[1], d2 = g_.compute[2], s1 = g_.stored[1], s2 = g_.stored[2];
  // The fp32 compute block (gathered, or the stored block rounded to the compute dtype); where
  // gemm()'s kernel reads 16 bits as stored (not merely gemm_reads_16bit(): under
  // MESHTRAIN_GEMM_16BIT_OPERANDS=always an fp32 kernel widens into gemm()'s own scratch), a
  // weight with a copy reaches the Linear's GEMMs only through compute_matrix_16bit(): 2 bytes an
  // element, or nothing stored whole (partition/sixteen_bit_storage.hpp, weight_scratch_floats;
  // framework/train/memory_plan.cpp counts it alike). (The fp32 uses, the tangent passes, are
  // fp32-only; compute_matrix() checks the size all the same.)
  needs.weight = static_cast<size_t>(
      weight_scratch_floats(d1, d2, gathered(), compute_ != Dtype::fp32, copy_ != nullptr,
                            gemm_kernel_reads_16bit(compute_)));
  // The gathered gradient's compute block: fp32, or 16-bit elements (take_16bit_gradient).
  needs.grad = static_cast<size_t>(gradient_scratch_floats(d1, d2, gathered(), grad_16bit_));
  if (copy_) {
    // Widened into scratch.weight (or put there as 16 bits); a prefetch lands in the 16-bit
    // landing (a blocking gather in scratch.grad's bytes, or, dim-0 blocks read as 16 bits, in
    // scratch.weight itself).
    if (can_prefetch()) needs.weight_16bit = static_cast<size_t>(d1 * d2);
  } else if (can_prefetch()) {
    needs.prefetch = needs.weight;  // (a weight stored whole is never prefetched)
  }
  if (gather1_ && gather2_) needs.stage = static_cast<size_t>(std::max(d1 * s2, s1 * d2));
  return needs;
}

detail::GatheredBlocks ShardedParameter::blocks() const {
  return {g_.compute[1],
          g_.compute[2],
          g_.stored[1],
          g_.stored[2],
          g_.stored[0] * g_.stored[1] * g_.stored[2],
          group2_};
}

const uint16_t* ShardedParameter::current_copy() {
  if (!copy_->current) {
    const Vector& local = value().local;
    pack_16bit(local.data(), copy_->bits.data(), local.extent(0), compute_);
    copy_->current = true;
  }
  return copy_->bits.data();
}

namespace {
// Where a blocking gather of a 16-bit copy lands (but dim-0 blocks read as 16 bits, which land
// in scratch.weight: compute_matrix_16bit): the first half of the bytes of scratch.grad,
// the gathered weight gradient's buffer (d1 * d2 floats, twice what the d1 * d2 16-bit elements
// need), which is free whenever a weight is gathered: forward writes no weight gradient, and
// backward gathers the weight before it computes the gradient there (the layer before has
// reduce-scattered its own). A prefetch lands in scratch.weight_16bit instead (it runs while the
// layer before uses scratch.grad).
uint16_t* blocking_landing(LayerScratch& scratch) {
  return reinterpret_cast<uint16_t*>(scratch.grad.data());
}
}  // namespace

// The gathered blocks widened into scratch.weight: from scratch.weight_16bit while a prefetch is
// being completed, else from the blocking landing.
MatrixView ShardedParameter::widen_landed(LayerScratch& scratch) {
  const int64_t d1 = g_.compute[1], d2 = g_.compute[2];
  MatrixView full(scratch.weight.data(), d1, d2);
  const uint16_t* landed =
      prefetch_started_ ? scratch.weight_16bit.data() : blocking_landing(scratch);
  if (gather1_) {  // dim 0 blocks in rank order are the matrix itself
    widen_16bit(ConstHalfMatrixView(landed, d1, d2), full, compute_);
  } else {
    widen_gathered_columns(landed, full, gather2_->size(), compute_);
  }
  return full;
}

namespace {

// The n gathered blocks [n][d1][d2 / n] of a 16-bit weight put in place as the matrix [d1, d2]
// (block j holds columns [j d2 / n, (j + 1) d2 / n)), checked to divide.
void place_gathered_blocks_16bit(const uint16_t* landed, int64_t n, int64_t d1, int64_t d2,
                                 uint16_t* full) {
  const int64_t c = d2 / n;
  MESHTRAIN_REQUIRE(n >= 1 && c * n == d2, "place_gathered_blocks_16bit: ", d2, " columns are not ",
                    n, " equal column blocks");
  place_column_blocks(landed, full, d2, n, d1, c,
                      MESHTRAIN_LABEL("meshtrain::place_gathered_16bit"));
}

}  // namespace

ConstHalfMatrixView ShardedParameter::place_landed(LayerScratch& scratch) {
  const int64_t d1 = g_.compute[1], d2 = g_.compute[2];
  MESHTRAIN_REQUIRE(scratch.weight.span() * 2 >= static_cast<size_t>(d1 * d2), "parameter '",
                    value().name, "': no weight scratch to put its 16-bit blocks in");
  uint16_t* full = reinterpret_cast<uint16_t*>(scratch.weight.data());
  const uint16_t* landed =
      prefetch_started_ ? scratch.weight_16bit.data() : blocking_landing(scratch);
  // Dim 0 blocks in rank order are the matrix itself (one block of d2 columns); dim 1 blocks
  // [n][d1][d2 / n] go to their columns.
  const int64_t n = gather1_ ? 1 : static_cast<int64_t>(gather2_->size());
  place_gathered_blocks_16bit(landed, n, d1, d2, full);
  return ConstHalfMatrixView(full, d1, d2);
}

ConstHalfMatrixView ShardedParameter::compute_matrix_16bit(LayerScratch& scratch) {
  MESHTRAIN_REQUIRE(copy_ != nullptr, "parameter '", value().name, "': no 16-bit compute copy");
  const int64_t d1 = g_.compute[1], d2 = g_.compute[2];
  if (!gathered()) return ConstHalfMatrixView(current_copy(), d1, d2);
  if (prefetch_started_) {
    prefetch_.wait();
    scratch.landing_busy = false;
    const ConstHalfMatrixView placed = place_landed(scratch);  // from scratch.weight_16bit
    prefetch_started_ = false;
    return placed;
  }
  if (gather1_) {
    // Dim 0 blocks in rank order are the matrix itself: they land where the GEMMs read them,
    // with no pass to put them there (the place backward's weight gradient, written into
    // scratch.grad before dX reads the weight, cannot reach).
    MESHTRAIN_REQUIRE(scratch.weight.span() * 2 >= static_cast<size_t>(d1 * d2), "parameter '",
                      value().name, "': no weight scratch to land its 16-bit gather in");
    uint16_t* full = reinterpret_cast<uint16_t*>(scratch.weight.data());
    gather1_->all_gather_16bit(current_copy(), full, value().local.extent(0), compute_);
    return ConstHalfMatrixView(full, d1, d2);
  }
  MESHTRAIN_REQUIRE(scratch.grad.span() * 2 >= static_cast<size_t>(d1 * d2), "parameter '",
                    value().name, "': no gradient scratch to land its gather in");
  gather2_->all_gather_16bit(current_copy(), blocking_landing(scratch), value().local.extent(0),
                             compute_);
  return place_landed(scratch);
}

MatrixView ShardedParameter::compute_matrix(LayerScratch& scratch) {
  const int64_t d1 = g_.compute[1], d2 = g_.compute[2];
  MatrixView stored = value().matrix();
  // Each branch checks the buffer it writes its fp32 compute block into (the weight scratch is
  // half that size where gemm()'s kernel reads a weight with a copy as 16 bits: scratch_needs).
  const auto require_fits = [&](const Vector& buffer, const char* which) {
    MESHTRAIN_REQUIRE(buffer.extent(0) >= static_cast<size_t>(d1 * d2), "parameter '", value().name,
                      "': its fp32 compute block [", d1, ", ", d2, "] does not fit the ", which,
                      " scratch of ", buffer.extent(0), " floats");
  };
  MatrixView full(scratch.weight.data(), d1, d2);
  if (copy_) {
    require_fits(scratch.weight, "weight");
    if (!gathered()) {
      // The optimizer's 16-bit copy widened (exactly): round_P(master) without a cast pass.
      widen_16bit(ConstHalfMatrixView(current_copy(), d1, d2), full, compute_);
      return full;
    }
    if (prefetch_started_) {
      prefetch_.wait();
      scratch.landing_busy = false;
      const MatrixView widened = widen_landed(scratch);  // from scratch.weight_16bit
      prefetch_started_ = false;
      return widened;
    }
    MESHTRAIN_REQUIRE(scratch.grad.span() * 2 >= static_cast<size_t>(d1 * d2), "parameter '",
                      value().name, "': no gradient scratch to land its gather in");
    Communicator& group = gather1_ ? *gather1_ : *gather2_;
    group.all_gather_16bit(current_copy(), blocking_landing(scratch), value().local.extent(0),
                           compute_);
    return widen_landed(scratch);
  }
  if (!gathered()) {
    if (compute_ == Dtype::fp32) return stored;
    require_fits(scratch.weight, "weight");
    round_copy(stored, full, compute_);  // the fp32 master cast to the compute dtype
    return full;
  }
  // Gathered in the compute dtype: the blocks are rounded as they are packed.
  if (prefetch_started_) {
    // Started while the layer before computed: the blocks are landing in scratch.prefetch.
    // (A poll may have completed the request already; then wait() returns at once.)
    prefetch_started_ = false;
    prefetch_.wait();
    if (gather1_) {
      // Dim 1 blocks in rank order are the block itself: the landing buffer becomes the
      // weight buffer, and the old weight buffer (free: its layer is done) the landing one.
      require_fits(scratch.prefetch, "prefetch");
      std::swap(scratch.weight, scratch.prefetch);
      return MatrixView(scratch.weight.data(), d1, d2);
    }
    require_fits(scratch.weight, "weight");
    place_gathered_columns(ConstVectorView(scratch.prefetch.data(), full.span()), full,
                           gather2_->size());
    return full;
  }
  require_fits(scratch.weight, "weight");
  if (gather1_ && gather2_) {
    MatrixView stage(scratch.stage.data(), d1, g_.stored[2]);
    gather1_->all_gather(stored, stage, 0, compute_);
    gather2_->all_gather(stage, full, 1, compute_);
  } else if (gather1_) {
    gather1_->all_gather(stored, full, 0, compute_);
  } else {
    gather2_->all_gather(stored, full, 1, compute_);
  }
  return full;
}

ShardedParameter::PrefetchGather ShardedParameter::prefetch_gather() const {
  MESHTRAIN_REQUIRE(can_prefetch(), "parameter '", value().name, "' cannot be prefetched");
  return {gather1_ ? gather1_ : gather2_, value().local.extent(0), compute_, copy_ != nullptr};
}

void ShardedParameter::start_prefetch(LayerScratch& scratch) {
  const size_t gathered = static_cast<size_t>(g_.compute[1] * g_.compute[2]);
  MESHTRAIN_REQUIRE(
      can_prefetch() && !prefetch_started_ &&
          (copy_ ? scratch.weight_16bit.extent(0) : scratch.prefetch.extent(0)) >= gathered,
      "parameter '", value().name,
      "': it cannot be prefetched (gathered over two groups, already started, or a scratch "
      "made without prefetch)");
  Communicator& group = gather1_ ? *gather1_ : *gather2_;
  const Vector& stored = value().local;
  if (copy_) {
    MESHTRAIN_REQUIRE(!scratch.landing_busy, "parameter '", value().name,
                      "': its prefetch would land where another gather is landing");
    prefetch_ = group.start_all_gather_16bit(current_copy(), scratch.weight_16bit.data(),
                                             stored.extent(0), compute_);
    scratch.landing_busy = true;
    prefetch_started_ = true;
    return;
  }
  prefetch_ = group.start_all_gather(ConstVectorView(stored.data(), stored.extent(0)),
                                     VectorView(scratch.prefetch.data(), gathered), compute_);
  prefetch_started_ = true;
}

ConstVectorView ShardedParameter::compute(LayerScratch& scratch) {
  if (method_ == GatherMethod::by_dims) {
    const MatrixView m = compute_matrix(scratch);
    return ConstVectorView(m.data(), m.span());
  }
  const Vector& local = value().local;
  if (method_ == GatherMethod::full_width_sum) {
    // The stored block as it is (a 16-bit compute rounds it where it is used), or the
    // vector gathered in the compute dtype.
    const float* vector = local.data();
    if (gather2_) {
      const size_t n = static_cast<size_t>(g_.stored[2]) * gather2_->size();
      float* into = g_.own_gather_buffer ? block_.data() : scratch.bias.data();
      gather2_->all_gather(ConstVectorView(local.data(), static_cast<size_t>(g_.stored[2])),
                           VectorView(into, n), compute_);
      vector = into;
    }
    return ConstVectorView(vector + (g_.compute_offset - g_.gathered_offset),
                           static_cast<size_t>(g_.compute[2]));
  }
  if (!gather1_) {
    if (compute_ == Dtype::fp32) return ConstVectorView(local.data(), local.extent(0));
    round_copy(ConstMatrixView(local.data(), 1, local.extent(0)),
               MatrixView(block_.data(), 1, block_.extent(0)), compute_);
    return ConstVectorView(block_.data(), block_.extent(0));
  }
  // Every member's block in rank order, then each into its place of [d0, d1, d2].
  gather1_->all_gather(ConstVectorView(local.data(), local.extent(0)), VectorView(stage_),
                       compute_);
  const detail::GatheredBlocks b = blocks();
  const Vector stage = stage_, full = block_;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_place_gathered"), Range(device_space(), 0, full.extent(0)),
      KOKKOS_LAMBDA(const int64_t i) { full(b.compute_index(i)) = stage(i); });
  return ConstVectorView(block_.data(), block_.extent(0));
}

MatrixView ShardedParameter::gradient_matrix(LayerScratch& scratch) {
  if (!gathered()) return grad().matrix();
  MESHTRAIN_REQUIRE(!grad_16bit_, "parameter '", value().name,
                    "': its gathered gradient is written as 16 bits (gradient_matrix_16bit)");
  return MatrixView(scratch.grad.data(), g_.compute[1], g_.compute[2]);
}

bool ShardedParameter::can_take_16bit_gradient() const {
  if (method_ != GatherMethod::by_dims || !may_write_16bit_ || compute_ == Dtype::fp32 ||
      reduce_ != compute_ || !gemm_kernel_writes_16bit(compute_)) {
    return false;
  }
  // Gathered: the reduce-scatter sends it first. Stored whole: the blocking all-reduce sends it
  // first where nothing scales it (DP; not a weight replicated over a non-batch axis).
  return gathered() || (allreduce_ != nullptr && scale_ == 1.0f);
}

void ShardedParameter::take_16bit_gradient() {
  MESHTRAIN_REQUIRE(can_take_16bit_gradient(), "parameter '", value().name,
                    "': its gradient cannot be written as 16 bits (see can_take_16bit_gradient)");
  grad_16bit_ = true;
}

HalfMatrixView ShardedParameter::gradient_matrix_16bit(LayerScratch& scratch) {
  const int64_t d1 = g_.compute[1], d2 = g_.compute[2];
  MESHTRAIN_REQUIRE(grad_16bit_, "parameter '", value().name,
                    "': its gradient is not written as 16 bits");
  if (gathered()) {
    MESHTRAIN_REQUIRE(scratch.grad.span() * 2 >= static_cast<size_t>(d1 * d2), "parameter '",
                      value().name, "': no gradient scratch for its 16-bit gradient");
    return HalfMatrixView(reinterpret_cast<uint16_t*>(scratch.grad.data()), d1, d2);
  }
  wire_written_ = HalfMatrixView(allreduce_->all_reduce_wire(static_cast<size_t>(d1 * d2)), d1, d2);
  return wire_written_;
}

VectorView ShardedParameter::gradient(LayerScratch& scratch) {
  if (method_ == GatherMethod::by_dims) {
    const MatrixView m = gradient_matrix(scratch);
    return VectorView(m.data(), m.span());
  }
  if (method_ == GatherMethod::full_width_sum) {
    if (g_.direct) {
      const Vector& local = grad().local;
      return VectorView(local.data(), local.extent(0));
    }
    if (g_.full_gradient.extent(0) > 0) return g_.full_gradient;
    return VectorView(scratch.bias.data(), static_cast<size_t>(g_.width));
  }
  if (gather1_) return VectorView(grad_);
  const Vector& local = grad().local;
  return VectorView(local.data(), local.extent(0));
}

bool ShardedParameter::reduce_rounds_to(Dtype dtype, bool all_reduce) const {
  if (dtype == Dtype::fp32 || reduce_ != dtype || method_ != GatherMethod::by_dims) return false;
  if (gather1_ != nullptr || gather2_ != nullptr) return true;  // the reduce-scatter packs first
  return allreduce_ != nullptr && all_reduce && scale_ == 1.0f;
}

void ShardedParameter::reduce(LayerScratch& scratch, bool all_reduce) {
  const Dtype wire = reduce_;
  if (grad().stored_16bit()) {
    // A gradient stored as 16 bits of the wire's dtype (partition/gradient_storage.hpp: an
    // ungathered, unscaled by_dims weight whose backward wrote it as 16 bits): summed in place.
    MESHTRAIN_REQUIRE(
        method_ == GatherMethod::by_dims && !gathered() && scale_ == 1.0f && grad().storage == wire,
        "parameter '", value().name,
        "': its gradient is stored as 16 bits but it is not an ungathered weight "
        "reduced over a wire of that format");
    if (allreduce_ && all_reduce) all_reduce_stored_16bit(*allreduce_, grad());
    return;
  }
  if (method_ == GatherMethod::by_dims && writes_16bit_gradient(all_reduce)) {
    // Written as 16 bits of the wire's dtype: sent as they are.
    MatrixView dst = grad().matrix();
    if (!gathered()) {
      // Where the producer wrote it: the buffer all_reduce_wire handed out in backward, checked
      // there (the same buffer, no blocking 16-bit operation since).
      MESHTRAIN_REQUIRE(wire_written_.data() != nullptr, "parameter '", value().name,
                        "': its gradient was not written as 16 bits (gradient_matrix_16bit) "
                        "before reduce()");
      const HalfMatrixView written = wire_written_;
      wire_written_ = HalfMatrixView();
      allreduce_->all_reduce_from_wire(written, dst, wire);  // (unscaled, all_reduce: writes_16bit)
      ++reduced_from_16bit_;
      return;
    }
    const HalfMatrixView g = gradient_matrix_16bit(scratch);
    if (gather1_ && gather2_) {
      MatrixView stage(scratch.stage.data(), g_.stored[1], g_.compute[2]);
      gather1_->reduce_scatter_16bit(g, stage, 0, wire);
      gather2_->reduce_scatter(stage, dst, 1, wire);  // 16-bit sums: packed exactly
    } else if (gather1_) {
      gather1_->reduce_scatter_16bit(g, dst, 0, wire);
    } else {
      gather2_->reduce_scatter_16bit(g, dst, 1, wire);
    }
    if (scale_ != 1.0f) scale_matrix(dst, scale_);
    if (allreduce_ && all_reduce) allreduce_->all_reduce(dst, ReduceOp::sum, wire);
    ++reduced_from_16bit_;
    return;
  }
  if (method_ == GatherMethod::by_dims) {
    MatrixView g = gradient_matrix(scratch);
    MatrixView dst = grad().matrix();
    if (gather1_ && gather2_) {
      MatrixView stage(scratch.stage.data(), g_.stored[1], g_.compute[2]);
      gather1_->reduce_scatter(g, stage, 0, wire);
      gather2_->reduce_scatter(stage, dst, 1, wire);
    } else if (gather1_) {
      gather1_->reduce_scatter(g, dst, 0, wire);
    } else if (gather2_) {
      gather2_->reduce_scatter(g, dst, 1, wire);
    }
    if (scale_ != 1.0f) scale_matrix(dst, scale_);
    if (allreduce_ && all_reduce) allreduce_->all_reduce(dst, ReduceOp::sum, wire);
    return;
  }
  const Vector& local = grad().local;
  VectorView dst(local.data(), local.extent(0));
  if (method_ == GatherMethod::full_width_sum) {
    if (g_.direct) {  // in place in the stored gradient
      if (allreduce_ && all_reduce) allreduce_->all_reduce(dst, ReduceOp::sum, wire);
      return;
    }
    // Summed at full width, then this rank's stored block kept.
    VectorView full = gradient(scratch);
    if (allreduce_ && all_reduce) allreduce_->all_reduce(full, ReduceOp::sum, wire);
    copy_block(full, value().box.offset[0], dst);
    return;
  }
  if (gather1_) {
    // The compute block's gradient cut into the members' blocks, in rank order.
    const detail::GatheredBlocks b = blocks();
    const Vector stage = stage_, full = grad_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_cut_gradient"), Range(device_space(), 0, full.extent(0)),
        KOKKOS_LAMBDA(const int64_t i) { stage(i) = full(b.compute_index(i)); });
    gather1_->reduce_scatter(ConstVectorView(stage_.data(), stage_.extent(0)), dst, wire);
  }
  if (g_.nonbatch_replication != 1) {
    const float scale = scale_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_scale_gradient"), Range(device_space(), 0, dst.extent(0)),
        KOKKOS_LAMBDA(const int64_t i) { dst(i) *= scale; });
  }
  if (allreduce_ && all_reduce) allreduce_->all_reduce(dst, ReduceOp::sum, wire);
}

void ShardedParameter::reduce_side_by_side(const std::vector<ShardedParameter*>& parameters,
                                           bool all_reduce) {
  if (parameters.empty()) return;
  const ShardedParameter& first = *parameters.front();
  const int64_t width = first.g_.width;
  for (size_t k = 0; k < parameters.size(); ++k) {
    const ShardedParameter& p = *parameters[k];
    MESHTRAIN_REQUIRE(p.method_ == GatherMethod::full_width_sum && !p.g_.direct &&
                          p.g_.width == width && p.allreduce_ == first.allreduce_ &&
                          p.g_.full_gradient.data() ==
                              first.g_.full_gradient.data() + static_cast<int64_t>(k) * width,
                      "parameter '", p.value().name,
                      "': not a full-width gradient beside the others over the same group");
  }
  const VectorView all(first.g_.full_gradient.data(),
                       static_cast<size_t>(width) * parameters.size());
  if (first.allreduce_ && all_reduce)
    first.allreduce_->all_reduce(all, ReduceOp::sum, first.reduce_);
  for (ShardedParameter* p : parameters) {
    const Vector& local = p->grad().local;
    copy_block(p->g_.full_gradient, p->value().box.offset[0],
               VectorView(local.data(), local.extent(0)));
  }
}

void ShardedParameter::all_reduce_deferred() {
  if (!allreduce_) return;
  if (grad().stored_16bit()) {
    all_reduce_stored_16bit(*allreduce_, grad());
    return;
  }
  if (method_ == GatherMethod::by_dims) {
    allreduce_->all_reduce(grad().matrix(), ReduceOp::sum, reduce_);
  } else {
    const Vector& local = grad().local;
    allreduce_->all_reduce(VectorView(local.data(), local.extent(0)), ReduceOp::sum, reduce_);
  }
}

}  // namespace meshtrain
