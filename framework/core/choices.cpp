#include "framework/core/choices.hpp"

#include <algorithm>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {
namespace {

template <class Enum>
Enum parse(const ChoiceTable<Enum>& table, const std::string& name, const std::string& key) {
  for (const auto& [text, value] : table) {
    if (text == name) return value;
  }
  MESHTRAIN_BAD_INPUT(key, " = '", name, "' is not one of ", join(choice_names(table), " | "));
}

template <class Enum>
const char* name_of(const ChoiceTable<Enum>& table, Enum value) {
  for (const auto& [text, entry] : table) {
    if (entry == value) return text.c_str();
  }
  return "?";
}

}  // namespace

const ChoiceTable<DlrmInteraction>& dlrm_interaction_choices() {
  static const ChoiceTable<DlrmInteraction> table = {{"dot", DlrmInteraction::dot},
                                                     {"cat", DlrmInteraction::cat}};
  return table;
}

const ChoiceTable<ModelKind>& model_kind_choices() {
  static const ChoiceTable<ModelKind> table = {{"mlp", ModelKind::mlp},
                                               {"residual_mlp", ModelKind::residual_mlp},
                                               {"dlrm", ModelKind::dlrm}};
  return table;
}

const ChoiceTable<ModelNorm>& model_norm_choices() {
  static const ChoiceTable<ModelNorm> table = {{"layernorm", ModelNorm::layernorm},
                                               {"rmsnorm", ModelNorm::rmsnorm},
                                               {"none", ModelNorm::none}};
  return table;
}

const ChoiceTable<Activation>& activation_choices() {
  static const ChoiceTable<Activation> table = {
      {"relu", Activation::relu}, {"tanh", Activation::tanh},
      {"gelu", Activation::gelu}, {"gelu_erf", Activation::gelu_erf},
      {"silu", Activation::silu}, {"sigmoid", Activation::sigmoid},
      {"none", Activation::none}};
  return table;
}

const ChoiceTable<InitScheme>& init_scheme_choices() {
  static const ChoiceTable<InitScheme> table = {{"he_normal", InitScheme::he_normal},
                                                {"xavier_uniform", InitScheme::xavier_uniform},
                                                {"normal", InitScheme::normal},
                                                {"zeros", InitScheme::zeros}};
  return table;
}

const ChoiceTable<LossKind>& loss_kind_choices() {
  static const ChoiceTable<LossKind> table = {
      {"cross_entropy", LossKind::cross_entropy},
      {"mse", LossKind::mse},
      {"huber", LossKind::huber},
      {"mae", LossKind::mae},
      {"binary_cross_entropy", LossKind::binary_cross_entropy}};
  return table;
}

const ChoiceTable<OptimizerKind>& optimizer_kind_choices() {
  static const ChoiceTable<OptimizerKind> table = {{"sgd", OptimizerKind::sgd},
                                                   {"adamw", OptimizerKind::adamw}};
  return table;
}

const ChoiceTable<EmbeddingOptimizer>& embedding_optimizer_choices() {
  static const ChoiceTable<EmbeddingOptimizer> table = {
      {"dense", EmbeddingOptimizer::dense},
      {"rowwise_adagrad", EmbeddingOptimizer::rowwise_adagrad},
      {"sparse_adamw", EmbeddingOptimizer::sparse_adamw}};
  return table;
}

const ChoiceTable<CollectiveMatmulAlgorithm>& collective_matmul_choices() {
  static const ChoiceTable<CollectiveMatmulAlgorithm> table = {
      {"naive", CollectiveMatmulAlgorithm::naive},
      {"ring", CollectiveMatmulAlgorithm::ring},
      {"bidirectional", CollectiveMatmulAlgorithm::bidirectional},
      {"auto", CollectiveMatmulAlgorithm::automatic}};
  return table;
}

const ChoiceTable<LrScheduleKind>& lr_schedule_choices() {
  static const ChoiceTable<LrScheduleKind> table = {{"constant", LrScheduleKind::constant},
                                                    {"linear", LrScheduleKind::linear},
                                                    {"cosine", LrScheduleKind::cosine}};
  return table;
}

const ChoiceTable<CommBackendChoice>& comm_backend_choices() {
  static const ChoiceTable<CommBackendChoice> table = {{"auto", CommBackendChoice::automatic},
                                                       {"mpi", CommBackendChoice::mpi},
                                                       {"nccl", CommBackendChoice::nccl}};
  return table;
}

const ChoiceTable<CudaGraphsChoice>& cuda_graphs_choices() {
  static const ChoiceTable<CudaGraphsChoice> table = {{"auto", CudaGraphsChoice::automatic},
                                                      {"off", CudaGraphsChoice::off}};
  return table;
}

const ChoiceTable<ReductionAlgorithm>& reduction_algorithm_choices() {
  static const ChoiceTable<ReductionAlgorithm> table = {{"auto", ReductionAlgorithm::automatic},
                                                        {"mpi", ReductionAlgorithm::mpi},
                                                        {"ring", ReductionAlgorithm::ring},
                                                        {"measure", ReductionAlgorithm::measure}};
  return table;
}

const ChoiceTable<MatmulPrecision>& matmul_precision_choices() {
  static const ChoiceTable<MatmulPrecision> table = {{"fp32", MatmulPrecision::fp32},
                                                     {"tf32", MatmulPrecision::tf32}};
  return table;
}

const ChoiceTable<Dtype>& dtype_choices() {
  static const ChoiceTable<Dtype> table = {
      {"fp32", Dtype::fp32}, {"bf16", Dtype::bf16}, {"fp16", Dtype::fp16}};
  return table;
}

const ChoiceTable<Dtype>& table_dtype_choices() {
  static const ChoiceTable<Dtype> table = {{"fp32", Dtype::fp32}, {"bf16", Dtype::bf16}};
  return table;
}

const ChoiceTable<DataSource>& data_source_choices() {
  static const ChoiceTable<DataSource> table = {{"fashion_mnist", DataSource::fashion_mnist},
                                                {"synthetic", DataSource::synthetic},
                                                {"hdf5", DataSource::hdf5},
                                                {"stream", DataSource::stream}};
  return table;
}

const ChoiceTable<StreamPolicy>& stream_policy_choices() {
  static const ChoiceTable<StreamPolicy> table = {{"window", StreamPolicy::window},
                                                  {"reservoir", StreamPolicy::reservoir}};
  return table;
}

const ChoiceTable<StreamOrder>& stream_order_choices() {
  static const ChoiceTable<StreamOrder> table = {{"random", StreamOrder::random},
                                                 {"arrival", StreamOrder::arrival}};
  return table;
}

const ChoiceTable<StreamMerge>& stream_merge_choices() {
  static const ChoiceTable<StreamMerge> table = {{"arrival", StreamMerge::arrival},
                                                 {"round_robin", StreamMerge::round_robin}};
  return table;
}

const ChoiceTable<StreamRowType>& stream_row_type_choices() {
  static const ChoiceTable<StreamRowType> table = {{"float32", StreamRowType::float32},
                                                   {"float64", StreamRowType::float64}};
  return table;
}

const ChoiceTable<StreamUntil>& stream_until_choices() {
  static const ChoiceTable<StreamUntil> table = {{"steps", StreamUntil::steps},
                                                 {"closed", StreamUntil::closed}};
  return table;
}

const ChoiceTable<ShuffleMode>& shuffle_mode_choices() {
  static const ChoiceTable<ShuffleMode> table = {
      {"none", ShuffleMode::none}, {"rows", ShuffleMode::rows}, {"blocks", ShuffleMode::blocks}};
  return table;
}

const std::vector<std::string>& eval_metric_names() {
  static const std::vector<std::string> names = {
      "test_loss", "test_accuracy", "test_top5_accuracy", "test_mse",     "test_mae",
      "test_r2",   "test_rel_l2",   "test_auc",           "test_log_loss"};
  return names;
}

std::optional<EvalMetric> find_eval_metric(const std::string& name) {
  const std::vector<std::string>& names = eval_metric_names();
  const size_t bracket = name.find('[');
  const std::string base = name.substr(0, bracket);
  const auto it = std::find(names.begin(), names.end(), base);
  if (it == names.end()) return std::nullopt;
  EvalMetric metric;
  metric.kind = static_cast<EvalMetric::Kind>(it - names.begin());
  if (bracket == std::string::npos) return metric;
  // "[j]": a non-negative decimal index, on a metric kept per output.
  if (!metric.per_output() || name.back() != ']') return std::nullopt;
  const std::string index = name.substr(bracket + 1, name.size() - bracket - 2);
  if (index.empty() || index.size() > 9 ||
      !std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  metric.output = std::stoll(index);
  return metric;
}

std::string reported_metrics_text(LossKind loss) {
  std::vector<std::string> reported;
  const std::vector<std::string>& names = eval_metric_names();
  for (size_t i = 0; i < names.size(); ++i) {
    if (EvalMetric{static_cast<EvalMetric::Kind>(i), -1}.reported_for(loss)) {
      reported.push_back(names[i]);
    }
  }
  std::string text;
  for (size_t i = 0; i < reported.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == reported.size() ? " or " : ", ") + reported[i];
  }
  return text;
}

std::string eval_metric_choices_text() {
  return join(eval_metric_names(), " | ") +
         ", or one output's test_mse[j] | test_mae[j] | test_r2[j] | test_rel_l2[j] | "
         "test_auc[j] | test_log_loss[j]";
}

const ChoiceTable<Normalize>& normalize_choices() {
  static const ChoiceTable<Normalize> table = {{"none", Normalize::none},
                                               {"standard", Normalize::standard}};
  return table;
}

Activation parse_activation(const std::string& name, const std::string& key) {
  return parse(activation_choices(), name, key);
}

InitScheme parse_init_scheme(const std::string& name, const std::string& key) {
  return parse(init_scheme_choices(), name, key);
}
LossKind parse_loss_kind(const std::string& name, const std::string& key) {
  return parse(loss_kind_choices(), name, key);
}
OptimizerKind parse_optimizer_kind(const std::string& name, const std::string& key) {
  return parse(optimizer_kind_choices(), name, key);
}
CollectiveMatmulAlgorithm parse_collective_matmul_algorithm(const std::string& name,
                                                            const std::string& key) {
  return parse(collective_matmul_choices(), name, key);
}

LrScheduleKind parse_lr_schedule(const std::string& name, const std::string& key) {
  return parse(lr_schedule_choices(), name, key);
}
CommBackendChoice parse_comm_backend(const std::string& name, const std::string& key) {
  return parse(comm_backend_choices(), name, key);
}
ReductionAlgorithm parse_reduction_algorithm(const std::string& name, const std::string& key) {
  return parse(reduction_algorithm_choices(), name, key);
}
MatmulPrecision parse_matmul_precision(const std::string& name, const std::string& key) {
  return parse(matmul_precision_choices(), name, key);
}

Dtype parse_dtype(const std::string& name, const std::string& key) {
  return parse(dtype_choices(), name, key);
}

const char* to_string(ModelKind value) {
  return name_of(model_kind_choices(), value);
}
const char* to_string(ModelNorm value) {
  return name_of(model_norm_choices(), value);
}
const char* to_string(Activation value) {
  return name_of(activation_choices(), value);
}
const char* to_string(InitScheme value) {
  return name_of(init_scheme_choices(), value);
}
const char* to_string(LossKind value) {
  return name_of(loss_kind_choices(), value);
}
const char* to_string(OptimizerKind value) {
  return name_of(optimizer_kind_choices(), value);
}
const char* to_string(EmbeddingOptimizer value) {
  return name_of(embedding_optimizer_choices(), value);
}
const char* to_string(CollectiveMatmulAlgorithm value) {
  return name_of(collective_matmul_choices(), value);
}
const char* to_string(LrScheduleKind value) {
  return name_of(lr_schedule_choices(), value);
}
const char* to_string(CommBackendChoice value) {
  return name_of(comm_backend_choices(), value);
}
const char* to_string(ReductionAlgorithm value) {
  return name_of(reduction_algorithm_choices(), value);
}
const char* to_string(CudaGraphsChoice value) {
  return name_of(cuda_graphs_choices(), value);
}
const char* to_string(MatmulPrecision value) {
  return name_of(matmul_precision_choices(), value);
}

const char* to_string(Dtype value) {
  return name_of(dtype_choices(), value);
}

const char* to_string(DataSource value) {
  return name_of(data_source_choices(), value);
}
const char* to_string(ShuffleMode value) {
  return name_of(shuffle_mode_choices(), value);
}
const char* to_string(StreamPolicy value) {
  return name_of(stream_policy_choices(), value);
}
const char* to_string(StreamOrder value) {
  return name_of(stream_order_choices(), value);
}
const char* to_string(StreamMerge value) {
  return name_of(stream_merge_choices(), value);
}
const char* to_string(StreamRowType value) {
  return name_of(stream_row_type_choices(), value);
}
const char* to_string(StreamUntil value) {
  return name_of(stream_until_choices(), value);
}
std::string to_string(const EvalMetric& value) {
  std::string name = eval_metric_names().at(static_cast<size_t>(value.kind));
  if (value.output >= 0) name += "[" + std::to_string(value.output) + "]";
  return name;
}

const char* to_string(Normalize value) {
  return name_of(normalize_choices(), value);
}

}  // namespace meshtrain
