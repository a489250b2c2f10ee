#pragma once
// Zeroing, filling and copying views inside the training step. Kokkos::deep_copy does the same,
// but the kernels it launches for a scalar or a row-strided view carry labels that Kokkos 3.4
// turns into a std::string (a heap allocation) at every call; these kernels label themselves
// once (kernel_label.hpp: at their first call, which should come before the first step).

#include <string>
#include <type_traits>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/views.hpp"

namespace meshtrain {

// m = 0.
void set_zero(MatrixView m);
// dst = src (same extents; either may be row-strided).
void copy_into(MatrixView dst, ConstMatrixView src);

namespace view_ops_detail {
// The global fences and the fill kernel's label of the templates below, made once for all
// their instantiations (a MESHTRAIN_LABEL in a template is made at the first call of each
// instantiation, which may come inside a step or a Predictor call).
void fence_before_copy();
void fence_after_copy();
const std::string& fill_label();
}  // namespace view_ops_detail

// dst = src with the synchronization of the two-argument Kokkos::deep_copy(dst, src): a global
// fence (every queued kernel, copy and stream), the copy, a global fence. Without its heap
// allocations under Kokkos 4 (exec_space.hpp): the copy runs on a long-lived instance, and
// the fences carry labels made once. Copies touching device memory run on device_space()
// (an asynchronous cudaMemcpy on Kokkos' stream, no fence of its own); copies between host
// buffers on host_space() (a memcpy on a Serial host space).
template <class Dst, class Src>
void copy_view(const Dst& dst, const Src& src) {
  view_ops_detail::fence_before_copy();
  if constexpr (std::is_same_v<typename Dst::memory_space, Kokkos::HostSpace> &&
                std::is_same_v<typename Src::memory_space, Kokkos::HostSpace>) {
    Kokkos::deep_copy(host_space(), dst, src);
  } else {
    Kokkos::deep_copy(device_space(), dst, src);
  }
  view_ops_detail::fence_after_copy();
}

// Every element of a contiguous view in the default memory space = value, with the
// synchronization of the two-argument Kokkos::deep_copy(view, value) (global fences before
// and after) and a kernel label made once.
template <class View>
void fill_view(const View& view, typename View::const_value_type value) {
  static_assert(
      std::is_same_v<typename View::memory_space, Kokkos::DefaultExecutionSpace::memory_space>,
      "fill_view: the view must be in the default memory space");
  MESHTRAIN_REQUIRE(view.span_is_contiguous(), "fill_view: the view is not contiguous");
  const Kokkos::View<typename View::non_const_value_type*, typename View::memory_space,
                     Kokkos::MemoryTraits<Kokkos::Unmanaged>>
      flat(view.data(), view.span());
  view_ops_detail::fence_before_copy();
  Kokkos::parallel_for(
      view_ops_detail::fill_label(), device_range(0, static_cast<int64_t>(flat.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) { flat(i) = value; });
  view_ops_detail::fence_after_copy();
}

}  // namespace meshtrain
