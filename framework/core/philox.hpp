#pragma once
// Philox-4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011), the counter-based generator of Random123, cuRAND and JAX: a keyed bijection of a
// 128-bit counter, so any element's random bits are computed from its own coordinates alone,
// on any device, in any order. Header-only and device-callable (KOKKOS_INLINE_FUNCTION);
// checked against Random123's published known-answer vectors (tests/core/philox_test.cpp).

#include <Kokkos_Core.hpp>
#include <cstdint>

namespace meshtrain {

struct Philox4x32Counter {
  uint32_t word[4];
};
struct Philox4x32Key {
  uint32_t word[2];
};

namespace philox_detail {
constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // the key bump of each round (golden ratio)
constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

KOKKOS_INLINE_FUNCTION void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}
}  // namespace philox_detail

// The 10-round Philox-4x32 of `counter` under `key` (Random123's philox4x32(ctr, key)).
KOKKOS_INLINE_FUNCTION Philox4x32Counter philox4x32_10(Philox4x32Counter counter,
                                                       Philox4x32Key key) {
  using namespace philox_detail;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.word[0] += kWeyl0;
      key.word[1] += kWeyl1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMultiplier0, counter.word[0], hi0, lo0);
    mulhilo(kMultiplier1, counter.word[2], hi1, lo1);
    counter = Philox4x32Counter{
        {hi1 ^ counter.word[1] ^ key.word[0], lo1, hi0 ^ counter.word[3] ^ key.word[1], lo0}};
  }
  return counter;
}

}  // namespace meshtrain
