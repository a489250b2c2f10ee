#include "framework/core/precision.hpp"

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/host_chunks.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision_sums.hpp"

namespace meshtrain {

namespace {
using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

// The element-wise passes below run one loop per 16-bit format, the format a template
// argument: a contiguous loop with no per-element branch on the dtype, which the compiler
// vectorizes (the dtype compared inside the loop kept the bf16 passes scalar). The values
// are those of to_16bit / from_16bit / round_to, bit for bit.
//
// Where the default execution space is the host's (host_chunks.hpp), the loops run as per-ISA
// clones (host_clones.hpp, without FMA contraction: the fp16 conversions' one float addition or
// subtraction is the same IEEE operation in every clone; the bf16 ones are integer arithmetic),
// so 16 lanes on AVX-512 where the baseline runs 4; the same bits, the same one labelled kernel.
// pack_span and unpack_span's source and destination must not overlap (precision.hpp): they
// are of different types (float, uint16_t), so under strict aliasing the compiler may assume
// them disjoint and vectorize without a run-time overlap check.
template <Dtype dtype>
MESHTRAIN_INLINE void round_span(float* data, int64_t count) {
  for (int64_t k = 0; k < count; ++k) data[k] = round_as<dtype>(data[k]);
}
template <Dtype dtype>
MESHTRAIN_INLINE void pack_span(const float* src, uint16_t* dst, int64_t count) {
  for (int64_t k = 0; k < count; ++k) dst[k] = to_16bit_as<dtype>(src[k]);
}
template <Dtype dtype>
MESHTRAIN_INLINE void unpack_span(const uint16_t* src, float* dst, int64_t count) {
  for (int64_t k = 0; k < count; ++k) dst[k] = from_16bit_as<dtype>(src[k]);
}

// [[maybe_unused]]: a GPU build (kDefaultSpaceIsHost false) compiles them and calls none.
[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void round_host(float* data, int64_t count,
                                                             bool bf16) {
  if (bf16) {
    round_span<Dtype::bf16>(data, count);
  } else {
    round_span<Dtype::fp16>(data, count);
  }
}
[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void pack_host(const float* src, uint16_t* dst,
                                                            int64_t count, bool bf16) {
  if (bf16) {
    pack_span<Dtype::bf16>(src, dst, count);
  } else {
    pack_span<Dtype::fp16>(src, dst, count);
  }
}
[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void unpack_host(const uint16_t* src, float* dst,
                                                              int64_t count, bool bf16) {
  if (bf16) {
    unpack_span<Dtype::bf16>(src, dst, count);
  } else {
    unpack_span<Dtype::fp16>(src, dst, count);
  }
}

template <Dtype dtype>
void round_contiguous(float* data, int64_t count) {
  const std::string& label = MESHTRAIN_LABEL("meshtrain::round_to_dtype");
  if constexpr (kDefaultSpaceIsHost) {
    for_host_chunks(label, count, [=](int64_t begin, int64_t end) {
      round_host(data + begin, end - begin, dtype == Dtype::bf16);
    });
  } else {
    Kokkos::parallel_for(
        label, device_range(0, count),
        KOKKOS_LAMBDA(const int64_t k) { data[k] = round_as<dtype>(data[k]); });
  }
}

template <Dtype dtype>
void pack_as(const float* src, uint16_t* dst, int64_t count) {
  const std::string& label = MESHTRAIN_LABEL("meshtrain::pack_16bit");
  if constexpr (kDefaultSpaceIsHost) {
    for_host_chunks(label, count, [=](int64_t begin, int64_t end) {
      pack_host(src + begin, dst + begin, end - begin, dtype == Dtype::bf16);
    });
  } else {
    Kokkos::parallel_for(
        label, device_range(0, count),
        KOKKOS_LAMBDA(const int64_t k) { dst[k] = to_16bit_as<dtype>(src[k]); });
  }
}

template <Dtype dtype>
void unpack_as(const uint16_t* src, float* dst, int64_t count) {
  const std::string& label = MESHTRAIN_LABEL("meshtrain::unpack_16bit");
  if constexpr (kDefaultSpaceIsHost) {
    for_host_chunks(label, count, [=](int64_t begin, int64_t end) {
      unpack_host(src + begin, dst + begin, end - begin, dtype == Dtype::bf16);
    });
  } else {
    Kokkos::parallel_for(
        label, device_range(0, count),
        KOKKOS_LAMBDA(const int64_t k) { dst[k] = from_16bit_as<dtype>(src[k]); });
  }
}

void round_contiguous(float* data, int64_t count, Dtype dtype) {
  if (dtype == Dtype::bf16) {
    round_contiguous<Dtype::bf16>(data, count);
  } else if (dtype == Dtype::fp16) {
    round_contiguous<Dtype::fp16>(data, count);
  }
}

}  // namespace

void round_in_place(VectorView data, Dtype dtype) {
  // A LayoutRight rank-1 view has stride 1: always contiguous (no strided fallback).
  if (dtype == Dtype::fp32) return;
  round_contiguous(data.data(), static_cast<int64_t>(data.extent(0)), dtype);
}

void round_in_place(MatrixView data, Dtype dtype) {
  if (dtype == Dtype::fp32) return;
  if (data.span_is_contiguous()) {
    round_contiguous(data.data(), static_cast<int64_t>(data.extent(0) * data.extent(1)), dtype);
    return;
  }
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::round_to_dtype"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(data.extent(0)), static_cast<int64_t>(data.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        data(i, j) = round_to(data(i, j), dtype);
      });
}

void round_copy(ConstMatrixView src, MatrixView dst, Dtype dtype) {
  MESHTRAIN_REQUIRE(src.extent(0) == dst.extent(0) && src.extent(1) == dst.extent(1),
                    "round_copy: source [", src.extent(0), ", ", src.extent(1),
                    "] and destination [", dst.extent(0), ", ", dst.extent(1), "] differ");
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::round_copy"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) { dst(i, j) = round_to(src(i, j), dtype); });
}

void round_copy_keeping_16bit(ConstMatrixView src, MatrixView dst, HalfMatrixView kept,
                              Dtype dtype) {
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32 && src.extent(0) == dst.extent(0) &&
                        src.extent(1) == dst.extent(1) && kept.extent(0) == dst.extent(0) &&
                        kept.extent(1) == dst.extent(1) && dst.span_is_contiguous() &&
                        kept.span_is_contiguous(),
                    "round_copy_keeping_16bit: a 16-bit dtype and [", src.extent(0), ", ",
                    src.extent(1), "] contiguous destinations of the same extents are needed");
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::round_copy_keeping_16bit"),
      Range2(device_space(), {0, 0},
             {static_cast<int64_t>(dst.extent(0)), static_cast<int64_t>(dst.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const uint16_t bits = to_16bit(src(i, j), dtype);
        kept(i, j) = bits;
        dst(i, j) = from_16bit(bits, dtype);
      });
}

void widen_16bit(ConstHalfMatrixView src, MatrixView dst, Dtype dtype) {
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32 && src.extent(0) == dst.extent(0) &&
                        src.extent(1) == dst.extent(1) && src.span_is_contiguous() &&
                        dst.span_is_contiguous(),
                    "widen_16bit: a 16-bit dtype and contiguous [", src.extent(0), ", ",
                    src.extent(1), "] views of the same extents are needed");
  const uint16_t* from = src.data();
  float* to = dst.data();
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::widen_16bit"),
      device_range(0, static_cast<int64_t>(dst.extent(0) * dst.extent(1))),
      KOKKOS_LAMBDA(const int64_t k) { to[k] = from_16bit(from[k], dtype); });
}

template <Dtype dtype>
MESHTRAIN_INLINE void add_16bit_span(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                     std::size_t count) {
  for (std::size_t k = 0; k < count; ++k) {
    out[k] = to_16bit_as<dtype>(from_16bit_as<dtype>(a[k]) + from_16bit_as<dtype>(b[k]));
  }
}

// Without FMA contraction: one float addition, then the integer rounding of to_16bit_as.
MESHTRAIN_HOST_CLONES_EXACT
void add_bf16(uint16_t* out, const uint16_t* a, const uint16_t* b, std::size_t count) noexcept {
  add_16bit_span<Dtype::bf16>(out, a, b, count);
}

MESHTRAIN_HOST_CLONES_EXACT
void add_fp16(uint16_t* out, const uint16_t* a, const uint16_t* b, std::size_t count) noexcept {
  add_16bit_span<Dtype::fp16>(out, a, b, count);
}

void add_16bit(uint16_t* out, const uint16_t* a, const uint16_t* b, std::size_t count,
               Dtype dtype) {
  if (dtype == Dtype::bf16) {
    add_bf16(out, a, b, count);
  } else {
    MESHTRAIN_REQUIRE(dtype == Dtype::fp16, "add_16bit: the dtype must be bf16 or fp16, not fp32");
    add_fp16(out, a, b, count);
  }
}

void pack_16bit(const float* src, uint16_t* dst, std::size_t count, Dtype dtype) {
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32, "pack_16bit: fp32 is not a 16-bit format");
  if (dtype == Dtype::bf16) {
    pack_as<Dtype::bf16>(src, dst, static_cast<int64_t>(count));
  } else {
    pack_as<Dtype::fp16>(src, dst, static_cast<int64_t>(count));
  }
}

void unpack_16bit(const uint16_t* src, float* dst, std::size_t count, Dtype dtype) {
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32, "unpack_16bit: fp32 is not a 16-bit format");
  if (dtype == Dtype::bf16) {
    unpack_as<Dtype::bf16>(src, dst, static_cast<int64_t>(count));
  } else {
    unpack_as<Dtype::fp16>(src, dst, static_cast<int64_t>(count));
  }
}

void widen_gathered_columns(const uint16_t* blocks, MatrixView dst, int n, Dtype dtype) {
  const int64_t r = static_cast<int64_t>(dst.extent(0));
  const int64_t c = static_cast<int64_t>(dst.extent(1)) / n;
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32 && n >= 1 &&
                        c * n == static_cast<int64_t>(dst.extent(1)) && dst.span_is_contiguous(),
                    "widen_gathered_columns: [", dst.extent(0), ", ", dst.extent(1),
                    "] is not a contiguous matrix of ", n, " column blocks, or fp32");
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::widen_gathered_columns"),
      Kokkos::MDRangePolicy<Kokkos::Rank<3>>(device_space(), {0, 0, 0},
                                             {static_cast<int64_t>(n), r, c}),
      KOKKOS_LAMBDA(const int64_t j, const int64_t row, const int64_t cc) {
        dst(row, j * c + cc) = from_16bit(blocks[(j * r + row) * c + cc], dtype);
      });
}

}  // namespace meshtrain
