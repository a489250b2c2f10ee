#pragma once
// One training run of a DLRM (`[model] kind = "dlrm"`, docs/recsys.md), as a library type: what
// `meshtrain train` does for that kind, TrainingRun's sibling. From a RunConfig it sets up, before
// the first step:
//   the mesh and the sharding plan (the one `meshtrain plan` prints), the flight recorder
//   ([runtime] flight_records, into <run.output_dir>/flight/ as TrainingRun's) -> the
//   communicators and the layers' context -> the data: the dense features and click labels of
//   data.path / test_path (x_key, y_key; streamed as every HDF5 source) and the sparse features
//   of the same files (data.sparse_key, SparseHdf5Reader), this rank's rows of every batch in
//   the same order ->
//   the model (Dlrm), its loss (binary cross entropy) and optimizer (optimizer.kind, AdamW or SGD,
//   over every parameter, or with a sparse optimizer.embeddings over the linear layers only, the
//   tables then updated in their touched rows by layers/sparse_optimizer.hpp) -> the checkpoint
//   view of the live tensors -> resume from the latest checkpoint when checkpoint.resume (the
//   tables resharded onto this mesh by the generic checkpoint code), else checkpoint.init_from's
//   parameters when set, else the initializer.
// The batches of the training steps are read ahead (data.prefetch > 0, the default 2: that many
// batches) by a reader thread (ReadAhead, dlrm_run.cpp) into host slots: the dense rows through
// the RowSource, the ids of the same rows through SparseHdf5Reader::read_unagreed (no MPI on the
// thread), both from BatchSchedule::slice_samples in file order; the step takes its slot, agrees
// on the ids' checks (collective, as SparseHdf5Reader::read) and copies it into the batch views:
// the same rows in the same order as a read in the step (data.prefetch = 0), so the same bits.
// The slots are made with the run, the thread starts at the first training step (a run that only
// evaluates reads no training batch). Evaluation and prediction read in the step. The dense
// training source keeps every chunk of x_key and y_key it reads in HDF5's cache
// (DlrmDataCaches::dense_budget), as the sparse reader keeps its tables'. Every buffer is made at
// set-up: step() allocates nothing of its own (HDF5 may inside its calls).
//
// Errors: set-up errors and bad data are AgreedErrors, the same on every rank (an id outside its
// table names the table, the file and the global row: SparseHdf5Reader's agreement), as is a
// non-finite loss. Every method is collective: every rank calls the same ones in the same order.
//
// Not yet (docs/recsys.md, "What is left"): gradient accumulation, zero_stage 1, mixed
// precision, input normalization, an evaluation batch other than the
// training batch, early stopping and keep_best, memory reports. Traces ([runtime] trace_steps):
// the steps, their phases (data read, forward, loss, backward, optimizer) and every collective
// (the tables' all-to-alls included) into <run.output_dir>/trace/ as TrainingRun's, without its
// passes.json.

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/io/metrics.hpp"
#include "framework/io/sparse_hdf5.hpp"
#include "framework/train/config.hpp"
#include "framework/train/lr_schedule.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/context.hpp"
#include "layers/dlrm.hpp"
#include "layers/eval_metrics.hpp"
#include "layers/loss.hpp"
#include "layers/sparse_optimizer.hpp"
#include "partition/planner.hpp"
#include "run/progress_window.hpp"

namespace meshtrain {

// bad_input, one sentence, when `command` (e.g. "meshtrain predict") does not build the model
// kind of `model` yet: the commands' policy, which model kinds each serves (apps/ calls it).
// `meshtrain train`, `evaluate` and `predict` (apps/predict.cpp: a DlrmRun for kind = "dlrm")
// build every kind; the others (and Predictor) not kind = "dlrm".
void require_command_builds(const ModelSection& model, const std::string& command);

// The events DlrmRun::train() reports (on every rank; print on rank 0), as TrainingRun's.
struct DlrmRunEvents {
  std::function<void(const LogEvent&)> on_log;
  std::function<void(const EvalEvent&)> on_eval;
  std::function<void(int64_t step, const std::string& path)> on_checkpoint;
};

struct DlrmRunSummary {
  int64_t steps_run = 0;
  double wall_s = 0.0;
  double samples_per_s = 0.0;
  std::optional<EvalEvent> last_eval;
};

// This rank's rows of one batch: the dense features, the labels and each table's bags.
struct DlrmBatch {
  Matrix dense;    // [rows, bottom[0]]
  Matrix targets;  // [rows, 1]
  // Per table: the CSR copied from the reader (device memory), and the bags viewing it.
  std::vector<Kokkos::View<int64_t*>> offsets, values;
  std::vector<SparseBags> bags;
};

// What a DlrmRun is made for. predict: the rows of data.path (one file: its x_key dense features
// and its tables, no labels read) in batches of data.batch_size, the parameters of
// checkpoint.init_from; no test split, loss, optimizer or checkpoints are made.
enum class DlrmRunPurpose { train, predict };

// DlrmRun::predict's consumer: this rank's `count` valid rows of a batch (global row indices,
// consecutive) and their logits. It must not throw (every rank takes part in every batch).
using DlrmLogitsSink = std::function<void(const int64_t* rows, int64_t count, const float* logits)>;

class DlrmRun {
 public:
  // Collective over `comm`. config.model.kind must be "dlrm".
  explicit DlrmRun(RunConfig config, DlrmRunEvents events = {}, MPI_Comm comm = MPI_COMM_WORLD,
                   DlrmRunPurpose purpose = DlrmRunPurpose::train);
  ~DlrmRun();
  DlrmRun(const DlrmRun&) = delete;
  DlrmRun& operator=(const DlrmRun&) = delete;

  // One optimizer step on the next global batch; its loss (mean over the global batch).
  double step();
  // The test split's metrics (loss, AUC, log loss, accuracy) at the current step.
  EvalEvent evaluate();
  // Purpose predict: the logits of every row of data.path, batch after batch, handed to `sink`
  // (the last batch's padding rows are not). An id outside its table, or a dense row a rank
  // cannot read, is an AgreedError on every rank at the same batch. Collective.
  void predict(const DlrmLogitsSink& sink);
  // The rows of data.path (predict) or of the training split.
  int64_t rows_of_data() const { return train_source_->shape().num_samples; }
  // This rank's slice of every batch (ranks of the same index hold the same rows).
  const BatchSlice& slice() const { return slice_; }
  // A checkpoint of the current step under checkpoint.dir; its path once complete.
  std::string save();
  // The remaining steps with log, eval (train.eval_every and at the end) and checkpoint
  // (checkpoint.every_steps and at the end) events; metrics.jsonl under run.output_dir.
  DlrmRunSummary train();
  // The parameters of the checkpoint at `path` (a file, pointer or directory), resharded onto
  // this mesh; the step and optimizer state stay (checkpoint.init_from, `meshtrain evaluate`).
  CheckpointInfo load_model(const std::string& path);

  const RunConfig& config() const { return config_; }
  const Mesh& mesh() const { return *mesh_; }
  const ShardingPlan& plan() const { return *plan_; }
  Dlrm& model() { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }
  // The tables' sparse optimizer (optimizer.embeddings other than "dense"), else nullptr.
  SparseTableOptimizer* sparse_tables() { return sparse_tables_.get(); }
  int64_t steps_done() const { return steps_done_; }
  int64_t total_steps() const { return total_steps_; }
  bool finished() const { return steps_done_ >= total_steps_; }
  const std::optional<CheckpointInfo>& resumed_from() const { return resumed_from_; }
  const std::optional<CheckpointInfo>& initialized_from() const { return initialized_from_; }
  const DataShape& test_shape() const { return test_source_->shape(); }
  const std::string& test_path() const { return test_file_; }
  // Lines describing the run: the mesh, batch and steps, then one per layer.
  std::vector<std::string> describe() const;

 private:
  void plan_run();
  void open_data();
  void build_model();
  void resume();
  // Reads `count` global rows of `source` / `reader` into this rank's buffers; rows [count,
  // slice rows) are padding (zeros, empty bags).
  void read_rows(RowSource& source, SparseHdf5Reader& reader, const int64_t* rows, int64_t count);
  // The training batch of step steps_done_ + 1 into the batch buffers: read in the step, or
  // taken from the read-ahead (its thread started by the first call). Collective.
  void read_training_batch();
  // The batch buffers' device views from the host mirrors (count valid rows, the rest padding).
  void copy_batch_to_device();
  void log_step(double loss);
  void report(const std::optional<std::string>& path);
  // The step's work inside its trace span (step() opens and closes the trace window).
  double traced_step();
  // [runtime] trace_steps: start recording before step trace_first; after trace_last each rank
  // writes <output_dir>/trace/rank-<k>.json and rank 0 merges them (all-ranks.json) with the
  // run's config.toml (or at the end of train(), for a run that ends inside the window).
  // Collective.
  void begin_trace();
  void end_trace();

  RunConfig config_;
  DlrmRunEvents events_;
  bool predicting_ = false;  // DlrmRunPurpose::predict
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  std::optional<Mesh> mesh_;
  std::optional<ShardingPlan> plan_;
  std::vector<std::string> batch_axes_;
  std::unique_ptr<MeshCommunicators> comms_;
  std::optional<ParallelContext> context_;

  std::string train_file_, test_file_;
  std::unique_ptr<RowSource> train_source_, test_source_;
  std::unique_ptr<SparseHdf5Reader> train_sparse_, test_sparse_;
  std::optional<BatchSchedule> schedule_;
  BatchSlice slice_;
  EvalSchedule eval_schedule_;
  int64_t total_steps_ = 0;
  int64_t steps_done_ = 0;
  int64_t max_ids_ = 0;  // per table and rank of a batch (the model's and the readers' capacity)

  std::unique_ptr<Dlrm> model_;
  std::unique_ptr<Loss> loss_;
  std::unique_ptr<EvalMetrics> eval_metrics_;
  std::unique_ptr<Optimizer> optimizer_;
  // Sparse table updates: the tables' optimizer, and what optimizer_ updates then (the linear
  // layers' parameters and gradients; with dense tables, every parameter).
  std::unique_ptr<SparseTableOptimizer> sparse_tables_;
  std::vector<ShardedTensor> optimized_params_, optimized_grads_;
  std::unique_ptr<GradientClipper> clipper_;
  Communicator* world_ = nullptr;
  LrSchedule lr_schedule_;
  float lr_ = 0.0f;

  // The batch buffers: device views and the host mirrors the rows are read into.
  DlrmBatch batch_;
  std::vector<int64_t> rows_;  // [slice rows]: the global rows of the batch
  Matrix::HostMirror dense_mirror_, targets_mirror_;
  std::vector<Kokkos::View<int64_t*>::HostMirror> offsets_mirror_, values_mirror_;

  CheckpointContents checkpoint_;
  std::unique_ptr<Checkpointer> checkpointer_;
  int64_t in_flight_step_ = 0;
  std::optional<CheckpointInfo> resumed_from_, initialized_from_;

  bool tracing_ = false;
  int64_t trace_clock_offset_ns_ = 0, trace_origin_ns_ = 0;

  std::unique_ptr<MetricsLog> metrics_;
  ProgressWindow window_;
  double window_loss_ = 0.0;
  int64_t window_steps_ = 0;

  // The training batches read ahead (data.prefetch > 0); declared last: it reads the sources,
  // the schedule and the slice above, so it stops before they go.
  struct ReadAhead;
  std::unique_ptr<ReadAhead> read_ahead_;
};

}  // namespace meshtrain
