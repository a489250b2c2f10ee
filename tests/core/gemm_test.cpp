// gemm() (framework/core/gemm.hpp) against a float64 reference written here: every transpose
// combination, row-strided views (column blocks of wider matrices whose other columns hold
// NaN, so a read or write outside the block shows), beta 0 (over NaN), 1 and 0.5, every
// epilogue (bias and each activation forward; each activation's derivative and the bias
// gradient backward) and every input dtype (fp32, and bf16 and fp16 values in fp32 buffers),
// on each host library of the build (oneDNN, and OpenBLAS with gemm()'s own epilogue pass),
// oneDNN's bf16 kernel included where oneDNN makes one (emulated on CPUs without
// AVX512_BF16: slower, never wrong). Then oneDNN's fp32 results against OpenBLAS's within the
// tolerance the docs state, the kernels' description, empty shapes, bad epilogues, and no
// Kokkos allocation on a repeated call.
//
// Tolerances, from the rounding (u = 2^-24, fp32's unit roundoff; S = sum |a||b| over K):
//   product and sums   a K-term fp32 dot product, in any order and with or without FMA, is
//                      within K u S of the exact one (to first order); beta C and the bias
//                      add one rounding each: |z^ - z| <= (K + 3) u (S + |beta c| + |bias|)
//   forward f          |f(z^) - f(z)| <= 1.2 |z^ - z| (every activation's |f'| <= 1.13), plus
//                      the evaluation of f in fp32: 16 u (|z| + |f(z)|) (oneDNN's eltwise
//                      approximations are within a few ulps; ours are the formulas of
//                      layers/activation.hpp)
//   backward f'        dz = G f'(z): |f'(z)| |G^ - G| + |G| 32 u (1 + |z|), |z| <= 3 (f' in fp32:
//                      each term of the formulas is at most ~3 in size, each rounded a few
//                      times), plus u |dz| for the product
//   bias gradient      the bounds of its terms, plus M u sum |dz| for the M-term sum
// bf16 and fp16 operands hold 16-bit values: their products are exact in fp32, so the same
// bounds hold. A missing bias, activation or derivative, a wrong stride or transpose is off
// by O(1), far outside them (checked by breaking each, while writing this test).

#include "framework/core/gemm.hpp"

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/views.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/reference_activations.hpp"

namespace meshtrain::testing {
namespace {

using gemm_backend::Bf16Kernel;
using gemm_backend::HostLibrary;

constexpr double kUnit = 0x1p-24;  // fp32's unit roundoff

// ------------------------------------------------------------------ matrices

// Values of a test matrix on the host, row-major, and their place on the device: a column
// block [offset, offset + cols) of a [rows, cols + pad] matrix whose other columns hold NaN.
struct TestMatrix {
  std::size_t rows = 0, cols = 0, offset = 0;
  std::vector<float> values;
  Matrix store;

  double at(std::size_t i, std::size_t j) const { return values[i * cols + j]; }
  MatrixView view() const {
    return Kokkos::subview(store, Kokkos::ALL, std::make_pair(offset, offset + cols));
  }
};

// Random values in [lo, hi] rounded to `dtype`; pad > 0 makes the view row-strided.
TestMatrix make_matrix(std::size_t rows, std::size_t cols, std::size_t pad, Dtype dtype,
                       std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  TestMatrix t;
  t.rows = rows;
  t.cols = cols;
  t.offset = pad > 0 ? 1 : 0;
  std::uniform_real_distribution<float> uniform(lo, hi);
  t.values.resize(rows * cols);
  for (float& v : t.values) v = round_to(uniform(rng), dtype);
  t.store = Matrix("test_matrix", rows, cols + pad);
  auto host = host_mirror(t.store);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols + pad; ++j)
      host(i, j) = j >= t.offset && j < t.offset + cols ? t.values[i * cols + j - t.offset]
                                                        : std::numeric_limits<float>::quiet_NaN();
  Kokkos::deep_copy(t.store, host);
  return t;
}

// The whole stored matrix (block and padding), row-major.
std::vector<float> read_store(const TestMatrix& t) {
  auto host = host_mirror(t.store);
  Kokkos::deep_copy(host, t.store);
  std::vector<float> out(t.store.extent(0) * t.store.extent(1));
  for (std::size_t i = 0; i < t.store.extent(0); ++i)
    for (std::size_t j = 0; j < t.store.extent(1); ++j) out[i * t.store.extent(1) + j] = host(i, j);
  return out;
}

std::vector<float> read_vector(const Vector& v) {
  auto host = host_mirror(v);
  Kokkos::deep_copy(host, v);
  return std::vector<float>(host.data(), host.data() + host.extent(0));
}

Vector make_vector(const std::vector<float>& values) {
  Vector v("test_vector", values.size());
  auto host = host_mirror(v);
  for (std::size_t j = 0; j < values.size(); ++j) host(j) = values[j];
  Kokkos::deep_copy(v, host);
  return v;
}

// op(A) @ op(B) in double, and sum |a||b| for the tolerance.
struct Product {
  std::vector<double> value, magnitude;
};
Product reference_product(const TestMatrix& a, bool ta, const TestMatrix& b, bool tb, std::size_t m,
                          std::size_t k, std::size_t n) {
  Product p{std::vector<double>(m * n, 0.0), std::vector<double>(m * n, 0.0)};
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t l = 0; l < k; ++l) {
      const double x = ta ? a.at(l, i) : a.at(i, l);
      for (std::size_t j = 0; j < n; ++j) {
        const double y = tb ? b.at(j, l) : b.at(l, j);
        p.value[i * n + j] += x * y;
        p.magnitude[i * n + j] += std::fabs(x * y);
      }
    }
  return p;
}

constexpr Activation kActivations[] = {Activation::none,     Activation::relu, Activation::gelu,
                                       Activation::gelu_erf, Activation::silu, Activation::tanh,
                                       Activation::sigmoid};

// ------------------------------------------------------------------ host libraries

// A way gemm() computes on host memory: a library (and, for bf16, a oneDNN kernel).
struct Path {
  std::string name;
  HostLibrary library;
  Bf16Kernel bf16_kernel;
};

std::vector<Path> paths_for(Dtype dtype) {
  if (kDeviceMemoryIsHostInaccessible) {  // CUDA: the one device library
    return {{"cuda", gemm_backend::default_host_library(), Bf16Kernel::automatic}};
  }
  std::vector<Path> paths{{"openblas", HostLibrary::openblas, Bf16Kernel::automatic}};
#if defined(MESHTRAIN_GEMM_ONEDNN)
  paths.push_back({"onednn", HostLibrary::onednn, Bf16Kernel::automatic});
  if (dtype == Dtype::bf16) {
    paths.push_back({"onednn fp32 kernel", HostLibrary::onednn, Bf16Kernel::fp32});
    if (gemm_backend::onednn_has_bf16_matmul()) {
      paths.push_back({"onednn bf16 kernel", HostLibrary::onednn, Bf16Kernel::bf16});
    }
  }
#else
  (void)dtype;
#endif
  return paths;
}

// Selects a path for the scope of a test, and the build's own afterwards.
struct SelectedPath {
  explicit SelectedPath(const Path& path) {
    if (!kDeviceMemoryIsHostInaccessible) {
      gemm_backend::select_host_library(path.library, path.bf16_kernel);
    }
  }
  ~SelectedPath() {
    if (!kDeviceMemoryIsHostInaccessible) {
      gemm_backend::select_host_library(gemm_backend::default_host_library());
    }
  }
};

// ------------------------------------------------------------------ checking

// Collects |got - want| / bound over a case's elements; fails the test naming the first
// element outside its bound. worst() shows how close the results came to the bounds.
class Checker {
 public:
  explicit Checker(std::string name) : name_(std::move(name)) {}
  void check(const char* what, std::size_t i, std::size_t j, double got, double want,
             double bound) {
    const double error = std::fabs(got - want);
    const double ratio = bound > 0.0 ? error / bound : (error == 0.0 ? 0.0 : INFINITY);
    if (!(ratio <= 1.0)) {  // NaN fails too
      if (failures_++ < 3) {
        ADD_FAILURE() << name_ << ": " << what << "(" << i << ", " << j << ") = " << got
                      << ", want " << want << " within " << bound << " (off by " << error << ")";
      }
    } else {
      worst_ = std::max(worst_, ratio);
    }
  }
  double worst() const { return worst_; }

 private:
  std::string name_;
  int failures_ = 0;
  double worst_ = 0.0;
};

// Every element of the padding (outside the block) is still NaN.
void expect_padding_untouched(const TestMatrix& c, const std::string& name) {
  const std::vector<float> stored = read_store(c);
  const std::size_t width = c.store.extent(1);
  for (std::size_t i = 0; i < c.rows; ++i)
    for (std::size_t j = 0; j < width; ++j) {
      if (j >= c.offset && j < c.offset + c.cols) continue;
      if (!std::isnan(stored[i * width + j])) {
        ADD_FAILURE() << name << ": C's padding (" << i << ", " << j << ") was written";
        return;
      }
    }
}

std::vector<float> block_of(const TestMatrix& c) {
  const std::vector<float> stored = read_store(c);
  std::vector<float> out(c.rows * c.cols);
  for (std::size_t i = 0; i < c.rows; ++i)
    for (std::size_t j = 0; j < c.cols; ++j)
      out[i * c.cols + j] = stored[i * c.store.extent(1) + c.offset + j];
  return out;
}

struct Shape {
  std::size_t m, k, n;
};
// Small odd sizes (tails everywhere), and a K long enough for the libraries' K blocking with
// N over a backward block of 64 columns.
constexpr Shape kShapes[] = {{37, 29, 23}, {64, 515, 130}};

std::string case_name(const Path& path, Dtype dtype, const Shape& s, bool ta, bool tb,
                      const std::string& rest) {
  std::ostringstream out;
  out << path.name << " " << to_string(dtype) << " [" << s.m << "x" << s.k << "x" << s.n << "] ta "
      << ta << " tb " << tb << " " << rest;
  return out.str();
}

double g_worst_ratio = 0.0;  // over every case, printed once

// Runs `body(a, ta, b, tb, product, name)` for every path, dtype, shape and transpose pair.
template <class Body>
void for_every_case(Body body) {
  for (Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
    for (const Path& path : paths_for(dtype)) {
      const SelectedPath selected(path);
      for (const Shape& s : kShapes) {
        for (bool ta : {false, true}) {
          for (bool tb : {false, true}) {
            std::mt19937 rng(static_cast<unsigned>(s.m * 131 + s.k * 17 + ta * 2 + tb));
            const TestMatrix a = make_matrix(ta ? s.k : s.m, ta ? s.m : s.k, 3, dtype, rng);
            const TestMatrix b = make_matrix(tb ? s.n : s.k, tb ? s.k : s.n, 2, dtype, rng);
            const Product product = reference_product(a, ta, b, tb, s.m, s.k, s.n);
            body(dtype, path, s, ta ? transposed(a.view()) : plain(a.view()),
                 tb ? transposed(b.view()) : plain(b.view()), product, rng,
                 [&](const std::string& rest) { return case_name(path, dtype, s, ta, tb, rest); });
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ the tests

// C = beta C + op(A) op(B), no epilogue.
TEST(Gemm, EveryTransposeStrideBetaAndDtypeMatchesFloat64) {
  for_every_case([](Dtype dtype, const Path&, const Shape& s, GemmOperand a, GemmOperand b,
                    const Product& product, std::mt19937& rng, auto name_of) {
    for (float beta : {0.0f, 1.0f, 0.5f}) {
      const std::string name = name_of("beta " + std::to_string(beta));
      TestMatrix c = make_matrix(s.m, s.n, 4, Dtype::fp32, rng);
      const std::vector<float> c0 = c.values;
      if (beta == 0.0f) {  // beta 0 overwrites, NaN included
        Kokkos::deep_copy(c.view(), std::numeric_limits<float>::quiet_NaN());
      }
      gemm(a, b, beta, c.view(), dtype);
      const std::vector<float> got = block_of(c);
      Checker checker(name);
      for (std::size_t i = 0; i < s.m; ++i)
        for (std::size_t j = 0; j < s.n; ++j) {
          const std::size_t e = i * s.n + j;
          const double scaled = beta == 0.0f ? 0.0 : beta * double(c0[e]);
          const double want = product.value[e] + scaled;
          const double bound = (s.k + 3) * kUnit * (product.magnitude[e] + std::fabs(scaled));
          checker.check("C", i, j, got[e], want, bound);
        }
      expect_padding_untouched(c, name);
      g_worst_ratio = std::max(g_worst_ratio, checker.worst());
    }
  });
}

// C = f(beta C + op(A) op(B) + bias) for each activation, with and without a bias.
TEST(Gemm, ForwardEpiloguesMatchFloat64) {
  for_every_case([](Dtype dtype, const Path&, const Shape& s, GemmOperand a, GemmOperand b,
                    const Product& product, std::mt19937& rng, auto name_of) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> bias_values(s.n);
    for (float& v : bias_values) v = round_to(uniform(rng), dtype);
    const Vector bias = make_vector(bias_values);
    for (Activation f : kActivations) {
      for (bool with_bias : {false, true}) {
        for (float beta : {0.0f, 1.0f}) {
          const std::string name =
              name_of(std::string("forward ") + to_string(f) + (with_bias ? " +bias" : "") +
                      " beta " + std::to_string(beta));
          TestMatrix c = make_matrix(s.m, s.n, 4, Dtype::fp32, rng);
          const std::vector<float> c0 = c.values;
          gemm(a, b, beta, c.view(), dtype,
               GemmEpilogue::forward(with_bias ? ConstVectorView(bias) : ConstVectorView(), f));
          const std::vector<float> got = block_of(c);
          Checker checker(name);
          for (std::size_t i = 0; i < s.m; ++i)
            for (std::size_t j = 0; j < s.n; ++j) {
              const std::size_t e = i * s.n + j;
              const double scaled = beta * double(c0[e]);
              const double bias_j = with_bias ? bias_values[j] : 0.0;
              const double z = product.value[e] + scaled + bias_j;
              const double z_error = (s.k + 3) * kUnit *
                                     (product.magnitude[e] + std::fabs(scaled) + std::fabs(bias_j));
              const double want = activation(f, z);
              const double bound =
                  f == Activation::none
                      ? z_error
                      : 1.2 * z_error + 16.0 * kUnit * (std::fabs(z) + std::fabs(want));
              checker.check("C", i, j, got[e], want, bound);
            }
          expect_padding_untouched(c, name);
          g_worst_ratio = std::max(g_worst_ratio, checker.worst());
        }
      }
    }
  });
}

// G = beta C + op(A) op(B); C = G f'(z); bias_gradient = column sums of C.
TEST(Gemm, BackwardEpiloguesMatchFloat64) {
  for_every_case([](Dtype dtype, const Path&, const Shape& s, GemmOperand a, GemmOperand b,
                    const Product& product, std::mt19937& rng, auto name_of) {
    // z in [-3, 3], row-strided, with some exact zeros (relu' (0) = 0).
    TestMatrix z = make_matrix(s.m, s.n, 5, dtype, rng, -3.0f, 3.0f);
    for (std::size_t e = 0; e < z.values.size(); e += 7) z.values[e] = 0.0f;
    {
      auto host = host_mirror(z.store);
      Kokkos::deep_copy(host, z.store);
      for (std::size_t i = 0; i < s.m; ++i)
        for (std::size_t j = 0; j < s.n; ++j) host(i, z.offset + j) = z.values[i * s.n + j];
      Kokkos::deep_copy(z.store, host);
    }
    for (Activation f : kActivations) {
      for (bool with_gradient : {false, true}) {
        if (f == Activation::none && !with_gradient) continue;  // no epilogue at all
        for (float beta : {0.0f, 0.5f}) {
          const std::string name =
              name_of(std::string("backward ") + to_string(f) +
                      (with_gradient ? " +bias gradient" : "") + " beta " + std::to_string(beta));
          TestMatrix c = make_matrix(s.m, s.n, 4, Dtype::fp32, rng);
          const std::vector<float> c0 = c.values;
          Vector bias_gradient("bias_gradient", s.n);
          Kokkos::deep_copy(bias_gradient, std::numeric_limits<float>::quiet_NaN());
          const VectorView gradient_view = with_gradient ? VectorView(bias_gradient) : VectorView();
          const GemmEpilogue epilogue = f == Activation::none
                                            ? GemmEpilogue::bias_gradient_only(gradient_view)
                                            : GemmEpilogue::backward(f, z.view(), gradient_view);
          gemm(a, b, beta, c.view(), dtype, epilogue);
          const std::vector<float> got = block_of(c);
          Checker checker(name);
          std::vector<double> sum(s.n, 0.0), sum_bound(s.n, 0.0), sum_magnitude(s.n, 0.0);
          for (std::size_t i = 0; i < s.m; ++i)
            for (std::size_t j = 0; j < s.n; ++j) {
              const std::size_t e = i * s.n + j;
              const double scaled = beta * double(c0[e]);
              const double g = product.value[e] + scaled;
              const double g_error = (s.k + 2) * kUnit * (product.magnitude[e] + std::fabs(scaled));
              const double zv = z.values[e];
              const double d = activation_derivative(f, zv);
              const double want = g * d;
              const double bound =
                  std::fabs(d) * g_error +
                  (f == Activation::none ? 0.0
                                         : std::fabs(g) * 32.0 * kUnit * (1.0 + std::fabs(zv))) +
                  kUnit * std::fabs(want);
              checker.check("C", i, j, got[e], want, bound);
              sum[j] += want;
              sum_bound[j] += bound;
              sum_magnitude[j] += std::fabs(want);
            }
          if (with_gradient) {
            const std::vector<float> db = read_vector(bias_gradient);
            for (std::size_t j = 0; j < s.n; ++j) {
              checker.check("bias_gradient", 0, j, db[j], sum[j],
                            sum_bound[j] + s.m * kUnit * sum_magnitude[j]);
            }
          }
          expect_padding_untouched(c, name);
          g_worst_ratio = std::max(g_worst_ratio, checker.worst());
        }
      }
    }
  });
  std::cout << "worst |error| / bound over the float64 comparisons so far: " << g_worst_ratio
            << "\n";
}

// The stated agreement of the two host libraries (docs/design.md, GEMM): fp32 results of
// oneDNN and OpenBLAS within 2 (K + 2) u sum |a||b| of each other, each being within (K + 2) u
// sum |a||b| of the exact product. Shapes of a training step too (784-4096-4096-10 at batch 64).
TEST(Gemm, OneDnnAgreesWithOpenBlasInFp32) {
#if !defined(MESHTRAIN_GEMM_ONEDNN)
  GTEST_SKIP() << "this build has no oneDNN (MESHTRAIN_CPU_GEMM=openblas or libdnnl-dev missing)";
#else
  if (kDeviceMemoryIsHostInaccessible) GTEST_SKIP() << "CUDA memory: no host libraries";
  const Shape shapes[] = {{64, 784, 512}, {64, 512, 10}, {37, 29, 23}};
  double worst = 0.0;
  for (const Shape& s : shapes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        std::mt19937 rng(static_cast<unsigned>(s.k + ta * 2 + tb));
        const TestMatrix a = make_matrix(ta ? s.k : s.m, ta ? s.m : s.k, 0, Dtype::fp32, rng);
        const TestMatrix b = make_matrix(tb ? s.n : s.k, tb ? s.k : s.n, 0, Dtype::fp32, rng);
        const Product product = reference_product(a, ta, b, tb, s.m, s.k, s.n);
        std::vector<float> results[2];
        for (int library = 0; library < 2; ++library) {
          gemm_backend::select_host_library(library == 0 ? HostLibrary::openblas
                                                         : HostLibrary::onednn);
          TestMatrix c = make_matrix(s.m, s.n, 0, Dtype::fp32, rng);
          gemm({a.view(), ta}, {b.view(), tb}, 0.0f, c.view());
          results[library] = block_of(c);
        }
        gemm_backend::select_host_library(gemm_backend::default_host_library());
        Checker checker("oneDNN vs OpenBLAS " + std::to_string(s.m) + "x" + std::to_string(s.k) +
                        "x" + std::to_string(s.n));
        for (std::size_t e = 0; e < s.m * s.n; ++e) {
          checker.check("C", e / s.n, e % s.n, results[1][e], results[0][e],
                        2.0 * (s.k + 2) * kUnit * product.magnitude[e]);
        }
        worst = std::max(worst, checker.worst());
      }
    }
  }
  std::cout << "oneDNN vs OpenBLAS: worst |difference| / tolerance " << worst << "\n";
#endif
}

// The run's line: which library, its kernels (oneDNN's ISA) and one thread (OMP_NUM_THREADS=1
// and OPENBLAS_NUM_THREADS=1, as the tests and scripts/env.sh set them).
TEST(Gemm, KernelsAreNamed) {
  const std::string text = gemm_kernels();
  std::cout << "GEMM: " << text << "\n";
  if (kDeviceMemoryIsHostInaccessible) {
    EXPECT_NE(text.find("cuBLAS"), std::string::npos) << text;
    return;
  }
  // The build's library (or the environment's MESHTRAIN_CPU_GEMM) names itself, one thread.
  const bool onednn_selected = gemm_backend::selected_host_library() == HostLibrary::onednn;
  EXPECT_EQ(text.rfind(onednn_selected ? "oneDNN 2." : "OpenBLAS 0.", 0), 0u) << text;
  EXPECT_NE(text.find(", 1 thread"), std::string::npos) << text;
#if defined(MESHTRAIN_GEMM_ONEDNN)
  // oneDNN by default wherever the build has it; the environment's choice wins.
  const char* env = std::getenv("MESHTRAIN_CPU_GEMM");
  const bool env_set = env != nullptr && *env != '\0';
  const bool onednn_by_default = !env_set || std::string(env) != "openblas";
  EXPECT_EQ(gemm_backend::default_host_library() == HostLibrary::onednn, onednn_by_default);
  gemm_backend::select_host_library(HostLibrary::onednn);
  const std::string onednn = gemm_kernels();
  EXPECT_EQ(onednn.rfind("oneDNN 2.", 0), 0u) << onednn;
  EXPECT_NE(onednn.find("avx"), std::string::npos) << "no ISA named: " << onednn;  // x86-64
  EXPECT_EQ(gemm_backend::onednn_has_native_bf16(),
            onednn.find("no AVX512_BF16") == std::string::npos)
      << onednn;
  EXPECT_NE(onednn.find(", 1 thread"), std::string::npos) << onednn;
#else
  EXPECT_EQ(gemm_backend::default_host_library(), HostLibrary::openblas);
#endif
  gemm_backend::select_host_library(HostLibrary::openblas);
  const std::string openblas = gemm_kernels();
  gemm_backend::select_host_library(gemm_backend::default_host_library());
  EXPECT_EQ(openblas.rfind("OpenBLAS 0.", 0), 0u) << openblas;
  EXPECT_NE(openblas.find(", 1 thread"), std::string::npos) << openblas;
}

// K = 0: C = f(beta C + bias); M = 0: the bias gradient is a sum of nothing.
TEST(Gemm, EmptySumsStillApplyTheEpilogue) {
  for (const Path& path : paths_for(Dtype::fp32)) {
    const SelectedPath selected(path);
    std::mt19937 rng(5);
    const std::size_t m = 3, n = 4;
    const TestMatrix a = make_matrix(m, 0, 0, Dtype::fp32, rng);
    const TestMatrix b = make_matrix(0, n, 0, Dtype::fp32, rng);
    TestMatrix c = make_matrix(m, n, 0, Dtype::fp32, rng);
    const std::vector<float> c0 = c.values;
    const std::vector<float> bias_values{0.25f, -0.5f, 1.0f, -2.0f};
    const Vector bias = make_vector(bias_values);
    gemm(plain(a.view()), plain(b.view()), 0.5f, c.view(), Dtype::fp32,
         GemmEpilogue::forward(bias, Activation::relu));
    const std::vector<float> got = block_of(c);
    for (std::size_t e = 0; e < m * n; ++e) {
      EXPECT_EQ(got[e], std::max(0.0f, 0.5f * c0[e] + bias_values[e % n])) << path.name;
    }
    Vector db("db", n);
    Kokkos::deep_copy(db, 7.0f);
    const TestMatrix no_rows_a = make_matrix(0, 5, 0, Dtype::fp32, rng);
    const TestMatrix b5 = make_matrix(5, n, 0, Dtype::fp32, rng);
    Matrix no_rows("no_rows", 0, n), z("z", 0, n);
    gemm(plain(no_rows_a.view()), plain(b5.view()), 0.0f, no_rows, Dtype::fp32,
         GemmEpilogue::backward(Activation::relu, z, db));
    for (float v : read_vector(db)) EXPECT_EQ(v, 0.0f) << path.name;
  }
}

// The environment's MESHTRAIN_CPU_GEMM picks the host library without a rebuild; a name that
// is none of them is bad input naming it.
TEST(Gemm, TheEnvironmentPicksTheHostLibrary) {
  const char* before = std::getenv("MESHTRAIN_CPU_GEMM");
  const std::string saved = before != nullptr ? before : "";
  setenv("MESHTRAIN_CPU_GEMM", "openblas", 1);
  EXPECT_EQ(gemm_backend::default_host_library(), HostLibrary::openblas);
#if defined(MESHTRAIN_GEMM_ONEDNN)
  setenv("MESHTRAIN_CPU_GEMM", "onednn", 1);
  EXPECT_EQ(gemm_backend::default_host_library(), HostLibrary::onednn);
  setenv("MESHTRAIN_CPU_GEMM", "auto", 1);
  EXPECT_EQ(gemm_backend::default_host_library(), HostLibrary::onednn);
#endif
  setenv("MESHTRAIN_CPU_GEMM", "mkl", 1);
  expect_bad_input([] { gemm_backend::default_host_library(); }, {"MESHTRAIN_CPU_GEMM = 'mkl'"});
  if (before != nullptr) {
    setenv("MESHTRAIN_CPU_GEMM", saved.c_str(), 1);
  } else {
    unsetenv("MESHTRAIN_CPU_GEMM");
  }
}

TEST(Gemm, EpiloguesThatDoNotFitAreBadInput) {
  Matrix a("a", 4, 3), b("b", 3, 5), c("c", 4, 5), z_wrong("z", 5, 4), z("z", 4, 5);
  Vector bias4("bias4", 4), bias5("bias5", 5);
  expect_bad_input(
      [&] { gemm(plain(a), plain(b), 0.0f, c, Dtype::fp32, GemmEpilogue::forward(bias4)); },
      {"the bias has 4 elements and C has 5 columns"});
  expect_bad_input(
      [&] {
        gemm(plain(a), plain(b), 0.0f, c, Dtype::fp32,
             GemmEpilogue::backward(Activation::gelu, z_wrong));
      },
      {"the activation input is [5, 4] and C is [4, 5]"});
  expect_bad_input(
      [&] {
        gemm(plain(a), plain(b), 0.0f, c, Dtype::fp32,
             GemmEpilogue::backward(Activation::silu, {}));
      },
      {"the backward epilogue of silu needs the activation's input z [4, 5]"});
  expect_bad_input(
      [&] {
        gemm(plain(a), plain(b), 0.0f, c, Dtype::fp32,
             GemmEpilogue::backward(Activation::relu, z, bias4));
      },
      {"the bias gradient has 4 elements and C has 5 columns"});
  GemmEpilogue both = GemmEpilogue::backward(Activation::relu, z, bias5);
  both.bias = bias5;
  expect_bad_input([&] { gemm(plain(a), plain(b), 0.0f, c, Dtype::fp32, both); },
                   {"a backward epilogue adds no bias"});
  GemmEpilogue forward_with_gradient = GemmEpilogue::forward(bias5);
  forward_with_gradient.bias_gradient = bias5;
  expect_bad_input([&] { gemm(plain(a), plain(b), 0.0f, c, Dtype::fp32, forward_with_gradient); },
                   {"a forward epilogue takes no activation input or bias gradient"});
}

// 16-bit operands (plain/transposed of a ConstHalfMatrixView) give C bit for bit as the fp32
// buffers holding the same values, on every path: oneDNN's bf16 matmul reads the same bf16
// numbers either way (as stored, or its copy of the fp32 buffer), and an fp32 kernel gets the
// 16-bit operand widened exactly. Row-strided 16-bit views (column blocks of wider matrices),
// each operand alone 16-bit and both, with a forward epilogue; and an fp32 `inputs` with a
// 16-bit operand is bad input.
HalfMatrix sixteen_bit_store(const TestMatrix& t, Dtype dtype) {
  HalfMatrix store("test_matrix_16bit", t.rows, t.cols + 2);
  auto host = host_mirror(store);
  for (std::size_t i = 0; i < t.rows; ++i)
    for (std::size_t j = 0; j < t.cols + 2; ++j)
      host(i, j) = j >= 1 && j < 1 + t.cols
                       ? to_16bit(t.values[i * t.cols + j - 1], dtype)
                       : to_16bit(std::numeric_limits<float>::quiet_NaN(), dtype);
  Kokkos::deep_copy(store, host);
  return store;
}

TEST(Gemm, SixteenBitOperandsGiveTheResultsOfTheirFp32Buffers) {
  for_every_case([](Dtype dtype, const Path& path, const Shape& s, GemmOperand a, GemmOperand b,
                    const Product&, std::mt19937& rng, auto name_of) {
    if (dtype == Dtype::fp32) return;
    // The stored matrices again, as 16 bits.
    TestMatrix a_stored, b_stored;
    a_stored.rows = a.matrix.extent(0), a_stored.cols = a.matrix.extent(1);
    b_stored.rows = b.matrix.extent(0), b_stored.cols = b.matrix.extent(1);
    for (TestMatrix* t : {&a_stored, &b_stored}) {
      const GemmOperand& x = t == &a_stored ? a : b;
      auto host = host_mirror(x.matrix);
      Kokkos::deep_copy(host, x.matrix);
      for (std::size_t i = 0; i < t->rows; ++i)
        for (std::size_t j = 0; j < t->cols; ++j) t->values.push_back(host(i, j));
    }
    const HalfMatrix a16_store = sixteen_bit_store(a_stored, dtype),
                     b16_store = sixteen_bit_store(b_stored, dtype);
    const auto block = [](const HalfMatrix& m, std::size_t cols) {
      return ConstHalfMatrixView(
          Kokkos::subview(m, Kokkos::ALL, std::make_pair(std::size_t{1}, 1 + cols)));
    };
    GemmOperand a16 = plain(block(a16_store, a_stored.cols)),
                b16 = plain(block(b16_store, b_stored.cols));
    a16.transpose = a.transpose;
    b16.transpose = b.transpose;
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> bias_values(s.n);
    for (float& v : bias_values) v = round_to(uniform(rng), dtype);
    const Vector bias = make_vector(bias_values);
    const GemmEpilogue epilogue = GemmEpilogue::forward(bias, Activation::relu);
    const TestMatrix c0 = make_matrix(s.m, s.n, 4, Dtype::fp32, rng);
    const auto product = [&](GemmOperand x, GemmOperand y) {
      TestMatrix c = c0;
      c.store = Matrix("c", c0.store.extent(0), c0.store.extent(1));
      Kokkos::deep_copy(c.store, c0.store);
      gemm(x, y, 0.5f, c.view(), dtype, epilogue);
      return read_store(c);
    };
    const std::vector<float> want = product(a, b);
    const std::pair<GemmOperand, GemmOperand> cases[] = {{a16, b}, {a, b16}, {a16, b16}};
    for (std::size_t k = 0; k < 3; ++k) {
      const std::vector<float> got = product(cases[k].first, cases[k].second);
      const std::string name = name_of(k == 0 ? "16-bit A" : k == 1 ? "16-bit B" : "16-bit A, B");
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t e = 0; e < got.size(); ++e) {
        if (std::isnan(want[e]) && std::isnan(got[e])) continue;  // C's padding
        ASSERT_EQ(precision_detail::bits_of(got[e]), precision_detail::bits_of(want[e]))
            << name << ": element " << e;
      }
    }
    if (path.library == HostLibrary::onednn && path.bf16_kernel == Bf16Kernel::bf16) {
      EXPECT_TRUE(gemm_reads_16bit(dtype)) << path.name;
    }
    if (path.library == HostLibrary::openblas && !kDeviceMemoryIsHostInaccessible) {
      EXPECT_FALSE(gemm_reads_16bit(dtype)) << path.name;
    }
  });
  Matrix b("b", 3, 5), c("c", 4, 5);
  HalfMatrix a16("a16", 4, 3);
  expect_bad_input([&] { gemm(plain(ConstHalfMatrixView(a16)), plain(b), 0.0f, c); },
                   {"a 16-bit operand needs inputs bf16 or fp16"});
}

// The oneDNN executions a piece of code ran, by kind: on a primitive made for the call's whole
// shape (fixed) or on the runtime-dimension one (gemm_onednn.cpp, primitive_for).
struct Executions {
  int64_t fixed = 0, runtime = 0;
};
template <class Run>
Executions executions_of(Run&& run) {
#if defined(MESHTRAIN_GEMM_ONEDNN)
  const int64_t all = gemm_backend::onednn_executions(),
                fixed = gemm_backend::onednn_fixed_shape_executions();
  run();
  const int64_t fixed_now = gemm_backend::onednn_fixed_shape_executions() - fixed;
  return {fixed_now, gemm_backend::onednn_executions() - all - fixed_now};
#else
  run();
  return {};
#endif
}

// What one gemm() (or gemm_varying_rows()) call on `path` must run: on oneDNN's bf16 matmul a
// fixed-shape primitive unless the rows vary; on its fp32 matmul the runtime one; elsewhere no
// oneDNN execution at all.
Executions expected_executions(const Path& path, Dtype dtype, bool rows_vary) {
  Executions e;
#if defined(MESHTRAIN_GEMM_ONEDNN)
  if (!kDeviceMemoryIsHostInaccessible && path.library == HostLibrary::onednn) {
    const bool fixed = !rows_vary && gemm_backend::onednn_runs_bf16(dtype, path.bf16_kernel);
    (fixed ? e.fixed : e.runtime) = 1;
  }
#else
  (void)path, (void)dtype, (void)rows_vary;
#endif
  return e;
}

// gemm() or gemm_varying_rows().
void multiply(bool rows_vary, const GemmOperand& a, const GemmOperand& b, MatrixView c,
              Dtype dtype) {
  if (rows_vary) {
    gemm_varying_rows(a, b, 0.0f, c, dtype);
  } else {
    gemm(a, b, 0.0f, c, dtype);
  }
}

// A layer shape called with other rows (an MoE expert's varying share, or another batch size),
// through gemm() and gemm_varying_rows(): each call within the float64 bounds, of the kernel its
// entry point says (counted: on oneDNN's bf16 matmul gemm() runs a primitive of the call's whole
// shape, gemm_varying_rows() the runtime-dimension one; framework/core/backends/gemm_onednn.cpp,
// primitive_for), and a repeated call the same bits. Every path, fp32 too. Both forms whose rows
// vary: x @ W (rows are M) and Xᵀ @ dY (rows are K), with K = 515 for x @ W past oneDNN's K block.
TEST(Gemm, OtherRowsOfALayerShapeMatchFloat64) {
  constexpr std::size_t kFeatures = 515, kOut = 133;
  for (Dtype dtype : {Dtype::bf16, Dtype::fp32}) {
    for (const Path& path : paths_for(dtype)) {
      const SelectedPath selected(path);
      std::mt19937 rng(21);
      const TestMatrix w = make_matrix(kFeatures, kOut, 0, dtype, rng);
      for (bool rows_vary : {false, true}) {
        const Executions want = expected_executions(path, dtype, rows_vary);
        for (bool weight_gradient : {false, true}) {
          std::ostringstream form;
          form << path.name << " " << to_string(dtype)
               << (rows_vary ? " gemm_varying_rows " : " gemm ")
               << (weight_gradient ? "Xᵀ @ dY" : "x @ W");
          for (std::size_t rows : {64, 17, 40, 64}) {
            const TestMatrix x = make_matrix(rows, kFeatures, 0, dtype, rng);
            const TestMatrix dy = make_matrix(rows, kOut, 0, dtype, rng);
            // x @ W: [rows, 515] @ [515, 133]; Xᵀ @ dY: [515, rows] @ [rows, 133].
            const std::size_t m = weight_gradient ? kFeatures : rows,
                              k = weight_gradient ? rows : kFeatures;
            const TestMatrix& b = weight_gradient ? dy : w;
            const Product product = reference_product(x, weight_gradient, b, false, m, k, kOut);
            TestMatrix c = make_matrix(m, kOut, 0, Dtype::fp32, rng);
            const Executions ran = executions_of([&] {
              multiply(rows_vary, weight_gradient ? transposed(x.view()) : plain(x.view()),
                       plain(b.view()), c.view(), dtype);
            });
            EXPECT_EQ(ran.fixed, want.fixed) << form.str() << " rows " << rows;
            EXPECT_EQ(ran.runtime, want.runtime) << form.str() << " rows " << rows;
            const std::vector<float> got = block_of(c);
            std::ostringstream name;
            name << form.str() << " rows " << rows;
            Checker checker(name.str());
            for (std::size_t i = 0; i < m; ++i)
              for (std::size_t j = 0; j < kOut; ++j) {
                const std::size_t e = i * kOut + j;
                checker.check("C", i, j, got[e], product.value[e],
                              (k + 3) * kUnit * product.magnitude[e]);
              }
            g_worst_ratio = std::max(g_worst_ratio, checker.worst());
          }
          // 64 rows again, twice on the same operands: the same bits both times.
          const TestMatrix x = make_matrix(64, kFeatures, 0, dtype, rng);
          const TestMatrix dy = make_matrix(64, kOut, 0, dtype, rng);
          const std::size_t m = weight_gradient ? kFeatures : 64;
          TestMatrix c1 = make_matrix(m, kOut, 0, Dtype::fp32, rng),
                     c2 = make_matrix(m, kOut, 0, Dtype::fp32, rng);
          const GemmOperand a = weight_gradient ? transposed(x.view()) : plain(x.view());
          const GemmOperand b = plain(weight_gradient ? dy.view() : w.view());
          multiply(rows_vary, a, b, c1.view(), dtype);
          multiply(rows_vary, a, b, c2.view(), dtype);
          EXPECT_EQ(block_of(c1), block_of(c2)) << form.str();
        }
      }
    }
  }
}

// A call's bits do not depend on the calls before it (a sweep's second config, a resumed run,
// `meshtrain evaluate` after training): x @ W with 128 rows called first in a process (its
// primitives dropped before, as a new process has none) and called after 17 rows of the same
// layer shape give the same bits, through gemm() and gemm_varying_rows(); the kernel each call ran
// is counted as well. The shape is one where oneDNN's bf16 brgemm and gemm kernels differ in the
// last bits (their fp32 additions in other orders), so the bits fail where the kernel depends on
// the order: measured here (AMX), 128 x 4096 x N differs for N = 64 to 4096, while 64 x 4096 x N
// (N 32 to 4096) and 128 x 1024 x 256 give the same bits on both kernels. An earlier version
// (the first rows of a layer shape fixed, other rows on the runtime primitive) fails this test.
TEST(Gemm, KernelOfACallDoesNotDependOnTheCallsBefore) {
  constexpr std::size_t kFeatures = 4096, kOut = 64, kRows = 128;
  for (Dtype dtype : {Dtype::bf16, Dtype::fp32}) {
    for (const Path& path : paths_for(dtype)) {
      const SelectedPath selected(path);
      std::mt19937 rng(23);
      const TestMatrix w = make_matrix(kFeatures, kOut, 0, dtype, rng);
      const TestMatrix x = make_matrix(kRows, kFeatures, 0, dtype, rng);
      const MatrixView x17 =
          Kokkos::subview(x.view(), std::make_pair(std::size_t{0}, std::size_t{17}), Kokkos::ALL);
      for (bool rows_vary : {false, true}) {
        std::ostringstream name;
        name << path.name << " " << to_string(dtype)
             << (rows_vary ? " gemm_varying_rows" : " gemm");
        const Executions want = expected_executions(path, dtype, rows_vary);
        TestMatrix alone = make_matrix(kRows, kOut, 0, Dtype::fp32, rng),
                   after = make_matrix(kRows, kOut, 0, Dtype::fp32, rng),
                   c17 = make_matrix(17, kOut, 0, Dtype::fp32, rng);
#if defined(MESHTRAIN_GEMM_ONEDNN)
        gemm_backend::onednn_drop_primitives();
#endif
        const Executions ran_alone = executions_of(
            [&] { multiply(rows_vary, plain(x.view()), plain(w.view()), alone.view(), dtype); });
#if defined(MESHTRAIN_GEMM_ONEDNN)
        gemm_backend::onednn_drop_primitives();
#endif
        const Executions ran_17 = executions_of(
            [&] { multiply(rows_vary, plain(x17), plain(w.view()), c17.view(), dtype); });
        const Executions ran_after = executions_of(
            [&] { multiply(rows_vary, plain(x.view()), plain(w.view()), after.view(), dtype); });
        EXPECT_EQ(block_of(alone), block_of(after)) << name.str();
        for (const Executions& ran : {ran_alone, ran_17, ran_after}) {
          EXPECT_EQ(ran.fixed, want.fixed) << name.str();
          EXPECT_EQ(ran.runtime, want.runtime) << name.str();
        }
      }
    }
  }
}

// A repeated call (same shape, dtype and epilogue; through gemm_varying_rows(), M and K may differ,
// as an MoE expert's rows do) allocates nothing, neither Kokkos memory nor on the heap: primitives,
// scratchpads and 16-bit copies are made at the first call and kept (the 16-bit copies grow only
// for larger operands). The heap count leaves out what oneDNN allocates inside its calls
// (tests/support/onednn_allocations.hpp).

TEST(Gemm, RepeatedCallsAllocateNothing) {
  for (Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
    for (const Path& path : paths_for(dtype)) {
      const SelectedPath selected(path);
      std::mt19937 rng(9);
      const TestMatrix x = make_matrix(64, 96, 0, dtype, rng),
                       w = make_matrix(96, 80, 0, dtype, rng);
      TestMatrix y = make_matrix(64, 80, 0, Dtype::fp32, rng);
      TestMatrix dx = make_matrix(64, 96, 0, Dtype::fp32, rng);
      TestMatrix dw = make_matrix(96, 80, 0, Dtype::fp32, rng);
      const Vector bias = make_vector(std::vector<float>(80, 0.5f));
      Vector db("db", 96);
      const auto calls = [&] {
        gemm(plain(x.view()), plain(w.view()), 0.0f, y.view(), dtype,
             GemmEpilogue::forward(bias, Activation::gelu));
        gemm(plain(y.view()), transposed(w.view()), 0.0f, dx.view(), dtype,
             GemmEpilogue::backward(Activation::silu, x.view(), db));
        gemm(transposed(x.view()), plain(y.view()), 1.0f, dw.view(), dtype);
      };
      // Other rows (an MoE expert's share of a batch) through gemm_varying_rows(): other M and
      // K, the same runtime-dimension primitives, made at the first such call.
      const auto fewer_rows = [&](std::size_t first, std::size_t count) {
        const auto rows = std::make_pair(first, first + count);
        const MatrixView xr = Kokkos::subview(x.view(), rows, Kokkos::ALL);
        const MatrixView yr = Kokkos::subview(y.view(), rows, Kokkos::ALL);
        const MatrixView dxr = Kokkos::subview(dx.view(), rows, Kokkos::ALL);
        gemm_varying_rows(plain(xr), plain(w.view()), 0.0f, yr, dtype,
                          GemmEpilogue::forward(bias, Activation::gelu));
        gemm_varying_rows(plain(yr), transposed(w.view()), 0.0f, dxr, dtype,
                          GemmEpilogue::backward(Activation::silu, xr, db));
        gemm_varying_rows(transposed(xr), plain(yr), 1.0f, dw.view(), dtype);
      };
      calls();  // the first calls make what the later ones reuse
      fewer_rows(3, 17);
      Kokkos::fence();
      AllocationWindow window(AllocationWindow::Threads::all, AllocationWindow::OneDnn::left_out);
      calls();
      fewer_rows(0, 40);
      fewer_rows(3, 17);
      calls();
      Kokkos::fence();
      EXPECT_EQ(window.close(), 0) << path.name << " " << to_string(dtype);
      EXPECT_EQ(window.kokkos_allocations(), 0) << path.name << " " << to_string(dtype);
    }
  }
}

// gemm_to_16bit(): C's 16 bits are gemm()'s fp32 C of the same call rounded to nearest even by
// precision.hpp's to_16bit, bit for bit, on every path and 16-bit dtype: small shapes with every
// transpose, fp32 and 16-bit operands and a row-strided C (whose padding must stay untouched), and
// on the default path the weight-gradient shapes of the 784-4096-4096-10 step (Xᵀ @ dY, K the
// rows of a rank's batch: 128 at batch 256 over 2 ranks, 256 on one), where oneDNN's bf16 matmul
// writes the bf16 dst itself (its conversion rounds to nearest even; a kernel that accumulated
// differently for a bf16 dst would show here). No tolerance: equality is the claim. Then the
// fp32 kernel's fallback allocates nothing when repeated.
TEST(Gemm, SixteenBitCIsTheFp32CRounded) {
  struct Case {
    std::size_t m, k, n;
    bool big;  // the step's shapes: the default path only
  };
  const Case cases[] = {{5, 7, 9, false},        {33, 70, 17, false},     {784, 128, 4096, true},
                        {4096, 128, 4096, true}, {4096, 256, 4096, true}, {4096, 128, 10, true}};
  for (Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    for (const Path& path : paths_for(dtype)) {
      const SelectedPath selected(path);
      const bool default_path = path.library == gemm_backend::default_host_library() &&
                                path.bf16_kernel == Bf16Kernel::automatic;
      std::mt19937 rng(21);
      for (const Case& c : cases) {
        // The step's shapes where the bf16 kernel writes the dst itself (fp16, and the fp32
        // kernel's fallback, are the small shapes' case).
        if (c.big && (!default_path || dtype != Dtype::bf16)) continue;
        for (int flags = 0; flags < (c.big ? 1 : 4); ++flags) {
          // The step's Xᵀ @ dY: A transposed, a 16-bit A (the kept input) and an fp32 B.
          const bool ta = c.big || (flags & 1) != 0, tb = !c.big && (flags & 2) != 0;
          const TestMatrix a = make_matrix(ta ? c.k : c.m, ta ? c.m : c.k, 0, dtype, rng);
          const TestMatrix b =
              make_matrix(tb ? c.n : c.k, tb ? c.k : c.n, c.big ? 0 : 3, dtype, rng);
          TestMatrix want = make_matrix(c.m, c.n, 0, Dtype::fp32, rng);
          GemmOperand op_a = plain(a.view()), op_b = plain(b.view());
          op_a.transpose = ta;
          op_b.transpose = tb;
          gemm(op_a, op_b, 0.0f, want.view(), dtype);
          const std::vector<float> wide = read_store(want);
          // The 16-bit A as stored (exact: its values are 16-bit ones).
          HalfMatrix a16("a16", a.rows, a.cols);
          {
            auto host = Kokkos::create_mirror_view(a16);
            for (std::size_t i = 0; i < a.rows; ++i)
              for (std::size_t j = 0; j < a.cols; ++j)
                host(i, j) = to_16bit(static_cast<float>(a.at(i, j)), dtype);
            Kokkos::deep_copy(a16, host);
          }
          const std::size_t pad = c.big ? 0 : 2;
          for (bool sixteen_bit_a : {false, true}) {
            HalfMatrix store("c16", c.m, c.n + pad);
            Kokkos::deep_copy(store, uint16_t{0x7777});
            const HalfMatrixView c16 =
                Kokkos::subview(store, Kokkos::ALL, std::make_pair(pad / 2, pad / 2 + c.n));
            GemmOperand x = sixteen_bit_a ? plain(ConstHalfMatrixView(a16)) : op_a;
            x.transpose = ta;
            gemm_to_16bit(x, op_b, c16, dtype);
            auto host = Kokkos::create_mirror_view(store);
            Kokkos::deep_copy(host, store);
            std::size_t wrong = 0;
            for (std::size_t i = 0; i < c.m; ++i) {
              for (std::size_t j = 0; j < c.n + pad; ++j) {
                const bool inside = j >= pad / 2 && j < pad / 2 + c.n;
                const uint16_t expected =
                    inside ? to_16bit(wide[i * c.n + j - pad / 2], dtype) : uint16_t{0x7777};
                if (host(i, j) != expected && wrong++ < 3) {
                  ADD_FAILURE() << path.name << " " << to_string(dtype) << " [" << c.m << ", "
                                << c.k << ", " << c.n << "] ta " << ta << " tb " << tb
                                << " 16-bit A " << sixteen_bit_a << ": C(" << i << ", "
                                << j - pad / 2 << ") bits " << host(i, j) << ", want " << expected;
                }
              }
            }
            EXPECT_EQ(wrong, 0u);
          }
        }
      }
      if (dtype == Dtype::bf16) {
        // Tiny products (A's and B's values +-2^-64 times 1 or 1.5, so fp32 sums of three
        // products near 2^-128, below and above 2^-126): where the bf16 kernel writes the dst,
        // its f32 -> bf16 conversion (VCVTNEPS2BF16) flushes sums below 2^-126 to zeros of their
        // sign, which to_16bit() keeps as subnormal bf16 (gemm.hpp). Each element is the fp32 C
        // rounded or, below 2^-126 only, the zero of its sign; every other element the rounded C.
        const float tiny = std::ldexp(1.0f, -64);
        const std::size_t m = 6, k = 3, n = 8;
        TestMatrix a = make_matrix(k, m, 0, dtype, rng), b = make_matrix(k, n, 0, dtype, rng);
        for (TestMatrix* t : {&a, &b}) {
          for (float& v : t->values)
            v = (v < 0 ? -tiny : tiny) * (std::abs(v) < 0.5f ? 1.0f : 1.5f);
          auto host = host_mirror(t->store);
          for (std::size_t i = 0; i < t->rows; ++i)
            for (std::size_t j = 0; j < t->cols; ++j) host(i, j) = t->values[i * t->cols + j];
          Kokkos::deep_copy(t->store, host);
        }
        TestMatrix want = make_matrix(m, n, 0, Dtype::fp32, rng);
        gemm(transposed(a.view()), plain(b.view()), 0.0f, want.view(), dtype);
        const std::vector<float> wide = read_store(want);
        HalfMatrix c16("c16", m, n);
        gemm_to_16bit(transposed(a.view()), plain(b.view()), c16, dtype);
        auto host = Kokkos::create_mirror_view(c16);
        Kokkos::deep_copy(host, c16);
        std::size_t below = 0, flushed = 0, wide_subnormal = 0, wrong = 0;
        for (std::size_t i = 0; i < m; ++i) {
          for (std::size_t j = 0; j < n; ++j) {
            double exact = 0.0;
            for (std::size_t p = 0; p < k; ++p) exact += a.at(p, i) * b.at(p, j);
            const float w = wide[i * n + j];
            const bool small = std::abs(w) < std::ldexp(1.0f, -126);
            below += std::abs(exact) < std::ldexp(1.0, -126);
            wide_subnormal += small && w != 0.0f;
            const uint16_t rounded = to_16bit(w, dtype);
            const uint16_t zero = std::signbit(w) ? uint16_t{0x8000} : uint16_t{0};
            if (host(i, j) == rounded) continue;
            if (small && host(i, j) == zero) {
              ++flushed;
              continue;
            }
            if (wrong++ < 3) {
              ADD_FAILURE() << path.name << " tiny products: C(" << i << ", " << j << ") bits "
                            << host(i, j) << ", want " << rounded << " (fp32 C " << w << ", exact "
                            << exact << ")";
            }
          }
        }
        EXPECT_EQ(wrong, 0u) << path.name;
        // What this CPU does (not asserted: it depends on the ISA the kernel runs).
        std::cout << path.name << " tiny products: " << below << " of " << m * n
                  << " exact sums below 2^-126, " << wide_subnormal
                  << " subnormal in gemm()'s fp32 C, " << flushed
                  << " of those written as zeros by gemm_to_16bit\n";
      }
      if (path.library == HostLibrary::openblas && !kDeviceMemoryIsHostInaccessible) {
        EXPECT_FALSE(gemm_kernel_writes_16bit(dtype)) << path.name;
      }
      if (path.library == HostLibrary::onednn && path.bf16_kernel == Bf16Kernel::bf16) {
        EXPECT_TRUE(gemm_kernel_writes_16bit(dtype)) << path.name;
      }
      // Repeated calls allocate nothing (the fallback's fp32 scratch is kept).
      const TestMatrix a = make_matrix(40, 24, 0, dtype, rng),
                       b = make_matrix(40, 30, 0, dtype, rng);
      HalfMatrix c16("c16", 24, 30);
      const auto call = [&] { gemm_to_16bit(transposed(a.view()), plain(b.view()), c16, dtype); };
      call();
      Kokkos::fence();
      AllocationWindow window(AllocationWindow::Threads::all, AllocationWindow::OneDnn::left_out);
      call();
      call();
      Kokkos::fence();
      EXPECT_EQ(window.close(), 0) << path.name << " " << to_string(dtype);
      EXPECT_EQ(window.kokkos_allocations(), 0) << path.name << " " << to_string(dtype);
    }
  }
  Matrix a("a", 3, 4), b("b", 4, 5);
  HalfMatrix c16("c16", 3, 6);
  expect_bad_input([&] { gemm_to_16bit(plain(a), plain(b), c16, Dtype::bf16); },
                   {"gemm: op(A) is [3, 4], op(B) is [4, 5] and C is [3, 6]"});
  expect_bad_input([&] { gemm_to_16bit(plain(a), plain(b), HalfMatrix("c", 3, 5), Dtype::fp32); },
                   {"C's 16 bits need inputs bf16 or fp16"});
}

}  // namespace
}  // namespace meshtrain::testing
