// TrainingRun through its C++ API: a config made in code (mesh, rules from a preset, model
// sizes, synthetic data) trains on dp, fsdp, tp and fsdp x tp meshes with the losses and
// the evaluation of a one-rank run of the same config (computed in the same test, each
// rank on MPI_COMM_SELF); train() emits its events and saves; a run resumed from that
// checkpoint continues exactly as an uninterrupted run. Mixed precision: bf16/bf16,
// fp16/fp16 and bf16/fp32 runs on every mesh stay within 16 unit roundoffs of their one-rank
// run and learn; an fp16 overflow (the loss scale forced to 2^40) skips the step on every
// rank alike, and the run skips as many steps and ends at the same scale as on one rank;
// so does a forward pass that overflows fp16, while inputs beyond fp16's range, or overflows
// that no scale fixes, end the run naming mixed_precision.param_dtype; fp32/fp32 written out
// is the default run bit for bit. The evaluations' regression metrics (MSE, MAE, R^2 per
// output) agree with the one-rank run's on every mesh, MoE included.

#include "run/training_run.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/train/lr_schedule.hpp"
#include "framework/train/plan_report.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// Where the tests write runs and checkpoints: the temp directory, or a folder of its own for
// a ctest variant (MESHTRAIN_TEST_REDUCTIONS), which may run beside the plain registration.
std::string temp_dir() {
  std::string dir = std::filesystem::temp_directory_path().string();
  const char* variant = std::getenv("MESHTRAIN_TEST_REDUCTIONS");
  if (variant && *variant) {
    dir += std::string("/meshtrain_reductions_") + variant;
    std::error_code ignored;  // made by several ranks at once: one wins, the others find it
    std::filesystem::create_directories(dir, ignored);
  }
  return dir;
}

RunConfig small_config(std::vector<std::pair<std::string, int>> axes, const std::string& preset) {
  RunConfig config = testing::synthetic_run_config("training_run_test", std::move(axes), preset);
  config.runtime.backend = testing::test_backend_choice();  // mpi unless the registration says
  config.runtime.reductions = testing::test_reductions(config.runtime.reductions);
  config.run.seed = 3;
  config.model.sizes = {8, 16, 16, 4};  // every width divides by 4
  config.model.activation = Activation::tanh;
  config.optimizer.lr = 1e-2;
  config.train.steps = 6;
  config.train.log_every = 2;
  config.train.eval_every = 3;
  return config;
}

struct Trace {
  std::vector<double> losses;
  EvalEvent eval;
  std::string reductions;  // describe()'s last line: each group's reduction algorithm
};

Trace run_steps(const RunConfig& config, MPI_Comm comm, int steps) {
  TrainingRun run(config, {}, std::nullopt, comm);
  Trace trace;
  for (int s = 0; s < steps; ++s) trace.losses.push_back(run.step().loss);
  trace.eval = run.evaluate();
  trace.reductions = run.describe().back();
  return trace;
}

// The regression metrics of an evaluation (layers/eval_metrics.hpp) against a one-rank run's,
// to 1e-5 relative: per output and overall, and the rows counted.
void expect_regression_metrics_like(const EvalEvent& eval, const EvalEvent& reference) {
  EXPECT_EQ(eval.test_rows, reference.test_rows);
  ASSERT_EQ(eval.test_mse_per_output.size(), reference.test_mse_per_output.size());
  ASSERT_FALSE(reference.test_mse_per_output.empty());
  const auto near = [](double a, double b, const char* what) {
    EXPECT_NEAR(a, b, 1e-5 * (1 + std::abs(b))) << what;
  };
  for (size_t j = 0; j < reference.test_mse_per_output.size(); ++j) {
    near(eval.test_mse_per_output[j], reference.test_mse_per_output[j], "test_mse_per_output");
    near(eval.test_mae_per_output[j], reference.test_mae_per_output[j], "test_mae_per_output");
    near(eval.test_r2_per_output[j], reference.test_r2_per_output[j], "test_r2_per_output");
  }
  near(eval.test_mse, reference.test_mse, "test_mse");
  near(eval.test_mae, reference.test_mae, "test_mae");
  near(eval.test_r2, reference.test_r2, "test_r2");
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
  // sp splits the rows (an MLP's tokens) like a batch axis; here beside tp and fsdp.
  cases.push_back({"dp", {{"sp", n}}});
  if (n % 2 == 0) cases.push_back({"tp", {{"tp", 2}, {"sp", n / 2}}});
  if (n % 4 == 0) cases.push_back({"fsdp", {{"fsdp", 2}, {"sp", n / 2}}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.preset + " on " + std::to_string(c.axes.size()) + " axes");
    const RunConfig config = small_config(c.axes, c.preset);
    const Trace trace = run_steps(config, MPI_COMM_WORLD, 5);
    if (config.runtime.reductions == ReductionAlgorithm::ring && n > 1) {
      // The ring variant (MESHTRAIN_TEST_REDUCTIONS=ring) does reduce on the ring.
      EXPECT_EQ(trace.reductions.rfind("  reductions (ring): ", 0), 0u) << trace.reductions;
      EXPECT_EQ(trace.reductions.find("library"), std::string::npos) << trace.reductions;
    }
    ASSERT_EQ(trace.losses.size(), reference.losses.size());
    for (size_t s = 0; s < trace.losses.size(); ++s) {
      EXPECT_NEAR(trace.losses[s], reference.losses[s], 1e-5 * (1 + std::abs(reference.losses[s])))
          << "step " << s + 1;
    }
    EXPECT_LT(trace.losses.back(), trace.losses.front());  // it learns
    EXPECT_NEAR(trace.eval.test_loss, reference.eval.test_loss,
                1e-5 * (1 + std::abs(reference.eval.test_loss)));
    EXPECT_TRUE(std::isnan(trace.eval.test_accuracy));  // regression
    expect_regression_metrics_like(trace.eval, reference.eval);
  }
}

TEST(TrainingRun, TrainEmitsEventsSavesAndResumesExactly) {
  const int n = world_size();
  const std::string dir = temp_dir() + "/meshtrain_training_run_test_np" + std::to_string(n);
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

// load_model (what `meshtrain evaluate` builds on): a checkpoint saved on fsdp loads onto a
// fresh run on dp, fsdp, tp and fsdp x tp, whose evaluation then equals the saving run's (to
// the bit on the same mesh, to 1e-5 relative on the others) and whose step stays 0; a
// checkpoint of another model is bad input naming the shapes.
TEST(TrainingRun, LoadModelOntoAnyMeshEvaluatesAlike) {
  const int n = world_size();
  const std::string dir = temp_dir() + "/meshtrain_training_run_load_model_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  RunConfig config = small_config({{"fsdp", n}}, "fsdp");
  config.checkpoint.dir = dir;
  EvalEvent saved_eval;
  std::string path;
  {
    TrainingRun run(config);
    for (int s = 0; s < 6; ++s) run.step();
    path = run.save();
    saved_eval = run.evaluate();
  }
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, int>>>> cases = {
      {"fsdp", {{"fsdp", n}}}, {"dp", {{"dp", n}}}, {"tp", {{"tp", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
  for (const auto& [preset, axes] : cases) {
    SCOPED_TRACE(preset);
    TrainingRun fresh(small_config(axes, preset));
    const CheckpointInfo info = fresh.load_model(dir);  // the directory: its latest
    EXPECT_EQ(info.path, path);
    EXPECT_EQ(info.train_state.step, 6);
    EXPECT_EQ(fresh.steps_done(), 0);
    const EvalEvent eval = fresh.evaluate();
    if (preset == "fsdp") {
      EXPECT_EQ(eval.test_loss, saved_eval.test_loss);
      EXPECT_EQ(eval.test_mse_per_output, saved_eval.test_mse_per_output);
      EXPECT_EQ(eval.test_r2_per_output, saved_eval.test_r2_per_output);
    }
    EXPECT_NEAR(eval.test_loss, saved_eval.test_loss, 1e-5 * (1 + saved_eval.test_loss));
    expect_regression_metrics_like(eval, saved_eval);
  }
  RunConfig other = small_config({{"dp", n}}, "dp");
  other.model.sizes = {8, 12, 16, 4};
  TrainingRun other_model(other);
  testing::expect_bad_input([&] { other_model.load_model(path); }, {"has shape", "in the model"});
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// With data.normalize_targets the model trains on standardized targets: the test loss stays
// in those units while MSE and MAE are the data's (each output's std^2 and std times the
// standardized ones), so sum_j MSE_j / std_j^2 is the loss; R^2 is the same in both. On dp,
// fsdp and tp meshes, against the one-rank run.
TEST(TrainingRun, EvaluationMetricsAreInTheDataUnits) {
  const int n = world_size();
  const auto normalized = [](RunConfig config) {
    config.data.normalize_inputs = Normalize::standard;
    config.data.normalize_targets = Normalize::standard;
    return config;
  };
  TrainingRun one(normalized(small_config({{"dp", 1}}, "dp")), {}, std::nullopt, MPI_COMM_SELF);
  for (int s = 0; s < 4; ++s) one.step();
  const EvalEvent reference = one.evaluate();
  for (const auto& [preset, axes] :
       std::vector<std::pair<std::string, std::vector<std::pair<std::string, int>>>>{
           {"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}}) {
    SCOPED_TRACE(preset);
    TrainingRun run(normalized(small_config(axes, preset)));
    for (int s = 0; s < 4; ++s) run.step();
    const EvalEvent eval = run.evaluate();
    const std::vector<double>& sd = run.normalization().target_std;
    ASSERT_EQ(sd.size(), eval.test_mse_per_output.size());
    double loss = 0.0;
    bool scaled = false;  // some output's std is far from 1: the units matter
    for (size_t j = 0; j < sd.size(); ++j) {
      loss += eval.test_mse_per_output[j] / (sd[j] * sd[j]);
      scaled = scaled || std::abs(sd[j] - 1.0) > 0.1;
    }
    EXPECT_TRUE(scaled);
    EXPECT_NEAR(loss, eval.test_loss, 1e-6 * eval.test_loss);
    expect_regression_metrics_like(eval, reference);
  }
}

using testing::MeshCase;

std::vector<MeshCase> dp_fsdp_tp(int n) {
  return testing::one_axis_meshes(n);
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
  config.run.output_dir = temp_dir() + "/meshtrain_training_run_lr_np" + std::to_string(n);
  config.optimizer.schedule = LrScheduleKind::cosine;
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

// --- Mixed precision (docs/mixed_precision.md) on every mesh against its one-rank run. ---

RunConfig with_precision(RunConfig config, Dtype param, Dtype reduce) {
  config.mixed_precision.param_dtype = param;
  config.mixed_precision.reduce_dtype = reduce;
  return config;
}

// The 16-bit runs below are compared with their one-rank runs under SGD with momentum, whose
// update is linear in the gradient: a rounding-level difference in a gradient stays a
// rounding-level difference in the parameters. AdamW's first update is lr x sign(g) in every
// element, so an element whose gradient is within rounding noise of 0 can step by lr either
// way, and that 2 lr moves every later loss by 2 lr |dL/dw|: a difference set by the
// learning rate and the data, not by the dtype (observed with AdamW: the fp16 tp np 2 run of
// Fp16OverflowSkipsTheStepOnEveryRank left the one-rank run by 0.5%, ten fp16 roundings, in
// the step after its first update; 0.03% under SGD).
RunConfig with_sgd(RunConfig config) {
  config.optimizer.kind = OptimizerKind::sgd;
  config.optimizer.lr = 0.05;  // momentum 0.9 (the default); the loss falls within 5 steps
  return config;
}

using testing::every_mesh;

// The largest |got - want| / (1 + |want|) over the steps (what expect_near_losses bounds).
double max_relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double worst = 0.0;
  for (size_t s = 0; s < std::min(got.size(), want.size()); ++s) {
    worst = std::max(worst, std::abs(got[s] - want[s]) / (1 + std::abs(want[s])));
  }
  return worst;
}

using testing::copy_parameters;
using testing::same_bits;

// min and max of `value` over MPI_COMM_WORLD.
std::pair<double, double> world_range(double value) {
  double low = 0.0, high = 0.0;
  check_mpi(MPI_Allreduce(&value, &low, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  check_mpi(MPI_Allreduce(&value, &high, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  return {low, high};
}

// An fp16 run started at a loss scale of 2^40: the loss gradient S * dL/dz overflows fp16
// (65504) at once, so step 1 is skipped (no parameter changes, the optimizer's count stays
// 0, the scale halves to 2^39) and so are the next ones until the scale is small enough;
// then the run trains. `skipped`, `scale` and `first_clean` describe the run after the
// first clean step and kClean - 1 more.
struct OverflowTrace {
  std::vector<double> losses;
  int64_t skipped = 0;
  double scale = 0.0;
  int first_clean = 0;  // 1-based step
  // After step 1 (the forced overflow).
  int64_t skipped_after_1 = 0;
  double scale_after_1 = 0.0;
};

constexpr int kMaxSkipped = 40;  // 2^40 halved 40 times is 1: far below any overflow
constexpr int kClean = 4;        // clean steps after the first one that is not skipped

OverflowTrace run_from_overflow(const RunConfig& config, MPI_Comm comm) {
  TrainingRun run(config, {}, std::nullopt, comm);
  OverflowTrace trace;
  LossScaler* scaler = run.loss_scaler();
  EXPECT_NE(scaler, nullptr) << "fp16 without loss scaling";
  if (scaler == nullptr) return trace;
  scaler->restore(std::ldexp(1.0, 40), 0);

  const std::vector<std::vector<float>> before = copy_parameters(run);
  trace.losses.push_back(run.step().loss);
  trace.skipped_after_1 = run.skipped_steps();
  trace.scale_after_1 = scaler->scale();
  EXPECT_EQ(run.skipped_steps(), 1);
  EXPECT_EQ(run.steps_done(), 1);              // a skipped step is still a step
  EXPECT_EQ(run.optimizer().step_count(), 0);  // ... but not an optimizer step
  EXPECT_EQ(scaler->scale(), std::ldexp(1.0f, 39));
  EXPECT_EQ(scaler->clean_steps(), 0);
  EXPECT_TRUE(same_bits(copy_parameters(run), before)) << "a skipped step changed parameters";

  // Step on until one is not skipped; it is the first to change the parameters.
  while (run.skipped_steps() == static_cast<int64_t>(trace.losses.size()) &&
         static_cast<int>(trace.losses.size()) <= kMaxSkipped) {
    trace.losses.push_back(run.step().loss);
  }
  trace.first_clean = static_cast<int>(trace.losses.size());
  EXPECT_EQ(run.skipped_steps(), trace.first_clean - 1) << "no step was taken";
  EXPECT_FALSE(same_bits(copy_parameters(run), before)) << "a clean step changed nothing";
  EXPECT_EQ(run.optimizer().step_count(), 1);
  for (int s = 1; s < kClean; ++s) trace.losses.push_back(run.step().loss);
  trace.skipped = run.skipped_steps();
  trace.scale = scaler->scale();
  EXPECT_EQ(scaler->clean_steps(), kClean);
  return trace;
}

// Tolerances of the fp16 and bf16 runs against their one-rank runs, relative to
// (1 + |loss|) as elsewhere here. u = 2^-11 (fp16) or 2^-8 (bf16) is the unit roundoff (of
// the 16-bit dtype in the policy). The one-rank run rounds at the same cast points; a mesh
// changes the sums over ranks (the gradients: each rank's partial rounded, then one rounding
// per hop; TP's forward partial products: one per hop), and
// tests/layers/mixed_precision_test.cpp bounds one step's loss by K u relative,
// K = 3 x batch ranks + 3 x (tp - 1) + 2: at most 14 at np 4 (dp4, fsdp4 and tp4; 11 on
// fsdp2 x tp2). The later steps start from parameters that differ by lr times the
// (momentum-summed) gradient roundings, which moves their loss by a small fraction of u at
// lr 0.05 and 5 steps. 16 u (fp16 0.78%, bf16 6.25%) holds the 14 u plus that drift.
// Observed on this CPU build (printed by rank 0): at most 4.0e-4 (0.8 u) for fp16 and
// 3.1e-3 (0.8 u) for bf16, on the losses and the evaluation.
constexpr double kFp16Tolerance = 16.0 / 2048;  // 16 u, u = 2^-11
constexpr double kBf16Tolerance = 16.0 / 256;   // 16 u, u = 2^-8

// fp16 with the scale forced to 2^40 on every mesh: the overflow skips the step on every
// rank alike (parameters bit for bit, skipped_steps() 1, scale 2^39, the same on every
// rank), and the run then skips the same number of steps and ends with the same scale as
// the one-rank run, with its losses within kFp16Tolerance.
TEST(TrainingRun, Fp16OverflowSkipsTheStepOnEveryRank) {
  const int n = world_size();
  RunConfig base = small_config({{"dp", 1}}, "dp");
  base.train.steps = kMaxSkipped + kClean + 1;
  const OverflowTrace reference =
      run_from_overflow(with_sgd(with_precision(base, Dtype::fp16, Dtype::fp16)), MPI_COMM_SELF);
  ASSERT_GT(reference.first_clean, 1);
  ASSERT_LE(reference.first_clean, kMaxSkipped);
  for (const MeshCase& c : every_mesh(n)) {
    SCOPED_TRACE(c.preset);
    RunConfig config =
        with_sgd(with_precision(small_config(c.axes, c.preset), Dtype::fp16, Dtype::fp16));
    config.train.steps = base.train.steps;
    const OverflowTrace trace = run_from_overflow(config, MPI_COMM_WORLD);
    // Every rank skipped alike and holds the same scale, after step 1 and at the end.
    const auto skipped_after_1 = world_range(static_cast<double>(trace.skipped_after_1));
    const auto scale_after_1 = world_range(trace.scale_after_1);
    EXPECT_EQ(skipped_after_1, std::make_pair(1.0, 1.0));
    EXPECT_EQ(scale_after_1, std::make_pair(std::ldexp(1.0, 39), std::ldexp(1.0, 39)));
    const auto skipped = world_range(static_cast<double>(trace.skipped));
    const auto scale = world_range(trace.scale);
    const auto first_clean = world_range(trace.first_clean);
    EXPECT_EQ(skipped.first, skipped.second);
    EXPECT_EQ(scale.first, scale.second);
    EXPECT_EQ(first_clean.first, first_clean.second);
    // ... and as the one-rank run.
    EXPECT_EQ(trace.skipped, reference.skipped);
    EXPECT_EQ(trace.scale, reference.scale);
    EXPECT_EQ(trace.first_clean, reference.first_clean);
    expect_near_losses(trace.losses, reference.losses, kFp16Tolerance);
    if (world_rank() == 0) {
      std::printf(
          "[ observed ] fp16 overflow, %s np %d: %lld skipped, scale 2^%g, "
          "max loss error %.2e (bound %.2e)\n",
          c.preset.c_str(), n, static_cast<long long>(trace.skipped), std::log2(trace.scale),
          max_relative_error(trace.losses, reference.losses), kFp16Tolerance);
    }
  }
}

// bf16/bf16, fp16/fp16 and bf16 params with fp32 reduction train on every mesh like the
// one-rank run of the same policy (kBf16Tolerance or kFp16Tolerance, above) and learn.
TEST(TrainingRun, MixedPrecisionMeshesTrainLikeOneRank) {
  const int n = world_size();
  struct Policy {
    Dtype param, reduce;
    double tolerance;
    const char* name;
  };
  const Policy policies[] = {{Dtype::bf16, Dtype::bf16, kBf16Tolerance, "bf16/bf16"},
                             {Dtype::fp16, Dtype::fp16, kFp16Tolerance, "fp16/fp16"},
                             {Dtype::bf16, Dtype::fp32, kBf16Tolerance, "bf16/fp32"}};
  for (const Policy& p : policies) {
    SCOPED_TRACE(p.name);
    const Trace reference =
        run_steps(with_sgd(with_precision(small_config({{"dp", 1}}, "dp"), p.param, p.reduce)),
                  MPI_COMM_SELF, 5);
    EXPECT_LT(reference.losses.back(), reference.losses.front());
    for (const MeshCase& c : every_mesh(n)) {
      SCOPED_TRACE(c.preset);
      const Trace trace =
          run_steps(with_sgd(with_precision(small_config(c.axes, c.preset), p.param, p.reduce)),
                    MPI_COMM_WORLD, 5);
      expect_near_losses(trace.losses, reference.losses, p.tolerance);
      EXPECT_LT(trace.losses.back(), trace.losses.front());  // it learns
      EXPECT_NEAR(trace.eval.test_loss, reference.eval.test_loss,
                  p.tolerance * (1 + std::abs(reference.eval.test_loss)));
      if (world_rank() == 0) {
        std::printf("[ observed ] %s, %s np %d: max loss error %.2e, eval %.2e (bound %.2e)\n",
                    p.name, c.preset.c_str(), n, max_relative_error(trace.losses, reference.losses),
                    std::abs(trace.eval.test_loss - reference.eval.test_loss) /
                        (1 + std::abs(reference.eval.test_loss)),
                    p.tolerance);
      }
    }
  }
}

RunConfig with_residual(RunConfig config, ModelNorm norm, bool swiglu);  // below

// The bf16 tolerance of the residual_mlp below (layernorm + swiglu, inputs 8, width 16, hidden
// 16, depth 2, outputs 4) on mesh c, relative to (1 + |loss|), derived as kBf16Tolerance is for
// the plain MLP. The one-rank run rounds at the same cast points (norm outputs, SwiGLU, the
// residual adds), so only the sums over ranks differ. mixed_precision_test's
// K = 3 x batch ranks + 3 x (tp - 1) + 2 bounds a step's loss in units of u = 2^-8 with one
// sum over tp on the way to it; this model's forward has 4 (its plan under the tp preset,
// `meshtrain plan`: the row-parallel input Linear, the two blocks' down projections and the
// output Linear each reduce-scatter in bf16; the norms' statistics are summed in fp32, which
// moves a norm's output by fp32 rounding, a flipped bf16 rounding at most: the + 2), so, as in
// moe_block_test, the tp term counts once per sum:
//   K = 3 x batch ranks + 3 x (tp - 1) x 4 + 2.
// The backward's 5 sums over tp (the SwiGLU's gate-and-up input gradient per block, the 3
// norms' gradient row sums) move the gradients, which reach the later steps' losses and the
// evaluation only through lr 0.05 times their difference: as for the plain MLP, 2 u more for
// that drift over 5 steps. Bounds: dp/fsdp n: 3n + 4 u (np 2 3.9%, np 4 6.25%); tp 2 19 u
// (7.4%); tp 4 43 u (16.8%); fsdp 2 x tp 2 22 u (8.6%).
double residual_bf16_tolerance(const MeshCase& c) {
  int batch_ranks = 1, tp = 1;
  for (const auto& [axis, size] : c.axes) (axis == "tp" ? tp : batch_ranks) *= size;
  constexpr int kForwardTpSums = 4;
  const double k = 3.0 * batch_ranks + 3.0 * (tp - 1) * kForwardTpSums + 2 + 2;
  return k / 256;
}

// A residual_mlp (layernorm + swiglu) in bf16/bf16 trains on every mesh like the one-rank bf16
// run, within residual_bf16_tolerance (above). Observed on this CPU build (printed per mesh):
// losses within 7.6e-3 (1.9 u), the evaluation within 1.3e-2 (3.3 u), both on tp at np 2.
TEST(TrainingRun, ResidualMlpBf16MeshesTrainLikeOneRank) {
  const int n = world_size();
  auto config = [](const MeshCase& c) {
    return with_sgd(
        with_precision(with_residual(small_config(c.axes, c.preset), ModelNorm::layernorm, true),
                       Dtype::bf16, Dtype::bf16));
  };
  const Trace reference = run_steps(config({"dp", {{"dp", 1}}}), MPI_COMM_SELF, 5);
  EXPECT_LT(reference.losses.back(), reference.losses.front());
  for (const MeshCase& c : every_mesh(n)) {
    SCOPED_TRACE(c.preset);
    const double tolerance = residual_bf16_tolerance(c);
    const Trace trace = run_steps(config(c), MPI_COMM_WORLD, 5);
    expect_near_losses(trace.losses, reference.losses, tolerance);
    EXPECT_NEAR(trace.eval.test_loss, reference.eval.test_loss,
                tolerance * (1 + std::abs(reference.eval.test_loss)));
    if (world_rank() == 0) {
      std::printf(
          "[ observed ] residual bf16, %s np %d: max loss error %.2e, eval %.2e "
          "(bound %.2e)\n",
          c.preset.c_str(), n, max_relative_error(trace.losses, reference.losses),
          std::abs(trace.eval.test_loss - reference.eval.test_loss) /
              (1 + std::abs(reference.eval.test_loss)),
          tolerance);
    }
  }
}

// [mixed_precision] fp32/fp32 written out is the default run, bit for bit, on every mesh
// (and scales no loss).
TEST(TrainingRun, Fp32PolicyIsBitIdentical) {
  for (const MeshCase& c : every_mesh(world_size())) {
    SCOPED_TRACE(c.preset);
    const RunConfig plain = small_config(c.axes, c.preset);
    const RunConfig fp32 = with_precision(plain, Dtype::fp32, Dtype::fp32);
    const Trace want = run_steps(plain, MPI_COMM_WORLD, 4);
    const Trace got = run_steps(fp32, MPI_COMM_WORLD, 4);
    EXPECT_EQ(got.losses, want.losses);
    EXPECT_EQ(got.eval.test_loss, want.eval.test_loss);
    TrainingRun run(fp32, {}, std::nullopt, MPI_COMM_WORLD);
    EXPECT_EQ(run.loss_scaler(), nullptr);
  }
}

// MoE (issue 19): a model with an MoE hidden layer (4 experts, top-2) trains on ep, ep x dp,
// ep x fsdp and ep x tp meshes with the losses, aux losses and evaluation of its one-rank
// run; ep without MoE layers trains like dp would not (the rows are not split over it) and
// still equals one rank.
RunConfig with_moe(RunConfig config) {
  config.model.moe_layers = {1};
  config.model.experts = 4;
  config.model.top_k = 2;
  config.model.aux_loss_coef = 0.05;
  return config;
}

TEST(TrainingRun, MoeMeshesTrainLikeOneRank) {
  const int n = world_size();
  // (A mesh made in code has the axes it lists: the preset puts experts on ep.)
  RunConfig single = with_moe(small_config({{"dp", 1}, {"ep", 1}}, "dp"));
  TrainingRun one(single, {}, std::nullopt, MPI_COMM_SELF);
  std::vector<StepResult> reference;
  for (int s = 0; s < 5; ++s) reference.push_back(one.step());
  const EvalEvent reference_eval = one.evaluate();
  EXPECT_GT(reference.front().aux_loss, 0.0);
  struct Case {
    std::string preset;
    std::vector<std::pair<std::string, int>> axes;
  };
  std::vector<Case> cases = {{"dp", {{"ep", n}}}};
  if (n % 2 == 0) {
    cases.push_back({"dp", {{"dp", n / 2}, {"ep", 2}}});
    cases.push_back({"fsdp", {{"fsdp", n / 2}, {"ep", 2}}});
    cases.push_back({"fsdp_tp", {{"fsdp", 1}, {"ep", n / 2}, {"tp", 2}}});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.preset + " " + c.axes.front().first + "=" +
                 std::to_string(c.axes.front().second));
    TrainingRun run(with_moe(small_config(c.axes, c.preset)), {}, std::nullopt, MPI_COMM_WORLD);
    for (int s = 0; s < 5; ++s) {
      const StepResult r = run.step();
      const StepResult& want = reference[static_cast<size_t>(s)];
      EXPECT_NEAR(r.loss, want.loss, 1e-5 * (1 + std::abs(want.loss))) << "step " << s + 1;
      EXPECT_NEAR(r.aux_loss, want.aux_loss, 1e-5 * (1 + want.aux_loss)) << "step " << s + 1;
    }
    const EvalEvent eval = run.evaluate();
    EXPECT_NEAR(eval.test_loss, reference_eval.test_loss, 1e-5 * (1 + reference_eval.test_loss));
    expect_regression_metrics_like(eval, reference_eval);
    EXPECT_EQ(run.model().moe_layers().size(), 1u);
  }
}

// A residual_mlp (docs/models.md) of the same task: 8 -> width 16, 2 blocks of hidden 16, -> 4.
RunConfig with_residual(RunConfig config, ModelNorm norm, bool swiglu) {
  testing::use_residual_mlp(config, /*inputs=*/8, /*width=*/16, /*hidden=*/16, /*depth=*/2,
                            /*outputs=*/4, norm, swiglu);
  config.model.activation = Activation::silu;
  return config;
}

// Five steps and an evaluation of a residual_mlp (rmsnorm + silu, layernorm + swiglu) on dp,
// fsdp, tp and fsdp x tp, overlap off and on, equal one rank's to 1e-5 relative, and it learns.
TEST(TrainingRun, ResidualMlpMeshesTrainLikeOneRank) {
  const int n = world_size();
  for (const bool swiglu : {false, true}) {
    const ModelNorm norm = swiglu ? ModelNorm::layernorm : ModelNorm::rmsnorm;
    const Trace reference =
        run_steps(with_residual(small_config({{"dp", 1}}, "dp"), norm, swiglu), MPI_COMM_SELF, 5);
    std::vector<MeshCase> cases = {
        {"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}};
    if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
    for (const MeshCase& c : cases) {
      for (const bool overlap : {false, true}) {
        SCOPED_TRACE(c.preset + (swiglu ? ", layernorm + swiglu" : ", rmsnorm + silu") +
                     (overlap ? ", overlap" : ""));
        RunConfig config = with_residual(small_config(c.axes, c.preset), norm, swiglu);
        config.runtime.overlap = overlap;
        const Trace trace = run_steps(config, MPI_COMM_WORLD, 5);
        ASSERT_EQ(trace.losses.size(), reference.losses.size());
        for (size_t s = 0; s < trace.losses.size(); ++s) {
          EXPECT_NEAR(trace.losses[s], reference.losses[s],
                      1e-5 * (1 + std::abs(reference.losses[s])))
              << "step " << s + 1;
        }
        EXPECT_LT(trace.losses.back(), trace.losses.front());  // it learns
        EXPECT_NEAR(trace.eval.test_loss, reference.eval.test_loss,
                    1e-5 * (1 + std::abs(reference.eval.test_loss)));
      }
    }
  }
}

// The communication thread ([runtime] comm_thread) changes who drives the started operations,
// not what they compute: dp and fsdp (and fsdp x tp) with overlap give the same losses and
// evaluation, bit for bit, with the thread on as off.
TEST(TrainingRun, CommThreadTrainsBitForBitLikeWithout) {
  const int n = world_size();
  std::vector<MeshCase> cases = {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
  for (const MeshCase& c : cases) {
    SCOPED_TRACE(c.preset);
    RunConfig config = small_config(c.axes, c.preset);
    config.runtime.backend = CommBackendChoice::mpi;  // the thread drives MPI's operations
    config.runtime.overlap = true;
    config.runtime.bucket_mb = 0.0005;  // several DP buckets in flight at once
    config.runtime.comm_thread = CommThreadChoice::off;
    const Trace off = run_steps(config, MPI_COMM_WORLD, 5);
    config.runtime.comm_thread = CommThreadChoice::on;
    Trace on;
    {
      TrainingRun run(config, {}, std::nullopt, MPI_COMM_WORLD);
      EXPECT_NE(running_comm_progress(), nullptr);  // the run holds the thread on
      for (int s = 0; s < 5; ++s) on.losses.push_back(run.step().loss);
      on.eval = run.evaluate();
    }
    EXPECT_EQ(running_comm_progress(), nullptr);  // and stops it when it ends
    ASSERT_EQ(on.losses.size(), off.losses.size());
    for (size_t s = 0; s < on.losses.size(); ++s) {
      EXPECT_EQ(on.losses[s], off.losses[s]) << "step " << s + 1;
    }
    EXPECT_EQ(on.eval.test_loss, off.eval.test_loss);
  }
}

// DP with overlap and reductions = "ring": the gradient buckets run the started ring (its
// partial sums are reserved when the model is built: counted here by their Kokkos label), and
// the run equals the same run with overlap off (blocking ring all-reduces per gradient) and
// (next test) with overlap and the communication thread. With 2 ranks every element is the sum
// of two values, whatever the order, so all three are equal bit for bit. With more, a bucket
// that packs several gradients splits them into the ring's blocks differently from a
// per-gradient all-reduce, so an element's sum may start at another rank
// (docs/communication.md): overlap off is then equal to 1e-5 relative, and the thread on and
// off still bit for bit.
int64_t g_started_ring_buffers = 0;
void count_started_ring_buffers(const Kokkos::Profiling::SpaceHandle, const char* label,
                                const void*, const uint64_t) {
  if (std::string(label) == "meshtrain::started_ring_partial_sums") ++g_started_ring_buffers;
}

RunConfig ring_config(bool overlap, CommThreadChoice comm_thread) {
  RunConfig config = small_config({{"dp", world_size()}}, "dp");
  config.runtime.backend = CommBackendChoice::mpi;
  config.runtime.reductions = ReductionAlgorithm::ring;
  config.runtime.comm_thread = comm_thread;
  config.runtime.bucket_mb = 0.0005;  // several buckets in flight at once
  config.runtime.overlap = overlap;
  return config;
}

TEST(TrainingRun, OverlapOnTheRingTrainsLikeWithout) {
  const int n = world_size();
  const Trace off = run_steps(ring_config(false, CommThreadChoice::off), MPI_COMM_WORLD, 5);
  g_started_ring_buffers = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_started_ring_buffers);
  const Trace on = run_steps(ring_config(true, CommThreadChoice::off), MPI_COMM_WORLD, 5);
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  if (n > 1) EXPECT_GT(g_started_ring_buffers, 0) << "the buckets did not run the started ring";
  ASSERT_EQ(on.losses.size(), off.losses.size());
  for (size_t s = 0; s < on.losses.size(); ++s) {
    if (n <= 2) {
      EXPECT_EQ(on.losses[s], off.losses[s]) << "step " << s + 1;
    } else {
      EXPECT_NEAR(on.losses[s], off.losses[s], 1e-5 * (1 + std::abs(off.losses[s])))
          << "step " << s + 1;
    }
  }
  if (n <= 2) EXPECT_EQ(on.eval.test_loss, off.eval.test_loss);
  EXPECT_LT(on.losses.back(), on.losses.front());  // it learns
}

// The same overlapped ring run with the communication thread equals it without, bit for bit
// (above). The thread needs MPI_THREAD_MULTIPLE; without it the case is skipped, saying so.
TEST(TrainingRun, OverlapOnTheRingTrainsLikeWithoutWithTheCommThread) {
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    GTEST_SKIP() << "MPI lacks MPI_THREAD_MULTIPLE: the communication thread cannot run";
  }
  const Trace on = run_steps(ring_config(true, CommThreadChoice::off), MPI_COMM_WORLD, 5);
  const Trace threaded = run_steps(ring_config(true, CommThreadChoice::on), MPI_COMM_WORLD, 5);
  ASSERT_EQ(threaded.losses.size(), on.losses.size());
  for (size_t s = 0; s < on.losses.size(); ++s) {
    EXPECT_EQ(threaded.losses[s], on.losses[s]) << "step " << s + 1;
  }
  EXPECT_EQ(threaded.eval.test_loss, on.eval.test_loss);
}

// `meshtrain plan`'s ring reductions (framework/train/plan_report.hpp) are what the run
// allocates for its ring partial sums (the peak of the live Kokkos allocations by label, from
// construction through two steps), on every mesh, with overlap off and on, with and without a
// separate evaluation batch: to the byte for the
// blocking ones; the buckets' within one element per gradient and bucket (the plan counts per
// gradient). Live bytes of the ring's buffers, and their peak (a buffer that grows is freed first).
struct RingAllocations {
  int64_t live = 0, peak = 0;
};
RingAllocations* g_ring_allocations = nullptr;
bool is_ring_buffer(const char* label) {
  const std::string name(label);
  return name == "meshtrain::ring_partial_sums" || name == "meshtrain::started_ring_partial_sums";
}
void count_ring_bytes(const Kokkos::Profiling::SpaceHandle, const char* label, const void*,
                      const uint64_t size) {
  if (!is_ring_buffer(label)) return;
  g_ring_allocations->live += static_cast<int64_t>(size);
  g_ring_allocations->peak = std::max(g_ring_allocations->peak, g_ring_allocations->live);
}
void uncount_ring_bytes(const Kokkos::Profiling::SpaceHandle, const char* label, const void*,
                        const uint64_t size) {
  if (is_ring_buffer(label)) g_ring_allocations->live -= static_cast<int64_t>(size);
}

TEST(TrainingRun, PlanCountsTheRingBuffersTheRunAllocates) {
  const int n = world_size();
  std::vector<MeshCase> cases = {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
  for (const MeshCase& c : cases) {
    for (const bool overlap : {false, true}) {
      for (const bool eval_batch : {false, true}) {
        SCOPED_TRACE(c.preset + (overlap ? ", overlap" : "") + (eval_batch ? ", eval batch" : ""));
        RunConfig config = small_config(c.axes, c.preset);
        // A separate evaluation model (other rows) reserves its layers' reductions at its rows,
        // and its own DP buckets under overlap (issue 36, item 19).
        if (eval_batch) config.data.eval_batch_size = 64;
        config.runtime.backend = CommBackendChoice::mpi;
        config.runtime.reductions = ReductionAlgorithm::ring;
        config.runtime.overlap = overlap;
        config.runtime.bucket_mb = 0.0005;  // several buckets
        RingAllocations allocated;
        g_ring_allocations = &allocated;
        Kokkos::Tools::Experimental::set_allocate_data_callback(count_ring_bytes);
        Kokkos::Tools::Experimental::set_deallocate_data_callback(uncount_ring_bytes);
        RingReductionBytes planned;
        {
          TrainingRun run(config, {}, std::nullopt, MPI_COMM_WORLD);
          run.step();
          run.step();
          planned = ring_reduction_bytes(run.plan(), config, collective_matmul_hardware());
        }
        Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
        Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
        EXPECT_EQ(allocated.live, 0) << "the run did not free its ring buffers";
        if (n == 1) {
          EXPECT_EQ(planned.total(), 0);
          EXPECT_EQ(allocated.peak, 0);
          continue;
        }
        EXPECT_GT(planned.total(), 0);
        const int64_t slack = overlap ? 2 * 4 * 2 * 16 : 0;  // 2 buffers, fp32, <= 16 ceilings
        EXPECT_NEAR(static_cast<double>(allocated.peak), static_cast<double>(planned.total()),
                    static_cast<double>(eval_batch ? 2 * slack : slack))
            << "planned " << planned.blocking << " blocking + " << planned.started << " started";
      }
    }
  }
}

// [runtime] reductions = "auto" under a hardware profile that measured the ring faster from
// 256 bytes (train --hardware): the run takes the ring for some of these small reductions (without
// a profile, "auto" starts at 64 KiB and takes it for none), and `meshtrain plan --hardware`
// with the same profile counts the ring buffers the run allocates and names the choice each of
// its groups made (issue 36, the house: one resolution of runtime.reductions); the plan
// without the profile counts none.
TEST(TrainingRun, PlanUnderAHardwareProfileCountsTheRingTheRunChooses) {
  const int n = world_size();
  HardwareProfile profile = default_hardware_profile();
  profile.source = "the test's profile";
  for (auto& [axis, link] : profile.links) {
    link.ring_reduce_scatter_bandwidth = link.reduce_scatter_bandwidth;
    link.ring_all_reduce_bandwidth = link.all_reduce_bandwidth;
    link.ring_reduce_scatter_from = 256;
    link.ring_all_reduce_from = 256;
  }
  std::vector<MeshCase> cases = {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}, {"tp", {{"tp", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", n / 2}, {"tp", 2}}});
  const auto plan_json = [&](const RunConfig& config, const HardwareProfile* hardware) {
    std::ostringstream out;
    print_plan(config, n, /*json=*/true, out, hardware);
    return nlohmann::json::parse(out.str());
  };
  for (const MeshCase& c : cases) {
    SCOPED_TRACE(c.preset);
    RunConfig config = small_config(c.axes, c.preset);
    config.runtime.backend = CommBackendChoice::mpi;
    config.runtime.reductions = ReductionAlgorithm::automatic;
    RingAllocations allocated;
    g_ring_allocations = &allocated;
    Kokkos::Tools::Experimental::set_allocate_data_callback(count_ring_bytes);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(uncount_ring_bytes);
    set_collective_matmul_hardware(profile);
    RingReductionBytes planned;
    std::string chosen;  // describe()'s line of the groups' choices
    {
      TrainingRun run(config, {}, std::nullopt, MPI_COMM_WORLD);
      run.step();
      run.step();
      planned = run.planned_memory().ring;
      chosen = run.describe().back();
    }
    set_collective_matmul_hardware(default_hardware_profile());
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
    EXPECT_EQ(allocated.peak, planned.total())
        << "planned " << planned.blocking << " blocking + " << planned.started << " started";
    const nlohmann::json with_profile = plan_json(config, &profile);
    EXPECT_EQ(with_profile["totals"]["ring_reduction_bytes"].get<int64_t>(), allocated.peak);
    const nlohmann::json without = plan_json(config, nullptr);
    EXPECT_EQ(without["totals"]["ring_reduction_bytes"].get<int64_t>(), 0);
    if (n == 1) {
      EXPECT_EQ(allocated.peak, 0);
      EXPECT_TRUE(with_profile["reductions"]["groups"].empty());
      continue;
    }
    EXPECT_GT(allocated.peak, 0) << "the profile's 256 B did not put any reduction on the ring";
    // Every group the plan names chose as the run's group did.
    ASSERT_FALSE(with_profile["reductions"]["groups"].empty());
    EXPECT_EQ(with_profile["reductions"]["algorithm"], "auto");
    for (const auto& group : with_profile["reductions"]["groups"]) {
      const std::string choice = group["choice"].get<std::string>();
      EXPECT_EQ(choice, "ring from 256 B (reduce_scatter), ring from 256 B (all_reduce)");
      EXPECT_NE(chosen.find(": " + choice), std::string::npos) << chosen;
    }
    for (const auto& group : without["reductions"]["groups"]) {
      EXPECT_EQ(group["choice"].get<std::string>(),
                "ring from 64 KiB (reduce_scatter), ring from 64 KiB (all_reduce)");
    }
  }
}

// A residual_mlp saved at step 6 resumes bit for bit on the same mesh (fsdp), and onto
// another mesh (tp; the checkpoint is resharded) to 1e-5 relative, against a run of 9 steps
// that was never interrupted.
TEST(TrainingRun, ResidualMlpResumesExactlyAndAcrossMeshes) {
  const int n = world_size();
  const std::string dir = temp_dir() + "/meshtrain_training_run_residual_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  RunConfig config = with_residual(small_config({{"fsdp", n}}, "fsdp"), ModelNorm::layernorm, true);
  config.run.output_dir = dir;
  {
    TrainingRun run(config);
    EXPECT_EQ(run.train().steps_run, 6);
  }
  RunConfig longer = config;
  longer.train.steps = 9;
  const Trace uninterrupted = run_steps(longer, MPI_COMM_WORLD, 9);
  longer.checkpoint.resume = true;
  {
    TrainingRun resumed(longer);
    ASSERT_TRUE(resumed.resumed_from().has_value());
    EXPECT_EQ(resumed.steps_done(), 6);
    for (int s = 6; s < 9; ++s) {
      EXPECT_EQ(resumed.step().loss, uninterrupted.losses[s]) << "same mesh, step " << s + 1;
    }
  }
  RunConfig other = longer;
  other.mesh.axes = {{"tp", n}};
  other.partition.preset = "tp";
  {
    TrainingRun resumed(other);
    ASSERT_TRUE(resumed.resumed_from().has_value());
    EXPECT_EQ(resumed.steps_done(), 6);
    for (int s = 6; s < 9; ++s) {
      const double want = uninterrupted.losses[s];
      EXPECT_NEAR(resumed.step().loss, want, 1e-5 * (1 + std::abs(want)))
          << "tp mesh, step " << s + 1;
    }
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// A residual_mlp whose block 1 is an MoE block (model.moe_layers = [1], 4 experts, top-2;
// rmsnorm + silu and layernorm + swiglu): five steps and an evaluation on ep, dp x ep,
// fsdp x ep and ep x tp equal one rank's to 1e-5 relative (loss, aux loss, test loss), the
// aux loss is part of the training; saved at step 6 on ep = n, it resumes bit for bit against
// a run of 9 steps that was never interrupted, and onto another mesh (fsdp x ep, or dp at
// np 1) to 1e-5 relative.
TEST(TrainingRun, ResidualMoeBlocksTrainLikeOneRankAndResumeExactly) {
  const int n = world_size();
  for (const bool swiglu : {false, true}) {
    const ModelNorm norm = swiglu ? ModelNorm::layernorm : ModelNorm::rmsnorm;
    auto config_of = [&](std::vector<std::pair<std::string, int>> axes, const std::string& preset) {
      return with_moe(with_residual(small_config(std::move(axes), preset), norm, swiglu));
    };
    TrainingRun one(config_of({{"dp", 1}, {"ep", 1}}, "dp"), {}, std::nullopt, MPI_COMM_SELF);
    std::vector<StepResult> reference;
    for (int s = 0; s < 5; ++s) reference.push_back(one.step());
    const EvalEvent reference_eval = one.evaluate();
    EXPECT_GT(reference.front().aux_loss, 0.0);
    EXPECT_LT(reference.back().loss, reference.front().loss);  // it learns
    std::vector<MeshCase> cases = {{"dp", {{"ep", n}}}};
    if (n % 2 == 0) {
      cases.push_back({"dp", {{"dp", n / 2}, {"ep", 2}}});
      cases.push_back({"fsdp", {{"fsdp", n / 2}, {"ep", 2}}});
      cases.push_back({"tp", {{"ep", n / 2}, {"tp", 2}}});
    }
    for (const MeshCase& c : cases) {
      SCOPED_TRACE(c.preset + " " + c.axes.front().first + "=" +
                   std::to_string(c.axes.front().second) + (swiglu ? ", swiglu" : ", silu"));
      TrainingRun run(config_of(c.axes, c.preset), {}, std::nullopt, MPI_COMM_WORLD);
      for (int s = 0; s < 5; ++s) {
        const StepResult r = run.step();
        const StepResult& want = reference[static_cast<size_t>(s)];
        EXPECT_NEAR(r.loss, want.loss, 1e-5 * (1 + std::abs(want.loss))) << "step " << s + 1;
        EXPECT_NEAR(r.aux_loss, want.aux_loss, 1e-5 * (1 + want.aux_loss)) << "step " << s + 1;
      }
      const EvalEvent eval = run.evaluate();
      EXPECT_NEAR(eval.test_loss, reference_eval.test_loss, 1e-5 * (1 + reference_eval.test_loss));
    }
  }

  const std::string dir = temp_dir() + "/meshtrain_training_run_moe_blocks_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  RunConfig config =
      with_moe(with_residual(small_config({{"ep", n}}, "dp"), ModelNorm::layernorm, true));
  config.run.output_dir = dir;
  {
    TrainingRun run(config);
    EXPECT_EQ(run.train().steps_run, 6);
  }
  RunConfig longer = config;
  longer.train.steps = 9;
  const Trace uninterrupted = run_steps(longer, MPI_COMM_WORLD, 9);
  longer.checkpoint.resume = true;
  {
    TrainingRun resumed(longer);
    ASSERT_TRUE(resumed.resumed_from().has_value());
    EXPECT_EQ(resumed.steps_done(), 6);
    for (int s = 6; s < 9; ++s) {
      EXPECT_EQ(resumed.step().loss, uninterrupted.losses[s]) << "same mesh, step " << s + 1;
    }
  }
  // Resharded onto another mesh (the experts replicated over dp, or split over fsdp x ep).
  RunConfig other = longer;
  other.mesh.axes = n % 2 == 0
                        ? std::vector<std::pair<std::string, int>>{{"fsdp", n / 2}, {"ep", 2}}
                        : std::vector<std::pair<std::string, int>>{{"dp", n}, {"ep", 1}};
  other.partition.preset = n % 2 == 0 ? "fsdp" : "dp";
  {
    TrainingRun resumed(other);
    ASSERT_TRUE(resumed.resumed_from().has_value());
    EXPECT_EQ(resumed.steps_done(), 6);
    for (int s = 6; s < 9; ++s) {
      const double want = uninterrupted.losses[s];
      EXPECT_NEAR(resumed.step().loss, want, 1e-5 * (1 + std::abs(want)))
          << "other mesh, step " << s + 1;
    }
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// --- fp16 and a forward pass that overflows (the loss scale cannot help there). ---

// 64 rows of 8 inputs in file order (no shuffle), class = row % 4; the rows of step `step`
// (16 a step) hold `large` in every input, the others 0.25 * (1 + row % 3).
RunData inputs_with_large_step(float large, int step, bool every_step = false) {
  Dataset train;
  train.description = "the test's data";
  train.num_samples = 64;
  train.features = 8;
  train.num_classes = 4;
  for (int row = 0; row < 64; ++row) {
    const bool is_large = every_step || row / 16 == step - 1;
    for (int f = 0; f < 8; ++f) train.inputs.push_back(is_large ? large : 0.25f * (1 + row % 3));
    train.labels.push_back(row % 4);
  }
  return RunData{std::move(train), Dataset{}};
}

RunConfig fp16_relu_config(std::vector<std::pair<std::string, int>> axes,
                           const std::string& preset) {
  RunConfig config =
      with_sgd(with_precision(small_config(std::move(axes), preset), Dtype::fp16, Dtype::fp16));
  config.model.activation =
      Activation::relu;  // tanh would squash an overflowed (inf) activation to 1
  config.data.shuffle = ShuffleMode::none;
  return config;
}

// Step 2's inputs are 60000, inside fp16's range, but their first layer's outputs are not:
// the loss (or under TP, whose partial sums round per hop, the gradient) is not finite. As
// under GradScaler the step is skipped (parameters untouched, skipped_steps 1, scale halved)
// and step 3 trains again, on every mesh as on one rank; fp32 trains through step 2.
TEST(TrainingRun, Fp16ForwardOverflowSkipsTheStep) {
  std::vector<MeshCase> meshes = every_mesh(world_size());
  meshes.insert(meshes.begin(), {"dp", {{"dp", 1}}});  // the one-rank run, on MPI_COMM_SELF
  for (size_t m = 0; m < meshes.size(); ++m) {
    SCOPED_TRACE(m == 0 ? "one rank" : meshes[m].preset);
    TrainingRun run(fp16_relu_config(meshes[m].axes, meshes[m].preset), {},
                    inputs_with_large_step(60000.0f, 2), m == 0 ? MPI_COMM_SELF : MPI_COMM_WORLD);
    const double initial_scale = run.loss_scaler()->scale();
    EXPECT_TRUE(std::isfinite(run.step().loss));
    const std::vector<std::vector<float>> after_1 = copy_parameters(run);
    run.step();  // TP's partial sums may keep the loss finite: then its gradient overflows
    EXPECT_EQ(run.skipped_steps(), 1);
    EXPECT_EQ(run.steps_done(), 2);
    EXPECT_EQ(run.optimizer().step_count(), 1);
    EXPECT_EQ(run.loss_scaler()->scale(), initial_scale / 2);
    EXPECT_TRUE(same_bits(copy_parameters(run), after_1)) << "a skipped step changed parameters";
    EXPECT_TRUE(std::isfinite(run.step().loss));
    EXPECT_EQ(run.optimizer().step_count(), 2);
    EXPECT_FALSE(same_bits(copy_parameters(run), after_1));
  }
  RunConfig fp32 = fp16_relu_config({{"dp", 1}}, "dp");
  fp32.mixed_precision = {};
  TrainingRun run(fp32, {}, inputs_with_large_step(60000.0f, 2), MPI_COMM_SELF);
  run.step();
  EXPECT_TRUE(std::isfinite(run.step().loss)) << "fp32 overflowed too: the test shows nothing";
}

// The inputs of step 1 are 1e5, beyond fp16's range: no loss scale makes the loss finite, so
// the fp16 run ends at step 1 on every rank in one sentence naming the key that fixes it
// (bad input), where fp32 and bf16 train. Inputs inside the range whose forward pass
// overflows in every step end the run too, naming the same key: after 16 non-finite losses
// in a row, or (TP, where the loss stays finite) once the gradients overflow at a scale
// below 2^-24, 41 halvings of 2^16.
TEST(TrainingRun, Fp16LossThatNoScaleFixesNamesTheKey) {
  for (const MeshCase& c : every_mesh(world_size())) {
    SCOPED_TRACE(c.preset);
    for (Dtype param : {Dtype::fp32, Dtype::bf16}) {
      RunConfig config = fp16_relu_config(c.axes, c.preset);
      config.mixed_precision = {param, param};
      TrainingRun run(config, {}, inputs_with_large_step(1e5f, 1));
      EXPECT_TRUE(std::isfinite(run.step().loss)) << to_string(param);
    }
    try {
      TrainingRun run(fp16_relu_config(c.axes, c.preset), {}, inputs_with_large_step(1e5f, 1));
      run.step();
      ADD_FAILURE() << "fp16 took inputs of 1e5";
    } catch (const AgreedError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::bad_input);
      const std::string message = e.what();
      EXPECT_NE(message.find("mixed_precision.param_dtype"), std::string::npos) << message;
      EXPECT_NE(message.find("beyond fp16's range"), std::string::npos) << message;
      EXPECT_NE(message.find("step 1"), std::string::npos) << message;
    }
    RunConfig config = fp16_relu_config(c.axes, c.preset);
    config.train.steps = 60;
    TrainingRun run(config, {}, inputs_with_large_step(60000.0f, 0, /*every_step=*/true));
    int64_t steps = 0;
    try {
      while (!run.finished()) {
        run.step();
        ++steps;
      }
      ADD_FAILURE() << "every step overflowed fp16 and the run went on";
    } catch (const AgreedError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::runtime);
      const std::string message = e.what();
      const bool loss =
          message.find("loss was not finite in 16 steps in a row") != std::string::npos;
      const bool gradients = message.find("at every loss scale down to 2^-24") != std::string::npos;
      EXPECT_TRUE(loss || gradients) << message;
      EXPECT_EQ(steps, loss ? 15 : 40) << message;
      EXPECT_EQ(run.skipped_steps(), steps);
      EXPECT_NE(message.find("mixed_precision.param_dtype"), std::string::npos) << message;
    }
  }
}

// A fresh directory for the run's output on every rank (removed by rank 0 first).
std::string fresh_run_dir(const std::string& name) {
  const std::string dir = temp_dir() + "/meshtrain_" + name + "_np" + std::to_string(world_size());
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  return dir;
}

// checkpoint.keep_best (issue 26): every evaluation that improves on the earlier ones saves a
// checkpoint and points `best` at it; rotation (keep = 1) never removes that file, and it
// holds the parameters of the best evaluation's step. Evaluated on an fsdp mesh after every
// step, the test losses agree on every rank, and so does the best step.
TEST(TrainingRun, KeepBestSurvivesRotation) {
  const int n = world_size();
  const std::string dir = fresh_run_dir("keep_best");
  RunConfig config = small_config({{"fsdp", n}}, "fsdp");
  config.run.output_dir = dir;
  config.checkpoint.dir = dir + "/checkpoints";
  config.checkpoint.keep = 1;
  config.checkpoint.keep_best = EvalMetric::test_loss;
  config.train.eval_every = 1;
  config.train.steps = 12;
  config.optimizer.lr = 0.2;  // large enough that some evaluation gets worse
  std::vector<EvalEvent> evals;
  RunEvents events;
  events.on_eval = [&](const EvalEvent& e) { evals.push_back(e); };
  TrainingRun run(config, events);
  run.train();
  ASSERT_EQ(evals.size(), 12u);
  size_t best = 0;
  for (size_t i = 1; i < evals.size(); ++i) {
    if (evals[i].test_loss < evals[best].test_loss) best = i;
  }
  EXPECT_EQ(run.best_step(), evals[best].step);
  EXPECT_EQ(run.best_metric(), evals[best].test_loss);
  EXPECT_EQ(world_range(static_cast<double>(run.best_step())).first,
            world_range(static_cast<double>(run.best_step())).second);
  const std::optional<std::string> pointed = find_best_checkpoint(config.checkpoint.dir);
  ASSERT_TRUE(pointed.has_value());
  EXPECT_EQ(std::filesystem::path(*pointed).filename().string(),
            checkpoint_file_name(evals[best].step));
  EXPECT_TRUE(std::filesystem::exists(*find_latest_checkpoint(config.checkpoint.dir)));
  // Rotation kept the best beside the latest, and only those (step 4 is the best here).
  ASSERT_LT(evals[best].step, 12) << "the loss fell at every step: rotation is not tested";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(config.checkpoint.dir)) {
    files += entry.path().extension() == ".h5";
  }
  EXPECT_EQ(files, 2);
  // The best checkpoint holds the best step's state: evaluating it gives the best loss.
  RunConfig from_best = config;
  from_best.checkpoint.dir = dir + "/from_best";
  std::filesystem::create_directories(from_best.checkpoint.dir);  // every rank: same path
  if (world_rank() == 0) {
    std::filesystem::copy_file(
        *pointed, from_best.checkpoint.dir + "/" + checkpoint_file_name(evals[best].step));
    std::ofstream(from_best.checkpoint.dir + "/latest")
        << checkpoint_file_name(evals[best].step) << "\n";
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  from_best.checkpoint.resume = true;
  TrainingRun resumed(from_best);
  EXPECT_EQ(resumed.steps_done(), evals[best].step);
  EXPECT_EQ(resumed.evaluate().test_loss, evals[best].test_loss);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// train.early_stopping = 2: with a learning rate too small to change a float parameter the
// test loss never improves after the first evaluation, so the run stops after evaluation 3
// (step 3) on every rank, saves there, and a resumed run stops at once.
TEST(TrainingRun, EarlyStoppingStopsEveryRankAtTheSameStep) {
  const int n = world_size();
  const std::string dir = fresh_run_dir("early_stopping");
  RunConfig config = small_config({{"dp", n}}, "dp");
  config.run.output_dir = dir;
  config.checkpoint.dir = dir + "/checkpoints";
  config.optimizer.kind = OptimizerKind::sgd;
  config.optimizer.momentum = 0.0;
  config.optimizer.lr = 1e-30;
  config.train.eval_every = 1;
  config.train.early_stopping = 2;
  config.train.steps = 20;
  {
    TrainingRun run(config);
    const RunSummary summary = run.train();
    EXPECT_TRUE(run.stopped_early());
    EXPECT_EQ(summary.steps_run, 3);
    const auto steps = world_range(static_cast<double>(run.steps_done()));
    EXPECT_EQ(steps, std::make_pair(3.0, 3.0));
    EXPECT_EQ(run.best_step(), 1);
  }
  RunConfig again = config;
  again.checkpoint.resume = true;
  TrainingRun resumed(again);
  EXPECT_EQ(resumed.steps_done(), 3);
  EXPECT_TRUE(resumed.finished());
  EXPECT_EQ(resumed.train().steps_run, 0);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// train.eval_every = "epoch" (issue 36, defect 21): an evaluation at the end of every epoch
// (64 rows in batches of 16 over 2 micro-batches: 2 steps an epoch) and at the end, each the
// same as with eval_every = 2 steps, on every mesh of the test's ranks.
TEST(TrainingRun, EvalEveryEpochEvaluatesAtEachEpochEnd) {
  const int n = world_size();
  const std::string dir = fresh_run_dir("eval_every_epoch");
  const auto evaluations = [&](bool each_epoch, int64_t every) {
    RunConfig config = small_config({{"fsdp", n}}, "fsdp");
    config.run.output_dir = dir;
    config.checkpoint.dir = dir + "/checkpoints";
    config.checkpoint.async = false;
    config.train.accumulation_steps = 2;
    config.train.steps = 7;
    config.train.eval_each_epoch = each_epoch;
    config.train.eval_every = every;
    std::vector<std::pair<int64_t, double>> seen;
    RunEvents events;
    events.on_eval = [&](const EvalEvent& e) { seen.emplace_back(e.step, e.test_loss); };
    TrainingRun run(config, events);
    EXPECT_EQ(run.schedule().steps_per_epoch(), 2);
    run.train();
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    if (world_rank() == 0) std::filesystem::remove_all(dir);
    return seen;
  };
  const auto by_epoch = evaluations(true, 0);
  std::vector<int64_t> steps;
  for (const auto& [step, loss] : by_epoch) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 4, 6, 7}));
  EXPECT_EQ(by_epoch, evaluations(false, 2));  // the same evaluations, to the bit
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
