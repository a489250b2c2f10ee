#include "partition/mesh.hpp"

#include <gtest/gtest.h>

#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

Mesh make(std::vector<std::pair<std::string, int>> axes, int world) {
  return Mesh::create(axes, world, "[mesh]");
}

TEST(Mesh, InfersTheMinusOneAxis) {
  Mesh mesh = make({{"dp", -1}, {"fsdp", 1}, {"ep", 1}, {"tp", 2}, {"sp", 1}}, 8);
  EXPECT_EQ(mesh.axis_size("dp"), 4);
  EXPECT_EQ(mesh.axis_size("tp"), 2);
  EXPECT_EQ(mesh.world_size(), 8);
  EXPECT_EQ(mesh.describe(), "dp=4 fsdp=1 ep=1 tp=2 sp=1");
  EXPECT_EQ(mesh.short_description(), "4x2 (dp=4, tp=2)");
}

TEST(Mesh, CoordinatesAreRowMajorWithTheLastAxisFastest) {
  Mesh mesh = make({{"fsdp", 2}, {"tp", 4}}, 8);
  EXPECT_EQ(mesh.coordinates(0), (std::vector<int>{0, 0}));
  EXPECT_EQ(mesh.coordinates(3), (std::vector<int>{0, 3}));
  EXPECT_EQ(mesh.coordinates(5), (std::vector<int>{1, 1}));
  for (int r = 0; r < 8; ++r) EXPECT_EQ(mesh.rank_of(mesh.coordinates(r)), r);
}

TEST(Mesh, AxisGroupsAreNeighboursForTheFastAxis) {
  Mesh mesh = make({{"fsdp", 2}, {"tp", 4}}, 8);
  EXPECT_EQ(mesh.group_ranks(5, {"tp"}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(mesh.group_ranks(5, {"fsdp"}), (std::vector<int>{1, 5}));
  EXPECT_EQ(mesh.group_index(5, {"tp"}), 1);
  EXPECT_EQ(mesh.group_index(5, {"fsdp"}), 1);
  EXPECT_EQ(mesh.all_groups({"tp"}), (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(mesh.all_groups({"fsdp"}).size(), 4u);
  EXPECT_NE(mesh.group_color(0, {"tp"}), mesh.group_color(4, {"tp"}));
  EXPECT_EQ(mesh.group_color(1, {"tp"}), mesh.group_color(3, {"tp"}));
}

TEST(Mesh, TupleGroupsReadMajorToMinor) {
  Mesh mesh = make({{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, 8);
  // (fsdp, dp): fsdp is the major part of the index.
  EXPECT_EQ(mesh.group_ranks(0, {"fsdp", "dp"}), (std::vector<int>{0, 4, 2, 6}));
  EXPECT_EQ(mesh.group_index(4, {"fsdp", "dp"}), 1);
  EXPECT_EQ(mesh.group_index(2, {"fsdp", "dp"}), 2);
  EXPECT_EQ(mesh.size_of({"fsdp", "dp"}), 4);
  EXPECT_EQ(mesh.size_of({}), 1);
}

TEST(Mesh, ErrorsNameTheOffendingValue) {
  expect_bad_input([] { make({{"dp", 2}, {"tp", 4}}, 7); }, {"[mesh]", "7", "dp=2 tp=4"});
  expect_bad_input([] { make({{"dp", -1}, {"tp", -1}}, 4); }, {"-1", "dp", "tp"});
  expect_bad_input([] { make({{"dp", 0}}, 4); }, {"dp", "0"});
  expect_bad_input([] { make({{"dp", -3}}, 4); }, {"dp", "-3"});
  expect_bad_input([] { make({{"dp", 2}, {"dp", 2}}, 4); }, {"dp", "repeated"});
  expect_bad_input([] { make({{"data", 4}}, 4); }, {"data", "unknown"});
  expect_bad_input([] { make({{"dp", -1}, {"tp", 3}}, 4); }, {"dp", "3", "4"});
  expect_bad_input([] { make({{"dp", 4}}, 4).axis_size("tp"); }, {"tp"});
}

TEST(Mesh, SingleHasEveryKnownAxis) {
  Mesh mesh = Mesh::single();
  EXPECT_EQ(mesh.world_size(), 1);
  EXPECT_EQ(mesh.axes().size(), Mesh::known_axes().size());
  EXPECT_EQ(mesh.short_description(), "1 rank");
}

}  // namespace
}  // namespace meshtrain
