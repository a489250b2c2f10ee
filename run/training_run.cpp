// A training run, set up top to bottom in the constructor and stepped by step(): see
// training_run.hpp for the order and the error contract.

#include "run/training_run.hpp"

#include <mpi.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "framework/train/resume.hpp"
#include "partition/error.hpp"

namespace meshtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs one phase on every rank and agrees on the outcome: the lowest failing rank's error
// is thrown on every rank (as AgreedError), so none goes on into a collective alone.
void on_every_rank(MPI_Comm comm, const std::function<void()>& phase) {
  if (std::optional<AgreedError> error = run_agreed(comm, phase)) throw *error;
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
  long long length = value ? static_cast<long long>(value->size()) : -1;
  check_mpi(MPI_Bcast(&length, 1, MPI_LONG_LONG, 0, comm), "MPI_Bcast");
  if (length < 0) return std::nullopt;
  std::string text = value.value_or(std::string(static_cast<size_t>(length), '\0'));
  check_mpi(
      MPI_Bcast(text.data(), checked_int(text.size(), "checkpoint path length"), MPI_CHAR, 0, comm),
      "MPI_Bcast");
  return text;
}

OptimizerSettings optimizer_settings(const OptimizerSection& section) {
  OptimizerSettings settings;
  settings.kind = parse_optimizer_kind(section.kind);
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

}  // namespace

TrainingRun::TrainingRun(RunConfig config, RunEvents events, std::optional<RunData> data,
                         MPI_Comm comm)
    : config_(std::move(config)), events_(std::move(events)), comm_(comm) {
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  int world_size = 1;
  check_mpi(MPI_Comm_size(comm_, &world_size), "MPI_Comm_size");

  // --- What to run: config, mesh and the plan (the same one `meshtrain plan` prints). ---
  on_every_rank(comm_, [&] {
    check_config(config_);
    backend_ = resolve_comm_backend(config_.runtime.backend);
    set_matmul_precision(parse_matmul_precision(config_.runtime.matmul_precision));
    mesh_ = config_.mesh.resolve(world_size);
    const std::vector<int64_t>& sizes = config_.model.sizes;
    plan_ = make_plan(mlp_parameter_shapes(sizes), *mesh_, partition_rules(config_),
                      plan_options(config_), mlp_linear_layers(sizes));
    logical_ = LogicalAxes::with_overrides(config_.partition.logical_axes);
  });
  const std::vector<int64_t>& sizes = config_.model.sizes;
  const int64_t global_batch = config_.data.batch_size;

  // --- Data: every rank holds the dataset and copies its slice of each global batch. ----
  on_every_rank(comm_, [&] {
    if (data) {
      data_ = std::move(*data);
    } else {
      const uint64_t seed = config_.run.seed;
      data_.train = load_dataset(config_.data, Split::train, seed, sizes.front(), sizes.back());
      data_.test = load_dataset(config_.data, Split::test, seed, sizes.front(), sizes.back());
    }
    if (config_.model.loss == "auto") {
      config_.model.loss = data_.train.classification() ? "cross_entropy" : "mse";
    }
    check_loss_fits_data(config_.model.loss, config_.data, data_.train);
    check_loss_fits_data(config_.model.loss, config_.data, data_.test);
    schedule_.emplace(data_.train.num_samples, global_batch, config_.data.shuffle,
                      config_.run.seed);
    slice_ = make_batch_slice(*mesh_, rank_, logical_->axes_of("batch"), global_batch);
    eval_schedule_ = EvalSchedule::create(data_.test.num_samples, global_batch);
    total_steps_ = training_steps(config_, schedule_->steps_per_epoch());
  });

  // --- Model, loss, optimizer: collective construction, identical on every rank. --------
  comms_ =
      std::make_unique<MeshCommunicators>(*mesh_, comm_, prepare_comm_backend(backend_, comm_));
  world_ = &comms_->get(all_axes(*mesh_));
  context_.emplace(ParallelContext::from_logical_axes(
      *comms_, *logical_, parse_collective_matmul_algorithm(config_.partition.collective_matmul)));
  model_ = std::make_unique<Mlp>(sizes, parse_activation(config_.model.activation),
                                 specs_from_plan(*plan_), *context_, slice_.rows);
  model_->initialize(parse_init_scheme(config_.model.init), config_.run.seed);
  loss_ = std::make_unique<Loss>(parse_loss_kind(config_.model.loss), *context_, slice_.rows,
                                 sizes.back(), model_->output_layout());
  optimizer_ =
      std::make_unique<Optimizer>(optimizer_settings(config_.optimizer), model_->parameters());
  clipper_ = std::make_unique<GradientClipper>(*mesh_, rank_, model_->gradients());
  lr_ = static_cast<float>(config_.optimizer.lr);

  x_ = Matrix("meshtrain::batch_x", slice_.rows, sizes.front());
  if (data_.train.classification()) {
    labels_ = BatchLabels("meshtrain::batch_labels", slice_.rows);
  } else {
    targets_ = Matrix("meshtrain::batch_targets", slice_.rows, data_.train.output_width());
  }
  batch_staging_ = make_batch_staging(x_, labels_, targets_);

  // The checkpoint views the live tensors (no copies): a save writes them, a load fills them.
  checkpoint_.mesh = *mesh_;
  // A run made in code has no file text: its checkpoints store the config as TOML.
  if (config_.text.empty()) config_.text = config_to_toml(config_);
  checkpoint_.config_text = config_.text;
  checkpoint_.params = model_->parameters();
  for (const std::string& slot : optimizer_->slot_names()) {
    checkpoint_.opt_state.push_back({slot, optimizer_->slot(slot)});
  }
  if (config_.checkpoint.resume) resume();
}

TrainingRun::~TrainingRun() = default;

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
    if (rank_ == 0) check_resume_compatible(config_, list_checkpoint(*latest).info, total_steps_);
  });
  // load_checkpoint throws the same error on every rank, after the same collectives.
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(*latest, checkpoint_, comm_); });
  steps_done_ = info.train_state.step;
  optimizer_->set_step_count(info.train_state.optimizer_step);
  resumed_from_ = info;
}

void TrainingRun::load_batch(int64_t step) {
  if (data_.train.classification()) {
    fill_batch(data_.train, *schedule_, step, slice_, x_, labels_, &batch_staging_);
  } else {
    fill_batch(data_.train, *schedule_, step, slice_, x_, targets_, &batch_staging_);
  }
}

LossResult TrainingRun::compute_loss(MatrixView output, bool with_gradient, int64_t valid_rows) {
  if (loss_->kind() == LossKind::cross_entropy) {
    return loss_->cross_entropy(output, labels_, with_gradient, valid_rows);
  }
  return loss_->mse(output, targets_, with_gradient, valid_rows);
}

StepResult TrainingRun::step() {
  load_batch(steps_done_);
  return step_on_loaded_batch();
}

// The training step, top to bottom. Nothing here allocates.
StepResult TrainingRun::step_on_loaded_batch() {
  MatrixView output = model_->forward(x_);
  const LossResult result = compute_loss(output, /*with_gradient=*/true);
  // The loss is reduced over the ranks, so every rank stops here together.
  if (!std::isfinite(result.loss)) {
    throw AgreedError(Error(
        ErrorKind::runtime,
        detail::concat("the training loss became ", std::isnan(result.loss) ? "NaN" : "infinite",
                       " at step ", steps_done_ + 1, "; lower optimizer.lr (now ",
                       config_.optimizer.lr, ") or set optimizer.clip_norm"),
        __FILE__, __LINE__));
  }
  model_->backward(loss_->gradient());
  if (config_.optimizer.clip_norm > 0) {
    // The norm is reduced over the ranks too: every rank stops here together.
    const double norm = clipper_->clip(model_->gradients(), config_.optimizer.clip_norm, *world_);
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
  optimizer_->step(model_->parameters(), model_->gradients(), lr_);
  ++steps_done_;
  return {steps_done_, result.loss};
}

// Loss (and accuracy for classification) over the whole test split, sharded over the
// batch axes like training; Loss reduces each batch's sums over the ranks.
EvalEvent TrainingRun::evaluate() {
  double loss_sum = 0.0;
  int64_t correct = 0, count = 0;
  const Dataset& test = data_.test;
  for (int64_t b = 0; b < eval_schedule_.num_batches; ++b) {
    const int64_t valid =
        test.classification()
            ? fill_eval_batch(test, eval_schedule_, b, slice_, x_, labels_, &batch_staging_)
            : fill_eval_batch(test, eval_schedule_, b, slice_, x_, targets_, &batch_staging_);
    const LossResult r = compute_loss(model_->forward(x_), /*with_gradient=*/false, valid);
    loss_sum += r.loss_sum;
    correct += r.correct;
    count += r.count;
  }
  EvalEvent event;
  event.step = steps_done_;
  event.test_loss = count ? loss_sum / count : std::numeric_limits<double>::quiet_NaN();
  event.test_accuracy = test.classification() && count ? static_cast<double>(correct) / count
                                                       : std::numeric_limits<double>::quiet_NaN();
  return event;
}

std::string TrainingRun::save() {
  TrainState& state = checkpoint_.train_state;
  state.step = steps_done_;
  state.epoch = schedule_->epoch_of(steps_done_);
  state.batch_in_epoch = steps_done_ % schedule_->steps_per_epoch();
  state.seed = config_.run.seed;
  state.optimizer_step = optimizer_->step_count();
  return save_checkpoint(checkpoint_, config_.checkpoint.dir, config_.checkpoint.keep, comm_);
}

void TrainingRun::log_step(const StepResult& result) {
  window_loss_ += result.loss;
  ++window_steps_;
  if (result.step % config_.train.log_every != 0 && result.step != total_steps_) return;
  const double elapsed = seconds_since(window_start_);
  LogEvent event;
  event.step = result.step;
  event.total_steps = total_steps_;
  event.epoch = schedule_->epoch_of(result.step - 1);
  event.loss = window_loss_ / window_steps_;
  event.samples_per_s = elapsed > 0 ? window_steps_ * config_.data.batch_size / elapsed : 0.0;
  event.eta_s = (total_steps_ - result.step) * elapsed / window_steps_;
  metrics_->log(event);
  if (events_.on_log) events_.on_log(event);
  window_start_ = Clock::now();
  window_loss_ = 0.0;
  window_steps_ = 0;
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
  window_loss_ = 0.0;
  window_steps_ = 0;
  while (!finished()) {
    const StepResult result = step();
    log_step(result);
    const int64_t done = result.step;
    const bool eval_now = config_.train.eval_every > 0 && done % config_.train.eval_every == 0;
    if ((eval_now || done == total_steps_) && eval_schedule_.num_batches > 0) {
      summary.last_eval = evaluate();
      metrics_->eval(*summary.last_eval);
      if (events_.on_eval) events_.on_eval(*summary.last_eval);
    }
    const bool save_now =
        config_.checkpoint.every_steps > 0 && done % config_.checkpoint.every_steps == 0;
    if (save_now || done == total_steps_) {
      const std::string path = save();
      if (events_.on_checkpoint) events_.on_checkpoint(done, path);
    }
  }
  summary.wall_s = seconds_since(start);
  summary.steps_run = steps_done_ - first_step;
  summary.samples_per_s =
      summary.wall_s > 0 ? summary.steps_run * config_.data.batch_size / summary.wall_s : 0.0;
  return summary;
}

std::vector<std::string> TrainingRun::describe() const {
  std::vector<std::string> lines;
  lines.push_back(detail::concat(mesh_->world_size(), " ranks, mesh ", mesh_->short_description(),
                                 ", batch ", config_.data.batch_size, " (", slice_.rows,
                                 " rows per rank), ", total_steps_, " steps"));
  lines.push_back(detail::concat("  compute on ", Kokkos::DefaultExecutionSpace::name(),
                                 ", communication ", to_string(backend_), ", matmul precision ",
                                 to_string(matmul_precision())));
  for (const std::string& line : model_->describe()) lines.push_back("  " + line);
  return lines;
}

}  // namespace meshtrain
