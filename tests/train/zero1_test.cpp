// ZeRO-1 (optimizer.zero_stage = 1): the optimizer state and update split over dp train
// exactly like plain DP. Against plain DP on the same ranks and a one-rank run (computed in
// the same test, each rank on MPI_COMM_SELF), with layer widths that do not divide by 2 or 4
// (uneven and empty chunks), with clipping, weight decay and gradient accumulation; each
// rank holds only its chunk of the state; a ZeRO-1 checkpoint resumes onto ZeRO-1 and onto
// plain DP with the same state, and a plain-DP checkpoint onto ZeRO-1; the plan counts half
// the optimizer bytes at dp = 2; a table-wise tensor is not chunked.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/gemm.hpp"
#include "framework/train/config.hpp"
#include "framework/train/zero1.hpp"
#include "partition/zero1_layout.hpp"
#include "run/training_run.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// Rows 8, 13, 7 and biases 13, 7, 3: 13 and 7 divide by neither 2 nor 4; 3 rows over dp = 4
// leave the last rank an empty chunk.
RunConfig config_on(MPI_Comm comm, int64_t zero_stage) {
  int n = 1;
  check_mpi(MPI_Comm_size(comm, &n), "MPI_Comm_size");
  RunConfig config = testing::synthetic_run_config("zero1_test", {{"dp", n}}, "dp");
  config.run.seed = 5;
  config.model.sizes = {8, 13, 7, 3};
  config.model.activation = Activation::tanh;
  config.optimizer.lr = 1e-2;
  config.optimizer.weight_decay = 0.01;
  config.optimizer.zero_stage = zero_stage;
  config.train.steps = 8;
  return config;
}

std::vector<double> losses_of(TrainingRun& run, int steps) {
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(run.step().loss);
  return losses;
}

std::vector<float> host(const Vector& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

// The tolerance against the one-rank run (sums over ranks round differently).
constexpr double kRankTolerance = 1e-5;
// ZeRO-1 against plain DP on the same ranks: the same sums (observed bit-identical at np
// 1, 2 and 4 with Open MPI; the tolerance leaves room for a reduce-scatter that orders its
// sums differently from the all-reduce).
constexpr double kPlainTolerance = 1e-6;

void expect_losses(const std::vector<double>& got, const std::vector<double>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_NEAR(got[s], want[s], rtol * (1 + std::abs(want[s]))) << "step " << s + 1;
  }
}

struct Variant {
  std::string name;
  double clip_norm = 0.0;
  int64_t accumulation = 1;
};

TEST(Zero1, TrainsLikePlainDp) {
  const int n = world_size();
  for (const Variant& v : {Variant{"plain", 0.0, 1}, Variant{"clipped", 0.05, 1},
                           Variant{"2 micro-batches", 0.0, 2}}) {
    SCOPED_TRACE(v.name);
    auto configure = [&](MPI_Comm comm, int64_t zero_stage) {
      RunConfig c = config_on(comm, zero_stage);
      c.optimizer.clip_norm = v.clip_norm;
      c.data.batch_size = 16 / v.accumulation;
      c.train.accumulation_steps = v.accumulation;
      return c;
    };
    TrainingRun single(configure(MPI_COMM_SELF, 0), {}, std::nullopt, MPI_COMM_SELF);
    TrainingRun plain(configure(MPI_COMM_WORLD, 0), {}, std::nullopt, MPI_COMM_WORLD);
    TrainingRun zero(configure(MPI_COMM_WORLD, 1), {}, std::nullopt, MPI_COMM_WORLD);
    const std::vector<double> reference = losses_of(single, 6);
    const std::vector<double> plain_losses = losses_of(plain, 6);
    const std::vector<double> zero_losses = losses_of(zero, 6);
    expect_losses(zero_losses, reference, kRankTolerance);
    expect_losses(zero_losses, plain_losses, kPlainTolerance);
    EXPECT_LT(zero_losses.back(), zero_losses.front());  // it learns

    // Every replica holds the same parameters as plain DP's, and only its chunk of state.
    const std::vector<ShardedTensor>& pz = zero.model().parameters();
    const std::vector<ShardedTensor>& pp = plain.model().parameters();
    const std::vector<ShardedTensor>& mz = zero.optimizer().slot("m");
    for (size_t i = 0; i < pz.size(); ++i) {
      const std::vector<float> a = host(pz[i].local), b = host(pp[i].local);
      ASSERT_EQ(a.size(), b.size());
      for (size_t j = 0; j < a.size(); ++j) {
        ASSERT_NEAR(a[j], b[j], 1e-6 + 1e-5 * std::abs(b[j])) << pz[i].name << "[" << j << "]";
      }
      const int64_t rows = pz[i].box.extent[0];
      const auto [first, count] = zero1_rows(rows, n, world_rank());
      EXPECT_EQ(mz[i].box.offset[0], first) << mz[i].name;
      EXPECT_EQ(mz[i].box.extent[0], count) << mz[i].name;
      EXPECT_EQ(static_cast<int64_t>(mz[i].local.extent(0)), pz[i].box.elements() / rows * count);
    }
    if (n > 1) {
      EXPECT_NE(zero.describe()[2].find("ZeRO-1"), std::string::npos) << zero.describe()[2];
    }
  }
}

// bf16 (docs/mixed_precision.md): the optimizer updates ZeRO-1's chunks, not the model's
// tensors, so it cannot write the weights' 16-bit compute copies; the gather of the updated
// masters marks them stale and the next forward casts them again. ZeRO-1 then trains like
// without it in bf16 (whose optimizer writes the copies and leaves them current), within bf16's
// rounding of the differently ordered gradient sums (on one dp rank ZeRO-1 splits nothing: the
// optimizer writes the copies). Weights gathered over one group have copies:
// on dp x fsdp (np 4: dp 2, fsdp 2) every weight; on dp (np 1, 2) every weight where gemm() reads
// 16 bits (oneDNN, the default, on a CPU with AVX512_BF16), else none.
TEST(Zero1, SixteenBitCopiesAreCastAgainAfterTheGather) {
  const int n = world_size();
  const bool hybrid = n >= 4 && n % 2 == 0;
  auto configure = [&](int64_t zero_stage) {
    RunConfig c = config_on(MPI_COMM_WORLD, zero_stage);
    if (hybrid) {
      c.mesh.axes = {{"dp", n / 2}, {"fsdp", 2}};
      c.partition.preset = "dp_fsdp";
      c.model.sizes = {8, 16, 8, 3};  // every weight's rows split over fsdp
    }
    c.mixed_precision.param_dtype = Dtype::bf16;
    c.mixed_precision.reduce_dtype = Dtype::bf16;
    return c;
  };
  TrainingRun plain(configure(0), {}, std::nullopt, MPI_COMM_WORLD);
  TrainingRun zero(configure(1), {}, std::nullopt, MPI_COMM_WORLD);
  const std::vector<double> plain_losses = losses_of(plain, 6);
  const std::vector<double> zero_losses = losses_of(zero, 6);
  expect_losses(zero_losses, plain_losses, 1e-2);
  EXPECT_LT(zero_losses.back(), zero_losses.front());  // it learns
  const Mlp& zm = zero.model();
  const Mlp& pm = plain.model();
  int copies = 0, weights = 0;
  for (size_t i = 0; i < zm.parameters().size(); ++i) {
    const ShardedTensor& z = zm.parameters()[i];
    const ShardedTensor& p = pm.parameters()[i];
    weights += z.name.size() > 6 && z.name.compare(z.name.size() - 6, 6, "weight") == 0;
    ASSERT_EQ(z.copy_16bit != nullptr, p.copy_16bit != nullptr) << z.name;
    if (!z.copy_16bit) continue;
    ++copies;
    if (zero1_splits(z.global_shape.size(), z.spec, hybrid ? n / 2 : n)) {
      EXPECT_FALSE(z.copy_16bit->current) << z.name << ": ZeRO-1's gather left it current";
    } else {  // (one dp rank: ZeRO-1 splits nothing, the optimizer updates the tensor itself)
      EXPECT_TRUE(z.copy_16bit->current) << z.name << ": the optimizer did not leave it current";
    }
    EXPECT_TRUE(p.copy_16bit->current) << p.name << ": the optimizer did not leave it current";
  }
  // One per weight gathered over fsdp, or stored whole where gemm() reads 16 bits.
  EXPECT_EQ(copies, hybrid ? 3 : gemm_reads_16bit(Dtype::bf16) ? weights : 0);
  if (!hybrid) EXPECT_GT(weights, 0);
}

// On dp x fsdp and dp x tp meshes the layers reduce their gradients themselves (a
// reduce-scatter over fsdp, the bias over tp) before ZeRO-1 takes each rank's rows of the
// blocks replicated over dp: the same losses as without ZeRO-1.
TEST(Zero1, HybridMeshesTrainLikeWithoutIt) {
  const int n = world_size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  for (const std::string preset : {"dp_fsdp", "dp_tp"}) {
    SCOPED_TRACE(preset);
    auto configure = [&](int64_t zero_stage) {
      RunConfig c = config_on(MPI_COMM_WORLD, zero_stage);
      c.model.sizes = {8, 16, 16, 4};
      c.mesh.axes = {{"dp", -1}, {preset == "dp_fsdp" ? "fsdp" : "tp", 2}};
      c.partition.preset = preset;
      return c;
    };
    TrainingRun plain(configure(0), {}, std::nullopt, MPI_COMM_WORLD);
    TrainingRun zero(configure(1), {}, std::nullopt, MPI_COMM_WORLD);
    expect_losses(losses_of(zero, 5), losses_of(plain, 5), kPlainTolerance);
  }
}

// A checkpoint's optimizer state is global arrays, so one written by ZeRO-1 loads onto
// ZeRO-1 and onto plain DP, and plain DP's onto ZeRO-1, with the same state (each rank's
// rows of it) and training continues as if uninterrupted.
TEST(Zero1, CheckpointsResumeAcrossZeroStages) {
  const int n = world_size();
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_zero1_test_np" + std::to_string(n);
  for (int64_t saved_stage : {1, 0}) {
    for (int64_t loaded_stage : {1, 0}) {
      SCOPED_TRACE("saved with zero_stage " + std::to_string(saved_stage) + ", loaded with " +
                   std::to_string(loaded_stage));
      if (world_rank() == 0) std::filesystem::remove_all(dir);
      check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
      RunConfig saving = config_on(MPI_COMM_WORLD, saved_stage);
      saving.checkpoint.dir = dir;
      TrainingRun first(saving, {}, std::nullopt, MPI_COMM_WORLD);
      losses_of(first, 4);
      first.save();
      const std::vector<double> uninterrupted = losses_of(first, 3);

      RunConfig loading = config_on(MPI_COMM_WORLD, loaded_stage);
      loading.checkpoint.dir = dir;
      loading.checkpoint.resume = true;
      TrainingRun resumed(loading, {}, std::nullopt, MPI_COMM_WORLD);
      ASSERT_TRUE(resumed.resumed_from().has_value());
      EXPECT_EQ(resumed.steps_done(), 4);
      EXPECT_EQ(resumed.optimizer().step_count(), 4);
      // The state as loaded equals the state as saved, on the rows each holds: re-read it
      // from the file through a run of the saving stage.
      RunConfig reread = saving;
      reread.checkpoint.resume = true;
      TrainingRun saved(reread, {}, std::nullopt, MPI_COMM_WORLD);
      for (const std::string slot : {"m", "v"}) {
        const std::vector<ShardedTensor>& got = resumed.optimizer().slot(slot);
        const std::vector<ShardedTensor>& want = saved.optimizer().slot(slot);
        for (size_t i = 0; i < got.size(); ++i) {
          const std::vector<float> a = host(got[i].local), b = host(want[i].local);
          // Both are rows of the same block: compare the rows they share.
          const int64_t row = got[i].box.elements() / std::max<int64_t>(got[i].box.extent[0], 1);
          const int64_t lo = std::max(got[i].box.offset[0], want[i].box.offset[0]);
          const int64_t hi = std::min(got[i].box.offset[0] + got[i].box.extent[0],
                                      want[i].box.offset[0] + want[i].box.extent[0]);
          for (int64_t r = lo; r < hi; ++r) {
            for (int64_t c = 0; c < row; ++c) {
              ASSERT_EQ(a[(r - got[i].box.offset[0]) * row + c],
                        b[(r - want[i].box.offset[0]) * row + c])
                  << slot << " of " << got[i].name << " row " << r;
            }
          }
        }
      }
      expect_losses(losses_of(resumed, 3), uninterrupted,
                    saved_stage == loaded_stage ? 0.0 : kPlainTolerance);
    }
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// The plan counts ZeRO-1's optimizer state: half of plain DP's at dp = 2 when every block's
// rows divide by 2, the largest chunk (rank 0's) otherwise; FSDP-split tensors are not split
// again.
TEST(Zero1, PlanCountsTheSplitState) {
  RunConfig config;
  config.model.sizes = {784, 512, 512, 10};
  config.partition.preset = "dp";
  config.data.batch_size = 128;
  const std::vector<ParameterShape> shapes = mlp_parameter_shapes(config.model.sizes);
  const Mesh mesh = Mesh::create({{"dp", 2}}, 2);
  auto optimizer_bytes = [&](int64_t zero_stage, const Mesh& m) {
    config.optimizer.zero_stage = zero_stage;
    return make_plan(shapes, m, partition_rules(config), plan_options(config),
                     mlp_linear_layers(config.model.sizes))
        .totals.optimizer_bytes;
  };
  EXPECT_EQ(optimizer_bytes(1, mesh) * 2, optimizer_bytes(0, mesh));
  // dp = 3, rank 0's chunks: weight rows 784 -> 262, 512 -> 171, 512 -> 171; bias
  // elements 512 -> 171, 512 -> 171, 10 -> 4.
  const Mesh three = Mesh::create({{"dp", 3}}, 3);
  const int64_t elements = 262 * 512 + 171 + 171 * 512 + 171 + 171 * 10 + 4;
  EXPECT_EQ(optimizer_bytes(1, three), 2 * 4 * elements);
  // dp = 1: nothing to split.
  const Mesh one = Mesh::create({{"dp", 1}}, 1);
  EXPECT_EQ(optimizer_bytes(1, one), optimizer_bytes(0, one));
}

// A table-wise tensor (docs/recsys.md; P(fsdp@0) on fsdp 1 x dp n: every rank is a holder, the
// table replicated over dp) is not chunked over dp: its chunk keeps the tensor's spec and whole
// block (dp added to `fsdp@0` would name another holder), reduce() sums its whole gradient over
// dp and gather() leaves it alone; a replicated tensor beside it is chunked as always. Values
// are small integers: the sums are exact.
TEST(Zero1, TableWiseTensorsAreNotChunked) {
  const int n = world_size(), rank = world_rank();
  const Mesh mesh = Mesh::create({{"fsdp", 1}, {"dp", n}}, n);
  MeshCommunicators comms(mesh);
  Communicator& dp = comms.get({kZeroAxis});
  const std::vector<int64_t> shape = {6, 4};
  const PartitionSpec table = PartitionSpec::parse("P(fsdp@0, None)");
  std::vector<ShardedTensor> params = {
      ShardedTensor::allocate("embeddings/t/weight", shape, table, mesh, rank),
      ShardedTensor::allocate("top/0/weight", shape, PartitionSpec(), mesh, rank)};
  std::vector<ShardedTensor> grads = params;
  for (ShardedTensor& g : grads) g.local = Vector(g.name + "/grad", g.local.extent(0));
  for (size_t i = 0; i < 2; ++i) {
    Kokkos::deep_copy(params[i].local, static_cast<float>(rank + 1));
    Kokkos::deep_copy(grads[i].local, static_cast<float>(rank + 1));
  }
  Zero1 zero(params, grads, {&dp, &dp}, dp);

  const ShardedTensor& tc = zero.param_chunks()[0];
  EXPECT_EQ(tc.spec, table) << tc.spec.to_string();
  EXPECT_EQ(tc.box.offset, params[0].box.offset);
  EXPECT_EQ(tc.box.extent, shape);
  EXPECT_EQ(tc.local.extent(0), 24u);
  const auto [first, count] = zero1_rows(6, n, rank);
  const ShardedTensor& dc = zero.param_chunks()[1];
  EXPECT_EQ(dc.spec.to_string(), n > 1 ? "P(dp, None)" : "P()");
  EXPECT_EQ(dc.box.offset[0], n > 1 ? first : 0);
  EXPECT_EQ(dc.box.extent[0], n > 1 ? count : 6);

  zero.reduce(grads);
  const float sum = static_cast<float>(n * (n + 1) / 2);
  for (size_t i = 0; i < 2; ++i) {
    const std::vector<float> g = host(zero.grad_chunks()[i].local);
    EXPECT_EQ(g.size(), i == 0 || n == 1 ? 24u : static_cast<size_t>(count * 4));
    for (size_t j = 0; j < g.size(); ++j) ASSERT_EQ(g[j], sum) << params[i].name << "[" << j << "]";
  }
  zero.gather(params);
  const std::vector<float> t = host(params[0].local), d = host(params[1].local);
  for (size_t j = 0; j < t.size(); ++j) ASSERT_EQ(t[j], rank + 1) << "table [" << j << "]";
  // The replicated tensor: row r from dp rank r / ceil(6 / n), its chunk's owner.
  for (size_t j = 0; j < d.size(); ++j) {
    const int64_t owner = static_cast<int64_t>(j / 4) / zero1_chunk_rows(6, n);
    ASSERT_EQ(d[j], n > 1 ? owner + 1 : 1) << "top/0/weight [" << j << "]";
  }
}

}  // namespace
}  // namespace meshtrain
