// The residual_mlp model (layers/mlp.hpp's second constructor, docs/models.md): inputs 12,
// width 16, hidden 32, depth 2, outputs 5, with rmsnorm / layernorm / no norm, and silu /
// swiglu, built by Mlp from the plan of a preset on every mesh of np 1, 2 and 4 (dp, fsdp, tp;
// at 4 also fsdp x tp and dp x tp; at 8 a 2x4 fsdp x tp), overlap off and on, under tp every
// collective-matmul algorithm (naive, ring, bidirectional; the presets make the blocks' up and
// gate projections column-parallel and down row-parallel, checked from the layers' lines), against
// a float64 reference written here from docs/models.md's formulas: the output and every parameter
// gradient, for a backward that reduces in backward and one that leaves the deferrable gradients
// partial and completes them with reduce_gradients(). All meshes are compared with the same
// reference, so every mesh equals one rank. The loss is sum(R * out) over the global batch (8 rows)
// for a fixed R, so dOut = R. Outputs 5 does not divide by tp = 2 (the output projection's
// all-reduce path). Tolerance: |got - ref| <= 2e-5 (1 + |ref|) (float32, depth 2, sums of at most
// 32 terms of O(1); measured differences are below 3e-6). Also: initialize() gives norm scales 1
// and biases 0, a step allocates nothing, and the reference's backward is the derivative of its
// forward (ReferenceGradientsMatchCentralDifferences).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "layers/context.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/expect_close.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/layer_test_data.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/model_pass.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/reference_norm.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;

constexpr int64_t kRows = 8;
constexpr double kTolerance = 2e-5;

ResidualMlpShape shape_of(const std::string& norm, bool gated) {
  ResidualMlpShape s;
  s.inputs = 12;
  s.outputs = 5;
  s.width = 16;
  s.hidden = 32;
  s.depth = 2;
  s.norm = norm != "none";
  s.norm_kind = norm == "layernorm" ? NormKind::layernorm : NormKind::rmsnorm;
  s.gated = gated;
  return s;
}

// Every value as float, so that the reference sees exactly what the model sees. Norm scales
// around 1.
double parameter_value(const ParameterShape& p, int k, int64_t i, int64_t j) {
  const double v = testing::parameter_wave(k, i, j);
  const bool scale = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, "scale") == 0;
  return static_cast<float>(scale ? 1.0 + v : v);
}
using testing::loss_weight;

void fill(ShardedTensor& t, const ParameterShape& p, int k) {
  const int64_t cols = p.shape.back();
  const bool matrix = p.shape.size() == 2;
  testing::fill_global(t, [&](int64_t flat) {
    return matrix ? parameter_value(p, k, flat / cols, flat % cols)
                  : parameter_value(p, k, 0, flat);
  });
}

// ---- The float64 reference, one row at a time (docs/models.md). ----
using testing::ReferenceParam;
using testing::Vec;

struct Reference {
  Tensor out;                  // [rows, outputs]
  std::vector<Tensor> grad;    // per parameter, in residual_mlp_parameter_shapes order
  std::vector<Tensor> values;  // the parameters it was computed with, in the same order

  // The loss whose gradient `grad` is: sum(R * out).
  double loss() const { return testing::weighted_loss(out, kRows); }
};

// The output and (with_backward) gradients in float64 for the parameters parameter_value
// gives, or for `values` (in residual_mlp_parameter_shapes order).
Reference reference(const ResidualMlpShape& s, const std::vector<Tensor>* values = nullptr,
                    bool with_backward = true) {
  const std::vector<ParameterShape> shapes = residual_mlp_parameter_shapes(s);
  std::vector<ReferenceParam> p(shapes.size());
  for (size_t k = 0; k < shapes.size(); ++k) {
    const bool matrix = shapes[k].shape.size() == 2;
    const int64_t rows = matrix ? shapes[k].shape[0] : 1;
    const int64_t cols = matrix ? shapes[k].shape[1] : shapes[k].shape[0];
    if (values) {
      p[k].value = (*values)[k];
    } else {
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          p[k].value.push_back(parameter_value(shapes[k], static_cast<int>(k), matrix ? i : 0, j));
    }
    p[k].grad.assign(p[k].value.size(), 0.0);
  }
  const bool ln = s.norm && s.norm_kind == NormKind::layernorm;
  Reference r;
  for (int64_t row = 0; row < kRows; ++row) {
    // Forward, keeping what backward needs.
    Vec x(s.inputs);
    for (int64_t c = 0; c < s.inputs; ++c) x[c] = testing::model_input(row, c);
    size_t k = 0;
    const size_t input = k;
    k += 2;
    Vec h = testing::affine(x, p[input], p[input + 1]);
    struct Block {
      size_t norm, gate, up, down;
      Vec h_in, u, g, z, a;
      testing::NormCache nc;
    };
    std::vector<Block> blocks(s.depth);
    for (auto& b : blocks) {
      b.h_in = h;
      b.norm = k;
      if (s.norm) k += ln ? 2 : 1;
      b.u = s.norm ? testing::norm_forward(h, p[b.norm], ln ? &p[b.norm + 1] : nullptr, b.nc) : h;
      if (s.gated) {
        b.gate = k;
        k += 2;
      }
      b.up = k;
      k += 2;
      b.down = k;
      k += 2;
      b.z = testing::affine(b.u, p[b.up], p[b.up + 1]);
      b.a.resize(b.z.size());
      if (s.gated) {
        b.g = testing::affine(b.u, p[b.gate], p[b.gate + 1]);
        for (size_t j = 0; j < b.z.size(); ++j) b.a[j] = testing::swiglu(b.g[j], b.z[j]);
      } else {
        for (size_t j = 0; j < b.z.size(); ++j) {
          b.a[j] = testing::activation(Activation::silu, b.z[j]);
        }
      }
      const Vec d = testing::affine(b.a, p[b.down], p[b.down + 1]);
      for (size_t j = 0; j < h.size(); ++j) h[j] += d[j];
    }
    const size_t out_norm = k;
    testing::NormCache onc;
    const Vec h_last = h;
    if (s.norm) {
      k += ln ? 2 : 1;
      h = testing::norm_forward(h_last, p[out_norm], ln ? &p[out_norm + 1] : nullptr, onc);
    }
    const size_t output = k;
    const Vec y = testing::affine(h, p[output], p[output + 1]);
    for (double v : y) r.out.push_back(v);
    if (!with_backward) continue;

    // Backward from dOut = R.
    Vec dy(s.outputs);
    for (int64_t c = 0; c < s.outputs; ++c) dy[c] = loss_weight(row, c);
    Vec dh = testing::affine_backward(h, p[output], p[output + 1], dy);
    if (s.norm) dh = testing::norm_backward(onc, p[out_norm], ln ? &p[out_norm + 1] : nullptr, dh);
    for (int64_t i = s.depth; i-- > 0;) {
      Block& b = blocks[i];
      const Vec da = testing::affine_backward(b.a, p[b.down], p[b.down + 1], dh);
      Vec du;
      if (s.gated) {
        Vec dg(da.size()), dz(da.size());
        for (size_t j = 0; j < da.size(); ++j) {
          dg[j] = testing::swiglu_gate_gradient(b.g[j], b.z[j], da[j]);
          dz[j] = testing::swiglu_up_gradient(b.g[j], da[j]);
        }
        du = testing::affine_backward(b.u, p[b.up], p[b.up + 1], dz);
        const Vec du_gate = testing::affine_backward(b.u, p[b.gate], p[b.gate + 1], dg);
        for (size_t j = 0; j < du.size(); ++j) du[j] += du_gate[j];
      } else {
        Vec dz(da.size());
        for (size_t j = 0; j < da.size(); ++j) {
          dz[j] = da[j] * testing::activation_derivative(Activation::silu, b.z[j]);
        }
        du = testing::affine_backward(b.u, p[b.up], p[b.up + 1], dz);
      }
      if (s.norm) du = testing::norm_backward(b.nc, p[b.norm], ln ? &p[b.norm + 1] : nullptr, du);
      for (size_t j = 0; j < dh.size(); ++j) dh[j] += du[j];  // the residual's part
    }
    testing::affine_backward(x, p[input], p[input + 1], dh);
  }
  for (const ReferenceParam& q : p) {
    r.grad.push_back(q.grad);
    r.values.push_back(q.value);
  }
  return r;
}

void expect_close(const Tensor& got, const Tensor& ref, const std::string& what) {
  testing::expect_close_to_reference(got, ref, kTolerance, what);
}

using testing::MeshCase;

// dp, fsdp, tp; at np 4 also fsdp x tp and dp x tp; at np 8 a 2x4 fsdp x tp alone.
std::vector<MeshCase> mesh_cases() {
  const int n = world_size();
  std::vector<MeshCase> cases = testing::layer_meshes(n);
  if (n == 8) {  // a 2x4 fsdp x tp mesh: the column-parallel layers over 4 feature ranks
    cases = {{"fsdp_tp", {{"fsdp", 2}, {"tp", 4}}}};
  }
  return cases;
}

struct ModelCase {
  std::string norm;
  bool gated;
};

// The reference's hand-derived backward (SwiGLU's gate and up, silu, the residual adds,
// LayerNorm and RMSNorm) is the derivative of its forward: every parameter gradient of the
// four models against central differences in float64 of sum(R * out). Step h = 1e-5
// (parameters of O(0.3..1.3)): truncation h^2/6 |L'''| and rounding eps |L| / h (|L| ~ 10, a
// sum of ~40 terms) are each ~1e-9 (measured largest difference printed); tolerance 1e-7 (1 +
// |g|), a factor ~100 above that, five orders below a missing term of size O(|g|) (everything
// here is smooth: no ties). The reference does not depend on the ranks: checked once, at np 1.
TEST(ResidualMlp, ReferenceGradientsMatchCentralDifferences) {
  if (world_size() > 1) GTEST_SKIP() << "the float64 reference alone: checked at np 1";
  constexpr double kStep = 1e-5, kFdTolerance = 1e-7;
  for (const ModelCase& m : {ModelCase{"rmsnorm", false}, ModelCase{"layernorm", true},
                             ModelCase{"rmsnorm", true}, ModelCase{"none", false}}) {
    SCOPED_TRACE(m.norm + (m.gated ? " swiglu" : " silu"));
    const ResidualMlpShape shape = shape_of(m.norm, m.gated);
    const Reference ref = reference(shape);
    std::vector<std::string> names;
    for (const ParameterShape& p : residual_mlp_parameter_shapes(shape)) names.push_back(p.name);
    const testing::Tensors numeric = testing::central_differences(
        ref.values, [&](const testing::Tensors& v) { return reference(shape, &v, false).loss(); },
        kStep);
    const double worst =
        testing::expect_matches_central_differences(numeric, ref.grad, kFdTolerance, names);
    std::printf(
        "[ residual_mlp ] %s%s: reference gradients vs central differences: largest "
        "|fd - g| / (1 + |g|) %.2e (tolerance %.0e)\n",
        m.norm.c_str(), m.gated ? " swiglu" : " silu", worst, kFdTolerance);
  }
}

TEST(ResidualMlp, EqualsTheFloat64ReferenceOnEveryMesh) {
  const int n = world_size();
  for (const ModelCase& m : {ModelCase{"rmsnorm", false}, ModelCase{"layernorm", true},
                             ModelCase{"rmsnorm", true}, ModelCase{"none", false}}) {
    const ResidualMlpShape shape = shape_of(m.norm, m.gated);
    const Reference ref = reference(shape);
    const std::vector<ParameterShape> shapes = residual_mlp_parameter_shapes(shape);
    for (const MeshCase& c : mesh_cases()) {
      // Every collective-matmul algorithm where the mesh splits features (the column- and
      // row-parallel layers run them); the others run none.
      std::vector<CollectiveMatmulAlgorithm> algorithms = {
          CollectiveMatmulAlgorithm::bidirectional};
      if (c.preset.find("tp") != std::string::npos && n > 1) {
        algorithms = {CollectiveMatmulAlgorithm::naive, CollectiveMatmulAlgorithm::ring,
                      CollectiveMatmulAlgorithm::bidirectional};
      }
      for (const CollectiveMatmulAlgorithm algorithm : algorithms)
        for (bool overlap : {false, true}) {
          SCOPED_TRACE(m.norm + (m.gated ? " swiglu" : " silu") + ", " + c.preset + " at np " +
                       std::to_string(n) + (overlap ? ", overlap" : "") + ", " +
                       to_string(algorithm));
          const Mesh mesh = Mesh::create(c.axes, n);
          MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
          ParallelContext context(comms, {"fsdp", "dp"}, "tp", algorithm, overlap, 1e-4);
          const ShardingPlan plan =
              make_plan(shapes, mesh, preset_rules(c.preset, false, true, true), PlanOptions{0});
          const int64_t rows = kRows / context.batch_parallel();
          const int64_t row0 = context.batch_index() * rows;
          Mlp model(shape, Activation::silu, specs_from_plan(plan), context, rows);
          ASSERT_EQ(model.parameters().size(), shapes.size());
          // Under tp the blocks' up (and gate) projections are column-parallel, down row-parallel
          // (Megatron's pair; partition/rules.hpp), every other preset has no column split.
          const bool megatron = c.preset.find("tp") != std::string::npos && n > 1;
          int column_parallel_layers = 0;
          for (const std::string& line : model.describe()) {
            for (size_t at = line.find("column-parallel"); at != std::string::npos;
                 at = line.find("column-parallel", at + 1)) {
              ++column_parallel_layers;
            }
          }
          EXPECT_EQ(column_parallel_layers, megatron ? shape.depth * (m.gated ? 2 : 1) : 0);
          // SwiGLU's gate and up share one gather of the block's input.
          int shared = 0;
          for (const std::string& line : model.describe()) {
            for (size_t at = line.find("shares its SwiGLU's one gather"); at != std::string::npos;
                 at = line.find("shares its SwiGLU's one gather", at + 1)) {
              ++shared;
            }
          }
          EXPECT_EQ(shared, megatron && m.gated ? 2 * shape.depth : 0);

          // initialize(): norm scales 1, norm biases 0 on every mesh.
          model.initialize(InitScheme::normal, 7);
          for (size_t k = 0; k < shapes.size(); ++k) {
            const std::string& name = shapes[k].name;
            const bool scale = name.find("norm/scale") != std::string::npos;
            const bool norm_bias = name.find("norm/bias") != std::string::npos;
            if (!scale && !norm_bias) continue;
            for (double v : testing::to_host(model.parameters()[k])) {
              ASSERT_EQ(v, scale ? 1.0 : 0.0) << name;
            }
          }
          for (size_t k = 0; k < shapes.size(); ++k) {
            fill(model.parameters()[k], shapes[k], static_cast<int>(k));
          }

          const int64_t cols = model.output_width(), col0 = model.output_offset();
          const Matrix x =
              testing::block_matrix("x", rows, shape.inputs, row0, 0, testing::model_input);
          const Matrix dout = testing::block_matrix("dout", rows, cols, row0, col0, loss_weight);
          Tensor out_ref(rows * cols);
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t j = 0; j < cols; ++j) {
              out_ref[i * cols + j] = ref.out[(row0 + i) * shape.outputs + col0 + j];
            }
          }

          for (bool reduce : {true, false}) {
            SCOPED_TRACE(reduce ? "reduced in backward" : "reduce_gradients()");
            auto step = [&] { return testing::forward_backward(model, x, dout, reduce); };
            step();  // warm-up, then the counted one
            testing::KokkosAllocationCounter allocations;
            const MatrixView out = step();
            allocations.stop();
            // Also where buckets run beside prefetches on one communicator (fsdp x tp with
            // overlap: the norms' gradients bucketed over fsdp) and over MPI staged through host
            // memory: the buckets and the prefetch reserve their request slots (and staging)
            // when the model is built.
            EXPECT_EQ(allocations.count(), 0) << "the first:" << allocations.described();

            expect_close(testing::host_matrix(out), out_ref, "output");
            for (size_t k = 0; k < shapes.size(); ++k) {
              expect_close(testing::gather_full(model.gradients()[k], mesh, context.rank()),
                           ref.grad[k], shapes[k].name + " gradient");
            }
          }
        }
    }
  }
}

}  // namespace
}  // namespace meshtrain
