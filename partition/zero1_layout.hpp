#pragma once
// ZeRO-1's split of the optimizer state over `dp` (optimizer.zero_stage = 1), as one rule
// that the planner (bytes per rank) and the trainer (the state it allocates) share.
//
// A tensor whose spec does not name `dp` is replicated over dp; with dp = n > 1 its
// optimizer state is split over dp along dim 0 of the rank's own block: R rows go in
// chunks of r = ceil(R / n), rank i of dp holding rows [i*r, min((i+1)*r, R)) (the last
// chunks may be shorter or empty when R does not divide by n). Scalars, tensors whose
// spec names dp and table-wise tensors (`P(fsdp@1)`, docs/recsys.md: a spec cannot say "the
// holder's block, split again over dp") keep the whole state of their block.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "partition/partition_spec.hpp"

namespace meshtrain {

inline constexpr const char* kZeroAxis = "dp";

// Whether ZeRO-1 splits the state of a tensor of this rank and spec over dp of size n.
inline bool zero1_splits(size_t tensor_rank, const PartitionSpec& spec, int64_t dp_size) {
  if (dp_size <= 1 || tensor_rank == 0 || spec.table_entry() >= 0) return false;
  const std::vector<std::string> axes = spec.axes();
  return std::find(axes.begin(), axes.end(), kZeroAxis) == axes.end();
}

// Rows per dp rank (the padded chunk) of a block with `rows` rows: ceil(rows / n).
inline int64_t zero1_chunk_rows(int64_t rows, int64_t dp_size) {
  return (rows + dp_size - 1) / dp_size;
}

// The first row (within the block) and the row count of dp rank `index`'s chunk.
inline std::pair<int64_t, int64_t> zero1_rows(int64_t rows, int64_t dp_size, int64_t index) {
  const int64_t chunk = zero1_chunk_rows(rows, dp_size);
  const int64_t first = std::min(index * chunk, rows);
  return {first, std::min(chunk, rows - first)};
}

}  // namespace meshtrain
