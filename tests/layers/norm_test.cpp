// LayerNorm and RMSNorm (layers/norm.hpp) on every mesh below equal a float64 reference
// written here (two-pass statistics in double, PyTorch's formulas: biased variance,
// LayerNorm eps 1e-5, RMSNorm eps 2^-23): the forward output, the input gradient and the
// scale and bias gradients (gathered to full shape), for features whole on a rank and split
// over tp (2 and 4), with the parameters stored whole, split like the features, over fsdp,
// and over (tp, fsdp); with the gradient reduction now, deferred (all_reduce_deferred()) and
// in DP buckets; and without an input gradient (the first layer of a model). Every mesh also
// equals the same layer built on one rank (MPI_COMM_SELF). Backward leaves dy as it was.
// The reference's backward is checked against central differences of its forward, and
// decide_norm_layout / norm_step_collectives (what a plan reports) on hand-worked meshes.
//
// Data: global batch 16, 32 features; x ~ N(0, 1), and rows with a large mean offset
// (x ~ +-1e3 .. 3e3 + N(0, 1)) to show the variance is computed stably (E[x^2] - E[x]^2 in
// fp32 is off by more than 1% there: Norm.OffsetRowsDefeatTheOnePassVariance); scale ~ 1 + 0.3 N(0,
// 1), bias ~ 0.2 N(0, 1), dy ~ N(0, 1).
//
// Tolerances (fp32): per tensor, max |got - ref| <= 1e-5 * max |ref| against the float64
// reference (observed at most 3e-7), and <= 2e-6 * max |ref| against one rank (the only
// difference is the order of fp32 sums over ranks; observed at most 2.2e-7).
// Mixed precision {bf16, fp32}, {fp16, fp32}, {bf16, bf16}: x and dy are given as 16-bit
// values, the reference uses the 16-bit scale and bias; u = 2^-8 (bf16) / 2^-11 (fp16) is the
// unit roundoff, s = half the spacing of its subnormals (fp16 2^-25, bf16 2^-134). The output
// and the input gradient are rounded once:
//   |got - ref| <= u * |ref| + s + 1e-5 * max |ref|   (elementwise)
// The parameter gradients are fp32 column sums rounded to P on every rank, then summed over
// k ranks in R (one rounding per hop when R is 16-bit):
//   |got - ref| <= (1 + 3 k [R 16-bit]) * u * sum_i |term_i| + (k + 1) s + 1e-5 * max |ref|
// where term_i is row i's contribution (dy * x_hat or dy).
// Allocation: forward and backward allocate nothing: heap allocations (operator new, replaced
// by tests/support/counting_allocator.cpp) and Kokkos allocations (the allocate-data callback)
// counted over a second pass, as tests/train/step_allocations_test.cpp counts a training step;
// the counter is checked to see allocations (Norm.AllocationCounterSeesAllocations).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/precision.hpp"
#include "framework/train/init.hpp"
#include "layers/context.hpp"
#include "layers/gradient_buckets.hpp"
#include "layers/gradient_reduction.hpp"
#include "layers/norm.hpp"
#include "partition/norm_layout.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::gather_full;
using testing::host_matrix;
using testing::Tensor;
using testing::to_host;

constexpr int64_t kBatch = 16;
constexpr int64_t kWidth = 32;
constexpr uint64_t kSeed = 7;

// ---- data -------------------------------------------------------------------------------
struct Data {
  Tensor x, dy, scale, bias;  // [B, N], [B, N], [N], [N]
};

// v rounded to `dtype` through float; fp32 leaves a double as it is (the data are float values
// already; the finite-difference check perturbs them by less than a float's spacing).
double rounded(double v, Dtype dtype) {
  if (dtype == Dtype::fp32) return v;
  return static_cast<double>(round_to(static_cast<float>(v), dtype));
}

// The same global data on every rank; `offset`: rows of x ~ +-(1..3) * 1e3 + N(0, 1).
// Values are fp32 (or `dtype`) values, so the layer and the reference see the same inputs.
Data make_data(bool offset, Dtype dtype = Dtype::fp32) {
  Data d;
  d.x.resize(kBatch * kWidth);
  d.dy.resize(kBatch * kWidth);
  d.scale.resize(kWidth);
  d.bias.resize(kWidth);
  for (int64_t i = 0; i < kBatch; ++i) {
    const double shift = offset ? (i % 2 ? -1.0 : 1.0) * 1e3 * (1 + i % 3) : 0.0;
    for (int64_t j = 0; j < kWidth; ++j) {
      const int64_t k = i * kWidth + j;
      d.x[k] =
          rounded(static_cast<float>(shift + counter_normal(kSeed, name_stream("x"), k)), dtype);
      d.dy[k] = rounded(counter_normal(kSeed, name_stream("dy"), k), dtype);
    }
  }
  for (int64_t j = 0; j < kWidth; ++j) {
    d.scale[j] = static_cast<float>(1.0 + 0.3 * counter_normal(kSeed, name_stream("scale"), j));
    d.bias[j] = static_cast<float>(0.2 * counter_normal(kSeed, name_stream("bias"), j));
  }
  return d;
}

// ---- the float64 reference ---------------------------------------------------------------
struct Reference {
  Tensor y, dx, dscale, dbias;     // [B, N], [B, N], [N], [N]
  Tensor abs_dscale, abs_dbias;    // sum over rows of |term| (the 16-bit bounds)
  Tensor dscale_rows, dbias_rows;  // [B, N]: row i's term (partial sums over a rank's rows)
};

// scale and bias as the layer uses them (cast to `dtype`).
Reference reference(NormKind kind, const Data& d, Dtype dtype = Dtype::fp32) {
  const bool ln = kind == NormKind::layernorm;
  const double eps = ln ? kLayerNormEps : kRmsNormEps;
  const int64_t n = kWidth;
  Reference r;
  r.y.assign(kBatch * n, 0.0);
  r.dx.assign(kBatch * n, 0.0);
  r.dscale.assign(n, 0.0);
  r.dbias.assign(n, 0.0);
  r.abs_dscale.assign(n, 0.0);
  r.abs_dbias.assign(n, 0.0);
  r.dscale_rows.assign(kBatch * n, 0.0);
  r.dbias_rows.assign(kBatch * n, 0.0);
  for (int64_t i = 0; i < kBatch; ++i) {
    const double* x = &d.x[i * n];
    const double* dy = &d.dy[i * n];
    double mean = 0.0, second = 0.0;
    if (ln) {
      for (int64_t j = 0; j < n; ++j) mean += x[j];
      mean /= n;
      for (int64_t j = 0; j < n; ++j) second += (x[j] - mean) * (x[j] - mean);
    } else {
      for (int64_t j = 0; j < n; ++j) second += x[j] * x[j];
    }
    const double rstd = 1.0 / std::sqrt(second / n + eps);
    std::vector<double> x_hat(n), g(n);
    double sg = 0.0, sgx = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double s = rounded(d.scale[j], dtype);
      const double b = ln ? rounded(d.bias[j], dtype) : 0.0;
      x_hat[j] = (x[j] - mean) * rstd;
      r.y[i * n + j] = x_hat[j] * s + b;
      g[j] = dy[j] * s;
      sg += g[j];
      sgx += g[j] * x_hat[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      r.dx[i * n + j] = rstd * (g[j] - (ln ? sg / n : 0.0) - x_hat[j] * sgx / n);
      r.dscale_rows[i * n + j] = dy[j] * x_hat[j];
      r.dbias_rows[i * n + j] = dy[j];
      r.dscale[j] += dy[j] * x_hat[j];
      r.dbias[j] += dy[j];
      r.abs_dscale[j] += std::abs(dy[j] * x_hat[j]);
      r.abs_dbias[j] += std::abs(dy[j]);
    }
  }
  return r;
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (double v : t) m = std::max(m, std::abs(v));
  return m;
}

// max |got - ref| <= rel * max |ref| (+1e-12), with the worst element named.
void expect_close(const Tensor& got, const Tensor& ref, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double bound = rel * max_abs(ref) + 1e-12;
  size_t worst = 0;
  double err = 0.0;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double e = std::abs(got[k] - ref[k]);
    if (!(e <= err)) {  // NaN counts as the worst
      err = e;
      worst = k;
    }
  }
  EXPECT_LE(err, bound) << what << ": element " << worst << " is " << got[worst] << ", reference "
                        << ref[worst] << " (max |ref| " << max_abs(ref) << ")";
}

// Elementwise: |got - ref| <= a[k] + b * max |ref|.
void expect_within(const Tensor& got, const Tensor& ref, const Tensor& a, double b,
                   const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double floor = b * max_abs(ref);
  int bad = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double e = std::abs(got[k] - ref[k]);
    if (!(e <= a[k] + floor) && bad++ < 3) {
      ADD_FAILURE() << what << ": element " << k << " is " << got[k] << ", reference " << ref[k]
                    << ", allowed " << a[k] + floor;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// ---- meshes -------------------------------------------------------------------------------
struct NormCase {
  std::string name;
  std::vector<std::pair<std::string, int>> mesh;
  FeatureLayout layout;
  std::string spec;  // of scale and bias
  bool direct;       // expected direct_gradients()
};

std::vector<NormCase> cases_for(int n) {
  const FeatureLayout R = FeatureLayout::replicated, S = FeatureLayout::split;
  std::vector<NormCase> c;
  if (n == 1) {
    c.push_back({"single", {{"dp", 1}}, R, "P()", true});
    c.push_back({"single_tp1_split", {{"tp", 1}}, S, "P(tp)", true});
  } else if (n == 2) {
    c.push_back({"dp2", {{"dp", 2}}, R, "P()", true});
    c.push_back({"fsdp2", {{"fsdp", 2}}, R, "P(fsdp)", false});
    c.push_back({"tp2", {{"tp", 2}}, S, "P(tp)", true});
    c.push_back({"tp2_stored_whole", {{"tp", 2}}, S, "P()", false});
    c.push_back({"tp2_features_whole", {{"tp", 2}}, R, "P(tp)", false});
  } else if (n == 4) {
    c.push_back({"dp4", {{"dp", 4}}, R, "P()", true});
    c.push_back({"tp4", {{"tp", 4}}, S, "P(tp)", true});
    c.push_back({"tp4_stored_whole", {{"tp", 4}}, S, "P()", false});
    c.push_back({"dp2_tp2", {{"dp", 2}, {"tp", 2}}, S, "P(tp)", true});
    c.push_back({"fsdp2_tp2_tuple", {{"fsdp", 2}, {"tp", 2}}, S, "P((tp, fsdp))", false});
    c.push_back({"fsdp2_tp2_fsdp", {{"fsdp", 2}, {"tp", 2}}, S, "P(fsdp)", false});
    c.push_back({"dp2_fsdp2", {{"dp", 2}, {"fsdp", 2}}, R, "P(fsdp)", false});
    c.push_back({"dp2_tp2_features_whole", {{"dp", 2}, {"tp", 2}}, R, "P()", true});
  } else if (n == 8) {
    c.push_back({"dp2_tp4", {{"dp", 2}, {"tp", 4}}, S, "P(tp)", true});
    c.push_back({"fsdp2_tp4_tuple", {{"fsdp", 2}, {"tp", 4}}, S, "P((tp, fsdp))", false});
    c.push_back({"dp2_fsdp2_tp2", {{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, S, "P(tp)", true});
  }
  return c;
}

// ---- one layer on one mesh ------------------------------------------------------------------
enum class Mode { now, later, buckets };
const char* mode_name(Mode m) {
  return m == Mode::now ? "now" : m == Mode::later ? "later" : "buckets";
}

struct Result {
  Tensor y, dx;                  // this rank's block [rows, cols] of the global output / input grad
  Tensor dscale, dbias;          // full gradients
  Tensor scale_init, bias_init;  // full parameters after initialize_parameters()
  int64_t first_row = 0, rows = 0, offset = 0, cols = 0;
  bool direct = false, defers = false;
  bool dy_unchanged = false;  // backward leaves its dy as it was
  std::string describe;
  Tensor partial_dscale;     // deferring in Mode::later: the gradient before all_reduce_deferred
  int64_t allocations = -1;  // heap and Kokkos allocations in a second forward + backward
};

Matrix device_block(const Tensor& full, int64_t first_row, int64_t rows, int64_t offset,
                    int64_t cols, const std::string& label) {
  Matrix m(label, rows, cols);
  auto h = Kokkos::create_mirror_view(m);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      h(i, j) = static_cast<float>(full[(first_row + i) * kWidth + offset + j]);
  Kokkos::deep_copy(m, h);
  return m;
}

void fill_block(ShardedTensor& t, const Tensor& full) {
  auto h = Kokkos::create_mirror_view(t.local);
  for (size_t k = 0; k < h.extent(0); ++k) h(k) = static_cast<float>(full[t.box.offset[0] + k]);
  Kokkos::deep_copy(t.local, h);
}

Tensor block_of(const Tensor& full, const Result& r) {
  Tensor t(r.rows * r.cols);
  for (int64_t i = 0; i < r.rows; ++i)
    for (int64_t j = 0; j < r.cols; ++j)
      t[i * r.cols + j] = full[(r.first_row + i) * kWidth + r.offset + j];
  return t;
}

// Builds the norm on `comms`' mesh, runs forward and backward once (and a second time counting
// allocations), returns what it computed. `world` gathers the full gradients (collective).
Result run_norm(NormKind kind, const NormCase& c, MeshCommunicators& comms, const Data& d,
                Mode mode, const MixedPrecision& precision, bool gather_over_world,
                bool input_grad = true) {
  const Mesh& mesh = comms.mesh();
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  context.set_precision(precision);
  const int rank = comms.rank();
  const PartitionSpec spec = PartitionSpec::parse(c.spec);
  const std::string prefix = "blocks/0/norm";
  const auto shapes = norm_parameter_shapes(kind, prefix, kWidth);
  std::vector<ShardedTensor> values, grads;
  for (const auto& s : shapes) {
    values.push_back(ShardedTensor::allocate(s.name, s.shape, spec, mesh, rank));
    grads.push_back(ShardedTensor::allocate(s.name, s.shape, spec, mesh, rank));
  }
  const int64_t rows = kBatch / context.batch_parallel();
  ParameterRef scale{&values[0], &grads[0]};
  ParameterRef bias =
      kind == NormKind::layernorm ? ParameterRef{&values[1], &grads[1]} : ParameterRef{};
  FeatureNorm layer(kind, prefix, scale, bias, c.layout, rows, context,
                    kind == NormKind::layernorm ? kLayerNormEps : kRmsNormEps);

  Result r;
  layer.initialize_parameters();
  auto full = [&](const ShardedTensor& t) {
    return gather_over_world ? gather_full(t, mesh, rank) : to_host(t);
  };
  r.scale_init = full(values[0]);
  if (kind == NormKind::layernorm) r.bias_init = full(values[1]);
  fill_block(values[0], d.scale);
  if (kind == NormKind::layernorm) fill_block(values[1], d.bias);

  r.first_row = context.batch_index() * rows;
  r.rows = rows;
  r.offset = layer.output_offset();
  r.cols = layer.output_width();
  r.direct = layer.direct_gradients();
  // Which gradients are left partial: the model's plan, as Mlp makes it.
  std::vector<Layer*> sequence = {&layer};
  const GradientReductionPlan reductions(sequence);
  r.defers = reductions.layer_group(0) != nullptr;
  r.describe = layer.describe();
  const Matrix x = device_block(d.x, r.first_row, rows, r.offset, r.cols, "x");
  const Matrix dy = device_block(d.dy, r.first_row, rows, r.offset, r.cols, "dy");
  GradientBuckets buckets;
  if (mode == Mode::buckets) {
    buckets = GradientBuckets(reductions.bucket_gradients(), 25.0, precision.reduce);
  }
  LayerScratch scratch(layer.scratch_needs());
  LayerPass pass;
  pass.scratch = &scratch;
  pass.deferred = reductions.for_layer(0, mode == Mode::now     ? DeferredReduction::now
                                          : mode == Mode::later ? DeferredReduction::later
                                          : buckets.empty()     ? DeferredReduction::now
                                                                : DeferredReduction::in_buckets);
  pass.buckets = &buckets;
  pass.index = 0;

  auto step = [&]() -> MatrixView {
    layer.forward(x, LayerPass{&scratch});
    MatrixView dx = layer.backward(dy, input_grad, pass);
    if (pass.deferred == DeferredReduction::in_buckets) buckets.wait_all();
    return dx;
  };
  MatrixView dx = step();
  if (mode == Mode::later && r.defers) r.partial_dscale = to_host(grads[0]);
  if (mode == Mode::later) reductions.all_reduce_deferred();
  r.y = host_matrix(layer.output());
  r.dx = input_grad ? host_matrix(dx) : Tensor();
  if (!input_grad) EXPECT_EQ(dx.extent(0) * dx.extent(1), 0u) << "dx without need_input_grad";
  r.dy_unchanged = host_matrix(dy) == block_of(d.dy, r);
  r.dscale = full(grads[0]);
  if (kind == NormKind::layernorm) r.dbias = full(grads[1]);

  testing::AllocationWindow window;
  step();
  if (mode == Mode::later) reductions.all_reduce_deferred();
  const long heap = window.close();
  r.allocations = heap + window.kokkos_allocations();
  return r;
}

// ---- tests -----------------------------------------------------------------------------------
// The counters really count (so the zero counts below can fail).
TEST(Norm, AllocationCounterSeesAllocations) {
  testing::AllocationWindow window;
  { Vector v("probe", 10); }
  const long kokkos = window.kokkos_allocations();
  const long heap_before = window.heap_allocations();
  { std::vector<double> heap(10); }
  const long heap = window.close() - heap_before;
  EXPECT_GE(kokkos, 1);
  EXPECT_GE(heap, 1);
}

TEST(Norm, ParameterShapesAndEps) {
  const auto ln = norm_parameter_shapes(NormKind::layernorm, "blocks/3/norm", 8);
  ASSERT_EQ(ln.size(), 2u);
  EXPECT_EQ(ln[0].name, "blocks/3/norm/scale");
  EXPECT_EQ(ln[1].name, "blocks/3/norm/bias");
  EXPECT_EQ(ln[1].shape, (std::vector<int64_t>{8}));
  const auto rms = norm_parameter_shapes(NormKind::rmsnorm, "n", 8);
  ASSERT_EQ(rms.size(), 1u);
  EXPECT_EQ(rms[0].name, "n/scale");
  EXPECT_EQ(kLayerNormEps, 1e-5f);
  EXPECT_EQ(kRmsNormEps, std::ldexp(1.0f, -23));  // torch.finfo(torch.float32).eps
}

// The layout decision and the collectives it lists per step (what a plan reports), on meshes
// built without MPI: fp32 and bf16 parameters (2-byte gathers; statistics stay 4 bytes).
TEST(NormLayout, DecisionAndCollectivesPerStep) {
  const LayerAxes axes{{"fsdp", "dp"}, "tp"};
  auto params = [](NormKind kind, const std::string& spec) {
    std::vector<LinearParameter> p = {{"n/scale", {32}, PartitionSpec::parse(spec)}};
    if (kind == NormKind::layernorm) p.push_back({"n/bias", {32}, PartitionSpec::parse(spec)});
    return p;
  };
  auto text = [](const std::vector<LayerCollective>& cs) {
    std::string t;
    for (const auto& c : cs) {
      t += c.phase + " " + to_string(c.kind) + " " + c.operand + " " + format_shape(c.shape) +
           " x" + std::to_string(c.element_bytes) + " over " + std::to_string(c.ranks) + "; ";
    }
    return t;
  };
  const Mesh dp2 = Mesh::create({{"dp", 2}}, 2);
  const NormLayout a =
      decide_norm_layout("n", NormKind::layernorm, params(NormKind::layernorm, "P()"), dp2, axes,
                         FeatureLayout::replicated);
  EXPECT_TRUE(a.direct);
  EXPECT_TRUE(a.defers_reduction());
  EXPECT_EQ(describe_norm_layout(a), "layernorm 32 features, grads all-reduced over (dp)");
  EXPECT_EQ(text(norm_step_collectives(a, dp2, 8, true, 4)),
            "backward all-reduce scale gradient [32] x4 over 2; "
            "backward all-reduce bias gradient [32] x4 over 2; ");

  const Mesh tp2 = Mesh::create({{"tp", 2}}, 2);
  const NormLayout b = decide_norm_layout(
      "n", NormKind::rmsnorm, params(NormKind::rmsnorm, "P(tp)"), tp2, axes, FeatureLayout::split);
  EXPECT_TRUE(b.direct);
  EXPECT_FALSE(b.defers_reduction());  // no batch axis: nothing to reduce
  EXPECT_EQ(b.local_width, 16);
  EXPECT_EQ(text(norm_step_collectives(b, tp2, 8, true, 4)),
            "forward all-reduce row sums [8] x4 over 2; "
            "backward all-reduce gradient row sums [8] x4 over 2; ");

  const Mesh fsdp_tp = Mesh::create({{"fsdp", 2}, {"tp", 2}}, 4);
  const NormLayout c =
      decide_norm_layout("n", NormKind::layernorm, params(NormKind::layernorm, "P(fsdp)"), fsdp_tp,
                         axes, FeatureLayout::split);
  EXPECT_FALSE(c.direct);
  EXPECT_EQ(describe_norm_layout(c),
            "layernorm 32 features (split 16 over tp), statistics all-reduced over (tp), "
            "parameters gathered over (fsdp), full-width grads all-reduced over (fsdp, tp)");
  EXPECT_EQ(text(norm_step_collectives(c, fsdp_tp, 8, true, 4, {Dtype::bf16, Dtype::fp32})),
            "forward all-gather scale [32] x2 over 2; forward all-gather bias [32] x2 over 2; "
            "forward all-reduce row sums [8] x4 over 2; "
            "forward all-reduce centered row sums [8, 2] x4 over 2; "
            "backward all-reduce scale and bias gradients [64] x4 over 4; "
            "backward all-gather scale [32] x2 over 2; "
            "backward all-reduce gradient row sums [8, 2] x4 over 2; ");
  // (tp, fsdp): sliced by tp, then gathered over fsdp to the 16 features of the rank.
  const NormLayout d =
      decide_norm_layout("n", NormKind::rmsnorm, params(NormKind::rmsnorm, "P((tp, fsdp))"),
                         fsdp_tp, axes, FeatureLayout::split);
  ASSERT_EQ(d.params.size(), 1u);
  EXPECT_TRUE(d.params[0].gather_sliced);
  EXPECT_EQ(d.params[0].gather, (std::vector<std::string>{"fsdp"}));
  EXPECT_EQ(d.params[0].stored, 8);
  EXPECT_EQ(d.params[0].gathered, 16);
  // Rows unknown (0): only the parameter collectives; no input gradient: no second gather.
  EXPECT_EQ(text(norm_step_collectives(d, fsdp_tp, 0, false, 4)),
            "forward all-gather scale [16] x4 over 2; "
            "backward all-reduce scale gradient [32] x4 over 4; ");
  testing::expect_bad_input(
      [&] {
        decide_norm_layout("n", NormKind::layernorm, params(NormKind::rmsnorm, "P()"), dp2, axes,
                           FeatureLayout::replicated);
      },
      {"norm 'n'", "2 parameters"});
}

TEST(Norm, BadShapesAreBadInput) {
  const Mesh mesh = Mesh::create({{"tp", world_size()}}, world_size());
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  ShardedTensor matrix = ShardedTensor::allocate("n/scale", {4, 4}, PartitionSpec(), mesh, 0);
  ShardedTensor s = ShardedTensor::allocate("n/scale", {6}, PartitionSpec(), mesh, 0);
  ShardedTensor b = ShardedTensor::allocate("n/bias", {5}, PartitionSpec(), mesh, 0);
  testing::expect_bad_input(
      [&] {
        RMSNorm("n", {&matrix, &matrix}, FeatureLayout::replicated, 2, context);
      },
      {"norm 'n'", "n/scale", "vector"});
  testing::expect_bad_input(
      [&] {
        LayerNorm("n", {&s, &s}, {&b, &b}, FeatureLayout::replicated, 2, context);
      },
      {"norm 'n'", "n/bias", "width 6"});
  if (world_size() == 4) {  // 6 features do not split over tp = 4
    testing::expect_bad_input(
        [&] {
          RMSNorm("n", {&s, &s}, FeatureLayout::split, 2, context);
        },
        {"norm 'n'", "6 features", "'tp' of size 4"});
  }
}

// fp32: every mesh, both norms, both data sets, every reduction mode.
TEST(Norm, EveryMeshEqualsFloat64ReferenceAndOneRank) {
  MeshCommunicators single(Mesh::single(), MPI_COMM_SELF);
  for (const NormCase& c : cases_for(world_size())) {
    const Mesh mesh = Mesh::create(c.mesh, world_size());
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    for (NormKind kind : {NormKind::layernorm, NormKind::rmsnorm}) {
      for (bool offset : {false, true}) {
        const Data d = make_data(offset);
        const Reference ref = reference(kind, d);
        const NormCase whole{"one rank", {}, FeatureLayout::replicated, "P()", true};
        const Result one = run_norm(kind, whole, single, d, Mode::now, {}, false);
        for (Mode mode : {Mode::now, Mode::later, Mode::buckets}) {
          SCOPED_TRACE(c.name + " " + to_string(kind) + (offset ? " offset rows" : " N(0,1)") +
                       " reduce " + mode_name(mode));
          const Result r = run_norm(kind, c, comms, d, mode, {}, true);
          EXPECT_EQ(r.direct, c.direct) << r.describe;
          // The statistics are all-reduced over tp exactly when the features are split.
          const bool split = r.cols < kWidth;
          EXPECT_EQ(r.describe.find("statistics all-reduced over (tp)") != std::string::npos, split)
              << r.describe;
          EXPECT_EQ(r.allocations, 0) << "allocations in forward/backward";
          EXPECT_TRUE(r.dy_unchanged);
          // scale 1, bias 0 after initialize_parameters().
          EXPECT_EQ(r.scale_init, Tensor(kWidth, 1.0));
          if (kind == NormKind::layernorm) EXPECT_EQ(r.bias_init, Tensor(kWidth, 0.0));
          expect_close(r.y, block_of(ref.y, r), 1e-5, "output vs float64");
          expect_close(r.dx, block_of(ref.dx, r), 1e-5, "input gradient vs float64");
          expect_close(r.dscale, ref.dscale, 1e-5, "scale gradient vs float64");
          expect_close(r.y, block_of(one.y, r), 2e-6, "output vs one rank");
          expect_close(r.dx, block_of(one.dx, r), 2e-6, "input gradient vs one rank");
          expect_close(r.dscale, one.dscale, 2e-6, "scale gradient vs one rank");
          if (kind == NormKind::layernorm) {
            expect_close(r.dbias, ref.dbias, 1e-5, "bias gradient vs float64");
            expect_close(r.dbias, one.dbias, 2e-6, "bias gradient vs one rank");
          }
          // Deferred: before all_reduce_deferred() the gradient is this rank's rows only.
          if (mode == Mode::later && r.defers) {
            Tensor partial(r.partial_dscale.size(), 0.0);
            for (int64_t i = 0; i < r.rows; ++i)
              for (size_t j = 0; j < partial.size(); ++j)
                partial[j] += ref.dscale_rows[(r.first_row + i) * kWidth + r.offset + j];
            expect_close(r.partial_dscale, partial, 1e-5, "deferred partial scale gradient");
          }
        }
        {  // The first layer of a model: no input gradient, the same parameter gradients.
          SCOPED_TRACE(c.name + " " + to_string(kind) + " without input gradient");
          const Result r = run_norm(kind, c, comms, d, Mode::now, {}, true, false);
          EXPECT_EQ(r.allocations, 0) << "allocations in forward/backward";
          expect_close(r.dscale, ref.dscale, 1e-5, "scale gradient vs float64");
          if (kind == NormKind::layernorm) {
            expect_close(r.dbias, ref.dbias, 1e-5, "bias gradient vs float64");
          }
        }
      }
    }
  }
}

// The reference's backward is the derivative of its forward: central differences in double of
// L = sum(dy * y) with respect to x, scale and bias (step 1e-5, tolerance 1e-6 * max |grad|).
TEST(Norm, ReferenceBackwardMatchesFiniteDifferences) {
  for (NormKind kind : {NormKind::layernorm, NormKind::rmsnorm}) {
    SCOPED_TRACE(to_string(kind));
    const Data d = make_data(false);
    const Reference r = reference(kind, d);
    auto loss = [&](const Data& e) {
      const Reference f = reference(kind, e);
      double l = 0.0;
      for (size_t k = 0; k < f.y.size(); ++k) l += e.dy[k] * f.y[k];
      return l;
    };
    const double h = 1e-5;
    auto numeric = [&](Tensor Data::*field, size_t k) {
      Data plus = d, minus = d;
      (plus.*field)[k] += h;
      (minus.*field)[k] -= h;
      return (loss(plus) - loss(minus)) / (2 * h);
    };
    Tensor dx(d.x.size()), dscale(kWidth), dbias(kWidth);
    for (size_t k = 0; k < d.x.size(); k += 7) dx[k] = numeric(&Data::x, k);
    for (int64_t j = 0; j < kWidth; ++j) {
      dscale[j] = numeric(&Data::scale, j);
      dbias[j] = numeric(&Data::bias, j);
    }
    for (size_t k = 0; k < d.x.size(); k += 7) {
      EXPECT_NEAR(r.dx[k], dx[k], 1e-6 * max_abs(r.dx)) << "dx " << k;
    }
    expect_close(dscale, r.dscale, 1e-6, "scale gradient");
    if (kind == NormKind::layernorm) expect_close(dbias, r.dbias, 1e-6, "bias gradient");
  }
}

// FSDP overlap: the norm starts the gather the model names in pass.prefetch (the next layer in
// forward, the previous one in backward) and lets it progress, as a Linear does.
class PrefetchSpy : public Layer {
 public:
  int started = 0, polled = 0;
  MatrixView forward(MatrixView x, const LayerPass&) override { return x; }
  MatrixView backward(MatrixView dy, bool, const LayerPass&) override { return dy; }
  bool can_prefetch_weight() const override { return true; }
  void start_weight_prefetch(LayerScratch&) override { ++started; }
  void poll_weight_prefetch() override { ++polled; }
  MatrixView output() const override { return MatrixView(); }
  FeatureLayout output_layout() const override { return FeatureLayout::replicated; }
  int64_t output_width() const override { return 0; }
  int64_t output_offset() const override { return 0; }
  std::string describe() const override { return ""; }
};

TEST(Norm, StartsTheNamedPrefetch) {
  const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const PartitionSpec spec = PartitionSpec::parse("P(fsdp)");
  std::vector<ShardedTensor> v, g;
  for (const auto& s : norm_parameter_shapes(NormKind::layernorm, "n", kWidth)) {
    v.push_back(ShardedTensor::allocate(s.name, s.shape, spec, mesh, context.rank()));
    g.push_back(ShardedTensor::allocate(s.name, s.shape, spec, mesh, context.rank()));
  }
  const int64_t rows = kBatch / context.batch_parallel();
  LayerNorm norm("n", {&v[0], &g[0]}, {&v[1], &g[1]}, FeatureLayout::replicated, rows, context);
  norm.initialize_parameters();
  LayerScratch scratch;
  Matrix x("x", rows, kWidth), dy("dy", rows, kWidth);
  Kokkos::deep_copy(dy, 1.0f);
  PrefetchSpy next, previous;
  LayerPass forward_pass;
  forward_pass.scratch = &scratch;
  forward_pass.prefetch = &next;
  norm.forward(x, forward_pass);
  EXPECT_EQ(next.started, 1);
  EXPECT_GE(next.polled, 1);
  LayerPass backward_pass = forward_pass;
  backward_pass.prefetch = &previous;
  norm.backward(dy, true, backward_pass);
  EXPECT_EQ(previous.started, 1);
  EXPECT_GE(previous.polled, 1);
  EXPECT_EQ(next.started, 1);
}

// The statistics really are stable: on offset rows the naive one-pass fp32 variance
// (E[x^2] - E[x]^2) is off by far more than the tolerance the layer meets above.
TEST(Norm, OffsetRowsDefeatTheOnePassVariance) {
  const Data d = make_data(true);
  double worst = 0.0;
  for (int64_t i = 0; i < kBatch; ++i) {
    float s = 0.0f, ss = 0.0f;
    double mean = 0.0, var = 0.0;
    for (int64_t j = 0; j < kWidth; ++j) {
      const float x = static_cast<float>(d.x[i * kWidth + j]);
      s += x;
      ss += x * x;
      mean += d.x[i * kWidth + j];
    }
    mean /= kWidth;
    for (int64_t j = 0; j < kWidth; ++j) {
      var += (d.x[i * kWidth + j] - mean) * (d.x[i * kWidth + j] - mean);
    }
    var /= kWidth;
    const float m = s / kWidth;
    const double naive = static_cast<double>(ss / kWidth - m * m);
    worst = std::max(worst, std::abs(naive - var) / var);
  }
  EXPECT_GT(worst, 1e-2) << "the offset rows do not test the variance's stability";
}

// Mixed precision: both norms on every mesh within the documented rounding bounds.
TEST(Norm, MixedPrecisionWithinRoundingBounds) {
  struct Policy {
    MixedPrecision p;
    const char* name;
  };
  const std::vector<Policy> policies = {{{Dtype::bf16, Dtype::fp32}, "bf16/fp32"},
                                        {{Dtype::fp16, Dtype::fp32}, "fp16/fp32"},
                                        {{Dtype::bf16, Dtype::bf16}, "bf16/bf16"}};
  for (const NormCase& c : cases_for(world_size())) {
    const Mesh mesh = Mesh::create(c.mesh, world_size());
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    for (const Policy& policy : policies) {
      const Dtype p = policy.p.param;
      const double u_p = p == Dtype::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
      // Half the spacing of P's subnormals: the rounding error below P's normal range.
      const double sub = p == Dtype::bf16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
      const bool r16 = policy.p.reduce != Dtype::fp32;
      const double u = std::max(u_p, r16 ? std::ldexp(1.0, -8) : 0.0);
      for (NormKind kind : {NormKind::layernorm, NormKind::rmsnorm}) {
        for (bool offset : {false, true}) {
          SCOPED_TRACE(c.name + " " + to_string(kind) + " " + policy.name +
                       (offset ? " offset rows" : " N(0,1)"));
          const Data d = make_data(offset, p);
          const Reference ref = reference(kind, d, p);
          const Result r = run_norm(kind, c, comms, d, Mode::buckets, policy.p, true);
          EXPECT_EQ(r.allocations, 0) << "allocations in forward/backward";
          // Output and input gradient: P values, one rounding from the reference.
          for (const Tensor* t : {&r.y, &r.dx}) {
            for (double v : *t) ASSERT_EQ(v, rounded(v, p)) << "not a " << to_string(p) << " value";
          }
          const Tensor y_ref = block_of(ref.y, r), dx_ref = block_of(ref.dx, r);
          Tensor a(y_ref.size());
          for (size_t k = 0; k < a.size(); ++k) a[k] = u_p * std::abs(y_ref[k]) + sub;
          expect_within(r.y, y_ref, a, 1e-5, "output");
          for (size_t k = 0; k < a.size(); ++k) a[k] = u_p * std::abs(dx_ref[k]) + sub;
          expect_within(r.dx, dx_ref, a, 1e-5, "input gradient");
          // Parameter gradients: rounded per rank, summed over the ranks of their reduction.
          int k_ranks = 1;
          for (const auto& axis : c.mesh) k_ranks *= axis.second;
          const double factor = (1.0 + (r16 ? 3.0 * k_ranks : 0.0)) * u;
          Tensor g(kWidth);
          for (int64_t j = 0; j < kWidth; ++j)
            g[j] = factor * ref.abs_dscale[j] + (k_ranks + 1) * sub;
          expect_within(r.dscale, ref.dscale, g, 1e-5, "scale gradient");
          if (kind == NormKind::layernorm) {
            for (int64_t j = 0; j < kWidth; ++j)
              g[j] = factor * ref.abs_dbias[j] + (k_ranks + 1) * sub;
            expect_within(r.dbias, ref.dbias, g, 1e-5, "bias gradient");
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
