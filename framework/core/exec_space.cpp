#include "framework/core/exec_space.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>

#include "base/error.hpp"
#endif

namespace meshtrain {

namespace exec_space_detail {
std::atomic<void (*)(const char*)> fence_observer{nullptr};
}  // namespace exec_space_detail

#if defined(KOKKOS_ENABLE_CUDA)
namespace {
// The stream of device_space(): created once, after Kokkos::initialize picked the device, and
// never destroyed (the instance is destroyed after Kokkos::finalize, at exit). Non-blocking:
// the legacy default stream (another thread's synchronous cudaMemcpy) does not wait for it,
// nor it for that, so a capture of it is not invalidated by such work; meshtrain orders its
// copies with fences (copy_view) and events (NCCL), never through the legacy stream.
cudaStream_t make_device_stream() {
  cudaStream_t stream = nullptr;
  const cudaError_t code = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (code != cudaSuccess) {
    MESHTRAIN_FAIL("device_space: cudaStreamCreateWithFlags failed: ", cudaGetErrorString(code),
                   " (", cudaGetErrorName(code), ")");
  }
  return stream;
}
}  // namespace

const Kokkos::DefaultExecutionSpace& device_space() {
  static const Kokkos::DefaultExecutionSpace space(make_device_stream(),
                                                   Kokkos::Impl::ManageStream::no);
  return space;
}
#else
const Kokkos::DefaultExecutionSpace& device_space() {
  static const Kokkos::DefaultExecutionSpace space;
  return space;
}
#endif

const Kokkos::DefaultHostExecutionSpace& host_space() {
  static const Kokkos::DefaultHostExecutionSpace space;
  return space;
}

}  // namespace meshtrain
