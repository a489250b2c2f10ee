#pragma once
// Stochastic rounding to bf16 (docs/recsys.md, "bf16 tables"): what the sparse table optimizers
// write into a table kept in bf16 (layers/sparse_optimizer.hpp). A value is rounded to one of
// its two bf16 neighbours at random, towards each with the probability that makes the expected
// result the value itself, so an update smaller than half a bf16 step still moves a row on
// average (round to nearest would drop it every time: a row at 1.0 ignores any step below
// 2^-9). The random bits are Philox-4x32-10 (framework/core/philox.hpp) of the element's global
// coordinates and the update's index, so the draw is the same on every mesh, in any order, and
// again after a resume that restores the index (the fp32 value it rounds may still differ from
// one mesh to another where a gradient's sum changes order). Header-only and device-callable.

#include <Kokkos_Core.hpp>
#include <cstdint>

#include "framework/core/philox.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {

// f's magnitude rounded up to the next bf16 with probability (|f| - lower) / (upper - lower),
// down otherwise; `random`'s low 16 bits are the uniform draw: added to the 16 bits bf16 cuts
// off, the sum truncated (FBGEMM's and torch's recipe). A bf16 value comes back unchanged
// whatever `random`; NaN stays NaN and inf stays inf; a finite f above the largest bf16 may
// round to inf. NaN needs its branch (a payload in the low bits alone would truncate to inf);
// inf does not: its low 16 bits are zero, so the sum truncates back to inf whatever the draw.
KOKKOS_INLINE_FUNCTION uint16_t float_to_bf16_stochastic(float f, uint32_t random) {
  const uint32_t u = precision_detail::bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((u + (random & 0xffffu)) >> 16);
}

// Table t's stream of draws under a run's rounding `seed`: the seed mixed with the table's
// index (t + 1 times the golden-ratio constant), so that tables draw independently.
KOKKOS_INLINE_FUNCTION constexpr uint64_t table_rounding_seed(uint64_t seed, uint64_t t) {
  return seed ^ ((t + 1) * 0x9E3779B97F4A7C15ull);
}

// The draw for element (row, column) of a table at update `step` under `seed` (a run's seed
// mixed with the table's index): Philox of (row, column, step) keyed by the seed's two halves.
KOKKOS_INLINE_FUNCTION uint32_t stochastic_rounding_bits(uint64_t seed, int64_t row, int64_t column,
                                                         int64_t step) {
  const Philox4x32Counter counter{{static_cast<uint32_t>(row),
                                   static_cast<uint32_t>(static_cast<uint64_t>(row) >> 32),
                                   static_cast<uint32_t>(column), static_cast<uint32_t>(step)}};
  const Philox4x32Key key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
  return philox4x32_10(counter, key).word[0];
}

// f stochastically rounded to bf16 and widened back (exactly) to fp32.
KOKKOS_INLINE_FUNCTION float round_bf16_stochastic(float f, uint32_t random) {
  return bf16_to_float(float_to_bf16_stochastic(f, random));
}

}  // namespace meshtrain
