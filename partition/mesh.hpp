#pragma once
// A device mesh: a named, ordered list of axes whose sizes multiply to the world size.
// The rightmost axis varies fastest over ranks (row-major), so with the default order
// dp, fsdp, ep, tp, sp the tp and sp groups are neighbouring ranks.
//
// An axis group is the set of ranks that share every coordinate except those of the
// named axes. Within a group over a tuple of axes (a, b), a rank's index is
// coord(a) * size(b) + coord(b): the tuple is read major to minor, as in a
// PartitionSpec entry like (fsdp, dp).

#include <string>
#include <utility>
#include <vector>

namespace meshtrain {

struct MeshAxis {
  std::string name;
  int size = 1;
};

// Why `size` cannot be the size of a mesh axis when `inferred_axis` ("" if none) is already
// -1, as a phrase that follows the axis: "must be a positive size (or -1 for what is left of
// the world), got 0" or "is -1 but so is 'dp'; only one axis may take what is left"; "" when
// it can. Shared by Mesh::create and the config reader (which names the key's line).
std::string mesh_axis_size_problem(long long size, const std::string& inferred_axis);

class Mesh {
 public:
  // The axis names meshtrain knows, in the default order.
  static const std::vector<std::string>& known_axes();

  // Builds a mesh for `world_size` ranks from (name, size) pairs in mesh order. One size
  // may be -1: it becomes world_size divided by the product of the others. Throws a
  // bad_input Error naming the offending value for: unknown or repeated names, zero or
  // negative sizes other than a single -1, two -1, and sizes whose product is not
  // world_size. `source` names where the sizes came from (for messages), e.g. "[mesh]".
  static Mesh create(const std::vector<std::pair<std::string, int>>& requested, int world_size,
                     const std::string& source = "mesh");

  // The mesh of one rank with every known axis of size 1.
  static Mesh single();

  int world_size() const { return world_size_; }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  bool has_axis(const std::string& name) const;
  int axis_index(const std::string& name) const;  // throws bad_input for unknown names
  int axis_size(const std::string& name) const;
  // Product of the sizes of `names` (1 for none).
  int size_of(const std::vector<std::string>& names) const;
  // The active axes among `names`: those the mesh has with size > 1, in the order given.
  std::vector<std::string> active_axes(const std::vector<std::string>& names) const;
  // Every active axis of the mesh, in mesh order.
  std::vector<std::string> active_axes() const;

  // Coordinate of `rank` on every axis, in mesh order.
  std::vector<int> coordinates(int rank) const;
  int coordinate(int rank, const std::string& axis) const;
  int rank_of(const std::vector<int>& coordinates) const;

  // Ranks of the group over `names` that contains `rank`, ordered by their index in the
  // group (tuple read major to minor).
  std::vector<int> group_ranks(int rank, const std::vector<std::string>& names) const;
  // Index of `rank` within its group over `names`.
  int group_index(int rank, const std::vector<std::string>& names) const;
  // Index of the group over `names` that holds `rank` (the same for all its members;
  // distinct groups have distinct colors). Used as the MPI_Comm_split color.
  int group_color(int rank, const std::vector<std::string>& names) const;
  // All groups over `names`, each ordered as group_ranks; together they cover every rank.
  std::vector<std::vector<int>> all_groups(const std::vector<std::string>& names) const;

  // "dp=2 fsdp=1 ep=1 tp=2 sp=1"
  std::string describe() const;
  // "2x2 (dp=2, tp=2)": only axes larger than 1.
  std::string short_description() const;

  bool operator==(const Mesh& other) const;
  bool operator!=(const Mesh& other) const { return !(*this == other); }

 private:
  void check_rank(int rank) const;
  std::vector<MeshAxis> axes_;
  int world_size_ = 1;
};

}  // namespace meshtrain
