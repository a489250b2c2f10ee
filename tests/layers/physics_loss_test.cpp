// Physics losses through the forward Laplacian (docs/derivatives.md, "Physics losses"):
// Mlp::forward_laplacian and backward_with_laplacian with PhysicsLoss, the loss
//   L = mse(y, t) + weight * mean over (rows, residuals) of r^2
// with a residual of u, du/dx and d2u/dx2 in the user's units (input std, target mean and std
// != 1 and 0 here), 2 of 3 inputs differentiated, 2 outputs and 2 residuals using every seed
// (u, du, d2u, nonlinearly):
//   r0 = d2u0/dx0^2 + d2u0/dx2^2 + 0.5 u1 du0/dx2 - sin(x0)
//   r1 = u0 - 0.3 d2u1/dx0^2 + (du1/dx0)^2 + x1 u1
//
//   * LaplacianMatchesFiniteDifferences (np 1): a float64 forward Laplacian written here (plain
//     loops, f' and f'' of each activation) against second central differences of its own
//     float64 forward (h = 1e-4, at most 1e-5 of the largest |d2u|, or of the largest |du| for
//     relu and none, whose d2u is 0), and the layers' float32 streams (u, du, d2u) against it
//     (1e-5 of each quantity's largest value; relu's and none's d2u exactly 0), per activation.
//   * GradientsMatchFloat64CentralDifferences (np 1): every parameter gradient of L for relu,
//     tanh, gelu, gelu_erf, silu, sigmoid and none against central differences (h = 1e-6) of
//     that float64 L (its forward uses f' and f'' only, so the layers' f''' is checked too):
//     |got - fd| <= 2e-6 max |fd| per tensor; the losses within 1e-5 relative.
//   * EveryMeshEqualsOneRank (np 1, 2, 4): 3 SGD steps on dp, fsdp, tp and (np 4) fsdp x tp and
//     dp x tp against the same steps on one rank in the same test: both losses, every gradient
//     of every step and the parameters after within 1e-5 of the tensor's largest value; the
//     step's passes make no Kokkos allocation; gradients reduced in the backward and left for
//     reduce_gradients().
//   * Refusals: a residual_mlp, no residual function, a repeated column.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/context.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "layers/physics_loss.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;

constexpr int64_t kRows = 16;  // global batch (divides by 1, 2, 4)
const std::vector<int64_t> kSizes = {3, 16, 12, 2};
const std::vector<int64_t> kChosen = {0, 2};  // k = 2 of the 3 input columns
constexpr int64_t kK = 2, kOutputs = 2, kResiduals = 2;
const std::vector<double> kInputMean = {0.1, -0.2, 0.3};
const std::vector<double> kInputStd = {0.5, 2.0, 1.5};
const std::vector<double> kTargetMean = {0.5, -1.0};
const std::vector<double> kTargetStd = {3.0, 0.25};
constexpr double kWeight = 0.7;
constexpr uint64_t kSeed = 7;

const std::vector<Activation> kActivations = {
    Activation::relu, Activation::tanh,    Activation::gelu, Activation::gelu_erf,
    Activation::silu, Activation::sigmoid, Activation::none};

// The residuals above, their value and partial derivatives; in the user's units.
// du[o * k + d], d2u[o * k + d]; x the user's point.
void residual_device(const PhysicsPoints& p, const PhysicsResiduals& q) {
  const MatrixView x = p.x, u = p.u, du = p.du, d2u = p.d2u;
  const MatrixView r = q.r, dr_du = q.dr_du, dr_ddu = q.dr_ddu, dr_dd2u = q.dr_dd2u;
  Kokkos::parallel_for(
      "test_residual", Kokkos::RangePolicy<>(0, static_cast<int64_t>(u.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        r(i, 0) = d2u(i, 0) + d2u(i, 1) + 0.5f * u(i, 1) * du(i, 1) - kmath::sin(x(i, 0));
        dr_dd2u(i, (0 * kOutputs + 0) * kK + 0) = 1.0f;
        dr_dd2u(i, (0 * kOutputs + 0) * kK + 1) = 1.0f;
        dr_du(i, 0 * kOutputs + 1) = 0.5f * du(i, 1);
        dr_ddu(i, (0 * kOutputs + 0) * kK + 1) = 0.5f * u(i, 1);
        r(i, 1) = u(i, 0) - 0.3f * d2u(i, 2) + du(i, 2) * du(i, 2) + x(i, 1) * u(i, 1);
        dr_du(i, 1 * kOutputs + 0) = 1.0f;
        dr_du(i, 1 * kOutputs + 1) = x(i, 1);
        dr_dd2u(i, (1 * kOutputs + 1) * kK + 0) = -0.3f;
        dr_ddu(i, (1 * kOutputs + 1) * kK + 0) = 2.0f * du(i, 2);
      });
}

struct Residual64 {
  double r0, r1;
};
Residual64 residual_reference(const double* x, const double* u, const double* du,
                              const double* d2u) {
  return {d2u[0] + d2u[1] + 0.5 * u[1] * du[1] - std::sin(x[0]),
          u[0] - 0.3 * d2u[2] + du[2] * du[2] + x[1] * u[1]};
}

// The global batch: x' (normalized, what the model takes) [rows, in], t [rows, out].
struct Batch {
  Tensor x, x_user, t;
};
Batch make_batch(int64_t rows, int step) {
  const int64_t in = kSizes.front(), out = kSizes.back();
  const uint64_t s = kSeed + 100 * static_cast<uint64_t>(step);
  Batch b;
  for (int64_t i = 0; i < rows * in; ++i) {
    b.x.push_back(counter_normal(s, name_stream("x"), i));
    b.x_user.push_back(kInputMean[i % in] + kInputStd[i % in] * b.x.back());
  }
  for (int64_t i = 0; i < rows * out; ++i) b.t.push_back(counter_normal(s, name_stream("t"), i));
  return b;
}

// ---- the float64 reference: plain loops -------------------------------------------------------
// f''(z) of each activation in float64.
double second_derivative(Activation a, double z) {
  switch (a) {
    case Activation::relu:
    case Activation::none:
      return 0.0;
    case Activation::tanh: {
      const double t = std::tanh(z);
      return -2.0 * t * (1.0 - t * t);
    }
    case Activation::gelu: {
      const double c = std::sqrt(2.0 / M_PI), a3 = 0.044715;
      const double t = std::tanh(c * (z + a3 * z * z * z));
      const double du = c * (1.0 + 3.0 * a3 * z * z), ddu = 6.0 * a3 * c * z;
      return (1.0 - t * t) * (du - z * t * du * du + 0.5 * z * ddu);
    }
    case Activation::gelu_erf:
      return testing::normal_pdf(z) * (2.0 - z * z);
    case Activation::silu: {
      const double s = testing::sigmoid(z);
      return s * (1 - s) * (2.0 + z * (1.0 - 2.0 * s));
    }
    case Activation::sigmoid: {
      const double s = testing::sigmoid(z);
      return s * (1 - s) * (1.0 - 2.0 * s);
    }
  }
  return 0.0;
}

// Per row: u' (normalized output), and along the seeds e_i / input_std_i the first and second
// derivatives t'[o * k + d], s'[o * k + d], by forward propagation in float64.
struct Propagated {
  std::vector<double> u, t, s;
};
Propagated propagate(const std::vector<Tensor>& p, Activation act, const double* x_row) {
  const size_t layers = kSizes.size() - 1;
  std::vector<double> a(x_row, x_row + kSizes[0]);
  std::vector<std::vector<double>> t(kK, std::vector<double>(kSizes[0], 0.0));
  std::vector<std::vector<double>> s(kK, std::vector<double>(kSizes[0], 0.0));
  for (int64_t d = 0; d < kK; ++d) t[d][kChosen[d]] = 1.0 / kInputStd[kChosen[d]];
  for (size_t l = 0; l < layers; ++l) {
    const int64_t in = kSizes[l], out = kSizes[l + 1];
    const Tensor& w = p[2 * l];
    std::vector<double> z(p[2 * l + 1].begin(), p[2 * l + 1].end());
    std::vector<std::vector<double>> tz(kK, std::vector<double>(out, 0.0)), sz = tz;
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < out; ++j) {
        z[j] += a[i] * w[i * out + j];
        for (int64_t d = 0; d < kK; ++d) {
          tz[d][j] += t[d][i] * w[i * out + j];
          sz[d][j] += s[d][i] * w[i * out + j];
        }
      }
    if (l + 1 < layers) {
      for (int64_t j = 0; j < out; ++j) {
        const double f1 = testing::activation_derivative(act, z[j]);
        const double f2 = second_derivative(act, z[j]);
        for (int64_t d = 0; d < kK; ++d) {
          sz[d][j] = f1 * sz[d][j] + f2 * tz[d][j] * tz[d][j];
          tz[d][j] *= f1;
        }
        z[j] = testing::activation(act, z[j]);
      }
    }
    a = z;
    t = tz;
    s = sz;
  }
  Propagated result;
  result.u = a;
  for (int64_t o = 0; o < kOutputs; ++o)
    for (int64_t d = 0; d < kK; ++d) {
      result.t.push_back(t[d][o]);
      result.s.push_back(s[d][o]);
    }
  return result;
}

// The user's units of a row: u, du, d2u as the residual reads them.
struct UserUnits {
  std::vector<double> u, du, d2u;
};
UserUnits user_units(const Propagated& n) {
  UserUnits q;
  for (int64_t o = 0; o < kOutputs; ++o) {
    q.u.push_back(n.u[o] * kTargetStd[o] + kTargetMean[o]);
    for (int64_t d = 0; d < kK; ++d) {
      q.du.push_back(kTargetStd[o] * n.t[o * kK + d]);
      q.d2u.push_back(kTargetStd[o] * n.s[o * kK + d]);
    }
  }
  return q;
}

struct ReferenceLoss {
  double data = 0, physics = 0, total = 0;
};
ReferenceLoss reference_loss(const std::vector<Tensor>& p, Activation act, const Batch& b,
                             int64_t rows) {
  const int64_t in = kSizes.front();
  ReferenceLoss loss;
  for (int64_t r = 0; r < rows; ++r) {
    const UserUnits q = user_units(propagate(p, act, &b.x[r * in]));
    const Propagated n = propagate(p, act, &b.x[r * in]);
    for (int64_t o = 0; o < kOutputs; ++o) {
      const double e = n.u[o] - b.t[r * kOutputs + o];
      loss.data += e * e / rows;
    }
    const Residual64 res =
        residual_reference(&b.x_user[r * in], q.u.data(), q.du.data(), q.d2u.data());
    loss.physics += (res.r0 * res.r0 + res.r1 * res.r1) / static_cast<double>(rows * kResiduals);
  }
  loss.total = loss.data + kWeight * loss.physics;
  return loss;
}

// ---- the model on a mesh ------------------------------------------------------------------
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

Matrix rows_of(const std::string& label, const Tensor& full, int64_t width, int64_t row0,
               int64_t rows) {
  Matrix m(label, rows, width);
  auto h = Kokkos::create_mirror_view(m);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < width; ++j) h(i, j) = static_cast<float>(full[(row0 + i) * width + j]);
  Kokkos::deep_copy(m, h);
  return m;
}

Tensor to_tensor(MatrixView m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  Tensor t;
  for (size_t i = 0; i < h.extent(0); ++i)
    for (size_t j = 0; j < h.extent(1); ++j) t.push_back(h(i, j));
  return t;
}

PhysicsLossSettings physics_settings() {
  return {kChosen, kResiduals, kWeight, kInputStd, kTargetMean, kTargetStd, residual_device};
}

struct StepsRun {
  std::vector<double> data_losses, physics_losses;
  std::vector<std::vector<Tensor>> grads;  // per step, full tensors
  std::vector<Tensor> initial, final_params;
  int64_t last_step_allocations = -1;
  std::string first_allocations;
};

StepsRun run_steps(const testing::MeshCase& c, Activation act, bool self, int steps, float lr,
                   bool reduce = true) {
  MeshSetup s(c, self);
  ParallelContext& context = s.context;
  MPI_Comm comm = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int64_t rows = kRows / context.batch_parallel();
  const int64_t row0 = context.batch_index() * rows;
  Mlp model(kSizes, act, specs_from_plan(s.plan), context, rows);
  model.initialize(InitScheme::he_normal, kSeed);
  model.reserve_laplacian(kK);
  if (context.feature_parallel() > 1) {  // the tp meshes really split the layers
    bool split = false;
    for (const Linear& l : model.layers()) split = split || l.tensor_parallel();
    EXPECT_TRUE(split) << "no tensor-parallel layer";
  }
  Loss loss(LossKind::mse, context, rows, kSizes.back(), model.output_layout());
  PhysicsLoss physics(physics_settings(), context, rows, kSizes.front(), kSizes.back(),
                      model.output_layout());
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  Optimizer optimizer(sgd, model.parameters());
  StepsRun run;
  for (const auto& p : model.parameters())
    run.initial.push_back(testing::gather_full(p, s.mesh, context.rank(), comm));
  for (int step = 0; step < steps; ++step) {
    const Batch b = make_batch(kRows, step);
    const Matrix x = rows_of("x", b.x, kSizes.front(), row0, rows);
    const Matrix x_user = rows_of("x_user", b.x_user, kSizes.front(), row0, rows);
    const Matrix t = rows_of("t", b.t, kSizes.back(), row0, rows);
    testing::KokkosAllocationCounter allocations;  // the step allocates nothing
    const MatrixView y = model.forward(x);
    run.data_losses.push_back(loss.regression(y, t).loss);
    const MatrixView streams = model.forward_laplacian(physics.seeds());
    run.physics_losses.push_back(physics.evaluate(x_user, y, streams).loss);
    physics.add_output_gradient_to(loss.gradient());
    model.backward_with_laplacian(loss.gradient(), physics.stream_gradient(), reduce);
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

// |got - ref| <= tolerance * max |ref| elementwise; returns the largest such ratio.
// floor: the least scale (for a reference that is 0 throughout, as relu's d2u).
double expect_close_scaled(const Tensor& got, const Tensor& ref, double tolerance,
                           const std::string& what, double floor = 1e-30) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  double scale = floor, worst = 0.0;
  for (double v : ref) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    worst = std::max(worst, std::abs(got[i] - ref[i]) / scale);
  }
  EXPECT_LE(worst, tolerance) << what << ": largest |got - ref| / max |ref| " << worst;
  return worst;
}

TEST(PhysicsLoss, LaplacianMatchesFiniteDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  constexpr double kStep = 1e-4;
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  const int64_t in = kSizes.front();
  for (const Activation act : kActivations) {
    SCOPED_TRACE(std::string(to_string(act)));
    MeshSetup s(one, true);
    Mlp model(kSizes, act, specs_from_plan(s.plan), s.context, kRows);
    model.initialize(InitScheme::he_normal, kSeed);
    model.reserve_laplacian(kK);
    PhysicsLoss physics(physics_settings(), s.context, kRows, in, kOutputs, model.output_layout());
    std::vector<Tensor> p;
    for (const auto& q : model.parameters())
      p.push_back(testing::gather_full(q, s.mesh, 0, MPI_COMM_SELF));
    const Batch b = make_batch(kRows, 0);
    const Matrix x = rows_of("x", b.x, in, 0, kRows);
    const Tensor y = to_tensor(model.forward(x));
    const Tensor streams = to_tensor(model.forward_laplacian(physics.seeds()));
    Tensor got_u, got_t, got_s, ref_u, ref_t, ref_s, fd_t, fd_s;
    for (int64_t r = 0; r < kRows; ++r) {
      const Propagated n = propagate(p, act, &b.x[r * in]);
      for (int64_t o = 0; o < kOutputs; ++o) {
        got_u.push_back(y[r * kOutputs + o]);
        ref_u.push_back(n.u[o]);
        for (int64_t d = 0; d < kK; ++d) {
          got_t.push_back(streams[(r * 2 * kK + d) * kOutputs + o]);
          got_s.push_back(streams[(r * 2 * kK + kK + d) * kOutputs + o]);
          ref_t.push_back(n.t[o * kK + d]);
          ref_s.push_back(n.s[o * kK + d]);
          // Central differences along x_user's column i (x' moves by h / std_i).
          const int64_t i = kChosen[d];
          std::vector<double> xp(&b.x[r * in], &b.x[r * in] + in), xm = xp;
          xp[i] += kStep / kInputStd[i];
          xm[i] -= kStep / kInputStd[i];
          const double up = propagate(p, act, xp.data()).u[o];
          const double down = propagate(p, act, xm.data()).u[o];
          fd_t.push_back((up - down) / (2 * kStep));
          fd_s.push_back((up - 2 * n.u[o] + down) / (kStep * kStep));
        }
      }
    }
    // The float64 reference against finite differences of its own forward (relu's and the
    // identity's second derivative is 0, except across a kink, which no step of 1e-4 crosses
    // here: the differences' rounding, about 1e-8, is measured against the first derivatives'
    // scale then).
    double du_scale = 0.0;
    for (const double v : fd_t) du_scale = std::max(du_scale, std::abs(v));
    const double ref_t_err = expect_close_scaled(ref_t, fd_t, 1e-7, "reference du vs fd");
    const double ref_s_err =
        expect_close_scaled(fd_s, ref_s, 1e-5, "reference d2u vs fd", du_scale);
    if (act == Activation::relu || act == Activation::none) {
      for (const double v : got_s) EXPECT_EQ(v, 0.0) << "a piecewise linear network's d2u";
    }
    // The layers' float32 streams against the float64 reference.
    const double u_err = expect_close_scaled(got_u, ref_u, 1e-5, "u");
    const double t_err = expect_close_scaled(got_t, ref_t, 1e-5, "du");
    const double s_err = expect_close_scaled(got_s, ref_s, 1e-5, "d2u");
    std::printf(
        "[ physics ] %s: reference vs fd du %.1e d2u %.1e; layers vs reference u %.1e du %.1e "
        "d2u %.1e\n",
        to_string(act), ref_t_err, ref_s_err, u_err, t_err, s_err);
  }
}

TEST(PhysicsLoss, GradientsMatchFloat64CentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  constexpr double kStep = 1e-6, kTolerance = 2e-6;
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  for (const Activation act : kActivations) {
    SCOPED_TRACE(std::string(to_string(act)));
    const StepsRun run = run_steps(one, act, /*self=*/true, 1, 0.0f);
    const Batch b = make_batch(kRows, 0);
    std::vector<Tensor> p = run.initial;
    const ReferenceLoss ref = reference_loss(p, act, b, kRows);
    EXPECT_NEAR(run.data_losses[0], ref.data, 1e-5 * ref.data);
    EXPECT_NEAR(run.physics_losses[0], kWeight * ref.physics, 1e-5 * kWeight * ref.physics);
    double worst = 0.0;
    for (size_t q = 0; q < p.size(); ++q) {
      Tensor fd(p[q].size());
      for (size_t i = 0; i < p[q].size(); ++i) {
        const double v = p[q][i];
        p[q][i] = v + kStep;
        const double up = reference_loss(p, act, b, kRows).total;
        p[q][i] = v - kStep;
        const double down = reference_loss(p, act, b, kRows).total;
        p[q][i] = v;
        fd[i] = (up - down) / (2 * kStep);
      }
      worst = std::max(worst, expect_close_scaled(run.grads[0][q], fd, kTolerance,
                                                  "gradient " + std::to_string(q)));
    }
    std::printf(
        "[ physics ] %s: loss %.4e (physics %.4e); gradient vs float64 central differences: "
        "largest |g - fd| / max|fd| %.2e (tolerance %.0e)\n",
        to_string(act), ref.total, kWeight * ref.physics, worst, kTolerance);
  }
}

TEST(PhysicsLoss, EveryMeshEqualsOneRank) {
  constexpr double kTolerance = 1e-5;
  constexpr int kSteps = 3;
  constexpr float kLr = 0.002f;
  for (const Activation act : {Activation::tanh, Activation::gelu, Activation::silu}) {
    const StepsRun one = run_steps({"dp", {{"dp", 1}}}, act, /*self=*/true, kSteps, kLr);
    for (const testing::MeshCase& c : testing::layer_meshes(world_size())) {
      for (const bool reduce : {true, false}) {
        SCOPED_TRACE(std::string(to_string(act)) + " on " + testing::describe(c) +
                     (reduce ? "" : ", gradients reduced after backward"));
        const StepsRun got = run_steps(c, act, /*self=*/false, kSteps, kLr, reduce);
        double worst = 0.0;
        for (int step = 0; step < kSteps; ++step) {
          EXPECT_NEAR(got.data_losses[step], one.data_losses[step],
                      kTolerance * one.data_losses[step]);
          EXPECT_NEAR(got.physics_losses[step], one.physics_losses[step],
                      kTolerance * one.physics_losses[step]);
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
          std::printf("[ physics ] %s on %s%s: largest difference from one rank %.2e\n",
                      to_string(act), testing::describe(c).c_str(),
                      reduce ? "" : " (reduce_gradients)", worst);
        }
      }
    }
  }
}

void expect_bad_input(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << " accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(PhysicsLoss, Refusals) {
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
  shape.depth = 1;
  Mlp residual(shape, Activation::silu, replicated, context, 4);
  expect_bad_input([&] { residual.reserve_laplacian(2); }, "residual_mlp");
  // Reserved for the Jacobian (which residual models have), then asked for the Laplacian.
  residual.reserve_tangents(4);
  Matrix streams("streams", 4 * 4, 2);
  expect_bad_input([&] { residual.forward_laplacian(streams); }, "residual_mlp");
  PhysicsLossSettings none;
  none.inputs = {0, 1};
  expect_bad_input([&] { PhysicsLoss(none, context, 4, 2, 1, FeatureLayout::replicated); },
                   "no residual function");
  PhysicsLossSettings repeated = physics_settings();
  repeated.inputs = {1, 1};
  repeated.input_std = {};
  repeated.target_mean = {0.0};
  repeated.target_std = {};
  expect_bad_input([&] { PhysicsLoss(repeated, context, 4, 2, 1, FeatureLayout::replicated); },
                   "chosen twice");
}

}  // namespace
}  // namespace meshtrain
