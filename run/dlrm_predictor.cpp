// A DLRM checkpoint as a function: see dlrm_predictor.hpp for the contract.

#include "run/dlrm_predictor.hpp"

#include <mpi.h>

#include <algorithm>
#include <utility>

#include "base/error.hpp"
#include "framework/comm/backend.hpp"
#include "framework/core/choices.hpp"  // to_string(ModelKind)
#include "framework/core/exec_space.hpp"
#include "framework/core/gemm.hpp"  // set_matmul_precision
#include "framework/core/kernel_label.hpp"
#include "framework/core/sigmoid.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/train/model_summary.hpp"
#include "layers/mlp.hpp"  // specs_from_plan

namespace meshtrain {
namespace {

// p = sigmoid(z) per row (stable_sigmoid: in double, rounded once, as `meshtrain predict`).
void sigmoid_rows(const MatrixView& logits, const Matrix& probabilities) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::dlrm_predict_sigmoid"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(probabilities.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) { probabilities(i, 0) = stable_sigmoid(logits(i, 0)); });
}

// The checkpoint config's overrides that DlrmPredictor cannot honour: the mesh is this rank's
// (every axis at size 1) and the model predicts in fp32 as it trains (Dlrm refuses a 16-bit
// context), whatever they say. Throws bad_input naming the first such key.
void refuse_dlrm_overrides(const std::vector<std::string>& overrides) {
  for (const std::string& o : overrides) {
    const std::string key = override_key(o);
    const bool mesh = key == "mesh" || key.rfind("mesh.", 0) == 0;
    const bool precision = key == "mixed_precision" || key.rfind("mixed_precision.", 0) == 0;
    if (mesh || precision) {
      MESHTRAIN_BAD_INPUT("DlrmPredictor: the override of ", key, " is refused: ",
                          mesh ? "the model is whole on this rank, every mesh axis at size 1"
                               : "a DLRM predicts in fp32, as it trains",
                          ", whatever the override says");
    }
  }
}

}  // namespace

DlrmPredictor::DlrmPredictor(const std::string& checkpoint, int64_t batch_size, int64_t max_ids,
                             const std::vector<std::string>& overrides) {
  device_space();  // the long-lived instances (exec_space.hpp), made before any call
  host_space();
  predictor_detail::copy_rows_label();
  if (batch_size < 0) {
    MESHTRAIN_BAD_INPUT("DlrmPredictor: the batch size must be positive or 0 (the config's), got ",
                        batch_size);
  }
  if (max_ids < 0) {
    MESHTRAIN_BAD_INPUT("DlrmPredictor: max_ids must be positive or 0 (one id per row), got ",
                        max_ids);
  }
  check_prediction_overrides(overrides);
  refuse_dlrm_overrides(overrides);
  path_ = resolve_checkpoint_path(checkpoint);
  const CheckpointInfo info = list_checkpoint(path_).info;
  step_ = info.train_state.step;
  config_ = parse_config(info.config_text, "the config of checkpoint '" + path_ + "'", overrides);
  if (config_.model.kind != ModelKind::dlrm) {
    MESHTRAIN_BAD_INPUT("checkpoint '", path_, "' holds a model.kind = \"",
                        to_string(config_.model.kind),
                        "\" model; DlrmPredictor reads model.kind = \"dlrm\" checkpoints only ",
                        "(meshtrain::Predictor reads the others)");
  }
  shape_ = config_.model.dlrm();
  require_comm_backend_available(config_.runtime.backend);
  // fp32, as the model trains (Dlrm refuses a 16-bit context); the matmul precision fp32 unless
  // an override sets it, as for Predictor.
  config_.mixed_precision = {};
  if (!predictor_detail::overrides_key(overrides, "runtime.matmul_precision")) {
    config_.runtime.matmul_precision = MatmulPrecision::fp32;
  }
  set_matmul_precision(config_.runtime.matmul_precision);

  // The whole model on this rank (Predictor's mesh for a model whole on every rank).
  mesh_ = predictor_detail::whole_model_mesh(config_.mesh, 1);
  batch_size_ =
      batch_size > 0 ? batch_size : config_.data.eval_batch_size.value_or(config_.data.batch_size);
  max_ids_ = max_ids > 0 ? max_ids : batch_size_;
  config_.data.batch_size = batch_size_;
  config_.data.eval_batch_size = batch_size_;
  const PlanOptions options = plan_options(config_);
  plan_ = make_plan(model_parameter_shapes(config_.model), *mesh_, partition_rules(config_),
                    options, model_linear_layers(config_.model));

  const CommBackend backend = resolve_comm_backend(config_.runtime.backend, MPI_COMM_SELF);
  comms_ = std::make_unique<MeshCommunicators>(*mesh_, MPI_COMM_SELF,
                                               prepare_comm_backend(backend, MPI_COMM_SELF));
  context_.emplace(*comms_, options.batch_axes, options.feature_axis,
                   config_.partition.collective_matmul, config_.runtime.overlap,
                   config_.runtime.bucket_mb);
  context_->set_precision(config_.mixed_precision.policy());
  // TableGradients::none: prediction needs no table gradient (a dense one is as large as the
  // table) and no interaction gradient; only the linear layers' small gradients are allocated.
  model_ = std::make_unique<Dlrm>(shape_, config_.model.activation, specs_from_plan(*plan_),
                                  *context_, batch_size_, max_ids_, TableGradients::none);
  CheckpointContents contents;
  contents.mesh = *mesh_;
  contents.params = model_->parameters();  // views: the load fills the model's tensors
  load_checkpoint(path_, contents, MPI_COMM_SELF);

  // --- Buffers, allocated once. -------------------------------------------------------------
  dense_ = Matrix("meshtrain::dlrm_predict_dense", batch_size_, dense_features());
  dense_host_ = host_mirror(dense_);
  probabilities_ = Matrix("meshtrain::dlrm_predict_probabilities", batch_size_, 1);
  probabilities_host_ = host_mirror(probabilities_);
  for (size_t t = 0; t < shape_.tables.size(); ++t) {
    offsets_.emplace_back("meshtrain::dlrm_predict_offsets", batch_size_ + 1);
    ids_.emplace_back("meshtrain::dlrm_predict_ids", max_ids_);
    offsets_host_.push_back(host_mirror(offsets_.back()));
    ids_host_.push_back(host_mirror(ids_.back()));
    model_bags_.push_back(SparseBags{IdView(offsets_.back().data(), batch_size_ + 1),
                                     IdView(ids_.back().data(), max_ids_)});
  }
  // One call on nothing (zero rows, empty bags): whatever a layer sets up at its first use
  // happens here, so that predict() allocates nothing.
  std::vector<int64_t> zeros(1, 0);
  std::vector<DlrmBags> empty(shape_.tables.size(),
                              DlrmBags{HostIds(zeros.data(), 1), HostIds(zeros.data(), 0)});
  run(0, empty);
}

DlrmPredictor::~DlrmPredictor() = default;

std::string DlrmPredictor::model_description() const {
  return model_summary(config_.model);
}

std::vector<std::string> DlrmPredictor::describe() const {
  std::vector<std::string> lines;
  lines.push_back(detail::concat("checkpoint ", path_, " (step ", step_, ")"));
  lines.push_back("model " + model_description());
  lines.push_back(detail::concat("one rank, batch ", batch_size_, " rows, at most ", max_ids_,
                                 " ids per table and call"));
  for (const std::string& line : model_->describe()) lines.push_back("  " + line);
  return lines;
}

void DlrmPredictor::check_input(int64_t rows, int64_t width,
                                const std::vector<DlrmBags>& bags) const {
  if (width != dense_features()) {
    MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: the dense view has ", width,
                        " features per row but the model takes ", dense_features(),
                        " (model.bottom[0])");
  }
  if (rows > batch_size_) {
    MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: the dense view has ", rows,
                        " rows, more than the batch size of ", batch_size_,
                        " the predictor was made for");
  }
  if (bags.size() != shape_.tables.size()) {
    MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: ", bags.size(), " tables' bags given but the ",
                        "model has ", shape_.tables.size(), " tables (first '",
                        shape_.tables.front().name, "')");
  }
  for (size_t t = 0; t < bags.size(); ++t) {
    const DlrmTable& table = shape_.tables[t];
    const HostIds& offsets = bags[t].offsets;
    const HostIds& ids = bags[t].ids;
    if (static_cast<int64_t>(offsets.extent(0)) < rows + 1) {
      MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: table '", table.name, "': ", offsets.extent(0),
                          " offsets given for ", rows, " rows, which need ", rows + 1);
    }
    if (offsets(0) != 0) {
      MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: table '", table.name, "': the offsets start at ",
                          offsets(0), ", not 0");
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (offsets(r + 1) < offsets(r)) {
        MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: table '", table.name, "': offsets[", r + 1,
                            "] = ", offsets(r + 1), " is below offsets[", r, "] = ", offsets(r),
                            " (the offsets must not decrease)");
      }
    }
    const int64_t count = offsets(rows);
    if (count > max_ids_) {
      MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: table '", table.name, "': ", count,
                          " ids in one call, more than the max_ids of ", max_ids_,
                          " the predictor was made for");
    }
    if (static_cast<int64_t>(ids.extent(0)) < count) {
      MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: table '", table.name, "': the offsets name ",
                          count, " ids but the ids view holds ", ids.extent(0));
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = offsets(r); k < offsets(r + 1); ++k) {
        if (ids(k) < 0 || ids(k) >= table.rows) {
          MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: table '", table.name, "', row ", r, ": id ",
                              ids(k), " is outside the table's rows [0, ", table.rows, ")");
        }
      }
    }
  }
}

DlrmPrediction DlrmPredictor::run(int64_t rows, const std::vector<DlrmBags>& bags) {
  if (rows < batch_size_) predictor_detail::zero_rows(dense_, rows);
  for (size_t t = 0; t < bags.size(); ++t) {
    const HostIds& offsets = bags[t].offsets;
    const HostIds& ids = bags[t].ids;
    auto& offsets_host = offsets_host_[t];
    const int64_t count = offsets(rows);
    for (int64_t r = 0; r <= rows; ++r) offsets_host(r) = offsets(r);
    for (int64_t r = rows + 1; r <= batch_size_; ++r) offsets_host(r) = count;  // empty bags
    std::copy(ids.data(), ids.data() + count, ids_host_[t].data());
    if (device_memory_is_separate()) {
      copy_view(offsets_[t], offsets_host);
      copy_view(Kokkos::subview(ids_[t], std::make_pair(int64_t{0}, count)),
                Kokkos::subview(ids_host_[t], std::make_pair(int64_t{0}, count)));
    }
  }
  const MatrixView logits = model_->forward(dense_, model_bags_);
  sigmoid_rows(logits, probabilities_);
  fence_device(MESHTRAIN_LABEL("meshtrain::DlrmPredictor::predict"));
  // Rows [0, rows): the padding rows are computed, never returned.
  return DlrmPrediction{rows, ConstMatrixView(logits.data(), rows, 1),
                        ConstMatrixView(probabilities_.data(), rows, 1)};
}

}  // namespace meshtrain
