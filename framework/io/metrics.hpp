#pragma once
// What a run reports: the progress line on rank 0 and OUTPUT_DIR/metrics.jsonl, one JSON
// object per log or eval event (DESIGN.md section 10). Only rank 0 owns a MetricsLog
// that writes; on other ranks every call is a no-op, so the training loop needs no ifs.

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

  // Each writes the progress line on stdout and one JSON line, flushed; a failed write
  // throws a runtime Error naming the file and the system's reason.
  void log(const LogEvent& event);
  void eval(const EvalEvent& event);
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& json);
  std::FILE* file_ = nullptr;
  std::string path_;
};

// "1h02m", "3m05s", "12s"
std::string format_duration(double seconds);

}  // namespace meshtrain
