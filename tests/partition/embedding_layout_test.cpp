// partition/embedding_layout.hpp: an embedding table's layout from its spec (replicated, row-wise
// over batch axes, column-wise over non-batch axes, the gradient's all-reduce axes) and the specs
// it refuses, without MPI.

#include "partition/embedding_layout.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using Strings = std::vector<std::string>;

const LayerAxes kAxes{{"fsdp", "dp"}, "tp"};

EmbeddingLayout layout(const std::vector<std::pair<std::string, int>>& mesh_axes,
                       const std::string& spec, std::vector<int64_t> shape = {48, 6}) {
  int world = 1;
  for (const auto& axis : mesh_axes) world *= axis.second;
  const Mesh mesh = Mesh::create(mesh_axes, world);
  return embedding_layout("cat", {"embeddings/cat/weight", shape, PartitionSpec::parse(spec)}, mesh,
                          layer_axes_on(mesh, kAxes));
}

TEST(EmbeddingLayout, ReplicatedSumsTheGradientOverTheBatchAxes) {
  const EmbeddingLayout l = layout({{"fsdp", 2}, {"dp", 2}, {"tp", 2}}, "P()");
  EXPECT_EQ(l.sharding, EmbeddingSharding::replicated);
  EXPECT_EQ(l.rows, 48);
  EXPECT_EQ(l.dim, 6);
  EXPECT_EQ(l.owners, 1);
  EXPECT_EQ(l.rows_per_owner, 48);
  EXPECT_EQ(l.gradient_allreduce, (Strings{"fsdp", "dp"}));
  EXPECT_EQ(l.all_to_all_floats(10), 0);
}

TEST(EmbeddingLayout, RowWiseSumsOverTheBatchAxesItDoesNotName) {
  const EmbeddingLayout fsdp = layout({{"fsdp", 2}, {"dp", 2}}, "P(fsdp, None)");
  EXPECT_EQ(fsdp.sharding, EmbeddingSharding::row_wise);
  EXPECT_EQ(fsdp.row_axes, (Strings{"fsdp"}));
  EXPECT_EQ(fsdp.owners, 2);
  EXPECT_EQ(fsdp.rows_per_owner, 24);
  EXPECT_EQ(fsdp.gradient_allreduce, (Strings{"dp"}));
  EXPECT_EQ(fsdp.all_to_all_floats(10), 10 * 3 + 2 * 10 * 6);

  const EmbeddingLayout both = layout({{"fsdp", 2}, {"dp", 2}}, "P((fsdp, dp), None)");
  EXPECT_EQ(both.owners, 4);
  EXPECT_EQ(both.rows_per_owner, 12);
  EXPECT_TRUE(both.gradient_allreduce.empty());

  // Over an axis of size 1: replicated, and the plan's note says why.
  const EmbeddingLayout one = layout({{"dp", 1}, {"tp", 2}}, "P(dp, None)");
  EXPECT_EQ(one.sharding, EmbeddingSharding::replicated);
  ASSERT_EQ(one.notes.size(), 1u);
  EXPECT_NE(one.notes[0].find("size 1"), std::string::npos);
}

TEST(EmbeddingLayout, ColumnWiseSlicesDimOverANonBatchAxis) {
  // Column-wise alone: whole rows' ids looked up in every slice; the gradient summed over the
  // batch axes like a replicated table's, no all-to-all.
  const EmbeddingLayout columns = layout({{"dp", 2}, {"tp", 2}}, "P(None, tp)");
  EXPECT_EQ(columns.sharding, EmbeddingSharding::replicated);
  EXPECT_EQ(columns.column_axes, (Strings{"tp"}));
  EXPECT_EQ(columns.column_slices, 2);
  EXPECT_EQ(columns.dim_per_slice, 3);
  EXPECT_EQ(columns.gradient_allreduce, (Strings{"dp"}));
  EXPECT_EQ(columns.all_to_all_floats(10), 0);
  // With row-wise over the batch axes: the all-to-all carries this slice's columns only.
  const EmbeddingLayout both = layout({{"dp", 2}, {"tp", 2}}, "P(dp, tp)");
  EXPECT_EQ(both.sharding, EmbeddingSharding::row_wise);
  EXPECT_EQ(both.row_axes, (Strings{"dp"}));
  EXPECT_EQ(both.column_slices, 2);
  EXPECT_TRUE(both.gradient_allreduce.empty());
  EXPECT_EQ(both.all_to_all_floats(10), 10 * 3 + 2 * 10 * 3);
  // Over an axis of size 1: whole rows, and the plan's note says why.
  const EmbeddingLayout one = layout({{"dp", 2}, {"tp", 1}}, "P(None, tp)");
  EXPECT_EQ(one.column_slices, 1);
  EXPECT_EQ(one.dim_per_slice, 6);
  ASSERT_EQ(one.notes.size(), 1u);
  EXPECT_NE(one.notes[0].find("column-wise over (tp), axes of size 1"), std::string::npos);
}

TEST(EmbeddingLayout, OtherSpecsAndShapesAreBadInput) {
  // A column split of a dim it does not divide: no uneven slices.
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 4}}, "P(None, tp)");
      },
      {"table 'cat'", "dim 6", "4 column slices of (tp)", "P(None, tp)"});
  // Columns over a batch axis (its ranks hold different bags).
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 2}}, "P(None, dp)");
      },
      {"table 'cat'", "embeddings/cat/weight", "P(None, dp)", "P(None, axis)", "not a batch axis"});
  // A misspelt axis is named as such, not refused as an unsupported layout.
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 2}}, "P(None, tq)");
      },
      {"embeddings/cat/weight", "P(None, tq)", "mesh axis 'tq'", "does not have"});
  testing::expect_bad_input(
      [] {
        layout({{"fsdp", 2}, {"tp", 2}}, "P(tp, None)");
      },
      {"table 'cat'", "P(tp, None)", "batch axes (fsdp)"});
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 2}}, "P(tp, dp)");
      },
      {"table 'cat'", "P(tp, dp)"});
  testing::expect_bad_input(
      [] {
        layout({{"fsdp", 2}}, "P()", {48});
      },
      {"table 'cat'", "[48]", "not [rows, dim]"});
  testing::expect_bad_input(
      [] {
        layout({{"fsdp", 2}}, "P(fsdp, None)", {5, 6});
      },
      {"embeddings/cat/weight", "size 5", "fsdp=2"});
}

// The bytes one rank moves for a table [48, 6] in a step (`meshtrain plan`), by hand: an
// all-to-all or all-gather of S bytes over n ranks moves S (n - 1) / n, an all-reduce twice that.
TEST(EmbeddingStepBytes, RowWiseSendsIdsAndPartialSumsToTheOwners) {
  // 8 bags of 3 ids over 4 owners: 24 ids, at most 8 x min(3, 4) = 24 parts (one per owner a
  // bag's ids live on).
  const EmbeddingStepBytes four =
      embedding_step_bytes(layout({{"fsdp", 4}}, "P(fsdp, None)"), 8, 3, false);
  EXPECT_EQ(four.ids, 24);
  EXPECT_EQ(four.parts, 24);
  EXPECT_EQ(four.counts_all_to_all, 4 * 4 * 4 * 3 / 4);         // 4 floats per owner
  EXPECT_EQ(four.ids_all_to_all, 24 * 3 * 4 * 3 / 4);           // 3 floats per id
  EXPECT_EQ(four.partial_sums_all_to_all, 24 * 6 * 4 * 3 / 4);  // a row of dim per part
  EXPECT_EQ(four.backward_all_to_all, 24 * 6 * 4 * 3 / 4);      // dy of each part
  EXPECT_EQ(four.column_all_gather, 0);
  EXPECT_EQ(four.gradient_all_reduce, 0);  // the rows cover every batch axis
  EXPECT_EQ(four.forward(), 48 + 216 + 432);
  EXPECT_EQ(four.total(), 48 + 216 + 432 + 432);
  // Over 2 owners a bag sends at most 2 parts; the dp copies' gradients are summed.
  const EmbeddingStepBytes two =
      embedding_step_bytes(layout({{"fsdp", 2}, {"dp", 2}}, "P(fsdp, None)"), 8, 3, false);
  EXPECT_EQ(two.parts, 16);
  EXPECT_EQ(two.counts_all_to_all, 2 * 4 * 4 / 2);
  EXPECT_EQ(two.ids_all_to_all, 24 * 3 * 4 / 2);
  EXPECT_EQ(two.partial_sums_all_to_all, 16 * 6 * 4 / 2);
  EXPECT_EQ(two.gradient_all_reduce, 2 * (24 * 6 * 4) / 2);  // the local [24, 6] over dp
  // One id per bag: one part per bag.
  EXPECT_EQ(embedding_step_bytes(layout({{"fsdp", 4}}, "P(fsdp, None)"), 8, 1, false).parts, 8);
}

TEST(EmbeddingStepBytes, ColumnWiseGathersThePooledSlices) {
  // [8 bags, 6] gathered over tp 2; the [48, 3] slice's gradient all-reduced over dp 2.
  const EmbeddingLayout columns = layout({{"dp", 2}, {"tp", 2}}, "P(None, tp)");
  const EmbeddingStepBytes dense = embedding_step_bytes(columns, 8, 3, false);
  EXPECT_EQ(dense.ids_all_to_all, 0);
  EXPECT_EQ(dense.partial_sums_all_to_all, 0);
  EXPECT_EQ(dense.column_all_gather, 8 * 6 * 4 / 2);
  EXPECT_EQ(dense.gradient_all_reduce, 2 * (48 * 3 * 4) / 2);
  EXPECT_EQ(dense.touched_rows_all_gather, 0);
  // Sparse: at most 2 x 24 touched rows (capped at 48); the lists of 25 entries of 2 floats.
  const EmbeddingStepBytes sparse = embedding_step_bytes(columns, 8, 3, true);
  EXPECT_EQ(sparse.gradient_all_reduce, 2 * (48 * 3 * 4) / 2);
  EXPECT_EQ(sparse.touched_rows_all_gather, 2 * 25 * 2 * 4 / 2);
  // Row-wise within the slices: the all-to-alls carry 3 of the 6 columns.
  const EmbeddingStepBytes both =
      embedding_step_bytes(layout({{"dp", 2}, {"tp", 2}}, "P(dp, tp)"), 8, 1, false);
  EXPECT_EQ(both.partial_sums_all_to_all, 8 * 3 * 4 / 2);
  EXPECT_EQ(both.column_all_gather, 8 * 6 * 4 / 2);
}

TEST(EmbeddingStepBytes, ReplicatedSumsItsGradientOnly) {
  // One rank: nothing moves.
  EXPECT_EQ(embedding_step_bytes(layout({{"dp", 1}}, "P()"), 8, 3, false).total(), 0);
  EXPECT_EQ(embedding_step_bytes(layout({{"dp", 1}}, "P(dp, None)"), 8, 3, true).total(), 0);
  // dp 2: the whole [48, 6] all-reduced, or with sparse updates the rows 2 x 2 bags can touch.
  const EmbeddingLayout replicated = layout({{"dp", 2}}, "P()");
  EXPECT_EQ(embedding_step_bytes(replicated, 8, 1, false).total(), 2 * (48 * 6 * 4) / 2);
  const EmbeddingStepBytes sparse = embedding_step_bytes(replicated, 2, 1, true);
  EXPECT_EQ(sparse.gradient_all_reduce, 2 * (4 * 6 * 4) / 2);
  EXPECT_EQ(sparse.touched_rows_all_gather, 2 * 3 * 2 * 4 / 2);
  EXPECT_EQ(sparse.forward(), 0);
}

TEST(EmbeddingLayout, ShardingNames) {
  EXPECT_STREQ(to_string(EmbeddingSharding::replicated), "replicated");
  EXPECT_STREQ(to_string(EmbeddingSharding::row_wise), "row-wise");
}

// Table-wise (P(axes@k), placed by the planner): the whole table on member k of batch axes.
TEST(EmbeddingLayout, TableWiseIsWholeOnOneMemberOfBatchAxes) {
  const EmbeddingLayout l = layout({{"fsdp", 2}, {"dp", 2}}, "P(fsdp@1, None)", {5, 6});
  EXPECT_EQ(l.sharding, EmbeddingSharding::table_wise);
  EXPECT_EQ(l.row_axes, (Strings{"fsdp"}));
  EXPECT_EQ(l.owners, 2);
  EXPECT_EQ(l.holder, 1);
  EXPECT_EQ(l.rows_per_owner, 5);  // on the holder; rows need not divide
  EXPECT_EQ(l.dim_per_slice, 6);
  EXPECT_EQ(l.gradient_allreduce, (Strings{"dp"}));  // among the holders' dp copies
  const EmbeddingLayout all = layout({{"fsdp", 2}, {"dp", 2}}, "P((fsdp, dp)@3)");
  EXPECT_EQ(all.owners, 4);
  EXPECT_EQ(all.holder, 3);
  EXPECT_TRUE(all.gradient_allreduce.empty());
  // Over axes of size 1: replicated, with the note.
  const EmbeddingLayout one = layout({{"dp", 1}, {"tp", 2}}, "P(dp@0, None)");
  EXPECT_EQ(one.sharding, EmbeddingSharding::replicated);
  ASSERT_EQ(one.notes.size(), 1u);
  EXPECT_NE(one.notes[0].find("table-wise over (dp), axes of size 1"), std::string::npos);
  // Refused, naming the table and the spec: a non-batch axis (its ranks hold the same bags),
  // columns split as well, a placement on dimension 1, one the planner has not placed, or off
  // the group.
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 2}}, "P(tp@0, None)");
      },
      {"table 'cat'", "P(tp@0, None)", "P(axis@table)", "batch axes (dp)"});
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 2}}, "P(dp@0, tp)");
      },
      {"table 'cat'", "P(dp@0, tp)"});
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}, {"tp", 2}}, "P(None, tp@1)");
      },
      {"table 'cat'", "P(None, tp@1)"});
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}}, "P(dp@table, None)");
      },
      {"table 'cat'", "P(dp@table, None)", "not on a member of dp=2"});
  testing::expect_bad_input(
      [] {
        layout({{"dp", 2}}, "P(dp@2, None)");
      },
      {"table 'cat'", "P(dp@2, None)", "not on a member of dp=2"});
}

// Table-wise moves what row-wise does with one owner: a bag is one part (its ids all go to
// the holder); the figures are the mean over the group's ranks (collectives.hpp).
TEST(EmbeddingStepBytes, TableWiseSendsEveryIdToTheHolder) {
  const EmbeddingStepBytes b =
      embedding_step_bytes(layout({{"fsdp", 4}}, "P(fsdp@2, None)"), 8, 3, false);
  EXPECT_EQ(b.ids, 24);
  EXPECT_EQ(b.parts, 8);
  EXPECT_EQ(b.counts_all_to_all, 4 * 4 * 4 * 3 / 4);
  EXPECT_EQ(b.ids_all_to_all, 24 * 3 * 4 * 3 / 4);
  EXPECT_EQ(b.partial_sums_all_to_all, 8 * 6 * 4 * 3 / 4);
  EXPECT_EQ(b.backward_all_to_all, 8 * 6 * 4 * 3 / 4);
  EXPECT_EQ(b.gradient_all_reduce, 0);
  EXPECT_STREQ(to_string(EmbeddingSharding::table_wise), "table-wise");
}

}  // namespace
}  // namespace meshtrain
