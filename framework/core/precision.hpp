#pragma once
// The 16-bit formats of mixed precision (base/dtype.hpp), as raw bits:
//   bf16  1 sign, 8 exponent, 7 mantissa bits: the top half of an fp32 (same range)
//   fp16  IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits, max 65504, subnormals
// Conversions from fp32 round to nearest, ties to even, as CUDA's __float2bfloat16_rn and
// __float2half_rn and PyTorch's .to(): NaN stays a (quiet) NaN, fp16 overflows to inf.
//
// Values between cast points live in fp32 buffers holding exactly representable 16-bit
// values (round_to); communication moves 16-bit elements, and a plain MLP keeps the
// activations backward needs as 16-bit elements (HalfMatrix; docs/mixed_precision.md).

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "base/dtype.hpp"
#include "framework/core/views.hpp"

namespace meshtrain {

namespace precision_detail {
KOKKOS_INLINE_FUNCTION uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
KOKKOS_INLINE_FUNCTION float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace precision_detail

KOKKOS_INLINE_FUNCTION uint16_t float_to_bf16(float f) {
  const uint32_t u = precision_detail::bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

KOKKOS_INLINE_FUNCTION float bf16_to_float(uint16_t h) {
  return precision_detail::float_of(static_cast<uint32_t>(h) << 16);
}

// After F. Giesen's float_to_half_fast3_rtne: subnormal results come out of one fp32
// addition that aligns the 10 mantissa bits at the bottom (rounding to nearest even). All
// three cases are computed and one selected, without branches, so loops vectorize.
KOKKOS_INLINE_FUNCTION uint16_t float_to_fp16(float f) {
  using namespace precision_detail;
  const uint32_t all = bits_of(f);
  const uint32_t sign = all & 0x80000000u;
  const uint32_t u = all ^ sign;
  const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t special = u > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN stays NaN, else inf
  const uint32_t subnormal = bits_of(float_of(u) + float_of(magic)) - magic;
  // Rebias and round; a carry into exponent 31 gives inf, as it should.
  const uint32_t normal =
      (u + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t out = u >= (127u + 16u) << 23  // |f| >= 65536: inf, or NaN
                           ? special
                           : (u < 113u << 23 ? subnormal : normal);  // below 2^-14: subnormal
  return static_cast<uint16_t>(out | (sign >> 16));
}

KOKKOS_INLINE_FUNCTION float fp16_to_float(uint16_t h) {
  using namespace precision_detail;
  const uint32_t shifted_exponent = 0x7c00u << 13;
  const uint32_t u = ((static_cast<uint32_t>(h) & 0x7fffu) << 13) + ((127u - 15u) << 23);
  const uint32_t exponent = (static_cast<uint32_t>(h) << 13) & shifted_exponent;
  const float normal = float_of(u);
  const float inf_or_nan = float_of(u + ((128u - 16u) << 23));
  // Zero or subnormal: renormalized through one subtraction.
  const float subnormal = float_of(u + (1u << 23)) - float_of(113u << 23);
  const float f = exponent == shifted_exponent ? inf_or_nan : (exponent == 0 ? subnormal : normal);
  return float_of(bits_of(f) | ((static_cast<uint32_t>(h) & 0x8000u) << 16));
}

KOKKOS_INLINE_FUNCTION uint16_t to_16bit(float f, Dtype dtype) {
  return dtype == Dtype::bf16 ? float_to_bf16(f) : float_to_fp16(f);
}
KOKKOS_INLINE_FUNCTION float from_16bit(uint16_t h, Dtype dtype) {
  return dtype == Dtype::bf16 ? bf16_to_float(h) : fp16_to_float(h);
}
// f rounded to the nearest `dtype` value (f itself for fp32).
KOKKOS_INLINE_FUNCTION float round_to(float f, Dtype dtype) {
  return dtype == Dtype::fp32 ? f : from_16bit(to_16bit(f, dtype), dtype);
}

// The same conversions with the format fixed at compile time (no branch on the dtype: what a
// loop that should vectorize calls).
template <Dtype dtype>
KOKKOS_INLINE_FUNCTION uint16_t to_16bit_as(float f) {
  static_assert(dtype != Dtype::fp32, "to_16bit_as: a 16-bit format");
  if constexpr (dtype == Dtype::bf16) {
    return float_to_bf16(f);
  } else {
    return float_to_fp16(f);
  }
}
template <Dtype dtype>
KOKKOS_INLINE_FUNCTION float from_16bit_as(uint16_t h) {
  static_assert(dtype != Dtype::fp32, "from_16bit_as: a 16-bit format");
  if constexpr (dtype == Dtype::bf16) {
    return bf16_to_float(h);
  } else {
    return fp16_to_float(h);
  }
}
template <Dtype dtype>
KOKKOS_INLINE_FUNCTION float round_as(float f) {
  return from_16bit_as<dtype>(to_16bit_as<dtype>(f));
}

// out[k] = a[k] + b[k] on the host for count 16-bit elements of `dtype` (bf16 or fp16): added in
// fp32 and rounded once to 16 bits, as NCCL's 16-bit sums do (the MPI backend's wire sums: its
// ring and its MPI user operation). out may be a or b (element by element in place); no other
// overlap. Per-ISA clones (precision.cpp), the same bits in each.
void add_16bit(uint16_t* out, const uint16_t* a, const uint16_t* b, std::size_t count, Dtype dtype);

// Bits of 16-bit elements in the default memory space (what communication moves).
using HalfBits = Kokkos::View<uint16_t*, Kokkos::LayoutRight>;

// Matrices of 16-bit elements (the bits of a bf16 or fp16 value; which one is the caller's
// Dtype), row-major: the activations a 16-bit model keeps for backward.
using HalfMatrix = Kokkos::View<uint16_t**, Kokkos::LayoutRight>;
using HalfMatrixView =
    Kokkos::View<uint16_t**, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using ConstHalfMatrixView =
    Kokkos::View<const uint16_t**, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// In place: every element rounded to `dtype` (nothing for fp32). Labelled kernels.
void round_in_place(VectorView data, Dtype dtype);
void round_in_place(MatrixView data, Dtype dtype);
// dst = src rounded to `dtype` (a copy for fp32); same extents.
void round_copy(ConstMatrixView src, MatrixView dst, Dtype dtype);
// One pass: dst = src rounded to `dtype` (16-bit) and kept = its 16-bit bits; same extents,
// dst and kept contiguous.
void round_copy_keeping_16bit(ConstMatrixView src, MatrixView dst, HalfMatrixView kept,
                              Dtype dtype);
// dst = the fp32 values of the 16-bit elements src (exact); same extents, both contiguous.
void widen_16bit(ConstHalfMatrixView src, MatrixView dst, Dtype dtype);
// dst[k] = to_16bit(src[k]) (pack) and src[k]'s fp32 value (unpack); count elements,
// contiguous. src and dst must not overlap (the loops assume them disjoint, precision.cpp).
void pack_16bit(const float* src, uint16_t* dst, std::size_t count, Dtype dtype);
// dst [r, n*c] = the fp32 values of n gathered blocks [n][r][c] of 16-bit elements (block j at
// columns j*c), in one pass: a weight all-gathered on its columns as 16 bits, widened in place.
void widen_gathered_columns(const uint16_t* blocks, MatrixView dst, int n, Dtype dtype);
void unpack_16bit(const uint16_t* src, float* dst, std::size_t count, Dtype dtype);

}  // namespace meshtrain
