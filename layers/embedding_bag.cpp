#include "layers/embedding_bag.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/view_ops.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {
// Named, not anonymous: template arguments of the kernels below (nvcc's extended lambdas).
namespace embedding_bag_detail {

// A table's local block read as fp32: stored as fp32, or as bf16 bits widened (exact). The
// pooling kernels take either, so a bf16 table is read as stored and summed in fp32.
struct Fp32Table {
  ConstMatrixView m;
  KOKKOS_INLINE_FUNCTION float operator()(int64_t r, int64_t c) const { return m(r, c); }
};
struct Bf16Table {
  ConstHalfMatrixView m;
  KOKKOS_INLINE_FUNCTION float operator()(int64_t r, int64_t c) const {
    return bf16_to_float(m(r, c));
  }
};

}  // namespace embedding_bag_detail

namespace {

using embedding_bag_detail::Bf16Table;
using embedding_bag_detail::Fp32Table;

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

// Integers below 2^24 are exact in a float: the counts and the row halves that travel as fp32.
constexpr int64_t kExactInFloat = int64_t{1} << 24;

KOKKOS_INLINE_FUNCTION int64_t decode_row(float high, float low) {
  return static_cast<int64_t>(high) * kExactInFloat + static_cast<int64_t>(low);
}

Range2 range2(int64_t rows, int64_t cols) {
  return Range2(device_space(), {0, 0}, {rows, cols});
}

std::string axes_text(const std::vector<std::string>& axes) {
  std::string text = "(";
  for (size_t i = 0; i < axes.size(); ++i) text += (i ? ", " : "") + axes[i];
  return text + ")";
}

// The kernels, as free functions: nvcc rejects a device lambda inside a private member.

// out[b] = the sum of the rows of bag b's ids, in order (mean: / its count; empty: 0).
template <class Table>
void pool_bags(Table table, IdView offsets, IdView values, bool mean, MatrixView out) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_pool"),
      range2(static_cast<int64_t>(out.extent(0)), static_cast<int64_t>(out.extent(1))),
      KOKKOS_LAMBDA(const int64_t b, const int64_t c) {
        float sum = 0.0f;
        for (int64_t k = offsets(b); k < offsets(b + 1); ++k) sum += table(values(k), c);
        const int64_t count = offsets(b + 1) - offsets(b);
        out(b, c) = mean && count > 0 ? sum / static_cast<float>(count) : sum;
      });
}

// grad[id] += dy[b] (mean: / the bag's count) for every id of every bag; one column per
// thread, bags and ids in order, so a row's contributions add up in batch order.
void scatter_bags(ConstMatrixView dy, IdView offsets, IdView values, bool mean, MatrixView grad) {
  const int64_t bags = static_cast<int64_t>(dy.extent(0));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_scatter"),
      device_range(0, static_cast<int64_t>(dy.extent(1))), KOKKOS_LAMBDA(const int64_t c) {
        for (int64_t b = 0; b < bags; ++b) {
          const int64_t count = offsets(b + 1) - offsets(b);
          const float g = mean && count > 0 ? dy(b, c) / static_cast<float>(count) : dy(b, c);
          for (int64_t k = offsets(b); k < offsets(b + 1); ++k) grad(values(k), c) += g;
        }
      });
}

// Owner: this table's received ids out of the exchange's ids message, source by source: the
// ids from source j are rows [id_base(j), id_base(j + 1)) here and start at row id_from(j) of
// the message.
void take_received_ids(ConstMatrixView message, int64_t received,
                       Kokkos::View<const int64_t*> id_base, Kokkos::View<const int64_t*> id_from,
                       MatrixView requests) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_take_ids"), range2(received, 3),
      KOKKOS_LAMBDA(const int64_t i, const int64_t c) {
        int j = 0;
        while (id_base(j + 1) <= i) ++j;
        requests(i, c) = message(id_from(j) + i - id_base(j), c);
      });
}

// Owner: part_start[s] = the first received id of part s (a part's ids are consecutive and
// carry its index among its source's parts), part_start[parts] = received; sums_at[s] = where
// part s's sum goes in the exchange's sums message (its source's block starts at sums_from(j),
// `dim` floats a part, in part order).
void find_part_starts(ConstMatrixView requests, int64_t received, int64_t parts,
                      Kokkos::View<const int64_t*> id_base, Kokkos::View<const int64_t*> part_base,
                      Kokkos::View<const int64_t*> sums_from, int64_t dim,
                      Kokkos::View<int64_t*> part_start, Kokkos::View<int64_t*> sums_at) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_part_starts"), device_range(0, received + 1),
      KOKKOS_LAMBDA(const int64_t i) {
        if (i == received) {
          part_start(parts) = received;
          return;
        }
        int j = 0;
        while (id_base(j + 1) <= i) ++j;
        const int64_t part = static_cast<int64_t>(requests(i, 2));
        if (i == id_base(j) || static_cast<int64_t>(requests(i - 1, 2)) != part) {
          part_start(part_base(j) + part) = i;
          sums_at(part_base(j) + part) = sums_from(j) + part * dim;
        }
      });
}

// The exchange's sums and dy messages are flat floats ([floats, 1]): a part's `dim` values
// start at the float its table's plan gives (sums_at, bag_parts, dy_at below).

// Owner: the partial sum of each part's rows, in the order of its ids, into the sums message.
template <class Table>
void pool_parts(Table table, ConstMatrixView requests, Kokkos::View<const int64_t*> part_start,
                Kokkos::View<const int64_t*> sums_at, int64_t parts, int64_t dim, MatrixView sums) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_pool_parts"), range2(parts, dim),
      KOKKOS_LAMBDA(const int64_t s, const int64_t c) {
        float sum = 0.0f;
        for (int64_t i = part_start(s); i < part_start(s + 1); ++i) {
          sum += table(decode_row(requests(i, 0), requests(i, 1)), c);
        }
        sums(sums_at(s) + c, 0) = sum;
      });
}

// Requester: out[b] = the sum of bag b's returned parts in owner order (mean: / its count).
void combine_parts(ConstMatrixView returned, Kokkos::View<const int64_t*> bag_part_offsets,
                   Kokkos::View<const int64_t*> bag_parts, IdView offsets, bool mean,
                   MatrixView out) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_combine"),
      range2(static_cast<int64_t>(out.extent(0)), static_cast<int64_t>(out.extent(1))),
      KOKKOS_LAMBDA(const int64_t b, const int64_t c) {
        float sum = 0.0f;
        for (int64_t p = bag_part_offsets(b); p < bag_part_offsets(b + 1); ++p) {
          sum += returned(bag_parts(p) + c, 0);
        }
        const int64_t count = offsets(b + 1) - offsets(b);
        out(b, c) = mean && count > 0 ? sum / static_cast<float>(count) : sum;
      });
}

// Requester: the gradient of each part, its bag's dy (mean: / the bag's count, never 0 here),
// into the dy message.
void part_gradients(ConstMatrixView dy, Kokkos::View<const int64_t*> part_bag,
                    Kokkos::View<const int64_t*> dy_at, int64_t parts, IdView offsets, bool mean,
                    MatrixView outgoing) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_part_grads"),
      range2(parts, static_cast<int64_t>(dy.extent(1))),
      KOKKOS_LAMBDA(const int64_t p, const int64_t c) {
        const int64_t b = part_bag(p);
        const int64_t count = offsets(b + 1) - offsets(b);
        outgoing(dy_at(p) + c, 0) = mean ? dy(b, c) / static_cast<float>(count) : dy(b, c);
      });
}

// Owner: each part's gradient (at sums_at in the dy message) into the rows of its ids; one
// column per thread, parts in arrival order (source rank, then bag), ids in order.
void scatter_parts(ConstMatrixView incoming, ConstMatrixView requests,
                   Kokkos::View<const int64_t*> part_start, Kokkos::View<const int64_t*> sums_at,
                   int64_t parts, MatrixView grad) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_scatter_parts"),
      device_range(0, static_cast<int64_t>(grad.extent(1))), KOKKOS_LAMBDA(const int64_t c) {
        for (int64_t s = 0; s < parts; ++s) {
          const float g = incoming(sums_at(s) + c, 0);
          for (int64_t i = part_start(s); i < part_start(s + 1); ++i) {
            grad(decode_row(requests(i, 0), requests(i, 1)), c) += g;
          }
        }
      });
}

// Sparse: grad[slot of id k] += dy[b] (mean: / the bag's count), in the order of scatter_bags.
void scatter_bags_compact(ConstMatrixView dy, IdView offsets, Kokkos::View<const int64_t*> id_slot,
                          bool mean, MatrixView grad) {
  const int64_t bags = static_cast<int64_t>(dy.extent(0));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_scatter_sparse"),
      device_range(0, static_cast<int64_t>(dy.extent(1))), KOKKOS_LAMBDA(const int64_t c) {
        for (int64_t b = 0; b < bags; ++b) {
          const int64_t count = offsets(b + 1) - offsets(b);
          const float g = mean && count > 0 ? dy(b, c) / static_cast<float>(count) : dy(b, c);
          for (int64_t k = offsets(b); k < offsets(b + 1); ++k) grad(id_slot(k), c) += g;
        }
      });
}

// Sparse, owner: each part's gradient into the slots of its ids, in the order of scatter_parts.
void scatter_parts_compact(ConstMatrixView incoming, Kokkos::View<const int64_t*> id_slot,
                           Kokkos::View<const int64_t*> part_start,
                           Kokkos::View<const int64_t*> sums_at, int64_t parts, MatrixView grad) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_scatter_parts_sparse"),
      device_range(0, static_cast<int64_t>(grad.extent(1))), KOKKOS_LAMBDA(const int64_t c) {
        for (int64_t s = 0; s < parts; ++s) {
          const float g = incoming(sums_at(s) + c, 0);
          for (int64_t i = part_start(s); i < part_start(s + 1); ++i) grad(id_slot(i), c) += g;
        }
      });
}

// Column-wise: slice = dy's columns [first, first + slice width).
void take_dy_columns(ConstMatrixView dy, int64_t first, MatrixView slice) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::embedding_bag_dy_columns"),
      range2(static_cast<int64_t>(slice.extent(0)), static_cast<int64_t>(slice.extent(1))),
      KOKKOS_LAMBDA(const int64_t b, const int64_t c) { slice(b, c) = dy(b, first + c); });
}

}  // namespace

EmbeddingBag::EmbeddingBag(std::string table, ParameterRef weight, EmbeddingPooling pooling,
                           int64_t batch_rows, int64_t max_ids, ParallelContext& context,
                           RowExchange exchange)
    : table_(std::move(table)), pooling_(pooling), batch_rows_(batch_rows), max_ids_(max_ids) {
  MESHTRAIN_REQUIRE(weight.value && weight.grad, "embedding table '", table_,
                    "': no weight or gradient tensor");
  MESHTRAIN_REQUIRE(batch_rows >= 0 && max_ids >= 0, "embedding table '", table_,
                    "': negative batch rows or id capacity");
  const ShardedTensor& w = *weight.value;
  // The sharding, from the spec (partition/embedding_layout.hpp): P() or P(batch axes, None).
  layout_ = embedding_layout(table_, {w.name, w.global_shape, w.spec}, context.mesh(),
                             LayerAxes{context.batch_axes(), context.feature_axis()});
  rows_ = layout_.rows;
  dim_ = layout_.dim;
  if (max_ids >= kExactInFloat) {
    // The per-owner counts and part indices travel as floats.
    MESHTRAIN_BAD_INPUT("embedding table '", table_, "': a capacity of ", max_ids,
                        " ids per step is too large (at most ", kExactInFloat - 1, ")");
  }
  if (!context.precision().is_fp32()) {
    MESHTRAIN_BAD_INPUT("embedding table '", table_,
                        "': mixed precision is not supported by embedding bags yet (fp32 only)");
  }
  first_row_ = w.box.offset.empty() ? 0 : w.box.offset[0];
  local_rows_ = w.box.extent.empty() ? rows_ : w.box.extent[0];
  first_col_ = w.box.offset.size() == 2 ? w.box.offset[1] : 0;
  local_dim_ = w.box.extent.size() == 2 ? w.box.extent[1] : dim_;
  MESHTRAIN_REQUIRE(w.box.extent.size() == 2 && local_dim_ == layout_.dim_per_slice,
                    "embedding table '", table_, "': its block holds ", local_dim_,
                    " columns, not the layout's ", layout_.dim_per_slice);

  // Communicators, in the same order on every rank: the owners' group, then the gradient's.
  row_comm_ = context.comm(layout_.row_axes);  // nullptr: replicated
  if (row_comm_) {
    group_ = row_comm_->size();
    me_ = row_comm_->rank();
    if (layout_.sharding == EmbeddingSharding::table_wise) {
      row_blocks_ = 0;
      // The holder has every row, the other members none.
      MESHTRAIN_REQUIRE(first_row_ == 0 && local_rows_ == (me_ == layout_.holder ? rows_ : 0),
                        "embedding table '", table_, "': rank ", me_, " of ",
                        axes_text(layout_.row_axes), " holds ", local_rows_,
                        " rows, not what table-wise placement on member ", layout_.holder,
                        " gives it");
    } else {
      MESHTRAIN_REQUIRE(first_row_ == me_ * local_rows_ && local_rows_ * group_ == rows_,
                        "embedding table '", table_, "': rank ", me_, " of ",
                        axes_text(layout_.row_axes), " holds rows from ", first_row_,
                        ", not its group index's block");
    }
  }
  if (layout_.column_slices > 1) {
    col_comm_ = context.comm(layout_.column_axes);
    // The all-gather puts rank k's slice at columns [k local_dim, (k + 1) local_dim).
    MESHTRAIN_REQUIRE(col_comm_ && first_col_ == col_comm_->rank() * local_dim_ &&
                          local_dim_ * col_comm_->size() == dim_,
                      "embedding table '", table_, "': rank ", col_comm_ ? col_comm_->rank() : -1,
                      " of ", axes_text(layout_.column_axes), " holds columns from ", first_col_,
                      ", not its group index's slice");
  }
  ParameterGathers gathers;
  gathers.compute = {1, local_rows_, local_dim_};
  gathers.stored = gathers.compute;
  gathers.allreduce = layout_.gradient_allreduce;
  weight_ = ShardedParameter(weight, gathers, GatherMethod::by_dims, context);
  weight_.reserve_reductions(false);

  out_ = Matrix("embeddings/" + table_ + "/pooled", static_cast<size_t>(batch_rows_),
                static_cast<size_t>(dim_));
  offsets_host_ =
      HostIds("embeddings/" + table_ + "/offsets_host", static_cast<size_t>(batch_rows_ + 1));
  values_host_ = HostIds("embeddings/" + table_ + "/ids_host", static_cast<size_t>(max_ids_));
  if (col_comm_) {
    out_slice_ = Matrix("embeddings/" + table_ + "/pooled_slice", static_cast<size_t>(batch_rows_),
                        static_cast<size_t>(local_dim_));
    dy_slice_ = Matrix("embeddings/" + table_ + "/dy_slice", static_cast<size_t>(batch_rows_),
                       static_cast<size_t>(local_dim_));
    const size_t slice_bytes = out_slice_.size() * sizeof(float);
    col_comm_->reserve_staging(slice_bytes, slice_bytes * static_cast<size_t>(col_comm_->size()));
    // The gather of the slices side by side (dim 1) stages through the scratch buffer.
    col_comm_->reserve_scratch(static_cast<size_t>(batch_rows_) * static_cast<size_t>(dim_));
  }
  if (!row_comm_) return;

  const size_t n = static_cast<size_t>(group_), ids = static_cast<size_t>(max_ids_);
  const size_t received = n * ids;
  for (std::vector<int64_t>* v :
       {&send_ids_, &send_parts_, &id_cursor_, &part_cursor_, &last_bag_}) {
    v->assign(n, 0);
  }
  send_part_base_.assign(n + 1, 0);
  const std::string prefix = "embeddings/" + table_ + "/";
  recv_requests_ = Matrix(prefix + "recv_requests", received, 3);
  const auto index = [&prefix](const char* name, size_t size) {
    return Kokkos::View<int64_t*>(prefix + name, size);
  };
  source_id_base_ = index("source_id_base", n + 1);
  source_id_from_ = index("source_id_from", n);
  source_part_base_ = index("source_part_base", n + 1);
  source_sums_from_ = index("source_sums_from", n);
  source_id_base_host_ = host_mirror(source_id_base_);
  source_id_from_host_ = host_mirror(source_id_from_);
  source_part_base_host_ = host_mirror(source_part_base_);
  source_sums_from_host_ = host_mirror(source_sums_from_);
  part_start_ = index("part_start", received + 1);
  part_sums_at_ = index("part_sums_at", received);
  bag_part_offsets_ = index("bag_part_offsets", static_cast<size_t>(batch_rows_ + 1));
  bag_parts_ = index("bag_parts", ids);
  part_bag_ = index("part_bag", ids);
  part_dy_at_ = index("part_dy_at", ids);
  bag_part_offsets_host_ = host_mirror(bag_part_offsets_);
  bag_parts_host_ = host_mirror(bag_parts_);
  part_bag_host_ = host_mirror(part_bag_);
  part_dy_at_host_ = host_mirror(part_dy_at_);
  // The messages: this table's own exchange, or a shared one the caller builds.
  if (exchange == RowExchange::own) {
    own_exchange_ = std::make_unique<EmbeddingExchange>(std::vector<EmbeddingBag*>{this});
  }
}

std::string EmbeddingBag::describe() const {
  std::string text =
      "embedding bag '" + table_ + "' " + format_shape({rows_, dim_}) + " " + to_string(pooling_);
  if (layout_.sharding == EmbeddingSharding::replicated) {
    text += col_comm_ ? ", rows whole" : ", replicated";
  } else if (layout_.sharding == EmbeddingSharding::table_wise) {
    text += ", table-wise on member " + std::to_string(layout_.holder) + " of " +
            axes_text(layout_.row_axes) + (me_ == layout_.holder ? " (here)" : " (not here)");
  } else {
    text += ", row-wise over " + axes_text(layout_.row_axes) + " (rows [" +
            std::to_string(first_row_) + ", " + std::to_string(first_row_ + local_rows_) +
            ") here)";
  }
  if (col_comm_) {
    text += ", column-wise over " + axes_text(layout_.column_axes) + " (columns [" +
            std::to_string(first_col_) + ", " + std::to_string(first_col_ + local_dim_) + ") here)";
  }
  return weight_.value().stored_16bit() ? text + ", stored as bf16" : text;
}

std::string EmbeddingBag::read_bags(const SparseBags& bags) {
  // The message is built only when something is wrong (a step allocates nothing).
  const auto who = [this] { return "embedding table '" + table_ + "'"; };
  if (static_cast<int64_t>(bags.offsets.extent(0)) != batch_rows_ + 1) {
    return who() + ": the bags' offsets have " + std::to_string(bags.offsets.extent(0)) +
           " entries, not batch rows + 1 = " + std::to_string(batch_rows_ + 1);
  }
  copy_view(offsets_host_, bags.offsets);
  const auto& off = offsets_host_;
  if (off(0) != 0)
    return who() + ": the bags' offsets start at " + std::to_string(off(0)) + ", not 0";
  for (int64_t b = 0; b < batch_rows_; ++b) {
    if (off(b + 1) < off(b)) {
      return who() + ": the bags' offsets decrease at bag " + std::to_string(b) + " (" +
             std::to_string(off(b)) + " then " + std::to_string(off(b + 1)) + ")";
    }
  }
  ids_ = off(batch_rows_);
  if (ids_ > max_ids_) {
    return who() + ": " + std::to_string(ids_) +
           " ids in this step's bags, more than the capacity of " + std::to_string(max_ids_) +
           " ids per step the layer was built with";
  }
  if (ids_ > static_cast<int64_t>(bags.values.extent(0))) {
    return who() + ": the bags' offsets end at " + std::to_string(ids_) + ", past the " +
           std::to_string(bags.values.extent(0)) + " ids given";
  }
  const std::pair<int64_t, int64_t> used(0, ids_);
  copy_view(Kokkos::subview(values_host_, used), Kokkos::subview(bags.values, used));
  for (int64_t b = 0; b < batch_rows_; ++b) {
    for (int64_t k = off(b); k < off(b + 1); ++k) {
      const int64_t id = values_host_(k);
      if (id < 0 || id >= rows_) {
        return who() + ": id " + std::to_string(id) + " (bag " + std::to_string(b) +
               " of this rank's batch) is outside the table's rows [0, " + std::to_string(rows_) +
               ")";
      }
    }
  }
  return "";
}

MatrixView EmbeddingBag::forward(const SparseBags& bags, const LayerPass& /*pass*/) {
  if (row_comm_) {
    // Its own exchange (a group of one table): every rank of the group throws when one has a
    // problem; the slices are all-gathered there too.
    MESHTRAIN_REQUIRE(own_exchange_ != nullptr, "embedding table '", table_,
                      "' exchanges its rows through a shared exchange, which forwards it");
    EmbeddingBag* self = this;
    own_exchange_->forward(&self, &bags);
    return out_;
  }
  const std::string problem = read_bags(bags);
  if (!problem.empty()) MESHTRAIN_BAD_INPUT(problem);
  bags_ = bags;
  forward_replicated(bags);
  // Column-wise: the slices side by side, rank k's at columns [k local_dim, (k + 1) local_dim).
  if (col_comm_) col_comm_->all_gather(out_slice_, out_, 1);
  return out_;
}

void EmbeddingBag::forward_replicated(const SparseBags& bags) {
  const ShardedTensor& w = weight_.value();
  const bool mean = pooling_ == EmbeddingPooling::mean;
  const MatrixView out = col_comm_ ? out_slice_ : out_;
  if (w.stored_16bit()) {
    pool_bags(Bf16Table{w.bits_matrix()}, bags.offsets, bags.values, mean, out);
  } else {
    pool_bags(Fp32Table{w.matrix()}, bags.offsets, bags.values, mean, out);
  }
}

int64_t EmbeddingBag::owner_of(int64_t id) const {
  // Row-wise: the block of rows_per_owner rows the id falls in; table-wise: the holder.
  return row_blocks_ ? id / layout_.rows_per_owner : layout_.holder;
}

std::string EmbeddingBag::count_requests(const SparseBags& bags, Matrix::HostMirror& counts,
                                         size_t k, size_t tables) {
  std::string problem = read_bags(bags);
  const int n = group_;
  std::fill(send_ids_.begin(), send_ids_.end(), 0);
  std::fill(send_parts_.begin(), send_parts_.end(), 0);
  std::fill(last_bag_.begin(), last_bag_.end(), -1);
  const auto& off = offsets_host_;
  const auto& ids = values_host_;
  if (problem.empty()) {
    bags_ = bags;
    // Per owner: its ids, and its parts (the bags with at least one id there).
    for (int64_t b = 0; b < batch_rows_; ++b) {
      for (int64_t k2 = off(b); k2 < off(b + 1); ++k2) {
        const size_t j = static_cast<size_t>(owner_of(ids(k2)));
        ++send_ids_[j];
        if (last_bag_[j] != b) {
          ++send_parts_[j];
          last_bag_[j] = b;
        }
      }
    }
  }
  for (int j = 0; j < n; ++j) {
    const size_t u = static_cast<size_t>(j);
    const size_t row = u * tables + k;  // rank j's block, this table's row
    send_part_base_[u + 1] = send_part_base_[u] + send_parts_[u];
    counts(row, 0) = static_cast<float>(send_ids_[u]);
    counts(row, 1) = static_cast<float>(send_parts_[u]);
    counts(row, 2) = problem.empty() ? 0.0f : 1.0f;
    counts(row, 3) = 0.0f;
  }
  sent_parts_ = send_part_base_[static_cast<size_t>(n)];
  return problem;
}

void EmbeddingBag::check_counts(const std::string& problem, const Matrix::HostMirror& counts,
                                size_t k, size_t tables) const {
  if (!problem.empty()) MESHTRAIN_BAD_INPUT(problem);
  for (int j = 0; j < group_; ++j) {
    if (counts(static_cast<size_t>(j) * tables + k, 2) != 0.0f) {
      MESHTRAIN_BAD_INPUT("embedding table '", table_, "': rank ", j, " of the ",
                          to_string(layout_.sharding), " group ", axes_text(layout_.row_axes),
                          " was given bad bags in this step (its own error names them)");
    }
  }
}

void check_received_counts(const std::string& table, int source, float ids, float parts,
                           int64_t capacity) {
  // Every comparison is false for NaN, so a NaN fails the first test.
  const bool whole = std::isfinite(ids) && std::isfinite(parts) && std::floor(ids) == ids &&
                     std::floor(parts) == parts;
  const bool bounded = whole && 0.0f <= parts && parts <= ids &&
                       static_cast<double>(ids) <= static_cast<double>(capacity) &&
                       (ids == 0.0f) == (parts == 0.0f);
  MESHTRAIN_REQUIRE(bounded, "embedding table '", table, "': rank ", source, " of the group sent ",
                    ids, " ids in ", parts,
                    " parts, not whole counts with 0 < parts <= ids <= its capacity of ", capacity,
                    " (or none)");
}

void EmbeddingBag::receive_counts(const Matrix::HostMirror& counts, size_t k, size_t tables) {
  // Each source's counts checked before they size anything: its ids at most max_ids (every
  // rank's capacity of this table; the sender checked its bags against it), its parts at most
  // its ids, so received_parts_ <= received_ids_ <= group x max_ids, the extent of
  // recv_requests_, part_start_ (+ 1) and part_sums_at_, which the kernels index up to them.
  // A violation is an internal error (a sender's bug, or a corrupted message), seen by the
  // receiving rank only: it throws alone and the others wait in the ids' all-to-all-v. That is
  // acceptable: the meshtrain command runs in run_or_abort, which ends every rank when one
  // throws (framework/comm/exit_policy.hpp); agreeing would cost a collective every step.
  received_ids_ = received_parts_ = 0;
  source_id_base_host_(0) = source_part_base_host_(0) = 0;
  for (int j = 0; j < group_; ++j) {
    const size_t u = static_cast<size_t>(j), row = u * tables + k;
    check_received_counts(table_, j, counts(row, 0), counts(row, 1), max_ids_);
    received_ids_ += static_cast<int64_t>(counts(row, 0));
    received_parts_ += static_cast<int64_t>(counts(row, 1));
    source_id_base_host_(u + 1) = received_ids_;
    source_part_base_host_(u + 1) = received_parts_;
  }
}

void EmbeddingBag::plan_requests(EmbeddingExchange& exchange, size_t k) {
  // The requests, per owner in bag order, into owner j's block of the ids message (this
  // table's rows there start at ids_out_at_); each bag's parts listed in owner order, as where
  // their sums come back (owner j's block of the returned sums, this table's floats there
  // starting at requester_at_, local_dim_ a part in part order), which is also where each
  // part's dy goes in backward.
  const auto& off = offsets_host_;
  const auto& ids = values_host_;
  Matrix::HostMirror& message = exchange.ids_send_host_;
  std::fill(id_cursor_.begin(), id_cursor_.end(), 0);
  std::fill(part_cursor_.begin(), part_cursor_.end(), 0);
  std::fill(last_bag_.begin(), last_bag_.end(), -1);
  int64_t listed = 0;
  bag_part_offsets_host_(0) = 0;
  for (int64_t b = 0; b < batch_rows_; ++b) {
    const int64_t first_part = listed;
    for (int64_t i = off(b); i < off(b + 1); ++i) {
      const int64_t id = ids(i);
      const size_t j = static_cast<size_t>(owner_of(id));
      const size_t at = exchange.at(static_cast<int>(j), k);
      const int64_t local = id - static_cast<int64_t>(j) * layout_.rows_per_owner * row_blocks_;
      if (last_bag_[j] != b) {
        last_bag_[j] = b;
        const int64_t part = send_part_base_[j] + part_cursor_[j];
        const int64_t sums_at = exchange.requester_at_[at] + part_cursor_[j] * local_dim_;
        ++part_cursor_[j];
        bag_parts_host_(listed++) = sums_at;
        part_bag_host_(part) = b;
        part_dy_at_host_(part) = sums_at;
      }
      const size_t row = static_cast<size_t>(exchange.ids_out_at_[at] + id_cursor_[j]++);
      message(row, 0) = static_cast<float>(local / kExactInFloat);
      message(row, 1) = static_cast<float>(local % kExactInFloat);
      message(row, 2) = static_cast<float>(part_cursor_[j] - 1);
    }
    // Owner order: the sums of owner j come back before those of owner j + 1.
    std::sort(bag_parts_host_.data() + first_part, bag_parts_host_.data() + listed);
    bag_part_offsets_host_(b + 1) = listed;
  }
  // The owner's side: where each source's ids and sums lie in the messages it receives.
  for (int j = 0; j < group_; ++j) {
    const size_t at = exchange.at(j, k);
    source_id_from_host_(j) = exchange.ids_in_at_[at];
    source_sums_from_host_(j) = exchange.owner_at_[at];
  }
  copy_view(bag_part_offsets_, bag_part_offsets_host_);
  copy_view(bag_parts_, bag_parts_host_);
  copy_view(part_bag_, part_bag_host_);
  copy_view(part_dy_at_, part_dy_at_host_);
  copy_view(source_id_base_, source_id_base_host_);
  copy_view(source_id_from_, source_id_from_host_);
  copy_view(source_part_base_, source_part_base_host_);
  copy_view(source_sums_from_, source_sums_from_host_);
}

void EmbeddingBag::pool_received(EmbeddingExchange& exchange) {
  // Owner: this table's ids out of the message, then the parts' partial sums into the sums
  // message, back to their requesters, who add them up per bag.
  take_received_ids(exchange.ids_recv_, received_ids_, source_id_base_, source_id_from_,
                    recv_requests_);
  find_part_starts(recv_requests_, received_ids_, received_parts_, source_id_base_,
                   source_part_base_, source_sums_from_, local_dim_, part_start_, part_sums_at_);
  const ShardedTensor& w = weight_.value();
  if (w.stored_16bit()) {
    pool_parts(Bf16Table{w.bits_matrix()}, recv_requests_, part_start_, part_sums_at_,
               received_parts_, local_dim_, exchange.owner_);
  } else {
    pool_parts(Fp32Table{w.matrix()}, recv_requests_, part_start_, part_sums_at_, received_parts_,
               local_dim_, exchange.owner_);
  }
}

void EmbeddingBag::combine_received(EmbeddingExchange& exchange) {
  combine_parts(exchange.requester_, bag_part_offsets_, bag_parts_, bags_.offsets,
                pooling_ == EmbeddingPooling::mean, col_comm_ ? out_slice_ : out_);
  // Column-wise too: the slices side by side, rank k's at columns [k local_dim, (k + 1)
  // local_dim).
  if (col_comm_) col_comm_->all_gather(out_slice_, out_, 1);
}

ConstMatrixView EmbeddingBag::sparse_dy(ConstMatrixView whole_dy) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(whole_dy.extent(0)) == batch_rows_ &&
                        static_cast<int64_t>(whole_dy.extent(1)) == dim_,
                    "embedding table '", table_, "': dy is [", whole_dy.extent(0), ", ",
                    whole_dy.extent(1), "], not [", batch_rows_, ", ", dim_, "]");
  // Column-wise: this slice's columns of dy (every rank of the axis has the same dy).
  if (col_comm_) take_dy_columns(whole_dy, first_col_, dy_slice_);
  return col_comm_ ? ConstMatrixView(dy_slice_) : whole_dy;
}

void EmbeddingBag::backward(ConstMatrixView whole_dy, const LayerPass& pass) {
  MESHTRAIN_REQUIRE(!bucketed_, "embedding table '", table_,
                    "': its sparse gradient is bucketed; the backward_sparse_* calls make it");
  MESHTRAIN_REQUIRE(!row_comm_ || own_exchange_ != nullptr, "embedding table '", table_,
                    "' exchanges its rows through a shared exchange: backward_begin, the "
                    "exchange's exchange_dy and backward_end make its backward");
  MESHTRAIN_REQUIRE(pass.deferred == DeferredReduction::now || can_leave_gradients_partial(),
                    "embedding table '", table_, "': its gradient reduction cannot be deferred");
  backward_begin(whole_dy);
  if (own_exchange_) own_exchange_->exchange_dy();
  backward_end(pass);
}

void EmbeddingBag::backward_begin(ConstMatrixView whole_dy) {
  dy_ = sparse_dy(whole_dy);
  // Row-wise: dy of each part this rank sent, into the exchange's dy message (to the part's
  // owner, who adds it into the rows of the part's ids).
  if (row_comm_) {
    MESHTRAIN_REQUIRE(exchange_ != nullptr, "embedding table '", table_,
                      "' exchanges its rows through a shared exchange, and none was built over it");
    part_gradients(dy_, part_bag_, part_dy_at_, sent_parts_, bags_.offsets,
                   pooling_ == EmbeddingPooling::mean, exchange_->requester_);
  }
}

void EmbeddingBag::backward_end(const LayerPass& pass) {
  MESHTRAIN_REQUIRE(!bucketed_, "embedding table '", table_,
                    "': its sparse gradient is bucketed; the backward_sparse_* calls make it");
  MESHTRAIN_REQUIRE(pass.deferred == DeferredReduction::now || can_leave_gradients_partial(),
                    "embedding table '", table_, "': its gradient reduction cannot be deferred");
  if (sparse_) {
    MESHTRAIN_REQUIRE(pass.deferred == DeferredReduction::now, "embedding table '", table_,
                      "': a sparse gradient is reduced in backward, never deferred");
    backward_sparse(dy_);
    return;
  }
  fill_view(weight_.grad().local, 0.0f);
  if (!row_comm_) {
    backward_replicated(dy_);
  } else {
    backward_row_wise();
  }
  const bool now = pass.deferred == DeferredReduction::now;
  weight_.reduce(no_scratch_, now);
  if (pass.deferred == DeferredReduction::in_buckets) pass.buckets->layer_ready(pass.index);
}

void EmbeddingBag::backward_replicated(ConstMatrixView dy) {
  scatter_bags(dy, bags_.offsets, bags_.values, pooling_ == EmbeddingPooling::mean,
               weight_.grad().matrix());
}

void EmbeddingBag::backward_row_wise() {
  // Owner: each part's dy (arrived in the exchange's dy message) into the rows of its ids.
  scatter_parts(exchange_->owner_, recv_requests_, part_start_, part_sums_at_, received_parts_,
                weight_.grad().matrix());
}

void EmbeddingBag::use_sparse_gradient(ParallelContext& context, bool bucketed) {
  if (sparse_) return;
  sparse_ = true;
  gradient_comm_ = context.comm(layout_.gradient_allreduce);  // nullptr: nothing to sum over
  bucketed_ = bucketed && gradient_comm_ != nullptr;
  const int64_t arriving = row_comm_ ? group_ * max_ids_ : max_ids_;
  local_touch_capacity_ = std::min(local_rows_, arriving);
  const int64_t holders = gradient_comm_ ? gradient_comm_->size() : 1;
  touch_capacity_ = std::min(local_rows_, holders * local_touch_capacity_);
  // A step's touched rows are numbered in int32 slots (slot_of_row_): 2^31 of them per step
  // and rank is far beyond any batch, but it is checked, not assumed.
  MESHTRAIN_REQUIRE(touch_capacity_ <= std::numeric_limits<int32_t>::max(), "embedding table '",
                    table_, "': ", touch_capacity_,
                    " rows may be touched in one step on this rank, more than int32 slots hold");
  const std::string prefix = "embeddings/" + table_ + "/sparse_";
  const size_t capacity = static_cast<size_t>(std::max<int64_t>(touch_capacity_, 1));
  slot_of_row_.assign(static_cast<size_t>(local_rows_), -1);
  touched_host_rows_.assign(capacity, 0);
  touched_rows_ = Kokkos::View<int64_t*>(prefix + "rows", capacity);
  touched_rows_host_ = host_mirror(touched_rows_);
  id_slot_ = Kokkos::View<int64_t*>(prefix + "id_slot",
                                    static_cast<size_t>(std::max<int64_t>(arriving, 1)));
  id_slot_host_ = host_mirror(id_slot_);
  if (row_comm_) recv_requests_host_ = host_mirror(recv_requests_);
  // Bucketed: the model holds the messages and the compact gradient (its buffers, reserved on
  // the communicator by the model).
  if (bucketed_) return;
  row_grads_ = Matrix(prefix + "grads", capacity, static_cast<size_t>(local_dim_));
  row_grads_data_ = row_grads_.data();
  if (gradient_comm_) {
    const size_t per_rank = static_cast<size_t>(local_touch_capacity_ + 1);
    touched_send_ = Matrix(prefix + "touched_send", per_rank, 2);
    touched_recv_ = Matrix(prefix + "touched_recv", per_rank * static_cast<size_t>(holders), 2);
    touched_send_host_ = host_mirror(touched_send_);
    touched_recv_host_ = host_mirror(touched_recv_);
    const size_t gathered = touched_recv_.size() * sizeof(float);
    gradient_comm_->reserve_staging(gathered, gathered);
    // The compact gradient's all-reduce, up to every row a step may touch: staged (device
    // memory) through buffers reserved now, so that a step touching more rows than the ones
    // before it does not grow them.
    const size_t grads = capacity * static_cast<size_t>(local_dim_) * sizeof(float);
    gradient_comm_->reserve_staging(grads, grads);
    gradient_comm_->reserve_reductions(capacity * static_cast<size_t>(local_dim_));
  }
}

void EmbeddingBag::touch(int64_t row) {
  int32_t& slot = slot_of_row_[static_cast<size_t>(row)];
  if (slot >= 0) return;
  slot = static_cast<int32_t>(touched_);
  touched_host_rows_[static_cast<size_t>(touched_++)] = row;
}

void EmbeddingBag::touch_local() {
  // The rows this rank's ids touch (the owner: the ids it received from its group).
  touched_ = 0;
  if (!row_comm_) {
    for (int64_t k = 0; k < ids_; ++k) touch(values_host_(k));
  } else {
    const std::pair<int64_t, int64_t> used(0, received_ids_);
    copy_view(Kokkos::subview(recv_requests_host_, used, Kokkos::ALL),
              Kokkos::subview(recv_requests_, used, Kokkos::ALL));
    for (int64_t i = 0; i < received_ids_; ++i) {
      touch(decode_row(recv_requests_host_(i, 0), recv_requests_host_(i, 1)));
    }
  }
}

void EmbeddingBag::write_touched(Matrix::HostMirror& message, int64_t at) const {
  MESHTRAIN_REQUIRE(
      at >= 0 && at + local_touch_capacity_ + 1 <= static_cast<int64_t>(message.extent(0)),
      "embedding table '", table_, "': its touched rows do not fit the message");
  const auto put = [&message](int64_t r, int64_t value) {
    message(static_cast<size_t>(r), 0) = static_cast<float>(value / kExactInFloat);
    message(static_cast<size_t>(r), 1) = static_cast<float>(value % kExactInFloat);
  };
  put(at, touched_);
  for (int64_t i = 0; i < touched_; ++i)
    put(at + 1 + i, touched_host_rows_[static_cast<size_t>(i)]);
}

void EmbeddingBag::union_touched(const Matrix::HostMirror& gathered, int64_t rank_rows,
                                 int64_t at) {
  // Their union over the ranks that hold the same block with other bags: every one of them
  // updates the same rows, so the compact gradients line up for the all-reduce.
  for (int j = 0; j < gradient_comm_->size(); ++j) {
    const int64_t base = j * rank_rows + at;
    const int64_t count = decode_row(gathered(base, 0), gathered(base, 1));
    MESHTRAIN_REQUIRE(count >= 0 && count <= local_touch_capacity_, "embedding table '", table_,
                      "': rank ", j, " of its gradient group sent ", count,
                      " touched rows, more than it may touch (", local_touch_capacity_, ")");
    for (int64_t i = 1; i <= count; ++i) {
      touch(decode_row(gathered(base + i, 0), gathered(base + i, 1)));
    }
  }
}

void EmbeddingBag::compact_gradient(ConstMatrixView dy) {
  // In row order, the same on every holder; each row's slot is its index.
  std::sort(touched_host_rows_.begin(), touched_host_rows_.begin() + touched_);
  for (int64_t i = 0; i < touched_; ++i) {
    const int64_t row = touched_host_rows_[static_cast<size_t>(i)];
    slot_of_row_[static_cast<size_t>(row)] = static_cast<int32_t>(i);
    touched_rows_host_(i) = row;
  }
  const int64_t ids = row_comm_ ? received_ids_ : ids_;
  for (int64_t k = 0; k < ids; ++k) {
    const int64_t row = row_comm_ ? decode_row(recv_requests_host_(k, 0), recv_requests_host_(k, 1))
                                  : values_host_(k);
    id_slot_host_(k) = slot_of_row_[static_cast<size_t>(row)];
  }
  for (int64_t i = 0; i < touched_; ++i) {
    slot_of_row_[static_cast<size_t>(touched_host_rows_[static_cast<size_t>(i)])] = -1;
  }
  const std::pair<int64_t, int64_t> touched(0, touched_), arrived(0, ids);
  copy_view(Kokkos::subview(touched_rows_, touched), Kokkos::subview(touched_rows_host_, touched));
  copy_view(Kokkos::subview(id_slot_, arrived), Kokkos::subview(id_slot_host_, arrived));

  // The compact gradient: the dense one's sums, in its order, into the touched rows only.
  const MatrixView grads = row_gradients();
  fill_view(grads, 0.0f);
  const bool mean = pooling_ == EmbeddingPooling::mean;
  if (!row_comm_) {
    scatter_bags_compact(dy, bags_.offsets, id_slot_, mean, grads);
  } else {
    // The parts' dy arrived in the exchange's dy message (backward_begin, exchange_dy).
    scatter_parts_compact(exchange_->owner_, id_slot_, part_start_, part_sums_at_, received_parts_,
                          grads);
  }
}

void EmbeddingBag::backward_sparse(ConstMatrixView dy) {
  touch_local();
  if (gradient_comm_) {
    write_touched(touched_send_host_, 0);
    copy_view(touched_send_, touched_send_host_);
    gradient_comm_->all_gather(touched_send_, touched_recv_, 0);
    copy_view(touched_recv_host_, touched_recv_);
    union_touched(touched_recv_host_, local_touch_capacity_ + 1, 0);
  }
  compact_gradient(dy);
  if (gradient_comm_ && touched_ > 0) gradient_comm_->all_reduce(row_gradients());
}

void EmbeddingBag::backward_sparse_touch(Matrix::HostMirror& message, int64_t at) {
  MESHTRAIN_REQUIRE(bucketed_, "embedding table '", table_,
                    "': backward_sparse_touch needs use_sparse_gradient(context, true)");
  touch_local();
  write_touched(message, at);
}

int64_t EmbeddingBag::backward_sparse_union(const Matrix::HostMirror& gathered, int64_t rank_rows,
                                            int64_t at) {
  union_touched(gathered, rank_rows, at);
  return touched_;
}

void EmbeddingBag::backward_sparse_finish(float* grads) {
  row_grads_data_ = grads;
  compact_gradient(dy_);
}

EmbeddingExchange::EmbeddingExchange(const std::vector<EmbeddingBag*>& tables) {
  MESHTRAIN_REQUIRE(!tables.empty(), "an embedding exchange needs at least one table");
  comm_ = tables.front()->row_comm_;
  std::string names;
  int64_t ids = 0, floats = 0;  // the tables' capacities of ids and of part floats (below)
  for (size_t k = 0; k < tables.size(); ++k) {
    EmbeddingBag& t = *tables[k];
    MESHTRAIN_REQUIRE(t.row_comm_ != nullptr && t.row_comm_ == comm_, "embedding table '", t.table_,
                      "' does not exchange rows over the group of table '", tables.front()->table_,
                      "'");
    MESHTRAIN_REQUIRE(t.exchange_ == nullptr, "embedding table '", t.table_,
                      "' already has an exchange");
    t.exchange_ = this;
    t.slot_ = k;
    dims_.push_back(t.local_dim_);
    ids += t.max_ids_;
    floats += t.max_ids_ * t.local_dim_;
    names += (k ? ", '" : "'") + t.table_ + "'";
  }
  n_ = comm_->size();
  const size_t n = static_cast<size_t>(n_), count = tables.size();
  // The largest messages a step can send or receive: every table's capacity of ids (3 floats
  // each) and of parts (a part per id at most, local_dim floats each), an owner receiving the
  // whole group's. Each all-to-all's counts and displacements become ints in MPI: checked here,
  // once, for the largest; a step sends at most these.
  const int64_t most = std::numeric_limits<int>::max();
  if (static_cast<int64_t>(n) * ids * 3 > most || static_cast<int64_t>(n) * floats > most) {
    MESHTRAIN_BAD_INPUT("the embedding tables ", names, " exchange up to ",
                        static_cast<int64_t>(n) * ids * 3, " floats of ids and ",
                        static_cast<int64_t>(n) * floats,
                        " floats of partial sums a step at an owner, more than an MPI count "
                        "holds (",
                        most, "); lower data.batch_size or shard fewer of model.tables this way");
  }
  const std::string prefix = "embeddings/exchange_" + tables.front()->table_ + "/";
  counts_send_ = Matrix(prefix + "counts_send", n * count, 4);
  counts_recv_ = Matrix(prefix + "counts_recv", n * count, 4);
  counts_send_host_ = host_mirror(counts_send_);
  counts_recv_host_ = host_mirror(counts_recv_);
  ids_send_ = Matrix(prefix + "ids_send", static_cast<size_t>(ids), 3);
  ids_send_host_ = host_mirror(ids_send_);
  ids_recv_ = Matrix(prefix + "ids_recv", n * static_cast<size_t>(ids), 3);
  requester_ = Matrix(prefix + "requester", static_cast<size_t>(floats), 1);
  owner_ = Matrix(prefix + "owner", n * static_cast<size_t>(floats), 1);
  for (std::vector<int64_t>* v : {&ids_out_, &ids_in_, &owner_floats_, &requester_floats_}) {
    v->assign(n, 0);
  }
  for (std::vector<int64_t>* v : {&ids_out_at_, &ids_in_at_, &requester_at_, &owner_at_}) {
    v->assign(n * count, 0);
  }
  problems_.assign(count, std::string());
  // What a backend stages the largest all-to-all through (device memory): now, not in a step.
  // The counts' message (4 floats a table and rank) is the largest when the capacities are tiny.
  const int64_t counts_floats = static_cast<int64_t>(count) * 4;
  const size_t largest =
      n * static_cast<size_t>(std::max({ids * 3, floats, counts_floats})) * sizeof(float);
  comm_->reserve_staging(largest, largest);
}

void EmbeddingExchange::lay_out() {
  // Rank j's block of each message holds the tables in slot order; the blocks in rank order.
  const size_t count = dims_.size();
  int64_t ids_out = 0, ids_in = 0, owner = 0, requester = 0;
  for (int j = 0; j < n_; ++j) {
    const size_t u = static_cast<size_t>(j);
    ids_out_[u] = ids_in_[u] = owner_floats_[u] = requester_floats_[u] = 0;
    for (size_t k = 0; k < count; ++k) {
      const size_t row = at(j, k);
      ids_out_at_[row] = ids_out + ids_out_[u];
      ids_in_at_[row] = ids_in + ids_in_[u];
      requester_at_[row] = requester + requester_floats_[u];
      owner_at_[row] = owner + owner_floats_[u];
      // What this rank sends rank j (ids, parts) and receives from it, for table k.
      ids_out_[u] += static_cast<int64_t>(counts_send_host_(row, 0));
      ids_in_[u] += static_cast<int64_t>(counts_recv_host_(row, 0));
      requester_floats_[u] += static_cast<int64_t>(counts_send_host_(row, 1)) * dims_[k];
      owner_floats_[u] += static_cast<int64_t>(counts_recv_host_(row, 1)) * dims_[k];
    }
    ids_out += ids_out_[u];
    ids_in += ids_in_[u];
    requester += requester_floats_[u];
    owner += owner_floats_[u];
  }
}

void EmbeddingExchange::forward(EmbeddingBag* const* tables, const SparseBags* bags) {
  const size_t count = dims_.size();
  for (size_t k = 0; k < count; ++k) {
    MESHTRAIN_REQUIRE(tables[k]->exchange_ == this && tables[k]->slot_ == k, "embedding table '",
                      tables[k]->table_, "' is not slot ", k, " of this exchange");
  }
  // Each table's bags read and checked, its ids and parts counted per owner: one all-to-all of
  // every table's counts (with its error flag), so that every rank of the group knows what it
  // will receive and throws at the same call when one rank's bags are bad.
  for (size_t k = 0; k < count; ++k) {
    problems_[k] = tables[k]->count_requests(bags[k], counts_send_host_, k, count);
  }
  copy_view(counts_send_, counts_send_host_);
  comm_->all_to_all(counts_send_, counts_recv_);
  copy_view(counts_recv_host_, counts_recv_);
  for (size_t k = 0; k < count; ++k) {
    tables[k]->check_counts(problems_[k], counts_recv_host_, k, count);
  }
  for (size_t k = 0; k < count; ++k) tables[k]->receive_counts(counts_recv_host_, k, count);
  lay_out();
  // The ids: every table's requests for rank j side by side, one all-to-all-v.
  for (size_t k = 0; k < count; ++k) tables[k]->plan_requests(*this, k);
  int64_t sent = 0;
  for (int64_t rows : ids_out_) sent += rows;
  const std::pair<int64_t, int64_t> used(0, sent);
  copy_view(Kokkos::subview(ids_send_, used, Kokkos::ALL),
            Kokkos::subview(ids_send_host_, used, Kokkos::ALL));
  comm_->all_to_all_v(ids_send_, ids_out_, ids_recv_, ids_in_);
  // The owners' partial sums, one all-to-all-v back; the requesters add up each bag's parts.
  for (size_t k = 0; k < count; ++k) tables[k]->pool_received(*this);
  comm_->all_to_all_v(owner_, owner_floats_, requester_, requester_floats_);
  for (size_t k = 0; k < count; ++k) tables[k]->combine_received(*this);
}

void EmbeddingExchange::exchange_dy() {
  // The sums' layout reversed: each part's dy from its requester to its owner.
  comm_->all_to_all_v(requester_, requester_floats_, owner_, owner_floats_);
}

}  // namespace meshtrain
