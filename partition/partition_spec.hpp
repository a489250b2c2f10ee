#pragma once
// PartitionSpec: how each dimension of a tensor is split over mesh axes (docs/design.md,
// "PartitionSpec"). One entry per dimension: None (not split), one axis, or a tuple of axes (split
// over their product, read major to minor). Written as text `P(fsdp, tp)`, `P((fsdp,dp), None)`,
// `P()`; in TOML as `[]`, `["fsdp", "tp"]`, `[["fsdp","dp"], ""]` ("" = None).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "partition/mesh.hpp"

namespace meshtrain {

// One dimension of a spec: the mesh axes it is split over, major to minor; empty = None.
// Table-wise placement (embedding tables only, docs/recsys.md): `axis@table` on dimension 0 puts
// the whole tensor on one member of the axis group (the others hold none of it): `table` set,
// `member` the group index that holds it, -1 while the planner has not placed it (written
// `fsdp@table`; placed or pinned: `fsdp@1`). The placement is read by shard_box and owns_block
// (the holder's block and writer), the planner (placing, totals), embedding_layout (the holder
// the layer sends ids to), sharding_picture (no block on the others), plan_report (the JSON
// text `"fsdp@1"`) and zero1_splits (not chunked over dp); everything else treats the entry as
// not splitting the dimension (splits() is false).
struct SpecEntry {
  std::vector<std::string> axes;
  bool table = false;
  int member = -1;
  bool is_none() const { return axes.empty(); }
  // Whether the entry splits its dimension into equal blocks (a table-wise entry does not).
  bool splits() const { return !axes.empty() && !table; }
  bool operator==(const SpecEntry& o) const {
    return axes == o.axes && table == o.table && member == o.member;
  }
  bool operator!=(const SpecEntry& o) const { return !(*this == o); }
};

struct PartitionSpec {
  std::vector<SpecEntry> entries;

  PartitionSpec() = default;
  explicit PartitionSpec(std::vector<SpecEntry> e) : entries(std::move(e)) {}

  // Parses `P(fsdp, tp)`, `P((fsdp,dp), None)`, `P()`, and a table-wise entry `P(fsdp@table)`,
  // `P((fsdp, dp)@1)` (an axis or tuple, `@`, then `table` or a member index); also accepts the
  // same without the leading P. Throws bad_input naming the text and what is wrong (including an
  // axis that appears twice).
  static PartitionSpec parse(std::string_view text);

  // `P(fsdp, tp)`, `P((fsdp, dp), None)`, `P()`: parse(to_string()) == *this.
  std::string to_string() const;

  size_t size() const { return entries.size(); }
  bool is_replicated() const;  // no entry names an axis
  // The index of the table-wise entry (axis@table), or -1 when there is none.
  int table_entry() const;
  // Every axis named by the spec, in order of appearance.
  std::vector<std::string> axes() const;

  // The first axis the spec names twice, or "" when each appears once.
  std::string repeated_axis() const;
  // What is wrong with the spec's axes on `mesh`, as a phrase that follows "spec P(...)":
  // "names mesh axis 'x', which the mesh (dp=2 ...) does not have" or "names mesh axis 'tp'
  // twice; ..."; "" when every axis is in the mesh, once.
  std::string axes_problem(const Mesh& mesh) const;
  // Throws bad_input when an axis is not in the mesh (naming `parameter` and the axis), or
  // when an axis appears twice.
  void check_axes(const Mesh& mesh, const std::string& parameter) const;

  // The spec trimmed (or padded with None) to `rank` entries.
  PartitionSpec with_rank(size_t rank) const;

  bool operator==(const PartitionSpec& o) const { return entries == o.entries; }
  bool operator!=(const PartitionSpec& o) const { return entries != o.entries; }
};

// The block of a global tensor that one rank holds under a spec: per dimension the
// offset and extent. Requires every split dimension to divide by its axis product.
struct ShardBox {
  std::vector<int64_t> offset;
  std::vector<int64_t> extent;
  int64_t elements() const;
};

// "[784, 512]"
std::string format_shape(const std::vector<int64_t>& shape);

// A spec entry's axes and the product of their sizes: "tp=4", "(fsdp, dp)=8".
std::string axis_product_text(const SpecEntry& entry, const Mesh& mesh);

// The first dimension that `spec` splits and whose size does not divide by its axis product,
// or -1 when every split divides. The spec must be no longer than the shape and name only
// axes of the mesh.
int first_indivisible_dim(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                          const Mesh& mesh);
// Why dimension `dim` does not divide: "dim 0 (size 10) does not divide by tp=4 (axis product
// 4)", "dim 1 (size 6) does not divide by (fsdp, tp)=8 (axis product 8: fsdp=2 x tp=4)".
std::string indivisible_dim_text(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                                 const Mesh& mesh, int dim);

// Throws bad_input naming the parameter, dimension, size and axis product when a split
// dimension does not divide, and when the spec is longer than the shape.
void check_divisible(const std::vector<int64_t>& shape, const PartitionSpec& spec, const Mesh& mesh,
                     const std::string& parameter);

// The local shape of every rank (identical on all ranks because splits must divide; a
// table-wise entry leaves its dimension whole: the holder's shape, the others hold nothing).
std::vector<int64_t> local_shape(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                                 const Mesh& mesh);

// The block held by `rank`. Replicated dimensions give offset 0 and the full extent. A
// table-wise entry: the whole dimension on its member, extent 0 elsewhere (the planner must have
// placed it: member >= 0).
ShardBox shard_box(const std::vector<int64_t>& shape, const PartitionSpec& spec, const Mesh& mesh,
                   int rank);

// True when `rank` holds the first copy of its block: coordinate 0 on every mesh axis the
// spec does not split over, so the first copies tile the tensor exactly once (the block a
// checkpoint writes, the one a global norm counts); a table-wise entry's axes: the member only.
bool owns_block(const Mesh& mesh, int rank, const PartitionSpec& spec);

}  // namespace meshtrain
