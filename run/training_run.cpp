// A training run, set up top to bottom in the constructor and stepped by step(): see
// training_run.hpp for the order and the error contract.

#include "run/training_run.hpp"

#include <mpi.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <utility>

#include "base/error.hpp"
#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/flight_recorder.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/reduction_choice.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/memory_tracker.hpp"
#include "framework/core/trace.hpp"
#include "framework/io/normalization_stats.hpp"
#include "framework/train/resume.hpp"
#include "partition/zero1.hpp"

namespace meshtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Creates `dir` (and its parents) and checks that a file can be made in it; bad_input
// naming the config key otherwise.
void ensure_writable_directory(const std::string& dir, const char* key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string probe = dir + "/.meshtrain-write-test";
  std::FILE* file = ec ? nullptr : std::fopen(probe.c_str(), "w");
  if (!file) {
    MESHTRAIN_BAD_INPUT("cannot write to the directory '", dir, "' (", key,
                        "): ", ec ? ec.message() : std::strerror(errno));
  }
  std::fclose(file);
  std::remove(probe.c_str());
}

// Rank 0's value on every rank of `comm`.
std::optional<std::string> broadcast_from_rank0(const std::optional<std::string>& value,
                                                MPI_Comm comm) {
  const char* op = "MPI_Ibcast (the checkpoint to resume)";
  int present = value.has_value() ? 1 : 0;
  broadcast_collective(&present, 1, MPI_INT, 0, comm, op);
  if (!present) return std::nullopt;
  std::string text = value.value_or(std::string());
  broadcast_string(text, 0, comm, op);
  return text;
}

OptimizerSettings optimizer_settings(const OptimizerSection& section) {
  OptimizerSettings settings;
  settings.kind = section.kind;
  settings.momentum = static_cast<float>(section.momentum);
  settings.beta1 = static_cast<float>(section.betas.first);
  settings.beta2 = static_cast<float>(section.betas.second);
  settings.eps = static_cast<float>(section.eps);
  settings.weight_decay = static_cast<float>(section.weight_decay);
  return settings;
}

// Every mesh axis, for the communicator of all ranks (gradient clipping's norm).
std::vector<std::string> all_axes(const Mesh& mesh) {
  std::vector<std::string> axes;
  for (const auto& axis : mesh.axes()) axes.push_back(axis.name);
  return axes;
}

// sum = g (first) or sum += g: the gradient of one micro-batch added to the step's sum.
void add_gradient(const Vector& sum, const Vector& g, bool first) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::accumulate_gradient"),
      Kokkos::RangePolicy<>(device_space(), 0, g.extent(0)),
      KOKKOS_LAMBDA(const int64_t i) { sum(i) = first ? g(i) : sum(i) + g(i); });
}

// g = (g + sum) / micro_batches: the mean gradient of the step's micro-batches, each
// already the mean over its own rows.
void finish_gradient(const Vector& g, const Vector& sum, int64_t micro_batches) {
  const float scale = 1.0f / static_cast<float>(micro_batches);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::mean_gradient"),
      Kokkos::RangePolicy<>(device_space(), 0, g.extent(0)),
      KOKKOS_LAMBDA(const int64_t i) { g(i) = (g(i) + sum(i)) * scale; });
}

// "memory per rank, planned: 12.30 MiB: Kokkos 10.10 MiB (parameters 2.55 MiB, gradients
// 2.55 MiB, optimizer state 5.11 MiB, data staging 12.00 KiB), host 2.20 MiB (data in memory)"
std::string describe_planned_memory(const PlannedMemory& m) {
  std::string kokkos;
  const auto item = [&](const char* name, int64_t bytes) {
    if (bytes <= 0) return;
    kokkos += (kokkos.empty() ? "" : ", ") + std::string(name) + " " + format_bytes(bytes);
  };
  const PlanTotals& t = m.totals;
  item("parameters", t.parameter_bytes);
  item("gradients", t.gradient_bytes);
  item("optimizer state", t.optimizer_bytes);
  item("gradient accumulation", t.accumulation_bytes);
  item("evaluation batch", t.evaluation_bytes);
  item("ZeRO-1 buffers", t.zero1_buffer_bytes);
  item("MoE buffers", t.moe_buffer_bytes);
  item("activations", m.workspace.activation_bytes);
  item("batch buffers", m.workspace.batch_bytes);
  item("gathered weights", m.workspace.gathered_weight_bytes);
  item("collective matmul workspace", m.workspace.collective_matmul_bytes);
  item("communicator scratch", m.workspace.comm_scratch_bytes);
  item("staging (ckpt)", m.checkpoint_staging_bytes);
  item("data staging", m.data.staging_bytes);
  item("ring reductions", m.ring.total());
  std::string text = "memory per rank, planned: " + format_bytes(m.total_bytes()) + ": Kokkos " +
                     format_bytes(m.kokkos_bytes()) + " (" + kokkos + "), host " +
                     format_bytes(m.host_bytes()) + " (data " + m.data.source;
  if (m.data.cache_bytes > 0) text += ", chunk caches " + format_bytes(m.data.cache_bytes);
  return text + ")";
}

}  // namespace

TrainingRun::TrainingRun(RunConfig config, RunEvents events, std::optional<RunData> data,
                         MPI_Comm comm)
    : config_(std::move(config)), events_(std::move(events)), comm_(comm) {
  // Kokkos allocations are counted from here on, the run's peak too (measure_memory).
  install_memory_tracker();
  reset_kokkos_peak();
  const bool data_in_code = data.has_value();
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  int world_size = 1;
  check_mpi(MPI_Comm_size(comm_, &world_size), "MPI_Comm_size");

  // --- What to run: config, mesh and the plan (the same one `meshtrain plan` prints). ---
  on_every_rank(comm_, [&] {
    check_config(config_);
    require_comm_backend_available(config_.runtime.backend);
    set_matmul_precision(config_.runtime.matmul_precision);
    mesh_ = config_.mesh.resolve(world_size);
    const PlanOptions options = plan_options(config_);
    plan_ = make_plan(model_parameter_shapes(config_.model), *mesh_, partition_rules(config_),
                      options, model_linear_layers(config_.model));
    // The rows' axes (the logical batch's, and the expert axes in an MoE model) and the
    // features'.
    layer_axes_ = LayerAxes{options.batch_axes, options.feature_axis};
    planned_memory_ = meshtrain::planned_memory(config_, *plan_);
    // Every collective from here on goes into the flight recorder ([runtime] flight_records).
    int world_rank = 0;
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
    flight_recorder().configure(static_cast<std::size_t>(config_.runtime.flight_records), run_dir(),
                                world_rank, world_size);
  });
  const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
  const ModelWidthKeys width_keys = config_.model.kind == ModelKind::residual_mlp
                                        ? ModelWidthKeys{"model.inputs", "model.outputs"}
                                        : ModelWidthKeys{};
  const int64_t global_batch = config_.data.batch_size;  // of one micro-batch
  accumulation_ = config_.train.accumulation_steps;
  const int64_t eval_batch = config_.data.eval_batch_size.value_or(global_batch);
  const char* eval_key = config_.data.eval_batch_size ? "data.eval_batch_size"
                                                      : "data.batch_size (the evaluation batch)";

  // --- Data: every rank opens the data set and reads its slice of each global batch. ---
  on_every_rank(comm_, [&] {
    if (data) {
      check_data_fits_model(data->train, inputs, outputs, width_keys);
      check_data_fits_model(data->test, inputs, outputs, width_keys);
      train_source_ = make_memory_source(std::move(data->train));
      test_source_ = make_memory_source(std::move(data->test));
    } else {
      const uint64_t seed = config_.run.seed;
      train_source_ = open_data_source(config_.data, Split::train, seed, inputs, outputs,
                                       config_.model.loss, width_keys);
      test_source_ = open_data_source(config_.data, Split::test, seed, inputs, outputs,
                                      config_.model.loss, width_keys);
    }
    const DataShape& train = train_source_->shape();
    if (!config_.model.loss) {
      config_.model.loss = train.classification() ? LossKind::cross_entropy : LossKind::mse;
    }
    check_loss_fits_data(*config_.model.loss, config_.data, train);
    if (config_.data.normalize_targets == Normalize::standard &&
        *config_.model.loss != LossKind::mse) {
      MESHTRAIN_BAD_INPUT(config_.file, ": data.normalize_targets = \"standard\" needs regression ",
                          "targets (model.loss = \"mse\"), but model.loss = \"",
                          to_string(*config_.model.loss), "\" reads class labels; set ",
                          "data.normalize_targets = \"none\"");
    }
    if (config_.checkpoint.keep_best == EvalMetric::test_accuracy && !train.classification()) {
      MESHTRAIN_BAD_INPUT(config_.file, ": checkpoint.keep_best = \"test_accuracy\" needs class ",
                          "labels, but the ", train.description, " has regression targets; use ",
                          "\"test_loss\"");
    }
    check_loss_fits_data(*config_.model.loss, config_.data, test_source_->shape());
    if (accumulation_ > 1 && global_batch * accumulation_ > train.num_samples) {
      MESHTRAIN_BAD_INPUT(config_.file, ": train.accumulation_steps = ", accumulation_,
                          " x data.batch_size = ", global_batch, " is more than the ",
                          train.num_samples, " training samples");
    }
    // The schedule hands out the global batch of each optimizer step; micro-batch m is
    // its rows [m * batch_size, +batch_size).
    schedule_.emplace(train.num_samples, global_batch * accumulation_, config_.data.shuffle,
                      config_.run.seed, config_.data.block_rows, config_.data.shuffle_window);
    slice_ = make_batch_slice(*mesh_, rank_, layer_axes_.batch, global_batch);
    eval_slice_ = make_batch_slice(*mesh_, rank_, layer_axes_.batch, eval_batch, eval_key);
    eval_schedule_ = EvalSchedule::create(test_source_->shape().num_samples, eval_batch, eval_key);
    total_steps_ = training_steps(config_, schedule_->steps_per_epoch());
    if (data_in_code) {  // config.data does not describe it: its rows as they are
      planned_memory_.data.source = "given in code";
      planned_memory_.data.source_bytes =
          train_source_->resident_bytes() + test_source_->resident_bytes();
      planned_memory_.data.cache_bytes = 0;
    }
  });

  agree_on_data_shape();

  // --- Model, loss, optimizer: collective construction, identical on every rank. --------
  std::string backend_note;
  backend_ = resolve_comm_backend(config_.runtime.backend, comm_, &backend_note);
  if (!backend_note.empty() && rank_ == 0) warnings_.push_back(backend_note);
  if (backend_ == CommBackend::mpi) {  // NCCL progresses on its own stream
    std::string note;
    const std::string key =
        config_.file.empty() ? "runtime.comm_thread" : config_.file + ": runtime.comm_thread";
    if (want_comm_thread(config_.runtime.comm_thread, config_.runtime.overlap, comm_, key, note)) {
      comm_thread_.emplace();
    }
    if (!note.empty() && rank_ == 0) warnings_.push_back(note);
  }
  comms_ =
      std::make_unique<MeshCommunicators>(*mesh_, comm_, prepare_comm_backend(backend_, comm_));
  if (backend_ == CommBackend::mpi) {
    // [runtime] reductions, per group (auto: by the --hardware profile; measure: timed now).
    comms_->set_configure([this, algorithm = config_.runtime.reductions](
                              Communicator& group, const std::vector<std::string>& axes) {
      group.set_reduction_choice(
          choose_reductions(algorithm, group, axes, collective_matmul_hardware()));
      if (group.size() > 1) {
        reduction_choices_.push_back(group.description() + ": " +
                                     meshtrain::describe(group.reduction_choice()));
      }
    });
  }
  world_ = &comms_->get(all_axes(*mesh_));
  context_.emplace(*comms_, layer_axes_.batch, layer_axes_.feature,
                   config_.partition.collective_matmul, config_.runtime.overlap,
                   config_.runtime.bucket_mb);
  const MixedPrecision precision = config_.mixed_precision.policy();
  context_->set_precision(precision);
  model_ = make_model(config_.model, specs_from_plan(*plan_), *context_, slice_.rows);
  model_->initialize(config_.model.init, config_.run.seed);
  loss_ = std::make_unique<Loss>(*config_.model.loss, *context_, slice_.rows, outputs,
                                 model_->output_layout());
  if (config_.optimizer.zero_stage == 1 && mesh_->has_axis(kZeroAxis) &&
      mesh_->size_of({kZeroAxis}) > 1) {
    // ZeRO-1: the gradients the model's plan leaves partial (DP storage, reduce = false) are
    // reduce-scattered over dp by zero1_ instead of all-reduced by the layer.
    zero1_ = std::make_unique<Zero1>(model_->parameters(), model_->gradients(),
                                     model_->gradient_reductions().parameter_groups(),
                                     comms_->get({kZeroAxis}), precision.reduce);
  }
  // Who completes the gradients a layer can leave partial over the batch axes (DP storage),
  // decided here once: ZeRO-1's reduce-scatter over dp; with accumulation, one all-reduce
  // per step of the summed micro-batches; else the layers in every backward. The other
  // gradients (FSDP's reduce-scatter, TP's bias) are reduced by their layer every backward.
  gradient_reduction_ = zero1_              ? GradientReduction::zero1
                        : accumulation_ > 1 ? GradientReduction::per_step
                                            : GradientReduction::in_backward;
  model_->reserve_reductions(gradient_reduction_);
  if (precision.needs_loss_scaling()) scaler_ = std::make_unique<LossScaler>(*world_);
  optimizer_ =
      std::make_unique<Optimizer>(optimizer_settings(config_.optimizer), updated_parameters());
  clipper_ = std::make_unique<GradientClipper>(*mesh_, rank_, updated_gradients());
  const OptimizerSection& opt = config_.optimizer;
  lr_schedule_ = LrSchedule{opt.schedule, opt.lr, opt.min_lr, opt.warmup_steps, total_steps_};
  lr_ = static_cast<float>(lr_schedule_.at(0));
  if (accumulation_ > 1) {
    for (const ShardedTensor& g : model_->gradients()) {
      ShardedTensor sum = g;
      sum.local = Vector(g.name + "/gradient_sum", g.local.extent(0));
      gradient_sum_.push_back(std::move(sum));
    }
  }
  if (eval_slice_.rows != slice_.rows) {
    // A forward-only copy of the model for the evaluation batch: it shares the training
    // model's parameters (and gradients, never written), so only activations are its own.
    eval_model_ = make_model(config_.model, specs_from_plan(*plan_), *context_, eval_slice_.rows);
    eval_model_->parameters() = model_->parameters();
    eval_model_->gradients() = model_->gradients();
    eval_loss_ = std::make_unique<Loss>(loss_->kind(), *context_, eval_slice_.rows, outputs,
                                        eval_model_->output_layout());
    eval_x_ = Matrix("meshtrain::eval_x", eval_slice_.rows, inputs);
    if (test_source_->shape().classification()) {
      eval_labels_ = BatchLabels("meshtrain::eval_labels", eval_slice_.rows);
    } else {
      eval_targets_ =
          Matrix("meshtrain::eval_targets", eval_slice_.rows, test_source_->shape().output_width());
    }
  }

  // The metrics of every evaluation batch (layers/eval_metrics.hpp).
  eval_metrics_ = std::make_unique<EvalMetrics>(loss_->kind(), *context_, eval_slice_.rows, outputs,
                                                model_->output_layout());

  x_ = Matrix("meshtrain::batch_x", slice_.rows, inputs);
  if (train_source_->shape().classification()) {
    labels_ = BatchLabels("meshtrain::batch_labels", slice_.rows);
  } else {
    targets_ =
        Matrix("meshtrain::batch_targets", slice_.rows, train_source_->shape().output_width());
  }

  // The checkpoint views the live tensors (no copies): a save writes them, a load fills them.
  checkpoint_.mesh = *mesh_;
  // A run made in code has no file text: its checkpoints store the config as TOML.
  if (config_.text.empty()) config_.text = config_to_toml(config_);
  checkpoint_.config_text = config_.text;
  checkpointer_ = std::make_unique<Checkpointer>(comm_, config_.checkpoint.async);
  checkpoint_.params = model_->parameters();
  for (const std::string& slot : optimizer_->slot_names()) {
    checkpoint_.opt_state.push_back({slot, optimizer_->slot(slot)});
  }
  // Where the run starts: a checkpoint of its own (resume wins), another run's parameters
  // and statistics (init_from), or the initializer and fresh statistics.
  if (config_.checkpoint.resume) resume();
  if (!resumed_from_ && !config_.checkpoint.init_from.empty()) {
    try {
      initialized_from_ = load_model(config_.checkpoint.init_from);
    } catch (const AgreedError& e) {
      // The same error on every rank: each adds the key that named the checkpoint.
      throw AgreedError(Error(e.kind(),
                              detail::concat(config_.file, ": checkpoint.init_from = '",
                                             config_.checkpoint.init_from, "': ", e.what()),
                              e.file(), e.line()));
    }
  } else if (!resumed_from_) {
    compute_statistics();
  }
  warn_about_input_scales();
  const RuntimeSection& rt = config_.runtime;
  if (rt.traces() && rank_ == 0 &&
      (rt.trace_first <= steps_done_ || rt.trace_first > total_steps_)) {
    warnings_.push_back(
        detail::concat("runtime.trace_steps = [", rt.trace_first, ", ", rt.trace_last,
                       "] traces nothing: this run ",
                       rt.trace_first <= steps_done_ ? "resumes after step " : "ends at step ",
                       rt.trace_first <= steps_done_ ? steps_done_ : total_steps_));
  }
  start_streams();
}

// One pass over the training rows, shared by the ranks (normalization_stats.hpp).
void TrainingRun::compute_statistics() {
  const bool inputs = config_.data.normalize_inputs == Normalize::standard;
  const bool targets = config_.data.normalize_targets == Normalize::standard;
  if (!inputs && !targets) return;
  const NormalizationStats stats =
      compute_normalization(*train_source_, inputs, targets, comm_, slice_.rows);
  normalization_ = stats.normalization;
  checkpoint_.normalization = normalization_;
  const std::string note = constant_features_note(stats);
  if (!note.empty() && rank_ == 0) warnings_.push_back(note);
}

// Raw inputs of very different scales train badly and silently: rank 0 looks at a sample.
void TrainingRun::warn_about_input_scales() {
  if (normalization_.inputs() || rank_ != 0) return;
  const std::string warning = input_scale_warning(*train_source_, slice_.rows);
  if (!warning.empty()) warnings_.push_back(warning);
}

Normalization TrainingRun::read_checkpoint_normalization(const std::string& file,
                                                         const std::string& role) {
  Normalization n;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) n = read_normalization(file);
  });
  // Rank 0's vectors on every rank: their lengths, then their values.
  std::vector<double>* sides[] = {&n.input_mean, &n.input_std, &n.target_mean, &n.target_std};
  long long lengths[4];
  for (int i = 0; i < 4; ++i) lengths[i] = static_cast<long long>(sides[i]->size());
  broadcast_collective(lengths, 4, MPI_LONG_LONG, 0, comm_,
                       "MPI_Ibcast (the checkpoint's normalization statistics)");
  for (int i = 0; i < 4; ++i) {
    sides[i]->resize(static_cast<size_t>(lengths[i]));
    if (lengths[i] > 0) {
      broadcast_collective(sides[i]->data(), static_cast<int>(lengths[i]), MPI_DOUBLE, 0, comm_,
                           "MPI_Ibcast (the checkpoint's normalization statistics)");
    }
  }
  // The same values on every rank: every rank decides alike.
  on_every_rank(comm_, [&] {
    const DataShape& data = train_source_->shape();
    const auto check = [&](bool has, Normalize wanted, const char* key, const char* what,
                           size_t length, int64_t width) {
      const bool wants = wanted == Normalize::standard;
      if (has && !wants) {
        MESHTRAIN_BAD_INPUT(role, " '", file, "' holds ", what,
                            " statistics (its model was trained on standardized ", what, "s), but ",
                            config_.file, " sets ", key, " = \"none\"; set ", key,
                            " = \"standard\" (the statistics come from the checkpoint)");
      }
      if (!has && wants) {
        MESHTRAIN_BAD_INPUT(role, " '", file, "' holds no ", what,
                            " statistics (its model was trained on raw ", what, "s), but ",
                            config_.file, " sets ", key, " = \"standard\"; set ", key,
                            " = \"none\"");
      }
      if (has && static_cast<int64_t>(length) != width) {
        MESHTRAIN_BAD_INPUT(role, " '", file, "' holds ", what, " statistics of width ", length,
                            " but the data has width ", width);
      }
    };
    check(n.inputs(), config_.data.normalize_inputs, "data.normalize_inputs", "input",
          n.input_mean.size(), data.features);
    check(n.targets(), config_.data.normalize_targets, "data.normalize_targets", "target",
          n.target_mean.size(), data.output_width());
  });
  return n;
}

CheckpointInfo TrainingRun::load_model(const std::string& path) {
  // The parameters alone: the optimizer state, the step and the data position are this run's.
  CheckpointContents model_only;
  model_only.mesh = *mesh_;
  model_only.params = model_->parameters();
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(path, model_only, comm_); });
  normalization_ = read_checkpoint_normalization(info.path, "checkpoint");
  checkpoint_.normalization = normalization_;
  if (train_stream_) {
    // Batches read ahead were standardized with the old statistics: read them again.
    train_stream_.reset();
    eval_stream_.reset();
    eval_seq_ = 0;
    start_streams();
  }
  return info;
}

// The reader threads start where the run does (after a resume), so the first batches are
// being read while the first step is set up.
void TrainingRun::start_streams() {
  on_every_rank(comm_, [&] {
    const int64_t depth = config_.data.prefetch;
    train_stream_ = std::make_unique<BatchStream>(
        *train_source_, slice_.rows,
        [this](int64_t seq, int64_t* rows) {
          BatchSlice slice = slice_;
          slice.offset = (seq % accumulation_) * slice_.global_batch;
          schedule_->slice_samples(seq / accumulation_, slice, rows);
          return slice.rows;
        },
        depth, steps_done_ * accumulation_, normalization_);
    if (eval_schedule_.num_batches > 0) {
      // Every evaluation reads the same batches: the sequence goes round them, so the first
      // batches of the next evaluation are read ahead during training.
      eval_stream_ = std::make_unique<BatchStream>(
          *test_source_, eval_slice_.rows,
          [this](int64_t seq, int64_t* rows) {
            return eval_slice_samples(eval_schedule_, seq % eval_schedule_.num_batches, eval_slice_,
                                      rows);
          },
          depth, 0, normalization_);
    }
  });
}

int64_t TrainingRun::data_bytes() const {
  int64_t bytes = train_source_->resident_bytes() + test_source_->resident_bytes();
  if (train_stream_) bytes += train_stream_->staging_bytes();
  if (eval_stream_) bytes += eval_stream_->staging_bytes();
  return bytes;
}

// Every rank must see the same data: a node-local copy of another size gives its ranks
// another schedule, and they would wait for each other in different steps. One reduction
// at set-up, the same answer on every rank.
void TrainingRun::agree_on_data_shape() {
  const DataShape& train = train_source_->shape();
  const DataShape& test = test_source_->shape();
  constexpr int kCount = 4;
  long long low[kCount] = {train.num_samples, train.features, train.output_width(),
                           test.num_samples};
  long long high[kCount];
  std::copy(low, low + kCount, high);
  all_reduce_collective(low, kCount, MPI_LONG_LONG, MPI_MIN, comm_,
                        "the agreement on the data's shape");
  all_reduce_collective(high, kCount, MPI_LONG_LONG, MPI_MAX, comm_,
                        "the agreement on the data's shape");
  const char* what[] = {"training rows", "input features", "output width", "test rows"};
  for (int i = 0; i < kCount; ++i) {
    if (low[i] == high[i]) continue;
    throw AgreedError(
        Error(ErrorKind::bad_input,
              detail::concat("the ranks do not see the same data: ", what[i], " differ between ",
                             low[i], " and ", high[i], " (the ", train.description,
                             " here); every rank must read the same files"),
              __FILE__, __LINE__));
  }
}

// In a catch of a batch this rank could not read: only this rank knows, so it keeps the
// error (the first) and poisons the loss's next reduction, which every rank then sees.
void TrainingRun::keep_data_error(Loss& loss) {
  if (!data_error_) data_error_ = std::current_exception();
  loss.poison_next_reduction();
}

// After a non-finite reduced loss: when some rank could not read its rows, that is why
// (the lowest such rank's error, thrown on every rank); otherwise returns.
void TrainingRun::throw_agreed_data_error() {
  std::exception_ptr error = std::exchange(data_error_, nullptr);
  on_every_rank(comm_, [&] {
    if (error) std::rethrow_exception(error);
  });
}

// Under fp16, after a non-finite loss or gradient. Skipping steps and backing off the scale
// (GradScaler) recovers from a scale too large for the gradients; it cannot recover from
// inputs beyond fp16's range, from a forward pass that overflows (the scale does not touch
// it) in 16 steps in a row, or from gradients that overflow at a scale below 2^-24 (fp16's
// smallest step). Each ends the run in one sentence naming the key that fixes it.
void TrainingRun::check_fp16_overflow(bool loss_overflowed) {
  constexpr int64_t kMaxLossOverflowsInARow = 16;
  const double kSmallestScale = std::ldexp(1.0, -24);
  const auto fix = [&] {  // only when failing: skipping a step allocates nothing
    return detail::concat(
        "set mixed_precision.param_dtype = \"bf16\" (fp32's range) or lower "
        "optimizer.lr (now ",
        config_.optimizer.lr, ")");
  };
  if (loss_overflowed) {
    const double beyond = scaler_->sum_over_ranks(inputs_beyond_fp16_);
    if (beyond > 0) {
      throw AgreedError(
          Error(ErrorKind::bad_input,
                detail::concat("the inputs of step ", steps_done_ + 1, " hold ", beyond,
                               " values beyond fp16's range (|x| >= 65520 rounds to inf), so the "
                               "training loss is not finite at any loss scale; set "
                               "mixed_precision.param_dtype = \"bf16\" (fp32's range) or scale the "
                               "inputs down"),
                __FILE__, __LINE__));
    }
    if (loss_overflows_in_a_row_ + 1 >= kMaxLossOverflowsInARow) {
      throw AgreedError(
          Error(ErrorKind::runtime,
                detail::concat("the training loss was not finite in ", kMaxLossOverflowsInARow,
                               " steps in a row up to step ", steps_done_ + 1,
                               " under fp16: the forward pass overflows fp16's "
                               "range (65504) whatever the loss scale; ",
                               fix()),
                __FILE__, __LINE__));
    }
  } else if (scaler_->scale() < kSmallestScale) {
    throw AgreedError(Error(ErrorKind::runtime,
                            detail::concat("the gradients were not finite under fp16 at every loss "
                                           "scale down to 2^-24 (step ",
                                           steps_done_ + 1,
                                           "): the backward pass overflows fp16's range (65504) "
                                           "whatever the scale; ",
                                           fix()),
                            __FILE__, __LINE__));
  }
}

void TrainingRun::forget_micro_batches() {
  micro_done_ = 0;
  micro_loss_sum_ = 0.0;
  micro_aux_loss_sum_ = 0.0;
  step_loss_overflowed_ = false;
}

// Whether `eval` is better than every earlier evaluation by the run's metric
// (checkpoint.keep_best, else the test loss); counts the evaluations since the best.
bool TrainingRun::record_evaluation(const EvalEvent& eval) {
  const EvalMetric metric = config_.checkpoint.keep_best.value_or(EvalMetric::test_loss);
  const double value = metric == EvalMetric::test_loss ? eval.test_loss : eval.test_accuracy;
  const bool improved =
      std::isnan(best_metric_) ||
      (metric == EvalMetric::test_loss ? value < best_metric_ : value > best_metric_);
  if (improved && !std::isnan(value)) {
    best_metric_ = value;
    best_step_ = steps_done_;
    evals_since_best_ = 0;
    return true;
  }
  ++evals_since_best_;
  return false;
}

TrainingRun::~TrainingRun() {
  if (tracing_) tracer().stop();  // a run that ended inside its trace window writes nothing
}

void TrainingRun::resume() {
  // Rank 0 reads the pointer and every rank follows its answer: on a lagging shared file
  // system another rank might not see the pointer yet, and must not start alone.
  std::optional<std::string> latest;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) latest = find_latest_checkpoint(config_.checkpoint.dir);
  });
  latest = broadcast_from_rank0(latest, comm_);
  if (!latest) return;
  // Same data order and model, and a step before the end, before any tensor is read.
  on_every_rank(comm_, [&] {
    if (rank_ == 0) {
      const CheckpointInfo saved = list_checkpoint(*latest).info;
      check_resume_compatible(config_, saved, total_steps_, schedule_->order().name());
      const std::string warning =
          learning_rate_change_warning(config_, saved, total_steps_, schedule_->steps_per_epoch());
      if (!warning.empty()) warnings_.push_back(warning);
    }
  });
  // load_checkpoint throws the same error on every rank, after the same collectives.
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(*latest, checkpoint_, comm_); });
  steps_done_ = info.train_state.step;
  optimizer_->set_step_count(info.train_state.optimizer_step);
  // A run saved without loss scaling (bf16, fp32) resumed under fp16 starts at the initial scale.
  if (scaler_ && info.train_state.loss_scale > 0) {
    scaler_->restore(info.train_state.loss_scale, info.train_state.loss_scale_clean_steps);
  }
  // The run's statistics are the checkpoint's: never computed again.
  normalization_ = read_checkpoint_normalization(info.path, "checkpoint");
  checkpoint_.normalization = normalization_;
  best_metric_ = info.train_state.best_metric;
  evals_since_best_ = info.train_state.evals_since_best;
  stopped_early_ =
      config_.train.early_stopping > 0 && evals_since_best_ >= config_.train.early_stopping;
  resumed_from_ = info;
}

void TrainingRun::load_batch(int64_t step, int64_t micro) {
  try {
    train_stream_->take(step * accumulation_ + micro, x_, labels_, targets_);
  } catch (const Error&) {
    keep_data_error(*loss_);
  }
}

LossResult TrainingRun::compute_loss(Loss& loss, MatrixView output, const BatchLabels& labels,
                                     const Matrix& targets, bool with_gradient,
                                     int64_t valid_rows) {
  if (loss.kind() == LossKind::cross_entropy) {
    return loss.cross_entropy(output, labels, with_gradient, valid_rows);
  }
  return loss.mse(output, targets, with_gradient, valid_rows);
}

StepResult TrainingRun::step() {
  const int64_t number = steps_done_ + 1;
  if (config_.runtime.traces() && number == config_.runtime.trace_first) begin_trace();
  StepResult result;
  {
    TraceSpan span("step", TraceKind::step);
    span.number(number);
    for (int64_t micro = 0; micro < accumulation_; ++micro) {
      {
        TraceSpan data("data wait");
        load_batch(steps_done_, micro);
      }
      accumulate_loaded_batch();
    }
    result = apply_update();
  }
  if (tracing_ && number == config_.runtime.trace_last) end_trace();
  return result;
}

StepResult TrainingRun::step_on_loaded_batch() {
  MESHTRAIN_REQUIRE(accumulation_ == 1,
                    "step_on_loaded_batch needs train.accumulation_steps = 1; use step()");
  TraceSpan span("step", TraceKind::step);
  span.number(steps_done_ + 1);
  accumulate_loaded_batch();
  return apply_update();
}

// [runtime] trace_steps: the tracer records from the first traced step on; every rank's
// timestamps go onto rank 0's clock. Collective (all ranks step together).
void TrainingRun::begin_trace() {
  trace_clock_offset_ns_ = clock_offset_to_rank0_ns(comm_);
  trace_origin_ns_ = Tracer::now_ns() + trace_clock_offset_ns_;
  check_mpi(MPI_Bcast(&trace_origin_ns_, 1, MPI_INT64_T, 0, comm_), "MPI_Bcast (trace origin)");
  const int64_t steps = config_.runtime.trace_last - config_.runtime.trace_first + 1;
  // Room for 64 Ki events a step (a few MiB); more are counted as dropped in the file.
  tracer().start(static_cast<std::size_t>(std::min<int64_t>(steps, 64)) << 16);
  tracing_ = true;
}

// After the last traced step: each rank writes <output_dir>/trace/rank-<k>.json, then rank 0
// merges them into all-ranks.json (a track per rank). Collective; errors are agreed.
void TrainingRun::end_trace() {
  tracer().stop();
  tracing_ = false;
  int ranks = 1;
  check_mpi(MPI_Comm_size(comm_, &ranks), "MPI_Comm_size");
  const std::string dir = trace_dir();
  on_every_rank(comm_, [&] {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) MESHTRAIN_FAIL("cannot create the trace folder '", dir, "': ", error.message());
    write_chrome_trace(tracer().events(), device_timer::resolve(), tracer().lane_events(),
                       tracer().dropped(), rank_, trace_clock_offset_ns_, trace_origin_ns_,
                       dir + "/rank-" + std::to_string(rank_) + ".json");
  });
  on_every_rank(comm_, [&] {
    if (rank_ != 0) return;
    std::vector<std::string> paths;
    for (int r = 0; r < ranks; ++r) paths.push_back(dir + "/rank-" + std::to_string(r) + ".json");
    merge_chrome_traces(paths, dir + "/all-ranks.json");
    // The run's config beside it: `meshtrain trace-report` predicts the step from it.
    const std::string config_path = dir + "/config.toml";
    std::ofstream config_file(config_path, std::ios::trunc);
    if (config_file) config_file << config_to_toml(config_);
    if (!config_file) MESHTRAIN_FAIL("cannot write '", config_path, "'");
  });
}

std::string TrainingRun::run_dir() const {
  return config_.run.output_dir.empty() ? "runs/" + config_.run.name : config_.run.output_dir;
}

std::string TrainingRun::trace_dir() const {
  return run_dir() + "/trace";
}

// The training step, top to bottom: accumulate_loaded_batch for each micro-batch, then
// apply_update. Nothing here allocates.
double TrainingRun::accumulate_loaded_batch() {
  MESHTRAIN_REQUIRE(micro_done_ < accumulation_, "accumulate_loaded_batch: the step already has ",
                    accumulation_, " micro-batches; call apply_update()");
  // Dropout's key: the run's seed and step counter (restored by a resume), the micro-batch,
  // and where this rank's rows sit in it (the same mask on every mesh).
  const TrainingPass training{config_.run.seed, steps_done_, micro_done_, slice_.begin()};
  MatrixView output = [&] {
    TraceSpan span("forward");
    return model_->forward(x_, &training);
  }();
  // fp16: inputs beyond its range overflow at every loss scale. This rank's loss is poisoned
  // so that every rank sees a non-finite loss and stops below, in check_fp16_overflow.
  inputs_beyond_fp16_ = scaler_ ? scaler_->count_beyond_fp16(x_) : 0.0;
  if (inputs_beyond_fp16_ > 0) loss_->poison_next_reduction();
  LossResult result = [&] {
    TraceSpan span("loss");
    return compute_loss(*loss_, output, labels_, targets_, /*with_gradient=*/true);
  }();
  // MoE layers: their load-balancing loss is part of the training loss (backward adds its
  // gradient); it is the same on every rank.
  const double aux_loss = model_->aux_loss();
  result.loss += aux_loss;
  // The loss is reduced over the ranks, so every rank decides here alike.
  if (!std::isfinite(result.loss)) {
    if (!scaler_) {
      forget_micro_batches();
      throw_agreed_data_error();
      throw AgreedError(Error(
          ErrorKind::runtime,
          detail::concat("the training loss became ", std::isnan(result.loss) ? "NaN" : "infinite",
                         " at step ", steps_done_ + 1, "; lower optimizer.lr (now ",
                         config_.optimizer.lr, ") or set optimizer.clip_norm"),
          __FILE__, __LINE__));
    }
    // fp16, as GradScaler: this loss's gradient would not be finite, so the step's update is
    // skipped (apply_update) and the scale backs off.
    try {
      throw_agreed_data_error();
      check_fp16_overflow(/*loss_overflowed=*/true);
    } catch (...) {
      forget_micro_batches();
      throw;
    }
    step_loss_overflowed_ = true;
  }
  // A step whose loss overflowed fp16 runs no more backward passes: its update is skipped.
  if (!step_loss_overflowed_) {
    // Partial gradients (gradient_reduction_ other than in_backward) are completed once per
    // step, in apply_update. The last micro-batch's gradient stays in the gradients.
    TraceSpan span("backward");
    model_->backward(loss_->gradient(), gradient_reduction_, scaler_ ? scaler_->scale() : 1.0f);
    if (micro_done_ + 1 < accumulation_) {
      std::vector<ShardedTensor>& grads = model_->gradients();
      for (size_t i = 0; i < grads.size(); ++i) {
        add_gradient(gradient_sum_[i].local, grads[i].local, micro_done_ == 0);
      }
    }
  }
  ++micro_done_;
  micro_loss_sum_ += result.loss;
  micro_aux_loss_sum_ += aux_loss;
  return result.loss;
}

StepResult TrainingRun::apply_update() {
  MESHTRAIN_REQUIRE(micro_done_ == accumulation_, "apply_update after ", micro_done_, " of ",
                    accumulation_, " micro-batches");
  if (step_loss_overflowed_) {
    // Every rank saw the same non-finite loss and skipped the same reductions.
    const double loss = micro_loss_sum_ / static_cast<double>(accumulation_);
    const double aux_loss = micro_aux_loss_sum_ / static_cast<double>(accumulation_);
    forget_micro_batches();
    ++loss_overflows_in_a_row_;
    scaler_->update(/*finite=*/false);
    ++skipped_steps_;
    ++steps_done_;
    return {steps_done_, loss, aux_loss};
  }
  loss_overflows_in_a_row_ = 0;
  std::vector<ShardedTensor>& grads = model_->gradients();
  if (accumulation_ > 1) {
    for (size_t i = 0; i < grads.size(); ++i) {
      finish_gradient(grads[i].local, gradient_sum_[i].local, accumulation_);
    }
  }
  // The reductions backward left out, once per step (gradient_reduction_). With ZeRO-1 the
  // update (clipping included) sees this rank's chunk of each gradient.
  if (gradient_reduction_ == GradientReduction::per_step) {
    TraceSpan span("gradient reduction");
    model_->reduce_gradients();
  }
  if (gradient_reduction_ == GradientReduction::zero1) {
    TraceSpan span("gradient reduction");
    zero1_->reduce(grads);
  }
  std::vector<ShardedTensor>& update_grads = updated_gradients();
  const double loss = micro_loss_sum_ / static_cast<double>(accumulation_);
  const double aux_loss = micro_aux_loss_sum_ / static_cast<double>(accumulation_);
  forget_micro_batches();
  if (scaler_) {
    // fp16: the gradients come scaled; a step with an inf or NaN anywhere is skipped on
    // every rank (the optimizer does not run) and the scale backs off.
    TraceSpan span("loss scaling");
    const bool finite = scaler_->unscale(update_grads);
    scaler_->update(finite);
    if (!finite) {
      check_fp16_overflow(/*loss_overflowed=*/false);
      ++skipped_steps_;
      ++steps_done_;
      return {steps_done_, loss, aux_loss};
    }
  }
  if (config_.optimizer.clip_norm > 0) {
    // The norm is reduced over the ranks too: every rank stops here together.
    TraceSpan span("clip");
    const double norm = clipper_->clip(update_grads, config_.optimizer.clip_norm, *world_);
    if (!std::isfinite(norm)) {
      throw AgreedError(Error(
          ErrorKind::runtime,
          detail::concat("the gradient norm became ", std::isnan(norm) ? "NaN" : "infinite",
                         " at step ", steps_done_ + 1, " (the gradient of ",
                         clipper_->non_finite_gradient(),
                         " is not finite); lower optimizer.lr (now ", config_.optimizer.lr, ")"),
          __FILE__, __LINE__));
    }
  }
  // The rate depends on the step index alone, so a resumed run continues it exactly.
  lr_ = static_cast<float>(lr_schedule_.at(steps_done_));
  {
    TraceSpan span("optimizer");
    checkpointer_->wait_snapshot();  // a save in flight has copied the tensors it writes
    optimizer_->step(updated_parameters(), update_grads, lr_);
    if (zero1_) zero1_->gather(model_->parameters());  // every replica gets every chunk
  }
  ++steps_done_;
  return {steps_done_, loss, aux_loss};
}

double TrainingRun::flops_per_step() const {
  const int64_t rows = config_.data.batch_size * accumulation_;
  if (config_.model.kind == ModelKind::residual_mlp) {  // every weight's elements, 6 per row
    double parameters = 0.0;  // an MoE block's: its router and top_k experts' [E, in, out]
    for (const ParameterShape& p : model_parameter_shapes(config_.model)) {
      if (p.shape.size() == 2) parameters += static_cast<double>(p.shape[0]) * p.shape[1];
      if (p.shape.size() == 3) {
        parameters += static_cast<double>(config_.model.top_k) * p.shape[1] * p.shape[2];
      }
    }
    return 6.0 * parameters * static_cast<double>(rows);
  }
  const std::vector<int64_t>& sizes = config_.model.sizes;
  const MoeSettings moe = config_.model.moe();
  double parameters = 0.0;  // those a row uses: an MoE layer's router and its top_k experts
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    const double layer = static_cast<double>(sizes[i]) * sizes[i + 1] + sizes[i + 1];
    if (moe.is_moe(static_cast<int64_t>(i))) {
      parameters += static_cast<double>(sizes[i]) * moe.experts + moe.top_k * layer;
    } else {
      parameters += layer;
    }
  }
  return 6.0 * parameters * static_cast<double>(config_.data.batch_size * accumulation_);
}

// The metrics over the whole test split, sharded over the batch axes like training: Loss
// reduces each batch's loss sums over the ranks, EvalMetrics the rest once at the end.
EvalEvent TrainingRun::evaluate() {
  TraceSpan span("evaluate");
  Mlp& model = eval_model_ ? *eval_model_ : *model_;
  Loss& loss = eval_model_ ? *eval_loss_ : *loss_;
  const Matrix& x = eval_model_ ? eval_x_ : x_;
  const BatchLabels& labels = eval_model_ ? eval_labels_ : labels_;
  const Matrix& targets = eval_model_ ? eval_targets_ : targets_;
  eval_metrics_->reset();
  for (int64_t b = 0; b < eval_schedule_.num_batches; ++b) {
    int64_t valid = 0;
    try {
      valid = eval_stream_->take(eval_seq_++, x, labels, targets);
    } catch (const Error&) {
      keep_data_error(loss);
    }
    MatrixView output = model.forward(x);
    const LossResult r =
        compute_loss(loss, output, labels, targets, /*with_gradient=*/false, valid);
    eval_metrics_->add(output, labels, targets, valid, r);
  }
  if (!std::isfinite(eval_metrics_->loss_sum())) throw_agreed_data_error();
  EvalEvent event;
  eval_metrics_->finish(event, &normalization_);
  event.step = steps_done_;
  return event;
}

std::string TrainingRun::start_save() {
  // The train state is copied by save() (the tensors by the staging copy), so changing it
  // here does not touch a checkpoint in flight.
  TrainState& state = checkpoint_.train_state;
  state.step = steps_done_;
  state.epoch = schedule_->epoch_of(steps_done_);
  state.batch_in_epoch = steps_done_ % schedule_->steps_per_epoch();
  state.seed = config_.run.seed;
  state.optimizer_step = optimizer_->step_count();
  state.data_order = schedule_->order().name();
  state.loss_scale = scaler_ ? scaler_->scale() : 0.0;
  state.loss_scale_clean_steps = scaler_ ? scaler_->clean_steps() : 0;
  state.best_metric = best_metric_;
  state.evals_since_best = evals_since_best_;
  // The best evaluation so far is this step's: this checkpoint becomes `best`.
  const bool best = config_.checkpoint.keep_best && best_step_ == steps_done_;
  std::string path;
  TraceSpan span("checkpoint save");
  on_every_rank(comm_, [&] {
    report_checkpoint(checkpointer_->wait());  // the previous one, when still in flight
    in_flight_step_ = steps_done_;
    path = checkpointer_->save(checkpoint_, config_.checkpoint.dir, config_.checkpoint.keep, best);
    // A synchronous save is complete when save() returns: nothing is left in flight.
    if (!checkpointer_->async()) report_checkpoint(path);
  });
  return path;
}

std::optional<std::string> TrainingRun::finish_save() {
  std::optional<std::string> path;
  on_every_rank(comm_, [&] { path = checkpointer_->wait(); });
  report_checkpoint(path);
  return path;
}

std::string TrainingRun::save() {
  const std::string path = start_save();
  finish_save();
  return path;
}

void TrainingRun::report_checkpoint(const std::optional<std::string>& path) {
  if (path && events_.on_checkpoint) events_.on_checkpoint(in_flight_step_, *path);
}

void TrainingRun::log_step(const StepResult& result) {
  window_loss_ += result.loss;
  window_aux_loss_ += result.aux_loss;
  ++window_steps_;
  if (result.step % config_.train.log_every != 0 && result.step != total_steps_) return;
  const double elapsed = seconds_since(window_start_) - window_paused_s_;
  LogEvent event;
  event.step = result.step;
  event.total_steps = total_steps_;
  event.epoch = schedule_->epoch_of(result.step - 1);
  event.loss = window_loss_ / window_steps_;
  if (config_.model.moe().any()) event.aux_loss = window_aux_loss_ / window_steps_;
  event.lr = lr_;
  const int64_t samples = window_steps_ * config_.data.batch_size * accumulation_;
  event.samples_per_s = elapsed > 0 ? samples / elapsed : 0.0;
  // Model TFLOP/s of one rank (torchtitan's convention: the model's FLOPs over the ranks).
  event.tflops_per_rank =
      elapsed > 0 ? window_steps_ * flops_per_step() / mesh_->world_size() / elapsed / 1e12 : 0.0;
  if (config_.run.peak_tflops > 0) {
    event.mfu_percent = 100.0 * event.tflops_per_rank / config_.run.peak_tflops;
  }
  event.eta_s = (total_steps_ - result.step) * elapsed / window_steps_;
  if (scaler_) {
    event.loss_scale = scaler_->scale();
    event.skipped_steps = skipped_steps_;
  }
  // The slowest rank's wait: a rank whose reader keeps up waits in the gradient all-reduce
  // for the one whose reader does not, so rank 0's own wait alone can read 0.
  double waited = train_stream_->take_wait_seconds();
  all_reduce_collective(&waited, 1, MPI_DOUBLE, MPI_MAX, comm_, "the reduction of the data wait",
                        data_wait_reduction_);
  event.data_wait_s = waited / window_steps_;
  data_wait_s_ += waited;
  metrics_->log(event);
  if (events_.on_log) events_.on_log(event);
  window_start_ = Clock::now();
  window_paused_s_ = 0.0;
  window_loss_ = 0.0;
  window_aux_loss_ = 0.0;
  window_steps_ = 0;
}

std::string TrainingRun::plan_item_of(const TrackedAllocation& a) const {
  // Kokkos reports the start of an allocation: the View's data, or the header before it.
  const auto holds = [&](const std::vector<ShardedTensor>& tensors) {
    for (const ShardedTensor& t : tensors) {
      const auto offset =
          reinterpret_cast<const char*>(t.local.data()) - static_cast<const char*>(a.data);
      if (t.local.data() != nullptr &&
          (offset == 0 || offset == sizeof(Kokkos::Impl::SharedAllocationHeader))) {
        return true;
      }
    }
    return false;
  };
  const auto starts = [&](const char* prefix) { return a.label.rfind(prefix, 0) == 0; };
  if (holds(model_->parameters())) return "parameters";
  if (holds(model_->gradients())) return "gradients";
  for (const std::string& slot : optimizer_->slot_names()) {
    if (holds(optimizer_->slot(slot))) return "optimizer state";
  }
  if (holds(gradient_sum_)) return "gradient accumulation";
  if (zero1_ && (holds(zero1_->grad_chunks()) || starts("meshtrain::zero1_"))) {
    return "ZeRO-1 buffers";
  }
  if (starts("meshtrain::checkpoint_staging")) return "staging (ckpt)";
  if (starts("meshtrain::staged_")) return "data staging";
  if (starts("meshtrain::ring_partial_sums") || starts("meshtrain::started_ring_partial_sums")) {
    return "ring reductions";
  }
  if (eval_model_ && (starts("meshtrain::eval_x") || starts("meshtrain::eval_labels") ||
                      starts("meshtrain::eval_targets"))) {
    return "evaluation batch";
  }
  // The step's workspace (PlannedMemory::workspace). A separate evaluation model's buffers
  // carry the training layers' labels: they are matched as activations too.
  if (starts("meshtrain::scratch_")) return "gathered weights";
  if (starts("meshtrain::collective_matmul_workspace")) return "collective matmul workspace";
  if (starts("meshtrain::comm_scratch")) return "communicator scratch";
  if (starts("meshtrain::batch_")) return "batch buffers";
  // An MoE layer's buffers: the plan counts its dispatch buffers (the rest is not counted).
  for (const LayerPlan& layer : plan_->layers) {
    if (layer.moe && starts((layer.name + "/").c_str())) return "MoE buffers";
  }
  if (starts("layers/") || starts("blocks/") || starts("input/") || starts("output/") ||
      starts("output_norm/") || starts("model/") || starts("meshtrain::loss_")) {
    return "activations";
  }
  return "";
}

MemoryEvent TrainingRun::measure_memory(const std::string& when) {
  install_memory_tracker();     // a program may have set callbacks of its own since
  constexpr int kScanned = 32;  // the largest live allocations looked at on the worst rank
  constexpr int kListed = 8;    // and listed (the largest, then unplanned ones further down)
  const KokkosMemory kokkos = kokkos_memory(kScanned);
  const HostMemory host = host_memory();
  int64_t device_peak = -1;
#ifdef KOKKOS_ENABLE_CUDA
  for (const SpaceMemory& space : kokkos.spaces) {
    if (space.space == Kokkos::CudaSpace::name()) device_peak = space.peak_bytes;
  }
  if (device_peak < 0) device_peak = 0;
#endif
  // Every rank's figures, by a sum of slots each rank fills with its own (under the
  // collective timeout, like every reduction of the run).
  constexpr int kFields = 6;
  const int world = mesh_->world_size();
  std::vector<int64_t> all(static_cast<size_t>(kFields) * world, 0);
  int64_t* mine = all.data() + static_cast<size_t>(kFields) * rank_;
  mine[0] = kokkos.peak_bytes;
  mine[1] = kokkos.live_bytes;
  mine[2] = device_peak;
  mine[3] = host.peak_rss_bytes;
  mine[4] = host.current_rss_bytes;
  mine[5] = kokkos.complete ? 1 : 0;
  all_reduce_collective(all.data(), kFields * world, MPI_INT64_T, MPI_SUM, comm_,
                        "the reduction of the memory figures");
  MemoryEvent event;
  event.step = steps_done_;
  event.when = when;
  event.planned_bytes = planned_memory_.total_bytes();
  event.planned_kokkos_bytes = planned_memory_.kokkos_bytes();
  for (int r = 0; r < world; ++r) {
    const int64_t* f = all.data() + static_cast<size_t>(kFields) * r;
    event.kokkos_peak_bytes.push_back(f[0]);
    event.kokkos_live_bytes.push_back(f[1]);
    if (f[2] >= 0) event.device_peak_bytes.push_back(f[2]);
    event.rss_peak_bytes.push_back(f[3]);
    event.rss_bytes.push_back(f[4]);
    event.kokkos_complete.push_back(f[5] != 0);
  }
  // Every rank has the same plan: the worst rank is the one with the largest Kokkos peak.
  event.worst_rank = static_cast<int>(
      std::max_element(event.kokkos_peak_bytes.begin(), event.kokkos_peak_bytes.end()) -
      event.kokkos_peak_bytes.begin());
  const int64_t worst_peak = event.kokkos_peak_bytes[event.worst_rank];
  event.over_plan =
      static_cast<double>(worst_peak) >
          (1.0 + kOverPlanFraction) * static_cast<double>(event.planned_kokkos_bytes) &&
      worst_peak - event.planned_kokkos_bytes > kOverPlanMinBytes;
  // The worst rank's largest live allocations, each with its plan item, go to every rank.
  std::string listed;
  if (rank_ == event.worst_rank) {
    nlohmann::json list = nlohmann::json::array();
    int unplanned_beyond = 0;
    for (size_t i = 0; i < kokkos.largest.size(); ++i) {
      const TrackedAllocation& a = kokkos.largest[i];
      const std::string item = plan_item_of(a);
      const bool among_largest = i < static_cast<size_t>(kListed);
      if (!among_largest && (!item.empty() || unplanned_beyond == kListed)) continue;
      if (!among_largest) ++unplanned_beyond;
      list.push_back({a.label, a.space, a.bytes, item});
    }
    // A label cut at 47 bytes may end inside a UTF-8 character: replaced, not thrown.
    listed = list.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  broadcast_string(listed, event.worst_rank, comm_, "the broadcast of the largest allocations");
  for (const auto& a : nlohmann::json::parse(listed)) {
    event.largest.push_back({a[0].get<std::string>(), a[1].get<std::string>(),
                             a[3].get<std::string>(), a[2].get<int64_t>()});
  }
  return event;
}

void TrainingRun::report_memory(const std::string& when, RunSummary* summary) {
  const auto begin = Clock::now();
  MemoryEvent event = measure_memory(when);
  metrics_->memory(event);
  if (events_.on_memory) events_.on_memory(event);
  if (summary) summary->memory = std::move(event);
  window_paused_s_ += seconds_since(begin);  // not training time
}

// train()'s loop: each step, then its log, evaluation and checkpoint events.
void TrainingRun::train_steps(RunSummary& summary) {
  const int64_t first_step = steps_done_;
  while (!finished()) {
    const StepResult result = step();
    log_step(result);
    if (steps_done_ == first_step + 1) report_memory("first_step", nullptr);
    const auto after_step = Clock::now();  // evaluation and saving are not training time
    const int64_t done = result.step;
    const bool eval_now = config_.train.eval_every > 0 && done % config_.train.eval_every == 0;
    bool improved = false;
    if ((eval_now || done == total_steps_) && eval_schedule_.num_batches > 0) {
      summary.last_eval = evaluate();
      improved = record_evaluation(*summary.last_eval);
      metrics_->eval(*summary.last_eval);
      if (events_.on_eval) events_.on_eval(*summary.last_eval);
    }
    // Every rank holds the same evaluation, so every rank stops at the same step.
    stopped_early_ =
        config_.train.early_stopping > 0 && evals_since_best_ >= config_.train.early_stopping;
    const bool save_now =
        (config_.checkpoint.every_steps > 0 && done % config_.checkpoint.every_steps == 0) ||
        (improved && config_.checkpoint.keep_best) || stopped_early_;
    if (save_now || done == total_steps_) {
      start_save();
    } else if (checkpointer_->in_flight()) {
      // Not wrapped in an agreement: poll() reads an MPI_Iallreduce started at the previous
      // poll (so it waits for no slower rank), and the completion it may run agrees on its
      // own outcome, the same on every rank.
      report_checkpoint(checkpointer_->poll());
    }
    window_paused_s_ += seconds_since(after_step);
  }
}

RunSummary TrainingRun::train() {
  // Output and checkpoint directories are made (and found writable) before the first
  // step, not discovered unusable at the end of the run. A resumed run appends to the
  // metrics of the run it continues.
  on_every_rank(comm_, [&] {
    metrics_ = std::make_unique<MetricsLog>(config_.run.output_dir, rank_ == 0,
                                            /*append=*/steps_done_ > 0);
    if (rank_ == 0) ensure_writable_directory(config_.checkpoint.dir, "checkpoint.dir");
  });

  RunSummary summary;
  const int64_t first_step = steps_done_;
  const auto start = Clock::now();
  window_start_ = start;
  window_paused_s_ = 0.0;
  window_loss_ = 0.0;
  window_aux_loss_ = 0.0;
  window_steps_ = 0;
  data_wait_s_ = 0.0;
  train_stream_->take_wait_seconds();  // waits before train() are not its steps'
  try {
    train_steps(summary);
  } catch (const AgreedError&) {
    // Every rank stopped at the same step and is alive: complete the save in flight, the
    // last good state a user resumes from (with a lower lr, or after fixing the data).
    try {
      finish_save();
    } catch (const Error&) {
      // The save failed too: the error that stopped training is the one to report.
    }
    throw;
  }
  finish_save();
  // A run that stopped inside its trace window (early stopping, fewer steps) writes what it
  // recorded.
  if (tracing_) end_trace();
  summary.wall_s = seconds_since(start);
  if (steps_done_ > first_step) report_memory("end", &summary);
  summary.steps_run = steps_done_ - first_step;
  summary.samples_per_s = summary.wall_s > 0 ? summary.steps_run * config_.data.batch_size *
                                                   accumulation_ / summary.wall_s
                                             : 0.0;
  summary.data_wait_s = data_wait_s_;
  summary.tflops_per_rank = summary.wall_s > 0 ? summary.steps_run * flops_per_step() /
                                                     mesh_->world_size() / summary.wall_s / 1e12
                                               : 0.0;
  return summary;
}

std::vector<std::string> TrainingRun::describe() const {
  std::vector<std::string> lines;
  lines.push_back(detail::concat(
      mesh_->world_size(), " ranks, mesh ", mesh_->short_description(), ", batch ",
      config_.data.batch_size, " (", slice_.rows, " rows per rank)",
      accumulation_ > 1 ? detail::concat(" x ", accumulation_, " micro-batches per step")
                        : std::string(),
      ", eval batch ", eval_slice_.global_batch, ", ", total_steps_, " steps, lr ",
      to_string(lr_schedule_.kind)));
  lines.push_back(detail::concat("  compute on ", Kokkos::DefaultExecutionSpace::name(),
                                 ", communication ", to_string(backend_), ", matmul precision ",
                                 to_string(matmul_precision())));
  if (config_.optimizer.zero_stage == 1) {
    lines.push_back(zero1_ ? "  optimizer state and update split over dp (ZeRO-1)"
                           : "  optimizer.zero_stage = 1 changes nothing with dp = 1");
  }
  lines.push_back("  GEMM: " + gemm_kernels());
  const DataShape& data = train_source_->shape();
  lines.push_back(detail::concat("  data: ", data.description, ", ", data.num_samples,
                                 " rows, order ", schedule_->order().name(), ", ",
                                 config_.data.prefetch > 0
                                     ? detail::concat(config_.data.prefetch, " batches read ahead")
                                     : std::string("read in the step"),
                                 ", ", data_bytes() >> 10, " KiB on this rank"));
  for (const std::string& line : model_->describe()) lines.push_back("  " + line);
  lines.push_back("  " + describe_planned_memory(planned_memory_));
  // Last: tests index the lines above.
  if (!reduction_choices_.empty()) {
    std::string groups;
    for (const auto& choice : reduction_choices_) groups += (groups.empty() ? "" : "; ") + choice;
    lines.push_back(
        detail::concat("  reductions (", to_string(config_.runtime.reductions), "): ", groups));
  }
  return lines;
}

}  // namespace meshtrain
