// The 16-bit conversions of framework/core/precision.hpp against an independent reference
// written here in double precision: a format's values decoded from their bits, and the
// nearest of them (ties to the even pattern, overflow to inf as IEEE 754 rounds) found by
// a search over the sorted values. Exhaustive over the 65536 patterns of each format,
// named corner cases (ties, subnormals, the largest finite values, inf, NaN), and random
// floats, their exact ties and their neighbours. Also the Kokkos kernels built on them
// (round_in_place, round_copy, pack_16bit, unpack_16bit) against the scalar functions.

#include "framework/core/precision.hpp"
#include "framework/core/stochastic_rounding.hpp"

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace meshtrain {
namespace {

// ------------------------------------------------------------------ the reference

// A 16-bit binary format: 1 sign bit, `exponent_bits`, `mantissa_bits`, IEEE 754 rules.
struct Format {
  const char* name;
  Dtype dtype;
  int exponent_bits;
  int mantissa_bits;

  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  uint16_t inf_bits() const {
    return static_cast<uint16_t>(((1u << exponent_bits) - 1u) << mantissa_bits);
  }
  uint16_t sign_bit() const { return 0x8000u; }
  bool is_nan(uint16_t h) const {
    const uint16_t magnitude = h & 0x7fffu;
    return magnitude > inf_bits();
  }
  // The value of a non-negative pattern in 0..inf_bits(), with the inf pattern decoded as an
  // ordinary number (the power of two above the largest finite value): rounding treats the
  // exponent as unbounded, and a result at or beyond that power is inf.
  double unbounded_value(uint16_t magnitude) const {
    const int exponent = magnitude >> mantissa_bits;
    const int mantissa = magnitude & ((1 << mantissa_bits) - 1);
    if (exponent == 0) return std::ldexp(mantissa, 1 - bias() - mantissa_bits);  // subnormal
    return std::ldexp((1 << mantissa_bits) + mantissa, exponent - bias() - mantissa_bits);
  }
  // The value of any pattern, in double.
  double value(uint16_t h) const {
    const double sign = (h & sign_bit()) ? -1.0 : 1.0;
    const uint16_t magnitude = h & 0x7fffu;
    if (magnitude > inf_bits()) return std::numeric_limits<double>::quiet_NaN();
    if (magnitude == inf_bits()) return sign * std::numeric_limits<double>::infinity();
    return sign * unbounded_value(magnitude);
  }
};

constexpr Format kBf16{"bf16", Dtype::bf16, 8, 7};
constexpr Format kFp16{"fp16", Dtype::fp16, 5, 10};

// The nearest pattern to x, ties to the even pattern; NaN for NaN (the format's quiet NaN).
// Non-negative values in pattern order are increasing, so the two candidates are the
// largest pattern at most |x| and the next one; x is compared with their midpoint, which
// double holds exactly (both have at most 11 significant bits).
class Reference {
 public:
  explicit Reference(const Format& format) : format_(format) {
    for (uint32_t p = 0; p <= format.inf_bits(); ++p) {
      values_.push_back(format.unbounded_value(static_cast<uint16_t>(p)));
    }
  }

  uint16_t round(float f) const {
    const double x = f;
    if (std::isnan(x)) return static_cast<uint16_t>(format_.inf_bits() | 1u);  // a NaN
    const uint16_t sign = std::signbit(x) ? format_.sign_bit() : 0;
    const double magnitude = std::fabs(x);
    const uint16_t inf = format_.inf_bits();
    if (magnitude >= values_[inf]) return static_cast<uint16_t>(sign | inf);
    // values_[below] <= magnitude < values_[below + 1]
    const std::size_t below =
        std::upper_bound(values_.begin(), values_.end(), magnitude) - values_.begin() - 1;
    const double midpoint = (values_[below] + values_[below + 1]) / 2;
    std::size_t nearest = below;
    if (magnitude > midpoint || (magnitude == midpoint && below % 2 == 1)) nearest = below + 1;
    return static_cast<uint16_t>(sign | nearest);
  }

  // The midpoint between pattern p and p + 1 (non-negative patterns below inf), as a float:
  // exact, since it has at most 12 significant bits and lies within float's range.
  float midpoint(uint16_t p) const { return static_cast<float>((values_[p] + values_[p + 1]) / 2); }

 private:
  Format format_;
  std::vector<double> values_;  // unbounded_value of patterns 0..inf_bits()
};

float float_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint32_t bits_of_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

std::string hex(uint32_t bits, int digits) {
  std::ostringstream out;
  out << "0x" << std::hex << std::setw(digits) << std::setfill('0') << bits;
  return out.str();
}

uint16_t to_format(float f, const Format& format) {
  return format.dtype == Dtype::bf16 ? float_to_bf16(f) : float_to_fp16(f);
}

// Both NaN, or the same bits.
::testing::AssertionResult same_pattern(uint16_t got, uint16_t want, const Format& format,
                                        float input) {
  if (format.is_nan(want) ? format.is_nan(got) : got == want) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << format.name << " of " << std::setprecision(9) << input << " ("
         << hex(bits_of_float(input), 8) << ") is " << hex(got, 4) << ", expected " << hex(want, 4)
         << (format.is_nan(want) ? " (a NaN)" : "");
}

// -------------------------------------------------------- the reference checked itself

TEST(PrecisionReference, DecodesKnownPatterns) {
  EXPECT_EQ(kFp16.value(0x3c00), 1.0);
  EXPECT_EQ(kFp16.value(0x7bff), 65504.0);
  EXPECT_EQ(kFp16.value(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(kFp16.value(0x0400), std::ldexp(1.0, -14));
  EXPECT_EQ(kFp16.value(0xc000), -2.0);
  EXPECT_TRUE(std::isinf(kFp16.value(0xfc00)) && kFp16.value(0xfc00) < 0);
  EXPECT_TRUE(std::isnan(kFp16.value(0x7e00)));
  EXPECT_EQ(kBf16.value(0x3f80), 1.0);
  EXPECT_EQ(kBf16.value(0x7f7f), std::ldexp(255.0, 120));
  EXPECT_EQ(kBf16.value(0x0001), std::ldexp(1.0, -133));
  EXPECT_TRUE(std::isnan(kBf16.value(0x7fc0)));
}

// ------------------------------------------------------------------ exhaustive

// Every fp16 pattern widens to the value its bits encode and narrows back to itself
// (a NaN to a NaN).
TEST(Precision, Fp16EveryPatternRoundTrips) {
  for (uint32_t p = 0; p <= 0xffffu; ++p) {
    const uint16_t h = static_cast<uint16_t>(p);
    const float f = fp16_to_float(h);
    const double want = kFp16.value(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << hex(h, 4);
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << hex(h, 4);
      ASSERT_EQ(std::signbit(f), std::signbit(want)) << hex(h, 4);  // -0 stays -0
    }
    ASSERT_TRUE(same_pattern(float_to_fp16(f), h, kFp16, f));
  }
}

TEST(Precision, Bf16EveryPatternRoundTrips) {
  for (uint32_t p = 0; p <= 0xffffu; ++p) {
    const uint16_t h = static_cast<uint16_t>(p);
    const float f = bf16_to_float(h);
    const double want = kBf16.value(h);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << hex(h, 4);
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << hex(h, 4);
      ASSERT_EQ(std::signbit(f), std::signbit(want)) << hex(h, 4);
    }
    ASSERT_TRUE(same_pattern(float_to_bf16(f), h, kBf16, f));
  }
}

// ------------------------------------------------------------------ named cases

struct Case {
  float input;
  uint16_t want;
};

void expect_cases(const Format& format, const std::vector<Case>& cases) {
  const Reference reference(format);
  for (const Case& c : cases) {
    EXPECT_TRUE(same_pattern(to_format(c.input, format), c.want, format, c.input));
    // The reference agrees (the table and the reference check each other).
    EXPECT_TRUE(same_pattern(reference.round(c.input), c.want, format, c.input)) << " (reference)";
  }
}

TEST(Precision, Fp16RoundsToNearestEven) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect_cases(kFp16, {
                          {0.0f, 0x0000},
                          {-0.0f, 0x8000},
                          {1.0f, 0x3c00},
                          {-2.0f, 0xc000},
                          {0.1f, 0x2e66},
                          // Ties between neighbours 2^-10 apart at 1: to the even mantissa.
                          {1.0f + 0x1p-11f, 0x3c00},
                          {1.0f + 3 * 0x1p-11f, 0x3c02},
                          {1.0f + 0x1p-11f + 0x1p-23f, 0x3c01},  // just above the tie
                          {-(1.0f + 3 * 0x1p-11f), 0xbc02},
                          // Subnormals (spacing 2^-24) and their ties.
                          {0x1p-24f, 0x0001},
                          {0x1p-25f, 0x0000},  // tie between 0 and 2^-24: to 0
                          {std::nextafter(0x1p-25f, 1.0f), 0x0001},
                          {std::nextafter(0x1p-25f, 0.0f), 0x0000},
                          {3 * 0x1p-25f, 0x0002},  // tie between 1 and 2 ulps: to 2
                          {5 * 0x1p-25f, 0x0002},  // tie between 2 and 3 ulps: to 2
                          {-0x1p-25f, 0x8000},     // to -0
                          {-3 * 0x1p-25f, 0x8002},
                          {0x1p-14f - 0x1p-25f, 0x0400},  // largest subnormal tie: up to 2^-14
                          {0x1p-14f - 0x1p-24f, 0x03ff},  // the largest subnormal
                          {0x1p-14f, 0x0400},             // the smallest normal
                          {1e-10f, 0x0000},
                          {0x1p-149f, 0x0000},  // float's smallest subnormal
                          // The top of the range: 65504 is the largest finite fp16, the
                          // tie with the next power (65536) is 65520, which goes to inf.
                          {65504.0f, 0x7bff},
                          {65519.0f, 0x7bff},
                          {65519.99f, 0x7bff},
                          {std::nextafter(65520.0f, 0.0f), 0x7bff},
                          {65520.0f, 0x7c00},
                          {65536.0f, 0x7c00},
                          {-65520.0f, 0xfc00},
                          {-65504.0f, 0xfbff},
                          {FLT_MAX, 0x7c00},
                          {inf, 0x7c00},
                          {-inf, 0xfc00},
                          {nan, 0x7e00},
                          {-nan, 0x7e00},
                          {float_of_bits(0x7f800001u), 0x7e00},  // a signaling NaN
                          {float_of_bits(0x7fffffffu), 0x7e00},
                      });
}

TEST(Precision, Bf16RoundsToNearestEven) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float bf16_max = float_of_bits(0x7f7f0000u);    // (2 - 2^-7) * 2^127
  const float tie_to_inf = float_of_bits(0x7f7f8000u);  // (2 - 2^-8) * 2^127
  expect_cases(kBf16, {
                          {0.0f, 0x0000},
                          {-0.0f, 0x8000},
                          {1.0f, 0x3f80},
                          {-2.0f, 0xc000},
                          {0.1f, 0x3dcd},
                          // Ties between neighbours 2^-7 apart at 1: to the even mantissa.
                          {1.0f + 0x1p-8f, 0x3f80},
                          {1.0f + 3 * 0x1p-8f, 0x3f82},  // 1 + 2^-6
                          {1.0f + 0x1p-8f + 0x1p-23f, 0x3f81},
                          {std::nextafter(1.0f + 3 * 0x1p-8f, 0.0f), 0x3f81},
                          {-(1.0f + 3 * 0x1p-8f), 0xbf82},
                          // Subnormals (spacing 2^-133).
                          {0x1p-133f, 0x0001},
                          {0x1p-134f, 0x0000},  // tie: to 0
                          {3 * 0x1p-134f, 0x0002},
                          {0x1p-149f, 0x0000},
                          {-0x1p-149f, 0x8000},
                          // The top of the range: the tie between the largest finite value and
                          // 2^128 goes to inf, as does everything above it.
                          {bf16_max, 0x7f7f},
                          {std::nextafter(tie_to_inf, 0.0f), 0x7f7f},
                          {tie_to_inf, 0x7f80},
                          {FLT_MAX, 0x7f80},
                          {-FLT_MAX, 0xff80},
                          {inf, 0x7f80},
                          {-inf, 0xff80},
                          // NaN stays NaN, also where plain rounding of the bits would carry
                          // into inf (0x7f800001 + rounding) or past the sign (0x7fffffff).
                          {nan, 0x7fc0},
                          {-nan, 0x7fc0},
                          {float_of_bits(0x7f800001u), 0x7fc0},
                          {float_of_bits(0x7fffffffu), 0x7fc0},
                          {float_of_bits(0xffffffffu), 0x7fc0},
                      });
}

// Stochastic rounding to bf16 (stochastic_rounding.hpp): every result is one of f's two bf16
// neighbours; bf16 values (and inf, NaN) come back unchanged; over all 65536 draws each
// neighbour is chosen exactly as often as makes the mean f (counted, so exact, not statistical);
// a negative value mirrors its magnitude (subnormals included); FLT_MAX rounds up to inf with
// the share of its cut-off bits; a NaN stays NaN for every draw, also one whose payload is only
// in the low 16 bits (0x7f800001, which truncation alone would turn into inf); the keyed draws
// are the same for the same coordinates and differ between steps.
TEST(Precision, Bf16StochasticRoundingIsUnbiasedOverEveryDraw) {
  using precision_detail::bits_of;
  std::mt19937 rng(11);
  std::vector<float> values = {1.0f,    -1.0f,  0.0f,     1.00390625f, 1.001f,  -1.001f,
                               3.0e-3f, 1e-30f, -2.5e20f, 0.1f,        65504.0f};
  std::uniform_real_distribution<float> any(-100.0f, 100.0f);
  for (int i = 0; i < 20; ++i) values.push_back(any(rng));
  // Subnormals: the smallest, one with every cut-off bit set, one with bits on both sides of
  // the cut (and its negative), and a bf16 subnormal (exact).
  for (const uint32_t u : {0x00000001u, 0x0000ffffu, 0x00012345u, 0x80012345u, 0x00010000u})
    values.push_back(float_of_bits(u));
  for (const float f : values) {
    SCOPED_TRACE(f);
    const uint32_t top = bits_of(f) >> 16;
    const float down = bf16_to_float(static_cast<uint16_t>(top));     // towards 0
    const float up = bf16_to_float(static_cast<uint16_t>(top + 1u));  // away from 0
    const bool exact = down == f;
    double sum = 0.0;
    uint32_t ups = 0;
    for (uint32_t r = 0; r < 65536u; ++r) {
      const float got = round_bf16_stochastic(f, r | (r << 16));
      if (exact) {
        ASSERT_EQ(bits_of(got), bits_of(f)) << r;
        continue;
      }
      ASSERT_TRUE(got == down || got == up) << r;
      ups += got == up ? 1u : 0u;
      sum += got;
    }
    if (exact) continue;
    EXPECT_EQ(ups, bits_of(f) & 0xffffu);  // the share away from 0 is the cut-off bits / 2^16
    EXPECT_NEAR(sum / 65536.0, static_cast<double>(f), std::abs(static_cast<double>(f)) * 1e-12);
    EXPECT_EQ(float_to_bf16_stochastic(-f, 12345u),
              static_cast<uint16_t>(float_to_bf16_stochastic(f, 12345u) ^ 0x8000u));
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(round_bf16_stochastic(inf, 0xffffu), inf);
  EXPECT_EQ(round_bf16_stochastic(-inf, 0xffffu), -inf);
  EXPECT_TRUE(std::isnan(round_bf16_stochastic(std::numeric_limits<float>::quiet_NaN(), 0xffffu)));
  // FLT_MAX (0x7f7fffff) lies above the largest bf16 (0x7f7f): inf with probability
  // 0xffff / 2^16, else the largest bf16; a NaN with its payload in the low bits stays NaN.
  uint32_t to_inf = 0;
  for (uint32_t r = 0; r < 65536u; ++r) {
    const uint16_t got = float_to_bf16_stochastic(FLT_MAX, r);
    ASSERT_TRUE(got == 0x7f7fu || got == 0x7f80u) << r;
    to_inf += got == 0x7f80u ? 1u : 0u;
    ASSERT_TRUE(std::isnan(round_bf16_stochastic(float_of_bits(0x7f800001u), r))) << r;
    ASSERT_TRUE(std::isnan(round_bf16_stochastic(float_of_bits(0xff800001u), r))) << r;
    ASSERT_EQ(round_bf16_stochastic(inf, r), inf) << r;
  }
  EXPECT_EQ(to_inf, 0xffffu);
  // The keyed draws: a function of (seed, row, column, step), different when any changes.
  EXPECT_EQ(stochastic_rounding_bits(7, 3, 5, 2), stochastic_rounding_bits(7, 3, 5, 2));
  EXPECT_NE(stochastic_rounding_bits(7, 3, 5, 2), stochastic_rounding_bits(7, 3, 5, 3));
  EXPECT_NE(stochastic_rounding_bits(7, 3, 5, 2), stochastic_rounding_bits(7, 3, 6, 2));
  EXPECT_NE(stochastic_rounding_bits(7, 3, 5, 2), stochastic_rounding_bits(7, 4, 5, 2));
  EXPECT_NE(stochastic_rounding_bits(7, 3, 5, 2), stochastic_rounding_bits(8, 3, 5, 2));
  // Their low 16 bits are close to uniform: over 65536 steps of one element, each of 16 buckets
  // of the draw holds 4096 +- 5 sigma (sigma = sqrt(4096 * 15 / 16) = 62).
  std::vector<int> buckets(16, 0);
  for (int64_t step = 0; step < 65536; ++step)
    ++buckets[(stochastic_rounding_bits(7, 3, 5, step) & 0xffffu) >> 12];
  for (int count : buckets) EXPECT_NEAR(count, 4096, 5 * 62);
}

// round_to: the nearest value of the dtype, the identity for fp32.
TEST(Precision, RoundToIsConversionAndBack) {
  for (float f : {0.1f, -3.3f, 1e-6f, 70000.0f, 1.0f + 0x1p-11f}) {
    EXPECT_EQ(round_to(f, Dtype::fp32), f);
    EXPECT_EQ(round_to(f, Dtype::bf16), bf16_to_float(float_to_bf16(f)));
    EXPECT_EQ(round_to(f, Dtype::fp16), fp16_to_float(float_to_fp16(f)));
    EXPECT_EQ(round_to(round_to(f, Dtype::bf16), Dtype::bf16), round_to(f, Dtype::bf16));
  }
  EXPECT_TRUE(std::isinf(round_to(70000.0f, Dtype::fp16)));
}

// ------------------------------------------------------------------ randomized

// Random floats: uniform bit patterns (every exponent, NaNs and infs included) and values
// with an exponent in or around the format's range; every one as a tie between two random
// neighbouring patterns and the floats on either side of that tie.
void check_random(const Format& format, uint32_t seed) {
  const Reference reference(format);
  std::mt19937 random(seed);
  std::uniform_int_distribution<uint32_t> any_bits;
  const int min_exponent = 1 - format.bias() - format.mantissa_bits - 2;
  const int max_exponent = format.bias() + 2;
  std::uniform_int_distribution<int> exponent(min_exponent, max_exponent);
  std::uniform_int_distribution<uint32_t> pattern(0, format.inf_bits() - 1u);
  int failures = 0;
  auto check = [&](float f) {
    const auto same = same_pattern(to_format(f, format), reference.round(f), format, f);
    if (!same && failures++ < 5) ADD_FAILURE() << same.message();
  };
  for (int k = 0; k < 200000; ++k) {
    check(float_of_bits(any_bits(random)));
    // A random significand at a random exponent, either sign.
    const uint32_t bits = any_bits(random);
    const float significand = 1.0f + static_cast<float>(bits & 0x7fffffu) * 0x1p-23f;
    const float magnitude = std::ldexp(significand, exponent(random));
    check((bits >> 31) ? -magnitude : magnitude);
    // The tie between patterns p and p + 1, and its neighbours.
    const float tie = reference.midpoint(static_cast<uint16_t>(pattern(random)));
    for (float f : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, INFINITY)}) {
      check(f);
      check(-f);
    }
  }
  EXPECT_EQ(failures, 0) << format.name;
}

TEST(Precision, Fp16MatchesTheReferenceOnRandomFloats) {
  check_random(kFp16, 12345);
}

TEST(Precision, Bf16MatchesTheReferenceOnRandomFloats) {
  check_random(kBf16, 67890);
}

// ------------------------------------------------------------------ kernels

// The Kokkos kernels give what the scalar functions give, element by element, on values
// that need rounding (and a few special ones).
TEST(Precision, KernelsMatchTheScalarFunctions) {
  const std::size_t rows = 7, cols = 13, count = rows * cols;
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> host("host", rows, cols);
  std::mt19937 random(4242);
  std::uniform_real_distribution<float> uniform(-70000.0f, 70000.0f);
  for (std::size_t k = 0; k < count; ++k) host.data()[k] = uniform(random) * 1e-3f;
  host(0, 0) = 65520.0f;
  host(0, 1) = -0.0f;
  host(0, 2) = 0x1p-25f;
  host(0, 3) = 70000.0f;
  // The bf16 passes run as vectorized loops over the contiguous elements: NaN, the
  // infinities, an fp32 subnormal, fp16 subnormals and ties go through them too.
  host(0, 4) = std::numeric_limits<float>::quiet_NaN();
  host(0, 5) = std::numeric_limits<float>::infinity();
  host(0, 6) = -std::numeric_limits<float>::infinity();
  host(0, 7) = 0x1p-130f;
  host(0, 8) = 1.0f + 0x1p-8f;    // a bf16 tie (to even: 1)
  host(0, 9) = 1.0f + 0x3p-8f;    // a bf16 tie (to even: 1 + 2^-6)
  host(0, 10) = 1.0f + 0x1p-11f;  // an fp16 tie
  host(0, 11) = 0x1.8p-20f;       // an fp16 subnormal
  host(0, 12) = -0x1p-24f;        // fp16's smallest subnormal
  for (Dtype dtype : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
    SCOPED_TRACE(dtype == Dtype::fp32 ? "fp32" : dtype == Dtype::bf16 ? "bf16" : "fp16");
    Matrix src("src", rows, cols), in_place("in_place", rows, cols), copied("copied", rows, cols);
    Kokkos::deep_copy(src, host);
    Kokkos::deep_copy(in_place, host);
    Vector vector("vector", count);
    Kokkos::deep_copy(vector, VectorView(src.data(), count));
    round_in_place(MatrixView(in_place), dtype);
    round_in_place(VectorView(vector), dtype);
    round_copy(src, copied, dtype);
    Kokkos::fence();
    const auto in_place_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), in_place);
    const auto copied_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), copied);
    const auto vector_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), vector);
    for (std::size_t k = 0; k < count; ++k) {
      const float want = round_to(host.data()[k], dtype);
      ASSERT_EQ(bits_of_float(in_place_host.data()[k]), bits_of_float(want)) << k;
      ASSERT_EQ(bits_of_float(copied_host.data()[k]), bits_of_float(want)) << k;
      ASSERT_EQ(bits_of_float(vector_host(k)), bits_of_float(want)) << k;
    }
    if (dtype == Dtype::fp32) continue;
    // pack to 16-bit elements and unpack them again.
    HalfBits packed("packed", count);
    Vector unpacked("unpacked", count);
    pack_16bit(src.data(), packed.data(), count, dtype);
    unpack_16bit(packed.data(), unpacked.data(), count, dtype);
    Kokkos::fence();
    const auto packed_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), packed);
    const auto unpacked_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), unpacked);
    for (std::size_t k = 0; k < count; ++k) {
      ASSERT_EQ(packed_host(k), to_16bit(host.data()[k], dtype)) << k;
      ASSERT_EQ(bits_of_float(unpacked_host(k)), bits_of_float(round_to(host.data()[k], dtype)))
          << k;
    }
  }
}

// pack_16bit, unpack_16bit and round_in_place over many bit patterns: every upper half of an
// fp32 (every sign, exponent, NaN payload and infinity) with lower halves at and around the
// rounding points of bf16 (0x8000: the tie) and fp16 (bit 13's neighbourhood: 0x1000, 0x3000),
// as one contiguous array whose length is no multiple of any vector width and spans several of
// the host passes' chunks (framework/core/host_chunks.hpp): each element must be what the scalar
// functions give, bit for bit, whichever instruction set's clone of the loop the CPU runs.
TEST(Precision, ContiguousPassesMatchTheScalarFunctionsOnEveryUpperHalf) {
  const uint32_t lows[] = {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x2fffu,
                           0x3000u, 0x3001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu};
  constexpr std::size_t kLows = sizeof(lows) / sizeof(lows[0]);
  const std::size_t count = 65536 * kLows + 5;  // + 5: a tail past the vector lanes
  Kokkos::View<float*, Kokkos::HostSpace> host("host", count);
  for (std::size_t k = 0; k < count; ++k) {
    const uint32_t high = static_cast<uint32_t>(k / kLows) & 0xffffu;
    host(k) = float_of_bits((high << 16) | lows[k % kLows]);
  }
  for (Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    SCOPED_TRACE(dtype == Dtype::bf16 ? "bf16" : "fp16");
    Vector src("src", count), rounded("rounded", count), unpacked("unpacked", count);
    HalfBits packed("packed", count);
    Kokkos::deep_copy(src, host);
    Kokkos::deep_copy(rounded, host);
    pack_16bit(src.data(), packed.data(), count, dtype);
    unpack_16bit(packed.data(), unpacked.data(), count, dtype);
    round_in_place(VectorView(rounded), dtype);
    Kokkos::fence();
    const auto packed_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), packed);
    const auto unpacked_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), unpacked);
    const auto rounded_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), rounded);
    for (std::size_t k = 0; k < count; ++k) {
      const uint16_t want = to_16bit(host(k), dtype);
      ASSERT_EQ(packed_host(k), want) << hex(bits_of_float(host(k)), 8);
      ASSERT_EQ(bits_of_float(unpacked_host(k)), bits_of_float(from_16bit(want, dtype)))
          << hex(bits_of_float(host(k)), 8);
      ASSERT_EQ(bits_of_float(rounded_host(k)), bits_of_float(round_to(host(k), dtype)))
          << hex(bits_of_float(host(k)), 8);
    }
  }
}

// round_in_place on a matrix whose rows are not contiguous (a column block of a wider
// matrix: the 2-D fallback, not the contiguous loop) rounds exactly the block's elements, as
// round_to does, and leaves the columns outside it untouched, bit for bit.
TEST(Precision, RoundInPlaceOfAStridedMatrix) {
  const std::size_t rows = 5, cols = 11, first = 3, last = 9;
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> host("host", rows, cols);
  std::mt19937 random(777);
  std::uniform_real_distribution<float> uniform(-70000.0f, 70000.0f);
  for (std::size_t k = 0; k < rows * cols; ++k) host.data()[k] = uniform(random) * 1e-3f;
  host(0, first) = 65520.0f;
  host(0, first + 1) = std::numeric_limits<float>::quiet_NaN();
  host(0, first + 2) = 1.0f + 0x1p-8f;   // a bf16 tie
  host(0, first + 3) = 1.0f + 0x1p-11f;  // an fp16 tie
  host(0, first + 4) = 0x1.8p-20f;       // an fp16 subnormal
  host(0, first + 5) = -70000.0f;
  for (Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
    SCOPED_TRACE(dtype == Dtype::bf16 ? "bf16" : "fp16");
    Matrix full("full", rows, cols);
    Kokkos::deep_copy(full, host);
    MatrixView block = Kokkos::subview(MatrixView(full), Kokkos::ALL, std::make_pair(first, last));
    ASSERT_FALSE(block.span_is_contiguous());  // else this would not test the fallback
    round_in_place(block, dtype);
    Kokkos::fence();
    const auto out = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), full);
    for (std::size_t i = 0; i < rows; ++i) {
      for (std::size_t j = 0; j < cols; ++j) {
        const bool inside = j >= first && j < last;
        const float want = inside ? round_to(host(i, j), dtype) : host(i, j);
        ASSERT_EQ(bits_of_float(out(i, j)), bits_of_float(want)) << i << ", " << j;
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
