#pragma once
// Column blocks of a matrix [rows, n * cols] and their contiguous form [n][rows][cols]: what a
// collective over dim 1 sends (a reduce-scatter hands rank j block j) and receives (an
// all-gather's blocks arrive in rank order). Elements of any type: floats, or 16-bit bits.
// Function templates, not lambdas in member functions: nvcc refuses a device lambda in a private
// member. Neither fences: the caller does, where the next reader needs it.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <string>

#include "framework/core/exec_space.hpp"

namespace meshtrain {

// Column block j of `from` (rows `row_stride` elements apart) into block j of `to`.
template <class T>
void stage_column_blocks(const T* from, int64_t row_stride, T* to, int64_t n, int64_t rows,
                         int64_t cols, const std::string& label) {
  Kokkos::parallel_for(
      label, Kokkos::MDRangePolicy<Kokkos::Rank<3>>(device_space(), {0, 0, 0}, {n, rows, cols}),
      KOKKOS_LAMBDA(const int64_t j, const int64_t row, const int64_t cc) {
        to[(j * rows + row) * cols + cc] = from[row * row_stride + j * cols + cc];
      });
}

// The inverse: block j of `from` into column block j of `to` (rows `row_stride` elements apart).
template <class T>
void place_column_blocks(const T* from, T* to, int64_t row_stride, int64_t n, int64_t rows,
                         int64_t cols, const std::string& label) {
  Kokkos::parallel_for(
      label, Kokkos::MDRangePolicy<Kokkos::Rank<3>>(device_space(), {0, 0, 0}, {n, rows, cols}),
      KOKKOS_LAMBDA(const int64_t j, const int64_t row, const int64_t cc) {
        to[row * row_stride + j * cols + cc] = from[(j * rows + row) * cols + cc];
      });
}

}  // namespace meshtrain
