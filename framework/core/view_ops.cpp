#include "framework/core/view_ops.hpp"

#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"

namespace meshtrain {
namespace {

// Made before main, not at a first call that may come inside a step.
const std::string copy_fence_before = "meshtrain::copy_view: before";
const std::string copy_fence_after = "meshtrain::copy_view: after";
const std::string fill_kernel = "meshtrain::fill_view";

Kokkos::MDRangePolicy<Kokkos::Rank<2>> every_element(const MatrixView& m) {
  return Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
      device_space(), {0, 0},
      {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))});
}

}  // namespace

void view_ops_detail::fence_before_copy() { fence_all(copy_fence_before); }
void view_ops_detail::fence_after_copy() { fence_all(copy_fence_after); }
const std::string& view_ops_detail::fill_label() { return fill_kernel; }

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
