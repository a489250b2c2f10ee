// Device memory emulated on a CPU is a run-time switch (base/device_memory_emulation.hpp): the
// environment variable MESHTRAIN_EMULATE_DEVICE_MEMORY=1 makes the same program treat host
// memory as a GPU's. Registered EMULATED, so ctest runs it both ways (<name>_mpi_np<n> without
// the variable, <name>_emulated_np<n> with it), and each run checks that every place that
// decides on it (host mirrors, MPI staging, checkpoint staging, device spans) follows the
// environment the run was given.

#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>
#include <string>

#include "base/device_memory_emulation.hpp"
#include "base/error.hpp"
#include "framework/comm/backends/host_staging.hpp"
#include "framework/core/views.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/observe/device_timer.hpp"

namespace meshtrain {
namespace {

// What this run was given, read here independently of the library.
bool run_emulates() {
  const char* value = std::getenv("MESHTRAIN_EMULATE_DEVICE_MEMORY");
  return value != nullptr && std::string(value) == "1";
}

// The emulated registration is given the variable and the others are not (ctest sets
// MESHTRAIN_TEST_REGISTRATION; a run by hand has none and checks nothing here). Without this,
// a registration that lost the variable would pass as the plain one.
TEST(DeviceMemoryEmulation, TheRegistrationGivesTheVariable) {
  const char* registration = std::getenv("MESHTRAIN_TEST_REGISTRATION");
  if (registration == nullptr) GTEST_SKIP() << "not run by ctest";
  EXPECT_EQ(run_emulates(), std::string(registration) == "emulated")
      << "registration " << registration;
  EXPECT_EQ(device_memory_is_separate(),
            kDeviceMemoryIsHostInaccessible || std::string(registration) == "emulated");
}

TEST(DeviceMemoryEmulation, ValuesOfTheVariable) {
  EXPECT_FALSE(device_memory_emulation_from(nullptr));
  EXPECT_FALSE(device_memory_emulation_from(""));
  EXPECT_FALSE(device_memory_emulation_from("0"));
  EXPECT_TRUE(device_memory_emulation_from("1"));
  try {
    device_memory_emulation_from("yes");
    FAIL() << "'yes' was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    EXPECT_NE(std::string(e.what()).find("MESHTRAIN_EMULATE_DEVICE_MEMORY is 'yes'"),
              std::string::npos)
        << e.what();
  }
}

TEST(DeviceMemoryEmulation, FollowsTheEnvironment) {
  if (kDeviceMemoryIsHostInaccessible) GTEST_SKIP() << "device memory is real here";
  const bool emulated = run_emulates();
  EXPECT_EQ(device_memory_emulated(), emulated);
  EXPECT_EQ(device_memory_is_separate(), emulated);
}

TEST(DeviceMemoryEmulation, HostMirrorIsItsOwnAllocationWhenEmulated) {
  if (kDeviceMemoryIsHostInaccessible) GTEST_SKIP() << "device memory is real here";
  Vector device("device", 4);
  Kokkos::deep_copy(device, 1.0f);
  auto host = host_mirror(device);
  EXPECT_EQ(host.data() != device.data(), run_emulates());
  // Emulating, a write to the mirror reaches the "device" only through a deep_copy.
  host(0) = 2.0f;
  auto check = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), device);
  EXPECT_EQ(check(0), run_emulates() ? 1.0f : 2.0f);
  Kokkos::deep_copy(device, host);
  Kokkos::deep_copy(check, device);
  EXPECT_EQ(check(0), 2.0f);
}

TEST(DeviceMemoryEmulation, MpiAndCheckpointsStageWhenEmulated) {
  if (kDeviceMemoryIsHostInaccessible) GTEST_SKIP() << "device memory is real here";
  const bool emulated = run_emulates();
  Vector device("device", 4);
  HostStaging staging;
  EXPECT_EQ(HostStaging::stages(), emulated);
  EXPECT_EQ(staging.send_buffer(device.data(), 4) != device.data(), emulated);
  EXPECT_EQ(staging.receive_buffer(device.data(), 4, false) != device.data(), emulated);
  // A synchronous save stages its tensors where device memory is separate.
  EXPECT_EQ(checkpoint_stages_tensors(/*async=*/false), emulated);
  EXPECT_TRUE(checkpoint_stages_tensors(/*async=*/true));
}

TEST(DeviceMemoryEmulation, DeviceSpansTimedWhenEmulated) {
  if (kDeviceMemoryIsHostInaccessible) GTEST_SKIP() << "device memory is real here";
  EXPECT_EQ(device_timer::enabled(), run_emulates());
}

}  // namespace
}  // namespace meshtrain
