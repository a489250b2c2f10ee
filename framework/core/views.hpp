#pragma once
// The Kokkos View types of meshtrain, one name per idea:
//   Vector, Matrix              owning, row-major (LayoutRight), float
//   VectorView, MatrixView      non-owning views of someone else's floats (a tensor's
//                               block, a layer's output, a batch): what functions take
//   Const*View                  the same, read-only
//   DoubleVectorView            doubles, for reductions of scalars (loss sums, norms,
//                               counts) that float would round
// 2-D views may be row-strided (a column block of a LayoutRight matrix obtained with
// Kokkos::subview(m, rows, cols) keeps LayoutRight with stride(0) > extent(1)); operations
// that need contiguous memory check span_is_contiguous() and say so.

#include <Kokkos_Core.hpp>

#include "base/device_memory_emulation.hpp"

namespace meshtrain {

using Vector = Kokkos::View<float*, Kokkos::LayoutRight>;
using Matrix = Kokkos::View<float**, Kokkos::LayoutRight>;

using VectorView =
    Kokkos::View<float*, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using ConstVectorView =
    Kokkos::View<const float*, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using MatrixView =
    Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using ConstMatrixView =
    Kokkos::View<const float**, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
// Doubles, for reductions of scalars (loss sums, norms, counts) that float would round.
using DoubleVectorView =
    Kokkos::View<double*, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// Host memory that device copies go through: pinned (page-locked) with a CUDA Kokkos, so
// copies run at full speed and may be asynchronous; plain host memory otherwise. The one
// choice for every staging buffer (MPI staging, batches, checkpoints).
#if defined(KOKKOS_ENABLE_CUDA)
using HostStagingSpace = Kokkos::CudaHostPinnedSpace;
#else
using HostStagingSpace = Kokkos::HostSpace;
#endif

// True when the default memory space is device memory the host cannot dereference (CUDA):
// host code then reaches it only through explicit copies.
inline constexpr bool kDeviceMemoryIsHostInaccessible =
    !Kokkos::SpaceAccessibility<Kokkos::HostSpace,
                                Kokkos::DefaultExecutionSpace::memory_space>::accessible;

// True when host code must treat the default memory space as apart from the host's: on a
// GPU, and on a CPU when device memory is emulated (the environment variable
// MESHTRAIN_EMULATE_DEVICE_MEMORY=1, base/device_memory_emulation.hpp; the tests registered
// EMULATED run so), which makes every host mirror its own allocation and stages MPI and
// checkpoints through host buffers exactly where a CUDA build does, so that a missing
// deep_copy (or a read of a mirror before it) gives wrong results on the CPU too.
inline bool device_memory_is_separate() {
  if constexpr (kDeviceMemoryIsHostInaccessible) {
    return true;
  } else {
    return device_memory_emulated();
  }
}

// The host copy of `view` that host code reads and writes (Kokkos::deep_copy between the
// two): the view itself where memory is shared, a separate allocation where it is not (the
// one place meshtrain makes host mirrors).
template <class View>
typename View::HostMirror host_mirror(const View& view) {
  if (device_memory_is_separate()) {
    return Kokkos::create_mirror(view);
  } else {
    return Kokkos::create_mirror_view(view);
  }
}

}  // namespace meshtrain
