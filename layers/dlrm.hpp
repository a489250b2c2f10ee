#pragma once
// DLRM (issue 39 item 1; docs/recsys.md, "The model"): a click model of dense features and
// bags of categorical ids.
//
//   z = bottom MLP(dense)                       bottom/<i>/weight [bottom[i], bottom[i+1]], bias
//   e_t = EmbeddingBag_t(bags of table t)       embeddings/<t>/weight [rows_t, dim_t]
//   h = interaction(z, e_1 .. e_T)
//   logit = top MLP(h)                          top/<i>/weight [top[i], top[i+1]], bias
//
// The activation follows every bottom layer (DLRM's bottom MLP ends in its activation too) and
// every top layer but the last (the logit). Interaction:
//   dot  (DLRM's): the features F = [z, e_1, .., e_T] (all of width d = bottom's last size =
//        every table's dim); h = [z, F_i . F_j for i = 1 .. T, j = 0 .. i-1] (the strictly
//        lower triangle of F F^T, row by row, as dlrm_s_pytorch's interact_features without
//        self-interaction): width d + T (T + 1) / 2.
//   cat: h = [z, e_1, .., e_T]: width d + sum of the tables' dims.
// top[0] must be that width and top's last size 1 (check_dlrm_shape). Parameters, in
// parameters() order: the bottom layers, the tables in their order, the top layers.
//
// Sharding: every parameter's spec comes from the rules like any other. The linear layers are
// the same Linear as an mlp's (replicated, DP or FSDP storage); their outputs must be whole rows
// (a tensor-parallel split of a layer's output is refused, bad_input naming the layer). The
// tables are EmbeddingBags (replicated, row-wise over batch axes or column-wise over tp:
// layers/embedding_bag.hpp).
// Every gradient is reduced in backward (no FSDP prefetch yet), with as few collectives as the
// layout allows (docs/recsys.md, "Collectives per step"):
//   the linear layers   those whose gradients are only all-reduced over the batch axes (DP or
//                       replicated storage; GradientReductionPlan decides) go into
//                       GradientBuckets of up to runtime.bucket_mb (the context's; bucketed
//                       whatever runtime.overlap says): one all-reduce, started when the
//                       bottom's first layer is done, for the MLPs of this model's sizes;
//                       the others (FSDP) reduce their own, as an mlp's do;
//   row exchanges       the tables that exchange rows (row-wise, table-wise) over the same
//                       communicator share one EmbeddingExchange: one all-to-all of the
//                       counts, one of the ids and one of the partial sums in forward, one of
//                       the parts' dy in backward, per group and step, whatever the number of
//                       tables (the exchange moves what each table's own would, packed);
//   sparse table grads  the tables summed over the same batch axes (replicated ones, the
//                       row-wise ones on a mesh with more batch axes than they split) exchange
//                       their touched rows in one all-gather and sum their compact gradients,
//                       packed side by side, in one all-reduce per step and group (the
//                       EmbeddingBag's backward_sparse_* calls), in table order on every rank.
// Both sums are elementwise: each element has the addends it had in its own all-reduce, the
// same values bit for bit at np <= 2 and with Open MPI's elementwise sums at np 4 (an MPI
// library that chose another summation order for the longer message could change last bits at
// more than 2 ranks: docs/recsys.md, "Collectives per step"). The reduce dtype must be fp32
// (bad_input otherwise): both sums add in fp32.
//
// Everything (activations, the interaction's buffers, every table's pooled rows and their
// gradients) is allocated at construction for `local_rows` rows and `max_ids` ids per table per
// step: forward() and backward() allocate nothing. fp32 only (bad_input for a 16-bit context),
// except that the tables may be stored as bf16 (shape.table_dtype, model.table_dtype): their
// tensors in parameters() then hold bf16 bits (ShardedTensor::storage) and only a sparse
// optimizer that rounds to bf16 may update them (docs/recsys.md, "bf16 tables").

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "framework/train/init.hpp"
#include "layers/activation.hpp"
#include "layers/context.hpp"
#include "layers/embedding_bag.hpp"
#include "layers/gradient_buckets.hpp"
#include "layers/gradient_reduction.hpp"
#include "layers/linear.hpp"
#include "layers/mlp.hpp"  // SpecLookup
#include "partition/dlrm_shape.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

// How a DLRM's tables are updated, fixed at construction (optimizer.embeddings).
//   dense:  every table has a dense gradient like any parameter (a dense optimizer updates it).
//   sparse: the tables' backward leaves the gradients of the rows they touched only
//           (EmbeddingBag::use_sparse_gradient; a sparse optimizer updates them,
//           layers/sparse_optimizer.hpp) and no dense table gradient is ever allocated.
//   none:   a model that only predicts (run/dlrm_predictor.cpp): no table gradient, dense or
//           sparse, and none of the interaction's gradient buffers; backward() refuses.
enum class TableGradients { dense, sparse, none };

// The dot interaction's kernels as Dlrm::interact and interact_backward run them (features
// [rows, blocks * d]: z then each table's pooled rows; out [rows, d + blocks (blocks - 1) / 2];
// g its gradient, grads the features' gradient), for `meshtrain calibrate` to time at a
// config's shape (the cost model's "dlrm_dot_forward" and "dlrm_dot_backward" rates: rows x
// pairs x d multiply-adds, forward; twice that, backward).
void dlrm_dot_interaction(MatrixView features, MatrixView out, int64_t d, int64_t blocks);
void dlrm_dot_interaction_backward(MatrixView features, MatrixView g, MatrixView grads, int64_t d,
                                   int64_t blocks);

class Dlrm {
 public:
  // Checks the shape (check_dlrm_shape) and the specs, allocates every parameter and buffer.
  // Collective (the layers ask the context for communicators): every rank builds the same model.
  // local_rows: this rank's rows per step; max_ids: the most ids one table's bags of a rank
  // hold in a step (the same on every rank). table_gradients: see TableGradients; with
  // `sparse` or `none`, each table's tensor in gradients() keeps its name and spec but its box
  // and `local` are empty, so a table costs its weights and its optimizer's rows only (a 12 GiB
  // table set never needs 12 GiB more for gradients no step writes, not even for a moment).
  Dlrm(const DlrmShape& shape, Activation activation, const SpecLookup& spec_of,
       ParallelContext& context, int64_t local_rows, int64_t max_ids,
       TableGradients table_gradients = TableGradients::dense);
  Dlrm(const Dlrm&) = delete;
  Dlrm& operator=(const Dlrm&) = delete;

  // The linear layers under `scheme` (framework/train/init.hpp); the tables uniform in
  // [-sqrt(1 / rows), sqrt(1 / rows)) as DLRM's reference does, from (seed, the table's name,
  // the global index): the same global values on every mesh.
  void initialize(InitScheme scheme, uint64_t seed);

  // dense [local_rows, bottom[0]] and one SparseBags per table, in the shape's order (both must
  // stay valid until backward) -> the logits [local_rows, 1], owned by the model.
  MatrixView forward(MatrixView dense, const std::vector<SparseBags>& bags);
  // dLoss/dlogit [local_rows, 1] -> every gradient, overwritten and reduced. Refused (a runtime
  // Error) for a model built with TableGradients::none.
  void backward(MatrixView output_grad);

  std::vector<ShardedTensor>& parameters() { return params_; }
  const std::vector<ShardedTensor>& parameters() const { return params_; }
  std::vector<ShardedTensor>& gradients() { return grads_; }
  const std::vector<ShardedTensor>& gradients() const { return grads_; }
  const DlrmShape& shape() const { return shape_; }
  int64_t local_rows() const { return rows_; }
  const std::vector<EmbeddingBag>& tables() const { return tables_; }
  TableGradients table_gradients() const { return table_gradients_; }
  // The parameters and gradients that are not tables (the bottom and top layers, in
  // parameters() order): what a dense optimizer updates when the tables are updated sparsely.
  // They share the model's storage.
  std::vector<ShardedTensor> dense_parameters() const;
  std::vector<ShardedTensor> dense_gradients() const;
  // The interaction's output of the last forward [local_rows, top[0]] (the top MLP's input).
  MatrixView interaction_output() const { return top_input_; }
  // Bytes of the buffers the bucketed reductions own (the linear layers' gradient buckets, the
  // tables' touched-row messages and packed compact gradients); 0 for a prediction model.
  int64_t reduction_buffer_bytes() const;
  // One line per layer with parameters.
  std::vector<std::string> describe() const;

 private:
  // The interaction forward (features_ from z and the pooled rows, then top_input_) and
  // backward (top_input_grad -> dz_, table_grads_).
  void interact();
  void interact_backward(MatrixView top_input_grad);

  DlrmShape shape_;
  int64_t rows_ = 0;
  TableGradients table_gradients_ = TableGradients::dense;
  int64_t width_d_ = 0;        // bottom's last size
  int64_t feature_width_ = 0;  // d + sum of the tables' dims (the features side by side)
  std::vector<ShardedTensor> params_, grads_;
  // The layers (reserved at construction: pointers stay valid).
  std::vector<Linear> bottom_, top_;
  std::vector<ActivationLayer> bottom_act_, top_act_;
  std::vector<EmbeddingBag> tables_;
  LayerScratch scratch_;
  // The features [z, e_1, .., e_T] side by side [rows, feature_width_], and their gradient.
  Matrix features_, feature_grads_;
  Matrix top_input_;                 // the interaction's output [rows, top[0]]
  Matrix dz_;                        // the bottom output's gradient [rows, d]
  std::vector<Matrix> table_grads_;  // each table's pooled rows' gradient [rows, dim_t]
  // (feature_grads_, dz_ and table_grads_ are empty under TableGradients::none.)
  // Per feature block (z, then each table): its first column in features_.
  std::vector<int64_t> block_first_;
  MatrixView logits_;
  // The linear layers' gradient reduction (sequence: the bottom's, then the top's) and its
  // buckets (empty: every layer reduces its own).
  GradientReductionPlan dense_plan_;
  GradientBuckets dense_buckets_;
  // Sparse table gradients summed over one group of batch axes, exchanged together: the tables
  // (in table order), where each one's list starts in a rank's message, the message [rank_rows,
  // 2] and the gathered messages [group x rank_rows, 2] (device, host), and the compact
  // gradients side by side (up to every table's capacity), all made at construction.
  struct SparseBucket {
    std::vector<std::string> axes;
    Communicator* comm = nullptr;
    std::vector<size_t> tables;
    std::vector<int64_t> at;
    int64_t rank_rows = 0;
    Matrix send, recv;
    Matrix::HostMirror send_host, recv_host;
    Vector grads;
    int64_t used = 0;  // floats of grads this step
  };
  std::vector<SparseBucket> sparse_buckets_;
  std::vector<int> table_bucket_;  // per table: its bucket's index, -1 when not bucketed
  // The tables that exchange rows (row-wise, table-wise) over one communicator, in table order,
  // and their shared exchange (4 all-to-alls a step for all of them): the tables' indices, the
  // tables themselves (tables_ never moves) and this step's bags of each.
  struct RowGroup {
    std::unique_ptr<EmbeddingExchange> exchange;
    std::vector<size_t> tables;
    std::vector<EmbeddingBag*> members;
    std::vector<SparseBags> bags;
  };
  std::vector<RowGroup> row_groups_;
  void backward_tables(const LayerPass& pass);
};

}  // namespace meshtrain
