// Training on derivatives (Sobolev training, docs/derivatives.md): Mlp::backward_with_tangents
// with DerivativeLoss, the loss
//   L = mse(y, t) + lambda * mean over (rows, outputs, chosen inputs) of (dy_pred - dy_t)^2
// with dy_pred the Jacobian in the user's units (input_std and target_std != 1 here).
//
//   * GradientsMatchFloat64CentralDifferences (np 1): every parameter gradient of L, for every
//     activation of mlp (relu, tanh, gelu, gelu_erf, silu, sigmoid, none), against central
//     differences (h = 1e-6) of a float64 forward of L written here from docs/model_math.md
//     (plain loops, no layer code; its tangents use f' only, so the layers' f'' is checked too):
//     |got - fd| <= 2e-6 max |fd| per tensor (measured at most 3.5e-7); the loss within 1e-5
//     relative.
//   * EveryMeshEqualsOneRank (np 1, 2, 4): 3 SGD steps of the same model on dp, fsdp, tp and (np 4)
//     fsdp x tp and dp x tp, against the same steps on one rank (MPI_COMM_SELF) in the same test:
//     both losses and every gradient of every step within 1e-5 after dividing by the
//     tensor's largest |one| (measured at most 2.0e-6, the identity on fsdp x tp), and the
//     parameters after the steps; the step's passes allocate nothing (Kokkos allocations counted).
//     Each mesh twice: gradients reduced in backward_with_tangents, and left partial for
//     reduce_gradients() (reduce = false, as gradient accumulation runs it).
//   * SobolevTrainingFitsTheDerivatives (np 1): y = sin(x1) x2 on 32 points; the derivative loss
//     falls to below a tenth of its start, and the Jacobian error on 256 other points after
//     training is at most half of that of the same training with lambda = 0.
//   * Dropout (model.dropout 0.3): the same gradient check and mesh runs with the training
//     pass's mask, which the float64 reference draws from the same key (dropout_bits) and holds
//     fixed (a fixed diagonal map per row: value and tangents times the same mask and scale).
//   * Refusals: bf16 parameters are bad_input (dropout and MoE layers are accepted: MoE in
//     tests/layers/sobolev_moe_test.cpp).

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/context.hpp"
#include "layers/derivative_loss.hpp"
#include "layers/dropout.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/expect_close.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/reference_dropout.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::expect_close_scaled;
using testing::rows_of;
using testing::Tensor;

constexpr int64_t kRows = 16;  // global batch (divides by 1, 2, 4)
const std::vector<int64_t> kSizes = {3, 16, 12, 2};
const std::vector<int64_t> kChosen = {0, 2};  // k = 2 of the 3 input columns
const std::vector<double> kInputStd = {0.5, 2.0, 1.5};
const std::vector<double> kTargetStd = {3.0, 0.25};
constexpr double kLambda = 0.7;
constexpr uint64_t kSeed = 7;

const std::vector<Activation> kActivations = {
    Activation::relu, Activation::tanh,    Activation::gelu, Activation::gelu_erf,
    Activation::silu, Activation::sigmoid, Activation::none};
constexpr double kDropout = 0.3;  // the dropout cases' rate

// The training pass of step `step` on the rank whose first global row is `first_row`.
TrainingPass training_pass(int step, int64_t first_row) {
  return {kSeed, step, /*micro_batch=*/0, first_row};
}
// What dropout multiplies element (global row, feature) of hidden layer (block) `layer` by in
// step 0's training pass (tests/support/reference_dropout.hpp).
double dropout_factor(double rate, int64_t row, int64_t feature, int64_t layer) {
  return testing::dropout_factor(kSeed, rate, row, feature, layer);
}

// The global batch: x [rows, in], t [rows, out], dy_t [rows, out, k].
struct Batch {
  Tensor x, t, dyt;
};
Batch make_batch(int64_t rows, int64_t k, int step) {
  const int64_t in = kSizes.front(), out = kSizes.back();
  const uint64_t s = kSeed + 100 * static_cast<uint64_t>(step);
  Batch b;
  for (int64_t i = 0; i < rows * in; ++i) b.x.push_back(counter_normal(s, name_stream("x"), i));
  for (int64_t i = 0; i < rows * out; ++i) b.t.push_back(counter_normal(s, name_stream("t"), i));
  for (int64_t i = 0; i < rows * out * k; ++i)
    b.dyt.push_back(2.0 * counter_normal(s, name_stream("dy"), i));
  return b;
}

// ---- the float64 reference: plain loops from docs/model_math.md ----------------------------
// L of parameters W0, b0, W1, b1, ... (row-major [in, out], [out]); tangents by f' only.
struct ReferenceLoss {
  double data = 0, derivative = 0, total = 0;
};
// dropout: the rate of model.dropout, its mask that of step 0 (dropout_factor), held fixed.
ReferenceLoss reference_loss(const std::vector<Tensor>& p, Activation act, const Batch& b,
                             int64_t rows, double dropout = 0.0) {
  const int64_t k = static_cast<int64_t>(kChosen.size());
  const size_t layers = kSizes.size() - 1;
  const int64_t out_width = kSizes.back();
  ReferenceLoss loss;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> a(b.x.begin() + r * kSizes[0], b.x.begin() + (r + 1) * kSizes[0]);
    std::vector<std::vector<double>> t(k, std::vector<double>(kSizes[0], 0.0));
    for (int64_t d = 0; d < k; ++d) t[d][kChosen[d]] = 1.0 / kInputStd[kChosen[d]];
    for (size_t l = 0; l < layers; ++l) {
      const int64_t in = kSizes[l], out = kSizes[l + 1];
      const Tensor& w = p[2 * l];
      const Tensor& bias = p[2 * l + 1];
      std::vector<double> z(bias.begin(), bias.end());
      std::vector<std::vector<double>> tz(k, std::vector<double>(out, 0.0));
      for (int64_t i = 0; i < in; ++i)
        for (int64_t j = 0; j < out; ++j) {
          z[j] += a[i] * w[i * out + j];
          for (int64_t d = 0; d < k; ++d) tz[d][j] += t[d][i] * w[i * out + j];
        }
      if (l + 1 < layers) {
        for (int64_t j = 0; j < out; ++j) {
          const double keep = dropout_factor(dropout, r, j, static_cast<int64_t>(l));
          const double slope = testing::activation_derivative(act, z[j]) * keep;
          for (int64_t d = 0; d < k; ++d) tz[d][j] *= slope;
          z[j] = testing::activation(act, z[j]) * keep;
        }
      }
      a = z;
      t = tz;
    }
    for (int64_t o = 0; o < out_width; ++o) {
      const double e = a[o] - b.t[r * out_width + o];
      loss.data += e * e / rows;
      for (int64_t d = 0; d < k; ++d) {
        const double e2 = kTargetStd[o] * t[d][o] - b.dyt[(r * out_width + o) * k + d];
        loss.derivative += e2 * e2 / static_cast<double>(rows * out_width * k);
      }
    }
  }
  loss.total = loss.data + kLambda * loss.derivative;
  return loss;
}

// ---- the model on a mesh ----------------------------------------------------------------
struct StepsRun {
  std::vector<double> data_losses, derivative_losses;
  std::vector<std::vector<Tensor>> grads;  // per step, full tensors
  std::vector<Tensor> initial, final_params;
  int64_t last_step_allocations = -1;  // Kokkos allocations of the last step's passes
  std::string first_allocations;
};

struct MeshSetup {
  Mesh mesh;
  MeshCommunicators comms;
  ParallelContext context;
  ShardingPlan plan;
  MeshSetup(const testing::MeshCase& c, bool self)
      : mesh(make_mesh(c, self)),
        comms(mesh, self ? MPI_COMM_SELF : MPI_COMM_WORLD,
              self ? CommunicatorFactory{} : testing::test_communicator_factory()),
        context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                25.0) {
    PlanOptions options;
    options.min_sharding_size = 0;  // every layer split as the preset says, however small
    options.batch_axes = {"fsdp", "dp"};
    options.feature_axis = "tp";
    options.global_batch = kRows;
    plan = make_plan(mlp_parameter_shapes(kSizes), mesh, preset_rules(c.preset), options);
  }
  static Mesh make_mesh(const testing::MeshCase& c, bool self) {
    std::vector<std::pair<std::string, int>> axes = {{"dp", 1}, {"fsdp", 1}, {"tp", 1}};
    if (!self) {
      for (const auto& [name, size] : c.axes)
        for (auto& a : axes)
          if (a.first == name) a.second = size;
    }
    return Mesh::create(axes, self ? 1 : world_size());
  }
};

// reduce = false: the gradients the model's plan defers (DP storage) are left partial by
// backward_with_tangents and completed by reduce_gradients(), as gradient accumulation does.
// dropout > 0: the model has dropout layers, and every forward is a training pass.
StepsRun run_steps(const testing::MeshCase& c, Activation act, bool self, int steps, float lr,
                   bool reduce = true, double dropout = 0.0) {
  MeshSetup s(c, self);
  ParallelContext& context = s.context;
  MPI_Comm comm = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int64_t rows = kRows / context.batch_parallel();
  const int64_t row0 = context.batch_index() * rows;
  const int64_t k = static_cast<int64_t>(kChosen.size());
  Mlp model(kSizes, act, specs_from_plan(s.plan), context, rows, {}, dropout);
  model.initialize(InitScheme::he_normal, kSeed);
  model.reserve_tangent_backward(k);
  if (context.feature_parallel() > 1) {  // the tp meshes really split the layers
    bool split = false;
    for (const Linear& l : model.layers()) split = split || l.tensor_parallel();
    EXPECT_TRUE(split) << "no tensor-parallel layer";
  }
  Loss loss(LossKind::mse, context, rows, kSizes.back(), model.output_layout());
  DerivativeLoss derivative({kChosen, kLambda, kInputStd, kTargetStd}, context, rows,
                            kSizes.front(), kSizes.back(), model.output_layout());
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  Optimizer optimizer(sgd, model.parameters());
  StepsRun run;
  for (const auto& p : model.parameters())
    run.initial.push_back(testing::gather_full(p, s.mesh, context.rank(), comm));
  for (int step = 0; step < steps; ++step) {
    const Batch b = make_batch(kRows, k, step);
    const Matrix x = rows_of("x", b.x, kSizes.front(), row0, rows);
    const Matrix t = rows_of("t", b.t, kSizes.back(), row0, rows);
    const Matrix dyt = rows_of("dyt", b.dyt, kSizes.back() * k, row0, rows);
    const TrainingPass training = training_pass(step, row0);
    testing::KokkosAllocationCounter allocations;  // the step allocates nothing
    const MatrixView y = model.forward(x, dropout > 0.0 ? &training : nullptr);
    run.data_losses.push_back(loss.regression(y, t).loss);
    const MatrixView tangents = model.forward_tangents(derivative.seeds());
    run.derivative_losses.push_back(derivative.evaluate(tangents, dyt).loss);
    model.backward_with_tangents(loss.gradient(), derivative.gradient(), reduce);
    if (!reduce) model.reduce_gradients();
    allocations.stop();
    run.last_step_allocations = allocations.count();
    run.first_allocations = allocations.described();
    std::vector<Tensor> grads;
    for (const auto& g : model.gradients())
      grads.push_back(testing::gather_full(g, s.mesh, context.rank(), comm));
    run.grads.push_back(grads);
    optimizer.step(model.parameters(), model.gradients(), lr);
  }
  for (const auto& p : model.parameters())
    run.final_params.push_back(testing::gather_full(p, s.mesh, context.rank(), comm));
  return run;
}

TEST(Sobolev, GradientsMatchFloat64CentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  constexpr double kStep = 1e-6, kTolerance = 2e-6;
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  std::vector<std::pair<Activation, double>> cases;  // (activation, dropout)
  for (const Activation act : kActivations) cases.push_back({act, 0.0});
  for (const Activation act : {Activation::tanh, Activation::gelu})
    cases.push_back({act, kDropout});
  for (const auto& [act, dropout] : cases) {
    const std::string name = std::string(to_string(act)) + (dropout > 0.0 ? " with dropout" : "");
    SCOPED_TRACE(name);
    const StepsRun run = run_steps(one, act, /*self=*/true, 1, 0.0f, true, dropout);
    const Batch b = make_batch(kRows, static_cast<int64_t>(kChosen.size()), 0);
    std::vector<Tensor> p = run.initial;
    const ReferenceLoss ref = reference_loss(p, act, b, kRows, dropout);
    EXPECT_NEAR(run.data_losses[0], ref.data, 1e-5 * ref.data);
    EXPECT_NEAR(run.derivative_losses[0], kLambda * ref.derivative, 1e-5 * ref.derivative);
    double worst = 0.0;
    const std::vector<Tensor> fd = testing::central_differences(
        p,
        [&](const std::vector<Tensor>& v) {
          return reference_loss(v, act, b, kRows, dropout).total;
        },
        kStep);
    for (size_t q = 0; q < p.size(); ++q) {
      worst = std::max(worst, expect_close_scaled(run.grads[0][q], fd[q], kTolerance,
                                                  "gradient " + std::to_string(q)));
    }
    std::printf(
        "[ sobolev ] %s: gradient vs float64 central differences: largest |g - fd| / "
        "max|fd| %.2e (tolerance %.0e)\n",
        name.c_str(), worst, kTolerance);
  }
}

TEST(Sobolev, EveryMeshEqualsOneRank) {
  constexpr double kTolerance = 1e-5;
  constexpr int kSteps = 3;
  constexpr float kLr = 0.02f;
  std::vector<std::pair<Activation, double>> cases;  // (activation, dropout)
  for (const Activation act : kActivations) cases.push_back({act, 0.0});
  cases.push_back({Activation::tanh, kDropout});
  for (const auto& [act, dropout] : cases) {
    const std::string name = std::string(to_string(act)) + (dropout > 0.0 ? " with dropout" : "");
    const StepsRun one =
        run_steps({"dp", {{"dp", 1}}}, act, /*self=*/true, kSteps, kLr, true, dropout);
    for (const testing::MeshCase& c : testing::layer_meshes(world_size())) {
      for (const bool reduce : {true, false}) {
        SCOPED_TRACE(name + " on " + testing::describe(c) +
                     (reduce ? "" : ", gradients reduced after backward"));
        const StepsRun got = run_steps(c, act, /*self=*/false, kSteps, kLr, reduce, dropout);
        double worst = 0.0;
        for (int step = 0; step < kSteps; ++step) {
          EXPECT_NEAR(got.data_losses[step], one.data_losses[step],
                      kTolerance * one.data_losses[step]);
          EXPECT_NEAR(got.derivative_losses[step], one.derivative_losses[step],
                      kTolerance * one.derivative_losses[step]);
          for (size_t q = 0; q < one.grads[step].size(); ++q) {
            worst = std::max(
                worst, expect_close_scaled(
                           got.grads[step][q], one.grads[step][q], kTolerance,
                           "gradient " + std::to_string(q) + " step " + std::to_string(step)));
          }
        }
        EXPECT_EQ(got.last_step_allocations, 0) << got.first_allocations;
        for (size_t q = 0; q < one.final_params.size(); ++q) {
          worst =
              std::max(worst, expect_close_scaled(got.final_params[q], one.final_params[q],
                                                  kTolerance, "parameter " + std::to_string(q)));
        }
        if (world_rank() == 0) {
          std::printf("[ sobolev ] %s on %s%s: largest difference from one rank %.2e\n",
                      name.c_str(), testing::describe(c).c_str(),
                      reduce ? "" : " (reduce_gradients)", worst);
        }
      }
    }
  }
}

// ---- a small Sobolev training run ----------------------------------------------------------
struct FitResult {
  double first_derivative_mse = 0, last_derivative_mse = 0;
  double jacobian_rms_error = 0;  // on the held-out points
};

// y = sin(x1) x2, x uniform in [-2, 2]^2; dy/dx = (cos(x1) x2, sin(x1)).
void fill_points(int64_t rows, uint64_t seed, Matrix& x, Matrix& y, Matrix& dy) {
  auto xh = Kokkos::create_mirror_view(x);
  auto yh = Kokkos::create_mirror_view(y);
  auto dh = Kokkos::create_mirror_view(dy);
  for (int64_t r = 0; r < rows; ++r) {
    const double x1 = 4.0 * counter_uniform(seed, name_stream("x1"), r) - 2.0;
    const double x2 = 4.0 * counter_uniform(seed, name_stream("x2"), r) - 2.0;
    xh(r, 0) = static_cast<float>(x1);
    xh(r, 1) = static_cast<float>(x2);
    yh(r, 0) = static_cast<float>(std::sin(x1) * x2);
    dh(r, 0) = static_cast<float>(std::cos(x1) * x2);  // output 0 along input 0
    dh(r, 1) = static_cast<float>(std::sin(x1));       // along input 1
  }
  Kokkos::deep_copy(x, xh);
  Kokkos::deep_copy(y, yh);
  Kokkos::deep_copy(dy, dh);
}

FitResult fit(double lambda, int steps) {
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  const std::vector<int64_t> sizes = {2, 32, 32, 1};
  constexpr int64_t kTrain = 32, kTest = 256;
  const Mesh mesh = Mesh::create({{"dp", 1}}, 1);
  MeshCommunicators comms(mesh, MPI_COMM_SELF, CommunicatorFactory{});
  ParallelContext context(comms, {"dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                          25.0);
  const SpecLookup replicated = [](const std::string&) { return PartitionSpec(); };
  Mlp model(sizes, Activation::tanh, replicated, context, kTrain);
  model.initialize(InitScheme::he_normal, kSeed);
  model.reserve_tangent_backward(2);
  Loss loss(LossKind::mse, context, kTrain, 1, model.output_layout());
  DerivativeLoss derivative({{0, 1}, lambda, {}, {}}, context, kTrain, 2, 1, model.output_layout());
  OptimizerSettings adam;
  adam.kind = OptimizerKind::adamw;
  adam.weight_decay = 0.0f;
  Optimizer optimizer(adam, model.parameters());
  Matrix x("x", kTrain, 2), y("y", kTrain, 1), dy("dy", kTrain, 2);
  fill_points(kTrain, 11, x, y, dy);
  FitResult result;
  for (int step = 0; step < steps; ++step) {
    loss.regression(model.forward(x), y);
    const DerivativeLossResult d =
        derivative.evaluate(model.forward_tangents(derivative.seeds()), dy);
    if (step == 0) result.first_derivative_mse = d.mse;
    result.last_derivative_mse = d.mse;
    model.backward_with_tangents(loss.gradient(), derivative.gradient());
    optimizer.step(model.parameters(), model.gradients(), 3e-3f);
  }
  // The Jacobian on held-out points, through a forward-only copy sharing the parameters.
  Mlp test_model(sizes, Activation::tanh, replicated, context, kTest, {}, 0.0, &model);
  test_model.reserve_tangents(2);
  DerivativeLoss test_derivative({{0, 1}, 1.0, {}, {}}, context, kTest, 2, 1,
                                 test_model.output_layout());
  Matrix tx("tx", kTest, 2), ty("ty", kTest, 1), tdy("tdy", kTest, 2);
  fill_points(kTest, 12, tx, ty, tdy);
  test_model.forward(tx);
  const DerivativeLossResult t = test_derivative.evaluate(
      test_model.forward_tangents(test_derivative.seeds()), tdy, /*with_gradient=*/false);
  result.jacobian_rms_error = std::sqrt(t.mse);
  return result;
}

TEST(Sobolev, SobolevTrainingFitsTheDerivatives) {
  if (world_size() > 1) GTEST_SKIP() << "one small run: at np 1";
  constexpr int kSteps = 600;
  const FitResult sobolev = fit(1.0, kSteps);
  const FitResult plain = fit(0.0, kSteps);
  std::printf(
      "[ sobolev ] y = sin(x1) x2, 32 points, %d steps: derivative mse %.3e -> %.3e "
      "(lambda 1), %.3e -> %.3e (lambda 0); held-out Jacobian rms error %.3e (lambda 1) "
      "vs %.3e (lambda 0)\n",
      kSteps, sobolev.first_derivative_mse, sobolev.last_derivative_mse, plain.first_derivative_mse,
      plain.last_derivative_mse, sobolev.jacobian_rms_error, plain.jacobian_rms_error);
  EXPECT_LT(sobolev.last_derivative_mse, 0.1 * sobolev.first_derivative_mse);
  EXPECT_LT(sobolev.jacobian_rms_error, 0.5 * plain.jacobian_rms_error);
}

// reserve_tangent_backward refuses, as bad_input naming what: 16-bit parameters (a residual_mlp
// is tests/layers/sobolev_residual_test.cpp's); dropout and MoE layers it accepts.
void expect_refused(Mlp& model, const std::string& what) {
  try {
    model.reserve_tangent_backward(1);
    ADD_FAILURE() << what << " accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(Sobolev, RefusesWhatItIsNotBuiltFor) {
  const Mesh mesh = Mesh::create({{"dp", 1}}, 1);
  MeshCommunicators comms(mesh, MPI_COMM_SELF, CommunicatorFactory{});
  ParallelContext context(comms, {"dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                          25.0);
  const SpecLookup replicated = [](const std::string&) { return PartitionSpec(); };
  Mlp with_dropout({2, 4, 1}, Activation::tanh, replicated, context, 4, {}, 0.1);
  EXPECT_NO_THROW(with_dropout.reserve_tangent_backward(1));
  MoeSettings moe;
  moe.layers = {0};
  moe.experts = 2;
  moe.top_k = 1;
  Mlp with_moe({2, 4, 1}, Activation::tanh, replicated, context, 4, moe);
  EXPECT_NO_THROW(with_moe.reserve_tangent_backward(1));  // tests/layers/sobolev_moe_test.cpp
  context.set_precision({Dtype::bf16, Dtype::bf16});
  Mlp bf16(std::vector<int64_t>{2, 4, 1}, Activation::tanh, replicated, context, 4);
  expect_refused(bf16, "fp32 only");
}

}  // namespace
}  // namespace meshtrain
