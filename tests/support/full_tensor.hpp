#pragma once
// Sharded tensors and layer inputs and outputs as a single-rank reference sees them: every
// value in double, gathered to the full shape on every rank (gather_full), or filled block by
// block from a function of the global index (fill_global, block_matrix), so that every mesh
// holds the same global values.

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "framework/core/views.hpp"
#include "partition/mesh.hpp"

namespace meshtrain::testing {

using Tensor = std::vector<double>;

// This rank's block, in double.
inline Tensor to_host(const ShardedTensor& t) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.local);
  return Tensor(h.data(), h.data() + h.extent(0));
}

// A matrix (a layer's output or input gradient, possibly a strided view of the default memory
// space), row-major in double.
inline Tensor host_matrix(MatrixView m) {
  Matrix copy("copy", m.extent(0), m.extent(1));
  Kokkos::deep_copy(copy, m);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), copy);
  return Tensor(h.data(), h.data() + h.span());
}

// A [rows, cols] matrix of the default memory space whose element (i, j) is value(row0 + i,
// col0 + j), rounded to float: a rank's block of a global input or output gradient.
template <class ValueOf>
Matrix block_matrix(const std::string& label, int64_t rows, int64_t cols, int64_t row0,
                    int64_t col0, ValueOf&& value) {
  Matrix m(label, rows, cols);
  auto h = Kokkos::create_mirror_view(m);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) h(i, j) = static_cast<float>(value(row0 + i, col0 + j));
  Kokkos::deep_copy(m, h);
  return m;
}

// The global flat index (row-major over global_shape) of each element of this rank's block
// (row-major over box.extent), for a tensor of any rank.
inline std::vector<int64_t> global_indices(const ShardedTensor& t) {
  const size_t rank = t.global_shape.size();
  int64_t count = 1;
  for (size_t d = 0; d < rank; ++d) count *= t.box.extent[d];
  std::vector<int64_t> out(static_cast<size_t>(count));
  std::vector<int64_t> index(rank, 0);
  for (int64_t l = 0; l < count; ++l) {
    int64_t rest = l, flat = 0;
    for (size_t d = rank; d-- > 0;) {
      index[d] = rest % t.box.extent[d];
      rest /= t.box.extent[d];
    }
    for (size_t d = 0; d < rank; ++d) flat = flat * t.global_shape[d] + index[d] + t.box.offset[d];
    out[static_cast<size_t>(l)] = flat;
  }
  return out;
}

// Sets every element of this rank's block to value(global flat index), rounded to float.
template <class ValueOfIndex>
void fill_global(ShardedTensor& t, ValueOfIndex&& value) {
  auto h = Kokkos::create_mirror_view(t.local);
  const std::vector<int64_t> flat = global_indices(t);
  for (size_t l = 0; l < flat.size(); ++l) h(l) = static_cast<float>(value(flat[l]));
  Kokkos::deep_copy(t.local, h);
}

// The full tensor from every rank's block: the replica with coordinate 0 on the axes the
// spec does not name writes its block, the rest add zeros. `rank` is this process's rank in
// `mesh`, whose ranks are those of `comm`. Collective over `comm`.
inline Tensor gather_full(const ShardedTensor& t, const Mesh& mesh, int rank,
                          MPI_Comm comm = MPI_COMM_WORLD) {
  int64_t total = 1;
  for (auto d : t.global_shape) total *= d;
  Tensor full(static_cast<size_t>(total), 0.0);
  const auto named = t.spec.axes();
  bool writer = true;
  for (const auto& a : mesh.axes()) {
    const bool in_spec = std::find(named.begin(), named.end(), a.name) != named.end();
    if (!in_spec && mesh.coordinate(rank, a.name) != 0) writer = false;
  }
  if (writer) {
    const Tensor local = to_host(t);
    const std::vector<int64_t> flat = global_indices(t);
    for (size_t l = 0; l < flat.size(); ++l) full[static_cast<size_t>(flat[l])] = local[l];
  }
  MPI_Allreduce(MPI_IN_PLACE, full.data(), static_cast<int>(total), MPI_DOUBLE, MPI_SUM, comm);
  return full;
}

// Rows row0 .. row0 + rows - 1 of a global [*, width] tensor, as this rank's float input.
inline Matrix rows_of(const std::string& label, const Tensor& full, int64_t width, int64_t row0,
                      int64_t rows) {
  Matrix m(label, rows, width);
  auto h = Kokkos::create_mirror_view(m);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < width; ++j) h(i, j) = static_cast<float>(full[(row0 + i) * width + j]);
  Kokkos::deep_copy(m, h);
  return m;
}

}  // namespace meshtrain::testing
