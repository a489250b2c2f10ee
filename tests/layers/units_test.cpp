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
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/precision.hpp"
#include "framework/train/adamw_math.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/activation.hpp"
#include "layers/gradient_buckets.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "layers/sharded_parameter.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
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

// The updates run as per-ISA clones of host loops where the default execution space is the
// host's (framework/core/host_clones.hpp, without FMA contraction): the masters, the state and
// the 16-bit copies must stay the bits of the formulas applied one element at a time
// (adamw_math.hpp's adamw_element; SGD's written out as optimizer.hpp states them), for AdamW,
// SGD with momentum (its first step and a later one) and plain SGD, with a bf16, an fp16 or no
// copy, over a length that spans several chunks and ends past the vector lanes. Values from
// 1e-30 to 1e4 and zeros, so that the divisions, square roots and roundings meet subnormals,
// ties and large quotients.
TEST(Optimizer, UpdatesAreTheScalarFormulasBitForBit) {
  const Mesh mesh = Mesh::create({{"dp", world_size()}}, world_size());
  const int64_t n = 3 * 16384 + 7;
  std::mt19937 random(2718);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-100, 13);
  std::vector<float> p0(n), g0(n), g1(n);
  for (auto* v : {&p0, &g0, &g1}) {
    for (float& x : *v) x = std::ldexp(uniform(random), exponent(random));
  }
  for (int64_t i = 0; i < n; i += 97) g0[i] = 0.0f;
  const std::vector<float>* grads_by_step[] = {&g0, &g1};
  const float lr = 0.05f, wd = 0.01f;
  OptimizerSettings adamw, sgd, plain;
  adamw.kind = OptimizerKind::adamw;
  sgd.kind = plain.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  plain.momentum = 0.0f;
  for (OptimizerSettings* settings : {&adamw, &sgd, &plain}) {
    settings->weight_decay = wd;
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
      SCOPED_TRACE(std::string(dtype == Dtype::fp32   ? "fp32"
                               : dtype == Dtype::bf16 ? "bf16"
                                                      : "fp16") +
                   ", " + to_string(settings->kind) + (settings == &plain ? " (plain)" : ""));
      std::vector<ShardedTensor> params = {
          ShardedTensor::allocate("w", {n}, PartitionSpec::parse("P()"), mesh, world_rank())};
      std::vector<ShardedTensor> grads = {
          ShardedTensor::allocate("w", {n}, PartitionSpec::parse("P()"), mesh, world_rank())};
      auto copy = std::make_shared<SixteenBitCopy>();
      if (dtype != Dtype::fp32) {
        copy->bits = HalfBits("copy", n);
        copy->dtype = dtype;
        params[0].copy_16bit = copy;
      }
      Kokkos::deep_copy(params[0].local,
                        Kokkos::View<const float*, Kokkos::HostSpace>(p0.data(), n));
      Optimizer optimizer(*settings, params);
      // The reference, one element at a time on the host.
      std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f), b(n, 0.0f);
      for (int step = 0; step < 2; ++step) {
        const std::vector<float>& g = *grads_by_step[step];
        Kokkos::deep_copy(grads[0].local,
                          Kokkos::View<const float*, Kokkos::HostSpace>(g.data(), n));
        optimizer.step(params, grads, lr);
        if (settings == &adamw) {
          const double t = step + 1;
          const float c1 = adamw_bias_correction(adamw.beta1, t);
          const float c2 = adamw_bias_correction(adamw.beta2, t);
          for (int64_t i = 0; i < n; ++i) {
            p[i] = adamw_element(p[i], g[i], m[i], v[i], adamw.beta1, adamw.beta2, 1.0f - lr * wd,
                                 lr / c1, 1.0f / c2, adamw.eps);
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const float grad = g[i] + wd * p[i];
            if (settings == &plain) {
              p[i] = p[i] - lr * grad;
            } else {
              b[i] = step == 0 ? grad : sgd.momentum * b[i] + grad;
              p[i] = p[i] - lr * b[i];
            }
          }
        }
        const auto master =
            Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params[0].local);
        int64_t moved = 0;
        for (int64_t i = 0; i < n; ++i) {
          uint32_t got, want;
          std::memcpy(&got, &master(i), sizeof got);
          std::memcpy(&want, &p[i], sizeof want);
          ASSERT_EQ(got, want) << "step " << step << ", master element " << i;
          moved += p[i] != p0[i];
        }
        EXPECT_GT(moved, n / 2);  // the update did move the masters
        if (dtype != Dtype::fp32) {
          const auto bits = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), copy->bits);
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(bits(i), to_16bit(p[i], dtype)) << "step " << step << ", copy element " << i;
          }
        }
        if (settings == &adamw) {
          const auto mh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(),
                                                              optimizer.slot("m")[0].local);
          const auto vh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(),
                                                              optimizer.slot("v")[0].local);
          // As bits (a float == would take -0 for +0 and fail on NaN).
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(std::memcmp(&mh(i), &m[i], sizeof(float)), 0)
                << "step " << step << ", m element " << i << ": " << mh(i) << " vs " << m[i];
            ASSERT_EQ(std::memcmp(&vh(i), &v[i], sizeof(float)), 0)
                << "step " << step << ", v element " << i << ": " << vh(i) << " vs " << v[i];
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- the wire's rounding
// layers/linear.cpp leaves out the weight gradient's round_in_place where the reduction that
// follows packs it to a 16-bit wire of the compute dtype (ShardedParameter::reduce_rounds_to;
// GradientBuckets::wire() for the DP overlap buckets): rounding twice to one format is
// rounding once, so the reduced gradient must be the same bits. Pinned here bit for bit: the
// same unrounded fp32 gradients reduced (a) as they are and (b) after round_in_place, for the
// DP all-reduce, the FSDP reduce-scatter and the buckets, bf16 and fp16, on values that
// overflow fp16 (65520, 70000, -70000), NaN, ties to even, fp16 and bf16 subnormals. Where
// reduce_rounds_to says the wire rounds, (a) and (b) are the same bits; where it says not
// (fp32 wire, a scale before the all-reduce, a deferred all-reduce, one rank), they differ on
// some element (so a skip there would change the result: the test fails if the predicate
// said true). Plus the predicate's truth table, and at np 2 the DP sum against a host
// reference (one 16-bit sum of the two ranks' rounded values, as the wire adds).
namespace {

constexpr int64_t kWireRows = 8, kWireCols = 12;  // rows: a multiple of 4 (the FSDP split)

// Rank `rank`'s unrounded gradient for micro-batch `micro`: random magnitudes from fp16
// subnormals to 4096, and the corner cases at places that move with the rank (so that they
// meet each other and random values in the sums).
std::vector<float> raw_gradient(int rank, int micro) {
  const std::size_t count = static_cast<std::size_t>(kWireRows * kWireCols);
  std::vector<float> g(count);
  std::mt19937 random(static_cast<unsigned>(9000 + 17 * rank + micro));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 12);
  for (float& v : g) v = std::ldexp(uniform(random), exponent(random));
  const float corners[] = {
      65520.0f,  // fp16: to inf (a tie past 65504); bf16: 65536
      70000.0f,
      -70000.0f,
      1.0f + 0x1p-8f,    // bf16 tie, to even: 1
      1.0f + 0x3p-8f,    // bf16 tie, to even: 1 + 2^-6
      1.0f + 0x1p-11f,   // fp16 tie, to even: 1
      1.0f + 0x3p-11f,   // fp16 tie, to even: 1 + 2^-9
      0x1.8p-20f,        // fp16 subnormal
      0x1.666666p-24f,   // 1.4 of fp16's smallest subnormal (halved: 0.7, rounds up)
      -0x1p-25f,         // fp16: a tie to -0
      0x1.666666p-133f,  // 1.4 of bf16's smallest subnormal
      0x1p-130f,         // fp32 subnormal
      -0.0f,
      65504.0f,
      3.0e38f};
  const std::size_t n = sizeof(corners) / sizeof(corners[0]);
  for (std::size_t i = 0; i < n; ++i)
    g[(i + 5 * static_cast<std::size_t>(rank)) % count] = corners[i];
  // On every rank: 1.4 of each format's smallest subnormal, which a halving rounds
  // differently from a rounding then a halving (the scaled cases' control).
  g[count - 2] = 0x1.666666p-133f;
  g[count - 3] = 0x1.666666p-24f;
  if (rank == world_size() - 1) g[count - 1] = std::numeric_limits<float>::quiet_NaN();
  return g;
}

void write_gradient(VectorView dst, std::vector<float> values, bool round_first, Dtype dtype) {
  ASSERT_EQ(dst.extent(0), values.size());
  Kokkos::deep_copy(dst,
                    Kokkos::View<const float*, Kokkos::HostSpace>(values.data(), values.size()));
  if (round_first) round_in_place(dst, dtype);
  Kokkos::fence();
}

std::vector<uint32_t> bits_of(const Vector& v) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<uint32_t> out(h.extent(0));
  std::memcpy(out.data(), h.data(), out.size() * sizeof(float));
  return out;
}

const char* dtype_name(Dtype d) {
  return d == Dtype::fp32 ? "fp32" : d == Dtype::bf16 ? "bf16" : "fp16";
}

struct WireCase {
  bool gathered;    // FSDP: storage split over fsdp, the gradient reduce-scattered
  Dtype wire;       // reduce dtype (the compute dtype is the test's)
  int replication;  // nonbatch_replication: a scale 1 / replication
  bool deferred;    // DeferredReduction::later: two micro-batches summed, then all-reduced
  bool rounds;      // reduce_rounds_to's answer on more than one rank
};

}  // namespace

// A weight gradient stored as bf16 (partition/gradient_storage.hpp) read by the prepared
// update's Kokkos kernels (enable_prepared_steps, prepare_step, launch_prepared: the CUDA-graph
// path, the only one whose kernels widen a 16-bit gradient; step() loops on the host): AdamW and
// SGD with momentum, two steps, move the masters bit for bit as step() does with an fp32 gradient
// holding the same values (bf16 values, exact in fp32), and as the prepared update with that fp32
// gradient.
TEST(Optimizer, PreparedStepsReadABf16GradientAsItsFp32Values) {
  const Mesh mesh = Mesh::create({{"dp", world_size()}}, world_size());
  const int64_t n = 4099;
  std::mt19937 random(31);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> p0(n);
  std::vector<std::vector<float>> g(2, std::vector<float>(n));
  std::vector<std::vector<uint16_t>> g16(2, std::vector<uint16_t>(n));
  for (float& x : p0) x = uniform(random);
  for (int step = 0; step < 2; ++step) {
    for (int64_t i = 0; i < n; ++i) {
      g16[step][i] = float_to_bf16(std::ldexp(uniform(random), -(i % 20)));
      g[step][i] = bf16_to_float(g16[step][i]);
    }
  }
  OptimizerSettings adamw, sgd;
  adamw.kind = OptimizerKind::adamw;
  sgd.kind = OptimizerKind::sgd;
  sgd.momentum = 0.9f;
  for (OptimizerSettings* settings : {&adamw, &sgd}) {
    settings->weight_decay = 0.01f;
    SCOPED_TRACE(to_string(settings->kind));
    // 0: step() with the fp32 gradient (the reference); 1: prepared, fp32; 2: prepared, bf16.
    std::vector<std::vector<float>> after;
    for (int run = 0; run < 3; ++run) {
      const PartitionSpec spec = PartitionSpec::parse("P()");
      std::vector<ShardedTensor> params = {
          ShardedTensor::allocate("w", {n}, spec, mesh, world_rank())};
      std::vector<ShardedTensor> grads = {ShardedTensor::allocate(
          "w", {n}, spec, mesh, world_rank(), run == 2 ? Dtype::bf16 : Dtype::fp32)};
      ASSERT_EQ(grads[0].stored_16bit(), run == 2);
      Kokkos::deep_copy(params[0].local,
                        Kokkos::View<const float*, Kokkos::HostSpace>(p0.data(), n));
      Optimizer optimizer(*settings, params);
      if (run > 0) optimizer.enable_prepared_steps();
      for (int step = 0; step < 2; ++step) {
        if (run == 2) {
          Kokkos::deep_copy(grads[0].bits,
                            Kokkos::View<const uint16_t*, Kokkos::HostSpace>(g16[step].data(), n));
        } else {
          Kokkos::deep_copy(grads[0].local,
                            Kokkos::View<const float*, Kokkos::HostSpace>(g[step].data(), n));
        }
        const float lr = 0.05f;
        if (run == 0) {
          optimizer.step(params, grads, lr);
        } else {
          optimizer.prepare_step(lr);
          optimizer.launch_prepared(params, grads);
          Kokkos::fence();
        }
      }
      const auto master = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params[0].local);
      after.emplace_back(master.data(), master.data() + n);
    }
    int64_t moved = 0;
    for (int64_t i = 0; i < n; ++i) moved += after[0][i] != p0[i];
    EXPECT_GT(moved, n / 2);  // the updates did move the masters
    for (int run = 1; run < 3; ++run) {
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::memcmp(&after[run][i], &after[0][i], sizeof(float)), 0)
            << (run == 1 ? "fp32" : "bf16") << " gradient, prepared: element " << i << ": "
            << after[run][i] << " vs " << after[0][i];
      }
    }
  }
}

TEST(WireRounding, SkippedRoundingIsBitIdenticalWhereTheWireRounds) {
  const int n = world_size(), rank = world_rank();
  for (Dtype param : {Dtype::bf16, Dtype::fp16}) {
    const std::vector<WireCase> cases = {
        {false, param, 1, false, true},         // DP all-reduce
        {false, Dtype::fp32, 1, false, false},  // fp32 wire
        {false, param, 2, false, false},        // scaled before the all-reduce
        {false, param, 1, true, false},         // deferred (accumulation, ZeRO-1)
        {true, param, 1, false, true},          // FSDP reduce-scatter
        {true, param, 2, false, true},          // scaled after it
        {true, param, 1, true, true},           // accumulating: the reduce-scatter per micro-batch
        {true, Dtype::fp32, 1, false, false},   // fp32 wire
    };
    for (const WireCase& c : cases) {
      SCOPED_TRACE(std::string(dtype_name(param)) + " wire " + dtype_name(c.wire) +
                   (c.gathered ? " fsdp" : " dp") + " replication " +
                   std::to_string(c.replication) + (c.deferred ? " deferred" : " now") + " np " +
                   std::to_string(n));
      const std::string axis = c.gathered ? "fsdp" : "dp";
      MeshCommunicators comms(Mesh::create({{axis, n}}, n), MPI_COMM_WORLD,
                              testing::test_communicator_factory());
      ParallelContext context(comms, {axis}, "");
      context.set_precision({param, c.wire});
      const PartitionSpec spec =
          c.gathered ? PartitionSpec::parse("P(fsdp, None)") : PartitionSpec();
      ShardedTensor value =
          ShardedTensor::allocate("w", {kWireRows, kWireCols}, spec, comms.mesh(), rank);
      ShardedTensor grad =
          ShardedTensor::allocate("w/grad", {kWireRows, kWireCols}, spec, comms.mesh(), rank);
      ParameterGathers gathers;
      gathers.compute = {1, kWireRows, kWireCols};
      gathers.stored = {1, value.box.extent[0], kWireCols};
      (c.gathered ? gathers.gather_dim1 : gathers.allreduce) = {axis};
      gathers.nonbatch_replication = c.replication;
      ShardedParameter parameter({&value, &grad}, gathers, GatherMethod::by_dims, context);
      LayerScratchNeeds needs;
      needs.grad = static_cast<std::size_t>(kWireRows * kWireCols);
      LayerScratch scratch(needs);

      const bool skip = parameter.reduce_rounds_to(param, !c.deferred);
      EXPECT_EQ(skip, n > 1 && c.rounds);
      // What the layer leaves in the stored gradient: micro-batches reduced (all-reduce left
      // out when deferred), summed in fp32, then the deferred all-reduce.
      auto reduced = [&](bool round_first) {
        std::vector<float> sum(grad.local.extent(0), 0.0f);
        for (int micro = 0; micro < (c.deferred ? 2 : 1); ++micro) {
          MatrixView g = parameter.gradient_matrix(scratch);
          write_gradient(VectorView(g.data(), g.span()), raw_gradient(rank, micro), round_first,
                         param);
          parameter.reduce(scratch, !c.deferred);
          Kokkos::fence();
          const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grad.local);
          for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += h(k);
        }
        if (c.deferred) {
          write_gradient(VectorView(grad.local.data(), grad.local.extent(0)), sum, false, param);
          parameter.all_reduce_deferred();
          Kokkos::fence();
        }
        return bits_of(grad.local);
      };
      const std::vector<uint32_t> as_is = reduced(false), rounded = reduced(true);
      if (skip) {
        EXPECT_EQ(as_is, rounded);
      } else {
        // The positive control: here the rounding pass changes the result.
        EXPECT_NE(as_is, rounded);
      }
      if (n == 2 && !c.gathered && c.wire == param && c.replication == 1 && !c.deferred) {
        // The host reference: each element one 16-bit sum of the two ranks' rounded values.
        const std::vector<float> g0 = raw_gradient(0, 0), g1 = raw_gradient(1, 0);
        for (std::size_t k = 0; k < g0.size(); ++k) {
          const float want =
              from_16bit(to_16bit(round_to(g0[k], param) + round_to(g1[k], param), param), param);
          uint32_t want_bits;
          std::memcpy(&want_bits, &want, sizeof want_bits);
          ASSERT_EQ(rounded[k], want_bits) << k;
        }
      }
    }
  }
}

// The DP overlap buckets: a 16-bit wire of the compute dtype gives the same bits from the
// unrounded gradients as from the rounded ones (what linear.cpp's `wire() == compute dtype`
// relies on); an fp32 wire does not (there the rounding pass must run). Two layers' gradients
// in one bucket (the packed buffer) and a bucket of its own (one piece, reduced in place).
TEST(WireRounding, BucketsRoundOnTheirSixteenBitWire) {
  const int n = world_size(), rank = world_rank();
  if (n == 1) GTEST_SKIP() << "no bucket without a second rank (nothing is reduced)";
  MeshCommunicators comms(Mesh::create({{"dp", n}}, n), MPI_COMM_WORLD,
                          testing::test_communicator_factory());
  ParallelContext context(comms, {"dp"}, "");
  const std::size_t count = static_cast<std::size_t>(kWireRows * kWireCols);
  for (Dtype param : {Dtype::bf16, Dtype::fp16}) {
    for (Dtype wire : {param, Dtype::fp32}) {
      for (double bucket_mb : {25.0, count * sizeof(float) / (1024.0 * 1024.0)}) {
        SCOPED_TRACE(std::string(dtype_name(param)) + " wire " + dtype_name(wire) + " bucket_mb " +
                     std::to_string(bucket_mb));
        Vector a("a", count), b("b", count);
        GradientBuckets buckets(
            {LayerGradients{{VectorView(a.data(), count)}, context.comm({"dp"})},
             LayerGradients{{VectorView(b.data(), count)}, context.comm({"dp"})}},
            bucket_mb, wire);
        ASSERT_EQ(buckets.size(), bucket_mb == 25.0 ? 1u : 2u);
        auto reduced = [&](bool round_first) {
          write_gradient(VectorView(a.data(), count), raw_gradient(rank, 0), round_first, param);
          write_gradient(VectorView(b.data(), count), raw_gradient(rank, 1), round_first, param);
          buckets.layer_ready(1);
          buckets.layer_ready(0);
          buckets.wait_all();
          Kokkos::fence();
          std::vector<uint32_t> out = bits_of(a), more = bits_of(b);
          out.insert(out.end(), more.begin(), more.end());
          return out;
        };
        const std::vector<uint32_t> as_is = reduced(false), rounded = reduced(true);
        if (buckets.wire() == param) {
          EXPECT_EQ(as_is, rounded);
        } else {
          EXPECT_NE(as_is, rounded);
        }
      }
    }
  }
}

// A layer whose weight-gradient GEMM writes its gradient as 16 bits straight into the buckets'
// 16-bit buffer (gemm_to_16bit into GradientBuckets::wire_home, layer_ready's written_16bit:
// layers/linear.cpp under DP overlap with reduce_dtype = param_dtype) gives, after the sum, the
// bits of the fp32 GEMM's gradient packed by the buckets (the path before): both layers' gradients
// in one bucket, a bucket per gradient, and the GEMM's gradient split over several buckets (as the
// 784-4096-4096-10 model's [4096, 4096] weight is at 25 MiB), bf16 and fp16 (fp16's C goes through
// gemm()'s fp32 scratch on oneDNN: the same bits). Its fp32 gradient is overwritten with NaN
// first: wait_all() alone fills it. No tolerance: equality is the claim.
TEST(WireRounding, BucketsTakeAGradientItsGemmWroteAs16Bits) {
  const int n = world_size(), rank = world_rank();
  if (n == 1) GTEST_SKIP() << "no bucket without a second rank (nothing is reduced)";
  MeshCommunicators comms(Mesh::create({{"dp", n}}, n), MPI_COMM_WORLD,
                          testing::test_communicator_factory());
  ParallelContext context(comms, {"dp"}, "");
  const std::size_t rows = 24, inner = 16, cols = 20, count = rows * cols;
  const std::size_t small = static_cast<std::size_t>(kWireRows * kWireCols);
  for (Dtype param : {Dtype::bf16, Dtype::fp16}) {
    // X [inner, rows] and dY [inner, cols]: this rank's 16-bit values.
    std::mt19937 rng(static_cast<unsigned>(11 + rank));
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    Matrix x("x", inner, rows), dy("dy", inner, cols);
    for (Matrix* m : {&x, &dy}) {
      auto h = Kokkos::create_mirror_view(*m);
      for (std::size_t i = 0; i < h.extent(0); ++i)
        for (std::size_t j = 0; j < h.extent(1); ++j) h(i, j) = round_to(uniform(rng), param);
      Kokkos::deep_copy(*m, h);
    }
    for (double bucket_floats : {1.0e6, static_cast<double>(count), 100.0}) {
      const double bucket_mb = bucket_floats * sizeof(float) / (1024.0 * 1024.0);
      SCOPED_TRACE(std::string(dtype_name(param)) + " buckets of " + std::to_string(bucket_floats) +
                   " floats");
      Vector w("w", count), bias("bias", small), other("other", small);
      GradientBuckets buckets(
          {LayerGradients{{VectorView(other.data(), small)}, context.comm({"dp"})},
           LayerGradients{{VectorView(w.data(), count), VectorView(bias.data(), small)},
                          context.comm({"dp"})}},
          bucket_mb, param);
      EXPECT_EQ(buckets.size(), bucket_floats == 1.0e6 ? 1u : bucket_floats == count ? 2u : 7u);
      // Only the gradient itself has a home: not another buffer, nor another size.
      EXPECT_EQ(buckets.wire_home(1, 0, bias.data(), small), nullptr);
      EXPECT_EQ(buckets.wire_home(1, 0, w.data(), count - 1), nullptr);
      auto reduced = [&](bool sixteen_bit) {
        const MatrixView g(w.data(), rows, cols);
        if (sixteen_bit) {
          uint16_t* home = buckets.wire_home(1, 0, w.data(), count);
          EXPECT_NE(home, nullptr);
          Kokkos::deep_copy(w, std::numeric_limits<float>::quiet_NaN());
          gemm_to_16bit(transposed(ConstMatrixView(x)), plain(ConstMatrixView(dy)),
                        HalfMatrixView(home, rows, cols), param);
        } else {
          gemm(transposed(ConstMatrixView(x)), plain(ConstMatrixView(dy)), 0.0f, g, param);
        }
        write_gradient(VectorView(bias.data(), small), raw_gradient(rank, 0), false, param);
        write_gradient(VectorView(other.data(), small), raw_gradient(rank, 1), false, param);
        buckets.layer_ready(1, sixteen_bit ? 1u : 0u);
        buckets.layer_ready(0);
        buckets.wait_all();
        Kokkos::fence();
        std::vector<uint32_t> out = bits_of(w), more = bits_of(bias), rest = bits_of(other);
        out.insert(out.end(), more.begin(), more.end());
        out.insert(out.end(), rest.begin(), rest.end());
        return out;
      };
      const std::vector<uint32_t> before = reduced(false), written = reduced(true);
      EXPECT_EQ(written, before);
      // The sums are 16-bit values and not this rank's product alone.
      const std::vector<uint32_t> mine = [&] {
        Vector local("local", count);
        gemm(transposed(ConstMatrixView(x)), plain(ConstMatrixView(dy)), 0.0f,
             MatrixView(local.data(), rows, cols), param);
        round_in_place(VectorView(local.data(), count), param);
        Kokkos::fence();
        return bits_of(local);
      }();
      std::size_t differ = 0;
      for (std::size_t k = 0; k < count; ++k) {
        float v;
        std::memcpy(&v, &written[k], sizeof v);
        ASSERT_EQ(round_to(v, param), v) << "element " << k;
        differ += written[k] != mine[k];
      }
      EXPECT_GT(differ, count / 2);
    }
  }
  Vector a("a", 8);
  GradientBuckets fp32_wire({LayerGradients{{VectorView(a.data(), 8)}, context.comm({"dp"})}},
                            25.0);
  EXPECT_EQ(fp32_wire.wire_home(0, 0, a.data(), 8), nullptr);
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
