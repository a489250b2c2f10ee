// The pass budget of the training step (issue 37, item 6): the Kokkos kernels, deep copies
// and fences of one steady-state step (step 3; steps 1 and 2 warm up) of two reference models,
// counted through Kokkos' tool callbacks (framework/observe/pass_counter.hpp), must not exceed
// the committed budget tests/train/pass_budget/<space>-<gemm>-np<N>.json (<gemm>: OpenBLAS,
// oneDNN-bf16 on a CPU with bf16 instructions, oneDNN-fp32 elsewhere). The models have the
// structure of 784-4096-4096-10 (an MLP of two hidden layers) and of a residual SwiGLU model
// (RMSNorm, gate and up projections, residual adds), at small widths: the number of passes
// does not depend on the widths. Each runs in fp32 and bf16 on dp, fsdp and tp over all
// ranks. A count above its budget fails, naming the model, dtype, mesh and the labels that
// grew; counts below it pass with a line suggesting to lower it. The budget file is written
// anew by
//   MESHTRAIN_UPDATE_BUDGET=1 ctest --test-dir build -R train_pass_budget
// (docs/testing.md). A missing file fails on the host builds whose budgets are committed
// (Serial on OpenBLAS, oneDNN-bf16 or oneDNN-fp32); another build (CUDA) skips, saying how to
// write one.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "framework/core/gemm.hpp"
#include "framework/observe/pass_counter.hpp"
#include "framework/observe/step_passes.hpp"
#include "run/training_run.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

// 16 rows of 32 inputs with 8 classes.
Dataset small_data() {
  Dataset d;
  d.description = "the test's data";
  d.num_samples = 16;
  d.features = 32;
  d.inputs.resize(16 * 32);
  for (std::size_t i = 0; i < d.inputs.size(); ++i) d.inputs[i] = 0.01f * float(i % 37);
  d.num_classes = 8;
  d.labels.resize(16);
  for (int i = 0; i < 16; ++i) d.labels[i] = i % 8;
  return d;
}

struct ModelCase {
  std::string name;
  ModelSection model;
};

std::vector<ModelCase> reference_models() {
  ModelSection mlp;  // 784-4096-4096-10's structure
  mlp.kind = ModelKind::mlp;
  mlp.sizes = {32, 64, 64, 8};
  mlp.activation = Activation::relu;
  ModelSection swiglu;  // a residual SwiGLU model
  swiglu.kind = ModelKind::residual_mlp;
  swiglu.inputs = 32;
  swiglu.outputs = 8;
  swiglu.width = 16;
  swiglu.hidden = 24;
  swiglu.depth = 2;
  swiglu.norm = ModelNorm::rmsnorm;
  swiglu.swiglu = true;
  swiglu.activation = Activation::silu;
  return {{"mlp", mlp}, {"residual_swiglu", swiglu}};
}

// The passes of step 3 of `model` on `mesh` in `dtype`. (Not an allocation-free step: with a
// deep-copy callback installed, Kokkos 3.4 makes each copy's View labels into std::strings,
// a few heap blocks per copy; the counter itself allocates nothing, PassCounter below.)
RunConfig reference_config(const ModelSection& model, const testing::MeshCase& mesh, Dtype dtype) {
  RunConfig config;
  config.model = model;
  config.model.loss = LossKind::cross_entropy;
  config.mesh.axes = mesh.axes;
  config.partition.preset = mesh.preset;
  config.partition.min_sharding_size = 0;
  config.mixed_precision.param_dtype = dtype;
  config.mixed_precision.reduce_dtype = dtype;
  config.optimizer.kind = OptimizerKind::adamw;
  config.data.batch_size = 16;
  config.data.prefetch = 0;  // batches loaded in the step, on this thread: counts that repeat
  config.train.steps = 4;
  config.run.seed = 7;
  return config;
}

PassCounts steady_step_passes(const ModelSection& model, const testing::MeshCase& mesh,
                              Dtype dtype) {
  TrainingRun run(reference_config(model, mesh, dtype), {}, RunData{small_data(), Dataset{}});
  run.step();
  run.step();
  install_pass_counter();
  reset_pass_counts();
  run.step();
  PassCounts counts = pass_counts();
  uninstall_pass_counter();
  return counts;
}

// This build's budget file: the counts depend on the execution space and the GEMM library, and
// on oneDNN whether the CPU has bf16 instructions (its bf16 matmul reads 16-bit operands as they
// are: no widening passes; elsewhere the fp32 kernel, after them): oneDNN-bf16 or oneDNN-fp32.
std::string budget_path() {
  const std::string text = gemm_kernels();
  std::istringstream kernels(text);
  std::string gemm;
  kernels >> gemm;
  if (gemm == "oneDNN") {
    gemm += text.find("no AVX512_BF16") == std::string::npos ? "-bf16" : "-fp32";
  }
  return std::string(MESHTRAIN_PASS_BUDGET_DIR) + "/" + Kokkos::DefaultExecutionSpace::name() +
         "-" + gemm + "-np" + std::to_string(world_size()) + ".json";
}

// Whether this build's budget is one the repository commits (a missing file fails): a host
// build on OpenBLAS or oneDNN (either ISA: ONEDNN_MAX_CPU_ISA=AVX512_CORE writes and checks the
// fp32 one on a CPU with bf16 instructions, tests/passes.cmake). Others skip: a CUDA build's
// counts (other kernels, device fences) can only be written on a machine with a GPU.
bool budget_is_committed() {
  const std::string name = std::filesystem::path(budget_path()).filename().string();
  const std::string space = Kokkos::DefaultExecutionSpace::name();
  if (space != "Serial") return false;
  for (const char* gemm : {"OpenBLAS", "oneDNN-bf16", "oneDNN-fp32"}) {
    if (name.rfind(space + "-" + gemm + "-np", 0) == 0) return true;
  }
  return false;
}

const char* kRegenerate = "MESHTRAIN_UPDATE_BUDGET=1 ctest --test-dir build -R train_pass_budget";

// What the budget file keeps of a count: kernels, copies, fences and the labels' counts.
nlohmann::ordered_json budget_entry(const PassCounts& counts) {
  nlohmann::ordered_json entry = pass_counts_json(counts);
  entry.erase("copy_bytes");  // depends on the widths
  entry.erase("complete");
  return entry;
}

// The failure message (empty when within budget) for `measured` against `budget`, and the
// note when some total is below it.
std::string compare(const std::string& name, const PassCounts& measured, const PassCounts& budget,
                    std::string& below) {
  std::ostringstream out;
  const auto total = [&](const char* what, int64_t m, int64_t b) {
    if (m > b) out << " " << what << " " << m << " > " << b << ";";
    if (m < b)
      below += std::string(" ") + what + " " + std::to_string(m) + " < " + std::to_string(b) + ";";
  };
  total("kernels", measured.kernels, budget.kernels);
  total("copies", measured.copies, budget.copies);
  total("fences", measured.fences, budget.fences);
  if (out.str().empty()) return "";
  std::map<std::string, int64_t> allowed;
  for (const LabelPasses& l : budget.labels) allowed[pass_label_key(l)] = l.count;
  std::ostringstream labels;
  for (const LabelPasses& l : measured.labels) {
    const auto it = allowed.find(pass_label_key(l));
    const int64_t before = it == allowed.end() ? 0 : it->second;
    if (l.count > before) {
      labels << "\n    " << pass_label_key(l) << ": " << before << " -> " << l.count;
    }
  }
  return name + ": passes per step above the budget:" + out.str() +
         (labels.str().empty() ? "" : "\n  labels that grew:" + labels.str()) +
         "\n  (a change that means to add them rewrites the budget: " + kRegenerate + ")";
}

TEST(PassBudget, TheTrainingStepStaysWithinItsBudget) {
  const int n = world_size();
  const std::string path = budget_path();
  const char* update_env = std::getenv("MESHTRAIN_UPDATE_BUDGET");
  const bool update = update_env != nullptr && std::string(update_env) == "1";
  nlohmann::json budget;
  if (!update) {
    std::ifstream in(path);
    if (!in && budget_is_committed()) {
      FAIL() << "no pass budget '" << path << "' for " << gemm_kernels()
             << ", whose budget is committed: write it with " << kRegenerate;
    }
    if (!in) {
      GTEST_SKIP() << "no pass budget for this build ('" << path << "'): write it with "
                   << kRegenerate;
    }
    budget = nlohmann::json::parse(in);
  }
  nlohmann::ordered_json written;
  for (const ModelCase& model : reference_models()) {
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
      for (const testing::MeshCase& mesh : testing::one_axis_meshes(n)) {
        const std::string name =
            model.name + " " + to_string(dtype) + " " + mesh.preset + " np" + std::to_string(n);
        SCOPED_TRACE(name);
        const PassCounts measured = steady_step_passes(model.model, mesh, dtype);
        ASSERT_TRUE(measured.complete) << "more labels than the counter holds";
        EXPECT_GT(measured.kernels, 0) << "the counter saw no kernel: is it installed?";
        if (update) {
          written[name] = budget_entry(measured);
          continue;
        }
        if (!budget.contains(name)) {
          ADD_FAILURE() << name << ": not in the budget '" << path << "'; write it with "
                        << kRegenerate;
          continue;
        }
        const PassCounts allowed = pass_counts_from_json(budget[name]);
        std::string below;
        const std::string failure = compare(name, measured, allowed, below);
        EXPECT_TRUE(failure.empty()) << failure;
        if (!below.empty() && world_rank() == 0) {
          std::cout << name << ": fewer passes than the budget:" << below << " lower it with "
                    << kRegenerate << "\n";
        }
      }
    }
  }
  if (update && world_rank() == 0) {
    std::filesystem::create_directories(MESHTRAIN_PASS_BUDGET_DIR);
    std::ofstream out(path);
    out << written.dump(2) << "\n";
    ASSERT_TRUE(out.good()) << "cannot write '" << path << "'";
    std::cout << "wrote the pass budget '" << path << "'\n";
  }
}

// A traced run (steps 3 and 4) writes trace/passes.json, which trace-report prints: each
// traced step's totals equal those of the same step counted here, and the labels of step 4
// too; the counter is uninstalled after the window.
TEST(PassBudget, ATracedRunWritesEachStepsPasses) {
  const testing::MeshCase mesh = testing::one_axis_meshes(world_size())[1];  // fsdp
  const ModelCase model = reference_models()[1];
  const PassCounts expected = steady_step_passes(model.model, mesh, Dtype::bf16);
  const testing::TempDir dir(/*shared=*/true);
  RunConfig config = reference_config(model.model, mesh, Dtype::bf16);
  config.runtime.trace_first = 3;
  config.runtime.trace_last = 4;
  config.run.output_dir = dir.path();
  {
    TrainingRun run(config, {}, RunData{small_data(), Dataset{}});
    for (int s = 0; s < 4; ++s) run.step();
    EXPECT_FALSE(pass_counter_installed()) << "still counting after the trace window";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::optional<TracedPasses> passes = read_traced_passes(dir.path() + "/trace");
  ASSERT_TRUE(passes.has_value()) << "no trace/passes.json";
  EXPECT_EQ(passes->rank, 0);
  ASSERT_EQ(passes->steps.size(), 2u);
  for (const StepPasses& step : passes->steps) {
    SCOPED_TRACE("step " + std::to_string(step.step));
    EXPECT_EQ(step.totals.kernels, expected.kernels);
    EXPECT_EQ(step.totals.copies, expected.copies);
    EXPECT_EQ(step.totals.copy_bytes, expected.copy_bytes);
    EXPECT_EQ(step.totals.fences, expected.fences);
  }
  EXPECT_EQ(passes->steps[0].step, 3);
  EXPECT_EQ(passes->labels_step, 4);
  EXPECT_EQ(budget_entry(passes->labels), budget_entry(expected));
  std::ostringstream printed;
  print_traced_passes(*passes, printed);
  EXPECT_NE(printed.str().find("kernel  meshtrain::adamw_step"), std::string::npos)
      << printed.str();
}

// The counter itself: a known number of launches, copies and fences by label, counted while
// installed and not after; another tool's callback installed before it still sees each one.
int g_other_tool_kernels = 0;
void other_tool_kernel(const char*, uint32_t, uint64_t* id) {
  ++g_other_tool_kernels;
  *id = 0;
}

// Free functions: nvcc refuses a device lambda inside a TEST body (a private member).
void fill_with_index(Kokkos::View<float*> v, const std::string& label, float scale) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<>(0, v.extent(0)), KOKKOS_LAMBDA(int j) { v(j) = scale * j; });
}
float sum_of(Kokkos::View<float*> v) {
  float sum = 0;
  Kokkos::parallel_reduce(
      "pass_test_sum", Kokkos::RangePolicy<>(0, v.extent(0)),
      KOKKOS_LAMBDA(int j, float& s) { s += v(j); }, sum);
  return sum;
}

TEST(PassCounter, CountsKernelsCopiesAndFencesByLabel) {
  Kokkos::View<float*> a("pass_test_a", 100), b("pass_test_b", 100);
  Kokkos::Tools::Experimental::set_begin_parallel_for_callback(&other_tool_kernel);
  g_other_tool_kernels = 0;
  install_pass_counter();
  EXPECT_TRUE(pass_counter_installed());
  reset_pass_counts();
  const std::string fill = "pass_test_fill";
  // Labels within the small-string buffer: what Kokkos allocates to pass a longer one to
  // the callbacks (a deep copy's View label) is not the counter's.
  testing::AllocationWindow window;
  for (int i = 0; i < 3; ++i) fill_with_index(a, fill, 1.0f);
  const float sum = sum_of(a);
  Kokkos::deep_copy(b, a);
  Kokkos::deep_copy(b, a);
  EXPECT_EQ(window.close(), 0) << "counting allocated on the heap";
  const PassCounts counts = pass_counts();
  EXPECT_EQ(sum, 4950.0f);
  EXPECT_EQ(counts.kernels, 4);
  EXPECT_EQ(counts.copies, 2);
  EXPECT_EQ(counts.copy_bytes, 2 * 100 * int64_t(sizeof(float)));
  EXPECT_EQ(g_other_tool_kernels, 3) << "the callback set before the counter was dropped";
  std::map<std::string, int64_t> by_label;
  for (const LabelPasses& l : counts.labels) by_label[pass_label_key(l)] = l.count;
  EXPECT_EQ(by_label["kernel pass_test_fill"], 3);
  EXPECT_EQ(by_label["kernel pass_test_sum"], 1);
  EXPECT_EQ(by_label["copy pass_test_b <- pass_test_a"], 2);
  uninstall_pass_counter();
  EXPECT_FALSE(pass_counter_installed());
  fill_with_index(a, fill, 0.0f);
  EXPECT_EQ(pass_counts().kernels, 4) << "counted after it was uninstalled";
  EXPECT_EQ(g_other_tool_kernels, 4) << "the other tool's callback was not put back";
  Kokkos::Tools::Experimental::set_begin_parallel_for_callback(nullptr);
}

}  // namespace
}  // namespace meshtrain
