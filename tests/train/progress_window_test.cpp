// The progress line's time (issue 36, item 16): a window's samples/s comes from its steps' time
// alone, and the time it spent saving checkpoints is reported apart (LogEvent::save_s, the
// line's "save ... ms", metrics.jsonl's "save_s") when a save was started or completed in it.
// Checked on the accounting, not on speeds: ProgressWindow on a clock the test moves, and
// train() on a clock that the test moves by 100 s inside a synchronous save (on_checkpoint),
// by 1000 s inside an evaluation (on_eval), and by 100 s while an asynchronous save's snapshot
// is copied, which the next step waits for (the checkpoint fault hook holds the writer until
// the step waits). Those seconds must land in save_s, never in the steps' time; a window
// without a save shows none. On dp, fsdp and tp at every world size.

#include <gtest/gtest.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint_testing.hpp"
#include "run/progress_window.hpp"
#include "run/training_run.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

TEST(ProgressWindow, StepsTimeLeavesOutPausesAndSavingWhichIsReportedApart) {
  double now = 10.0;
  ProgressWindow window([&] { return now; });
  window.start();
  now += 1.5;  // a step
  const double evaluating = window.now();
  now += 20.0;  // an evaluation
  window.add_paused(window.now() - evaluating);
  const double saving = window.now();
  now += 7.0;  // a save
  window.add_saving(window.now() - saving);
  window.mark_save();
  now += 2.5;  // a step
  ProgressWindow::Times t = window.times();
  EXPECT_DOUBLE_EQ(t.step_s, 4.0);
  EXPECT_DOUBLE_EQ(t.save_s, 7.0);
  EXPECT_TRUE(t.saved);
  // A new window: nothing paused or saved yet.
  window.start();
  now += 3.0;
  t = window.times();
  EXPECT_DOUBLE_EQ(t.step_s, 3.0);
  EXPECT_DOUBLE_EQ(t.save_s, 0.0);
  EXPECT_FALSE(t.saved);
  // A poll's time without a save started or completed is saving time, but not a save.
  window.add_saving(0.5);
  EXPECT_FALSE(window.times().saved);
}

// --- train() on the test's clock -------------------------------------------------------------

// Seconds the test adds to the steady clock (microseconds: written by the writer thread too).
std::atomic<int64_t> g_offset_us{0};
void advance(double seconds) {
  g_offset_us += static_cast<int64_t>(seconds * 1e6);
}
double test_clock() {
  return steady_seconds() + 1e-6 * static_cast<double>(g_offset_us.load());
}

// The asynchronous case: the writer holds the snapshot until a step waits for it, then the
// snapshot "takes" 100 s.
std::atomic<bool> g_hold_snapshot{false};
std::atomic<bool> g_step_waits{false};
void hold_snapshot(const char* point, int64_t) {
  if (!g_hold_snapshot) return;
  const std::string_view name(point);
  if (name == "snapshot_wait") g_step_waits = true;
  if (name == "before_snapshot") {
    // A step that never waits fails the test (its time has no 100 s), it does not hang it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!g_step_waits && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    advance(100.0);
  }
}

// Far above what two steps of this tiny model take, far below the seconds the test adds.
constexpr double kStepsBound = 50.0;

std::string run_dir(const std::string& name) {
  return std::filesystem::temp_directory_path().string() + "/meshtrain_progress_window_" + name +
         "_np" + std::to_string(world_size());
}

RunConfig config_for(const std::string& preset, const std::string& dir, bool async) {
  RunConfig c;
  c.file = "progress_window_test";
  c.run.seed = 2;
  c.run.output_dir = dir;
  c.checkpoint.dir = dir + "/checkpoints";
  c.checkpoint.async = async;
  c.checkpoint.every_steps = 3;
  c.mesh.axes = {{preset, world_size()}};
  c.partition.preset = preset;
  c.partition.min_sharding_size = 0;
  c.model.sizes = {8, 16, 16, 4};
  c.data.source = DataSource::synthetic;
  c.data.synthetic_samples = 64;
  c.data.batch_size = 16;
  c.train.steps = 6;
  c.train.log_every = 2;
  c.train.eval_every = 3;
  return c;
}

struct Logged {
  std::vector<LogEvent> events;         // on_log's, every rank
  std::vector<nlohmann::json> records;  // metrics.jsonl's log records (rank 0)
};

Logged train(const RunConfig& config, bool time_saves_and_evals) {
  if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  Logged logged;
  RunEvents events;
  events.on_log = [&](const LogEvent& e) { logged.events.push_back(e); };
  if (time_saves_and_evals) {
    events.on_checkpoint = [](int64_t, const std::string&) { advance(100.0); };
    events.on_eval = [](const EvalEvent&) { advance(1000.0); };
  }
  {
    TrainingRun run(config, events);
    run.set_clock(test_clock);
    run.train();
  }
  if (world_rank() == 0) {
    std::ifstream in(config.run.output_dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto record = nlohmann::json::parse(line);
      if (record["event"] == "log") logged.records.push_back(record);
    }
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
  return logged;
}

// Windows: steps 1-2 (nothing saved), 3-4 (the step-3 save started after step 3's evaluation),
// 5-6 (logged before step 6's evaluation and save). Every window's samples/s is its rows over
// its steps' time.
void expect_windows(const Logged& logged, const RunConfig& config) {
  ASSERT_EQ(logged.events.size(), 3u);
  for (const LogEvent& e : logged.events) {
    SCOPED_TRACE("step " + std::to_string(e.step));
    EXPECT_LT(2 * e.step_s, kStepsBound) << "saving or evaluation counted as the steps' time";
    EXPECT_GT(e.step_s, 0.0);
    EXPECT_NEAR(e.samples_per_s * e.step_s, static_cast<double>(config.data.batch_size),
                1e-9 * config.data.batch_size);
  }
  EXPECT_TRUE(std::isnan(logged.events[0].save_s)) << logged.events[0].save_s;
  EXPECT_GE(logged.events[1].save_s, 100.0);
  EXPECT_LT(logged.events[1].save_s, 100.0 + kStepsBound) << "the evaluation counted as saving";
  EXPECT_NE(format_log_line(logged.events[1]).find("  save 1"), std::string::npos)
      << format_log_line(logged.events[1]);
  EXPECT_EQ(format_log_line(logged.events[0]).find("save"), std::string::npos)
      << format_log_line(logged.events[0]);
  if (world_rank() == 0) {
    ASSERT_EQ(logged.records.size(), 3u);
    EXPECT_FALSE(logged.records[0].contains("save_s"));
    ASSERT_TRUE(logged.records[1].contains("save_s"));
    EXPECT_EQ(logged.records[1]["save_s"].get<double>(), logged.events[1].save_s);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(logged.records[i]["step_s"].get<double>(), logged.events[i].step_s);
    }
  }
}

std::vector<std::string> presets() {
  return {"dp", "fsdp", "tp"};
}

TEST(ProgressWindow, ASynchronousSaveAndAnEvaluationAreNotTheStepsTime) {
  for (const std::string& preset : presets()) {
    SCOPED_TRACE(preset);
    const RunConfig config = config_for(preset, run_dir("sync_" + preset), /*async=*/false);
    expect_windows(train(config, /*time_saves_and_evals=*/true), config);
  }
}

// The step after an asynchronous save waits for its snapshot (wait_snapshot, before the
// optimizer changes the tensors): saving time, not the step's.
TEST(ProgressWindow, TheWaitForAnAsynchronousSnapshotIsNotTheStepsTime) {
  set_checkpoint_fault_hook(hold_snapshot);
  for (const std::string& preset : presets()) {
    SCOPED_TRACE(preset);
    g_step_waits = false;
    g_hold_snapshot = true;
    RunConfig config = config_for(preset, run_dir("async_" + preset), /*async=*/true);
    config.train.eval_every = 0;  // evaluation at the end only
    const Logged logged = train(config, /*time_saves_and_evals=*/false);
    g_hold_snapshot = false;
    EXPECT_TRUE(g_step_waits.load()) << "no step waited for the snapshot";
    expect_windows(logged, config);
  }
  set_checkpoint_fault_hook(nullptr);
}

}  // namespace
}  // namespace meshtrain
