#pragma once
// The test programs' checkpoint fault hook (framework/checkpoint_testing.hpp), configured by
// environment variables that only these test programs read:
//   MESHTRAIN_TEST_FAULT=<point>[:<count>]          where (a point of checkpoint_testing.hpp)
//   MESHTRAIN_TEST_FAULT_RANK=<rank>                only on that world rank (default: all)
//   MESHTRAIN_TEST_FAULT_ACTION=abort|kill|throw    abort() (default), SIGKILL, or throw
// Each prints "fault injected at <point>:<count> (<action>)" to stderr first.

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "framework/io/checkpoint_testing.hpp"

namespace meshtrain::testing {

struct FaultSetting {
  std::string point;
  int64_t count = 0;
  std::string action = "abort";
};

inline FaultSetting& fault_setting() {
  static FaultSetting setting;
  return setting;
}

inline void fault_hook(const char* point, int64_t count) {
  const FaultSetting& f = fault_setting();
  if (f.point != point || f.count != count) return;
  std::fprintf(stderr, "fault injected at %s:%lld (%s)\n", point, static_cast<long long>(count),
               f.action.c_str());
  std::fflush(stderr);
  if (f.action == "throw") throw std::runtime_error("fault injected at " + f.point);
  if (f.action == "kill") raise(SIGKILL);
  std::abort();
}

// Installs the hook on `rank` when the environment asks for it.
inline void install_fault_hook_from_environment(int rank) {
  const char* point = std::getenv("MESHTRAIN_TEST_FAULT");
  if (point == nullptr || point[0] == '\0') return;
  const char* only = std::getenv("MESHTRAIN_TEST_FAULT_RANK");
  if (only != nullptr && only[0] != '\0' && std::atoi(only) != rank) return;
  FaultSetting& f = fault_setting();
  if (const char* action = std::getenv("MESHTRAIN_TEST_FAULT_ACTION")) f.action = action;
  f.point = point;
  const size_t colon = f.point.find(':');
  if (colon != std::string::npos) {
    f.count = std::stoll(f.point.substr(colon + 1));
    f.point.resize(colon);
  }
  set_checkpoint_fault_hook(fault_hook);
}

}  // namespace meshtrain::testing
