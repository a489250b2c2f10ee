#include "framework/core/exec_space.hpp"

namespace meshtrain {

const Kokkos::DefaultExecutionSpace& device_space() {
  static const Kokkos::DefaultExecutionSpace space;
  return space;
}

const Kokkos::DefaultHostExecutionSpace& host_space() {
  static const Kokkos::DefaultHostExecutionSpace space;
  return space;
}

}  // namespace meshtrain
