// The derivative forward's kept values (Mlp::reserve_derivative_forward, docs/derivatives.md):
// activations keep f'(z), norms x_hat, in forward_for_derivatives, and forward_tangents and
// backward_cotangents read them instead of computing them again. Two models with the same
// parameters on a dp mesh of every rank (each rank its own rows; the reference, a model that
// never reserved, runs on the same rank in the same test): residual_mlp 4-8-...-2 (hidden 16,
// 2 blocks) with LayerNorm + silu, RMSNorm + gelu, and no norm + tanh; an mlp 4-16-16-2 (gelu).
//
//   * PlainForwardClearsTheKeptValues: forward_for_derivatives(x1), then forward(x2), then the
//     tangent and cotangent passes of x2: bit for bit those of the model that never reserved
//     (a stale slope or x_hat of x1 would change them).
//   * KeptEqualsRecomputed: forward_for_derivatives(x), its tangents and cotangents, with and
//     without reserve (and reserved for tangents only, Predictor's forward mode: the values and
//     tangents of the model reserved for both, bit for bit): bit for bit for the activation-only
//     models (the slopes are the same formulas without FMA contraction); for the norms within 2e-6
//     of the tensor's largest |value|: the keeping forward sums a row in 16 lanes
//     (inference::layernorm) where the plain one reduces in Kokkos' order, so the statistics differ
//     by a few float32 ulps (2^-24 ~ 6e-8 relative each), carried through two blocks and a linear
//     output. Measured here at np 1, 2 and 4: at most 1.8e-7 (3 ulps); 2e-6 leaves 10x room and is
//     far below what a wrong slope or x_hat gives (order 1e-1).

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/init.hpp"
#include "layers/context.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kRowsPerRank = 8;
constexpr int64_t kInputs = 4, kOutputs = 2, kK = 2;
constexpr uint64_t kSeed = 11;
constexpr double kNormTolerance = 2e-6;  // of the tensor's largest |value| (the header)

struct ModelCase {
  bool residual = true;
  bool norm = true;
  NormKind norm_kind = NormKind::layernorm;
  Activation activation = Activation::silu;
  std::string describe() const {
    if (!residual) return std::string("mlp + ") + to_string(activation);
    return std::string(norm ? to_string(norm_kind) : "no norm") + " + " + to_string(activation);
  }
  bool has_norm() const { return residual && norm; }
  ResidualMlpShape shape() const {
    ResidualMlpShape s;
    s.inputs = kInputs;
    s.outputs = kOutputs;
    s.width = 8;
    s.hidden = 16;
    s.depth = 2;
    s.norm = norm;
    s.norm_kind = norm_kind;
    return s;
  }
  std::vector<int64_t> sizes() const { return {kInputs, 16, 16, kOutputs}; }
};
const std::vector<ModelCase> kCases = {
    {true, true, NormKind::layernorm, Activation::silu},
    {true, true, NormKind::rmsnorm, Activation::gelu},
    {true, false, NormKind::rmsnorm, Activation::tanh},
    {false, false, NormKind::rmsnorm, Activation::gelu},
};

struct MeshSetup {
  Mesh mesh;
  MeshCommunicators comms;
  ParallelContext context;
  ShardingPlan plan;
  explicit MeshSetup(const ModelCase& m)
      : mesh(Mesh::create({{"dp", world_size()}, {"fsdp", 1}, {"tp", 1}}, world_size())),
        comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory()),
        context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                25.0) {
    PlanOptions options;
    options.min_sharding_size = 0;
    options.batch_axes = {"fsdp", "dp"};
    options.feature_axis = "tp";
    options.global_batch = kRowsPerRank * world_size();
    const auto shapes =
        m.residual ? residual_mlp_parameter_shapes(m.shape()) : mlp_parameter_shapes(m.sizes());
    plan = make_plan(shapes, mesh, preset_rules("dp", false, m.has_norm(), m.residual), options);
  }
};

// A model of the case, its parameters the same on every call (norms' scales and biases away
// from 1 and 0), room for k tangent and k cotangent directions; the derivative forward's kept
// values reserved or not.
enum class Reserve { none, tangents_only, cotangents };
std::unique_ptr<Mlp> make_model(MeshSetup& s, const ModelCase& m, Reserve reserve) {
  std::unique_ptr<Mlp> model =
      m.residual ? std::make_unique<Mlp>(m.shape(), m.activation, specs_from_plan(s.plan),
                                         s.context, kRowsPerRank)
                 : std::make_unique<Mlp>(m.sizes(), m.activation, specs_from_plan(s.plan),
                                         s.context, kRowsPerRank);
  model->initialize(InitScheme::he_normal, kSeed);
  for (ShardedTensor& p : model->parameters()) {
    if (p.name.find("norm/") == std::string::npos) continue;
    const bool scale = p.name.find("/scale") != std::string::npos;
    const uint64_t stream = name_stream(p.name);
    testing::fill_global(p, [&](int64_t i) {
      const double z = counter_normal(kSeed, stream, static_cast<uint64_t>(i));
      return scale ? 1.0 + 0.3 * z : 0.2 * z;
    });
  }
  model->reserve_tangents(kK);
  model->reserve_cotangents(kK);
  if (reserve != Reserve::none) {
    model->reserve_derivative_forward(/*for_cotangents=*/reserve == Reserve::cotangents);
  }
  return model;
}

// [rows, width] of normals, this rank's own (stream `what`).
Matrix normals(const std::string& what, int64_t rows, int64_t width) {
  Matrix m(what, rows, width);
  auto h = Kokkos::create_mirror_view(m);
  const uint64_t stream = name_stream(what + std::to_string(world_rank()));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < width; ++j)
      h(i, j) = counter_normal(kSeed, stream, static_cast<uint64_t>(i * width + j));
  Kokkos::deep_copy(m, h);
  return m;
}

std::vector<float> host(MatrixView v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<float> out;
  for (size_t i = 0; i < h.extent(0); ++i)
    for (size_t j = 0; j < h.extent(1); ++j) out.push_back(h(i, j));
  return out;
}

// The value, tangent and cotangent results of one forward.
struct Passes {
  std::vector<float> y, tangents, cotangents;
};
struct Inputs {
  Matrix x1 = normals("x1", kRowsPerRank, kInputs);
  Matrix x2 = normals("x2", kRowsPerRank, kInputs);
  Matrix dx = normals("dx", kRowsPerRank* kK, kInputs);
  Matrix dy = normals("dy", kRowsPerRank* kK, kOutputs);
};
Passes derivatives_after(Mlp& model, MatrixView y, const Inputs& in) {
  Passes p;
  p.y = host(y);
  p.tangents = host(model.forward_tangents(in.dx));
  p.cotangents = host(model.backward_cotangents(in.dy));
  return p;
}

void expect_bits(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i] ? 1 : 0;
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << got.size() << " differ";
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double largest = 0.0, worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    largest = std::max(largest, std::fabs(static_cast<double>(want[i])));
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_LE(worst, kNormTolerance * largest) << what << ": largest |value| " << largest;
}

TEST(DerivativeForward, PlainForwardClearsTheKeptValues) {
  const Inputs in;
  for (const ModelCase& m : kCases) {
    SCOPED_TRACE(m.describe());
    MeshSetup s(m);
    auto kept = make_model(s, m, Reserve::cotangents);
    auto plain = make_model(s, m, Reserve::none);
    kept->forward_for_derivatives(in.x1);
    const Passes got = derivatives_after(*kept, kept->forward(in.x2), in);
    const Passes want = derivatives_after(*plain, plain->forward(in.x2), in);
    expect_bits(got.y, want.y, "y");
    expect_bits(got.tangents, want.tangents, "tangents");
    expect_bits(got.cotangents, want.cotangents, "cotangents");
  }
}

TEST(DerivativeForward, KeptEqualsRecomputed) {
  const Inputs in;
  for (const ModelCase& m : kCases) {
    SCOPED_TRACE(m.describe());
    MeshSetup s(m);
    auto kept = make_model(s, m, Reserve::cotangents);
    auto plain = make_model(s, m, Reserve::none);
    auto tangents_only = make_model(s, m, Reserve::tangents_only);
    const Passes got = derivatives_after(*kept, kept->forward_for_derivatives(in.x1), in);
    const Passes want = derivatives_after(*plain, plain->forward_for_derivatives(in.x1), in);
    // Reserved for tangents only (forward mode: no x_hat kept), the same one-pass forward and
    // statistics: the values and tangents of the model reserved for both, bit for bit.
    const MatrixView y_tangents_only = tangents_only->forward_for_derivatives(in.x1);
    expect_bits(host(y_tangents_only), got.y, "y (tangents only)");
    expect_bits(host(tangents_only->forward_tangents(in.dx)), got.tangents,
                "tangents (tangents only)");
    if (m.has_norm()) {
      expect_near(got.y, want.y, "y");
      expect_near(got.tangents, want.tangents, "tangents");
      expect_near(got.cotangents, want.cotangents, "cotangents");
    } else {
      expect_bits(got.y, want.y, "y");
      expect_bits(got.tangents, want.tangents, "tangents");
      expect_bits(got.cotangents, want.cotangents, "cotangents");
    }
  }
}

}  // namespace
}  // namespace meshtrain
