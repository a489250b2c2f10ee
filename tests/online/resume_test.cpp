// Online training's checkpoints (docs/online.md, "Checkpoints"): one program splits
// MPI_COMM_WORLD into producers and a trainer, at every split the world allows (np 2: 1 + 1;
// np 3: 1 + 2 and 2 + 1; np 4: 2 + 2), so trainers 1 and 2 (two on dp and on tp) meet
// producers 1 and 2. Checked: a run saved once every row had come, then resumed beside
// producers that have nothing more to send, takes the same batches as the uninterrupted run
// (the same losses, parameters and held-out evaluation, bit for bit, and the same stream
// counters): its reservoir, held-out window and their counts came back with it; beside
// producers that send their rows again, they are counted on top of the saved ones; the
// checkpoint holds them under /stream (shapes, rows_seen); stream.checkpoint_buffer = false
// leaves them out; a checkpoint's buffers on another trainer count are refused in one sentence;
// a Predictor reads an online run's checkpoint. The registration's timeout ends any hang.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/stream/producer.hpp"
#include "framework/stream/stream_protocol.hpp"
#include "framework/stream/stream_source.hpp"
#include "run/predictor.hpp"
#include "run/training_run.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kInputs = 4, kOutputs = 2;
constexpr int64_t kRowsPerProducer = 160, kSteps = 24, kBufferRows = 40;

// One split of the world: producers are world ranks [0, producers), the trainer the rest.
struct Split {
  int producers = 1, trainers = 1;
  bool producer = false;
  MPI_Comm comm = MPI_COMM_NULL;  // this side's
  int rank = 0;                   // in comm
  Split(int p, int t) : producers(p), trainers(t) {
    producer = world_rank() < producers;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, producer ? 0 : 1, world_rank(), &comm),
              "MPI_Comm_split");
    MPI_Comm_rank(comm, &rank);
  }
  ~Split() { MPI_Comm_free(&comm); }
  Split(const Split&) = delete;
  Split& operator=(const Split&) = delete;
};

std::vector<std::pair<int, int>> splits() {
  switch (world_size()) {
    case 2:
      return {{1, 1}};
    case 3:
      return {{1, 2}, {2, 1}};
    case 4:
      return {{2, 2}};
    default:
      return {};
  }
}

// Producer p's row r, a smooth function of both.
void make_row(int64_t p, int64_t r, float* x, float* y) {
  const double t = 0.01 * static_cast<double>(r) + 0.37 * static_cast<double>(p);
  for (int64_t j = 0; j < kInputs; ++j) x[j] = static_cast<float>(std::sin(t * (j + 1)));
  for (int64_t o = 0; o < kOutputs; ++o) y[o] = static_cast<float>(std::cos(t + o));
}

// A producer's side: connect, send `rows` rows (none: a simulation that has finished), close.
// `before_close`: what the producer does between its last send and its close (which waits for
// the trainer to take it, at a pull: a barrier with the trainer goes before it).
void produce(const Split& split, const std::string& name, int64_t rows,
             const std::function<void()>& before_close = {}) {
  StreamProducerOptions options;
  options.message_rows = 8;
  options.backpressure = StreamBackpressure::block;
  StreamProducer producer;
  producer.connect(split.comm, name, kInputs, kOutputs, StreamDtype::float32, options);
  std::vector<float> x(8 * kInputs), y(8 * kOutputs);
  for (int64_t r = 0; r < rows; r += 8) {
    for (int64_t i = 0; i < 8; ++i) make_row(split.rank, r + i, &x[i * kInputs], &y[i * kOutputs]);
    producer.send(x.data(), y.data(), 8);
  }
  if (before_close) before_close();
  producer.close();
  EXPECT_EQ(producer.rows_dropped(), 0);
}

// A reservoir smaller than a group's rows and a held-out window smaller than its held-out
// rows: both overwrite, so their counts matter on resume.
// `tp`: the trainer's ranks on tp (one batch group whose ranks hold the same buffer) rather
// than dp (a group per rank).
RunConfig trainer_config(const std::string& name, int trainers, const std::string& dir,
                         bool tp = false) {
  RunConfig config;
  config.file = "resume_test";
  config.run.seed = 11;
  config.run.output_dir = dir + "/run";
  config.mesh.axes = {{tp ? "tp" : "dp", trainers}};
  config.model.sizes = {kInputs, 16, kOutputs};
  config.model.activation = Activation::tanh;
  config.model.loss = LossKind::mse;
  config.partition.preset = tp ? "tp" : "dp";
  config.data.source = DataSource::stream;
  config.data.batch_size = 8 * (tp ? 1 : trainers);
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-2;
  config.train.steps = kSteps;
  config.train.log_every = 1;
  config.checkpoint.dir = dir + "/checkpoints";
  config.stream.name = name;
  config.stream.buffer_rows = kBufferRows;
  config.stream.policy = StreamPolicy::reservoir;
  config.stream.test_fraction = 0.25;
  return config;
}

const StreamSource& stream_of(const TrainingRun& run) {
  return dynamic_cast<const StreamSource&>(run.train_data());
}

bool same_counters(const StreamCounters& a, const StreamCounters& b) {
  return a.rows_received == b.rows_received && a.rows_overwritten == b.rows_overwritten &&
         a.buffer_rows == b.buffer_rows && a.rows_held_out == b.rows_held_out;
}

// What the uninterrupted run did after its save.
struct Reference {
  int64_t saved_at = -1;
  std::vector<double> losses;  // of steps saved_at + 1 .. kSteps
  std::vector<std::vector<float>> params;
  double test_loss = 0.0;
  StreamCounters counters;
};

// The trainer's uninterrupted run: a save at the first step after which every row had come
// (no row changes the buffers after it), then on to kSteps.
Reference run_uninterrupted(const Split& split, const RunConfig& config) {
  Reference ref;
  TrainingRun run(config, {}, std::nullopt, split.comm);
  // The producers have sent every row (and closed) before the first step, so that on a loaded
  // machine every row still comes within the first steps (a pull takes 4 messages a producer).
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  const int64_t total = split.producers * kRowsPerProducer;
  for (int64_t s = 0; s < kSteps; ++s) {
    const double loss = run.step().loss;
    if (ref.saved_at >= 0) {
      ref.losses.push_back(loss);
    } else if (stream_of(run).counters().rows_received == total) {  // agreed over the trainer
      run.save();
      ref.saved_at = run.steps_done();
    }
  }
  ref.params = testing::copy_parameters(run);
  ref.test_loss = run.evaluate().test_loss;
  ref.counters = stream_of(run).counters();
  return ref;
}

TEST(StreamCheckpoint, ResumedRunContinuesWithItsBufferBitForBit) {
  for (const auto& [producers, trainers] : splits()) {
    for (const bool tp : {false, true}) {
      if (tp && trainers == 1) continue;
      SCOPED_TRACE(std::to_string(producers) + " producers, " + std::to_string(trainers) +
                   " trainer ranks" + (tp ? " on tp" : " on dp"));
      Split split(producers, trainers);
      TempDir dir(/*shared=*/true);
      const int64_t groups = tp ? 1 : trainers;
      const std::string name = "resume-" + std::to_string(producers) + "-" +
                               std::to_string(trainers) + (tp ? "-tp" : "");
      // The uninterrupted run, saving once every row had come.
      Reference ref;
      if (split.producer) {
        produce(split, name, kRowsPerProducer, [] {
          check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // run_uninterrupted's
        });
      } else {
        ref = run_uninterrupted(split, trainer_config(name, trainers, dir.path(), tp));
        ASSERT_GT(ref.saved_at, 0) << "not every row had come by step " << kSteps;
        ASSERT_LT(ref.saved_at, kSteps - 4);
        EXPECT_EQ(ref.counters.rows_received, producers * kRowsPerProducer);
        // Every group's reservoir chose (each took more than kBufferRows training rows).
        EXPECT_GT(ref.counters.rows_overwritten, 0);
        EXPECT_GT(ref.counters.rows_received - ref.counters.rows_held_out,
                  groups * (kBufferRows + 8));
      }
      // The checkpoint holds every group's buffers and counts.
      if (!split.producer && split.rank == 0) {
        const std::string file = *find_latest_checkpoint(dir.path() + "/checkpoints");
        std::vector<int64_t> x_shape, held_shape;
        for (const DatasetListing& d : list_checkpoint(file).datasets) {
          if (d.path == "/stream/x") x_shape = d.shape;
          if (d.path == "/stream/held_out_y") held_shape = d.shape;
        }
        EXPECT_EQ(x_shape, (std::vector<int64_t>{groups, kBufferRows, kInputs}));
        EXPECT_EQ(held_shape, (std::vector<int64_t>{groups, kBufferRows / 4, kOutputs}));
        const std::vector<int64_t> seen = read_stream_rows_seen(file);
        ASSERT_EQ(seen.size(), static_cast<size_t>(groups * 2));
        int64_t sum = 0;
        for (int64_t v : seen) sum += v;
        EXPECT_EQ(sum, producers * kRowsPerProducer);
        EXPECT_GT(verify_checkpoint(file), 0);
      }
      // Resumed beside producers that have nothing more to send.
      if (split.producer) {
        produce(split, name, 0);
      } else {
        RunConfig config = trainer_config(name, trainers, dir.path(), tp);
        config.checkpoint.resume = true;
        TrainingRun run(config, {}, std::nullopt, split.comm);
        ASSERT_TRUE(run.resumed_from().has_value());
        EXPECT_EQ(run.steps_done(), ref.saved_at);
        std::vector<double> losses;
        while (run.steps_done() < kSteps) losses.push_back(run.step().loss);
        EXPECT_EQ(losses, ref.losses) << "the resumed run took other batches";
        EXPECT_TRUE(testing::same_bits(testing::copy_parameters(run), ref.params));
        EXPECT_EQ(run.evaluate().test_loss, ref.test_loss) << "another held-out window";
        EXPECT_TRUE(same_counters(stream_of(run).counters(), ref.counters))
            << stream_of(run).counters().rows_received << " rows against "
            << ref.counters.rows_received;
      }
      // Resumed again from the same checkpoint beside producers that send their rows again: they
      // are new rows, added to the restored buffers, and the counters go on from the saved ones.
      if (split.producer) {
        produce(split, name, kRowsPerProducer);
      } else {
        RunConfig config = trainer_config(name, trainers, dir.path(), tp);
        config.checkpoint.resume = true;
        config.train.steps = 400;  // a longer run: until every new row has come
        TrainingRun run(config, {}, std::nullopt, split.comm);
        const int64_t expected = ref.counters.rows_received + producers * kRowsPerProducer;
        while (run.steps_done() < 400 && stream_of(run).counters().rows_received < expected) {
          run.step();
        }
        run.mark_completed();  // stopped early on purpose: the producers get done, not a stop
        EXPECT_EQ(stream_of(run).counters().rows_received, expected);
        EXPECT_GT(stream_of(run).counters().rows_overwritten, ref.counters.rows_overwritten);
      }
      // A Predictor reads the online run's checkpoint (its /stream group aside).
      if (!split.producer) {
        const std::string file = *find_latest_checkpoint(dir.path() + "/checkpoints");
        Predictor predictor(file, 8, {}, split.comm);
        Kokkos::View<float**, Kokkos::HostSpace> x("x", predictor.local_rows(), kInputs);
        Kokkos::View<float**, Kokkos::HostSpace> y("y", predictor.local_rows(), kOutputs);
        for (int64_t i = 0; i < predictor.local_rows(); ++i) make_row(0, i, &x(i, 0), &y(i, 0));
        EXPECT_EQ(predictor.predict(x, y), predictor.local_rows());
        EXPECT_TRUE(std::isfinite(y(0, 0)));
      }
      check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    }
  }
}

// stream.checkpoint_buffer = false: the checkpoint holds no /stream group, and a run resumed
// from it starts with empty buffers (here fed again by its producers), with a warning.
TEST(StreamCheckpoint, BufferLeftOutWhenTurnedOff) {
  for (const auto& [producers, trainers] : splits()) {
    SCOPED_TRACE(std::to_string(producers) + " producers, " + std::to_string(trainers) +
                 " trainer ranks");
    Split split(producers, trainers);
    TempDir dir(/*shared=*/true);
    const std::string name = "off-" + std::to_string(producers) + "-" + std::to_string(trainers);
    if (split.producer) {
      produce(split, name, kRowsPerProducer);
    } else {
      RunConfig config = trainer_config(name, trainers, dir.path());
      config.stream.checkpoint_buffer = false;
      TrainingRun run(config, {}, std::nullopt, split.comm);
      run.step();
      run.save();
      run.mark_completed();  // one step on purpose: the producers get done, not a stop
    }
    if (!split.producer && split.rank == 0) {
      for (const DatasetListing& d :
           list_checkpoint(*find_latest_checkpoint(dir.path() + "/checkpoints")).datasets) {
        EXPECT_NE(d.path.rfind("/stream", 0), 0u) << d.path;
      }
    }
    // Resumed with the key back on: empty buffers, refilled by the producers.
    if (split.producer) {
      produce(split, name, kRowsPerProducer);
    } else {
      RunConfig config = trainer_config(name, trainers, dir.path());
      config.checkpoint.resume = true;
      TrainingRun run(config, {}, std::nullopt, split.comm);
      ASSERT_TRUE(run.resumed_from().has_value());
      if (split.rank == 0) {
        EXPECT_TRUE(
            std::any_of(run.warnings().begin(), run.warnings().end(), [](const std::string& w) {
              return w.find("holds no buffer of stream") != std::string::npos;
            }));
      }
      run.step();
      run.mark_completed();
      EXPECT_LE(stream_of(run).counters().rows_received, producers * kRowsPerProducer);
    }
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  }
}

// Buffers saved by two batch groups, resumed on a trainer of one: refused in one sentence
// naming both shapes and the way out (they are not redistributed).
TEST(StreamCheckpoint, AnotherTrainerCountIsRefused) {
  for (const auto& [producers, trainers] : splits()) {
    if (trainers != 2) continue;
    Split split(producers, trainers);
    TempDir dir(/*shared=*/true);
    const std::string name = "refused-" + std::to_string(producers);
    if (split.producer) {
      produce(split, name, kRowsPerProducer);
    } else {
      TrainingRun run(trainer_config(name, trainers, dir.path()), {}, std::nullopt, split.comm);
      run.step();
      run.save();
      run.mark_completed();  // one step on purpose: the producers get done, not a stop
    }
    // Trainer rank 0 alone resumes; trainer rank 1 only takes part in the rendezvous.
    if (split.producer) {
      produce(split, name, 0);
    } else if (split.rank == 0) {
      RunConfig config = trainer_config(name, 1, dir.path());
      config.data.batch_size = 16;  // the batch saved (another is refused before the buffers)
      config.checkpoint.resume = true;
      testing::expect_bad_input([&] { TrainingRun run(config, {}, std::nullopt, MPI_COMM_SELF); },
                                {"holds stream buffers /stream/x of shape [2, 40, 4]",
                                 "this run keeps [1, 40, 4]", "resume on the trainer mesh"});
    } else {
      stream_protocol::Hello none;  // neither producer nor trainer
      MPI_Comm stream_comm = MPI_COMM_NULL;
      stream_protocol::rendezvous(MPI_COMM_WORLD, none, &stream_comm);
      MPI_Comm_free(&stream_comm);
    }
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  }
}

// The buffer's own state: restored from a copy of its slots and its row count, a reservoir
// (and a window) goes on exactly as the buffer that never stopped.
TEST(StreamCheckpoint, RestoredBufferContinuesExactly) {
  for (StreamPolicy policy : {StreamPolicy::reservoir, StreamPolicy::window}) {
    StreamBuffer whole(16, 1, 1, policy, 7, 1), first(16, 1, 1, policy, 7, 1);
    for (int64_t n = 0; n < 100; ++n) {
      const float v = static_cast<float>(n);
      whole.add(&v, &v);
      if (n < 40) first.add(&v, &v);
    }
    StreamBuffer resumed(16, 1, 1, policy, 7, 1);
    std::copy(first.x(0), first.x(0) + 16, resumed.x_data());
    std::copy(first.y(0), first.y(0) + 16, resumed.y_data());
    resumed.restore_seen(first.seen());
    for (int64_t n = 40; n < 100; ++n) {
      const float v = static_cast<float>(n);
      resumed.add(&v, &v);
    }
    EXPECT_TRUE(std::equal(whole.x(0), whole.x(0) + 16, resumed.x(0)));
    EXPECT_EQ(resumed.seen(), whole.seen());
    EXPECT_EQ(resumed.filled(), whole.filled());
    EXPECT_EQ(resumed.overwritten(), whole.overwritten());
  }
}

}  // namespace
}  // namespace meshtrain
