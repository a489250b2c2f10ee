// A trained model as a function: see predictor.hpp for the contract.

#include "run/predictor.hpp"

#include <unistd.h>  // sysconf
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
#include "layers/inference.hpp"  // layers_run_host_kernels

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

// --- Jacobians: the seeds and the result's columns ---------------------------------------

// seed(t, c) = scale(c) when c = first + t mod dirs, else 0: rows r * dirs + d seed input
// direction first + d of every row (scaled by 1 / input_std: the derivative of the model's
// normalized input with respect to the user's).
void seed_input_directions(const MatrixView& seed, int64_t first, int64_t dirs,
                           const Vector& scale) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::jacobian_seed_inputs"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {int64_t{0}, int64_t{0}},
          {static_cast<int64_t>(seed.extent(0)), static_cast<int64_t>(seed.extent(1))}),
      KOKKOS_LAMBDA(const int64_t t, const int64_t c) {
        seed(t, c) = c == first + t % dirs ? scale(c) : 0.0f;
      });
}

// J(r, o, first + d) = scale(o) * tangents(r * dirs + d, o) for the model's rows.
void store_output_tangents(const MatrixView& tangents, int64_t first, int64_t dirs,
                           const Vector& scale,
                           const Kokkos::View<float***, Kokkos::LayoutRight>& J) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::jacobian_store_tangents"),
      Kokkos::MDRangePolicy<Kokkos::Rank<3>>(
          device_space(), {int64_t{0}, int64_t{0}, int64_t{0}},
          {static_cast<int64_t>(J.extent(0)), static_cast<int64_t>(J.extent(1)), dirs}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t o, const int64_t d) {
        J(r, o, first + d) = scale(o) * tangents(r * dirs + d, o);
      });
}

// seed(t, j) = scale(offset + j) when offset + j = first + t mod dirs, else 0: rows r * dirs + d
// pick output first + d (times target_std: the derivative of the user's output with respect
// to the model's) of every row, on the rank whose output columns [offset, + width) hold it.
void seed_output_directions(const MatrixView& seed, int64_t first, int64_t dirs, int64_t offset,
                            const Vector& scale) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::jacobian_seed_outputs"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {int64_t{0}, int64_t{0}},
          {static_cast<int64_t>(seed.extent(0)), static_cast<int64_t>(seed.extent(1))}),
      KOKKOS_LAMBDA(const int64_t t, const int64_t j) {
        seed(t, j) = offset + j == first + t % dirs ? scale(offset + j) : 0.0f;
      });
}

// J(first_row + r, first + d, c) = cotangents(r * dirs + d, c) * scale(c) for the block's rows
// r < rows.
void store_input_cotangents(const MatrixView& cotangents, int64_t first, int64_t dirs,
                            const Vector& scale,
                            const Kokkos::View<float***, Kokkos::LayoutRight>& J, int64_t first_row,
                            int64_t rows) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::jacobian_store_cotangents"),
      Kokkos::MDRangePolicy<Kokkos::Rank<3>>(device_space(), {int64_t{0}, int64_t{0}, int64_t{0}},
                                             {rows, dirs, static_cast<int64_t>(J.extent(2))}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t d, const int64_t c) {
        J(first_row + r, first + d, c) = cotangents(r * dirs + d, c) * scale(c);
      });
}

// A reverse-mode row block's working set: a block's cotangents going in and out of the widest
// layer (2k rows a value row) and the forward's values it reads (one). A quarter of the core's
// L2 (sysconf; 512 KiB, a quarter of 2 MiB, where it says nothing), the rest for the weights
// every block reads again (the benchmark's model: 8 of 128 KiB) and what the GEMMs pack;
// measured against 1 MiB and 256 KiB on a 2 MiB L2 in docs/derivatives.md.
int64_t row_block_bytes() {
  static const int64_t bytes = [] {
    int64_t l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = static_cast<int64_t>(sysconf(_SC_LEVEL2_CACHE_SIZE));  // 0 or -1: unknown
#endif
    return l2 > 0 ? l2 / 4 : int64_t{1} << 19;
  }();
  return bytes;
}

// The widest layer's features (global), for the forward-mode passes' size.
int64_t widest_layer(const ModelSection& model) {
  int64_t widest = std::max(model.input_width(), model.output_width());
  if (model.kind == ModelKind::residual_mlp) return std::max({widest, model.width, model.hidden});
  for (int64_t size : model.sizes) widest = std::max(widest, size);
  return widest;
}

}  // namespace

const char* to_string(JacobianMode mode) {
  switch (mode) {
    case JacobianMode::automatic:
      return "auto";
    case JacobianMode::forward:
      return "forward";
    case JacobianMode::reverse:
      return "reverse";
  }
  return "?";
}

JacobianMode parse_jacobian_mode(const std::string& text, const std::string& what) {
  for (JacobianMode mode :
       {JacobianMode::automatic, JacobianMode::forward, JacobianMode::reverse}) {
    if (text == to_string(mode)) return mode;
  }
  MESHTRAIN_BAD_INPUT(what, " is '", text, "'; choose auto, forward or reverse");
}

void predictor_detail::zero_rows(const Matrix& x, int64_t first) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::predict_pad"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {first, int64_t{0}},
          {static_cast<int64_t>(x.extent(0)), static_cast<int64_t>(x.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { x(i, j) = 0.0f; });
}

bool predictor_detail::overrides_key(const std::vector<std::string>& overrides, const char* key) {
  return std::any_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return override_key(o) == key; });
}

Mesh predictor_detail::whole_model_mesh(MeshSection& mesh, int world_size) {
  bool has_dp = false;
  for (auto& [name, size] : mesh.axes) {
    size = name == "dp" ? world_size : 1;
    has_dp = has_dp || name == "dp";
  }
  if (!has_dp) mesh.axes.insert(mesh.axes.begin(), {"dp", world_size});
  return mesh.resolve(world_size);
}

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

  build(config_text, "the config of checkpoint '" + path_ + "'", overrides, batch_size,
        /*whole_model_on_every_rank=*/false);
  CheckpointContents contents;
  contents.mesh = *mesh_;
  contents.params = model_->parameters();  // views: the load fills the model's tensors
  load_checkpoint(path_, contents, comm_);
  finish_construction();
}

Predictor::Predictor(const NoWeightsYet& model, int64_t batch_size, MPI_Comm comm) : comm_(comm) {
  predictor_detail::copy_rows_label();
  device_space();
  host_space();
  path_ = model.source;
  not_ready_ = model.not_ready;
  on_every_rank(comm_, [&] {
    if (batch_size < 0) MESHTRAIN_BAD_INPUT("the batch size must be positive, got ", batch_size);
  });
  build(model.config_text, model.source, {}, batch_size, /*whole_model_on_every_rank=*/true);
  // Identity statistics until the first weights come with their own.
  if (model.input_stats) {
    normalization_.input_mean.assign(static_cast<size_t>(inputs()), 0.0);
    normalization_.input_std.assign(static_cast<size_t>(inputs()), 1.0);
  }
  if (model.target_stats) {
    normalization_.target_mean.assign(static_cast<size_t>(outputs()), 0.0);
    normalization_.target_std.assign(static_cast<size_t>(outputs()), 1.0);
  }
  finish_construction();
}

void Predictor::build(const std::string& config_text, const std::string& where,
                      const std::vector<std::string>& overrides, int64_t batch_size,
                      bool whole_model_on_every_rank) {
  // --- The model's config, the mesh and the plan. ------------------------------------------
  int rank = 0, world_size = 1;
  check_mpi(MPI_Comm_rank(comm_, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &world_size), "MPI_Comm_size");
  LayerAxes axes;
  on_every_rank(comm_, [&] {
    config_ = parse_config(config_text, where, overrides);
    if (config_.model.kind == ModelKind::dlrm) {
      MESHTRAIN_BAD_INPUT(where, " describes a model.kind = \"dlrm\" model, which ",
                          "meshtrain::Predictor does not build: meshtrain::DlrmPredictor ",
                          "(run/dlrm_predictor.hpp) predicts with it");
    }
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
    if (!predictor_detail::overrides_key(overrides, "runtime.matmul_precision")) {
      config_.runtime.matmul_precision = MatmulPrecision::fp32;
    }
    // Every axis of the config's mesh stays (the partition rules may name it), at size 1, and
    // dp takes every rank: each rank holds the whole model and computes its own rows.
    const auto whole_model_per_rank = [&] {
      mesh_ = predictor_detail::whole_model_mesh(config_.mesh, world_size);
    };
    if (whole_model_on_every_rank) {
      whole_model_per_rank();
    } else {
      try {
        mesh_ = config_.mesh.resolve(world_size);
      } catch (const Error& e) {
        if (overrides_section(overrides, "mesh")) throw;
        whole_model_per_rank();
        mesh_note_ = detail::concat("the checkpoint's mesh does not fit ", world_size, " ranks (",
                                    e.what(), "): predicting on dp = ", world_size);
      }
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
  whole_rows_ =
      std::make_unique<WholeOutputRows>(*context_, slice_.rows, outputs(), model_->output_layout());
}

void Predictor::set_normalization(const double* input_mean, const double* input_std,
                                  const double* target_mean, const double* target_std) {
  const auto copy_into = [](std::vector<double>& values, const DoubleView& view,
                            const double* from) {
    std::copy(from, from + values.size(), values.begin());
    Kokkos::View<const double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(
        from, values.size());
    Kokkos::deep_copy(view, host);
  };
  if (normalization_.inputs() && input_mean) {
    copy_into(normalization_.input_mean, input_mean_, input_mean);
    copy_into(normalization_.input_std, input_std_, input_std);
  }
  if (normalization_.targets() && target_mean) {
    copy_into(normalization_.target_mean, target_mean_, target_mean);
    copy_into(normalization_.target_std, target_std_, target_std);
  }
}

void Predictor::finish_construction() {
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
  if (!not_ready_.empty()) MESHTRAIN_BAD_INPUT(not_ready_);
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
  if (device_memory_is_separate()) copy_view(x_, x_host_);
}

void Predictor::download_output() {
  if (device_memory_is_separate()) copy_view(output_host_, output_);
}

Prediction Predictor::run(int64_t rows, bool for_derivatives) {
  if (rows < slice_.rows)
    predictor_detail::zero_rows(x_, rows);  // padding: computed, never returned
  if (normalization_.inputs()) standardize(x_, input_mean_, input_std_);
  const MatrixView output =
      for_derivatives ? model_->forward_for_derivatives(x_) : model_->infer(x_);
  const MatrixView whole = whole_rows_->gather(output);
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

void Predictor::check_jacobian_shape(int64_t rows, int64_t j0, int64_t j1, int64_t j2) const {
  if (j0 < rows || j1 != outputs() || j2 != inputs()) {
    MESHTRAIN_BAD_INPUT("Predictor::jacobian: the Jacobian view is [", j0, ", ", j1, ", ", j2,
                        "] but ", rows, " rows of ", outputs(), " outputs by ", inputs(),
                        " inputs are asked for");
  }
}

JacobianMode Predictor::jacobian_mode(JacobianMode mode) const {
  if (mode != JacobianMode::automatic) return mode;
  // Each pass costs about one forward: ceil(inputs / k) forward-mode passes against one
  // reverse pass per output; ties go forward (fewer, larger GEMMs and collectives).
  return inputs() <= outputs() ? JacobianMode::forward : JacobianMode::reverse;
}

int64_t Predictor::jacobian_directions(JacobianMode mode) const {
  const int64_t wanted = jacobian_mode(mode) == JacobianMode::forward ? inputs() : outputs();
  const int64_t per_direction = slice_.rows * widest_layer(config_.model);
  const int64_t k = std::min(wanted, std::max<int64_t>(1, kTangentElements / per_direction));
  return directions_limit_ > 0 ? std::min(k, directions_limit_) : k;
}

void Predictor::limit_jacobian_directions(int64_t k) {
  if (k < 1) MESHTRAIN_BAD_INPUT("the Jacobian's directions per pass must be at least 1, got ", k);
  if (forward_ready_ || reverse_ready_) {
    MESHTRAIN_BAD_INPUT("limit_jacobian_directions(", k, ") after the first jacobian(): its ",
                        "buffers are made");
  }
  directions_limit_ = k;
}

void Predictor::set_jacobian_row_block(int64_t rows) {
  if (rows < 0) {
    MESHTRAIN_BAD_INPUT("set_jacobian_row_block(", rows, "): rows per block must be 0 (automatic) ",
                        "or positive");
  }
  row_block_ = rows;
}

int64_t Predictor::jacobian_row_block() const {
  const int64_t rows = slice_.rows;
  if (!model_->cotangents_by_rows() || !inference::layers_run_host_kernels() || rows == 0) {
    return rows;
  }
  int64_t block = row_block_;
  if (block == 0) {
    const int64_t k = jacobian_directions(JacobianMode::reverse);
    const int64_t bytes_per_row =
        static_cast<int64_t>(sizeof(float)) * (2 * k + 1) * widest_layer(config_.model);
    block = std::max<int64_t>(8, row_block_bytes() / bytes_per_row);
  }
  if (block >= rows) return rows;
  const int64_t blocks = (rows + block - 1) / block;  // as even as whole blocks go
  return (rows + blocks - 1) / blocks;
}

JacobianMode Predictor::prepare_jacobian(JacobianMode requested) {
  const JacobianMode mode = jacobian_mode(requested);
  bool& ready = mode == JacobianMode::forward ? forward_ready_ : reverse_ready_;
  if (ready) return mode;
  if (config_.mixed_precision.param_dtype != Dtype::fp32) {
    MESHTRAIN_BAD_INPUT("Jacobians are computed in fp32; the predictor computes in ",
                        to_string(config_.mixed_precision.param_dtype),
                        " (drop the mixed_precision override)");
  }
  const int64_t rows = slice_.rows;
  if (jacobian_.extent(0) == 0) {  // what both modes use
    jacobian_ = Kokkos::View<float***, Kokkos::LayoutRight>("meshtrain::jacobian", rows, outputs(),
                                                            inputs());
    jacobian_host_ = host_mirror(jacobian_);
    inverse_input_std_ = Vector("meshtrain::jacobian_input_scale", inputs());
    target_scale_ = Vector("meshtrain::jacobian_target_scale", outputs());
    auto inverse_host = host_mirror(inverse_input_std_);
    auto target_host = host_mirror(target_scale_);
    for (int64_t c = 0; c < inputs(); ++c) {
      inverse_host(c) =
          normalization_.inputs() ? static_cast<float>(1.0 / normalization_.input_std[c]) : 1.0f;
    }
    for (int64_t o = 0; o < outputs(); ++o) {
      target_host(o) =
          normalization_.targets() ? static_cast<float>(normalization_.target_std[o]) : 1.0f;
    }
    Kokkos::deep_copy(inverse_input_std_, inverse_host);
    Kokkos::deep_copy(target_scale_, target_host);
  }
  const int64_t k = jacobian_directions(mode);
  // Once: what the derivative forward keeps for this mode's passes (the norms' x_hat only for
  // the cotangents: the tangents do not read it).
  model_->reserve_derivative_forward(/*for_cotangents=*/mode == JacobianMode::reverse);
  if (mode == JacobianMode::forward) {
    model_->reserve_tangents(k);
    tangent_seed_ = Matrix("meshtrain::jacobian_input_tangents", rows * k, inputs());
    if (whole_rows_->split()) {
      output_columns_comm_ = context_->comm({context_->feature_axis()});
      tangent_whole_ = Matrix("meshtrain::jacobian_output_tangents", rows * k, outputs());
      output_columns_comm_->reserve_scratch(static_cast<size_t>(rows * k * outputs()));
    }
  } else {
    model_->reserve_cotangents(k);
    cotangent_seed_ =
        Matrix("meshtrain::jacobian_output_cotangents", rows * k, model_->output_width());
  }
  ready = true;
  // One pass on zeros: whatever a layer or communicator sets up at its first use happens here.
  run_jacobian(0, mode);
  return mode;
}

Prediction Predictor::run_jacobian(int64_t rows, JacobianMode mode) {
  const Prediction result = run(rows, /*for_derivatives=*/true);  // the forward they are of
  const int64_t k = jacobian_directions(mode);
  if (mode == JacobianMode::forward) {
    for (int64_t first = 0; first < inputs(); first += k) {
      const int64_t dirs = std::min(k, inputs() - first);
      const MatrixView seed(tangent_seed_.data(), slice_.rows * dirs, inputs());
      seed_input_directions(seed, first, dirs, inverse_input_std_);
      MatrixView tangents = model_->forward_tangents(seed);
      if (output_columns_comm_) {  // the column blocks of tp ranks into whole rows
        const MatrixView whole(tangent_whole_.data(), slice_.rows * dirs, outputs());
        output_columns_comm_->all_gather(ConstMatrixView(tangents), whole, 1);
        tangents = whole;
      }
      store_output_tangents(tangents, first, dirs, target_scale_, jacobian_);
    }
  } else {
    const int64_t offset = model_->output_offset(), width = model_->output_width();
    const int64_t local = slice_.rows, block = jacobian_row_block();
    // One block (block == local) is the pass over every row, padding included (collective where
    // layers are); blocks have no collective and stop after the call's rows (the padding's are
    // never returned); the warm-up (rows 0) takes every row.
    const int64_t end = block < local && rows > 0 ? rows : local;
    for (int64_t first = 0; first < outputs(); first += k) {
      const int64_t dirs = std::min(k, outputs() - first);
      // Every block's seed is the first rows of one: row t's direction is t % dirs (the layers
      // read it and never write it).
      seed_output_directions(MatrixView(cotangent_seed_.data(), block * dirs, width), first, dirs,
                             offset, target_scale_);
      for (int64_t row = 0; row < end; row += block) {  // each block through every layer
        const int64_t n = std::min(block, end - row);
        const MatrixView seed(cotangent_seed_.data(), n * dirs, width);
        store_input_cotangents(model_->backward_cotangents(seed, row, n), first, dirs,
                               inverse_input_std_, jacobian_, row, n);
      }
    }
  }
  fence_device(MESHTRAIN_LABEL("meshtrain::Predictor::jacobian"));
  return result;
}

void Predictor::download_jacobian() {
  if (device_memory_is_separate()) Kokkos::deep_copy(jacobian_host_, jacobian_);
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
