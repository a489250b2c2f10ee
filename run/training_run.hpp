#pragma once
// One training run, as a library type: what `meshtrain train` does, for any program.
// Built from a RunConfig (read from TOML with load_config, or filled in code; see
// docs/library.md), it sets up, in this order and before the first step:
//   the mesh (config.mesh on the MPI world) -> the sharding plan (the one `meshtrain plan`
//   prints) -> the mesh's communicators -> the data and this rank's slice of every batch
//   -> the model (Mlp), its loss and optimizer -> the checkpoint view of the live tensors
//   -> resume from the latest checkpoint when config.checkpoint.resume, else start from
//   checkpoint.init_from's parameters and statistics when set -> the normalization
//   statistics (data.normalize_inputs / normalize_targets; kept from the checkpoint when
//   resumed or initialized from one, else one pass over the training rows).
// Everything a step touches is allocated then: step() allocates nothing.
//
//   meshtrain::Runtime runtime(argc, argv);       // MPI + Kokkos, outlives the run
//   meshtrain::TrainingRun run(config, events);    // collective over MPI_COMM_WORLD
//   run.train();          // the remaining steps, with log/eval events and checkpoints
//   // or by hand:  while (!run.finished()) run.step();  run.evaluate();  run.save();
//
// Errors: set-up errors (bad config, data, mesh, checkpoint) are agreed over the ranks
// and thrown as AgreedError, the same on every rank, as is a non-finite training loss;
// the caller may print it once and return. Any other Error struck only some ranks: the
// program should end every rank (framework/comm/exit_policy.hpp). Every method is collective:
// every rank calls the same methods in the same order.

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/comm/backend.hpp"
#include "framework/comm/failure_agreement.hpp"  // AgreedError
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/core/step_graph.hpp"
#include "framework/io/batch_stream.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/io/metrics.hpp"
#include "framework/io/normalization.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "framework/observe/step_passes.hpp"
#include "framework/stream/stream_source.hpp"
#include "framework/train/config.hpp"
#include "framework/train/loss_scaler.hpp"
#include "framework/train/lr_schedule.hpp"
#include "framework/train/memory_plan.hpp"  // PlannedMemory
#include "framework/train/optimizer.hpp"
#include "framework/train/zero1.hpp"
#include "layers/context.hpp"
#include "layers/derivative_loss.hpp"
#include "layers/eval_metrics.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "layers/physics_loss.hpp"
#include "partition/linear_layout.hpp"  // LayerAxes
#include "partition/planner.hpp"
#include "run/progress_window.hpp"

namespace meshtrain {

// What a run reports while train() runs, on every rank (print on rank 0 only). Each may be
// empty. metrics.jsonl (rank 0, under run.output_dir) gets the log and eval events too.
struct RunEvents {
  std::function<void(const LogEvent&)> on_log;    // every train.log_every steps and at the end
  std::function<void(const EvalEvent&)> on_eval;  // every train.eval_every steps and at the end
  std::function<void(int64_t step, const std::string& path)> on_checkpoint;  // after each save
  // Every rank's memory against the plan, after train()'s first step and at its end
  // (measure_memory); metrics.jsonl gets them too.
  std::function<void(const MemoryEvent&)> on_memory;
  // What the run's user should be told while it trains or ends, one sentence each (no
  // "warning: " prefix), on rank 0: a stream's producer taken for gone (docs/online.md), which
  // may come as the run is destroyed. The library prints nothing itself.
  std::function<void(const std::string&)> on_warning;
};

// Training and test data given in code instead of config.data (a program's own data). The
// test split may be empty (num_samples 0): evaluation then has nothing to do.
struct RunData {
  Dataset train;
  Dataset test;
};

// The result of one step: the steps done so far and the step's loss (mean over the
// global batch, the same on every rank).
struct StepResult {
  int64_t step = 0;
  double loss = 0.0;             // the MoE layers' load-balancing loss included
  double aux_loss = 0.0;         // that part (0 without MoE layers)
  double derivative_loss = 0.0;  // data.dy_key: the derivative term, part of loss (else 0)
  double physics_loss = 0.0;     // set_physics: the residual term, part of loss (else 0)
};

// A physics loss joined to a run from C++ (docs/derivatives.md, "Physics losses"): each
// micro-batch's rows are collocation points; the run's loss becomes
//   data_loss_weight * (data loss) + loss.weight * mean r^2.
// The residual reads the batch's inputs in the data's units (the batch de-normalized, x' std +
// mean) and u, du/dx, d2u/dx2 in the targets' units: leave loss.input_std, target_mean and
// target_std empty (the run fills them with its normalization statistics).
struct RunPhysics {
  PhysicsLossSettings loss;
  double data_loss_weight = 1.0;  // >= 0; 0: the physics term alone (targets still read)
};

// What train() did.
struct RunSummary {
  int64_t steps_run = 0;  // steps taken by this call (0 when resumed at or past the end)
  double wall_s = 0.0;
  double samples_per_s = 0.0;
  double tflops_per_rank = 0.0;  // model TFLOP/s of one rank over wall_s (evaluation and
                                 // checkpoints included)
  double data_wait_s = 0.0;      // seconds the steps waited for their batches, in all (the
                                 // slowest rank's, window by window)
  std::optional<EvalEvent> last_eval;
  std::optional<MemoryEvent> memory;  // measured at the end (nullopt when no step ran)
};

class TrainingRun {
 public:
  // Collective over `comm` (a Runtime must exist; the mesh spans comm's ranks). Checks
  // the config (check_config), loads config.data unless `data` is given, builds
  // everything above and resumes when config.checkpoint.resume. Writes nothing to disk.
  explicit TrainingRun(RunConfig config, RunEvents events = {},
                       std::optional<RunData> data = std::nullopt, MPI_Comm comm = MPI_COMM_WORLD);
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  // One optimizer step on the next global batch: for each of the train.accumulation_steps
  // micro-batches, this rank's rows of it (load_batch) and its gradient
  // (accumulate_loaded_batch); then apply_update(). Throws AgreedError when the loss is not
  // finite. Allocates nothing.
  StepResult step();
  // Writes this rank's rows of micro-batch `micro` of the global batch of `step` into the
  // batch buffers (read ahead by the data reader thread when data.prefetch > 0). A batch
  // this rank cannot read (bad rows, a changed file) makes the next loss non-finite on every
  // rank; the step then throws the reading error as an AgreedError on every rank.
  void load_batch(int64_t step, int64_t micro = 0);
  // Forward, loss and backward of the micro-batch in the buffers; its gradient is added to
  // those of the step's earlier micro-batches. Returns its loss (mean over its rows).
  double accumulate_loaded_batch();
  // Ends the step: the mean gradient of its micro-batches, clipping, the optimizer update at
  // the schedule's rate. Returns the steps done and the mean loss of the micro-batches.
  StepResult apply_update();
  // The step on the batch in the buffers (accumulate_loaded_batch + apply_update) when
  // train.accumulation_steps is 1. (Benchmarks time this alone.)
  StepResult step_on_loaded_batch();

  // The metrics of the whole test split at the current step (layers/eval_metrics.hpp: loss,
  // and accuracy, top-5 and per-class accuracy, or MSE, MAE and R^2 per output in the data's
  // units, de-normalized with normalization()'s target statistics), in batches
  // of data.eval_batch_size. With the training batch size it uses the batch buffers
  // (load_batch again before accumulate_loaded_batch); otherwise buffers of its own.
  EvalEvent evaluate();
  // Saves a checkpoint of the current step under checkpoint.dir (keeping checkpoint.keep)
  // and returns its path once it is complete. Collective.
  std::string save();
  // The same in two halves, as train() uses them: start_save() completes a checkpoint still
  // in flight, then starts this step's (written in the background when checkpoint.async:
  // the tensors are copied to a staging buffer before the next optimizer step) and returns
  // the path it will have; finish_save() waits for the one in flight and returns its path
  // (nullopt when none). on_checkpoint fires as each one completes. Collective.
  std::string start_save();
  std::optional<std::string> finish_save();
  // Runs the remaining steps up to total_steps(): creates run.output_dir (metrics.jsonl)
  // and checkpoint.dir first (bad_input when not writable), emits the events, evaluates
  // every train.eval_every steps and at the end, saves every checkpoint.every_steps and
  // at the end. When a step throws an AgreedError (a non-finite loss, unreadable data) the
  // save in flight is completed before it is rethrown: the last good state stays
  // resumable.
  RunSummary train();

  const RunConfig& config() const { return config_; }
  const Mesh& mesh() const { return *mesh_; }
  const ShardingPlan& plan() const { return *plan_; }
  const BatchSlice& batch_slice() const { return slice_; }
  const BatchSchedule& schedule() const { return *schedule_; }
  const RowSource& train_data() const { return *train_source_; }
  const RowSource& test_data() const { return *test_source_; }
  // Host bytes of the data path on this rank: the sources (in-memory rows, a stream's
  // scratch and chunk caches) and the staging buffers of both streams.
  int64_t data_bytes() const;
  CommBackend backend() const { return backend_; }
  Mlp& model() { return *model_; }
  Loss& loss() { return *loss_; }
  Optimizer& optimizer() { return *optimizer_; }
  int64_t steps_done() const { return steps_done_; }
  // fp16 loss scaling (nullptr in bf16 and fp32 runs) and the steps it skipped so far.
  LossScaler* loss_scaler() { return scaler_.get(); }
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t total_steps() const { return total_steps_; }
  // The learning rate of step `step` (0-based; optimizer.schedule).
  double learning_rate(int64_t step) const { return lr_schedule_.at(step); }
  // Model FLOPs of one optimizer step over all ranks: 6 x parameters x samples (forward
  // 2, backward 4 multiply-adds per parameter and sample; the MLP's FLOPs are its GEMMs').
  double flops_per_step() const;
  // Where [runtime] trace_steps writes: <run.output_dir>/trace (runs/<run.name>/trace when
  // the config names no output_dir).
  std::string trace_dir() const;
  // The run's directory: run.output_dir, or runs/<run.name> when the config names none. The
  // flight recorder ([runtime] flight_records) writes to its flight/ folder.
  std::string run_dir() const;
  // The last step is done, or train.early_stopping stopped the run (also when resumed from
  // a checkpoint saved as it stopped).
  // With stream.until = "closed": every producer had closed at the last step.
  bool finished() const { return steps_done_ >= total_steps_ || stopped_early_ || stream_ended_; }
  // Ends the training here on purpose (a program stepping by hand that stops before
  // finished()): the run counts as completed, so that destroyed it ends its stream with "done"
  // to the producers rather than the stop a run destroyed before it finished sends (an error
  // the caller caught, say; docs/online.md). train() and the last step() do this themselves.
  void mark_completed() {
    if (stream_) stream_->finish();
  }
  bool stopped_early() const { return stopped_early_; }
  // The best evaluation so far by the run's metric (checkpoint.keep_best, else the test
  // loss; NaN before the first) and the step it was made at (-1 when not in this process).
  double best_metric() const { return best_metric_; }
  int64_t best_step() const { return best_step_; }
  // The checkpoint this run resumed from (nullopt for a fresh start).
  const std::optional<CheckpointInfo>& resumed_from() const { return resumed_from_; }
  // What the resume did not carry over, for the resume line ("" when everything was): the
  // checkpoint's best evaluation measured another metric than this run's keep_best, or an
  // unrecorded one, so the best starts afresh (framework/train/resume.hpp resumed_best).
  const std::string& resume_note() const { return resume_note_; }
  // The statistics every batch (training and evaluation) is standardized with, and that every
  // checkpoint stores (framework/io/normalization.hpp): an empty side is not normalized. The
  // same bits on every rank, mesh and world size.
  const Normalization& normalization() const { return normalization_; }
  // The checkpoint checkpoint.init_from named, once loaded (nullopt otherwise, and when a
  // checkpoint of the run's own was resumed instead).
  const std::optional<CheckpointInfo>& initialized_from() const { return initialized_from_; }
  // Collective: loads the parameters and the normalization statistics of the checkpoint at
  // `path` (a .h5 file, a latest/best pointer file, or a checkpoint directory: its latest)
  // into this run, resharded onto its mesh; the optimizer state, the step and the data
  // position stay as they are. What checkpoint.init_from does at set-up (and `meshtrain
  // evaluate` with a run built from the checkpoint's config). Throws AgreedError (bad_input)
  // for a model that does not match (naming the parameter and both shapes) and for
  // statistics that do not match data.normalize_inputs / normalize_targets (naming the key).
  CheckpointInfo load_model(const std::string& path);
  // Collective, once, between steps (a resumed run calls it again: the term is not saved in
  // checkpoints): every later step adds `physics`'s term (above) through
  // Mlp::forward_laplacian and backward_with_laplacian. Throws bad_input (agreed) for what the
  // forward Laplacian is not built for (mixed precision, MoE layers),
  // with data.dy_key, for a cross_entropy loss, statistics set in `physics.loss`, a negative
  // data_loss_weight, or what PhysicsLoss refuses. Evaluation (test loss, metrics) stays the
  // data loss's.
  void set_physics(RunPhysics physics);
  // The clock train() times its progress windows on (the steps' time, which samples/s and
  // TFLOP/s are computed from, and the time spent saving; LogEvent): steady_clock unless a
  // program (a test) gives its own, in seconds.
  void set_clock(SecondsClock clock) { window_ = ProgressWindow(std::move(clock)); }
  // What set-up found worth a warning but not an error (on rank 0 only; e.g. a resumed run
  // whose learning-rate schedule was stretched to another length).
  const std::vector<std::string>& warnings() const { return warnings_; }
  // [runtime] cuda_graphs (docs/gpu.md, "CUDA graphs"): whether this run's steps replay their
  // captured device work (framework/core/step_graph.hpp), and the sentence saying what was
  // chosen and why (describe() prints it; metrics.jsonl's log lines carry "cuda_graphs").
  // On a build without CUDA, MESHTRAIN_EMULATE_CUDA_GRAPHS=1 makes "auto" choose as a CUDA
  // build would and run the chosen steps through StepGraph's host capture-safety checker.
  bool cuda_graphs() const { return graphs_; }
  const std::string& cuda_graphs_note() const { return graphs_note_; }
  // The regions' replays so far (0 before the capture or with graphs off).
  int64_t cuda_graph_replays() const { return graphs_ ? forward_backward_graph_->replays() : 0; }
  // The host checker's count of the kernels in the two captured regions (StepGraph).
  int64_t cuda_graph_kernels() const {
    return graphs_ ? forward_backward_graph_->captured_kernels() + update_graph_->captured_kernels()
                   : 0;
  }
  // What the plan predicts per rank for this run (the "per rank" total of `meshtrain plan`),
  // with the data path's bytes measured where the data was given in code.
  const PlannedMemory& planned_memory() const { return planned_memory_; }
  // Collective, outside a step: every rank's memory now (Kokkos allocations since the run was
  // built, through framework/observe/memory_tracker.hpp; the resident set) against the plan, the
  // largest live allocations of the rank furthest above it, each with the plan item it
  // belongs to, and whether that rank is over the plan (below). The same event on every rank.
  // train() calls it after its first step ("first_step") and at its end ("end").
  MemoryEvent measure_memory(const std::string& when);
  // A rank is over the plan when its Kokkos peak is more than kOverPlanFraction above the
  // plan's Kokkos bytes and more than kOverPlanMinBytes above them (a few KiB of activations
  // over a tiny model's plan are not worth a warning).
  static constexpr double kOverPlanFraction = 0.25;
  static constexpr int64_t kOverPlanMinBytes = int64_t{16} << 20;
  // Lines describing the run: the mesh, batch and steps, then one per layer.
  std::vector<std::string> describe() const;
  // The plan item (as `meshtrain plan` names its per-rank totals) a live Kokkos allocation of
  // this rank belongs to, "" when the plan has none for it (public for the tests that sum
  // each item's allocations against the plan).
  std::string plan_item_of(const TrackedAllocation& allocation) const;

 private:
  StepResult run_step();  // step() without its stream stop on an error
  // Trainer rank 0 answers the stream's producers' closes outside a step (evaluation, saves,
  // the end of train()): StreamSource::answer_closes.
  void answer_stream_closes() {
    if (stream_) stream_->answer_closes();
  }
  // Set-up, in the constructor's order (run_setup.cpp).
  void plan_run();
  void open_data(std::optional<RunData> data);
  void open_stream();
  void connect();
  void build_model();
  void build_checkpoint_view();
  void choose_start();
  void choose_cuda_graphs();
  std::string cuda_graphs_blocker() const;  // why this run's step cannot be captured, or ""

  LossResult compute_loss(Loss& loss, MatrixView output, const BatchLabels& labels,
                          const Matrix& targets, bool with_gradient, int64_t valid_rows = -1);
  void resume();
  // The checkpoint's statistics (read on rank 0, the same bits on every rank), checked
  // against data.normalize_inputs / normalize_targets and the data's widths.
  Normalization read_checkpoint_normalization(const std::string& file, const std::string& role);
  bool check_stream_buffer_fits(const CheckpointListing& listing);
  void freeze_stream_statistics();
  void compute_statistics();
  void warn_about_input_scales();
  void log_step(const StepResult& result);
  void train_steps(RunSummary& summary);
  void start_streams();
  void build_derivative_loss();
  void denormalize_physics_points();  // physics_x_ = x_ in the data's units
  void keep_data_error(Loss& loss);
  double accumulate_captured_batch();  // accumulate_loaded_batch with graphs_ on
  void fill_graph_buffers();
  // One call of a captured region; a capture or replay it refuses turns graphs off (below).
  void run_graphed(StepGraph& graph, const StepRegion& region);
  void turn_graphs_off(const StepGraph& graph, const std::string& why);
  void check_fp16_overflow(bool loss_overflowed);
  void forget_micro_batches();  // the step under way starts over
  bool record_evaluation(const EvalEvent& eval);
  EvalMetric best_metric_kind() const;  // checkpoint.keep_best, else test_loss
  void throw_agreed_data_error();
  [[noreturn]] void fail_non_finite_loss(double loss);
  void agree_on_data_shape();
  void report_checkpoint(const std::optional<std::string>& path);
  void begin_trace();
  void end_trace();
  void report_memory(const std::string& when, RunSummary* summary);

  RunConfig config_;
  RunEvents events_;
  MPI_Comm comm_ = MPI_COMM_NULL;  // the caller's; the run's ranks
  int rank_ = 0;
  std::optional<Mesh> mesh_;
  std::optional<ShardingPlan> plan_;
  PlannedMemory planned_memory_;
  LayerAxes layer_axes_;  // the batch and feature axes of the plan's layers
  std::unique_ptr<RowSource> train_source_;
  std::unique_ptr<RowSource> test_source_;
  // data.source = "stream": train_source_ as what it is (pulled before every micro-batch).
  StreamSource* stream_ = nullptr;
  // stream.test_fraction > 0: evaluations read the stream's held-out rows, their batches
  // numbered from eval_first_seq_ (the evaluation's first).
  bool evaluates_held_out_rows() const {
    return stream_ != nullptr && config_.stream.test_fraction > 0.0;
  }
  int64_t eval_first_seq_ = 0;
  // data.source = "stream" with normalization "standard": the statistics are made from the
  // first rows before the first batch (freeze_stream_statistics).
  bool stream_statistics_pending_ = false;
  bool stream_ended_ = false;              // stream.until = "closed" and every producer had closed
  std::optional<BatchSchedule> schedule_;  // of optimizer steps: accumulation x batch rows
  BatchSlice slice_;                       // of one micro-batch
  int64_t accumulation_ = 1;               // micro-batches per step
  EvalSchedule eval_schedule_;
  BatchSlice eval_slice_;
  int64_t total_steps_ = 0;
  int64_t steps_done_ = 0;
  CommBackend backend_ = CommBackend::mpi;
  // [runtime] trace_steps: whether this run's window is being recorded, and the timestamps'
  // shift onto rank 0's clock and origin there (begin_trace).
  bool tracing_ = false;
  int64_t trace_clock_offset_ns_ = 0;
  int64_t trace_origin_ns_ = 0;
  // The traced steps' passes (framework/observe/step_passes.hpp), reserved by begin_trace.
  TracedPasses traced_passes_;

  // Declared in dependency order: destroyed in reverse, the communicators last, and the
  // communication thread (runtime.comm_thread) after every request that may use it.
  std::optional<CommThreadLease> comm_thread_;
  std::unique_ptr<MeshCommunicators> comms_;
  // "<group>: <algorithm>" of every group of 2 or more ranks ([runtime] reductions), for
  // describe().
  std::vector<std::string> reduction_choices_;
  Communicator* world_ = nullptr;  // the group over every mesh axis (owned by comms_)
  std::optional<ParallelContext> context_;
  std::unique_ptr<Mlp> model_;
  std::unique_ptr<Loss> loss_;
  // optimizer.zero_stage = 1 with dp > 1: the optimizer works on this rank's chunks.
  std::unique_ptr<Zero1> zero1_;
  // Who completes the gradients layers can leave partial (set once, in the constructor).
  GradientReduction gradient_reduction_ = GradientReduction::in_backward;
  std::unique_ptr<LossScaler> scaler_;  // fp16 runs only
  // fp16 steps skipped for a non-finite gradient or loss, in all; whether the step under way
  // had a non-finite loss (its update is skipped); steps in a row skipped for one.
  int64_t skipped_steps_ = 0;
  bool step_loss_overflowed_ = false;
  double inputs_beyond_fp16_ = 0.0;  // in this rank's rows of the micro-batch under way
  int64_t loss_overflows_in_a_row_ = 0;
  // What the optimizer and the clipper work on: zero1_'s chunks, else the whole model's.
  std::vector<ShardedTensor>& updated_parameters() {
    return zero1_ ? zero1_->param_chunks() : model_->parameters();
  }
  std::vector<ShardedTensor>& updated_gradients() {
    return zero1_ ? zero1_->grad_chunks() : model_->gradients();
  }
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradientClipper> clipper_;
  // [runtime] cuda_graphs on (choose_cuda_graphs): the step's two captured regions, forward,
  // loss kernels and backward, then (after the loss is read back and checked on the host) the
  // optimizer's update; the note describe() prints either way.
  bool graphs_ = false;
  std::string graphs_note_;
  std::unique_ptr<StepGraph> forward_backward_graph_;
  std::unique_ptr<StepGraph> update_graph_;
  LrSchedule lr_schedule_;
  float lr_ = 0.0f;  // of the last step
  // Gradient accumulation (accumulation_ > 1): the sum of the step's earlier micro-batch
  // gradients, and how many micro-batches and what loss the step has so far.
  std::vector<ShardedTensor> gradient_sum_;
  int64_t micro_done_ = 0;
  double micro_loss_sum_ = 0.0;
  double micro_aux_loss_sum_ = 0.0;
  double micro_derivative_loss_sum_ = 0.0;

  // Sobolev training (data.dy_key; docs/derivatives.md): the derivative targets' source (the
  // training files' dy_key, in the training rows' numbering), the loss term on the model's
  // tangents (built once the normalization is known), and this rank's rows of the targets
  // [rows, outputs * k]. Null / empty without dy_key.
  std::unique_ptr<RowSource> dy_source_;
  std::unique_ptr<DerivativeLoss> derivative_loss_;
  Matrix dy_targets_;
  // set_physics: the residual term, the batch's inputs in the data's units, the data loss's
  // weight, and the step's physics losses so far.
  std::unique_ptr<PhysicsLoss> physics_loss_;
  Matrix physics_x_;
  Vector physics_input_mean_, physics_input_std_;
  double physics_data_weight_ = 1.0;
  double micro_physics_loss_sum_ = 0.0;

  // Evaluation with another batch size than training: a forward-only model sharing the
  // training model's parameters, its loss and batch buffers. Empty: evaluation uses the
  // training model and buffers.
  std::unique_ptr<Mlp> eval_model_;
  std::unique_ptr<Loss> eval_loss_;
  Matrix eval_x_;
  BatchLabels eval_labels_;
  Matrix eval_targets_;
  std::unique_ptr<EvalMetrics> eval_metrics_;  // of every evaluation batch

  // This rank's rows of one batch: inputs and either labels or targets.
  Matrix x_;
  BatchLabels labels_;
  Matrix targets_;

  CheckpointContents checkpoint_;               // views of the live tensors: a save writes them
  std::unique_ptr<Checkpointer> checkpointer_;  // the writer (a thread when async)
  int64_t in_flight_step_ = 0;                  // the step of the last checkpoint started
  std::optional<CheckpointInfo> resumed_from_;
  std::string resume_note_;
  std::optional<CheckpointInfo> initialized_from_;
  Normalization normalization_;  // applied by the streams, saved in checkpoint_
  std::vector<std::string> warnings_;
  double best_metric_ = std::numeric_limits<double>::quiet_NaN();
  int64_t best_step_ = -1;
  int64_t evals_since_best_ = 0;
  bool stopped_early_ = false;

  // train(): metrics.jsonl and the loss window since the last log event.
  std::unique_ptr<MetricsLog> metrics_;
  ProgressWindow window_;  // the steps', evaluation's and saving's time since the last log
  double window_loss_ = 0.0;
  double window_aux_loss_ = 0.0;
  double window_derivative_loss_ = 0.0;
  int64_t window_steps_ = 0;
  double data_wait_s_ = 0.0;  // over the whole of train()
  // The heap copy of each log's data-wait reduction (framework/comm/mpi_util.hpp), made at
  // set-up so that logging allocates nothing.
  std::vector<char> data_wait_reduction_ = std::vector<char>(2 * sizeof(double));

  // The batches, read ahead (they read the schedule, the slices and the sources above, so
  // they are declared last and stopped first). A reading error on this rank waits in
  // data_error_ until the ranks agree on it.
  std::unique_ptr<BatchStream> train_stream_;
  std::unique_ptr<BatchStream> eval_stream_;
  std::unique_ptr<BatchStream> dy_stream_;  // dy_source_'s rows of each training micro-batch
  int64_t eval_seq_ = 0;  // evaluation batches taken so far (the eval stream's sequence)
  std::exception_ptr data_error_;
};

}  // namespace meshtrain
