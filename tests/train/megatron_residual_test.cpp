// residual_mlp under the tp presets (Megatron's pair: the blocks' up and gate projections
// column-parallel, down row-parallel; partition/rules.hpp) through TrainingRun, with adamw:
// - a checkpoint written on a tp mesh (tp = n; at np 4 also fsdp 2 x tp 2, at np 8 fsdp 2 x
//   tp 4) resumes bit for bit on the same mesh: the next steps' losses and the final
//   parameters equal the uninterrupted run's exactly;
// - it loads across a mesh change (tp -> dp and dp -> tp): the resumed run's losses equal the
//   uninterrupted run's to 1e-5 relative (meshes compute the same function to float
//   tolerance; measured differences are below 1e-6).
// - the blocks' Linear layers are built with the column-/row-parallel pair (their layouts).
// SwiGLU with rmsnorm and relu with layernorm; widths divide by 4.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "layers/linear.hpp"
#include "layers/residual_block.hpp"
#include "layers/swiglu.hpp"
#include "run/training_run.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using Axes = std::vector<std::pair<std::string, int>>;

RunConfig residual_config(const std::string& preset, const Axes& axes, bool swiglu) {
  RunConfig config = testing::synthetic_run_config("megatron_residual_test", axes, preset);
  config.run.seed = 11;
  testing::use_residual_mlp(config, /*inputs=*/8, /*width=*/16, /*hidden=*/32, /*depth=*/2,
                            /*outputs=*/4, swiglu ? ModelNorm::rmsnorm : ModelNorm::layernorm,
                            swiglu);
  config.model.activation = swiglu ? Activation::silu : Activation::relu;
  config.optimizer.lr = 1e-2;
  config.train.steps = 6;
  return config;
}

std::vector<std::pair<std::string, Axes>> tp_meshes() {
  const int n = world_size();
  std::vector<std::pair<std::string, Axes>> cases = {{"tp", {{"tp", n}}}};
  if (n == 4) cases.push_back({"fsdp_tp", {{"fsdp", 2}, {"tp", 2}}});
  if (n == 8) cases.push_back({"fsdp_tp", {{"fsdp", 2}, {"tp", 4}}});
  return cases;
}

// The layouts the blocks' Linear layers were built with (Linear::layout(), what forward and
// backward run), both halves of the pair: the up half (SwiGLU's gate and up, or the up
// projection) column-parallel over tp, fed the split residual stream (gathered inside its
// collective matmuls, or once for both by the SwiGLU) and leaving its hidden features split;
// the down projection row-parallel (its weight's rows split over tp, TP in the plan), taking
// those split features and returning the residual stream split as it came. SwiGLU and plain
// blocks, every tp mesh.
TEST(MegatronResidual, UsesTheColumnRowPairUnderTp) {
  if (world_size() == 1) GTEST_SKIP() << "one rank: no feature axis to split";
  for (const auto& [preset, axes] : tp_meshes()) {
    for (const bool swiglu : {true, false}) {
      SCOPED_TRACE(preset + (swiglu ? " swiglu" : " relu"));
      TrainingRun run(residual_config(preset, axes, swiglu));
      int tp = 1;
      for (const auto& [axis, size] : axes)
        if (axis == "tp") tp = size;
      int blocks = 0;
      for (const Layer* layer : run.model().sequence()) {
        const auto* block = dynamic_cast<const ResidualBlock*>(layer);
        if (block == nullptr) continue;
        ++blocks;
        // The block's Linear layers in order: the up half, then the down projection.
        std::vector<const Linear*> linears;
        for (const auto& inner : block->layers()) {
          if (const auto* gated = dynamic_cast<const SwiGlu*>(inner.get())) {
            linears.push_back(&gated->gate());
            linears.push_back(&gated->up());
          } else if (const auto* linear = dynamic_cast<const Linear*>(inner.get())) {
            linears.push_back(linear);
          }
        }
        ASSERT_EQ(linears.size(), swiglu ? 3u : 2u) << "block " << blocks - 1;
        for (size_t k = 0; k + 1 < linears.size(); ++k) {
          const LinearLayout& up = linears[k]->layout();
          SCOPED_TRACE(up.layer);
          EXPECT_TRUE(up.column_parallel);
          EXPECT_FALSE(up.tensor_parallel);
          EXPECT_EQ(up.feature_axis, "tp");
          EXPECT_EQ(up.tp, tp);
          if (swiglu) {
            // The SwiGLU gathers the split stream once for gate and up (shares_input_gather):
            // each sees it whole and leaves a partial input gradient, summed and
            // reduce-scattered once.
            EXPECT_EQ(up.input_layout, FeatureLayout::replicated);
            EXPECT_TRUE(up.input_grad_partial);
          } else {
            EXPECT_TRUE(up.column_gathers_input()) << "fed the split residual stream";
          }
          EXPECT_EQ(up.out_local, up.out / tp);
          EXPECT_EQ(up.output_layout(), FeatureLayout::split);
        }
        const LinearLayout& down = linears.back()->layout();
        SCOPED_TRACE(down.layer);
        EXPECT_TRUE(down.tensor_parallel) << "row-parallel";
        EXPECT_FALSE(down.column_parallel);
        EXPECT_EQ(down.tp, tp);
        EXPECT_EQ(down.input_layout, FeatureLayout::split);
        EXPECT_EQ(down.in_compute, down.in / tp);
        EXPECT_EQ(down.output_layout(), block->output_layout());
        EXPECT_EQ(block->output_layout(), FeatureLayout::split);
      }
      EXPECT_EQ(blocks, 2);
    }
  }
}

TEST(MegatronResidual, ResumeIsBitIdenticalOnTheSameMesh) {
  for (bool swiglu : {true, false}) {
    for (const auto& [preset, axes] : tp_meshes()) {
      SCOPED_TRACE(preset + (swiglu ? " swiglu" : " relu"));
      const testing::TempDir tmp(/*shared=*/true, "meshtrain_megatron_resume");
      const std::string& dir = tmp.path();
      RunConfig config = residual_config(preset, axes, swiglu);
      config.checkpoint.dir = dir;
      testing::expect_bit_identical_resume(config, /*save_at=*/3, /*steps=*/6);
    }
  }
}

TEST(MegatronResidual, CheckpointLoadsAcrossAMeshChange) {
  const int n = world_size();
  const Axes tp = {{"tp", n}}, dp = {{"dp", n}};
  struct Change {
    std::string from_preset;
    Axes from;
    std::string to_preset;
    Axes to;
  };
  for (const Change& c : {Change{"tp", tp, "dp", dp}, Change{"dp", dp, "tp", tp}}) {
    SCOPED_TRACE(c.from_preset + " -> " + c.to_preset);
    const testing::TempDir tmp(/*shared=*/true, "meshtrain_megatron_reshard");
    const std::string& dir = tmp.path();
    RunConfig config = residual_config(c.from_preset, c.from, true);
    config.checkpoint.dir = dir;
    std::vector<double> losses;
    {
      TrainingRun run(config);
      for (int s = 0; s < 3; ++s) run.step();
      run.save();
      for (int s = 3; s < 6; ++s) losses.push_back(run.step().loss);
    }
    RunConfig moved = residual_config(c.to_preset, c.to, true);
    moved.checkpoint.dir = dir;
    moved.checkpoint.resume = true;
    TrainingRun resumed(moved);
    ASSERT_TRUE(resumed.resumed_from().has_value());
    ASSERT_EQ(resumed.steps_done(), 3);
    for (int s = 3; s < 6; ++s) {
      EXPECT_NEAR(resumed.step().loss, losses[s - 3], 1e-5 * (1 + std::abs(losses[s - 3])))
          << "step " << s + 1;
    }
  }
}

}  // namespace
}  // namespace meshtrain
