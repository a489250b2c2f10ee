// train()'s checkpoints as a user sees them (issue 20, bugs 1 and 2): a synchronous save is
// reported like an asynchronous one, and a run stopped by an agreed error (here a loss that
// became infinite) completes the save in flight, so the last good state is resumable.

#include <gtest/gtest.h>
#include <mpi.h>

#include <filesystem>
#include <string>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "run/training_run.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// A fresh directory per test and world size, removed by rank 0 after every rank is done.
class RunDirectory {
 public:
  explicit RunDirectory(const std::string& name)
      : path_(std::filesystem::temp_directory_path().string() + "/meshtrain_" + name + "_np" +
              std::to_string(world_size())) {
    if (world_rank() == 0) std::filesystem::remove_all(path_);
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  }
  ~RunDirectory() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(path_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

RunConfig small_config(const std::string& dir) {
  RunConfig config;
  config.file = "save_events_test";
  config.mesh.axes = {{"dp", world_size()}};
  config.partition.preset = "dp";
  config.model.sizes = {8, 16, 4};
  config.model.loss = LossKind::mse;
  config.data.source = DataSource::synthetic;
  config.data.synthetic_samples = 64;
  config.data.batch_size = 16;
  config.train.steps = 6;
  config.train.log_every = 1;
  config.run.output_dir = dir;
  config.checkpoint.dir = dir + "/checkpoints";
  config.checkpoint.every_steps = 2;
  return config;
}

TEST(SaveEvents, SynchronousSavesAreReported) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    RunDirectory dir(async ? "save_events_async" : "save_events_sync");
    RunConfig config = small_config(dir.path());
    config.checkpoint.async = async;
    std::vector<int64_t> saved;
    RunEvents events;
    events.on_checkpoint = [&](int64_t step, const std::string& path) {
      saved.push_back(step);
      EXPECT_TRUE(std::filesystem::exists(path)) << path;
    };
    TrainingRun run(config, events);
    run.train();
    EXPECT_EQ(saved, (std::vector<int64_t>{2, 4, 6}));
  }
}

// SGD at lr 10 diverges: the loss is infinite at step 4 (the reproduction), while
// step 2's checkpoint is being written. It is completed and `latest` names it.
TEST(SaveEvents, AnAgreedErrorCompletesTheSaveInFlight) {
  for (bool async : {true, false}) {
    SCOPED_TRACE(async ? "async" : "sync");
    RunDirectory dir(async ? "save_on_error_async" : "save_on_error_sync");
    RunConfig config = small_config(dir.path());
    config.checkpoint.async = async;
    config.optimizer.kind = OptimizerKind::sgd;
    config.optimizer.lr = 10.0;
    config.train.steps = 20;
    int64_t last_reported = 0;
    RunEvents events;
    events.on_checkpoint = [&](int64_t step, const std::string&) { last_reported = step; };
    TrainingRun run(config, events);
    try {
      run.train();
      FAIL() << "SGD at lr 10 did not diverge";
    } catch (const AgreedError& e) {
      EXPECT_NE(std::string(e.what()).find("the training loss became"), std::string::npos)
          << e.what();
    }
    const int64_t failed_at = run.steps_done() + 1;
    ASSERT_GT(failed_at, 2) << "the loss must stay finite until a checkpoint was started";
    const int64_t expected = (run.steps_done() / 2) * 2;  // the last save started
    EXPECT_EQ(last_reported, expected);
    const std::string ckpt = config.checkpoint.dir;
    const std::string name = "ckpt-" + std::string(6 - std::to_string(expected).size(), '0') +
                             std::to_string(expected) + ".h5";
    EXPECT_TRUE(std::filesystem::exists(ckpt + "/" + name)) << name;
    EXPECT_FALSE(std::filesystem::exists(ckpt + "/" + name + ".tmp")) << name;
    EXPECT_EQ(find_latest_checkpoint(ckpt), ckpt + "/" + name);
  }
}

}  // namespace
}  // namespace meshtrain
