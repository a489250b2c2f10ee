// Multi-rank tests of batch slicing: the union over ranks of their slices of step s is
// the single-rank global batch of step s, for several meshes, at NP 1, 2, 4 and 8, read
// through a BatchStream with and without its reader thread, for every shuffle mode; tp
// ranks share a slice; the order is the same on every rank; evaluation covers the test
// split exactly once.

#include <gtest/gtest.h>
#include <mpi.h>

#include <map>
#include <memory>

#include "framework/io/batch_stream.hpp"
#include "framework/io/data.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// A classification set whose values say where they came from: x[s, c] = s + c / 100,
// label = s mod 10.
Dataset numbered_dataset(int64_t n, int64_t f) {
  Dataset d;
  d.description = "numbered test set";
  d.num_samples = n;
  d.features = f;
  d.num_classes = 10;
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t c = 0; c < f; ++c) d.inputs.push_back(static_cast<float>(s) + c / 100.0f);
    d.labels.push_back(static_cast<int32_t>(s % 10));
  }
  return d;
}

// The meshes of `world` ranks to test, each with the logical batch axes (fsdp, dp).
std::vector<Mesh> meshes_of(int world) {
  std::vector<std::vector<std::pair<std::string, int>>> shapes;
  if (world == 1) shapes = {{{"dp", 1}, {"fsdp", 1}, {"tp", 1}}};
  if (world == 2) shapes = {{{"dp", 2}}, {{"fsdp", 2}}, {{"tp", 2}}, {{"dp", 1}, {"fsdp", 2}}};
  if (world == 4) {
    shapes = {
        {{"dp", 4}}, {{"dp", 2}, {"fsdp", 2}}, {{"fsdp", 2}, {"tp", 2}}, {{"dp", 2}, {"tp", 2}}};
  }
  if (world == 8) {
    // 2x4: the batch tuple (fsdp, dp) is read fsdp-major while ranks are dp-major.
    shapes = {{{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, {{"fsdp", 8}}, {{"dp", 2}, {"fsdp", 4}}};
  }
  // Every known axis present (absent ones of size 1), in the default order.
  std::vector<Mesh> meshes;
  for (const auto& s : shapes) {
    std::vector<std::pair<std::string, int>> full;
    for (const auto& name : Mesh::known_axes()) {
      int size = 1;
      for (const auto& [n, v] : s) {
        if (n == name) size = v;
      }
      full.emplace_back(name, size);
    }
    meshes.push_back(Mesh::create(full, world));
  }
  return meshes;
}

const std::vector<std::string> kBatchAxes = {"fsdp", "dp"};

// A stream of this slice of every training step's batch, as TrainingRun makes it.
std::unique_ptr<BatchStream> step_stream(RowSource& source, const BatchSchedule& schedule,
                                         const BatchSlice& slice, int64_t depth) {
  return std::make_unique<BatchStream>(
      source, slice.rows,
      [&schedule, slice](int64_t seq, int64_t* rows) {
        schedule.slice_samples(seq, slice, rows);
        return slice.rows;
      },
      depth);
}

// Every rank recomputes every rank's slice locally, for meshes of 1, 2, 4 and 8 ranks:
// the slices tile the global batch and tp ranks share theirs.
TEST(BatchSlicing, SlicesOfAllRanksTileTheGlobalBatch) {
  const Dataset d = numbered_dataset(50, 3);
  auto source = make_memory_source(d);
  const int64_t batch = 8;
  BatchSchedule schedule(d.num_samples, batch, ShuffleMode::rows, 11);
  for (int world : {1, 2, 4, 8}) {
    for (const Mesh& mesh : meshes_of(world)) {
      for (int64_t step : {0, 5, 6, 13}) {  // 6 steps per epoch: crosses epochs
        const auto global = schedule.global_batch_samples(step);
        std::map<int64_t, std::vector<int>> owners;  // global row -> ranks holding it
        for (int rank = 0; rank < world; ++rank) {
          const BatchSlice slice = make_batch_slice(mesh, rank, kBatchAxes, batch);
          EXPECT_EQ(slice.count, mesh.size_of({"fsdp", "dp"}));
          Matrix x("x", slice.rows, 3);
          BatchLabels labels("labels", slice.rows);
          EXPECT_EQ(step_stream(*source, schedule, slice, 0)->take(step, x, labels, Matrix()),
                    slice.rows);
          const auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
          const auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), labels);
          for (int64_t r = 0; r < slice.rows; ++r) {
            const int64_t row = slice.begin() + r;
            owners[row].push_back(rank);
            EXPECT_EQ(xh(r, 0), static_cast<float>(global[row]));
            EXPECT_EQ(lh(r), global[row] % 10);
          }
        }
        // Every row is held by the same number of ranks (the replicas over non-batch
        // axes, e.g. tp), and together they cover the batch.
        ASSERT_EQ(static_cast<int64_t>(owners.size()), batch) << mesh.describe();
        const size_t replicas = world / mesh.size_of({"fsdp", "dp"});
        for (const auto& [row, ranks] : owners) {
          EXPECT_EQ(ranks.size(), replicas) << mesh.describe() << " row " << row;
          // Ranks holding the same row differ only on tp.
          for (int rank : ranks) {
            EXPECT_EQ(mesh.group_color(rank, {"tp"}) == mesh.group_color(ranks[0], {"tp"}), true)
                << mesh.describe();
          }
        }
      }
    }
  }
}

// The real thing: each rank reads only its own slice, through a BatchStream with and
// without a reader thread; the rows gathered over MPI_COMM_WORLD equal the global batch
// of the order function (a single-rank schedule), step after step, across epochs, for
// every shuffle mode.
TEST(BatchSlicing, GatheredSlicesEqualTheSingleRankBatch) {
  const int world = world_size();
  const int rank = world_rank();
  const Dataset d = numbered_dataset(70, 5);
  auto source = make_memory_source(d);
  const int64_t batch = 8;
  for (ShuffleMode mode : {ShuffleMode::none, ShuffleMode::rows, ShuffleMode::blocks}) {
    // blocks: 70 rows in blocks of 8 (the last one partial), windows of 3 blocks.
    BatchSchedule schedule(d.num_samples, batch, mode, 3, 8, 3);
    const BatchSchedule reference(d.num_samples, batch, mode, 3, 8, 3);  // single-rank view
    for (int64_t depth : {0, 2}) {
      for (const Mesh& mesh : meshes_of(world)) {
        SCOPED_TRACE(mesh.describe() + ", shuffle " + to_string(mode) + ", depth " +
                     std::to_string(depth));
        const BatchSlice slice = make_batch_slice(mesh, rank, kBatchAxes, batch);
        Matrix x("x", slice.rows, d.features);  // allocated once, refilled every step
        BatchLabels labels("labels", slice.rows);
        // Host copies for MPI (the batch views may be device memory).
        auto xh = Kokkos::create_mirror_view(Kokkos::HostSpace(), x);
        auto lh = Kokkos::create_mirror_view(Kokkos::HostSpace(), labels);
        auto stream = step_stream(*source, schedule, slice, depth);
        for (int64_t step = 0; step < 20; ++step) {  // 8 steps per epoch
          ASSERT_EQ(stream->take(step, x, labels, Matrix()), slice.rows);
          Kokkos::deep_copy(xh, x);
          Kokkos::deep_copy(lh, labels);
          const int n = static_cast<int>(slice.rows * d.features);
          std::vector<float> all_x(static_cast<size_t>(n) * world);
          std::vector<int32_t> all_labels(static_cast<size_t>(slice.rows) * world);
          ASSERT_EQ(
              MPI_Allgather(xh.data(), n, MPI_FLOAT, all_x.data(), n, MPI_FLOAT, MPI_COMM_WORLD),
              MPI_SUCCESS);
          ASSERT_EQ(
              MPI_Allgather(lh.data(), static_cast<int>(slice.rows), MPI_INT32_T, all_labels.data(),
                            static_cast<int>(slice.rows), MPI_INT32_T, MPI_COMM_WORLD),
              MPI_SUCCESS);
          const auto global = reference.global_batch_samples(step);
          std::vector<int> covered(batch, 0);
          for (int r = 0; r < world; ++r) {
            const int64_t index = mesh.group_index(r, kBatchAxes);
            for (int64_t i = 0; i < slice.rows; ++i) {
              const int64_t row = index * slice.rows + i;
              ++covered[row];
              const int64_t sample = global[row];
              EXPECT_EQ(all_labels[r * slice.rows + i], sample % 10);
              for (int64_t c = 0; c < d.features; ++c) {
                EXPECT_EQ(all_x[(r * slice.rows + i) * d.features + c],
                          d.inputs[sample * d.features + c])
                    << "step " << step << " rank " << r;
              }
            }
          }
          for (int64_t row = 0; row < batch; ++row) {
            EXPECT_EQ(covered[row], world / mesh.size_of(kBatchAxes));
          }
        }
      }
    }
  }
}

// The shuffle depends on (seed, epoch) only: every rank, whatever the world size, gets
// the same permutation (checked by min/max over ranks of a hash), in both shuffled modes.
TEST(BatchSlicing, PermutationIsIdenticalOnEveryRank) {
  for (ShuffleMode mode : {ShuffleMode::rows, ShuffleMode::blocks}) {
    BatchSchedule schedule(1000, 32, mode, 99, 64, 4);
    for (int64_t epoch : {0, 1, 7}) {
      const auto perm = schedule.permutation(epoch);
      uint64_t hash = 1469598103934665603ULL;
      for (int64_t v : perm) hash = (hash ^ static_cast<uint64_t>(v)) * 1099511628211ULL;
      uint64_t lo = 0, hi = 0;
      ASSERT_EQ(MPI_Allreduce(&hash, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD), MPI_SUCCESS);
      ASSERT_EQ(MPI_Allreduce(&hash, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD), MPI_SUCCESS);
      EXPECT_EQ(lo, hi) << "epoch " << epoch << ", shuffle " << to_string(mode);
    }
  }
}

// Evaluation sharded over the batch axes: summing the valid rows and the labels of the
// rows each rank reports (over one batch group) counts every test sample exactly once;
// padding rows are zeros. Read as TrainingRun reads it: one stream going round the
// batches (two evaluations, so the second is read ahead of its first take), with and
// without a reader thread.
TEST(BatchSlicing, EvaluationCoversTheTestSplitOnce) {
  const int world = world_size();
  const int rank = world_rank();
  const Dataset d = numbered_dataset(23, 2);  // 23 samples: the last batch is partial
  auto source = make_memory_source(d);
  const int64_t eval_batch = 8;
  const EvalSchedule eval = EvalSchedule::create(d.num_samples, eval_batch);
  ASSERT_EQ(eval.num_batches, 3);
  for (int64_t depth : {0, 2}) {
    for (const Mesh& mesh : meshes_of(world)) {
      SCOPED_TRACE(mesh.describe() + ", depth " + std::to_string(depth));
      const BatchSlice slice = make_batch_slice(mesh, rank, kBatchAxes, eval_batch);
      Matrix x("x", slice.rows, d.features);
      BatchLabels labels("labels", slice.rows);
      BatchStream stream(
          *source, slice.rows,
          [&](int64_t seq, int64_t* rows) {
            return eval_slice_samples(eval, seq % eval.num_batches, slice, rows);
          },
          depth);
      int64_t seq = 0;
      for (int round = 0; round < 2; ++round) {
        int64_t local[2] = {0, 0};  // valid rows, sum of their sample numbers
        for (int64_t b = 0; b < eval.num_batches; ++b) {
          Kokkos::deep_copy(x, -1.0f);  // padding must be written, not left
          Kokkos::deep_copy(labels, -1);
          const int64_t valid = stream.take(seq++, x, labels, Matrix());
          const auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
          const auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), labels);
          local[0] += valid;
          for (int64_t r = 0; r < valid; ++r) {
            const int64_t sample = static_cast<int64_t>(xh(r, 0));
            local[1] += sample;
            EXPECT_EQ(sample, b * eval_batch + slice.begin() + r);
            EXPECT_EQ(lh(r), sample % 10);
          }
          for (int64_t r = valid; r < slice.rows; ++r) {
            for (int64_t c = 0; c < d.features; ++c) EXPECT_EQ(xh(r, c), 0.0f);
            EXPECT_EQ(lh(r), 0);
          }
        }
        int64_t total[2] = {0, 0};
        ASSERT_EQ(MPI_Allreduce(local, total, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD),
                  MPI_SUCCESS);
        const int64_t replicas = world / mesh.size_of(kBatchAxes);
        EXPECT_EQ(total[0], d.num_samples * replicas);
        EXPECT_EQ(total[1], replicas * (d.num_samples * (d.num_samples - 1) / 2));
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
