#pragma once
// Element-wise passes over host memory run as per-ISA clones (host_clones.hpp), where the
// default execution space is the host's (Serial, OpenMP): one labelled Kokkos kernel on the
// host space whose iterations are chunks of elements, each handed to a plain loop that the
// clone compiles 16 lanes wide on AVX-512 (the build's baseline runs 4). Tools see the same one
// kernel, with the same label, as the device_range parallel_for it stands for; no fence is
// needed since the two spaces are one type (inference::fence_after_host_kernel's reasoning).

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "framework/core/exec_space.hpp"

namespace meshtrain {

// Elements per chunk: 64 KB of floats, so that an OpenMP build splits a large pass over its
// threads and a chunk's loop is long enough for the vector lanes.
constexpr int64_t kHostChunk = 16384;

// body(begin, end) for the chunks [begin, end) of [0, count), as one kernel labelled `label` on
// the host execution space. Only where kDefaultSpaceIsHost (exec_space.hpp).
template <class Body>
void for_host_chunks(const std::string& label, int64_t count, const Body& body) {
  const int64_t chunks = (count + kHostChunk - 1) / kHostChunk;
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, chunks),
      [=](const int64_t c) {
        const int64_t begin = c * kHostChunk;
        body(begin, std::min(count, begin + kHostChunk));
      });
}

}  // namespace meshtrain
