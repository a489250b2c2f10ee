#pragma once
// What a run reports: OUTPUT_DIR/metrics.jsonl, one JSON object per log or eval event
// (the schema is in docs/running.md, "What the output means"), and the same events as the
// progress lines a program prints. Only rank 0 owns a MetricsLog that writes; on other
// ranks every call is a no-op, so the training loop needs no ifs.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "framework/core/choices.hpp"  // EvalMetric

namespace meshtrain {

struct LogEvent {
  int64_t step = 0;  // steps completed
  int64_t total_steps = 0;
  int64_t epoch = 0;  // 0-based epoch of the last step
  double loss = 0.0;  // mean training loss since the last log
  double samples_per_s = 0.0;
  double eta_s = 0.0;
  double lr = 0.0;  // the learning rate of the last step
  // Achieved model TFLOP/s of one rank (the run's model FLOPs / ranks / seconds), and its
  // percentage of run.peak_tflops (MFU); NaN (not written) when the peak is unknown.
  double tflops_per_rank = 0.0;
  double mfu_percent = std::nan("");
  // Mean seconds a step of the window waited for its batch to be read, on the rank that
  // waited longest (0 when every reader thread kept ahead).
  double data_wait_s = 0.0;
  // fp16 loss scaling: the scale after the last step and the steps skipped so far for a
  // non-finite gradient; NaN and 0 (neither written) without loss scaling.
  double loss_scale = std::nan("");
  int64_t skipped_steps = 0;
  // MoE models: the mean load-balancing loss (times its coefficient; part of `loss`) since
  // the last log; NaN (not written) without MoE layers.
  double aux_loss = std::nan("");
  // Sobolev training (data.dy_key): the mean derivative term (times model.derivative_loss_weight;
  // part of `loss`) since the last log; NaN (not written) without it.
  double derivative_loss = std::nan("");
  // Mean seconds of a step of the window: the window's time less evaluation and saving (what
  // samples_per_s, tflops_per_rank and the ETA are computed from).
  double step_s = 0.0;
  // [runtime] cuda_graphs as the run chose it: "on" (the step replays its captured work) or
  // "off" (TrainingRun::cuda_graphs_note says why); empty (not written) when not said.
  std::string cuda_graphs;
  // Seconds of the window spent saving checkpoints (starting and completing saves, a step's
  // wait for an asynchronous save's snapshot); NaN (not written, not shown) when no save was
  // started or completed in the window.
  double save_s = std::nan("");
  // data.source = "stream" (docs/online.md), summed over the batch groups; -1 (not written)
  // otherwise.
  int64_t stream_rows_received = -1;
  int64_t stream_rows_overwritten = -1;
  int64_t stream_buffer_rows = -1;
  // stream.publish_every > 0: publishes made, sent toward the producers, and replaced by a
  // newer one before they could be sent (trainer rank 0's counts); -1 (not written) otherwise.
  int64_t stream_rows_held_out = -1;  // stream.test_fraction > 0; -1 (not written) otherwise
  int64_t stream_publishes = -1;
  int64_t stream_publishes_sent = -1;
  int64_t stream_publishes_replaced = -1;
};

// One evaluation over the test split (or `meshtrain evaluate`'s data). The metrics are
// made in one place, layers/eval_metrics.hpp; fields that do not apply are NaN or empty and
// are not written. Regression metrics are in the user's units (targets de-normalized); the
// loss is in the units the model was trained in.
struct EvalEvent {
  int64_t step = 0;
  double test_loss = 0.0;      // the training loss's reduction: mean over the rows
  double test_accuracy = 0.0;  // classification: argmax == label; NaN for regression
  int64_t test_rows = 0;       // rows evaluated
  // Classification: the label among the 5 largest logits (ties: lower class first), only
  // with more than 5 classes; and per true class c, hits / rows of class c (NaN when the
  // data has no row of class c) with those rows.
  double test_top5_accuracy = std::nan("");
  std::vector<double> test_class_accuracy;
  std::vector<int64_t> test_class_rows;
  // Regression, per output j: mean squared and mean absolute error, and R^2 = 1 - SSE/SST
  // (SST about the mean of the evaluated targets; NaN for a constant target); overall: MSE
  // and MAE over every output and row, R^2 the mean of the outputs' (scikit-learn's
  // uniform average). Relative L2 error per output: ||y_j - t_j||_2 / ||t_j||_2 over the
  // evaluated rows (NaN when every t_j is 0); overall: sqrt(sum of (y - t)^2 / sum of t^2)
  // over every output and row.
  double test_mse = std::nan("");
  double test_mae = std::nan("");
  double test_r2 = std::nan("");
  double test_rel_l2 = std::nan("");
  std::vector<double> test_mse_per_output;
  std::vector<double> test_mae_per_output;
  std::vector<double> test_r2_per_output;
  std::vector<double> test_rel_l2_per_output;
  // binary_cross_entropy, per output j and overall (layers/eval_metrics.hpp): the area under
  // the ROC curve (overall: the mean of the outputs'), the log loss (overall: over every
  // output and row); NaN otherwise. test_accuracy is then the logit's side against t >= 0.5.
  double test_auc = std::nan("");
  double test_log_loss = std::nan("");
  std::vector<double> test_auc_per_output;
  std::vector<double> test_log_loss_per_output;
};

// Memory of every rank against the plan (docs/running.md, "Memory against the plan"), measured
// after the first step of a run and at its end. Bytes; one entry per rank in the vectors.
struct MemoryEvent {
  int64_t step = 0;
  std::string when;  // "first_step" or "end"
  // The plan's bytes per rank: its total, and the part that lives in Kokkos allocations
  // (parameters, gradients, optimizer state, buffers, checkpoint and data staging).
  int64_t planned_bytes = 0;
  int64_t planned_kokkos_bytes = 0;
  // Kokkos allocations (every memory space) since the run was built: high-water mark and now;
  // the device's (CudaSpace) high-water mark on a CUDA build, empty otherwise.
  std::vector<int64_t> kokkos_peak_bytes;
  std::vector<int64_t> kokkos_live_bytes;
  std::vector<int64_t> device_peak_bytes;
  // The process's resident set: peak (VmHWM) and now (VmRSS); the MPI library, BLAS and the
  // binary included, so not compared with the plan.
  std::vector<int64_t> rss_peak_bytes;
  std::vector<int64_t> rss_bytes;
  // Whether every Kokkos allocation of the rank was counted (memory_tracker.hpp).
  std::vector<bool> kokkos_complete;
  // The rank whose Kokkos peak is furthest above the plan's Kokkos bytes, and its largest live
  // allocations with the plan item each belongs to ("" when the plan has none for it).
  int worst_rank = 0;
  struct Allocation {
    std::string label, space, plan_item;
    int64_t bytes = 0;
  };
  std::vector<Allocation> largest;
  // The worst rank's Kokkos peak is more than 25% and more than 16 MiB above the plan's Kokkos
  // bytes (TrainingRun::kOverPlanFraction, kOverPlanMinBytes).
  bool over_plan = false;
};

class MetricsLog {
 public:
  // Creates output_dir (and parents) and opens metrics.jsonl when `writer` is true:
  // truncated for a new run, appended to when `append` (a resumed run).
  MetricsLog(const std::string& output_dir, bool writer, bool append = false);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Each writes one JSON line, flushed; a failed write throws a runtime Error naming the
  // file and the system's reason.
  void log(const LogEvent& event);
  void eval(const EvalEvent& event);
  void memory(const MemoryEvent& event);
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& json);
  std::FILE* file_ = nullptr;
  std::string path_;
};

// "step    100/4680  epoch   0  loss 0.53138  lr 1.000e-03     7714.8 samples/s  0.012 TFLOP/s
//  (MFU 3.1%)  data wait 0.0 ms  save 412.0 ms  ETA 1m02s" (no MFU when the peak is unknown;
//  the data wait is per step; the save, the window's saving time, only when a save was started
//  or completed in it)
std::string format_log_line(const LogEvent& event);
// The one-line JSON object of an eval event, as metrics.jsonl and `meshtrain evaluate --json`
// write it: "event": "eval", step, test_loss, test_rows, and the metrics that apply (per
// class and per output as arrays; a NaN inside an array is null). Doubles are written so
// that they read back to the same bits.
std::string eval_event_json(const EvalEvent& event);
// "eval at step 100: test loss 0.41234  test accuracy 0.8512  top-5 0.9934"; regression:
// "eval at step 100: test loss 0.04370  MSE 1.2345  MAE 0.8765  R^2 0.9561  rel L2 0.1234"
// (MSE, MAE and the relative L2 error over all outputs in the user's units, R^2 the outputs'
// mean)
std::string format_eval_line(const EvalEvent& event);

// The value of `metric` in `e` (checkpoint.keep_best, train.early_stopping); NaN where the
// evaluation does not have it (a regression metric of a classifier, an output it lacks).
double eval_metric_value(const EvalEvent& e, const EvalMetric& metric);

// {"event": "memory", "step", "when", "planned_bytes", "planned_kokkos_bytes",
// "kokkos_peak_bytes": [per rank], "kokkos_live_bytes", ("device_peak_bytes" on CUDA),
// "rss_peak_bytes", "rss_bytes", "kokkos_complete", "worst_rank", "over_plan",
// "largest_allocations": [{"label", "space", "bytes", "plan_item"}] (the worst rank's)}
std::string memory_event_json(const MemoryEvent& event);
// "Kokkos peak 80.10 MiB (max, rank 1) = 105% of the plan's 76.30 MiB, RSS peak 250.30 MiB
// (max, rank 0), RSS 240.10 MiB (max, rank 0)" (and the device's peak on CUDA; bytes as
// format_bytes writes them): the part of the memory and done lines that measures.
std::string format_memory_figures(const MemoryEvent& event);
// "memory after step 1: " + format_memory_figures(event)
std::string format_memory_line(const MemoryEvent& event);
// When event.over_plan: "rank 1's Kokkos allocations peaked at 120.00 MiB, 58% more than the
// plan's 76.00 MiB per rank; its largest allocations the plan does not hold: 'x' 40.00 MiB
// (Host), ..." (up to 5; or, when every one of event.largest is a plan item, those); else "".
std::string format_memory_warning(const MemoryEvent& event);
// "1h02m", "3m05s", "12s"
std::string format_duration(double seconds);

}  // namespace meshtrain
