#pragma once
// A text picture of how a 1-D or 2-D tensor is split over the ranks of a small mesh, in the
// spirit of jax.debug.visualize_array_sharding: one cell per block, labelled with the ranks
// that hold it ("0,2" when replicated over dp, "0-3" for a run).
//
//   +-----+-----+
//   | 0,2 | 1,3 |
//   +-----+-----+

#include <cstdint>
#include <string>
#include <vector>

#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

// Ranks holding each block, as [row][column] (a 1-D tensor is one row of columns; a scalar
// is one block). Ranks within a block are ascending. Requires a divisible spec; loops over
// every rank, so meant for small meshes.
std::vector<std::vector<std::vector<int>>> block_owners(const std::vector<int64_t>& shape,
                                                        const PartitionSpec& spec,
                                                        const Mesh& mesh);

// "0", "0,2", "0-3", "0-3,8-11": ascending ranks, runs of three or more as a-b.
std::string rank_list_label(const std::vector<int>& ranks);

// The picture, one line per text row, ending in '\n'; "" for tensors of rank above 2 and
// for meshes of more than `max_ranks` ranks. Labels longer than fit in `max_width`
// columns are cut and end in "..".
std::string sharding_picture(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                             const Mesh& mesh, int max_ranks = 16, int max_width = 80);

}  // namespace meshtrain
