#pragma once
// The named options of a run, in one place: each enum with the one table of its names.
// The config reader offers exactly these names, and the code that turns a name into a
// value (parse_*) reads the same table, so the two cannot disagree.
//
// clang-format off
//   model.kind                    ModelKind                  mlp | residual_mlp | dlrm
//   model.norm                    ModelNorm                  layernorm | rmsnorm | none
//   model.interaction             DlrmInteraction            dot | cat
//   model.activation              Activation                 relu | tanh | gelu | gelu_erf | silu | sigmoid | none
//   model.init                    InitScheme                 he_normal | xavier_uniform | normal | zeros
//   model.loss                    LossKind                   cross_entropy | mse | huber | mae | binary_cross_entropy
//                                                            (config: also auto)
//   optimizer.kind                OptimizerKind              sgd | adamw
//   optimizer.embeddings          EmbeddingOptimizer         dense | rowwise_adagrad | sparse_adamw
//   optimizer.schedule            LrScheduleKind             constant | linear | cosine
//   partition.collective_matmul   CollectiveMatmulAlgorithm  naive | ring | bidirectional | auto
//   runtime.backend               CommBackendChoice          auto | mpi | nccl
//   runtime.reductions            ReductionAlgorithm         auto | mpi | ring | measure
//   runtime.matmul_precision      MatmulPrecision            fp32 | tf32
//   runtime.cuda_graphs           CudaGraphsChoice           auto | off
//   data.source                   DataSource                 fashion_mnist | synthetic | hdf5 | stream
//   stream.policy                 StreamPolicy               window | reservoir
//   stream.order                  StreamOrder                random | arrival
//   stream.merge                  StreamMerge                arrival | round_robin
//   stream.dtype                  StreamRowType              float32 | float64
//   stream.until                  StreamUntil                steps | closed
//   data.shuffle                  ShuffleMode                none | rows | blocks (config: false | true | "blocks")
//   checkpoint.keep_best          EvalMetric                 test_loss | test_accuracy | test_top5_accuracy |
//                                                            test_mse | test_mae | test_r2 | test_rel_l2 |
//                                                            test_auc | test_log_loss, all from test_mse on also
//                                                            of one output: test_r2[j] (unset: off)
//   data.normalize_inputs         Normalize                  none | standard
//   data.normalize_targets        Normalize                  none | standard
//   mixed_precision.param_dtype   Dtype                      fp32 | bf16 | fp16
//   mixed_precision.reduce_dtype  Dtype                      fp32 | bf16 | fp16
// clang-format on

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.hpp"                             // Dtype
#include "partition/collective_matmul_algorithm.hpp"  // CollectiveMatmulAlgorithm
#include "partition/dlrm_shape.hpp"                   // DlrmInteraction

namespace meshtrain {

// mlp: a plain stack of layers (model.sizes); residual_mlp: pre-norm residual blocks
// (docs/models.md).
enum class ModelKind { mlp, residual_mlp, dlrm };
// The norm of a residual_mlp's blocks and its output (layers/norm.hpp).
enum class ModelNorm { layernorm, rmsnorm, none };
// gelu: the tanh form; gelu_erf: the exact erf form; none: the identity (layers/activation.hpp).
enum class Activation { relu, tanh, gelu, gelu_erf, silu, sigmoid, none };
enum class InitScheme { he_normal, xavier_uniform, normal, zeros };
// cross_entropy classifies (integer labels); mse, huber and mae regress (float targets);
// binary_cross_entropy is PyTorch's BCEWithLogitsLoss: one independent yes/no per output
// (float targets in [0, 1], the logits' sigmoid the probability).
enum class LossKind { cross_entropy, mse, huber, mae, binary_cross_entropy };
// Whether the loss reads float targets [rows, outputs] (data y as floats, model.loss_weights):
// every loss but cross_entropy.
constexpr bool takes_targets(LossKind kind) {
  return kind != LossKind::cross_entropy;
}
// Whether the loss regresses (everything mse enables: target normalization, the regression
// metrics): mse, huber and mae.
constexpr bool is_regression(LossKind kind) {
  return kind == LossKind::mse || kind == LossKind::huber || kind == LossKind::mae;
}
enum class OptimizerKind { sgd, adamw };
// How a dlrm's embedding tables are updated: dense (optimizer.kind over every row, as every
// parameter), or only the rows a step touched (layers/sparse_optimizer.hpp) by rowwise_adagrad
// or sparse_adamw (AdamW with lazy moments).
enum class EmbeddingOptimizer { dense, rowwise_adagrad, sparse_adamw };
enum class LrScheduleKind { constant, linear, cosine };
enum class CommBackendChoice { automatic, mpi, nccl };
// The MPI backend's blocking sums (framework/comm/reduction_choice.hpp): the MPI library's
// collectives, meshtrain's own ring, the faster of the two by the hardware file (automatic),
// or as measured when the run starts (measure).
enum class ReductionAlgorithm { automatic, mpi, ring, measure };
// [runtime] comm_thread: true | false | "auto" (framework/comm/progress_thread.hpp).
enum class CommThreadChoice { automatic, on, off };
// [runtime] cuda_graphs: capture the training step once as a CUDA graph and replay it where that
// is legal (automatic), or never (off); framework/core/step_graph.hpp.
enum class CudaGraphsChoice { automatic, off };
// How float GEMMs may round (see framework/core/gemm.hpp).
enum class MatmulPrecision { fp32, tf32 };
enum class DataSource { fashion_mnist, synthetic, hdf5, stream };
// A stream's buffer (docs/online.md): the newest rows, or a uniform sample of every row seen.
enum class StreamPolicy { window, reservoir };
// Which buffer rows a batch takes: hashed at random, or in the order they came.
enum class StreamOrder { random, arrival };
// How a batch group takes several producers' messages: as they come, or in a fixed turn.
enum class StreamMerge { arrival, round_robin };
// The type of a stream's rows on the wire.
enum class StreamRowType { float32, float64 };
// A stream run ends at train.steps, or after the step in which every producer had closed.
enum class StreamUntil { steps, closed };
// The order of an epoch's rows (framework/io/data_order.hpp): as stored, shuffled rows, or
// shuffled blocks of rows.
enum class ShuffleMode { none, rows, blocks };
// What an evaluation is judged by (checkpoint.keep_best, train.early_stopping): one metric the
// evaluation reports (docs/running.md), over every output or of one ("test_r2[2]"). Higher is
// better for the accuracies, R^2 and AUC, lower for the rest. test_accuracy is a classifier's
// or a binary_cross_entropy model's; test_auc and test_log_loss only the latter's.
struct EvalMetric {
  enum class Kind { loss, accuracy, top5_accuracy, mse, mae, r2, rel_l2, auc, log_loss };
  Kind kind = Kind::loss;
  int64_t output = -1;  // the output a per-output metric is of; -1: over every output

  static const EvalMetric test_loss, test_accuracy;

  bool higher_is_better() const {
    return kind == Kind::accuracy || kind == Kind::top5_accuracy || kind == Kind::r2 ||
           kind == Kind::auc;
  }
  bool classification() const { return kind == Kind::accuracy || kind == Kind::top5_accuracy; }
  bool binary() const { return kind == Kind::auc || kind == Kind::log_loss; }
  bool regression() const { return kind != Kind::loss && !classification() && !binary(); }
  // Whether "[j]" may name one output's.
  bool per_output() const { return regression() || binary(); }
  // Whether a model trained with `loss` reports it.
  bool reported_for(LossKind loss) const {
    if (kind == Kind::loss) return true;
    if (loss == LossKind::cross_entropy) return classification();
    if (loss == LossKind::binary_cross_entropy) return binary() || kind == Kind::accuracy;
    return regression();
  }
  bool operator==(const EvalMetric& o) const { return kind == o.kind && output == o.output; }
  bool operator!=(const EvalMetric& o) const { return !(*this == o); }
};
inline const EvalMetric EvalMetric::test_loss{EvalMetric::Kind::loss, -1};
inline const EvalMetric EvalMetric::test_accuracy{EvalMetric::Kind::accuracy, -1};
// What the data path does to inputs (or regression targets) before the model sees them
// (framework/io/normalization.hpp): nothing, or (x - mean) / std per feature.
enum class Normalize { none, standard };

// The names of each enum's values, in declaration order.
template <class Enum>
using ChoiceTable = std::vector<std::pair<std::string, Enum>>;
const ChoiceTable<ModelKind>& model_kind_choices();
const ChoiceTable<ModelNorm>& model_norm_choices();
const ChoiceTable<DlrmInteraction>& dlrm_interaction_choices();
const ChoiceTable<Activation>& activation_choices();
const ChoiceTable<InitScheme>& init_scheme_choices();
const ChoiceTable<LossKind>& loss_kind_choices();
const ChoiceTable<OptimizerKind>& optimizer_kind_choices();
const ChoiceTable<EmbeddingOptimizer>& embedding_optimizer_choices();
const ChoiceTable<CollectiveMatmulAlgorithm>& collective_matmul_choices();
const ChoiceTable<LrScheduleKind>& lr_schedule_choices();
const ChoiceTable<CommBackendChoice>& comm_backend_choices();
const ChoiceTable<ReductionAlgorithm>& reduction_algorithm_choices();
const ChoiceTable<MatmulPrecision>& matmul_precision_choices();
const ChoiceTable<CudaGraphsChoice>& cuda_graphs_choices();
const ChoiceTable<Dtype>& dtype_choices();
// model.table_dtype: fp32 | bf16.
const ChoiceTable<Dtype>& table_dtype_choices();
const ChoiceTable<DataSource>& data_source_choices();
const ChoiceTable<ShuffleMode>& shuffle_mode_choices();
const ChoiceTable<StreamPolicy>& stream_policy_choices();
const ChoiceTable<StreamOrder>& stream_order_choices();
const ChoiceTable<StreamMerge>& stream_merge_choices();
const ChoiceTable<StreamRowType>& stream_row_type_choices();
const ChoiceTable<StreamUntil>& stream_until_choices();
// The names of the metrics over every output, in EvalMetric::Kind's order ("test_loss", ...).
const std::vector<std::string>& eval_metric_names();
// "test_mse", "test_r2[2]", ...; nullopt for a name that is none (an index on a metric that has
// none per output, a malformed index). The index is not checked against any model.
std::optional<EvalMetric> find_eval_metric(const std::string& name);
// The metrics a model trained with `loss` reports, for a sentence: "test_loss, test_accuracy or
// test_top5_accuracy" (EvalMetric::reported_for, in the order of eval_metric_names()).
std::string reported_metrics_text(LossKind loss);
// What the metric names and what they may be, for messages and the docs.
std::string eval_metric_choices_text();
const ChoiceTable<Normalize>& normalize_choices();

// The names of a table, for the config reader's "must be one of" and for messages.
template <class Enum>
std::vector<std::string> choice_names(const ChoiceTable<Enum>& table) {
  std::vector<std::string> names;
  for (const auto& entry : table) names.push_back(entry.first);
  return names;
}

// Name -> value; bad_input "<key> = '<name>' is not one of a | b | c" otherwise.
Activation parse_activation(const std::string& name, const std::string& key = "model.activation");
InitScheme parse_init_scheme(const std::string& name, const std::string& key = "model.init");
LossKind parse_loss_kind(const std::string& name, const std::string& key = "model.loss");
OptimizerKind parse_optimizer_kind(const std::string& name,
                                   const std::string& key = "optimizer.kind");
CollectiveMatmulAlgorithm parse_collective_matmul_algorithm(
    const std::string& name, const std::string& key = "partition.collective_matmul");
LrScheduleKind parse_lr_schedule(const std::string& name,
                                 const std::string& key = "optimizer.schedule");
CommBackendChoice parse_comm_backend(const std::string& name,
                                     const std::string& key = "runtime.backend");
ReductionAlgorithm parse_reduction_algorithm(const std::string& name,
                                             const std::string& key = "runtime.reductions");
MatmulPrecision parse_matmul_precision(const std::string& name,
                                       const std::string& key = "runtime.matmul_precision");
Dtype parse_dtype(const std::string& name, const std::string& key);

// Value -> name.
const char* to_string(ModelKind value);
const char* to_string(ModelNorm value);
const char* to_string(Activation value);
const char* to_string(InitScheme value);
const char* to_string(LossKind value);
const char* to_string(OptimizerKind value);
const char* to_string(EmbeddingOptimizer value);
const char* to_string(CollectiveMatmulAlgorithm value);
const char* to_string(LrScheduleKind value);
const char* to_string(CommBackendChoice value);
const char* to_string(ReductionAlgorithm value);
const char* to_string(MatmulPrecision value);
const char* to_string(CudaGraphsChoice value);
const char* to_string(Dtype value);
const char* to_string(DataSource value);
const char* to_string(ShuffleMode value);
const char* to_string(StreamPolicy value);
const char* to_string(StreamOrder value);
const char* to_string(StreamMerge value);
const char* to_string(StreamRowType value);
const char* to_string(StreamUntil value);
std::string to_string(const EvalMetric& value);  // "test_loss", "test_r2[2]"

const char* to_string(Normalize value);

}  // namespace meshtrain
