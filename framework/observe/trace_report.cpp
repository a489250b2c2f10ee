#include "framework/observe/trace_report.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <ostream>
#include <sstream>
#include <tuple>

#include "base/error.hpp"

namespace meshtrain {

namespace {

// What a rank's file says of the window it belongs to (write_chrome_trace's otherData);
// -1 where an older file does not say.
struct TraceWindow {
  int64_t ranks = -1;
  int64_t origin_ns = -1;
  bool has_origin = false;
};

RankTrace read_rank(const std::string& path, int rank, TraceWindow* window = nullptr) {
  std::ifstream in(path);
  if (!in) MESHTRAIN_BAD_INPUT("cannot read the trace '", path, "'");
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    MESHTRAIN_BAD_INPUT("the trace '", path, "' is not JSON: ", e.what());
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array()) {
    MESHTRAIN_BAD_INPUT("the trace '", path, "' has no traceEvents array");
  }
  if (window != nullptr && doc.contains("otherData") && doc["otherData"].is_object()) {
    const auto& meta = doc["otherData"];
    if (meta.contains("ranks") && meta["ranks"].is_number_integer()) {
      window->ranks = meta["ranks"].get<int64_t>();
    }
    if (meta.contains("origin_ns") && meta["origin_ns"].is_number_integer()) {
      window->origin_ns = meta["origin_ns"].get<int64_t>();
      window->has_origin = true;
    }
  }
  RankTrace trace;
  trace.rank = rank;
  try {
    for (const auto& e : doc["traceEvents"]) {
      if (e.at("ph") != "X") continue;
      TracedSpan span;
      span.name = e.at("name").get<std::string>();
      span.category = e.value("cat", "");
      span.start = e.at("ts").get<double>() * 1e-6;
      span.duration = e.at("dur").get<double>() * 1e-6;
      if (e.contains("args")) {
        const auto& args = e["args"];
        // A span of the device track: "device gemm", "device layer", ...
        if (span.category == "device") span.category += " " + args.value("kind", "");
        span.step = args.value("step", int64_t{0});
        span.operation = args.value("operation", int64_t{0});
        if (span.category == "gemm" || span.category == "device gemm") {
          span.flops = 2.0 * args.value("m", 0.0) * args.value("n", 0.0) * args.value("k", 0.0);
        }
      }
      trace.spans.push_back(std::move(span));
    }
  } catch (const nlohmann::json::exception& e) {
    MESHTRAIN_BAD_INPUT("the trace '", path, "' has an event without ", e.what());
  }
  return trace;
}

bool within(const TracedSpan& inner, const TracedSpan& outer) {
  constexpr double kSlack = 1e-9;  // the files' nanosecond rounding
  return inner.start >= outer.start - kSlack && inner.end() <= outer.end() + kSlack;
}

// The first word of a cost item's `what` ("all-gather weight" -> "all-gather").
std::string first_word(const std::string& text) {
  return text.substr(0, text.find(' '));
}

// Where a span ran: the innermost layer holding it, else the innermost phase, else "step";
// among the spans of categories `track` + "layer" and `track` + "phase" ("" the host's,
// "device " the device's).
std::string where_of(const TracedSpan& span, const std::vector<const TracedSpan*>& in_step,
                     const std::string& track = "") {
  const TracedSpan* layer = nullptr;
  const TracedSpan* phase = nullptr;
  for (const TracedSpan* t : in_step) {
    if (t == &span || !within(span, *t)) continue;
    if (t->category == track + "layer" && (!layer || within(*t, *layer))) layer = t;
    if (t->category == track + "phase" && (!phase || within(*t, *phase))) phase = t;
  }
  return layer ? layer->name : phase ? phase->name : "step";
}

// The spans of `trace` inside its spans of category `step_category` (not those themselves).
std::vector<const TracedSpan*> spans_in_steps(const RankTrace& trace,
                                              const std::string& step_category) {
  std::vector<const TracedSpan*> steps, inside;
  for (const TracedSpan& s : trace.spans) {
    if (s.category == step_category) steps.push_back(&s);
  }
  for (const TracedSpan& s : trace.spans) {
    if (s.category == step_category) continue;
    if (std::any_of(steps.begin(), steps.end(),
                    [&](const TracedSpan* t) { return within(s, *t); })) {
      inside.push_back(&s);
    }
  }
  return inside;
}

}  // namespace

std::vector<RankTrace> read_trace_dir(const std::string& trace_dir) {
  const auto path_of = [&](int64_t rank) {
    return trace_dir + "/rank-" + std::to_string(rank) + ".json";
  };
  if (!std::filesystem::exists(path_of(0))) {
    MESHTRAIN_BAD_INPUT("'", trace_dir, "' holds no rank-0.json: trace a run with [runtime] ",
                        "trace_steps = [FIRST, LAST]");
  }
  std::vector<RankTrace> ranks;
  TraceWindow first;
  ranks.push_back(read_rank(path_of(0), 0, &first));
  if (first.ranks < 1) {
    // A file of an older meshtrain, which did not say: as many files as there are from 0 on.
    for (int rank = 1; std::filesystem::exists(path_of(rank)); ++rank) {
      ranks.push_back(read_rank(path_of(rank), rank));
    }
    return ranks;
  }
  // As many ranks as rank 0's file says were traced: a rank-<k>.json beyond them is an
  // earlier run's, of more ranks, and one of another window (its origin) is not this one's.
  for (int rank = 1; rank < first.ranks; ++rank) {
    const std::string path = path_of(rank);
    if (!std::filesystem::exists(path)) {
      MESHTRAIN_BAD_INPUT("'", trace_dir, "' lacks ", "rank-", rank, ".json: rank-0.json is of a ",
                          "trace of ", first.ranks, " ranks");
    }
    TraceWindow window;
    ranks.push_back(read_rank(path, rank, &window));
    if (window.ranks != first.ranks || window.has_origin != first.has_origin ||
        window.origin_ns != first.origin_ns) {
      MESHTRAIN_BAD_INPUT("the trace '", path, "' is not of the run that wrote rank-0.json (",
                          "its ranks or its window's origin differ): trace the run again");
    }
  }
  return ranks;
}

TraceReport summarize_trace(const std::vector<RankTrace>& ranks, const StepCost* predicted) {
  TraceReport report;
  report.ranks = static_cast<int>(ranks.size());
  // (where, kind) -> per rank, per step: seconds taken and exposed, and count
  struct Figures {
    double took = 0.0, exposed = 0.0, count = 0.0;
  };
  std::map<std::pair<std::string, std::string>, std::vector<Figures>> kinds;
  struct GemmFigures {
    double seconds = 0.0, flops = 0.0, count = 0.0;
  };
  std::map<std::string, std::vector<GemmFigures>> gemms;  // where -> per rank, per step
  std::map<std::string, std::vector<double>> phases;
  double overlapped_all = 0.0, communication_all = 0.0;
  for (const RankTrace& trace : ranks) {
    std::vector<const TracedSpan*> steps;
    for (const TracedSpan& s : trace.spans) {
      if (s.category == "step") steps.push_back(&s);
    }
    const std::vector<const TracedSpan*> in_steps = spans_in_steps(trace, "step");
    const auto step_count = static_cast<int64_t>(steps.size());
    if (trace.rank == 0) report.steps = step_count;
    if (step_count == 0 || step_count != report.steps) {
      MESHTRAIN_BAD_INPUT("rank ", trace.rank, " traced ", step_count, " steps and rank 0 ",
                          report.steps, ": the trace files are not of one run");
    }
    const double per_step = 1.0 / static_cast<double>(step_count);
    StepSplit split;
    split.rank = trace.rank;
    for (const TracedSpan* s : steps) split.step += s->duration;
    // Starts and waits of the non-blocking operations, by id.
    std::map<int64_t, const TracedSpan*> starts, waits;
    double phase_time = 0.0;
    for (const TracedSpan* s : in_steps) {
      if (s->category == "phase") {
        phases[s->name].resize(ranks.size(), 0.0);
        phases[s->name][trace.rank] += s->duration * per_step;
        phase_time += s->duration;
        if (s->name == "data wait") split.data_wait += s->duration;
      }
      if (s->category == "collective" || s->category == "wait") {
        split.exposed_communication += s->duration;
        if (s->operation != 0) (s->category == "wait" ? waits : starts)[s->operation] = s;
      }
    }
    for (const auto& [id, start] : starts) {
      const auto wait = waits.find(id);
      if (wait != waits.end()) {
        split.overlapped_communication += std::max(0.0, wait->second->start - start->end());
      }
    }
    // GEMMs at the device's times where the trace has them (a GPU's host span times the
    // launch), else at the host's.
    const std::vector<const TracedSpan*> in_device_steps = spans_in_steps(trace, "device step");
    const bool device =
        std::any_of(in_device_steps.begin(), in_device_steps.end(),
                    [](const TracedSpan* s) { return s->category == "device gemm"; });
    report.gemms_on_device = device;
    const std::string track = device ? "device " : "";
    for (const TracedSpan* s : device ? in_device_steps : in_steps) {
      if (s->category != track + "gemm") continue;
      auto& row = gemms[where_of(*s, device ? in_device_steps : in_steps, track)];
      row.resize(ranks.size());
      row[trace.rank].seconds += s->duration * per_step;
      row[trace.rank].flops += s->flops * per_step;
      row[trace.rank].count += per_step;
    }
    for (const TracedSpan* s : in_steps) {
      if (s->category != "collective") continue;
      const std::string where = where_of(*s, in_steps);
      double took = s->duration, exposed = s->duration;
      if (s->operation != 0) {
        const auto wait = waits.find(s->operation);
        if (wait != waits.end()) {
          took = wait->second->end() - s->start;
          exposed += wait->second->duration;
        }
      }
      auto& row = kinds[{where, s->name}];
      row.resize(ranks.size());
      row[trace.rank].took += took * per_step;
      row[trace.rank].exposed += exposed * per_step;
      row[trace.rank].count += per_step;
    }
    split.idle = split.step - phase_time;
    split.step *= per_step;
    split.data_wait *= per_step;
    split.exposed_communication *= per_step;
    split.overlapped_communication *= per_step;
    split.idle *= per_step;
    split.compute = split.step - split.data_wait - split.exposed_communication - split.idle;
    overlapped_all += split.overlapped_communication;
    communication_all += split.overlapped_communication + split.exposed_communication;
    report.split.push_back(split);
  }
  report.overlapped_fraction = communication_all > 0 ? overlapped_all / communication_all : 0.0;

  // The cost model's seconds per (layer, collective kind) and per layer's GEMMs, for the
  // whole step.
  std::map<std::pair<std::string, std::string>, double> predicted_rows;
  std::map<std::string, double> predicted_gemms;
  if (predicted) {
    report.predicted_step = predicted->total_s;
    const auto micro_batches = static_cast<double>(predicted->accumulation_steps);
    for (const CostItem& item : predicted->items) {
      if (item.category == "collective") {
        predicted_rows[{item.layer, first_word(item.what)}] += item.seconds * micro_batches;
      }
      if (item.category == "gemm") predicted_gemms[item.layer] += item.seconds * micro_batches;
    }
  }
  for (const auto& [where, per_rank] : gemms) {
    GemmRow row;
    row.where = where;
    double flops = 0.0;
    for (const GemmFigures& f : per_rank) {
      row.measured += f.seconds / static_cast<double>(ranks.size());
      flops += f.flops / static_cast<double>(ranks.size());
      row.slowest = std::max(row.slowest, f.seconds);
      row.count_per_step = std::max(row.count_per_step, f.count);
    }
    row.flop_per_s = row.measured > 0 ? flops / row.measured : 0.0;
    const auto p = predicted_gemms.find(where);
    if (p != predicted_gemms.end()) row.predicted = p->second;
    report.gemms.push_back(row);
  }
  for (const auto& [key, per_rank] : kinds) {
    CollectiveRow row;
    row.where = key.first;
    row.kind = key.second;
    for (const Figures& f : per_rank) {
      row.measured += f.took / static_cast<double>(ranks.size());
      row.exposed += f.exposed / static_cast<double>(ranks.size());
      row.slowest = std::max(row.slowest, f.took);
      row.count_per_step = std::max(row.count_per_step, f.count);
    }
    const auto p = predicted_rows.find(key);
    if (p != predicted_rows.end()) row.predicted = p->second;
    report.collectives.push_back(row);
  }
  for (const auto& [name, per_rank] : phases) {
    PhaseRow row;
    row.phase = name;
    for (size_t r = 0; r < per_rank.size(); ++r) {
      row.mean += per_rank[r] / static_cast<double>(per_rank.size());
      if (per_rank[r] > row.slowest) {
        row.slowest = per_rank[r];
        row.slowest_rank = static_cast<int>(r);
      }
    }
    report.phases.push_back(row);
  }
  return report;
}

nlohmann::ordered_json trace_report_json(const TraceReport& report) {
  nlohmann::ordered_json doc;
  doc["ranks"] = report.ranks;
  doc["traced_steps"] = report.steps;
  doc["overlapped_fraction"] = report.overlapped_fraction;
  if (report.predicted_step >= 0) doc["predicted_step_s"] = report.predicted_step;
  doc["split"] = nlohmann::ordered_json::array();
  for (const StepSplit& s : report.split) {
    doc["split"].push_back({{"rank", s.rank},
                            {"step_s", s.step},
                            {"compute_s", s.compute},
                            {"exposed_communication_s", s.exposed_communication},
                            {"overlapped_communication_s", s.overlapped_communication},
                            {"data_wait_s", s.data_wait},
                            {"idle_s", s.idle}});
  }
  doc["collectives"] = nlohmann::ordered_json::array();
  for (const CollectiveRow& c : report.collectives) {
    nlohmann::ordered_json row = {{"where", c.where},
                                  {"kind", c.kind},
                                  {"count_per_step", c.count_per_step},
                                  {"measured_s", c.measured},
                                  {"slowest_rank_s", c.slowest},
                                  {"exposed_s", c.exposed}};
    if (c.predicted >= 0) row["predicted_s"] = c.predicted;
    doc["collectives"].push_back(std::move(row));
  }
  doc["gemm_times"] = report.gemms_on_device ? "device" : "host";
  doc["gemms"] = nlohmann::ordered_json::array();
  for (const GemmRow& g : report.gemms) {
    nlohmann::ordered_json row = {{"where", g.where},
                                  {"count_per_step", g.count_per_step},
                                  {"measured_s", g.measured},
                                  {"slowest_rank_s", g.slowest},
                                  {"flop_per_s", g.flop_per_s}};
    if (g.predicted >= 0) row["predicted_s"] = g.predicted;
    doc["gemms"].push_back(std::move(row));
  }
  doc["phases"] = nlohmann::ordered_json::array();
  for (const PhaseRow& p : report.phases) {
    doc["phases"].push_back({{"phase", p.phase},
                             {"mean_s", p.mean},
                             {"slowest_rank", p.slowest_rank},
                             {"slowest_s", p.slowest}});
  }
  return doc;
}

void print_trace_report(const TraceReport& report, std::ostream& out) {
  const auto ms = [](double s) {
    std::ostringstream text;
    text << std::fixed << std::setprecision(3) << s * 1e3;
    return text.str();
  };
  out << report.ranks << " rank(s), " << report.steps << " traced step(s); milliseconds per step\n";
  if (report.predicted_step >= 0) out << "predicted step: " << ms(report.predicted_step) << "\n";
  out << "rank        step     compute   exposed comm  overlapped comm  data wait      idle\n";
  for (const StepSplit& s : report.split) {
    out << std::setw(4) << s.rank << std::setw(12) << ms(s.step) << std::setw(12) << ms(s.compute)
        << std::setw(15) << ms(s.exposed_communication) << std::setw(17)
        << ms(s.overlapped_communication) << std::setw(11) << ms(s.data_wait) << std::setw(10)
        << ms(s.idle) << "\n";
  }
  out << "communication overlapped: " << std::setprecision(3) << report.overlapped_fraction * 100
      << "%\n";
  out << "collectives per step: where, kind, count on each rank; took (mean over ranks, the "
         "slowest rank), exposed, predicted\n";
  for (const CollectiveRow& c : report.collectives) {
    out << "  " << std::left << std::setw(22) << c.where << std::setw(16) << c.kind << std::right
        << std::setw(4) << c.count_per_step << std::setw(11) << ms(c.measured) << std::setw(11)
        << ms(c.slowest) << std::setw(11) << ms(c.exposed) << std::setw(11)
        << (c.predicted >= 0 ? ms(c.predicted) : "-") << "\n";
  }
  out << "GEMMs per step" << (report.gemms_on_device ? " (device times)" : "")
      << ": where, count on each rank; took (mean over ranks, the slowest rank), GFLOP/s, "
         "predicted\n";
  for (const GemmRow& g : report.gemms) {
    std::ostringstream rate;
    rate << std::fixed << std::setprecision(1) << g.flop_per_s * 1e-9;
    out << "  " << std::left << std::setw(38) << g.where << std::right << std::setw(4)
        << g.count_per_step << std::setw(11) << ms(g.measured) << std::setw(11) << ms(g.slowest)
        << std::setw(11) << rate.str() << std::setw(11)
        << (g.predicted >= 0 ? ms(g.predicted) : "-") << "\n";
  }
  out << "phases (mean over ranks, slowest rank)\n";
  for (const PhaseRow& p : report.phases) {
    out << "  " << std::left << std::setw(22) << p.phase << std::right << std::setw(11)
        << ms(p.mean) << std::setw(11) << ms(p.slowest) << "  rank " << p.slowest_rank << "\n";
  }
}

}  // namespace meshtrain
