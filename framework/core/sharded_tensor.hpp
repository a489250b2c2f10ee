#pragma once
// A distributed tensor: a global shape, the spec that splits it over the mesh, and the
// block this rank holds. The block is stored flat (row-major over the local shape), so
// code that treats every parameter alike (init, optimizers, checkpoints, clipping) needs
// no rank-specific views; layers view it as 2-D with matrix().

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/views.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

struct ShardedTensor {
  std::string name;  // '/'-joined, e.g. "layers/0/weight"
  std::vector<int64_t> global_shape;
  PartitionSpec spec;  // storage layout
  ShardBox box;        // the block this rank holds
  Vector local;        // box.elements() values, row-major over box.extent

  // Allocates the local block of `rank` (zero-filled); the label is the name.
  static ShardedTensor allocate(const std::string& name, const std::vector<int64_t>& global_shape,
                                const PartitionSpec& spec, const Mesh& mesh, int rank) {
    ShardedTensor t;
    t.name = name;
    t.global_shape = global_shape;
    t.spec = spec;
    t.box = shard_box(global_shape, spec, mesh, rank);
    t.local = Vector(name, static_cast<size_t>(t.box.elements()));
    return t;
  }

  // The local block as a matrix (2-D tensors; a 1-D tensor is one row).
  MatrixView matrix() const {
    const size_t rows = box.extent.size() == 2 ? static_cast<size_t>(box.extent[0]) : 1;
    const size_t cols = box.extent.empty() ? 1 : static_cast<size_t>(box.extent.back());
    return MatrixView(local.data(), rows, cols);
  }
};

}  // namespace meshtrain
