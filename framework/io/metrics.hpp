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
};

struct EvalEvent {
  int64_t step = 0;
  double test_loss = 0.0;
  double test_accuracy = 0.0;  // NaN for regression (not written)
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
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& json);
  std::FILE* file_ = nullptr;
  std::string path_;
};

// "step    100/4680  epoch   0  loss 0.53138  lr 1.000e-03     7714.8 samples/s  0.012 TFLOP/s
//  (MFU 3.1%)  data wait 0.0 ms  ETA 1m02s" (no MFU when the peak is unknown; the data wait
//  is per step)
std::string format_log_line(const LogEvent& event);
// "eval at step 100: test loss 0.41234  test accuracy 0.8512" (no accuracy for regression)
std::string format_eval_line(const EvalEvent& event);

// "1h02m", "3m05s", "12s"
std::string format_duration(double seconds);

}  // namespace meshtrain
