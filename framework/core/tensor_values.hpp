#pragma once
// A ShardedTensor's local block read as floats, whatever its storage (ShardedTensor::storage):
// the one accessor for code outside the step that reads a tensor which may be stored as 16 bits
// (a gradient kept in 16 bits, partition/gradient_storage.hpp; a DLRM's bf16 table): tests,
// reports, checks. The step's own readers (the optimizer, the clipper, the reductions) read the
// storage itself.

#include <cstdint>

#include "framework/core/sharded_tensor.hpp"

namespace meshtrain {

// Elements of the local block (those of `bits` for a 16-bit storage, else of `local`).
int64_t held_elements(const ShardedTensor& t);
// Where the local block is stored (`bits`' data for a 16-bit storage, else `local`'s): what
// the memory tracker and the step's capture regions match a tensor by.
const void* data_pointer(const ShardedTensor& t);

// The local block as fp32 values in the default memory space: `local` itself for an fp32
// storage (no copy), else a new Vector with the 16-bit values widened (exact). Allocates for a
// 16-bit storage: not for the training step.
Vector values_fp32(const ShardedTensor& t);

}  // namespace meshtrain
