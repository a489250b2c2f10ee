// The training step's elementwise 16-bit passes (layers/sixteen_bit_passes.hpp): the host loops
// (per-ISA clones without FMA contraction, AVX-512 on this project's CPU) give the Kokkos
// kernels' bits, element for element, for bf16 and fp16 and every activation, on values chosen
// for the rounding's edge cases: +-0, NaN of both signs, +-inf, bf16's and fp16's subnormals,
// values that round to 0 or overflow fp16, ties of round-to-nearest-even in both formats (odd
// and even last bits), and a sweep of ordinary values. Bits are compared exactly (no
// tolerance; a NaN's sign aside, count_differences): the two versions do the same IEEE
// operations per element, so any difference is a bug. Sizes cross a host chunk (16384
// elements) and leave a tail that is not a multiple of 16 lanes. Skipped where the layers run
// no host kernels (a GPU build: the kernels only).

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.hpp"
#include "framework/core/activation_storage.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/precision.hpp"
#include "layers/inference.hpp"
#include "layers/sixteen_bit_passes.hpp"

namespace meshtrain {
namespace {

using sixteen_bit_passes::Path;

uint32_t bits_of(float f) {  // compared as bits: -0 is not +0, a NaN equals its own bits
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float from_bits(uint32_t u) {
  float f = 0.0f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

const char* dtype_name(Dtype dtype) {
  return dtype == Dtype::bf16 ? "bf16" : dtype == Dtype::fp16 ? "fp16" : "fp32";
}

const Activation kActivations[] = {Activation::relu,     Activation::tanh, Activation::gelu,
                                   Activation::gelu_erf, Activation::silu, Activation::sigmoid,
                                   Activation::none};

// The edge cases (kEdges values), then a sweep of `sweep` ordinary values over [-12, 12] (every
// activation's curved part and its saturation) with non-16-bit mantissas.
constexpr int64_t kEdges = 45;
std::vector<float> edge_values(int64_t sweep) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v = {0.0f, -0.0f, nan, -nan, inf, -inf};
  // bf16's smallest and largest subnormals, fp16's (as floats), both signs
  for (const uint16_t h : {0x0001, 0x8001, 0x007f, 0x807f}) v.push_back(bf16_to_float(h));
  for (const uint16_t h : {0x0001, 0x8001, 0x03ff, 0x83ff}) v.push_back(fp16_to_float(h));
  // fp32's smallest subnormal (0 in both formats), 1e-9 (0 in fp16), overflow of fp16, fp16's
  // largest, near fp32's largest
  for (const float x : {1e-45f, -1e-45f, 1e-9f, -1e-9f, 1e30f, -1e30f, 65504.0f, 65520.0f,
                        -65520.0f, 3.0e38f, -3.0e38f, 1.5f, -2.25f, 0.3f, -0.7f}) {
    v.push_back(x);
  }
  // Ties: bf16 (the low 16 bits 0x8000, last kept bit even and odd), fp16 (1 + 2^-11 and
  // 1 + 3 2^-11, and a tie between two fp16 subnormals: 1.5 2^-24), both signs.
  for (const uint32_t u : {0x3f808000u, 0x3f818000u, 0x40498000u, 0x00018000u}) {
    v.push_back(from_bits(u));
    v.push_back(-from_bits(u));
  }
  for (const float x : {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.5f * 0x1p-24f, 2.5f * 0x1p-24f}) {
    v.push_back(x);
    v.push_back(-x);
  }
  EXPECT_EQ(static_cast<int64_t>(v.size()), kEdges);
  for (int64_t k = 0; k < sweep; ++k) {
    v.push_back(-12.0f + 24.0f * static_cast<float>(k) / static_cast<float>(sweep) + 1e-4f);
  }
  return v;
}

using HostFloats = Kokkos::View<float*, Kokkos::HostSpace>;
using HostHalves = Kokkos::View<uint16_t*, Kokkos::HostSpace>;

template <class View>
View device_copy(const std::vector<typename View::value_type>& values, const std::string& name) {
  View v(name, values.size());
  auto h = Kokkos::create_mirror_view(v);
  for (size_t k = 0; k < values.size(); ++k) h(k) = values[k];
  Kokkos::deep_copy(v, h);
  return v;
}
template <class View>
auto host_copy(const View& v) {
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
}

// Each element's bits equal, but that a NaN equals any NaN: where an operation makes a NaN (silu
// and sigmoid of a NaN, through exp's selects) rather than passing its operand's on, IEEE 754
// leaves the new NaN's sign unspecified, and x86 gives the scalar and the vector instructions'
// NaNs different signs (0x7fc00000 against 0xffc00000); either is the 16-bit formats' NaN.
// `what` names the array. Returns the count of elements that differ.
bool is_nan_float(float f) {
  return std::isnan(f);
}
bool is_nan_16bit(uint16_t h, Dtype dtype) {  // exponent all ones and a mantissa
  return (h & 0x7fffu) > (dtype == Dtype::bf16 ? 0x7f80u : 0x7c00u);
}
uint32_t raw_bits(float f) {
  return bits_of(f);
}
uint32_t raw_bits(uint16_t h) {
  return h;
}
template <class A, class B>
int64_t count_differences(const A& a, const B& b, const std::string& what, int64_t n, Dtype dtype) {
  int64_t differ = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t x = raw_bits(a(k)), y = raw_bits(b(k));
    bool nans = false;
    if constexpr (std::is_same_v<typename A::value_type, float>) {
      nans = is_nan_float(a(k)) && is_nan_float(b(k));
    } else {
      nans = is_nan_16bit(a(k), dtype) && is_nan_16bit(b(k), dtype);
    }
    if (x != y && !nans && differ++ < 5) {
      ADD_FAILURE() << what << " element " << k << " differs: 0x" << std::hex << x << " against 0x"
                    << y << std::dec;
    }
  }
  return differ;
}

class SixteenBitPasses : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!inference::layers_run_host_kernels()) {
      GTEST_SKIP() << "this build's layers run no host kernels: the kernels only";
    }
  }
};

// activation_forward_keeping: the values written back, the kept z (where kept) and the kept
// f(z), host against kernel.
TEST_F(SixteenBitPasses, ActivationForwardKeepingIsTheKernelsBits) {
  const std::vector<float> raw = edge_values(16384 + 37);
  const auto n = static_cast<int64_t>(raw.size());
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    for (const Activation act : kActivations) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + to_string(act));
      const bool keeps_z = activation_keeps_16bit_input(act);
      Vector values[2] = {device_copy<Vector>(raw, "v_kernel"), device_copy<Vector>(raw, "v_host")};
      Kokkos::View<uint16_t*> kz[2] = {Kokkos::View<uint16_t*>("kz_kernel", keeps_z ? n : 0),
                                       Kokkos::View<uint16_t*>("kz_host", keeps_z ? n : 0)};
      Kokkos::View<uint16_t*> ko[2] = {Kokkos::View<uint16_t*>("ko_kernel", n),
                                       Kokkos::View<uint16_t*>("ko_host", n)};
      const Path paths[2] = {Path::kernel, Path::host};
      for (int p = 0; p < 2; ++p) {
        sixteen_bit_passes::activation_forward_keeping(paths[p], act, values[p].data(),
                                                       keeps_z ? kz[p].data() : nullptr,
                                                       ko[p].data(), n, dtype);
      }
      Kokkos::fence();
      const auto v0 = host_copy(values[0]), v1 = host_copy(values[1]);
      const auto o0 = host_copy(ko[0]), o1 = host_copy(ko[1]);
      EXPECT_EQ(count_differences(v0, v1, "value", n, dtype), 0);
      EXPECT_EQ(count_differences(o0, o1, "kept f(z)", n, dtype), 0);
      if (keeps_z) {
        const auto z0 = host_copy(kz[0]), z1 = host_copy(kz[1]);
        EXPECT_EQ(count_differences(z0, z1, "kept z", n, dtype), 0);
        for (int64_t k = 0; k < n; ++k) ASSERT_EQ(z1(k), to_16bit(raw[k], dtype)) << k;
      }
      // The pass did compute f: the written values are the kept bits' values, and (but for the
      // identity) not the inputs everywhere.
      int64_t moved = 0;
      for (int64_t k = 0; k < n; ++k) {
        ASSERT_EQ(bits_of(v1(k)), bits_of(from_16bit(o1(k), dtype))) << k;
        moved += bits_of(v1(k)) != bits_of(round_to(raw[k], dtype));
      }
      if (act == Activation::none) {
        EXPECT_EQ(moved, 0);
      } else {
        EXPECT_GT(moved, n / 4);
      }
    }
  }
}

// activation_backward_from: the gradients from the kept 16 bits of every edge value (as z, or
// as f(z) for relu and the identity) and gradients that are edge values themselves, host against
// kernel.
TEST_F(SixteenBitPasses, ActivationBackwardFromIsTheKernelsBits) {
  const std::vector<float> raw = edge_values(16384 + 37);
  const auto n = static_cast<int64_t>(raw.size());
  std::vector<float> grads(raw.size());
  for (int64_t k = 0; k < n; ++k) grads[k] = raw[(k * 7 + 3) % n] * (k % 2 == 0 ? 1.0f : -0.75f);
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    std::vector<uint16_t> kept(raw.size());
    for (int64_t k = 0; k < n; ++k) kept[k] = to_16bit(raw[k], dtype);
    const auto kept_view = device_copy<Kokkos::View<uint16_t*>>(kept, "kept");
    for (const Activation act : kActivations) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + to_string(act));
      Vector g[2] = {device_copy<Vector>(grads, "g_kernel"), device_copy<Vector>(grads, "g_host")};
      sixteen_bit_passes::activation_backward_from(Path::kernel, act, kept_view.data(), g[0].data(),
                                                   n, dtype);
      sixteen_bit_passes::activation_backward_from(Path::host, act, kept_view.data(), g[1].data(),
                                                   n, dtype);
      Kokkos::fence();
      const auto g0 = host_copy(g[0]), g1 = host_copy(g[1]);
      EXPECT_EQ(count_differences(g0, g1, "gradient", n, dtype), 0);
      int64_t rounded = 0;  // each result a dtype value; some differ from the incoming gradient
      for (int64_t k = 0; k < n; ++k) {
        ASSERT_EQ(bits_of(g1(k)), bits_of(round_to(g1(k), dtype))) << k;
        rounded += bits_of(g1(k)) != bits_of(grads[k]);
      }
      EXPECT_GT(rounded, n / 4);
    }
  }
}

// A [rows, cols] matrix of edge values in a wider allocation (rows strided by cols + 3, as a
// column block of a wider matrix), and the bias.
struct StridedMatrix {
  Matrix storage;
  MatrixView view;
};
StridedMatrix strided_matrix(const std::vector<float>& values, int64_t rows, int64_t cols,
                             const std::string& name) {
  StridedMatrix m{Matrix(name, rows, cols + 3), MatrixView()};
  auto h = Kokkos::create_mirror_view(m.storage);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols + 3; ++j) h(i, j) = values[(i * (cols + 3) + j) % values.size()];
  }
  Kokkos::deep_copy(m.storage, h);
  m.view = Kokkos::subview(m.storage, Kokkos::ALL, Kokkos::make_pair<int64_t>(0, cols));
  return m;
}

// linear_add_bias: y = round(round(y) + round(b)) on a strided y, host against kernel; the
// columns outside the view untouched by both.
TEST_F(SixteenBitPasses, LinearAddBiasIsTheKernelsBits) {
  const std::vector<float> raw = edge_values(4000);
  const int64_t rows = 37, cols = 1000 + 13;  // a tail of 5 lanes, rows of 1013 of 1016
  std::vector<float> bias(cols);
  for (int64_t j = 0; j < cols; ++j) bias[j] = raw[(j * 13 + 1) % raw.size()];
  const auto b = device_copy<Vector>(bias, "bias");
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    SCOPED_TRACE(dtype_name(dtype));
    StridedMatrix y[2] = {strided_matrix(raw, rows, cols, "y_kernel"),
                          strided_matrix(raw, rows, cols, "y_host")};
    sixteen_bit_passes::linear_add_bias(Path::kernel, y[0].view, b.data(), dtype);
    sixteen_bit_passes::linear_add_bias(Path::host, y[1].view, b.data(), dtype);
    Kokkos::fence();
    const auto y0 = host_copy(y[0].storage), y1 = host_copy(y[1].storage);
    int64_t differ = 0, moved = 0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols + 3; ++j) {
        const float before = raw[(i * (cols + 3) + j) % raw.size()];
        if (bits_of(y0(i, j)) != bits_of(y1(i, j)) && differ++ < 5) {
          ADD_FAILURE() << "y(" << i << ", " << j << ") differs";
        }
        if (j >= cols) {
          EXPECT_EQ(bits_of(y1(i, j)), bits_of(before)) << "padding (" << i << ", " << j << ")";
        } else {
          moved += bits_of(y1(i, j)) != bits_of(before);
        }
      }
    }
    EXPECT_EQ(differ, 0);
    EXPECT_GT(moved, rows * cols / 2);
  }
}

// linear_bias_gradient: column sums of a strided dY into a wider vector at an offset (0 outside),
// rounded to the dtype, host against kernel, fp32 too: one row of edge values (each column's sum
// is its value, rounded), and 300 rows.
TEST_F(SixteenBitPasses, LinearBiasGradientIsTheKernelsBits) {
  const std::vector<float> raw = edge_values(4000);
  const int64_t cols = 200 + 7, width = cols + 70, offset = 29;  // chunks of 64 cut at the edges
  // Over 300 rows, ordinary values but for the edge values along row 0's first columns (a
  // column with a NaN or inf in it sums to one).
  std::vector<float> ordinary(raw.begin() + kEdges, raw.end());
  for (const int64_t rows : {int64_t{1}, int64_t{300}}) {
    const StridedMatrix dy = strided_matrix(rows == 1 ? raw : ordinary, rows, cols, "dy");
    if (rows > 1) {
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dy.storage);
      for (int64_t j = 0; j < kEdges; ++j) h(0, j) = raw[j];
      Kokkos::deep_copy(dy.storage, h);
    }
    for (const Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", rows " + std::to_string(rows));
      Vector full[2] = {Vector("full_kernel", width), Vector("full_host", width)};
      Kokkos::deep_copy(full[0], 7.0f);  // overwritten everywhere
      Kokkos::deep_copy(full[1], 7.0f);
      sixteen_bit_passes::linear_bias_gradient(Path::kernel, dy.view, offset, full[0], dtype);
      sixteen_bit_passes::linear_bias_gradient(Path::host, dy.view, offset, full[1], dtype);
      Kokkos::fence();
      const auto f0 = host_copy(full[0]), f1 = host_copy(full[1]);
      EXPECT_EQ(count_differences(f0, f1, "bias gradient", width, dtype), 0);
      int64_t finite_nonzero = 0;
      for (int64_t j = 0; j < width; ++j) {
        if (j < offset || j >= offset + cols) {
          EXPECT_EQ(bits_of(f1(j)), 0u) << j;
        } else {
          EXPECT_EQ(bits_of(f1(j)), bits_of(round_to(f1(j), dtype))) << j;
          finite_nonzero += std::isfinite(f1(j)) && f1(j) != 0.0f;
        }
      }
      EXPECT_GT(finite_nonzero, cols / 2);
    }
  }
}

// The SwiGLU's forward keeping 16 bits (gate, value and output kept; the output written over
// value) and backward from them (dgate, and dvalue over dy), on strided gate, value, dy and dgate,
// host against kernel. The gate and value are 16-bit values of the edge values (as the layer's
// inputs are), in two different orders so that every pair of specials meets.
TEST_F(SixteenBitPasses, SwigluForwardKeepingAndBackwardFromAreTheKernelsBits) {
  const std::vector<float> raw = edge_values(6000);
  const int64_t rows = 23, cols = 300 + 9;
  for (const Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<float> g_values(raw.size()), u_values(raw.size()), d_values(raw.size());
    for (size_t k = 0; k < raw.size(); ++k) {
      g_values[k] = round_to(raw[k], dtype);
      u_values[k] = round_to(raw[(k * 11 + 5) % raw.size()], dtype);
      d_values[k] = raw[(k * 17 + 2) % raw.size()] * 0.37f;  // not 16-bit values
    }
    const StridedMatrix gate = strided_matrix(g_values, rows, cols, "gate");
    StridedMatrix value[2] = {strided_matrix(u_values, rows, cols, "value_kernel"),
                              strided_matrix(u_values, rows, cols, "value_host")};
    HalfMatrix kg[2] = {HalfMatrix("kg_kernel", rows, cols), HalfMatrix("kg_host", rows, cols)};
    HalfMatrix kv[2] = {HalfMatrix("kv_kernel", rows, cols), HalfMatrix("kv_host", rows, cols)};
    HalfMatrix ko[2] = {HalfMatrix("ko_kernel", rows, cols), HalfMatrix("ko_host", rows, cols)};
    StridedMatrix dy[2] = {strided_matrix(d_values, rows, cols, "dy_kernel"),
                           strided_matrix(d_values, rows, cols, "dy_host")};
    StridedMatrix dgate[2] = {strided_matrix(d_values, rows, cols, "dgate_kernel"),
                              strided_matrix(d_values, rows, cols, "dgate_host")};
    const Path paths[2] = {Path::kernel, Path::host};
    for (int p = 0; p < 2; ++p) {
      sixteen_bit_passes::swiglu_forward_keeping(paths[p], gate.view, value[p].view, kg[p], kv[p],
                                                 ko[p], dtype);
      sixteen_bit_passes::swiglu_backward_from(paths[p], kg[p], kv[p], dy[p].view, dgate[p].view,
                                               dtype);
    }
    Kokkos::fence();
    const auto flat = [](const auto& m) {  // a [rows, cols (+ 3)] host copy as one array
      auto h = host_copy(m);
      return Kokkos::View<typename decltype(h)::value_type*, Kokkos::HostSpace>(h.data(), h.size());
    };
    const int64_t n = rows * cols, padded = rows * (cols + 3);
    EXPECT_EQ(
        count_differences(flat(value[0].storage), flat(value[1].storage), "output", padded, dtype),
        0);
    EXPECT_EQ(count_differences(flat(kg[0]), flat(kg[1]), "kept gate", n, dtype), 0);
    EXPECT_EQ(count_differences(flat(kv[0]), flat(kv[1]), "kept value", n, dtype), 0);
    EXPECT_EQ(count_differences(flat(ko[0]), flat(ko[1]), "kept output", n, dtype), 0);
    EXPECT_EQ(count_differences(flat(dy[0].storage), flat(dy[1].storage), "dvalue", padded, dtype),
              0);
    EXPECT_EQ(
        count_differences(flat(dgate[0].storage), flat(dgate[1].storage), "dgate", padded, dtype),
        0);
    // The passes did compute: finite nonzero outputs and gradients in most places.
    const auto out = host_copy(value[1].storage);
    const auto dv = host_copy(dy[1].storage);
    int64_t finite = 0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        finite += std::isfinite(out(i, j)) && out(i, j) != 0.0f && std::isfinite(dv(i, j)) &&
                  dv(i, j) != 0.0f;
      }
    }
    EXPECT_GT(finite, n / 2);
  }
}

}  // namespace
}  // namespace meshtrain
