#pragma once
// The layer tests' view of a sharded tensor as the single-rank reference sees it: every
// value in double, gathered to the full shape on every rank.

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "partition/mesh.hpp"

namespace meshtrain::testing {

using Tensor = std::vector<double>;

// This rank's block, in double.
inline Tensor to_host(const ShardedTensor& t) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.local);
  return Tensor(h.data(), h.data() + h.extent(0));
}

// The full tensor from every rank's block: the replica with coordinate 0 on the axes the
// spec does not name writes its block, the rest add zeros. Collective over MPI_COMM_WORLD.
inline Tensor gather_full(const ShardedTensor& t, const Mesh& mesh, int rank) {
  int64_t total = 1;
  for (auto d : t.global_shape) total *= d;
  Tensor full(total, 0.0);
  const auto named = t.spec.axes();
  bool writer = true;
  for (const auto& a : mesh.axes()) {
    const bool in_spec = std::find(named.begin(), named.end(), a.name) != named.end();
    if (!in_spec && mesh.coordinate(rank, a.name) != 0) writer = false;
  }
  if (writer) {
    const Tensor local = to_host(t);
    const bool matrix = t.global_shape.size() == 2;
    const int64_t cols = matrix ? t.global_shape[1] : 1;
    const int64_t lcols = matrix ? t.box.extent[1] : 1;
    for (int64_t i = 0; i < static_cast<int64_t>(local.size()); ++i) {
      if (matrix) {
        full[(i / lcols + t.box.offset[0]) * cols + i % lcols + t.box.offset[1]] = local[i];
      } else {
        full[i + t.box.offset[0]] = local[i];
      }
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, full.data(), static_cast<int>(total), MPI_DOUBLE, MPI_SUM,
                MPI_COMM_WORLD);
  return full;
}

}  // namespace meshtrain::testing
