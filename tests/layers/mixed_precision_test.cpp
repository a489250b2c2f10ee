// Mixed precision (docs/mixed_precision.md) in every layout of mlp_test: for each policy
// {param P, reduce R} in {bf16, bf16}, {fp16, fp16}, {bf16, fp32}, {fp32, bf16}, the MLP built
// after context.set_precision(policy) gives, after one forward, loss and backward, the
// logits, the loss and EVERY gradient (gathered to full shape) of a reference computed here
// in double with independent loops that rounds at exactly the documented cast points 1-10:
// round_P(v) = round_to(float(v), P), i.e. fp32 arithmetic between cast points. The
// reference is one rank's full batch (no sum over ranks, so R does not enter it); it is the
// np-1 run, so every layout is also compared with the single-rank run.
//
// Tolerances. u = 2^-p is the unit roundoff of a dtype with p significant bits (bf16 8,
// fp16 11, fp32 24): one rounding moves a value by at most u relative to it; ulp_D(v) is the
// spacing of D's values at |v|.
//  * Flips only: one rank, and the logits and loss of a layout without a TP layer (its rows
//    are computed as on one rank). The model and the reference round the same values at the
//    same points; they differ only between cast points (fp32 GEMM accumulation order, fp32
//    tanh vs double), by a few fp32 ulps, which flips a 16-bit rounding only for a value
//    within those few fp32 ulps of a tie: that element is off by one ulp of its dtype, and
//    what is computed from it by a fraction of an ulp of each term. So every element is
//    within  ulp_P(ref) + 2^-18 * max|ref|  (per tensor; the second term is fp32
//    accumulation and flips carried into smaller sums), at most 2% of the 16-bit elements
//    differ at all, and the loss is within u_P relative (+1e-6). (Observed on this CPU
//    build: no element differs at all for the 16-bit policies.)
//  * Reductions: the gradients on several ranks, and the forward under TP. Each rank's
//    partial gradient is rounded to P on its own (the reference rounds the whole sum once),
//    then to R before the first hop of the sum over ranks, which rounds once per hop in an
//    order the backend chooses: 3 roundings per batch rank. Under TP the partial products of
//    the forward are summed in P, one rounding per hop, and the change in z moves the
//    activation, the loss gradient and the backward built on them: 3 per TP hop. Plus one
//    flipped final rounding (one ulp, 2u). Each rounding is of a partial sum no larger (up
//    to cancellation) than the tensor's largest value, so per tensor
//        max |got - ref| <= K * u * max|ref|,   u = max(u_P, u_R),
//        K = 3 * batch_ranks + 3 * (tp - 1) + 2,
//    and the loss within K * u relative. E.g. bf16 on dp4 or tp4: K = 14, 5.5%; observed
//    below 1.3% (see the summary the test prints).
// Also checked:
//  * the casts happen: with P 16-bit every logit is a P value; with P = fp32 some logit is
//    not a bf16 value; on one rank every gradient is a P value (point 8); on meshes that
//    only split the batch (every gradient is summed over ranks) every gradient is an R value.
//  * fp16 with loss scale 1024: the reference with S = 1024 as above, and 1024 x the
//    unscaled reference (S is a power of two: only values the unscaled run has below fp16's
//    normal range, 2^-14, round differently; on one rank u_fp16 * max|ref| is allowed for
//    that instead of 2^-18).
//  * {fp32, fp32} is bit for bit the model built without set_precision (EXPECT_EQ).
//  * overlap on (FSDP prefetch gathers in P, DP gradient buckets summed in R), same bounds.
//
// Models: 32-16-16-6, tanh, cross-entropy (6 outputs do not divide by 4: tp4 keeps the last
// output replicated through the all-reduce fallback, summed in P), and 32-16-16-8, relu, MSE;
// init `normal` (non-zero biases, so the second rounding of point 4 matters). Global batch
// 16 (2 rows per rank on dp2 x fsdp4). And silu (bf16/bf16), sigmoid (fp16/fp16, MSE) and
// gelu_erf (bf16/fp32) in the same shapes, one policy each, without overlap.

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/tensor_values.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/activation.hpp"
#include "layers/context.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "partition/sixteen_bit_storage.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/reference_losses.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kBatch = 16;
constexpr uint64_t kSeed = 11;

using testing::gather_full;
using testing::Tensor;
using testing::to_host;

// ---- dtypes -----------------------------------------------------------------------------
int significand_bits(Dtype d) {
  return d == Dtype::bf16 ? 8 : d == Dtype::fp16 ? 11 : 24;
}
double unit_roundoff(Dtype d) {
  return std::ldexp(1.0, -significand_bits(d));
}
const char* dtype_name(Dtype d) {
  return d == Dtype::bf16 ? "bf16" : d == Dtype::fp16 ? "fp16" : "fp32";
}
// The spacing of `d`'s values at |v| (fp16: 2^-24 below its normal range).
double ulp(double v, Dtype d) {
  const double smallest = d == Dtype::fp16 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -149);
  if (v == 0) return smallest;
  int e = 0;
  std::frexp(std::abs(v), &e);  // |v| in [2^(e-1), 2^e)
  return std::max(std::ldexp(1.0, e - significand_bits(d)), smallest);
}
// round_P: the fp32 result of the arithmetic before the cast point, rounded to `d`.
double rnd(double v, Dtype d) {
  return round_to(static_cast<float>(v), d);
}
bool representable(double v, Dtype d) {
  return rnd(v, d) == v;
}

struct Policy {
  std::string name;
  MixedPrecision mp;
};

std::vector<Policy> policies() {
  return {{"bf16/bf16", {Dtype::bf16, Dtype::bf16}},
          {"fp16/fp16", {Dtype::fp16, Dtype::fp16}},
          {"bf16/fp32", {Dtype::bf16, Dtype::fp32}},
          {"fp32/bf16", {Dtype::fp32, Dtype::bf16}}};
}

// ---- the models and the data --------------------------------------------------------------
struct ModelCase {
  std::string name;
  std::vector<int64_t> sizes;  // a residual_mlp: {inputs, outputs}
  Activation activation;
  LossKind loss;
  std::optional<ResidualMlpShape> residual;  // a residual_mlp of this shape (run_model only)
};

std::vector<ModelCase> models() {
  return {{"tanh_ce", {32, 16, 16, 6}, Activation::tanh, LossKind::cross_entropy},
          {"relu_mse", {32, 16, 16, 8}, Activation::relu, LossKind::mse}};
}

struct Batch {
  Tensor x;        // [B, in]
  Tensor targets;  // [B, out]
  std::vector<int32_t> labels;
};

Batch make_batch(const ModelCase& m) {
  const int64_t in = m.sizes.front(), out = m.sizes.back();
  Batch b;
  for (int64_t i = 0; i < kBatch * in; ++i)
    b.x.push_back(counter_normal(kSeed, name_stream("x"), i));
  for (int64_t i = 0; i < kBatch * out; ++i)
    b.targets.push_back(counter_normal(kSeed, name_stream("t"), i));
  for (int64_t i = 0; i < kBatch; ++i)
    b.labels.push_back(static_cast<int32_t>(counter_uniform(kSeed, name_stream("y"), i) * out));
  return b;
}

// The fp32 masters, as a single rank initializes them.
std::vector<Tensor> master_parameters(const ModelCase& m) {
  std::vector<Tensor> params;
  for (const auto& p : mlp_parameter_shapes(m.sizes)) {
    ShardedTensor t = ShardedTensor::allocate(p.name, p.shape, PartitionSpec(), Mesh::single(), 0);
    initialize(t, InitScheme::normal, kSeed);
    params.push_back(to_host(t));
  }
  return params;
}

// ---- the reference: plain loops in double, rounded at the cast points ---------------------
using testing::activation;
using testing::activation_derivative;

struct Reference {
  Tensor logits;  // the last z [B, out]
  double loss = 0;
  std::vector<Tensor> grads;  // weight, bias of layer 0, ...
};

// One rank's full batch; P = param dtype, S = loss scale. The reduce dtype does not appear:
// one rank sums over no ranks.
Reference reference(const ModelCase& m, const Batch& b, Dtype P, double S) {
  const std::vector<Tensor> masters = master_parameters(m);
  const size_t n = m.sizes.size() - 1;
  auto rounded = [P](Tensor t) {
    for (double& v : t) v = rnd(v, P);
    return t;
  };
  std::vector<Tensor> w(n), bias(n), a(n + 1), z(n);
  for (size_t l = 0; l < n; ++l) {  // 2: the parameters cast to P
    w[l] = rounded(masters[2 * l]);
    bias[l] = rounded(masters[2 * l + 1]);
  }
  a[0] = rounded(b.x);  // 1: the batch
  for (size_t l = 0; l < n; ++l) {
    const int64_t in = m.sizes[l], out = m.sizes[l + 1];
    z[l].assign(kBatch * out, 0.0);
    for (int64_t i = 0; i < kBatch; ++i)
      for (int64_t j = 0; j < out; ++j) {
        double p = 0;
        for (int64_t k = 0; k < in; ++k) p += a[l][i * in + k] * w[l][k * out + j];
        z[l][i * out + j] = rnd(rnd(p, P) + bias[l][j], P);  // 3 and 4
      }
    if (l + 1 < n) {
      a[l + 1] = z[l];
      for (double& v : a[l + 1]) v = rnd(activation(m.activation, v), P);  // 5
    }
  }
  Reference r;
  r.logits = z[n - 1];
  // 6: the loss from the last z, in double; 7: its gradient scaled and cast.
  Tensor g;
  r.loss = testing::mean_loss_and_gradient(m.loss, r.logits, kBatch, m.sizes.back(), b.targets,
                                           b.labels, g);
  for (double& v : g) v = rnd(S * static_cast<float>(v), P);
  r.grads.resize(2 * n);
  for (size_t l = n; l-- > 0;) {
    const int64_t in = m.sizes[l], o = m.sizes[l + 1];
    Tensor& gw = r.grads[2 * l];
    Tensor& gb = r.grads[2 * l + 1];
    gw.assign(in * o, 0.0);
    gb.assign(o, 0.0);
    for (int64_t k = 0; k < in; ++k)
      for (int64_t j = 0; j < o; ++j) {
        double s = 0;
        for (int64_t i = 0; i < kBatch; ++i) s += a[l][i * in + k] * g[i * o + j];
        gw[k * o + j] = rnd(s, P);  // 8
      }
    for (int64_t j = 0; j < o; ++j) {
      double s = 0;
      for (int64_t i = 0; i < kBatch; ++i) s += g[i * o + j];
      gb[j] = rnd(s, P);  // 8
    }
    if (l == 0) break;
    Tensor gx(kBatch * in);
    for (int64_t i = 0; i < kBatch; ++i)
      for (int64_t k = 0; k < in; ++k) {
        double s = 0;
        for (int64_t j = 0; j < o; ++j) s += g[i * o + j] * w[l][k * o + j];
        const double dx = rnd(s, P);  // 9
        gx[i * in + k] =
            rnd(dx * activation_derivative(m.activation, z[l - 1][i * in + k]), P);  // 10
      }
    g = gx;
  }
  return r;
}

// ---- the meshes and layouts (mlp_test's) -------------------------------------------------
struct LayoutCase {
  std::string name;
  std::vector<std::pair<std::string, int>> mesh;
  std::string preset;  // planner preset, or "" for the specs below
  int64_t min_sharding_size;
  std::string weight_spec, bias_spec;
  // Whether a plain MLP computing in 16 bits keeps its activations in 16-bit storage here
  // (docs/mixed_precision.md): without a feature axis, or under one where every layer is
  // row-parallel; not where a layer is column-parallel or replicated over tp.
  bool stores;
  CollectiveMatmulAlgorithm algorithm = CollectiveMatmulAlgorithm::automatic;
};

std::vector<LayoutCase> layouts_for(int n) {
  using A = CollectiveMatmulAlgorithm;
  std::vector<LayoutCase> c;
  if (n == 1) {
    c.push_back({"single", {{"dp", 1}}, "dp", 0, "", "", true});
    c.push_back({"single_fsdp_tp_specs", {{"fsdp", 1}, {"tp", 1}}, "fsdp_tp", 0, "", "", true});
  } else if (n == 2) {
    c.push_back({"dp2", {{"dp", 2}}, "dp", 0, "", "", true});
    c.push_back({"fsdp2", {{"fsdp", 2}}, "fsdp", 0, "", "", true});
    c.push_back({"tp2", {{"tp", 2}}, "tp", 0, "", "", true, A::naive});
    c.push_back({"tp2_ring", {{"tp", 2}}, "tp", 0, "", "", true, A::ring});
  } else if (n == 4) {
    c.push_back({"dp4", {{"dp", 4}}, "dp", 0, "", "", true});
    c.push_back({"fsdp4", {{"fsdp", 4}}, "fsdp", 0, "", "", true});
    c.push_back({"tp4", {{"tp", 4}}, "tp", 0, "", "", true, A::bidirectional});
    // The planner's default minimum size leaves the small layers replicated over tp.
    c.push_back({"tp4_planner_default", {{"tp", 4}}, "tp", 16384, "", "", false});
    c.push_back({"fsdp2_tp2", {{"fsdp", 2}, {"tp", 2}}, "fsdp_tp", 0, "", "", true, A::ring});
    c.push_back({"dp2_tp2", {{"dp", 2}, {"tp", 2}}, "dp_tp", 0, "", "", true});
    c.push_back({"dp2_fsdp2", {{"dp", 2}, {"fsdp", 2}}, "dp_fsdp", 0, "", "", true});
    // Columns split over tp: column-parallel.
    c.push_back(
        {"fsdp2_tp2_storage_2d", {{"fsdp", 2}, {"tp", 2}}, "", 0, "P(fsdp, tp)", "P(fsdp)", false});
    c.push_back({"fsdp2_tp2_tuple",
                 {{"fsdp", 2}, {"tp", 2}},
                 "",
                 0,
                 "P((tp, fsdp), None)",
                 "P((fsdp, tp))",
                 true});
    c.push_back(
        {"dp2_fsdp2_tuple", {{"dp", 2}, {"fsdp", 2}}, "", 0, "P((fsdp, dp), None)", "P(dp)", true});
    // A weight gathered over two groups (fsdp on dim 0, dp on dim 1) and no feature axis.
    c.push_back(
        {"dp2_fsdp2_storage_2d", {{"dp", 2}, {"fsdp", 2}}, "", 0, "P(fsdp, dp)", "P(fsdp)", true});
    c.push_back({"dp2_tp2_dp_storage", {{"dp", 2}, {"tp", 2}}, "", 0, "P(tp, dp)", "P(tp)", true});
  } else if (n == 8) {
    c.push_back({"fsdp2_tp4", {{"fsdp", 2}, {"tp", 4}}, "fsdp_tp", 0, "", "", true});
    c.push_back({"dp2_tp4", {{"dp", 2}, {"tp", 4}}, "dp_tp", 0, "", "", true, A::bidirectional});
    c.push_back({"dp2_fsdp4", {{"dp", 2}, {"fsdp", 4}}, "dp_fsdp", 0, "", "", true});
    c.push_back({"dp2_fsdp2_tp2", {{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, "fsdp_tp", 0, "", "", true});
  }
  return c;
}

// Meshes whose axes all split the batch: every gradient is a sum over ranks.
bool batch_only(const LayoutCase& layout) {
  for (const auto& a : layout.mesh)
    if (a.first == "tp" && a.second > 1) return false;
  return world_size() > 1;
}

// Replaces split dims that do not divide by None (like the planner's fallback).
PartitionSpec fitted(PartitionSpec spec, const std::vector<int64_t>& shape, const Mesh& mesh) {
  spec = spec.with_rank(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] % mesh.size_of(spec.entries[d].axes) != 0) spec.entries[d].axes.clear();
  }
  return spec;
}

// ---- one run -------------------------------------------------------------------------------
struct RunResult {
  double loss = 0;
  Tensor logits;  // this rank's block, row-major [rows, width]
  int64_t first_row = 0, rows = 0, col_offset = 0, width = 0;
  std::vector<Tensor> grads;  // full shape
  std::vector<std::string> names;
  int batch_ranks = 1, feature_ranks = 1;  // the sizes of the batch axes and the feature axis
  bool tensor_parallel = false;            // some layer is TP (else the forward is row-local)
  bool keeps_16bit = false;                // Mlp::keeps_16bit_activations()
  bool keeps_16bit_stream = false;         // Mlp::keeps_16bit_residual_stream()
  // The labels of the allocations live once the model is built (only while the memory tracker
  // is installed): which buffers the storage made.
  std::vector<std::string> live_labels;
  std::vector<Tensor> params;  // full shape, after the run's updates
  // The weights with a 16-bit compute copy, and those whose layer gathers them over exactly one
  // group.
  int weights_with_copies = 0, weights_gathered_over_one_group = 0, weights_stored_whole = 0;
  // Per Linear: the floats of shared weight scratch it needs (scratch_needs().weight: its
  // weight's, ShardedParameter::scratch_needs) and the elements of its weight's compute block.
  std::vector<int64_t> weight_scratch, compute_elements;
  // (With an optimizer) the last update left each copy current: the last forward computed from
  // the optimizer's copies, with no cast pass.
  bool copies_current = true;
  // The gradients the layers wrote as 16 bits into the DP buckets (over every backward).
  std::size_t gradients_written_16bit = 0;
  // The Linear weights whose gradient their GEMM writes as 16 bits for their own reduction
  // (ShardedParameter::writes_16bit_gradient; a gathered one always), and the reductions that
  // took it so (over every backward).
  int weights_writing_16bit_gradients = 0;
  std::size_t gradients_reduced_from_16bit = 0;
  std::vector<LinearLayout> linear_layouts;  // every Linear's, in order
  // Mlp::store_gradients_16bit's count (grads16 runs), and, while the memory tracker is installed,
  // the live bytes of the allocations that hold the gradients (matched by their data, as a run's
  // report matches them) and of the DP buckets' 16-bit buffer.
  std::size_t gradients_stored_16bit = 0;
  int64_t gradient_allocation_bytes = 0, bucket_16bit_bytes = 0;
  int64_t stored_16bit_elements = 0;  // of the gradients stored as 16 bits
};

// A gradient as fp32 values whatever its storage (values_fp32), for the readers below.
ShardedTensor fp32_values_of(const ShardedTensor& g) {
  ShardedTensor t = g;
  t.local = values_fp32(g);
  t.storage = Dtype::fp32;
  t.bits = HalfBits();
  return t;
}

// The tracker's live bytes of the allocations holding `tensors` (their data at the allocation's
// start or just after Kokkos' header), and of those labelled `label`.
int64_t tracked_bytes_holding(const std::vector<ShardedTensor>& tensors) {
  int64_t bytes = 0;
  for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
    // A gradient stored in the DP buckets' buffer has no allocation of its own.
    if (a.label == "meshtrain::grad_bucket_16bit") continue;
    for (const ShardedTensor& t : tensors) {
      const void* data = data_pointer(t);
      const auto offset = static_cast<const char*>(data) - static_cast<const char*>(a.data);
      if (data != nullptr &&
          (offset == 0 || offset == sizeof(Kokkos::Impl::SharedAllocationHeader))) {
        bytes += a.bytes;
        break;
      }
    }
  }
  return bytes;
}
int64_t tracked_bytes_labelled(const std::string& label) {
  int64_t bytes = 0;
  for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
    if (a.label == label) bytes += a.bytes;
  }
  return bytes;
}

// policy nullptr: the context's precision is never set. steps > 1: that many training steps,
// each but the first after the update w -= 0.1 * grad of the previous one (the gradients and
// logits reported are the last step's, the parameters those it started from). store_16bit:
// ParallelContext::set_store_16bit_activations.
// optimizer: the updates are that optimizer's steps (lr 0.01) instead of w -= 0.1 * grad.
// write_16bit_gradients: ParallelContext::set_write_16bit_weight_gradients.
RunResult run_model(const ModelCase& m, const LayoutCase& layout, const MixedPrecision* policy,
                    float loss_scale, bool overlap = false, int steps = 1, bool store_16bit = true,
                    const OptimizerSettings* optimizer = nullptr, bool write_16bit_gradients = true,
                    bool grads16 = false) {
  const Mesh mesh = Mesh::create(layout.mesh, world_size());
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  const double bucket_mb = 200.0 * sizeof(float) / (1024 * 1024);  // several buckets
  ParallelContext context(comms, {"fsdp", "dp"}, "tp", layout.algorithm, overlap, bucket_mb);
  if (policy) context.set_precision(*policy);
  context.set_store_16bit_activations(store_16bit);
  context.set_write_16bit_weight_gradients(write_16bit_gradients);

  ShardingPlan plan;
  SpecLookup spec_of;
  const std::vector<ParameterShape> model_shapes =
      m.residual ? residual_mlp_parameter_shapes(*m.residual) : mlp_parameter_shapes(m.sizes);
  if (!layout.preset.empty()) {
    PlanOptions options;
    options.min_sharding_size = layout.min_sharding_size;
    const bool residual = m.residual.has_value();
    plan = make_plan(model_shapes, mesh,
                     preset_rules(layout.preset, false, /*norms=*/residual, residual), options);
    spec_of = specs_from_plan(plan);
  } else {
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : model_shapes) shapes[p.name] = p.shape;
    spec_of = [&, shapes](const std::string& name) {
      const bool weight = name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0;
      return fitted(PartitionSpec::parse(weight ? layout.weight_spec : layout.bias_spec),
                    shapes.at(name), mesh);
    };
  }

  RunResult run;
  run.rows = kBatch / context.batch_parallel();
  run.first_row = context.batch_index() * run.rows;
  const std::unique_ptr<Mlp> built =
      m.residual ? std::make_unique<Mlp>(*m.residual, m.activation, spec_of, context, run.rows)
                 : std::make_unique<Mlp>(m.sizes, m.activation, spec_of, context, run.rows);
  Mlp& model = *built;
  model.initialize(InitScheme::normal, kSeed);
  if (grads16) {
    run.gradients_stored_16bit = model.store_gradients_16bit(context);
    for (const ShardedTensor& g : std::as_const(model).gradients()) {
      if (g.stored_16bit()) run.stored_16bit_elements += held_elements(g);
    }
  }
  if (memory_tracker_installed()) {
    run.gradient_allocation_bytes = tracked_bytes_holding(std::as_const(model).gradients());
    run.bucket_16bit_bytes = tracked_bytes_labelled("meshtrain::grad_bucket_16bit");
  }
  Loss loss(m.loss, context, run.rows, m.sizes.back(), model.output_layout());
  run.batch_ranks = context.batch_parallel();
  run.feature_ranks = context.feature_parallel();
  for (const auto& l : model.layers())
    run.tensor_parallel = run.tensor_parallel || l.tensor_parallel();

  const Batch b = make_batch(m);
  const int64_t in = m.sizes.front(), out = m.sizes.back();
  Matrix x("x", run.rows, in);
  Matrix targets("targets", run.rows, out);
  Kokkos::View<int32_t*> labels("labels", run.rows);
  auto xh = Kokkos::create_mirror_view(x);
  auto th = Kokkos::create_mirror_view(targets);
  auto lh = Kokkos::create_mirror_view(labels);
  for (int64_t i = 0; i < run.rows; ++i) {
    const int64_t r = run.first_row + i;
    for (int64_t k = 0; k < in; ++k) xh(i, k) = static_cast<float>(b.x[r * in + k]);
    for (int64_t j = 0; j < out; ++j) th(i, j) = static_cast<float>(b.targets[r * out + j]);
    lh(i) = b.labels[r];
  }
  Kokkos::deep_copy(x, xh);
  Kokkos::deep_copy(targets, th);
  Kokkos::deep_copy(labels, lh);

  run.keeps_16bit = model.keeps_16bit_activations();
  run.keeps_16bit_stream = model.keeps_16bit_residual_stream();
  if (memory_tracker_installed()) {
    for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
      run.live_labels.push_back(a.label);
    }
  }
  std::unique_ptr<Optimizer> opt;
  if (optimizer) opt = std::make_unique<Optimizer>(*optimizer, model.parameters());
  for (int step = 1; step < steps; ++step) {
    const MatrixView out = model.forward(x);
    if (m.loss == LossKind::mse) {
      loss.regression(out, targets);
    } else {
      loss.cross_entropy(out, labels);
    }
    model.backward(loss.gradient(), true, loss_scale);
    if (opt) {
      opt->step(model.parameters(), model.gradients(), 0.01f);
      continue;
    }
    for (size_t k = 0; k < model.parameters().size(); ++k) {
      const Vector p = model.parameters()[k].local;
      const Vector g = values_fp32(model.gradients()[k]);
      Kokkos::parallel_for(
          "sgd", p.extent(0), KOKKOS_LAMBDA(const int64_t e) { p(e) -= 0.1f * g(e); });
    }
  }
  // Read through the const overload, which leaves the 16-bit copies current.
  const Mlp& read = model;
  for (const auto& p : read.parameters()) {
    run.params.push_back(gather_full(p, mesh, context.rank()));
    if (p.name.size() < 6 || p.name.compare(p.name.size() - 6, 6, "weight") != 0) continue;
    run.weights_with_copies += p.copy_16bit != nullptr;
    if (p.copy_16bit) run.copies_current = run.copies_current && p.copy_16bit->current;
  }
  for (const Linear& l : read.layers()) {
    const bool dim0 = !l.layout().weight_gather_dim0.empty();
    const bool dim1 = !l.layout().weight_gather_dim1.empty();
    run.weights_gathered_over_one_group += dim0 != dim1;
    run.weights_stored_whole += !dim0 && !dim1;
    run.weight_scratch.push_back(static_cast<int64_t>(l.scratch_needs().weight));
    run.compute_elements.push_back(l.layout().in_compute * l.layout().compute_cols());
  }
  MatrixView logits = model.forward(x);
  auto logits_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), logits);
  run.col_offset = model.output_offset();
  run.width = model.output_width();
  for (int64_t i = 0; i < run.rows; ++i)
    for (int64_t j = 0; j < run.width; ++j) run.logits.push_back(logits_host(i, j));
  const LossResult r = m.loss == LossKind::mse ? loss.regression(logits, targets)
                                               : loss.cross_entropy(logits, labels);
  run.loss = r.loss;
  model.backward(loss.gradient(), true, loss_scale);
  for (const auto& g : model.gradients()) {
    run.grads.push_back(gather_full(fp32_values_of(g), mesh, context.rank()));
    run.names.push_back(g.name + " " + g.spec.to_string());
  }
  run.gradients_written_16bit = model.gradient_buckets().gradients_written_16bit();
  for (const Linear& l : read.layers()) {
    run.weights_writing_16bit_gradients += l.weight_parameter().writes_16bit_gradient(true);
    run.gradients_reduced_from_16bit += l.weight_parameter().gradients_reduced_from_16bit();
    run.linear_layouts.push_back(l.layout());
  }
  return run;
}

// ---- comparisons -----------------------------------------------------------------------------
// The largest errors seen per policy (relative to max|ref| of their tensor) and the fraction
// of 16-bit values flipped, printed by rank 0 at the end of a test (the numbers the header
// quotes).
std::map<std::string, double>& observed() {
  static std::map<std::string, double> m;
  return m;
}
void observe(const std::string& key, double value) {
  double& v = observed()[key];
  v = std::max(v, value);
}

// How values are held to the reference (header comment).
struct Tolerance {
  bool per_element;  // |err| <= one ulp of `dtype` at the element + relative * max|ref|
  Dtype dtype;
  double relative;  // of max|ref| per tensor
};

// The same roundings of the same values (one rank; the forward of a layout without TP, whose
// rows are computed as on one rank): only a rounding next to a tie can flip.
Tolerance flips_only(Dtype dtype) {
  return {true, dtype, std::ldexp(1.0, -18)};
}

// After sums over ranks: K roundings of relative size u, u of the coarser dtype.
Tolerance reductions(const MixedPrecision& p, int batch_ranks, int feature_ranks) {
  const Dtype coarse = unit_roundoff(p.param) > unit_roundoff(p.reduce) ? p.param : p.reduce;
  const int k = 3 * batch_ranks + 3 * (feature_ranks - 1) + 2;
  return {false, coarse, k * unit_roundoff(coarse)};
}

// Counts the elements that differ at all into *differing.
void expect_close(const Tensor& got, const Tensor& ref, const Tolerance& tol,
                  const std::string& what, const std::string& key, int64_t* differing = nullptr) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double max_ref = 0;
  for (double v : ref) max_ref = std::max(max_ref, std::abs(v));
  double max_err = 0, worst_excess = 0;
  size_t worst = 0;  // the element furthest beyond (or least within) what is allowed
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(got[i] - ref[i]);
    if (differing && e != 0) ++*differing;
    const double allowed = tol.relative * max_ref + (tol.per_element ? ulp(ref[i], tol.dtype) : 0);
    if (i == 0 || e - allowed > worst_excess) {
      worst_excess = e - allowed;
      worst = i;
    }
    max_err = std::max(max_err, e);
  }
  observe(key + (tol.per_element ? " (flips only)" : " (reductions)") + " max|err|/max|ref|",
          max_ref > 0 ? max_err / max_ref : max_err);
  EXPECT_LE(worst_excess, 0.0) << what << ": element " << worst << " is " << got[worst]
                               << ", reference " << ref[worst] << " (max |ref| " << max_ref
                               << ", max |err| " << max_err << ")";
}

// At most 2% of the 16-bit values differ from the reference where only flips can happen.
void expect_few_flips(int64_t differing, int64_t total, const Tolerance& tol,
                      const std::string& what, const std::string& key) {
  if (!tol.per_element || tol.dtype == Dtype::fp32) return;  // (fp32 differs in its last bits)
  EXPECT_LE(differing, total / 50) << what << ": elements that differ from the reference";
  observe(key + " fraction of elements flipped", double(differing) / double(total));
}

// A run against the reference: the loss, this rank's logits, every gradient.
void compare(const RunResult& run, const Reference& ref, const ModelCase& m,
             const MixedPrecision& p, const std::string& key) {
  const bool one_rank = world_size() == 1;
  const Tolerance grads =
      one_rank ? flips_only(p.param) : reductions(p, run.batch_ranks, run.feature_ranks);
  Tolerance forward = one_rank || !run.tensor_parallel ? flips_only(p.param) : grads;
  forward.dtype = p.param;  // the logits' last rounding (point 4)

  const double loss_tol =
      forward.per_element ? unit_roundoff(p.param) + 1e-6 : forward.relative;  // (relative)
  EXPECT_NEAR(run.loss, ref.loss, loss_tol * std::abs(ref.loss)) << "loss";
  observe(key + " loss relative error", std::abs(run.loss - ref.loss) / std::abs(ref.loss));

  const int64_t out = m.sizes.back();
  Tensor ref_block;  // this rank's rows and columns of the logits
  for (int64_t i = 0; i < run.rows; ++i)
    for (int64_t j = 0; j < run.width; ++j)
      ref_block.push_back(ref.logits[(run.first_row + i) * out + run.col_offset + j]);
  int64_t differing = 0, total = static_cast<int64_t>(ref_block.size());
  expect_close(run.logits, ref_block, forward, "logits", key + " logits", &differing);
  expect_few_flips(differing, total, forward, "logits", key + " logits");

  differing = total = 0;
  for (size_t k = 0; k < ref.grads.size(); ++k) {
    expect_close(run.grads[k], ref.grads[k], grads, "gradient of " + run.names[k], key + " grads",
                 &differing);
    total += static_cast<int64_t>(ref.grads[k].size());
  }
  expect_few_flips(differing, total, grads, "gradients", key + " grads");
}

void print_observed() {
  if (world_rank() != 0) return;
  std::printf("[mixed_precision np%d] largest errors seen:\n", world_size());
  for (const auto& [key, value] : observed()) std::printf("  %-60s %.3g\n", key.c_str(), value);
  observed().clear();
}

// ---- the tests -----------------------------------------------------------------------------

// Every policy on every layout: logits, loss and every gradient against the reference;
// the 16-bit values are there.
TEST(MixedPrecision, EveryPolicyMatchesTheRoundingReferenceOnEveryLayout) {
  for (const auto& m : models()) {
    const Batch b = make_batch(m);
    for (const auto& policy : policies()) {
      const MixedPrecision& p = policy.mp;
      const Reference ref = reference(m, b, p.param, 1.0);
      for (const auto& layout : layouts_for(world_size())) {
        for (bool overlap : {false, true}) {
          SCOPED_TRACE(m.name + ", " + policy.name + " on " + layout.name +
                       (overlap ? " with overlap" : ""));
          const RunResult run = run_model(m, layout, &p, 1.0f, overlap);
          compare(run, ref, m, p, policy.name);
          // The casts happen: the logits are P values (or, in fp32, not all bf16 values).
          bool all_p = true, all_bf16 = true;
          for (double v : run.logits) {
            all_p = all_p && representable(v, p.param);
            all_bf16 = all_bf16 && representable(v, Dtype::bf16);
          }
          EXPECT_TRUE(all_p) << "logits not all " << dtype_name(p.param);
          if (p.param == Dtype::fp32) {
            EXPECT_FALSE(all_bf16) << "fp32 logits that are all bf16 values";
          }
          // Point 8: one rank's gradients are P values; summed over ranks, R values.
          const bool in_p = world_size() == 1 && p.param != Dtype::fp32;
          const bool in_r = batch_only(layout) && p.reduce != Dtype::fp32;
          for (size_t k = 0; k < run.grads.size() && (in_p || in_r); ++k) {
            bool all = true;
            for (double v : run.grads[k]) all = all && representable(v, in_p ? p.param : p.reduce);
            EXPECT_TRUE(all) << "gradient of " << run.names[k] << " not all "
                             << dtype_name(in_p ? p.param : p.reduce);
          }
        }
      }
    }
  }
  print_observed();
}

// silu, sigmoid and gelu_erf round at the same cast points (5 and 10) as relu and tanh: one
// 16-bit policy each, every layout, the same reference and bounds as above.
TEST(MixedPrecision, SiluSigmoidGeluErfMatchTheRoundingReferenceOnEveryLayout) {
  const std::vector<std::pair<ModelCase, Policy>> cases = {
      {{"silu_ce", {32, 16, 16, 6}, Activation::silu, LossKind::cross_entropy},
       {"bf16/bf16", {Dtype::bf16, Dtype::bf16}}},
      {{"sigmoid_mse", {32, 16, 16, 8}, Activation::sigmoid, LossKind::mse},
       {"fp16/fp16", {Dtype::fp16, Dtype::fp16}}},
      {{"gelu_erf_ce", {32, 16, 16, 6}, Activation::gelu_erf, LossKind::cross_entropy},
       {"bf16/fp32", {Dtype::bf16, Dtype::fp32}}}};
  for (const auto& [m, policy] : cases) {
    const Batch b = make_batch(m);
    const Reference ref = reference(m, b, policy.mp.param, 1.0);
    for (const auto& layout : layouts_for(world_size())) {
      SCOPED_TRACE(m.name + ", " + policy.name + " on " + layout.name);
      compare(run_model(m, layout, &policy.mp, 1.0f, false), ref, m, policy.mp, policy.name);
    }
  }
  print_observed();
}

// fp16 with a loss scale: the gradients come out scaled, and equal 1024 x the unscaled
// reference within the tolerance.
TEST(MixedPrecision, Fp16LossScaleScalesTheGradients) {
  const MixedPrecision p{Dtype::fp16, Dtype::fp16};
  constexpr float kScale = 1024.0f;
  for (const auto& m : models()) {
    const Batch b = make_batch(m);
    const Reference scaled = reference(m, b, p.param, kScale);
    Reference unscaled_times_s = reference(m, b, p.param, 1.0);
    for (auto& g : unscaled_times_s.grads)
      for (double& v : g) v *= kScale;
    for (const auto& layout : layouts_for(world_size())) {
      SCOPED_TRACE(m.name + " on " + layout.name + ", loss scale 1024");
      const RunResult run = run_model(m, layout, &p, kScale);
      compare(run, scaled, m, p, "fp16/fp16 x1024");
      // One rank: the values the unscaled run has below 2^-14 are rounded to multiples of
      // 2^-24 instead of to 11 bits; allow u_fp16 of max|ref| for what that carries.
      Tolerance t = world_size() == 1 ? flips_only(p.param)
                                      : reductions(p, run.batch_ranks, run.feature_ranks);
      if (t.per_element) t.relative = unit_roundoff(Dtype::fp16);
      for (size_t k = 0; k < run.grads.size(); ++k) {
        expect_close(run.grads[k], unscaled_times_s.grads[k], t,
                     "gradient of " + run.names[k] + " vs 1024 x unscaled",
                     "fp16/fp16 x1024 vs 1024 x unscaled grads");
      }
    }
  }
  print_observed();
}

// 16-bit storage (docs/mixed_precision.md, "Compute and memory on this build": the activations
// kept for backward in 16-bit buffers, fp32 working buffers shared by the layers) changes no
// value: three training steps give bit for bit the loss, logits, gradients and parameters of the
// simulated path (fp32 buffers holding the same 16-bit values), on every layout (storage where
// there is no feature axis, and under one where every layer is row-parallel: the tp, dp_tp and
// fsdp_tp presets; the simulated path on both sides elsewhere) with overlap off and on. tanh and
// gelu keep z and f(z); relu and the identity only f(z), which their backward reads (and over
// which, under tp, the layer before packs its 16-bit dY).
TEST(MixedPrecision, SixteenBitStorageIsBitIdenticalToTheSimulatedPath) {
  const std::vector<Policy> sixteen = {{"bf16/bf16", {Dtype::bf16, Dtype::bf16}},
                                       {"fp16/fp16", {Dtype::fp16, Dtype::fp16}},
                                       {"bf16/fp32", {Dtype::bf16, Dtype::fp32}}};
  std::vector<ModelCase> cases = models();
  cases.push_back({"gelu_ce_one_hidden", {32, 24, 6}, Activation::gelu, LossKind::cross_entropy});
  cases.push_back({"identity_mse", {32, 16, 16, 8}, Activation::none, LossKind::mse});
  for (const auto& m : cases) {
    for (const auto& policy : sixteen) {
      for (const auto& layout : layouts_for(world_size())) {
        for (bool overlap : {false, true}) {
          SCOPED_TRACE(m.name + ", " + policy.name + " on " + layout.name +
                       (overlap ? " with overlap" : ""));
          const RunResult stored = run_model(m, layout, &policy.mp, 1.0f, overlap, 3, true);
          const RunResult simulated = run_model(m, layout, &policy.mp, 1.0f, overlap, 3, false);
          EXPECT_EQ(stored.keeps_16bit, layout.stores);
          EXPECT_FALSE(simulated.keeps_16bit);
          EXPECT_EQ(stored.loss, simulated.loss);
          ASSERT_EQ(stored.logits.size(), simulated.logits.size());
          for (size_t i = 0; i < stored.logits.size(); ++i)
            ASSERT_EQ(float(stored.logits[i]), float(simulated.logits[i])) << "logit " << i;
          for (size_t k = 0; k < stored.grads.size(); ++k) {
            for (size_t i = 0; i < stored.grads[k].size(); ++i) {
              ASSERT_EQ(float(stored.grads[k][i]), float(simulated.grads[k][i]))
                  << stored.names[k] << " gradient element " << i;
              ASSERT_EQ(float(stored.params[k][i]), float(simulated.params[k][i]))
                  << stored.names[k] << " element " << i;
            }
          }
        }
      }
    }
  }
}

// Two runs' loss, logits, gradients and parameters, bit for bit.
void expect_bit_identical(const RunResult& a, const RunResult& b) {
  EXPECT_EQ(a.loss, b.loss);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  for (size_t i = 0; i < a.logits.size(); ++i)
    ASSERT_EQ(float(a.logits[i]), float(b.logits[i])) << "logit " << i;
  ASSERT_EQ(a.params.size(), b.params.size());
  ASSERT_EQ(a.grads.size(), a.params.size());
  ASSERT_EQ(b.grads.size(), b.params.size());
  for (size_t k = 0; k < a.params.size(); ++k) {
    ASSERT_EQ(a.params[k].size(), b.params[k].size());
    ASSERT_EQ(a.grads[k].size(), a.params[k].size());
    ASSERT_EQ(b.grads[k].size(), b.params[k].size());
    for (size_t i = 0; i < a.params[k].size(); ++i) {
      ASSERT_EQ(float(a.grads[k][i]), float(b.grads[k][i]))
          << a.names[k] << " gradient element " << i;
      ASSERT_EQ(float(a.params[k][i]), float(b.params[k][i])) << a.names[k] << " element " << i;
    }
  }
}

// DP with overlap and a bf16 wire (reduce_dtype = param_dtype = bf16): where gemm()'s kernel writes
// 16 bits (gemm_kernel_writes_16bit: oneDNN's bf16 matmul on AVX512_BF16 or AMX) every bucketed
// Linear's weight-gradient product writes its gradient as bf16 straight into the buckets' 16-bit
// buffer (docs/mixed_precision.md, cast point 8: counted by the buckets), and three training steps
// give bit for bit the loss, logits, gradients and parameters of the same run with overlap off (the
// blocking all-reduce of the fp32 gradient packed to bf16), on dp over every rank and, at np 4, dp
// 2 x tp 2 with every weight's columns split over tp (P(None, tp), naive and ring): the first
// layer's one GEMM, the next layers, which gather their input, through all_gather_matmul_to_16bit
// (where the blocking run computes all_gather_matmul's fp32 product and the wire packs it). The
// gradients stay fp32 (grads16 off), as in a run that clips.
TEST(MixedPrecision, BucketsGivenTheWeightGradientAs16BitsMatchTheBlockingReduction) {
  using A = CollectiveMatmulAlgorithm;
  const MixedPrecision bf16{Dtype::bf16, Dtype::bf16};
  const int n = world_size();
  std::vector<LayoutCase> layouts = {
      {"dp" + std::to_string(n), {{"dp", n}}, "dp", 0, "", "", true}};
  if (n == 4) {
    for (A alg : {A::naive, A::ring}) {
      layouts.push_back({std::string("dp2_tp2_columns_") + to_string(alg),
                         {{"dp", 2}, {"tp", 2}},
                         "",
                         0,
                         "P(None, tp)",
                         "P(tp)",
                         false,
                         alg});
    }
  }
  const int steps = 3;
  const bool writes = gemm_kernel_writes_16bit(Dtype::bf16);
  for (const auto& m : models()) {
    for (const auto& layout : layouts) {
      SCOPED_TRACE(m.name + " on " + layout.name);
      const RunResult on = run_model(m, layout, &bf16, 1.0f, /*overlap=*/true, steps);
      const RunResult off = run_model(m, layout, &bf16, 1.0f, /*overlap=*/false, steps);
      // Three Linear layers, one weight gradient each; the bucketed ones (one rank: no DP group,
      // so no buckets) write theirs as 16 bits in each of the `steps` backward passes: under dp
      // and the columns layouts all of them (the layers after the first gather their input: their
      // all-gather-matmul writes the 16 bits).
      const std::size_t linears = m.sizes.size() - 1;
      ASSERT_EQ(on.linear_layouts.size(), linears);
      std::size_t bucketed = 0, gathering = 0;
      for (const LinearLayout& l : on.linear_layouts) {
        bucketed += n > 1 && l.defers_reduction();
        gathering += l.defers_reduction() && l.column_gathers_input();
      }
      EXPECT_EQ(bucketed, n > 1 ? linears : 0u);
      EXPECT_EQ(gathering, layout.preset == "dp" ? 0u : linears - 1);
      EXPECT_EQ(on.gradients_written_16bit, writes ? bucketed * steps : 0u);
      EXPECT_EQ(off.gradients_written_16bit, 0u);
      expect_bit_identical(on, off);
    }
  }
}

// FSDP with a bf16 wire (reduce_dtype = param_dtype = bf16): where gemm_to_16bit's kernel writes
// 16 bits (gemm_kernel_writes_16bit: oneDNN's bf16 matmul on AVX512_BF16 or AMX) every Linear
// whose weight is gathered and whose one GEMM writes its gradient (not the all-gather-matmuls of
// tensor parallelism) writes it as bf16 into the gradient scratch, which its reduce-scatter sends
// as it is (docs/mixed_precision.md, cast point 8; counted by the parameters), and three training
// steps give bit for bit the loss, logits, gradients and parameters of the same run with the fp32
// gradient packed by the reduce-scatter (ParallelContext::set_write_16bit_weight_gradients(false)),
// with overlap off and on: on fsdp over every rank and, at np 4, fsdp x dp, fsdp x tp with the
// columns split (column-parallel: the first layer's one GEMM), a weight gathered over two
// groups (fsdp on dim 0, dp on dim 1: the first reduce-scatter from the 16 bits), one gathered on
// dim 1 alone (dp: reduce_scatter_16bit's column reorder) and the two tuple layouts (dim 0 split
// over two axes). Each Linear that writes_16bit_gathered_gradient names writes 16 bits. One rank
// gathers nothing, so takes no 16-bit path: skipped there.
TEST(MixedPrecision, FsdpGradientsWrittenAs16BitsMatchTheFp32Scratch) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank gathers no weight, so no gradient is written as 16 bits";
  const MixedPrecision bf16{Dtype::bf16, Dtype::bf16};
  std::vector<LayoutCase> layouts = {
      {"fsdp" + std::to_string(n), {{"fsdp", n}}, "fsdp", 0, "", "", true}};
  if (n == 4) {
    layouts.push_back({"dp2_fsdp2", {{"dp", 2}, {"fsdp", 2}}, "dp_fsdp", 0, "", "", true});
    layouts.push_back(
        {"fsdp2_tp2_storage_2d", {{"fsdp", 2}, {"tp", 2}}, "", 0, "P(fsdp, tp)", "P(fsdp)", false});
    layouts.push_back(
        {"dp2_fsdp2_storage_2d", {{"dp", 2}, {"fsdp", 2}}, "", 0, "P(fsdp, dp)", "P(fsdp)", true});
    layouts.push_back(
        {"dp2_tp2_dp_storage", {{"dp", 2}, {"tp", 2}}, "", 0, "P(tp, dp)", "P(tp)", true});
    layouts.push_back({"fsdp2_tp2_tuple",
                       {{"fsdp", 2}, {"tp", 2}},
                       "",
                       0,
                       "P((tp, fsdp), None)",
                       "P((fsdp, tp))",
                       true});
    layouts.push_back(
        {"dp2_fsdp2_tuple", {{"dp", 2}, {"fsdp", 2}}, "", 0, "P((fsdp, dp), None)", "P(dp)", true});
  }
  const int steps = 3;
  const bool writes = gemm_kernel_writes_16bit(Dtype::bf16);
  std::size_t taken = 0;
  for (const auto& m : models()) {
    for (const auto& layout : layouts) {
      for (bool overlap : {false, true}) {
        SCOPED_TRACE(m.name + " on " + layout.name + (overlap ? " with overlap" : ""));
        const RunResult on = run_model(m, layout, &bf16, 1.0f, overlap, steps, true, nullptr, true);
        const RunResult off =
            run_model(m, layout, &bf16, 1.0f, overlap, steps, true, nullptr, false);
        // Plain fsdp over n > 1 ranks gathers every weight (three Linears); the others gather
        // some, and of those the Linears whose one GEMM writes the gradient write 16 bits. Every
        // weight that writes 16 bits does in each of the `steps` backward passes.
        int expected = 0;
        for (const LinearLayout& l : on.linear_layouts)
          expected += writes_16bit_gathered_gradient(l, true, writes);
        EXPECT_EQ(on.weights_writing_16bit_gradients, expected);
        if (layout.preset == "fsdp") {
          EXPECT_EQ(on.weights_writing_16bit_gradients,
                    writes ? static_cast<int>(m.sizes.size()) - 1 : 0);
        }
        EXPECT_EQ(on.gradients_reduced_from_16bit,
                  static_cast<std::size_t>(on.weights_writing_16bit_gradients) * steps);
        EXPECT_EQ(off.weights_writing_16bit_gradients, 0);
        EXPECT_EQ(off.gradients_reduced_from_16bit, 0u);
        taken += on.gradients_reduced_from_16bit;
        expect_bit_identical(on, off);
      }
    }
  }
  if (world_rank() == 0) {
    std::cout << "gradients written as 16 bits and reduced from them: " << taken
              << (writes ? "" : " (gemm_to_16bit's kernel writes no 16 bits here)") << "\n";
  }
}

// DP's blocking all-reduce (overlap off) with a bf16 wire (reduce_dtype = param_dtype = bf16):
// where gemm_to_16bit's kernel writes 16 bits every Linear whose weight is stored whole and whose
// one GEMM writes its gradient writes it as bf16 into the all-reduce's 16-bit buffer
// (Communicator::all_reduce_wire), summed there as it is (cast point 8; counted by the parameters),
// and three training steps give bit for bit the loss, logits, gradients and parameters of the
// fp32 gradient packed by the all-reduce (set_write_16bit_weight_gradients(false)), on dp over
// every rank and, at np 4, dp x tp with every weight's columns split over tp (P(None, tp):
// column-parallel, stored whole over dp; the Linears whose one GEMM writes the gradient write 16
// bits, those whose products are collective matmuls keep the fp32 path). With overlap on the
// buckets take the gradients (their own test above) and no reduction here does. One rank has no
// DP all-reduce, so takes no 16-bit path: skipped there.
TEST(MixedPrecision, DpBlockingGradientsWrittenAs16BitsMatchTheFp32Path) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "one rank has no DP all-reduce, so no gradient written as 16 bits";
  const MixedPrecision bf16{Dtype::bf16, Dtype::bf16};
  std::vector<LayoutCase> layouts = {
      {"dp" + std::to_string(n), {{"dp", n}}, "dp", 0, "", "", true}};
  if (n == 4) {
    layouts.push_back(
        {"dp2_tp2_columns", {{"dp", 2}, {"tp", 2}}, "", 0, "P(None, tp)", "P(tp)", false});
  }
  const int steps = 3;
  const bool writes = gemm_kernel_writes_16bit(Dtype::bf16);
  std::size_t taken = 0;
  for (const auto& m : models()) {
    for (const auto& layout : layouts) {
      for (bool overlap : {false, true}) {
        SCOPED_TRACE(m.name + " on " + layout.name + (overlap ? " with overlap" : ""));
        const RunResult on = run_model(m, layout, &bf16, 1.0f, overlap, steps, true, nullptr, true);
        const RunResult off =
            run_model(m, layout, &bf16, 1.0f, overlap, steps, true, nullptr, false);
        // The Linears whose weight is stored whole and whose one GEMM writes its gradient
        // (plain dp: all of them).
        std::size_t linears = 0;
        for (const LinearLayout& l : on.linear_layouts)
          linears += !l.gathers_weight() && !l.runs_collective_matmuls();
        if (layout.preset == "dp") EXPECT_EQ(linears, m.sizes.size() - 1);
        EXPECT_GT(linears, 0u) << "no Linear of this layout may take the 16-bit path";
        EXPECT_EQ(on.weights_writing_16bit_gradients, writes ? static_cast<int>(linears) : 0);
        EXPECT_EQ(on.gradients_reduced_from_16bit, writes && !overlap ? linears * steps : 0u);
        EXPECT_EQ(off.gradients_reduced_from_16bit, 0u);
        taken += on.gradients_reduced_from_16bit;
        expect_bit_identical(on, off);
      }
    }
  }
  if (world_rank() == 0) {
    std::cout << "gradients written as 16 bits into the blocking all-reduce: " << taken
              << (writes ? "" : " (gemm_to_16bit's kernel writes no 16 bits here)") << "\n";
  }
}

// The weight gradients stored as 16 bits (Mlp::store_gradients_16bit, partition/
// gradient_storage.hpp: a weight neither gathered nor replicated over a non-batch axis whose
// product writes each element with one GEMM, bf16 compute and wire, where gemm()'s kernel writes 16
// bits): three training steps under AdamW or SGD with momentum (both read the 16-bit gradient,
// widening it) give bit for bit the loss, logits, parameters and gradients (widened) of the same
// run with fp32 gradients, which hold the same bf16 values widened; blocking and with overlap (a
// DP layer group's stored gradient then its range of the DP buckets' 16-bit buffer). Layouts: one
// rank (no reduction), dp over every rank, and under tensor parallelism tp alone and dp x tp,
// row-parallel (split output: an all-gather-matmul, naive; at tp 4 the 6-wide output of tanh_ce
// all-reduced: one GEMM) and column-parallel (P(None, tp), ring: the first layer's one GEMM, the
// next ones gathering their input in an all-gather-matmul); the rule's exceptions keep their
// split-output layers in fp32: ring at tp 2 (row-strided column blocks) and bidirectional at tp 4
// (its halves split K), the other layers stored as 16 bits. The tracker
// sees the gradients' allocations shrink by 2 bytes per 16-bit element (own 16-bit buffers), or 4
// for those in the DP buckets' 16-bit buffer (overlap), whose size does not change.
TEST(MixedPrecision, WeightGradientsStoredAs16BitsMatchTheFp32StoredGradients) {
  if (!gemm_kernel_writes_16bit(Dtype::bf16)) {
    GTEST_SKIP() << "gemm()'s kernel does not write bf16 here (" << gemm_kernels() << ")";
  }
  install_memory_tracker();
  using A = CollectiveMatmulAlgorithm;
  const MixedPrecision bf16{Dtype::bf16, Dtype::bf16};
  const int n = world_size();
  std::vector<LayoutCase> layouts = {
      {"dp" + std::to_string(n), {{"dp", n}}, "dp", 0, "", "", true}};
  if (n == 2) {
    layouts.push_back({"tp2", {{"tp", 2}}, "tp", 0, "", "", true, A::naive});
    layouts.push_back({"tp2_ring", {{"tp", 2}}, "tp", 0, "", "", true, A::ring});
    layouts.push_back({"tp2_columns", {{"tp", 2}}, "", 0, "P(None, tp)", "P(tp)", false, A::ring});
  } else if (n == 4) {
    layouts.push_back({"dp2_tp2", {{"dp", 2}, {"tp", 2}}, "dp_tp", 0, "", "", true, A::naive});
    layouts.push_back({"dp2_tp2_columns",
                       {{"dp", 2}, {"tp", 2}},
                       "",
                       0,
                       "P(None, tp)",
                       "P(tp)",
                       false,
                       A::naive});
    layouts.push_back({"tp4", {{"tp", 4}}, "tp", 0, "", "", true, A::bidirectional});
  }
  const int steps = 3;
  OptimizerSettings adamw, sgd;
  adamw.kind = OptimizerKind::adamw;
  sgd.kind = OptimizerKind::sgd;  // momentum 0.9
  std::size_t stored_anywhere = 0;
  for (const auto& m : models()) {
    for (const auto& layout : layouts) {
      for (bool overlap : {false, true}) {
        // AdamW for the first model, SGD with momentum for the second.
        const OptimizerSettings& opt = m.name == models().front().name ? adamw : sgd;
        SCOPED_TRACE(m.name + " on " + layout.name + (overlap ? " with overlap" : "") +
                     (&opt == &adamw ? ", adamw" : ", sgd"));
        const RunResult fp32 = run_model(m, layout, &bf16, 1.0f, overlap, steps, true, &opt,
                                         /*write_16bit_gradients=*/true, /*grads16=*/false);
        const RunResult sixteen = run_model(m, layout, &bf16, 1.0f, overlap, steps, true, &opt,
                                            /*write_16bit_gradients=*/true, /*grads16=*/true);
        // Which weights the rule stores as 16 bits, from the layouts: every one but the
        // split-output and input-gathering products of the bidirectional algorithm (none is
        // gathered here); those of a DP layer group live in the buckets under overlap.
        std::size_t expected = 0, bucketed = 0;
        int64_t elements = 0, bucketed_elements = 0;
        for (const LinearLayout& l : sixteen.linear_layouts) {
          ASSERT_FALSE(l.gathers_weight());
          // (bidirectional splits K; ring writes a split-output layer's gradient as row-strided
          // column blocks: both stay fp32.)
          if (l.runs_collective_matmuls() &&
              (layout.algorithm == A::bidirectional ||
               (layout.algorithm == A::ring && !l.column_gathers_input()))) {
            continue;
          }
          const int64_t e = l.stored_rows * l.stored_cols;
          const bool in_buckets = overlap && l.defers_reduction();
          ++expected;
          elements += e;
          bucketed += in_buckets;
          bucketed_elements += in_buckets ? e : 0;
        }
        const bool all = layout.algorithm == A::naive || layout.algorithm == A::automatic ||
                         layout.name == "tp2_columns";
        if (all) EXPECT_EQ(expected, m.sizes.size() - 1);
        EXPECT_EQ(fp32.gradients_stored_16bit, 0u);
        EXPECT_EQ(sixteen.gradients_stored_16bit, expected);
        EXPECT_EQ(sixteen.stored_16bit_elements, elements);
        stored_anywhere += sixteen.gradients_stored_16bit;
        // The tracker: 2 bytes less per 16-bit element in a buffer of its own, all 4 for those
        // in the buckets' buffer, as large as before.
        const int64_t saved = (elements - bucketed_elements) * 2 + bucketed_elements * 4;
        EXPECT_EQ(sixteen.gradient_allocation_bytes, fp32.gradient_allocation_bytes - saved);
        EXPECT_EQ(sixteen.bucket_16bit_bytes, fp32.bucket_16bit_bytes);
        // The GEMMs wrote every bucketed weight gradient as 16 bits, in every backward.
        if (overlap) EXPECT_EQ(sixteen.gradients_written_16bit, bucketed * steps);
        EXPECT_EQ(sixteen.loss, fp32.loss);
        ASSERT_EQ(sixteen.logits.size(), fp32.logits.size());
        for (size_t i = 0; i < fp32.logits.size(); ++i)
          ASSERT_EQ(float(sixteen.logits[i]), float(fp32.logits[i])) << "logit " << i;
        ASSERT_EQ(sixteen.params.size(), fp32.params.size());
        ASSERT_EQ(sixteen.grads.size(), fp32.grads.size());
        for (size_t k = 0; k < fp32.params.size(); ++k) {
          ASSERT_EQ(sixteen.params[k].size(), fp32.params[k].size());
          ASSERT_EQ(sixteen.grads[k].size(), fp32.grads[k].size());
          for (size_t i = 0; i < fp32.params[k].size(); ++i) {
            ASSERT_EQ(float(sixteen.grads[k][i]), float(fp32.grads[k][i]))
                << fp32.names[k] << " gradient element " << i;
            ASSERT_EQ(float(sixteen.params[k][i]), float(fp32.params[k][i]))
                << fp32.names[k] << " element " << i;
          }
        }
      }
    }
  }
  EXPECT_GT(stored_anywhere, 0u);
}

// A residual_mlp's 16-bit storage (docs/mixed_precision.md, "Compute and memory on this build":
// the blocks' hidden activations, the up projections' outputs in one shared fp32 working buffer,
// the activations' output (and, but for relu's, input) kept as 16 bits, the down projections'
// input gradients in that buffer; the residual stream, the norms keeping their input and output as
// 16 bits, the stream, the norms' outputs and the gradient stream in three shared fp32 buffers, the
// norms' input gradients in place) changes no value: three training steps give bit for bit the
// loss, logits, gradients and parameters of the simulated path, LayerNorm with gelu and RMSNorm
// with relu, RMSNorm and LayerNorm with SwiGLU blocks (gate and up outputs and the SwiGLU's output
// kept as 16 bits, gate's output in a second shared buffer: the SwiGLU has no fp32 buffer of its
// own, checked by the allocations' labels), on every preset layout and the 2-D storage splits
// without a feature axis (storage where there is none; the simulated path on both sides
// elsewhere), with overlap off and on.
TEST(MixedPrecision, ResidualSixteenBitStorageIsBitIdenticalToTheSimulatedPath) {
  install_memory_tracker();  // the SwiGLU blocks' buffers, by their labels
  const auto has_label = [](const RunResult& r, const std::string& label) {
    return std::find(r.live_labels.begin(), r.live_labels.end(), label) != r.live_labels.end();
  };
  const std::vector<Policy> sixteen = {{"bf16/bf16", {Dtype::bf16, Dtype::bf16}},
                                       {"fp16/fp16", {Dtype::fp16, Dtype::fp16}},
                                       {"bf16/fp32", {Dtype::bf16, Dtype::fp32}}};
  ResidualMlpShape layernorm;
  layernorm.inputs = 32;
  layernorm.outputs = 6;
  layernorm.width = 16;
  layernorm.hidden = 24;
  layernorm.depth = 2;
  layernorm.norm_kind = NormKind::layernorm;
  ResidualMlpShape rmsnorm = layernorm;
  rmsnorm.outputs = 8;
  rmsnorm.norm_kind = NormKind::rmsnorm;
  ResidualMlpShape rmsnorm_swiglu = rmsnorm;
  rmsnorm_swiglu.gated = true;
  ResidualMlpShape layernorm_swiglu = layernorm;
  layernorm_swiglu.gated = true;
  const std::vector<ModelCase> cases = {
      {"residual_layernorm_gelu_ce", {32, 6}, Activation::gelu, LossKind::cross_entropy, layernorm},
      {"residual_rmsnorm_relu_mse", {32, 8}, Activation::relu, LossKind::mse, rmsnorm},
      {"residual_rmsnorm_swiglu_mse", {32, 8}, Activation::silu, LossKind::mse, rmsnorm_swiglu},
      {"residual_layernorm_swiglu_ce",
       {32, 6},
       Activation::silu,
       LossKind::cross_entropy,
       layernorm_swiglu}};
  for (const auto& m : cases) {
    for (const auto& policy : sixteen) {
      for (const auto& layout : layouts_for(world_size())) {
        bool feature_axis = false;
        for (const auto& [axis, size] : layout.mesh) feature_axis |= axis == "tp" && size > 1;
        // (A residual block needs up and down alike under tp: the presets' layouts.)
        if (feature_axis && layout.preset.empty()) continue;
        for (bool overlap : {false, true}) {
          SCOPED_TRACE(m.name + ", " + policy.name + " on " + layout.name +
                       (overlap ? " with overlap" : ""));
          const RunResult stored = run_model(m, layout, &policy.mp, 1.0f, overlap, 3, true);
          const RunResult simulated = run_model(m, layout, &policy.mp, 1.0f, overlap, 3, false);
          EXPECT_EQ(stored.keeps_16bit, !feature_axis);
          EXPECT_EQ(stored.keeps_16bit_stream, !feature_axis);
          EXPECT_FALSE(simulated.keeps_16bit);
          EXPECT_FALSE(simulated.keeps_16bit_stream);
          if (m.residual->gated) {
            // Each block's SwiGLU keeps gate, up and its output as 16 bits and owns no fp32
            // buffer; gate's output lands in the model's second shared buffer.
            for (int64_t b = 0; b < m.residual->depth; ++b) {
              const std::string swiglu = "blocks/" + std::to_string(b) + "/swiglu";
              for (const char* kept : {"/gate_16bit", "/value_16bit", "/output_16bit"}) {
                EXPECT_EQ(has_label(stored, swiglu + kept), !feature_axis) << swiglu + kept;
                EXPECT_FALSE(has_label(simulated, swiglu + kept)) << swiglu + kept;
              }
              for (const char* fp32 : {"/output", "/gate_grad", "/value_grad", "/input_grad"}) {
                EXPECT_EQ(has_label(stored, swiglu + fp32), feature_axis) << swiglu + fp32;
                EXPECT_TRUE(has_label(simulated, swiglu + fp32)) << swiglu + fp32;
              }
            }
            EXPECT_EQ(has_label(stored, "model/gate_work"), !feature_axis);
            EXPECT_FALSE(has_label(simulated, "model/gate_work"));
          }
          EXPECT_EQ(stored.loss, simulated.loss);
          ASSERT_EQ(stored.logits.size(), simulated.logits.size());
          for (size_t i = 0; i < stored.logits.size(); ++i)
            ASSERT_EQ(float(stored.logits[i]), float(simulated.logits[i])) << "logit " << i;
          ASSERT_EQ(stored.grads.size(), simulated.grads.size());
          for (size_t k = 0; k < stored.grads.size(); ++k) {
            for (size_t i = 0; i < stored.grads[k].size(); ++i) {
              ASSERT_EQ(float(stored.grads[k][i]), float(simulated.grads[k][i]))
                  << stored.names[k] << " gradient element " << i;
              ASSERT_EQ(float(stored.params[k][i]), float(simulated.params[k][i]))
                  << stored.names[k] << " element " << i;
            }
          }
        }
      }
    }
  }
}

// The weights' 16-bit compute copies (docs/mixed_precision.md, "Compute and memory on this
// build"): the optimizer writes round_P(new master) into them in its update pass, and the layers
// compute from them (gathered as 16 bits, blocking or prefetched, then widened; read as they are
// where gemm() reads 16 bits). The weights gathered over one group (FSDP) have them, and those
// stored whole (DP, one rank) where gemm() reads 16 bits (oneDNN, the default, on a CPU with
// AVX512_BF16; the _openblas registrations read fp32); elsewhere DP, one rank and a 2-D storage
// split round the master at use; under a feature axis (tensor parallelism, no 16-bit activation
// storage) the weights not gathered have copies where gemm() reads 16 bits, read as they are by the
// GEMMs and the collective matmuls. Three steps of AdamW and of SGD with momentum give bit for bit
// the loss, logits, gradients and parameters of the simulated path (weights cast from the fp32
// masters at use), on every layout with overlap off and on, and the last forward computed from the
// optimizer's copies (current after the update: no cast pass). fp32 makes no copies.
TEST(MixedPrecision, SixteenBitCopiesWrittenByTheOptimizerAreBitIdenticalToTheSimulatedPath) {
  const std::vector<Policy> sixteen = {{"bf16/bf16", {Dtype::bf16, Dtype::bf16}},
                                       {"fp16/fp16", {Dtype::fp16, Dtype::fp16}},
                                       {"bf16/fp32", {Dtype::bf16, Dtype::fp32}}};
  OptimizerSettings adamw;
  adamw.kind = OptimizerKind::adamw;
  adamw.weight_decay = 0.01f;
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  const ModelCase m = models().front();
  int whole_copies = 0;  // copies of weights stored whole seen (where gemm() reads 16 bits)
  int feature_parallel_copies = 0;       // of those under a feature axis
  bool feature_parallel_layout = false;  // a layout under a feature axis seen
  for (const auto& policy : sixteen) {
    for (const OptimizerSettings* optimizer : {&adamw, &sgd}) {
      for (const auto& layout : layouts_for(world_size())) {
        for (bool overlap : {false, true}) {
          SCOPED_TRACE(m.name + ", " + policy.name + ", " + to_string(optimizer->kind) + " on " +
                       layout.name + (overlap ? " with overlap" : ""));
          const RunResult stored =
              run_model(m, layout, &policy.mp, 1.0f, overlap, 3, true, optimizer);
          const RunResult simulated =
              run_model(m, layout, &policy.mp, 1.0f, overlap, 3, false, optimizer);
          // Copies of the weights gathered over one group, and of those stored whole (DP, one
          // rank) only where gemm() reads 16 bits (a 2-D storage split: none), each current
          // after the update.
          // Under a feature axis (no 16-bit activation storage) the weights not gathered have
          // copies where gemm() reads 16 bits, which the GEMMs and the collective matmuls read
          // as they are (tensor parallelism; a weight gathered over an FSDP axis too has none).
          const int whole = gemm_reads_16bit(policy.mp.param) ? stored.weights_stored_whole : 0;
          const bool feature_axis = stored.feature_ranks > 1;
          EXPECT_EQ(stored.weights_with_copies, stored.keeps_16bit
                                                    ? stored.weights_gathered_over_one_group + whole
                                                    : (feature_axis ? whole : 0));
          if (stored.keeps_16bit) whole_copies += whole;
          if (feature_axis) feature_parallel_copies += whole;
          feature_parallel_layout = feature_parallel_layout || feature_axis;
          EXPECT_TRUE(stored.copies_current);
          EXPECT_EQ(simulated.weights_with_copies, 0);
          EXPECT_EQ(stored.loss, simulated.loss);
          ASSERT_EQ(stored.logits.size(), simulated.logits.size());
          for (size_t i = 0; i < stored.logits.size(); ++i)
            ASSERT_EQ(float(stored.logits[i]), float(simulated.logits[i])) << "logit " << i;
          for (size_t k = 0; k < stored.grads.size(); ++k) {
            for (size_t i = 0; i < stored.grads[k].size(); ++i) {
              ASSERT_EQ(float(stored.grads[k][i]), float(simulated.grads[k][i]))
                  << stored.names[k] << " gradient element " << i;
              ASSERT_EQ(float(stored.params[k][i]), float(simulated.params[k][i]))
                  << stored.names[k] << " element " << i;
            }
          }
        }
      }
    }
  }
  std::printf(
      "[mixed_precision np%d] gemm() reads bf16: %s, fp16: %s; copies of weights stored "
      "whole checked: %d, of weights under a feature axis: %d\n",
      world_size(), gemm_reads_16bit(Dtype::bf16) ? "yes" : "no",
      gemm_reads_16bit(Dtype::fp16) ? "yes" : "no", whole_copies, feature_parallel_copies);
  // Where gemm() reads 16 bits (oneDNN bf16, or MESHTRAIN_GEMM_16BIT_OPERANDS=always: the
  // operands16 registration), the tp layouts' weights have copies, and they were checked.
  if (gemm_reads_16bit(Dtype::bf16) && world_size() > 1 && feature_parallel_layout) {
    EXPECT_GT(feature_parallel_copies, 0) << "no copy of a weight under a feature axis checked";
  }
  // fp32: no copies.
  const MixedPrecision fp32{Dtype::fp32, Dtype::fp32};
  const RunResult plain =
      run_model(m, layouts_for(world_size()).front(), &fp32, 1.0f, false, 2, true, &adamw);
  EXPECT_EQ(plain.weights_with_copies, 0);
}

// The shared weight scratch where gemm()'s kernel reads bf16 as stored (gemm_kernel_reads_16bit:
// oneDNN's bf16 matmul on a CPU with AVX512_BF16 or AMX; cuBLAS): under FSDP on 2 ranks a weight
// with a bf16 copy reaches the GEMMs only as its gathered 16-bit blocks put in place in the
// scratch's bytes, so each Linear needs (d1 d2 + 1) / 2 floats of it (ShardedParameter::
// scratch_needs), against d1 d2 on the simulated path (no copies: the master gathered in bf16
// into fp32). With that half-size scratch, an AdamW step and the next forward and backward
// (overlap off and on: blocking and prefetched gathers) give bit for bit the simulated path's
// loss, logits, gradients and parameters. Skipped where the kernel reads bf16 as fp32 (the scratch
// then keeps its fp32 size; the SixteenBitCopies test checks that path by value) and at other rank
// counts.
TEST(MixedPrecision, FsdpWeightScratchIsHalfSizeWhereTheKernelReadsBf16) {
  if (world_size() != 2) GTEST_SKIP() << "checked at np 2 (fsdp2) only";
  if (!gemm_kernel_reads_16bit(Dtype::bf16)) {
    GTEST_SKIP() << "gemm()'s kernel reads bf16 as fp32 here (" << gemm_kernels()
                 << "): the weight scratch keeps its fp32 size";
  }
  OptimizerSettings adamw;
  adamw.kind = OptimizerKind::adamw;
  const MixedPrecision bf16{Dtype::bf16, Dtype::bf16};
  const ModelCase m = models().front();
  LayoutCase fsdp2;
  for (const LayoutCase& l : layouts_for(2))
    if (l.name == "fsdp2") fsdp2 = l;
  ASSERT_EQ(fsdp2.name, "fsdp2");
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap on" : "overlap off");
    const RunResult stored = run_model(m, fsdp2, &bf16, 1.0f, overlap, 2, true, &adamw);
    const RunResult simulated = run_model(m, fsdp2, &bf16, 1.0f, overlap, 2, false, &adamw);
    const int layers = static_cast<int>(m.sizes.size()) - 1;
    ASSERT_EQ(stored.weights_gathered_over_one_group, layers);
    ASSERT_EQ(stored.weights_with_copies, layers);
    ASSERT_EQ(simulated.weights_with_copies, 0);
    ASSERT_EQ(stored.weight_scratch.size(), static_cast<size_t>(layers));
    for (int k = 0; k < layers; ++k) {
      SCOPED_TRACE("layer " + std::to_string(k));
      EXPECT_EQ(stored.compute_elements[k], m.sizes[k] * m.sizes[k + 1]);  // gathered whole
      EXPECT_EQ(stored.weight_scratch[k], (stored.compute_elements[k] + 1) / 2);
      EXPECT_EQ(simulated.weight_scratch[k], simulated.compute_elements[k]);
    }
    EXPECT_EQ(stored.loss, simulated.loss);
    ASSERT_EQ(stored.logits.size(), simulated.logits.size());
    for (size_t i = 0; i < stored.logits.size(); ++i)
      ASSERT_EQ(float(stored.logits[i]), float(simulated.logits[i])) << "logit " << i;
    ASSERT_EQ(stored.grads.size(), simulated.grads.size());
    for (size_t k = 0; k < stored.grads.size(); ++k) {
      for (size_t i = 0; i < stored.grads[k].size(); ++i) {
        ASSERT_EQ(float(stored.grads[k][i]), float(simulated.grads[k][i]))
            << stored.names[k] << " gradient element " << i;
        ASSERT_EQ(float(stored.params[k][i]), float(simulated.params[k][i]))
            << stored.names[k] << " element " << i;
      }
    }
  }
}

// The optimizer's update pass writes round_P(new master) into a parameter's 16-bit compute copy
// (every element, bf16 and fp16, AdamW, SGD with momentum and plain SGD), marks it current, and
// leaves the fp32 master bit for bit what it is without a copy.
TEST(MixedPrecision, TheOptimizerWritesTheSixteenBitCopyInItsUpdate) {
  const Mesh mesh = Mesh::create({{"dp", world_size()}}, world_size());
  const int64_t n = 1000;
  OptimizerSettings adamw, sgd, plain;
  adamw.kind = OptimizerKind::adamw;
  adamw.weight_decay = 0.01f;
  sgd.kind = plain.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  plain.momentum = 0.0f;
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    for (const OptimizerSettings* settings : {&adamw, &sgd, &plain}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + to_string(settings->kind) +
                   (settings == &plain ? " (plain)" : ""));
      std::vector<ShardedTensor> with = {
          ShardedTensor::allocate("w", {n}, PartitionSpec::parse("P()"), mesh, world_rank())};
      std::vector<ShardedTensor> without = {
          ShardedTensor::allocate("w", {n}, PartitionSpec::parse("P()"), mesh, world_rank())};
      std::vector<ShardedTensor> grads = {
          ShardedTensor::allocate("w", {n}, PartitionSpec::parse("P()"), mesh, world_rank())};
      auto copy = std::make_shared<SixteenBitCopy>();
      copy->bits = HalfBits("copy", n);
      copy->dtype = dtype;
      with[0].copy_16bit = copy;
      // (Separate host Views: a mirror of host memory would be the parameter itself.)
      Kokkos::View<float*, Kokkos::HostSpace> p("p", n), g("g", n);
      for (int64_t i = 0; i < n; ++i) {
        p(i) = static_cast<float>(std::sin(0.37 * i)) * 3.0f;
        g(i) = static_cast<float>(std::cos(0.11 * i)) * 0.5f;
      }
      Kokkos::deep_copy(with[0].local, p);
      Kokkos::deep_copy(without[0].local, p);
      Kokkos::deep_copy(grads[0].local, g);
      Optimizer a(*settings, with), b(*settings, without);
      for (int step = 0; step < 2; ++step) {
        copy->current = false;
        a.step(with, grads, 0.05f);
        b.step(without, grads, 0.05f);
        EXPECT_TRUE(copy->current);
      }
      auto master = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), with[0].local);
      auto reference = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), without[0].local);
      auto bits = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), copy->bits);
      int64_t moved = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(master(i), reference(i)) << "master element " << i;
        ASSERT_EQ(bits(i), to_16bit(master(i), dtype)) << "copy element " << i;
        moved += master(i) != p(i);
      }
      EXPECT_GT(moved, n / 2);  // the update did move the masters
    }
  }
}

// relu's and the identity's 16-bit storage keeps only f(z) (framework/core/activation_storage.hpp):
// activation_backward_from_16bit reads f(z)'s 16 bits where activation_backward reads z. On
// hand-picked z (+-0, NaN, +-inf, bf16 and fp16 subnormals, values that round to +-0, fp16's
// overflow, ordinary values), rounded to the dtype first as a Linear's output is (the functions'
// contract: z holds dtype values), and gradients that are not dtype values (the backward's
// rounding is in the comparison), forward and backward are bit for bit the fp32 functions' with
// the same dtype; and a kept z for them is refused (it would be left unwritten).
TEST(MixedPrecision, SixteenBitReluAndIdentityBackwardFromTheOutputIsBitForBitFromZ) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto bits_of = [](float f) {  // compared as bits: -0 is not +0, NaN equals itself
    uint32_t u = 0;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  std::vector<float> raw = {0.0f, -0.0f, nan, -nan, inf, -inf};
  // bf16's smallest and largest subnormals (+-2^-133, +-0x007f), then fp16's (+-2^-24, +-0x03ff)
  for (const uint16_t h : {0x0001, 0x8001, 0x007f, 0x807f}) raw.push_back(bf16_to_float(h));
  for (const uint16_t h : {0x0001, 0x8001, 0x03ff, 0x83ff}) raw.push_back(fp16_to_float(h));
  // fp32's smallest subnormal (0 in bf16 and fp16); 1e-9 (0 in fp16, a bf16 normal); 1e30 (inf
  // in fp16); ordinary values, fp16's largest, near fp32's largest
  for (const float v : {1e-45f, -1e-45f, 1e-9f, -1e-9f, 1e30f, -1e30f, 1.5f, -2.25f, 0.3f, -0.7f,
                        65504.0f, 3.0e38f}) {
    raw.push_back(v);
  }
  const int64_t n = static_cast<int64_t>(raw.size());
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    for (const Activation act : {Activation::relu, Activation::none}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + to_string(act));
      Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> z_host("z", 1, n),
          g_host("g", 1, n);
      for (int64_t k = 0; k < n; ++k) {
        z_host(0, k) = round_to(raw[k], dtype);
        // Gradients of both signs that are not 16-bit values (1/3-like mantissas).
        g_host(0, k) = (k % 2 == 0 ? 1.0f : -1.0f) * (1.0f + static_cast<float>(k)) / 3.0f;
      }
      Matrix z("z", 1, n), z_stored("z_stored", 1, n), out("out", 1, n);
      Matrix g_fp32("g_fp32", 1, n), g_16bit("g_16bit", 1, n);
      Kokkos::deep_copy(z, z_host);
      Kokkos::deep_copy(z_stored, z_host);
      Kokkos::deep_copy(g_fp32, g_host);
      Kokkos::deep_copy(g_16bit, g_host);
      HalfMatrix kept_out("kept_out", 1, n);
      activation_forward(act, z, out, dtype);
      activation_forward_keeping_16bit(act, z_stored, HalfMatrixView(), kept_out, dtype);
      activation_backward(act, z, g_fp32, dtype);
      activation_backward_from_16bit(act, kept_out, g_16bit, dtype);
      auto out_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
      auto stored_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), z_stored);
      auto kept_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), kept_out);
      auto fp32_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g_fp32);
      auto from16_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g_16bit);
      int64_t zero_grads = 0;
      for (int64_t k = 0; k < n; ++k) {
        SCOPED_TRACE("z = " + std::to_string(z_host(0, k)) + " (element " + std::to_string(k) +
                     ")");
        EXPECT_EQ(bits_of(stored_h(0, k)), bits_of(out_h(0, k)));
        EXPECT_EQ(kept_h(0, k), to_16bit(out_h(0, k), dtype));
        EXPECT_EQ(bits_of(from16_h(0, k)), bits_of(fp32_h(0, k)));
        zero_grads += fp32_h(0, k) == 0.0f;
      }
      // relu's gradient is 0 where z <= 0 or NaN (not 0 everywhere: +inf, the positive
      // subnormals, normals pass); the identity's never.
      if (act == Activation::relu) {
        EXPECT_GT(zero_grads, n / 3);
        EXPECT_LT(zero_grads, n);
      } else {
        EXPECT_EQ(zero_grads, 0);
      }
      HalfMatrix kept_z("kept_z", 1, n);
      EXPECT_THROW(activation_forward_keeping_16bit(act, z_stored, kept_z, kept_out, dtype), Error);
    }
  }
}

// {fp32, fp32} changes nothing: bit for bit the model built without a policy.
TEST(MixedPrecision, Fp32PolicyIsBitIdenticalToNoPolicy) {
  const MixedPrecision fp32{Dtype::fp32, Dtype::fp32};
  for (const auto& m : models()) {
    for (const auto& layout : layouts_for(world_size())) {
      for (bool overlap : {false, true}) {
        SCOPED_TRACE(m.name + " on " + layout.name + (overlap ? " with overlap" : ""));
        const RunResult with = run_model(m, layout, &fp32, 1.0f, overlap);
        const RunResult without = run_model(m, layout, nullptr, 1.0f, overlap);
        EXPECT_EQ(with.loss, without.loss);
        ASSERT_EQ(with.logits.size(), without.logits.size());
        for (size_t i = 0; i < with.logits.size(); ++i)
          ASSERT_EQ(float(with.logits[i]), float(without.logits[i])) << "logit " << i;
        for (size_t k = 0; k < with.grads.size(); ++k)
          for (size_t i = 0; i < with.grads[k].size(); ++i)
            ASSERT_EQ(float(with.grads[k][i]), float(without.grads[k][i]))
                << with.names[k] << " element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
