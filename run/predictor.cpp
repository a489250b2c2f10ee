// A trained model as a function: see predictor.hpp for the contract.

#include "run/predictor.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "framework/comm/backend.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/gemm.hpp"  // set_matmul_precision
#include "framework/core/kokkos_math.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/train/model_summary.hpp"

namespace meshtrain {
namespace {

bool in_section(const std::string& key, const char* section) {
  const std::string s = section;
  return key == s || key.rfind(s + ".", 0) == 0;
}

bool overrides_section(const std::vector<std::string>& overrides, const char* section) {
  return std::any_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return in_section(override_key(o), section); });
}

bool overrides_key(const std::vector<std::string>& overrides, const char* key) {
  return std::any_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return override_key(o) == key; });
}

// Rank 0's string on every rank.
void broadcast_text(std::string& text, MPI_Comm comm, const char* what) {
  broadcast_string(text, 0, comm, what);
}

std::vector<double> broadcast_doubles(std::vector<double> values, MPI_Comm comm) {
  long long n = static_cast<long long>(values.size());
  broadcast_collective(&n, 1, MPI_LONG_LONG, 0, comm, "MPI_Ibcast (normalization statistics)");
  values.resize(static_cast<size_t>(n));
  if (n > 0) {
    broadcast_collective(values.data(), static_cast<int>(n), MPI_DOUBLE, 0, comm,
                         "MPI_Ibcast (normalization statistics)");
  }
  return values;
}

Kokkos::View<double*, Kokkos::LayoutRight> device_doubles(const std::vector<double>& values,
                                                          const char* label) {
  Kokkos::View<double*, Kokkos::LayoutRight> view(std::string(label), values.size());
  auto host = host_mirror(view);
  for (size_t i = 0; i < values.size(); ++i) host(i) = values[i];
  Kokkos::deep_copy(view, host);
  return view;
}

// The kernels of a prediction, as free functions (CUDA's extended lambdas may not live in a
// private member function).
using DoubleView = Kokkos::View<double*, Kokkos::LayoutRight>;

// x rows [first, end) = 0.
void zero_rows(const Matrix& x, int64_t first) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::predict_pad"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {first, int64_t{0}},
          {static_cast<int64_t>(x.extent(0)), static_cast<int64_t>(x.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { x(i, j) = 0.0f; });
}

// x = (x - mean) / std per column, in double.
void standardize(const Matrix& x, const DoubleView& mean, const DoubleView& stddev) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::predict_normalize_inputs"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {int64_t{0}, int64_t{0}},
          {static_cast<int64_t>(x.extent(0)), static_cast<int64_t>(x.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        x(i, j) = static_cast<float>((static_cast<double>(x(i, j)) - mean(j)) / stddev(j));
      });
}

// out = y * std + mean per column, in double.
void to_target_units(const MatrixView& y, const DoubleView& mean, const DoubleView& stddev,
                     const Matrix& out) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::predict_denormalize_outputs"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {int64_t{0}, int64_t{0}},
          {static_cast<int64_t>(out.extent(0)), static_cast<int64_t>(out.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        out(i, j) = static_cast<float>(static_cast<double>(y(i, j)) * stddev(j) + mean(j));
      });
}

// Per row of logits: the softmax (in double) and the argmax (the lower index on ties).
void softmax_and_argmax(const Matrix& logits, const Matrix& probabilities,
                        const ClassView& classes) {
  const auto width = static_cast<int64_t>(logits.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::predict_softmax"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(logits.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        int64_t best = 0;
        for (int64_t j = 1; j < width; ++j) {
          if (logits(i, j) > logits(i, best)) best = j;
        }
        const double top = logits(i, best);
        double sum = 0.0;
        for (int64_t j = 0; j < width; ++j)
          sum += kmath::exp(static_cast<double>(logits(i, j)) - top);
        for (int64_t j = 0; j < width; ++j) {
          probabilities(i, j) =
              static_cast<float>(kmath::exp(static_cast<double>(logits(i, j)) - top) / sum);
        }
        classes(i) = best;
      });
}

}  // namespace

const std::string& predictor_detail::copy_rows_label() {
  static const std::string label = "meshtrain::predictor_copy_rows";
  return label;
}

void check_prediction_overrides(const std::vector<std::string>& overrides) {
  check_overrides(overrides, ConfigCommand::predict);  // the schema says which keys
}

Predictor::Predictor(const std::string& checkpoint, int64_t batch_size,
                     const std::vector<std::string>& overrides, MPI_Comm comm)
    : comm_(comm) {
  predictor_detail::copy_rows_label();
  device_space();  // the long-lived instances (exec_space.hpp), made before any call
  host_space();
  int rank = 0, world_size = 1;
  check_mpi(MPI_Comm_rank(comm_, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &world_size), "MPI_Comm_size");

  // --- The checkpoint: rank 0 resolves it and reads its config and statistics; every rank
  // follows rank 0's answer (a lagging shared file system must not split the ranks). ---------
  std::string config_text;
  Normalization stats;
  on_every_rank(comm_, [&] {
    if (batch_size < 0) MESHTRAIN_BAD_INPUT("the batch size must be positive, got ", batch_size);
    check_prediction_overrides(overrides);
    if (rank != 0) return;
    path_ = resolve_checkpoint_path(checkpoint);
    const CheckpointInfo info = list_checkpoint(path_).info;
    config_text = info.config_text;
    step_ = info.train_state.step;
    stats = read_normalization(path_);
  });
  broadcast_text(path_, comm_, "MPI_Ibcast (the checkpoint path)");
  broadcast_text(config_text, comm_, "MPI_Ibcast (the checkpoint's config)");
  long long step = step_;
  broadcast_collective(&step, 1, MPI_LONG_LONG, 0, comm_, "MPI_Ibcast (the checkpoint's step)");
  step_ = step;
  normalization_.input_mean = broadcast_doubles(stats.input_mean, comm_);
  normalization_.input_std = broadcast_doubles(stats.input_std, comm_);
  normalization_.target_mean = broadcast_doubles(stats.target_mean, comm_);
  normalization_.target_std = broadcast_doubles(stats.target_std, comm_);

  // --- The model's config, the mesh and the plan. ------------------------------------------
  LayerAxes axes;
  on_every_rank(comm_, [&] {
    config_ = parse_config(config_text, "the config of checkpoint '" + path_ + "'", overrides);
    require_comm_backend_available(config_.runtime.backend);
    const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
    classification_ = config_.model.loss == LossKind::cross_entropy;
    if (normalization_.inputs() &&
        static_cast<int64_t>(normalization_.input_mean.size()) != inputs) {
      MESHTRAIN_BAD_INPUT("checkpoint '", path_, "' holds input statistics of ",
                          normalization_.input_mean.size(), " features but its model takes ",
                          inputs);
    }
    if (normalization_.targets() &&
        static_cast<int64_t>(normalization_.target_mean.size()) != outputs) {
      MESHTRAIN_BAD_INPUT("checkpoint '", path_, "' holds target statistics of ",
                          normalization_.target_mean.size(), " outputs but its model gives ",
                          outputs);
    }
    // fp32 whatever the model was trained in, unless asked otherwise.
    if (!overrides_section(overrides, "mixed_precision")) config_.mixed_precision = {};
    if (!overrides_key(overrides, "runtime.matmul_precision")) {
      config_.runtime.matmul_precision = MatmulPrecision::fp32;
    }
    try {
      mesh_ = config_.mesh.resolve(world_size);
    } catch (const Error& e) {
      if (overrides_section(overrides, "mesh")) throw;
      // Every axis of the config's mesh stays (the partition rules may name it), at size 1.
      bool has_dp = false;
      for (auto& [name, size] : config_.mesh.axes) {
        size = name == "dp" ? world_size : 1;
        has_dp = has_dp || name == "dp";
      }
      if (!has_dp) config_.mesh.axes.insert(config_.mesh.axes.begin(), {"dp", world_size});
      mesh_ = config_.mesh.resolve(world_size);
      mesh_note_ = detail::concat("the checkpoint's mesh does not fit ", world_size, " ranks (",
                                  e.what(), "): predicting on dp = ", world_size);
    }
    // Rows per call: the batch axes must divide them.
    PlanOptions options = plan_options(config_);
    std::vector<std::string> batch_axes;
    for (const std::string& a : options.batch_axes) {
      if (mesh_->has_axis(a)) batch_axes.push_back(a);
    }
    const int64_t row_ranks = mesh_->size_of(batch_axes);
    int64_t batch = batch_size;
    if (batch == 0) {
      batch = config_.data.eval_batch_size.value_or(config_.data.batch_size);
      batch = (batch + row_ranks - 1) / row_ranks * row_ranks;
    }
    config_.data.batch_size = batch;
    config_.data.eval_batch_size = batch;
    options = plan_options(config_);
    set_matmul_precision(config_.runtime.matmul_precision);
    plan_ = make_plan(model_parameter_shapes(config_.model), *mesh_, partition_rules(config_),
                      options, model_linear_layers(config_.model));
    axes = LayerAxes{options.batch_axes, options.feature_axis};
    slice_ = make_batch_slice(*mesh_, rank, axes.batch, batch, "the batch size");
  });

  // --- The model on the mesh, its parameters from the checkpoint. ---------------------------
  const CommBackend backend = resolve_comm_backend(config_.runtime.backend, comm_);
  comms_ = std::make_unique<MeshCommunicators>(*mesh_, comm_, prepare_comm_backend(backend, comm_));
  context_.emplace(*comms_, axes.batch, axes.feature, config_.partition.collective_matmul,
                   config_.runtime.overlap, config_.runtime.bucket_mb);
  context_->set_precision(config_.mixed_precision.policy());
  model_ = make_model(config_.model, specs_from_plan(*plan_), *context_, slice_.rows);
  CheckpointContents contents;
  contents.mesh = *mesh_;
  contents.params = model_->parameters();  // views: the load fills the model's tensors
  load_checkpoint(path_, contents, comm_);
  whole_rows_ =
      std::make_unique<WholeOutputRows>(*context_, slice_.rows, outputs(), model_->output_layout());

  // --- Buffers, allocated once. -------------------------------------------------------------
  x_ = Matrix("meshtrain::predict_x", slice_.rows, inputs());
  x_host_ = host_mirror(x_);
  output_ = Matrix("meshtrain::predict_output", slice_.rows, outputs());
  output_host_ = host_mirror(output_);
  if (classification_) {
    classes_ = ClassView("meshtrain::predict_classes", slice_.rows);
    probabilities_ = Matrix("meshtrain::predict_probabilities", slice_.rows, outputs());
  }
  if (normalization_.inputs()) {
    input_mean_ = device_doubles(normalization_.input_mean, "meshtrain::input_mean");
    input_std_ = device_doubles(normalization_.input_std, "meshtrain::input_std");
  }
  if (normalization_.targets()) {
    target_mean_ = device_doubles(normalization_.target_mean, "meshtrain::target_mean");
    target_std_ = device_doubles(normalization_.target_std, "meshtrain::target_std");
  }
  // One pass on zeros: whatever a layer or communicator sets up at its first use happens here,
  // so that predict() allocates nothing.
  run(0);
}

Predictor::~Predictor() = default;

void Predictor::check_input(int64_t rows, int64_t width) const {
  if (width != inputs()) {
    MESHTRAIN_BAD_INPUT("Predictor::predict: the input has ", width,
                        " columns but the model of checkpoint '", path_, "' takes ", inputs(),
                        " inputs");
  }
  if (rows > local_rows()) {
    MESHTRAIN_BAD_INPUT("Predictor::predict: ", rows, " input rows on this rank, but each call ",
                        "takes at most ", local_rows(), " (batch size ", batch_size(), " over ",
                        slice_.count, " row groups)");
  }
}

void Predictor::upload_input() {
  if constexpr (kDeviceMemoryIsSeparate) copy_view(x_, x_host_);
}

void Predictor::download_output() {
  if constexpr (kDeviceMemoryIsSeparate) copy_view(output_host_, output_);
}

Prediction Predictor::run(int64_t rows) {
  if (rows < slice_.rows) zero_rows(x_, rows);  // padding: computed, never returned
  if (normalization_.inputs()) standardize(x_, input_mean_, input_std_);
  const MatrixView whole = whole_rows_->gather(model_->forward(x_));
  if (normalization_.targets()) {
    to_target_units(whole, target_mean_, target_std_, output_);
  } else {
    copy_view(output_, whole);
  }
  Prediction result;
  result.rows = rows;
  result.outputs = ConstMatrixView(output_.data(), rows, outputs());
  if (classification_) {
    softmax_and_argmax(output_, probabilities_, classes_);
    result.classes = ConstClassView(classes_.data(), rows);
    result.probabilities = ConstMatrixView(probabilities_.data(), rows, outputs());
  }
  fence_device(MESHTRAIN_LABEL("meshtrain::Predictor::predict"));
  return result;
}

std::string Predictor::model_description() const {
  return model_summary(config_.model);
}

std::vector<std::string> Predictor::describe() const {
  std::vector<std::string> lines;
  lines.push_back(detail::concat("checkpoint ", path_, " (step ", step_, "): ", model_description(),
                                 ", ", classification_ ? "classification" : "regression"));
  lines.push_back(detail::concat("  ", mesh_->world_size(), " ranks, mesh ",
                                 mesh_->short_description(), ", batch ", slice_.global_batch, " (",
                                 slice_.rows, " rows per rank), compute ",
                                 to_string(config_.mixed_precision.param_dtype)));
  if (!mesh_note_.empty()) lines.push_back("  " + mesh_note_);
  lines.push_back(std::string("  normalization: inputs ") +
                  (normalization_.inputs() ? "standardized" : "as given") + ", outputs " +
                  (normalization_.targets() ? "returned to the targets' units" : "as computed"));
  return lines;
}

}  // namespace meshtrain
