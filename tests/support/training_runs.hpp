#pragma once
// TrainingRun tests' shared set-up and checks: the small synthetic run they start from
// (synthetic_run_config), a residual_mlp in place of its MLP (use_residual_mlp), this rank's
// parameters copied to the host and compared bit for bit (copy_parameters, same_bits), and a
// resume that must continue the uninterrupted run bit for bit (expect_bit_identical_resume).

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "framework/train/config.hpp"
#include "run/training_run.hpp"

namespace meshtrain::testing {

// `name` (config.file) on mesh `axes` under `preset`'s rules with every layer allowed to split
// (min_sharding_size 0); 64 synthetic samples in batches of 16; AdamW. The tests set the model,
// the seed, the rate and the steps they need.
inline RunConfig synthetic_run_config(const std::string& name,
                                      std::vector<std::pair<std::string, int>> axes,
                                      const std::string& preset) {
  RunConfig config;
  config.file = name;
  config.mesh.axes = std::move(axes);
  config.partition.preset = preset;
  config.partition.min_sharding_size = 0;
  config.data.source = DataSource::synthetic;
  config.data.synthetic_samples = 64;
  config.data.batch_size = 16;
  config.optimizer.kind = OptimizerKind::adamw;
  return config;
}

// config's model made a residual_mlp (docs/models.md): inputs -> width, `depth` blocks of
// `hidden`, -> outputs, with `norm` and SwiGLU or not (model.sizes cleared; the activation
// stays the config's).
inline void use_residual_mlp(RunConfig& config, int64_t inputs, int64_t width, int64_t hidden,
                             int64_t depth, int64_t outputs, ModelNorm norm, bool swiglu) {
  config.model.kind = ModelKind::residual_mlp;
  config.model.sizes.clear();
  config.model.inputs = inputs;
  config.model.outputs = outputs;
  config.model.width = width;
  config.model.hidden = hidden;
  config.model.depth = depth;
  config.model.norm = norm;
  config.model.swiglu = swiglu;
}

// This rank's blocks of every parameter, copied to the host.
inline std::vector<std::vector<float>> copy_parameters(TrainingRun& run) {
  std::vector<std::vector<float>> copies;
  for (const ShardedTensor& p : run.model().parameters()) {
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p.local);
    copies.emplace_back(host.data(), host.data() + host.extent(0));
  }
  return copies;
}

// Bit for bit (memcmp, so -0 vs 0 or a changed NaN payload counts as a change).
inline bool same_bits(const std::vector<std::vector<float>>& a,
                      const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// Trains `config` save_at steps, saves, trains on to `steps`; a run resumed from that checkpoint
// must then take the same steps: every loss and the final parameters bit for bit.
// config.checkpoint.dir is a fresh directory. Collective over the run's ranks.
inline void expect_bit_identical_resume(RunConfig config, int save_at, int steps) {
  std::vector<double> losses;
  std::vector<std::vector<float>> final_params;
  {
    TrainingRun run(config);
    for (int s = 0; s < save_at; ++s) run.step();
    run.save();
    for (int s = save_at; s < steps; ++s) losses.push_back(run.step().loss);
    final_params = copy_parameters(run);
  }
  config.checkpoint.resume = true;
  TrainingRun resumed(config);
  ASSERT_TRUE(resumed.resumed_from().has_value());
  ASSERT_EQ(resumed.steps_done(), save_at);
  for (int s = save_at; s < steps; ++s) {
    EXPECT_EQ(resumed.step().loss, losses[s - save_at]) << "step " << s + 1;
  }
  EXPECT_TRUE(same_bits(copy_parameters(resumed), final_params));
}

}  // namespace meshtrain::testing
