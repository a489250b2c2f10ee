#pragma once
// Trace spans as the device saw them (issue 28): a marker put into the device's work queue at
// a span's start and one at its end, read back on the host's steady clock after the trace
// window. On a CUDA build a marker is a CUDA event recorded on the stream of Kokkos' default
// execution space (the one cuBLAS and every kernel use), so a GEMM's device span is the time
// the GPU ran it, not the time the host took to launch it. A CPU build has no work queue and
// no device spans, except where it emulates device memory (MESHTRAIN_EMULATE_DEVICE_MEMORY=1,
// base/device_memory_emulation.hpp): there a marker is the host clock after a fence of the
// device space, so that the CPU tests read the device track a GPU build writes.
//
// Used by the tracing thread only (framework/observe/trace.hpp).

#include <cstddef>
#include <cstdint>
#include <vector>

namespace meshtrain::device_timer {

// Whether this build (or, on a CPU, this process) times device spans.
bool enabled();

// Makes room for `markers` markers and takes the reference point (at the trace window's
// start, outside the steps). Throws a runtime Error when the device refuses.
void reserve(std::size_t markers);

// Puts the next marker into the device's queue; its index, or -1 when none is left (or this
// build has none). Allocates nothing.
int32_t record();

// The host steady-clock nanoseconds of every marker recorded since reserve(), in order;
// waits until the device has passed them. Throws a runtime Error when the device fails.
std::vector<int64_t> resolve();

// The host steady-clock nanoseconds of markers from the device's elapsed times (resolve() on
// a CUDA build): `reference_ns` the host clock at the reference marker, `elapsed_ms[i]` the
// device's milliseconds from marker i - 1 (the reference for i = 0) to marker i, as
// cudaEventElapsedTime gives them (a float). Each is measured from the previous marker and
// summed in double: a float of milliseconds since the window's start steps by about 4 us
// after 64 s (2^16 ms) and would put spans of a long window a few microseconds off.
std::vector<int64_t> marker_times(int64_t reference_ns, const std::vector<float>& elapsed_ms);

}  // namespace meshtrain::device_timer
