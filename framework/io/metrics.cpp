#include "framework/io/metrics.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.hpp"

namespace meshtrain {

MetricsLog::MetricsLog(const std::string& output_dir, bool writer, bool append)
    : path_(output_dir + "/metrics.jsonl") {
  if (!writer) return;
  std::error_code ec;
  std::filesystem::create_directories(output_dir, ec);
  if (ec) {
    MESHTRAIN_BAD_INPUT("cannot create the output directory '", output_dir,
                        "' (run.output_dir): ", ec.message());
  }
  file_ = std::fopen(path_.c_str(), append ? "a" : "w");
  if (!file_) {
    MESHTRAIN_BAD_INPUT("cannot open '", path_, "' for writing: ", std::strerror(errno));
  }
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write_line(const std::string& json) {
  // Flushed per event so a crashed or interrupted run keeps what it logged; a full disk
  // or a lost file system is an error, not a silently missing record.
  if (std::fputs(json.c_str(), file_) == EOF || std::fputc('\n', file_) == EOF ||
      std::fflush(file_) != 0) {
    MESHTRAIN_FAIL("cannot write to '", path_, "' (run.output_dir): ", std::strerror(errno));
  }
}

void MetricsLog::log(const LogEvent& e) {
  if (!file_) return;
  nlohmann::json j = {{"event", "log"},
                      {"step", e.step},
                      {"epoch", e.epoch},
                      {"loss", e.loss},
                      {"lr", e.lr},
                      {"samples_per_s", e.samples_per_s},
                      {"tflops_per_rank", e.tflops_per_rank},
                      {"data_wait_s", e.data_wait_s}};
  if (!std::isnan(e.mfu_percent)) j["mfu_percent"] = e.mfu_percent;
  if (!std::isnan(e.loss_scale)) {
    j["loss_scale"] = e.loss_scale;
    j["skipped_steps"] = e.skipped_steps;
  }
  if (!std::isnan(e.aux_loss)) j["aux_loss"] = e.aux_loss;
  write_line(j.dump());
}

void MetricsLog::eval(const EvalEvent& e) {
  if (!file_) return;
  write_line(eval_event_json(e));
}

std::string eval_event_json(const EvalEvent& e) {
  nlohmann::json j = {
      {"event", "eval"}, {"step", e.step}, {"test_loss", e.test_loss}, {"test_rows", e.test_rows}};
  if (!std::isnan(e.test_accuracy)) j["test_accuracy"] = e.test_accuracy;
  if (!std::isnan(e.test_top5_accuracy)) j["test_top5_accuracy"] = e.test_top5_accuracy;
  if (!e.test_class_accuracy.empty()) {
    j["test_class_accuracy"] = e.test_class_accuracy;  // NaN (a class without rows): null
    j["test_class_rows"] = e.test_class_rows;
  }
  if (!e.test_mse_per_output.empty()) {
    j["test_mse"] = e.test_mse;
    j["test_mae"] = e.test_mae;
    j["test_r2"] = e.test_r2;
    j["test_mse_per_output"] = e.test_mse_per_output;
    j["test_mae_per_output"] = e.test_mae_per_output;
    j["test_r2_per_output"] = e.test_r2_per_output;
  }
  return j.dump();
}

std::string format_log_line(const LogEvent& e) {
  char mfu[32] = "";
  if (!std::isnan(e.mfu_percent)) std::snprintf(mfu, sizeof mfu, " (MFU %.1f%%)", e.mfu_percent);
  char scale[64] = "";
  if (!std::isnan(e.loss_scale)) {
    std::snprintf(scale, sizeof scale, "  loss scale %g (%lld skipped)", e.loss_scale,
                  static_cast<long long>(e.skipped_steps));
  }
  char aux[48] = "";
  if (!std::isnan(e.aux_loss)) std::snprintf(aux, sizeof aux, " (aux %.5f)", e.aux_loss);
  char line[360];
  std::snprintf(line, sizeof line,
                "step %6lld/%lld  epoch %3lld  loss %.5f%s  lr %.3e  %9.1f samples/s  %.4f "
                "TFLOP/s%s  data wait %.1f ms%s  ETA %s",
                static_cast<long long>(e.step), static_cast<long long>(e.total_steps),
                static_cast<long long>(e.epoch), e.loss, aux, e.lr, e.samples_per_s,
                e.tflops_per_rank, mfu, 1e3 * e.data_wait_s, scale,
                format_duration(e.eta_s).c_str());
  return line;
}

std::string format_eval_line(const EvalEvent& e) {
  char line[240];
  int n = std::snprintf(line, sizeof line, "eval at step %lld: test loss %.5f",
                        static_cast<long long>(e.step), e.test_loss);
  const auto append = [&](const char* format, double value) {
    if (n >= 0 && n < static_cast<int>(sizeof line)) {
      n += std::snprintf(line + n, sizeof line - n, format, value);
    }
  };
  if (!std::isnan(e.test_accuracy)) append("  test accuracy %.4f", e.test_accuracy);
  if (!std::isnan(e.test_top5_accuracy)) append("  top-5 %.4f", e.test_top5_accuracy);
  if (!e.test_mse_per_output.empty()) {
    append("  MSE %.5g", e.test_mse);
    append("  MAE %.5g", e.test_mae);
    append("  R^2 %.4f", e.test_r2);
  }
  return line;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long long s = std::llround(seconds);
  char buffer[32];
  if (s >= 3600) {
    std::snprintf(buffer, sizeof buffer, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  } else if (s >= 60) {
    std::snprintf(buffer, sizeof buffer, "%lldm%02llds", s / 60, s % 60);
  } else {
    std::snprintf(buffer, sizeof buffer, "%llds", s);
  }
  return buffer;
}

}  // namespace meshtrain
