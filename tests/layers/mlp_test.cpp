// The MLP in every layout computes the single-rank function: for each mesh below, the
// loss of the first steps and EVERY gradient (gathered to full shape) equal those of a
// plain double-precision reference computed in this test (independent loops, no layer
// code), and so does the global gradient norm used for clipping.
//
// Models: the reference notebook's (784, 128 x5, 8), relu, MSE, SGD with momentum; and
// 784-64-64-10, tanh, cross-entropy, AdamW with clipping (10 outputs do not divide by
// 4: the last layer all-reduces and keeps its output replicated). Global batch 32. And
// 24-32-16-8 with silu, sigmoid and gelu_erf (the activations beyond relu and tanh).
// Tolerance: per tensor, max |got - ref| <= 1e-4 * max |ref| (+1e-7 absolute); the loss
// and the norm within 1e-4 relative.
// For every mesh, the planner's per-layer layout (make_plan with the model's layers, what
// `meshtrain plan` prints) is the one the built Linear layers report. The reference's backward
// is checked against central differences of its forward
// (ReferenceGradientsMatchCentralDifferences).

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/context.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/reference_losses.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr double kRelTol = 1e-4;
constexpr int64_t kBatch = 32;
constexpr uint64_t kSeed = 42;

using testing::gather_full;
using testing::Tensor;
using testing::to_host;

struct ModelCase {
  std::string name;
  std::vector<int64_t> sizes;
  Activation activation;
  LossKind loss;
  InitScheme init;
  OptimizerSettings optimizer;
  float lr;
  double clip;  // 0 = off
  int steps;
};

ModelCase notebook_model() {
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  sgd.weight_decay = 0.01f;
  return {"notebook",
          {784, 128, 128, 128, 128, 128, 8},
          Activation::relu,
          LossKind::mse,
          InitScheme::normal,
          sgd,
          0.01f,
          0.0,
          3};
}

ModelCase classifier_model() {
  OptimizerSettings adamw;
  adamw.kind = OptimizerKind::adamw;
  adamw.weight_decay = 0.1f;
  return {"classifier",
          {784, 64, 64, 10},
          Activation::tanh,
          LossKind::cross_entropy,
          InitScheme::he_normal,
          adamw,
          1e-3f,
          0.5,
          3};
}

// Small models for the activations added after relu and tanh (silu, sigmoid, gelu_erf): each
// trains 3 steps on every layout like the two above, against the same float64 reference.
std::vector<ModelCase> activation_models() {
  OptimizerSettings adamw;
  adamw.kind = OptimizerKind::adamw;
  adamw.weight_decay = 0.1f;
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  const std::vector<int64_t> sizes = {24, 32, 16, 8};
  return {
      {"silu", sizes, Activation::silu, LossKind::cross_entropy, InitScheme::he_normal, adamw,
       1e-3f, 0.5, 3},
      {"sigmoid", sizes, Activation::sigmoid, LossKind::mse, InitScheme::normal, sgd, 0.05f, 0.0,
       3},
      {"gelu_erf", sizes, Activation::gelu_erf, LossKind::cross_entropy, InitScheme::he_normal,
       adamw, 1e-3f, 0.0, 3},
  };
}

// ---- the data: global batch, the same for every mesh -------------------------------------
struct Batch {
  Tensor x;        // [B, in]
  Tensor targets;  // [B, out]
  std::vector<int32_t> labels;
};

Batch make_batch(const ModelCase& m, int step) {
  const int64_t in = m.sizes.front(), out = m.sizes.back();
  Batch b;
  b.x.resize(kBatch * in);
  b.targets.resize(kBatch * out);
  b.labels.resize(kBatch);
  const uint64_t s = kSeed + 1000 * static_cast<uint64_t>(step);
  for (int64_t i = 0; i < kBatch * in; ++i) b.x[i] = counter_normal(s, name_stream("x"), i);
  for (int64_t i = 0; i < kBatch * out; ++i) b.targets[i] = counter_normal(s, name_stream("t"), i);
  for (int64_t i = 0; i < kBatch; ++i) {
    b.labels[i] = static_cast<int32_t>(counter_uniform(s, name_stream("y"), i) * out);
  }
  return b;
}

// ---- the reference: plain loops in double ------------------------------------------------
using testing::activation;
using testing::activation_derivative;

struct Reference {
  ModelCase m;
  std::vector<Tensor> params, grads, slot1, slot2;
  int64_t t = 0;
  double min_kink = HUGE_VAL;  // the smallest |z| between layers in the last loss_and_grads

  // Loss of the batch; fills grads.
  double loss_and_grads(const Batch& b) {
    const size_t n = m.sizes.size() - 1;
    std::vector<Tensor> a(n + 1), z(n);
    a[0] = b.x;
    for (size_t l = 0; l < n; ++l) {
      const int64_t in = m.sizes[l], out = m.sizes[l + 1];
      const Tensor& w = params[2 * l];
      const Tensor& bias = params[2 * l + 1];
      z[l].assign(kBatch * out, 0.0);
      for (int64_t i = 0; i < kBatch; ++i)
        for (int64_t k = 0; k < in; ++k) {
          const double xv = a[l][i * in + k];
          for (int64_t j = 0; j < out; ++j) z[l][i * out + j] += xv * w[k * out + j];
        }
      for (int64_t i = 0; i < kBatch; ++i)
        for (int64_t j = 0; j < out; ++j) z[l][i * out + j] += bias[j];
      a[l + 1] = z[l];
      if (l + 1 < n)
        for (auto& v : a[l + 1]) {
          min_kink = std::min(min_kink, std::abs(v));
          v = activation(m.activation, v);
        }
    }
    Tensor dy;
    const double loss = testing::mean_loss_and_gradient(m.loss, a[n], kBatch, m.sizes.back(),
                                                        b.targets, b.labels, dy);
    Tensor grad = dy;
    for (size_t l = n; l-- > 0;) {
      const int64_t in = m.sizes[l], o = m.sizes[l + 1];
      if (l + 1 < n)
        for (int64_t i = 0; i < kBatch * o; ++i)
          grad[i] *= activation_derivative(m.activation, z[l][i]);
      Tensor& gw = grads[2 * l];
      Tensor& gb = grads[2 * l + 1];
      std::fill(gw.begin(), gw.end(), 0.0);
      std::fill(gb.begin(), gb.end(), 0.0);
      for (int64_t i = 0; i < kBatch; ++i)
        for (int64_t k = 0; k < in; ++k) {
          const double xv = a[l][i * in + k];
          for (int64_t j = 0; j < o; ++j) gw[k * o + j] += xv * grad[i * o + j];
        }
      for (int64_t i = 0; i < kBatch; ++i)
        for (int64_t j = 0; j < o; ++j) gb[j] += grad[i * o + j];
      if (l > 0) {
        Tensor gx(kBatch * in, 0.0);
        const Tensor& w = params[2 * l];
        for (int64_t i = 0; i < kBatch; ++i)
          for (int64_t k = 0; k < in; ++k) {
            double s = 0;
            for (int64_t j = 0; j < o; ++j) s += grad[i * o + j] * w[k * o + j];
            gx[i * in + k] = s;
          }
        grad = gx;
      }
    }
    return loss;
  }

  double clip() {
    double sq = 0;
    for (const auto& g : grads)
      for (double v : g) sq += v * v;
    const double norm = std::sqrt(sq);
    if (m.clip > 0 && norm > m.clip) {
      for (auto& g : grads)
        for (double& v : g) v *= m.clip / (norm + 1e-6);
    }
    return norm;
  }

  void step() {
    const auto& s = m.optimizer;
    ++t;
    for (size_t p = 0; p < params.size(); ++p) {
      for (size_t i = 0; i < params[p].size(); ++i) {
        double& w = params[p][i];
        const double g = grads[p][i];
        if (s.kind == OptimizerKind::sgd) {
          const double gg = g + s.weight_decay * w;
          slot1[p][i] = t == 1 ? gg : s.momentum * slot1[p][i] + gg;
          w -= m.lr * slot1[p][i];
        } else {
          slot1[p][i] = s.beta1 * slot1[p][i] + (1 - s.beta1) * g;
          slot2[p][i] = s.beta2 * slot2[p][i] + (1 - s.beta2) * g * g;
          const double mh = slot1[p][i] / (1 - std::pow(double(s.beta1), double(t)));
          const double vh = slot2[p][i] / (1 - std::pow(double(s.beta2), double(t)));
          w = w * (1 - m.lr * s.weight_decay) - m.lr * mh / (std::sqrt(vh) + s.eps);
        }
      }
    }
  }
};

Reference make_reference(const ModelCase& m) {
  Reference r;
  r.m = m;
  const Mesh single = Mesh::single();
  for (const auto& p : mlp_parameter_shapes(m.sizes)) {
    ShardedTensor t = ShardedTensor::allocate(p.name, p.shape, PartitionSpec(), single, 0);
    initialize(t, m.init, kSeed);
    r.params.push_back(to_host(t));
    r.grads.emplace_back(r.params.back().size(), 0.0);
    r.slot1.emplace_back(r.params.back().size(), 0.0);
    r.slot2.emplace_back(r.params.back().size(), 0.0);
  }
  return r;
}

void expect_close(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double max_ref = 0, max_err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, std::abs(ref[i]));
    const double e = std::abs(got[i] - ref[i]);
    if (e > max_err) {
      max_err = e;
      worst = i;
    }
  }
  EXPECT_LE(max_err, kRelTol * max_ref + 1e-7)
      << what << ": element " << worst << " is " << got[worst] << ", reference " << ref[worst]
      << " (max |ref| " << max_ref << ")";
}

// ---- the meshes and layouts --------------------------------------------------------------
struct CustomSpecs {
  std::string weight, bias;  // spec text of every weight / bias; "" = use the preset
};

struct LayoutCase {
  std::string name;
  std::vector<std::pair<std::string, int>> mesh;
  std::string preset;         // planner preset, or "" for `custom`
  int64_t min_sharding_size;  // for presets
  CustomSpecs custom;
  CollectiveMatmulAlgorithm algorithm = CollectiveMatmulAlgorithm::automatic;
};

bool is_weight(const std::string& p) {
  return p.size() >= 6 && p.compare(p.size() - 6, 6, "weight") == 0;
}

std::vector<LayoutCase> layouts_for(int n) {
  using A = CollectiveMatmulAlgorithm;
  auto custom = [](std::string w, std::string b) { return CustomSpecs{w, b}; };
  std::vector<LayoutCase> c;
  if (n == 1) {
    c.push_back({"single", {{"dp", 1}}, "dp", 0, {}});
    c.push_back({"single_fsdp_tp_specs", {{"fsdp", 1}, {"tp", 1}}, "fsdp_tp", 0, {}});
  } else if (n == 2) {
    c.push_back({"dp2", {{"dp", 2}}, "dp", 0, {}});
    c.push_back({"fsdp2", {{"fsdp", 2}}, "fsdp", 0, {}});
    c.push_back({"tp2", {{"tp", 2}}, "tp", 0, {}, A::naive});
    c.push_back({"tp2_ring", {{"tp", 2}}, "tp", 0, {}, A::ring});
    // Column-parallel Linears (weights split on dim 1 over tp): the first fed a replicated
    // input, the others a split one (gathered inside the collective matmuls).
    c.push_back({"tp2_column_naive", {{"tp", 2}}, "", 0, custom("P(None, tp)", "P(tp)"), A::naive});
    c.push_back({"tp2_column_ring", {{"tp", 2}}, "", 0, custom("P(None, tp)", "P(tp)"), A::ring});
    c.push_back({"tp2_column_bidirectional",
                 {{"tp", 2}},
                 "",
                 0,
                 custom("P(None, tp)", "P(tp)"),
                 A::bidirectional});
  } else if (n == 4) {
    c.push_back({"dp4", {{"dp", 4}}, "dp", 0, {}});
    c.push_back({"fsdp4", {{"fsdp", 4}}, "fsdp", 0, {}});
    c.push_back({"tp4", {{"tp", 4}}, "tp", 0, {}, A::bidirectional});
    c.push_back({"tp4_planner_default", {{"tp", 4}}, "tp", 16384, {}});
    c.push_back({"fsdp2_tp2", {{"fsdp", 2}, {"tp", 2}}, "fsdp_tp", 0, {}, A::ring});
    c.push_back({"dp2_tp2", {{"dp", 2}, {"tp", 2}}, "dp_tp", 0, {}});
    c.push_back({"dp2_fsdp2", {{"dp", 2}, {"fsdp", 2}}, "dp_fsdp", 0, {}});
    // Storage layouts no preset gives: tp on dim 1 (column-parallel since the Megatron layout;
    // before it, a storage axis whose copies divided the gradient),
    // a dim-0 tuple with tp first, a bias gathered then sliced, storage over dp.
    c.push_back({"fsdp2_tp2_storage_2d",
                 {{"fsdp", 2}, {"tp", 2}},
                 "",
                 0,
                 custom("P(fsdp, tp)", "P(fsdp)")});
    c.push_back({"fsdp2_tp2_tuple",
                 {{"fsdp", 2}, {"tp", 2}},
                 "",
                 0,
                 custom("P((tp, fsdp), None)", "P((fsdp, tp))")});
    c.push_back({"dp2_fsdp2_tuple",
                 {{"dp", 2}, {"fsdp", 2}},
                 "",
                 0,
                 custom("P((fsdp, dp), None)", "P(dp)")});
    c.push_back(
        {"dp2_tp2_dp_storage", {{"dp", 2}, {"tp", 2}}, "", 0, custom("P(tp, dp)", "P(tp)")});
    c.push_back({"tp4_column_bidirectional",
                 {{"tp", 4}},
                 "",
                 0,
                 custom("P(None, tp)", "P(tp)"),
                 A::bidirectional});
    c.push_back({"fsdp2_tp2_column_ring",
                 {{"fsdp", 2}, {"tp", 2}},
                 "",
                 0,
                 custom("P(fsdp, tp)", "P(tp)"),
                 A::ring});
    c.push_back({"dp2_tp2_column_naive",
                 {{"dp", 2}, {"tp", 2}},
                 "",
                 0,
                 custom("P(None, tp)", "P(tp)"),
                 A::naive});
  } else if (n == 8) {
    c.push_back({"fsdp2_tp4_column",
                 {{"fsdp", 2}, {"tp", 4}},
                 "",
                 0,
                 custom("P(fsdp, tp)", "P(tp)"),
                 A::bidirectional});
    c.push_back({"fsdp2_tp4", {{"fsdp", 2}, {"tp", 4}}, "fsdp_tp", 0, {}});
    c.push_back({"dp2_tp4", {{"dp", 2}, {"tp", 4}}, "dp_tp", 0, {}, A::bidirectional});
    c.push_back({"dp2_fsdp4", {{"dp", 2}, {"fsdp", 4}}, "dp_fsdp", 0, {}});
    c.push_back({"dp2_fsdp2_tp2", {{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, "fsdp_tp", 0, {}});
  }
  return c;
}

// Replaces split dims that do not divide by None (like the planner's fallback).
PartitionSpec fitted(PartitionSpec spec, const std::vector<int64_t>& shape, const Mesh& mesh) {
  spec = spec.with_rank(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] % mesh.size_of(spec.entries[d].axes) != 0) spec.entries[d].axes.clear();
  }
  return spec;
}

// The planner (`meshtrain plan`) reports for every layer the layout the built layers use:
// the same specs, the same describe() line, the same TP decision and output layout, and
// the local batch rows the model was built for.
void expect_planner_agrees(const ModelCase& m, const LayoutCase& layout, const Mesh& mesh,
                           const Mlp& model) {
  std::vector<PartitionRule> rules;
  PlanOptions options;
  if (!layout.preset.empty()) {
    rules = preset_rules(layout.preset);
    options.min_sharding_size = layout.min_sharding_size;
  } else {  // as fitted(): dims that do not divide are replicated
    rules = {PartitionRule{"weight$", PartitionSpec::parse(layout.custom.weight), true},
             PartitionRule{".*", PartitionSpec::parse(layout.custom.bias), true}};
    options.min_sharding_size = 0;
  }
  options.batch_axes = {"fsdp", "dp"};  // as the ParallelContext of run_case
  options.feature_axis = "tp";
  options.global_batch = kBatch;
  const ShardingPlan plan =
      make_plan(mlp_parameter_shapes(m.sizes), mesh, rules, options, mlp_linear_layers(m.sizes));
  EXPECT_EQ(plan.local_batch_rows, model.local_rows());
  for (const auto& p : model.parameters()) {
    EXPECT_EQ(plan.find(p.name).spec, p.spec) << p.name;
  }
  ASSERT_EQ(plan.layers.size(), model.layers().size());
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& planned = plan.layers[i];
    const Linear& built = model.layers()[i];
    EXPECT_EQ(planned.name + ": " + planned.compute, built.describe());
    EXPECT_EQ(planned.layout.tensor_parallel, built.tensor_parallel()) << built.describe();
    EXPECT_EQ(planned.layout.output_layout(), built.output_layout()) << built.describe();
    EXPECT_EQ(planned.layout.out_local, built.output_width()) << built.describe();
    // The all-reduce fallback is in the plan's notes exactly when the layer uses it.
    bool fallback_noted = false;
    for (const auto& note : planned.notes) {
      fallback_noted = fallback_noted || note.find("keeps it replicated") != std::string::npos;
    }
    EXPECT_EQ(fallback_noted,
              built.tensor_parallel() && built.output_layout() == FeatureLayout::replicated)
        << built.describe();
  }
}

// What a run leaves, for comparing two runs of one case bit for bit.
struct RunTrace {
  std::vector<double> losses;
  std::vector<double> values;  // every gradient of every step, then the final parameters
  int prefetched_layers = 0;   // layers whose weight gather was started early
  size_t buckets = 0;          // DP gradient buckets all-reduced while backward runs
};

RunTrace run_case(const ModelCase& m, const LayoutCase& layout, bool overlap = false,
                  double bucket_mb = 25.0) {
  SCOPED_TRACE(m.name + " on " + layout.name + (overlap ? " with overlap" : ""));
  RunTrace trace;
  const Mesh mesh = Mesh::create(layout.mesh, world_size());
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  std::vector<std::string> all_axes;
  for (const auto& a : mesh.axes()) all_axes.push_back(a.name);
  Communicator& world = comms.get(all_axes);
  ParallelContext context(comms, {"fsdp", "dp"}, "tp", layout.algorithm, overlap, bucket_mb);

  ShardingPlan plan;
  SpecLookup spec_of;
  if (!layout.preset.empty()) {
    PlanOptions options;
    options.min_sharding_size = layout.min_sharding_size;
    plan = make_plan(mlp_parameter_shapes(m.sizes), mesh, preset_rules(layout.preset), options);
    spec_of = specs_from_plan(plan);
  } else {
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : mlp_parameter_shapes(m.sizes)) shapes[p.name] = p.shape;
    spec_of = [&, shapes](const std::string& name) {
      const std::string& text = is_weight(name) ? layout.custom.weight : layout.custom.bias;
      return fitted(PartitionSpec::parse(text), shapes.at(name), mesh);
    };
  }

  const int64_t rows = kBatch / context.batch_parallel();
  Mlp model(m.sizes, m.activation, spec_of, context, rows);
  model.initialize(m.init, kSeed);
  // The layouts really are the ones the case is about.
  const int tp = context.feature_parallel();
  if (tp > 1 && layout.preset.find("tp") != std::string::npos) {
    for (const auto& l : model.layers()) {
      const bool small = l.in() * l.out() < layout.min_sharding_size;
      EXPECT_EQ(l.tensor_parallel(), !small) << l.describe();
    }
    EXPECT_EQ(model.output_layout() == FeatureLayout::split,
              m.sizes.back() % tp == 0 && model.layers().back().tensor_parallel())
        << model.layers().back().describe();
  }
  if (layout.name.find("column") != std::string::npos) {
    // (A dim that does not divide by tp is left whole by fitted(): that layer is replicated.)
    for (const auto& l : model.layers()) {
      EXPECT_EQ(l.layout().column_parallel, l.out() % tp == 0) << l.describe();
    }
    EXPECT_EQ(model.output_layout() == FeatureLayout::split, m.sizes.back() % tp == 0);
  }
  if (mesh.has_axis("fsdp") && mesh.axis_size("fsdp") > 1 &&
      layout.preset.find("fsdp") != std::string::npos) {
    EXPECT_NE(model.layers().front().describe().find("gathered over (fsdp)"), std::string::npos)
        << model.layers().front().describe();
  }
  expect_planner_agrees(m, layout, mesh, model);
  if (overlap) {
    for (size_t k = 1; k < model.layers().size(); ++k)
      trace.prefetched_layers += model.layers()[k].can_prefetch_weight() ? 1 : 0;
    // The buckets hold exactly the gradients of the layers that defer their reduction,
    // none over the cap.
    size_t deferred = 0, bucketed = 0;
    for (size_t k = 0; k < model.layers().size(); ++k) {
      if (!model.layers()[k].defers_reduction()) continue;
      deferred += model.gradients()[2 * k].local.extent(0);
      deferred += model.gradients()[2 * k + 1].local.extent(0);
    }
    const double cap = std::max(1.0, std::floor(bucket_mb * 1024 * 1024 / sizeof(float)));
    for (size_t floats : model.gradient_buckets().bucket_floats()) {
      EXPECT_LE(static_cast<double>(floats), cap);
      bucketed += floats;
    }
    EXPECT_EQ(bucketed, deferred);
    trace.buckets = model.gradient_buckets().size();
  }
  Loss loss(m.loss, context, rows, m.sizes.back(), model.output_layout());
  Optimizer optimizer(m.optimizer, model.parameters());
  GradientClipper clipper(mesh, context.rank(), model.gradients());
  Reference ref = make_reference(m);

  const int64_t in = m.sizes.front(), out = m.sizes.back();
  Matrix x("x", rows, in);
  Matrix targets("targets", rows, out);
  Kokkos::View<int32_t*> labels("labels", rows);
  auto xh = Kokkos::create_mirror_view(x);
  auto th = Kokkos::create_mirror_view(targets);
  auto lh = Kokkos::create_mirror_view(labels);
  const int64_t first = context.batch_index() * rows;

  for (int step = 0; step < m.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Batch b = make_batch(m, step);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t k = 0; k < in; ++k) xh(i, k) = static_cast<float>(b.x[(first + i) * in + k]);
      for (int64_t j = 0; j < out; ++j)
        th(i, j) = static_cast<float>(b.targets[(first + i) * out + j]);
      lh(i) = b.labels[first + i];
    }
    Kokkos::deep_copy(x, xh);
    Kokkos::deep_copy(targets, th);
    Kokkos::deep_copy(labels, lh);

    MatrixView logits = model.forward(x);
    const LossResult r = m.loss == LossKind::mse ? loss.regression(logits, targets)
                                                 : loss.cross_entropy(logits, labels);
    model.backward(loss.gradient());
    const double ref_loss = ref.loss_and_grads(b);
    EXPECT_NEAR(r.loss, ref_loss, kRelTol * std::abs(ref_loss)) << "loss";
    EXPECT_EQ(r.count, kBatch);
    trace.losses.push_back(r.loss);
    for (size_t p = 0; p < ref.grads.size(); ++p) {
      const Tensor full = gather_full(model.gradients()[p], mesh, context.rank());
      expect_close(
          full, ref.grads[p],
          "gradient of " + model.gradients()[p].name + " " + model.gradients()[p].spec.to_string());
      trace.values.insert(trace.values.end(), full.begin(), full.end());
    }
    const double norm = clipper.clip(model.gradients(), m.clip, world);
    const double ref_norm = ref.clip();
    EXPECT_NEAR(norm, ref_norm, kRelTol * ref_norm) << "global gradient norm";
    optimizer.step(model.parameters(), model.gradients(), m.lr);
    ref.step();
  }
  for (size_t p = 0; p < ref.params.size(); ++p) {
    const Tensor full = gather_full(model.parameters()[p], mesh, context.rank());
    expect_close(full, ref.params[p],
                 "parameter " + model.parameters()[p].name + " after the steps");
    trace.values.insert(trace.values.end(), full.begin(), full.end());
  }
  return trace;
}

// The reference's hand-derived backward (each activation's derivative, MSE and the softmax
// cross-entropy, the chain through the layers) is the derivative of its forward: every
// parameter gradient against central differences in float64 of the batch loss, on 24-32-16-8
// with each activation (both losses among them). Step h = 1e-5 (parameters of O(0.1..1)):
// truncation h^2/6 |L'''| and rounding eps |L| / h (|L| up to ~10 with MSE) are each at most a
// few 1e-9 (measured at most 3.2e-9, printed); tolerance 1e-7 (1 + |g|), orders below a wrong
// derivative.
// relu is piecewise: its pre-activations must stay >= 1e-3 from 0 (asserted; 1.2e-3 here)
// against moves of at most h |x| < 1e-4. The reference does not depend on the ranks: checked
// once, at np 1.
TEST(Mlp, ReferenceGradientsMatchCentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "the float64 reference alone: checked at np 1";
  constexpr double kStep = 1e-5, kFdTolerance = 1e-7;
  std::vector<ModelCase> cases = activation_models();
  ModelCase relu = cases[1], tanh = cases[0];
  relu.name = "relu";
  relu.activation = Activation::relu;  // with MSE
  tanh.name = "tanh";
  tanh.activation = Activation::tanh;  // with cross-entropy
  cases.push_back(relu);
  cases.push_back(tanh);
  for (const ModelCase& m : cases) {
    SCOPED_TRACE(m.name + (m.loss == LossKind::mse ? ", mse" : ", cross-entropy"));
    const Batch b = make_batch(m, 0);
    const Reference initial = make_reference(m);
    Reference ref = initial;
    ref.loss_and_grads(b);
    if (m.activation == Activation::relu) ASSERT_GE(ref.min_kink, 1e-3);
    std::vector<std::string> names;
    for (const auto& p : mlp_parameter_shapes(m.sizes)) names.push_back(p.name);
    const testing::Tensors numeric = testing::central_differences(
        ref.params,
        [&](const testing::Tensors& v) {
          Reference r = initial;
          r.params = v;
          return r.loss_and_grads(b);
        },
        kStep);
    const double worst =
        testing::expect_matches_central_differences(numeric, ref.grads, kFdTolerance, names);
    std::printf(
        "[ mlp ] %s: reference gradients vs central differences: largest "
        "|fd - g| / (1 + |g|) %.2e (tolerance %.0e)\n",
        m.name.c_str(), worst, kFdTolerance);
  }
}

TEST(Mlp, NotebookModelMseSgdMatchesSingleRank) {
  for (const auto& layout : layouts_for(world_size())) run_case(notebook_model(), layout);
}

TEST(Mlp, ClassifierCrossEntropyAdamwClipMatchesSingleRank) {
  for (const auto& layout : layouts_for(world_size())) run_case(classifier_model(), layout);
}

// silu, sigmoid and gelu_erf between the layers: every layout equals the float64 reference
// (so also the single-rank run), forward loss, every gradient and the parameters after 3 steps.
TEST(Mlp, SiluSigmoidGeluErfMatchSingleRank) {
  for (const ModelCase& m : activation_models()) {
    for (const auto& layout : layouts_for(world_size())) run_case(m, layout);
  }
}

// Overlap on against off. Over MPI the same sums run in the same order, so the two runs agree
// bit for bit. NCCL sums an all-reduce in an order that depends on the message's size and
// offset (its algorithm, protocol and chunking), so buckets and prefetches change the last
// bits there: over NCCL the runs agree to float rounding (each also matches the float64
// reference inside run_case).
void expect_same_run(const RunTrace& on, const RunTrace& off, const std::string& layout) {
  const bool bitwise = testing::test_backend_choice() != CommBackendChoice::nccl;
  ASSERT_EQ(on.losses.size(), off.losses.size()) << layout;
  ASSERT_EQ(on.values.size(), off.values.size()) << layout;
  for (size_t s = 0; s < on.losses.size(); ++s) {
    if (bitwise) {
      EXPECT_EQ(on.losses[s], off.losses[s]) << layout << " loss " << s;
    } else {
      EXPECT_NEAR(on.losses[s], off.losses[s], 1e-5 * std::max(1.0, std::abs(off.losses[s])))
          << layout << " loss " << s;
    }
  }
  int64_t mismatches = 0;
  for (size_t k = 0; k < on.values.size(); ++k) {
    const double scale = std::max(1e-3, std::abs(static_cast<double>(off.values[k])));
    const bool same = bitwise ? on.values[k] == off.values[k]
                              : std::abs(on.values[k] - off.values[k]) <= 1e-5 * scale;
    if (!same && mismatches++ < 5) {
      ADD_FAILURE() << layout << " value " << k << ": " << on.values[k] << " with overlap, "
                    << off.values[k] << " without";
    }
  }
  EXPECT_EQ(mismatches, 0) << layout;
}

// With overlap, FSDP layers gather their weight while the layer before computes (forward
// and backward). The same sums in the same order: losses, gradients and parameters equal
// the gather-when-used run bit for bit over MPI, on every layout (expect_same_run).
TEST(Mlp, WeightPrefetchIsBitIdenticalToGatheringWhenUsed) {
  int prefetched = 0;
  for (const auto& layout : layouts_for(world_size())) {
    const RunTrace off = run_case(classifier_model(), layout, false);
    const RunTrace on = run_case(classifier_model(), layout, true);
    prefetched += on.prefetched_layers;
    expect_same_run(on, off, layout.name);
  }
  // The layouts with fsdp > 1 exercise the prefetch (dim 0: fsdp; dim 1: fsdp_tp).
  if (world_size() > 1) {
    EXPECT_GT(prefetched, 0);
  }
}

// With overlap, the gradients of DP-stored layers are all-reduced in buckets started while
// backward goes on, instead of one blocking all-reduce per tensor. A cap of 3000 floats
// makes several buckets: some span layers, the first weight is split over many, most are
// all-reduced in place. Losses, gradients and parameters equal the per-tensor run bit for
// bit over MPI (expect_same_run) on every layout (those without DP storage keep their own
// reductions).
TEST(Mlp, GradientBucketsAreBitIdenticalToAllReducingEachTensor) {
  const double bucket_mb = 3000.0 * sizeof(float) / (1024 * 1024);
  size_t buckets = 0;
  for (const auto& layout : layouts_for(world_size())) {
    const RunTrace off = run_case(classifier_model(), layout, false);
    const RunTrace on = run_case(classifier_model(), layout, true, bucket_mb);
    buckets += on.buckets;
    expect_same_run(on, off, layout.name);
  }
  // On dp2 / dp4 every layer defers: 55,050 floats in buckets of at most 3000 are 19
  // buckets. (On dp x tp and dp x fsdp the layers reduce over tp / fsdp too and keep their
  // own reductions, except dp2 x tp4's last layer, whose output is not split.)
  if (world_size() == 2 || world_size() == 4) {
    EXPECT_GE(buckets, 19u);
  }
}

}  // namespace
}  // namespace meshtrain
