#pragma once
// Whether this CPU process emulates device memory: the environment variable
// MESHTRAIN_EMULATE_DEVICE_MEMORY=1 (unset or 0: no). With it, host code treats Kokkos' host
// memory as if it were a GPU's (framework/core/views.hpp's device_memory_is_separate: every
// host mirror its own allocation, MPI and checkpoints staged through host buffers, device
// spans timed after a fence), so that a missing deep_copy fails on a CPU too. A run-time
// switch rather than a build option, so one build runs the tests both ways (docs/testing.md).
// Read once per process: every rank of a job gets mpirun's environment.

#include <cstdlib>
#include <string>

#include "base/error.hpp"

namespace meshtrain {

// What a value of MESHTRAIN_EMULATE_DEVICE_MEMORY means (null: unset); throws a bad-input
// Error for anything but unset, empty, 0 or 1.
inline bool device_memory_emulation_from(const char* value) {
  if (value == nullptr || std::string(value).empty() || std::string(value) == "0") return false;
  if (std::string(value) == "1") return true;
  MESHTRAIN_BAD_INPUT("the environment variable MESHTRAIN_EMULATE_DEVICE_MEMORY is '", value,
                      "'; it must be 0 or 1");
}

// Whether this process emulates device memory (the environment read at the first call).
inline bool device_memory_emulated() {
  static const bool emulated =
      device_memory_emulation_from(std::getenv("MESHTRAIN_EMULATE_DEVICE_MEMORY"));
  return emulated;
}

}  // namespace meshtrain
