// Online training (docs/online.md): one program splits MPI_COMM_WORLD into producers (the first
// half of the ranks, rounded down) and a trainer (the rest), as a simulation and `meshtrain
// train` do under MPMD. Checked: every row a producer sent is counted on the trainer (dp and
// tp meshes; the ranks of a tp group hold the same buffer bits); the window and reservoir
// buffers hold exactly min(rows, buffer_rows) rows, the window the newest, the reservoir a
// spread sample; with a buffer that holds every row and order = "arrival", the run equals the
// run on the same rows written to an HDF5 file (bit for bit on the same mesh, and close to one
// rank's run computed in the same test); a shape mismatch is the same one sentence on both
// sides, naming the stream and both shapes, before any step. The registration's timeout ends
// any hang.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/stream/producer.hpp"
#include "framework/stream/stream_protocol.hpp"
#include "run/training_run.hpp"
#include "stream.h"
#include "tests/support/expect_error.hpp"
#include "tests/support/hdf5_files.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kInputs = 4, kOutputs = 2;

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

// Producer p's row r: x encodes (p, r) in x[0], the rest a smooth function of it.
void make_row(int64_t p, int64_t r, double* x, double* y) {
  const double t = 0.01 * static_cast<double>(r) + 0.37 * static_cast<double>(p);
  x[0] = static_cast<double>(p * 100000 + r);
  for (int64_t j = 1; j < kInputs; ++j) x[j] = std::sin(t * static_cast<double>(j + 1));
  for (int64_t o = 0; o < kOutputs; ++o) y[o] = std::cos(t + static_cast<double>(o));
}
// The same row as the model sees it: x[0] scaled into a sane range is not wanted here (it
// would change the row id), so the model's input 0 is the id over 1e5.
void make_row_f(int64_t p, int64_t r, float* x, float* y) {
  double xd[kInputs], yd[kOutputs];
  make_row(p, r, xd, yd);
  for (int64_t j = 0; j < kInputs; ++j) x[j] = static_cast<float>(xd[j]);
  for (int64_t o = 0; o < kOutputs; ++o) y[o] = static_cast<float>(yd[o]);
}

// Sends `rows` rows from producer `p` in sends of irregular sizes; returns rows handed to MPI.
int64_t produce(MPI_Comm comm, int p, const std::string& name, int64_t rows, StreamDtype dtype,
                const StreamProducerOptions& options) {
  StreamProducer producer;
  producer.connect(comm, name, kInputs, kOutputs, dtype, options);
  std::vector<double> xd(64 * kInputs), yd(64 * kOutputs);
  std::vector<float> xf(64 * kInputs), yf(64 * kOutputs);
  int64_t r = 0;
  for (int64_t k = 0; r < rows; ++k) {
    const int64_t n = std::min<int64_t>(1 + (k * 7) % 37, rows - r);
    for (int64_t i = 0; i < n; ++i) {
      make_row(p, r + i, &xd[i * kInputs], &yd[i * kOutputs]);
      make_row_f(p, r + i, &xf[i * kInputs], &yf[i * kOutputs]);
    }
    if (dtype == StreamDtype::float64) {
      producer.send(xd.data(), yd.data(), n);
    } else {
      producer.send(xf.data(), yf.data(), n);
    }
    if (options.share_messages && k == 3) producer.flush();  // a partial message, started now
    if (options.direct_sends) {
      // send() returned: the rows may be reused (a direct send still reading them would carry
      // these NaNs to the trainer).
      std::fill(xd.begin(), xd.end(), std::nan(""));
      std::fill(xf.begin(), xf.end(), std::nanf(""));
      std::fill(yd.begin(), yd.end(), std::nan(""));
      std::fill(yf.begin(), yf.end(), std::nanf(""));
    }
    r += n;
  }
  producer.close();
  EXPECT_EQ(producer.rows_sent() + producer.rows_dropped(), rows);
  return producer.rows_sent();
}

RunConfig trainer_config(const std::string& name, std::vector<std::pair<std::string, int>> axes,
                         const std::string& preset) {
  RunConfig config;
  config.file = "stream_test";
  config.run.seed = 11;
  config.mesh.axes = std::move(axes);
  config.model.sizes = {kInputs, 16, kOutputs};
  config.model.activation = Activation::tanh;
  config.model.loss = LossKind::mse;
  config.partition.preset = preset;
  config.partition.min_sharding_size = 0;
  config.data.source = DataSource::stream;
  config.data.batch_size = 8;
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-3;
  config.train.log_every = 1;
  config.stream.name = name;
  return config;
}

int64_t sum_over_world(int64_t value) {
  int64_t sum = 0;
  check_mpi(MPI_Allreduce(&value, &sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  return sum;
}

// The row ids (x[0]) the buffer holds.
std::vector<int64_t> buffer_ids(const StreamBuffer& buffer) {
  std::vector<int64_t> ids;
  for (int64_t s = 0; s < buffer.filled(); ++s) ids.push_back(static_cast<int64_t>(buffer.x(s)[0]));
  return ids;
}

std::vector<testing::MeshCase> trainer_meshes(int trainers) {
  std::vector<testing::MeshCase> cases = {{"dp", {{"dp", trainers}}}};
  if (trainers % 2 == 0) cases.push_back({"tp", {{"tp", trainers}}});
  return cases;
}

// Every row sent is counted, and the buffers are bounded exactly, by each policy; a run
// that ends when every producer closed (stream.until = "closed") writes the counters to
// metrics.jsonl.
TEST(Stream, EveryRowCountedAndBuffersBoundedExactly) {
  Roles roles;
  const int64_t rows_per_producer = 300, capacity = 40;
  for (const testing::MeshCase& mesh : trainer_meshes(roles.trainers)) {
    for (StreamPolicy policy : {StreamPolicy::window, StreamPolicy::reservoir}) {
      SCOPED_TRACE(std::string(to_string(policy)) + " on " + mesh.preset);
      TempDir dir(/*shared=*/true);
      const std::string name = std::string("count-") + to_string(policy);
      int64_t sent = 0;
      if (roles.producer) {
        StreamProducerOptions options;
        options.message_rows = 16;
        options.ring_rows = 64;
        options.backpressure = StreamBackpressure::block;
        sent =
            produce(roles.comm, roles.rank, name, rows_per_producer, StreamDtype::float64, options);
        EXPECT_EQ(sent, rows_per_producer);
        sum_over_world(sent);
        continue;
      }
      RunConfig config = trainer_config(name, mesh.axes, mesh.preset);
      config.stream.buffer_rows = capacity;
      config.stream.policy = policy;
      config.stream.min_rows = 4;
      config.stream.dtype = StreamRowType::float64;
      config.stream.until = StreamUntil::closed;
      config.train.steps = 1000000;
      config.run.output_dir = dir.path() + "/run";
      config.checkpoint.dir = dir.path() + "/run/checkpoints";
      TrainingRun run(config, {}, std::nullopt, roles.comm);
      const RunSummary summary = run.train();
      EXPECT_LT(summary.steps_run, 1000000) << "the run did not end when the producers closed";
      const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
      const StreamBuffer& buffer = source.buffer();
      const int64_t total_sent = sum_over_world(0);
      // Every producer's rows reached a group; each group's rows are counted once.
      EXPECT_EQ(source.counters().rows_received, total_sent);
      // This rank's buffer: exactly min(seen, capacity) rows, the rest counted.
      EXPECT_EQ(buffer.filled(), std::min(buffer.seen(), capacity));
      EXPECT_EQ(buffer.overwritten(), std::max<int64_t>(0, buffer.seen() - capacity));
      // The ranks of one group hold the same bits.
      {
        MPI_Comm group;
        MPI_Comm_split(roles.comm, static_cast<int>(run.batch_slice().index), roles.rank, &group);
        std::vector<int64_t> ids = buffer_ids(buffer);
        int64_t n = static_cast<int64_t>(ids.size()), lo = 0, hi = 0;
        MPI_Allreduce(&n, &lo, 1, MPI_INT64_T, MPI_MIN, group);
        MPI_Allreduce(&n, &hi, 1, MPI_INT64_T, MPI_MAX, group);
        EXPECT_EQ(lo, hi);
        std::vector<int64_t> first(ids);
        MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_INT64_T, 0, group);
        EXPECT_EQ(first, ids) << "the ranks of a tp group hold other rows";
        MPI_Comm_free(&group);
      }
      int64_t seen_sum = 0;
      {
        // Rows seen summed over the group leads = rows received; buffer rows likewise.
        int group_rank = 0;
        MPI_Comm group;
        MPI_Comm_split(roles.comm, static_cast<int>(run.batch_slice().index), roles.rank, &group);
        MPI_Comm_rank(group, &group_rank);
        MPI_Comm_free(&group);
        int64_t mine[2] = {group_rank == 0 ? buffer.seen() : 0,
                           group_rank == 0 ? buffer.filled() : 0};
        int64_t sums[2] = {0, 0};
        MPI_Allreduce(mine, sums, 2, MPI_INT64_T, MPI_SUM, roles.comm);
        seen_sum = sums[0];
        EXPECT_EQ(sums[1], source.counters().buffer_rows);
      }
      EXPECT_EQ(seen_sum, total_sent);
      // What the buffer holds: distinct rows; the window the newest of a one-producer group.
      std::vector<int64_t> ids = buffer_ids(buffer);
      const std::set<int64_t> distinct(ids.begin(), ids.end());
      EXPECT_EQ(static_cast<int64_t>(distinct.size()), buffer.filled());
      const bool one_producer = roles.producers == 1 || roles.producers == run.batch_slice().count;
      if (one_producer && buffer.seen() > capacity) {
        const int64_t p = roles.producers == 1 ? 0 : run.batch_slice().index;
        // This group's rows of producer p, in order (message m of p goes to group (p + mP) % G).
        // The producer's messages are cut from sends of irregular sizes: rebuild them.
        std::vector<int64_t> mine;
        const int64_t groups = run.batch_slice().count;
        int64_t r = 0, m = 0;
        for (int64_t k = 0; r < rows_per_producer; ++k) {
          const int64_t n = std::min<int64_t>(1 + (k * 7) % 37, rows_per_producer - r);
          for (int64_t done = 0; done < n; done += 16, ++m) {
            const int64_t count = std::min<int64_t>(16, n - done);
            if (stream_protocol::group_of_message(p, m, roles.producers, groups) ==
                run.batch_slice().index) {
              for (int64_t i = 0; i < count; ++i) mine.push_back(p * 100000 + r + done + i);
            }
          }
          r += n;
        }
        ASSERT_EQ(static_cast<int64_t>(mine.size()), buffer.seen());
        if (policy == StreamPolicy::window) {
          const std::set<int64_t> newest(mine.end() - capacity, mine.end());
          EXPECT_EQ(distinct, newest) << "the window holds other rows than the newest";
        } else {
          // A uniform sample of every row seen: rows from the older half too, not the window.
          const std::set<int64_t> older(mine.begin(), mine.begin() + (mine.size() / 2));
          int64_t from_older = 0;
          for (int64_t id : ids) from_older += older.count(id);
          EXPECT_GT(from_older, capacity / 5) << "the reservoir kept mostly the newest rows";
          EXPECT_LT(from_older, capacity * 4 / 5);
          for (int64_t id : ids) EXPECT_TRUE(std::find(mine.begin(), mine.end(), id) != mine.end());
        }
      }
      // metrics.jsonl has the counters (rank 0 of the trainer writes it).
      if (roles.rank == 0) {
        std::ifstream file(config.run.output_dir + "/metrics.jsonl");
        std::string line, last_log;
        while (std::getline(file, line)) {
          if (line.find("\"event\":\"log\"") != std::string::npos) last_log = line;
        }
        EXPECT_NE(last_log.find("\"stream_rows_received\":" + std::to_string(total_sent)),
                  std::string::npos)
            << last_log;
        EXPECT_NE(last_log.find("\"stream_buffer_rows\""), std::string::npos) << last_log;
      }
    }
  }
}

// Training from the stream with a buffer that holds every row, in arrival order, equals
// training from an HDF5 file of the same rows laid out as the batches take them.
TEST(Stream, RunEqualsTheSameRowsFromHdf5) {
  Roles roles;
  const int groups = roles.trainers;  // dp over the trainer
  if (roles.producers != 1 && roles.producers != groups) {
    GTEST_SKIP() << "a group fed by several producers takes their rows as they come";
  }
  const int64_t batch = 8 * groups, rows = 8, steps = 12;
  // Rows per group, and so per producer: every group gets steps * rows rows.
  const int64_t per_group = steps * rows;
  const int64_t per_producer = per_group * groups / roles.producers;
  TempDir dir(/*shared=*/true);
  const std::string file = dir.file("rows.h5");
  if (roles.producer) {
    StreamProducerOptions options;
    options.message_rows = 8;  // sends are whole messages: message m is rows [8m, 8m + 8)
    options.ring_rows = 4096;
    options.backpressure = StreamBackpressure::block;
    StreamProducer producer;
    producer.connect(roles.comm, "equal", kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(8 * kInputs), y(8 * kOutputs);
    for (int64_t r = 0; r < per_producer; r += 8) {
      for (int64_t i = 0; i < 8; ++i)
        make_row_f(roles.rank, r + i, &x[i * kInputs], &y[i * kOutputs]);
      producer.send(x.data(), y.data(), 8);
    }
    producer.close();
    EXPECT_EQ(producer.rows_dropped(), 0);
    MPI_Barrier(MPI_COMM_WORLD);  // the file is written
    return;
  }
  RunConfig config = trainer_config("equal", {{"dp", groups}}, "dp");
  config.stream.buffer_rows = per_group;
  config.stream.min_rows = per_group;
  config.stream.order = StreamOrder::arrival;
  config.data.batch_size = batch;
  config.train.steps = steps;
  std::vector<double> stream_losses;
  std::vector<std::vector<float>> stream_params;
  {
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    for (int64_t s = 0; s < steps; ++s) stream_losses.push_back(run.step().loss);
    stream_params = testing::copy_parameters(run);
    EXPECT_EQ(run.batch_slice().count, groups);
  }
  // The file: row s * batch + g * rows + j is group g's row s * rows + j; group g's rows are
  // its messages in order (message m of producer p goes to group (p + m P) mod G).
  Dataset d;
  d.description = "the streamed rows";
  d.num_samples = steps * batch;
  d.features = kInputs;
  d.target_width = kOutputs;
  d.inputs.resize(static_cast<size_t>(d.num_samples * kInputs));
  d.targets.resize(static_cast<size_t>(d.num_samples * kOutputs));
  std::vector<std::vector<std::pair<int64_t, int64_t>>> group_rows(static_cast<size_t>(groups));
  for (int64_t p = 0; p < roles.producers; ++p) {
    for (int64_t m = 0; m * 8 < per_producer; ++m) {
      const int64_t g = stream_protocol::group_of_message(p, m, roles.producers, groups);
      for (int64_t i = 0; i < 8; ++i) group_rows[static_cast<size_t>(g)].push_back({p, m * 8 + i});
    }
  }
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < rows; ++j) {
        const auto [p, r] = group_rows[static_cast<size_t>(g)][static_cast<size_t>(s * rows + j)];
        const int64_t at = s * batch + g * rows + j;
        make_row_f(p, r, &d.inputs[at * kInputs], &d.targets[at * kOutputs]);
      }
    }
  }
  if (roles.rank == 0) testing::write_h5(file, d);
  MPI_Barrier(MPI_COMM_WORLD);
  RunConfig offline = config;
  offline.data.source = DataSource::hdf5;
  offline.data.path = {file};
  offline.data.shuffle = ShuffleMode::none;
  offline.stream = StreamSection{};  // [stream] keys belong to a stream run
  std::vector<double> file_losses;
  {
    TrainingRun run(offline, {}, std::nullopt, roles.comm);
    for (int64_t s = 0; s < steps; ++s) file_losses.push_back(run.step().loss);
    EXPECT_TRUE(testing::same_bits(stream_params, testing::copy_parameters(run)))
        << "the stream's run and the file's differ";
  }
  EXPECT_EQ(stream_losses, file_losses);
  // One rank on the file: the same run up to the reduction's rounding.
  if (roles.rank == 0) {
    RunConfig single = offline;
    single.mesh.axes = {{"dp", 1}};
    TrainingRun run(single, {}, std::nullopt, MPI_COMM_SELF);
    for (int64_t s = 0; s < steps; ++s) {
      EXPECT_NEAR(run.step().loss, stream_losses[static_cast<size_t>(s)],
                  1e-5 * std::abs(stream_losses[static_cast<size_t>(s)]) + 1e-7);
    }
  }
}

// Normalization "standard" on a stream: the statistics of the first stream.min_rows rows each
// batch group took (one producer per group: the first min_rows rows of its messages in order;
// several: every row, min_rows being all of them), against the same statistics computed here
// in float64 (two passes), to 1e-12 of the std; frozen in the checkpoint.
TEST(Stream, StandardNormalizationFromTheFirstRows) {
  Roles roles;
  const int groups = roles.trainers;  // dp over the trainer
  constexpr int64_t kRows = 64;       // per producer, in messages of 8
  const int64_t per_group = kRows * roles.producers / groups;
  const bool one_producer_per_group = roles.producers <= groups;
  const int64_t min_rows = one_producer_per_group ? 24 : per_group;
  TempDir dir(/*shared=*/true);
  if (roles.producer) {
    StreamProducerOptions options;
    options.message_rows = 8;
    options.backpressure = StreamBackpressure::block;
    StreamProducer producer;
    producer.connect(roles.comm, "standard", kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(8 * kInputs), y(8 * kOutputs);
    for (int64_t r = 0; r < kRows; r += 8) {
      for (int64_t i = 0; i < 8; ++i)
        make_row_f(roles.rank, r + i, &x[i * kInputs], &y[i * kOutputs]);
      producer.send(x.data(), y.data(), 8);
    }
    producer.close();
    return;
  }
  RunConfig config = trainer_config("standard", {{"dp", groups}}, "dp");
  config.data.normalize_inputs = Normalize::standard;
  config.data.normalize_targets = Normalize::standard;
  config.data.batch_size = 8 * groups;
  config.stream.buffer_rows = 128;
  config.stream.min_rows = min_rows;
  config.train.steps = 4;
  config.checkpoint.dir = dir.path() + "/checkpoints";
  TrainingRun run(config, {}, std::nullopt, roles.comm);
  // `meshtrain plan` counts the buffer (128 rows of 4 + 2 floats; no held-out window here).
  EXPECT_EQ(run.planned_memory().data.source_bytes, 128 * (kInputs + kOutputs) * 4);
  run.step();
  const Normalization n = run.normalization();
  // The reference: each group's first min_rows rows, its messages in order.
  std::vector<std::vector<double>> columns(static_cast<size_t>(kInputs + kOutputs));
  for (int64_t g = 0; g < groups; ++g) {
    int64_t taken = 0;
    for (int64_t p = 0; p < roles.producers; ++p) {
      for (int64_t m = 0; m * 8 < kRows; ++m) {
        if (stream_protocol::group_of_message(p, m, roles.producers, groups) != g) continue;
        for (int64_t i = 0; i < 8 && taken < min_rows; ++i, ++taken) {
          float x[kInputs], y[kOutputs];
          make_row_f(p, m * 8 + i, x, y);
          for (int64_t j = 0; j < kInputs; ++j) columns[static_cast<size_t>(j)].push_back(x[j]);
          for (int64_t o = 0; o < kOutputs; ++o)
            columns[static_cast<size_t>(kInputs + o)].push_back(y[o]);
        }
      }
    }
    EXPECT_EQ(taken, min_rows);
  }
  ASSERT_EQ(n.input_mean.size(), static_cast<size_t>(kInputs));
  ASSERT_EQ(n.target_std.size(), static_cast<size_t>(kOutputs));
  for (int64_t c = 0; c < kInputs + kOutputs; ++c) {
    const std::vector<double>& v = columns[static_cast<size_t>(c)];
    double mean = 0.0, squares = 0.0;
    for (double e : v) mean += e;
    mean /= static_cast<double>(v.size());
    for (double e : v) squares += (e - mean) * (e - mean);
    const double std_dev = std::sqrt(squares / static_cast<double>(v.size()));
    const bool input = c < kInputs;
    const double got_mean = input ? n.input_mean[static_cast<size_t>(c)]
                                  : n.target_mean[static_cast<size_t>(c - kInputs)];
    const double got_std = input ? n.input_std[static_cast<size_t>(c)]
                                 : n.target_std[static_cast<size_t>(c - kInputs)];
    EXPECT_NEAR(got_mean, mean, 1e-12 * std_dev) << "column " << c;
    EXPECT_NEAR(got_std, std_dev, 1e-12 * std_dev) << "column " << c;
  }
  // Frozen: the same after more steps, and in the checkpoint.
  run.step();
  EXPECT_EQ(run.normalization().input_mean, n.input_mean);
  const std::string file = run.save();
  if (roles.rank == 0) {
    const Normalization saved = read_normalization(file);
    EXPECT_EQ(saved.input_std, n.input_std);
    EXPECT_EQ(saved.target_mean, n.target_mean);
  }
}

// Shapes that disagree: the same sentence on both sides, naming the stream and both shapes,
// before any step (the run is never built).
// stream.test_fraction: the rows held out are those of a seedless hash of (producer rank, row
// number), so the same in every run; none of them is trained on, every one is counted
// (stream_rows_held_out) and the run's evaluation reads them (its test_rows).
TEST(Stream, HeldOutRowsByTheirHashAreEvaluatedAndNeverTrainedOn) {
  Roles roles;
  const int64_t rows_per_producer = 300;
  const double fraction = 0.25;
  for (const testing::MeshCase& mesh : trainer_meshes(roles.trainers)) {
    SCOPED_TRACE(mesh.preset);
    TempDir dir(/*shared=*/true);
    const std::string name = "held-out-" + mesh.preset;
    if (roles.producer) {
      StreamProducerOptions options;
      options.message_rows = 16;
      options.ring_rows = 64;
      options.backpressure = StreamBackpressure::block;
      produce(roles.comm, roles.rank, name, rows_per_producer, StreamDtype::float64, options);
      continue;
    }
    // The rows every producer sends that the hash holds out, counted here.
    int64_t expected = 0;
    for (int64_t p = 0; p < roles.producers; ++p) {
      for (int64_t r = 0; r < rows_per_producer; ++r) {
        expected += stream_row_held_out(p, r, fraction) ? 1 : 0;
      }
    }
    const double total = static_cast<double>(rows_per_producer * roles.producers);
    EXPECT_GT(static_cast<double>(expected), 0.15 * total);
    EXPECT_LT(static_cast<double>(expected), 0.35 * total);

    RunConfig config = trainer_config(name, mesh.axes, mesh.preset);
    config.stream.buffer_rows = 1000;  // every row kept: the window never overwrites
    config.stream.min_rows = 4;
    config.stream.dtype = StreamRowType::float64;
    config.stream.until = StreamUntil::closed;
    config.stream.test_fraction = fraction;
    config.train.steps = 1000000;
    config.train.eval_every = 1000000;  // the last step evaluates
    config.run.output_dir = dir.path() + "/run";
    config.checkpoint.dir = dir.path() + "/run/checkpoints";
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    const RunSummary summary = run.train();
    const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
    EXPECT_EQ(source.counters().rows_held_out, expected);
    EXPECT_EQ(source.counters().rows_received,
              rows_per_producer * roles.producers);  // held out or trained on, every row
    // Row ids: x[0] = p * 100000 + r (make_row).
    const auto held = [&](float id) {
      const auto n = static_cast<int64_t>(id);
      return stream_row_held_out(n / 100000, n % 100000, fraction);
    };
    for (int64_t s = 0; s < source.buffer().filled(); ++s) {
      EXPECT_FALSE(held(source.buffer().x(s)[0]))
          << "trained on held-out row " << source.buffer().x(s)[0];
    }
    for (int64_t s = 0; s < source.held_out().filled(); ++s) {
      EXPECT_TRUE(held(source.held_out().x(s)[0])) << "held out row " << source.held_out().x(s)[0];
    }
    ASSERT_TRUE(summary.last_eval.has_value()) << "the held-out rows were not evaluated";
    EXPECT_EQ(summary.last_eval->test_rows, expected);
    EXPECT_TRUE(std::isfinite(summary.last_eval->test_loss));
    if (roles.rank == 0) {
      std::ifstream metrics(dir.path() + "/run/metrics.jsonl");
      std::string text((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
      EXPECT_NE(text.find("\"stream_rows_held_out\":" + std::to_string(expected)),
                std::string::npos);
    }
  }
}

TEST(Stream, ShapeMismatchIsOneSentenceOnBothSides) {
  Roles roles;
  std::string message;
  if (roles.producer) {
    StreamProducer producer;
    try {
      producer.connect(roles.comm, "mismatch", kInputs + 1, kOutputs, StreamDtype::float32);
      ADD_FAILURE() << "connect accepted 5 inputs against a model of 4";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::bad_input);
      message = e.what();
    }
    EXPECT_FALSE(producer.connected());
    // The C API says the same through its error code and sentence.
    mt_stream* s = nullptr;
    EXPECT_EQ(mt_stream_connect(roles.comm, "mismatch-c", kInputs, kOutputs + 1, MT_STREAM_FLOAT32,
                                nullptr, &s),
              MT_STREAM_BAD_INPUT);
    EXPECT_NE(std::string(mt_stream_last_error(s)).find("3 outputs"), std::string::npos)
        << mt_stream_last_error(s);
    mt_stream_free(s);
  } else {
    for (const char* name : {"mismatch", "mismatch-c"}) {
      RunConfig config = trainer_config(name, {{"dp", roles.trainers}}, "dp");
      config.train.steps = 5;
      try {
        TrainingRun run(config, {}, std::nullopt, roles.comm);
        ADD_FAILURE() << "the run was built against producers of another shape";
      } catch (const AgreedError& e) {
        EXPECT_EQ(e.kind(), ErrorKind::bad_input);
        if (std::string(name) == "mismatch") message = e.what();
      }
    }
  }
  EXPECT_NE(message.find("stream \"mismatch\""), std::string::npos) << message;
  EXPECT_NE(message.find("5 inputs and 2 outputs as float32"), std::string::npos) << message;
  EXPECT_NE(message.find("4 inputs and 2 outputs as float32"), std::string::npos) << message;
  // One sentence, and the same on both sides.
  const uint64_t hash = std::hash<std::string>{}(message);
  uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&hash, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&hash, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi) << "the producers and the trainer report different sentences: " << message;
}

// The rendezvous refuses ranks of another protocol version (a trainer of a release before the
// version, whose record reads 0 there, would take a split message's header for a whole one):
// here a stand-in trainer whose Hello carries version 0; the producers' connect and the
// trainer's rendezvous give the same sentence, naming both versions.
TEST(Stream, ProtocolVersionMismatchIsOneSentenceOnBothSides) {
  namespace sp = stream_protocol;
  Roles roles;
  std::string message;
  if (roles.producer) {
    StreamProducer producer;
    try {
      producer.connect(roles.comm, "version", kInputs, kOutputs, StreamDtype::float32);
      ADD_FAILURE() << "connect accepted a trainer of protocol version 0";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::bad_input);
      message = e.what();
    }
    EXPECT_FALSE(producer.connected());
  } else {
    sp::Hello hello;
    hello.role = sp::kTrainer;
    hello.local_rank = roles.rank;
    hello.inputs = kInputs;
    hello.outputs = kOutputs;
    hello.batch_index = roles.rank;
    hello.batch_count = roles.trainers;
    hello.protocol = 0;
    std::memcpy(hello.name, "version", 7);
    MPI_Comm stream_comm = MPI_COMM_NULL;
    message = sp::rendezvous(MPI_COMM_WORLD, hello, &stream_comm).problem;
    check_mpi(MPI_Comm_free(&stream_comm), "MPI_Comm_free");
  }
  const std::string expected =
      "stream \"version\": the ranks speak different versions of the "
      "stream protocol (rank 0 of the rendezvous, a producer, version " +
      std::to_string(sp::kProtocolVersion) + "; rank " + std::to_string(roles.producers) +
      ", a trainer rank, version 0;";
  EXPECT_EQ(message.rfind(expected, 0), 0u) << message;
  const uint64_t hash = std::hash<std::string>{}(message);
  uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&hash, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&hash, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi) << "the producers and the trainer report different sentences: " << message;
}

// A trainer that fails before its rendezvous (here: no train.steps) tells the producers, whose
// connect then fails with its sentence instead of waiting.
TEST(Stream, TrainerFailingAtSetUpEndsTheProducersConnect) {
  Roles roles;
  std::string message;
  if (roles.producer) {
    StreamProducer producer;
    try {
      producer.connect(roles.comm, "early", kInputs, kOutputs, StreamDtype::float32);
      ADD_FAILURE() << "connect succeeded with a trainer that failed";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::bad_input);
      message = e.what();
    }
    EXPECT_NE(message.find("stream \"early\": the trainer stopped before it trained: "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("train.steps"), std::string::npos) << message;
    return;
  }
  RunConfig config = trainer_config("early", {{"dp", roles.trainers}}, "dp");
  try {
    TrainingRun run(config, {}, std::nullopt, roles.comm);  // no train.steps
    ADD_FAILURE() << "a stream run without train.steps was built";
  } catch (const AgreedError& e) {
    stream_trainer_failed(e.what());
  }
}

// A library caller that catches the run's error and then destroys the run (here: a loss that
// becomes infinite in a step() called by hand, lr 1e38) ends its stream with the stop, decided
// by the run's finished flag: every producer rank takes it (stopped(), with the step's own
// error as its sentence, which step() sends as it throws), drops its rows from then on and
// closes; producer rank 0 alone is told once through options.on_warning (the library prints
// nothing itself). Before the flag the destructor, run outside any exception's unwinding, sent
// no stop: the producers sent on until they gave up, never told; before step() sent the stop
// itself, they were told only the destructor's "ended before it finished".
void run_destroyed_after_a_caught_error(const std::string& name, bool split) {
  Roles roles;
  if (roles.producer) {
    std::vector<std::string> warnings;
    StreamProducerOptions options;
    options.on_warning = [&](const std::string& warning) { warnings.push_back(warning); };
    if (split) options.split_bytes = 0;
    StreamProducer producer;
    producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(8 * kInputs, 0.5f), y(8 * kOutputs, 0.25f);
    int after_stop = -1;
    for (int k = 0; k < 4000 && (after_stop < 0 || k < after_stop + 10); ++k) {
      producer.send(x.data(), y.data(), 8);
      if (after_stop < 0 && producer.stopped()) after_stop = k;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    producer.close();
    ASSERT_TRUE(producer.stopped()) << "the destroyed run never told this producer to stop";
    // The step's own error, not the destructor's generic sentence.
    EXPECT_NE(std::string(producer.stop_reason()).find("the training loss became"),
              std::string::npos)
        << producer.stop_reason();
    EXPECT_GT(producer.rows_dropped(), 0) << "no send dropped its rows after the stop";
    ASSERT_EQ(warnings.size(), roles.rank == 0 ? 1u : 0u);
    if (roles.rank == 0) {
      EXPECT_EQ(warnings[0].rfind("stream \"" + name + "\": the trainer stopped: ", 0), 0u)
          << warnings[0];
      EXPECT_NE(warnings[0].find("the training loss became"), std::string::npos) << warnings[0];
    }
    return;
  }
  RunConfig config = trainer_config(name, {{"dp", roles.trainers}}, "dp");
  config.optimizer.lr = 1e38;
  config.stream.min_rows = 8;
  config.train.steps = 1000;
  std::string message;
  {
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    try {
      while (!run.finished()) run.step();
      ADD_FAILURE() << "the run at lr 1e38 finished";
    } catch (const AgreedError& e) {
      message = e.what();  // caught: the run is destroyed below, outside any exception
    }
  }
  EXPECT_NE(message.find("the training loss became"), std::string::npos) << message;
}

TEST(Stream, RunDestroyedAfterACaughtErrorStopsTheProducers) {
  run_destroyed_after_a_caught_error("caught", /*split=*/false);
}

// The same with every message split (split_bytes 0): the staged messages' payloads, matched but
// never taken, and those owed to a header are received and dropped by the destructor
// (StreamSource::discard_payloads), so that the producers' sends and close() complete.
TEST(Stream, RunDestroyedAfterACaughtErrorStopsTheProducersWithSplitMessages) {
  run_destroyed_after_a_caught_error("caught-split", /*split=*/true);
}

// A trainer that never answers a producer's close (here a stand-in: it takes part in the
// rendezvous, receives every producer's close and sends no last word): close() waits
// options.close_timeout, reports one warning on that rank through on_warning and returns, the
// producer not stopped.
TEST(Stream, CloseUnansweredReturnsAfterItsTimeoutWithOneWarning) {
  namespace sp = stream_protocol;
  Roles roles;
  if (roles.producer) {
    std::vector<std::string> warnings;
    StreamProducerOptions options;
    options.close_timeout = 0.5;
    options.on_warning = [&](const std::string& warning) { warnings.push_back(warning); };
    StreamProducer producer;
    producer.connect(roles.comm, "mute", kInputs, kOutputs, StreamDtype::float32, options);
    const auto start = std::chrono::steady_clock::now();
    producer.close();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(waited, 0.5) << "close() did not wait for the trainer's last word";
    EXPECT_FALSE(producer.stopped());
    EXPECT_EQ(warnings.size(), 1u);
    if (!warnings.empty()) {
      const std::string expected = "stream \"mute\": producer rank " + std::to_string(roles.rank) +
                                   ": the trainer did not answer its close within 0.5 s";
      EXPECT_EQ(warnings[0].rfind(expected, 0), 0u) << warnings[0];
    }
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    return;
  }
  sp::Hello hello;
  hello.role = sp::kTrainer;
  hello.local_rank = roles.rank;
  hello.inputs = kInputs;
  hello.outputs = kOutputs;
  hello.dtype = sp::kFloat32;
  hello.batch_index = roles.rank;
  hello.batch_count = roles.trainers;
  std::memcpy(hello.name, "mute", 4);
  MPI_Comm stream_comm = MPI_COMM_NULL;
  const sp::Rendezvous r = sp::rendezvous(MPI_COMM_WORLD, hello, &stream_comm);
  EXPECT_EQ(r.problem, "");
  // Every producer's close comes to every trainer rank: taken, never answered.
  for (int producer : r.producers) {
    sp::Header header;
    check_mpi(MPI_Recv(&header, sizeof header, MPI_BYTE, producer, sp::kTag, stream_comm,
                       MPI_STATUS_IGNORE),
              "MPI_Recv");
    EXPECT_EQ(header.kind, sp::kClose);
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  check_mpi(MPI_Comm_free(&stream_comm), "MPI_Comm_free");
}

// A simulation that closes while the trainer is in its final evaluation, then waits for the
// trainer's program (here: a barrier after train() returns, before the run is destroyed) is
// answered at once: train() answers the closes that came during its last evaluation and save
// (StreamSource::answer_closes). The close comes inside the last on_eval, ordered by a
// non-blocking barrier the producers test between sends. Before, only a pull answered a close:
// close() waited its whole close_timeout and warned, and the done was left unreceived.
// `split`: sends of 512 rows split (split_bytes 0; x 8 KiB, over the 4 KiB eager limit, so a
// send completes only when the trainer receives its payloads), else 8-row messages sent whole.
void close_during_the_final_evaluation(const std::string& name, bool split) {
  Roles roles;
  TempDir dir(/*shared=*/true);
  constexpr double kCloseTimeout = 8.0;
  const int64_t rows = split ? 512 : 8;
  if (roles.producer) {
    std::vector<std::string> warnings;
    StreamProducerOptions options;
    options.close_timeout = kCloseTimeout;
    options.message_rows = rows;
    if (split) options.split_bytes = 0;
    options.on_warning = [&](const std::string& warning) { warnings.push_back(warning); };
    StreamProducer producer;
    producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(rows * kInputs), y(rows * kOutputs);
    for (int64_t i = 0; i < rows; ++i) {
      make_row_f(roles.rank, i, &x[i * kInputs], &y[i * kOutputs]);
    }
    MPI_Request in_final_eval = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(MPI_COMM_WORLD, &in_final_eval), "MPI_Ibarrier");
    for (int reached = 0; !reached;) {
      producer.send(x.data(), y.data(), rows);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      check_mpi(MPI_Test(&in_final_eval, &reached, MPI_STATUS_IGNORE), "MPI_Test");
    }
    const auto start = std::chrono::steady_clock::now();
    producer.close();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, kCloseTimeout / 2) << "close() waited for its timeout";
    EXPECT_TRUE(warnings.empty()) << warnings.front();
    EXPECT_FALSE(producer.stopped()) << producer.stop_reason();
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the trainer's program goes on
    return;
  }
  RunConfig config = trainer_config(name, {{"dp", roles.trainers}}, "dp");
  config.stream.min_rows = 8;
  config.stream.test_fraction = 0.25;
  config.train.steps = 5;
  config.train.eval_every = 1000000;  // the last step evaluates
  config.run.output_dir = dir.path() + "/run";
  config.checkpoint.dir = dir.path() + "/run/checkpoints";
  RunEvents events;
  events.on_eval = [&](const EvalEvent& eval) {
    if (eval.step != config.train.steps) return;
    MPI_Request in_final_eval = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(MPI_COMM_WORLD, &in_final_eval), "MPI_Ibarrier");
    check_mpi(MPI_Wait(&in_final_eval, MPI_STATUS_IGNORE), "MPI_Wait");
    // A slow evaluation: the producers' closes come now.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  };
  TrainingRun run(config, events, std::nullopt, roles.comm);
  run.train();
  // The program's own code before the run is destroyed: here it waits for the producers.
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

TEST(Stream, CloseDuringTheFinalEvaluationIsAnsweredAtOnce) {
  close_during_the_final_evaluation("final", /*split=*/false);
}

// The same with split messages: the ones staged and never taken hold their producer's sends
// (and so its close()) until their payloads are received; after the run finished every trainer
// rank drops them outside the steps (StreamSource::answer_closes), not only rank 0, so the close
// returns before the trainer's program destroys the run (with 2 trainer ranks, before the fix,
// rank 1 kept them until its destructor, after the barrier: a hang).
TEST(Stream, CloseDuringTheFinalEvaluationIsAnsweredAtOnceWithSplitMessages) {
  close_during_the_final_evaluation("final-split", /*split=*/true);
}

// close_timeout negative or NaN would wait for ever: connect refuses it (before the
// rendezvous, so no trainer takes part), in C++ and through the C API; every rank alone.
TEST(Stream, CloseTimeoutNegativeOrNaNRefused) {
  for (double bad : {-1.0, std::nan("")}) {
    StreamProducerOptions options;
    options.close_timeout = bad;
    StreamProducer producer;
    testing::expect_bad_input(
        [&] {
          producer.connect(MPI_COMM_SELF, "t", kInputs, kOutputs, StreamDtype::float32, options);
        },
        {"stream \"t\"", "close_timeout", std::isnan(bad) ? "nan" : "-1"});
    EXPECT_FALSE(producer.connected());
    mt_stream_options c_options = {0, 0, MT_STREAM_DROP, MPI_COMM_NULL, bad, nullptr, nullptr, 0};
    mt_stream* s = nullptr;
    EXPECT_EQ(
        mt_stream_connect(MPI_COMM_SELF, "t", kInputs, kOutputs, MT_STREAM_FLOAT32, &c_options, &s),
        MT_STREAM_BAD_INPUT);
    EXPECT_NE(std::string(mt_stream_last_error(s)).find("close_timeout"), std::string::npos)
        << mt_stream_last_error(s);
    mt_stream_free(s);
  }
}

// The C API's warnings go to mt_stream_options.on_warning with its warning_data, and nothing
// is printed (stderr captured): here a close no trainer answers (the stand-in of
// CloseUnansweredReturnsAfterItsTimeoutWithOneWarning), close_timeout 0.5 s.
TEST(Stream, CWarningsGoToTheirCallback) {
  namespace sp = stream_protocol;
  Roles roles;
  if (roles.producer) {
    std::vector<std::string> warnings;
    mt_stream_options options = {0, 0, MT_STREAM_DROP, MPI_COMM_NULL, 0.5, nullptr, &warnings, 0};
    options.on_warning = [](const char* sentence, void* data) {
      static_cast<std::vector<std::string>*>(data)->push_back(sentence);
    };
    mt_stream* s = nullptr;
    EXPECT_EQ(
        mt_stream_connect(roles.comm, "mute-c", kInputs, kOutputs, MT_STREAM_FLOAT32, &options, &s),
        MT_STREAM_OK)
        << mt_stream_last_error(s);
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(mt_stream_close(s), MT_STREAM_OK) << mt_stream_last_error(s);
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(printed, "") << "the C API printed a warning it had a callback for";
    EXPECT_EQ(warnings.size(), 1u);  // not ASSERT: the barrier below must be reached
    if (!warnings.empty()) {
      EXPECT_EQ(warnings[0].rfind("stream \"mute-c\": producer rank " + std::to_string(roles.rank) +
                                      ": the trainer did not answer its close within 0.5 s",
                                  0),
                0u)
          << warnings[0];
    }
    mt_stream_free(s);
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    return;
  }
  sp::Hello hello;
  hello.role = sp::kTrainer;
  hello.local_rank = roles.rank;
  hello.inputs = kInputs;
  hello.outputs = kOutputs;
  hello.dtype = sp::kFloat32;
  hello.batch_index = roles.rank;
  hello.batch_count = roles.trainers;
  std::memcpy(hello.name, "mute-c", 6);
  MPI_Comm stream_comm = MPI_COMM_NULL;
  const sp::Rendezvous r = sp::rendezvous(MPI_COMM_WORLD, hello, &stream_comm);
  EXPECT_EQ(r.problem, "");
  for (int producer : r.producers) {
    sp::Header header;
    check_mpi(MPI_Recv(&header, sizeof header, MPI_BYTE, producer, sp::kTag, stream_comm,
                       MPI_STATUS_IGNORE),
              "MPI_Recv");
    EXPECT_EQ(header.kind, sp::kClose);
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  check_mpi(MPI_Comm_free(&stream_comm), "MPI_Comm_free");
}

// Producer 0 whose close() gave up waiting (close_timeout 0.5 s: the trainer's program does its
// own work for 2 s after train() before it destroys the run) never takes the publish still
// waiting on trainer rank 0 (wide: past the eager limits, so its send waits for a receive).
// The run's destructor sends it, waits at most stream.last_word_timeout (2 s here; 30 s by
// default) and returns; before, it waited for it for ever (the registration's timeout ended the
// test).
TEST(Stream, DestructorStopsWaitingForPublishesAProducerGaveUpOn) {
  // The bound does not depend on how many ranks take part: one count is enough for CI's time.
  if (world_size() != 2) GTEST_SKIP() << "runs at np 2 only (it waits out its 2 s bound)";
  Roles roles;
  TempDir dir(/*shared=*/true);
  if (roles.producer) {
    std::vector<std::string> warnings;
    StreamProducerOptions options;
    options.close_timeout = 0.5;
    options.message_rows = 8;
    options.on_warning = [&](const std::string& warning) { warnings.push_back(warning); };
    StreamProducer producer;
    producer.connect(roles.comm, "gave-up", kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(8 * kInputs), y(8 * kOutputs);
    for (int64_t i = 0; i < 8; ++i) make_row_f(roles.rank, i, &x[i * kInputs], &y[i * kOutputs]);
    MPI_Request trained = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibarrier(MPI_COMM_WORLD, &trained), "MPI_Ibarrier");
    for (int reached = 0; !reached;) {
      producer.send(x.data(), y.data(), 8);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      check_mpi(MPI_Test(&trained, &reached, MPI_STATUS_IGNORE), "MPI_Test");
    }
    producer.close();
    // The scenario: this rank's close went unanswered (the trainer was busy).
    EXPECT_EQ(warnings.size(), 1u);
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // after the trainer's destructor
    return;
  }
  RunConfig config = trainer_config("gave-up", {{"dp", roles.trainers}}, "dp");
  config.model.sizes = {kInputs, 4096, kOutputs};  // a publish of 112 KiB
  config.stream.min_rows = 8;
  config.stream.publish_every = 1;
  config.stream.last_word_timeout = 2.0;
  config.train.steps = 3;
  config.run.output_dir = dir.path() + "/run";
  config.checkpoint.dir = dir.path() + "/run/checkpoints";
  std::optional<TrainingRun> run;
  run.emplace(config, RunEvents{}, std::nullopt, roles.comm);
  run->train();
  MPI_Request trained = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(MPI_COMM_WORLD, &trained), "MPI_Ibarrier");
  check_mpi(MPI_Wait(&trained, MPI_STATUS_IGNORE), "MPI_Wait");
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the program's own work
  const auto start = std::chrono::steady_clock::now();
  run.reset();
  const double destroy_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Two waits of at most 2 s each (the publishes, then the last words' sends), the rest
  // milliseconds; 20 s leaves a loaded machine room and is still under the default's 30 s, which
  // the key replaces.
  EXPECT_LT(destroy_s, 20.0) << "the destructor did not stop waiting at stream.last_word_timeout";
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

// The [stream] keys go through the one schema: read, written back, refused without
// data.source = "stream" (every rank alike; no MPI).
TEST(StreamConfig, KeysReadWrittenAndRefusedElsewhere) {
  const std::string text =
      "[model]\nsizes = [4, 3]\nloss = \"mse\"\n[train]\nsteps = 5\n"
      "[data]\nsource = \"stream\"\n"
      "[stream]\nname = \"heat\"\nbuffer_rows = 1000\npolicy = \"reservoir\"\n"
      "min_rows = 100\norder = \"arrival\"\ndtype = \"float64\"\nuntil = \"closed\"\n";
  const RunConfig c = parse_config(text, "online.toml");
  EXPECT_EQ(c.data.source, DataSource::stream);
  EXPECT_EQ(c.stream.name, "heat");
  EXPECT_EQ(c.stream.buffer_rows, 1000);
  EXPECT_EQ(c.stream.policy, StreamPolicy::reservoir);
  EXPECT_EQ(c.stream.min_rows, 100);
  EXPECT_EQ(c.stream.order, StreamOrder::arrival);
  EXPECT_EQ(c.stream.dtype, StreamRowType::float64);
  EXPECT_EQ(c.stream.until, StreamUntil::closed);
  EXPECT_TRUE(c.stream.checkpoint_buffer);
  const RunConfig off = parse_config(text, "online.toml", {"stream.checkpoint_buffer=false"});
  EXPECT_FALSE(off.stream.checkpoint_buffer);
  EXPECT_FALSE(parse_config(config_to_toml(off), "again.toml").stream.checkpoint_buffer);
  const RunConfig again = parse_config(config_to_toml(c), "again.toml");
  EXPECT_EQ(again.stream.name, "heat");
  EXPECT_EQ(again.stream.policy, StreamPolicy::reservoir);
  EXPECT_EQ(again.stream.until, StreamUntil::closed);
  testing::expect_bad_input(
      [] {
        parse_config("[model]\nsizes = [4, 3]\n[train]\nsteps = 5\n[stream]\nname = \"x\"\n",
                     "t.toml");
      },
      {"t.toml", "[stream] name", "data.source = \"stream\""});
  testing::expect_bad_input([&] { parse_config(text + "", "t.toml", {"stream.policy=newest"}); },
                            {"stream.policy", "window", "reservoir"});
  EXPECT_EQ(c.stream.last_word_timeout, 30.0);
  EXPECT_EQ(parse_config(text, "t.toml", {"stream.last_word_timeout=2.5"}).stream.last_word_timeout,
            2.5);
  for (const char* bad : {"stream.last_word_timeout=0", "stream.last_word_timeout=-1"}) {
    testing::expect_bad_input([&] { parse_config(text, "t.toml", {bad}); },
                              {"stream.last_word_timeout"});
  }
  // A library user's StreamSource refuses it too, before the rendezvous (nothing collective).
  StreamSection section = c.stream;
  section.last_word_timeout = 0.0;
  testing::expect_bad_input(
      [&] { StreamSource source(section, MPI_COMM_WORLD, BatchSlice{}, 4, 3, 1, 0); },
      {"stream \"heat\"", "last_word_timeout", "positive"});
}

// The buffer alone: exact bounds and counters; the window keeps the newest rows in slot
// n mod capacity; the reservoir's choices are a function of (seed, group, n) alone.
TEST(StreamBuffer, BoundsAndPolicies) {
  for (StreamPolicy policy : {StreamPolicy::window, StreamPolicy::reservoir}) {
    StreamBuffer a(10, 1, 1, policy, 7, 0), b(10, 1, 1, policy, 7, 0), c(10, 1, 1, policy, 8, 0);
    for (int64_t n = 0; n < 100; ++n) {
      const float x = static_cast<float>(n), y = -x;
      a.add(&x, &y);
      b.add(&x, &y);
      c.add(&x, &y);
      EXPECT_EQ(a.filled(), std::min<int64_t>(n + 1, 10));
      EXPECT_EQ(a.overwritten(), std::max<int64_t>(0, n + 1 - 10));
    }
    bool same_as_b = true, same_as_c = true;
    for (int64_t s = 0; s < 10; ++s) {
      EXPECT_EQ(a.y(s)[0], -a.x(s)[0]);
      same_as_b = same_as_b && a.x(s)[0] == b.x(s)[0];
      same_as_c = same_as_c && a.x(s)[0] == c.x(s)[0];
      if (policy == StreamPolicy::window) EXPECT_EQ(a.x(s)[0], static_cast<float>(90 + s));
    }
    EXPECT_TRUE(same_as_b);
    if (policy == StreamPolicy::reservoir) EXPECT_FALSE(same_as_c) << "the seed changes nothing";
  }
}

// With backpressure drop, a ring of two messages whose sends cannot complete (no trainer
// receives until the producer is done) drops later messages and counts them; send returns.
// (Two: with one producer and two groups, each group gets one message.)
// (Only messages above the MPI library's eager limit wait for their receiver, so the rows
// are wide.)
TEST(Stream, DropWhenTheRingIsFullIsCounted) {
  Roles roles;
  constexpr int64_t kWide = 4096;  // 16 KiB + a row: past the eager limits of shared memory
  if (roles.producer) {
    StreamProducer producer;
    StreamProducerOptions options;
    options.message_rows = 4;
    options.ring_rows = 8;
    producer.connect(roles.comm, "drop", kWide, 1, StreamDtype::float32, options);
    std::vector<float> x(4 * kWide, 1.0f), y(4, 2.0f);
    for (int k = 0; k < 20; ++k) producer.send(x.data(), y.data(), 4);
    EXPECT_EQ(producer.rows_sent() + producer.rows_dropped(), 80);
    EXPECT_GT(producer.rows_dropped(), 0) << "the ring never filled";
    MPI_Barrier(MPI_COMM_WORLD);  // only now may the trainer receive
    producer.close();
    sum_over_world(producer.rows_sent());
    return;
  }
  RunConfig config = trainer_config("drop", {{"dp", roles.trainers}}, "dp");
  config.model.sizes = {kWide, 4, 1};
  config.stream.until = StreamUntil::closed;
  config.stream.min_rows = 1;
  config.data.batch_size = roles.trainers;
  config.train.steps = 1000;
  TrainingRun run(config, {}, std::nullopt, roles.comm);
  MPI_Barrier(MPI_COMM_WORLD);
  while (!run.finished()) run.step();
  const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
  EXPECT_EQ(source.counters().rows_received, sum_over_world(0));
}

// options.share_messages: sends of 1 to 37 rows (300 rows per producer) fill messages of 16
// rows, the last one's 12 rows started by close(): 19 messages of consecutive rows, message m
// of producer p to the group stream_protocol::group_of_message gives it; each batch group's
// buffers (large enough for every row) hold exactly the rows of its messages, rebuilt here from
// that rule. With stream.test_fraction 0.25 the trainer holds rows out by the hash of their
// (producer, row number), which it computes from each message's first_row: a wrong first_row
// puts other rows in the held-out window. Without share_messages the same sends make 27
// messages (one per 16 rows or fewer of each send), counted here from the sends; the groups'
// buffers are rebuilt from those messages the same way.
TEST(Stream, SharedSendsFillWholeMessages) {
  Roles roles;
  constexpr int64_t kRows = 300, kMessageRows = 16;
  constexpr double kFraction = 0.25;
  constexpr int64_t kMessages = (kRows + kMessageRows - 1) / kMessageRows;
  for (const bool share : {true, false}) {
    SCOPED_TRACE(share ? "share_messages" : "unshared");
    const std::string name = share ? "shared" : "unshared";
    if (roles.producer) {
      StreamProducerOptions options;
      options.share_messages = share;
      options.message_rows = kMessageRows;
      options.ring_rows = 64;
      options.backpressure = StreamBackpressure::block;
      StreamProducer producer;
      producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32, options);
      std::vector<float> x(64 * kInputs), y(64 * kOutputs);
      int64_t r = 0, unshared_messages = 0;
      for (int64_t k = 0; r < kRows; ++k) {
        const int64_t n = std::min<int64_t>(1 + (k * 7) % 37, kRows - r);
        for (int64_t i = 0; i < n; ++i)
          make_row_f(roles.rank, r + i, &x[i * kInputs], &y[i * kOutputs]);
        producer.send(x.data(), y.data(), n);
        unshared_messages += (n + kMessageRows - 1) / kMessageRows;
        r += n;
      }
      EXPECT_EQ(unshared_messages, 27) << "the sends' sizes are not the ones this test describes";
      if (share) {
        EXPECT_EQ(producer.messages_sent(), kRows / kMessageRows)
            << "only whole messages before close";
        EXPECT_EQ(producer.rows_sent(), kRows / kMessageRows * kMessageRows);
      }
      producer.close();
      EXPECT_EQ(producer.messages_sent(), share ? kMessages : unshared_messages);
      EXPECT_EQ(producer.rows_sent(), kRows);
      EXPECT_EQ(producer.rows_dropped(), 0);
      sum_over_world(producer.rows_sent());
      continue;
    }
    RunConfig config = trainer_config(name, {{"dp", roles.trainers}}, "dp");
    config.stream.buffer_rows = 1024;  // every row of every producer of a group
    config.stream.min_rows = 1;
    config.stream.until = StreamUntil::closed;
    config.stream.test_fraction = kFraction;
    config.data.batch_size = roles.trainers;
    config.train.steps = 1000000;
    config.train.eval_every = 1000000;
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    while (!run.finished()) run.step();
    const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
    EXPECT_EQ(source.counters().rows_received, sum_over_world(0));
    EXPECT_EQ(source.counters().rows_received, kRows * roles.producers);
    // The messages every producer sent ({first row, rows}, in order): shared, whole messages
    // of consecutive rows; unshared, each send's rows in messages of 16 or fewer. Message m
    // of producer p goes to group_of_message(p, m); of its rows, the hash holds some out.
    std::vector<std::pair<int64_t, int64_t>> messages;
    for (int64_t k = 0, r = 0; r < kRows; ++k) {
      const int64_t n = share ? std::min(kMessageRows, kRows - r)
                              : std::min<int64_t>(1 + (k * 7) % 37, kRows - r);
      for (int64_t first = r; first < r + n; first += kMessageRows) {
        messages.emplace_back(first, std::min(kMessageRows, r + n - first));
      }
      r += n;
    }
    EXPECT_EQ(static_cast<int64_t>(messages.size()), share ? kMessages : 27);
    std::multiset<int64_t> trained, held;
    const int64_t group = run.batch_slice().index, groups = run.batch_slice().count;
    for (int64_t p = 0; p < roles.producers; ++p) {
      for (size_t m = 0; m < messages.size(); ++m) {
        if (stream_protocol::group_of_message(p, static_cast<int64_t>(m), roles.producers,
                                              groups) != group) {
          continue;
        }
        for (int64_t r = messages[m].first; r < messages[m].first + messages[m].second; ++r) {
          (stream_row_held_out(p, r, kFraction) ? held : trained).insert(p * 100000 + r);
        }
      }
    }
    const std::vector<int64_t> ids = buffer_ids(source.buffer());
    const std::vector<int64_t> held_ids = buffer_ids(source.held_out());
    EXPECT_EQ(std::multiset<int64_t>(ids.begin(), ids.end()), trained)
        << "a group's buffer holds other rows than its messages' not held out";
    EXPECT_EQ(std::multiset<int64_t>(held_ids.begin(), held_ids.end()), held)
        << "the held-out window holds other rows than the hash of their row numbers gives";
    EXPECT_GT(held.size(), 0u);
  }
}

// options.share_messages with backpressure drop: a ring of two messages whose sends cannot
// complete (no trainer receives until the producers are done; wide rows, past the eager
// limit) drops sends' rows once both slots are taken; every row is sent or dropped, and the
// trainer receives exactly the rows sent.
TEST(Stream, SharedMessagesDropWhenTheRingIsFull) {
  Roles roles;
  constexpr int64_t kWide = 4096;
  if (roles.producer) {
    StreamProducer producer;
    StreamProducerOptions options;
    options.share_messages = true;
    options.message_rows = 4;
    options.ring_rows = 8;
    producer.connect(roles.comm, "shared-drop", kWide, 1, StreamDtype::float32, options);
    std::vector<float> x(3 * kWide, 1.0f), y(3, 2.0f);
    for (int k = 0; k < 20; ++k) producer.send(x.data(), y.data(), 3);
    EXPECT_GT(producer.rows_dropped(), 0) << "the ring never filled";
    MPI_Barrier(MPI_COMM_WORLD);  // only now may the trainer receive
    producer.close();
    EXPECT_EQ(producer.rows_sent() + producer.rows_dropped(), 60);
    sum_over_world(producer.rows_sent());
    return;
  }
  RunConfig config = trainer_config("shared-drop", {{"dp", roles.trainers}}, "dp");
  config.model.sizes = {kWide, 4, 1};
  config.stream.until = StreamUntil::closed;
  config.stream.min_rows = 1;
  config.data.batch_size = roles.trainers;
  config.train.steps = 1000;
  TrainingRun run(config, {}, std::nullopt, roles.comm);
  MPI_Barrier(MPI_COMM_WORLD);
  while (!run.finished()) run.step();
  const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
  EXPECT_EQ(source.counters().rows_received, sum_over_world(0));
}

// options.share_messages and the trainer's stop (a run at lr 1e38 that fails and is
// destroyed): two whole messages are sent, then 5 rows wait in a half-filled message while
// the producer looks for the stop with empty sends; close() drops those 5 rows (rows_dropped)
// instead of sending them to a trainer that stopped.
TEST(Stream, SharedMessageHalfFilledAtAStopIsDropped) {
  Roles roles;
  if (roles.producer) {
    StreamProducerOptions options;
    options.share_messages = true;
    options.message_rows = 16;
    StreamProducer producer;
    producer.connect(roles.comm, "shared-stop", kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(8 * kInputs, 0.5f), y(8 * kOutputs, 0.25f);
    for (int k = 0; k < 4; ++k) producer.send(x.data(), y.data(), 8);  // two whole messages
    producer.send(x.data(), y.data(), 5);                              // half a message
    EXPECT_EQ(producer.rows_sent(), 32);
    for (int k = 0; k < 20000 && !producer.stopped(); ++k) {
      producer.send(x.data(), y.data(), 0);  // looks for the stop only
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(producer.stopped()) << "the failed run never told this producer to stop";
    EXPECT_EQ(producer.rows_dropped(), 0);
    producer.close();
    EXPECT_EQ(producer.rows_sent(), 32);
    EXPECT_EQ(producer.rows_dropped(), 5) << "the half-filled message's rows at close";
    EXPECT_EQ(producer.messages_sent(), 2);
    EXPECT_EQ(producer.rows_sent() + producer.rows_dropped(), 37);
    return;
  }
  RunConfig config = trainer_config("shared-stop", {{"dp", roles.trainers}}, "dp");
  config.optimizer.lr = 1e38;
  config.stream.min_rows = 8;
  config.data.batch_size = roles.trainers;
  config.train.steps = 1000;
  {
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    const auto train = [&] {
      while (!run.finished()) run.step();
    };
    EXPECT_THROW(train(), AgreedError);
  }
}

// The C API's mt_stream_options.share_messages: six sends of 5 rows fill one message of 16
// (mt_stream_rows_sent 16: the rows of the second wait in it, not handed to MPI) until
// mt_stream_close starts the second; the trainer receives the 30 rows of every producer (two
// messages: one for each batch group with 2 trainer ranks).
TEST(Stream, CSharedMessagesWaitForTheClose) {
  Roles roles;
  if (roles.producer) {
    mt_stream_options options = {64, 16, MT_STREAM_BLOCK, MPI_COMM_NULL, 0.0, nullptr, nullptr, 1};
    mt_stream* s = nullptr;
    ASSERT_EQ(mt_stream_connect(roles.comm, "c-shared", kInputs, kOutputs, MT_STREAM_FLOAT32,
                                &options, &s),
              MT_STREAM_OK)
        << mt_stream_last_error(s);
    std::vector<float> x(5 * kInputs), y(5 * kOutputs);
    for (int64_t k = 0; k < 6; ++k) {
      for (int64_t i = 0; i < 5; ++i)
        make_row_f(roles.rank, 5 * k + i, &x[i * kInputs], &y[i * kOutputs]);
      EXPECT_EQ(mt_stream_send(s, x.data(), y.data(), 5), MT_STREAM_OK) << mt_stream_last_error(s);
    }
    EXPECT_EQ(mt_stream_rows_sent(s), 16) << "a shared message started before it filled";
    EXPECT_EQ(mt_stream_close(s), MT_STREAM_OK) << mt_stream_last_error(s);
    EXPECT_EQ(mt_stream_rows_sent(s), 30);
    EXPECT_EQ(mt_stream_rows_dropped(s), 0);
    sum_over_world(mt_stream_rows_sent(s));
    mt_stream_free(s);
    return;
  }
  RunConfig config = trainer_config("c-shared", {{"dp", roles.trainers}}, "dp");
  config.stream.min_rows = 1;
  config.stream.until = StreamUntil::closed;
  config.data.batch_size = roles.trainers;
  config.train.steps = 1000000;
  TrainingRun run(config, {}, std::nullopt, roles.comm);
  while (!run.finished()) run.step();
  const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
  EXPECT_EQ(source.counters().rows_received, sum_over_world(0));
  EXPECT_EQ(source.counters().rows_received, 30 * roles.producers);
}

// direct_sends needs backpressure block and excludes share_messages; split_bytes may not be
// negative: connect refuses each before the rendezvous (every rank alone), naming the option.
TEST(Stream, DirectSendsAndSplitBytesRefusedWhereTheyCannotHold) {
  const auto refused = [](const StreamProducerOptions& options,
                          std::initializer_list<std::string> fragments) {
    StreamProducer producer;
    testing::expect_bad_input(
        [&] {
          producer.connect(MPI_COMM_SELF, "t", kInputs, kOutputs, StreamDtype::float32, options);
        },
        fragments);
    EXPECT_FALSE(producer.connected());
  };
  StreamProducerOptions drop;
  drop.direct_sends = true;
  refused(drop, {"stream \"t\"", "direct_sends needs backpressure block", "drop"});
  StreamProducerOptions shared;
  shared.direct_sends = true;
  shared.backpressure = StreamBackpressure::block;
  shared.share_messages = true;
  refused(shared, {"direct_sends and share_messages"});
  StreamProducerOptions negative;
  negative.split_bytes = -1;
  refused(negative, {"split_bytes", "-1"});
}

// mt_stream_flush (C, and Fortran through the same function) starts the shared message being
// filled: its rows are handed to MPI at once, not when it fills or at the close; a second flush,
// or one with nothing waiting, sends nothing; on a closed stream it is bad input with a
// sentence. The trainer receives every row.
TEST(Stream, CFlushStartsTheSharedMessage) {
  Roles roles;
  if (roles.producer) {
    EXPECT_EQ(mt_stream_flush(nullptr), MT_STREAM_BAD_INPUT);
    mt_stream_options options = {64, 16, MT_STREAM_BLOCK, MPI_COMM_NULL, 0.0, nullptr, nullptr, 1};
    mt_stream* s = nullptr;
    ASSERT_EQ(mt_stream_connect(roles.comm, "c-flush", kInputs, kOutputs, MT_STREAM_FLOAT32,
                                &options, &s),
              MT_STREAM_OK)
        << mt_stream_last_error(s);
    std::vector<float> x(5 * kInputs), y(5 * kOutputs);
    for (int64_t i = 0; i < 5; ++i) make_row_f(roles.rank, i, &x[i * kInputs], &y[i * kOutputs]);
    EXPECT_EQ(mt_stream_flush(s), MT_STREAM_OK) << "nothing waits: a flush that sends nothing";
    EXPECT_EQ(mt_stream_send(s, x.data(), y.data(), 5), MT_STREAM_OK) << mt_stream_last_error(s);
    EXPECT_EQ(mt_stream_rows_sent(s), 0) << "a shared message started before it filled";
    EXPECT_EQ(mt_stream_flush(s), MT_STREAM_OK) << mt_stream_last_error(s);
    EXPECT_EQ(mt_stream_rows_sent(s), 5) << "the flush did not start the shared message";
    EXPECT_EQ(mt_stream_flush(s), MT_STREAM_OK);
    EXPECT_EQ(mt_stream_rows_sent(s), 5);
    for (int64_t i = 0; i < 5; ++i) {
      make_row_f(roles.rank, 5 + i, &x[i * kInputs], &y[i * kOutputs]);
    }
    EXPECT_EQ(mt_stream_send(s, x.data(), y.data(), 5), MT_STREAM_OK) << mt_stream_last_error(s);
    EXPECT_EQ(mt_stream_rows_sent(s), 5);
    EXPECT_EQ(mt_stream_close(s), MT_STREAM_OK) << mt_stream_last_error(s);
    EXPECT_EQ(mt_stream_rows_sent(s), 10);
    EXPECT_EQ(mt_stream_rows_dropped(s), 0);
    EXPECT_EQ(mt_stream_flush(s), MT_STREAM_BAD_INPUT);
    EXPECT_NE(std::string(mt_stream_last_error(s))
                  .find("mt_stream_flush: the stream is not "
                        "connected"),
              std::string::npos)
        << mt_stream_last_error(s);
    sum_over_world(mt_stream_rows_sent(s));
    mt_stream_free(s);
    return;
  }
  RunConfig config = trainer_config("c-flush", {{"dp", roles.trainers}}, "dp");
  config.stream.min_rows = 1;
  config.stream.until = StreamUntil::closed;
  config.data.batch_size = roles.trainers;
  config.train.steps = 1000000;
  TrainingRun run(config, {}, std::nullopt, roles.comm);
  while (!run.finished()) run.step();
  const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
  EXPECT_EQ(source.counters().rows_received, sum_over_world(0));
  EXPECT_EQ(source.counters().rows_received, 10 * roles.producers);
}

// Large messages go as a header and two payloads (StreamProducerOptions::split_bytes), which
// the trainer receives straight into its buffer's slots where they fit (float32, nothing held
// out, consecutive slots) and through its staging otherwise (the window wrapping within a
// message, the full reservoir, float64, held-out rows). The reference, computed in the same
// test: the same rows sent whole (split_bytes too large to split), into a StreamSource of the
// same keys. The split runs (every message split; split from 8 rows' bytes, so one producer's
// sends of 1 to 37 rows mix whole and split messages), and those with direct_sends (sent from
// the caller's arrays, which it fills with NaN as soon as send() returns; at most 16 rows, 384
// B, under MPI's 4 KiB eager limit, so the NaN cannot catch a send returning early here:
// DirectSendsReturnOnlyOnceTheirRowsAreTaken does), must hold the same bits in the buffer and
// held-out window, row for row, with the same counters; so must shared messages split against
// shared messages whole. The rows received straight are counted where the path applies. dp groups
// and, with 2 trainer ranks, one group of both ranks (tp-like: the same bits on each).
TEST(Stream, SplitMessagesLandInTheBufferAsWholeOnesDo) {
  Roles roles;
  struct Case {
    const char* name;
    StreamPolicy policy;
    StreamDtype dtype;
    double test_fraction;
    bool direct;  // some rows must go straight into the buffer
  };
  // 300 rows per producer in messages of 16 (sends of irregular sizes cut them) into 40 slots:
  // the window wraps inside some messages, the reservoir fills and then hashes.
  const Case cases[] = {{"window-f32", StreamPolicy::window, StreamDtype::float32, 0.0, true},
                        {"reservoir-f32", StreamPolicy::reservoir, StreamDtype::float32, 0.0, true},
                        {"window-f64", StreamPolicy::window, StreamDtype::float64, 0.0, false},
                        {"held-out-f32", StreamPolicy::window, StreamDtype::float32, 0.25, false}};
  const int64_t rows_per_producer = 300, capacity = 40;
  for (const bool one_group : {false, true}) {
    if (one_group && roles.trainers < 2) continue;
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + (one_group ? " in one group" : " in dp groups"));
      // Runs: 0 whole, 1 split, 2 direct, 3 split from 8 rows (the sends of 1 to 37 rows mix
      // whole and split messages), 4 shared messages whole, 5 shared messages split (the
      // partial ones flushed: produce(), and close()); 1-3 must equal 0, and 5 equal 4.
      // [run][x, y, held-out x, held-out y, first rows' x and y]
      constexpr int kRuns = 6;
      std::vector<std::vector<float>> bits[kRuns];
      int64_t counters[kRuns][3] = {};
      for (int split = 0; split < kRuns; ++split) {
        const std::string name = std::string("split-") + c.name + "-" + std::to_string(split);
        if (roles.producer) {
          StreamProducerOptions options;
          options.message_rows = 16;
          options.ring_rows = 64;
          options.backpressure = StreamBackpressure::block;
          const int64_t row_bytes =
              (kInputs + kOutputs) * (c.dtype == StreamDtype::float64 ? 8 : 4);
          options.split_bytes = split == 0 || split == 4 ? (int64_t{1} << 40)
                                : split == 3             ? 8 * row_bytes
                                                         : 0;
          options.direct_sends = split == 2;
          options.share_messages = split >= 4;
          EXPECT_EQ(produce(roles.comm, roles.rank, name, rows_per_producer, c.dtype, options),
                    rows_per_producer);
          continue;
        }
        StreamSection section;
        section.name = name;
        section.buffer_rows = capacity;
        section.policy = c.policy;
        section.dtype =
            c.dtype == StreamDtype::float64 ? StreamRowType::float64 : StreamRowType::float32;
        section.test_fraction = c.test_fraction;
        section.min_rows = 1;
        section.until = StreamUntil::closed;
        section.producer_timeout = 0;
        section.merge = StreamMerge::round_robin;  // two producers in one group: a fixed order
        BatchSlice slice;
        slice.index = one_group ? 0 : roles.rank;
        slice.count = one_group ? 1 : roles.trainers;
        slice.global_batch = roles.trainers;
        slice.rows = one_group ? roles.trainers : 1;
        StreamSource source(section, roles.comm, slice, kInputs, kOutputs, 1, 7);
        source.keep_first_rows(8);
        do {
          source.pull();
        } while (!source.ended());
        source.finish();
        const StreamBuffer& b = source.buffer();
        const StreamBuffer& h = source.held_out();
        bits[split] = {std::vector<float>(b.x(0), b.x(0) + capacity * kInputs),
                       std::vector<float>(b.y(0), b.y(0) + capacity * kOutputs),
                       std::vector<float>(h.x(0), h.x(0) + h.capacity() * kInputs),
                       std::vector<float>(h.y(0), h.y(0) + h.capacity() * kOutputs)};
        std::vector<float> first_x, first_y;
        source.first_rows(first_x, first_y);
        bits[split].push_back(first_x);
        bits[split].push_back(first_y);
        counters[split][0] = source.counters().rows_received;
        counters[split][1] = source.counters().rows_overwritten;
        counters[split][2] = source.counters().rows_held_out;
        if (split == 0 || split == 4) {
          EXPECT_EQ(source.copy_times().rows_direct, 0) << "a whole message went straight";
        } else if (c.direct) {
          EXPECT_GT(source.copy_times().rows_direct, 0) << "no split message went straight";
          EXPECT_LT(source.copy_times().rows_direct, b.seen()) << "the staging path never ran";
        } else {
          EXPECT_EQ(source.copy_times().rows_direct, 0);
        }
        EXPECT_EQ(source.counters().rows_received, int64_t{roles.producers} * rows_per_producer);
      }
      if (roles.producer) continue;
      for (int run = 1; run < kRuns; ++run) {
        if (run == 4) continue;  // the reference of run 5
        const int ref = run == 5 ? 4 : 0;
        for (size_t k = 0; k < bits[ref].size(); ++k) {
          EXPECT_EQ(bits[run][k], bits[ref][k]) << "part " << k << " differs in run " << run;
        }
        for (int k = 0; k < 3; ++k) {
          EXPECT_EQ(counters[run][k], counters[ref][k]) << "counter " << k << ", run " << run;
        }
      }
    }
  }
}

// direct_sends with messages over MPI's eager limit (1,024 rows: x 16 KiB, y 8 KiB), whose
// bytes MPI reads from the caller's arrays only when the trainer receives them: the producer
// overwrites its arrays with NaN as soon as each send returns, and every row the trainer holds
// must be the row sent (by its id, x[0]), with nothing dropped. A send returning before its
// message was taken would deliver NaN (checked by hand: without the wait this fails).
TEST(Stream, DirectSendsReturnOnlyOnceTheirRowsAreTaken) {
  Roles roles;
  constexpr int64_t kRows = 1024, kSends = 6;
  if (roles.producer) {
    StreamProducerOptions options;
    options.message_rows = kRows;
    options.ring_rows = 2 * kRows;
    options.backpressure = StreamBackpressure::block;
    options.direct_sends = true;
    options.split_bytes = 0;  // 24 KiB messages: split (the default splits from 64 KiB)
    StreamProducer producer;
    producer.connect(roles.comm, "direct", kInputs, kOutputs, StreamDtype::float32, options);
    std::vector<float> x(kRows * kInputs), y(kRows * kOutputs);
    for (int64_t k = 0; k < kSends; ++k) {
      for (int64_t i = 0; i < kRows; ++i) {
        make_row_f(roles.rank, k * kRows + i, &x[i * kInputs], &y[i * kOutputs]);
      }
      producer.send(x.data(), y.data(), kRows);
      std::fill(x.begin(), x.end(), std::nanf(""));
      std::fill(y.begin(), y.end(), std::nanf(""));
    }
    EXPECT_DOUBLE_EQ(producer.pack_seconds(), 0.0) << "a direct send packed its rows";
    producer.close();
    EXPECT_EQ(producer.rows_sent(), kRows * kSends);
    EXPECT_EQ(producer.rows_dropped(), 0);
    return;
  }
  StreamSection section;
  section.name = "direct";
  section.buffer_rows = kRows * kSends * roles.producers;  // every row a group gets
  section.min_rows = 1;
  section.until = StreamUntil::closed;
  section.producer_timeout = 0;
  BatchSlice slice;
  slice.index = roles.rank;
  slice.count = roles.trainers;
  slice.global_batch = roles.trainers;
  slice.rows = 1;
  StreamSource source(section, roles.comm, slice, kInputs, kOutputs, 1, 7);
  do {
    source.pull();
  } while (!source.ended());
  source.finish();
  const StreamBuffer& buffer = source.buffer();
  EXPECT_EQ(source.counters().rows_received, kRows * kSends * roles.producers);
  EXPECT_EQ(source.copy_times().rows_direct, buffer.seen()) << "a message took the staging path";
  int64_t wrong = 0;
  for (int64_t slot = 0; slot < buffer.filled(); ++slot) {
    const float* x = buffer.x(slot);
    const float* y = buffer.y(slot);
    if (std::isnan(x[0])) {  // read after send() returned (a cast of NaN would be undefined)
      ++wrong;
      continue;
    }
    const auto id = static_cast<int64_t>(x[0]);
    float ex[kInputs], ey[kOutputs];
    make_row_f(id / 100000, id % 100000, ex, ey);
    wrong += std::equal(x, x + kInputs, ex) && std::equal(y, y + kOutputs, ey) ? 0 : 1;
  }
  EXPECT_EQ(wrong, 0) << "rows that are not the rows sent (NaN: read after send() returned)";
}

}  // namespace
}  // namespace meshtrain
