#pragma once
// Memory of this process as a run measures it against its plan (docs/running.md, "Memory
// against the plan"):
// - Kokkos allocations, through Kokkos' allocate / deallocate tool callbacks: the live bytes
//   of every memory space (HostSpace, CudaSpace, CudaHostPinnedSpace, ...) and their
//   high-water mark, and every live allocation's label, bytes and space (a fixed table in
//   static storage: the callbacks never allocate, lock a spin lock and return).
// - The host: the process's peak and current resident set (VmHWM, VmRSS).
//
// Kokkos keeps one callback of each kind. install_memory_tracker() chains the ones it finds
// (a test's counting callback still sees every allocation); a program that later sets its own
// replaces the tracker's until install_memory_tracker() runs again. Allocations made while the
// tracker was not installed are not counted, and their deallocations are ignored (the tracker
// only subtracts what it added), so the figures stay a lower bound; kokkos_memory() says so.

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain {

// One live Kokkos allocation.
struct TrackedAllocation {
  std::string label;  // the View's label (cut at 47 characters)
  std::string space;  // Kokkos' name of its memory space ("Host", "Cuda", ...)
  int64_t bytes = 0;
  const void* data = nullptr;  // the View's data() (a run matches its own tensors by it)
};

// Bytes of one memory space.
struct SpaceMemory {
  std::string space;
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;  // high-water mark since the peak was last reset
};

struct KokkosMemory {
  int64_t live_bytes = 0;  // every space together
  int64_t peak_bytes = 0;  // high-water mark of that sum since the peak was last reset
  std::vector<SpaceMemory> spaces;
  std::vector<TrackedAllocation> largest;  // live allocations, largest first
  // False when some allocations since reset_kokkos_peak() went uncounted: the tracker was
  // replaced by another callback for a while, or more allocations were live than its table
  // holds.
  bool complete = true;
};

// Installs (or reinstalls) the tracker's callbacks, chaining the callbacks set before it.
// Call outside any step: it may allocate nothing, but it reads Kokkos' callback set.
void install_memory_tracker();
bool memory_tracker_installed();
// The high-water marks start again from the live bytes, and `complete` from true (a run
// measures its own peak, and whether it missed any of its own allocations).
void reset_kokkos_peak();
// The tracker's figures now, with the `largest` live allocations (at most every live one the
// table holds). Allocates (the strings and the list):
// call outside the step.
KokkosMemory kokkos_memory(int largest = 8);

struct HostMemory {
  int64_t peak_rss_bytes = 0;     // VmHWM (getrusage's ru_maxrss where /proc is missing)
  int64_t current_rss_bytes = 0;  // VmRSS (0 where /proc is missing)
};
HostMemory host_memory();

}  // namespace meshtrain
