#include "framework/core/exec_space.hpp"

namespace meshtrain {

namespace exec_space_detail {
std::atomic<void (*)(const char*)> fence_observer{nullptr};
}  // namespace exec_space_detail

// With CUDA, the default instance runs on the stream Kokkos 4 made for it at initialize
// (cudaStreamCreate in Cuda::impl_initialize, Kokkos 4.6.99), which a CUDA graph can capture; the
// legacy default stream could not be (StepGraph's CUDA backend refuses it). Not a stream of
// meshtrain's own: every kernel, the device timer's events (framework/observe/device_timer.cpp,
// on a default instance) and View initialization stay on the one stream they were on.
const Kokkos::DefaultExecutionSpace& device_space() {
  static const Kokkos::DefaultExecutionSpace space;
  return space;
}

const Kokkos::DefaultHostExecutionSpace& host_space() {
  static const Kokkos::DefaultHostExecutionSpace space;
  return space;
}

}  // namespace meshtrain
