// The inference forward (Mlp::infer, layers/inference.hpp) that Predictor::predict runs,
// against the model's forward() that Predictor::jacobian runs for the prediction it returns,
// on the same checkpoint, mesh and rows: plain MLPs with every activation that has an
// inference kernel of its own (relu, silu, sigmoid) or falls back on the layers' formulas
// (tanh, gelu_erf), residual_mlps with LayerNorm + SiLU (widths past the kernels' 16-lane
// blocks, with a tail), RMSNorm + SwiGLU, no norm + relu, and an MoE block; on dp, fsdp, tp
// and fsdp x tp (tp: the layers that cannot fuse take forward() and a pass). Tolerance: 1e-5 x
// the largest |output| of the batch (tests/predict/predictor_test.cpp's against float64).
//
// The pass budget: one predict() call of a residual model launches at most one kernel per
// Linear layer (its bias, filled into C before the GEMM), one per activation, one per norm and
// predict's own three (the input's copy, its standardization, the outputs' de-normalization):
// no separate bias pass, no LayerNorm in four kernels, no residual add of its own. Counted
// through Kokkos' begin-kernel tool callbacks.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "run/predictor.hpp"
#include "run/training_run.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kBatch = 16;  // global rows per call (every world size divides it)

struct ModelCase {
  std::string name;
  ModelSection model;
  bool moe = false;
};

std::vector<ModelCase> model_cases() {
  std::vector<ModelCase> cases;
  for (Activation a : {Activation::relu, Activation::silu, Activation::sigmoid, Activation::tanh,
                       Activation::gelu_erf}) {
    ModelSection mlp;
    mlp.sizes = {5, 36, 20, 3};
    mlp.activation = a;
    cases.push_back({std::string("mlp_") + to_string(a), mlp});
  }
  ModelSection residual;
  residual.kind = ModelKind::residual_mlp;
  residual.inputs = 6;
  residual.outputs = 2;
  residual.width = 40;   // two 16-lane blocks and a tail of 8
  residual.hidden = 52;  // an odd number of 16-lane blocks, a tail of 4
  residual.depth = 2;
  residual.norm = ModelNorm::layernorm;
  residual.activation = Activation::silu;
  cases.push_back({"residual_layernorm_silu", residual});

  ModelSection swiglu = residual;
  swiglu.norm = ModelNorm::rmsnorm;
  swiglu.swiglu = true;
  cases.push_back({"residual_rmsnorm_swiglu", swiglu});

  ModelSection plain = residual;
  plain.norm = ModelNorm::none;
  plain.activation = Activation::relu;
  cases.push_back({"residual_relu_no_norm", plain});

  ModelSection moe = residual;
  moe.width = 8;
  moe.hidden = 12;
  moe.moe_layers = {1};
  moe.experts = 4;
  moe.top_k = 2;
  cases.push_back({"residual_moe", moe, true});
  return cases;
}

// x[s, c] = 2 sin(0.37 s + 1.3 c) + 0.3 c.
std::vector<float> inputs(int64_t rows, int64_t features) {
  std::vector<float> x(static_cast<size_t>(rows * features));
  for (int64_t s = 0; s < rows; ++s) {
    for (int64_t c = 0; c < features; ++c) {
      x[s * features + c] = static_cast<float>(2.0 * std::sin(0.37 * s + 1.3 * c) + 0.3 * c);
    }
  }
  return x;
}

Dataset training_rows(const ModelSection& model, int64_t n) {
  const int64_t in = model.input_width(), out = model.output_width();
  Dataset d;
  d.description = "inference test rows";
  d.num_samples = n;
  d.features = in;
  d.target_width = out;
  d.inputs = inputs(n, in);
  d.targets.resize(static_cast<size_t>(n * out));
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = 0.0;
      for (int64_t c = 0; c < in; ++c) sum += std::sin((1 + o + c) * d.inputs[s * in + c]);
      d.targets[s * out + o] = static_cast<float>((1.0 + 10.0 * o) * sum + 0.5 * o);
    }
  }
  return d;
}

// Trains the model two steps on dp = world (inputs and targets standardized, so that predict
// standardizes and de-normalizes); returns the checkpoint directory.
std::string train_checkpoint(const std::string& dir, const ModelCase& m) {
  RunConfig config;
  config.run.seed = 3;
  config.run.output_dir = dir + "/" + m.name;
  config.checkpoint.dir = config.run.output_dir + "/checkpoints";
  config.checkpoint.async = false;
  config.mesh.axes = {{"dp", -1}};
  if (m.moe) config.mesh.axes.push_back({"ep", 1});
  config.partition.preset = "dp";
  config.partition.min_sharding_size = 0;
  config.model = m.model;
  config.model.loss = LossKind::mse;
  config.data.batch_size = 8;
  config.data.normalize_inputs = Normalize::standard;
  config.data.normalize_targets = Normalize::standard;
  config.train.steps = 2;
  config.train.log_every = 100;
  config.optimizer.lr = 0.05;  // the parameters move from their initial values
  TrainingRun run(config, {}, RunData{training_rows(m.model, 32), Dataset{}});
  run.train();
  return config.checkpoint.dir;
}

struct MeshCase {
  std::string name;
  std::vector<std::string> overrides;
};

std::vector<MeshCase> mesh_cases(const ModelCase& m) {
  std::vector<MeshCase> cases = {{"dp", {}}};
  if (m.moe) {
    cases.push_back({"ep", {"mesh.dp=1", "mesh.ep=-1", "partition.preset=dp"}});
    return cases;
  }
  cases.push_back({"fsdp", {"mesh.dp=1", "mesh.fsdp=-1", "partition.preset=fsdp"}});
  cases.push_back({"tp", {"mesh.dp=1", "mesh.tp=-1", "partition.preset=tp"}});
  if (world_size() % 2 == 0) {
    cases.push_back(
        {"fsdp_tp", {"mesh.dp=1", "mesh.fsdp=-1", "mesh.tp=2", "partition.preset=fsdp_tp"}});
  }
  return cases;
}

using HostMatrix = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>;

// This rank's rows of one batch (a full one: the padding path is predictor_test's).
HostMatrix local_inputs(const Predictor& p) {
  const std::vector<float> x = inputs(p.batch_size(), p.inputs());
  HostMatrix xs("x", p.local_rows(), p.inputs());
  for (int64_t s = 0; s < p.local_rows(); ++s) {
    for (int64_t c = 0; c < p.inputs(); ++c) {
      xs(s, c) = x[(p.slice().begin() + s) * p.inputs() + c];
    }
  }
  return xs;
}

HostMatrix to_host(const Prediction& prediction, int64_t outputs) {
  HostMatrix host("outputs", prediction.rows, outputs);
  Kokkos::deep_copy(host, prediction.outputs);
  return host;
}

class InferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir(/*shared=*/true);
    for (const ModelCase& m : model_cases())
      checkpoints_.push_back(train_checkpoint(dir_->path(), m));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
    checkpoints_.clear();
  }
  static TempDir* dir_;
  static std::vector<std::string> checkpoints_;
};
TempDir* InferenceTest::dir_ = nullptr;
std::vector<std::string> InferenceTest::checkpoints_;

TEST_F(InferenceTest, PredictEqualsTheForwardOfTheDerivativesOnEveryMesh) {
  const std::vector<ModelCase> models = model_cases();
  for (size_t k = 0; k < models.size(); ++k) {
    for (const MeshCase& mesh : mesh_cases(models[k])) {
      const std::string what = models[k].name + " on " + mesh.name;
      SCOPED_TRACE(what);
      Predictor p(checkpoints_[k], kBatch, mesh.overrides);
      const HostMatrix x = local_inputs(p);
      const HostMatrix inferred = to_host(p.predict(x), p.outputs());
      Kokkos::View<float***, Kokkos::HostSpace> jacobian("J", p.local_rows(), p.outputs(),
                                                         p.inputs());
      const HostMatrix forward = to_host(p.jacobian(x, jacobian), p.outputs());
      double scale = 0.0, worst = 0.0;
      for (int64_t s = 0; s < p.local_rows(); ++s) {
        for (int64_t o = 0; o < p.outputs(); ++o) {
          scale = std::max(scale, std::abs(static_cast<double>(forward(s, o))));
          worst = std::max(worst, std::abs(static_cast<double>(inferred(s, o) - forward(s, o))));
        }
      }
      ASSERT_GT(scale, 0.0);
      EXPECT_LE(worst, 1e-5 * scale)
          << "largest |predict - forward| " << worst << " against the largest |output| " << scale;
    }
  }
}

std::atomic<int64_t> g_kernels{0};
void count_kernel(const char*, uint32_t, uint64_t*) {
  ++g_kernels;
}

TEST_F(InferenceTest, OneCallStaysInItsPassBudget) {
  const std::vector<ModelCase> models = model_cases();
  for (size_t k = 0; k < models.size(); ++k) {
    const ModelSection& model = models[k].model;
    if (model.kind != ModelKind::residual_mlp || models[k].moe || model.swiglu) continue;
    SCOPED_TRACE(models[k].name);
    Predictor p(checkpoints_[k], kBatch);
    const int64_t linears = 2 * model.depth + 2;
    const int64_t activations = model.depth;
    const int64_t norms = model.norm == ModelNorm::none ? 0 : model.depth + 1;
    const int64_t budget = linears + activations + norms + 3;
    const HostMatrix x = local_inputs(p);
    p.predict(x);
    g_kernels = 0;
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(count_kernel);
    Kokkos::Tools::Experimental::set_begin_parallel_reduce_callback(count_kernel);
    Kokkos::Tools::Experimental::set_begin_parallel_scan_callback(count_kernel);
    p.predict(x);
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(nullptr);
    Kokkos::Tools::Experimental::set_begin_parallel_reduce_callback(nullptr);
    Kokkos::Tools::Experimental::set_begin_parallel_scan_callback(nullptr);
    EXPECT_LE(g_kernels.load(), budget) << linears << " Linear layers, " << activations
                                        << " activations, " << norms << " norms and predict's 3";
  }
}

}  // namespace
}  // namespace meshtrain
