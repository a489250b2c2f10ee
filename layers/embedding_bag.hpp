#pragma once
// An embedding bag (issue 39's first slice; docs/recsys.md): one table `embeddings/<table>/weight`
// [rows, dim], a model parameter like any other (partition rules give its spec, checkpoints
// save it), looked up by bags of ids and pooled:
//   out[b] = sum over the ids i of bag b (in order, a repeated id counting each time) of W[i]
//   (`mean`: divided by the bag's id count; an empty bag gives 0 with either pooling).
// Backward writes the table gradient dW[i] += dy[b] (`mean`: dy[b] / count) for every id i of
// every bag b; the bags have no input gradient.
//
// Input: this rank's batch rows as CSR (SparseBags): `offsets` [rows + 1] (offsets[0] = 0,
// non-decreasing) and the int64 ids `values`, bag b being values[offsets[b], offsets[b + 1]).
// Both in the default memory space; they must stay valid until backward.
//
// Sharding, from the table's PartitionSpec (partition/embedding_layout.hpp decides it, as
// linear_layout.hpp decides a Linear's layout from its weight's):
//   replicated  P(): every rank holds the table; lookups are local; the gradient is summed over
//               the batch axes (the one all-reduce a GradientReductionPlan may defer).
//   row-wise    P(axis, None), `axis` one batch axis or a tuple of them: group rank j of the
//               axis holds rows [j * rows / n, (j + 1) * rows / n). Forward: the ids travel to
//               their owners (per owner, grouped by bag, in bag order) by all_to_all_v over the
//               axis, each owner pools a partial sum per (bag, owner) and sends it back, and the
//               requester adds the parts of a bag in owner rank order (so the result does not
//               depend on timing; a bag whose ids all live on one owner is bit for bit the
//               one-rank sum). Backward: dy of each (bag, owner) part goes to the owner, who adds
//               it into the rows of the bag's ids, in source rank order, then bag, then id order
//               (the one-rank order when the axis is every batch axis); the gradient is then
//               summed over the batch axes the spec does not name.
//   column-wise P(None, axis), `axis` one non-batch axis (tp) or a tuple of them: group rank k
//               of the axis holds columns [k * dim / m, (k + 1) * dim / m) of every row (m must
//               divide dim). Forward: every rank of the axis pools its batch's bags (the same
//               bags: the axis does not split the batch) in its columns, and the pooled slices
//               are all-gathered over the axis into whole rows [batch_rows, dim]. Backward: each
//               rank takes its columns of dy (equal on the axis's ranks: the output is whole)
//               and scatters them into its slice, no communication for the table; then summed
//               over the batch axes as a replicated table's. Every column's sums are the
//               one-rank sums in the one-rank order (bit for bit). P(batch axes, tp) composes
//               both: row-wise over the batch axes within each column slice.
//   table-wise  P(axis@k), `axis` batch axes as row-wise (the planner places P(axis@table) on a
//               member k): member k holds the whole table, the others no rows of it. Row-wise's
//               exchange with one owner: every id goes to member k, which pools each bag whole
//               (one part per bag, in id order: the one-rank sum) and returns it; backward as
//               row-wise. Any other spec is bad_input naming the parameter and the spec. Ranks of a
//               non-batch axis (tp) that does not split the columns hold the same bags
// and compute the same outputs and gradients.
//
// Bad input (bad_input naming the table): an id outside [0, rows) (and the id), offsets that do
// not start at 0, decrease or run past the ids, more ids in a step than max_ids (the capacity
// given at construction). Under row-wise sharding the axis's ranks learn of it together (a flag
// in the count exchange that precedes the all-to-all), so every rank of the group throws at the
// same call and none is left waiting; a replicated table has no collective in forward, so only
// the rank whose batch is wrong throws there.
//
// Buffers: everything is allocated at construction for `max_ids` ids per rank per step (an owner
// may receive the whole group's: n x max_ids), so forward() and backward() allocate nothing.
// Mixed precision is a later slice: the context must be fp32 (bad_input otherwise). The table
// itself may be stored as bf16 (ShardedTensor::storage, model.table_dtype = "bf16"): the
// pooling kernels then read its bf16 bits, widen them (exact) and sum in fp32; the pooled rows,
// their all-to-all and all-gather, and the gradients stay fp32 (docs/recsys.md, "bf16 tables").
//
// Sparse gradients (use_sparse_gradient(), for the row-wise optimizers of layers/
// sparse_optimizer.hpp): backward then leaves the dense gradient tensor alone and writes only
// the rows the step touched: touched_rows() (local row indices, sorted, each once; the union
// over every rank that holds this block: the owners' group, then the batch axes the gradient is
// summed over) and row_gradients() [touched, dim], the summed gradient of each (the same sums
// in the same order as the dense gradient's rows, all-reduced over the same axes). Nothing in
// a step passes over the whole table; the buffers are sized at use_sparse_gradient() from the
// ids a step can bring (max_ids per rank of the group, capped at the local rows).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "framework/core/views.hpp"
#include "layers/context.hpp"
#include "layers/layer.hpp"
#include "layers/sharded_parameter.hpp"
#include "partition/embedding_layout.hpp"

namespace meshtrain {

using IdView =
    Kokkos::View<const int64_t*, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// A batch of bags as CSR (see the header comment).
struct SparseBags {
  IdView offsets;  // [rows + 1]
  IdView values;   // at least offsets[rows] ids
};

class EmbeddingBag {
 public:
  // weight: `embeddings/<table>/weight` [rows, dim] with its gradient, allocated under its spec;
  // batch_rows: the bags of this rank per step; max_ids: the most ids any rank's bags hold in a
  // step (the same on every rank). Asks the context for its communicators (collective, see
  // context.hpp). bad_input for an unsupported spec or precision.
  EmbeddingBag(std::string table, ParameterRef weight, EmbeddingPooling pooling, int64_t batch_rows,
               int64_t max_ids, ParallelContext& context);
  EmbeddingBag(EmbeddingBag&&) = default;

  // The pooled rows [batch_rows, dim], owned by the layer (valid until the next forward).
  // Collective over the row-wise axis.
  MatrixView forward(const SparseBags& bags, const LayerPass& pass);
  // dy [batch_rows, dim] (times pass.loss_scale) -> the table gradient (overwritten), reduced as
  // pass.deferred says. Collective over the row-wise axis (and the batch axes when reduced).
  void backward(ConstMatrixView dy, const LayerPass& pass);

  // Switches backward to sparse gradients (above) and allocates their buffers. Collective (asks
  // the context for the gradient's communicator); call before the first step. bucketed: the
  // model exchanges this table's touched rows and sums its compact gradient together with other
  // tables' (one all-gather and one all-reduce per gradient group and step: Dlrm), through the
  // three backward_sparse_* calls below instead of backward(); ignored for a table with no
  // gradient group (nothing to exchange), which stays on backward().
  void use_sparse_gradient(ParallelContext& context, bool bucketed = false);
  bool sparse_gradient() const { return sparse_; }
  bool bucketed() const { return bucketed_; }
  // The batch axes the gradient is summed over (the spec's, before size-1 axes are dropped) and
  // their communicator (nullptr: nothing to sum over).
  const std::vector<std::string>& gradient_axes() const { return layout_.gradient_allreduce; }
  Communicator* gradient_comm() const { return gradient_comm_; }
  // Bucketed: the rows [., 2] this table takes in a rank's touched-row message (a count, then
  // up to that many rows), and the most floats its compact gradient may need.
  int64_t touched_message_rows() const { return local_touch_capacity_ + 1; }
  int64_t gradient_capacity() const { return std::max<int64_t>(touch_capacity_, 1) * local_dim_; }
  // A bucketed backward, in three calls that every rank of the gradient group makes for its
  // tables in the same order (the model does the collectives between them):
  //   backward_sparse_touch   checks dy as backward() does and writes this rank's touched rows
  //                           into `message` rows [at, at + touched_message_rows()): local, no
  //                           communication;
  //   backward_sparse_union   after the message of every rank was gathered (rank j's at rows
  //                           [j * rank_rows, (j + 1) * rank_rows) of `gathered`): the union of
  //                           the touched rows; returns their count;
  //   backward_sparse_finish  the compact gradient (this rank's partial sum; the row-wise
  //                           all-to-all included) into `grads` [count, local_dim], contiguous,
  //                           which row_gradients() then views; the model all-reduces it.
  void backward_sparse_touch(ConstMatrixView dy, Matrix::HostMirror& message, int64_t at);
  int64_t backward_sparse_union(const Matrix::HostMirror& gathered, int64_t rank_rows, int64_t at);
  void backward_sparse_finish(float* grads);
  // After a sparse backward: the touched local rows (device, [touched_count()]) and their
  // gradients [touched_count(), dim] (owned by the layer, valid until the next backward).
  int64_t touched_count() const { return touched_; }
  Kokkos::View<const int64_t*> touched_rows() const {
    return Kokkos::subview(touched_rows_, std::make_pair(int64_t{0}, touched_));
  }
  // Of this rank's columns: [touched_count(), local_dim()].
  MatrixView row_gradients() const {
    return MatrixView(row_grads_data_, static_cast<size_t>(touched_),
                      static_cast<size_t>(local_dim_));
  }
  // The most rows a sparse backward may touch here (the sparse buffers' rows).
  int64_t touch_capacity() const { return std::max<int64_t>(touch_capacity_, 1); }
  ShardedTensor& weight() const { return weight_.value(); }

  size_t parameter_count() const { return 1; }
  std::vector<ShardedParameter*> sharded_parameters() { return {&weight_}; }
  // Whether the gradient's only communication is its all-reduce over batch axes (deferrable).
  bool can_leave_gradients_partial() const { return weight_.deferrable_group() != nullptr; }

  const std::string& table() const { return table_; }
  const EmbeddingLayout& layout() const { return layout_; }
  EmbeddingSharding sharding() const { return layout_.sharding; }
  EmbeddingPooling pooling() const { return pooling_; }
  int64_t rows() const { return rows_; }               // of the whole table
  int64_t dim() const { return dim_; }                 // output width (pooled rows are whole)
  int64_t first_column() const { return first_col_; }  // of this rank's block
  int64_t local_dim() const { return local_dim_; }     // its columns (dim unless column-wise)
  // Column-wise: the column slices' group (nullptr when this rank holds whole rows).
  Communicator* column_comm() const { return col_comm_; }
  int64_t first_row() const { return first_row_; }  // of this rank's block
  int64_t local_rows() const { return local_rows_; }
  int64_t max_ids() const { return max_ids_; }
  MatrixView output() const { return out_; }
  FeatureLayout output_layout() const { return FeatureLayout::replicated; }
  // "embedding bag 'cat' [48, 6] sum, row-wise over (fsdp) (12 rows here)"
  std::string describe() const;

 private:
  // Copies the bags to the host and checks them; "" or what is wrong.
  std::string read_bags(const SparseBags& bags);
  // Row-wise: buckets the ids by owner, exchanges the counts (with the error flag) and builds
  // the plan of the step (host, then device).
  void plan_row_wise(const std::string& problem);
  // The member of the owners' group that holds global row `id`.
  int64_t owner_of(int64_t id) const;
  void forward_replicated(const SparseBags& bags);
  void forward_row_wise(const SparseBags& bags);
  void backward_replicated(ConstMatrixView dy);
  void backward_row_wise(ConstMatrixView dy);
  // Sparse backward: the touched rows (deduplicated, unioned over the gradient's group), then
  // the compact gradient, all-reduced over that group.
  void backward_sparse(ConstMatrixView dy);
  // Adds local row `row` to the touched set (once).
  void touch(int64_t row);
  // The sparse backward's parts: dy checked (and its columns taken, column-wise); the rows this
  // rank's ids touch; this rank's list into rows [at, ...) of a touched-row message; the union
  // of the gathered lists; the compact gradient into row_grads_data_.
  ConstMatrixView sparse_dy(ConstMatrixView whole_dy);
  void touch_local();
  void write_touched(Matrix::HostMirror& message, int64_t at) const;
  void union_touched(const Matrix::HostMirror& gathered, int64_t rank_rows, int64_t at);
  void compact_gradient(ConstMatrixView dy);

  std::string table_;
  EmbeddingPooling pooling_ = EmbeddingPooling::sum;
  EmbeddingLayout layout_;
  int64_t rows_ = 0, dim_ = 0, batch_rows_ = 0, max_ids_ = 0;
  int64_t first_row_ = 0, local_rows_ = 0;
  Communicator* row_comm_ = nullptr;  // row-wise: the owners' group
  int group_ = 1, me_ = 0;            // its size and this rank's index in it
  // 1: row-wise (member j owns rows [j rows_per_owner, ...)); 0: table-wise (one holder).
  int64_t row_blocks_ = 1;
  // Column-wise: this rank's columns [first_col_, first_col_ + local_dim_) and their group.
  int64_t first_col_ = 0, local_dim_ = 0;
  Communicator* col_comm_ = nullptr;
  ShardedParameter weight_;
  LayerScratch no_scratch_;  // the parameter is never gathered: nothing of the scratch is used

  // The last forward's bags (backward uses them) and their host copies.
  SparseBags bags_;
  using HostIds = Kokkos::View<int64_t*, Kokkos::LayoutRight, Kokkos::HostSpace>;
  HostIds offsets_host_, values_host_;
  int64_t ids_ = 0;  // in the last forward's bags

  Matrix out_;  // [batch_rows, dim]
  // Column-wise: the pooled slice [batch_rows, local_dim] gathered into out_, and dy's columns
  // of this slice in backward (the same shape). Else empty: out_ and dy are used directly.
  Matrix out_slice_, dy_slice_;

  // Row-wise, per owner j (host): ids and parts ((bag, owner) pairs) sent to and received from
  // j, where j's ids and parts start in the send buffers, cursors, the last bag seen per owner.
  std::vector<int64_t> send_ids_, send_parts_, recv_ids_, recv_parts_;
  std::vector<int64_t> send_id_base_, send_part_base_, id_cursor_, part_cursor_, last_bag_;
  int64_t received_ids_ = 0, received_parts_ = 0, sent_parts_ = 0;
  // The count exchange: [group, 4] rows (ids, parts, error flag, 0) sent to and received from
  // each member.
  Matrix counts_send_, counts_recv_;
  Matrix::HostMirror counts_send_host_, counts_recv_host_;
  // Requests [max_ids, 3] (local row / 2^24, local row mod 2^24, part index at the owner: floats
  // hold integers below 2^24 exactly) and what arrives at the owner [group x max_ids, 3].
  Matrix send_requests_, recv_requests_;
  Matrix::HostMirror send_requests_host_;
  // Owner: where the received ids of each source start, [group + 1], and of each part,
  // [group x max_ids + 1] (computed on the device from the part indices).
  Kokkos::View<int64_t*> source_id_base_, source_part_base_, part_start_;
  Kokkos::View<int64_t*>::HostMirror source_id_base_host_, source_part_base_host_;
  // Owner: partial sums of the parts [group x max_ids, dim] (forward) and the parts' gradients
  // (backward, the same buffer). Requester: the parts returned [max_ids, dim], and dy of each
  // part on its way out (backward, the same buffer).
  Matrix owner_parts_, requester_parts_;
  // Requester: a bag's parts in owner order (rows of requester_parts_), [batch_rows + 1] and
  // [max_ids]; the bag of each part [max_ids].
  Kokkos::View<int64_t*> bag_part_offsets_, bag_parts_, part_bag_;
  Kokkos::View<int64_t*>::HostMirror bag_part_offsets_host_, bag_parts_host_, part_bag_host_;

  // Sparse gradients (use_sparse_gradient). slot_of_row_ [local rows] is -1 except, inside a
  // backward, for the touched rows (reset after: no pass over the table); id_slot_ maps each id
  // of the step (replicated: of the bags; row-wise: received at the owner) to its touched row.
  bool sparse_ = false, bucketed_ = false;
  ConstMatrixView sparse_dy_;              // bucketed: the dy of backward_sparse_touch, for _finish
  Communicator* gradient_comm_ = nullptr;  // the batch axes the gradient is summed over
  int64_t touched_ = 0, local_touch_capacity_ = 0, touch_capacity_ = 0;
  std::vector<int32_t> slot_of_row_;
  std::vector<int64_t> touched_host_rows_;
  Kokkos::View<int64_t*> touched_rows_, id_slot_;
  Kokkos::View<int64_t*>::HostMirror touched_rows_host_, id_slot_host_;
  Matrix row_grads_;  // [touch capacity, dim] (bucketed: empty, the model's buffer is used)
  float* row_grads_data_ = nullptr;  // where row_gradients() starts
  // The owner's received requests on the host (row-wise), and the touched-row lists gathered
  // over gradient_comm_: [local capacity + 1, 2] per rank (a count, then rows as 24-bit halves).
  Matrix::HostMirror recv_requests_host_;
  Matrix touched_send_, touched_recv_;
  Matrix::HostMirror touched_send_host_, touched_recv_host_;
};

}  // namespace meshtrain
