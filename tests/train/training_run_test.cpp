// TrainingRun through its C++ API: a config made in code (mesh, rules from a preset, model
// sizes, synthetic data) trains on dp, fsdp, tp and fsdp x tp meshes with the losses and
// the evaluation of a one-rank run of the same config (computed in the same test, each
// rank on MPI_COMM_SELF); train() emits its events and saves; a run resumed from that
// checkpoint continues exactly as an uninterrupted run.

#include "run/training_run.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "tests/test_support.hpp"

namespace meshtrain {
namespace {

RunConfig small_config(std::vector<std::pair<std::string, int>> axes, const std::string& preset) {
  RunConfig config;
  config.file = "training_run_test";
  config.run.seed = 3;
  config.mesh.axes = std::move(axes);
  config.model.sizes = {8, 16, 16, 4};  // every width divides by 4
  config.model.activation = "tanh";
  config.partition.preset = preset;
  config.partition.min_sharding_size = 0;
  config.data.source = "synthetic";
  config.data.synthetic_samples = 64;
  config.data.batch_size = 16;
  config.optimizer.kind = "adamw";
  config.optimizer.lr = 1e-2;
  config.train.steps = 6;
  config.train.log_every = 2;
  config.train.eval_every = 3;
  return config;
}

struct Trace {
  std::vector<double> losses;
  EvalEvent eval;
};

Trace run_steps(const RunConfig& config, MPI_Comm comm, int steps) {
  TrainingRun run(config, {}, std::nullopt, comm);
  Trace trace;
  for (int s = 0; s < steps; ++s) trace.losses.push_back(run.step().loss);
  trace.eval = run.evaluate();
  return trace;
}

TEST(TrainingRun, EveryMeshTrainsLikeOneRank) {
  const int n = world_size();
  const Trace reference = run_steps(small_config({{"dp", 1}}, "dp"), MPI_COMM_SELF, 5);
  struct Case {
    std::string preset;
    std::vector<std::pair<std::string, int>> axes;
  };
  std::vector<Case> cases = {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.preset);
    const Trace trace = run_steps(small_config(c.axes, c.preset), MPI_COMM_WORLD, 5);
    ASSERT_EQ(trace.losses.size(), reference.losses.size());
    for (size_t s = 0; s < trace.losses.size(); ++s) {
      EXPECT_NEAR(trace.losses[s], reference.losses[s], 1e-5 * (1 + std::abs(reference.losses[s])))
          << "step " << s + 1;
    }
    EXPECT_LT(trace.losses.back(), trace.losses.front());  // it learns
    EXPECT_NEAR(trace.eval.test_loss, reference.eval.test_loss,
                1e-5 * (1 + std::abs(reference.eval.test_loss)));
    EXPECT_TRUE(std::isnan(trace.eval.test_accuracy));  // regression
  }
}

TEST(TrainingRun, TrainEmitsEventsSavesAndResumesExactly) {
  const int n = world_size();
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_training_run_test_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");

  RunConfig config = small_config({{"fsdp", n}}, "fsdp");
  config.run.output_dir = dir;
  std::vector<int64_t> logged, evaluated, saved;
  std::string checkpoint;
  RunEvents events;
  events.on_log = [&](const LogEvent& e) { logged.push_back(e.step); };
  events.on_eval = [&](const EvalEvent& e) { evaluated.push_back(e.step); };
  events.on_checkpoint = [&](int64_t step, const std::string& path) {
    saved.push_back(step);
    checkpoint = path;
  };
  {
    TrainingRun run(config, events);
    const RunSummary summary = run.train();
    EXPECT_EQ(summary.steps_run, 6);
    ASSERT_TRUE(summary.last_eval.has_value());
    EXPECT_EQ(summary.last_eval->step, 6);
  }
  EXPECT_EQ(logged, (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(evaluated, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(saved, (std::vector<int64_t>{6}));
  EXPECT_TRUE(std::filesystem::exists(checkpoint)) << checkpoint;
  EXPECT_TRUE(std::filesystem::exists(dir + "/metrics.jsonl") || world_rank() != 0);

  // Resumed at step 6, steps 7..9 equal those of a run that was never interrupted.
  RunConfig longer = config;
  longer.train.steps = 9;
  const Trace uninterrupted = run_steps(longer, MPI_COMM_WORLD, 9);
  longer.checkpoint.resume = true;
  TrainingRun resumed(longer);
  ASSERT_TRUE(resumed.resumed_from().has_value());
  EXPECT_EQ(resumed.steps_done(), 6);
  for (int s = 6; s < 9; ++s) {
    EXPECT_EQ(resumed.step().loss, uninterrupted.losses[s]) << "step " << s + 1;
  }
  EXPECT_TRUE(resumed.finished());
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST(TrainingRun, BadInputIsAgreedAndNamesTheKey) {
  RunConfig config = small_config({{"fsdp", -1}}, "fsdp");
  config.data.batch_size = 0;
  try {
    TrainingRun run(config);
    ADD_FAILURE() << "a batch size of 0 was accepted";
  } catch (const AgreedError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    EXPECT_NE(std::string(e.what()).find("data.batch_size"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain
