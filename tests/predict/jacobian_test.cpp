// Predictor::jacobian (docs/derivatives.md) on every mesh the world allows: dp, fsdp, tp,
// fsdp x tp, and ep for the MoE models. Small regression models (an MLP, residual_mlps with
// LayerNorm + SiLU (widths 8 and 40), RMSNorm + SwiGLU and RMSNorm + SiLU + dropout, an MoE MLP
// and an MoE residual block) are trained two
// steps on dp with standardized inputs and targets, saved, and differentiated on each mesh in
// both modes. Checked, on 37 rows (not a multiple of the batch of 16, inputs at scales 1e-3 to
// 1e3):
//   1. forward mode (tangents) equals reverse mode (cotangents): two independent paths
//      through every layer, to 1e-5 of the largest |J| in normalized units;
//   2. every mesh equals a single-rank Predictor on MPI_COMM_SELF, computed in the same test;
//   3. the dense models equal central differences of predict() (float32: step 1e-2 input
//      standard deviations, 2e-3 of the largest normalized |J|; the float64 comparisons are
//      tests/predict/jacobian_test.py's);
//   4. several passes of each mode (limit_jacobian_directions) equal one (also a width-40
//      LayerNorm model with 5 outputs on dp, the norm cotangents' groups of 1 to 4 directions);
//   5. no allocation in jacobian() after the first call of each mode;
//   6. the automatic mode's choice, J in host LayoutLeft double and in device memory, a
//      partial batch, and the refusals (J's shape, mixed precision, the mode's name).
// Normalized units: J' = J * input_std / target_std, the model's own derivative, whose
// float32 rounding scales with its largest entries.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "layers/inference.hpp"
#include "run/predictor.hpp"
#include "run/training_run.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kRows = 37;   // rows differentiated (not a multiple of kBatch)
constexpr int64_t kBatch = 16;  // global rows per call (every world size divides it)

struct ModelCase {
  const char* name;
  ModelSection model;
  bool moe = false;
};

std::vector<ModelCase> model_cases() {
  std::vector<ModelCase> cases;
  ModelSection mlp;
  mlp.sizes = {5, 16, 12, 3};
  mlp.activation = Activation::gelu;
  cases.push_back({"mlp_gelu", mlp});

  ModelSection residual;
  residual.kind = ModelKind::residual_mlp;
  residual.inputs = 6;
  residual.outputs = 2;
  residual.width = 8;
  residual.hidden = 12;
  residual.depth = 2;
  residual.norm = ModelNorm::layernorm;
  residual.activation = Activation::silu;
  cases.push_back({"residual_layernorm_silu", residual});

  ModelSection swiglu = residual;
  swiglu.inputs = 3;
  swiglu.outputs = 4;  // fewer inputs than outputs: automatic is forward mode
  swiglu.norm = ModelNorm::rmsnorm;
  swiglu.swiglu = true;
  cases.push_back({"residual_rmsnorm_swiglu", swiglu});

  ModelSection moe = mlp;
  moe.activation = Activation::tanh;
  moe.moe_layers = {1};
  moe.experts = 4;
  moe.top_k = 2;
  cases.push_back({"moe_mlp", moe, true});

  ModelSection residual_moe = residual;
  residual_moe.norm = ModelNorm::rmsnorm;
  residual_moe.moe_layers = {1};
  residual_moe.experts = 4;
  residual_moe.top_k = 2;
  cases.push_back({"moe_residual", residual_moe, true});

  // Width 40: the reverse pass's one-pass norm cotangents (layers/norm.cpp) run their 16-lane
  // loop twice and the tail for 8 columns per row (width 8 above runs the tail alone).
  ModelSection wide = residual;
  wide.width = 40;
  wide.hidden = 48;
  wide.depth = 1;
  cases.push_back({"residual_layernorm_silu_wide", wide});

  // Dropout in training, the identity here (the Predictor's forward is not a training one).
  ModelSection dropout = residual;
  dropout.norm = ModelNorm::rmsnorm;
  dropout.dropout = 0.1;
  cases.push_back({"residual_rmsnorm_silu_dropout", dropout});
  return cases;
}

// x[s, c] = scale_c (2 sin(0.37 s + 1.3 c) + 0.3 c): varied rows, features at scales 1e-3 to 1e3.
double input_scale(int64_t c) {
  static const double scales[] = {1e-3, 1.0, 1e3, 0.05, 20.0, 3.0};
  return scales[c % 6];
}
std::vector<float> inputs(int64_t rows, int64_t features) {
  std::vector<float> x(static_cast<size_t>(rows * features));
  for (int64_t s = 0; s < rows; ++s) {
    for (int64_t c = 0; c < features; ++c) {
      x[s * features + c] =
          static_cast<float>(input_scale(c) * (2.0 * std::sin(0.37 * s + 1.3 * c) + 0.3 * c));
    }
  }
  return x;
}

// Smooth targets of the inputs (in normalized units, scaled per output).
Dataset training_rows(const ModelSection& model, int64_t n) {
  const int64_t in = model.input_width(), out = model.output_width();
  Dataset d;
  d.description = "jacobian test rows";
  d.num_samples = n;
  d.features = in;
  d.target_width = out;
  d.inputs = inputs(n, in);
  d.targets.resize(static_cast<size_t>(n * out));
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = 0.0;
      for (int64_t c = 0; c < in; ++c) {
        sum += std::sin((1 + o + c) * d.inputs[s * in + c] / input_scale(c));
      }
      d.targets[s * out + o] = static_cast<float>((1.0 + 10.0 * o) * sum + 0.5 * o);
    }
  }
  return d;
}

// Trains the model two steps on dp = world, inputs and targets standardized; returns the
// checkpoint directory.
std::string train_checkpoint(const std::string& dir, const ModelCase& m) {
  RunConfig config;
  config.run.seed = 5;
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
  std::vector<MeshCase> cases = {
      {"dp", {}},
      {"fsdp", {"mesh.dp=1", "mesh.fsdp=-1", "partition.preset=fsdp"}},
      {"tp", {"mesh.dp=1", "mesh.tp=-1", "partition.preset=tp"}},
  };
  if (world_size() % 2 == 0) {
    cases.push_back(
        {"fsdp_tp", {"mesh.dp=1", "mesh.fsdp=-1", "mesh.tp=2", "partition.preset=fsdp_tp"}});
  }
  if (m.moe) cases.push_back({"ep", {"mesh.dp=1", "mesh.ep=-1", "partition.preset=dp"}});
  return cases;
}

// Whether this rank is the first of those holding its slice (tp partners hold the same rows).
bool first_of_slice(const Predictor& p, MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm slice_comm;
  MPI_Comm_split(comm, static_cast<int>(p.slice().index), rank, &slice_comm);
  int slice_rank = 0;
  MPI_Comm_rank(slice_comm, &slice_rank);
  MPI_Comm_free(&slice_comm);
  return slice_rank == 0;
}

// J of every row [kRows, outputs, inputs] (row-major) as every rank of `comm` sees it, and the
// outputs [kRows, outputs]; inputs as float64 host views in LayoutLeft, J as LayoutLeft doubles.
struct AllRows {
  std::vector<double> jacobian, outputs;
};

AllRows jacobian_all(Predictor& p, const std::vector<float>& x, JacobianMode mode,
                     MPI_Comm comm = MPI_COMM_WORLD) {
  const int64_t in = p.inputs(), out = p.outputs();
  AllRows all;
  all.jacobian.assign(static_cast<size_t>(kRows * out * in), 0.0);
  all.outputs.assign(static_cast<size_t>(kRows * out), 0.0);
  const bool contributes = first_of_slice(p, comm);
  for (int64_t b = 0; b * p.batch_size() < kRows; ++b) {
    const int64_t first = b * p.batch_size() + p.slice().begin();
    const int64_t rows = std::clamp<int64_t>(kRows - first, 0, p.local_rows());
    Kokkos::View<double**, Kokkos::LayoutLeft, Kokkos::HostSpace> xs("x", rows, in);
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t c = 0; c < in; ++c) xs(s, c) = x[(first + s) * in + c];
    }
    Kokkos::View<double***, Kokkos::LayoutLeft, Kokkos::HostSpace> js("J", rows + 1, out, in);
    const Prediction pr = p.jacobian(xs, js, mode);
    EXPECT_EQ(pr.rows, rows);
    Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> ys("y", rows, out);
    Kokkos::deep_copy(ys, pr.outputs);
    if (!contributes) continue;
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t o = 0; o < out; ++o) {
        all.outputs[(first + s) * out + o] = ys(s, o);
        for (int64_t c = 0; c < in; ++c) {
          all.jacobian[((first + s) * out + o) * in + c] = js(s, o, c);
        }
      }
    }
  }
  for (std::vector<double>* v : {&all.jacobian, &all.outputs}) {
    MPI_Allreduce(MPI_IN_PLACE, v->data(), static_cast<int>(v->size()), MPI_DOUBLE, MPI_SUM, comm);
  }
  return all;
}

// J' = J * input_std / target_std (the model's own derivative).
std::vector<double> normalized(const Predictor& p, std::vector<double> j) {
  const int64_t in = p.inputs(), out = p.outputs();
  const Normalization& n = p.normalization();
  for (int64_t s = 0; s < kRows; ++s) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t c = 0; c < in; ++c) {
        j[(s * out + o) * in + c] *= n.input_std[c] / n.target_std[o];
      }
    }
  }
  return j;
}

// |got - want| <= tolerance x the largest |want|, for each value.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 0.0) << what << ": the reference is all zeros";
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= tolerance * scale) && reported++ < 5) {
      ADD_FAILURE() << what << ": value " << i << " is " << got[i] << ", expected " << want[i]
                    << " (tolerance " << tolerance * scale << ")";
    }
  }
}

// The outputs of every row through predict() [kRows, outputs], as every rank sees them.
std::vector<double> predict_all(Predictor& p, const std::vector<float>& x) {
  const int64_t in = p.inputs(), out = p.outputs();
  std::vector<double> all(static_cast<size_t>(kRows * out), 0.0);
  const bool contributes = first_of_slice(p, MPI_COMM_WORLD);
  for (int64_t b = 0; b * p.batch_size() < kRows; ++b) {
    const int64_t first = b * p.batch_size() + p.slice().begin();
    const int64_t rows = std::clamp<int64_t>(kRows - first, 0, p.local_rows());
    Kokkos::View<float**, Kokkos::HostSpace> xs("x", rows, in), ys("y", rows, out);
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t c = 0; c < in; ++c) xs(s, c) = x[(first + s) * in + c];
    }
    p.predict(xs, ys);
    if (!contributes) continue;
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t o = 0; o < out; ++o) all[(first + s) * out + o] = ys(s, o);
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, all.data(), static_cast<int>(all.size()), MPI_DOUBLE, MPI_SUM,
                MPI_COMM_WORLD);
  return all;
}

// Central differences of predict() in float32, in normalized units: steps of `h` input
// standard deviations.
std::vector<double> central_differences(Predictor& p, const std::vector<float>& x, double h) {
  const int64_t in = p.inputs(), out = p.outputs();
  const Normalization& n = p.normalization();
  std::vector<double> j(static_cast<size_t>(kRows * out * in), 0.0);
  for (int64_t c = 0; c < in; ++c) {
    const double step = h * n.input_std[c];
    std::vector<double> up, down;
    for (double sign : {1.0, -1.0}) {
      std::vector<float> moved = x;
      for (int64_t s = 0; s < kRows; ++s) {
        moved[s * in + c] = static_cast<float>(x[s * in + c] + sign * step);
      }
      // The step as float32 made it: the difference of the inputs actually used.
      (sign > 0 ? up : down) = predict_all(p, moved);
    }
    for (int64_t s = 0; s < kRows; ++s) {
      const double used = static_cast<double>(static_cast<float>(x[s * in + c] + step)) -
                          static_cast<double>(static_cast<float>(x[s * in + c] - step));
      for (int64_t o = 0; o < out; ++o) {
        j[(s * out + o) * in + c] =
            (up[s * out + o] - down[s * out + o]) / used * n.input_std[c] / n.target_std[o];
      }
    }
  }
  return j;
}

class JacobianTest : public ::testing::Test {
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
TempDir* JacobianTest::dir_ = nullptr;
std::vector<std::string> JacobianTest::checkpoints_;

TEST_F(JacobianTest, ModesMeshesAndCentralDifferencesAgree) {
  const std::vector<ModelCase> cases = model_cases();
  for (size_t k = 0; k < cases.size(); ++k) {
    const ModelCase& m = cases[k];
    const std::vector<float> x = inputs(kRows, m.model.input_width());
    // The single-rank reference, on every rank alone.
    std::vector<double> single;
    {
      Predictor p(checkpoints_[k], kBatch, {}, MPI_COMM_SELF);
      ASSERT_TRUE(p.normalization().inputs() && p.normalization().targets()) << m.name;
      single = normalized(p, jacobian_all(p, x, JacobianMode::reverse, MPI_COMM_SELF).jacobian);
    }
    for (const MeshCase& mesh : mesh_cases(m)) {
      const std::string what = std::string(m.name) + " on " + mesh.name;
      SCOPED_TRACE(what);
      Predictor p(checkpoints_[k], kBatch, mesh.overrides);
      const std::vector<double> forward =
          normalized(p, jacobian_all(p, x, JacobianMode::forward).jacobian);
      const std::vector<double> reverse =
          normalized(p, jacobian_all(p, x, JacobianMode::reverse).jacobian);
      expect_close(forward, reverse, 1e-5, what + ": forward mode against reverse mode");
      expect_close(forward, single, 1e-5, what + ": against one rank");
      if (!m.moe && mesh.name == "dp") {  // routing may switch inside a step: not for MoE
        expect_close(forward, central_differences(p, x, 1e-2), 2e-3,
                     what + ": against central differences of predict()");
      }
    }
  }
}

// limit_jacobian_directions(k): ceil(inputs / k) forward passes, ceil(outputs / k) reverse
// passes, give the one-pass Jacobian.
TEST_F(JacobianTest, SeveralPassesEqualOne) {
  const ModelCase m = model_cases()[2];  // 3 inputs, 4 outputs
  const std::vector<float> x = inputs(kRows, m.model.input_width());
  Predictor whole(checkpoints_[2], kBatch);
  EXPECT_EQ(whole.jacobian_directions(JacobianMode::forward), 3);
  EXPECT_EQ(whole.jacobian_directions(JacobianMode::reverse), 4);
  const std::vector<double> once = jacobian_all(whole, x, JacobianMode::forward).jacobian;
  for (JacobianMode mode : {JacobianMode::forward, JacobianMode::reverse}) {
    for (int64_t k : {1, 2}) {
      SCOPED_TRACE(std::string(to_string(mode)) + ", " + std::to_string(k) + " per pass");
      Predictor p(checkpoints_[2], kBatch, {"mesh.dp=1", "mesh.tp=-1", "partition.preset=tp"});
      p.limit_jacobian_directions(k);
      EXPECT_EQ(p.jacobian_directions(mode), k);
      expect_close(jacobian_all(p, x, mode).jacobian, once, 1e-5, "several passes");
      testing::expect_bad_input([&] { p.limit_jacobian_directions(3); },
                                {"limit_jacobian_directions", "after the first"});
    }
  }
}

// The one-pass norm cotangents with x_hat kept (layers/norm.cpp, norm_cotangent_kept_host: on
// host kernels, fp32, whole rows, so dp) take a row's directions in groups of up to 4
// (norm_cotangent_group<G>). A width-40 LayerNorm residual_mlp (the 16-lane loop twice and an
// 8-column tail) with 5 outputs: one reverse pass runs groups of 4 then 1,
// limit_jacobian_directions(1) groups of 1, (3) groups of 3 then 2. Each direction's norm sums
// are the same 16 partial sums in the same order whatever G, but the GEMMs' kernels for another
// row count (local rows x directions) may sum in another order: measured here equal bit for bit
// at np 1, and up to 2.1e-7 of the largest |J'| at np 2 and 4. So in normalized units within
// 1e-5 of the largest |J'|, the tolerance of forward against reverse mode.
TEST_F(JacobianTest, GroupsOfDirectionsEqualOnePass) {
  ModelCase m = model_cases()[5];  // residual_layernorm_silu_wide: width 40
  ASSERT_EQ(m.model.width, 40);
  m.name = "residual_layernorm_silu_wide_5_outputs";
  m.model.outputs = 5;
  const std::string checkpoint = train_checkpoint(dir_->path(), m);
  const std::vector<float> x = inputs(kRows, m.model.input_width());
  Predictor whole(checkpoint, kBatch);
  ASSERT_EQ(whole.jacobian_directions(JacobianMode::reverse), 5);
  const std::vector<double> once =
      normalized(whole, jacobian_all(whole, x, JacobianMode::reverse).jacobian);
  for (int64_t k : {1, 3}) {
    SCOPED_TRACE(std::to_string(k) + " directions a pass");
    Predictor p(checkpoint, kBatch);
    p.limit_jacobian_directions(k);
    EXPECT_EQ(p.jacobian_directions(JacobianMode::reverse), k);
    const std::vector<double> passes =
        normalized(p, jacobian_all(p, x, JacobianMode::reverse).jacobian);
    expect_close(passes, once, 1e-5, "several passes against one");
  }
}

TEST_F(JacobianTest, AutomaticModeFollowsTheShape) {
  const std::vector<ModelCase> cases = model_cases();
  for (size_t k = 0; k < cases.size(); ++k) {
    Predictor p(checkpoints_[k], kBatch);
    EXPECT_EQ(p.jacobian_mode(),
              p.inputs() <= p.outputs() ? JacobianMode::forward : JacobianMode::reverse)
        << cases[k].name;
    EXPECT_EQ(p.jacobian_mode(JacobianMode::forward), JacobianMode::forward);
  }
  EXPECT_EQ(Predictor(checkpoints_[2], kBatch).jacobian_mode(), JacobianMode::forward);  // 3 -> 4
  EXPECT_EQ(Predictor(checkpoints_[0], kBatch).jacobian_mode(), JacobianMode::reverse);  // 5 -> 3
}

TEST_F(JacobianTest, AllocatesNothingPerCall) {
  for (size_t k : {size_t{1}, size_t{4}}) {  // a residual_mlp, an MoE residual_mlp
    const ModelCase m = model_cases()[k];
    for (const MeshCase& mesh : mesh_cases(m)) {
      for (JacobianMode mode : {JacobianMode::forward, JacobianMode::reverse}) {
        SCOPED_TRACE(std::string(m.name) + " on " + mesh.name + ", " + to_string(mode));
        Predictor p(checkpoints_[k], kBatch, mesh.overrides);
        Kokkos::View<float**, Kokkos::HostSpace> host_x("x", p.local_rows(), p.inputs());
        Kokkos::View<double***, Kokkos::LayoutLeft, Kokkos::HostSpace> host_j(
            "J", p.local_rows(), p.outputs(), p.inputs());
        Matrix device_x("x", p.local_rows() - 1, p.inputs());  // a partial batch
        Kokkos::View<float***, Kokkos::LayoutRight> device_j("J", p.local_rows(), p.outputs(),
                                                             p.inputs());
        Kokkos::deep_copy(host_x, 0.5f);
        Kokkos::deep_copy(device_x, -0.25f);
        p.jacobian(host_x, host_j, mode);  // the first call makes the mode's buffers
        {
          // oneDNN's own blocks inside its executions (the GEMMs' library where the build has
          // it) counted apart, none kept (tests/support/onednn_allocations.hpp).
          testing::AllocationWindow window(testing::AllocationWindow::Threads::all,
                                           testing::AllocationWindow::OneDnn::left_out);
          p.jacobian(host_x, host_j, mode);
          p.jacobian(device_x, device_j, mode);
          EXPECT_EQ(window.close(), 0) << "heap allocations (oneDNN's blocks kept included) in "
                                          "two jacobian() calls";
          EXPECT_EQ(window.kokkos_allocations(), 0) << "Kokkos allocations in two jacobian() calls";
        }
        // The device and host results of the same rows agree.
        auto device_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), device_j);
        p.jacobian(host_x, host_j, mode);
        Kokkos::View<double***, Kokkos::LayoutLeft, Kokkos::HostSpace> again(
            "again", p.local_rows(), p.outputs(), p.inputs());
        p.jacobian(device_x, again, mode);
        for (int64_t s = 0; s + 1 < p.local_rows(); ++s) {
          for (int64_t o = 0; o < p.outputs(); ++o) {
            for (int64_t c = 0; c < p.inputs(); ++c) {
              ASSERT_EQ(static_cast<double>(device_host(s, o, c)), again(s, o, c));
            }
          }
        }
      }
    }
  }
}

// Reverse mode blocked over rows (set_jacobian_row_block; docs/derivatives.md, "Blocked reverse
// pass"): blocks of 1 and 3 rows (a partial last block) against one block of every row, in
// normalized units within 1e-5 of the largest |J'|, the tolerance of forward against reverse mode:
// the same float32 arithmetic per row but for the GEMMs, whose kernels for a few rows may sum in
// another order (measured: at most 2.8e-7 here, 0 at np 4); no allocation per call; a partial
// batch (the last of kRows) stops after its rows' blocks. Where a layer takes no blocks (a
// gathered weight under fsdp, tp, SwiGLU, MoE) one block is used: checked with blocks of 3
// asked. Models: the MLP, residual LayerNorm + SiLU, residual RMSNorm + SiLU + dropout (eval),
// SwiGLU and the MoE MLP (one block).
TEST_F(JacobianTest, BlockedReversePassEqualsOneBlock) {
  const std::vector<ModelCase> cases = model_cases();
  for (size_t k : {size_t{0}, size_t{1}, size_t{6}, size_t{2}, size_t{3}}) {
    const ModelCase& m = cases[k];
    const std::vector<float> x = inputs(kRows, m.model.input_width());
    for (const MeshCase& mesh : mesh_cases(m)) {
      const std::string what = std::string(m.name) + " on " + mesh.name;
      SCOPED_TRACE(what);
      Predictor whole(checkpoints_[k], kBatch, mesh.overrides);
      whole.set_jacobian_row_block(whole.local_rows());
      EXPECT_EQ(whole.jacobian_row_block(), whole.local_rows());
      const std::vector<double> once =
          normalized(whole, jacobian_all(whole, x, JacobianMode::reverse).jacobian);
      const bool blocks = inference::layers_run_host_kernels() && !m.model.swiglu && !m.moe &&
                          (mesh.name == "dp" || world_size() == 1);
      for (int64_t rows : blocks ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{3}) {
        Predictor p(checkpoints_[k], kBatch, mesh.overrides);
        p.set_jacobian_row_block(rows);
        const int64_t local = p.local_rows();
        const int64_t count = (local + rows - 1) / rows;  // blocks, evened out over the rows
        EXPECT_EQ(p.jacobian_row_block(), blocks ? (local + count - 1) / count : local)
            << rows << " rows a block asked";
        const std::vector<double> blocked =
            normalized(p, jacobian_all(p, x, JacobianMode::reverse).jacobian);
        expect_close(blocked, once, 1e-5,
                     what + ": blocks of " + std::to_string(rows) + " rows against one block");
        Kokkos::View<float**, Kokkos::HostSpace> host_x("x", local - 1, p.inputs());
        Kokkos::View<float***, Kokkos::HostSpace> host_j("J", local, p.outputs(), p.inputs());
        Kokkos::deep_copy(host_x, 0.5f);
        testing::AllocationWindow window(testing::AllocationWindow::Threads::all,
                                         testing::AllocationWindow::OneDnn::left_out);
        p.jacobian(host_x, host_j, JacobianMode::reverse);
        EXPECT_EQ(window.close(), 0) << "heap allocations in a blocked jacobian() call";
        EXPECT_EQ(window.kokkos_allocations(), 0);
      }
      if (k == 0 && mesh.name == "dp") {                       // mlp_gelu: 3 outputs
        Predictor p(checkpoints_[k], kBatch, mesh.overrides);  // passes of 2 and 1 outputs
        p.limit_jacobian_directions(2);
        p.set_jacobian_row_block(3);
        expect_close(normalized(p, jacobian_all(p, x, JacobianMode::reverse).jacobian), once, 1e-5,
                     what + ": blocks of 3 rows, 2 outputs a pass, against one block");
      }
    }
  }
  Predictor p(checkpoints_[0], kBatch);
  testing::expect_bad_input([&] { p.set_jacobian_row_block(-1); },
                            {"set_jacobian_row_block(-1)", "0 (automatic) or positive"});
}

// Mlp::backward_cotangents(dy, first_row, rows): [0, local rows) is the pass over every row,
// bit for bit, on a model that takes no block (SwiGLU), which refuses a smaller block; a model
// that takes blocks refuses rows <= 0 and blocks outside its rows. dy is one direction a row.
TEST_F(JacobianTest, CotangentBlocksOfTheModel) {
  {
    Predictor swiglu(checkpoints_[2], kBatch);
    swiglu.prepare_jacobian(JacobianMode::reverse);  // the forward, the cotangent buffers
    Mlp& model = swiglu.model();
    const int64_t n = swiglu.local_rows();
    EXPECT_FALSE(model.cotangents_by_rows());
    Matrix dy("dy", n, model.output_width());
    Kokkos::deep_copy(dy, 0.5f);
    Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> whole("whole", n,
                                                                        swiglu.inputs());
    Kokkos::deep_copy(whole, model.backward_cotangents(dy));
    const auto block = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(),
                                                           model.backward_cotangents(dy, 0, n));
    ASSERT_EQ(block.extent(0), whole.extent(0));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < swiglu.inputs(); ++c) ASSERT_EQ(block(r, c), whole(r, c));
    }
    if (n > 1) {
      testing::expect_bad_input(
          [&] { model.backward_cotangents(MatrixView(dy.data(), n - 1, dy.extent(1)), 1, n - 1); },
          {"Mlp::backward_cotangents", "takes its cotangents only for every row"});
    }
  }
  Predictor mlp(checkpoints_[0], kBatch);
  mlp.prepare_jacobian(JacobianMode::reverse);
  Mlp& model = mlp.model();
  const int64_t n = mlp.local_rows();
  EXPECT_EQ(model.cotangents_by_rows(), inference::layers_run_host_kernels());
  Matrix dy("dy", n, model.output_width());
  const MatrixView two(dy.data(), 2, dy.extent(1));
  testing::expect_bad_input([&] { model.backward_cotangents(two, n - 1, 2); },
                            {"Mlp::backward_cotangents", "not a block of the forward's"});
  testing::expect_bad_input([&] { model.backward_cotangents(two, -1, 2); },
                            {"Mlp::backward_cotangents", "not a block of the forward's"});
  testing::expect_bad_input([&] { model.backward_cotangents(two, 0, -2); },
                            {"Mlp::backward_cotangents", "not a block of the forward's"});
  testing::expect_bad_input([&] { model.backward_cotangents(two, 1, 0); },
                            {"Mlp::backward_cotangents", "not a block of the forward's"});
}

TEST_F(JacobianTest, RefusesBadShapesAndModes) {
  Predictor p(checkpoints_[0], kBatch);  // 5 inputs, 3 outputs
  Kokkos::View<float**, Kokkos::HostSpace> x("x", 2, p.inputs());
  Kokkos::View<float***, Kokkos::HostSpace> small("J", 1, 3, 5), wide("J", 2, 3, 6),
      tall("J", 2, 4, 5);
  for (const auto& j : {small, wide, tall}) {
    testing::expect_bad_input([&] { p.jacobian(x, j); },
                              {"Jacobian view is [", "2 rows of 3 outputs by 5 inputs"});
  }
  testing::expect_bad_input([&] { parse_jacobian_mode("backward", "--jacobian-mode"); },
                            {"--jacobian-mode", "'backward'", "auto, forward or reverse"});
  EXPECT_EQ(parse_jacobian_mode("reverse", "mode"), JacobianMode::reverse);
  testing::expect_bad_input([&] { p.limit_jacobian_directions(0); }, {"at least 1", "got 0"});
  Predictor bf16(checkpoints_[0], kBatch, {"mixed_precision.param_dtype=\"bf16\""});
  Kokkos::View<float***, Kokkos::HostSpace> j("J", 2, 3, 5);
  testing::expect_bad_input([&] { bf16.jacobian(x, j); }, {"fp32", "bf16", "mixed_precision"});
}

}  // namespace
}  // namespace meshtrain
