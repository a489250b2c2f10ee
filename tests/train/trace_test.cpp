// [runtime] trace_steps (framework/observe/trace.hpp, issue 28 item 1): a TrainingRun traced
// over steps 2 and 3 writes one Chrome trace event file per rank and a merged one. Checked
// here on rank 0, for dp, fsdp and tp (and fsdp with overlap): the files are JSON Perfetto
// reads (every span a complete "X" event, one track per rank, named), timestamps do not go
// back within a track, spans nest properly, each rank holds exactly the two traced steps and
// nothing outside them, every collective the plan lists appears in each traced step with the
// plan's bytes, and each started operation's flow ends at its wait. And the trace report's
// figures (meshtrain trace-report) equal the same figures computed here from the file; the
// report reads the ranks of this trace only (not an earlier run's files of more ranks); trace
// files are replaced whole (a temporary file and a rename); device marker times keep
// nanosecond steps late in a long window.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "framework/observe/device_timer.hpp"
#include "framework/observe/trace.hpp"
#include "framework/observe/trace_report.hpp"
#include "framework/train/config.hpp"
#include "framework/train/plan_report.hpp"
#include "run/training_run.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using Json = nlohmann::json;

RunConfig traced_config(std::vector<std::pair<std::string, int>> axes, const std::string& preset,
                        const std::string& dir) {
  RunConfig config = testing::synthetic_run_config("trace_test", std::move(axes), preset);
  config.run.seed = 5;
  config.run.output_dir = dir;
  config.model.sizes = {8, 16, 16, 4};  // every width divides by 4
  config.model.activation = Activation::tanh;
  config.train.steps = 4;
  config.runtime.trace_first = 2;
  config.runtime.trace_last = 3;
  return config;
}

Json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    ADD_FAILURE() << path << " is not JSON: " << e.what();
    return Json::object();
  }
}

// Plan collectives of groups of 2 or more ranks, as (kind, bytes per rank) -> count per step.
std::map<std::pair<std::string, int64_t>, int> plan_collectives(const TrainingRun& run,
                                                                const RunConfig& config) {
  const auto doc =
      plan_to_json(run.plan(), partition_rules(config), plan_options(config), config.file);
  std::map<std::pair<std::string, int64_t>, int> counts;
  for (const auto& layer : doc.at("layers")) {
    for (const auto& c : layer.at("collectives")) {
      if (c.at("ranks").get<int>() < 2) continue;
      ++counts[{c.at("kind").get<std::string>(), c.at("bytes_per_rank").get<int64_t>()}];
    }
  }
  return counts;
}

// The checks of one rank's events (its track in `events`, pid `rank`).
void check_track(const Json& events, int rank,
                 const std::map<std::pair<std::string, int64_t>, int>& plan) {
  SCOPED_TRACE("rank " + std::to_string(rank));
  std::vector<const Json*> spans, device_spans;        // the host's track (tid 0), the device's (1)
  std::map<int, std::vector<const Json*>> lane_spans;  // background threads' (2, 3, ...)
  std::map<int64_t, int> flow_starts, flow_ends;
  bool named = false;
  for (const Json& e : events) {
    if (e.at("pid").get<int>() != rank) continue;
    const std::string ph = e.at("ph").get<std::string>();
    if (ph == "M" && e.at("name") == "process_name") {
      named = e.at("args").at("name") == "rank " + std::to_string(rank);
    } else if (ph == "X") {
      const int tid = e.at("tid").get<int>();
      if (tid == 0) spans.push_back(&e);
      if (tid == 1) device_spans.push_back(&e);
      if (tid >= 2) lane_spans[tid].push_back(&e);
    } else if (ph == "s") {
      ++flow_starts[e.at("id").get<int64_t>()];
    } else if (ph == "f") {
      ++flow_ends[e.at("id").get<int64_t>()];
    }
  }
  EXPECT_TRUE(named) << "no process_name for this rank";
  ASSERT_FALSE(spans.empty());
  // Time order within each track; proper nesting (a span that starts inside another ends
  // inside it). 1 ns of slack for the microsecond rounding.
  constexpr double kSlack = 0.001;
  std::vector<const std::vector<const Json*>*> tracks = {&spans, &device_spans};
  for (const auto& [tid, lane] : lane_spans) tracks.push_back(&lane);
  for (const auto* track : tracks) {
    std::vector<double> open_ends;
    double last_start = -1e300;
    for (const Json* e : *track) {
      const double ts = e->at("ts").get<double>(), end = ts + e->at("dur").get<double>();
      EXPECT_GE(e->at("dur").get<double>(), 0.0);
      EXPECT_GE(ts, last_start) << "timestamps go back at " << e->dump();
      last_start = ts;
      while (!open_ends.empty() && ts >= open_ends.back() - kSlack) open_ends.pop_back();
      if (!open_ends.empty()) {
        EXPECT_LE(end, open_ends.back() + kSlack) << "overlaps its parent: " << e->dump();
      }
      open_ends.push_back(end);
    }
  }
  // The device track (a build that times the device: device_timer.hpp) holds every host span
  // but the waits once, by name and kind; a build without one writes none.
  if (device_timer::enabled()) {
    std::map<std::pair<std::string, std::string>, int> host_kinds, device_kinds;
    for (const Json* e : spans) {
      if (e->at("cat") != "wait") ++host_kinds[{e->at("name"), e->at("cat")}];
    }
    for (const Json* e : device_spans) {
      EXPECT_EQ(e->at("cat"), "device");
      ++device_kinds[{e->at("name"), e->at("args").at("kind")}];
    }
    EXPECT_EQ(device_kinds, host_kinds);
  } else {
    EXPECT_TRUE(device_spans.empty()) << "a device track on a build without device timing";
  }
  // Exactly steps 2 and 3, and every span inside one of them.
  std::vector<std::pair<double, double>> steps;
  std::vector<int64_t> numbers;
  for (const Json* e : spans) {
    if (e->at("cat") != "step") continue;
    numbers.push_back(e->at("args").at("step").get<int64_t>());
    const double ts = e->at("ts").get<double>();
    steps.push_back({ts, ts + e->at("dur").get<double>()});
  }
  EXPECT_EQ(numbers, (std::vector<int64_t>{2, 3}));
  for (const Json* e : spans) {
    const double ts = e->at("ts").get<double>();
    const bool inside = std::any_of(steps.begin(), steps.end(), [&](const auto& s) {
      return ts >= s.first - kSlack && ts + e->at("dur").get<double>() <= s.second + kSlack;
    });
    EXPECT_TRUE(inside) << "outside the traced steps: " << e->dump();
  }
  // Each plan collective, with the plan's bytes, in each traced step (the run also reduces
  // its loss and evaluation metrics, which the plan does not list).
  std::map<std::pair<std::string, int64_t>, int> seen;
  for (const Json* e : spans) {
    if (e->at("cat") != "collective") continue;
    ++seen[{e->at("name").get<std::string>(), e->at("args").at("bytes").get<int64_t>()}];
  }
  for (const auto& [key, count] : plan) {
    EXPECT_GE(seen[key], 2 * count) << key.first << " of " << key.second << " bytes";
  }
  // Every started operation's flow ends at its wait.
  EXPECT_EQ(flow_starts, flow_ends);
  for (const auto& [id, count] : flow_starts) EXPECT_EQ(count, 1) << "flow " << id;
}

// The trace report (framework/observe/trace_report.hpp) against the same figures computed
// here from the merged file, rank by rank: step, data wait, exposed and overlapped
// communication, idle, compute (the rest), the overlapped fraction, and each collective
// kind's count and seconds per step where the report puts it.
void check_report(const Json& events, const TraceReport& report, int ranks) {
  ASSERT_EQ(report.ranks, ranks);
  EXPECT_EQ(report.steps, 2);
  ASSERT_EQ(report.split.size(), static_cast<size_t>(ranks));
  const auto near = [](double a, double b, const char* what) {
    EXPECT_NEAR(a, b, 1e-9 + 1e-9 * std::abs(b)) << what;
  };
  double overlapped_all = 0.0, communication_all = 0.0;
  double kinds_count = 0.0, kinds_exposed = 0.0, kinds_took = 0.0;  // all ranks and steps
  double gemm_count = 0.0, gemm_seconds = 0.0, gemm_flops = 0.0;    // all ranks and steps
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    double step = 0.0, data = 0.0, exposed = 0.0, phases = 0.0, overlapped = 0.0;
    std::map<int64_t, std::pair<double, double>> flows;  // id: start's end, wait's start
    std::map<int64_t, double> flow_begin, flow_end;      // id: start's start, wait's end
    for (const Json& e : events) {
      if (e.at("pid").get<int>() != r || e.at("ph") != "X") continue;
      const double ts = e.at("ts").get<double>() * 1e-6, dur = e.at("dur").get<double>() * 1e-6;
      const std::string cat = e.at("cat").get<std::string>();
      if (cat == "step") step += dur;
      if (cat == "phase") phases += dur;
      if (cat == "phase" && e.at("name") == "data wait") data += dur;
      if (cat == "collective" || cat == "wait") exposed += dur;
      const int64_t id = e.at("args").value("operation", int64_t{0});
      if (id != 0 && cat == "collective") flows[id].first = ts + dur;
      if (id != 0 && cat == "wait") flows[id].second = ts;
      if (cat == "collective") kinds_count += 1;
      const bool device = e.at("tid").get<int>() == 1;
      if (cat == (device_timer::enabled() ? "device" : "gemm") &&
          (!device || e.at("args").at("kind") == "gemm")) {
        const Json& args = e.at("args");
        gemm_count += 1;
        gemm_seconds += dur;
        gemm_flops += 2.0 * args.at("m").get<double>() * args.at("n").get<double>() *
                      args.at("k").get<double>();
      }
      if (cat == "collective" || cat == "wait") kinds_exposed += dur;
      if (cat == "collective" && id == 0) kinds_took += dur;
      if (id != 0 && cat == "collective") flow_begin[id] = ts;
      if (id != 0 && cat == "wait") flow_end[id] = ts + dur;
    }
    for (const auto& [id, times] : flows) overlapped += std::max(0.0, times.second - times.first);
    for (const auto& [id, begin] : flow_begin) kinds_took += flow_end.at(id) - begin;
    const StepSplit& s = report.split[r];
    EXPECT_EQ(s.rank, r);
    near(s.step, step / 2, "step");
    near(s.data_wait, data / 2, "data wait");
    near(s.exposed_communication, exposed / 2, "exposed communication");
    near(s.overlapped_communication, overlapped / 2, "overlapped communication");
    near(s.idle, (step - phases) / 2, "idle");
    near(s.compute, (step - data - exposed - (step - phases)) / 2, "compute");
    EXPECT_GT(s.compute, 0.0);
    overlapped_all += overlapped;
    communication_all += overlapped + exposed;
  }
  near(report.overlapped_fraction, communication_all > 0 ? overlapped_all / communication_all : 0,
       "overlapped fraction");
  // Over every row: the counts add up to the collective spans, the exposed seconds to the
  // spans and the waits, and the seconds taken to the blocking spans plus each started
  // operation's start-to-end-of-wait.
  double count = 0.0, exposed_rows = 0.0, took_rows = 0.0;
  for (const CollectiveRow& row : report.collectives) {
    count += row.count_per_step * ranks * 2;
    exposed_rows += row.exposed * ranks * 2;
    took_rows += row.measured * ranks * 2;
  }
  EXPECT_NEAR(count, kinds_count, 1e-9);
  near(exposed_rows, kinds_exposed, "collective seconds exposed");
  near(took_rows, kinds_took, "collective seconds taken");
  // The GEMM rows: counts, seconds and floating point operations add up to the GEMM spans'.
  double gemm_count_rows = 0.0, gemm_seconds_rows = 0.0, gemm_flops_rows = 0.0;
  for (const GemmRow& row : report.gemms) {
    gemm_count_rows += row.count_per_step * ranks * 2;
    gemm_seconds_rows += row.measured * ranks * 2;
    gemm_flops_rows += row.flop_per_s * row.measured * ranks * 2;
    EXPECT_GE(row.slowest, row.measured) << row.where;
  }
  EXPECT_GT(gemm_count, 0.0) << "no GEMM traced";
  EXPECT_EQ(report.gemms_on_device, device_timer::enabled());
  EXPECT_NEAR(gemm_count_rows, gemm_count, 1e-9);
  near(gemm_seconds_rows, gemm_seconds, "GEMM seconds");
  near(gemm_flops_rows, gemm_flops, "GEMM floating point operations");
}

struct TraceCase {
  std::string preset;
  std::vector<std::pair<std::string, int>> axes;
  bool overlap = false;
};

TEST(Trace, EveryRankWritesAValidTraceOfTheTracedStepsWithThePlansCollectives) {
  const int n = world_size();
  const std::string root =
      std::filesystem::temp_directory_path().string() + "/meshtrain_trace_np" + std::to_string(n);
  const std::vector<TraceCase> cases = {{"dp", {{"dp", n}}},
                                        {"fsdp", {{"fsdp", n}}},
                                        {"tp", {{"tp", n}}},
                                        {"fsdp", {{"fsdp", n}}, true}};
  for (const TraceCase& c : cases) {
    SCOPED_TRACE(c.preset + (c.overlap ? " with overlap" : ""));
    const std::string dir = root + "/" + c.preset + (c.overlap ? "_overlap" : "");
    if (world_rank() == 0) std::filesystem::remove_all(dir);
    MPI_Barrier(MPI_COMM_WORLD);
    RunConfig config = traced_config(c.axes, c.preset, dir);
    config.runtime.overlap = c.overlap;
    TrainingRun run(config, {}, std::nullopt, MPI_COMM_WORLD);
    EXPECT_EQ(run.trace_dir(), dir + "/trace");
    for (int s = 0; s < 4; ++s) run.step();
    const auto plan = plan_collectives(run, config);
    if (n > 1 && c.preset == "fsdp") {
      EXPECT_FALSE(plan.empty()) << "fsdp moves its weights";
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() != 0) continue;
    const Json merged = read_json(dir + "/trace/all-ranks.json");
    ASSERT_TRUE(merged.contains("traceEvents") && merged.at("traceEvents").is_array());
    EXPECT_EQ(merged.at("otherData").at("dropped_events").get<int64_t>(), 0);
    std::vector<int> pids;
    for (const Json& e : merged.at("traceEvents")) pids.push_back(e.at("pid").get<int>());
    std::sort(pids.begin(), pids.end());
    pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
    std::vector<int> ranks(n);
    for (int r = 0; r < n; ++r) ranks[r] = r;
    EXPECT_EQ(pids, ranks) << "one track per rank";
    for (int r = 0; r < n; ++r) {
      check_track(merged.at("traceEvents"), r, plan);
      // The rank's own file holds its track alone, the same events.
      const Json own = read_json(dir + "/trace/rank-" + std::to_string(r) + ".json");
      size_t in_merged = 0;
      for (const Json& e : merged.at("traceEvents")) in_merged += e.at("pid").get<int>() == r;
      EXPECT_EQ(own.at("traceEvents").size(), in_merged);
    }
    check_report(merged.at("traceEvents"), summarize_trace(read_trace_dir(dir + "/trace"), nullptr),
                 n);
    if (c.overlap && n > 1) {  // fsdp's prefetch: started gathers and their waits
      bool flows = false;
      for (const Json& e : merged.at("traceEvents")) flows = flows || e.at("ph") == "s";
      EXPECT_TRUE(flows) << "no started operation with overlap on";
    }
  }
}

// The background threads that run during the window have threads of their own in the file:
// the asynchronous checkpoint's writer (its snapshot copy, which the step after the save waits
// for) and, with FSDP's prefetch on the communication thread, that thread's operations, each
// a span from its hand-over to the pass that saw it complete. Spans of category "background",
// nested properly (check_track), outside the report's figures.
TEST(Trace, BackgroundThreadsHaveThreadsOfTheirOwn) {
  const int n = world_size();
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_trace_background_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  RunConfig config = traced_config({{"fsdp", n}}, "fsdp", dir);
  config.runtime.overlap = true;
  config.runtime.comm_thread = CommThreadChoice::on;
  config.checkpoint.every_steps = 2;
  config.checkpoint.async = true;
  TrainingRun(config, {}, std::nullopt, MPI_COMM_WORLD).train();
  MPI_Barrier(MPI_COMM_WORLD);
  const Json own = read_json(dir + "/trace/rank-" + std::to_string(world_rank()) + ".json");
  std::map<int, std::string> threads;                       // tid -> name
  std::map<std::string, std::map<std::string, int>> spans;  // thread -> span name -> count
  for (const Json& e : own.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") {
      threads[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
    }
  }
  for (const Json& e : own.at("traceEvents")) {
    if (e.at("ph") != "X" || e.at("tid").get<int>() < 2) continue;
    EXPECT_EQ(e.at("cat"), "background") << e.dump();
    ++spans[threads.at(e.at("tid").get<int>())][e.at("name").get<std::string>()];
  }
  EXPECT_EQ(threads.at(0), "host");
  EXPECT_GE(spans["checkpoint writer"]["checkpoint snapshot"], 1) << "the save at step 2";
  if (n > 1) {
    EXPECT_GE(spans["communication thread"]["operation in flight"], 1)
        << "FSDP's prefetch gathers on the communication thread";
  } else {
    EXPECT_EQ(spans.count("communication thread"), 0u) << "nothing to move on one rank";
  }
  // The report reads the file as before (the background threads are not the step's).
  const TraceReport report = summarize_trace(read_trace_dir(dir + "/trace"), nullptr);
  EXPECT_EQ(report.steps, 2);
}

// A run that ends inside its window (train.steps = 4, trace_steps = [3, 9]) writes the steps
// it traced; one whose window starts after its end is told so.
TEST(Trace, ARunEndingInsideItsWindowWritesWhatItTraced) {
  const int n = world_size();
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_trace_early_end_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  RunConfig config = traced_config({{"fsdp", n}}, "fsdp", dir);
  config.runtime.trace_first = 3;
  config.runtime.trace_last = 9;
  TrainingRun(config, {}, std::nullopt, MPI_COMM_WORLD).train();
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) {
    const Json own = read_json(dir + "/trace/rank-0.json");
    std::vector<int64_t> steps;
    for (const Json& e : own.at("traceEvents")) {
      if (e.value("cat", "") == "step") steps.push_back(e.at("args").at("step").get<int64_t>());
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{3, 4}));
  }
  config.runtime.trace_first = 7;
  config.run.output_dir = dir + "_late";
  const TrainingRun late(config, {}, std::nullopt, MPI_COMM_WORLD);
  if (world_rank() == 0) {
    ASSERT_FALSE(late.warnings().empty());
    EXPECT_NE(late.warnings().back().find("traces nothing: this run ends at step 4"),
              std::string::npos)
        << late.warnings().back();
  }
}

// trace_steps in the config file: [FIRST, LAST] with 1 <= FIRST <= LAST, one sentence naming
// the key otherwise; written back by the config writer.
TEST(Trace, TraceStepsAreCheckedAndRoundTrip) {
  const std::string base = "[model]\nsizes = [4, 2]\n[runtime]\n";
  const RunConfig ok = parse_config(base + "trace_steps = [3, 5]\n", "t.toml");
  EXPECT_EQ(ok.runtime.trace_first, 3);
  EXPECT_EQ(ok.runtime.trace_last, 5);
  const RunConfig again = parse_config(config_to_toml(ok), "again.toml");
  EXPECT_EQ(again.runtime.trace_first, 3);
  EXPECT_EQ(again.runtime.trace_last, 5);
  for (const std::string bad : {"[0, 2]", "[3, 2]", "[1]", "[\"a\", 2]", "4"}) {
    SCOPED_TRACE(bad);
    testing::expect_bad_input([&] { parse_config(base + "trace_steps = " + bad + "\n", "t.toml"); },
                              {"t.toml", "[runtime] trace_steps", "[FIRST, LAST]"});
  }
}

// A traced run of fewer ranks in a folder an earlier run of more ranks traced into: the
// earlier rank files are removed when the window starts, and the report counts the ranks rank
// 0's file says were traced (a rank-<k>.json beyond them is not read; one of another window is
// refused by name).
TEST(Trace, TheReportReadsTheRanksOfThisTraceOnly) {
  const int n = world_size();
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_trace_stale_np" + std::to_string(n);
  const std::string trace = dir + "/trace";
  const auto rank_file = [&](int rank) {
    return trace + "/rank-" + std::to_string(rank) + ".json";
  };
  if (world_rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(trace);
    for (int stale = n; stale < n + 2; ++stale) std::ofstream(rank_file(stale)) << "{}";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  RunConfig config = traced_config({{"fsdp", n}}, "fsdp", dir);
  TrainingRun(config, {}, std::nullopt, MPI_COMM_WORLD).train();
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() != 0) return;
  EXPECT_FALSE(std::filesystem::exists(rank_file(n))) << "an earlier run's file is left";
  EXPECT_FALSE(std::filesystem::exists(rank_file(n + 1))) << "an earlier run's file is left";
  EXPECT_EQ(summarize_trace(read_trace_dir(trace), nullptr).ranks, n);
  // A complete trace of one more rank left beside it (as a run of more ranks left it).
  std::filesystem::copy_file(rank_file(0), rank_file(n));
  EXPECT_EQ(summarize_trace(read_trace_dir(trace), nullptr).ranks, n);
  if (n > 1) {
    Json other = read_json(rank_file(1));
    other["otherData"]["origin_ns"] = other["otherData"]["origin_ns"].get<int64_t>() + 1;
    std::ofstream(rank_file(1), std::ios::trunc) << other.dump();
    testing::expect_bad_input([&] { read_trace_dir(trace); },
                              {"rank-1.json", "is not of the run that wrote rank-0.json"});
  }
}

// The trace files are replaced whole: written to a temporary file and renamed over the old
// one, so a reader that opened the earlier file reads it to its end, and nothing is left
// beside them.
TEST(Trace, TraceFilesAreReplacedThroughARename) {
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_trace_rename_np" + std::to_string(world_size()) + "_rank" +
                          std::to_string(world_rank());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/rank-0.json", merged = dir + "/all-ranks.json";
  std::ofstream(path) << "the earlier trace\n";
  std::ofstream(merged) << "the earlier merged trace\n";
  std::ifstream earlier(path), earlier_merged(merged);  // opened before the writes

  TraceEvent step;
  step.name = "step";
  step.kind = TraceKind::step;
  step.begin_ns = 1000;
  step.end_ns = 5000;
  step.number = 1;
  write_chrome_trace({step}, {}, {}, 0, 0, 1, 0, 0, path);
  merge_chrome_traces({path}, merged);

  std::string line;
  std::getline(earlier, line);
  EXPECT_EQ(line, "the earlier trace") << "the file was rewritten in place";
  std::getline(earlier_merged, line);
  EXPECT_EQ(line, "the earlier merged trace") << "the merged file was rewritten in place";
  EXPECT_EQ(read_json(path).at("otherData").at("ranks").get<int>(), 1);
  EXPECT_EQ(read_json(merged).at("traceEvents").size(), read_json(path).at("traceEvents").size());
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name == "rank-0.json" || name == "all-ranks.json") << name << " left behind";
  }
  // A folder that does not exist: the error names the file.
  try {
    write_trace_file(dir + "/missing/config.toml", "x");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/missing/config.toml"), std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

// Device marker times (device_timer::marker_times, what resolve() makes of CUDA's elapsed
// milliseconds): 70 s into a window, markers 1.2345 us apart stay 1.2345 us apart (to the
// nanosecond's rounding). Measured from the window's start as a float of milliseconds they
// would step by 7.8 us (a float's spacing above 2^16 ms).
TEST(Trace, DeviceMarkerTimesKeepNanosecondsLateInALongWindow) {
  const int64_t reference_ns = 123456789;
  std::vector<float> elapsed_ms = {70000.0f};  // the first marker, 70 s after the reference
  constexpr int kMarkers = 1000;
  const float apart_ms = 0.0012345f;
  for (int k = 0; k < kMarkers; ++k) elapsed_ms.push_back(apart_ms);
  const std::vector<int64_t> ns = device_timer::marker_times(reference_ns, elapsed_ms);
  ASSERT_EQ(ns.size(), elapsed_ms.size());
  EXPECT_EQ(ns[0], reference_ns + int64_t{70000} * 1000000);
  const double apart_ns = static_cast<double>(apart_ms) * 1e6;
  for (int k = 1; k <= kMarkers; ++k) {
    ASSERT_NEAR(static_cast<double>(ns[k] - ns[k - 1]), apart_ns, 1.0) << "marker " << k;
  }
  EXPECT_NEAR(static_cast<double>(ns.back() - ns[0]), kMarkers * apart_ns, 1.0);
}

}  // namespace
}  // namespace meshtrain
