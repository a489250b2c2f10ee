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
#include "framework/train/lr_schedule.hpp"
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

struct MeshCase {
  std::string preset;
  std::vector<std::pair<std::string, int>> axes;
};

std::vector<MeshCase> dp_fsdp_tp(int n) {
  return {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}};
}

void expect_near_losses(const std::vector<double>& got, const std::vector<double>& want,
                        double rtol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_NEAR(got[s], want[s], rtol * (1 + std::abs(want[s]))) << "step " << s + 1;
  }
}

// Gradient accumulation (issue 12): 4 micro-batches of 4 rows per step train like one
// batch of 16 rows: on dp, fsdp and tp meshes against the one-rank 16-row run, and, on the
// same mesh, every local parameter against the 16-row run's after 5 steps (they cross an
// epoch: 64 samples are 4 steps).
TEST(TrainingRun, GradientAccumulationTrainsLikeTheLargerBatch) {
  const int n = world_size();
  const Trace reference = run_steps(small_config({{"dp", 1}}, "dp"), MPI_COMM_SELF, 5);
  for (const MeshCase& c : dp_fsdp_tp(n)) {
    SCOPED_TRACE(c.preset);
    RunConfig large = small_config(c.axes, c.preset);
    RunConfig accumulated = large;
    if (4 % (c.preset == "tp" ? 1 : n) != 0) continue;  // np 8: 4 rows do not split
    accumulated.data.batch_size = 4;
    accumulated.train.accumulation_steps = 4;
    accumulated.data.eval_batch_size = 16;
    TrainingRun a(accumulated, {}, std::nullopt, MPI_COMM_WORLD);
    TrainingRun b(large, {}, std::nullopt, MPI_COMM_WORLD);
    // DP layers all-reduce the accumulated gradient once per step; FSDP reduce-scatters and
    // TP (no batch split here) reduce in every backward.
    for (const Linear& layer : a.model().layers()) {
      EXPECT_EQ(layer.defers_reduction(), c.preset == "dp" && n > 1) << layer.describe();
    }
    std::vector<double> losses;
    for (int s = 0; s < 5; ++s) {
      losses.push_back(a.step().loss);
      b.step();
    }
    expect_near_losses(losses, reference.losses, 1e-5);
    const EvalEvent eval = a.evaluate();
    EXPECT_NEAR(eval.test_loss, reference.eval.test_loss,
                1e-5 * (1 + std::abs(reference.eval.test_loss)));
    const std::vector<ShardedTensor>& pa = a.model().parameters();
    const std::vector<ShardedTensor>& pb = b.model().parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pa[i].local);
      auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), pb[i].local);
      ASSERT_EQ(ha.extent(0), hb.extent(0));
      for (size_t j = 0; j < ha.extent(0); ++j) {
        ASSERT_NEAR(ha(j), hb(j), 1e-5 + 1e-4 * std::abs(hb(j))) << pa[i].name << "[" << j << "]";
      }
    }
  }
}

// Evaluation batches of other sizes than training (data.eval_batch_size): any size the
// batch axes divide gives the evaluation of the training batch size (every test sample
// once), also one larger than the test split; one they do not divide is bad input naming
// the key.
TEST(TrainingRun, EvaluationBatchOfAnyDividingSize) {
  const int n = world_size();
  for (const MeshCase& c : dp_fsdp_tp(n)) {
    SCOPED_TRACE(c.preset);
    const int shards = c.preset == "tp" ? 1 : n;
    RunConfig config = small_config(c.axes, c.preset);
    const Trace base = run_steps(config, MPI_COMM_WORLD, 2);
    for (int64_t eval_batch : {int64_t{shards}, int64_t{3 * shards}, int64_t{40 * shards}}) {
      SCOPED_TRACE(eval_batch);
      config.data.eval_batch_size = eval_batch;
      const Trace trace = run_steps(config, MPI_COMM_WORLD, 2);
      EXPECT_EQ(trace.losses, base.losses);  // training is untouched
      EXPECT_NEAR(trace.eval.test_loss, base.eval.test_loss,
                  1e-6 * (1 + std::abs(base.eval.test_loss)));
    }
    if (shards > 1) {
      config.data.eval_batch_size = shards + 1;
      try {
        TrainingRun run(config, {}, std::nullopt, MPI_COMM_WORLD);
        ADD_FAILURE() << "an evaluation batch the batch axes do not divide was accepted";
      } catch (const AgreedError& e) {
        EXPECT_EQ(e.kind(), ErrorKind::bad_input);
        EXPECT_NE(
            std::string(e.what()).find("data.eval_batch_size = " + std::to_string(shards + 1)),
            std::string::npos)
            << e.what();
      }
    }
  }
}

// The log events carry the schedule's rate of their step, the model TFLOP/s per rank
// (6 x parameters x samples) and, with run.peak_tflops, the MFU against it.
TEST(TrainingRun, LogEventsCarryRateAndUtilization) {
  const int n = world_size();
  RunConfig config = small_config({{"fsdp", n}}, "fsdp");
  config.run.output_dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_training_run_lr_np" + std::to_string(n);
  config.optimizer.schedule = "cosine";
  config.optimizer.warmup_steps = 2;
  config.optimizer.min_lr = 1e-3;
  config.train.log_every = 1;
  config.run.peak_tflops = 0.5;
  std::vector<LogEvent> logged;
  RunEvents events;
  events.on_log = [&](const LogEvent& e) { logged.push_back(e); };
  TrainingRun run(config, events);
  run.train();
  ASSERT_EQ(logged.size(), 6u);
  LrSchedule schedule{LrScheduleKind::cosine, 1e-2, 1e-3, 2, 6};
  for (const LogEvent& e : logged) {
    EXPECT_EQ(e.lr, static_cast<float>(schedule.at(e.step - 1))) << "step " << e.step;
    EXPECT_GT(e.tflops_per_rank, 0.0);
    // 6 x 484 parameters x samples, over the ranks: the same window as samples/s.
    EXPECT_NEAR(e.tflops_per_rank, 6.0 * 484 * e.samples_per_s / n / 1e12,
                1e-9 * e.tflops_per_rank);
    EXPECT_DOUBLE_EQ(e.mfu_percent, 100.0 * e.tflops_per_rank / 0.5);
  }
  EXPECT_NEAR(logged[0].lr, 1e-2 / 3, 1e-9);  // warm-up: lr (s + 1) / (warmup + 1)
  EXPECT_NEAR(logged[2].lr, 1e-2, 1e-9);      // the peak after warm-up
  // parameters 8*16+16 + 16*16+16 + 16*4+4 = 484; 16 samples a step
  EXPECT_DOUBLE_EQ(run.flops_per_step(), 6.0 * 484 * 16);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
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
