#include "framework/train/zero1.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "partition/zero1_layout.hpp"

namespace meshtrain {
namespace {

// dst[0, padded) = src[first, first + count) followed by zeros.
void copy_padded(const float* src, int64_t first, int64_t count, float* dst, int64_t padded) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::zero1_pad"), Kokkos::RangePolicy<>(device_space(), 0, padded),
      KOKKOS_LAMBDA(const int64_t i) { dst[i] = i < count ? src[first + i] : 0.0f; });
}

void copy(const float* src, float* dst, int64_t count) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::zero1_copy"), Kokkos::RangePolicy<>(device_space(), 0, count),
      KOKKOS_LAMBDA(const int64_t i) { dst[i] = src[i]; });
}

// The parameter's spec with dp added, as the minor axis, to dim 0 (never a table-wise spec:
// zero1_splits keeps those whole, and dp added to `fsdp@1` would name another holder).
PartitionSpec chunk_spec(const PartitionSpec& spec, size_t rank) {
  MESHTRAIN_REQUIRE(spec.table_entry() < 0, "zero1: the table-wise spec ", spec.to_string(),
                    " has no chunk over dp");
  PartitionSpec out = spec.with_rank(rank);
  out.entries.resize(rank);
  out.entries[0].axes.push_back(kZeroAxis);
  return out;
}

}  // namespace

Zero1::Zero1(const std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads,
             std::vector<Communicator*> partial, Communicator& dp, Dtype reduce_dtype)
    : dp_(dp), reduce_dtype_(reduce_dtype), partial_(std::move(partial)) {
  MESHTRAIN_REQUIRE(params.size() == grads.size() && params.size() == partial_.size(),
                    "zero1: ", params.size(), " parameters, ", grads.size(), " gradients, ",
                    partial_.size(), " reduction groups");
  const int64_t n = dp.size();
  int64_t padded = 0, send = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardedTensor& p = params[i];
    Split s;
    ShardedTensor pc = p, gc = grads[i];
    const int64_t rows = p.box.extent.empty() ? 0 : p.box.extent[0];
    s.split = zero1_splits(p.global_shape.size(), p.spec, n) && rows > 0;
    if (s.split) {
      s.row_elements = p.box.elements() / rows;
      const auto [first_row, row_count] = zero1_rows(rows, n, dp.rank());
      s.chunk = zero1_chunk_rows(rows, n) * s.row_elements;
      s.first = first_row * s.row_elements;
      s.count = row_count * s.row_elements;
      s.divides = rows % n == 0;
      pc.spec = gc.spec = chunk_spec(p.spec, p.global_shape.size());
      pc.box.offset[0] += first_row;
      pc.box.extent[0] = row_count;
      gc.box = pc.box;
      pc.local = Kokkos::subview(p.local, std::make_pair(s.first, s.first + s.count));
      // A chunk has no 16-bit copy of its own (the optimizer would write the chunk's elements at
      // the copy's first offsets): gather() marks the whole tensor's copy stale instead.
      pc.copy_16bit.reset();
      Vector storage(p.name + "/zero1_grad_chunk", static_cast<size_t>(s.chunk));
      gc.local = Kokkos::subview(storage, std::make_pair(int64_t{0}, s.count));
      grad_chunk_storage_.push_back(storage);
      send = std::max(send, s.chunk);
      if (!s.divides) padded = std::max(padded, s.chunk * n);
    }
    splits_.push_back(s);
    param_chunks_.push_back(std::move(pc));
    grad_chunks_.push_back(std::move(gc));
  }
  padded_ = Vector("meshtrain::zero1_padded", static_cast<size_t>(padded));
  send_chunk_ = Vector("meshtrain::zero1_send_chunk", static_cast<size_t>(send));
  // The gradients' reduce-scatter over dp (send * n elements at most) now, not in a step.
  dp_.reserve_reductions(static_cast<size_t>(send * dp_.size()), reduce_dtype_);
}

void Zero1::reduce(const std::vector<ShardedTensor>& grads) {
  MESHTRAIN_REQUIRE(grads.size() == splits_.size(), "zero1: got ", grads.size(),
                    " gradients, expected ", splits_.size());
  const int64_t n = dp_.size();
  for (size_t i = 0; i < grads.size(); ++i) {
    const Split& s = splits_[i];
    const Vector& g = grads[i].local;
    Communicator* partial = partial_[i];
    if (!s.split || (partial && partial != &dp_)) {
      // Not split, or partial over another group: the whole sum first (as the layer would).
      if (partial)
        partial->all_reduce(VectorView(g.data(), g.extent(0)), ReduceOp::sum, reduce_dtype_);
      if (s.split) copy(g.data() + s.first, grad_chunks_[i].local.data(), s.count);
      continue;
    }
    float* chunk = grad_chunks_[i].local.data();
    if (!partial) {  // already summed by the layer: this rank's rows of it
      copy(g.data() + s.first, chunk, s.count);
      continue;
    }
    // Partial over dp: reduce-scatter, padded to n equal chunks when the rows do not divide.
    const float* send = g.data();
    if (!s.divides) {
      copy_padded(g.data(), 0, static_cast<int64_t>(g.extent(0)), padded_.data(), s.chunk * n);
      send = padded_.data();
    }
    dp_.reduce_scatter(ConstVectorView(send, static_cast<size_t>(s.chunk * n)),
                       VectorView(chunk, static_cast<size_t>(s.chunk)), reduce_dtype_);
  }
}

void Zero1::gather(const std::vector<ShardedTensor>& params) {
  MESHTRAIN_REQUIRE(params.size() == splits_.size(), "zero1: got ", params.size(),
                    " parameters, expected ", splits_.size());
  const int64_t n = dp_.size();
  for (size_t i = 0; i < params.size(); ++i) {
    const Split& s = splits_[i];
    if (!s.split) continue;
    const Vector& p = params[i].local;
    copy_padded(p.data(), s.first, s.count, send_chunk_.data(), s.chunk);
    float* recv = s.divides ? p.data() : padded_.data();
    dp_.all_gather(ConstVectorView(send_chunk_.data(), static_cast<size_t>(s.chunk)),
                   VectorView(recv, static_cast<size_t>(s.chunk * n)));
    if (!s.divides) copy(padded_.data(), p.data(), static_cast<int64_t>(p.extent(0)));
    if (params[i].copy_16bit) params[i].copy_16bit->current = false;  // cast again at next use
  }
}

}  // namespace meshtrain
