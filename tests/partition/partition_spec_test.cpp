#include "partition/partition_spec.hpp"

#include <gtest/gtest.h>

#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

SpecEntry axes(std::vector<std::string> names) {
  return SpecEntry{std::move(names)};
}
const SpecEntry none{};

TEST(PartitionSpec, ParsesTheDocumentedForms) {
  EXPECT_EQ(PartitionSpec::parse("P(fsdp, tp)"), PartitionSpec({axes({"fsdp"}), axes({"tp"})}));
  EXPECT_EQ(PartitionSpec::parse("P((fsdp,dp), None)"),
            PartitionSpec({axes({"fsdp", "dp"}), none}));
  EXPECT_EQ(PartitionSpec::parse("P()"), PartitionSpec());
  EXPECT_EQ(PartitionSpec::parse("  P ( tp ,None , ( fsdp , dp ) )  "),
            PartitionSpec({axes({"tp"}), none, axes({"fsdp", "dp"})}));
  // Without the leading P, with or without parentheses, with Python quotes.
  EXPECT_EQ(PartitionSpec::parse("(fsdp, tp)"), PartitionSpec::parse("P(fsdp, tp)"));
  EXPECT_EQ(PartitionSpec::parse("fsdp, tp"), PartitionSpec::parse("P(fsdp, tp)"));
  EXPECT_EQ(PartitionSpec::parse("(fsdp, dp), None"), PartitionSpec::parse("P((fsdp, dp), None)"));
  EXPECT_EQ(PartitionSpec::parse("()"), PartitionSpec());
  EXPECT_EQ(PartitionSpec::parse("P('fsdp', \"tp\")"), PartitionSpec::parse("P(fsdp, tp)"));
  // A trailing comma, one-axis tuples, and () as None, as in JAX.
  EXPECT_EQ(PartitionSpec::parse("P(tp,)"), PartitionSpec({axes({"tp"})}));
  EXPECT_EQ(PartitionSpec::parse("P((tp,), (), None)"), PartitionSpec({axes({"tp"}), none, none}));
}

TEST(PartitionSpec, PrintsAndRoundTrips) {
  EXPECT_EQ(PartitionSpec({axes({"fsdp"}), axes({"tp"})}).to_string(), "P(fsdp, tp)");
  EXPECT_EQ(PartitionSpec({axes({"fsdp", "dp"}), none}).to_string(), "P((fsdp, dp), None)");
  EXPECT_EQ(PartitionSpec().to_string(), "P()");
  EXPECT_EQ(PartitionSpec({none}).to_string(), "P(None)");
  for (const char* text : {"P(fsdp, tp)", "P((fsdp, dp), None)", "P()", "P(None, None)", "P(tp)",
                           "P(None, (dp, fsdp, ep), sp)"}) {
    const PartitionSpec spec = PartitionSpec::parse(text);
    EXPECT_EQ(spec.to_string(), text);
    EXPECT_EQ(PartitionSpec::parse(spec.to_string()), spec);
  }
}

TEST(PartitionSpec, RejectsGarbageNamingTheText) {
  expect_bad_input([] { PartitionSpec::parse(""); }, {"''", "empty"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp tp)"); }, {"P(fsdp tp)", "')'", "'t'"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp"); }, {"P(fsdp", "')'"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp))"); }, {"P(fsdp))", "unexpected ')'"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp,,tp)"); }, {"P(fsdp,,tp)", "','"});
  expect_bad_input([] { PartitionSpec::parse("P[fsdp]"); }, {"P[fsdp]", "'(' after P"});
  expect_bad_input([] { PartitionSpec::parse("P(tp), fsdp"); }, {"P(tp), fsdp", "unexpected ','"});
  expect_bad_input([] { PartitionSpec::parse("P((fsdp, None))"); }, {"None", "tuple"});
  expect_bad_input([] { PartitionSpec::parse("P(1tp)"); }, {"P(1tp)", "'1'"});
  expect_bad_input([] { PartitionSpec::parse("P('tp)"); }, {"P('tp)", "quote"});
  expect_bad_input([] { PartitionSpec::parse("P(tp, (fsdp, tp))"); }, {"'tp'", "twice"});
}

TEST(PartitionSpec, QueriesAndRank) {
  const PartitionSpec spec = PartitionSpec::parse("P((fsdp, dp), None, tp)");
  EXPECT_EQ(spec.axes(), (std::vector<std::string>{"fsdp", "dp", "tp"}));
  EXPECT_FALSE(spec.is_replicated());
  EXPECT_TRUE(PartitionSpec::parse("P(None, None)").is_replicated());
  EXPECT_TRUE(PartitionSpec().is_replicated());
  EXPECT_EQ(spec.with_rank(2).to_string(), "P((fsdp, dp), None)");
  EXPECT_EQ(spec.with_rank(4).to_string(), "P((fsdp, dp), None, tp, None)");
  EXPECT_EQ(spec.with_rank(0), PartitionSpec());
}

TEST(PartitionSpec, CheckAxesNamesParameterAndAxis) {
  const Mesh mesh = Mesh::create({{"dp", 2}, {"tp", 2}}, 4);
  PartitionSpec::parse("P(dp, tp)").check_axes(mesh, "w");
  expect_bad_input([&] { PartitionSpec::parse("P(fsdp)").check_axes(mesh, "layers/0/weight"); },
                   {"layers/0/weight", "'fsdp'", "dp=2 tp=2"});
  PartitionSpec repeated({axes({"tp"}), axes({"tp"})});  // built directly, not parsed
  expect_bad_input([&] { repeated.check_axes(mesh, "layers/1/weight"); },
                   {"layers/1/weight", "'tp'", "twice"});
}

Mesh mesh_of(std::vector<std::pair<std::string, int>> axes) {
  int world = 1;
  for (const auto& a : axes) world *= a.second;
  return Mesh::create(axes, world);
}

TEST(ShardBox, TwoAxesOnAFourByTwoMesh) {
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"tp", 4}});
  const std::vector<int64_t> shape{8, 12};
  const PartitionSpec spec = PartitionSpec::parse("P(fsdp, tp)");
  EXPECT_EQ(local_shape(shape, spec, mesh), (std::vector<int64_t>{4, 3}));
  ShardBox box = shard_box(shape, spec, mesh, 5);  // fsdp=1, tp=1
  EXPECT_EQ(box.offset, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(box.extent, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(box.elements(), 12);
  // Swapped axes: dim 0 over tp, dim 1 over fsdp.
  box = shard_box(shape, PartitionSpec::parse("P(tp, fsdp)"), mesh, 5);
  EXPECT_EQ(box.offset, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(box.extent, (std::vector<int64_t>{2, 6}));
  // Replicated dims give offset 0 and the full extent.
  box = shard_box(shape, PartitionSpec::parse("P(None, tp)"), mesh, 7);
  EXPECT_EQ(box.offset, (std::vector<int64_t>{0, 9}));
  EXPECT_EQ(box.extent, (std::vector<int64_t>{8, 3}));
  // A spec shorter than the rank leaves the rest whole.
  box = shard_box(shape, PartitionSpec::parse("P(fsdp)"), mesh, 6);
  EXPECT_EQ(box.offset, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(box.extent, (std::vector<int64_t>{4, 12}));
}

TEST(ShardBox, TupleEntriesReadMajorToMinor) {
  const Mesh mesh = mesh_of({{"dp", 2}, {"fsdp", 2}, {"tp", 2}});
  const std::vector<int64_t> shape{8, 3};
  const PartitionSpec spec = PartitionSpec::parse("P((fsdp, dp), None)");
  EXPECT_EQ(local_shape(shape, spec, mesh), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(shard_box(shape, spec, mesh, 4).offset, (std::vector<int64_t>{2, 0}));  // dp=1
  EXPECT_EQ(shard_box(shape, spec, mesh, 2).offset, (std::vector<int64_t>{4, 0}));  // fsdp=1
  EXPECT_EQ(shard_box(shape, spec, mesh, 6).offset, (std::vector<int64_t>{6, 0}));
  EXPECT_EQ(shard_box(shape, spec, mesh, 7).offset, (std::vector<int64_t>{6, 0}));  // tp copy
}

// On several meshes and specs, the blocks of all ranks cover every element exactly
// (world / split product) times.
TEST(ShardBox, BlocksCoverTheTensorEvenly) {
  struct Case {
    std::vector<std::pair<std::string, int>> axes;
    std::string spec;
  };
  const std::vector<Case> cases = {
      {{{"dp", 1}}, "P()"},
      {{{"dp", 2}, {"tp", 2}}, "P(tp, None)"},
      {{{"fsdp", 4}}, "P(None, fsdp)"},
      {{{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, "P((fsdp, dp), tp)"},
      {{{"fsdp", 2}, {"tp", 4}}, "P(tp, fsdp)"},
      {{{"dp", 2}, {"fsdp", 2}, {"ep", 1}, {"tp", 2}, {"sp", 2}}, "P((tp, sp), (dp, fsdp))"},
  };
  const std::vector<int64_t> shape{8, 12};
  for (const auto& c : cases) {
    const Mesh mesh = mesh_of(c.axes);
    const PartitionSpec spec = PartitionSpec::parse(c.spec);
    int split = 1;
    for (const auto& entry : spec.entries) split *= mesh.size_of(entry.axes);
    std::vector<int> count(8 * 12, 0);
    for (int rank = 0; rank < mesh.world_size(); ++rank) {
      const ShardBox box = shard_box(shape, spec, mesh, rank);
      EXPECT_EQ(box.extent, local_shape(shape, spec, mesh));
      for (int64_t i = 0; i < box.extent[0]; ++i) {
        for (int64_t j = 0; j < box.extent[1]; ++j) {
          ++count[(box.offset[0] + i) * 12 + box.offset[1] + j];
        }
      }
    }
    for (int n : count) ASSERT_EQ(n, mesh.world_size() / split) << mesh.describe() << " " << c.spec;
  }
}

TEST(ShardBox, IndivisibleAndTooLongSpecsAreErrors) {
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"tp", 4}});
  expect_bad_input(
      [&] {
        check_divisible({10, 8}, PartitionSpec::parse("P(tp)"), mesh, "layers/2/weight");
      },
      {"layers/2/weight", "dim 0", "10", "tp=4"});
  expect_bad_input(
      [&] {
        check_divisible({8, 6}, PartitionSpec::parse("P(None, (fsdp, tp))"), mesh, "w");
      },
      {"'w'", "dim 1", "6", "(fsdp, tp)=8"});
  expect_bad_input([&] { check_divisible({8}, PartitionSpec::parse("P(fsdp, tp)"), mesh, "b"); },
                   {"'b'", "2 entries", "rank 1"});
  expect_bad_input([&] { local_shape({10}, PartitionSpec::parse("P(tp)"), mesh); }, {"10", "tp=4"});
  expect_bad_input([&] { check_divisible({8}, PartitionSpec::parse("P(ep)"), mesh, "b"); },
                   {"'b'", "'ep'"});
}

// Table-wise placement (docs/recsys.md): `axis@table` (placed by the planner) or `axis@k`.
TEST(PartitionSpec, TableWiseEntriesParsePrintAndRoundTrip) {
  const PartitionSpec unplaced = PartitionSpec::parse("P(fsdp@table)");
  ASSERT_EQ(unplaced.size(), 1u);
  EXPECT_EQ(unplaced.entries[0].axes, (std::vector<std::string>{"fsdp"}));
  EXPECT_TRUE(unplaced.entries[0].table);
  EXPECT_EQ(unplaced.entries[0].member, -1);
  EXPECT_FALSE(unplaced.entries[0].splits());
  EXPECT_FALSE(unplaced.is_replicated());
  EXPECT_EQ(unplaced.table_entry(), 0);
  EXPECT_EQ(PartitionSpec::parse("P(fsdp, tp)").table_entry(), -1);
  const PartitionSpec placed = PartitionSpec::parse("P((fsdp, dp) @ 3, None)");
  EXPECT_EQ(placed.entries[0].axes, (std::vector<std::string>{"fsdp", "dp"}));
  EXPECT_TRUE(placed.entries[0].table);
  EXPECT_EQ(placed.entries[0].member, 3);
  EXPECT_NE(placed, PartitionSpec::parse("P((fsdp, dp), None)"));
  EXPECT_NE(placed, PartitionSpec::parse("P((fsdp, dp)@2, None)"));
  for (const char* text :
       {"P(fsdp@table)", "P(dp@0, None)", "P((fsdp, dp)@table, None)", "P((fsdp, dp)@12)"}) {
    const PartitionSpec spec = PartitionSpec::parse(text);
    EXPECT_EQ(spec.to_string(), text);
    EXPECT_EQ(PartitionSpec::parse(spec.to_string()), spec);
  }
  expect_bad_input([] { PartitionSpec::parse("P(None@table)"); }, {"P(None@table)", "None"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp@tables)"); },
                   {"P(fsdp@tables)", "'table' or a member index"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp@)"); }, {"'table' or a member index"});
  expect_bad_input([] { PartitionSpec::parse("P(fsdp@-1)"); }, {"'table' or a member index"});
}

// The member holds the whole tensor, the others an empty block; only the member's first copy
// owns it (a checkpoint writes it once).
TEST(ShardBox, TableWiseIsWholeOnItsMemberAndEmptyElsewhere) {
  const Mesh mesh = mesh_of({{"fsdp", 2}, {"dp", 2}});  // rank = 2 fsdp + dp
  const std::vector<int64_t> shape{5, 3};               // rows need not divide
  const PartitionSpec spec = PartitionSpec::parse("P(fsdp@1, None)");
  EXPECT_EQ(first_indivisible_dim(shape, spec, mesh), -1);
  EXPECT_EQ(local_shape(shape, spec, mesh), shape);  // the holder's
  for (int rank = 0; rank < 4; ++rank) {
    const ShardBox box = shard_box(shape, spec, mesh, rank);
    const bool holder = rank >= 2;
    EXPECT_EQ(box.offset, (std::vector<int64_t>{0, 0})) << rank;
    EXPECT_EQ(box.extent, (std::vector<int64_t>{holder ? 5 : 0, 3})) << rank;
    EXPECT_EQ(owns_block(mesh, rank, spec), rank == 2) << rank;  // dp copy 0 of the holder
  }
  const PartitionSpec both = PartitionSpec::parse("P((fsdp, dp)@2, None)");
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(shard_box(shape, both, mesh, rank).elements(), rank == 2 ? 15 : 0) << rank;
    EXPECT_EQ(owns_block(mesh, rank, both), rank == 2) << rank;
  }
  // A 1-D tensor of the table's rows (a row-wise optimizer's state) follows the same entry.
  EXPECT_EQ(shard_box({5}, spec.with_rank(1), mesh, 3).extent, (std::vector<int64_t>{5}));
  EXPECT_EQ(shard_box({5}, spec.with_rank(1), mesh, 1).extent, (std::vector<int64_t>{0}));
}

}  // namespace
}  // namespace meshtrain
