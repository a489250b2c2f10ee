// Online training with two producers feeding one batch group (docs/online.md): world ranks 0
// and 1 are producers, the rest (1 or 2 ranks) the trainer, on dp = 1 or tp = 2, so that one
// group takes both producers' rows. Checked:
// - stream.merge = "round_robin": the producers sleep at random between their sends (so their
//   messages arrive in another interleaving each run), and two runs give the same buffer bits,
//   losses and parameters; the buffer holds exactly the round robin of the producers' messages
//   by producer rank and message index, and a single producer that sends those messages in that
//   order gives the same run bit for bit. The normalization "standard" statistics of the first
//   min_rows rows (fewer than every row) are the same bits in both runs.
// - stream.held_out_rows: the held-out window has that size (not ceil(buffer_rows x
//   test_fraction)), holds exactly the newest held-out rows, is evaluated whole, and the plan
//   counts it; the key is refused without test_fraction. On dp = 2 (np 4) each group's window
//   holds its own producer's rows, the other producer's close taken outside the turn.
// - stream.producer_timeout under round_robin: a producer silent from the rendezvous while the
//   merge waits at it is taken for gone, the producer held back meanwhile is not, and the gone
//   one's later rows and close are still taken.
// The registration's timeout ends any hang.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/stream/producer.hpp"
#include "framework/stream/stream_protocol.hpp"
#include "run/training_run.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kInputs = 4, kOutputs = 2, kMessageRows = 8;
constexpr int kProducers = 2;
// Rows each producer sends: different, so that the merge goes on with one producer after the
// other closed.
constexpr int64_t kRows[kProducers] = {150, 100};

// World ranks 0 and 1 produce; the others train.
struct Roles {
  int trainers = 1;
  bool producer = false;
  MPI_Comm comm = MPI_COMM_NULL;  // this side's
  int rank = 0;                   // in comm
  Roles() {
    trainers = world_size() - kProducers;
    producer = world_rank() < kProducers;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, producer ? 0 : 1, world_rank(), &comm),
              "MPI_Comm_split");
    MPI_Comm_rank(comm, &rank);
  }
  ~Roles() { MPI_Comm_free(&comm); }
};

// Producer p's row r: x[0] is its id p * 100000 + r, the rest a smooth function of it.
void make_row(int64_t p, int64_t r, float* x, float* y) {
  const double t = 0.01 * static_cast<double>(r) + 0.37 * static_cast<double>(p);
  x[0] = static_cast<float>(p * 100000 + r);
  for (int64_t j = 1; j < kInputs; ++j) x[j] = static_cast<float>(std::sin(t * (j + 1)));
  for (int64_t o = 0; o < kOutputs; ++o) y[o] = static_cast<float>(std::cos(t + o));
}

// Producer p's sends: irregular sizes (1 to 19 rows), each split into messages of at most
// kMessageRows rows from its start, as StreamProducer::send does.
std::vector<int64_t> send_sizes(int64_t p) {
  std::vector<int64_t> sizes;
  for (int64_t r = 0, k = 0; r < kRows[p]; ++k) {
    sizes.push_back(std::min<int64_t>(1 + (k * 5 + p * 3) % 19, kRows[p] - r));
    r += sizes.back();
  }
  return sizes;
}

struct Message {
  int64_t producer, first_row, rows;
};

// The round robin of the producers' messages by producer rank and message index, a producer
// leaving it after its last message (one batch group takes every message).
std::vector<Message> merged_messages() {
  std::vector<std::vector<Message>> of(kProducers);
  for (int64_t p = 0; p < kProducers; ++p) {
    int64_t r = 0;
    for (int64_t n : send_sizes(p)) {
      for (int64_t done = 0; done < n; done += kMessageRows) {
        of[static_cast<size_t>(p)].push_back({p, r + done, std::min(kMessageRows, n - done)});
      }
      r += n;
    }
  }
  std::vector<Message> merged;
  for (size_t m = 0; merged.size() < of[0].size() + of[1].size(); ++m) {
    for (const auto& messages : of) {
      if (m < messages.size()) merged.push_back(messages[m]);
    }
  }
  return merged;
}

StreamProducerOptions producer_options() {
  StreamProducerOptions options;
  options.message_rows = kMessageRows;
  options.ring_rows = 4096;  // every message: nothing dropped
  options.backpressure = StreamBackpressure::block;
  return options;
}

// Producer `p` sends its rows (send_sizes), sleeping 0 to 2 ms at random before each send
// (seeded from std::random_device: another arrival order in every run).
void produce_at_random_times(MPI_Comm comm, int64_t p, const std::string& name) {
  std::mt19937 random(std::random_device{}());
  std::uniform_int_distribution<int> micros(0, 2000);
  StreamProducer producer;
  producer.connect(comm, name, kInputs, kOutputs, StreamDtype::float32, producer_options());
  std::vector<float> x(32 * kInputs), y(32 * kOutputs);
  int64_t r = 0;
  for (int64_t n : send_sizes(p)) {
    for (int64_t i = 0; i < n; ++i) make_row(p, r + i, &x[i * kInputs], &y[i * kOutputs]);
    std::this_thread::sleep_for(std::chrono::microseconds(micros(random)));
    producer.send(x.data(), y.data(), n);
    r += n;
  }
  producer.close();
  EXPECT_EQ(producer.rows_dropped(), 0);
}

// Producer rank 0 alone sends the merged messages in their order (rank 1 takes part in the
// rendezvous as neither producer nor trainer).
void produce_merged_alone(MPI_Comm comm, int rank, const std::string& name) {
  if (rank != 0) {
    stream_protocol::Hello none;
    none.role = stream_protocol::kNone;
    MPI_Comm stream_comm = MPI_COMM_NULL;
    stream_protocol::rendezvous(MPI_COMM_WORLD, none, &stream_comm);
    check_mpi(MPI_Comm_free(&stream_comm), "MPI_Comm_free");
    return;
  }
  StreamProducerOptions options = producer_options();
  options.parent = MPI_COMM_WORLD;
  StreamProducer producer;
  producer.connect(comm, name, kInputs, kOutputs, StreamDtype::float32, options);
  std::vector<float> x(kMessageRows * kInputs), y(kMessageRows * kOutputs);
  for (const Message& m : merged_messages()) {
    for (int64_t i = 0; i < m.rows; ++i) {
      make_row(m.producer, m.first_row + i, &x[i * kInputs], &y[i * kOutputs]);
    }
    producer.send(x.data(), y.data(), m.rows);  // one message
  }
  producer.close();
}

RunConfig trainer_config(const std::string& name, const testing::MeshCase& mesh) {
  RunConfig config;
  config.file = "order_test";
  config.run.seed = 5;
  config.mesh.axes = mesh.axes;
  config.model.sizes = {kInputs, 16, kOutputs};
  config.model.activation = Activation::tanh;
  config.model.loss = LossKind::mse;
  config.partition.preset = mesh.preset;
  config.partition.min_sharding_size = 0;
  config.data.source = DataSource::stream;
  config.data.batch_size = 16;
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-3;
  config.train.log_every = 1;
  config.stream.name = name;
  config.stream.merge = StreamMerge::round_robin;
  return config;
}

// One group on every trainer mesh: both producers feed it.
std::vector<testing::MeshCase> one_group_meshes(int trainers) {
  if (trainers == 1) return {{"dp", {{"dp", 1}}}};
  return {{"tp", {{"tp", trainers}}}};
}

std::vector<int64_t> buffer_ids(const StreamBuffer& buffer) {
  std::vector<int64_t> ids;
  for (int64_t s = 0; s < buffer.filled(); ++s) ids.push_back(static_cast<int64_t>(buffer.x(s)[0]));
  return ids;
}

struct Outcome {
  std::vector<int64_t> ids;  // the buffer's rows, slot by slot
  std::vector<std::vector<float>> buffer_x;
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  Normalization stats;
};

constexpr int64_t kSteps = 8;

// The trainer's side of one run: a buffer holding every row, the first step waiting for
// `min_rows` of them (every row: the buffer's contents at each step are then the same whatever
// the timing; fewer: only the statistics of the first rows are).
Outcome train(const std::string& name, const testing::MeshCase& mesh, MPI_Comm comm,
              int64_t min_rows, bool normalize) {
  RunConfig config = trainer_config(name, mesh);
  config.stream.buffer_rows = kRows[0] + kRows[1];
  config.stream.min_rows = min_rows;
  config.train.steps = kSteps;
  if (normalize) {
    config.data.normalize_inputs = Normalize::standard;
    config.data.normalize_targets = Normalize::standard;
  }
  Outcome out;
  TrainingRun run(config, {}, std::nullopt, comm);
  const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
  if (min_rows == config.stream.buffer_rows) {
    for (int64_t s = 0; s < kSteps; ++s) out.losses.push_back(run.step().loss);
    out.params = testing::copy_parameters(run);
    out.ids = buffer_ids(source.buffer());
    for (int64_t s = 0; s < source.buffer().filled(); ++s) {
      out.buffer_x.emplace_back(source.buffer().x(s), source.buffer().x(s) + kInputs);
    }
  } else {
    run.step();  // the statistics come before it
  }
  out.stats = run.normalization();
  run.mark_completed();  // stopped early on purpose: the producers get done
  return out;
}

TEST(StreamMerge, RoundRobinIsTheSameWhateverTheArrivalTiming) {
  Roles roles;
  ASSERT_GE(roles.trainers, 1) << "registered at np 3 and 4: two producers and the trainer";
  std::vector<int64_t> merged_ids;
  for (const Message& m : merged_messages()) {
    for (int64_t i = 0; i < m.rows; ++i)
      merged_ids.push_back(m.producer * 100000 + m.first_row + i);
  }
  for (const testing::MeshCase& mesh : one_group_meshes(roles.trainers)) {
    SCOPED_TRACE(mesh.preset);
    const int64_t every_row = kRows[0] + kRows[1];
    // Two runs at random timings, then the single producer's; then two runs whose first
    // step waits for 64 rows only, with normalization "standard" (their statistics compared).
    std::vector<Outcome> runs;
    std::vector<Normalization> first_rows_stats;
    for (int run = 0; run < 5; ++run) {
      const std::string name = "merge-" + mesh.preset + "-" + std::to_string(run);
      if (roles.producer) {
        if (run == 2) {
          produce_merged_alone(roles.comm, roles.rank, name);
        } else {
          produce_at_random_times(roles.comm, roles.rank, name);
        }
        continue;
      }
      if (run < 3) {
        runs.push_back(train(name, mesh, roles.comm, every_row, /*normalize=*/false));
      } else {
        first_rows_stats.push_back(train(name, mesh, roles.comm, 64, /*normalize=*/true).stats);
      }
    }
    if (roles.producer) continue;
    ASSERT_EQ(runs.size(), 3u);
    EXPECT_EQ(runs[0].ids, merged_ids) << "not the round robin by producer and message index";
    for (size_t k = 1; k < runs.size(); ++k) {
      SCOPED_TRACE(k == 1 ? "a second run at other timings" : "one producer sending that order");
      EXPECT_EQ(runs[k].ids, merged_ids);
      EXPECT_EQ(runs[k].buffer_x, runs[0].buffer_x);
      EXPECT_EQ(runs[k].losses, runs[0].losses);  // bit for bit: == on doubles
      EXPECT_TRUE(testing::same_bits(runs[k].params, runs[0].params));
    }
    ASSERT_EQ(first_rows_stats.size(), 2u);
    EXPECT_TRUE(first_rows_stats[0].inputs());
    EXPECT_EQ(first_rows_stats[0].input_mean, first_rows_stats[1].input_mean);
    EXPECT_EQ(first_rows_stats[0].input_std, first_rows_stats[1].input_std);
    EXPECT_EQ(first_rows_stats[0].target_mean, first_rows_stats[1].target_mean);
    EXPECT_EQ(first_rows_stats[0].target_std, first_rows_stats[1].target_std);
    // They are those of the merge's first 64 rows (input 0 is the row id): its mean here.
    double id_mean = 0.0;
    for (int64_t i = 0; i < 64; ++i) id_mean += static_cast<double>(merged_ids[i]) / 64.0;
    EXPECT_NEAR(first_rows_stats[0].input_mean[0], id_mean, 1e-9 * id_mean);
  }
}

TEST(StreamMerge, HeldOutWindowOfItsOwnSize) {
  Roles roles;
  ASSERT_GE(roles.trainers, 1);
  const double fraction = 0.25;
  const int64_t window = 12;
  // The held-out rows in the merge's order: the window keeps the newest `window`, held-out
  // row n in slot n mod window.
  std::vector<int64_t> held;
  for (const Message& m : merged_messages()) {
    for (int64_t i = 0; i < m.rows; ++i) {
      if (stream_row_held_out(m.producer, m.first_row + i, fraction)) {
        held.push_back(m.producer * 100000 + m.first_row + i);
      }
    }
  }
  ASSERT_GT(static_cast<int64_t>(held.size()), window) << "the window must overwrite";
  // The newest `window` of `rows` (in the order taken), row n in slot n mod window.
  const auto window_of = [&](const std::vector<int64_t>& rows) {
    std::vector<int64_t> slots(static_cast<size_t>(window));
    for (size_t n = 0; n < rows.size(); ++n) slots[n % window] = rows[n];
    return slots;
  };
  // On dp = 2 (np 4) each group takes one producer's rows (group_of_message: producer p's
  // messages all go to group p) and only the other's close, which the merge takes outside the
  // turn: the window of group g holds producer g's newest held-out rows.
  std::vector<testing::MeshCase> meshes = one_group_meshes(roles.trainers);
  if (roles.trainers == 2) meshes.push_back({"dp", {{"dp", 2}}});
  for (const testing::MeshCase& mesh : meshes) {
    SCOPED_TRACE(mesh.preset);
    const bool two_groups = mesh.preset == "dp" && roles.trainers == 2;
    const std::string name = "held-out-window-" + mesh.preset;
    TempDir dir(/*shared=*/true);  // collective over the world
    if (roles.producer) {
      produce_at_random_times(roles.comm, roles.rank, name);
      continue;
    }
    RunConfig config = trainer_config(name, mesh);
    config.stream.buffer_rows = 256;  // the default window would be ceil(256 x 0.25) = 64
    config.stream.min_rows = 4;
    config.stream.until = StreamUntil::closed;
    config.stream.test_fraction = fraction;
    config.stream.held_out_rows = window;
    config.train.steps = 1000000;
    config.train.eval_every = 1000000;  // the last step evaluates
    config.run.output_dir = dir.path() + "/run";
    config.checkpoint.dir = dir.path() + "/run/checkpoints";
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    EXPECT_EQ(run.planned_memory().data.source_bytes, (256 + window) * (kInputs + kOutputs) * 4);
    const RunSummary summary = run.train();
    const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
    EXPECT_EQ(source.held_out().capacity(), window);
    EXPECT_EQ(source.counters().rows_held_out, static_cast<int64_t>(held.size()));
    std::vector<int64_t> mine = held;  // this rank's group's held-out rows, in the merge's order
    if (two_groups) {
      ASSERT_EQ(source.groups(), 2);
      const int64_t group = roles.rank;  // dp over the trainer's 2 ranks
      mine.clear();
      for (int64_t id : held) {
        if (id / 100000 == group) mine.push_back(id);
      }
      ASSERT_GT(static_cast<int64_t>(mine.size()), window) << "the window must overwrite";
    }
    EXPECT_EQ(buffer_ids(source.held_out()), window_of(mine));
    ASSERT_TRUE(summary.last_eval.has_value());
    // Each group's window once (the ranks of a group hold the same rows).
    EXPECT_EQ(summary.last_eval->test_rows, (two_groups ? 2 : 1) * window);
  }
}

// A producer that sends nothing for longer than stream.producer_timeout while the merge waits
// at its turn, beside one that the merge holds back meanwhile: producer 0 connects, then sleeps
// 2 s before its first send; producer 1 sends 6 sends (more than the trainer's 4 staging slots
// of messages) at once, then the rest, one every 0.5 s, and closes once producer 0 closed.
// With producer_timeout = 1 s:
// - producer 0 is taken for gone (its clock runs from the rendezvous while the merge waits at
//   it; before, one that died before its first rows held a round_robin run for ever);
// - producer 1, whose staging stayed full meanwhile, is not (before, its clock ran while the
//   trainer held it back and it was named too);
// - producer 0's rows and close, sent once it was taken for gone, are still taken, as they
//   come, and its close() gets its done (before, its staging stayed full and its close()
//   waited for a last word that never came: the registration's timeout);
// so the run ends by itself with exactly one warning, naming producer 0 (and producer 1 as held
// back by the merge meanwhile), and every row.
TEST(StreamMerge, ProducerGoneLeavesTheTurnOnly) {
  Roles roles;
  ASSERT_GE(roles.trainers, 1);
  for (const testing::MeshCase& mesh : one_group_meshes(roles.trainers)) {
    SCOPED_TRACE(mesh.preset);
    const std::string name = "gone-" + mesh.preset;
    if (roles.producer) {
      const int64_t p = roles.rank;
      StreamProducer producer;
      producer.connect(roles.comm, name, kInputs, kOutputs, StreamDtype::float32,
                       producer_options());
      if (p == 0) std::this_thread::sleep_for(std::chrono::seconds(2));
      std::vector<float> x(32 * kInputs), y(32 * kOutputs);
      int64_t r = 0, sends = 0;
      for (int64_t n : send_sizes(p)) {
        // Producer 1's rest every 0.5 s (never silent for the timeout).
        if (p == 1 && sends++ >= 6) std::this_thread::sleep_for(std::chrono::milliseconds(500));
        for (int64_t i = 0; i < n; ++i) make_row(p, r + i, &x[i * kInputs], &y[i * kOutputs]);
        producer.send(x.data(), y.data(), n);
        r += n;
      }
      // Producer 1's close, which lets the run end, only once producer 0's close() returned,
      // i.e. once a pull took that close outside the turn.
      if (p == 0) producer.close();
      check_mpi(MPI_Barrier(roles.comm), "MPI_Barrier");
      if (p == 1) producer.close();
      EXPECT_EQ(producer.rows_dropped(), 0);
      continue;
    }
    RunConfig config = trainer_config(name, mesh);
    config.stream.buffer_rows = kRows[0] + kRows[1];
    config.stream.min_rows = 4;
    config.stream.until = StreamUntil::closed;
    config.stream.producer_timeout = 1.0;
    config.train.steps = 100000000;
    config.train.log_every = 1000000;
    std::vector<std::string> warnings;
    RunEvents events;
    events.on_warning = [&](const std::string& w) { warnings.push_back(w); };
    std::vector<int64_t> ids;
    {
      TrainingRun run(config, events, std::nullopt, roles.comm);
      run.train();
      const auto& source = dynamic_cast<const StreamSource&>(run.train_data());
      EXPECT_TRUE(source.producer_gone(0));
      EXPECT_FALSE(source.producer_gone(1)) << "held back by the merge, not silent";
      EXPECT_EQ(source.counters().rows_received, kRows[0] + kRows[1]);
      ids = buffer_ids(source.buffer());
    }
    std::vector<int64_t> every_id;
    for (int64_t p = 0; p < kProducers; ++p) {
      for (int64_t r = 0; r < kRows[p]; ++r) every_id.push_back(p * 100000 + r);
    }
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(ids, every_id);  // every row once (out of the turn's order after the gone one)
    if (roles.rank == 0) {
      ASSERT_EQ(warnings.size(), 1u);
      EXPECT_NE(warnings[0].find("producer 0 (world rank 0) sent nothing for 1 s"),
                std::string::npos)
          << warnings[0];
      EXPECT_NE(warnings[0].find("the merge waited at its turn and held back producer 1"),
                std::string::npos)
          << warnings[0];
    } else {
      EXPECT_TRUE(warnings.empty());  // trainer rank 0 alone reports
    }
  }
}

TEST(StreamMerge, KeysReadAndRefused) {
  const std::string text =
      "[model]\nsizes = [4, 3]\nloss = \"mse\"\n[train]\nsteps = 5\n"
      "[data]\nsource = \"stream\"\n[stream]\nbuffer_rows = 1000\n";
  const RunConfig c = parse_config(text, "online.toml");
  EXPECT_EQ(c.stream.merge, StreamMerge::arrival);  // the default: no waiting
  EXPECT_EQ(c.stream.held_out_rows, 0);
  const RunConfig set = parse_config(
      text, "online.toml",
      {"stream.merge=round_robin", "stream.test_fraction=0.1", "stream.held_out_rows=7"});
  EXPECT_EQ(set.stream.merge, StreamMerge::round_robin);
  EXPECT_EQ(stream_held_out_rows(set.stream), 7);
  const RunConfig again = parse_config(config_to_toml(set), "again.toml");
  EXPECT_EQ(again.stream.merge, StreamMerge::round_robin);
  EXPECT_EQ(again.stream.held_out_rows, 7);
  EXPECT_EQ(stream_held_out_rows(parse_config(text, "t.toml", {"stream.test_fraction=0.1"}).stream),
            100);  // ceil(1000 x 0.1) without the key
  testing::expect_bad_input([&] { parse_config(text, "t.toml", {"stream.merge=sorted"}); },
                            {"stream.merge", "arrival", "round_robin", "sorted"});
  testing::expect_bad_input([&] { parse_config(text, "t.toml", {"stream.held_out_rows=7"}); },
                            {"t.toml", "held_out_rows = 7", "test_fraction = 0"});
  testing::expect_bad_input(
      [&] {
        parse_config(text, "t.toml", {"stream.test_fraction=0.1", "stream.held_out_rows=-1"});
      },
      {"stream.held_out_rows", "-1"});
  // A library caller's section, not read from a config: refused before the rendezvous (so not
  // collective; each rank on its own).
  StreamSection section;
  section.name = "negative-window";
  section.buffer_rows = 16;
  section.test_fraction = 0.5;
  section.held_out_rows = -1;
  BatchSlice slice;
  slice.global_batch = slice.rows = 4;
  testing::expect_bad_input(
      [&] { StreamSource source(section, MPI_COMM_SELF, slice, kInputs, kOutputs, 4, 0); },
      {"stream \"negative-window\"", "held_out_rows", "-1"});
}

}  // namespace
}  // namespace meshtrain
