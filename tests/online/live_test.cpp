// The trainer's model back in the simulation (docs/online.md): one program splits
// MPI_COMM_WORLD into producers (the first half of the ranks, rounded down) and a trainer (the
// rest) with stream.publish_every set. Checked, on every trainer mesh (dp; and fsdp, tp with two
// trainer ranks): a LiveModel is not ready before the first publish (predict throws the
// sentence); its versions rise and each comes from step version x publish_every; refresh()
// allocates nothing; after its last publish it predicts bit for bit what a Predictor on the
// checkpoint of the same step predicts (same weights, same dp mesh of the producers, same
// kernels: nothing may differ); and a producer that never takes a publish (a model of ~270 KB,
// past MPI's eager sends) does not hold the trainer back, and still gets the newest publish
// when it closes. A bf16 trainer's publish leaves the optimizer's 16-bit weight copies current.
// The registration's timeout ends any hang.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint.hpp"
#include "run/training_run.hpp"
#include "stream.h"
#include "stream.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kInputs = 4, kOutputs = 2, kPublishEvery = 3;

// Who is who: producers are world ranks [0, P), the trainer [P, world).
struct Roles {
  int producers = 1, trainers = 1;
  bool producer = false;
  MPI_Comm comm = MPI_COMM_NULL;  // this side's
  int rank = 0;                   // in comm
  Roles() {
    producers = std::max(1, world_size() / 2);
    trainers = world_size() - producers;
    producer = world_rank() < producers;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, producer ? 0 : 1, world_rank(), &comm),
              "MPI_Comm_split");
    MPI_Comm_rank(comm, &rank);
  }
  ~Roles() { MPI_Comm_free(&comm); }
};

// `rows` rows of producer p from row `first`: a smooth function the model can learn.
void make_rows(int64_t p, int64_t first, int64_t rows, std::vector<float>& x,
               std::vector<float>& y) {
  x.resize(static_cast<size_t>(rows * kInputs));
  y.resize(static_cast<size_t>(rows * kOutputs));
  for (int64_t i = 0; i < rows; ++i) {
    const double t = 0.01 * static_cast<double>(first + i) + 0.37 * static_cast<double>(p);
    for (int64_t j = 0; j < kInputs; ++j) {
      x[static_cast<size_t>(i * kInputs + j)] = static_cast<float>(std::sin(t * (j + 1)));
    }
    for (int64_t o = 0; o < kOutputs; ++o) {
      y[static_cast<size_t>(i * kOutputs + o)] = static_cast<float>(std::cos(t + o));
    }
  }
}

RunConfig trainer_config(const std::string& name, const testing::MeshCase& mesh,
                         const std::string& dir, std::vector<int64_t> sizes) {
  RunConfig config;
  config.file = "live_test";
  config.run.seed = 5;
  config.mesh.axes = mesh.axes;
  config.model.sizes = std::move(sizes);
  config.model.activation = Activation::tanh;
  config.model.loss = LossKind::mse;
  config.partition.preset = mesh.preset;
  config.partition.min_sharding_size = 0;
  config.data.source = DataSource::stream;
  config.data.batch_size = 8;
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-2;
  config.train.log_every = 1;
  config.stream.name = name;
  config.stream.buffer_rows = 256;
  config.stream.min_rows = 8;
  config.stream.publish_every = kPublishEvery;
  config.run.output_dir = dir + "/run";
  config.checkpoint.dir = dir + "/run/checkpoints";
  return config;
}

std::vector<testing::MeshCase> trainer_meshes(int trainers) {
  if (trainers == 1) return {{"dp", {{"dp", 1}}}};
  return testing::one_axis_meshes(trainers);  // dp, fsdp, tp
}

StreamProducerOptions blocking_options() {
  StreamProducerOptions options;
  options.message_rows = 8;
  options.ring_rows = 64;
  options.backpressure = StreamBackpressure::block;
  return options;
}

// The overrides that put a checkpoint's model on the LiveModel's mesh: dp over the producers.
std::vector<std::string> whole_model_overrides(int producers) {
  return {"mesh.dp=" + std::to_string(producers), "mesh.fsdp=1", "mesh.tp=1"};
}

// The trainer's side of the LiveModel tests: until every producer closed, a publish and a
// checkpoint every kPublishEvery steps; its publish counters checked; then the barrier after
// which the producers read the checkpoints.
void train_until_closed(const Roles& roles, const testing::MeshCase& mesh, const std::string& dir,
                        const std::string& name) {
  RunConfig config = trainer_config(name, mesh, dir, {kInputs, 32, kOutputs});
  config.checkpoint.every_steps = kPublishEvery;  // a checkpoint at every publish's step
  config.checkpoint.keep = 1000000;
  config.stream.until = StreamUntil::closed;
  config.train.steps = 1000000;
  {
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    const RunSummary summary = run.train();
    const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
    if (roles.rank == 0) {
      EXPECT_EQ(source.counters().publishes, summary.steps_run / kPublishEvery);
      EXPECT_GE(source.counters().publishes_sent, 1);
      // metrics.jsonl carries the publishes.
      std::ifstream metrics(dir + "/run/metrics.jsonl");
      std::string line, last;
      while (std::getline(metrics, line)) {
        if (line.find("\"stream_publishes\"") != std::string::npos) last = line;
      }
      EXPECT_NE(last.find("\"stream_publishes_sent\""), std::string::npos) << last;
    }
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the checkpoints are written
}

TEST(LiveModel, FollowsThePublishesAndEqualsPredictOnTheCheckpointOfItsStep) {
  Roles roles;
  for (const testing::MeshCase& mesh : trainer_meshes(roles.trainers)) {
    SCOPED_TRACE("trainer mesh " + mesh.preset);
    TempDir dir(/*shared=*/true);
    const std::string name = "live-" + mesh.preset;
    if (!roles.producer) {
      train_until_closed(roles, mesh, dir.path(), name);
      continue;
    }

    StreamProducer producer;
    producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32, blocking_options());
    LiveModel live(producer);
    EXPECT_FALSE(live.ready());
    EXPECT_EQ(live.version(), 0);
    Kokkos::View<float**, Kokkos::HostSpace> x("x", live.local_rows(), kInputs);
    Kokkos::View<float**, Kokkos::HostSpace> y_live("y_live", live.local_rows(), kOutputs);
    Kokkos::deep_copy(x, 0.25f);
    try {
      live.predict(x, y_live);
      ADD_FAILURE() << "predict before any publish did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("has published no weights yet"), std::string::npos)
          << e.what();
    }

    std::vector<float> xs, ys;
    long heap = 0, kokkos = 0;
    int64_t taken = 0, last_version = 0;
    const auto refresh = [&] {
      testing::AllocationWindow window;
      const bool changed = live.refresh();
      heap += window.close();
      kokkos += window.kokkos_allocations();
      if (!changed) return;
      ++taken;
      EXPECT_GT(live.version(), last_version);
      EXPECT_EQ(live.step(), live.version() * kPublishEvery) << "version " << live.version();
      last_version = live.version();
    };
    // Rows while refreshing between sends, then (the trainer going on over its buffer) until
    // a few publishes were taken.
    for (int64_t first = 0; first < 400; first += 8) {
      make_rows(roles.rank, first, 8, xs, ys);
      producer.send(xs.data(), ys.data(), 8);
      refresh();
    }
    while (live.version() < 4) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      refresh();
    }
    producer.close();  // takes the publishes until the trainer's end
    refresh();
    EXPECT_GE(taken, 2);
    EXPECT_EQ(heap, 0) << "heap allocations in " << taken << " refreshes that took weights";
    EXPECT_EQ(kokkos, 0) << "Kokkos allocations in refresh()";
    ASSERT_TRUE(live.ready());

    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the trainer's run has ended
    const std::string checkpoint =
        dir.path() + "/run/checkpoints/" + checkpoint_file_name(live.step());
    Predictor reference(checkpoint, live.batch_size(), whole_model_overrides(roles.producers),
                        roles.comm);
    EXPECT_EQ(reference.step(), live.step());
    for (int64_t i = 0; i < live.local_rows(); ++i) {
      for (int64_t j = 0; j < kInputs; ++j) {
        x(i, j) = static_cast<float>(std::sin(0.3 * static_cast<double>(i + 7 * j + roles.rank)));
      }
    }
    Kokkos::View<float**, Kokkos::HostSpace> y_ref("y_ref", live.local_rows(), kOutputs);
    live.predict(x, y_live);
    reference.predict(x, y_ref);
    EXPECT_EQ(std::memcmp(y_live.data(), y_ref.data(), y_live.size() * sizeof(float)), 0)
        << "the LiveModel of step " << live.step() << " against its checkpoint: " << y_live(0, 0)
        << " against " << y_ref(0, 0);
  }
}

TEST(LiveModel, AProducerThatNeverTakesAPublishDoesNotHoldTheTrainer) {
  Roles roles;
  const int64_t steps = 25;
  for (const testing::MeshCase& mesh : trainer_meshes(roles.trainers)) {
    SCOPED_TRACE("trainer mesh " + mesh.preset);
    TempDir dir(/*shared=*/true);
    const std::string name = "idle-" + mesh.preset;
    if (!roles.producer) {
      // 4 x 256 x 256 x 2: ~67k parameters, a publish of ~270 KB, past any eager send.
      RunConfig config = trainer_config(name, mesh, dir.path(), {kInputs, 256, 256, kOutputs});
      config.stream.publish_every = 1;
      config.train.steps = steps;
      TrainingRun run(config, {}, std::nullopt, roles.comm);
      const RunSummary summary = run.train();
      EXPECT_EQ(summary.steps_run, steps);
      const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
      if (roles.rank == 0) EXPECT_EQ(source.counters().publishes, steps);
      // Every step ran and published while producer 0 took nothing (it waits here).
      check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      continue;  // the run's end takes the producers' closes and sends the end
    }
    StreamProducer producer;
    producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32, blocking_options());
    std::vector<float> xs, ys;
    for (int64_t first = 0; first < 64; first += 8) {
      make_rows(roles.rank, first, 8, xs, ys);
      producer.send(xs.data(), ys.data(), 8);
    }
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the trainer trained every step
    producer.close();
    // The newest publish replaced the older ones and reached producer 0 as it closed.
    if (roles.rank == 0) EXPECT_EQ(producer.latest_version(), steps);
  }
}

// A publish reads the parameters and writes none: the 16-bit copies the optimizer wrote in the
// step (bf16, fsdp's weights gathered over one group; tp's where gemm() reads 16 bits) stay
// current after it, so the next step casts nothing again (a publish once marked every copy stale
// through Mlp::parameters()' non-const overload: one cast pass over the weights per publish).
// Steps by hand, a publish after each; a trainer mesh of two ranks must have copies on fsdp.
TEST(LiveModel, APublishLeavesTheOptimizersSixteenBitCopiesCurrent) {
  Roles roles;
  const int64_t steps = 3;
  for (const testing::MeshCase& mesh : trainer_meshes(roles.trainers)) {
    SCOPED_TRACE("trainer mesh " + mesh.preset);
    TempDir dir(/*shared=*/true);
    const std::string name = "copies-" + mesh.preset;
    if (!roles.producer) {
      RunConfig config = trainer_config(name, mesh, dir.path(), {kInputs, 32, kOutputs});
      config.mixed_precision.param_dtype = Dtype::bf16;
      config.mixed_precision.reduce_dtype = Dtype::bf16;
      config.stream.publish_every = 1;
      config.train.steps = steps;
      TrainingRun run(config, {}, std::nullopt, roles.comm);
      int copies = 0;
      for (int64_t s = 1; s <= steps; ++s) {
        run.step();
        for (const ShardedTensor& p : std::as_const(run.model()).parameters()) {
          if (!p.copy_16bit) continue;
          ++copies;
          EXPECT_TRUE(p.copy_16bit->current) << p.name << " stale after step " << s << "'s publish";
        }
      }
      const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
      if (roles.rank == 0) EXPECT_EQ(source.counters().publishes, steps);
      if (mesh.preset == "fsdp" && roles.trainers > 1) EXPECT_GT(copies, 0);
      check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      continue;
    }
    StreamProducer producer;
    producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32, blocking_options());
    std::vector<float> xs, ys;
    for (int64_t first = 0; first < 32; first += 8) {
      make_rows(roles.rank, first, 8, xs, ys);
      producer.send(xs.data(), ys.data(), 8);
    }
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the trainer took its steps
    producer.close();
  }
}

// The C form (stream.h): not ready before a publish (MT_STREAM_BAD_INPUT and the sentence),
// versions and steps, and after the last publish bit for bit predict on its checkpoint.
TEST(LiveModel, CFormEqualsPredictOnTheCheckpointOfItsStep) {
  Roles roles;
  const testing::MeshCase mesh = trainer_meshes(roles.trainers).back();  // tp with 2 ranks
  TempDir dir(/*shared=*/true);
  const std::string name = "live-c";
  if (!roles.producer) {
    train_until_closed(roles, mesh, dir.path(), name);
    return;
  }
  mt_stream_options options = {64, 8, MT_STREAM_BLOCK, MPI_COMM_NULL, 0.0, nullptr, nullptr, 0};
  mt_stream* s = nullptr;
  ASSERT_EQ(mt_stream_connect(roles.comm, name.c_str(), kInputs, kOutputs, MT_STREAM_FLOAT32,
                              &options, &s),
            0)
      << mt_stream_last_error(s);
  mt_live_model* m = nullptr;
  ASSERT_EQ(mt_live_model_create(s, 0, &m), 0) << mt_live_model_last_error(m);
  const int64_t rows = mt_live_model_local_rows(m);
  std::vector<float> x(static_cast<size_t>(rows * kInputs)),
      y(static_cast<size_t>(rows * kOutputs));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::cos(0.1 * i + roles.rank));
  EXPECT_EQ(mt_live_model_version(m), 0);
  EXPECT_EQ(mt_live_model_predict(m, x.data(), y.data(), rows), MT_STREAM_BAD_INPUT);
  EXPECT_NE(std::string(mt_live_model_last_error(m)).find("has published no weights yet"),
            std::string::npos)
      << mt_live_model_last_error(m);
  std::vector<float> xs, ys;
  for (int64_t first = 0; first < 200; first += 8) {
    make_rows(roles.rank, first, 8, xs, ys);
    ASSERT_EQ(mt_stream_send(s, xs.data(), ys.data(), 8), 0) << mt_stream_last_error(s);
    ASSERT_GE(mt_live_model_refresh(m), 0) << mt_live_model_last_error(m);
  }
  while (mt_live_model_version(m) < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GE(mt_live_model_refresh(m), 0) << mt_live_model_last_error(m);
  }
  ASSERT_EQ(mt_stream_close(s), 0) << mt_stream_last_error(s);
  ASSERT_GE(mt_live_model_refresh(m), 0) << mt_live_model_last_error(m);
  const int64_t step = mt_live_model_step(m);
  EXPECT_EQ(step, mt_live_model_version(m) * kPublishEvery);
  ASSERT_EQ(mt_live_model_predict(m, x.data(), y.data(), rows), 0) << mt_live_model_last_error(m);

  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the trainer's run has ended
  Predictor reference(dir.path() + "/run/checkpoints/" + checkpoint_file_name(step), 0,
                      whole_model_overrides(roles.producers), roles.comm);
  ASSERT_EQ(reference.local_rows(), rows);
  Kokkos::View<const float**, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> xv(
      x.data(), rows, kInputs);
  Kokkos::View<float**, Kokkos::HostSpace> y_ref("y_ref", rows, kOutputs);
  reference.predict(xv, y_ref);
  EXPECT_EQ(std::memcmp(y.data(), y_ref.data(), y.size() * sizeof(float)), 0)
      << "the C LiveModel of step " << step << " against its checkpoint: " << y[0] << " against "
      << y_ref(0, 0);
  mt_live_model_free(m);
  mt_stream_free(s);
}

}  // namespace
}  // namespace meshtrain
