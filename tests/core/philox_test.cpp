// Philox-4x32-10 against Random123's published known-answer vectors (the "philox4x32 10"
// lines of tests/kat_vectors in https://github.com/DEShawResearch/random123, v1.14.0):
// counter words 0-3, key words 0-1, expected output words 0-3. Run on the host and in a
// Kokkos kernel (the device path on a GPU build).

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cstdint>

#include "framework/core/philox.hpp"

namespace meshtrain {
namespace {

struct KnownAnswer {
  Philox4x32Counter counter;
  Philox4x32Key key;
  uint32_t expected[4];
};

const KnownAnswer kVectors[] = {
    {{{0x00000000u, 0x00000000u, 0x00000000u, 0x00000000u}},
     {{0x00000000u, 0x00000000u}},
     {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
     {{0xffffffffu, 0xffffffffu}},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
     {{0xa4093822u, 0x299f31d0u}},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};

TEST(Philox, KnownAnswerVectorsOnTheHost) {
  for (const KnownAnswer& v : kVectors) {
    const Philox4x32Counter out = philox4x32_10(v.counter, v.key);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(out.word[w], v.expected[w]) << "word " << w;
  }
}

// A free function, not the test body: nvcc rejects an extended lambda inside a TEST body
// (a private member function of the generated test class).
void philox_in_a_kernel(Kokkos::View<const uint32_t* [6]> in, Kokkos::View<uint32_t* [4]> out) {
  Kokkos::parallel_for(
      "meshtrain::philox_test", Kokkos::RangePolicy<>(0, in.extent(0)), KOKKOS_LAMBDA(const int i) {
        const Philox4x32Counter c{{in(i, 0), in(i, 1), in(i, 2), in(i, 3)}};
        const Philox4x32Key k{{in(i, 4), in(i, 5)}};
        const Philox4x32Counter r = philox4x32_10(c, k);
        for (int w = 0; w < 4; ++w) out(i, w) = r.word[w];
      });
}

TEST(Philox, KnownAnswerVectorsInAKernel) {
  constexpr int n = 3;
  Kokkos::View<uint32_t* [6]> in("philox_in", n);
  Kokkos::View<uint32_t* [4]> out("philox_out", n);
  auto in_host = Kokkos::create_mirror_view(in);
  for (int i = 0; i < n; ++i) {
    for (int w = 0; w < 4; ++w) in_host(i, w) = kVectors[i].counter.word[w];
    for (int w = 0; w < 2; ++w) in_host(i, 4 + w) = kVectors[i].key.word[w];
  }
  Kokkos::deep_copy(in, in_host);
  philox_in_a_kernel(in, out);
  auto out_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
  for (int i = 0; i < n; ++i) {
    for (int w = 0; w < 4; ++w) EXPECT_EQ(out_host(i, w), kVectors[i].expected[w]);
  }
}

}  // namespace
}  // namespace meshtrain
