// The mixture-of-experts layer (layers/moe.hpp) inside the MLP, on every mesh below:
// after one forward, loss and backward, the model output (gathered over ranks), the
// cross-entropy, model.aux_loss(), the global rows per expert (MoeLayer::expert_rows) and
// EVERY gradient (gathered to full shape, the rank-3 expert weights included) equal a plain
// double-precision reference computed here on the full global batch (independent loops,
// no layer code). Every run also checks that the layer was built as the planner describes
// it (make_plan with the model's layers), that its layout is the one the mesh case is
// about, that the gathered parameters are the single-rank initialization, and that every
// copy of a value on different ranks agrees (gather_blocks below handles any rank; the
// shared gather_full only handles rank 1 and 2).
//
// Models: sizes 12-8-8-5, E = 4 experts, top-2, aux_loss_coef 0.05, init `normal`
// (non-zero biases), global batch 16 (divides on every mesh):
//   tanh and relu with layer 1 an MoE layer, and tanh with layers 0 and 1 both MoE (an MoE
//   layer first: no input gradient; MoE into MoE; two aux losses summed).
// The reference, for x [N, in] into an MoE layer:
//   logits = x Wr; p = softmax per row; the k largest p (ties: the lower expert index);
//   g_s = p_{e_s} / sum_t p_{e_t}; y = sum_s g_s (x W_{e_s} + b_{e_s});
//   aux = coef * E * sum_e f_e P_e, f_e = rows choosing e / N, P_e = mean_r p(r, e);
//   the training loss CE + aux, differentiated exactly except through f (a count) and the
//   top-k choice (piecewise constant).
//
// Meshes (axes dp, fsdp, ep, tp; batch axes (fsdp, dp, ep) from layer_axes(with_experts),
// feature axis tp; presets are preset_rules(name, moe = true)):
//   np1 single ("dp"), single with the "fsdp_tp" specs;
//   np2 ep2 ("dp"), dp2 (experts replicated), fsdp2 ("fsdp"), tp2 ("fsdp_tp");
//   np4 ep4 (one expert per rank), dp2 x ep2 ("dp"), fsdp2 x ep2 ("fsdp": experts
//       P(ep, fsdp, None)), ep2 x tp2 ("fsdp_tp": experts P(ep, tp, fsdp), input gathered
//       over tp), dp2 x ep2 with rules storing the experts' bias whole (all_experts), ep4
//       with "dp" and min_sharding_size 100 (bias whole too), fsdp2 x ep2 with the router
//       split over fsdp and the bias whole but split over fsdp on its out dim, ep2 x tp2
//       with the router split over tp (a non-batch axis), fsdp2 x ep2 with the experts over
//       the tuples (ep, fsdp) and (fsdp, ep);
//   np8 dp2 x fsdp2 x ep2 ("fsdp"), fsdp2 x ep4 with fsdp on the experts' out dim
//       (P(ep, None, fsdp), P(ep, fsdp) before "fsdp").
//
// Tests and tolerances.
//  * ReferenceGradientsMatchCentralDifferences: the reference's gradients against central
//    differences of its own forward in float64 (1e-7; at np 1, see there).
//  * Fp32MatchesDoubleReferenceOnEveryMesh: fp32 model vs the double reference, per tensor
//    |got - ref| <= 1e-4 * max|ref| + 1e-6 (loss and aux loss: 1e-4 relative + 1e-6).
//    Every value is a short chain (depth 3, sums of at most 16 x 12 terms of size O(1)) of
//    fp32 operations, each off by at most 2^-24 relative: the honest error is a few 1e-7 of
//    max|ref| (observed at most 4e-7; the summary lines print it). 1e-4 leaves room for
//    sums in another order over the ranks yet is two orders of magnitude below the
//    smallest effect checked: dropping the aux-loss gradient moves every router gradient by
//    over 100x the bound (asserted on the reference, so that the check can fail; it needs
//    a routing that is not uniform); a gate, a bias or a row of one expert moves more. The
//    1e-6 absolute term is for tensors that are exactly 0 (unchosen experts). The top-k
//    choice must be the reference's: every row's gap between its k-th and (k+1)-th
//    probability is asserted >= 1e-3 (fp32 moves a probability by ~1e-7), and the rows per
//    expert must equal the reference's exactly. The same run with overlap on (FSDP
//    prefetch, DP gradient buckets of 40 floats around the MoE layers) is bit for bit the
//    same.
//  * ZeroRouterTiesChooseTheLowerExpertsOnEveryMesh: after a step with the initialized
//    routers (buffers reused, other dispatch sizes), every router is set to 0: every p is
//    1/4 exactly, every row must choose experts 0 and 1 (expert_rows() == {16, 16, 0, 0}
//    per MoE layer), aux = coef * E * 1/2 per layer, the gradients of experts 2 and 3 are
//    exactly 0, and everything equals the reference (fp32 bound above).
//  * Bf16IsCloseToTheReferenceAndToOneRankOnEveryMesh: {bf16, bf16} (u = 2^-8). Against
//    the fp32 reference, per tensor within 5% of max|ref| (a dozen roundings of relative
//    size u on the way to any value: ~13 u = 5%; observed at most 1.1%); against the np-1
//    bf16 run (every process builds it on MPI_COMM_SELF), mixed_precision_test's bound
//    K u max|ref|, K = 3 * batch ranks + 3 * (tp - 1) + 2 (each rank's partial gradient
//    rounded, then one rounding per hop of the sums over ranks; observed at most 0.8%).
//    Both need the same discrete choices: the top-k gaps are asserted >= 0.01 and, for
//    relu, every hidden |z| >= 0.01 (kSeed is picked for that: bf16 moves a logit by
//    under 1%, and with a relu pre-activation at 0.002, seed 389, a flipped relu moved the
//    first layer's gradients by 19% of max|ref|); the rows per expert must equal the
//    reference's. The MoE outputs must be bf16 values, and a run with loss scale 8 (a
//    power of two, which every rounding commutes with) must give exactly 8x the gradients,
//    the aux loss's part included (within the fp32 bound).
// Rank 0 prints one summary line per mesh and model: the largest |err| / max|ref| of each
// kind of check.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/precision.hpp"
#include "framework/io/data.hpp"
#include "framework/train/init.hpp"
#include "layers/context.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/linear_layout.hpp"
#include "partition/logical_axes.hpp"
#include "partition/moe_layout.hpp"
#include "partition/moe_limits.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/reference_losses.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;
using testing::to_host;

constexpr int64_t kBatch = 16;
constexpr int64_t kExperts = 4;
constexpr int64_t kTopK = 2;
constexpr double kAuxCoef = 0.05;
constexpr uint64_t kSeed = 1062;  // top-k gaps >= 0.0116, relu |z| >= 0.018 (bf16 test)
const std::vector<int64_t> kSizes = {12, 8, 8, 5};

constexpr double kRelTol = 1e-4;  // fp32 vs the double reference (header)
constexpr double kAbsTol = 1e-6;
constexpr double kBf16VsReference = 0.05;

struct ModelCase {
  std::string name;
  Activation activation;
  std::vector<int64_t> moe_layers;
};

std::vector<ModelCase> models() {
  return {{"tanh", Activation::tanh, {1}},
          {"relu", Activation::relu, {1}},
          {"tanh_moe_0_1", Activation::tanh, {0, 1}}};  // MoE first (no input gradient), MoE -> MoE
}

MoeSettings moe_settings(const ModelCase& m, double coef = kAuxCoef) {
  return MoeSettings{m.moe_layers, kExperts, kTopK, coef};
}

std::string layer_name(size_t l) {
  return "layers/" + std::to_string(l);
}

// ---- the data ----------------------------------------------------------------------------
struct Batch {
  Tensor x;  // [N, in]
  std::vector<int32_t> labels;
};

Batch make_batch() {
  const int64_t in = kSizes.front(), out = kSizes.back();
  Batch b;
  for (int64_t i = 0; i < kBatch * in; ++i)
    b.x.push_back(counter_normal(kSeed, name_stream("x"), i));
  for (int64_t i = 0; i < kBatch; ++i)
    b.labels.push_back(static_cast<int32_t>(counter_uniform(kSeed, name_stream("y"), i) * out));
  return b;
}

using Params = std::map<std::string, Tensor>;

bool is_router(const std::string& name) {
  const std::string suffix = "/router/weight";
  return name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The fp32 parameters as one rank initializes them (every router zeroed on request).
Params master_parameters(const ModelCase& m, bool zero_router) {
  Params params;
  for (const auto& p : mlp_parameter_shapes(kSizes, moe_settings(m))) {
    ShardedTensor t = ShardedTensor::allocate(p.name, p.shape, PartitionSpec(), Mesh::single(), 0);
    initialize(t, InitScheme::normal, kSeed);
    params[p.name] = to_host(t);
    if (zero_router && is_router(p.name))
      std::fill(params[p.name].begin(), params[p.name].end(), 0.0);
  }
  return params;
}

// ---- the reference: plain loops in double on the whole batch ------------------------------
using testing::activation;
using testing::activation_derivative;

struct Reference {
  Tensor logits;  // [N, out]
  double ce = 0, aux = 0;
  std::vector<std::vector<double>> expert_rows;  // per MoE layer: rows choosing each expert
  double min_gap = 1;          // min over rows and MoE layers of p_(k) - p_(k+1) (sorted, 1-based)
  double min_kink = HUGE_VAL;  // relu: min |z| over the hidden pre-activations
  Params grads;
  std::vector<int> routing;  // the chosen experts, MoE layer by layer, row by row
};

// y [N, o] = x [N, i] W [i, o] + b [o]
Tensor affine(const Tensor& x, const Tensor& w, const Tensor& b, int64_t i_dim, int64_t o_dim) {
  Tensor y(kBatch * o_dim, 0.0);
  for (int64_t r = 0; r < kBatch; ++r)
    for (int64_t j = 0; j < o_dim; ++j) {
      double s = b[j];
      for (int64_t i = 0; i < i_dim; ++i) s += x[r * i_dim + i] * w[i * o_dim + j];
      y[r * o_dim + j] = s;
    }
  return y;
}

// What an MoE layer's backward needs from its forward.
struct MoeForward {
  Tensor p;                              // [N, E]
  std::vector<std::vector<int>> chosen;  // [N][k]
  Tensor gates;                          // [N, k]
  std::vector<Tensor> ye;                // [N * k][out]: x W_e + b_e of each chosen expert
  std::vector<double> f;                 // [E]
};

Tensor moe_forward(const Tensor& x, const Tensor& wr, const Tensor& we, const Tensor& be,
                   int64_t in, int64_t out, double coef, MoeForward& c, Reference& ref) {
  const int64_t E = kExperts, K = kTopK;
  const double N = static_cast<double>(kBatch);
  c.p.assign(kBatch * E, 0.0);
  c.chosen.assign(kBatch, {});
  c.gates.assign(kBatch * K, 0.0);
  c.ye.assign(kBatch * K, Tensor(out, 0.0));
  std::vector<double> rows(E, 0.0), P(E, 0.0);
  Tensor y(kBatch * out, 0.0);
  for (int64_t r = 0; r < kBatch; ++r) {
    std::vector<double> l(E, 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < in; ++i) l[e] += x[r * in + i] * wr[i * E + e];
    const double mx = *std::max_element(l.begin(), l.end());
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(l[e] - mx);
    double* p = &c.p[r * E];
    for (int64_t e = 0; e < E; ++e) p[e] = std::exp(l[e] - mx) / s;
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    c.chosen[r].assign(order.begin(), order.begin() + K);
    ref.routing.insert(ref.routing.end(), c.chosen[r].begin(), c.chosen[r].end());
    ref.min_gap = std::min(ref.min_gap, p[order[K - 1]] - p[order[K]]);
    double sum = 0;
    for (int e : c.chosen[r]) sum += p[e];
    for (int64_t k = 0; k < K; ++k) {
      const int e = c.chosen[r][k];
      rows[e] += 1;
      c.gates[r * K + k] = p[e] / sum;
      for (int64_t j = 0; j < out; ++j) {
        double v = be[e * out + j];
        for (int64_t i = 0; i < in; ++i) v += x[r * in + i] * we[(e * in + i) * out + j];
        c.ye[r * K + k][j] = v;
        y[r * out + j] += c.gates[r * K + k] * v;
      }
    }
    for (int64_t e = 0; e < E; ++e) P[e] += p[e] / N;
  }
  c.f.assign(E, 0.0);
  for (int64_t e = 0; e < E; ++e) {
    c.f[e] = rows[e] / N;
    ref.aux += coef * E * c.f[e] * P[e];
  }
  ref.expert_rows.push_back(rows);
  return y;
}

// dy [N, out] -> the three gradients; returns dx [N, in].
Tensor moe_backward(const Tensor& x, const Tensor& dy, const Tensor& wr, const Tensor& we,
                    int64_t in, int64_t out, double coef, const MoeForward& c, Tensor& gwr,
                    Tensor& gwe, Tensor& gbe) {
  const int64_t E = kExperts, K = kTopK;
  const double N = static_cast<double>(kBatch);
  gwr.assign(in * E, 0.0);
  gwe.assign(E * in * out, 0.0);
  gbe.assign(E * out, 0.0);
  Tensor dx(kBatch * in, 0.0);
  for (int64_t r = 0; r < kBatch; ++r) {
    const double* d = &dy[r * out];
    const double* xr = &x[r * in];
    const double* p = &c.p[r * E];
    std::vector<double> dg(K, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const int e = c.chosen[r][k];
      const double g = c.gates[r * K + k];
      for (int64_t j = 0; j < out; ++j) {
        dg[k] += d[j] * c.ye[r * K + k][j];
        gbe[e * out + j] += g * d[j];
        for (int64_t i = 0; i < in; ++i) {
          gwe[(e * in + i) * out + j] += g * xr[i] * d[j];
          dx[r * in + i] += g * d[j] * we[(e * in + i) * out + j];
        }
      }
    }
    // g_s = p_s / S, S = sum of the chosen p: d g_s / d p_u = [s == u] / S - p_s / S^2.
    double S = 0;
    for (int e : c.chosen[r]) S += p[e];
    std::vector<double> dp(E);
    for (int64_t e = 0; e < E; ++e) dp[e] = coef * E * c.f[e] / N;  // the aux loss, f constant
    for (int64_t u = 0; u < K; ++u)
      for (int64_t s = 0; s < K; ++s) {
        const double dgs_dpu = (s == u ? 1.0 / S : 0.0) - p[c.chosen[r][s]] / (S * S);
        dp[c.chosen[r][u]] += dg[s] * dgs_dpu;
      }
    // Softmax: d logit_c = sum_e dp_e p_e ([e == c] - p_c).
    std::vector<double> dl(E, 0.0);
    for (int64_t col = 0; col < E; ++col)
      for (int64_t e = 0; e < E; ++e) dl[col] += dp[e] * p[e] * ((e == col ? 1.0 : 0.0) - p[col]);
    for (int64_t i = 0; i < in; ++i)
      for (int64_t col = 0; col < E; ++col) {
        gwr[i * E + col] += xr[i] * dl[col];
        dx[r * in + i] += dl[col] * wr[i * E + col];
      }
  }
  return dx;
}

Reference reference(const ModelCase& m, const Batch& batch, const Params& params, double coef) {
  const size_t n = kSizes.size() - 1;
  const MoeSettings moe = moe_settings(m, coef);
  Reference ref;
  std::vector<Tensor> a(n + 1), z(n);
  std::vector<MoeForward> cache(n);
  a[0] = batch.x;
  for (size_t l = 0; l < n; ++l) {
    const int64_t in = kSizes[l], out = kSizes[l + 1];
    const std::string L = layer_name(l);
    if (moe.is_moe(static_cast<int64_t>(l))) {
      z[l] = moe_forward(a[l], params.at(moe_router_name(L)), params.at(moe_experts_weight_name(L)),
                         params.at(moe_experts_bias_name(L)), in, out, coef, cache[l], ref);
    } else {
      z[l] = affine(a[l], params.at(L + "/weight"), params.at(L + "/bias"), in, out);
    }
    if (l + 1 < n) {
      a[l + 1] = z[l];
      for (double& v : a[l + 1]) v = activation(m.activation, v);
      if (m.activation == Activation::relu)
        for (double v : z[l]) ref.min_kink = std::min(ref.min_kink, std::abs(v));
    }
  }
  ref.logits = z[n - 1];

  // Mean cross-entropy over the global batch and its gradient.
  Tensor g;
  ref.ce = testing::mean_loss_and_gradient(LossKind::cross_entropy, ref.logits, kBatch,
                                           kSizes.back(), {}, batch.labels, g);

  for (size_t l = n; l-- > 0;) {
    const int64_t in = kSizes[l], o = kSizes[l + 1];
    const std::string L = layer_name(l);
    Tensor dx;
    if (moe.is_moe(static_cast<int64_t>(l))) {
      dx = moe_backward(a[l], g, params.at(moe_router_name(L)),
                        params.at(moe_experts_weight_name(L)), in, o, coef, cache[l],
                        ref.grads[moe_router_name(L)], ref.grads[moe_experts_weight_name(L)],
                        ref.grads[moe_experts_bias_name(L)]);
    } else {
      const Tensor& w = params.at(L + "/weight");
      Tensor& gw = ref.grads[L + "/weight"];
      Tensor& gb = ref.grads[L + "/bias"];
      gw.assign(in * o, 0.0);
      gb.assign(o, 0.0);
      dx.assign(kBatch * in, 0.0);
      for (int64_t r = 0; r < kBatch; ++r)
        for (int64_t j = 0; j < o; ++j) {
          const double d = g[r * o + j];
          gb[j] += d;
          for (int64_t i = 0; i < in; ++i) {
            gw[i * o + j] += a[l][r * in + i] * d;
            dx[r * in + i] += d * w[i * o + j];
          }
        }
    }
    if (l == 0) break;
    g = dx;
    for (int64_t i = 0; i < kBatch * in; ++i)
      g[i] *= activation_derivative(m.activation, z[l - 1][i]);
  }
  return ref;
}

// ---- the meshes ---------------------------------------------------------------------------
struct MeshCase {
  std::string name;
  int dp = 1, fsdp = 1, ep = 1, tp = 1;
  std::string preset;  // preset_rules(preset, true) after `rules`; "" for `rules` alone
  std::vector<std::pair<std::string, std::string>> rules;  // (pattern, spec) first
  int64_t min_sharding_size = 0;
  // What the MoE layer must have decided (the case is what its name says).
  bool bias_whole = false;                    // experts' bias stored whole, experts split
  std::vector<std::string> experts_gathered;  // the experts' weight gathered over
  int expert_ranks = 0;                       // the expert group's size; 0: ep
  std::vector<std::string> router_gathered;   // the router gathered over
};

std::vector<MeshCase> meshes_for(int n) {
  std::vector<MeshCase> c;
  auto add = [&c](MeshCase m) { c.push_back(std::move(m)); };
  if (n == 1) {
    add({"single", 1, 1, 1, 1, "dp"});
    add({"single_fsdp_tp_specs", 1, 1, 1, 1, "fsdp_tp"});
  } else if (n == 2) {
    add({"ep2", 1, 1, 2, 1, "dp"});
    add({"dp2_experts_replicated", 2, 1, 1, 1, "dp"});
    add({"fsdp2", 1, 2, 1, 1, "fsdp", {}, 0, false, {"fsdp"}});
    add({"tp2", 1, 1, 1, 2, "fsdp_tp", {}, 0, false, {"tp"}});
  } else if (n == 4) {
    add({"ep4", 1, 1, 4, 1, "dp"});
    add({"dp2_ep2", 2, 1, 2, 1, "dp"});
    add({"fsdp2_ep2", 1, 2, 2, 1, "fsdp", {}, 0, false, {"fsdp"}});
    add({"ep2_tp2", 1, 1, 2, 2, "fsdp_tp", {}, 0, false, {"tp"}});
    add({"dp2_ep2_bias_whole",
         2,
         1,
         2,
         1,
         "",
         {{"experts/weight$", "P(ep, None, None)"}, {".*", "P()"}},
         0,
         true});
    // Biases [4, 8] = 32 elements < 100 <= 256 ([4, 8, 8]) or 384 ([4, 12, 8]) of the
    // weights: only the experts' weight is split.
    add({"ep4_bias_below_min_sharding_size", 1, 1, 4, 1, "dp", {}, 100, true});
    // A bias stored whole but split over fsdp on its out dim, and the router split over
    // fsdp (gathered, its gradient reduce-scattered).
    add({"fsdp2_ep2_router_split_bias_whole",
         1,
         2,
         2,
         1,
         "fsdp",
         {{"router/weight$", "P(fsdp, None)"}, {"experts/bias$", "P(None, fsdp)"}},
         0,
         true,
         {"fsdp"},
         0,
         {"fsdp"}});
    // The router split over tp, which does not split the batch (gradient divided by tp).
    add({"ep2_tp2_router_split_tp",
         1,
         1,
         2,
         2,
         "fsdp_tp",
         {{"router/weight$", "P(tp, None)"}},
         0,
         false,
         {"tp"},
         0,
         {"tp"}});
    // The experts over a tuple of batch axes, one expert per rank, both tuple orders.
    add({"fsdp2_ep2_experts_over_ep_fsdp",
         1,
         2,
         2,
         1,
         "fsdp",
         {{"experts/weight$", "P((ep, fsdp), None, None)"}, {"experts/bias$", "P((ep, fsdp))"}},
         0,
         false,
         {},
         4});
    add({"fsdp2_ep2_experts_over_fsdp_ep",
         1,
         2,
         2,
         1,
         "fsdp",
         {{"experts/weight$", "P((fsdp, ep), None, None)"}, {"experts/bias$", "P((fsdp, ep))"}},
         0,
         false,
         {},
         4});
  } else if (n == 8) {
    add({"dp2_fsdp2_ep2", 2, 2, 2, 1, "fsdp", {}, 0, false, {"fsdp"}});
    add({"fsdp2_ep4_out_dim",
         1,
         2,
         4,
         1,
         "fsdp",
         {{"experts/weight$", "P(ep, None, fsdp)"}, {"experts/bias$", "P(ep, fsdp)"}},
         0,
         false,
         {"fsdp"}});
  }
  return c;
}

std::vector<PartitionRule> rules_of(const MeshCase& c) {
  std::vector<PartitionRule> rules;
  for (const auto& [pattern, spec] : c.rules)
    rules.push_back(PartitionRule{pattern, PartitionSpec::parse(spec), false});
  if (!c.preset.empty()) {
    const auto preset = preset_rules(c.preset, /*moe=*/true);
    rules.insert(rules.end(), preset.begin(), preset.end());
  }
  return rules;
}

// ---- gathering blocks to full tensors, checking the replicas agree -------------------------
struct Gathered {
  Tensor full;
  double spread = 0;  // largest difference between two ranks' copies of one element
  bool tiled = true;  // every element held by the same number (>= 1) of ranks
};

// Collective over `comm`: every rank gives its block (offset, extent of any rank, row-major
// values) of a tensor of `shape`; the same calls in the same order on every rank.
Gathered gather_blocks(const Tensor& local, const std::vector<int64_t>& shape,
                       const std::vector<int64_t>& offset, const std::vector<int64_t>& extent,
                       MPI_Comm comm) {
  int64_t total = 1;
  for (int64_t d : shape) total *= d;
  Tensor sum(total, 0.0), count(total, 0.0), hi(total, -HUGE_VAL), lo(total, HUGE_VAL);
  const size_t rank = shape.size();
  std::vector<int64_t> idx(rank, 0);  // multi-index within the block
  for (size_t i = 0; i < local.size(); ++i) {
    int64_t g = 0;
    for (size_t d = 0; d < rank; ++d) g = g * shape[d] + offset[d] + idx[d];
    sum[g] += local[i];
    count[g] += 1;
    hi[g] = std::max(hi[g], local[i]);
    lo[g] = std::min(lo[g], local[i]);
    for (size_t d = rank; d-- > 0;) {  // next multi-index, last dim fastest
      if (++idx[d] < extent[d]) break;
      idx[d] = 0;
    }
  }
  const int n = static_cast<int>(total);
  MPI_Allreduce(MPI_IN_PLACE, sum.data(), n, MPI_DOUBLE, MPI_SUM, comm);
  MPI_Allreduce(MPI_IN_PLACE, count.data(), n, MPI_DOUBLE, MPI_SUM, comm);
  MPI_Allreduce(MPI_IN_PLACE, hi.data(), n, MPI_DOUBLE, MPI_MAX, comm);
  MPI_Allreduce(MPI_IN_PLACE, lo.data(), n, MPI_DOUBLE, MPI_MIN, comm);
  Gathered out;
  out.full.resize(total);
  for (int64_t i = 0; i < total; ++i) {
    out.tiled = out.tiled && count[i] >= 1 && count[i] == count[0];
    out.full[i] = count[i] > 0 ? sum[i] / count[i] : 0.0;
    if (count[i] > 0) out.spread = std::max(out.spread, hi[i] - lo[i]);
  }
  return out;
}

Gathered gather_tensor(const ShardedTensor& t, MPI_Comm comm) {
  return gather_blocks(to_host(t), t.global_shape, t.box.offset, t.box.extent, comm);
}

// ---- one run --------------------------------------------------------------------------------
struct RunResult {
  Gathered logits;  // [N, out]
  double ce = 0, aux = 0;
  std::vector<std::vector<double>> expert_rows;  // per MoE layer
  std::map<std::string, Gathered> grads, params;
  bool moe_output_in_bf16 = true;  // this rank's MoE layer outputs are all bf16 values
  // What was built and planned, per MoE layer.
  std::vector<MoeLayout> layouts;
  std::vector<std::string> built, planned;
  int64_t rows = 0, planned_rows = 0, first_row = 0, slice_first_row = 0;
};

struct RunOptions {
  bool zero_router = false;  // after a first step with the initialized routers
  bool bf16 = false;
  float loss_scale = 1.0f;
  bool overlap = false;  // FSDP prefetch and DP gradient buckets around the MoE layers
};

// `self`: the mesh of one rank on MPI_COMM_SELF (every process runs the np-1 model).
RunResult run_model(const ModelCase& m, const MeshCase& c, const Batch& batch, const RunOptions& o,
                    bool self = false) {
  MPI_Comm world = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  const int ranks = self ? 1 : world_size();
  const Mesh mesh =
      Mesh::create({{"dp", c.dp}, {"fsdp", c.fsdp}, {"ep", c.ep}, {"tp", c.tp}, {"sp", 1}}, ranks);
  MeshCommunicators comms(mesh, world,
                          self ? CommunicatorFactory{} : testing::test_communicator_factory());
  const LayerAxes axes = layer_axes(LogicalAxes(), /*with_experts=*/true);
  const double bucket_mb = 40.0 * sizeof(float) / (1024 * 1024);  // several buckets
  ParallelContext context(comms, axes.batch, axes.feature, CollectiveMatmulAlgorithm::automatic,
                          o.overlap, bucket_mb);
  if (o.bf16) context.set_precision({Dtype::bf16, Dtype::bf16});

  const MoeSettings moe = moe_settings(m);
  PlanOptions options;
  options.min_sharding_size = c.min_sharding_size;
  options.batch_axes = axes.batch;
  options.feature_axis = axes.feature;
  options.global_batch = kBatch;
  const ShardingPlan plan = make_plan(mlp_parameter_shapes(kSizes, moe), mesh, rules_of(c), options,
                                      mlp_linear_layers(kSizes, moe));

  RunResult run;
  run.rows = kBatch / context.batch_parallel();
  run.first_row = context.batch_index() * run.rows;
  run.slice_first_row = make_batch_slice(mesh, context.rank(), axes.batch, kBatch).begin();
  run.planned_rows = plan.local_batch_rows;
  Mlp model(kSizes, m.activation, specs_from_plan(plan), context, run.rows, moe);
  model.initialize(InitScheme::normal, kSeed);
  Loss loss(LossKind::cross_entropy, context, run.rows, kSizes.back(), model.output_layout());
  for (const MoeLayer& layer : model.moe_layers()) {
    run.layouts.push_back(layer.layout());
    run.built.push_back(layer.describe());
  }
  for (const auto& l : plan.layers)
    if (l.moe) run.planned.push_back(l.name + ": " + l.compute);

  const int64_t in = kSizes.front();
  Matrix x("x", run.rows, in);
  Kokkos::View<int32_t*> labels("labels", run.rows);
  auto xh = Kokkos::create_mirror_view(x);
  auto lh = Kokkos::create_mirror_view(labels);
  for (int64_t i = 0; i < run.rows; ++i) {
    const int64_t r = run.first_row + i;
    for (int64_t k = 0; k < in; ++k) xh(i, k) = static_cast<float>(batch.x[r * in + k]);
    lh(i) = batch.labels[r];
  }
  Kokkos::deep_copy(x, xh);
  Kokkos::deep_copy(labels, lh);

  if (o.zero_router) {
    // A step with the routers as initialized (other routing, other dispatch sizes), then
    // the measured one with every router zero: the layer's buffers are reused.
    loss.cross_entropy(model.forward(x), labels);
    model.backward(loss.gradient(), true, o.loss_scale);
    for (auto& p : model.parameters())
      if (is_router(p.name)) Kokkos::deep_copy(p.local, 0.0f);
  }

  MatrixView logits = model.forward(x);
  {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), logits);
    Tensor block;
    for (size_t i = 0; i < h.extent(0); ++i)
      for (size_t j = 0; j < h.extent(1); ++j) block.push_back(h(i, j));
    run.logits =
        gather_blocks(block, {kBatch, kSizes.back()}, {run.first_row, model.output_offset()},
                      {run.rows, model.output_width()}, world);
    for (const MoeLayer& layer : model.moe_layers()) {
      auto y = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), layer.output());
      for (size_t i = 0; i < y.extent(0); ++i)
        for (size_t j = 0; j < y.extent(1); ++j)
          run.moe_output_in_bf16 =
              run.moe_output_in_bf16 && round_to(y(i, j), Dtype::bf16) == y(i, j);
    }
  }
  run.ce = loss.cross_entropy(logits, labels).loss;
  run.aux = model.aux_loss();
  for (const MoeLayer& layer : model.moe_layers()) run.expert_rows.push_back(layer.expert_rows());
  model.backward(loss.gradient(), true, o.loss_scale);
  for (const auto& g : model.gradients()) run.grads[g.name] = gather_tensor(g, world);
  for (const auto& p : model.parameters()) run.params[p.name] = gather_tensor(p, world);
  return run;
}

// ---- comparisons ----------------------------------------------------------------------------
// Largest error relative to max|ref| per check, for the summary line.
struct Errors {
  std::map<std::string, double> worst;
  void note(const std::string& key, double v) { worst[key] = std::max(worst[key], v); }
  std::string line() const {
    std::string s;
    for (const auto& [k, v] : worst) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s%s %.2g", s.empty() ? "" : ", ", k.c_str(), v);
      s += buf;
    }
    return s;
  }
};

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t) m = std::max(m, std::abs(v));
  return m;
}

// Per tensor: max |got - ref| <= rel * max|ref| + abs.
void expect_close(const Tensor& got, const Tensor& ref, double rel, double abs,
                  const std::string& what, Errors& errors, const std::string& key) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double max_ref = max_abs(ref);
  double max_err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(got[i] - ref[i]);
    if (e > max_err || i == 0) {
      max_err = e;
      worst = i;
    }
  }
  errors.note(key, max_ref > 0 ? max_err / max_ref : max_err);
  EXPECT_LE(max_err, rel * max_ref + abs)
      << what << ": element " << worst << " is " << got[worst] << ", reference " << ref[worst]
      << " (max |ref| " << max_ref << ", allowed " << rel * max_ref + abs << ")";
}

void expect_scalar(double got, double ref, double rel, const std::string& what, Errors& errors,
                   const std::string& key) {
  const double err = std::abs(got - ref);
  errors.note(key, std::abs(ref) > 0 ? err / std::abs(ref) : err);
  EXPECT_LE(err, rel * std::abs(ref) + kAbsTol) << what << ": " << got << ", reference " << ref;
}

// Replicas agree and the blocks tile the tensor.
void expect_consistent(const Gathered& g, double rel, const std::string& what) {
  EXPECT_TRUE(g.tiled) << what << ": the ranks' blocks do not tile the full tensor";
  EXPECT_LE(g.spread, rel * max_abs(g.full) + kAbsTol)
      << what << ": copies of one element on different ranks differ by " << g.spread;
}

// A run against expected values: logits, CE, aux, rows per expert, every gradient.
struct Expected {
  Tensor logits;
  double ce, aux;
  Params grads;
};

void compare(const RunResult& run, const Expected& want, double rel, double abs, Errors& errors,
             const std::string& tag) {
  expect_consistent(run.logits, rel, tag + " logits");
  expect_close(run.logits.full, want.logits, rel, abs, tag + " logits", errors, tag + " logits");
  expect_scalar(run.ce, want.ce, rel, tag + " cross-entropy", errors, tag + " ce");
  expect_scalar(run.aux, want.aux, rel, tag + " aux loss", errors, tag + " aux");
  for (const auto& [name, ref] : want.grads) {
    ASSERT_TRUE(run.grads.count(name)) << "the model has no gradient " << name;
    const Gathered& g = run.grads.at(name);
    expect_consistent(g, rel, tag + " gradient of " + name);
    expect_close(g.full, ref, rel, abs, tag + " gradient of " + name, errors, tag + " grads");
  }
}

Expected expected_of(const Reference& r) {
  return {r.logits, r.ce, r.aux, r.grads};
}
Expected expected_of(const RunResult& r) {
  Params grads;
  for (const auto& [name, g] : r.grads) grads[name] = g.full;
  return {r.logits.full, r.ce, r.aux, grads};
}

// What every run must have built: the layout of its mesh case, the plan's description, the
// batch slice, the parameters of the single-rank initialization.
void expect_built_as_planned(const RunResult& run, const ModelCase& m, const MeshCase& c,
                             const Params& masters) {
  EXPECT_EQ(run.built, run.planned);
  ASSERT_EQ(run.layouts.size(), m.moe_layers.size());
  EXPECT_EQ(run.planned_rows, run.rows);
  EXPECT_EQ(run.slice_first_row, run.first_row);
  const int expert_ranks = c.expert_ranks ? c.expert_ranks : c.ep;
  for (size_t i = 0; i < run.layouts.size(); ++i) {
    const MoeLayout& l = run.layouts[i];
    const int64_t index = m.moe_layers[i];
    EXPECT_EQ(l.layer, layer_name(index));
    EXPECT_EQ(l.ep, expert_ranks) << run.built[i];
    EXPECT_EQ(l.experts_local, kExperts / expert_ranks) << run.built[i];
    EXPECT_EQ(l.experts_bias.all_experts, c.bias_whole) << run.built[i];
    EXPECT_EQ(l.experts_weight.gather(), c.experts_gathered) << run.built[i];
    EXPECT_EQ(l.router.gather(), c.router_gathered) << run.built[i];
    // After a linear layer under TP the input arrives split and is gathered.
    const bool after_linear = index > 0 && !moe_settings(m).is_moe(index - 1);
    EXPECT_EQ(l.gathers_input(), c.tp > 1 && after_linear) << run.built[i];
  }
  for (const auto& [name, ref] : masters) {
    ASSERT_TRUE(run.params.count(name)) << name;
    const Gathered& p = run.params.at(name);
    EXPECT_TRUE(p.tiled) << name;
    EXPECT_EQ(p.spread, 0.0) << name;
    EXPECT_EQ(p.full, ref) << "parameter " << name << " is not the single-rank initialization";
  }
}

void summary(const std::string& what, const Errors& errors) {
  if (world_rank() == 0) {
    std::printf("[moe np%d] %s: max |err|/max|ref|: %s\n", world_size(), what.c_str(),
                errors.line().c_str());
    std::fflush(stdout);
  }
}

// ---- the tests --------------------------------------------------------------------------------

// The reference's hand-derived backward (the router's softmax, the renormalized gates of the
// top-k choice, the experts, the aux loss through the probabilities with the counts held, the
// cross-entropy, tanh and relu) is the derivative of its forward: every parameter gradient of
// every model against central differences in float64 of CE + aux. Step h = 1e-5 (parameters
// of O(0.1..1)): truncation h^2/6 |L'''| and rounding eps |L| / h (|L| ~ 2) are each below
// 1e-9 (measured largest difference printed); tolerance 1e-7 (1 + |g|), far below the smallest
// effect the fp32 test relies on (dropping the aux gradient, a control here too). The top-k
// choice and relu are piecewise: every perturbed forward must choose the same experts (top-k
// gaps >= 1e-3, asserted, against moves of ~1e-5), and relu's pre-activations stay >= 0.01
// from 0. The reference does not depend on the ranks: checked once, at np 1.
TEST(Moe, ReferenceGradientsMatchCentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "the float64 reference alone: checked at np 1";
  constexpr double kStep = 1e-5, kFdTolerance = 1e-7;
  const Batch batch = make_batch();
  for (const auto& m : models()) {
    SCOPED_TRACE(m.name);
    const Params masters = master_parameters(m, false);
    const Reference ref = reference(m, batch, masters, kAuxCoef);
    ASSERT_GE(ref.min_gap, 1e-3);
    if (m.activation == Activation::relu) ASSERT_GE(ref.min_kink, 1e-2);
    std::vector<std::string> names;
    testing::Tensors values, grads, no_aux_grads;
    const Reference no_aux = reference(m, batch, masters, 0.0);
    for (const auto& [name, value] : masters) {
      names.push_back(name);
      values.push_back(value);
      grads.push_back(ref.grads.at(name));
      no_aux_grads.push_back(no_aux.grads.at(name));
    }
    int64_t rerouted = 0;
    const testing::Tensors numeric = testing::central_differences(
        values,
        [&](const testing::Tensors& v) {
          Params p;
          for (size_t k = 0; k < names.size(); ++k) p[names[k]] = v[k];
          const Reference r = reference(m, batch, p, kAuxCoef);
          rerouted += r.routing == ref.routing ? 0 : 1;
          return r.ce + r.aux;
        },
        kStep);
    ASSERT_EQ(rerouted, 0) << "a perturbed forward chose other experts";
    const double worst =
        testing::expect_matches_central_differences(numeric, grads, kFdTolerance, names);
    EXPECT_GT(testing::largest_difference(numeric, no_aux_grads), 1000 * kFdTolerance);
    std::printf(
        "[ moe ] %s: reference gradients vs central differences: largest "
        "|fd - g| / (1 + |g|) %.2e (tolerance %.0e)\n",
        m.name.c_str(), worst, kFdTolerance);
  }
}

// fp32 on every mesh: output, CE, aux loss, rows per expert and every gradient equal the
// double reference; the layer is built as planned.
TEST(Moe, Fp32MatchesDoubleReferenceOnEveryMesh) {
  const Batch batch = make_batch();
  for (const auto& m : models()) {
    const Params masters = master_parameters(m, false);
    const Reference ref = reference(m, batch, masters, kAuxCoef);
    // The data decides the top-k choice with room to spare, and the choice is not uniform
    // (else the aux gradient vanishes through the softmax): dropping the aux gradient moves
    // every router gradient by over 100x the tolerance.
    ASSERT_GE(ref.min_gap, 1e-3) << m.name;
    const Reference no_aux = reference(m, batch, masters, 0.0);
    for (const auto& [name, g] : ref.grads) {
      if (!is_router(name)) continue;
      double diff = 0;
      for (size_t i = 0; i < g.size(); ++i)
        diff = std::max(diff, std::abs(g[i] - no_aux.grads.at(name)[i]));
      ASSERT_GE(diff, 100 * (kRelTol * max_abs(g) + kAbsTol)) << m.name << " " << name;
    }
    for (const auto& c : meshes_for(world_size())) {
      SCOPED_TRACE(m.name + " on " + c.name);
      const RunResult run = run_model(m, c, batch, {});
      expect_built_as_planned(run, m, c, masters);
      EXPECT_EQ(run.expert_rows, ref.expert_rows);
      Errors errors;
      compare(run, expected_of(ref), kRelTol, kAbsTol, errors, "fp32");
      // With overlap the linear layers prefetch and bucket around the MoE layer, which
      // reduces its own gradients: the same sums in the same order, bit for bit.
      const RunResult overlapped = run_model(m, c, batch, {false, false, 1.0f, /*overlap=*/true});
      EXPECT_EQ(overlapped.logits.full, run.logits.full);
      EXPECT_EQ(overlapped.ce, run.ce);
      EXPECT_EQ(overlapped.aux, run.aux);
      for (const auto& [name, g] : run.grads)
        EXPECT_EQ(overlapped.grads.at(name).full, g.full) << "with overlap: gradient of " << name;
      summary(c.name + " " + m.name + " fp32 vs double", errors);
    }
  }
}

// Ties: a zero router gives every expert 1/4; the lower indices win, so every row uses
// experts 0 and 1, the others get no rows and zero gradients; all as the reference. The
// step measured is the second (the first with the initialized routers).
TEST(Moe, ZeroRouterTiesChooseTheLowerExpertsOnEveryMesh) {
  const Batch batch = make_batch();
  const double n = static_cast<double>(kBatch);
  for (const auto& m : models()) {
    const Params masters = master_parameters(m, true);
    const Reference ref = reference(m, batch, masters, kAuxCoef);
    const std::vector<std::vector<double>> tied(m.moe_layers.size(), {n, n, 0, 0});
    ASSERT_EQ(ref.expert_rows, tied);
    for (const auto& c : meshes_for(world_size())) {
      SCOPED_TRACE(m.name + " on " + c.name + ", routers all zeros");
      const RunResult run = run_model(m, c, batch, {/*zero_router=*/true});
      expect_built_as_planned(run, m, c, masters);
      EXPECT_EQ(run.expert_rows, tied);
      // Per layer coef * E * (f_0 P_0 + f_1 P_1) = 0.05 * 4 * (1/4 + 1/4).
      EXPECT_DOUBLE_EQ(run.aux, m.moe_layers.size() * kAuxCoef * kExperts * 0.5);
      Errors errors;
      compare(run, expected_of(ref), kRelTol, kAbsTol, errors, "ties");
      // Experts 2 and 3 see no row: their weight and bias gradients are exactly 0.
      for (int64_t l : m.moe_layers) {
        const std::string L = layer_name(l);
        const Tensor& gw = run.grads.at(moe_experts_weight_name(L)).full;
        const Tensor& gb = run.grads.at(moe_experts_bias_name(L)).full;
        EXPECT_TRUE(std::all_of(gw.begin() + gw.size() / 2, gw.end(), [](double v) {
          return v == 0;
        })) << L;
        EXPECT_TRUE(std::all_of(gb.begin() + gb.size() / 2, gb.end(), [](double v) {
          return v == 0;
        })) << L;
        EXPECT_GT(max_abs(Tensor(gw.begin(), gw.begin() + gw.size() / 2)), 0.0) << L;
      }
      summary(c.name + " " + m.name + " zero routers vs double", errors);
    }
  }
}

// bf16 compute and reductions: within 5% of the fp32 reference and within the reductions'
// bound of the np-1 bf16 run; the MoE layers' outputs are rounded to bf16.
TEST(Moe, Bf16IsCloseToTheReferenceAndToOneRankOnEveryMesh) {
  const Batch batch = make_batch();
  for (const auto& m : models()) {
    const Params masters = master_parameters(m, false);
    const Reference ref = reference(m, batch, masters, kAuxCoef);
    ASSERT_GE(ref.min_gap, 0.01) << m.name;  // room for bf16 (header)
    ASSERT_GE(ref.min_kink, 0.01) << m.name;
    const MeshCase single{"single", 1, 1, 1, 1, "dp"};
    const RunResult one = run_model(m, single, batch, {false, true}, /*self=*/true);
    for (const auto& c : meshes_for(world_size())) {
      SCOPED_TRACE(m.name + " on " + c.name + ", bf16");
      const RunResult run = run_model(m, c, batch, {false, /*bf16=*/true});
      expect_built_as_planned(run, m, c, masters);
      EXPECT_EQ(run.expert_rows, ref.expert_rows);
      EXPECT_TRUE(run.moe_output_in_bf16) << "an MoE output is not rounded to bf16";
      Errors errors;
      compare(run, expected_of(ref), kBf16VsReference, kAbsTol, errors, "bf16 vs double");
      const double k = 3 * (c.dp * c.fsdp * c.ep) + 3 * (c.tp - 1) + 2;
      compare(run, expected_of(one), k * std::ldexp(1.0, -8), kAbsTol, errors, "bf16 vs np1 bf16");
      // Loss scale 8 (a power of two: every rounding commutes with it): the gradients, the
      // aux loss's part included, are 8x those of the unscaled run.
      const RunResult x8 = run_model(m, c, batch, {false, true, 8.0f});
      Expected want = expected_of(run);
      for (auto& [name, g] : want.grads)
        for (double& v : g) v *= 8;
      compare(x8, want, kRelTol, kAbsTol, errors, "bf16 x8 vs 8 x bf16");
      summary(c.name + " " + m.name + " bf16", errors);
    }
  }
}

// top_k above kMoeMaxTopK (partition/moe_limits.hpp; the gate kernels keep k values per row
// in registers), with enough experts for it: bad_input naming top_k and the limit (the config
// refuses it first: cli_plan_moe_top_k_limit; this is a model built in code).
TEST(Moe, TopKAboveTheLimitIsBadInput) {
  const Mesh mesh = Mesh::create({{"dp", 1}, {"fsdp", 1}, {"ep", 1}, {"tp", 1}, {"sp", 1}}, 1);
  MeshCommunicators comms(mesh, MPI_COMM_SELF, CommunicatorFactory{});
  const LayerAxes axes = layer_axes(LogicalAxes(), /*with_experts=*/true);
  ParallelContext context(comms, axes.batch, axes.feature, CollectiveMatmulAlgorithm::automatic,
                          false, 25.0);
  const int64_t top_k = kMoeMaxTopK + 1;
  const MoeSettings moe{{1}, top_k + 3, top_k, kAuxCoef};
  PlanOptions options;
  options.min_sharding_size = 0;
  options.batch_axes = axes.batch;
  options.feature_axis = axes.feature;
  options.global_batch = kBatch;
  const ShardingPlan plan =
      make_plan(mlp_parameter_shapes(kSizes, moe), mesh, preset_rules("dp", /*moe=*/true), options,
                mlp_linear_layers(kSizes, moe));
  testing::expect_error(
      [&] { Mlp model(kSizes, Activation::relu, specs_from_plan(plan), context, kBatch, moe); },
      ErrorKind::bad_input,
      {"top_k = " + std::to_string(top_k), "largest top_k " + std::to_string(kMoeMaxTopK)});
}

}  // namespace
}  // namespace meshtrain
