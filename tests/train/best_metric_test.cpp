// The best evaluation across a resume (issue 36, item 6): a checkpoint stores the name of the
// metric its best value measures (/train_state attribute best_metric_name, a plain HDF5 string
// attribute), and a run resumed under another checkpoint.keep_best starts its best afresh
// instead of comparing an accuracy as a loss (or a loss as an accuracy), saying so in
// resume_note(); under the same keep_best the best carries over; a checkpoint saved before the
// name was stored still loads, and its best is dropped with a note. On a dp mesh of every
// world size (the best is the same on every rank).

#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/train/resume.hpp"
#include "run/training_run.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

std::string base_dir() {
  return std::filesystem::temp_directory_path().string() + "/meshtrain_best_metric_np" +
         std::to_string(world_size());
}

void barrier() {
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

// 4 classes of 8 inputs, class = the argmax of a fixed linear map of the row (learnable):
// 64 training rows, 32 test rows.
Dataset classes(int rows, int offset) {
  Dataset d;
  d.description = "the test's classes";
  d.num_samples = rows;
  d.features = 8;
  d.num_classes = 4;
  for (int r = 0; r < rows; ++r) {
    float score[4] = {0, 0, 0, 0};
    for (int f = 0; f < 8; ++f) {
      const float x = std::sin(0.7f * (r + offset) + 1.3f * f);
      d.inputs.push_back(x);
      score[f % 4] += x;
    }
    int best = 0;
    for (int c = 1; c < 4; ++c) best = score[c] > score[best] ? c : best;
    d.labels.push_back(best);
  }
  return d;
}

RunData data() {
  return RunData{classes(64, 0), classes(32, 1000)};
}

RunConfig config(const std::string& dir, EvalMetric keep_best, int64_t steps) {
  RunConfig c;
  c.file = "best_metric_test";
  c.run.seed = 7;
  c.run.output_dir = dir;
  c.checkpoint.dir = dir + "/checkpoints";
  c.checkpoint.keep_best = keep_best;
  c.mesh.axes = {{"dp", world_size()}};
  c.partition.preset = "dp";
  c.model.sizes = {8, 16, 4};
  c.data.batch_size = 16;
  c.optimizer.kind = OptimizerKind::adamw;
  c.optimizer.lr = 1e-2;
  c.train.steps = steps;
  c.train.log_every = 2;
  c.train.eval_every = 2;
  return c;
}

// Trains 6 steps under `keep_best` into `dir` (emptied first); returns the best value.
double train_six_steps(const std::string& dir, EvalMetric keep_best) {
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  barrier();
  TrainingRun run(config(dir, keep_best, 6), {}, data());
  run.train();
  EXPECT_FALSE(std::isnan(run.best_metric()));
  return run.best_metric();
}

// The string attribute /train_state/best_metric_name of the latest checkpoint in `dir`, read
// with the HDF5 library alone ("<absent>" when it has none).
std::string stored_metric_name(const std::string& dir) {
  const std::string path = *find_latest_checkpoint(dir + "/checkpoints");
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(file, 0) << path;
  std::string name = "<absent>";
  if (H5Aexists_by_name(file, "/train_state", "best_metric_name", H5P_DEFAULT) > 0) {
    const hid_t attribute =
        H5Aopen_by_name(file, "/train_state", "best_metric_name", H5P_DEFAULT, H5P_DEFAULT);
    const hid_t type = H5Aget_type(attribute);
    EXPECT_EQ(H5Tget_class(type), H5T_STRING);
    std::vector<char> text(H5Tget_size(type) + 1, '\0');
    const hid_t memory = H5Tcopy(type);
    H5Aread(attribute, memory, text.data());
    name = std::string(text.data());
    H5Tclose(memory);
    H5Tclose(type);
    H5Aclose(attribute);
  }
  H5Fclose(file);
  return name;
}

TEST(BestMetric, TheCheckpointNamesTheMetricOfItsBest) {
  const std::string dir = base_dir() + "/named";
  train_six_steps(dir, EvalMetric::test_accuracy);
  if (world_rank() == 0) {
    EXPECT_EQ(stored_metric_name(dir), "test_accuracy");
    const CheckpointInfo info = list_checkpoint(*find_latest_checkpoint(dir + "/checkpoints")).info;
    EXPECT_EQ(info.train_state.best_metric_name, "test_accuracy");
  }
  barrier();
  train_six_steps(dir, EvalMetric::test_loss);
  if (world_rank() == 0) EXPECT_EQ(stored_metric_name(dir), "test_loss");
  barrier();
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST(BestMetric, TheSameKeepBestCarriesTheBestOver) {
  const std::string dir = base_dir() + "/same";
  const double saved = train_six_steps(dir, EvalMetric::test_accuracy);
  RunConfig resumed_config = config(dir, EvalMetric::test_accuracy, 8);
  resumed_config.checkpoint.resume = true;
  TrainingRun resumed(resumed_config, {}, data());
  ASSERT_TRUE(resumed.resumed_from().has_value());
  EXPECT_EQ(resumed.best_metric(), saved);
  EXPECT_EQ(resumed.resume_note(), "");
  barrier();
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// Saved under `saved_metric`, resumed under `resumed_metric`: the best starts afresh (NaN), the
// note says why, and the first evaluation after the resume becomes the best (its step and its
// value by the new metric), so the `best` pointer names that step's checkpoint.
void expect_reset(EvalMetric saved_metric, EvalMetric resumed_metric) {
  const std::string dir = base_dir() + "/changed_" + to_string(saved_metric);
  train_six_steps(dir, saved_metric);
  RunConfig resumed_config = config(dir, resumed_metric, 8);
  resumed_config.checkpoint.resume = true;
  EvalEvent last;
  RunEvents events;
  events.on_eval = [&](const EvalEvent& e) { last = e; };
  {
    TrainingRun resumed(resumed_config, events, data());
    ASSERT_TRUE(resumed.resumed_from().has_value());
    EXPECT_TRUE(std::isnan(resumed.best_metric())) << resumed.best_metric();
    const std::string& note = resumed.resume_note();
    EXPECT_NE(note.find(std::string("the best ") + to_string(resumed_metric) + " starts afresh"),
              std::string::npos)
        << note;
    EXPECT_NE(note.find(std::string("is a ") + to_string(saved_metric)), std::string::npos) << note;
    EXPECT_NE(note.find("checkpoint.keep_best changed"), std::string::npos) << note;
    resumed.train();
    EXPECT_EQ(last.step, 8);
    EXPECT_EQ(resumed.best_step(), 8);
    EXPECT_EQ(resumed.best_metric(),
              resumed_metric == EvalMetric::test_loss ? last.test_loss : last.test_accuracy);
  }
  barrier();
  if (world_rank() == 0) {
    EXPECT_EQ(find_best_checkpoint(dir + "/checkpoints").value_or(""),
              dir + "/checkpoints/" + checkpoint_file_name(8));
    EXPECT_EQ(stored_metric_name(dir), to_string(resumed_metric));
    std::filesystem::remove_all(dir);
  }
  barrier();
}

TEST(BestMetric, AnAccuracyIsNotComparedAsALoss) {
  expect_reset(EvalMetric::test_accuracy, EvalMetric::test_loss);
}

TEST(BestMetric, ALossIsNotComparedAsAnAccuracy) {
  expect_reset(EvalMetric::test_loss, EvalMetric::test_accuracy);
}

// A checkpoint saved before the name was stored (the attribute deleted here) loads; its best
// cannot be compared, so it starts afresh, and the note says the name was not recorded.
TEST(BestMetric, ACheckpointWithoutTheNameLoadsAndStartsTheBestAfresh) {
  const std::string dir = base_dir() + "/unnamed";
  train_six_steps(dir, EvalMetric::test_loss);
  if (world_rank() == 0) {
    const std::string path = *find_latest_checkpoint(dir + "/checkpoints");
    const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(file, 0);
    EXPECT_GE(H5Adelete_by_name(file, "/train_state", "best_metric_name", H5P_DEFAULT), 0);
    H5Fclose(file);
    EXPECT_EQ(stored_metric_name(dir), "<absent>");
    EXPECT_EQ(list_checkpoint(path).info.train_state.best_metric_name, "");
  }
  barrier();
  // The checksums cover the datasets, not the attributes: the file still verifies.
  RunConfig resumed_config = config(dir, EvalMetric::test_loss, 8);
  resumed_config.checkpoint.resume = true;
  {
    TrainingRun resumed(resumed_config, {}, data());
    ASSERT_TRUE(resumed.resumed_from().has_value());
    EXPECT_EQ(resumed.steps_done(), 6);
    EXPECT_TRUE(std::isnan(resumed.best_metric()));
    EXPECT_NE(resumed.resume_note().find("does not record which metric it measured"),
              std::string::npos)
        << resumed.resume_note();
    resumed.train();
    EXPECT_EQ(resumed.best_step(), 8);
  }
  barrier();
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  barrier();
}

// One output's metric (issue 40, item 3) is its own metric: the saved best of test_r2[0]
// carries over to a run kept by test_r2[0], not to one kept by test_r2[1] or test_r2 (their
// values are of other numbers), whose best starts afresh with a note naming both.
TEST(BestMetric, OneOutputsMetricIsComparedOnlyWithTheSameOutputs) {
  TrainState saved;
  saved.best_metric = 0.75;
  saved.evals_since_best = 2;
  saved.best_metric_name = "test_r2[0]";
  const ResumedBest same = resumed_best(saved, EvalMetric{EvalMetric::Kind::r2, 0});
  EXPECT_EQ(same.metric, 0.75);
  EXPECT_EQ(same.evals_since, 2);
  EXPECT_EQ(same.note, "");
  for (const EvalMetric& other :
       {EvalMetric{EvalMetric::Kind::r2, 1}, EvalMetric{EvalMetric::Kind::r2, -1},
        EvalMetric{EvalMetric::Kind::mse, 0}}) {
    SCOPED_TRACE(to_string(other));
    const ResumedBest reset = resumed_best(saved, other);
    EXPECT_TRUE(std::isnan(reset.metric));
    EXPECT_EQ(reset.evals_since, 0);
    EXPECT_NE(reset.note.find("the best " + to_string(other) + " starts afresh"), std::string::npos)
        << reset.note;
    EXPECT_NE(reset.note.find("is a test_r2[0] (checkpoint.keep_best changed)"), std::string::npos)
        << reset.note;
  }
}

}  // namespace
}  // namespace meshtrain
