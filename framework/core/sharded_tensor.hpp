#pragma once
// A distributed tensor: a global shape, the spec that splits it over the mesh, and the
// block this rank holds. The block is stored flat (row-major over the local shape), so
// code that treats every parameter alike (init, optimizers, checkpoints, clipping) needs
// no rank-specific views; layers view it as 2-D with matrix().

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/precision.hpp"  // HalfBits
#include "framework/core/views.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

// Mixed precision's 16-bit compute copy of a parameter's local block (docs/mixed_precision.md,
// "Compute and memory on this build"): round_P(master) as 16-bit bits, written by the optimizer
// in the pass that updates the master. `current` says whether it holds the master's present
// values: the optimizer sets it; whoever may have written the master some other way (init, a
// checkpoint load, ZeRO-1's gather: anyone who took the model's parameters to write) clears it,
// and the next use casts the master again (refresh_16bit_copy). Shared by every copy of the
// ShardedTensor (a model sharing another's parameters uses the same copy).
struct SixteenBitCopy {
  HalfBits bits;
  Dtype dtype = Dtype::bf16;
  bool current = false;
};

struct ShardedTensor {
  std::string name;  // '/'-joined, e.g. "layers/0/weight"
  std::vector<int64_t> global_shape;
  PartitionSpec spec;  // storage layout
  ShardBox box;        // the block this rank holds
  Vector local;        // box.elements() values, row-major over box.extent
  // The 16-bit compute copy of `local` (null: none; only where the model computes from one).
  std::shared_ptr<SixteenBitCopy> copy_16bit;
  // How the block is stored. fp32: in `local`. bf16 (a DLRM's tables under model.table_dtype =
  // "bf16", docs/recsys.md "bf16 tables"): as bf16 bits in `bits` (box.elements() of them, 2
  // bytes an element) and `local` is empty: only code that knows the storage reads such a
  // tensor (the embedding bag, the sparse optimizers, the DLRM initializer, checkpoints).
  Dtype storage = Dtype::fp32;
  HalfBits bits;

  bool stored_16bit() const { return storage != Dtype::fp32; }
  // Bytes of one stored element (4, or 2 for a 16-bit storage).
  int64_t element_bytes() const { return stored_16bit() ? 2 : 4; }

  // Allocates the local block of `rank` (zero-filled); the label is the name. storage bf16: the
  // block as bf16 bits (`bits`; `local` empty).
  static ShardedTensor allocate(const std::string& name, const std::vector<int64_t>& global_shape,
                                const PartitionSpec& spec, const Mesh& mesh, int rank,
                                Dtype storage = Dtype::fp32) {
    ShardedTensor t;
    t.name = name;
    t.global_shape = global_shape;
    t.spec = spec;
    t.box = shard_box(global_shape, spec, mesh, rank);
    t.storage = storage;
    const size_t elements = static_cast<size_t>(t.box.elements());
    if (storage == Dtype::fp32) {
      t.local = Vector(name, elements);
    } else {
      t.bits = HalfBits(name, elements);
    }
    return t;
  }

  // The bf16 block as a matrix (storage bf16; as matrix()'s shape).
  HalfMatrixView bits_matrix() const {
    return HalfMatrixView(bits.data(), matrix_rows(), matrix_columns());
  }

  // The local block as a matrix (2-D tensors; a 1-D tensor is one row).
  MatrixView matrix() const { return MatrixView(local.data(), matrix_rows(), matrix_columns()); }

 private:
  size_t matrix_rows() const {
    return box.extent.size() == 2 ? static_cast<size_t>(box.extent[0]) : 1;
  }
  size_t matrix_columns() const {
    return box.extent.empty() ? 1 : static_cast<size_t>(box.extent.back());
  }
};

}  // namespace meshtrain
