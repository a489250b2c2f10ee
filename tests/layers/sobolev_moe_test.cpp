// Training on derivatives (Sobolev training, docs/derivatives.md) through MoE layers:
// Mlp::backward_with_tangents with DerivativeLoss, the loss
//   L = mse(y, t) + lambda * mean of (dy_pred - dy_t)^2 + the MoE load-balancing loss
// with dy_pred the Jacobian in the user's units (input_std and target_std != 1), the routing of
// each row held fixed (the derivative of the piece the forward chose).
//
// Two models, 4 experts, top 2, aux_loss_coef 0.01:
//   * mlp 4-8-6-2 with layer 1 an MoE layer of linear experts (tanh, gelu between the layers),
//     and with layer 0 (the model's first layer, on the input and its seeds) instead (tanh);
//   * residual_mlp 3 -> 6, one block without norm whose feed-forward is an MoE layer of
//     activation experts (6 -> 8 -> 6; tanh, silu) or of SwiGLU experts, -> 2; and 4 -> 6 (silu,
//     SwiGLU), whose stream the input layer splits under tp, so that the MoE block takes its
//     split-input path (gathers its input, keeps its block of the output and input gradients).
//
//   * GradientsMatchFloat64CentralDifferences (np 1): both losses against a float64 forward of
//     L written here from docs/model_math.md and docs/derivatives.md (plain loops, no layer
//     code; the router's softmax and renormalized gates, their tangents by the formulas of
//     docs/derivatives.md, the experts' tangents by f' only), and every parameter gradient
//     against its central differences (h = 1e-6, the routing of the unperturbed forward held
//     fixed, as the layer differentiates): |got - fd| <= 2e-6 max |fd| per tensor.
//   * EveryMeshEqualsOneRank (np 1, 2, 4): 3 SGD steps (lr 0.02, SwiGLU 4e-4, the 4-input silu
//     residual_mlp 0.005, see ModelCase::lr) on ep, dp, fsdp,
//     tp and (np 4) ep4, dp x ep, fsdp x ep, ep x tp against the same steps on one rank
//     (MPI_COMM_SELF) in the same test: losses, every gradient of every step and the parameters
//     after, within 1e-5 of the tensor's largest |value|; the step's passes allocate nothing
//     (Kokkos allocations counted). Each mesh twice: gradients reduced in backward_with_tangents,
//     and left for reduce_gradients(). On tp the layers' reported layouts show the feature-axis
//     paths taken (the MoE layer's input gathered over tp, a block's output split, Linears split).
//   * AcceptsTheLaplacian: reserve_tangent_backward and reserve_laplacian accept every kind of
//     expert (the forward Laplacian's checks: tests/layers/physics_moe_test.cpp).

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
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/context.hpp"
#include "layers/derivative_loss.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/linear_layout.hpp"
#include "partition/logical_axes.hpp"
#include "partition/moe_layout.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/expect_close.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::expect_close_scaled;
using testing::rows_of;
using testing::Tensor;
using Vec = std::vector<double>;

constexpr int64_t kRows = 16;                 // global batch (divides by 1, 2, 4)
constexpr int64_t kInputs = 3, kOutputs = 2;  // the residual_mlps'; the mlps' 4 (ModelCase)
constexpr int64_t kExperts = 4, kTopK = 2;
constexpr double kAuxCoef = 0.01;
const std::vector<int64_t> kMlpSizes = {4, 8, 6, 2};  // layer 1 (or 0): MoE, linear experts
constexpr int64_t kWidth = 6, kHidden = 8;            // the residual_mlp's
const std::vector<int64_t> kChosen = {0, 2};          // k = 2 of the input columns
const std::vector<double> kInputStd = {0.5, 2.0, 1.5};
const std::vector<double> kTargetStd = {3.0, 0.25};
constexpr double kLambda = 0.7;
constexpr uint64_t kSeed = 11;

struct ModelCase {
  bool residual = false;  // false: the mlp with linear experts
  Activation act = Activation::tanh;
  bool gated = false;     // the residual_mlp's experts SwiGLU (act: silu)
  int64_t moe_layer = 1;  // the mlp's MoE layer: 1, or 0 (the model's first layer)
  // The residual_mlps' inputs: 3 or 4. The mlps have 4, so that under tp the first layer splits
  // them (a width that does not divide by tp is replicated): layers/0 column-parallel and the
  // MoE layer 1 after it gathering its split input, or an MoE layer 0's experts split over tp
  // (and fsdp) on their input dim. With 3 inputs a residual_mlp's stream stays whole under tp
  // (its one block is MoE, which the planner does not follow); with 4 the input layer splits
  // the stream (6 = 3 + 3 over tp2), so the MoE block gathers its split input and hands back
  // its block of the output and of the input gradients (the split-input path).
  int64_t residual_inputs = kInputs;
  int64_t inputs() const { return residual ? residual_inputs : 4; }
  bool split_stream() const { return residual && residual_inputs == 4; }
  // SGD's step: 0.02; SwiGLU experts 50 times smaller (their products grow faster: at 0.02 the
  // 3 steps are not finite). The 4-input silu residual_mlp 4 times smaller: at 0.02 its
  // loss grows 100-fold by step 3 (data 36 -> 3.9e3, derivative 73 -> 2.9e4, gradients 80 ->
  // 2.4e4), which magnifies the float32 rounding of the first step (1e-7) to 1.2e-5 of the
  // gradients on dp2, beyond the tolerance; one rank fed the same 16 rows in reverse order
  // (the same sums in another order) drifts as far, 1.25e-5: rounding, not a wrong term
  // (docs/derivatives.md, "MoE layers").
  float lr(float base) const {
    if (gated) return 0.02f * base;
    return split_stream() ? 0.25f * base : base;
  }
  std::vector<double> input_std() const {
    std::vector<double> s = kInputStd;
    if (inputs() == 4) s.push_back(1.0);
    return s;
  }
  std::string name() const {
    const std::string split = split_stream() ? ", 4 inputs (stream split under tp)" : "";
    if (gated) return "residual_mlp, SwiGLU experts" + split;
    if (residual) return "residual_mlp, activation experts, " + std::string(to_string(act)) + split;
    return "mlp, linear experts in layer " + std::to_string(moe_layer) + ", " + to_string(act);
  }
};
const std::vector<ModelCase> kModels = {{false, Activation::tanh},
                                        {false, Activation::gelu},
                                        {false, Activation::tanh, false, 0},
                                        {true, Activation::tanh},
                                        {true, Activation::silu},
                                        {true, Activation::silu, true},
                                        {true, Activation::silu, false, 1, 4},
                                        {true, Activation::silu, true, 1, 4}};

// The mlp's MoE layer, or the residual_mlp's block 0.
MoeSettings moe_settings(int64_t layer) {
  return MoeSettings{{layer}, kExperts, kTopK, kAuxCoef};
}
ResidualMlpShape residual_shape(bool gated = false, int64_t inputs = kInputs) {
  ResidualMlpShape shape;
  shape.inputs = inputs;
  shape.outputs = kOutputs;
  shape.width = kWidth;
  shape.hidden = kHidden;
  shape.depth = 1;
  shape.norm = false;
  shape.gated = gated;
  shape.moe = moe_settings(0);
  return shape;
}

// The global batch: x [rows, in], t [rows, out], dy_t [rows, out, k].
struct Batch {
  Tensor x, t, dyt;
};
Batch make_batch(int64_t rows, int64_t k, int step, int64_t inputs = kInputs) {
  const uint64_t s = kSeed + 100 * static_cast<uint64_t>(step);
  Batch b;
  for (int64_t i = 0; i < rows * inputs; ++i) b.x.push_back(counter_normal(s, name_stream("x"), i));
  for (int64_t i = 0; i < rows * kOutputs; ++i)
    b.t.push_back(counter_normal(s, name_stream("t"), i));
  for (int64_t i = 0; i < rows * kOutputs * k; ++i)
    b.dyt.push_back(2.0 * counter_normal(s, name_stream("dy"), i));
  return b;
}

// ---- the float64 reference ---------------------------------------------------------------
// The routing: each global row's chosen experts (empty: choose them, the k largest
// probabilities, the lower index on ties, and record them).
using Routing = std::vector<std::vector<int>>;

// a (value) and t (k tangents) through x W + b (t: x W).
void linear(const Vec& a, const std::vector<Vec>& t, const double* w, const double* b, int64_t in,
            int64_t out, Vec& z, std::vector<Vec>& tz) {
  z.assign(b, b + out);
  tz.assign(t.size(), Vec(out, 0.0));
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) {
      z[j] += a[i] * w[i * out + j];
      for (size_t d = 0; d < t.size(); ++d) tz[d][j] += t[d][i] * w[i * out + j];
    }
}
void activate(Activation act, Vec& z, std::vector<Vec>& tz) {
  for (size_t j = 0; j < z.size(); ++j) {
    const double slope = testing::activation_derivative(act, z[j]);
    for (auto& t : tz) t[j] *= slope;
    z[j] = testing::activation(act, z[j]);
  }
}

// expert(e, a, t, y, ty): expert e's value and tangents.
using Expert =
    std::function<void(int64_t, const Vec&, const std::vector<Vec>&, Vec&, std::vector<Vec>&)>;
struct AuxStats {
  Vec rows = Vec(kExperts, 0.0), probs = Vec(kExperts, 0.0);
};
// One row through the MoE layer (docs/derivatives.md): logits l = a Wr, p = softmax(l), gates
// g_s = p_s / P over the chosen, y = sum g_s y_s; tangents dl = t Wr, dp = p (dl - p . dl),
// dg_s = (dp_s - g_s dP) / P, ty = sum dg_s y_s + g_s ty_s.
void moe_row(const Vec& a, const std::vector<Vec>& t, const Tensor& wr, int64_t in, int64_t out,
             const Expert& expert, std::vector<int>& chosen, AuxStats& stats, Vec& y,
             std::vector<Vec>& ty) {
  const size_t k = t.size();
  Vec l(kExperts, 0.0), p(kExperts);
  std::vector<Vec> tl(k, Vec(kExperts, 0.0));
  for (int64_t i = 0; i < in; ++i)
    for (int64_t e = 0; e < kExperts; ++e) {
      l[e] += a[i] * wr[i * kExperts + e];
      for (size_t d = 0; d < k; ++d) tl[d][e] += t[d][i] * wr[i * kExperts + e];
    }
  const double top = *std::max_element(l.begin(), l.end());
  double sum = 0.0;
  for (int64_t e = 0; e < kExperts; ++e) sum += p[e] = std::exp(l[e] - top);
  for (double& v : p) v /= sum;
  if (chosen.empty()) {
    for (int64_t s = 0; s < kTopK; ++s) {
      int best = -1;
      for (int e = 0; e < kExperts; ++e) {
        if (std::find(chosen.begin(), chosen.end(), e) != chosen.end()) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      chosen.push_back(best);
    }
  }
  for (int64_t e = 0; e < kExperts; ++e) stats.probs[e] += p[e];
  double chosen_sum = 0.0;
  for (int e : chosen) {
    chosen_sum += p[e];
    stats.rows[e] += 1.0;
  }
  y.assign(out, 0.0);
  ty.assign(k, Vec(out, 0.0));
  std::vector<Vec> dp(k, Vec(kExperts));
  Vec dp_sum(k, 0.0);
  for (size_t d = 0; d < k; ++d) {
    double dot = 0.0;
    for (int64_t e = 0; e < kExperts; ++e) dot += p[e] * tl[d][e];
    for (int64_t e = 0; e < kExperts; ++e) dp[d][e] = p[e] * (tl[d][e] - dot);
    for (int e : chosen) dp_sum[d] += dp[d][e];
  }
  for (int e : chosen) {
    Vec ye;
    std::vector<Vec> tye;
    expert(e, a, t, ye, tye);
    const double g = p[e] / chosen_sum;
    for (int64_t c = 0; c < out; ++c) y[c] += g * ye[c];
    for (size_t d = 0; d < k; ++d) {
      const double dg = (dp[d][e] - g * dp_sum[d]) / chosen_sum;
      for (int64_t c = 0; c < out; ++c) ty[d][c] += dg * ye[c] + g * tye[d][c];
    }
  }
}

struct ReferenceLoss {
  double data = 0, derivative = 0, aux = 0, total = 0;
};
// p: the parameters in the model's order (mlp_parameter_shapes, residual_mlp_parameter_shapes).
ReferenceLoss reference_loss(const ModelCase& m, const std::vector<Tensor>& p, const Batch& b,
                             Routing& routing) {
  const int64_t k = static_cast<int64_t>(kChosen.size());
  ReferenceLoss loss;
  AuxStats stats;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t inputs = m.inputs();
    Vec a(b.x.begin() + r * inputs, b.x.begin() + (r + 1) * inputs);
    std::vector<Vec> t(k, Vec(inputs, 0.0));
    for (int64_t d = 0; d < k; ++d) t[d][kChosen[d]] = 1.0 / kInputStd[kChosen[d]];
    Vec z, y;
    std::vector<Vec> tz, ty;
    if (!m.residual && m.moe_layer == 0) {
      // layer 0 MoE on the model's input (router [4, E], experts weight [E, 4, 8], bias
      // [E, 8]; the tangents are the seeds), act; layer 1 linear, act; layer 2 linear.
      const int64_t in = inputs, out = kMlpSizes[1];
      const Expert expert = [&](int64_t e, const Vec& x, const std::vector<Vec>& tx, Vec& ye,
                                std::vector<Vec>& tye) {
        linear(x, tx, p[1].data() + e * in * out, p[2].data() + e * out, in, out, ye, tye);
      };
      moe_row(a, t, p[0], in, out, expert, routing[r], stats, y, ty);
      activate(m.act, y, ty);
      linear(y, ty, p[3].data(), p[4].data(), kMlpSizes[1], kMlpSizes[2], z, tz);
      activate(m.act, z, tz);
      linear(z, tz, p[5].data(), p[6].data(), kMlpSizes[2], kMlpSizes[3], y, ty);
      z = y;
      tz = ty;
    } else if (!m.residual) {
      // layer 0 linear, act; layer 1 MoE (router, experts weight [E, 8, 6], bias [E, 6]), act;
      // layer 2 linear.
      linear(a, t, p[0].data(), p[1].data(), kMlpSizes[0], kMlpSizes[1], z, tz);
      activate(m.act, z, tz);
      const int64_t in = kMlpSizes[1], out = kMlpSizes[2];
      const Expert expert = [&](int64_t e, const Vec& x, const std::vector<Vec>& tx, Vec& ye,
                                std::vector<Vec>& tye) {
        linear(x, tx, p[3].data() + e * in * out, p[4].data() + e * out, in, out, ye, tye);
      };
      moe_row(z, tz, p[2], in, out, expert, routing[r], stats, y, ty);
      activate(m.act, y, ty);
      linear(y, ty, p[5].data(), p[6].data(), kMlpSizes[2], kMlpSizes[3], z, tz);
    } else {
      // input (p0, p1); block 0: router p2, (SwiGLU: gate weight [E, 6, 8], gate bias,) up
      // weight [E, 6, 8], up bias, down weight [E, 8, 6], down bias; output. h1 = h0 + moe(h0).
      const size_t up = m.gated ? 5 : 3;
      Vec h;
      std::vector<Vec> th;
      linear(a, t, p[0].data(), p[1].data(), inputs, kWidth, h, th);
      const Expert expert = [&](int64_t e, const Vec& x, const std::vector<Vec>& tx, Vec& ye,
                                std::vector<Vec>& tye) {
        Vec u;
        std::vector<Vec> tu;
        linear(x, tx, p[up].data() + e * kWidth * kHidden, p[up + 1].data() + e * kHidden, kWidth,
               kHidden, u, tu);
        if (m.gated) {  // silu(gate) * up; its tangent silu'(gate) t_gate up + silu(gate) t_up
          Vec g;
          std::vector<Vec> tg;
          linear(x, tx, p[3].data() + e * kWidth * kHidden, p[4].data() + e * kHidden, kWidth,
                 kHidden, g, tg);
          for (int64_t j = 0; j < kHidden; ++j) {
            const double s = testing::activation(Activation::silu, g[j]);
            const double ds = testing::activation_derivative(Activation::silu, g[j]);
            for (size_t d = 0; d < tu.size(); ++d) tu[d][j] = ds * tg[d][j] * u[j] + s * tu[d][j];
            u[j] *= s;
          }
        } else {
          activate(m.act, u, tu);
        }
        linear(u, tu, p[up + 2].data() + e * kHidden * kWidth, p[up + 3].data() + e * kWidth,
               kHidden, kWidth, ye, tye);
      };
      moe_row(h, th, p[2], kWidth, kWidth, expert, routing[r], stats, y, ty);
      for (int64_t c = 0; c < kWidth; ++c) {
        y[c] += h[c];
        for (int64_t d = 0; d < k; ++d) ty[d][c] += th[d][c];
      }
      linear(y, ty, p[up + 4].data(), p[up + 5].data(), kWidth, kOutputs, z, tz);
    }
    for (int64_t o = 0; o < kOutputs; ++o) {
      const double e = z[o] - b.t[r * kOutputs + o];
      loss.data += e * e / kRows;
      for (int64_t d = 0; d < k; ++d) {
        const double e2 = kTargetStd[o] * tz[d][o] - b.dyt[(r * kOutputs + o) * k + d];
        loss.derivative += e2 * e2 / static_cast<double>(kRows * kOutputs * k);
      }
    }
  }
  double balance = 0.0;
  for (int64_t e = 0; e < kExperts; ++e) balance += stats.rows[e] * stats.probs[e];
  loss.aux = kAuxCoef * kExperts * balance / (double(kRows) * kRows);
  loss.total = loss.data + kLambda * loss.derivative + loss.aux;
  return loss;
}

// ---- the model on a mesh ----------------------------------------------------------------
struct MeshCase {
  std::string name;
  int dp = 1, fsdp = 1, ep = 1, tp = 1;
  std::string preset;
};
std::vector<MeshCase> meshes_for(int n) {
  if (n == 1) return {{"single", 1, 1, 1, 1, "dp"}};
  if (n == 2) {
    return {{"ep2", 1, 1, 2, 1, "dp"},
            {"dp2", 2, 1, 1, 1, "dp"},
            {"fsdp2", 1, 2, 1, 1, "fsdp"},
            {"tp2", 1, 1, 1, 2, "fsdp_tp"}};
  }
  if (n == 4) {
    return {{"ep4", 1, 1, 4, 1, "dp"},
            {"dp2_ep2", 2, 1, 2, 1, "dp"},
            {"fsdp2_ep2", 1, 2, 2, 1, "fsdp"},
            {"ep2_tp2", 1, 1, 2, 2, "fsdp_tp"}};
  }
  return {};
}

struct StepsRun {
  std::vector<double> data_losses, derivative_losses, aux_losses;
  std::vector<std::vector<Tensor>> grads;  // per step, full tensors
  std::vector<Tensor> initial, final_params;
  int64_t last_step_allocations = -1;
  std::string first_allocations;
  std::vector<std::string> built;      // the MoE layers' describe()
  std::vector<std::string> described;  // every layer's describe()
};

// reduce = false: the gradients are left for reduce_gradients(), as gradient accumulation runs
// it (the MoE layers reduce theirs in the backward either way).
StepsRun run_steps(const ModelCase& m, const MeshCase& c, bool self, int steps, float lr,
                   bool reduce = true) {
  MPI_Comm comm = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int ranks = self ? 1 : world_size();
  const Mesh mesh =
      self ? Mesh::create({{"dp", 1}, {"fsdp", 1}, {"ep", 1}, {"tp", 1}}, 1)
           : Mesh::create({{"dp", c.dp}, {"fsdp", c.fsdp}, {"ep", c.ep}, {"tp", c.tp}}, ranks);
  MeshCommunicators comms(mesh, comm,
                          self ? CommunicatorFactory{} : testing::test_communicator_factory());
  const LayerAxes axes = layer_axes(LogicalAxes(), /*with_experts=*/true);
  ParallelContext context(comms, axes.batch, axes.feature, CollectiveMatmulAlgorithm::automatic,
                          false, 25.0);
  PlanOptions options;
  options.min_sharding_size = 0;
  options.batch_axes = axes.batch;
  options.feature_axis = axes.feature;
  options.global_batch = kRows;
  const std::vector<PartitionRule> rules = preset_rules(self ? "dp" : c.preset, /*moe=*/true);
  const ResidualMlpShape shape = residual_shape(m.gated, m.inputs());
  const ShardingPlan plan =
      m.residual
          ? make_plan(residual_mlp_parameter_shapes(shape), mesh, rules, options,
                      residual_mlp_linear_layers(shape))
          : make_plan(mlp_parameter_shapes(kMlpSizes, moe_settings(m.moe_layer)), mesh, rules,
                      options, mlp_linear_layers(kMlpSizes, moe_settings(m.moe_layer)));
  const int64_t rows = kRows / context.batch_parallel();
  const int64_t row0 = context.batch_index() * rows;
  const int64_t k = static_cast<int64_t>(kChosen.size());
  std::unique_ptr<Mlp> built =
      m.residual ? std::make_unique<Mlp>(shape, m.act, specs_from_plan(plan), context, rows)
                 : std::make_unique<Mlp>(kMlpSizes, m.act, specs_from_plan(plan), context, rows,
                                         moe_settings(m.moe_layer));
  Mlp& model = *built;
  model.initialize(InitScheme::he_normal, kSeed);
  model.reserve_tangent_backward(k);
  StepsRun run;
  run.described = model.describe();
  for (const std::string& line : run.described)
    if (line.find("router") != std::string::npos || line.find("expert") != std::string::npos)
      run.built.push_back(line);
  Loss loss(LossKind::mse, context, rows, kOutputs, model.output_layout());
  DerivativeLoss derivative({kChosen, kLambda, m.input_std(), kTargetStd}, context, rows,
                            m.inputs(), kOutputs, model.output_layout());
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  Optimizer optimizer(sgd, model.parameters());
  for (const auto& p : model.parameters())
    run.initial.push_back(testing::gather_full(p, mesh, context.rank(), comm));
  for (int step = 0; step < steps; ++step) {
    const Batch b = make_batch(kRows, k, step, m.inputs());
    const Matrix x = rows_of("x", b.x, m.inputs(), row0, rows);
    const Matrix t = rows_of("t", b.t, kOutputs, row0, rows);
    const Matrix dyt = rows_of("dyt", b.dyt, kOutputs * k, row0, rows);
    testing::KokkosAllocationCounter allocations;  // the step allocates nothing
    const MatrixView y = model.forward(x);
    run.data_losses.push_back(loss.regression(y, t).loss);
    run.aux_losses.push_back(model.aux_loss());
    const MatrixView tangents = model.forward_tangents(derivative.seeds());
    run.derivative_losses.push_back(derivative.evaluate(tangents, dyt).loss);
    model.backward_with_tangents(loss.gradient(), derivative.gradient(), reduce);
    if (!reduce) model.reduce_gradients();
    allocations.stop();
    run.last_step_allocations = allocations.count();
    run.first_allocations = allocations.described();
    std::vector<Tensor> grads;
    for (const auto& g : model.gradients())
      grads.push_back(testing::gather_full(g, mesh, context.rank(), comm));
    run.grads.push_back(grads);
    optimizer.step(model.parameters(), model.gradients(), lr);
  }
  for (const auto& p : model.parameters())
    run.final_params.push_back(testing::gather_full(p, mesh, context.rank(), comm));
  return run;
}

// Under tp the runs take the feature-axis paths (the layouts the layers report): every model
// has a Linear split over tp and its MoE layer's experts stored split over tp (gathered in the
// pass, gradients reduce-scattered); the mlp's MoE layer 1 gathers its input, split over tp by
// layers/0; with 4 inputs the residual_mlp's MoE block gathers its input, split over tp by the
// input layer, and keeps its block of the output (with 3 the stream stays whole under tp).
void expect_feature_paths(const ModelCase& m, const std::vector<std::string>& lines) {
  std::string all, moe;
  bool split_linear = false;
  for (const std::string& line : lines) {
    all += "\n  " + line;
    if (line.find("MoE in") != std::string::npos) {
      moe = line;
    } else if (line.find("TP in") != std::string::npos) {
      split_linear = true;
    }
  }
  EXPECT_TRUE(split_linear) << "no Linear layer split over tp:" << all;
  ASSERT_FALSE(moe.empty()) << "no MoE layer:" << all;
  EXPECT_NE(moe.find("experts gathered over (tp)"), std::string::npos)
      << "experts not split over tp: " << moe;
  if (!m.residual && m.moe_layer == 1) {
    EXPECT_NE(all.find("layers/0: TP in 4 -> out 8 (split 4)"), std::string::npos) << all;
    EXPECT_NE(moe.find("MoE in 8 (split 4, gathered)"), std::string::npos)
        << "input not split over tp:" << all;
  }
  if (m.split_stream()) {
    EXPECT_NE(all.find("input: TP in 4 -> out 6 (split 3)"), std::string::npos) << all;
    EXPECT_NE(moe.find("MoE in 6 (split 3, gathered)"), std::string::npos)
        << "input not split over tp:" << all;
    EXPECT_NE(moe.find("-> out 6 (split 3)"), std::string::npos) << "output not split:" << all;
  }
}

TEST(SobolevMoe, GradientsMatchFloat64CentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "against float64: checked at np 1";
  constexpr double kStep = 1e-6, kTolerance = 2e-6;
  for (const ModelCase& m : kModels) {
    SCOPED_TRACE(m.name());
    const StepsRun run = run_steps(m, meshes_for(1)[0], /*self=*/true, 1, 0.0f);
    const Batch b = make_batch(kRows, static_cast<int64_t>(kChosen.size()), 0, m.inputs());
    std::vector<Tensor> p = run.initial;
    Routing routing(kRows);  // chosen by the unperturbed forward, then held fixed
    const ReferenceLoss ref = reference_loss(m, p, b, routing);
    EXPECT_NEAR(run.data_losses[0], ref.data, 1e-5 * ref.data);
    EXPECT_NEAR(run.derivative_losses[0], kLambda * ref.derivative, 1e-5 * ref.derivative);
    EXPECT_NEAR(run.aux_losses[0], ref.aux, 1e-5 * ref.aux);
    double worst = 0.0;
    const std::vector<Tensor> fd = testing::central_differences(
        p, [&](const std::vector<Tensor>& v) { return reference_loss(m, v, b, routing).total; },
        kStep);
    for (size_t q = 0; q < p.size(); ++q) {
      worst = std::max(worst, expect_close_scaled(run.grads[0][q], fd[q], kTolerance,
                                                  "gradient " + std::to_string(q)));
    }
    std::printf(
        "[ sobolev moe ] %s: gradient vs float64 central differences: largest |g - fd| / "
        "max|fd| %.2e (tolerance %.0e)\n",
        m.name().c_str(), worst, kTolerance);
  }
}

TEST(SobolevMoe, EveryMeshEqualsOneRank) {
  constexpr double kTolerance = 1e-5;
  constexpr int kSteps = 3;
  constexpr float kLr = 0.02f;
  for (const ModelCase& m : kModels) {
    const float lr = m.lr(kLr);  // (ModelCase::lr: why smaller for some)
    const StepsRun one = run_steps(m, meshes_for(1)[0], /*self=*/true, kSteps, lr);
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(std::isfinite(one.data_losses[step]) &&
                  std::isfinite(one.derivative_losses[step]))
          << m.name() << " step " << step;
    }
    for (const MeshCase& c : meshes_for(world_size())) {
      for (const bool reduce : {true, false}) {
        SCOPED_TRACE(m.name() + " on " + c.name + (reduce ? "" : ", reduce_gradients()"));
        const StepsRun got = run_steps(m, c, /*self=*/false, kSteps, lr, reduce);
        ASSERT_FALSE(got.built.empty());
        if (c.ep > 1) {  // the experts really are split over ep, the rows sent by all-to-all
          EXPECT_NE(got.built[0].find("over (ep) by all-to-all"), std::string::npos)
              << got.built[0];
        }
        if (c.tp > 1) expect_feature_paths(m, got.described);
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
          std::printf("[ sobolev moe ] %s on %s%s (%s): largest difference from one rank %.2e\n",
                      m.name().c_str(), c.name.c_str(), reduce ? "" : " (reduce_gradients)",
                      got.built[0].c_str(), worst);
        }
      }
    }
  }
}

TEST(SobolevMoe, AcceptsTheLaplacian) {
  const Mesh mesh = Mesh::create({{"dp", 1}}, 1);
  MeshCommunicators comms(mesh, MPI_COMM_SELF, CommunicatorFactory{});
  ParallelContext context(comms, {"dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                          25.0);
  const SpecLookup replicated = [](const std::string&) { return PartitionSpec(); };
  for (const bool gated : {false, true}) {
    Mlp model(residual_shape(gated), Activation::silu, replicated, context, 4);
    EXPECT_NO_THROW(model.reserve_tangent_backward(1));
    EXPECT_NO_THROW(model.reserve_laplacian(1));  // built (tests/layers/physics_moe_test.cpp)
  }
}

}  // namespace
}  // namespace meshtrain
