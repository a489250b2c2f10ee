// A full training step allocates nothing: neither on the heap nor through Kokkos (device
// memory in a CUDA build). Global operator new is replaced in
// this executable by a counting version (tests/support/counting_allocator.cpp), and the count over
// steps 2..4 (step 1 warms the workspaces up) of TrainingRun::step (batch loading, forward, loss,
// backward, gradient clipping, optimizer update) must be 0 on every rank, for the dp, fsdp, tp and
// fsdp x tp meshes and every collective-matmul algorithm (ring and bidirectional ones move blocks
// with shifts). C++ allocations only: what MPI allocates with malloc inside its own calls is not
// counted. Mixed precision too: bf16/bf16 and fp16/fp16 steps (16-bit communication staging, casts,
// fp16 loss scaling with a skipped step in the window), with overlap off and on.
// The count is over every thread, so the data reader thread (data.prefetch > 0, the default)
// is counted too: the batches come from memory or are streamed from HDF5 files
// (contiguous ones read with pread, gzip-chunked ones through HDF5), with prefetch 0 and 2.
// Kokkos allocations (any memory space) are counted through Kokkos' allocate-data tool
// callback over the same steps. MESHTRAIN_TRACE_ALLOCATIONS=N prints the call stacks of
// the first N counted heap allocations.
// GEMMs on oneDNN (the default where the build has it; the _openblas registrations run
// OpenBLAS): dnnl_primitive_execute builds its execution context and a map of its arguments on
// the heap in every call (3-5 blocks, freed before it returns), which oneDNN 2.6's API cannot
// avoid; those are counted apart (tests/support/onednn_allocations.hpp), must all be freed in
// the window (none kept: AllocationWindow::close() counts the kept ones), must be as many in each
// steady step and at most kOneDnnBlocksPerCall per GEMM call, while everything else, meshtrain's
// GEMM state included, must allocate nothing.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/gemm.hpp"
#include "framework/io/checkpoint_testing.hpp"
#include "run/training_run.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/hdf5_files.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// The ring reductions' partial-sum buffers (blocking and started) allocated in step 1.
long g_ring_buffers_in_step1 = 0;
void count_ring_buffer(Kokkos::Profiling::SpaceHandle, const char* label, const void*, uint64_t) {
  const std::string_view name(label);
  if (name == "meshtrain::ring_partial_sums" || name == "meshtrain::started_ring_partial_sums") {
    ++g_ring_buffers_in_step1;
  }
}

using testing::AllocationWindow;

using testing::MeshCase;

// dp, fsdp, tp and fsdp x tp.
std::vector<MeshCase> mesh_cases() {
  return testing::every_mesh(world_size());
}

// 16 samples of 32 inputs (0.25) with label 3 (classification) or 8 targets of 0.5.
Dataset small_data(LossKind loss_kind) {
  Dataset d;
  d.description = "the test's data";
  d.num_samples = 16;
  d.features = 32;
  d.inputs.assign(16 * 32, 0.25f);
  if (loss_kind == LossKind::cross_entropy) {
    d.num_classes = 8;
    d.labels.assign(16, 3);
  } else {
    d.target_width = 8;
    d.targets.assign(16 * 8, 0.5f);
  }
  return d;
}

// Steps 2..4 of a small MLP's training run on `mesh_case`; returns the heap allocations
// they made on this rank.
// Heap and Kokkos allocations counted over some steps.
struct Allocations {
  long heap = 0;  // AllocationWindow::close(): oneDNN's blocks kept included
  long kokkos = 0;
  long onednn_kept = 0;  // of which oneDNN's blocks allocated in the window and not freed in it
  bool operator==(const Allocations& o) const {
    return heap == o.heap && kokkos == o.kokkos && onednn_kept == o.onednn_kept;
  }
};
std::ostream& operator<<(std::ostream& out, const Allocations& a) {
  return out << a.heap << " heap and " << a.kokkos << " Kokkos allocations (of the heap ones "
             << a.onednn_kept << " blocks allocated by oneDNN and not freed)";
}

// The matmul executions oneDNN has run in this process (0 in a build without it).
int64_t onednn_executions() {
#if defined(MESHTRAIN_GEMM_ONEDNN)
  return gemm_backend::onednn_executions();
#else
  return 0;
#endif
}

// The most heap blocks oneDNN's matmul takes in one execution (its execution context and
// argument map: 3-5 seen with oneDNN 2.6.3, tests/support/onednn_allocations.hpp says up to 8).
constexpr int64_t kOneDnnBlocksPerCall = 8;

// Where the batches come from: small_data in memory, or the HDF5 file `hdf5_path` holding
// the same rows; read ahead `prefetch` batches.
struct DataCase {
  int64_t prefetch = 2;  // data.prefetch's default
  std::string hdf5_path;
  // Sobolev training: data.dy_key and data.dy_inputs (the file holds the dataset).
  std::string dy_key;
  std::vector<int64_t> dy_inputs;
};

// [runtime] comm_thread of the runs below (the test with the communication thread sets it).
CommThreadChoice g_comm_thread = CommThreadChoice::automatic;
// Non-empty: step 1 is traced ([runtime] trace_steps = [1, 1]) into this run folder.
std::string g_trace_dir;

Allocations allocations_in_steps(const MeshCase& mesh_case, CollectiveMatmulAlgorithm algorithm,
                                 LossKind loss_kind, OptimizerKind optimizer_kind,
                                 int64_t accumulation_steps = 1, int64_t zero_stage = 0,
                                 bool overlap = false, double bucket_mb = 25.0,
                                 const DataCase& data = {}, MixedPrecision precision = {},
                                 const std::vector<int64_t>& moe_layers = {}, double dropout = 0.0,
                                 const ModelSection* residual = nullptr,
                                 ReductionAlgorithm reductions = ReductionAlgorithm::automatic) {
  RunConfig config;
  config.runtime.reductions = reductions;
  config.model.dropout = dropout;
  config.model.moe_layers = moe_layers;  // 4 experts, top-2
  config.model.experts = 4;
  config.mixed_precision.param_dtype = precision.param;
  config.mixed_precision.reduce_dtype = precision.reduce;
  config.runtime.overlap = overlap;
  config.runtime.bucket_mb = bucket_mb;
  config.runtime.comm_thread = g_comm_thread;
  if (!g_trace_dir.empty()) {
    config.runtime.trace_first = config.runtime.trace_last = 1;
    config.run.output_dir = g_trace_dir;
  }
  config.mesh.axes = mesh_case.axes;
  config.model.sizes = {32, 24, 16, 8};  // every width divides by 2 and 4
  config.model.activation = Activation::gelu;
  config.model.loss = loss_kind;
  config.partition.preset = mesh_case.preset;
  config.partition.min_sharding_size = 0;
  config.partition.collective_matmul = algorithm;
  config.optimizer.kind = optimizer_kind;
  config.optimizer.clip_norm = 0.5;  // small: clipping scales the gradients
  config.data.batch_size = 16 / accumulation_steps;
  config.train.accumulation_steps = accumulation_steps;
  config.optimizer.zero_stage = zero_stage;
  config.optimizer.schedule = LrScheduleKind::cosine;  // the rate changes every step
  config.optimizer.warmup_steps = 2;
  config.train.steps = 4;
  config.run.seed = 7;
  config.data.prefetch = data.prefetch;
  if (residual) {  // its kind and shape; the rest as above
    const Activation activation = config.model.activation;
    const std::optional<LossKind> loss = config.model.loss;
    config.model = *residual;
    if (!residual->swiglu && residual->activation == Activation::relu) {
      config.model.activation = activation;
    }
    config.model.loss = loss;
  }
  std::optional<RunData> rows = RunData{small_data(loss_kind), Dataset{}};
  if (!data.hdf5_path.empty()) {
    config.data.source = DataSource::hdf5;
    config.data.path = {data.hdf5_path};
    config.data.dy_key = data.dy_key;
    config.data.dy_inputs = data.dy_inputs;
    rows.reset();
  }
  TrainingRun run(config, {}, std::move(rows));
  // fp16: a scale of 2^8 overflows nothing here, 2^40 overflows the loss gradient, so step 3
  // is skipped and steps 1, 2 and 4 are taken: both paths of the step run in the window.
  LossScaler* scaler = run.loss_scaler();
  if (scaler) scaler->restore(256.0, 0);
  // Step 1: workspaces and scratch buffers reach their size; the ring's partial sums are
  // counted there too (reserved when the model is built, they must not grow).
  g_ring_buffers_in_step1 = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_ring_buffer);
  run.step();
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  AllocationWindow window(AllocationWindow::Threads::all, AllocationWindow::OneDnn::left_out);
  long onednn_in_step2 = 0;
  int64_t onednn_calls_in_step2 = -onednn_executions();
  for (int s = 2; s <= 4; ++s) {
    if (scaler) scaler->restore(s == 3 ? std::ldexp(1.0, 40) : 256.0, 0);
    run.step();
    if (s == 2) {
      onednn_in_step2 = window.onednn_allocations();
      onednn_calls_in_step2 += onednn_executions();
    }
  }
  const long heap = window.close();  // oneDNN's blocks kept included
  // Where gemm() reads 16 bits (MESHTRAIN_GEMM_16BIT_OPERANDS=always: the operands16
  // registration), a plain MLP's tp weights have 16-bit copies (and its row-parallel layers a
  // 16-bit dY): the steps counted above took that path.
  if (mesh_case.preset == "tp" && world_size() > 1 && precision.param != Dtype::fp32 &&
      gemm_reads_16bit(precision.param) && moe_layers.empty() && residual == nullptr &&
      dropout == 0.0) {
    int copies = 0;
    for (const ShardedTensor& p : std::as_const(run.model()).parameters()) {
      copies += p.copy_16bit != nullptr;
    }
    EXPECT_GT(copies, 0) << "tp without 16-bit weight copies where gemm() reads 16 bits";
  }
  if (scaler) EXPECT_EQ(run.skipped_steps(), 1) << "step 3 (only) must overflow";
  // oneDNN's own blocks (none where the GEMMs run OpenBLAS): the same in every steady step, and
  // at most kOneDnnBlocksPerCall per matmul execution of step 2: oneDNN making a primitive (or a
  // primitive descriptor) again in a step allocates far more (36 blocks for a new shape here).
  EXPECT_EQ(window.onednn_allocations(), 3 * onednn_in_step2)
      << "oneDNN allocated a different number of blocks in steps 3 and 4 than in step 2";
  EXPECT_LE(onednn_in_step2, kOneDnnBlocksPerCall * onednn_calls_in_step2)
      << "oneDNN allocated " << onednn_in_step2 << " blocks in step 2, in " << onednn_calls_in_step2
      << " matmul executions";
  return {heap, window.kokkos_allocations(), window.onednn_blocks_kept()};
}

TEST(TrainingStep, AllocatesNothingOnTheHeap) {
  for (const MeshCase& c : mesh_cases()) {
    for (CollectiveMatmulAlgorithm algorithm :
         {CollectiveMatmulAlgorithm::naive, CollectiveMatmulAlgorithm::ring,
          CollectiveMatmulAlgorithm::bidirectional}) {
      if (c.preset != "tp" && c.preset != "fsdp_tp" &&
          algorithm != CollectiveMatmulAlgorithm::naive) {
        continue;  // without a feature axis no collective matmul runs
      }
      SCOPED_TRACE(c.preset + ", " + to_string(algorithm) + ", cross_entropy + adamw");
      EXPECT_EQ(allocations_in_steps(c, algorithm, LossKind::cross_entropy, OptimizerKind::adamw),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    }
    SCOPED_TRACE(c.preset + ", bidirectional, mse + sgd");
    EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::bidirectional, LossKind::mse,
                                   OptimizerKind::sgd),
              Allocations{})
        << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
  }
}

// [runtime] reductions = "ring" (meshtrain's own reduce-scatter and all-reduce), fp32 and
// bf16: nothing allocated either, and the ring's partial sums not even in step 1 (reserved
// when the model is built: Communicator::reserve_reductions).
TEST(TrainingStep, RingReductionsAllocateNothing) {
  for (const MeshCase& c : mesh_cases()) {
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
      SCOPED_TRACE(c.preset + ", reductions ring, " + (dtype == Dtype::fp32 ? "fp32" : "bf16"));
      MixedPrecision precision;
      precision.param = dtype;
      precision.reduce = dtype;
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                     OptimizerKind::adamw, 1, 0, false, 25.0, {}, precision, {},
                                     0.0, nullptr, ReductionAlgorithm::ring),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      EXPECT_EQ(g_ring_buffers_in_step1, 0) << "the ring's partial sums grew in step 1";
    }
  }
}

// With gradient accumulation (2 micro-batches of 8 rows per step) the step allocates
// nothing either: the gradient sum is allocated with the model.
TEST(TrainingStep, WithAccumulationAllocatesNothing) {
  for (const MeshCase& c : mesh_cases()) {
    if (c.axes.front().first != "tp" && 8 % c.axes.front().second != 0) continue;
    SCOPED_TRACE(c.preset + ", 2 micro-batches");
    EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                   OptimizerKind::adamw, 2),
              Allocations{})
        << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
  }
}

// Dropout (P = 0.25): the mask is recomputed in backward, nothing stored or allocated per
// step; with one micro-batch and with two.
TEST(TrainingStep, WithDropoutAllocatesNothing) {
  for (const MeshCase& c : mesh_cases()) {
    for (int64_t micro_batches : {1, 2}) {
      if (micro_batches == 2 && c.axes.front().first != "tp" && 8 % c.axes.front().second != 0)
        continue;
      SCOPED_TRACE(c.preset + ", dropout, " + std::to_string(micro_batches) + " micro-batches");
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                     OptimizerKind::adamw, micro_batches, 0, false, 25.0, {}, {},
                                     {}, 0.25),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    }
  }
}

// ZeRO-1 (optimizer state split over dp; the reduce-scatter, the update of the chunks and
// the all-gather) allocates nothing either, with one micro-batch or two.
TEST(TrainingStep, WithZero1AllocatesNothing) {
  const int n = world_size();
  const MeshCase dp{"dp", {{"dp", n}}};
  for (int64_t accumulation : {1, 2}) {
    if (8 % n != 0 && accumulation == 2) continue;
    SCOPED_TRACE("dp, zero_stage 1, " + std::to_string(accumulation) + " micro-batches");
    EXPECT_EQ(allocations_in_steps(dp, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                   OptimizerKind::adamw, accumulation, 1),
              Allocations{})
        << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
  }
}

// With overlap (FSDP weight prefetch, DP gradient buckets) neither: the prefetch buffer and
// the bucket buffers are made with the model, and the started gathers' and all-reduces'
// requests come from the communicator's pool. On dp the default bucket holds every
// gradient (packed into its buffer); 1 KiB buckets (256 floats) add buckets all-reduced in
// place and several in flight at once.
TEST(TrainingStep, WithOverlapAllocatesNothing) {
  for (const MeshCase& c : mesh_cases()) {
    for (double bucket_mb : {25.0, 1.0 / 1024}) {
      if (c.preset != "dp" && bucket_mb != 25.0) continue;
      SCOPED_TRACE(c.preset + ", overlap, bucket_mb " + std::to_string(bucket_mb));
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                     OptimizerKind::adamw, 1, 0, true, bucket_mb),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    }
  }
}

// The same with the communication thread on (framework/comm/progress_thread.hpp): handing a
// started operation to the thread and back allocates nothing, and the count covers the
// thread's own allocations too (it counts every thread).
TEST(TrainingStep, WithOverlapAndTheCommThreadAllocatesNothing) {
  g_comm_thread = CommThreadChoice::on;
  for (const MeshCase& c : mesh_cases()) {
    for (double bucket_mb : {25.0, 1.0 / 1024}) {
      if (c.preset != "dp" && bucket_mb != 25.0) continue;
      SCOPED_TRACE(c.preset + ", overlap, comm_thread, bucket_mb " + std::to_string(bucket_mb));
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::ring, LossKind::cross_entropy,
                                     OptimizerKind::adamw, 1, 0, true, bucket_mb),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    }
  }
  g_comm_thread = CommThreadChoice::automatic;
}

// DP buckets on meshtrain's ring (reductions = "ring" with overlap: start_all_reduce runs the
// started ring, whose partial sums are reserved with the buckets), fp32 and bf16, with the
// communication thread off and on, one bucket and 1 KiB buckets (several in flight at once):
// nothing allocated either.
TEST(TrainingStep, WithOverlapOnTheRingAllocatesNothing) {
  const MeshCase dp{"dp", {{"dp", world_size()}}};
  for (const CommThreadChoice thread : {CommThreadChoice::off, CommThreadChoice::on}) {
    g_comm_thread = thread;
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
      for (double bucket_mb : {25.0, 1.0 / 1024}) {
        SCOPED_TRACE(std::string("dp, overlap, reductions ring, ") +
                     (dtype == Dtype::fp32 ? "fp32" : "bf16") + ", bucket_mb " +
                     std::to_string(bucket_mb) +
                     (thread == CommThreadChoice::on ? ", comm_thread" : ""));
        MixedPrecision precision;
        precision.param = dtype;
        precision.reduce = dtype;
        EXPECT_EQ(
            allocations_in_steps(dp, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                 OptimizerKind::adamw, 1, 0, true, bucket_mb, {}, precision, {},
                                 0.0, nullptr, ReductionAlgorithm::ring),
            Allocations{})
            << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
        EXPECT_EQ(g_ring_buffers_in_step1, 0) << "the started ring's buffers grew in step 1";
      }
    }
  }
  g_comm_thread = CommThreadChoice::automatic;
}

// [runtime] trace_steps = [1, 1]: step 1 is traced and its files written when it ends; the
// untraced steps after it allocate nothing (the tracer's events were reserved at its start).
TEST(TrainingStep, UntracedStepsAfterATracedOneAllocateNothing) {
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_step_allocations_trace_np" + std::to_string(world_size());
  g_trace_dir = dir;
  for (const MeshCase& c : mesh_cases()) {
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(c.preset + (overlap ? ", overlap" : "") + ", step 1 traced");
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                     OptimizerKind::adamw, 1, 0, overlap),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      EXPECT_TRUE(
          std::filesystem::exists(dir + "/trace/rank-" + std::to_string(world_rank()) + ".json"))
          << "step 1 was not traced";
    }
  }
  g_trace_dir.clear();
}

// Mixed precision (docs/mixed_precision.md): bf16/bf16 and fp16/fp16, without and with
// overlap, allocate nothing either. The 16-bit staging of the communicators (the packed
// elements sent and received, in every collective, started ones and shifts included) reached
// its size in step 1 and is kept; the MPI sums run through their user operation; the casts
// are kernels on the layers' own buffers. fp16 steps also unscale and check the gradients
// (LossScaler's one-double all-reduce), and step 3 overflows and is skipped (above), so the
// skipped path is counted as well as the taken one.
TEST(TrainingStep, MixedPrecisionAllocatesNothing) {
  const MixedPrecision policies[] = {{Dtype::bf16, Dtype::bf16}, {Dtype::fp16, Dtype::fp16}};
  for (const MeshCase& c : mesh_cases()) {
    for (const MixedPrecision& precision : policies) {
      const std::string dtype = precision.param == Dtype::bf16 ? "bf16" : "fp16";
      for (CollectiveMatmulAlgorithm algorithm :
           {CollectiveMatmulAlgorithm::naive, CollectiveMatmulAlgorithm::bidirectional}) {
        if (c.preset != "tp" && c.preset != "fsdp_tp" &&
            algorithm != CollectiveMatmulAlgorithm::naive) {
          continue;  // without a feature axis no collective matmul runs
        }
        SCOPED_TRACE(c.preset + ", " + dtype + ", " + to_string(algorithm));
        EXPECT_EQ(allocations_in_steps(c, algorithm, LossKind::cross_entropy, OptimizerKind::adamw,
                                       1, 0, false, 25.0, {}, precision),
                  Allocations{})
            << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      }
      for (double bucket_mb : {25.0, 1.0 / 1024}) {
        if (c.preset != "dp" && bucket_mb != 25.0) continue;
        SCOPED_TRACE(c.preset + ", " + dtype + ", overlap, bucket_mb " + std::to_string(bucket_mb));
        EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                       OptimizerKind::adamw, 1, 0, true, bucket_mb, {}, precision),
                  Allocations{})
            << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      }
    }
  }
}

// An MoE layer (issue 19) over ep, ep x fsdp, in fp32, bf16 and fp16: the dispatch buffers
// are sized for the worst case at construction; routing that changes from step to step
// (the weights move) allocates nothing.
TEST(TrainingStep, MoeAllocatesNothing) {
  const int n = world_size();
  std::vector<MeshCase> cases = {{"dp", {{"dp", 1}, {"ep", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp", {{"fsdp", n / 2}, {"ep", 2}}});
  const MixedPrecision policies[] = {
      {Dtype::fp32, Dtype::fp32}, {Dtype::bf16, Dtype::bf16}, {Dtype::fp16, Dtype::fp16}};
  for (const MeshCase& c : cases) {
    for (const MixedPrecision& precision : policies) {
      SCOPED_TRACE(c.preset + " with ep, " + to_string(precision.param));
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                     OptimizerKind::adamw, 1, 0, false, 25.0, {}, precision, {1}),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    }
  }
}

// A residual_mlp (32 -> width 16, 2 blocks of hidden 24, -> 8): norms (their statistics'
// all-reduces over tp, their gathered parameters), SwiGLU and the residual adds, in fp32 with
// overlap and in bf16 without, allocate nothing either.
TEST(TrainingStep, ResidualMlpAllocatesNothing) {
  for (const MeshCase& c : mesh_cases()) {
    for (const bool swiglu : {false, true}) {
      ModelSection model;
      model.kind = ModelKind::residual_mlp;
      model.inputs = 32;
      model.outputs = 8;
      model.width = 16;
      model.hidden = 24;
      model.depth = 2;
      model.norm = swiglu ? ModelNorm::layernorm : ModelNorm::rmsnorm;
      model.swiglu = swiglu;
      model.activation = Activation::silu;
      model.dropout = swiglu ? 0.1 : 0.0;  // dropout inside the blocks allocates nothing either
      // With overlap on fsdp x tp the norms' gradients (scale P(tp), all-reduced over fsdp)
      // go to the DP buckets while the FSDP prefetch gathers over fsdp: the fsdp
      // communicator's request (and 16-bit wire) slots for both are reserved when the model
      // is built (Communicator::reserve_started_*), so whichever finishes first, nothing grows.
      for (const bool bf16 : {false, true}) {
        const bool overlap = !bf16;
        const MixedPrecision precision =
            bf16 ? MixedPrecision{Dtype::bf16, Dtype::bf16} : MixedPrecision{};
        SCOPED_TRACE(c.preset + (swiglu ? ", layernorm + swiglu" : ", rmsnorm + silu") +
                     (bf16 ? ", bf16" : ", fp32, overlap"));
        EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::bidirectional,
                                       LossKind::cross_entropy, OptimizerKind::adamw, 1, 0, overlap,
                                       25.0, {}, precision, {}, 0.0, &model),
                  Allocations{})
            << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      }
    }
  }
}

// Batches read in the step (data.prefetch = 0) or ahead by the reader thread (2), from
// memory: nothing is allocated on either thread.
TEST(TrainingStep, WithAndWithoutPrefetchAllocatesNothing) {
  for (const MeshCase& c : mesh_cases()) {
    for (int64_t prefetch : {0, 2}) {
      SCOPED_TRACE(c.preset + ", data.prefetch " + std::to_string(prefetch));
      DataCase data;
      data.prefetch = prefetch;
      EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                     OptimizerKind::adamw, 1, 0, false, 25.0, data),
                Allocations{})
          << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    }
  }
}

// Batches streamed from an HDF5 file (contiguous: pread; gzip-chunked: through HDF5, whose
// own mallocs are not counted), read in the step or ahead: the source's scratch reached its
// size in step 1, so nothing is allocated either.
TEST(TrainingStep, StreamedFromHdf5AllocatesNothing) {
  testing::TempDir dir(/*shared=*/true);
  const std::string contiguous = dir.file("rows.h5"), chunked = dir.file("rows-chunked.h5");
  if (world_rank() == 0) {
    testing::H5Layout layout;
    testing::write_h5(contiguous, small_data(LossKind::cross_entropy), layout);
    layout.chunked = true;
    testing::write_h5(chunked, small_data(LossKind::cross_entropy), layout);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (const MeshCase& c : mesh_cases()) {
    for (const std::string& path : {contiguous, chunked}) {
      for (int64_t prefetch : {0, 2}) {
        SCOPED_TRACE(c.preset + ", " + path + ", data.prefetch " + std::to_string(prefetch));
        DataCase data;
        data.prefetch = prefetch;
        data.hdf5_path = path;
        EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::cross_entropy,
                                       OptimizerKind::adamw, 1, 0, false, 25.0, data),
                  Allocations{})
            << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      }
    }
  }
}

// Sobolev training (data.dy_key): the tangent pass, the derivative loss, the backward through
// both and the derivative targets' stream (contiguous: pread; chunked: HDF5's hyperslabs of
// [N, outputs, k]) are reserved at set-up, so nothing is allocated either; with one
// micro-batch and with two, and with an MoE layer whose experts are split over ep.
TEST(TrainingStep, WithDerivativeTargetsAllocatesNothing) {
  testing::TempDir dir(/*shared=*/true);
  const std::string contiguous = dir.file("dy.h5"), chunked = dir.file("dy-chunked.h5");
  const std::vector<int64_t> chosen = {3, 17};
  if (world_rank() == 0) {
    const Dataset d = small_data(LossKind::mse);
    const auto k = static_cast<hsize_t>(chosen.size());
    std::vector<float> dy(static_cast<size_t>(d.num_samples * d.target_width) * k);
    for (size_t i = 0; i < dy.size(); ++i) dy[i] = 0.1f * static_cast<float>(i % 7);
    for (const bool is_chunked : {false, true}) {
      testing::H5Layout layout;
      layout.chunked = is_chunked;
      const std::string& path = is_chunked ? chunked : contiguous;
      testing::write_h5(path, d, layout);
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      ASSERT_GE(file, 0);
      testing::write_h5_column(
          file, "/dy", H5T_NATIVE_FLOAT,
          {static_cast<hsize_t>(d.num_samples), static_cast<hsize_t>(d.target_width), k}, dy.data(),
          layout);
      ASSERT_GE(H5Fclose(file), 0);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (const MeshCase& c : mesh_cases()) {
    for (const std::string& path : {contiguous, chunked}) {
      for (int64_t micro_batches : {1, 2}) {
        if (micro_batches == 2 && c.axes.front().first != "tp" && 8 % c.axes.front().second != 0)
          continue;
        SCOPED_TRACE(c.preset + ", " + path + ", data.dy_key, " + std::to_string(micro_batches) +
                     " micro-batches");
        DataCase data;
        data.hdf5_path = path;
        data.dy_key = "/dy";
        data.dy_inputs = chosen;
        EXPECT_EQ(allocations_in_steps(c, CollectiveMatmulAlgorithm::naive, LossKind::mse,
                                       OptimizerKind::adamw, micro_batches, 0, false, 25.0, data),
                  Allocations{})
            << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
      }
    }
  }
  // An MoE layer (layer 1, its experts over ep): its tangent backward's dispatch buffers and
  // wide rows are reserved at set-up too.
  const int n = world_size();
  const MeshCase moe{"dp", {{"dp", 1}, {"ep", n}}};
  for (int64_t micro_batches : {1, 2}) {
    if (micro_batches == 2 && 8 % n != 0) continue;
    SCOPED_TRACE("MoE over ep " + std::to_string(n) + ", data.dy_key, " +
                 std::to_string(micro_batches) + " micro-batches");
    DataCase data;
    data.hdf5_path = contiguous;
    data.dy_key = "/dy";
    data.dy_inputs = chosen;
    EXPECT_EQ(
        allocations_in_steps(moe, CollectiveMatmulAlgorithm::naive, LossKind::mse,
                             OptimizerKind::adamw, micro_batches, 0, false, 25.0, data, {}, {1}),
        Allocations{})
        << "heap allocations in steps 2..4 (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
  }
}

// The counter sees what the step must not do (so the test above can fail): a heap string,
// and a Kokkos kernel launched with a long literal label, which Kokkos 3.4 turns into a
// std::string at every launch.
// (A free function: nvcc refuses a device lambda inside a TEST body, a private member.)
void fill_with_long_label(Vector v) {
  Kokkos::parallel_for(
      "meshtrain::a_label_longer_than_fifteen", 4, KOKKOS_LAMBDA(const int k) { v(k) = 1.0f; });
}

TEST(TrainingStep, CounterSeesAllocations) {
  Vector v("v", 4);
  AllocationWindow window;
  fill_with_long_label(v);
  const long counted = window.close();
  EXPECT_GE(counted, 1);
}

// Leaving oneDNN's own allocations out still counts every other one, and a GEMM on oneDNN
// (where selected) makes allocations the window counts apart and frees them all.
TEST(TrainingStep, CounterLeavesOutOnlyOneDnn) {
  const bool onednn = gemm_backend::selected_host_library() == gemm_backend::HostLibrary::onednn;
  Vector v("v", 4);
  Matrix a("a", 8, 16), b("b", 16, 24), c("c", 8, 24);
  gemm(plain(a), plain(b), 0.0f, c);  // the first call makes the primitive
  AllocationWindow window(AllocationWindow::Threads::all, AllocationWindow::OneDnn::left_out);
  gemm(plain(a), plain(b), 0.0f, c);
  const long by_gemm = window.heap_allocations();
  fill_with_long_label(v);
  window.close();
  EXPECT_EQ(by_gemm, 0) << "a repeated GEMM allocated outside oneDNN";
  EXPECT_GE(window.heap_allocations(), 1) << "the long label's string was not counted";
  if (onednn) {
    EXPECT_GT(window.onednn_allocations(), 0) << "oneDNN's argument map no longer allocates?";
    EXPECT_EQ(window.onednn_blocks_kept(), 0);
  } else {
    EXPECT_EQ(window.onednn_allocations(), 0);
  }
}

// The positive control of onednn_blocks_kept(): a GEMM of a shape not seen before makes its
// primitive inside the window, and oneDNN keeps blocks of it (its primitive cache's entry and
// the primitive descriptor's parts made with operator new), which the window must see, and
// close() returns with the heap count.
TEST(TrainingStep, CounterSeesBlocksOneDnnKeeps) {
  if (gemm_backend::selected_host_library() != gemm_backend::HostLibrary::onednn) {
    GTEST_SKIP() << "the GEMMs run OpenBLAS";
  }
  Matrix a("a", 8, 12), b("b", 12, 20), c("c", 8, 20);  // a shape no other test here uses
  AllocationWindow window(AllocationWindow::Threads::all, AllocationWindow::OneDnn::left_out);
  gemm(plain(a), plain(b), 0.0f, c);
  const long closed = window.close();
  std::cout << "a new shape's GEMM: " << window.onednn_allocations() << " blocks by oneDNN, "
            << window.onednn_blocks_kept() << " kept, " << window.heap_allocations()
            << " by meshtrain\n";
  EXPECT_GT(window.onednn_blocks_kept(), 0) << "a new primitive's blocks were not seen kept";
  EXPECT_LE(window.onednn_blocks_kept(), window.onednn_allocations());
  EXPECT_EQ(closed, window.heap_allocations() + window.onednn_blocks_kept());
}

// ... and a View allocated inside the window is a Kokkos allocation.
TEST(TrainingStep, CounterSeesKokkosAllocations) {
  AllocationWindow window;
  Vector v("v", 4);
  window.close();
  EXPECT_EQ(window.kokkos_allocations(), 1);
}

// train() with a checkpoint in flight (issue 20, bug 5): each step's poll of the save is
// one non-blocking MPI_Iallreduce, read at the next poll; no agreement that waits for the
// slowest rank and no allocation. A hook keeps the writer of step 6's save asleep, so the
// save is in flight from step 7 to step 12; counted on the training thread (the writer builds
// its own records) of ranks above 0 (rank 0 writes metrics.jsonl lines, which build JSON),
// from the log event of step 7 to that of step 12.
TEST(TrainingStep, TrainWithASaveInFlightAllocatesNothing) {
  const int n = world_size();
  if (n < 2) GTEST_SKIP() << "counted on ranks above 0 (rank 0 writes metrics as JSON)";
  const std::string dir = std::filesystem::temp_directory_path().string() +
                          "/meshtrain_step_allocations_save_np" + std::to_string(n);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  set_checkpoint_fault_hook([](const char* point, int64_t) {
    if (std::string_view(point) == "before_close") {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
  });
  RunConfig config;
  config.mesh.axes = {{"dp", n}};
  config.partition.preset = "dp";
  config.model.sizes = {32, 24, 8};
  config.model.loss = LossKind::cross_entropy;
  config.data.batch_size = 16;
  config.train.steps = 12;
  config.train.log_every = 7;  // logs at steps 7 and 12 (the last)
  config.train.eval_every = 0;
  config.checkpoint.every_steps = 6;
  config.run.output_dir = dir;
  config.run.seed = 7;
  long counted = -1, kokkos = -1;
  std::unique_ptr<AllocationWindow> window;
  RunEvents events;
  events.on_log = [&](const LogEvent& e) {
    if (e.step == 7) {
      window = std::make_unique<AllocationWindow>(AllocationWindow::Threads::this_thread,
                                                  AllocationWindow::OneDnn::left_out);
    } else if (e.step == 12 && window) {
      counted = window->close();  // oneDNN's blocks kept included
      kokkos = window->kokkos_allocations();
    }
  };
  std::vector<int64_t> saved;
  events.on_checkpoint = [&](int64_t step, const std::string&) { saved.push_back(step); };
  {
    TrainingRun run(config, events, RunData{small_data(LossKind::cross_entropy), Dataset{}});
    run.train();
  }
  set_checkpoint_fault_hook(nullptr);
  EXPECT_EQ(saved, (std::vector<int64_t>{6, 12}));  // step 6's save was in flight throughout
  if (world_rank() > 0) {
    EXPECT_EQ(counted, 0) << "heap allocations on the training thread in steps 8..12 with a "
                             "save in flight (rerun with MESHTRAIN_TRACE_ALLOCATIONS=5)";
    EXPECT_EQ(kokkos, 0);
  }
  check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace meshtrain
