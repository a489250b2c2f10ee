// Memory against the plan (issue 28 item 4): the Kokkos allocation tracker
// (framework/observe/memory_tracker.hpp) against Views of known sizes, beside another tool
// callback and after one replaced it; and train()'s memory records: after the first step and at
// the end, one figure per rank, at least the plan's parameter and optimizer-state bytes of the
// rank and within kPlanFactor of the plan's Kokkos bytes, the same in metrics.jsonl as in the
// summary the done line prints, smaller per rank on an fsdp mesh than on dp (as the plan
// says); a run that holds a large allocation the plan does not know is over the plan and the
// warning names it, a normal run is not.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/core/gemm.hpp"
#include "framework/core/views.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "run/training_run.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// --- the tracker ----------------------------------------------------------------------------

std::atomic<long> g_other_tool_allocations{0};
void count_allocation(Kokkos::Profiling::SpaceHandle, const char*, const void*, uint64_t) {
  ++g_other_tool_allocations;
}

TEST(MemoryTracker, CountsLiveBytesAndPeakOfViewsOfKnownSize) {
  install_memory_tracker();
  ASSERT_TRUE(memory_tracker_installed());
  const KokkosMemory before = kokkos_memory();
  reset_kokkos_peak();
  {
    Kokkos::View<float*> a("test::tracked_a", 1000);   // 4,000 B
    Kokkos::View<double*> b("test::tracked_b", 3000);  // 24,000 B
    const KokkosMemory during = kokkos_memory(4);
    EXPECT_EQ(during.live_bytes - before.live_bytes, 28000);
    EXPECT_EQ(during.peak_bytes, during.live_bytes);
    ASSERT_FALSE(during.largest.empty());
    EXPECT_EQ(during.largest.front().label, "test::tracked_b");
    EXPECT_EQ(during.largest.front().bytes, 24000);
    EXPECT_EQ(during.largest.front().space, Kokkos::DefaultExecutionSpace::memory_space::name());
  }
  const KokkosMemory after = kokkos_memory();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.peak_bytes, before.live_bytes + 28000);  // the peak stays
  // Many allocations freed in another order than made (the table's deletion).
  {
    std::vector<Kokkos::View<float*>> views;
    for (int i = 1; i <= 500; ++i) views.emplace_back("test::many", i);
    for (size_t i = 0; i < views.size(); i += 2) views[i] = Kokkos::View<float*>();
    int64_t odd = 0;
    for (int i = 2; i <= 500; i += 2) odd += 4 * i;
    EXPECT_EQ(kokkos_memory().live_bytes - before.live_bytes, odd);
  }
  EXPECT_EQ(kokkos_memory().live_bytes, before.live_bytes);
  EXPECT_TRUE(kokkos_memory().complete);
}

TEST(MemoryTracker, ChainsAnotherToolsCallbackAndNotesWhenReplaced) {
  // A callback set before the tracker still sees every allocation.
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_allocation);
  install_memory_tracker();
  g_other_tool_allocations = 0;
  const int64_t live = kokkos_memory().live_bytes;
  {
    Kokkos::View<float*> v("test::chained", 100);
    EXPECT_EQ(g_other_tool_allocations.load(), 1);
    EXPECT_EQ(kokkos_memory().live_bytes - live, 400);
  }
  // A callback set after it replaces it: that allocation goes uncounted (and its deallocation
  // is ignored), and the next installation says the figures are incomplete.
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_allocation);
  EXPECT_FALSE(memory_tracker_installed());
  Kokkos::View<float*> missed("test::missed", 100);
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  install_memory_tracker();
  EXPECT_EQ(kokkos_memory().live_bytes, live);
  missed = Kokkos::View<float*>();
  EXPECT_EQ(kokkos_memory().live_bytes, live);
  EXPECT_FALSE(kokkos_memory().complete);
}

// --- train()'s records ----------------------------------------------------------------------

// A run's Kokkos peak is at most this many times the plan's Kokkos bytes on these models
// (activations, the reductions' scratch and FSDP's gathered weights are not in the plan).
constexpr double kPlanFactor = 2.0;

std::string run_dir(const std::string& what) {
  return std::filesystem::temp_directory_path().string() + "/meshtrain_memory_plan_" + what +
         "_np" + std::to_string(world_size());
}

// 64-256-256-256-8 with AdamW: its parameters and optimizer state (and the asynchronous
// checkpoint's staging of them) are most of what a rank holds, 16 rows per batch.
RunConfig config_for(const std::string& preset, const std::string& dir) {
  RunConfig config =
      testing::synthetic_run_config("memory_plan_test", {{preset, world_size()}}, preset);
  config.run.seed = 5;
  config.model.sizes = {64, 256, 256, 256, 8};
  config.train.steps = 3;
  config.train.log_every = 1;
  config.train.eval_every = 0;
  config.run.output_dir = dir;
  config.checkpoint.dir = dir + "/checkpoints";
  config.checkpoint.keep_best = EvalMetric::test_loss;
  return config;
}

struct Trained {
  std::vector<MemoryEvent> events;  // on_memory's
  RunSummary summary;
  PlannedMemory planned;
  std::vector<nlohmann::json> records;  // metrics.jsonl's memory records (rank 0)
};

// `on_log` runs on every rank after each log event.
Trained train(const RunConfig& config, std::function<void(const LogEvent&)> on_log = {}) {
  if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
  MPI_Barrier(MPI_COMM_WORLD);
  Trained t;
  RunEvents events;
  events.on_log = std::move(on_log);
  events.on_memory = [&](const MemoryEvent& e) { t.events.push_back(e); };
  {
    TrainingRun run(config, events);
    t.planned = run.planned_memory();
    t.summary = run.train();
  }
  if (world_rank() == 0) {
    std::ifstream in(config.run.output_dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto record = nlohmann::json::parse(line);
      if (record["event"] == "memory") t.records.push_back(record);
    }
    std::filesystem::remove_all(config.run.output_dir);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return t;
}

TEST(MemoryPlan, RecordsAfterTheFirstStepAndAtTheEndForEveryRankAgainstThePlan) {
  const int n = world_size();
  const Trained dp = train(config_for("dp", run_dir("dp")));
  ASSERT_EQ(dp.events.size(), 2u);
  EXPECT_EQ(dp.events[0].when, "first_step");
  EXPECT_EQ(dp.events[0].step, 1);
  EXPECT_EQ(dp.events[1].when, "end");
  EXPECT_EQ(dp.events[1].step, 3);
  const PlanTotals& plan = dp.planned.totals;
  for (const MemoryEvent& e : dp.events) {
    SCOPED_TRACE(e.when);
    EXPECT_EQ(e.planned_kokkos_bytes, dp.planned.kokkos_bytes());
    EXPECT_EQ(e.planned_bytes, dp.planned.total_bytes());
    ASSERT_EQ(e.kokkos_peak_bytes.size(), static_cast<size_t>(n));
    ASSERT_EQ(e.rss_peak_bytes.size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      // Every rank holds its parameters, their gradients and AdamW's two slots.
      EXPECT_GE(e.kokkos_peak_bytes[r],
                plan.parameter_bytes + plan.gradient_bytes + plan.optimizer_bytes);
      EXPECT_LE(e.kokkos_peak_bytes[r], kPlanFactor * e.planned_kokkos_bytes);
      EXPECT_GE(e.kokkos_peak_bytes[r], e.kokkos_live_bytes[r]);
      EXPECT_TRUE(e.kokkos_complete[r]);
      // The process holds more than its Kokkos allocations (MPI, BLAS, the binary).
      EXPECT_GT(e.rss_peak_bytes[r], e.kokkos_live_bytes[r]);
      EXPECT_GE(e.rss_peak_bytes[r], e.rss_bytes[r]);
    }
    EXPECT_FALSE(e.over_plan) << format_memory_warning(e);
    EXPECT_EQ(format_memory_warning(e), "");
    // (Which plan item each allocation belongs to is checked over every live allocation in
    // EachWorkspaceItemIsWhatTheRunAllocates: the record's few largest tie in size, and which
    // of equal ones it lists varies.)
  }
  // The end holds the asynchronous checkpoint's staging buffer (a plan item) too.
  EXPECT_GE(dp.events[1].kokkos_peak_bytes[0],
            dp.events[0].kokkos_peak_bytes[0] + dp.planned.checkpoint_staging_bytes);

  // metrics.jsonl holds the same figures, and so does the done line's text.
  if (world_rank() == 0) {
    ASSERT_EQ(dp.records.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const nlohmann::json& r = dp.records[i];
      const MemoryEvent& e = dp.events[i];
      EXPECT_EQ(r["when"], e.when);
      EXPECT_EQ(r["step"], e.step);
      EXPECT_EQ(r["planned_kokkos_bytes"], e.planned_kokkos_bytes);
      EXPECT_EQ(r["kokkos_peak_bytes"].get<std::vector<int64_t>>(), e.kokkos_peak_bytes);
      EXPECT_EQ(r["rss_peak_bytes"].get<std::vector<int64_t>>(), e.rss_peak_bytes);
      EXPECT_EQ(r["rss_bytes"].get<std::vector<int64_t>>(), e.rss_bytes);
      EXPECT_EQ(r["over_plan"], false);
    }
    ASSERT_TRUE(dp.summary.memory);
    const auto& peaks = dp.records[1]["kokkos_peak_bytes"];
    const auto max_at = std::max_element(peaks.begin(), peaks.end()) - peaks.begin();
    const std::string done = format_memory_figures(*dp.summary.memory);
    const std::string expected = "Kokkos peak " + format_bytes(peaks[max_at].get<int64_t>()) +
                                 " (max, rank " + std::to_string(max_at) + ") = ";
    EXPECT_EQ(done.rfind(expected, 0), 0u) << done << "\nexpected to start with " << expected;
    EXPECT_NE(done.find("of the plan's " + format_bytes(dp.planned.kokkos_bytes())),
              std::string::npos)
        << done;
  }

  // FSDP shards parameters, gradients and optimizer state: less per rank than DP, as the plan
  // says (on one rank the meshes are the same). After the first step on every rank; at the end
  // the largest rank's (the plan's per-rank figure is a maximum: DP's checkpoint staging is on
  // rank 0 alone, which writes the replicated tensors, FSDP's on every rank).
  if (n == 1) return;
  const Trained fsdp = train(config_for("fsdp", run_dir("fsdp")));
  ASSERT_EQ(fsdp.events.size(), 2u);
  EXPECT_LT(fsdp.planned.kokkos_bytes(), dp.planned.kokkos_bytes());
  for (int r = 0; r < n; ++r) {
    EXPECT_LT(fsdp.events[0].kokkos_peak_bytes[r], dp.events[0].kokkos_peak_bytes[r])
        << "rank " << r;
  }
  // FSDP's gathered weights are not in the plan (over 25% on this model), but far below the
  // warning's floor: no warning.
  for (const MemoryEvent& e : fsdp.events) EXPECT_FALSE(e.over_plan) << format_memory_warning(e);
  const auto max_of = [](const std::vector<int64_t>& v) {
    return *std::max_element(v.begin(), v.end());
  };
  EXPECT_LT(max_of(fsdp.events[1].kokkos_peak_bytes), max_of(dp.events[1].kokkos_peak_bytes));
}

// The plan counts what a run allocates (parameters, gradients, optimizer state, the step's
// workspace: activations, batch buffers, FSDP's gathered weights, collective matmul workspace,
// communicator scratch; checkpoint and data staging; the ring reductions' partial sums). Each
// rank's Kokkos peak at the end is within this band of its own planned bytes
// (PlannedMemory::kokkos_bytes_of_rank). Measured: 12 KiB above the plan on every rank and mesh
// here (the evaluation metrics' buffers, the gradient clipper's norms, Kokkos' own scratch and
// empty Views' headers are no plan items), 0.3-0.5% of these 2.6-4.4 MiB; the band leaves room
// for a few such buffers more and fails when the activations (3-4% of the total here) or a
// larger item go missing; EachWorkspaceItemIsWhatTheRunAllocates checks the small items. Also a
// residual_mlp with an evaluation batch of other rows (its forward-only model) on dp, fsdp, tp.
constexpr double kBandLow = 0.98, kBandHigh = 1.02;

RunConfig preset_config(const std::string& preset, int tp) {
  RunConfig config = config_for(preset, run_dir("band_" + preset));
  const int n = world_size();
  // dp_tp: dp x tp; fsdp_tp (and the others): fsdp x tp.
  if (tp > 1) config.mesh.axes = {{preset == "dp_tp" ? "dp" : "fsdp", n / tp}, {"tp", tp}};
  return config;
}

// data.eval_batch_size other than data.batch_size (16): the run evaluates with a forward-only
// copy of the model built for its rows (issue 36, item 19: a residual_mlp's was counted as its
// inputs and layer outputs alone, and every run warned "107% more than the plan"; the copy also
// held parameters and gradients of its own while it was built, which under dp set the peak of
// every rank but the one that stages the checkpoint).
constexpr int64_t kOtherEvalBatch = 48;

struct BandCase {
  std::string name, preset;
  int tp = 1;
  bool residual_eval_batch = false;  // a residual_mlp with kOtherEvalBatch
};

TEST(MemoryPlan, EveryRanksPeakAtTheEndIsWithinTheBandOfItsPlan) {
  const int n = world_size();
  std::vector<BandCase> cases = {{"dp", "dp"},
                                 {"fsdp", "fsdp"},
                                 {"tp", "tp"},
                                 {"dp_residual_eval_batch", "dp", 1, true},
                                 {"fsdp_residual_eval_batch", "fsdp", 1, true},
                                 {"tp_residual_eval_batch", "tp", 1, true}};
  if (n == 4) cases.push_back({"fsdp_tp", "fsdp_tp", 2});
  for (const BandCase& c : cases) {
    SCOPED_TRACE(c.name);
    RunConfig config = preset_config(c.preset, c.tp);
    if (c.residual_eval_batch) {
      testing::use_residual_mlp(config, /*inputs=*/64, /*width=*/128, /*hidden=*/256,
                                /*depth=*/2, /*outputs=*/8, ModelNorm::layernorm, false);
      config.data.eval_batch_size = kOtherEvalBatch;  // evaluated at the end, before its peak
    }
    const Trained t = train(config);
    ASSERT_EQ(t.events.size(), 2u);
    const MemoryEvent& end = t.events[1];
    // The plan's figure is the largest rank's.
    int64_t largest = 0;
    for (int r = 0; r < n; ++r) largest = std::max(largest, t.planned.kokkos_bytes_of_rank(r));
    EXPECT_EQ(largest, t.planned.kokkos_bytes());
    EXPECT_GT(t.planned.workspace.activation_bytes, 0);
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const double planned = static_cast<double>(t.planned.kokkos_bytes_of_rank(r));
      const double ratio = static_cast<double>(end.kokkos_peak_bytes[r]) / planned;
      EXPECT_GE(ratio, kBandLow) << end.kokkos_peak_bytes[r] << " against " << planned;
      // Where device memory is separate (a GPU build, the emulated one) MPI also stages
      // through host buffers (meshtrain::mpi_host_staging) that the plan does not hold yet
      // (docs/running.md): there the peak may exceed the band by them.
      if (!device_memory_is_separate()) {
        EXPECT_LE(ratio, kBandHigh) << end.kokkos_peak_bytes[r] << " against " << planned;
      }
    }
    for (const MemoryEvent& e : t.events) EXPECT_FALSE(e.over_plan) << format_memory_warning(e);
    // The workspace's allocations are matched to their plan items, none left unmatched among
    // the largest but the ring reductions' partial sums.
    for (const MemoryEvent::Allocation& a : end.largest) {
      if (a.label.rfind("layers/", 0) == 0) EXPECT_NE(a.plan_item, "") << a.label;
      if (a.label.rfind("meshtrain::scratch_", 0) == 0) EXPECT_EQ(a.plan_item, "gathered weights");
      if (a.label == "meshtrain::collective_matmul_workspace") {
        EXPECT_EQ(a.plan_item, "collective matmul workspace");
      }
    }
  }
}

// Each workspace item of the plan equals, to the byte (the scratch: but for empty Views'
// headers), the sum of this rank's live allocations the run matches to it (every live allocation,
// not only the largest): the plan counts what the code allocates. On dp, fsdp, tp (and fsdp x tp
// and dp x tp at np 4), in fp32, in bf16 with overlap, for a residual model with norms (and with
// SwiGLU blocks and dropout), and an MLP with dropout; with an evaluation batch of other rows
// (larger and smaller) for both kinds, whose forward-only model's buffers are the plan's evaluation
// batch. And over a bf16 wire (weight gradients stored as 16 bits), dp and tp, overlap off and
// on: "gradients" is the stored weights, each in a buffer of its own or, under overlap, the
// training model's 16-bit bucket buffer whole; at np 4 dp x tp and a column-parallel first layer.
struct WorkspaceCase {
  std::string name, preset;
  int tp = 1;
  bool bf16_overlap = false, residual = false;
  bool swiglu_dropout = false;  // residual: SwiGLU blocks; both kinds: dropout 0.1
  int64_t eval_batch = 0;       // data.eval_batch_size (0: unset, the training batch)
  // A plain MLP with tanh instead of the presets' relu: under 16-bit storage its activations
  // keep their input z beside their output (framework/core/activation_storage.hpp), relu's only
  // their output.
  bool tanh = false;
  // bf16 compute over a bf16 wire (reduce_dtype bf16): DP weight gradients stored as 16 bits
  // (partition/gradient_storage.hpp) where gemm()'s kernel writes them.
  bool bf16_wire = false;
  // dp x tp (np 4): layers/0 column-parallel over tp (its weight P(None, tp), its bias P(tp)),
  // the other layers replicated (the dp preset): its gradient, written by one GEMM, is stored as
  // 16 bits in model and plan alike (in the buckets under overlap).
  bool column_first = false;
};

TEST(MemoryPlan, EachWorkspaceItemIsWhatTheRunAllocates) {
  const int n = world_size();
  std::vector<WorkspaceCase> cases = {
      {"dp", "dp"},
      {"fsdp", "fsdp"},
      {"tp", "tp"},
      // (bf16 under tp: where gemm() reads 16 bits, oneDNN (the default) on a CPU
      // with AVX512_BF16, the weights' 16-bit copies and the layers' 16-bit dY.)
      {"tp_bf16_overlap", "tp", 1, true},
      // 16-bit storage under tp with a forward-only evaluation model of other rows (its own
      // sliced input and work buffers, sized by its rows).
      {"tp_bf16_eval_batch", "tp", 1, true, false, false, kOtherEvalBatch},
      // 16-bit storage keeping z as well as f(z) (tanh), under tp and without it.
      {"tp_bf16_overlap_tanh", "tp", 1, true, false, false, 0, true},
      {"dp_bf16_overlap_tanh", "dp", 1, true, false, false, 0, true},
      {"fsdp_bf16_overlap", "fsdp", 1, true},
      {"dp_residual_bf16_overlap", "dp", 1, true, true},
      {"fsdp_residual_bf16_overlap_eval_batch", "fsdp", 1, true, true, false, kOtherEvalBatch},
      {"tp_residual", "tp", 1, false, true},
      {"tp_swiglu_dropout", "tp", 1, false, true, true},
      {"dp_dropout", "dp", 1, false, false, true},
      {"dp_residual_eval_batch", "dp", 1, false, true, false, kOtherEvalBatch},
      {"tp_residual_eval_batch", "tp", 1, false, true, false, kOtherEvalBatch},
      {"fsdp_swiglu_dropout_small_eval_batch", "fsdp", 1, false, true, true, 8},
      {"dp_eval_batch", "dp", 1, false, false, false, kOtherEvalBatch}};
  // bf16 over a bf16 wire: the weight gradients are stored as 16 bits, without overlap each in a
  // buffer of its own, with overlap in the DP buckets' 16-bit buffer (with the biases' 16-bit
  // copies); at np 1 (no reduction) each in a buffer of its own. Under tp (every rank; np 1: one)
  // the row-parallel layers' too, written by their all-gather-matmul, each in a buffer of its own
  // (nothing reduces them).
  for (const char* preset : {"dp", "tp"}) {
    WorkspaceCase wire{std::string(preset) + "_bf16_wire", preset};
    wire.bf16_wire = true;
    cases.push_back(wire);
    wire.name += "_overlap";
    wire.bf16_overlap = true;
    cases.push_back(wire);
  }
  if (n == 4) {
    cases.push_back({"fsdp_tp", "fsdp_tp", 2});
    // 16-bit storage under fsdp x tp: the weights' copies gathered over fsdp, the layers
    // row-parallel over tp.
    cases.push_back({"fsdp_tp_bf16_overlap", "fsdp_tp", 2, true});
    // ... and under dp x tp: the weights stored whole, their copies not gathered.
    cases.push_back({"dp_tp_bf16_overlap", "dp_tp", 2, true});
    // dp x tp over a bf16 wire: the row-parallel layers' gradients all-reduced over dp by the
    // layers themselves, as 16 bits in buffers of their own.
    WorkspaceCase dp_tp{"dp_tp_bf16_wire_overlap", "dp_tp", 2, true};
    dp_tp.bf16_wire = true;
    cases.push_back(dp_tp);
    // A column-parallel first layer in a bf16-wire run, without and with overlap.
    WorkspaceCase column{"dp_tp_column_bf16_wire", "dp"};
    column.bf16_wire = column.column_first = true;
    cases.push_back(column);
    column.name += "_overlap";
    column.bf16_overlap = true;
    cases.push_back(column);
  }
  for (const WorkspaceCase& c : cases) {
    SCOPED_TRACE(c.name);
    RunConfig config = preset_config(c.preset, c.tp);
    if (c.bf16_overlap || c.bf16_wire) config.mixed_precision.param_dtype = Dtype::bf16;
    if (c.bf16_overlap) config.runtime.overlap = true;
    if (c.bf16_wire) config.mixed_precision.reduce_dtype = Dtype::bf16;
    if (c.column_first) {
      // The dp preset on a dp x tp mesh: the other layers replicated over tp.
      config.mesh.axes = {{"dp", n / 2}, {"tp", 2}};
      config.partition.rules = {{"layers/0/weight$", PartitionSpec::parse("P(None, tp)")},
                                {"layers/0/bias$", PartitionSpec::parse("P(tp)")}};
    }
    if (c.residual) {
      testing::use_residual_mlp(config, /*inputs=*/64, /*width=*/128, /*hidden=*/256,
                                /*depth=*/2, /*outputs=*/8, ModelNorm::layernorm, c.swiglu_dropout);
    }
    if (c.swiglu_dropout) config.model.dropout = 0.1;
    if (c.tanh) config.model.activation = Activation::tanh;
    if (c.eval_batch > 0) config.data.eval_batch_size = c.eval_batch;
    if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
    MPI_Barrier(MPI_COMM_WORLD);
    {
      TrainingRun run(config);
      const RunSummary summary = run.train();
      EXPECT_EQ(summary.steps_run, config.train.steps);
      if (summary.last_eval) EXPECT_TRUE(std::isfinite(summary.last_eval->test_loss));
      if (c.column_first) {
        const LayerPlan* first = nullptr;
        for (const LayerPlan& l : run.plan().layers) {
          if (l.name == "layers/0") first = &l;
        }
        ASSERT_NE(first, nullptr);
        EXPECT_TRUE(first->layout.column_parallel);
      }
      if (c.bf16_wire && gemm_kernel_writes_16bit(Dtype::bf16)) {
        // The feature is on: some weight gradient is stored as 16 bits, so the plan's gradients
        // are below the sharding plan's fp32 gradients.
        EXPECT_LT(run.planned_memory().totals.gradient_bytes, run.plan().totals.gradient_bytes);
      }
      std::map<std::string, int64_t> measured;
      int64_t kept_z_buffers = 0;  // "layers/i/activation/input_16bit"
      for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
        measured[run.plan_item_of(a)] += a.bytes;
        if (a.label.find("/activation/input_16bit") != std::string::npos) ++kept_z_buffers;
      }
      if (c.tanh) {  // the storage applies, and keeps z for each of the 3 hidden layers
        EXPECT_TRUE(run.model().keeps_16bit_activations());
        EXPECT_EQ(kept_z_buffers, 3);
      }
      const TrainingWorkspace& w = run.planned_memory().workspace;
      const PlanTotals& totals = run.planned_memory().totals;
      const EvaluationBuffers& e = run.planned_memory().evaluation;
      EXPECT_EQ(measured["parameters"], totals.parameter_bytes);
      EXPECT_EQ(measured["gradients"], totals.gradient_bytes);
      EXPECT_EQ(measured["optimizer state"], totals.optimizer_bytes);
      // A separate evaluation model's layers carry the training layers' labels: its buffers
      // are matched as activations too.
      EXPECT_EQ(measured["activations"], w.activation_bytes + e.activation_bytes);
      EXPECT_EQ(measured["evaluation batch"], e.batch_bytes);
      EXPECT_EQ(totals.evaluation_bytes, e.total_bytes());
      if (c.eval_batch > 0) EXPECT_GT(e.activation_bytes, 0);
      EXPECT_EQ(measured["batch buffers"], w.batch_bytes);
      // The shared scratch's six Views exist even when empty, and Kokkos reports an empty
      // labelled View as its allocation header (128 bytes): at most 6 such headers a model (a
      // separate evaluation model has a scratch of its own).
      const int64_t models = c.eval_batch > 0 ? 2 : 1;
      EXPECT_GE(measured["gathered weights"], w.gathered_weight_bytes + e.gathered_weight_bytes);
      EXPECT_LE(measured["gathered weights"],
                w.gathered_weight_bytes + e.gathered_weight_bytes + models * 6 * 128);
      EXPECT_EQ(measured["collective matmul workspace"],
                w.collective_matmul_bytes + e.collective_matmul_bytes);
      EXPECT_EQ(measured["communicator scratch"], w.comm_scratch_bytes);
    }
    if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// 16-bit storage (docs/mixed_precision.md, "Compute and memory on this build"): a plain MLP
// computing in bf16 or fp16 keeps its activations for backward in 2-byte buffers and computes in
// two shared fp32 working buffers, so its activations (64-256-256-256-8, relu, 16 rows a rank)
// take at most 0.6 of fp32's (relu, like the identity, keeps only its output; the simulated path
// took 1.03), measured by the tracker and planned alike, on dp and fsdp; and on tp, whose layers
// are all row-parallel (the first keeping its slice of the input as 16 bits where gemm()'s
// kernel reads them, a hidden layer's 16-bit dY packed over its activation's kept output; the
// simulated path took more than fp32's there).
TEST(MemoryPlan, SixteenBitActivationsOfAPlainMlpTakeLittleMoreThanHalfOfFp32s) {
  for (const std::string preset : {"dp", "fsdp", "tp"}) {
    std::map<Dtype, int64_t> measured, planned;
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
      SCOPED_TRACE(preset + ", " + to_string(dtype));
      RunConfig config = config_for(preset, run_dir("sixteen_bit_" + preset));
      config.mixed_precision.param_dtype = dtype;
      config.mixed_precision.reduce_dtype = dtype;
      if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
      MPI_Barrier(MPI_COMM_WORLD);
      {
        TrainingRun run(config);
        run.train();
        for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
          // (fp16's LossScaler buffer, "meshtrain::loss_scaler_found", is matched to
          // activations by its label's prefix but is not one: left out on both sides.)
          if (run.plan_item_of(a) == "activations" &&
              a.label.rfind("meshtrain::loss_scaler", 0) != 0) {
            measured[dtype] += a.bytes;
          }
        }
        planned[dtype] = run.planned_memory().workspace.activation_bytes;
        // Under tp every layer is row-parallel: the storage applies there too.
        if (dtype != Dtype::fp32) EXPECT_TRUE(run.model().keeps_16bit_activations());
      }
      EXPECT_EQ(measured[dtype], planned[dtype]);
      if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
      MPI_Barrier(MPI_COMM_WORLD);
    }
    for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
      EXPECT_LE(double(measured[dtype]), 0.6 * double(measured[Dtype::fp32]))
          << preset << ", " << to_string(dtype) << " against fp32";
    }
  }
}

// A residual_mlp's 16-bit storage (docs/mixed_precision.md, "Compute and memory on this build"):
// its blocks' hidden activations kept as 16 bits, the up projections' outputs and the down
// projections' input gradients in one shared fp32 buffer; its residual stream and its norms'
// inputs and outputs kept as 16 bits, the stream, the norms' outputs and the gradient stream in
// three shared fp32 buffers. Its activations (64 -> 128 wide, hidden 256, 2 LayerNorm blocks, 8
// outputs, 16 rows a rank; and the same with RMSNorm SwiGLU blocks, whose gate, up and SwiGLU
// outputs are kept as 16 bits and gate's output computed in a second shared buffer) are measured
// by the tracker as planned, to the byte, in fp32, bf16 and fp16 on dp and fsdp, and bf16's and
// fp16's take at most 0.6 of fp32's (0.81-0.82 with the hidden activations alone; the simulated
// path's take more than fp32's: its input copy and output gradient).
TEST(MemoryPlan, SixteenBitHiddenActivationsOfAResidualMlp) {
  struct Case {
    std::string preset;
    bool swiglu;        // SwiGLU blocks (RMSNorm), else LayerNorm ones
    bool norms = true;  // false: no norms, so the residual stream is not kept in 16 bits
  };
  const std::vector<Case> cases = {
      {"dp", false}, {"fsdp", false}, {"dp", true}, {"fsdp", true}, {"dp", true, false}};
  for (const auto& [preset, swiglu, norms] : cases) {
    std::map<Dtype, int64_t> measured, planned;
    const std::string name = preset + (swiglu ? " swiglu" : "") + (norms ? "" : " no norms");
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
      SCOPED_TRACE(name + ", " + to_string(dtype));
      RunConfig config = config_for(preset, run_dir("sixteen_bit_residual_" + preset));
      testing::use_residual_mlp(config, /*inputs=*/64, /*width=*/128, /*hidden=*/256,
                                /*depth=*/2, /*outputs=*/8,
                                !norms   ? ModelNorm::none
                                : swiglu ? ModelNorm::rmsnorm
                                         : ModelNorm::layernorm,
                                swiglu);
      if (swiglu) config.model.activation = Activation::silu;
      config.mixed_precision.param_dtype = dtype;
      config.mixed_precision.reduce_dtype = dtype;
      if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
      MPI_Barrier(MPI_COMM_WORLD);
      {
        TrainingRun run(config);
        run.train();
        EXPECT_EQ(run.model().keeps_16bit_activations(), dtype != Dtype::fp32);
        EXPECT_EQ(run.model().keeps_16bit_residual_stream(), norms && dtype != Dtype::fp32);
        for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
          // (fp16's LossScaler buffer is matched to activations by its label's prefix but is
          // not one: left out on both sides.)
          if (run.plan_item_of(a) == "activations" &&
              a.label.rfind("meshtrain::loss_scaler", 0) != 0) {
            measured[dtype] += a.bytes;
          }
        }
        planned[dtype] = run.planned_memory().workspace.activation_bytes;
      }
      EXPECT_EQ(measured[dtype], planned[dtype]);
      if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
      MPI_Barrier(MPI_COMM_WORLD);
    }
    for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
      if (world_rank() == 0) {
        std::printf("[memory_plan np%d] residual %s activations %s / fp32: %.3f\n", world_size(),
                    name.c_str(), to_string(dtype),
                    double(measured[dtype]) / double(measured[Dtype::fp32]));
      }
      // (Without norms the fp32 residual stream and its gradients stay: only plan = tracker.)
      if (norms) {
        EXPECT_LE(double(measured[dtype]), 0.6 * double(measured[Dtype::fp32]))
            << name << ", " << to_string(dtype) << " against fp32";
      }
    }
  }
}

// Activation bytes of one training run of `config` under `dtype` (param and reduce), as the
// tracker measures them (which must be what the plan counts, to the byte); `storage` gets
// Mlp::keeps_16bit_activations().
int64_t measured_activation_bytes(RunConfig config, Dtype dtype, bool* storage = nullptr) {
  config.mixed_precision.param_dtype = dtype;
  config.mixed_precision.reduce_dtype = dtype;
  if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
  MPI_Barrier(MPI_COMM_WORLD);
  int64_t measured = 0, planned = 0;
  {
    TrainingRun run(config);
    run.train();
    if (storage) *storage = run.model().keeps_16bit_activations();
    for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
      // (fp16's LossScaler buffer is matched to activations by its label's prefix but is not
      // one: left out on both sides.)
      if (run.plan_item_of(a) == "activations" && a.label.rfind("meshtrain::loss_scaler", 0) != 0) {
        measured += a.bytes;
      }
    }
    planned = run.planned_memory().workspace.activation_bytes;
  }
  EXPECT_EQ(measured, planned) << to_string(dtype);
  if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
  MPI_Barrier(MPI_COMM_WORLD);
  return measured;
}

// Issue 37's residual model (12 inputs, width 128, hidden 256, 4 LayerNorm SiLU blocks, 4
// outputs) at a batch of 512: under bf16 its activations take at most 0.6 of fp32's (the issue
// asks 0.55-0.6; 0.735 with the blocks' hidden activations alone, 0.35 with the residual stream
// and the norms as well: docs/mixed_precision.md), measured by the tracker as planned.
TEST(MemoryPlan, SixteenBitActivationsOfTheIssuesResidualMlp) {
  RunConfig config = config_for("dp", run_dir("sixteen_bit_issue_residual"));
  testing::use_residual_mlp(config, /*inputs=*/12, /*width=*/128, /*hidden=*/256, /*depth=*/4,
                            /*outputs=*/4, ModelNorm::layernorm, false);
  config.model.activation = Activation::silu;
  config.data.batch_size = 512;
  config.data.synthetic_samples = 1024;
  config.train.steps = 2;
  config.checkpoint.keep_best = std::nullopt;
  const int64_t fp32 = measured_activation_bytes(config, Dtype::fp32);
  bool storage = false;
  const int64_t bf16 = measured_activation_bytes(config, Dtype::bf16, &storage);
  EXPECT_TRUE(storage);
  if (world_rank() == 0) {
    std::printf(
        "[memory_plan np%d] issue's residual model, batch 512: activations bf16 %lld / "
        "fp32 %lld bytes a rank: %.3f\n",
        world_size(), static_cast<long long>(bf16), static_cast<long long>(fp32),
        double(bf16) / double(fp32));
  }
  EXPECT_LE(double(bf16), 0.6 * double(fp32));
}

// The issue's residual model with SwiGLU blocks (12 inputs, width 128, hidden 256, 4 RMSNorm
// SwiGLU blocks, 4 outputs) at a batch of 512 on one rank per batch shard: under bf16 the SwiGLU
// blocks keep gate, up and their output as 16 bits (docs/mixed_precision.md measures the ratio),
// measured by the tracker as planned, to the byte; at most 0.6 of fp32's.
TEST(MemoryPlan, SixteenBitActivationsOfTheIssuesResidualSwigluMlp) {
  RunConfig config = config_for("dp", run_dir("sixteen_bit_issue_residual_swiglu"));
  testing::use_residual_mlp(config, /*inputs=*/12, /*width=*/128, /*hidden=*/256, /*depth=*/4,
                            /*outputs=*/4, ModelNorm::rmsnorm, /*swiglu=*/true);
  config.model.activation = Activation::silu;
  config.data.batch_size = 512;
  config.data.synthetic_samples = 1024;
  config.train.steps = 2;
  config.checkpoint.keep_best = std::nullopt;
  const int64_t fp32 = measured_activation_bytes(config, Dtype::fp32);
  bool storage = false;
  const int64_t bf16 = measured_activation_bytes(config, Dtype::bf16, &storage);
  EXPECT_TRUE(storage);
  if (world_rank() == 0) {
    std::printf(
        "[memory_plan np%d] issue's residual SwiGLU model, batch 512: activations bf16 %lld / "
        "fp32 %lld bytes a rank: %.3f\n",
        world_size(), static_cast<long long>(bf16), static_cast<long long>(fp32),
        double(bf16) / double(fp32));
  }
  EXPECT_LE(double(bf16), 0.6 * double(fp32));
}

// Plan and model decide 16-bit activation storage by one predicate
// (partition/sixteen_bit_storage.hpp): on a mesh with a feature axis of size 2 whose rules split
// no layer over it (the dp preset: every weight replicated), neither stores 16 bits (the layers
// could compute over the axis), and the tracker measures what the plan counts, to the byte, for a
// plain MLP and a residual_mlp in bf16.
TEST(MemoryPlan, SixteenBitStorageDecidedAlikeOnAFeatureAxisThatSplitsNoLayer) {
  const int n = world_size();
  if (n % 2 != 0) GTEST_SKIP() << "needs a feature axis of size 2";
  for (const bool residual : {false, true}) {
    SCOPED_TRACE(residual ? "residual_mlp" : "mlp");
    RunConfig config = config_for("dp", run_dir("sixteen_bit_feature_axis"));
    config.mesh.axes = {{"dp", n / 2}, {"tp", 2}};
    if (residual) {
      testing::use_residual_mlp(config, /*inputs=*/64, /*width=*/128, /*hidden=*/256,
                                /*depth=*/2, /*outputs=*/8, ModelNorm::layernorm, false);
    }
    bool storage = true;
    measured_activation_bytes(config, Dtype::bf16, &storage);
    EXPECT_FALSE(storage);
  }
}

// The weights' 16-bit compute copies (docs/mixed_precision.md): under FSDP with prefetch, a plain
// MLP computing in bf16 or fp16 gathers its weights as 16 bits into one 16-bit landing, instead of
// an fp32 weight buffer and an fp32 prefetch buffer. Where gemm()'s kernel reads the dtype as
// stored (gemm_kernel_reads_16bit: oneDNN's bf16 matmul on a CPU with AVX512_BF16, cuBLAS) the
// GEMMs read the gathered blocks put in place in the weight buffer's bytes, which is then 2 bytes
// an element: the gathered weight buffers (scratch weight, prefetch and 16-bit landing) take half
// of fp32's (4 bytes an element against 8; the weight buffer exactly half of fp32's) where the
// weights are gathered (np > 1). Elsewhere (fp16 on a CPU, OpenBLAS, and an fp32 kernel under
// MESHTRAIN_GEMM_16BIT_OPERANDS=always, the operands16_openblas registration) the landing is
// widened into an fp32 weight buffer: at most 0.75 (6 bytes against 8; the weight buffer as
// fp32's). The plan counts them and the copies (2 bytes an element of each stored block) to the
// byte as the tracker measures them.
TEST(MemoryPlan, SixteenBitGatheredWeightsOfAPlainMlpUnderFsdpPrefetch) {
  std::map<Dtype, int64_t> gathered, weight_buffer;
  for (const Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
    SCOPED_TRACE(to_string(dtype));
    RunConfig config = config_for("fsdp", run_dir("sixteen_bit_gathered"));
    config.mixed_precision.param_dtype = dtype;
    config.mixed_precision.reduce_dtype = dtype;
    config.runtime.overlap = true;
    if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
    MPI_Barrier(MPI_COMM_WORLD);
    {
      TrainingRun run(config);
      run.train();
      int64_t copies = 0, buffers = 0, item = 0;
      for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
        if (a.label.rfind("meshtrain::scratch_16bit_copy:", 0) == 0) copies += a.bytes;
        if (a.label == "meshtrain::scratch_weight" || a.label == "meshtrain::scratch_prefetch" ||
            a.label == "meshtrain::scratch_weight_16bit") {
          buffers += a.bytes;
        }
        // (fp32 swaps the weight and prefetch buffers, of one size: either label.)
        if (a.label == "meshtrain::scratch_weight") weight_buffer[dtype] = a.bytes;
        if (run.plan_item_of(a) == "gathered weights") item += a.bytes;
      }
      const TrainingWorkspace& w = run.planned_memory().workspace;
      EXPECT_EQ(copies, w.sixteen_bit_copy_bytes);
      if (dtype == Dtype::fp32) EXPECT_EQ(copies, 0);
      // Each weight's stored block, 2 bytes an element, where the weights are gathered (np > 1;
      // on one rank nothing is gathered and no weight has a copy, unless gemm() reads 16 bits).
      if (dtype != Dtype::fp32) {
        int64_t stored = 0;
        for (const ShardedTensor& t : run.model().parameters()) {
          if (t.name.size() > 6 && t.name.compare(t.name.size() - 6, 6, "weight") == 0) {
            stored += static_cast<int64_t>(t.local.extent(0));
          }
        }
        EXPECT_EQ(copies, world_size() > 1 || gemm_reads_16bit(dtype) ? 2 * stored : 0);
      }
      // The scratch's empty Views are reported as headers (128 bytes each, six a model).
      EXPECT_GE(item, w.gathered_weight_bytes);
      EXPECT_LE(item, w.gathered_weight_bytes + 6 * 128);
      gathered[dtype] = buffers;
    }
    if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  // (On one rank nothing is gathered: fp32 computes from the master itself, 16 bits from the
  // master rounded into the fp32 weight buffer.)
  if (world_size() == 1) return;
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    const bool reads = gemm_kernel_reads_16bit(dtype);
    // Which sizing this CPU checked (the half-size branch runs only where the kernel reads 16
    // bits: oneDNN bf16 on AVX512_BF16 or AMX, cuBLAS): in the XML report and on rank 0's output.
    const std::string branch = reads ? "half: the kernel reads it" : "fp32: an fp32 kernel";
    RecordProperty(std::string("weight_buffer_") + to_string(dtype), branch);
    if (world_rank() == 0) {
      std::printf("[memory_plan np%d] %s weight buffer checked at %s (%s)\n", world_size(),
                  to_string(dtype), branch.c_str(), gemm_kernels().c_str());
    }
    SCOPED_TRACE(std::string(to_string(dtype)) + ": " + branch);
    // (64-256-256-256-8: the largest gathered block has an even number of elements.)
    EXPECT_EQ(weight_buffer[dtype],
              reads ? weight_buffer[Dtype::fp32] / 2 : weight_buffer[Dtype::fp32]);
    // Up to 3 empty Views' 128-byte headers on either side.
    EXPECT_LE(double(gathered[dtype]),
              (reads ? 0.5 : 0.75) * double(gathered[Dtype::fp32]) + 3 * 128)
        << to_string(dtype) << " against fp32";
  }
}

// The weights' 16-bit compute copies exist where a weight is gathered over one group (FSDP), and
// where it is stored whole (DP, one rank) only if gemm() reads 16 bits (the GEMMs then read the
// copy instead of the master rounded at each use): elsewhere a copy would be 2 bytes a parameter
// beside the fp32 weight buffer the GEMM reads, into which the master is rounded as the copy would
// be widened (issue 37: a bf16 DP plan 3% above fp32's). So, on dp (every np) and fsdp at np 1: a
// copy per weight where gemm() reads bf16 (oneDNN, the default, on a CPU with AVX512_BF16),
// none otherwise, measured or planned; under fsdp at np > 1 one per weight; the plan agrees with
// the tracker to the byte; and with 128 rows a rank the bf16 plan's total is at most fp32's, less
// the copies where weights stored whole have them (the 2 bytes a parameter spent to save passes;
// with them it was 0.05 MB above on dp). Under tp the weights, stored as their compute blocks,
// have copies where gemm() reads 16 bits, as DP's (the collective matmuls read them as they are),
// and its layers, all row-parallel, keep their activations as 16 bits as DP's do: its bf16 total
// is at most fp32's too (before that storage it was above).
TEST(MemoryPlan, SixteenBitCopiesWhereGatheredOverOneGroupOrWhereGemmReads16Bits) {
  for (const std::string preset : {"dp", "fsdp", "tp"}) {
    std::map<Dtype, int64_t> total;
    int64_t whole_copies = 0;  // bf16: the planned copies of weights stored whole
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
      SCOPED_TRACE(preset + ", " + to_string(dtype));
      RunConfig config = config_for(preset, run_dir("sixteen_bit_copies_" + preset));
      config.data.batch_size = 128 * world_size();
      config.data.synthetic_samples = 2 * config.data.batch_size;
      config.mixed_precision.param_dtype = dtype;
      config.mixed_precision.reduce_dtype = dtype;
      if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
      MPI_Barrier(MPI_COMM_WORLD);
      {
        TrainingRun run(config);
        run.train();
        int64_t copies = 0, item = 0, models_with_copies = 0;
        for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
          if (a.label.rfind("meshtrain::scratch_16bit_copy:", 0) == 0) copies += a.bytes;
          if (run.plan_item_of(a) == "gathered weights") item += a.bytes;
        }
        for (const ShardedTensor& t : run.model().parameters())
          models_with_copies += !!t.copy_16bit;
        const TrainingWorkspace& w = run.planned_memory().workspace;
        const bool gathered = preset == "fsdp" && world_size() > 1;
        const bool whole_copy = !gathered && gemm_reads_16bit(dtype);
        EXPECT_EQ(copies, w.sixteen_bit_copy_bytes);
        if (!gathered && !whole_copy) {
          EXPECT_EQ(copies, 0);
          EXPECT_EQ(models_with_copies, 0);
        } else if (dtype != Dtype::fp32) {
          EXPECT_EQ(models_with_copies, 4);  // every weight
          EXPECT_GT(copies, 0);
        }
        // Where gemm()'s kernel reads 16 bits the weights stored whole reach the GEMMs as their
        // copies alone (no fp32 weight buffer): the bf16 total is at most fp32's, copies and all.
        if (whole_copy && !gemm_kernel_reads_16bit(dtype)) whole_copies = w.sixteen_bit_copy_bytes;
        EXPECT_GE(item, w.gathered_weight_bytes);
        EXPECT_LE(item, w.gathered_weight_bytes + 6 * 128);  // the scratch's empty Views' headers
        total[dtype] = run.planned_memory().kokkos_bytes();
      }
      if (world_rank() == 0) std::filesystem::remove_all(config.run.output_dir);
      MPI_Barrier(MPI_COMM_WORLD);
    }
    EXPECT_LE(total[Dtype::bf16] - whole_copies, total[Dtype::fp32])
        << preset << ": the bf16 plan against fp32's";
  }
}

TEST(MemoryPlan, AnAllocationThePlanDoesNotKnowIsNamedInTheWarning) {
  const int n = world_size();
  const int holder = n - 1;  // the one rank that allocates it
  RunConfig config = config_for("dp", run_dir("unplanned"));
  PlannedMemory planned;
  {
    TrainingRun probe(config);
    planned = probe.planned_memory();
  }
  // After the first step's log, the last rank holds a View larger than the plan's Kokkos bytes
  // and the warning's floor together, till the end of the run.
  const int64_t block_bytes = planned.kokkos_bytes() + TrainingRun::kOverPlanMinBytes;
  auto block = std::make_shared<Kokkos::View<char*>>();
  const Trained t = train(config, [&](const LogEvent& e) {
    if (e.step == 1 && world_rank() == holder) {
      *block = Kokkos::View<char*>("test::unplanned_block", block_bytes);
    }
  });
  ASSERT_EQ(t.events.size(), 2u);
  for (const MemoryEvent& e : t.events) {
    SCOPED_TRACE(e.when);
    EXPECT_TRUE(e.over_plan);
    EXPECT_EQ(e.worst_rank, holder);
    EXPECT_GE(e.kokkos_peak_bytes[holder],
              block_bytes + planned.totals.parameter_bytes + planned.totals.optimizer_bytes);
    ASSERT_FALSE(e.largest.empty());
    EXPECT_EQ(e.largest.front().label, "test::unplanned_block");
    EXPECT_EQ(e.largest.front().plan_item, "");
    EXPECT_EQ(e.largest.front().bytes, block_bytes);
    const std::string warning = format_memory_warning(e);
    EXPECT_EQ(warning.rfind("rank " + std::to_string(holder) + "'s Kokkos allocations peaked at " +
                                format_bytes(e.kokkos_peak_bytes[holder]),
                            0),
              0u)
        << warning;
    EXPECT_NE(warning.find("the plan's " + format_bytes(planned.kokkos_bytes())), std::string::npos)
        << warning;
    EXPECT_NE(warning.find("'test::unplanned_block' " + format_bytes(block_bytes)),
              std::string::npos)
        << warning;
  }
  if (world_rank() == 0) {
    ASSERT_EQ(t.records.size(), 2u);
    EXPECT_EQ(t.records[0]["over_plan"], true);
    EXPECT_EQ(t.records[0]["largest_allocations"][0]["label"], "test::unplanned_block");
  }
  block.reset();
}

}  // namespace
}  // namespace meshtrain
