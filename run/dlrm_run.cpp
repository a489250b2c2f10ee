// DlrmRun (dlrm_run.hpp): set-up, the step, evaluation, checkpoints and train() of a DLRM run.

#include "run/dlrm_run.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/dtype.hpp"
#include "base/error.hpp"
#include "framework/comm/backend.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/gemm.hpp"
#include "framework/observe/device_timer.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/observe/trace.hpp"
#include "framework/train/resume.hpp"
#include "layers/mlp.hpp"  // specs_from_plan
#include "run/dlrm_data.hpp"
#include "run/run_common.hpp"

namespace meshtrain {

void require_command_builds(const ModelSection& model, const std::string& command) {
  if (model.kind == ModelKind::dlrm) {
    MESHTRAIN_BAD_INPUT("`", command, "` does not serve model.kind = \"dlrm\" yet (issue 39: ",
                        "`meshtrain train`, `evaluate`, `predict`, `export` and ",
                        "meshtrain::DlrmPredictor do)");
  }
}

// The training batches read ahead (dlrm_run.hpp): a thread fills batch seq into slot seq % depth
// once the step has taken what that slot held, from `first` to the last step. The slots are made
// with the run; the thread starts at the first take() (the first training step), so a run that
// only evaluates (`meshtrain evaluate`) reads no training batch. The thread calls
// BatchSchedule::slice_samples (const), RowSource::read and SparseHdf5Reader::read_unagreed only
// (no MPI, no Kokkos; HDF5 under its global mutex), into buffers made here. A read that throws
// is kept in its slot and rethrown by take() on this rank, where the step reads it as a read in
// the step would have failed; an exception other than Error (std::bad_alloc...) is kept as a
// runtime Error naming it, which the step's catch handles the same way.
struct DlrmRun::ReadAhead {
  struct Slot {
    std::vector<int64_t> rows;
    std::vector<float> dense, targets;
    std::vector<std::vector<int64_t>> offsets, values;
    SparseHdf5Reader::Problem problem;
    std::exception_ptr error;
    int64_t seq = -1;
    bool ready = false;
  };

  ReadAhead(RowSource& source, SparseHdf5Reader& reader, const BatchSchedule& schedule,
            BatchSlice slice, int64_t features, int64_t depth, int64_t first, int64_t end)
      : source_(source),
        reader_(reader),
        schedule_(schedule),
        slice_(slice),
        slots_(static_cast<size_t>(depth)),
        next_fill_(first),
        end_(end) {
    const auto n = static_cast<size_t>(slice.rows);
    const size_t tables = reader.tables().size();
    const auto ids = static_cast<size_t>(std::max<int64_t>(reader.max_ids(), 1));
    for (Slot& slot : slots_) {
      slot.rows.assign(n, 0);
      slot.dense.assign(n * static_cast<size_t>(features), 0.0f);
      slot.targets.assign(n, 0.0f);
      slot.offsets.assign(tables, std::vector<int64_t>(n + 1, 0));
      slot.values.assign(tables, std::vector<int64_t>(ids, 0));
    }
  }
  ~ReadAhead() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    freed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // Batch `seq` (the next one) once read; give() hands its slot back.
  Slot& take(int64_t seq) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    Slot& slot = slots_[static_cast<size_t>(seq) % slots_.size()];
    std::unique_lock<std::mutex> lock(mutex_);
    filled_.wait(lock, [&] { return slot.ready && slot.seq == seq; });
    return slot;
  }
  void give(Slot& slot) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot.ready = false;
    }
    freed_.notify_all();
  }
  int64_t depth() const { return static_cast<int64_t>(slots_.size()); }

 private:
  void loop() {
    for (int64_t seq = next_fill_; seq < end_; ++seq) {
      Slot& slot = slots_[static_cast<size_t>(seq) % slots_.size()];
      {
        std::unique_lock<std::mutex> lock(mutex_);
        freed_.wait(lock, [&] { return stop_ || !slot.ready; });
        if (stop_) return;
      }
      read(slot, seq);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        slot.seq = seq;
        slot.ready = true;
      }
      filled_.notify_all();
    }
  }

  // As DlrmRun::traced_step's read in the step: the rows in file order, the ids, the dense rows.
  void read(Slot& slot, int64_t seq) {
    slot.error = nullptr;
    slot.problem = SparseHdf5Reader::Problem{};
    try {
      schedule_.slice_samples(seq, slice_, slot.rows.data());
      std::sort(slot.rows.begin(), slot.rows.end());
      const int64_t n = slice_.rows;
      slot.problem = reader_.read_unagreed(slot.rows.data(), n);
      for (size_t t = 0; t < slot.offsets.size(); ++t) {
        const SparseTableRows csr = reader_.batch(t);
        std::copy(csr.offsets, csr.offsets + n + 1, slot.offsets[t].data());
        std::copy(csr.values, csr.values + csr.ids(), slot.values[t].data());
      }
      source_.read(slot.rows.data(), n,
                   RowBuffers{slot.dense.data(), nullptr, slot.targets.data()});
    } catch (const Error&) {
      slot.error = std::current_exception();
    } catch (const std::exception& e) {
      // Any other failure (std::bad_alloc...) as a runtime Error, so that the step's catch
      // poisons the loss's reduction and every rank stops at this step, as for a failed read.
      slot.error = failure(seq, e.what());
    } catch (...) {
      slot.error = failure(seq, "an unknown exception");
    }
  }
  std::exception_ptr failure(int64_t seq, const std::string& what) const {
    return std::make_exception_ptr(Error(ErrorKind::runtime,
                                         "reading the training batch of step " +
                                             std::to_string(seq + 1) + " of '" + reader_.path() +
                                             "' on the read-ahead thread failed: " + what,
                                         __FILE__, __LINE__));
  }

  RowSource& source_;
  SparseHdf5Reader& reader_;
  const BatchSchedule& schedule_;
  const BatchSlice slice_;
  std::vector<Slot> slots_;
  std::mutex mutex_;
  std::condition_variable filled_, freed_;
  const int64_t next_fill_;
  const int64_t end_;
  bool stop_ = false;
  std::thread thread_;
};

DlrmRun::DlrmRun(RunConfig config, DlrmRunEvents events, MPI_Comm comm, DlrmRunPurpose purpose)
    : config_(std::move(config)),
      events_(std::move(events)),
      predicting_(purpose == DlrmRunPurpose::predict),
      comm_(comm) {
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  plan_run();
  open_data();
  build_model();
  if (predicting_) {
    MESHTRAIN_REQUIRE(!config_.checkpoint.init_from.empty(),
                      "DlrmRun: a prediction needs checkpoint.init_from");
    initialized_from_ = load_model(config_.checkpoint.init_from);
    return;
  }
  if (config_.checkpoint.resume) resume();
  if (!resumed_from_ && !config_.checkpoint.init_from.empty()) {
    initialized_from_ = load_model(config_.checkpoint.init_from);
  }
  if (config_.data.prefetch > 0 && !finished()) {
    // From the first step this run takes (a resumed run's next) to its last; its slots made now.
    read_ahead_ = std::make_unique<ReadAhead>(*train_source_, *train_sparse_, *schedule_, slice_,
                                              batch_.dense.extent_int(1), config_.data.prefetch,
                                              steps_done_, total_steps_);
  }
}

DlrmRun::~DlrmRun() {
  // Only a run that failed inside its trace window gets here still tracing: it writes nothing.
  if (tracing_) tracer().stop();
}

// The config checked (with what this run does not do yet, each in one sentence naming the key),
// the mesh, the plan, the communicators and the layers' context.
void DlrmRun::plan_run() {
  int world_size = 1;
  check_mpi(MPI_Comm_size(comm_, &world_size), "MPI_Comm_size");
  PlanOptions options;
  on_every_rank(comm_, [&] {
    MESHTRAIN_REQUIRE(config_.model.kind == ModelKind::dlrm, "DlrmRun needs model.kind = dlrm");
    check_config(config_);
    const std::string where = config_.file.empty() ? "" : config_.file + ": ";
    auto refuse = [&](bool condition, const std::string& key_and_value) {
      if (condition) {
        MESHTRAIN_BAD_INPUT(where, key_and_value, ": model.kind = \"dlrm\" is not trained with ",
                            "it yet (docs/recsys.md, \"What is left\")");
      }
    };
    refuse(config_.train.accumulation_steps > 1,
           "train.accumulation_steps = " + std::to_string(config_.train.accumulation_steps));
    refuse(config_.optimizer.zero_stage > 0,
           "optimizer.zero_stage = " + std::to_string(config_.optimizer.zero_stage));
    refuse(config_.data.normalize_inputs != Normalize::none,
           "data.normalize_inputs = \"standard\"");
    refuse(config_.data.normalize_targets != Normalize::none,
           "data.normalize_targets = \"standard\"");
    refuse(!config_.data.dy_key.empty(), "data.dy_key = \"" + config_.data.dy_key + "\"");
    refuse(config_.train.early_stopping > 0,
           "train.early_stopping = " + std::to_string(config_.train.early_stopping));
    refuse(config_.checkpoint.keep_best.has_value(), "checkpoint.keep_best");
    refuse(config_.mixed_precision.param_dtype != Dtype::fp32,
           std::string("mixed_precision.param_dtype = \"") +
               to_string(config_.mixed_precision.param_dtype) + "\"");
    refuse(config_.mixed_precision.reduce_dtype != Dtype::fp32,
           std::string("mixed_precision.reduce_dtype = \"") +
               to_string(config_.mixed_precision.reduce_dtype) + "\"");
    refuse(config_.data.eval_batch_size && *config_.data.eval_batch_size != config_.data.batch_size,
           "data.eval_batch_size other than data.batch_size");
    if (config_.optimizer.embeddings != EmbeddingOptimizer::dense &&
        config_.optimizer.clip_norm > 0) {
      // The norm would need the tables' gradients, which sparse updates never make whole.
      MESHTRAIN_BAD_INPUT(where, "optimizer.clip_norm = ", config_.optimizer.clip_norm,
                          " cannot be used with optimizer.embeddings = \"",
                          to_string(config_.optimizer.embeddings),
                          "\" yet (the tables' gradients are never whole); set one of them off");
    }
    set_matmul_precision(config_.runtime.matmul_precision);
    mesh_ = config_.mesh.resolve(world_size);
    options = plan_options(config_);
    plan_ = make_plan(model_parameter_shapes(config_.model), *mesh_, partition_rules(config_),
                      options, model_linear_layers(config_.model));
    batch_axes_ = options.batch_axes;
    // Every collective from here on goes into the flight recorder ([runtime] flight_records),
    // written to <run.output_dir>/flight/ as TrainingRun's (`meshtrain evaluate` and `predict`
    // set flight_records = 0 or point output_dir at --flight-dir before they build the run).
    int world_rank = 0;
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
    const std::string run_dir =
        config_.run.output_dir.empty() ? "runs/" + config_.run.name : config_.run.output_dir;
    flight_recorder().configure(static_cast<std::size_t>(config_.runtime.flight_records), run_dir,
                                world_rank, world_size);
  });
  const CommBackend backend = resolve_comm_backend(config_.runtime.backend, comm_);
  comms_ = std::make_unique<MeshCommunicators>(*mesh_, comm_, prepare_comm_backend(backend, comm_));
  std::vector<std::string> axes;
  for (const auto& axis : mesh_->axes()) axes.push_back(axis.name);
  world_ = &comms_->get(axes);
  context_.emplace(*comms_, options.batch_axes, options.feature_axis,
                   config_.partition.collective_matmul, config_.runtime.overlap,
                   config_.runtime.bucket_mb);
  context_->set_precision(config_.mixed_precision.policy());
}

// The dense rows (RowSource) and the sparse rows (SparseHdf5Reader) of the same files, the
// schedules. The readers' capacity of ids comes from the files (the largest bag of any table
// times this rank's rows), the larger of the two splits' for the model.
void DlrmRun::open_data() {
  const DlrmShape shape = config_.model.dlrm();
  const std::vector<std::string> tables = dlrm_table_names(shape);
  const ModelWidthKeys keys{"model.bottom[0]", "the dlrm's one output"};
  on_every_rank(comm_, [&] {
    if (!config_.model.loss) config_.model.loss = LossKind::binary_cross_entropy;
    if (predicting_) {
      // The dense features alone (no labels), every row in file order.
      train_file_ = dlrm_one_file(config_.data.path, "data.path", config_.file);
      Hdf5SourceOptions options;
      options.x_name = config_.data.x_key;
      options.y_name = "";
      train_source_ = open_hdf5_source({train_file_}, 1, options);
      if (train_source_->shape().features != shape.bottom.front()) {
        MESHTRAIN_BAD_INPUT("input file '", train_file_, "': dataset ", config_.data.x_key, " has ",
                            train_source_->shape().features,
                            " features per row but the model takes ", shape.bottom.front(),
                            " (model.bottom[0])");
      }
      slice_ = make_batch_slice(*mesh_, rank_, batch_axes_, config_.data.batch_size);
      eval_schedule_ = EvalSchedule::create(train_source_->shape().num_samples,
                                            config_.data.batch_size, "data.batch_size");
      return;
    }
    train_file_ = dlrm_one_file(config_.data.path, "data.path", config_.file);
    test_file_ = dlrm_one_file(config_.data.test_path, "data.test_path", config_.file);
    const uint64_t seed = config_.run.seed;
    // Shared with calibrate (run/dlrm_data.hpp): its chunk cache keeps every chunk read.
    train_source_ = open_dlrm_train_source(config_, train_file_);
    test_source_ = open_data_source(config_.data, Split::test, seed, shape.bottom.front(), 1,
                                    config_.model.loss, keys);
    const int64_t global_batch = config_.data.batch_size;
    schedule_.emplace(train_source_->shape().num_samples, global_batch, config_.data.shuffle, seed,
                      config_.data.block_rows, config_.data.shuffle_window);
    slice_ = make_batch_slice(*mesh_, rank_, batch_axes_, global_batch);
    eval_schedule_ = EvalSchedule::create(test_source_->shape().num_samples, global_batch,
                                          "data.batch_size (the evaluation batch)");
    total_steps_ = training_steps(config_, schedule_->steps_per_epoch());
  });
  // Collective, each agreeing on its own errors (a missing table names the file).
  train_sparse_ = std::make_unique<SparseHdf5Reader>(train_file_, tables, slice_.rows, -1, comm_,
                                                     config_.data.sparse_key);
  max_ids_ = train_sparse_->max_ids();
  if (!predicting_ && !test_file_.empty()) {
    test_sparse_ = std::make_unique<SparseHdf5Reader>(test_file_, tables, slice_.rows, -1, comm_,
                                                      config_.data.sparse_key);
    max_ids_ = std::max(max_ids_, test_sparse_->max_ids());
  }
  // The files' tables against the model's: ids are checked against the file's `rows`, so a
  // file table larger than the model's would let ids past the model's rows through.
  on_every_rank(comm_, [&] {
    for (const SparseHdf5Reader* reader : {train_sparse_.get(), test_sparse_.get()}) {
      if (!reader) continue;
      check_dlrm_sparse_data(
          config_, *reader,
          (reader == train_sparse_.get() ? train_source_ : test_source_)->shape().num_samples);
    }
  });
}

void DlrmRun::build_model() {
  const DlrmShape shape = config_.model.dlrm();
  const int64_t rows = slice_.rows;
  on_every_rank(comm_, [&] {
    // Sparse updates: the tables never get a dense gradient (not even allocated then freed).
    // Predicting: no backward, so no table or interaction gradient (as DlrmPredictor; bf16
    // tables, which Dlrm refuses with dense table gradients, predict whatever the config's
    // optimizer.embeddings says).
    const TableGradients table_gradients =
        predicting_                                                 ? TableGradients::none
        : config_.optimizer.embeddings != EmbeddingOptimizer::dense ? TableGradients::sparse
                                                                    : TableGradients::dense;
    model_ = std::make_unique<Dlrm>(shape, config_.model.activation, specs_from_plan(*plan_),
                                    *context_, rows, max_ids_, table_gradients);
    // Predicting, load_model overwrites every parameter: no initializer pass over the tables,
    // no loss, metrics or optimizer.
    if (predicting_) return;
    model_->initialize(config_.model.init, config_.run.seed);
    loss_ = std::make_unique<Loss>(LossKind::binary_cross_entropy, *context_, rows, 1,
                                   FeatureLayout::replicated);
    eval_metrics_ = std::make_unique<EvalMetrics>(LossKind::binary_cross_entropy, *context_, rows,
                                                  1, FeatureLayout::replicated);
    if (config_.optimizer.embeddings != EmbeddingOptimizer::dense) {
      const OptimizerSection& opt = config_.optimizer;
      SparseOptimizerSettings sparse;
      sparse.eps = static_cast<float>(opt.embeddings_eps);
      sparse.beta1 = static_cast<float>(opt.betas.first);
      sparse.beta2 = static_cast<float>(opt.betas.second);
      sparse.weight_decay = static_cast<float>(opt.weight_decay);
      // model.table_dtype = "bf16": the tables are stored as bf16 and every update rounds
      // stochastically, with draws keyed by run.seed (the same on every mesh).
      sparse.bf16_tables = config_.model.table_dtype == Dtype::bf16;
      sparse.rounding_seed = config_.run.seed;
      sparse_tables_ = make_sparse_table_optimizer(opt.embeddings, sparse, model_->tables(), *mesh_,
                                                   context_->rank());
      optimized_params_ = model_->dense_parameters();
      optimized_grads_ = model_->dense_gradients();
    } else {
      optimized_params_ = model_->parameters();
      optimized_grads_ = model_->gradients();
    }
    optimizer_ =
        std::make_unique<Optimizer>(optimizer_settings(config_.optimizer), optimized_params_);
    clipper_ = std::make_unique<GradientClipper>(*mesh_, rank_, model_->gradients());
  });
  if (!predicting_) {
    const OptimizerSection& opt = config_.optimizer;
    lr_schedule_ = LrSchedule{opt.schedule, opt.lr, opt.min_lr, opt.warmup_steps, total_steps_};
    lr_ = static_cast<float>(lr_schedule_.at(0));
  }

  // The batch buffers, made once.
  const int64_t features = shape.bottom.front();
  batch_.dense = Matrix("meshtrain::dlrm_dense", rows, features);
  batch_.targets = Matrix("meshtrain::dlrm_targets", rows, 1);
  dense_mirror_ = host_mirror(batch_.dense);
  targets_mirror_ = host_mirror(batch_.targets);
  rows_.assign(static_cast<size_t>(rows), 0);
  for (size_t t = 0; t < shape.tables.size(); ++t) {
    batch_.offsets.emplace_back("meshtrain::dlrm_offsets", rows + 1);
    batch_.values.emplace_back("meshtrain::dlrm_ids", std::max<int64_t>(max_ids_, 1));
    offsets_mirror_.push_back(host_mirror(batch_.offsets.back()));
    values_mirror_.push_back(host_mirror(batch_.values.back()));
    batch_.bags.push_back(
        SparseBags{IdView(batch_.offsets.back().data(), rows + 1),
                   IdView(batch_.values.back().data(), batch_.values.back().extent(0))});
  }

  if (predicting_) return;
  // The checkpoint views the live tensors.
  checkpoint_.mesh = *mesh_;
  if (config_.text.empty()) config_.text = config_to_toml(config_);
  checkpoint_.config_text = config_.text;
  checkpoint_.params = model_->parameters();
  for (const std::string& slot : optimizer_->slot_names()) {
    checkpoint_.opt_state.push_back({slot, optimizer_->slot(slot)});
  }
  if (sparse_tables_) {
    for (SparseOptimizerSlot& slot : sparse_tables_->slots()) {
      checkpoint_.opt_state.push_back({slot.name, std::move(slot.tensors)});
    }
  }
  checkpointer_ = std::make_unique<Checkpointer>(comm_, config_.checkpoint.async);
}

void DlrmRun::read_rows(RowSource& source, SparseHdf5Reader& reader, const int64_t* rows,
                        int64_t count) {
  // The ids first: collective, its checks agreed on every rank (an id outside its table).
  reader.read(rows, count);
  const int64_t n = slice_.rows;
  const int64_t features = batch_.dense.extent_int(1);
  std::fill(dense_mirror_.data() + count * features, dense_mirror_.data() + n * features, 0.0f);
  std::fill(targets_mirror_.data() + count, targets_mirror_.data() + n, 0.0f);
  for (size_t t = 0; t < batch_.bags.size(); ++t) {
    const SparseTableRows csr = reader.batch(t);
    auto& offsets = offsets_mirror_[t];
    for (int64_t r = 0; r <= count; ++r) offsets(r) = csr.offsets[r];
    for (int64_t r = count + 1; r <= n; ++r) offsets(r) = csr.offsets[count];  // empty bags
    std::copy(csr.values, csr.values + csr.ids(), values_mirror_[t].data());
  }
  if (count > 0) {
    // A prediction's source has no labels.
    source.read(
        rows, count,
        RowBuffers{dense_mirror_.data(), nullptr, predicting_ ? nullptr : targets_mirror_.data()});
  }
  copy_batch_to_device();
}

void DlrmRun::copy_batch_to_device() {
  Kokkos::deep_copy(batch_.dense, dense_mirror_);
  Kokkos::deep_copy(batch_.targets, targets_mirror_);
  for (size_t t = 0; t < batch_.bags.size(); ++t) {
    Kokkos::deep_copy(batch_.offsets[t], offsets_mirror_[t]);
    Kokkos::deep_copy(batch_.values[t], values_mirror_[t]);
  }
}

void DlrmRun::read_training_batch() {
  if (!read_ahead_ || steps_done_ >= total_steps_) {  // past the last step: read here
    schedule_->slice_samples(steps_done_, slice_, rows_.data());
    // In file order: the same rows (the loss is their mean, the gradient their sum), but the
    // reads go through each HDF5 chunk once per batch.
    std::sort(rows_.begin(), rows_.end());
    read_rows(*train_source_, *train_sparse_, rows_.data(), slice_.rows);
    return;
  }
  ReadAhead::Slot& slot = read_ahead_->take(steps_done_);
  struct Give {
    ReadAhead& ahead;
    ReadAhead::Slot& slot;
    ~Give() { ahead.give(slot); }
  } give{*read_ahead_, slot};
  // Collective: every rank agrees on the ids' checks before anything else (as read()).
  train_sparse_->agree(slot.problem);
  std::copy(slot.rows.begin(), slot.rows.end(), rows_.begin());
  std::copy(slot.dense.begin(), slot.dense.end(), dense_mirror_.data());
  std::copy(slot.targets.begin(), slot.targets.end(), targets_mirror_.data());
  const int64_t n = slice_.rows;
  for (size_t t = 0; t < batch_.bags.size(); ++t) {
    std::copy(slot.offsets[t].begin(), slot.offsets[t].end(), offsets_mirror_[t].data());
    std::copy(slot.values[t].begin(), slot.values[t].begin() + slot.offsets[t][n],
              values_mirror_[t].data());
  }
  copy_batch_to_device();
  if (slot.error) std::rethrow_exception(slot.error);
}

double DlrmRun::step() {
  const int64_t number = steps_done_ + 1;
  if (config_.runtime.traces() && number == config_.runtime.trace_first) begin_trace();
  double loss = 0.0;
  {
    TraceSpan span("step", TraceKind::step);
    span.number(number);
    loss = traced_step();
  }
  if (tracing_ && number == config_.runtime.trace_last) end_trace();
  return loss;
}

void DlrmRun::begin_trace() {
  const TraceClock clock =
      start_trace(comm_, rank_, config_.runtime, run_directory(config_) + "/trace");
  trace_clock_offset_ns_ = clock.offset_ns;
  trace_origin_ns_ = clock.origin_ns;
  tracing_ = true;
}

void DlrmRun::end_trace() {
  tracer().stop();
  tracing_ = false;
  write_traces(comm_, rank_, {trace_clock_offset_ns_, trace_origin_ns_},
               run_directory(config_) + "/trace", config_);
}

double DlrmRun::traced_step() {
  // A dense row this rank cannot read (a runtime Error naming the file and row) poisons the
  // loss's reduction, so every rank stops below and the error is agreed on.
  std::exception_ptr data_error;
  try {
    TraceSpan span("data read");
    read_training_batch();
  } catch (const AgreedError&) {
    throw;
  } catch (const Error&) {
    data_error = std::current_exception();
    loss_->poison_next_reduction();
  }
  MatrixView logits;
  {
    TraceSpan span("forward");
    logits = model_->forward(batch_.dense, batch_.bags);
  }
  LossResult result;
  {
    TraceSpan span("loss");
    result = loss_->regression(logits, batch_.targets, /*with_gradient=*/true);
  }
  if (!std::isfinite(result.loss) || result.targets_outside > 0) {
    on_every_rank(comm_, [&] {
      if (data_error) std::rethrow_exception(data_error);
    });
    if (result.targets_outside > 0) {
      throw AgreedError(Error(ErrorKind::bad_input,
                              detail::concat(config_.file, ": data.path = \"", train_file_,
                                             "\": ", result.targets_outside, " of a batch's ",
                                             config_.data.y_key, " labels are outside [0, 1]"),
                              __FILE__, __LINE__));
    }
    throw AgreedError(Error(
        ErrorKind::runtime,
        detail::concat("the training loss became ", std::isnan(result.loss) ? "NaN" : "infinite",
                       " at step ", steps_done_ + 1, "; lower optimizer.lr (now ",
                       config_.optimizer.lr, ") or set optimizer.clip_norm"),
        __FILE__, __LINE__));
  }
  {
    TraceSpan span("backward");
    model_->backward(loss_->gradient());
  }
  if (config_.optimizer.clip_norm > 0) {
    TraceSpan span("clip");
    const double norm = clipper_->clip(model_->gradients(), config_.optimizer.clip_norm, *world_);
    if (!std::isfinite(norm)) {
      throw AgreedError(
          Error(ErrorKind::runtime,
                detail::concat("the gradient norm became non-finite at step ", steps_done_ + 1,
                               " (the gradient of ", clipper_->non_finite_gradient(), ")"),
                __FILE__, __LINE__));
    }
  }
  lr_ = static_cast<float>(lr_schedule_.at(steps_done_));
  checkpointer_->wait_snapshot();  // a save in flight has copied the tensors
  TraceSpan span("optimizer");
  optimizer_->step(optimized_params_, optimized_grads_, lr_);
  if (sparse_tables_) {
    TraceSpan tables_span("sparse optimizer", TraceKind::layer);
    // The tables' rate follows lr's schedule: embeddings_lr / lr times the step's rate.
    const OptimizerSection& opt = config_.optimizer;
    const double table_lr = opt.embeddings_lr > 0 ? lr_ * (opt.embeddings_lr / opt.lr) : lr_;
    sparse_tables_->step(model_->tables(), static_cast<float>(table_lr));
  }
  ++steps_done_;
  return result.loss;
}

EvalEvent DlrmRun::evaluate() {
  eval_metrics_->reset();
  for (int64_t b = 0; b < eval_schedule_.num_batches; ++b) {
    const int64_t valid = eval_slice_samples(eval_schedule_, b, slice_, rows_.data());
    std::exception_ptr data_error;
    try {
      read_rows(*test_source_, *test_sparse_, rows_.data(), valid);
    } catch (const AgreedError&) {
      throw;
    } catch (const Error&) {
      data_error = std::current_exception();
      loss_->poison_next_reduction();
    }
    const MatrixView logits = model_->forward(batch_.dense, batch_.bags);
    const LossResult r = loss_->regression(logits, batch_.targets, /*with_gradient=*/false, valid);
    if (!std::isfinite(r.loss_sum)) {
      on_every_rank(comm_, [&] {
        if (data_error) std::rethrow_exception(data_error);
      });
    }
    eval_metrics_->add(logits, LabelView(), batch_.targets, valid, r);
  }
  EvalEvent event;
  eval_metrics_->finish(event, nullptr);
  event.step = steps_done_;
  return event;
}

void DlrmRun::predict(const DlrmLogitsSink& sink) {
  MESHTRAIN_REQUIRE(predicting_, "DlrmRun::predict needs DlrmRunPurpose::predict");
  Matrix::HostMirror logits_host("meshtrain::dlrm_predict_logits", slice_.rows, 1);
  for (int64_t b = 0; b < eval_schedule_.num_batches; ++b) {
    const int64_t valid = eval_slice_samples(eval_schedule_, b, slice_, rows_.data());
    // The ids' checks are agreed inside the reader; a dense row one rank cannot read is agreed
    // here, before the forward's collectives (no loss reduction to poison).
    std::exception_ptr data_error;
    try {
      read_rows(*train_source_, *train_sparse_, rows_.data(), valid);
    } catch (const AgreedError&) {
      throw;
    } catch (const Error&) {
      data_error = std::current_exception();
    }
    on_every_rank(comm_, [&] {
      if (data_error) std::rethrow_exception(data_error);
    });
    const MatrixView logits = model_->forward(batch_.dense, batch_.bags);
    Kokkos::deep_copy(logits_host, logits);
    sink(rows_.data(), valid, logits_host.data());
  }
}

void DlrmRun::report(const std::optional<std::string>& path) {
  if (path) window_.mark_save();
  if (path && events_.on_checkpoint) events_.on_checkpoint(in_flight_step_, *path);
}

std::string DlrmRun::save() {
  TrainState& state = checkpoint_.train_state;
  state.step = steps_done_;
  state.epoch = schedule_->epoch_of(steps_done_);
  state.batch_in_epoch = steps_done_ % schedule_->steps_per_epoch();
  state.seed = config_.run.seed;
  state.optimizer_step = optimizer_->step_count();
  state.data_order = schedule_->order().name();
  std::string path;
  on_every_rank(comm_, [&] {
    report(checkpointer_->wait());
    in_flight_step_ = steps_done_;
    path = checkpointer_->save(checkpoint_, config_.checkpoint.dir, config_.checkpoint.keep);
    report(checkpointer_->async() ? checkpointer_->wait() : std::optional<std::string>(path));
  });
  return path;
}

void DlrmRun::resume() {
  std::string latest;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) latest = find_latest_checkpoint(config_.checkpoint.dir).value_or("");
  });
  broadcast_string(latest, 0, comm_, "MPI_Ibcast (the checkpoint to resume)");
  if (latest.empty()) return;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) {
      const CheckpointInfo saved = list_checkpoint(latest).info;
      check_resume_compatible(config_, saved, total_steps_, schedule_->order().name());
    }
  });
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(latest, checkpoint_, comm_); });
  steps_done_ = info.train_state.step;
  optimizer_->set_step_count(info.train_state.optimizer_step);
  // The sparse update's index (bf16 tables' draws) is not in the checkpoint: one per step.
  if (sparse_tables_) sparse_tables_->set_updates(steps_done_);
  resumed_from_ = info;
}

CheckpointInfo DlrmRun::load_model(const std::string& path) {
  CheckpointContents model_only;
  model_only.mesh = *mesh_;
  model_only.params = model_->parameters();
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(path, model_only, comm_); });
  return info;
}

void DlrmRun::log_step(double loss) {
  window_loss_ += loss;
  ++window_steps_;
  if (steps_done_ % config_.train.log_every != 0 && steps_done_ != total_steps_) return;
  const double elapsed = window_.times().step_s;
  LogEvent event;
  event.step = steps_done_;
  event.total_steps = total_steps_;
  event.epoch = schedule_->epoch_of(steps_done_ - 1);
  event.loss = window_loss_ / static_cast<double>(window_steps_);
  event.lr = lr_;
  const double samples = static_cast<double>(window_steps_ * config_.data.batch_size);
  event.samples_per_s = elapsed > 0 ? samples / elapsed : 0.0;
  event.step_s = elapsed / static_cast<double>(window_steps_);
  event.eta_s = static_cast<double>(total_steps_ - steps_done_) * event.step_s;
  const ProgressWindow::Times times = window_.times();
  if (times.saved) event.save_s = times.save_s;
  metrics_->log(event);
  if (events_.on_log) events_.on_log(event);
  window_.start();
  window_loss_ = 0.0;
  window_steps_ = 0;
}

DlrmRunSummary DlrmRun::train() {
  on_every_rank(comm_, [&] {
    metrics_ = std::make_unique<MetricsLog>(config_.run.output_dir, rank_ == 0,
                                            /*append=*/steps_done_ > 0);
    if (rank_ == 0) ensure_writable_directory(config_.checkpoint.dir, "checkpoint.dir");
  });
  DlrmRunSummary summary;
  const int64_t first_step = steps_done_;
  const double start = window_.now();
  window_.start();
  window_loss_ = 0.0;
  window_steps_ = 0;
  while (!finished()) {
    const double loss = step();
    log_step(loss);
    const double after_step = window_.now();
    const bool last = steps_done_ == total_steps_;
    const int64_t eval_every = config_.train.eval_interval(schedule_->steps_per_epoch());
    if (((eval_every > 0 && steps_done_ % eval_every == 0) || last) &&
        eval_schedule_.num_batches > 0) {
      summary.last_eval = evaluate();
      metrics_->eval(*summary.last_eval);
      if (events_.on_eval) events_.on_eval(*summary.last_eval);
    }
    const double before_save = window_.now();
    window_.add_paused(before_save - after_step);
    const int64_t every = config_.checkpoint.every_steps;
    if ((every > 0 && steps_done_ % every == 0) || last) save();
    window_.add_saving(window_.now() - before_save);
  }
  // A run that ended inside its trace window (fewer steps than trace_last) writes what it
  // recorded, as a TrainingRun does.
  if (tracing_) end_trace();
  summary.wall_s = window_.now() - start;
  summary.steps_run = steps_done_ - first_step;
  summary.samples_per_s =
      summary.wall_s > 0 ? summary.steps_run * config_.data.batch_size / summary.wall_s : 0.0;
  return summary;
}

std::vector<std::string> DlrmRun::describe() const {
  std::vector<std::string> lines;
  lines.push_back(detail::concat("mesh ", mesh_->short_description(), ", batch ",
                                 config_.data.batch_size, " (", slice_.rows, " per rank), ",
                                 total_steps_, " steps of ", train_source_->shape().num_samples,
                                 " rows; ", max_ids_, " ids per table and rank at most"));
  for (const std::string& line : model_->describe()) lines.push_back("  " + line);
  return lines;
}

}  // namespace meshtrain
