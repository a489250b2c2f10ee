#pragma once
// Branch-free float32 exp and tanh for the activation kernels (docs/model_math.md,
// "Activations"). glibc's expf and tanhf are scalar calls: a loop that calls them runs one
// element at a time, and tanhf (through expm1f) took most of a tanh model's step. These are
// plain arithmetic, bit operations and selects, so GCC vectorizes the loops that call them at
// the build's ISA (SSE2 on generic x86-64, no -march needed), and the same code runs on the
// host and the device.
//
// Accuracy against float64 over a dense sweep of float32 (every 257th bit pattern, every
// exponent; tests/layers/activation_fast_math_test.cpp, which fails when a bound is broken):
// exp at most 1 ulp (measured 0.96), tanh at most 2 ulps (measured 1.30).
// Special values as glibc's: exp(+inf) = +inf, exp(-inf) = 0, exp overflows to +inf for
// x > 88.7228 and underflows through the subnormals to 0 below -103.97; tanh saturates to
// +-1 exactly for large |x| (and for +-inf), keeps the sign of zero; NaN gives NaN.
//
// Not -ffast-math safe: exp's rounding of x log2(e) to an integer uses the 1.5 * 2^23 trick,
// which reassociation would fold away.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>

namespace meshtrain::fast_math {

namespace detail {

KOKKOS_FORCEINLINE_FUNCTION float float_from_bits(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);  // a register move; vectorizes as one
  return value;
#endif
}

// 2^n for -126 <= n <= 127, built from its exponent bits.
KOKKOS_FORCEINLINE_FUNCTION float pow2(int32_t n) {
  return float_from_bits((n + 127) << 23);
}

}  // namespace detail

// e^x: x = n ln2 + r, |r| <= ln2 / 2 (n rounded to nearest; ln2 in two parts, Cody and Waite,
// so r is exact to a few bits beyond float), e^r by Cephes' expf polynomial (degree 7, its
// error well under an ulp), then times 2^n in two factors 2^(n/2) 2^(n - n/2), each a normal
// float, so that e^r 2^(n/2) is exact and the last product rounds once: into the subnormals
// correctly, and to +inf on overflow.
KOKKOS_FORCEINLINE_FUNCTION float exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // 9 bits: n kLn2Hi is exact for |n| <= 2^15
  constexpr float kLn2Lo = -2.12194440e-4f;
  // 1.5 * 2^23: adding and subtracting it rounds to an integer.
  constexpr float kRound = 12582912.0f;
  // Below -104 the result is 0 and above 89 +inf either way; clamping keeps n in range. NaN
  // passes the clamps (its comparisons are false) and is replaced by 0 for n alone, so no
  // float-to-int conversion sees it; r stays NaN, and so the result.
  // Two selects, each of its own comparison: nested, the second comparison would run only on
  // one arm, and GCC (trapping math, its default) does not vectorize a conditional comparison.
  const float above_low = x < -104.0f ? -104.0f : x;
  const float clamped = above_low > 89.0f ? 89.0f : above_low;
  const float finite = clamped == clamped ? clamped : 0.0f;
  const float n_float = (finite * kLog2e + kRound) - kRound;
  const float r = (clamped - n_float * kLn2Hi) - n_float * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = (p * (r * r) + r) + 1.0f;
  const auto n = static_cast<int32_t>(n_float);  // -150 .. 129
  const int32_t half = n / 2;
  return (e_r * detail::pow2(half)) * detail::pow2(n - half);
}

// tanh(x) for |x| < kSmall: x + x^3 P(x^2), P a near-minimax fit of degree 4 in x^2
// (relative-weighted least squares on Chebyshev nodes; under an ulp before rounding). Above:
// 1 - 2 / (e^(2|x|) + 1) with tanh's sign, whose result is at least tanh(0.625) = 0.55, so the
// subtraction loses nothing; it rounds to exactly +-1 for |x| >= 9.01 (as tanhf).
KOKKOS_FORCEINLINE_FUNCTION float tanh(float x) {
  constexpr float kSmall = 0.625f;
  const float a = x < 0.0f ? -x : x;
  // The polynomial's argument: x where it is used, else 0 (no overflow exception from x^3).
  const float xs = a < kSmall ? x : 0.0f;
  const float w = xs * xs;
  float p = -5.718962755e-03f;
  p = p * w + 2.065312490e-02f;
  p = p * w + -5.374465883e-02f;
  p = p * w + 1.333151311e-01f;
  p = p * w + -3.333328664e-01f;
  // x itself at +-0: the polynomial's term would turn -0 into +0.
  const float small = a == 0.0f ? x : xs + xs * w * p;
  // tanh(40) rounds to 1 as any larger |x|'s: capping the argument keeps e^(2|x|) finite, so
  // no overflow exception is raised (glibc's tanhf raises none).
  const float capped = a > 40.0f ? 40.0f : a;
  const float big_abs = 1.0f - 2.0f / (fast_math::exp(2.0f * capped) + 1.0f);
  const float big = x < 0.0f ? -big_abs : big_abs;
  // NaN: a < kSmall is false, and big is NaN (e^NaN).
  return a < kSmall ? small : big;
}

}  // namespace meshtrain::fast_math
