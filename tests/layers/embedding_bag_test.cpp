// The embedding bag (layers/embedding_bag.hpp) on every mesh below against a one-rank reference
// computed in the same test: the same layer on MPI_COMM_SELF (a single-rank mesh, the table
// replicated) over the whole global batch. Each rank compares its pooled rows with the
// reference's rows of its batch slice and its block of the table gradient with the reference's
// rows of that block (no gather needed: the reference holds everything).
//
// Data: a table [48, 12], a global batch of 16 bags (bags 2, 7 and 12 empty, bag 3 with a
// repeated id, the others 1 to 6 ids), dy [16, 12]; every rank makes the same global values from
// one seed. Ids `spread` (uniform over the table: most bags span several owners) or `one shard`
// (all below 12: rows owner 0 holds on every mesh here, blocks of 12 rows or more). Values
// `random` (uniform in [-1, 1)) or `integers` (in [-4, 4]: every sum is exact in fp32).
//
// Meshes (batch axes (fsdp, dp), feature axis tp), each with the table replicated P() and
// row-wise over its batch axes: np 1 dp1 (row-wise P(dp, None) over an axis of size 1); np 2 and
// 4: dp n, fsdp n; np 4 also fsdp2 x dp2 with P(fsdp, None) (the gradient then all-reduced over
// dp) and P((fsdp, dp), None), and dp2 x tp2 with P(dp, None) (tp ranks hold the same bags).
// Column-wise (each rank of tp a slice of the 12 columns, the pooled slices all-gathered): np 2
// tp2 and np 4 tp4 with P(None, tp) (every rank the whole batch), np 4 dp2 x tp2 with P(None, tp)
// (the gradient all-reduced over dp) and P(dp, tp) (row-wise over dp within each column slice).
//
// What must be bit for bit (the order of every sum is the reference's):
//  * the forward of a replicated or column-wise table (each bag summed in its order, locally;
//    a column's sums do not depend on the other columns);
//  * the forward of a row-wise table with `one shard` ids (each bag's part is its whole sum,
//    added to 0 on the requester);
//  * the table gradient of a row-wise table whose axes are every batch axis of size > 1 (the
//    owner adds the parts in source rank order = batch order, then bag and id order);
//  * with `integers`, every forward and, with sum pooling, every gradient (exact sums).
// Everything else is within kTolerance = 1e-4 absolute: values in [-1, 1], and the test asserts
// that no sum has more than 20 terms (no id occurs more than 20 times in the global batch, no bag
// holds more than 7 ids), so a reordered fp32 sum moves by at most 20 x 2^-24 x 20 = 2.4e-5.
// A second forward and backward allocate nothing (heap and Kokkos, counted), the first no Kokkos
// memory (host memory; emulated device memory stages MPI through buffers grown on first use).
//
// Table-wise (P(axis@k), the whole table on member k of batch axes, none elsewhere): np 1
// P(dp@0) (an axis of size 1: replicated); np 2 and 4 P(dp@n-1) and P(fsdp@1); np 4 also
// fsdp2 x dp2 P(fsdp@1) (the holders' gradient all-reduced over dp) and P((fsdp, dp)@2), and
// dp2 x tp2 P(dp@1). Its forward is bit for bit (a bag is one part, the holder's whole sum) and
// its gradient as row-wise's; the non-holders' blocks are empty.
//
// Errors: an id outside [0, 48) (48, and -1) on the batch of batch rank 0, with the layer used
// again with good bags afterwards; decreasing offsets; more ids than the capacity; a spec that is
// neither replicated, row-wise over batch axes nor column-wise over non-batch axes; a column
// split of a dim it does not divide; a pooling name; mixed precision.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/device_memory_emulation.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/embedding_bag.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;

constexpr int64_t kRows = 48, kDim = 12, kBatch = 16;
constexpr int64_t kOneShardRows = 12;  // rows [0, 12) are owner 0's on every mesh here
constexpr double kTolerance = 1e-4;    // see the header
constexpr int64_t kMostTerms = 20;
const std::string kTable = "cat";

enum class Ids { spread, one_shard };
enum class Values { random, integers };

// The global batch as CSR, the table [kRows, kDim] and dy [kBatch, kDim].
struct Data {
  std::vector<int64_t> offsets, ids;
  std::vector<float> table, dy;
};

Data make_data(Ids ids, Values values, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Data d;
  const int64_t id_range = ids == Ids::one_shard ? kOneShardRows : kRows;
  auto random_id = [&] { return static_cast<int64_t>(rng() % static_cast<uint64_t>(id_range)); };
  d.offsets.push_back(0);
  for (int64_t b = 0; b < kBatch; ++b) {
    if (b % 5 != 2) {  // bags 2, 7, 12 stay empty
      const int64_t count = 1 + static_cast<int64_t>(rng() % 6);
      for (int64_t k = 0; k < count; ++k) d.ids.push_back(random_id());
      if (b == 3) d.ids.push_back(d.ids.back());  // a repeated id
    }
    d.offsets.push_back(static_cast<int64_t>(d.ids.size()));
  }
  auto value = [&]() -> float {
    if (values == Values::integers) return static_cast<float>(static_cast<int64_t>(rng() % 9) - 4);
    return static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  };
  for (int64_t i = 0; i < kRows * kDim; ++i) d.table.push_back(value());
  for (int64_t i = 0; i < kBatch * kDim; ++i) d.dy.push_back(value());
  return d;
}

// What one rank computed: its pooled rows [batch rows, kDim] and its block of the table gradient
// ([rows, columns] from (first_row, first_col)).
struct Result {
  std::vector<float> out, grad;
  int64_t first_bag = 0, first_row = 0, first_col = 0, columns = kDim;
  EmbeddingSharding sharding = EmbeddingSharding::replicated;
  long allocations = -1;
  // Kokkos allocations in the first forward and backward: the layer reserves at construction
  // what its communication stages through (a column-wise table's gather included).
  long first_step_kokkos_allocations = -1;
};

std::vector<float> to_floats(const Tensor& t) {
  return std::vector<float>(t.begin(), t.end());
}

// This rank's bags of `d` (batch slice `index` of `parts`).
struct LocalBags {
  Kokkos::View<int64_t*, Kokkos::LayoutRight> offsets, ids;
};
LocalBags local_bags(const Data& d, int64_t first_bag, int64_t bags) {
  const int64_t begin = d.offsets[static_cast<size_t>(first_bag)];
  const int64_t end = d.offsets[static_cast<size_t>(first_bag + bags)];
  LocalBags l{
      Kokkos::View<int64_t*, Kokkos::LayoutRight>("offsets", bags + 1),
      Kokkos::View<int64_t*, Kokkos::LayoutRight>("ids", std::max<int64_t>(end - begin, 1))};
  auto offsets = Kokkos::create_mirror_view(l.offsets);
  auto ids = Kokkos::create_mirror_view(l.ids);
  for (int64_t b = 0; b <= bags; ++b)
    offsets(b) = d.offsets[static_cast<size_t>(first_bag + b)] - begin;
  for (int64_t k = begin; k < end; ++k) ids(k - begin) = d.ids[static_cast<size_t>(k)];
  Kokkos::deep_copy(l.offsets, offsets);
  Kokkos::deep_copy(l.ids, ids);
  return l;
}

// The most ids any batch slice of `parts` holds (every rank's capacity).
int64_t most_ids(const Data& d, int parts) {
  const int64_t bags = kBatch / parts;
  int64_t most = 0;
  for (int p = 0; p < parts; ++p) {
    most = std::max(most, d.offsets[static_cast<size_t>((p + 1) * bags)] -
                              d.offsets[static_cast<size_t>(p * bags)]);
  }
  return most;
}

struct Built {
  ShardedTensor weight, grad;
};
Built make_table(const Data& d, const PartitionSpec& spec, const Mesh& mesh, int rank) {
  Built t{ShardedTensor::allocate(embedding_weight_name(kTable), {kRows, kDim}, spec, mesh, rank),
          ShardedTensor::allocate(embedding_weight_name(kTable) + "/grad", {kRows, kDim}, spec,
                                  mesh, rank)};
  auto h = Kokkos::create_mirror_view(t.weight.local);
  const int64_t first = t.weight.box.offset[0], rows = t.weight.box.extent[0];
  const int64_t first_col = t.weight.box.offset[1], columns = t.weight.box.extent[1];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < columns; ++c) {
      h(r * columns + c) = d.table[static_cast<size_t>((first + r) * kDim + first_col + c)];
    }
  }
  Kokkos::deep_copy(t.weight.local, h);
  return t;
}

Matrix dy_block(const Data& d, int64_t first_bag, int64_t bags) {
  return testing::block_matrix("dy", bags, kDim, first_bag, 0, [&](int64_t b, int64_t c) {
    return d.dy[static_cast<size_t>(b * kDim + c)];
  });
}

// One forward and backward of the layer on `comms`' mesh with `spec`, then a second counted.
Result run(MeshCommunicators& comms, const PartitionSpec& spec, EmbeddingPooling pooling,
           const Data& d) {
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  Built t = make_table(d, spec, comms.mesh(), comms.rank());
  const int parts = context.batch_parallel();
  const int64_t bags = kBatch / parts;
  Result r;
  r.first_bag = context.batch_index() * bags;
  r.first_row = t.weight.box.offset[0];
  r.first_col = t.weight.box.offset[1];
  r.columns = t.weight.box.extent[1];
  const LocalBags in = local_bags(d, r.first_bag, bags);
  const Matrix dy = dy_block(d, r.first_bag, bags);
  EmbeddingBag layer(kTable, {&t.weight, &t.grad}, pooling, bags, most_ids(d, parts), context);
  r.sharding = layer.sharding();
  const LayerPass pass;
  auto step = [&] {
    layer.forward({in.offsets, in.ids}, pass);
    layer.backward(dy, pass);
  };
  {
    testing::AllocationWindow first;
    step();
    first.close();
    r.first_step_kokkos_allocations = first.kokkos_allocations();
  }
  r.out = to_floats(testing::host_matrix(layer.output()));
  r.grad = to_floats(testing::to_host(t.grad));
  testing::AllocationWindow window;
  step();
  const long heap = window.close();
  r.allocations = heap + window.kokkos_allocations();
  return r;
}

// The reference: the replicated layer on one rank over the whole batch.
Result reference(const Data& d, EmbeddingPooling pooling) {
  MeshCommunicators single(Mesh::single(), MPI_COMM_SELF);
  return run(single, PartitionSpec(), pooling, d);
}

// got vs the reference's matching rows: bit for bit, or within kTolerance.
void expect_rows(const std::vector<float>& got, const std::vector<float>& ref, int64_t first_row,
                 bool bitwise, const char* what) {
  const size_t offset = static_cast<size_t>(first_row * kDim);
  ASSERT_LE(offset + got.size(), ref.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const float want = ref[offset + i];
    if (bitwise) {
      ASSERT_EQ(got[i], want) << what << " element " << offset + i << " (bit for bit)";
    } else {
      ASSERT_NEAR(got[i], want, kTolerance) << what << " element " << offset + i;
    }
  }
}

// A block [rows, columns] from (first_row, first_col) vs the reference's whole [kRows, kDim].
void expect_block(const std::vector<float>& got, const std::vector<float>& ref, int64_t first_row,
                  int64_t first_col, int64_t columns, bool bitwise, const char* what) {
  ASSERT_EQ(got.size() % static_cast<size_t>(columns), 0u) << what;
  const int64_t rows = static_cast<int64_t>(got.size()) / columns;
  ASSERT_LE((first_row + rows) * kDim, static_cast<int64_t>(ref.size())) << what;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < columns; ++c) {
      const float value = got[static_cast<size_t>(r * columns + c)];
      const int64_t at = (first_row + r) * kDim + first_col + c;
      const float want = ref[static_cast<size_t>(at)];
      if (bitwise) {
        ASSERT_EQ(value, want) << what << " element " << at << " (bit for bit)";
      } else {
        ASSERT_NEAR(value, want, kTolerance) << what << " element " << at;
      }
    }
  }
}

struct TableMeshCase {
  testing::Axes axes;
  std::vector<PartitionSpec> specs;
};

std::vector<TableMeshCase> mesh_cases(int n) {
  auto P = [](const std::string& text) { return PartitionSpec::parse(text); };
  std::vector<TableMeshCase> cases;
  // Table-wise specs come placed (P(axis@k): what the planner makes of P(axis@table)).
  if (n == 1) {
    return {{{{"dp", 1}}, {P("P()"), P("P(dp, None)"), P("P(dp@0, None)")}},
            {{{"tp", 1}}, {P("P(None, tp)")}}};  // column-wise over an axis of size 1
  }
  const std::string last = std::to_string(n - 1);
  cases.push_back({{{"dp", n}}, {P("P()"), P("P(dp, None)"), P("P(dp@" + last + ", None)")}});
  cases.push_back({{{"fsdp", n}}, {P("P()"), P("P(fsdp, None)"), P("P(fsdp@1, None)")}});
  cases.push_back({{{"tp", n}}, {P("P()"), P("P(None, tp)")}});  // column-wise, the whole batch
  if (n == 4) {
    cases.push_back({{{"fsdp", 2}, {"dp", 2}},
                     {P("P()"), P("P(fsdp, None)"), P("P((fsdp, dp), None)"), P("P(fsdp@1, None)"),
                      P("P((fsdp, dp)@2, None)")}});
    cases.push_back(
        {{{"dp", 2}, {"tp", 2}},
         {P("P()"), P("P(dp, None)"), P("P(None, tp)"), P("P(dp, tp)"), P("P(dp@1, None)")}});
  }
  return cases;
}

std::string describe(const testing::Axes& axes) {
  std::string text;
  for (const auto& [axis, size] : axes)
    text += (text.empty() ? "" : " x ") + axis + std::to_string(size);
  return text;
}

// Whether the row axes of `spec` cover every batch axis of size > 1 of `mesh` (then nothing
// sums the gradient after the owners: it adds up in the reference's order).
bool rows_cover_batch(const PartitionSpec& spec, const Mesh& mesh) {
  const std::vector<std::string> rows =
      spec.is_replicated() ? std::vector<std::string>{} : spec.entries[0].axes;
  for (const std::string axis : {"fsdp", "dp"}) {
    if (mesh.has_axis(axis) && mesh.axis_size(axis) > 1 &&
        std::find(rows.begin(), rows.end(), axis) == rows.end()) {
      return false;
    }
  }
  return true;
}

// The sums of the data stay within kMostTerms terms (the tolerance's premise).
void expect_few_terms(const Data& d) {
  std::map<int64_t, int64_t> occurrences;
  for (int64_t id : d.ids) ++occurrences[id];
  for (const auto& [id, count] : occurrences) ASSERT_LE(count, kMostTerms) << "id " << id;
  for (size_t b = 0; b + 1 < d.offsets.size(); ++b) {
    ASSERT_LE(d.offsets[b + 1] - d.offsets[b], 7) << "bag " << b;
  }
}

TEST(EmbeddingBag, DataHasEmptyBagsRepeatedIdsAndFewTerms) {
  for (Ids ids : {Ids::spread, Ids::one_shard}) {
    const Data d = make_data(ids, Values::random, 7);
    expect_few_terms(d);
    for (int64_t b : {2, 7, 12}) EXPECT_EQ(d.offsets[b + 1], d.offsets[b]) << "bag " << b;
    EXPECT_EQ(d.ids[d.offsets[4] - 1], d.ids[d.offsets[4] - 2]) << "bag 3's repeated id";
  }
  // The spread ids reach every owner of a four-way split, so bags span several owners.
  const Data d = make_data(Ids::spread, Values::random, 7);
  std::vector<bool> owners(4, false);
  for (int64_t id : d.ids) owners[static_cast<size_t>(id / (kRows / 4))] = true;
  EXPECT_EQ(std::count(owners.begin(), owners.end(), true), 4);
}

// The reference itself, against sums written out here (so that a wrong reference cannot make
// every mesh agree with it).
TEST(EmbeddingBag, ReferenceIsTheSumOfItsRows) {
  for (EmbeddingPooling pooling : {EmbeddingPooling::sum, EmbeddingPooling::mean}) {
    const Data d = make_data(Ids::spread, Values::random, 11);
    const Result r = reference(d, pooling);
    std::vector<double> grad(static_cast<size_t>(kRows * kDim), 0.0);
    for (int64_t b = 0; b < kBatch; ++b) {
      const int64_t begin = d.offsets[b], end = d.offsets[b + 1];
      for (int64_t c = 0; c < kDim; ++c) {
        double sum = 0.0;
        for (int64_t k = begin; k < end; ++k) sum += d.table[d.ids[k] * kDim + c];
        const double scale =
            pooling == EmbeddingPooling::mean && end > begin ? 1.0 / (end - begin) : 1.0;
        EXPECT_NEAR(r.out[b * kDim + c], sum * scale, 1e-5) << "bag " << b;
        if (end == begin) EXPECT_EQ(r.out[b * kDim + c], 0.0f) << "empty bag " << b;
        for (int64_t k = begin; k < end; ++k)
          grad[d.ids[k] * kDim + c] += d.dy[b * kDim + c] * scale;
      }
    }
    for (size_t i = 0; i < grad.size(); ++i) EXPECT_NEAR(r.grad[i], grad[i], 1e-5) << "grad " << i;
    EXPECT_EQ(r.allocations, 0);
  }
}

TEST(EmbeddingBag, EveryShardingEqualsOneRank) {
  const int n = world_size();
  for (const TableMeshCase& c : mesh_cases(n)) {
    const Mesh mesh = Mesh::create(c.axes, n);
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    for (const PartitionSpec& spec : c.specs) {
      for (Ids ids : {Ids::spread, Ids::one_shard}) {
        for (Values values : {Values::random, Values::integers}) {
          for (EmbeddingPooling pooling : {EmbeddingPooling::sum, EmbeddingPooling::mean}) {
            const Data d = make_data(
                ids, values, 20 + static_cast<uint64_t>(ids) * 2 + static_cast<uint64_t>(values));
            SCOPED_TRACE(describe(c.axes) + " " + spec.to_string() + " " + to_string(pooling) +
                         (ids == Ids::one_shard ? " one shard" : " spread") +
                         (values == Values::integers ? " integers" : " random"));
            const Result ref = reference(d, pooling);
            const Result got = run(comms, spec, pooling, d);
            const bool rows_split = !spec.is_replicated() && mesh.size_of(spec.entries[0].axes) > 1;
            const bool table_wise = rows_split && spec.entries[0].table;
            const bool row_wise = rows_split && !table_wise;
            EXPECT_EQ(got.sharding, table_wise ? EmbeddingSharding::table_wise
                                    : row_wise ? EmbeddingSharding::row_wise
                                               : EmbeddingSharding::replicated);
            if (table_wise) {
              // The holder has every row, the other members none (no memory).
              const bool holder =
                  mesh.group_index(comms.rank(), spec.entries[0].axes) == spec.entries[0].member;
              EXPECT_EQ(got.grad.size(), holder ? static_cast<size_t>(kRows * kDim) : 0u);
            }
            const bool exact = values == Values::integers;
            // Table-wise: a bag is one part, summed whole by the holder in its order.
            const bool forward_bitwise = !row_wise || ids == Ids::one_shard || exact;
            const bool grad_bitwise =
                rows_cover_batch(spec, mesh) || (exact && pooling == EmbeddingPooling::sum);
            const bool column_wise = spec.with_rank(2).entries[1].axes.size() > 0 &&
                                     mesh.size_of(spec.with_rank(2).entries[1].axes) > 1;
            EXPECT_EQ(got.columns, column_wise ? kDim / mesh.axis_size("tp") : kDim);
            expect_rows(got.out, ref.out, got.first_bag, forward_bitwise, "pooled rows");
            expect_block(got.grad, ref.grad, got.first_row, got.first_col, got.columns,
                         grad_bitwise, "table gradient");
            EXPECT_EQ(got.allocations, 0) << "allocations in a second forward and backward";
            // (Emulated device memory: MPI's host staging grows on first use, as in every
            // layer; the training step's tests count from the second step.)
            if (!device_memory_emulated()) {
              EXPECT_EQ(got.first_step_kokkos_allocations, 0)
                  << "Kokkos allocations in the first forward and backward";
            }
          }
        }
      }
    }
  }
}

// A gradient left partial (DeferredReduction::later, for gradient accumulation) and all-reduced
// afterwards equals the one reduced in backward, bit for bit; before that all-reduce it is this
// rank's part only (it differs from the sum wherever other ranks' bags add to it).
TEST(EmbeddingBag, DeferredGradientEqualsTheOneReducedInBackward) {
  const int n = world_size();
  int deferrable = 0;
  for (const TableMeshCase& c : mesh_cases(n)) {
    const Mesh mesh = Mesh::create(c.axes, n);
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    ParallelContext context(comms, {"fsdp", "dp"}, "tp");
    const Data d = make_data(Ids::spread, Values::random, 9);
    const int64_t bags = kBatch / context.batch_parallel();
    const int64_t first_bag = context.batch_index() * bags;
    const LocalBags in = local_bags(d, first_bag, bags);
    const Matrix dy = dy_block(d, first_bag, bags);
    for (const PartitionSpec& spec : c.specs) {
      SCOPED_TRACE(describe(c.axes) + " " + spec.to_string());
      Built t = make_table(d, spec, mesh, comms.rank());
      EmbeddingBag layer(kTable, {&t.weight, &t.grad}, EmbeddingPooling::mean, bags,
                         most_ids(d, context.batch_parallel()), context);
      const bool expected = !rows_cover_batch(spec, mesh);  // something left to all-reduce
      EXPECT_EQ(layer.can_leave_gradients_partial(), expected);
      if (!layer.can_leave_gradients_partial()) continue;
      ++deferrable;
      layer.forward({in.offsets, in.ids}, {});
      layer.backward(dy, {});
      const std::vector<float> reduced = to_floats(testing::to_host(t.grad));
      LayerPass later;
      later.deferred = DeferredReduction::later;
      layer.forward({in.offsets, in.ids}, {});
      layer.backward(dy, later);
      const std::vector<float> partial = to_floats(testing::to_host(t.grad));
      layer.sharded_parameters()[0]->all_reduce_deferred();
      EXPECT_EQ(to_floats(testing::to_host(t.grad)), reduced);
      if (!reduced.empty()) EXPECT_NE(partial, reduced);  // empty: not the table-wise holder
    }
  }
  if (n > 1) EXPECT_GT(deferrable, 0);
}

// An id outside the table on batch rank 0: that rank names it; under row-wise sharding every
// rank of the group throws too (and none waits for the others); the layer then works again.
TEST(EmbeddingBag, IdOutsideTheTableIsBadInputOnTheWholeGroup) {
  const int n = world_size();
  for (const TableMeshCase& c : mesh_cases(n)) {
    if (c.axes.size() != 1) continue;  // one group holds every rank
    const Mesh mesh = Mesh::create(c.axes, n);
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    for (const PartitionSpec& spec : c.specs) {
      for (int64_t bad : {kRows, int64_t{-1}}) {
        SCOPED_TRACE(describe(c.axes) + " " + spec.to_string() + " id " + std::to_string(bad));
        ParallelContext context(comms, {"fsdp", "dp"}, "tp");
        const Data good = make_data(Ids::spread, Values::random, 5);
        Data wrong = good;
        wrong.ids[static_cast<size_t>(good.offsets[1])] = bad;  // bag 1, batch rank 0's
        Built t = make_table(good, spec, mesh, comms.rank());
        const int64_t bags = kBatch / context.batch_parallel();
        const int64_t first_bag = context.batch_index() * bags;
        const int64_t capacity = most_ids(good, context.batch_parallel());
        EmbeddingBag layer(kTable, {&t.weight, &t.grad}, EmbeddingPooling::sum, bags, capacity,
                           context);
        const LocalBags in_wrong = local_bags(wrong, first_bag, bags);
        const bool row_wise = layer.sharding() != EmbeddingSharding::replicated;  // or table-wise
        if (context.batch_index() == 0) {
          testing::expect_bad_input(
              [&] {
                layer.forward({in_wrong.offsets, in_wrong.ids}, {});
              },
              {"table '" + kTable + "'", "id " + std::to_string(bad),
               "[0, " + std::to_string(kRows) + ")"});
        } else if (row_wise) {
          testing::expect_bad_input(
              [&] {
                layer.forward({in_wrong.offsets, in_wrong.ids}, {});
              },
              {"table '" + kTable + "'",
               std::string("rank 0 of the ") + to_string(layer.sharding()) + " group", "bad bags"});
        } else {
          EXPECT_NO_THROW(layer.forward({in_wrong.offsets, in_wrong.ids}, {}));
        }
        // Good bags afterwards: the same as one rank.
        const LocalBags in = local_bags(good, first_bag, bags);
        const Matrix dy = dy_block(good, first_bag, bags);
        layer.forward({in.offsets, in.ids}, {});
        layer.backward(dy, {});
        const Result ref = reference(good, EmbeddingPooling::sum);
        expect_rows(to_floats(testing::host_matrix(layer.output())), ref.out, first_bag,
                    layer.sharding() != EmbeddingSharding::row_wise, "pooled rows after the error");
        expect_block(to_floats(testing::to_host(t.grad)), ref.grad, t.weight.box.offset[0],
                     t.weight.box.offset[1], t.weight.box.extent[1], rows_cover_batch(spec, mesh),
                     "table gradient after the error");
      }
    }
  }
}

// Tables that exchange rows over the same group through one shared EmbeddingExchange (as Dlrm
// builds them: 4 all-to-alls a step for all of them) compute what each computes through its
// own, bit for bit: the pooled rows and the table gradient of three tables on dp n (row-wise
// P(dp, None) sum with spread ids, table-wise P(dp@n-1, None) mean, row-wise with one-shard
// ids), and at np 4 on dp 2 x tp 2 (P(dp, None), P(dp, tp): 6 of the 12 columns, a narrower
// table in the same message, and P(dp@1, None)) and fsdp 2 x dp 2 (P((fsdp, dp), None),
// P((fsdp, dp)@2, None), P((fsdp, dp), None)); two steps, the second allocating nothing. An id
// outside the second table on batch rank 0: every rank throws at the same call naming that
// table (rank 0 the id, the others rank 0's bad bags), and good bags afterwards still match;
// then rank 0 bad in the second table and the last batch rank in the first: every rank names
// the first (the first slot in order with a problem).
// np 1 has no group (the tables are replicated): skipped.
TEST(EmbeddingBag, SharedExchangeEqualsOwnExchanges) {
  const int n = world_size();
  if (n == 1) GTEST_SKIP() << "no row exchange on one rank";
  auto P = [](const std::string& text) { return PartitionSpec::parse(text); };
  std::vector<TableMeshCase> cases = {
      {{{"dp", n}},
       {P("P(dp, None)"), P("P(dp@" + std::to_string(n - 1) + ", None)"), P("P(dp, None)")}}};
  if (n == 4) {
    cases.push_back(
        {{{"dp", 2}, {"tp", 2}}, {P("P(dp, None)"), P("P(dp, tp)"), P("P(dp@1, None)")}});
    cases.push_back(
        {{{"fsdp", 2}, {"dp", 2}},
         {P("P((fsdp, dp), None)"), P("P((fsdp, dp)@2, None)"), P("P((fsdp, dp), None)")}});
  }
  const std::vector<EmbeddingPooling> poolings = {EmbeddingPooling::sum, EmbeddingPooling::mean,
                                                  EmbeddingPooling::sum};
  const std::vector<Data> data = {make_data(Ids::spread, Values::random, 11),
                                  make_data(Ids::spread, Values::random, 12),
                                  make_data(Ids::one_shard, Values::random, 13)};
  for (const TableMeshCase& c : cases) {
    SCOPED_TRACE(describe(c.axes));
    const Mesh mesh = Mesh::create(c.axes, n);
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    ParallelContext context(comms, {"fsdp", "dp"}, "tp");
    const int parts = context.batch_parallel();
    const int64_t bags = kBatch / parts;
    const int64_t first_bag = context.batch_index() * bags;
    std::vector<Built> own_tables, shared_tables;
    std::vector<EmbeddingBag> own, shared;
    std::vector<LocalBags> local;
    std::vector<SparseBags> in;
    std::vector<Matrix> dy;
    own.reserve(3);
    shared.reserve(3);
    for (size_t k = 0; k < 3; ++k) {
      own_tables.push_back(make_table(data[k], c.specs[k], mesh, comms.rank()));
      shared_tables.push_back(make_table(data[k], c.specs[k], mesh, comms.rank()));
      local.push_back(local_bags(data[k], first_bag, bags));
      dy.push_back(dy_block(data[k], first_bag, bags));
    }
    int64_t capacity = 0;
    for (const Data& d : data) capacity = std::max(capacity, most_ids(d, parts));
    for (size_t k = 0; k < 3; ++k) {
      const std::string name = "t" + std::to_string(k);
      own.emplace_back(name, ParameterRef{&own_tables[k].weight, &own_tables[k].grad}, poolings[k],
                       bags, capacity, context);
      shared.emplace_back(name, ParameterRef{&shared_tables[k].weight, &shared_tables[k].grad},
                          poolings[k], bags, capacity, context, RowExchange::shared);
      ASSERT_TRUE(shared.back().exchanges_rows()) << name;
      in.push_back({local[k].offsets, local[k].ids});
    }
    std::vector<EmbeddingBag*> members = {&shared[0], &shared[1], &shared[2]};
    EmbeddingExchange exchange(members);
    ASSERT_EQ(exchange.table_count(), 3u);
    const LayerPass pass;
    auto shared_step = [&](const SparseBags* bags_in) {
      exchange.forward(members.data(), bags_in);
      for (EmbeddingBag& t : shared) t.backward_begin(dy[&t - shared.data()]);
      exchange.exchange_dy();
      for (EmbeddingBag& t : shared) t.backward_end(pass);
    };
    auto compare = [&](const char* when) {
      for (size_t k = 0; k < 3; ++k) {
        SCOPED_TRACE(std::string(when) + " table t" + std::to_string(k) + " " +
                     c.specs[k].to_string());
        own[k].forward(in[k], pass);
        own[k].backward(dy[k], pass);
        const Tensor got_out = testing::host_matrix(shared[k].output());
        const Tensor want_out = testing::host_matrix(own[k].output());
        ASSERT_EQ(got_out.size(), want_out.size());
        for (size_t i = 0; i < got_out.size(); ++i) {
          ASSERT_EQ(got_out[i], want_out[i]) << "pooled element " << i;
        }
        const Tensor got_grad = testing::to_host(shared_tables[k].grad);
        const Tensor want_grad = testing::to_host(own_tables[k].grad);
        ASSERT_EQ(got_grad.size(), want_grad.size());
        for (size_t i = 0; i < got_grad.size(); ++i) {
          ASSERT_EQ(got_grad[i], want_grad[i]) << "gradient element " << i;
        }
      }
    };
    shared_step(in.data());
    compare("first step");
    {
      testing::AllocationWindow window;
      shared_step(in.data());
      const long heap = window.close();
      EXPECT_EQ(heap + window.kokkos_allocations(), 0) << "allocations in a second shared step";
    }
    compare("second step");

    // A bad id in t1's bag 1 (batch rank 0's): every rank of the group throws naming t1.
    Data wrong = data[1];
    wrong.ids[static_cast<size_t>(wrong.offsets[1])] = kRows;
    const LocalBags local_wrong = local_bags(wrong, first_bag, bags);
    std::vector<SparseBags> in_wrong = in;
    in_wrong[1] = {local_wrong.offsets, local_wrong.ids};
    const auto bad_forward = [&] { exchange.forward(members.data(), in_wrong.data()); };
    if (context.batch_index() == 0) {
      testing::expect_bad_input(bad_forward, {"table 't1'", "id 48"});
    } else {
      testing::expect_bad_input(bad_forward, {"table 't1'", "rank 0 of the", "bad bags"});
    }
    shared_step(in.data());
    compare("after the bad id");

    // Rank 0's bags bad in t1 (as above) and the last batch rank's in t0: every rank names t0,
    // the first table in slot order with a problem (the last rank its own id, the others its
    // bad bags), whatever came first on each rank.
    const int last = parts - 1;
    Data wrong_first = data[0];
    int64_t b = last * bags;
    while (b < (last + 1) * bags && wrong_first.offsets[static_cast<size_t>(b)] ==
                                        wrong_first.offsets[static_cast<size_t>(b + 1)]) {
      ++b;
    }
    ASSERT_LT(b, (last + 1) * bags) << "the last batch rank's bags of t0 are all empty";
    wrong_first.ids[static_cast<size_t>(wrong_first.offsets[static_cast<size_t>(b)])] = kRows;
    const LocalBags local_first = local_bags(wrong_first, first_bag, bags);
    std::vector<SparseBags> in_both = in_wrong;
    in_both[0] = {local_first.offsets, local_first.ids};
    const auto both_forward = [&] { exchange.forward(members.data(), in_both.data()); };
    if (context.batch_index() == last) {
      testing::expect_bad_input(both_forward, {"table 't0'", "id 48"});
    } else {
      testing::expect_bad_input(
          both_forward, {"table 't0'", "rank " + std::to_string(last) + " of the", "bad bags"});
    }
    shared_step(in.data());
    compare("after the bad ids in two tables");
  }
}

// The counts a rank receives are checked before they size its kernels (check_received_counts,
// called on every source's row of the counts' message): whole, finite, 0 < parts <= ids <= the
// capacity, or both 0; anything else is an internal error naming the table and the source,
// never an index past the buffers. The exchange itself sends only good counts (its senders
// check their bags), so the check is tested here directly, with the values a corrupted message
// could hold; on every rank alike (no communication).
TEST(EmbeddingBag, ReceivedCountsOutsideTheCapacityAreInternalErrors) {
  const int64_t capacity = 10;
  for (const auto& [ids, parts] : std::vector<std::pair<float, float>>{
           {0.0f, 0.0f}, {1.0f, 1.0f}, {10.0f, 1.0f}, {10.0f, 10.0f}}) {
    EXPECT_NO_THROW(check_received_counts("t", 1, ids, parts, capacity)) << ids << ", " << parts;
  }
  const float nan = std::nanf(""), inf = INFINITY;
  for (const auto& [ids, parts] : std::vector<std::pair<float, float>>{{11.0f, 1.0f},
                                                                       {1e30f, 1.0f},
                                                                       {3.0f, 4.0f},
                                                                       {-1.0f, -1.0f},
                                                                       {2.0f, -1.0f},
                                                                       {2.0f, 0.0f},
                                                                       {0.0f, 1.0f},
                                                                       {2.5f, 1.0f},
                                                                       {2.0f, 1.5f},
                                                                       {nan, 1.0f},
                                                                       {2.0f, nan},
                                                                       {inf, 1.0f},
                                                                       {2.0f, -inf}}) {
    SCOPED_TRACE(std::to_string(ids) + " ids, " + std::to_string(parts) + " parts");
    testing::expect_error([&] { check_received_counts("t", 1, ids, parts, capacity); },
                          ErrorKind::runtime,
                          {"table 't'", "rank 1 of the group", "capacity of 10"});
  }
}

TEST(EmbeddingBag, BadBagsAndSpecsAreBadInput) {
  const int n = world_size();
  const Mesh mesh = Mesh::create({{"fsdp", n}}, n);
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const Data d = make_data(Ids::spread, Values::random, 3);
  const int64_t bags = kBatch / n, first_bag = context.batch_index() * bags;
  const int64_t capacity = most_ids(d, n);
  for (const char* text : {"P()", "P(fsdp, None)"}) {
    SCOPED_TRACE(text);
    Built t = make_table(d, PartitionSpec::parse(text), mesh, comms.rank());
    EmbeddingBag layer(kTable, {&t.weight, &t.grad}, EmbeddingPooling::mean, bags, capacity,
                       context);
    EXPECT_NE(layer.describe().find(layer.sharding() == EmbeddingSharding::row_wise
                                        ? "mean, row-wise over (fsdp)"
                                        : "mean, replicated"),
              std::string::npos)
        << layer.describe();
    // Decreasing offsets (every rank's bags).
    LocalBags in = local_bags(d, first_bag, bags);
    auto offsets = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), in.offsets);
    const int64_t saved = offsets(1);
    offsets(1) = offsets(2) + 1;
    Kokkos::deep_copy(in.offsets, offsets);
    testing::expect_bad_input(
        [&] {
          layer.forward({in.offsets, in.ids}, {});
        },
        {"table '" + kTable + "'", "decrease at bag"});
    offsets(1) = saved;
    Kokkos::deep_copy(in.offsets, offsets);
    EXPECT_NO_THROW(layer.forward({in.offsets, in.ids}, {}));
    // More ids than the capacity: a layer built for fewer.
    Built small = make_table(d, PartitionSpec::parse(text), mesh, comms.rank());
    EmbeddingBag tight(kTable, {&small.weight, &small.grad}, EmbeddingPooling::sum, bags, 1,
                       context);
    const int64_t mine = d.offsets[first_bag + bags] - d.offsets[first_bag];
    if (mine > 1) {
      testing::expect_bad_input(
          [&] {
            tight.forward({in.offsets, in.ids}, {});
          },
          {"table '" + kTable + "'", "capacity of 1 ids"});
    } else if (tight.sharding() == EmbeddingSharding::row_wise) {
      testing::expect_bad_input(
          [&] {
            tight.forward({in.offsets, in.ids}, {});
          },
          {"table '" + kTable + "'", "bad bags"});
    }
  }
  // Specs other than P(), P(batch axes, None) and P(None, non-batch axes).
  {  // column-wise over a batch axis (its ranks hold different bags), on a table whose dim
     // divides by any world size here
    const PartitionSpec columns = PartitionSpec::parse("P(None, fsdp)");
    ShardedTensor weight = ShardedTensor::allocate(embedding_weight_name(kTable), {kRows, 8},
                                                   columns, mesh, comms.rank());
    ShardedTensor grad = ShardedTensor::allocate("grad", {kRows, 8}, columns, mesh, comms.rank());
    testing::expect_bad_input(
        [&] {
          EmbeddingBag(kTable, {&weight, &grad}, EmbeddingPooling::sum, bags, capacity, context);
        },
        {"table '" + kTable + "'", embedding_weight_name(kTable), "P(None, fsdp)", "P(axis, None)",
         "P(None, axis)", "not a batch axis"});
  }
  // Row-wise over a feature axis (not a batch axis).
  const Mesh tp = Mesh::create({{"tp", n}}, n);
  MeshCommunicators tp_comms(tp, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext tp_context(tp_comms, {"fsdp", "dp"}, "tp");
  Built t = make_table(d, PartitionSpec::parse("P(tp, None)"), tp, tp_comms.rank());
  testing::expect_bad_input(
      [&] {
        EmbeddingBag(kTable, {&t.weight, &t.grad}, EmbeddingPooling::sum, kBatch, 100, tp_context);
      },
      {"table '" + kTable + "'", "P(tp, None)", "batch axes"});
  // Mixed precision.
  ParallelContext bf16(comms, {"fsdp", "dp"}, "tp");
  bf16.set_precision({Dtype::bf16, Dtype::fp32});
  Built w = make_table(d, PartitionSpec(), mesh, comms.rank());
  testing::expect_bad_input(
      [&] {
        EmbeddingBag(kTable, {&w.weight, &w.grad}, EmbeddingPooling::sum, bags, 100, bf16);
      },
      {"table '" + kTable + "'", "fp32"});
}

TEST(EmbeddingBag, PoolingNames) {
  EXPECT_EQ(parse_embedding_pooling("sum", "model.tables.cat.pooling"), EmbeddingPooling::sum);
  EXPECT_EQ(parse_embedding_pooling("mean", "model.tables.cat.pooling"), EmbeddingPooling::mean);
  testing::expect_bad_input([] { parse_embedding_pooling("max", "model.tables.cat.pooling"); },
                            {"model.tables.cat.pooling", "'max'", "'sum' or 'mean'"});
}

}  // namespace
}  // namespace meshtrain
