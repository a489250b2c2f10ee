#include "framework/io/metrics.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.hpp"
#include "partition/planner.hpp"  // format_bytes

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
                      {"data_wait_s", e.data_wait_s},
                      {"step_s", e.step_s}};
  if (!e.cuda_graphs.empty()) j["cuda_graphs"] = e.cuda_graphs;
  if (!std::isnan(e.save_s)) j["save_s"] = e.save_s;
  if (!std::isnan(e.mfu_percent)) j["mfu_percent"] = e.mfu_percent;
  if (!std::isnan(e.loss_scale)) {
    j["loss_scale"] = e.loss_scale;
    j["skipped_steps"] = e.skipped_steps;
  }
  if (!std::isnan(e.aux_loss)) j["aux_loss"] = e.aux_loss;
  if (!std::isnan(e.derivative_loss)) j["derivative_loss"] = e.derivative_loss;
  if (e.stream_rows_received >= 0) {
    j["stream_rows_received"] = e.stream_rows_received;
    j["stream_rows_overwritten"] = e.stream_rows_overwritten;
    j["stream_buffer_rows"] = e.stream_buffer_rows;
  }
  if (e.stream_rows_held_out >= 0) j["stream_rows_held_out"] = e.stream_rows_held_out;
  if (e.stream_publishes >= 0) {
    j["stream_publishes"] = e.stream_publishes;
    j["stream_publishes_sent"] = e.stream_publishes_sent;
    j["stream_publishes_replaced"] = e.stream_publishes_replaced;
  }
  write_line(j.dump());
}

void MetricsLog::eval(const EvalEvent& e) {
  if (!file_) return;
  write_line(eval_event_json(e));
}

void MetricsLog::memory(const MemoryEvent& e) {
  if (!file_) return;
  write_line(memory_event_json(e));
}

std::string memory_event_json(const MemoryEvent& e) {
  nlohmann::ordered_json largest = nlohmann::ordered_json::array();
  for (const auto& a : e.largest) {
    largest.push_back(
        {{"label", a.label}, {"space", a.space}, {"bytes", a.bytes}, {"plan_item", a.plan_item}});
  }
  nlohmann::ordered_json j = {{"event", "memory"},
                              {"step", e.step},
                              {"when", e.when},
                              {"planned_bytes", e.planned_bytes},
                              {"planned_kokkos_bytes", e.planned_kokkos_bytes},
                              {"kokkos_peak_bytes", e.kokkos_peak_bytes},
                              {"kokkos_live_bytes", e.kokkos_live_bytes}};
  if (!e.device_peak_bytes.empty()) j["device_peak_bytes"] = e.device_peak_bytes;
  j["rss_peak_bytes"] = e.rss_peak_bytes;
  j["rss_bytes"] = e.rss_bytes;
  j["kokkos_complete"] = e.kokkos_complete;
  j["worst_rank"] = e.worst_rank;
  j["over_plan"] = e.over_plan;
  j["largest_allocations"] = largest;
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

namespace {

// "80.10 MiB (max, rank 1)"
std::string max_over_ranks(const std::vector<int64_t>& values) {
  if (values.empty()) return "?";
  const auto at = std::max_element(values.begin(), values.end());
  return format_bytes(*at) + " (max, rank " + std::to_string(at - values.begin()) + ")";
}

}  // namespace

std::string format_memory_figures(const MemoryEvent& e) {
  std::string text = "Kokkos peak " + max_over_ranks(e.kokkos_peak_bytes);
  if (e.planned_kokkos_bytes > 0 && !e.kokkos_peak_bytes.empty()) {
    const int64_t peak = *std::max_element(e.kokkos_peak_bytes.begin(), e.kokkos_peak_bytes.end());
    char share[32];
    std::snprintf(share, sizeof share, " = %.0f%%",
                  100.0 * static_cast<double>(peak) / static_cast<double>(e.planned_kokkos_bytes));
    text += share + std::string(" of the plan's ") + format_bytes(e.planned_kokkos_bytes);
  }
  if (!e.device_peak_bytes.empty()) text += ", device peak " + max_over_ranks(e.device_peak_bytes);
  text += ", RSS peak " + max_over_ranks(e.rss_peak_bytes);
  text += ", RSS " + max_over_ranks(e.rss_bytes);
  return text;
}

std::string format_memory_line(const MemoryEvent& e) {
  return "memory " + std::string(e.when == "end" ? "at the end" : "after the first step") +
         " (step " + std::to_string(e.step) + "), per rank: " + format_memory_figures(e);
}

std::string format_memory_warning(const MemoryEvent& e) {
  if (!e.over_plan) return "";
  const int64_t peak = e.kokkos_peak_bytes.at(e.worst_rank);
  char share[32];
  std::snprintf(
      share, sizeof share, "%.0f%%",
      100.0 * (static_cast<double>(peak) / static_cast<double>(e.planned_kokkos_bytes) - 1));
  std::string text = "rank " + std::to_string(e.worst_rank) + "'s Kokkos allocations peaked at " +
                     format_bytes(peak) + ", " + share + " more than the plan's " +
                     format_bytes(e.planned_kokkos_bytes) + " per rank";
  std::string unplanned;
  int listed = 0;
  for (const auto& a : e.largest) {
    if (!a.plan_item.empty() || listed == 5) continue;
    unplanned += (listed++ == 0 ? " '" : ", '") + a.label + "' " + format_bytes(a.bytes) + " (" +
                 a.space + ")";
  }
  if (listed > 0) return text + "; its largest allocations the plan does not hold:" + unplanned;
  text += "; its largest live allocations are all plan items:";
  for (size_t i = 0; i < e.largest.size() && i < 5; ++i) {
    const auto& a = e.largest[i];
    text +=
        (i == 0 ? " '" : ", '") + a.label + "' " + format_bytes(a.bytes) + " (" + a.plan_item + ")";
  }
  return text;
}

double eval_metric_value(const EvalEvent& e, const EvalMetric& metric) {
  using Kind = EvalMetric::Kind;
  const auto of_output = [&](double overall, const std::vector<double>& per_output) {
    if (metric.output < 0) return overall;
    return metric.output < static_cast<int64_t>(per_output.size())
               ? per_output[static_cast<size_t>(metric.output)]
               : std::nan("");
  };
  switch (metric.kind) {
    case Kind::loss:
      return e.test_loss;
    case Kind::accuracy:
      return e.test_accuracy;
    case Kind::top5_accuracy:
      return e.test_top5_accuracy;
    case Kind::mse:
      return of_output(e.test_mse, e.test_mse_per_output);
    case Kind::mae:
      return of_output(e.test_mae, e.test_mae_per_output);
    case Kind::r2:
      return of_output(e.test_r2, e.test_r2_per_output);
    case Kind::rel_l2:
      return of_output(e.test_rel_l2, e.test_rel_l2_per_output);
    case Kind::auc:
      return of_output(e.test_auc, e.test_auc_per_output);
    case Kind::log_loss:
      return of_output(e.test_log_loss, e.test_log_loss_per_output);
  }
  return std::nan("");
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
    j["test_rel_l2"] = e.test_rel_l2;
    j["test_rel_l2_per_output"] = e.test_rel_l2_per_output;
  }
  if (!e.test_auc_per_output.empty()) {
    j["test_auc"] = e.test_auc;  // NaN (no positive or no negative row): null
    j["test_log_loss"] = e.test_log_loss;
    j["test_auc_per_output"] = e.test_auc_per_output;
    j["test_log_loss_per_output"] = e.test_log_loss_per_output;
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
  if (!std::isnan(e.derivative_loss)) {
    std::snprintf(aux, sizeof aux, " (derivative %.5f)", e.derivative_loss);
  }
  char save[48] = "";
  if (!std::isnan(e.save_s)) std::snprintf(save, sizeof save, "  save %.1f ms", 1e3 * e.save_s);
  char stream[128] = "";
  if (e.stream_rows_received >= 0) {
    std::snprintf(stream, sizeof stream, "  stream %lld rows (%lld overwritten, %lld buffered)",
                  static_cast<long long>(e.stream_rows_received),
                  static_cast<long long>(e.stream_rows_overwritten),
                  static_cast<long long>(e.stream_buffer_rows));
    if (e.stream_rows_held_out >= 0) {
      const size_t used = std::strlen(stream);
      std::snprintf(stream + used, sizeof stream - used, ", %lld held out",
                    static_cast<long long>(e.stream_rows_held_out));
    }
    if (e.stream_publishes >= 0) {
      const size_t used = std::strlen(stream);
      std::snprintf(stream + used, sizeof stream - used, ", %lld published",
                    static_cast<long long>(e.stream_publishes));
    }
  }
  char line[500];
  std::snprintf(line, sizeof line,
                "step %6lld/%lld  epoch %3lld  loss %.5f%s  lr %.3e  %9.1f samples/s  %.4f "
                "TFLOP/s%s  data wait %.1f ms%s%s%s  ETA %s",
                static_cast<long long>(e.step), static_cast<long long>(e.total_steps),
                static_cast<long long>(e.epoch), e.loss, aux, e.lr, e.samples_per_s,
                e.tflops_per_rank, mfu, 1e3 * e.data_wait_s, save, scale, stream,
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
    append("  rel L2 %.4g", e.test_rel_l2);
  }
  if (!e.test_auc_per_output.empty()) {
    append("  AUC %.4f", e.test_auc);
    append("  log loss %.5f", e.test_log_loss);
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
