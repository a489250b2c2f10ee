// MoE blocks in residual_mlp (a block listed in model.moe_layers: its feed-forward is a
// mixture of expert feed-forwards with one router, layers/moe.hpp's feed-forward experts,
// docs/models.md): inputs 8, width 8, hidden 12, depth 3 with blocks 0 and 2 MoE (4 experts,
// top-2, aux_loss_coef 0.05), block 1 dense, outputs 5; rmsnorm + swiglu and layernorm +
// gelu. Built by Mlp from the plan of a preset (preset_rules(preset, moe = true)) on every
// mesh below, overlap off and on, after one forward and backward (the loss is
// sum(R * out) over the global batch of 8 rows for a fixed R, plus the aux losses, so
// dOut = R): the output, model.aux_loss() and every parameter gradient (gathered to full
// shape, the [E, in, out] experts included) equal
//   * a float64 reference written here (one row at a time, then the routing statistics of
//     the whole batch for the aux loss's gradient; no layer code):
//     |got - ref| <= 2e-5 (1 + |ref|) (float32, depth 3, sums of at most 12 terms of O(1);
//     measured differences are below 1e-6); the aux loss within 1e-5 relative;
//   * the same model on one rank (MPI_COMM_SELF): |got - one| <= 1e-5 (1 + |one|) (only the
//     order of the sums over ranks differs).
// The checks can fail: every row's gap between its 2nd and 3rd router probability is
// asserted >= 5e-4 (the router scale and phase were chosen for it; fp32 moves a probability
// after three blocks by ~1e-6, so the top-k choice is the reference's), and the aux loss's gradient
// is asserted to move the router gradients by more than 100 times the tolerance. Meshes (batch axes
// from layer_axes(with_experts): dp, fsdp, ep; feature axis tp):
//   np 1: one rank ("dp"), one rank with "fsdp_tp" specs;
//   np 2: ep2 ("dp": experts P(ep, ...)), dp2 (experts replicated), fsdp2 ("fsdp": experts
//         P(ep, fsdp, None) gathered over fsdp), tp2 ("tp": the residual stream split, the
//         MoE layer computed whole on both tp ranks, input gathered, output sliced);
//   np 4: ep4 (one expert per rank), dp2 x ep2, fsdp2 x ep2 ("fsdp"), ep2 x tp2 ("tp"),
//         tp4 ("tp").
// Also: a training step (forward, backward, reduce) allocates nothing, and the reference's
// backward is the derivative of its forward (ReferenceGradientsMatchCentralDifferences).
//
// Bf16IsCloseToTheReferenceAndToOneRankOnEveryMesh: the same models with {bf16, bf16}
// (u = 2^-8; cast points in docs/mixed_precision.md), one forward and backward per mesh
// above (overlap off, reduced in backward), against
//   * the float64 reference: per tensor |got - ref| <= 60 u max|ref| (+ 1e-6 for zeros).
//     60 is the number of roundings on the longest chain, forward to the output and back
//     to input/weight's gradient: forward, a Linear rounds its product, its bias and their
//     sum (3), a dense block its norm output (1), up (3; gate the same, in parallel),
//     activation or silu(gate) * up (1), down (3) and the residual sum (1): 9; an MoE
//     block also its router logits (1) and the gated combination (1): 11; input Linear 3
//     + 11 + 9 + 11 + output norm 1 + output Linear 3 = 38; backward, the output Linear's
//     and the output norm's input gradients (2), per block the down and up input
//     gradients, the activation's gradient, the gate + up sum, the norm's input gradient
//     and the residual sum (6): 18, and the weight gradient (1): 21; 38 + 21 = 59 -> 60.
//     Each rounding moves a value by at most u of itself, and no value on the chain
//     exceeds its tensor's max|ref| by much (norms bring the stream back to O(1)), so the
//     worst case adds up to 60 u = 23%. Observed at most 5.6% off tp and 10.9% at tp2
//     and ep2 x tp2 (layernorm gelu: the norm biases' and block 2's router gradients, sums
//     and differences of near-equal terms); rmsnorm swiglu at most 2.1%. 13 u = 5%
//     (moe_test's bound for one MoE layer) fails there;
//   * the same model in bf16 on one rank (MPI_COMM_SELF): K u max|one| with
//     K = 3 * batch ranks + 3 * (tp - 1) * 8 + 2: moe_test's K (each rank's partial
//     gradient rounded, then one rounding per hop of the sums over ranks) with its tp
//     term once per sum over tp on the chain, 8 under the tp preset: forward the
//     row-parallel input Linear, dense down projection and output Linear; backward the
//     column-parallel up projection's input gradient and the 4 norms' input gradients
//     (their row sums over tp in fp32, then rounded per rank). The MoE layers add none
//     (computed whole on every tp rank). Bounds: ep2 / dp2 / fsdp2 3.1%, np 4 batch meshes
//     5.5%, tp2 11%, ep2 x tp2 12%, tp4 30%. Observed at most 7.9% (layernorm gelu at tp2
//     and ep2 x tp2: the router gradient of block 2, p (dp - p.dp), a difference of
//     near-equal terms); with the tp sums counted once (moe_test's K, 3.1% at tp2) that
//     case fails;
//   * the aux loss within 60 u (reference) and K u (one rank) relative.
// Both need the reference's top-k choice: the routers get their own scale, phase and
// frequencies (kBf16Router) so that every row's gap between its 2nd and 3rd probability
// is >= 0.01 (asserted; observed 0.094: bf16 moves a logit of O(1) by a few u, a
// probability by under 0.01) and every expert gets >= 2 rows per MoE block (asserted: no
// ep rank idles). With the fp32 test's routers (smallest gap 8e-4) one phase tried flipped
// a routing in bf16 and moved a tensor by 66% of its max. The MoE layers' outputs and
// their blocks' outputs must be bf16 values (without the rounding of the gated combination,
// layers/moe.cpp, this check fails on every mesh).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/precision.hpp"
#include "layers/context.hpp"
#include "layers/mlp.hpp"
#include "layers/moe.hpp"
#include "layers/residual_block.hpp"
#include "partition/linear_layout.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/expect_close.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/layer_test_data.hpp"
#include "tests/support/model_pass.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/reference_norm.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;
using testing::Vec;

constexpr int64_t kRows = 8;
constexpr int64_t kExperts = 4;
constexpr int64_t kTopK = 2;
constexpr double kAuxCoef = 0.05;
constexpr double kTolerance = 2e-5;         // against the float64 reference
constexpr double kOneRankTolerance = 1e-5;  // against the same model on one rank
// bf16 against float64, of max|ref|: 60 roundings of relative size u = 2^-8 (header).
constexpr double kBf16VsReference = 60 * 0.00390625;
// The sums over tp on the chain under the tp preset (header).
constexpr int kTpReductions = 8;
constexpr double kBf16MinGap = 0.01;  // smallest top-k gap bf16 cannot flip (header)

struct ModelCase {
  std::string name;
  NormKind norm;
  bool gated;
  Activation activation;  // silu when gated
};

ResidualMlpShape shape_of(const ModelCase& m) {
  ResidualMlpShape s;
  s.inputs = 8;
  s.outputs = 5;
  s.width = 8;
  s.hidden = 12;
  s.depth = 3;
  s.norm = true;
  s.norm_kind = m.norm;
  s.gated = m.gated;
  s.moe.layers = {0, 2};
  s.moe.experts = kExperts;
  s.moe.top_k = kTopK;
  s.moe.aux_loss_coef = kAuxCoef;
  return s;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The routers' scale and phase (below); the bf16 test picks its own (header).
struct RouterInit {
  double scale = 0.6, phase = 3.2, a = 1.3, b = 2.1;
};
RouterInit g_router;
// Top-k gaps >= 0.094 and every expert >= 2 rows in both models (found by a search over
// scale, phase and frequencies; the fp32 routers' smallest gap is 8e-4).
constexpr RouterInit kBf16Router{1.0, 3.0, 1.3, 3.0};

// Element `flat` (row-major over the global shape) of parameter k, as float. Norm scales
// around 1; routers larger, so that the routing is far from uniform and from ties.
double parameter_value(const ParameterShape& p, int k, int64_t flat) {
  const int64_t cols = p.shape.back();
  const int64_t i = flat / cols, j = flat % cols;
  const double v = testing::parameter_wave(k, i, j);
  if (ends_with(p.name, "scale")) return static_cast<float>(1.0 + v);
  if (ends_with(p.name, "router/weight")) {
    return static_cast<float>(g_router.scale *
                              std::sin(g_router.a * i + g_router.b * j + 0.5 * k + g_router.phase));
  }
  return static_cast<float>(v);
}
using testing::loss_weight;

void fill(ShardedTensor& t, const ParameterShape& p, int k) {
  testing::fill_global(t, [&](int64_t flat) { return parameter_value(p, k, flat); });
}

// ---- The float64 reference (docs/models.md, layers/moe.hpp). ----
using Param = testing::ReferenceParam;
using testing::affine;
using testing::affine_backward;
using testing::norm_backward;
using testing::norm_forward;
using testing::NormCache;

// One feed-forward (dense block, or one expert): a = act(u U + bu) or silu(u G + bg) * (u U +
// bu), y = a D + bd.
struct FeedForward {
  const double *gw = nullptr, *gb = nullptr, *uw = nullptr, *ub = nullptr, *dw = nullptr,
               *db = nullptr;
  double *ggw = nullptr, *ggb = nullptr, *guw = nullptr, *gub = nullptr, *gdw = nullptr,
         *gdb = nullptr;
};
struct FeedForwardCache {
  Vec z, g, a, y;
};

struct Reference {
  Tensor out;                  // [rows, outputs]
  std::vector<Tensor> grad;    // per parameter, in residual_mlp_parameter_shapes order
  std::vector<Tensor> values;  // the parameters it was computed with, in the same order
  double aux = 0.0;
  double min_gap = 1.0;          // the smallest gap between a row's k-th and (k+1)-th probability
  double min_expert_rows = 0.0;  // the fewest rows an expert of an MoE block receives
  std::vector<int64_t> routing;  // the chosen experts, row by row and MoE block by block

  // The loss whose gradient `grad` is: sum(R * out) + aux.
  double loss() const { return aux + testing::weighted_loss(out, kRows); }
};

// The model's output, aux loss and (with_backward) gradients in float64, for the parameters
// parameter_value gives, or for `values` (in residual_mlp_parameter_shapes order).
Reference reference(const ResidualMlpShape& s, Activation activation, double coef,
                    const std::vector<Tensor>* values = nullptr, bool with_backward = true) {
  const std::vector<ParameterShape> shapes = residual_mlp_parameter_shapes(s);
  std::vector<Param> p(shapes.size());
  std::map<std::string, size_t> index;
  for (size_t k = 0; k < shapes.size(); ++k) {
    if (values) {
      p[k].value = (*values)[k];
    } else {
      int64_t total = 1;
      for (int64_t d : shapes[k].shape) total *= d;
      for (int64_t f = 0; f < total; ++f) {
        p[k].value.push_back(parameter_value(shapes[k], static_cast<int>(k), f));
      }
    }
    p[k].grad.assign(p[k].value.size(), 0.0);
    index[shapes[k].name] = k;
  }
  auto param = [&](const std::string& name) -> Param& { return p.at(index.at(name)); };
  auto has = [&](const std::string& name) { return index.count(name) > 0; };
  const bool ln = s.norm_kind == NormKind::layernorm;
  const int64_t width = s.width, hidden = s.hidden, experts = s.moe.experts, k = s.moe.top_k;
  const bool gated = s.gated;

  auto ff_forward = [&](const FeedForward& f, const Vec& u, FeedForwardCache& c) {
    c.z = affine(u, f.uw, f.ub, hidden);
    c.a.resize(c.z.size());
    if (gated) {
      c.g = affine(u, f.gw, f.gb, hidden);
      for (size_t j = 0; j < c.z.size(); ++j) c.a[j] = testing::swiglu(c.g[j], c.z[j]);
    } else {
      for (size_t j = 0; j < c.z.size(); ++j) c.a[j] = testing::activation(activation, c.z[j]);
    }
    c.y = affine(c.a, f.dw, f.db, width);
  };
  auto ff_backward = [&](const FeedForward& f, const Vec& u, const FeedForwardCache& c,
                         const Vec& dy) {
    const Vec da = affine_backward(c.a, f.dw, f.gdw, f.gdb, dy);
    Vec dz(da.size()), dg(da.size());
    for (size_t j = 0; j < da.size(); ++j) {
      if (gated) {
        dg[j] = testing::swiglu_gate_gradient(c.g[j], c.z[j], da[j]);
        dz[j] = testing::swiglu_up_gradient(c.g[j], da[j]);
      } else {
        dz[j] = da[j] * testing::activation_derivative(activation, c.z[j]);
      }
    }
    Vec du = affine_backward(u, f.uw, f.guw, f.gub, dz);
    if (gated) {
      const Vec du_gate = affine_backward(u, f.gw, f.ggw, f.ggb, dg);
      for (size_t j = 0; j < du.size(); ++j) du[j] += du_gate[j];
    }
    return du;
  };
  // Block i's dense feed-forward, or expert e of its MoE.
  auto dense = [&](const std::string& b) {
    FeedForward f;
    if (gated) {
      f.gw = param(b + "/gate/weight").value.data();
      f.gb = param(b + "/gate/bias").value.data();
      f.ggw = param(b + "/gate/weight").grad.data();
      f.ggb = param(b + "/gate/bias").grad.data();
    }
    f.uw = param(b + "/up/weight").value.data();
    f.ub = param(b + "/up/bias").value.data();
    f.guw = param(b + "/up/weight").grad.data();
    f.gub = param(b + "/up/bias").grad.data();
    f.dw = param(b + "/down/weight").value.data();
    f.db = param(b + "/down/bias").value.data();
    f.gdw = param(b + "/down/weight").grad.data();
    f.gdb = param(b + "/down/bias").grad.data();
    return f;
  };
  auto expert = [&](const std::string& b, int64_t e) {
    FeedForward f;
    const int64_t up = e * width * hidden, down = e * hidden * width;
    if (gated) {
      f.gw = param(b + "/experts/gate/weight").value.data() + up;
      f.gb = param(b + "/experts/gate/bias").value.data() + e * hidden;
      f.ggw = param(b + "/experts/gate/weight").grad.data() + up;
      f.ggb = param(b + "/experts/gate/bias").grad.data() + e * hidden;
    }
    f.uw = param(b + "/experts/up/weight").value.data() + up;
    f.ub = param(b + "/experts/up/bias").value.data() + e * hidden;
    f.guw = param(b + "/experts/up/weight").grad.data() + up;
    f.gub = param(b + "/experts/up/bias").grad.data() + e * hidden;
    f.dw = param(b + "/experts/down/weight").value.data() + down;
    f.db = param(b + "/experts/down/bias").value.data() + e * width;
    f.gdw = param(b + "/experts/down/weight").grad.data() + down;
    f.gdb = param(b + "/experts/down/bias").grad.data() + e * width;
    return f;
  };

  struct BlockCache {
    Vec h_in, u;
    NormCache nc;
    FeedForwardCache dense;
    Vec probs, gates;
    std::vector<int64_t> chosen;
    double chosen_sum = 0.0;
    std::vector<FeedForwardCache> experts;  // per chosen slot
  };
  struct RowCache {
    Vec x, h_last, h_out;
    NormCache onc;
    std::vector<BlockCache> blocks;
  };
  std::vector<RowCache> rows(kRows);
  // Per block: global rows per expert and probability sums.
  std::vector<Vec> counts(s.depth, Vec(experts, 0.0)), prob_sums(s.depth, Vec(experts, 0.0));
  Reference r;

  // Forward, every row.
  for (int64_t row = 0; row < kRows; ++row) {
    RowCache& rc = rows[row];
    rc.x.resize(s.inputs);
    for (int64_t c = 0; c < s.inputs; ++c) rc.x[c] = testing::model_input(row, c);
    Vec h =
        affine(rc.x, param("input/weight").value.data(), param("input/bias").value.data(), width);
    rc.blocks.resize(s.depth);
    for (int64_t i = 0; i < s.depth; ++i) {
      const std::string b = "blocks/" + std::to_string(i);
      BlockCache& bc = rc.blocks[i];
      bc.h_in = h;
      bc.u =
          norm_forward(h, param(b + "/norm/scale"), ln ? &param(b + "/norm/bias") : nullptr, bc.nc);
      Vec d;
      if (!has(b + "/router/weight")) {
        ff_forward(dense(b), bc.u, bc.dense);
        d = bc.dense.y;
      } else {
        const Vec logits = affine(bc.u, param(b + "/router/weight").value.data(), nullptr, experts);
        const double top = *std::max_element(logits.begin(), logits.end());
        double sum = 0.0;
        bc.probs.resize(experts);
        for (int64_t e = 0; e < experts; ++e) sum += bc.probs[e] = std::exp(logits[e] - top);
        for (int64_t e = 0; e < experts; ++e) bc.probs[e] /= sum;
        std::vector<int64_t> order(experts);
        for (int64_t e = 0; e < experts; ++e) order[e] = e;
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t c) { return bc.probs[a] > bc.probs[c]; });
        r.min_gap = std::min(r.min_gap, bc.probs[order[k - 1]] - bc.probs[order[k]]);
        bc.chosen.assign(order.begin(), order.begin() + k);
        r.routing.insert(r.routing.end(), bc.chosen.begin(), bc.chosen.end());
        for (int64_t e : bc.chosen) bc.chosen_sum += bc.probs[e];
        d.assign(width, 0.0);
        bc.experts.resize(k);
        for (int64_t t = 0; t < k; ++t) {
          bc.gates.push_back(bc.probs[bc.chosen[t]] / bc.chosen_sum);
          ff_forward(expert(b, bc.chosen[t]), bc.u, bc.experts[t]);
          for (int64_t j = 0; j < width; ++j) d[j] += bc.gates[t] * bc.experts[t].y[j];
          counts[i][bc.chosen[t]] += 1.0;
        }
        for (int64_t e = 0; e < experts; ++e) prob_sums[i][e] += bc.probs[e];
      }
      for (int64_t j = 0; j < width; ++j) h[j] += d[j];
    }
    rc.h_last = h;
    rc.h_out = norm_forward(h, param("output_norm/scale"),
                            ln ? &param("output_norm/bias") : nullptr, rc.onc);
    const Vec y = affine(rc.h_out, param("output/weight").value.data(),
                         param("output/bias").value.data(), s.outputs);
    for (double v : y) r.out.push_back(v);
  }
  const double n = static_cast<double>(kRows);
  r.min_expert_rows = n;
  for (int64_t i = 0; i < s.depth; ++i) {
    if (!has("blocks/" + std::to_string(i) + "/router/weight")) continue;
    for (int64_t e = 0; e < experts; ++e)
      r.min_expert_rows = std::min(r.min_expert_rows, counts[i][e]);
    double balance = 0.0;
    for (int64_t e = 0; e < experts; ++e) balance += counts[i][e] * prob_sums[i][e];
    r.aux += coef * static_cast<double>(experts) * balance / (n * n);
  }

  for (const Param& q : p) r.values.push_back(q.value);
  if (!with_backward) return r;

  // Backward from dOut = R and the aux losses (through the probabilities, not the counts).
  for (int64_t row = 0; row < kRows; ++row) {
    RowCache& rc = rows[row];
    Vec dy(s.outputs);
    for (int64_t c = 0; c < s.outputs; ++c) dy[c] = loss_weight(row, c);
    Vec dh =
        affine_backward(rc.h_out, param("output/weight").value.data(),
                        param("output/weight").grad.data(), param("output/bias").grad.data(), dy);
    dh = norm_backward(rc.onc, param("output_norm/scale"),
                       ln ? &param("output_norm/bias") : nullptr, dh);
    for (int64_t i = s.depth; i-- > 0;) {
      const std::string b = "blocks/" + std::to_string(i);
      BlockCache& bc = rc.blocks[i];
      Vec du(width, 0.0);
      if (!has(b + "/router/weight")) {
        du = ff_backward(dense(b), bc.u, bc.dense, dh);
      } else {
        Vec dgate(k);
        double weighted = 0.0;
        for (int64_t t = 0; t < k; ++t) {
          dgate[t] = 0.0;
          Vec dye(width);
          for (int64_t j = 0; j < width; ++j) {
            dgate[t] += dh[j] * bc.experts[t].y[j];
            dye[j] = bc.gates[t] * dh[j];
          }
          weighted += bc.gates[t] * dgate[t];
          const Vec due = ff_backward(expert(b, bc.chosen[t]), bc.u, bc.experts[t], dye);
          for (int64_t j = 0; j < width; ++j) du[j] += due[j];
        }
        Vec dp(experts);
        for (int64_t e = 0; e < experts; ++e) {
          dp[e] = coef * static_cast<double>(experts) * counts[i][e] / (n * n);
        }
        for (int64_t t = 0; t < k; ++t) dp[bc.chosen[t]] += (dgate[t] - weighted) / bc.chosen_sum;
        double dot = 0.0;
        for (int64_t e = 0; e < experts; ++e) dot += bc.probs[e] * dp[e];
        Vec dlogits(experts);
        for (int64_t e = 0; e < experts; ++e) dlogits[e] = bc.probs[e] * (dp[e] - dot);
        const Vec du_router =
            affine_backward(bc.u, param(b + "/router/weight").value.data(),
                            param(b + "/router/weight").grad.data(), nullptr, dlogits);
        for (int64_t j = 0; j < width; ++j) du[j] += du_router[j];
      }
      du = norm_backward(bc.nc, param(b + "/norm/scale"), ln ? &param(b + "/norm/bias") : nullptr,
                         du);
      for (int64_t j = 0; j < width; ++j) dh[j] += du[j];  // the residual's part
    }
    affine_backward(rc.x, param("input/weight").value.data(), param("input/weight").grad.data(),
                    param("input/bias").grad.data(), dh);
  }
  for (const Param& q : p) r.grad.push_back(q.grad);
  return r;
}

// ---- The model on a mesh. ----
struct MeshCase {
  std::string name;
  std::vector<std::pair<std::string, int>> axes;
  std::string preset;
};

std::vector<MeshCase> mesh_cases(int n) {
  if (n == 1) return {{"single", {}, "dp"}, {"single_fsdp_tp_specs", {}, "fsdp_tp"}};
  if (n == 2) {
    return {{"ep2", {{"ep", 2}}, "dp"},
            {"dp2", {{"dp", 2}}, "dp"},
            {"fsdp2", {{"fsdp", 2}}, "fsdp"},
            {"tp2", {{"tp", 2}}, "tp"}};
  }
  return {{"ep4", {{"ep", 4}}, "dp"},
          {"dp2_ep2", {{"dp", 2}, {"ep", 2}}, "dp"},
          {"fsdp2_ep2", {{"fsdp", 2}, {"ep", 2}}, "fsdp"},
          {"ep2_tp2", {{"ep", 2}, {"tp", 2}}, "tp"},
          {"tp4", {{"tp", 4}}, "tp"}};
}

struct RunResult {
  Tensor out;  // this rank's output block [rows, cols] as the model returns it
  int64_t row0 = 0, col0 = 0, rows = 0, cols = 0;
  std::vector<Tensor> grad;  // full, per parameter
  double aux = 0.0;
  int64_t allocations = -1;        // in the counted step
  std::string first_allocation;    // the first few of them (space, label, size)
  int moe_layers = 0;              // MoE layers found inside the model's blocks
  bool moe_output_in_bf16 = true;  // their outputs and their blocks' outputs are bf16 values
};

// Whether every element of `m` is a bf16 value.
bool all_bf16(MatrixView m) {
  for (double v : testing::host_matrix(m)) {
    if (round_to(static_cast<float>(v), Dtype::bf16) != v) return false;
  }
  return true;
}

RunResult run_model(const ResidualMlpShape& shape, Activation activation, const MeshCase& c,
                    bool overlap, bool reduce, bool self, bool bf16 = false) {
  MPI_Comm world = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int ranks = self ? 1 : world_size();
  std::vector<std::pair<std::string, int>> axes = {{"dp", 1}, {"fsdp", 1}, {"ep", 1}, {"tp", 1}};
  if (!self) {
    for (const auto& [name, size] : c.axes) {
      for (auto& a : axes)
        if (a.first == name) a.second = size;
    }
  }
  const Mesh mesh = Mesh::create(axes, ranks);
  MeshCommunicators comms(mesh, world,
                          self ? CommunicatorFactory{} : testing::test_communicator_factory());
  const LayerAxes layer = layer_axes(LogicalAxes(), /*with_experts=*/true);
  ParallelContext context(comms, layer.batch, layer.feature,
                          CollectiveMatmulAlgorithm::bidirectional, overlap, 1e-4);
  if (bf16) context.set_precision({Dtype::bf16, Dtype::bf16});
  PlanOptions options;
  options.min_sharding_size = 0;
  options.batch_axes = layer.batch;
  options.feature_axis = layer.feature;
  options.global_batch = kRows;
  const std::vector<ParameterShape> shapes = residual_mlp_parameter_shapes(shape);
  const ShardingPlan plan =
      make_plan(shapes, mesh, preset_rules(c.preset, true, true), options,
                residual_mlp_linear_layers(shape), residual_mlp_norm_layers(shape));
  RunResult run;
  run.rows = kRows / context.batch_parallel();
  run.row0 = context.batch_index() * run.rows;
  Mlp model(shape, activation, specs_from_plan(plan), context, run.rows);
  EXPECT_EQ(model.parameters().size(), shapes.size());
  for (size_t k = 0; k < shapes.size(); ++k)
    fill(model.parameters()[k], shapes[k], static_cast<int>(k));

  run.cols = model.output_width();
  run.col0 = model.output_offset();
  const Matrix x =
      testing::block_matrix("x", run.rows, shape.inputs, run.row0, 0, testing::model_input);
  const Matrix dout =
      testing::block_matrix("dout", run.rows, run.cols, run.row0, run.col0, loss_weight);
  auto step = [&] { return testing::forward_backward(model, x, dout, reduce); };
  step();  // warm-up, then the counted one
  testing::KokkosAllocationCounter allocations;
  const MatrixView out = step();
  allocations.stop();
  run.allocations = allocations.count();
  run.first_allocation = allocations.described();
  run.aux = model.aux_loss();
  for (Layer* layer : model.sequence()) {
    const auto* block = dynamic_cast<const ResidualBlock*>(layer);
    if (!block) continue;
    for (const auto& inner : block->layers()) {
      if (!dynamic_cast<const MoeLayer*>(inner.get())) continue;
      ++run.moe_layers;
      run.moe_output_in_bf16 =
          run.moe_output_in_bf16 && all_bf16(inner->output()) && all_bf16(block->output());
    }
  }
  run.out = testing::host_matrix(out);
  for (size_t k = 0; k < shapes.size(); ++k) {
    run.grad.push_back(testing::gather_full(model.gradients()[k], mesh, context.rank(), world));
  }
  return run;
}

// Failures: the first few per tensor; the largest difference relative to (1 + |ref|).
double expect_close(const Tensor& got, const Tensor& ref, double tolerance,
                    const std::string& what) {
  return testing::expect_close_to_reference(got, ref, tolerance, what);
}

// The rows and columns [row0, + rows) x [col0, + cols) of a full [kRows, outputs] output.
Tensor block_of(const Tensor& full, int64_t outputs, const RunResult& r) {
  Tensor out;
  for (int64_t i = 0; i < r.rows; ++i)
    for (int64_t j = 0; j < r.cols; ++j) out.push_back(full[(r.row0 + i) * outputs + r.col0 + j]);
  return out;
}

// The reference's hand-derived backward (SwiGLU, gelu, the MoE gates and routing through the
// softmax, the aux loss through the probabilities, the residual adds, the norms) is the
// derivative of its forward: every parameter gradient against central differences in float64
// of the loss it differentiates, sum(R * out) + aux, in both models. Step h = 1e-5 (parameters
// of O(0.3..1.3)): truncation h^2/6 |L'''| and rounding eps |L| / h (|L| ~ 10, a sum of ~100
// terms) are each ~1e-9 here (measured at most 3e-10, printed); tolerance 1e-7 (1 + |g|)
// leaves a factor ~100 over that and is far below any missing term: dropping the aux loss's
// gradient moves the router gradients by more than 1e-3 (a control below: the check fails
// there). The routing is piecewise constant (the top-k choice, the counts of the aux loss):
// every perturbed forward must choose the same experts (a step of 1e-5 moves a probability by
// ~1e-5, far inside the smallest top-k gap, >= 5e-4). The reference does not depend on the
// ranks: checked once, at np 1.
TEST(MoeBlock, ReferenceGradientsMatchCentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "the float64 reference alone: checked at np 1";
  const ModelCase models[] = {{"rmsnorm swiglu", NormKind::rmsnorm, true, Activation::silu},
                              {"layernorm gelu", NormKind::layernorm, false, Activation::gelu}};
  constexpr double kStep = 1e-5, kFdTolerance = 1e-7;
  for (const ModelCase& m : models) {
    SCOPED_TRACE(m.name);
    const ResidualMlpShape shape = shape_of(m);
    const Reference ref = reference(shape, m.activation, kAuxCoef);
    ASSERT_GE(ref.min_gap, 5e-4);
    std::vector<std::string> names;
    for (const ParameterShape& p : residual_mlp_parameter_shapes(shape)) names.push_back(p.name);
    int64_t rerouted = 0;
    const testing::Tensors numeric = testing::central_differences(
        ref.values,
        [&](const testing::Tensors& values) {
          const Reference r = reference(shape, m.activation, kAuxCoef, &values, false);
          rerouted += r.routing == ref.routing ? 0 : 1;
          return r.loss();
        },
        kStep);
    ASSERT_EQ(rerouted, 0) << "a perturbed forward chose other experts";
    const double worst =
        testing::expect_matches_central_differences(numeric, ref.grad, kFdTolerance, names);
    // The control: the gradient without the aux loss's part fails this check.
    const Reference no_aux = reference(shape, m.activation, 0.0);
    EXPECT_GT(testing::largest_difference(numeric, no_aux.grad), 1000 * kFdTolerance);
    if (world_rank() == 0) {
      std::printf(
          "[ moe_block ] %s: reference gradients vs central differences: largest "
          "|fd - g| / (1 + |g|) %.2e (tolerance %.0e)\n",
          m.name.c_str(), worst, kFdTolerance);
    }
  }
}

TEST(MoeBlock, EqualsTheFloat64ReferenceAndOneRankOnEveryMesh) {
  const int n = world_size();
  const ModelCase models[] = {{"rmsnorm swiglu", NormKind::rmsnorm, true, Activation::silu},
                              {"layernorm gelu", NormKind::layernorm, false, Activation::gelu}};
  for (const ModelCase& m : models) {
    SCOPED_TRACE(m.name);
    const ResidualMlpShape shape = shape_of(m);
    const std::vector<ParameterShape> shapes = residual_mlp_parameter_shapes(shape);
    const Reference ref = reference(shape, m.activation, kAuxCoef);
    // The checks below can fail: the top-k choice is far from ties, and the aux loss moves
    // the router gradients well beyond the tolerance.
    ASSERT_GE(ref.min_gap, 5e-4);
    {
      const Reference no_aux = reference(shape, m.activation, 0.0);
      double moved = 0.0;
      for (size_t k = 0; k < shapes.size(); ++k) {
        if (!ends_with(shapes[k].name, "router/weight")) continue;
        for (size_t i = 0; i < ref.grad[k].size(); ++i)
          moved = std::max(moved, std::abs(ref.grad[k][i] - no_aux.grad[k][i]));
      }
      ASSERT_GT(moved, 100 * kTolerance * 2);
      ASSERT_GT(ref.aux, 100 * 1e-5);
    }
    // The same model on one rank of its own.
    const RunResult one = run_model(shape, m.activation, {"one_rank", {}, "dp"}, false, true, true);
    expect_close(one.out, ref.out, kTolerance, "one-rank output");
    for (const MeshCase& c : mesh_cases(n)) {
      for (bool overlap : {false, true}) {
        for (bool reduce : {true, false}) {
          SCOPED_TRACE(c.name + " (" + c.preset + ") at np " + std::to_string(n) +
                       (overlap ? ", overlap" : "") +
                       (reduce ? ", reduced in backward" : ", reduce_gradients()"));
          const RunResult run = run_model(shape, m.activation, c, overlap, reduce, false);
          // Also with buckets beside prefetches on one communicator (fsdp x tp, overlap) and
          // MPI staged through host memory: their request slots are reserved at build.
          EXPECT_EQ(run.allocations, 0) << "the first:" << run.first_allocation;
          EXPECT_NEAR(run.aux, ref.aux, 1e-5 * ref.aux) << "aux loss";
          EXPECT_NEAR(run.aux, one.aux, 1e-6 * one.aux) << "aux loss against one rank";
          double worst =
              expect_close(run.out, block_of(ref.out, shape.outputs, run), kTolerance, "output");
          expect_close(run.out, block_of(one.out, shape.outputs, run), kOneRankTolerance,
                       "output against one rank");
          for (size_t k = 0; k < shapes.size(); ++k) {
            worst = std::max(worst, expect_close(run.grad[k], ref.grad[k], kTolerance,
                                                 shapes[k].name + " gradient"));
            expect_close(run.grad[k], one.grad[k], kOneRankTolerance,
                         shapes[k].name + " gradient against one rank");
          }
          if (world_rank() == 0 && overlap && !reduce) {
            std::printf("[ moe_block ] %s, %s np %d: largest |got - ref| / (1 + |ref|) %.2e\n",
                        m.name.c_str(), c.name.c_str(), n, worst);
          }
        }
      }
    }
  }
}

// |got - ref| <= bound * max|ref| + 1e-6 per tensor (the absolute term for tensors that are
// 0, as moe_test's); the first few failures reported. Returns the largest |got - ref| /
// max|ref|.
double expect_close_to_max(const Tensor& got, const Tensor& ref, double max_ref, double bound,
                           const std::string& what) {
  if (!testing::expect_each_within(
          got, ref, [&](size_t) { return bound * max_ref + 1e-6; },
          what + " (max |ref| " + std::to_string(max_ref) + ")")) {
    return INFINITY;
  }
  double worst = 0.0;
  if (max_ref > 0) {
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::abs(got[i] - ref[i]) / max_ref);
  }
  return worst;
}
double max_abs(const Tensor& t) {
  double m = 0.0;
  for (double v : t) m = std::max(m, std::abs(v));
  return m;
}

TEST(MoeBlock, Bf16IsCloseToTheReferenceAndToOneRankOnEveryMesh) {
  const int n = world_size();
  const double u = std::ldexp(1.0, -8);
  const ModelCase models[] = {{"rmsnorm swiglu", NormKind::rmsnorm, true, Activation::silu},
                              {"layernorm gelu", NormKind::layernorm, false, Activation::gelu}};
  struct UseRouter {  // the bf16 routers for this test, the fp32 ones again after it
    RouterInit saved = g_router;
    UseRouter() { g_router = kBf16Router; }
    ~UseRouter() { g_router = saved; }
  } use_bf16_router;
  for (const ModelCase& m : models) {
    SCOPED_TRACE(m.name + ", bf16");
    const ResidualMlpShape shape = shape_of(m);
    const std::vector<ParameterShape> shapes = residual_mlp_parameter_shapes(shape);
    const Reference ref = reference(shape, m.activation, kAuxCoef);
    // bf16 cannot change the top-k choice, and every expert has rows to compute (header).
    ASSERT_GE(ref.min_gap, kBf16MinGap);
    ASSERT_GE(ref.min_expert_rows, 2);
    const RunResult one =
        run_model(shape, m.activation, {"one_rank", {}, "dp"}, false, true, true, true);
    for (const MeshCase& c : mesh_cases(n)) {
      SCOPED_TRACE(c.name + " (" + c.preset + ") at np " + std::to_string(n));
      const RunResult run = run_model(shape, m.activation, c, false, true, false, true);
      EXPECT_EQ(run.allocations, 0) << "the first:" << run.first_allocation;
      EXPECT_EQ(run.moe_layers, 2);
      EXPECT_TRUE(run.moe_output_in_bf16) << "an MoE block's output is not rounded to bf16";
      int batch_ranks = 1, tp = 1;
      for (const auto& [axis, size] : c.axes) (axis == "tp" ? tp : batch_ranks) *= size;
      const double k_one = 3 * batch_ranks + 3 * (tp - 1) * kTpReductions + 2;  // (header)
      EXPECT_NEAR(run.aux, ref.aux, kBf16VsReference * ref.aux) << "aux loss";
      EXPECT_NEAR(run.aux, one.aux, k_one * u * one.aux) << "aux loss against one rank";
      const double max_out = max_abs(ref.out);
      double worst_ref = expect_close_to_max(run.out, block_of(ref.out, shape.outputs, run),
                                             max_out, kBf16VsReference, "output");
      double worst_one =
          expect_close_to_max(run.out, block_of(one.out, shape.outputs, run), max_abs(one.out),
                              k_one * u, "output against one rank");
      for (size_t k = 0; k < shapes.size(); ++k) {
        worst_ref = std::max(worst_ref,
                             expect_close_to_max(run.grad[k], ref.grad[k], max_abs(ref.grad[k]),
                                                 kBf16VsReference, shapes[k].name + " gradient"));
        worst_one =
            std::max(worst_one,
                     expect_close_to_max(run.grad[k], one.grad[k], max_abs(one.grad[k]), k_one * u,
                                         shapes[k].name + " gradient against one rank"));
      }
      if (world_rank() == 0) {
        std::printf(
            "[ moe_block ] bf16 %s, %s np %d: min gap %.4f; largest |err| / max|ref|: vs "
            "float64 %.2e (bound %.2e), vs one-rank bf16 %.2e (bound %.2e)\n",
            m.name.c_str(), c.name.c_str(), n, ref.min_gap, worst_ref, kBf16VsReference, worst_one,
            k_one * u);
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
