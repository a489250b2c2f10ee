// Small unit tests of the pieces under the MLP: activation derivatives (central finite
// differences in double, tolerance 2e-3 relative: float forward), silu, sigmoid and gelu_erf
// against float64 references (tolerances at the test) and their 16-bit rounding, option parsing,
// the optimizer's state layout, and that a training step allocates nothing (Kokkos allocation
// callbacks counted over steps 2 and 3, after the first step warmed up).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cfenv>
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/precision.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/activation.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/kokkos_allocations.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

TEST(Activation, BackwardMatchesFiniteDifferences) {
  const int n = 41;
  Matrix z("z", 1, n), out("out", 1, n), g("g", 1, n);
  auto zh = Kokkos::create_mirror_view(z);
  for (int j = 0; j < n; ++j) zh(0, j) = -3.0f + 0.15f * j + 0.01f;  // avoids 0 for relu
  Kokkos::deep_copy(z, zh);
  for (Activation a : {Activation::relu, Activation::tanh, Activation::gelu, Activation::gelu_erf,
                       Activation::silu, Activation::sigmoid, Activation::none}) {
    SCOPED_TRACE(to_string(a));
    Kokkos::deep_copy(g, 1.0f);
    activation_backward(a, z, g);
    auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g);
    const double h = 1e-2;
    Matrix zp("zp", 1, n), zm("zm", 1, n), fp("fp", 1, n), fm("fm", 1, n);
    auto zph = Kokkos::create_mirror_view(zp);
    auto zmh = Kokkos::create_mirror_view(zm);
    for (int j = 0; j < n; ++j) {
      zph(0, j) = zh(0, j) + static_cast<float>(h);
      zmh(0, j) = zh(0, j) - static_cast<float>(h);
    }
    Kokkos::deep_copy(zp, zph);
    Kokkos::deep_copy(zm, zmh);
    activation_forward(a, zp, fp);
    activation_forward(a, zm, fm);
    auto fph = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), fp);
    auto fmh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), fm);
    for (int j = 0; j < n; ++j) {
      const double numeric = (double(fph(0, j)) - double(fmh(0, j))) / (2 * h);
      EXPECT_NEAR(gh(0, j), numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 1e-3)
          << "at z = " << zh(0, j);
    }
  }
  // gelu is the tanh approximation: gelu(1) = 0.841192.
  Matrix one("one", 1, 1), r("r", 1, 1);
  Kokkos::deep_copy(one, 1.0f);
  activation_forward(Activation::gelu, one, r);
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r);
  EXPECT_NEAR(rh(0, 0), 0.841192, 1e-5);
}

// ---- silu, sigmoid, gelu_erf against float64 references ----------------------------------
// The float64 functions and derivatives. 1 - sigmoid(x) is sigmoid(-x) (a difference would
// lose the digits of the reference for x >> 0); exp(|x|) for |x| <= 100 is finite in double.
using testing::normal_cdf;
using testing::normal_pdf;
using testing::sigmoid;

// f(x), f'(x), and the scale of each: the sum of the magnitudes of the terms f' adds (f'
// itself where it is a product), so that the tolerance is relative to the values the float
// computation rounds, also where f' = 0 by cancellation (silu at x = -1.278..., gelu_erf at
// x = -0.751...).
struct Reference64 {
  double value, derivative, derivative_scale;
};
Reference64 reference64(Activation a, double x) {
  switch (a) {
    case Activation::sigmoid: {
      const double s = sigmoid(x), t = sigmoid(-x);
      return {s, s * t, s * t};
    }
    case Activation::silu: {
      const double s = sigmoid(x), t = sigmoid(-x);
      return {x * s, s + x * s * t, s + std::abs(x * s * t)};
    }
    case Activation::gelu_erf: {
      const double cdf = normal_cdf(x), pdf = normal_pdf(x);
      return {x * cdf, cdf + x * pdf, cdf + std::abs(x * pdf)};
    }
    default:
      ADD_FAILURE() << "no float64 reference for " << to_string(a);
      return {0, 0, 0};
  }
}

// The float32 kernels against the float64 references at 0, at |x| = 30 and 100 (where
// exp(x) overflows a float), and on a dense grid over [-12, 12], with incoming gradients
// other than 1. Tolerance, per element: |got - ref| <= 1e-6 * scale * c(x) + 2^-126 * |g|
// (the second term: results below float32's normal range, where float32 keeps fewer digits).
// scale is |f(x)| for the forward and |g| * derivative_scale for the backward. c(x) = 1 for
// silu and sigmoid: they take exp of -|x| only, which is exact in its argument. For gelu_erf
// c(x) = 1 + x^2 / 4: Phi(x) and exp(-x^2 / 2) have relative condition number about x^2 in
// x, so rounding x / sqrt(2) or x^2 to float32 (relative 2^-24) moves them by up to
// x^2 * 2^-24 (observed: see the printed worst ratio, below 1 when within tolerance).
// No NaN, no infinity, and on a host build no overflow, invalid or divide-by-zero
// floating-point exception raised by the kernels.
TEST(Activation, SiluSigmoidGeluErfMatchFloat64References) {
  std::vector<float> xs = {-100.0f, -30.0f, -1e-3f, 0.0f, 1e-3f, 30.0f, 100.0f, -0.0f};
  for (int k = -240; k <= 240; ++k) xs.push_back(0.05f * k);
  const int n = static_cast<int>(xs.size());
  Matrix z("z", 1, n), out("out", 1, n), g("g", 1, n);
  auto zh = Kokkos::create_mirror_view(z);
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> g0("g0", 1, n);  // not g's alias
  for (int j = 0; j < n; ++j) {
    zh(0, j) = xs[j];
    g0(0, j) = j % 3 == 0 ? 1.0f : j % 3 == 1 ? -0.75f : 2.5f;
  }
  Kokkos::deep_copy(z, zh);
  for (Activation a : {Activation::silu, Activation::sigmoid, Activation::gelu_erf}) {
    SCOPED_TRACE(to_string(a));
    Kokkos::deep_copy(g, g0);
#ifdef KOKKOS_ENABLE_SERIAL
    constexpr bool kernels_on_this_thread =
        std::is_same<Kokkos::DefaultExecutionSpace, Kokkos::Serial>::value;
#else
    constexpr bool kernels_on_this_thread = false;
#endif
    std::feclearexcept(FE_ALL_EXCEPT);
    activation_forward(a, z, out);
    activation_backward(a, z, g);
    Kokkos::fence();
    const int raised = std::fetestexcept(FE_OVERFLOW | FE_INVALID | FE_DIVBYZERO);
    if (kernels_on_this_thread) {
      EXPECT_EQ(raised & FE_OVERFLOW, 0) << "overflow";
      EXPECT_EQ(raised & FE_INVALID, 0) << "invalid operation";
      EXPECT_EQ(raised & FE_DIVBYZERO, 0) << "division by zero";
    }
    auto fh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
    auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g);
    double worst = 0;  // max over elements of |got - ref| / tolerance
    for (int j = 0; j < n; ++j) {
      const double x = xs[j], gin = g0(0, j);
      const Reference64 r = reference64(a, x);
      const double c = a == Activation::gelu_erf ? 1 + x * x / 4 : 1;
      const double floor = std::ldexp(1.0, -126);
      ASSERT_TRUE(std::isfinite(fh(0, j)) && std::isfinite(gh(0, j))) << "at x = " << x;
      const double value_tol = 1e-6 * std::abs(r.value) * c + floor;
      const double grad_tol = 1e-6 * std::abs(gin) * r.derivative_scale * c + floor * std::abs(gin);
      EXPECT_LE(std::abs(fh(0, j) - r.value), value_tol)
          << "f(" << x << ") = " << fh(0, j) << ", reference " << r.value;
      EXPECT_LE(std::abs(gh(0, j) - gin * r.derivative), grad_tol)
          << "g f'(" << x << ") = " << gh(0, j) << ", reference " << gin * r.derivative;
      worst = std::max({worst, std::abs(fh(0, j) - r.value) / value_tol,
                        std::abs(gh(0, j) - gin * r.derivative) / grad_tol});
    }
    std::printf("%s: worst |got - ref| / tolerance %.3g\n", to_string(a), worst);
  }
  // Known values: sigmoid(0) = 0.5 with slope 0.25, silu(0) = 0 with slope 0.5,
  // gelu_erf(1) = Phi(1) = 0.841344746..., while gelu (the tanh form) stays 0.841192.
  Matrix one("one", 1, 1), r("r", 1, 1);
  Kokkos::deep_copy(one, 1.0f);
  activation_forward(Activation::gelu_erf, one, r);
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r);
  EXPECT_NEAR(rh(0, 0), 0.8413447460685429, 1e-6);
}

// Under mixed precision the new activations round like the others: the value and the
// gradient are the float32 ones rounded to the compute dtype, bit for bit.
TEST(Activation, SiluSigmoidGeluErfRoundToTheComputeDtype) {
  const int n = 64;
  Matrix z("z", 1, n), out32("out32", 1, n), out16("out16", 1, n);
  Matrix g32("g32", 1, n), g16("g16", 1, n);
  auto zh = Kokkos::create_mirror_view(z);
  for (int j = 0; j < n; ++j) zh(0, j) = -7.0f + 0.2183f * j;
  Kokkos::deep_copy(z, zh);
  for (Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    for (Activation a : {Activation::silu, Activation::sigmoid, Activation::gelu_erf}) {
      SCOPED_TRACE(std::string(to_string(a)) + " in " + to_string(dtype));
      activation_forward(a, z, out32);
      activation_forward(a, z, out16, dtype);
      Kokkos::deep_copy(g32, 0.37f);
      Kokkos::deep_copy(g16, 0.37f);
      activation_backward(a, z, g32);
      activation_backward(a, z, g16, dtype);
      auto f32 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out32);
      auto f16 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out16);
      auto d32 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g32);
      auto d16 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g16);
      int rounded = 0;  // elements where rounding changed the value: the cast happens
      for (int j = 0; j < n; ++j) {
        EXPECT_EQ(f16(0, j), round_to(f32(0, j), dtype)) << "f at " << zh(0, j);
        EXPECT_EQ(d16(0, j), round_to(d32(0, j), dtype)) << "gradient at " << zh(0, j);
        rounded += f16(0, j) != f32(0, j) ? 1 : 0;
      }
      EXPECT_GT(rounded, n / 2);
    }
  }
}

TEST(Options, UnknownNamesAreBadInput) {
  testing::expect_bad_input([] { parse_activation("swish"); }, {"model.activation", "swish"});
  testing::expect_bad_input([] { parse_loss_kind("hinge"); }, {"model.loss", "hinge"});
  testing::expect_bad_input([] { parse_optimizer_kind("lion"); }, {"optimizer.kind", "lion"});
  EXPECT_EQ(parse_activation("gelu"), Activation::gelu);
  EXPECT_EQ(parse_loss_kind("mse"), LossKind::mse);
  EXPECT_EQ(parse_optimizer_kind("sgd"), OptimizerKind::sgd);
}

TEST(Optimizer, StateIsShardedLikeItsParameter) {
  const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<ShardedTensor> params = {
      ShardedTensor::allocate("layers/0/weight", {8, 4}, PartitionSpec::parse("P(fsdp, None)"),
                              mesh, rank),
      ShardedTensor::allocate("layers/0/bias", {4}, PartitionSpec(), mesh, rank)};
  OptimizerSettings adamw;
  Optimizer opt(adamw, params);
  EXPECT_EQ(opt.slot_names(), (std::vector<std::string>{"m", "v"}));
  for (const auto& slot : opt.slot_names()) {
    for (size_t i = 0; i < params.size(); ++i) {
      const ShardedTensor& s = opt.slot(slot)[i];
      EXPECT_EQ(s.name, params[i].name);
      EXPECT_EQ(s.spec, params[i].spec);
      EXPECT_EQ(s.box.offset, params[i].box.offset);
      EXPECT_EQ(s.local.extent(0), params[i].local.extent(0));
    }
  }
  testing::expect_bad_input([&] { opt.slot("momentum"); }, {"momentum"});
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  Optimizer opt2(sgd, params);
  EXPECT_EQ(opt2.slot_names(), (std::vector<std::string>{"momentum"}));
  std::vector<ShardedTensor> grads = params;  // shares storage: g = p
  Kokkos::deep_copy(params[0].local, 1.0f);
  opt2.step(params, grads, 0.5f);  // p = 1 - 0.5 * 1
  EXPECT_EQ(opt2.step_count(), 1);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params[0].local);
  EXPECT_FLOAT_EQ(h(0), 0.5f);
}

TEST(Mlp, TrainingStepsAllocateNothing) {
  const int n = world_size();
  std::vector<std::pair<std::vector<std::pair<std::string, int>>, std::string>> cases = {
      {{{"dp", n}}, "dp"}, {{{"fsdp", n}}, "fsdp"}, {{{"tp", n}}, "tp"}};
  if (n == 4) cases.push_back({{{"fsdp", 2}, {"tp", 2}}, "fsdp_tp"});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.second);
    const Mesh mesh = Mesh::create(c.first, n);
    MeshCommunicators comms(mesh);
    std::vector<std::string> all;
    for (const auto& a : mesh.axes()) all.push_back(a.name);
    Communicator& world = comms.get(all);
    ParallelContext context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional);
    const std::vector<int64_t> sizes = {64, 32, 32, 10};
    const ShardingPlan plan =
        make_plan(mlp_parameter_shapes(sizes), mesh, preset_rules(c.second), PlanOptions{0});
    const int64_t rows = 16 / context.batch_parallel();
    Mlp model(sizes, Activation::gelu, specs_from_plan(plan), context, rows);
    model.initialize(InitScheme::he_normal, 1);
    Loss loss(LossKind::cross_entropy, context, rows, sizes.back(), model.output_layout());
    Optimizer opt(OptimizerSettings{}, model.parameters());
    GradientClipper clipper(mesh, context.rank(), model.gradients());
    Matrix x("x", rows, sizes[0]);
    Kokkos::deep_copy(x, 0.5f);
    Kokkos::View<int32_t*> labels("labels", rows);
    Kokkos::deep_copy(labels, 3);
    auto step = [&] {
      MatrixView out = model.forward(x);
      loss.cross_entropy(out, labels);
      model.backward(loss.gradient());
      clipper.clip(model.gradients(), 1.0, world);
      opt.step(model.parameters(), model.gradients(), 1e-3f);
    };
    step();  // warm-up
    testing::KokkosAllocationCounter allocations;
    step();
    step();
    allocations.stop();
    EXPECT_EQ(allocations.count(), 0)
        << "Kokkos allocations inside training steps:" << allocations.described();
  }
}

// The callback really fires (so the test above can fail).
TEST(Mlp, AllocationCounterSeesAllocations) {
  testing::KokkosAllocationCounter allocations;
  { Vector v("probe", 10); }
  allocations.stop();
  EXPECT_GE(allocations.count(), 1);
}

}  // namespace
}  // namespace meshtrain
