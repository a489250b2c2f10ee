#include "partition/sharding_picture.hpp"

#include <gtest/gtest.h>

namespace meshtrain {
namespace {

Mesh mesh_of(std::vector<std::pair<std::string, int>> axes) {
  int world = 1;
  for (const auto& a : axes) world *= a.second;
  return Mesh::create(axes, world);
}

TEST(ShardingPicture, RankLabels) {
  EXPECT_EQ(rank_list_label({0}), "0");
  EXPECT_EQ(rank_list_label({2, 0}), "0,2");
  EXPECT_EQ(rank_list_label({0, 1}), "0,1");
  EXPECT_EQ(rank_list_label({0, 1, 2, 3}), "0-3");
  EXPECT_EQ(rank_list_label({0, 1, 2, 3, 8, 9, 10, 11, 13}), "0-3,8-11,13");
}

TEST(ShardingPicture, OwnersOfADpTpMesh) {
  // dp=2 x tp=2: ranks 0,1 are tp neighbours; P(None, tp) splits columns over tp and
  // replicates over dp, so column 0 is held by ranks 0 and 2.
  const Mesh mesh = mesh_of({{"dp", 2}, {"tp", 2}});
  const auto owners = block_owners({4, 6}, PartitionSpec::parse("P(None, tp)"), mesh);
  ASSERT_EQ(owners.size(), 1u);
  ASSERT_EQ(owners[0].size(), 2u);
  EXPECT_EQ(owners[0][0], (std::vector<int>{0, 2}));
  EXPECT_EQ(owners[0][1], (std::vector<int>{1, 3}));
  EXPECT_EQ(sharding_picture({4, 6}, PartitionSpec::parse("P(None, tp)"), mesh),
            "+-----+-----+\n"
            "| 0,2 | 1,3 |\n"
            "+-----+-----+\n");
}

TEST(ShardingPicture, TwoDimensionalGrid) {
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"tp", 2}});
  EXPECT_EQ(sharding_picture({4, 4}, PartitionSpec::parse("P(tp, fsdp)"), mesh),
            "+---+---+\n"
            "| 0 | 2 |\n"
            "+---+---+\n"
            "| 1 | 3 |\n"
            "+---+---+\n");
  EXPECT_EQ(sharding_picture({4}, PartitionSpec::parse("P()"), mesh),
            "+-----+\n"
            "| 0-3 |\n"
            "+-----+\n");
}

TEST(ShardingPicture, OnlyForSmallMeshesAndLowRanks) {
  const Mesh big = mesh_of({{"fsdp", 32}});
  EXPECT_EQ(sharding_picture({64, 64}, PartitionSpec::parse("P(fsdp)"), big), "");
  const Mesh mesh = mesh_of({{"tp", 2}});
  EXPECT_EQ(sharding_picture({2, 2, 2}, PartitionSpec(), mesh), "");
}

TEST(ShardingPicture, WidthIsCapped) {
  const Mesh mesh = mesh_of({{"dp", 4}, {"tp", 4}});
  const std::string picture =
      sharding_picture({4, 4}, PartitionSpec::parse("P(None, tp)"), mesh, 16, 40);
  size_t start = 0;
  while (start < picture.size()) {
    const size_t end = picture.find('\n', start);
    EXPECT_LE(end - start, 40u) << picture;
    start = end + 1;
  }
  EXPECT_NE(picture.find("| 0,4,.. |"), std::string::npos) << picture;
}

}  // namespace
}  // namespace meshtrain
