// What TrainingRun's constructor builds, in the order it builds it (training_run.hpp lists
// it): the plan, the data, the communicators, the model and its optimizer, the checkpoint's
// view of the live tensors, where the run starts, and the batch streams. Nothing here runs
// inside a step.

#include "run/training_run.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/communicator.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/reduction_choice.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/io/normalization_stats.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "framework/observe/trace.hpp"
#include "framework/train/resume.hpp"
#include "partition/zero1_layout.hpp"
#include "run/run_common.hpp"

namespace meshtrain {
namespace {
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
  // Kokkos allocations are counted from here on, the run's peak too (measure_memory).
  install_memory_tracker();
  reset_kokkos_peak();
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  on_every_rank(comm_, [&] {  // before any data is opened
    if (config_.model.kind == ModelKind::dlrm) {
      MESHTRAIN_BAD_INPUT(
          "TrainingRun trains model.kind = \"mlp\" and \"residual_mlp\"; ",
          "model.kind = \"dlrm\" is trained by meshtrain::DlrmRun (run/dlrm_run.hpp)");
    }
  });
  plan_run();
  try {
    open_data(std::move(data));
    agree_on_data_shape();
    connect();
    build_model();
    build_checkpoint_view();
    choose_start();
    build_derivative_loss();
    start_streams();
    choose_cuda_graphs();
  } catch (const std::exception& error) {
    // Refused after a stream's rendezvous (a checkpoint.init_from that does not exist, say):
    // the producers are told why (they drop their rows from now on and warn with this
    // sentence); the stream's destructor would only say that the run failed.
    if (stream_) stream_->stop_producers(error.what());
    throw;
  }
}

// What to run: the config checked, the mesh, the plan (the one `meshtrain plan` prints), the
// memory it predicts, and the flight recorder every later collective records into.
void TrainingRun::plan_run() {
  int world_size = 1;
  check_mpi(MPI_Comm_size(comm_, &world_size), "MPI_Comm_size");
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
    // With the profile the groups choose their reductions by (below).
    planned_memory_ = meshtrain::planned_memory(config_, *plan_, collective_matmul_hardware());
    // Every collective from here on goes into the flight recorder ([runtime] flight_records).
    int world_rank = 0;
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
    flight_recorder().configure(static_cast<std::size_t>(config_.runtime.flight_records), run_dir(),
                                world_rank, world_size);
  });
}

// The data: every rank opens the data set (or takes the rows given in code) and reads its
// slice of each global batch; the schedules of training and evaluation, the run's length.
void TrainingRun::open_data(std::optional<RunData> data) {
  const bool data_in_code = data.has_value();
  const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
  const ModelWidthKeys width_keys = config_.model.kind == ModelKind::residual_mlp
                                        ? ModelWidthKeys{"model.inputs", "model.outputs"}
                                        : ModelWidthKeys{};
  const int64_t global_batch = config_.data.batch_size;  // of one micro-batch
  accumulation_ = config_.train.accumulation_steps;
  const int64_t eval_batch = config_.data.eval_batch_size.value_or(global_batch);
  const char* eval_key = config_.data.eval_batch_size ? "data.eval_batch_size"
                                                      : "data.batch_size (the evaluation batch)";

  if (!data_in_code && config_.data.source == DataSource::stream) {
    open_stream();
    return;
  }
  on_every_rank(comm_, [&] {
    if (data && !config_.data.dy_key.empty()) {
      MESHTRAIN_BAD_INPUT("data.dy_key = \"", config_.data.dy_key, "\" reads derivative targets ",
                          "from the HDF5 files of data.path, but this run was given its data in ",
                          "code; unset data.dy_key");
    }
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
      // Sobolev training: the training rows' derivative targets (the test split's are not
      // read: evaluation reports the data loss alone).
      const int64_t directions = config_.data.dy_inputs.empty()
                                     ? inputs
                                     : static_cast<int64_t>(config_.data.dy_inputs.size());
      dy_source_ = open_derivative_source(config_.data, Split::train, outputs, directions);
    }
    const DataShape& train = train_source_->shape();
    if (!config_.model.loss) {
      config_.model.loss = train.classification() ? LossKind::cross_entropy : LossKind::mse;
    }
    check_loss_fits_data(*config_.model.loss, config_.data, train);
    if (!config_.model.loss_weights.empty() && !takes_targets(*config_.model.loss)) {
      MESHTRAIN_BAD_INPUT(
          config_.file, ": model.loss_weights weighs the outputs of a loss with ",
          "float targets (mse, huber, mae, binary_cross_entropy), but model.loss = \"",
          to_string(*config_.model.loss), "\" has none to weigh");
    }
    if (config_.data.normalize_targets == Normalize::standard &&
        !is_regression(*config_.model.loss)) {
      MESHTRAIN_BAD_INPUT(
          config_.file, ": data.normalize_targets = \"standard\" needs regression ",
          "targets (model.loss = \"mse\", \"huber\" or \"mae\"), but model.loss = \"",
          to_string(*config_.model.loss), "\" ",
          *config_.model.loss == LossKind::cross_entropy ? "reads class labels"
                                                         : "reads 0/1 targets",
          "; set data.normalize_targets = \"none\"");
    }
    if (const std::optional<EvalMetric>& best = config_.checkpoint.keep_best) {
      const std::string name = to_string(*best);
      if (!best->reported_for(*config_.model.loss)) {
        MESHTRAIN_BAD_INPUT(config_.file, ": checkpoint.keep_best = \"", name, "\" is not ",
                            "reported for model.loss = \"", to_string(*config_.model.loss),
                            "\" (the ", train.description, "); use ",
                            reported_metrics_text(*config_.model.loss));
      }
      if (best->output >= outputs) {
        MESHTRAIN_BAD_INPUT(config_.file, ": checkpoint.keep_best = \"", name, "\" names output ",
                            best->output, ", but the model has ", outputs, " outputs (0 to ",
                            outputs - 1, ")");
      }
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
}

// data.source = "stream": the rows come from a running simulation's producers
// (docs/online.md). This rank's buffer is fed by the producers of its group over the batch
// axes; the schedule only numbers the steps (its "samples" are the buffers' slots).
void TrainingRun::open_stream() {
  const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
  const int64_t global_batch = config_.data.batch_size;
  accumulation_ = config_.train.accumulation_steps;
  const StreamSection& stream = config_.stream;
  int64_t min_rows = 0;
  on_every_rank(comm_, [&] {
    const std::string where = config_.file.empty() ? "" : config_.file + ": ";
    if (!config_.train.steps) {
      MESHTRAIN_BAD_INPUT(where, "data.source = \"stream\" needs train.steps (a stream has no ",
                          "epochs)");
    }
    if (!config_.model.loss) config_.model.loss = LossKind::mse;
    if (!is_regression(*config_.model.loss)) {
      MESHTRAIN_BAD_INPUT(where, "data.source = \"stream\" sends regression targets, but ",
                          "model.loss = \"", to_string(*config_.model.loss), "\"; use \"mse\", ",
                          "\"huber\" or \"mae\"");
    }
    slice_ = make_batch_slice(*mesh_, rank_, layer_axes_.batch, global_batch);
    min_rows = stream.min_rows > 0 ? stream.min_rows : slice_.rows;
    if (min_rows > stream.buffer_rows) {
      MESHTRAIN_BAD_INPUT(where, "stream.min_rows (", min_rows,
                          stream.min_rows > 0 ? "" : ": one batch's rows on a rank",
                          ") is more than stream.buffer_rows (", stream.buffer_rows, ")");
    }
  });
  // Collective over every process of the job (the rendezvous): no early return above on
  // some ranks only (on_every_rank agreed on it).
  // What a publish carries, told to the producers at the rendezvous (their LiveModel is built
  // from it before the first publish).
  StreamModel model;
  if (stream.publish_every > 0) {
    model.config_text = config_.text.empty() ? config_to_toml(config_) : config_.text;
    for (const ParameterShape& p : model_parameter_shapes(config_.model)) {
      int64_t elements = 1;
      for (int64_t d : p.shape) elements *= d;
      model.parameter_floats += elements;
    }
    model.input_stats = config_.data.normalize_inputs == Normalize::standard;
    model.target_stats = config_.data.normalize_targets == Normalize::standard;
  }
  on_every_rank(comm_, [&] {
    auto source = std::make_unique<StreamSource>(stream, comm_, slice_, inputs, outputs, min_rows,
                                                 config_.run.seed, model);
    stream_ = source.get();
    stream_->set_on_warning(events_.on_warning);
    train_source_ =
        std::move(source);  // owned before anything below can throw (stream_ stays valid)
    // Normalization "standard": the statistics of the first min_rows rows (below).
    if (config_.data.normalize_inputs == Normalize::standard ||
        config_.data.normalize_targets == Normalize::standard) {
      stream_->keep_first_rows(min_rows);
    }
    if (stream.test_fraction > 0.0) {
      // The held-out rows are the test set; their count changes as they come (evaluate()).
      test_source_ = stream_->make_held_out_source();
    } else {
      Dataset none;
      none.description = "no test set (stream.test_fraction = 0)";
      none.features = inputs;
      none.target_width = outputs;
      test_source_ = make_memory_source(std::move(none));
    }
    // Steps are numbered by the schedule; its samples (the buffer's slots) are not used.
    schedule_.emplace(stream.buffer_rows * slice_.count, global_batch * accumulation_,
                      ShuffleMode::none, config_.run.seed);
    eval_slice_ = slice_;
    eval_schedule_ = EvalSchedule::create(0, global_batch);
    total_steps_ = *config_.train.steps;
  });
}

// The communication backend, the communication thread, the mesh's communicators (each group
// choosing its reductions) and the layers' parallel context. Collective, the same on every rank.
void TrainingRun::connect() {
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
}

// The model, its loss, ZeRO-1, who reduces which gradient, the loss scaler, the optimizer, the
// clipper and the rate schedule; the evaluation copy of the model for another batch size; the
// batch buffers. Collective construction, identical on every rank.
void TrainingRun::build_model() {
  const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
  const MixedPrecision precision = config_.mixed_precision.policy();
  context_->set_precision(precision);
  model_ = make_model(config_.model, specs_from_plan(*plan_), *context_, slice_.rows);
  model_->initialize(config_.model.init, config_.run.seed);
  const LossOptions loss_options{config_.model.huber_delta, config_.model.loss_weights};
  loss_ = std::make_unique<Loss>(*config_.model.loss, *context_, slice_.rows, outputs,
                                 model_->output_layout(), loss_options);
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
  // The weight gradients that hold only 16-bit values stored as 16 bits (partition/
  // gradient_storage.hpp): reduced in backward, neither clipped nor loss-scaled (fp16) nor
  // accumulated (accumulation reduces per_step).
  if (gradient_reduction_ == GradientReduction::in_backward && !(config_.optimizer.clip_norm > 0)) {
    model_->store_gradients_16bit(*context_);
  }
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
    // model's parameters (and gradients, never written) from its construction on, so only
    // activations are its own (no second copy of the model, not even while it is built).
    eval_model_ = make_model(config_.model, specs_from_plan(*plan_), *context_, eval_slice_.rows,
                             model_.get());
    eval_loss_ = std::make_unique<Loss>(loss_->kind(), *context_, eval_slice_.rows, outputs,
                                        eval_model_->output_layout(), loss_options);
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
}

void TrainingRun::build_checkpoint_view() {
  // The checkpoint views the live tensors (no copies): a save writes them, a load fills them.
  checkpoint_.mesh = *mesh_;
  // A run made in code has no file text: its checkpoints store the config as TOML.
  if (config_.text.empty()) config_.text = config_to_toml(config_);
  checkpoint_.config_text = config_.text;
  checkpointer_ = std::make_unique<Checkpointer>(comm_, config_.checkpoint.async);
  checkpoint_.params = model_->parameters();
  // The publishes' gather and buffers (stream.publish_every), made once: a publish allocates
  // nothing.
  if (stream_ && stream_->publishing()) {
    on_every_rank(comm_, [&] { stream_->prepare_publish(model_->parameters(), *mesh_); });
  }
  for (const std::string& slot : optimizer_->slot_names()) {
    checkpoint_.opt_state.push_back({slot, optimizer_->slot(slot)});
  }
  // An online run's buffers go with its checkpoints (stream.checkpoint_buffer).
  if (stream_ && config_.stream.checkpoint_buffer) {
    on_every_rank(comm_, [&] {
      checkpoint_.stream.tensors = stream_->prepare_checkpoint(*mesh_, layer_axes_.batch, rank_);
    });
  }
}

// Where the run starts: a checkpoint of its own (resume wins), another run's parameters and
// statistics (init_from), or the initializer and fresh statistics.
void TrainingRun::choose_start() {
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
}

TrainingRun::~TrainingRun() {
  if (tracing_) tracer().stop();  // a run that ended inside its trace window writes nothing
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

// One pass over the training rows, shared by the ranks (normalization_stats.hpp).
void TrainingRun::compute_statistics() {
  const bool inputs = config_.data.normalize_inputs == Normalize::standard;
  const bool targets = config_.data.normalize_targets == Normalize::standard;
  if (!inputs && !targets) return;
  // A stream's buffer is empty at set-up: its statistics come with its first rows.
  if (stream_) {
    stream_statistics_pending_ = true;
    return;
  }
  const NormalizationStats stats =
      compute_normalization(*train_source_, inputs, targets, comm_, slice_.rows);
  normalization_ = stats.normalization;
  checkpoint_.normalization = normalization_;
  const std::string note = constant_features_note(stats);
  if (!note.empty() && rank_ == 0) warnings_.push_back(note);
}

// data.source = "stream" with normalization "standard" (docs/online.md), before the first
// batch: the first pull (every rank holds stream.min_rows rows), then the statistics of the
// first min_rows rows each batch group took, in a fixed order (group, then producer rank, then
// row number), by compute_normalization over them all on every rank (so the same bits on every
// rank, as for a file), frozen from then on (checkpoints keep them; a resume reads them). The
// batch streams are made again with them. Collective.
void TrainingRun::freeze_stream_statistics() {
  stream_statistics_pending_ = false;
  {
    TraceSpan span("stream receive");
    stream_->pull();
  }
  const int64_t features = train_source_->shape().features;
  const int64_t outputs = train_source_->shape().output_width();
  std::vector<float> x, y;
  const int64_t mine = stream_->group_lead() ? stream_->first_rows(x, y) : 0;
  int size = 1;
  check_mpi(MPI_Comm_size(comm_, &size), "MPI_Comm_size");
  // Each rank's (group, rows): only a group's lead gives rows (its other ranks hold the same).
  const int64_t entry[2] = {slice_.index, mine};
  std::vector<int64_t> entries(static_cast<size_t>(2 * size));
  check_mpi(MPI_Allgather(entry, 2, MPI_INT64_T, entries.data(), 2, MPI_INT64_T, comm_),
            "MPI_Allgather (the rows of a stream's statistics)");
  std::vector<int> counts_x(static_cast<size_t>(size)), counts_y(counts_x), displs_x(counts_x),
      displs_y(counts_x);
  int64_t total = 0;
  // Displacements in group order, so that the rows are laid out group by group.
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<size_t>(r)] = r;
  std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
    return entries[static_cast<size_t>(2 * a)] < entries[static_cast<size_t>(2 * b)];
  });
  for (int r : ranks) {
    const int64_t rows = entries[static_cast<size_t>(2 * r + 1)];
    counts_x[static_cast<size_t>(r)] =
        checked_int(static_cast<size_t>(rows * features), "a stream's statistics rows");
    counts_y[static_cast<size_t>(r)] =
        checked_int(static_cast<size_t>(rows * outputs), "a stream's statistics rows");
    displs_x[static_cast<size_t>(r)] =
        checked_int(static_cast<size_t>(total * features), "a stream's statistics rows");
    displs_y[static_cast<size_t>(r)] =
        checked_int(static_cast<size_t>(total * outputs), "a stream's statistics rows");
    total += rows;
  }
  Dataset first;
  first.description = "the first stream.min_rows rows of stream \"" + config_.stream.name + "\"";
  first.num_samples = total;
  first.features = features;
  first.target_width = outputs;
  first.inputs.resize(static_cast<size_t>(total * features));
  first.targets.resize(static_cast<size_t>(total * outputs));
  check_mpi(MPI_Allgatherv(x.data(), static_cast<int>(x.size()), MPI_FLOAT, first.inputs.data(),
                           counts_x.data(), displs_x.data(), MPI_FLOAT, comm_),
            "MPI_Allgatherv (the rows of a stream's statistics)");
  check_mpi(MPI_Allgatherv(y.data(), static_cast<int>(y.size()), MPI_FLOAT, first.targets.data(),
                           counts_y.data(), displs_y.data(), MPI_FLOAT, comm_),
            "MPI_Allgatherv (the rows of a stream's statistics)");
  const std::unique_ptr<RowSource> rows = make_memory_source(std::move(first));
  const NormalizationStats stats = compute_normalization(
      *rows, config_.data.normalize_inputs == Normalize::standard,
      config_.data.normalize_targets == Normalize::standard, comm_, slice_.rows);
  normalization_ = stats.normalization;
  checkpoint_.normalization = normalization_;
  const std::string note = constant_features_note(stats);
  if (!note.empty() && rank_ == 0) warnings_.push_back(note);
  // The batch streams standardize with the statistics they were made with.
  train_stream_.reset();
  eval_stream_.reset();
  eval_seq_ = 0;
  start_streams();
}

// Raw inputs of very different scales train badly and silently: rank 0 looks at a sample.
void TrainingRun::warn_about_input_scales() {
  // A stream's buffer is empty at set-up (its rows come with the first step).
  if (normalization_.inputs() || rank_ != 0 || stream_) return;
  const std::string warning = input_scale_warning(*train_source_, slice_.rows);
  if (!warning.empty()) warnings_.push_back(warning);
}

// Sobolev training (data.dy_key): the derivative term with the run's statistics (the seeds
// carry 1 / input_std, the tangents target_std: the term is in the user's units), the
// buffers of the tangent passes and this rank's rows of the targets, all made here so that
// the step allocates nothing. Collective.
void TrainingRun::build_derivative_loss() {
  if (!dy_source_) return;
  const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
  DerivativeLossSettings settings;
  settings.inputs = config_.data.dy_inputs;
  if (settings.inputs.empty()) {
    for (int64_t i = 0; i < inputs; ++i) settings.inputs.push_back(i);
  }
  settings.weight = config_.model.derivative_loss_weight;
  settings.input_std = normalization_.input_std;    // empty (not normalized): every 1
  settings.target_std = normalization_.target_std;  // likewise
  const auto directions = static_cast<int64_t>(settings.inputs.size());
  on_every_rank(comm_, [&] {
    model_->reserve_tangent_backward(directions);
    derivative_loss_ = std::make_unique<DerivativeLoss>(settings, *context_, slice_.rows, inputs,
                                                        outputs, model_->output_layout());
    if (dy_targets_.extent(0) == 0) {
      dy_targets_ = Matrix("meshtrain::batch_dy", slice_.rows, outputs * directions);
    }
  });
}

void TrainingRun::set_physics(RunPhysics physics) {
  const int64_t inputs = config_.model.input_width(), outputs = config_.model.output_width();
  on_every_rank(comm_, [&] {
    const char* where = "set_physics: ";
    // Between steps, so a resumed run sets it again after its constructor resumed.
    if (micro_done_ > 0 || physics_loss_) {
      MESHTRAIN_BAD_INPUT(where, "a physics loss is set once, between steps");
    }
    if (derivative_loss_) MESHTRAIN_BAD_INPUT(where, "a physics loss cannot join data.dy_key");
    if (loss_->kind() == LossKind::cross_entropy) {
      MESHTRAIN_BAD_INPUT(where, "a physics loss needs a regression model.loss, not cross_entropy");
    }
    if (!physics.loss.input_std.empty() || !physics.loss.target_mean.empty() ||
        !physics.loss.target_std.empty()) {
      MESHTRAIN_BAD_INPUT(where, "leave the statistics of RunPhysics::loss empty: the run's ",
                          "normalization statistics are used");
    }
    if (!(physics.data_loss_weight >= 0.0)) {
      MESHTRAIN_BAD_INPUT(where, "data_loss_weight must be >= 0, got ", physics.data_loss_weight);
    }
    physics.loss.input_std = normalization_.input_std;  // empty (not normalized): every 1
    physics.loss.target_mean = normalization_.target_mean;
    physics.loss.target_std = normalization_.target_std;
    model_->reserve_laplacian(static_cast<int64_t>(physics.loss.inputs.size()));
    physics_loss_ = std::make_unique<PhysicsLoss>(std::move(physics.loss), *context_, slice_.rows,
                                                  inputs, outputs, model_->output_layout());
    physics_x_ = Matrix("meshtrain::physics_x", slice_.rows, inputs);
    physics_input_mean_ = Vector("meshtrain::physics_input_mean", inputs);
    physics_input_std_ = Vector("meshtrain::physics_input_std", inputs);
    auto mean = host_mirror(physics_input_mean_);
    auto scale = host_mirror(physics_input_std_);
    for (int64_t i = 0; i < inputs; ++i) {
      mean(i) = normalization_.inputs() ? static_cast<float>(normalization_.input_mean[i]) : 0.0f;
      scale(i) = normalization_.inputs() ? static_cast<float>(normalization_.input_std[i]) : 1.0f;
    }
    copy_view(physics_input_mean_, mean);
    copy_view(physics_input_std_, scale);
    physics_data_weight_ = physics.data_loss_weight;
  });
}

// The reader threads start where the run does (after a resume), so the first batches are
// being read while the first step is set up.
void TrainingRun::start_streams() {
  on_every_rank(comm_, [&] {
    // A stream's buffer changes between batches (pull): read in the step.
    const int64_t depth = stream_ ? 0 : config_.data.prefetch;
    const BatchSamples training_samples = [this](int64_t seq, int64_t* rows) {
      if (stream_) return stream_->batch_slots(seq, slice_.rows, rows);
      BatchSlice slice = slice_;
      slice.offset = (seq % accumulation_) * slice_.global_batch;
      schedule_->slice_samples(seq / accumulation_, slice, rows);
      return slice.rows;
    };
    train_stream_ =
        std::make_unique<BatchStream>(*train_source_, slice_.rows, training_samples, depth,
                                      steps_done_ * accumulation_, normalization_);
    // The derivative targets of the same rows, in the user's units (not standardized).
    if (dy_source_) {
      dy_stream_ = std::make_unique<BatchStream>(*dy_source_, slice_.rows, training_samples, depth,
                                                 steps_done_ * accumulation_);
    }
    if (evaluates_held_out_rows()) {
      eval_stream_ = std::make_unique<BatchStream>(
          *test_source_, eval_slice_.rows,
          [this](int64_t seq, int64_t* rows) {
            return stream_->held_out_slots(seq - eval_first_seq_, eval_slice_.rows, rows);
          },
          0, 0, normalization_);
    } else if (eval_schedule_.num_batches > 0) {
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
  if (dy_source_) bytes += dy_source_->resident_bytes();
  if (dy_stream_) bytes += dy_stream_->staging_bytes();
  return bytes;
}

// Why this run's step cannot be captured as a CUDA graph, or "" when it can. Every rank
// decides alike (the config, the build, the backend, the world size). The step is
// capturable where its device work between loading the batch and reading the loss back, and
// the update, neither waits for the device nor reads device values on the host, and every
// value its kernels take changes in memory, not as an argument (framework/core/step_graph.hpp).
// What each configuration left out does on the host every step is named.
std::string TrainingRun::cuda_graphs_blocker() const {
  const ModelSection& model = config_.model;
  const int world = mesh_->world_size();
  if (world > 1 && backend_ == CommBackend::mpi) {
    return "the MPI backend stages the step's collectives through host memory (Open MPI here is "
           "not CUDA-aware), which a graph cannot capture";
  }
  if (world > 1) {
    return "the NCCL backend's blocking collectives wait for their completion on the host (their "
           "timeout), which a capture forbids; a capture-mode NCCL path is not built yet";
  }
  if (model.kind != ModelKind::mlp) {
    return detail::concat("model.kind = \"", to_string(model.kind),
                          "\" is not checked capture-safe yet (only \"mlp\" is)");
  }
  if (!model.moe_layers.empty()) {
    return "mixture-of-experts layers read their routing and load-balancing loss on the host";
  }
  if (model.dropout > 0.0) {
    return "dropout's key changes every step and reaches its kernels as an argument, which a "
           "replayed graph would repeat";
  }
  if (loss_->kind() != LossKind::cross_entropy) {
    return detail::concat("model.loss = \"", to_string(loss_->kind()),
                          "\" reads its loss back inside the step (only cross_entropy's is "
                          "split from its kernels)");
  }
  if (scaler_) {
    return "fp16's loss scaler reads the gradients' finiteness on the host every step and passes "
           "its scale to backward as an argument";
  }
  if (config_.optimizer.clip_norm > 0) {
    return "optimizer.clip_norm reads the gradient norm on the host every step";
  }
  if (accumulation_ > 1) return "train.accumulation_steps > 1 is not captured yet";
  if (zero1_) return "ZeRO-1's update is not captured yet";
  if (config_.runtime.overlap) {
    return "runtime.overlap polls started collectives from the host between the step's GEMMs";
  }
  if (derivative_loss_) return "Sobolev training (data.dy_key) is not captured yet";
  if (config_.runtime.traces()) {
    return "runtime.trace_steps times the step's parts with events and fences between them";
  }
  return "";
}

// [runtime] cuda_graphs: "off", or "auto" (capture where legal, cuda_graphs_blocker), the
// choice said in one sentence (describe()). On a build without CUDA there is nothing to
// capture, unless MESHTRAIN_EMULATE_CUDA_GRAPHS=1 asks for StepGraph's host checker.
void TrainingRun::choose_cuda_graphs() {
  const char* emulate_env = std::getenv("MESHTRAIN_EMULATE_CUDA_GRAPHS");
  const bool emulated = !StepGraph::replays_cuda_graphs() && emulate_env != nullptr &&
                        std::string(emulate_env) == "1";
  std::string why_not;
  if (config_.runtime.cuda_graphs == CudaGraphsChoice::off) {
    why_not = "runtime.cuda_graphs = \"off\"";
  } else if (!StepGraph::replays_cuda_graphs() && !emulated) {
    why_not = detail::concat("this build computes on ", Kokkos::DefaultExecutionSpace::name(),
                             ", not CUDA: there is no graph to capture");
  } else {
    why_not = cuda_graphs_blocker();
  }
  graphs_ = why_not.empty();
  if (!graphs_) {
    graphs_note_ = "CUDA graphs: off, " + why_not;
    return;
  }
  graphs_note_ = detail::concat(
      "CUDA graphs: the step's forward, loss and backward and its update are captured at step ",
      steps_done_ + 3, " and replayed",
      emulated ? " (emulated: each replay re-runs the step under the host capture-safety checker)"
               : "");
  optimizer_->enable_prepared_steps();
  forward_backward_graph_ = std::make_unique<StepGraph>("forward, loss and backward");
  update_graph_ = std::make_unique<StepGraph>("optimizer update");
  // The regions' buffers, sized once (fill_graph_buffers writes them in place every step).
  const size_t tensors = model_->parameters().size();
  forward_backward_graph_->buffers().assign(3 + 2 * tensors, nullptr);
  update_graph_->buffers().assign((3 + optimizer_->slot_names().size()) * tensors, nullptr);
}

}  // namespace meshtrain
