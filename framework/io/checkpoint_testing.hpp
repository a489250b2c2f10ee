#pragma once
// Test-only: a hook that the checkpoint save calls at named points, so that tests can make a
// save fail (throw) or die (abort, kill) at a chosen point on a chosen rank. Only test code
// includes this header, and it is not installed: the hook exists only in the test build of
// checkpoint_save.cpp (the object library meshtrain_checkpoint_faults, tests/checkpoint.cmake,
// compiled with MESHTRAIN_CHECKPOINT_FAULTS), which a test program links ahead of
// meshtrain_framework so that it replaces the library's checkpoint_save.cpp. The library
// (meshtrain, the installed package) has no hook: its points are empty. No environment
// variable is read.
//
// Points, with `count`: "prepare" (0; main thread, before the file is created),
// "before_snapshot" (0; writer, before the tensors are staged), "snapshot" (0; writer, after
// the tensors are staged), "after_dataset" (datasets this rank has written so far; writer),
// "before_close" (0; writer, before fsync), "before_rename", "before_latest",
// "before_cleanup" (0; rank 0, main thread, while completing the save), "snapshot_wait" (0;
// main thread, in wait_snapshot() with a save in flight, before it waits).

#include <cstdint>

#ifndef MESHTRAIN_CHECKPOINT_FAULTS
#error "checkpoint_testing.hpp is for test programs linking meshtrain_checkpoint_faults"
#endif

namespace meshtrain {

using CheckpointFaultHook = void (*)(const char* point, int64_t count);

// Installs `hook` for this process (nullptr removes it). Not thread safe against a save in
// flight: install it before the first save.
void set_checkpoint_fault_hook(CheckpointFaultHook hook);

}  // namespace meshtrain
