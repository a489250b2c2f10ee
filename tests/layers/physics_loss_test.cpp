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
//     of every step (1e-5 at step 0, doubling each step) and the parameters after within 1e-5
//     of the tensor's largest value; the
//     step's passes make no Kokkos allocation; gradients reduced in the backward and left for
//     reduce_gradients().
//   * ResidualLaplacianMatchesFiniteDifferences, ResidualGradientsMatchFloat64CentralDifferences
//     (np 1): the same for residual_mlps (4-8-...-2, hidden 16, 2 blocks; LayerNorm + silu,
//     RMSNorm + tanh, RMSNorm + SwiGLU; the norms' scales and biases perturbed from 1 and 0),
//     against a float64
//     reference of jets (value, k first and k diagonal second derivatives through every
//     operation of the forward, norms included), itself against central differences; the
//     gradients to 1e-5 of each tensor's largest |fd|. The mesh test runs them too.
//   * DropoutLaplacianMatchesFiniteDifferences, DropoutGradientsMatchFloat64CentralDifferences
//     (np 1): the same with dropout (0.3) in an mlp (tanh) and residual_mlps (LayerNorm + silu,
//     RMSNorm + SwiGLU), every forward a training pass: the float64 references draw the same
//     mask (dropout_bits, the pass's key) and hold it fixed, so their central differences are of
//     the model with that mask. The mesh test runs them too (the mask is the same on any mesh).
//   * Refusals: no residual function, a repeated column, a pass before reserve_laplacian (MoE
//     models accepted: tests/layers/physics_moe_test.cpp).

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/activation.hpp"
#include "layers/context.hpp"
#include "layers/dropout.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "layers/physics_loss.hpp"
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
constexpr int64_t kK = 2, kOutputs = 2, kResiduals = 2;
// 4 entries: the residual models take 4 inputs, the mlp the first 3.
const std::vector<double> kInputMean = {0.1, -0.2, 0.3, 0.05};
const std::vector<double> kInputStd = {0.5, 2.0, 1.5, 0.8};
const std::vector<double> kTargetMean = {0.5, -1.0};
const std::vector<double> kTargetStd = {3.0, 0.25};
constexpr double kWeight = 0.7;
constexpr uint64_t kSeed = 7;
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
Batch make_batch(int64_t rows, int step, int64_t in = kSizes.front()) {
  const int64_t out = kSizes.back();
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
// derivatives t'[o * k + d], s'[o * k + d], by forward propagation in float64. With dropout,
// global row `row`'s mask of step 0 (held fixed: a constant factor per feature).
struct Propagated {
  std::vector<double> u, t, s;
};
Propagated propagate(const std::vector<Tensor>& p, Activation act, const double* x_row,
                     int64_t row = 0, double dropout = 0.0) {
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
        const double keep = dropout_factor(dropout, row, j, static_cast<int64_t>(l));
        const double f1 = testing::activation_derivative(act, z[j]);
        const double f2 = second_derivative(act, z[j]);
        for (int64_t d = 0; d < kK; ++d) {
          sz[d][j] = keep * (f1 * sz[d][j] + f2 * tz[d][j] * tz[d][j]);
          tz[d][j] *= keep * f1;
        }
        z[j] = keep * testing::activation(act, z[j]);
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
// The forward Laplacian of global row `row` (its dropout mask) at x_row.
using Propagation =
    std::function<Propagated(const std::vector<Tensor>& p, const double* x_row, int64_t row)>;

ReferenceLoss reference_loss_of(const std::vector<Tensor>& p, const Propagation& propagation,
                                const Batch& b, int64_t rows, int64_t in = kSizes.front()) {
  ReferenceLoss loss;
  for (int64_t r = 0; r < rows; ++r) {
    const Propagated n = propagation(p, &b.x[r * in], r);
    const UserUnits q = user_units(n);
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

ReferenceLoss reference_loss(const std::vector<Tensor>& p, Activation act, const Batch& b,
                             int64_t rows) {
  return reference_loss_of(
      p,
      [act](const std::vector<Tensor>& q, const double* x, int64_t) {
        return propagate(q, act, x);
      },
      b, rows);
}

// ---- a residual_mlp's float64 reference: jets ---------------------------------------------------
// A number with its first and diagonal second derivatives along the k seed directions: every
// operation of the model's forward (the norms' means, square roots and products included)
// propagates them by the chain rule, so the reference's d2u needs none of the layers' formulas.
struct Jet {
  double v = 0.0, t[kK] = {}, s[kK] = {};
};
Jet operator+(Jet a, const Jet& b) {
  a.v += b.v;
  for (int64_t d = 0; d < kK; ++d) a.t[d] += b.t[d], a.s[d] += b.s[d];
  return a;
}
Jet operator-(Jet a, const Jet& b) {
  a.v -= b.v;
  for (int64_t d = 0; d < kK; ++d) a.t[d] -= b.t[d], a.s[d] -= b.s[d];
  return a;
}
Jet operator*(double c, Jet a) {
  a.v *= c;
  for (int64_t d = 0; d < kK; ++d) a.t[d] *= c, a.s[d] *= c;
  return a;
}
Jet operator*(const Jet& a, const Jet& b) {
  Jet r;
  r.v = a.v * b.v;
  for (int64_t d = 0; d < kK; ++d) {
    r.t[d] = a.t[d] * b.v + a.v * b.t[d];
    r.s[d] = a.s[d] * b.v + 2.0 * a.t[d] * b.t[d] + a.v * b.s[d];
  }
  return r;
}
Jet constant(double c) {
  Jet r;
  r.v = c;
  return r;
}
// f(a) given f, f' and f'' at a.v.
Jet apply(const Jet& a, double f, double f1, double f2) {
  Jet r;
  r.v = f;
  for (int64_t d = 0; d < kK; ++d) {
    r.t[d] = f1 * a.t[d];
    r.s[d] = f1 * a.s[d] + f2 * a.t[d] * a.t[d];
  }
  return r;
}
Jet rsqrt(const Jet& a) {
  return apply(a, std::pow(a.v, -0.5), -0.5 * std::pow(a.v, -1.5), 0.75 * std::pow(a.v, -2.5));
}

std::vector<Jet> linear_jets(const std::vector<Jet>& in, const Tensor& w, const Tensor& b) {
  const size_t out = b.size();
  std::vector<Jet> y(out);
  for (size_t j = 0; j < out; ++j) {
    y[j] = constant(b[j]);
    for (size_t i = 0; i < in.size(); ++i) y[j] = y[j] + w[i * out + j] * in[i];
  }
  return y;
}

// LayerNorm (bias non-null) or RMSNorm, as docs/model_math.md defines them, in float64.
std::vector<Jet> norm_jets(const std::vector<Jet>& h, NormKind kind, const Tensor& scale,
                           const Tensor* bias) {
  const double n = static_cast<double>(h.size());
  std::vector<Jet> c = h, y(h.size());
  Jet second;
  if (kind == NormKind::layernorm) {
    Jet mean;
    for (const Jet& v : h) mean = mean + v;
    mean = (1.0 / n) * mean;
    for (Jet& v : c) v = v - mean;
    for (const Jet& v : c) second = second + v * v;
    second = (1.0 / n) * second + constant(static_cast<double>(kLayerNormEps));
  } else {
    for (const Jet& v : c) second = second + v * v;
    second = (1.0 / n) * second + constant(static_cast<double>(kRmsNormEps));
  }
  const Jet r = rsqrt(second);
  for (size_t j = 0; j < h.size(); ++j) {
    y[j] = scale[j] * (c[j] * r);
    if (bias) y[j] = y[j] + constant((*bias)[j]);
  }
  return y;
}

// The residual models of these tests: 3 inputs, 2 outputs, width 8, hidden 16, 2 blocks, a norm
// of `kind` in each block and before the output.
ResidualMlpShape residual_shape(NormKind kind, bool gated = false) {
  ResidualMlpShape shape;
  shape.inputs = 4;  // divides by tp (the stream is split under tp from the input layer on)
  shape.outputs = kSizes.back();
  shape.width = 8;
  shape.hidden = 16;
  shape.depth = 2;
  shape.norm = true;
  shape.norm_kind = kind;
  shape.gated = gated;  // SwiGLU blocks
  return shape;
}

// The forward Laplacian of the residual model, by jets (parameters in
// residual_mlp_parameter_shapes' order).
Propagated propagate_residual(const std::vector<Tensor>& p, NormKind kind, Activation act,
                              bool gated, const double* x_row, int64_t row = 0,
                              double dropout = 0.0) {
  const ResidualMlpShape shape = residual_shape(kind, gated);
  std::vector<Jet> x(shape.inputs);
  for (int64_t i = 0; i < shape.inputs; ++i) {
    x[i].v = x_row[i];
    for (int64_t d = 0; d < kK; ++d) x[i].t[d] = i == kChosen[d] ? 1.0 / kInputStd[i] : 0.0;
  }
  size_t q = 0;
  auto norm = [&](const std::vector<Jet>& h) {
    const Tensor& scale = p[q++];
    const Tensor* bias = kind == NormKind::layernorm ? &p[q++] : nullptr;
    return norm_jets(h, kind, scale, bias);
  };
  std::vector<Jet> h = linear_jets(x, p[0], p[1]);
  q = 2;
  for (int64_t block = 0; block < shape.depth; ++block) {
    std::vector<Jet> f = norm(h);
    std::vector<Jet> gate;
    if (gated) {  // silu(gate) * up
      gate = linear_jets(f, p[q], p[q + 1]);
      q += 2;
      act = Activation::silu;
    }
    f = linear_jets(f, p[q], p[q + 1]);
    q += 2;
    for (size_t j = 0; j < f.size(); ++j) {
      Jet& z = gated ? gate[j] : f[j];
      z = apply(z, testing::activation(act, z.v), testing::activation_derivative(act, z.v),
                second_derivative(act, z.v));
      if (gated) f[j] = gate[j] * f[j];
      f[j] = dropout_factor(dropout, row, static_cast<int64_t>(j), block) * f[j];  // fixed mask
    }
    f = linear_jets(f, p[q], p[q + 1]);
    q += 2;
    for (size_t j = 0; j < h.size(); ++j) h[j] = h[j] + f[j];
  }
  h = norm(h);
  const std::vector<Jet> y = linear_jets(h, p[q], p[q + 1]);
  Propagated result;
  for (int64_t o = 0; o < kOutputs; ++o) result.u.push_back(y[o].v);
  for (int64_t o = 0; o < kOutputs; ++o)
    for (int64_t d = 0; d < kK; ++d) {
      result.t.push_back(y[o].t[d]);
      result.s.push_back(y[o].s[d]);
    }
  return result;
}

// Which model a test runs: the plain mlp kSizes (residual false) or residual_shape(norm).
struct ModelCase {
  bool residual = false;
  NormKind norm = NormKind::layernorm;
  Activation activation = Activation::tanh;
  bool gated = false;    // SwiGLU blocks (silu)
  double dropout = 0.0;  // model.dropout; > 0: every forward is a training pass
  std::string describe() const {
    return (residual ? std::string("residual_mlp ") + to_string(norm) + " " +
                           (gated ? std::string("swiglu") : to_string(activation))
                     : std::string("mlp ") + to_string(activation)) +
           (dropout > 0.0 ? " dropout" : "");
  }
  int64_t inputs() const { return residual ? residual_shape(norm).inputs : kSizes.front(); }
  Propagation propagation() const {
    const ModelCase m = *this;
    return [m](const std::vector<Tensor>& p, const double* x, int64_t row) {
      return m.residual ? propagate_residual(p, m.norm, m.activation, m.gated, x, row, m.dropout)
                        : propagate(p, m.activation, x, row, m.dropout);
    };
  }
};
const std::vector<ModelCase> kResidualCases = {
    {true, NormKind::layernorm, Activation::silu},
    {true, NormKind::rmsnorm, Activation::tanh},
    {true, NormKind::rmsnorm, Activation::silu, /*gated=*/true},
};
const std::vector<ModelCase> kDropoutCases = {
    {false, NormKind::layernorm, Activation::tanh, false, kDropout},
    {true, NormKind::layernorm, Activation::silu, false, kDropout},
    {true, NormKind::rmsnorm, Activation::silu, /*gated=*/true, kDropout},
};

// ---- the model on a mesh ------------------------------------------------------------------
struct MeshSetup {
  Mesh mesh;
  MeshCommunicators comms;
  ParallelContext context;
  ShardingPlan plan;
  MeshSetup(const testing::MeshCase& c, bool self, const ModelCase& model = {})
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
    plan = model.residual
               ? make_plan(residual_mlp_parameter_shapes(residual_shape(model.norm, model.gated)),
                           mesh, preset_rules(c.preset, false, /*norms=*/true, /*residual=*/true),
                           options)
               : make_plan(mlp_parameter_shapes(kSizes), mesh, preset_rules(c.preset), options);
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

Tensor to_tensor(MatrixView m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  Tensor t;
  for (size_t i = 0; i < h.extent(0); ++i)
    for (size_t j = 0; j < h.extent(1); ++j) t.push_back(h(i, j));
  return t;
}

PhysicsLossSettings physics_settings(int64_t inputs = kSizes.front()) {
  return {kChosen,     kResiduals, kWeight,        {kInputStd.begin(), kInputStd.begin() + inputs},
          kTargetMean, kTargetStd, residual_device};
}

struct StepsRun {
  std::vector<double> data_losses, physics_losses;
  std::vector<std::vector<Tensor>> grads;  // per step, full tensors
  std::vector<Tensor> initial, final_params;
  int64_t last_step_allocations = -1;
  std::string first_allocations;
};

// The norms' scales and biases away from 1 and 0 (a factor of scale left out of a derivative
// would not show at 1), the same global values on every mesh.
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

// The model of case m on s's mesh, `rows` local rows.
Mlp make_model(const ModelCase& m, MeshSetup& s, int64_t rows) {
  ParallelContext& context = s.context;
  return m.residual
             ? Mlp(residual_shape(m.norm, m.gated), m.activation, specs_from_plan(s.plan), context,
                   rows, m.dropout)
             : Mlp(kSizes, m.activation, specs_from_plan(s.plan), context, rows, {}, m.dropout);
}

// m.dropout > 0: every forward is a training pass (step `step`, this rank's first row).
StepsRun run_steps(const testing::MeshCase& c, const ModelCase& m, bool self, int steps, float lr,
                   bool reduce = true) {
  MeshSetup s(c, self, m);
  ParallelContext& context = s.context;
  MPI_Comm comm = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int64_t in = m.inputs();
  const int64_t rows = kRows / context.batch_parallel();
  const int64_t row0 = context.batch_index() * rows;
  Mlp model = make_model(m, s, rows);
  model.initialize(InitScheme::he_normal, kSeed);
  if (m.residual) perturb_norms(model);
  model.reserve_laplacian(kK);
  if (context.feature_parallel() > 1) {  // the tp meshes really split the layers
    bool split = false;
    for (const Linear& l : model.layers()) split = split || l.tensor_parallel();
    for (const std::string& line : model.describe()) {
      split = split || line.find("column-parallel") != std::string::npos;
    }
    EXPECT_TRUE(split) << "no tensor-parallel layer";
  }
  Loss loss(LossKind::mse, context, rows, kSizes.back(), model.output_layout());
  PhysicsLoss physics(physics_settings(in), context, rows, in, kSizes.back(),
                      model.output_layout());
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  Optimizer optimizer(sgd, model.parameters());
  StepsRun run;
  for (const auto& p : model.parameters())
    run.initial.push_back(testing::gather_full(p, s.mesh, context.rank(), comm));
  for (int step = 0; step < steps; ++step) {
    const Batch b = make_batch(kRows, step, in);
    const Matrix x = rows_of("x", b.x, in, row0, rows);
    const Matrix x_user = rows_of("x_user", b.x_user, in, row0, rows);
    const Matrix t = rows_of("t", b.t, kSizes.back(), row0, rows);
    const TrainingPass training = training_pass(step, row0);
    testing::KokkosAllocationCounter allocations;  // the step allocates nothing
    const MatrixView y = model.forward(x, m.dropout > 0.0 ? &training : nullptr);
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
    const StepsRun run =
        run_steps(one, ModelCase{false, NormKind::layernorm, act}, /*self=*/true, 1, 0.0f);
    const Batch b = make_batch(kRows, 0);
    std::vector<Tensor> p = run.initial;
    const ReferenceLoss ref = reference_loss(p, act, b, kRows);
    EXPECT_NEAR(run.data_losses[0], ref.data, 1e-5 * ref.data);
    EXPECT_NEAR(run.physics_losses[0], kWeight * ref.physics, 1e-5 * kWeight * ref.physics);
    double worst = 0.0;
    const std::vector<Tensor> fd = testing::central_differences(
        p, [&](const std::vector<Tensor>& v) { return reference_loss(v, act, b, kRows).total; },
        kStep);
    for (size_t q = 0; q < p.size(); ++q) {
      worst = std::max(worst, expect_close_scaled(run.grads[0][q], fd[q], kTolerance,
                                                  "gradient " + std::to_string(q)));
    }
    std::printf(
        "[ physics ] %s: loss %.4e (physics %.4e); gradient vs float64 central differences: "
        "largest |g - fd| / max|fd| %.2e (tolerance %.0e)\n",
        to_string(act), ref.total, kWeight * ref.physics, worst, kTolerance);
  }
}

// The layers' u, du, d2u against the case's float64 forward Laplacian (the residual models': jets),
// which is checked against central differences of its own value forward.
void expect_laplacian_matches_reference(const std::vector<ModelCase>& cases) {
  constexpr double kStep = 1e-4;
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  for (const ModelCase& m : cases) {
    SCOPED_TRACE(m.describe());
    const int64_t in = m.inputs();
    MeshSetup s(one, true, m);
    Mlp model = make_model(m, s, kRows);
    model.initialize(InitScheme::he_normal, kSeed);
    if (m.residual) perturb_norms(model);
    model.reserve_laplacian(kK);
    PhysicsLoss physics(physics_settings(in), s.context, kRows, in, kOutputs,
                        model.output_layout());
    std::vector<Tensor> p;
    for (const auto& q : model.parameters())
      p.push_back(testing::gather_full(q, s.mesh, 0, MPI_COMM_SELF));
    const Propagation propagation = m.propagation();
    const Batch b = make_batch(kRows, 0, in);
    const Matrix x = rows_of("x", b.x, in, 0, kRows);
    const TrainingPass training = training_pass(0, 0);
    const Tensor y = to_tensor(model.forward(x, m.dropout > 0.0 ? &training : nullptr));
    const Tensor streams = to_tensor(model.forward_laplacian(physics.seeds()));
    Tensor got_u, got_t, got_s, ref_u, ref_t, ref_s, fd_t, fd_s;
    for (int64_t r = 0; r < kRows; ++r) {
      const Propagated n = propagation(p, &b.x[r * in], r);
      for (int64_t o = 0; o < kOutputs; ++o) {
        got_u.push_back(y[r * kOutputs + o]);
        ref_u.push_back(n.u[o]);
        for (int64_t d = 0; d < kK; ++d) {
          got_t.push_back(streams[(r * 2 * kK + d) * kOutputs + o]);
          got_s.push_back(streams[(r * 2 * kK + kK + d) * kOutputs + o]);
          ref_t.push_back(n.t[o * kK + d]);
          ref_s.push_back(n.s[o * kK + d]);
          const int64_t i = kChosen[d];
          std::vector<double> xp(&b.x[r * in], &b.x[r * in] + in), xm = xp;
          xp[i] += kStep / kInputStd[i];
          xm[i] -= kStep / kInputStd[i];
          const double up = propagation(p, xp.data(), r).u[o];
          const double down = propagation(p, xm.data(), r).u[o];
          fd_t.push_back((up - down) / (2 * kStep));
          fd_s.push_back((up - 2 * n.u[o] + down) / (kStep * kStep));
        }
      }
    }
    // The differences' truncation (h^2 f''' / 6) is larger through the norms than in the
    // plain mlp: 2.4e-7 of the largest |du| measured, hence 1e-6 for du here.
    const double ref_t_err = expect_close_scaled(ref_t, fd_t, 1e-6, "reference du vs fd");
    const double ref_s_err = expect_close_scaled(fd_s, ref_s, 1e-5, "reference d2u vs fd");
    const double u_err = expect_close_scaled(got_u, ref_u, 1e-5, "u");
    const double t_err = expect_close_scaled(got_t, ref_t, 1e-5, "du");
    const double s_err = expect_close_scaled(got_s, ref_s, 1e-5, "d2u");
    std::printf(
        "[ physics ] %s: reference vs fd du %.1e d2u %.1e; layers vs reference u %.1e du %.1e "
        "d2u %.1e\n",
        m.describe().c_str(), ref_t_err, ref_s_err, u_err, t_err, s_err);
  }
}

// Every parameter gradient of L through the cases (the norms' scales and biases included)
// against central differences of their float64 L.
void expect_gradients_match_reference(const std::vector<ModelCase>& cases) {
  constexpr double kStep = 1e-6, kTolerance = 1e-5;
  const testing::MeshCase one{"dp", {{"dp", 1}}};
  for (const ModelCase& m : cases) {
    SCOPED_TRACE(m.describe());
    const StepsRun run = run_steps(one, m, /*self=*/true, 1, 0.0f);
    const Batch b = make_batch(kRows, 0, m.inputs());
    std::vector<Tensor> p = run.initial;
    const Propagation propagation = m.propagation();
    const ReferenceLoss ref = reference_loss_of(p, propagation, b, kRows, m.inputs());
    EXPECT_NEAR(run.data_losses[0], ref.data, 1e-5 * ref.data);
    EXPECT_NEAR(run.physics_losses[0], kWeight * ref.physics, 1e-5 * kWeight * ref.physics);
    double worst = 0.0;
    const std::vector<Tensor> fd = testing::central_differences(
        p,
        [&](const std::vector<Tensor>& v) {
          return reference_loss_of(v, propagation, b, kRows, m.inputs()).total;
        },
        kStep);
    for (size_t q = 0; q < p.size(); ++q) {
      worst = std::max(worst, expect_close_scaled(run.grads[0][q], fd[q], kTolerance,
                                                  "gradient " + std::to_string(q)));
    }
    std::printf(
        "[ physics ] %s: loss %.4e (physics %.4e); gradient vs float64 central differences: "
        "largest |g - fd| / max|fd| %.2e (tolerance %.0e)\n",
        m.describe().c_str(), ref.total, kWeight * ref.physics, worst, kTolerance);
  }
}

TEST(PhysicsLoss, ResidualLaplacianMatchesFiniteDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  expect_laplacian_matches_reference(kResidualCases);
}

TEST(PhysicsLoss, ResidualGradientsMatchFloat64CentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  expect_gradients_match_reference(kResidualCases);
}

// Dropout in a training pass: a fixed mask per row, so the model's derivatives are those of the
// model with that mask (the references draw it from the same key).
TEST(PhysicsLoss, DropoutLaplacianMatchesFiniteDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  expect_laplacian_matches_reference(kDropoutCases);
}

TEST(PhysicsLoss, DropoutGradientsMatchFloat64CentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  expect_gradients_match_reference(kDropoutCases);
}

// The activation's second-order kernels read tanh's derivatives from the forward's output when
// given it (activation.hpp): the same floats as computing tanh(z) again, so bit for bit the same
// streams and gradients, for every activation (those without a formula in f(z) ignore it).
TEST(PhysicsLoss, SecondOrderFromForwardOutputIsBitForBit) {
  if (world_size() > 1) GTEST_SKIP() << "one process";
  constexpr int64_t rows = 37, width = 149, k = 3;  // 149: two chunks of 64 and a rest
  for (const Activation act : kActivations) {
    SCOPED_TRACE(std::string(to_string(act)));
    Matrix z("z", rows, width), y("y", rows, width), streams("streams", rows * 2 * k, width);
    Matrix grad_a("grad_a", rows, width), grad_b("grad_b", rows, width);
    Matrix sg("sg", rows * 2 * k, width);
    auto fill = [](Matrix& m, uint64_t stream, double scale) {
      auto h = Kokkos::create_mirror_view(m);
      for (size_t i = 0; i < h.extent(0); ++i)
        for (size_t j = 0; j < h.extent(1); ++j)
          h(i, j) = static_cast<float>(scale * counter_normal(kSeed, stream, i * h.extent(1) + j));
      Kokkos::deep_copy(m, h);
    };
    fill(z, 1, 2.0);
    fill(streams, 2, 1.0);
    fill(grad_a, 3, 1.0);
    fill(sg, 4, 1.0);
    Kokkos::deep_copy(grad_b, grad_a);
    activation_forward(act, z, y, Dtype::fp32);
    Matrix out_a("out_a", rows * 2 * k, width), out_b("out_b", rows * 2 * k, width);
    activation_second_order(act, z, streams, out_a);
    activation_second_order(act, z, streams, out_b, y);
    Matrix in_a("in_a", rows * 2 * k, width), in_b("in_b", rows * 2 * k, width);
    activation_second_order_backward(act, z, streams, grad_a, sg, in_a);
    activation_second_order_backward(act, z, streams, grad_b, sg, in_b, y);
    for (const auto& [a, b] :
         {std::pair<Matrix, Matrix>{out_a, out_b}, {in_a, in_b}, {grad_a, grad_b}}) {
      const Tensor ta = to_tensor(a), tb = to_tensor(b);
      size_t differing = 0;
      for (size_t i = 0; i < ta.size(); ++i) differing += ta[i] != tb[i] ? 1 : 0;
      EXPECT_EQ(differing, 0u) << a.label();
    }
  }
}

TEST(PhysicsLoss, EveryMeshEqualsOneRank) {
  constexpr double kTolerance = 1e-5;
  constexpr int kSteps = 3;
  constexpr float kLr = 0.002f;
  std::vector<ModelCase> models;
  for (const Activation act : {Activation::tanh, Activation::gelu, Activation::silu}) {
    models.push_back({false, NormKind::layernorm, act});
  }
  models.insert(models.end(), kResidualCases.begin(), kResidualCases.end());
  models.insert(models.end(), kDropoutCases.begin(), kDropoutCases.end());
  for (const ModelCase& m : models) {
    // The residual models' physics gradients are far larger (their d2u through the norms): a
    // step of kLr would diverge (the loss 58 -> 7.7e3 -> 6e5), where rounding differences grow
    // without bound; 100 times smaller steps descend.
    const float lr = m.residual ? kLr / 100 : kLr;
    const StepsRun one = run_steps({"dp", {{"dp", 1}}}, m, /*self=*/true, kSteps, lr);
    for (const testing::MeshCase& c : testing::layer_meshes(world_size())) {
      for (const bool reduce : {true, false}) {
        SCOPED_TRACE(m.describe() + " on " + testing::describe(c) +
                     (reduce ? "" : ", gradients reduced after backward"));
        const StepsRun got = run_steps(c, m, /*self=*/false, kSteps, lr, reduce);
        double worst = 0.0;
        for (int step = 0; step < kSteps; ++step) {
          EXPECT_NEAR(got.data_losses[step], one.data_losses[step],
                      kTolerance * one.data_losses[step]);
          EXPECT_NEAR(got.physics_losses[step], one.physics_losses[step],
                      kTolerance * one.physics_losses[step]);
          // A step's gradients carry the rounding differences of the updates before it,
          // amplified through the second-order terms: the tolerance doubles each step (measured,
          // residual rmsnorm swiglu dropout on tp2: 1.8e-6, 2.2e-6, 1.0e-5 on oneDNN; 2.0e-6,
          // 2.4e-6, 7.8e-6 on OpenBLAS). A wrong term shows at step 0, at 1e-5.
          const double grad_tolerance = kTolerance * static_cast<double>(1 << step);
          for (size_t q = 0; q < one.grads[step].size(); ++q) {
            worst = std::max(
                worst, expect_close_scaled(
                           got.grads[step][q], one.grads[step][q], grad_tolerance,
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
                      m.describe().c_str(), testing::describe(c).c_str(),
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
  // Reserved for the Jacobian only, the pass is refused by name (the norms' streams need
  // reserve_laplacian's room), not an internal error inside a layer.
  residual.reserve_tangents(4);
  Matrix unreserved("unreserved streams", 4 * 4, 2);
  expect_bad_input([&] { residual.forward_laplacian(unreserved); },
                   "call reserve_laplacian(k) before it");
  residual.reserve_laplacian(2);  // LayerNorm or RMSNorm residual blocks: supported
  Mlp with_dropout(shape, Activation::silu, replicated, context, 4, 0.1);
  EXPECT_NO_THROW(with_dropout.reserve_laplacian(2));  // dropout: supported
  // MoE blocks too (tests/layers/physics_moe_test.cpp); reserved for the Jacobian only, the pass
  // is refused by name as above.
  ResidualMlpShape moe = shape;
  moe.moe.layers = {0};
  moe.moe.experts = 2;
  moe.moe.top_k = 1;
  Mlp with_moe(moe, Activation::silu, replicated, context, 4);
  with_moe.reserve_tangents(4);
  Matrix streams("streams", 4 * 4, 2);
  expect_bad_input([&] { with_moe.forward_laplacian(streams); },
                   "call reserve_laplacian(k) before it");
  EXPECT_NO_THROW(with_moe.reserve_laplacian(2));
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
