// Training on derivatives (Sobolev training, docs/derivatives.md) through a residual_mlp:
// Mlp::backward_with_tangents with DerivativeLoss on residual blocks, norms and SwiGLU, the loss
//   L = mse(y, t) + lambda * mean over (rows, outputs, chosen inputs) of (dy_pred - dy_t)^2
// with dy_pred the Jacobian in the user's units (input_std and target_std != 1 here). Models:
// residual_mlp 4-8-...-2, hidden 16, 2 blocks, LayerNorm + silu, RMSNorm + SwiGLU, and no norm
// + tanh; the norms' scales and biases perturbed from 1 and 0 (a missing factor of the scale
// would not show at 1).
//
//   * GradientsMatchFloat64CentralDifferences (np 1): a float64 reference written here with dual
//     numbers (each number carries its k first derivatives through every operation of the
//     forward, the norms' means, square roots and products included, so it needs none of the
//     layers' tangent formulas): its du against central differences of its own forward
//     (h = 1e-5, tolerance 1e-7 of the largest |du|); the layers' data and derivative losses
//     against it (1e-5 relative), and every parameter gradient of L against central
//     differences (h = 1e-6) of its float64 L: |got - fd| <= 1e-5 max |fd| per tensor.
//   * EveryMeshEqualsOneRank (np 1, 2, 4): 3 SGD steps on dp, fsdp, tp and (np 4) fsdp x tp and
//     dp x tp against the same steps on one rank in the same test: both losses and every
//     gradient of every step, and the parameters after, within 1e-5 of the tensor's largest
//     |one|; with the gradients reduced in backward_with_tangents and left for
//     reduce_gradients(); the step's passes make no Kokkos allocation.
//   * A residual_mlp with MoE blocks (tests/layers/sobolev_moe_test.cpp) or dropout is accepted
//     (16-bit parameters are refused: tests/layers/sobolev_test.cpp).

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/context.hpp"
#include "layers/derivative_loss.hpp"
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
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::expect_close_scaled;
using testing::rows_of;
using testing::Tensor;

constexpr int64_t kRows = 16;  // global batch (divides by 1, 2, 4)
constexpr int64_t kInputs = 4, kOutputs = 2;
constexpr int64_t kK = 2;
const std::vector<int64_t> kChosen = {0, 2};  // k = 2 of the 4 input columns
const std::vector<double> kInputStd = {0.5, 2.0, 1.5, 0.8};
const std::vector<double> kTargetStd = {3.0, 0.25};
constexpr double kLambda = 0.7;
constexpr uint64_t kSeed = 7;

// The model of a case: residual_mlp 4-8-...-2 (hidden 16, 2 blocks).
struct ModelCase {
  bool norm = true;
  NormKind norm_kind = NormKind::layernorm;
  Activation activation = Activation::silu;
  bool gated = false;  // SwiGLU blocks (silu)
  std::string describe() const {
    return std::string(norm ? to_string(norm_kind) : "no norm") + " + " +
           (gated ? std::string("swiglu") : to_string(activation));
  }
  ResidualMlpShape shape() const {
    ResidualMlpShape s;
    s.inputs = kInputs;  // divides by tp (the stream is split under tp from the input layer on)
    s.outputs = kOutputs;
    s.width = 8;
    s.hidden = 16;
    s.depth = 2;
    s.norm = norm;
    s.norm_kind = norm_kind;
    s.gated = gated;
    return s;
  }
};
const std::vector<ModelCase> kCases = {
    {true, NormKind::layernorm, Activation::silu},
    {true, NormKind::rmsnorm, Activation::silu, /*gated=*/true},
    {false, NormKind::rmsnorm, Activation::tanh},
};

// The global batch: x [rows, in], t [rows, out], dy_t [rows, out, k].
struct Batch {
  Tensor x, t, dyt;
};
Batch make_batch(int64_t rows, int step) {
  const uint64_t s = kSeed + 100 * static_cast<uint64_t>(step);
  Batch b;
  for (int64_t i = 0; i < rows * kInputs; ++i)
    b.x.push_back(counter_normal(s, name_stream("x"), i));
  for (int64_t i = 0; i < rows * kOutputs; ++i)
    b.t.push_back(counter_normal(s, name_stream("t"), i));
  for (int64_t i = 0; i < rows * kOutputs * kK; ++i)
    b.dyt.push_back(2.0 * counter_normal(s, name_stream("dy"), i));
  return b;
}

// ---- the float64 reference: dual numbers ---------------------------------------------------
// A number and its derivatives along the k seed directions, through every operation.
struct Dual {
  double v = 0.0, t[kK] = {};
};
Dual operator+(Dual a, const Dual& b) {
  a.v += b.v;
  for (int64_t d = 0; d < kK; ++d) a.t[d] += b.t[d];
  return a;
}
Dual operator-(Dual a, const Dual& b) {
  a.v -= b.v;
  for (int64_t d = 0; d < kK; ++d) a.t[d] -= b.t[d];
  return a;
}
Dual operator*(double c, Dual a) {
  a.v *= c;
  for (int64_t d = 0; d < kK; ++d) a.t[d] *= c;
  return a;
}
Dual operator*(const Dual& a, const Dual& b) {
  Dual r;
  r.v = a.v * b.v;
  for (int64_t d = 0; d < kK; ++d) r.t[d] = a.t[d] * b.v + a.v * b.t[d];
  return r;
}
Dual constant(double c) {
  Dual r;
  r.v = c;
  return r;
}
Dual apply(const Dual& a, double f, double f1) {  // f(a) given f and f' at a.v
  Dual r;
  r.v = f;
  for (int64_t d = 0; d < kK; ++d) r.t[d] = f1 * a.t[d];
  return r;
}

std::vector<Dual> linear(const std::vector<Dual>& in, const Tensor& w, const Tensor& b) {
  const size_t out = b.size();
  std::vector<Dual> y(out);
  for (size_t j = 0; j < out; ++j) {
    y[j] = constant(b[j]);
    for (size_t i = 0; i < in.size(); ++i) y[j] = y[j] + w[i * out + j] * in[i];
  }
  return y;
}

// LayerNorm (bias non-null) or RMSNorm, as docs/model_math.md defines them.
std::vector<Dual> norm(const std::vector<Dual>& h, NormKind kind, const Tensor& scale,
                       const Tensor* bias) {
  const double n = static_cast<double>(h.size());
  std::vector<Dual> c = h, y(h.size());
  Dual second;
  if (kind == NormKind::layernorm) {
    Dual mean;
    for (const Dual& v : h) mean = mean + v;
    mean = (1.0 / n) * mean;
    for (Dual& v : c) v = v - mean;
  }
  for (const Dual& v : c) second = second + v * v;
  const double eps = kind == NormKind::layernorm ? kLayerNormEps : kRmsNormEps;
  second = (1.0 / n) * second + constant(eps);
  const Dual r = apply(second, std::pow(second.v, -0.5), -0.5 * std::pow(second.v, -1.5));
  for (size_t j = 0; j < h.size(); ++j) {
    y[j] = scale[j] * (c[j] * r);
    if (bias) y[j] = y[j] + constant((*bias)[j]);
  }
  return y;
}

// The model's outputs of one row with their derivatives along `seeds` (per direction, a
// tangent of the normalized input), parameters in residual_mlp_parameter_shapes' order.
std::vector<Dual> forward_row(const std::vector<Tensor>& p, const ModelCase& m, const double* x_row,
                              const double seeds[kK][kInputs]) {
  const ResidualMlpShape shape = m.shape();
  std::vector<Dual> x(shape.inputs);
  for (int64_t i = 0; i < shape.inputs; ++i) {
    x[i].v = x_row[i];
    for (int64_t d = 0; d < kK; ++d) x[i].t[d] = seeds[d][i];
  }
  size_t q = 2;
  auto block_norm = [&](const std::vector<Dual>& h) {
    if (!m.norm) return h;
    const Tensor& scale = p[q++];
    const Tensor* bias = m.norm_kind == NormKind::layernorm ? &p[q++] : nullptr;
    return norm(h, m.norm_kind, scale, bias);
  };
  std::vector<Dual> h = linear(x, p[0], p[1]);
  for (int64_t block = 0; block < shape.depth; ++block) {
    std::vector<Dual> f = block_norm(h);
    std::vector<Dual> gate;
    if (m.gated) {
      gate = linear(f, p[q], p[q + 1]);
      q += 2;
    }
    f = linear(f, p[q], p[q + 1]);
    q += 2;
    const Activation act = m.gated ? Activation::silu : m.activation;
    for (size_t j = 0; j < f.size(); ++j) {
      Dual& z = m.gated ? gate[j] : f[j];
      z = apply(z, testing::activation(act, z.v), testing::activation_derivative(act, z.v));
      if (m.gated) f[j] = gate[j] * f[j];
    }
    f = linear(f, p[q], p[q + 1]);
    q += 2;
    for (size_t j = 0; j < h.size(); ++j) h[j] = h[j] + f[j];
  }
  h = block_norm(h);
  return linear(h, p[q], p[q + 1]);
}

// The chosen directions in the user's units: e_{i_d} / input_std_{i_d}.
void user_seeds(double seeds[kK][kInputs]) {
  for (int64_t d = 0; d < kK; ++d)
    for (int64_t i = 0; i < kInputs; ++i) seeds[d][i] = i == kChosen[d] ? 1.0 / kInputStd[i] : 0.0;
}

struct ReferenceLoss {
  double data = 0, derivative = 0, total = 0;
};
ReferenceLoss reference_loss(const std::vector<Tensor>& p, const ModelCase& m, const Batch& b) {
  double seeds[kK][kInputs];
  user_seeds(seeds);
  ReferenceLoss loss;
  for (int64_t r = 0; r < kRows; ++r) {
    const std::vector<Dual> y = forward_row(p, m, &b.x[r * kInputs], seeds);
    for (int64_t o = 0; o < kOutputs; ++o) {
      const double e = y[o].v - b.t[r * kOutputs + o];
      loss.data += e * e / kRows;
      for (int64_t d = 0; d < kK; ++d) {
        const double e2 = kTargetStd[o] * y[o].t[d] - b.dyt[(r * kOutputs + o) * kK + d];
        loss.derivative += e2 * e2 / static_cast<double>(kRows * kOutputs * kK);
      }
    }
  }
  loss.total = loss.data + kLambda * loss.derivative;
  return loss;
}

// ---- the model on a mesh ----------------------------------------------------------------
struct MeshSetup {
  Mesh mesh;
  MeshCommunicators comms;
  ParallelContext context;
  ShardingPlan plan;
  MeshSetup(const testing::MeshCase& c, bool self, const ModelCase& m)
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
    plan = make_plan(residual_mlp_parameter_shapes(m.shape()), mesh,
                     preset_rules(c.preset, false, /*norms=*/m.norm, /*residual=*/true), options);
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

// The norms' scales and biases away from 1 and 0, the same global values on every mesh.
void perturb_norms(Mlp& model) {
  for (ShardedTensor& p : model.parameters()) {
    if (p.name.find("norm/") == std::string::npos) continue;
    const bool scale = p.name.find("/scale") != std::string::npos;
    const uint64_t stream = name_stream(p.name);
    testing::fill_global(p, [&](int64_t i) {
      const double z = counter_normal(kSeed, stream, static_cast<uint64_t>(i));
      return scale ? 1.0 + 0.3 * z : 0.2 * z;
    });
  }
}

struct StepsRun {
  std::vector<double> data_losses, derivative_losses;
  std::vector<std::vector<Tensor>> grads;  // per step, full tensors
  std::vector<Tensor> initial, final_params;
  int64_t last_step_allocations = -1;  // Kokkos allocations of the last step's passes
  std::string first_allocations;
};

StepsRun run_steps(const testing::MeshCase& c, const ModelCase& m, bool self, int steps, float lr,
                   bool reduce = true) {
  MeshSetup s(c, self, m);
  ParallelContext& context = s.context;
  MPI_Comm comm = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int64_t rows = kRows / context.batch_parallel();
  const int64_t row0 = context.batch_index() * rows;
  Mlp model(m.shape(), m.activation, specs_from_plan(s.plan), context, rows);
  model.initialize(InitScheme::he_normal, kSeed);
  perturb_norms(model);
  model.reserve_tangent_backward(kK);
  if (context.feature_parallel() > 1) {  // the tp meshes really split the layers
    bool split = false;
    for (const std::string& line : model.describe()) {
      split = split || line.find("column-parallel") != std::string::npos ||
              line.find("split") != std::string::npos;
    }
    EXPECT_TRUE(split) << "no tensor-parallel layer";
  }
  Loss loss(LossKind::mse, context, rows, kOutputs, model.output_layout());
  DerivativeLoss derivative({kChosen, kLambda, kInputStd, kTargetStd}, context, rows, kInputs,
                            kOutputs, model.output_layout());
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  Optimizer optimizer(sgd, model.parameters());
  StepsRun run;
  for (const auto& p : model.parameters())
    run.initial.push_back(testing::gather_full(p, s.mesh, context.rank(), comm));
  for (int step = 0; step < steps; ++step) {
    const Batch b = make_batch(kRows, step);
    const Matrix x = rows_of("x", b.x, kInputs, row0, rows);
    const Matrix t = rows_of("t", b.t, kOutputs, row0, rows);
    const Matrix dyt = rows_of("dyt", b.dyt, kOutputs * kK, row0, rows);
    testing::KokkosAllocationCounter allocations;  // the step allocates nothing
    const MatrixView y = model.forward(x);
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

TEST(SobolevResidual, GradientsMatchFloat64CentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  constexpr double kStep = 1e-6, kTolerance = 1e-5;
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  for (const ModelCase& m : kCases) {
    SCOPED_TRACE(m.describe());
    const StepsRun run = run_steps(one, m, /*self=*/true, 1, 0.0f);
    const Batch b = make_batch(kRows, 0);
    std::vector<Tensor> p = run.initial;

    // The duals' du against central differences of their own forward's values (the
    // reference checked on its own): along e_{i_d} / input_std, h = 1e-5.
    double seeds[kK][kInputs];
    user_seeds(seeds);
    const double no_seeds[kK][kInputs] = {};
    Tensor du, du_fd;
    for (int64_t r = 0; r < kRows; ++r) {
      const std::vector<Dual> y = forward_row(p, m, &b.x[r * kInputs], seeds);
      for (int64_t o = 0; o < kOutputs; ++o)
        for (int64_t d = 0; d < kK; ++d) {
          constexpr double h = 1e-5;
          std::vector<double> up(b.x.begin() + r * kInputs, b.x.begin() + (r + 1) * kInputs);
          std::vector<double> down = up;
          for (int64_t i = 0; i < kInputs; ++i) up[i] += h * seeds[d][i];
          for (int64_t i = 0; i < kInputs; ++i) down[i] -= h * seeds[d][i];
          du.push_back(y[o].t[d]);
          du_fd.push_back((forward_row(p, m, up.data(), no_seeds)[o].v -
                           forward_row(p, m, down.data(), no_seeds)[o].v) /
                          (2 * h));
        }
    }
    const double du_worst = expect_close_scaled(du, du_fd, 1e-7, "reference du");

    const ReferenceLoss ref = reference_loss(p, m, b);
    EXPECT_NEAR(run.data_losses[0], ref.data, 1e-5 * ref.data);
    EXPECT_NEAR(run.derivative_losses[0], kLambda * ref.derivative, 1e-5 * ref.derivative);
    double worst = 0.0;
    const std::vector<Tensor> fd = testing::central_differences(
        p, [&](const std::vector<Tensor>& v) { return reference_loss(v, m, b).total; }, kStep);
    for (size_t q = 0; q < p.size(); ++q) {
      worst = std::max(worst, expect_close_scaled(run.grads[0][q], fd[q], kTolerance,
                                                  "gradient " + std::to_string(q)));
    }
    std::printf(
        "[ sobolev residual ] %s: reference du vs central differences %.2e; gradient vs float64 "
        "central differences: largest |g - fd| / max|fd| %.2e (tolerance %.0e)\n",
        m.describe().c_str(), du_worst, worst, kTolerance);
  }
}

TEST(SobolevResidual, EveryMeshEqualsOneRank) {
  constexpr double kTolerance = 1e-5;
  constexpr int kSteps = 3;
  constexpr float kLr = 0.002f;
  for (const ModelCase& m : kCases) {
    const StepsRun one = run_steps({"dp", {{"dp", 1}}}, m, /*self=*/true, kSteps, kLr);
    for (const testing::MeshCase& c : testing::layer_meshes(world_size())) {
      for (const bool reduce : {true, false}) {
        SCOPED_TRACE(m.describe() + " on " + testing::describe(c) +
                     (reduce ? "" : ", gradients reduced after backward"));
        const StepsRun got = run_steps(c, m, /*self=*/false, kSteps, kLr, reduce);
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
          std::printf("[ sobolev residual ] %s on %s%s: largest difference from one rank %.2e\n",
                      m.describe().c_str(), testing::describe(c).c_str(),
                      reduce ? "" : " (reduce_gradients)", worst);
        }
      }
    }
  }
}

// reserve_tangent_backward accepts residual_mlps with MoE blocks (activation and SwiGLU experts:
// tests/layers/sobolev_moe_test.cpp) and with dropout (its Sobolev backward is checked through
// tests/layers/physics_loss_test.cpp's dropout cases, whose Laplacian backward carries the
// first-order tangents).
TEST(SobolevResidual, AcceptsMoeBlocksAndDropout) {
  const Mesh mesh = Mesh::create({{"dp", 1}}, 1);
  MeshCommunicators comms(mesh, MPI_COMM_SELF, CommunicatorFactory{});
  ParallelContext context(comms, {"dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                          25.0);
  const SpecLookup replicated = [](const std::string&) { return PartitionSpec(); };
  ResidualMlpShape shape;
  shape.inputs = 2;
  shape.outputs = 1;
  shape.width = 4;
  shape.hidden = 8;
  shape.depth = 2;
  Mlp dense(shape, Activation::silu, replicated, context, 4);
  dense.reserve_tangent_backward(2);  // accepted
  Mlp with_dropout(shape, Activation::silu, replicated, context, 4, 0.1);
  EXPECT_NO_THROW(with_dropout.reserve_tangent_backward(2));
  ResidualMlpShape moe = shape;
  moe.moe.layers = {1};
  moe.moe.experts = 2;
  moe.moe.top_k = 1;
  Mlp with_moe(moe, Activation::silu, replicated, context, 4);
  EXPECT_NO_THROW(with_moe.reserve_tangent_backward(2));  // tests/layers/sobolev_moe_test.cpp
  moe.gated = true;
  Mlp with_swiglu_experts(moe, Activation::silu, replicated, context, 4);
  EXPECT_NO_THROW(with_swiglu_experts.reserve_tangent_backward(2));
}

}  // namespace
}  // namespace meshtrain
