#include "framework/core/view_ops.hpp"

#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"

namespace meshtrain {
namespace {

Kokkos::MDRangePolicy<Kokkos::Rank<2>> every_element(const MatrixView& m) {
  return Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
      device_space(), {0, 0},
      {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))});
}

}  // namespace

void set_zero(MatrixView m) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::set_zero"), every_element(m),
      KOKKOS_LAMBDA(const int64_t r, const int64_t c) { m(r, c) = 0.0f; });
}

void copy_into(MatrixView dst, ConstMatrixView src) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::copy_into"), every_element(dst),
      KOKKOS_LAMBDA(const int64_t r, const int64_t c) { dst(r, c) = src(r, c); });
}

}  // namespace meshtrain
