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
// may receive the whole group's: n x max_ids), so forward() and backward() allocate nothing; the
// all-to-alls' messages belong to the table's EmbeddingExchange (below), its own (allocated with
// the table) or one shared with the other tables of its owners' group (allocated when that is
// built), so that the group's tables exchange in 4 all-to-alls a step together.
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
#include <memory>
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

class EmbeddingExchange;

// Whose all-to-all buffers a table that exchanges rows (row-wise, table-wise) uses: its own
// EmbeddingExchange (a group of one table), or one the caller builds over several tables of the
// same owners' group (Dlrm), which then drives their forward and dy exchange.
enum class RowExchange { own, shared };

class EmbeddingBag {
 public:
  // weight: `embeddings/<table>/weight` [rows, dim] with its gradient, allocated under its spec;
  // batch_rows: the bags of this rank per step; max_ids: the most ids any rank's bags hold in a
  // step (the same on every rank). Asks the context for its communicators (collective, see
  // context.hpp). bad_input for an unsupported spec or precision. exchange: RowExchange above
  // (ignored for a table that exchanges no rows).
  EmbeddingBag(std::string table, ParameterRef weight, EmbeddingPooling pooling, int64_t batch_rows,
               int64_t max_ids, ParallelContext& context, RowExchange exchange = RowExchange::own);
  EmbeddingBag(EmbeddingBag&&) = default;

  // The pooled rows [batch_rows, dim], owned by the layer (valid until the next forward).
  // Collective over the row-wise axis. A table on a shared exchange is forwarded by it
  // (EmbeddingExchange::forward), not here.
  MatrixView forward(const SparseBags& bags, const LayerPass& pass);
  // dy [batch_rows, dim] (times pass.loss_scale) -> the table gradient (overwritten), reduced as
  // pass.deferred says. Collective over the row-wise axis (and the batch axes when reduced).
  // It is backward_begin, the exchange's dy all-to-all (own exchange) and backward_end; a table
  // on a shared exchange makes those calls in that order, the exchange_dy between them once for
  // all its tables.
  void backward(ConstMatrixView dy, const LayerPass& pass);
  // backward_begin: checks dy (and takes its columns, column-wise) and, exchanging rows, writes
  // the dy of each part this rank sent into its place of the exchange's dy message (local, no
  // communication). backward_end: the rest of backward() (or of the sparse backward), after the
  // exchange's exchange_dy. A bucketed sparse table (below) calls backward_begin, then the three
  // backward_sparse_* calls instead of backward_end.
  void backward_begin(ConstMatrixView dy);
  void backward_end(const LayerPass& pass);
  // Whether the table exchanges rows over an owners' group (row-wise or table-wise), that
  // group's communicator, and the exchange it uses (nullptr: none).
  bool exchanges_rows() const { return row_comm_ != nullptr; }
  Communicator* row_comm() const { return row_comm_; }
  EmbeddingExchange* exchange() const { return exchange_; }

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
  //   backward_sparse_touch   after backward_begin (and the exchange's exchange_dy): writes
  //                           this rank's touched rows into `message` rows [at, at +
  //                           touched_message_rows()): local, no communication;
  //   backward_sparse_union   after the message of every rank was gathered (rank j's at rows
  //                           [j * rank_rows, (j + 1) * rank_rows) of `gathered`): the union of
  //                           the touched rows; returns their count;
  //   backward_sparse_finish  the compact gradient (this rank's partial sum, from the parts'
  //                           dy the exchange brought) into `grads` [count, local_dim],
  //                           contiguous, which row_gradients() then views; the model
  //                           all-reduces it.
  void backward_sparse_touch(Matrix::HostMirror& message, int64_t at);
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
  friend class EmbeddingExchange;
  // Row-wise forward, in the steps EmbeddingExchange::forward runs for each of its tables
  // (slot k of the exchange) around its collectives:
  //   count_requests   reads and checks the bags, buckets the ids by owner and writes this
  //                    table's counts row (ids, parts, error flag) for each owner; returns
  //                    what is wrong with the bags ("" when nothing);
  //   check_counts     after the counts' exchange: throws (bad_input) when this rank's bags or
  //                    another rank's were bad, the same call on every rank of the group;
  //   receive_counts   what each member will send this table;
  //   plan_requests    with the exchange's layout: the requests into the ids message and the
  //                    step's plan (host, then device);
  //   pool_received    after the ids' exchange: the parts' partial sums into the sums message;
  //   combine_received after the sums' exchange: each bag's parts added up (then, column-wise,
  //                    the slices all-gathered).
  std::string count_requests(const SparseBags& bags, Matrix::HostMirror& counts, size_t k,
                             size_t tables);
  void check_counts(const std::string& problem, const Matrix::HostMirror& counts, size_t k,
                    size_t tables) const;
  void receive_counts(const Matrix::HostMirror& counts, size_t k, size_t tables);
  void plan_requests(EmbeddingExchange& exchange, size_t k);
  void pool_received(EmbeddingExchange& exchange);
  void combine_received(EmbeddingExchange& exchange);
  // The member of the owners' group that holds global row `id`.
  int64_t owner_of(int64_t id) const;
  void forward_replicated(const SparseBags& bags);
  void backward_replicated(ConstMatrixView dy);
  void backward_row_wise();
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

  // Row-wise: the exchange this table uses (its own, owned here, or a shared one, owned by the
  // caller) and this table's slot in it.
  std::unique_ptr<EmbeddingExchange> own_exchange_;
  EmbeddingExchange* exchange_ = nullptr;
  size_t slot_ = 0;
  // Row-wise, per owner j (host): ids and parts ((bag, owner) pairs) sent to and received from
  // j, where j's parts start among this table's parts sent, cursors, the last bag seen per
  // owner.
  std::vector<int64_t> send_ids_, send_parts_;
  std::vector<int64_t> send_part_base_, id_cursor_, part_cursor_, last_bag_;
  int64_t received_ids_ = 0, received_parts_ = 0, sent_parts_ = 0;
  // What arrives at the owner [group x max_ids, 3] (local row / 2^24, local row mod 2^24, part
  // index at the owner: floats hold integers below 2^24 exactly), taken out of the exchange's
  // ids message, source by source.
  Matrix recv_requests_;
  // Owner: where the received ids of each source start here, [group + 1], and in the exchange's
  // ids message (its row), [group]; where the parts of each source start here [group + 1] and
  // their sums in the exchange's sums message (its float), [group]; where each part's ids start,
  // [group x max_ids + 1], and its sum (and in backward its dy) in the message, [group x
  // max_ids] (both computed on the device from the part indices).
  Kokkos::View<int64_t*> source_id_base_, source_id_from_, source_part_base_, source_sums_from_;
  Kokkos::View<int64_t*> part_start_, part_sums_at_;
  Kokkos::View<int64_t*>::HostMirror source_id_base_host_, source_id_from_host_;
  Kokkos::View<int64_t*>::HostMirror source_part_base_host_, source_sums_from_host_;
  // Requester: a bag's parts in owner order, as where each part's sum comes back in the
  // exchange's returned sums (a float), [batch_rows + 1] and [max_ids]; per part sent (in owner
  // order), its bag and where its dy goes in the exchange's dy message, [max_ids] each.
  Kokkos::View<int64_t*> bag_part_offsets_, bag_parts_, part_bag_, part_dy_at_;
  Kokkos::View<int64_t*>::HostMirror bag_part_offsets_host_, bag_parts_host_, part_bag_host_;
  Kokkos::View<int64_t*>::HostMirror part_dy_at_host_;

  // Sparse gradients (use_sparse_gradient). slot_of_row_ [local rows] is -1 except, inside a
  // backward, for the touched rows (reset after: no pass over the table); id_slot_ maps each id
  // of the step (replicated: of the bags; row-wise: received at the owner) to its touched row.
  bool sparse_ = false, bucketed_ = false;
  ConstMatrixView dy_;  // backward_begin's dy (this rank's columns), for the calls after it
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

// The counts a rank received from rank `source` of the group for table `table` (its ids and
// parts, as floats): throws Error{runtime} unless both are whole and finite with 0 < parts <=
// ids <= capacity (the table's max_ids, the same on every rank), or both 0. Checked before the
// counts size the step's kernels, so that a bad message cannot index past their buffers; an
// internal error (the sender checked its bags). Public for its test.
void check_received_counts(const std::string& table, int source, float ids, float parts,
                           int64_t capacity);

// The row-wise all-to-alls of the tables that exchange rows over one owners' group (row-wise
// and table-wise tables whose communicator is the same), run together (docs/recsys.md,
// "Collectives per step"): a step has one all_to_all of the counts (a row [ids, parts, error
// flag, 0] per table and destination rank), one all_to_all_v of the ids (to each destination,
// every table's requests side by side in table order), one all_to_all_v of the partial sums back
// (to each requester, every table's parts side by side in table order, as flat floats, so
// tables of different widths share a message) and, in backward, one all_to_all_v of the parts'
// dy (the sums' layout, reversed): 4 a step for any number of tables, moving the same floats as 4
// per table. Each table keeps its own sums and their order, so the results are those of
// tables that exchange alone, bit for bit. A table built with RowExchange::own has an exchange of
// its own (a group of one: the same code); Dlrm builds one per communicator over its tables.
//
// Every buffer is allocated at construction for the tables' capacities (max_ids ids a rank, as
// many parts, group x that at an owner), so a step allocates nothing and every count it sends
// is bounded by them; those bounds are checked against an MPI count (int) there (bad_input
// naming the tables and data.batch_size).
class EmbeddingExchange {
 public:
  // tables: each exchanges rows over the same communicator and has no exchange yet (built with
  // RowExchange::shared, or its own being made), in the order every rank of the group lists
  // them: slot k is tables[k]. Each table then exchanges through this object, which must
  // outlive that use; the tables' addresses are not kept.
  explicit EmbeddingExchange(const std::vector<EmbeddingBag*>& tables);
  EmbeddingExchange(const EmbeddingExchange&) = delete;
  EmbeddingExchange& operator=(const EmbeddingExchange&) = delete;

  // The forward of every table (as EmbeddingBag::forward each): tables[k] is slot k's table
  // (table_count() of them) and bags[k] its bags, valid until backward. Collective over the
  // group. When a rank's bags of any table are bad, every rank of the group throws at the same
  // call: the first table in slot order with a problem is named (this rank's own sentence
  // naming the table and the id, or that another rank of the group was given bad bags).
  void forward(EmbeddingBag* const* tables, const SparseBags* bags);
  // After every table's backward_begin: the parts' dy to their owners, one all_to_all_v; then
  // each table's backward_end (or its bucketed sparse calls).
  void exchange_dy();

  Communicator* comm() const { return comm_; }
  size_t table_count() const { return dims_.size(); }

 private:
  friend class EmbeddingBag;
  // From the counts exchanged: where each table's ids and floats go in each rank's block of
  // the four messages (at_[(j, k)], j the rank, k the slot) and each rank's block sizes.
  void lay_out();
  size_t at(int j, size_t k) const { return static_cast<size_t>(j) * dims_.size() + k; }

  Communicator* comm_ = nullptr;
  int n_ = 1;
  std::vector<int64_t> dims_;  // per slot: its columns here
  // Counts [group x tables, 4]: rank j's block holds a row per table.
  Matrix counts_send_, counts_recv_;
  Matrix::HostMirror counts_send_host_, counts_recv_host_;
  // Ids [sum of capacities, 3] out (written on the host, copied) and [group x that, 3] in.
  Matrix ids_send_, ids_recv_;
  Matrix::HostMirror ids_send_host_;
  // The requester's side of the sums and dy, [sum of capacity x dim, 1] (the sums back in
  // forward, the parts' dy out in backward), and the owner's, [group x that, 1].
  Matrix requester_, owner_;
  // Per rank: ids sent and received, floats of sums the owner sends (dy it receives) and the
  // requester receives (dy it sends).
  std::vector<int64_t> ids_out_, ids_in_, owner_floats_, requester_floats_;
  // Per (rank, slot): the first row of the table's ids in rank j's block of the message sent and
  // received; the first float of its parts in the requester's and the owner's message.
  std::vector<int64_t> ids_out_at_, ids_in_at_, requester_at_, owner_at_;
  std::vector<std::string> problems_;  // per slot, this step's (empty when none)
};

}  // namespace meshtrain
