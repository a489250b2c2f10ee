#include "partition/mesh.hpp"

#include <algorithm>
#include <climits>
#include <sstream>

#include "base/error.hpp"

namespace meshtrain {

namespace {
// Mesh products are capped here so absurd sizes cannot overflow.
constexpr long long kProductCap = 1LL << 40;
}  // namespace

std::string mesh_axis_size_problem(long long size, const std::string& inferred_axis) {
  if (size == 0 || size < -1 || size > INT_MAX) {
    return "must be a positive size (or -1 for what is left of the world), got " +
           std::to_string(size);
  }
  if (size == -1 && !inferred_axis.empty()) {
    return "is -1 but so is '" + inferred_axis + "'; only one axis may take what is left";
  }
  return "";
}

const std::vector<std::string>& Mesh::known_axes() {
  static const std::vector<std::string> axes = {"dp", "fsdp", "ep", "tp", "sp"};
  return axes;
}

Mesh Mesh::create(const std::vector<std::pair<std::string, int>>& requested, int world_size,
                  const std::string& source) {
  if (world_size < 1) {
    MESHTRAIN_BAD_INPUT("the world size must be at least 1, got ", world_size);
  }
  const auto& known = known_axes();
  Mesh mesh;
  mesh.world_size_ = world_size;
  int inferred = -1;
  long long product = 1;
  for (const auto& [name, size] : requested) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      MESHTRAIN_BAD_INPUT(source, ": unknown mesh axis '", name,
                          "' (known axes: dp, fsdp, ep, tp, sp)");
    }
    for (const auto& axis : mesh.axes_) {
      if (axis.name == name) MESHTRAIN_BAD_INPUT(source, ": mesh axis '", name, "' is repeated");
    }
    const std::string problem =
        mesh_axis_size_problem(size, inferred >= 0 ? mesh.axes_[inferred].name : "");
    if (!problem.empty()) MESHTRAIN_BAD_INPUT(source, ": mesh axis '", name, "' ", problem);
    if (size == -1) {
      inferred = static_cast<int>(mesh.axes_.size());
    } else {
      product = product > kProductCap / size ? kProductCap : product * size;
    }
    mesh.axes_.push_back({name, size});
  }
  if (inferred >= 0) {
    if (world_size % product != 0) {
      MESHTRAIN_BAD_INPUT(source, ": cannot infer mesh axis '", mesh.axes_[inferred].name,
                          "' = -1: the other axes multiply to ", product,
                          ", which does not divide the world size ", world_size);
    }
    mesh.axes_[inferred].size = static_cast<int>(world_size / product);
  } else if (product != world_size) {
    MESHTRAIN_BAD_INPUT(
        source, ": mesh ", mesh.describe(), " has ", product >= kProductCap ? "over " : "", product,
        " ranks but the world size is ", world_size, " (set one axis to -1 to take what is left)");
  }
  return mesh;
}

Mesh Mesh::single() {
  std::vector<std::pair<std::string, int>> axes;
  for (const auto& name : known_axes()) axes.emplace_back(name, 1);
  return create(axes, 1);
}

bool Mesh::has_axis(const std::string& name) const {
  return std::any_of(axes_.begin(), axes_.end(), [&](const MeshAxis& a) { return a.name == name; });
}

int Mesh::axis_index(const std::string& name) const {
  for (size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].name == name) return static_cast<int>(i);
  }
  MESHTRAIN_BAD_INPUT("the mesh (", describe(), ") has no axis '", name, "'");
}

int Mesh::axis_size(const std::string& name) const {
  return axes_[axis_index(name)].size;
}

int Mesh::size_of(const std::vector<std::string>& names) const {
  int product = 1;
  for (const auto& name : names) product *= axis_size(name);
  return product;
}

std::vector<std::string> Mesh::active_axes(const std::vector<std::string>& names) const {
  std::vector<std::string> out;
  for (const auto& name : names) {
    if (has_axis(name) && axis_size(name) > 1) out.push_back(name);
  }
  return out;
}

std::vector<std::string> Mesh::active_axes() const {
  std::vector<std::string> out;
  for (const auto& axis : axes_) {
    if (axis.size > 1) out.push_back(axis.name);
  }
  return out;
}

void Mesh::check_rank(int rank) const {
  if (rank < 0 || rank >= world_size_) {
    MESHTRAIN_FAIL("rank ", rank, " is outside the mesh of ", world_size_, " ranks");
  }
}

std::vector<int> Mesh::coordinates(int rank) const {
  check_rank(rank);
  std::vector<int> coords(axes_.size());
  for (size_t i = axes_.size(); i-- > 0;) {
    coords[i] = rank % axes_[i].size;
    rank /= axes_[i].size;
  }
  return coords;
}

int Mesh::coordinate(int rank, const std::string& axis) const {
  return coordinates(rank)[axis_index(axis)];
}

int Mesh::rank_of(const std::vector<int>& coords) const {
  MESHTRAIN_REQUIRE(coords.size() == axes_.size(), "expected ", axes_.size(),
                    " mesh coordinates, got ", coords.size());
  int rank = 0;
  for (size_t i = 0; i < axes_.size(); ++i) {
    MESHTRAIN_REQUIRE(coords[i] >= 0 && coords[i] < axes_[i].size, "coordinate ", coords[i],
                      " is outside mesh axis '", axes_[i].name, "' of size ", axes_[i].size);
    rank = rank * axes_[i].size + coords[i];
  }
  return rank;
}

std::vector<int> Mesh::group_ranks(int rank, const std::vector<std::string>& names) const {
  std::vector<int> indices;
  for (const auto& name : names) indices.push_back(axis_index(name));
  const int group_size = size_of(names);
  std::vector<int> coords = coordinates(rank);
  std::vector<int> ranks(group_size);
  for (int g = 0; g < group_size; ++g) {
    int rest = g;
    for (size_t j = indices.size(); j-- > 0;) {
      const int axis = indices[j];
      coords[axis] = rest % axes_[axis].size;
      rest /= axes_[axis].size;
    }
    ranks[g] = rank_of(coords);
  }
  return ranks;
}

int Mesh::group_index(int rank, const std::vector<std::string>& names) const {
  const std::vector<int> coords = coordinates(rank);
  int index = 0;
  for (const auto& name : names) {
    const int axis = axis_index(name);
    index = index * axes_[axis].size + coords[axis];
  }
  return index;
}

int Mesh::group_color(int rank, const std::vector<std::string>& names) const {
  // The rank with every coordinate of `names` set to 0 identifies the group.
  std::vector<int> coords = coordinates(rank);
  for (const auto& name : names) coords[axis_index(name)] = 0;
  return rank_of(coords);
}

std::vector<std::vector<int>> Mesh::all_groups(const std::vector<std::string>& names) const {
  std::vector<std::vector<int>> groups;
  for (int rank = 0; rank < world_size_; ++rank) {
    if (group_index(rank, names) == 0) groups.push_back(group_ranks(rank, names));
  }
  return groups;
}

std::string Mesh::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < axes_.size(); ++i) {
    out << (i ? " " : "") << axes_[i].name << "=" << axes_[i].size;
  }
  return out.str();
}

std::string Mesh::short_description() const {
  std::ostringstream dims, names;
  for (const auto& axis : axes_) {
    if (axis.size == 1) continue;
    dims << (dims.tellp() > 0 ? "x" : "") << axis.size;
    names << (names.tellp() > 0 ? ", " : "") << axis.name << "=" << axis.size;
  }
  if (dims.tellp() == 0) return "1 rank";
  return dims.str() + " (" + names.str() + ")";
}

bool Mesh::operator==(const Mesh& other) const {
  if (world_size_ != other.world_size_ || axes_.size() != other.axes_.size()) return false;
  for (size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].name != other.axes_[i].name || axes_[i].size != other.axes_[i].size) return false;
  }
  return true;
}

}  // namespace meshtrain
