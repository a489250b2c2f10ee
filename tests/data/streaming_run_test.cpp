// TrainingRun on streamed HDF5 data: a run on the HDF5 file(s) trains bit for bit like a
// run on the same rows given in memory (RunData), on dp and fsdp meshes, with and without
// prefetch, from one contiguous file and from gzip-chunked shards named by a glob, and
// like a one-rank run computed in the same test; a run resumed from a checkpoint mid-epoch
// or at an epoch boundary continues exactly; a data file that changes size, or a read that
// fails on some ranks only, ends the run on every rank with the same AgreedError (no hang).

#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "run/training_run.hpp"
#include "tests/support/agreed_error.hpp"
#include "tests/support/datasets.hpp"
#include "tests/support/hdf5_files.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::H5Layout;
using testing::TempDir;
using testing::varied_classes;
using testing::write_h5;
using testing::write_h5_shards;

// A rank that waits in a collective for one that took another path fails in seconds, not
// after the default 300 s.
const bool kShortTimeout = [] {
  ::setenv("MESHTRAIN_COLLECTIVE_TIMEOUT", "30", /*overwrite=*/0);
  return true;
}();

void barrier() {
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

// 96 training rows (6 steps of 16 per epoch) and 40 test rows of 12 features, 4 classes.
Dataset train_rows() {
  return varied_classes(96, 12, 4);
}
Dataset test_rows() {
  Dataset d = varied_classes(40, 12, 4);
  for (float& v : d.inputs) v = 1.0f - v;
  return d;
}

// The files of one test, written by rank 0: one contiguous file, three gzip-chunked
// shards (named by a glob), the test split.
struct Files {
  TempDir dir{/*shared=*/true};
  std::string one, shards_glob, test;
  Files() {
    one = dir.file("one.h5");
    shards_glob = dir.file("shard-*.h5");
    test = dir.file("test.h5");
    if (world_rank() == 0) {
      write_h5(one, train_rows());
      H5Layout chunked;
      chunked.chunked = true;
      write_h5_shards(dir.path(), "shard", train_rows(), 3, chunked);
      write_h5(test, test_rows());
    }
    barrier();
  }
};

RunConfig stream_config(std::vector<std::pair<std::string, int>> axes, const std::string& preset,
                        std::vector<std::string> paths, const std::string& test_path) {
  RunConfig config;
  config.file = "streaming_run_test";
  config.run.seed = 5;
  config.mesh.axes = std::move(axes);
  config.model.sizes = {12, 16, 4};
  config.model.activation = Activation::tanh;
  config.partition.preset = preset;
  config.partition.min_sharding_size = 0;
  config.data.source = DataSource::hdf5;
  config.data.path = std::move(paths);
  if (!test_path.empty()) config.data.test_path = {test_path};
  config.data.batch_size = 16;
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-2;
  config.train.steps = 9;
  config.train.log_every = 100;
  return config;
}

struct Trace {
  std::vector<double> losses;
  EvalEvent eval;
};

Trace run_steps(const RunConfig& config, std::optional<RunData> data, MPI_Comm comm, int steps) {
  TrainingRun run(config, {}, std::move(data), comm);
  Trace trace;
  for (int s = 0; s < steps; ++s) trace.losses.push_back(run.step().loss);
  trace.eval = run.evaluate();
  return trace;
}

using testing::MeshCase;

// The same rows streamed from HDF5 and given in memory train identically, bit for bit,
// and like one rank.
TEST(StreamingRun, HdfFilesTrainLikeTheRowsInMemory) {
  const int n = world_size();
  Files files;
  const std::vector<MeshCase> meshes = {{"dp", {{"dp", n}}}, {"fsdp", {{"fsdp", n}}}};
  for (ShuffleMode mode : {ShuffleMode::rows, ShuffleMode::blocks}) {
    RunConfig base = stream_config({{"dp", 1}}, "dp", {files.one}, files.test);
    base.data.shuffle = mode;
    base.data.block_rows = 8;  // 12 blocks in windows of 2
    base.data.shuffle_window = 2;
    const Trace reference = run_steps(base, RunData{train_rows(), test_rows()}, MPI_COMM_SELF, 3);
    for (const MeshCase& m : meshes) {
      for (int64_t prefetch : {0, 2}) {
        RunConfig config = base;
        config.mesh.axes = m.axes;
        config.partition.preset = m.preset;
        config.data.prefetch = prefetch;
        const Trace memory =
            run_steps(config, RunData{train_rows(), test_rows()}, MPI_COMM_WORLD, 3);
        for (const std::string& path : {files.one, files.shards_glob}) {
          SCOPED_TRACE(m.preset + ", shuffle " + to_string(mode) + ", prefetch " +
                       std::to_string(prefetch) + ", " + path);
          config.data.path = {path};
          const Trace streamed = run_steps(config, std::nullopt, MPI_COMM_WORLD, 3);
          EXPECT_EQ(streamed.losses, memory.losses);
          EXPECT_EQ(streamed.eval.test_loss, memory.eval.test_loss);
          EXPECT_EQ(streamed.eval.test_accuracy, memory.eval.test_accuracy);
          ASSERT_EQ(streamed.losses.size(), reference.losses.size());
          for (size_t s = 0; s < streamed.losses.size(); ++s) {
            EXPECT_NEAR(streamed.losses[s], reference.losses[s],
                        1e-5 * (1 + std::abs(reference.losses[s])))
                << "step " << s + 1;
          }
          EXPECT_NEAR(streamed.eval.test_loss, reference.eval.test_loss,
                      1e-5 * (1 + std::abs(reference.eval.test_loss)));
        }
      }
    }
  }
}

// What a streamed run holds: the sources' scratch and the staging of its prefetch depth,
// not the data set.
TEST(StreamingRun, HoldsStagingNotTheDataSet) {
  const int n = world_size();
  Files files;
  RunConfig config = stream_config({{"dp", n}}, "dp", {files.one}, files.test);
  TrainingRun streamed(config);
  TrainingRun memory(config, {}, RunData{train_rows(), test_rows()});
  EXPECT_EQ(streamed.train_data().shape().num_samples, 96);
  EXPECT_EQ(streamed.schedule().steps_per_epoch(), 6);
  EXPECT_EQ(streamed.batch_slice().rows, 16 / n);
  EXPECT_GT(streamed.data_bytes(), 0);
  EXPECT_LT(streamed.train_data().resident_bytes(), 96 * 12 * 4);
  EXPECT_GE(memory.train_data().resident_bytes(), 96 * 12 * 4);
  EXPECT_LT(streamed.data_bytes(), memory.data_bytes());
}

// Resumed mid-epoch (3), at the epoch boundary (6) and mid-epoch after it (8), the steps
// up to 9 equal those of a run that was never interrupted, whatever the prefetch depth of
// either leg, in both shuffled orders.
TEST(StreamingRun, ResumesExactlyMidEpochAndAcrossEpochs) {
  const int n = world_size();
  Files files;
  for (ShuffleMode mode : {ShuffleMode::rows, ShuffleMode::blocks}) {
    RunConfig config = stream_config({{"fsdp", n}}, "fsdp", {files.shards_glob}, files.test);
    config.data.shuffle = mode;
    config.data.block_rows = 8;
    config.data.shuffle_window = 2;
    const Trace uninterrupted = run_steps(config, std::nullopt, MPI_COMM_WORLD, 9);
    for (int resume_at : {3, 6, 8}) {
      SCOPED_TRACE(std::string("shuffle ") + to_string(mode) + ", resumed at step " +
                   std::to_string(resume_at));
      TempDir out(/*shared=*/true);
      RunConfig first = config;
      first.run.output_dir = out.path();
      first.train.steps = resume_at;
      first.data.prefetch = resume_at == 6 ? 0 : 2;
      {
        TrainingRun run(first);
        const RunSummary summary = run.train();
        EXPECT_EQ(summary.steps_run, resume_at);
      }
      if (world_rank() == 0) {  // the log event says how long the steps waited for data
        std::ifstream metrics(out.file("metrics.jsonl"));
        std::string text((std::istreambuf_iterator<char>(metrics)),
                         std::istreambuf_iterator<char>());
        EXPECT_NE(text.find("\"data_wait_s\""), std::string::npos) << text;
      }
      RunConfig second = config;
      second.run.output_dir = out.path();
      second.checkpoint.resume = true;
      second.data.prefetch = resume_at == 8 ? 0 : 2;
      TrainingRun resumed(second);
      ASSERT_TRUE(resumed.resumed_from().has_value());
      EXPECT_EQ(resumed.resumed_from()->train_state.data_order, resumed.schedule().order().name());
      EXPECT_EQ(resumed.steps_done(), resume_at);
      for (int s = resume_at; s < 9; ++s) {
        EXPECT_EQ(resumed.step().loss, uninterrupted.losses[s]) << "step " << s + 1;
      }
      EXPECT_TRUE(resumed.finished());
      EXPECT_EQ(resumed.evaluate().test_loss, uninterrupted.eval.test_loss);
    }
  }
}

// dp, fsdp, tp, and fsdp x tp from np 4.
std::vector<MeshCase> every_mesh(int n) {
  return n > 2 ? testing::every_mesh(n) : testing::one_axis_meshes(n);
}

// The data wait is the slowest rank's: the last rank's reader is held up (its HDF5 lock
// taken for a while by another thread after step 2), and every rank's summary reports a
// wait, the same on every rank, and the sum of the log events' waits.
TEST(StreamingRun, TheDataWaitIsTheSlowestRanks) {
  const int n = world_size();
  Files files;
  TempDir out(/*shared=*/true);
  RunConfig config = stream_config({{"dp", n}}, "dp", {files.shards_glob}, "");
  config.run.output_dir = out.path();
  config.train.steps = 6;
  config.train.log_every = 1;
  double logged = 0.0;
  std::thread holder;
  RunEvents events;
  events.on_log = [&](const LogEvent& e) {
    logged += e.data_wait_s;  // windows of one step
    if (e.step != 2 || world_rank() != n - 1) return;
    // The gzip shards are read under the HDF5 lock: the reader stops at its next batch.
    std::promise<void> taken;
    holder = std::thread([&taken] {
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      taken.set_value();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
    taken.get_future().wait();
  };
  RunSummary summary;
  {
    TrainingRun run(config, events);
    summary = run.train();
  }
  if (holder.joinable()) holder.join();
  EXPECT_GT(summary.data_wait_s, 0.0);
  EXPECT_DOUBLE_EQ(summary.data_wait_s, logged);
  double low = 0.0, high = 0.0;
  MPI_Allreduce(&summary.data_wait_s, &low, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&summary.data_wait_s, &high, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(low, high);
}

// A data file cut or grown during the run: the next batch read from it fails (the size
// check, or a pread past the end of a cut file), the loss is poisoned, and every rank throws the
// same runtime AgreedError naming the file, within the prefetch depth's steps.
TEST(StreamingRun, AFileThatChangesSizeEndsTheRunOnEveryRank) {
  const int n = world_size();
  TempDir dir(/*shared=*/true);
  for (const MeshCase& m : every_mesh(n)) {
    for (int64_t prefetch : {0, 2}) {
      for (bool grow : {false, true}) {
        SCOPED_TRACE(m.preset + ", prefetch " + std::to_string(prefetch) +
                     (grow ? ", grown" : ", cut"));
        const std::string path = dir.file("changing.h5");
        if (world_rank() == 0) write_h5(path, train_rows());
        barrier();
        RunConfig config = stream_config(m.axes, m.preset, {path}, "");
        config.data.prefetch = prefetch;
        TrainingRun run(config);
        run.step();
        barrier();
        if (world_rank() == 0) {
          const auto size = std::filesystem::file_size(path);
          std::filesystem::resize_file(path, grow ? size + 100 : size - 100);
        }
        barrier();
        int64_t steps = 1;
        const std::string message = testing::expect_agreed_error(
            [&] {
              for (; steps < 8; ++steps) run.step();
            },
            ErrorKind::runtime);
        EXPECT_NE(message.find(path), std::string::npos) << message;
        // The size check before the reads, or (a read ahead racing the change) a pread
        // past the new end.
        EXPECT_TRUE(message.find("changed size") != std::string::npos ||
                    message.find("the file ends there") != std::string::npos)
            << message;
        // Batches read ahead before the change were fine: at most `prefetch` more steps.
        EXPECT_LE(steps, 1 + prefetch) << message;
      }
    }
  }
}

// Ranks that read other files (here the last rank's has a NaN in every row: node-local
// copies that differ, an I/O error on one node): the failing rank poisons the loss, and
// every rank, its tp partners included, throws the failing rank's error, in training and
// in evaluation.
TEST(StreamingRun, AReadErrorOnOneRankIsAgreedByAll) {
  const int n = world_size();
  Files files;
  // The training and the test rows, each with a NaN in every row.
  const std::string bad = files.dir.file("nan.h5"), bad_test = files.dir.file("nan_test.h5");
  if (world_rank() == 0) {
    for (Dataset rows : {train_rows(), test_rows()}) {
      for (int64_t s = 0; s < rows.num_samples; ++s) {
        rows.inputs[s * rows.features + 5] = std::numeric_limits<float>::quiet_NaN();
      }
      write_h5(rows.num_samples == 96 ? bad : bad_test, rows);
    }
  }
  barrier();
  const bool last = world_rank() == n - 1;
  for (const MeshCase& m : every_mesh(n)) {
    for (int64_t prefetch : {0, 2}) {
      SCOPED_TRACE(m.preset + ", prefetch " + std::to_string(prefetch));
      {
        RunConfig config = stream_config(m.axes, m.preset, {last ? bad : files.one}, "");
        config.data.prefetch = prefetch;
        TrainingRun run(config);
        const std::string message =
            testing::expect_agreed_error([&] { run.step(); }, ErrorKind::runtime);
        EXPECT_NE(message.find(bad), std::string::npos) << message;
        EXPECT_NE(message.find("finite"), std::string::npos) << message;
      }
      {
        RunConfig config =
            stream_config(m.axes, m.preset, {files.one}, last ? bad_test : files.test);
        config.data.prefetch = prefetch;
        TrainingRun run(config);
        run.step();
        const std::string message =
            testing::expect_agreed_error([&] { run.evaluate(); }, ErrorKind::runtime);
        EXPECT_NE(message.find(bad_test), std::string::npos) << message;
      }
    }
  }
}

// Set-up errors are bad input agreed by every rank: a missing shard, a glob matching
// nothing (naming data.path), a shard of another width.
TEST(StreamingRun, BadFilesAreAgreedBadInput) {
  const int n = world_size();
  Files files;
  const std::string narrow = files.dir.file("narrow.h5");
  if (world_rank() == 0) write_h5(narrow, varied_classes(20, 11, 4));
  barrier();
  const auto agreed = [&](std::vector<std::string> paths) {
    const RunConfig config = stream_config({{"dp", n}}, "dp", std::move(paths), files.test);
    return testing::expect_agreed_error([&] { TrainingRun run(config); }, ErrorKind::bad_input);
  };
  const std::string missing = files.dir.file("missing.h5");
  std::string message = agreed({files.one, missing});
  EXPECT_NE(message.find(missing), std::string::npos) << message;
  message = agreed({files.dir.file("nothing-*.h5")});
  EXPECT_NE(message.find("data.path"), std::string::npos) << message;
  message = agreed({files.one, narrow});
  EXPECT_NE(message.find(narrow), std::string::npos) << message;
}

// Ranks that see different data (a node-local copy of another size) are refused at set-up,
// on every rank, instead of training on different schedules until a collective times out.
TEST(StreamingRun, RanksThatSeeOtherDataAreAgreedBadInput) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  Dataset train = train_rows();
  if (world_rank() == n - 1) {  // the last rank's copy has 16 rows fewer
    train.num_samples -= 16;
    train.inputs.resize(static_cast<size_t>(train.num_samples * train.features));
    train.labels.resize(static_cast<size_t>(train.num_samples));
  }
  RunConfig config = stream_config({{"dp", n}}, "dp", {}, "");
  config.data.source = DataSource::synthetic;  // unused: the rows are given
  const std::string message = testing::expect_agreed_error(
      [&] {
        TrainingRun run(config, {}, RunData{train, test_rows()});
      },
      ErrorKind::bad_input);
  EXPECT_NE(message.find("training rows differ between 80 and 96"), std::string::npos) << message;
}

}  // namespace
}  // namespace meshtrain
