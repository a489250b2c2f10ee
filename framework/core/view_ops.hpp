#pragma once
// Zeroing and copying matrices inside the training step. Kokkos::deep_copy does the same,
// but the kernels it launches for a scalar or a row-strided view carry labels that Kokkos 3.4
// turns into a std::string (a heap allocation) at every call; these kernels label themselves
// once (kernel_label.hpp: at their first call, which should come before the first step).

#include "framework/core/views.hpp"

namespace meshtrain {

// m = 0.
void set_zero(MatrixView m);
// dst = src (same extents; either may be row-strided).
void copy_into(MatrixView dst, ConstMatrixView src);

}  // namespace meshtrain
