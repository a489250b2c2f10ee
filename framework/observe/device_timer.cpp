#include "framework/observe/device_timer.hpp"

// Kokkos' configuration first: a CUDA build or a host one. A host build times device spans
// only when it emulates device memory (base/device_memory_emulation.hpp, a run-time switch);
// the communication thread's ThreadSanitizer test compiles this file without the Kokkos
// library (MESHTRAIN_DEVICE_TIMER_WITHOUT_KOKKOS), and then never does.
#include <Kokkos_Macros.hpp>

#include <cmath>

#include "base/device_memory_emulation.hpp"
#include "base/error.hpp"
#include "framework/observe/trace.hpp"

#if !defined(MESHTRAIN_DEVICE_TIMER_WITHOUT_KOKKOS)
#define MESHTRAIN_DEVICE_TIMER_HAS_QUEUE 1
#include <Kokkos_Core.hpp>
#include <string>
#endif
#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace meshtrain::device_timer {

std::vector<int64_t> marker_times(int64_t reference_ns, const std::vector<float>& elapsed_ms) {
  std::vector<int64_t> ns(elapsed_ms.size());
  double since_reference_ns = 0.0;  // exact to well under a nanosecond for days
  for (std::size_t i = 0; i < elapsed_ms.size(); ++i) {
    since_reference_ns += static_cast<double>(elapsed_ms[i]) * 1e6;
    ns[i] = reference_ns + std::llround(since_reference_ns);
  }
  return ns;
}

#if defined(MESHTRAIN_DEVICE_TIMER_HAS_QUEUE)
namespace {
// The device's work queue. A default-constructed instance refers to Kokkos' default instance
// (on CUDA its one stream), the same queue as framework/core/exec_space.hpp's device_space()
// on which every kernel and GEMM runs; the timer keeps its own handle so that observe/ needs
// nothing of core/. Made at the first reserve(), outside the steps (constructing an instance
// allocates in Kokkos 4).
const Kokkos::DefaultExecutionSpace& work_queue() {
  static const Kokkos::DefaultExecutionSpace space;
  return space;
}
}  // namespace
#endif

#if defined(KOKKOS_ENABLE_CUDA)

namespace {

void check_cuda(cudaError_t code, const char* call) {
  if (code != cudaSuccess) {
    MESHTRAIN_FAIL("device spans of the trace: ", call, " failed: ", cudaGetErrorString(code));
  }
}

// The events, made at the first window and kept for the process (a window reuses them).
// reference: recorded and waited for at reserve(), when the host clock read reference_ns.
struct Markers {
  std::vector<cudaEvent_t> events;
  cudaEvent_t reference = nullptr;
  int64_t reference_ns = 0;
  std::size_t recorded = 0;
};

Markers& markers() {
  static Markers instance;
  return instance;
}

}  // namespace

bool enabled() {
  return true;
}

void reserve(std::size_t count) {
  Markers& m = markers();
  if (m.reference == nullptr) check_cuda(cudaEventCreate(&m.reference), "cudaEventCreate");
  while (m.events.size() < count) {
    cudaEvent_t event = nullptr;
    check_cuda(cudaEventCreate(&event), "cudaEventCreate");
    m.events.push_back(event);
  }
  m.recorded = 0;
  check_cuda(cudaEventRecord(m.reference, work_queue().cuda_stream()), "cudaEventRecord");
  check_cuda(cudaEventSynchronize(m.reference), "cudaEventSynchronize");
  m.reference_ns = Tracer::now_ns();
}

int32_t record() {
  Markers& m = markers();
  if (m.recorded >= m.events.size()) return -1;
  // An error here (a broken context) surfaces at resolve(); a span must not throw.
  cudaEventRecord(m.events[m.recorded], work_queue().cuda_stream());
  return static_cast<int32_t>(m.recorded++);
}

std::vector<int64_t> resolve() {
  Markers& m = markers();
  // From the previous marker, not from the reference (marker_times): the markers are on one
  // stream, in order.
  std::vector<float> elapsed_ms(m.recorded, 0.0f);
  cudaEvent_t previous = m.reference;
  for (std::size_t i = 0; i < m.recorded; ++i) {
    check_cuda(cudaEventSynchronize(m.events[i]), "cudaEventSynchronize");
    check_cuda(cudaEventElapsedTime(&elapsed_ms[i], previous, m.events[i]), "cudaEventElapsedTime");
    previous = m.events[i];
  }
  return marker_times(m.reference_ns, elapsed_ms);
}

#elif defined(MESHTRAIN_DEVICE_TIMER_HAS_QUEUE)

// Host memory, emulated as a device's or not (the run-time switch): a marker is the host clock
// after a fence of the device space.
namespace {
std::vector<int64_t> marker_ns;  // reserved at reserve(); the tracing thread's only
}  // namespace

bool enabled() {
  return device_memory_emulated();
}

void reserve(std::size_t count) {
  if (!enabled()) return;
  (void)work_queue();
  marker_ns.clear();
  marker_ns.reserve(count);
}

int32_t record() {
  // Without emulation nothing was reserved: capacity 0, no marker.
  if (marker_ns.size() >= marker_ns.capacity()) return -1;
#if KOKKOS_VERSION >= 30500
  static const std::string label("meshtrain::trace_device_marker");  // no allocation per marker
  work_queue().fence(label);
#else
  work_queue().fence();
#endif
  marker_ns.push_back(Tracer::now_ns());
  return static_cast<int32_t>(marker_ns.size() - 1);
}

std::vector<int64_t> resolve() {
  return marker_ns;
}

#else

bool enabled() {
  return false;
}
void reserve(std::size_t) {}
int32_t record() {
  return -1;
}
std::vector<int64_t> resolve() {
  return {};
}

#endif

}  // namespace meshtrain::device_timer
