// SparseHdf5Reader (framework/io/sparse_hdf5.hpp, issue 39 items 3 and 6): this rank's rows of a
// batch as CSR per table, read from a file of scripts/make_recsys_data's layout written here.
//
// Data: 40 rows, two tables: `one` (10 rows, one id per row, as Criteo's categorical features)
// and `bags` (48 rows, bags of 0 to 4 ids: empty bags, and a repeated id in every fifth row).
//
// - The reader against the rows written (a one-rank reader, shuffled rows with repeats, a
//   range), and that a range costs one offsets and one values read per table.
// - On dp n, fsdp n (np 2, 4), fsdp 2 x dp 2 and dp 2 x tp 2 (np 4): every rank's CSR of
//   every step (shuffled, crossing an epoch) and of a contiguous range equals the rows of its
//   batch slice in a one-rank read of the whole global batch in the same test; fed to
//   EmbeddingBag (replicated and row-wise), the pooled rows and the table gradient equal the
//   one-rank layer's on the one-rank read, bit for bit (integer weights and dy: exact sums).
// - Bad files, each one sentence naming the file, the table and the global row, the same
//   AgreedError on every rank at the same read (the row read by one rank only): an id outside
//   the table (two bad rows: the lower one is named on every mesh), decreasing offsets, an
//   offset past the ids, offsets[0] != 0 and a last offset != the number of ids (at open), a
//   missing table (at open), more ids than the capacity.
// - A row past the file and a read longer than max_rows on one rank: a runtime AgreedError on
//   every rank, and the reader reads on.
// - A read allocates nothing on the heap (operator new, counted; HDF5's own mallocs are not).
// - Chunked files (tables held in memory whole, a batch gathered from there): CSR and fixed
//   hotness, int64 and int32 ids, all resident and under a smaller bound a mix, read as the
//   contiguous file; the bytes held as dlrm_data_cache_bytes counts them (the int64 copy's).
// - The plan's dlrm_bags finds the largest bag the reader finds (max_ids < 0).

#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "framework/io/data.hpp"
#include "framework/io/sparse_hdf5.hpp"
#include "layers/context.hpp"
#include "layers/embedding_bag.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "tests/support/agreed_error.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kRows = 40, kBatch = 8, kDim = 3, kMostPerBag = 4;

struct TableData {
  std::string name;
  int64_t table_rows = 0;
  std::vector<int64_t> offsets, values;
  int64_t hotness = 0;  // > 0: written as fixed-hotness ids [rows, hotness], not CSR
};
using FileData = std::vector<TableData>;

FileData make_data() {
  std::mt19937_64 rng(39);
  TableData one{"one", 10, {0}, {}}, bags{"bags", 48, {0}, {}}, pair{"pair", 48, {0}, {}, 2};
  for (int64_t r = 0; r < kRows; ++r) {
    one.values.push_back(static_cast<int64_t>(rng() % 10));
    one.offsets.push_back(static_cast<int64_t>(one.values.size()));
    const int64_t count = static_cast<int64_t>(rng() % (kMostPerBag + 1));  // 0 .. 4
    for (int64_t k = 0; k < count; ++k) {
      const bool repeat = r % 5 == 0 && k > 0;
      bags.values.push_back(repeat ? bags.values.back() : static_cast<int64_t>(rng() % 48));
    }
    bags.offsets.push_back(static_cast<int64_t>(bags.values.size()));
    for (int k = 0; k < 2; ++k) pair.values.push_back(static_cast<int64_t>(rng() % 48));
    pair.offsets.push_back(static_cast<int64_t>(pair.values.size()));
  }
  return {one, bags, pair};
}

// How a file's id datasets are stored: contiguous (chunk_rows 0) or in chunks of chunk_rows rows
// (as scripts/make_recsys_data writes them), as int64 or a narrower integer type.
struct Storage {
  hsize_t chunk_rows = 0;
  bool int32 = false;
};

void write_ids(hid_t group, const char* name, const std::vector<int64_t>& data, int64_t hotness = 0,
               Storage storage = {}) {
  const hsize_t n[2] = {hotness > 0 ? data.size() / static_cast<size_t>(hotness) : data.size(),
                        static_cast<hsize_t>(hotness)};
  const hid_t space = H5Screate_simple(hotness > 0 ? 2 : 1, n, nullptr);
  const hid_t create = H5Pcreate(H5P_DATASET_CREATE);
  if (storage.chunk_rows > 0 && n[0] > 0) {
    const hsize_t chunk[2] = {std::min(storage.chunk_rows, n[0]), n[1]};
    ASSERT_GE(H5Pset_chunk(create, hotness > 0 ? 2 : 1, chunk), 0);
  }
  const hid_t set = H5Dcreate2(group, name, storage.int32 ? H5T_STD_I32LE : H5T_STD_I64LE, space,
                               H5P_DEFAULT, create, H5P_DEFAULT);
  ASSERT_GE(set, 0);
  if (!data.empty())
    ASSERT_GE(H5Dwrite(set, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()), 0);
  H5Dclose(set);
  H5Pclose(create);
  H5Sclose(space);
}

// Rank 0 writes the file; every rank waits for it.
void write_file(const std::string& path, const FileData& tables, Storage storage = {}) {
  if (world_rank() == 0) {
    const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(file, 0);
    const hid_t sparse = H5Gcreate2(file, "sparse", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    for (const TableData& t : tables) {
      const hid_t group = H5Gcreate2(sparse, t.name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      if (t.hotness > 0) {
        write_ids(group, "ids", t.values, t.hotness, storage);
      } else {
        write_ids(group, "values", t.values, 0, storage);
        write_ids(group, "offsets", t.offsets, 0, storage);
      }
      const hid_t scalar = H5Screate(H5S_SCALAR);
      const hid_t attr = H5Acreate2(group, "rows", H5T_STD_I64LE, scalar, H5P_DEFAULT, H5P_DEFAULT);
      H5Awrite(attr, H5T_NATIVE_INT64, &t.table_rows);
      H5Aclose(attr);
      H5Sclose(scalar);
      H5Gclose(group);
    }
    H5Gclose(sparse);
    H5Fclose(file);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

const std::vector<std::string> kTables = {"one", "bags", "pair"};

// One table's CSR as plain vectors.
struct Csr {
  std::vector<int64_t> offsets, values;
  bool operator==(const Csr& o) const { return offsets == o.offsets && values == o.values; }
};
Csr csr(const SparseTableRows& t) {
  return {std::vector<int64_t>(t.offsets, t.offsets + t.rows + 1),
          std::vector<int64_t>(t.values, t.values + t.ids())};
}
// Rows [first, first + count) of a CSR, rebased.
Csr slice(const Csr& all, int64_t first, int64_t count) {
  Csr s;
  const int64_t begin = all.offsets[first], end = all.offsets[first + count];
  for (int64_t r = first; r <= first + count; ++r) s.offsets.push_back(all.offsets[r] - begin);
  s.values.assign(all.values.begin() + begin, all.values.begin() + end);
  return s;
}
// The written rows `rows` of a table, straight from the data.
Csr expected(const TableData& t, const std::vector<int64_t>& rows) {
  Csr c{{0}, {}};
  for (int64_t r : rows) {
    for (int64_t k = t.offsets[r]; k < t.offsets[r + 1]; ++k) c.values.push_back(t.values[k]);
    c.offsets.push_back(static_cast<int64_t>(c.values.size()));
  }
  return c;
}

TEST(SparseHdf5Reader, ReadsTheRowsAskedFor) {
  testing::TempDir dir(true);
  const std::string path = dir.file("sparse.h5");
  const FileData data = make_data();
  write_file(path, data);
  SparseHdf5Reader reader(path, kTables, kRows, kRows * kMostPerBag, MPI_COMM_SELF);
  EXPECT_EQ(reader.num_rows(), kRows);
  EXPECT_EQ(reader.table_rows(0), 10);
  EXPECT_EQ(reader.table_rows(1), 48);
  const std::vector<int64_t> rows = {17, 3, 4, 5, 39, 0, 17, 22, 23};  // runs and a repeat
  reader.read(rows.data(), static_cast<int64_t>(rows.size()));
  for (size_t t = 0; t < data.size(); ++t) {
    EXPECT_TRUE(csr(reader.batch(t)) == expected(data[t], rows)) << data[t].name;
  }
  std::vector<int64_t> range(12);
  for (int64_t i = 0; i < 12; ++i) range[i] = 9 + i;
  reader.read_range(9, 12);
  for (size_t t = 0; t < data.size(); ++t) {
    EXPECT_TRUE(csr(reader.batch(t)) == expected(data[t], range)) << data[t].name;
  }
  EXPECT_EQ(reader.table_rows(2), 48);
  {  // the buffers were sized at open: another batch allocates nothing of meshtrain's own
    testing::AllocationWindow window;
    reader.read(rows.data(), static_cast<int64_t>(rows.size()));
    reader.read_range(9, 12);
    EXPECT_EQ(window.close(), 0) << "heap allocations in read()";
  }
  EXPECT_EQ(reader.reads_last_batch(), 5)
      << "a range: one offsets and one values read per CSR table, one ids read per fixed one";
  // Shuffled rows (runs, a repeat): the same 5 reads, the rows' offsets and then their ids each
  // one point selection in file order, put back in the order asked for.
  reader.read(rows.data(), static_cast<int64_t>(rows.size()));
  EXPECT_EQ(reader.reads_last_batch(), 5) << "shuffled rows: still one read per dataset";
  for (size_t t = 0; t < data.size(); ++t) {
    EXPECT_TRUE(csr(reader.batch(t)) == expected(data[t], rows)) << data[t].name;
  }
  EXPECT_EQ(reader.chunk_cache_bytes(), 0) << "contiguous datasets: HDF5 keeps no chunk cache";
  // The data has what the layer tests need: empty bags and repeated ids.
  const Csr all = expected(data[1], range);
  EXPECT_NE(std::adjacent_find(all.offsets.begin(), all.offsets.end()), all.offsets.end());
}

// Chunked files are held in memory whole at open and a batch's offsets and ids gathered from
// there (SparseHdf5Reader::open_caches): CSR tables and the fixed-hotness one, ids stored as
// int64 and as int32, every dataset resident and, under a bound that holds the first table's
// two datasets only, a mix of resident tables and tables read through HDF5. Every read (rows
// shuffled with a repeat, a range) equals a reader of the same data written contiguous (HDF5's
// point selections, no gather), and the bytes held are each dataset's whole chunks at the stored
// size or its elements at 8 bytes (the copy is int64), the larger, as dlrm_data_cache_bytes
// counts them for the plan.
TEST(SparseHdf5Reader, ResidentTablesReadAsTheContiguousFile) {
  testing::TempDir dir(true);
  const FileData data = make_data();
  const std::string plain = dir.file("plain.h5");
  write_file(plain, data);
  SparseHdf5Reader reference(plain, kTables, kRows, kRows * kMostPerBag, MPI_COMM_SELF);
  EXPECT_EQ(reference.chunk_cache_bytes(), 0);
  const std::vector<int64_t> rows = {17, 3, 4, 5, 39, 0, 17, 22, 23};
  constexpr hsize_t kChunkRows = 16;
  for (const bool int32 : {false, true}) {
    const std::string path = dir.file(int32 ? "chunked32.h5" : "chunked64.h5");
    write_file(path, data, Storage{kChunkRows, int32});
    // Each dataset's bytes held, in table order (one's values and offsets, bags' values and
    // offsets, pair's ids [rows, 2]).
    std::vector<int64_t> held;
    int64_t stored_all = 0;
    for (const TableData& t : data) {
      const int64_t per_row = t.hotness > 0 ? t.hotness : 1;
      std::vector<int64_t> lengths = {static_cast<int64_t>(t.values.size()) / per_row};
      if (t.hotness == 0) lengths.push_back(static_cast<int64_t>(t.offsets.size()));
      for (const int64_t n : lengths) {
        const int64_t c = std::min<int64_t>(kChunkRows, n);
        const int64_t stored = (n + c - 1) / c * c * per_row * (int32 ? 4 : 8);
        held.push_back(std::max(stored, n * per_row * 8));
        stored_all += stored;
      }
    }
    ASSERT_EQ(held.size(), 5u);
    int64_t all = 0;
    for (const int64_t b : held) all += b;
    // int32 ids: the int64 copy takes more than the file's chunks (what the bound once counted).
    if (int32) EXPECT_GT(all, stored_all);
    for (const int64_t bound : {SparseHdf5Reader::kSparseCacheBytes, held[0] + held[1] + 1}) {
      const std::string what =
          std::string(int32 ? "int32" : "int64") + " ids, bound " + std::to_string(bound);
      SparseHdf5Reader reader(path, kTables, kRows, kRows * kMostPerBag, MPI_COMM_SELF, "/sparse",
                              bound);
      const int64_t expected_held = bound == SparseHdf5Reader::kSparseCacheBytes
                                        ? all
                                        : held[0] + held[1];  // the rest do not fit
      EXPECT_EQ(reader.chunk_cache_bytes(), expected_held) << what;
      EXPECT_EQ(dlrm_data_cache_bytes(path, kTables, "/sparse", {}, bound).sparse_bytes,
                expected_held)
          << what << ": the plan counts what the reader holds";
      reader.read(rows.data(), static_cast<int64_t>(rows.size()));
      reference.read(rows.data(), static_cast<int64_t>(rows.size()));
      for (size_t t = 0; t < data.size(); ++t) {
        EXPECT_TRUE(csr(reader.batch(t)) == csr(reference.batch(t)))
            << what << ", shuffled rows, table " << data[t].name;
        EXPECT_TRUE(csr(reader.batch(t)) == expected(data[t], rows)) << what << ", " << t;
      }
      reader.read_range(9, 12);
      reference.read_range(9, 12);
      for (size_t t = 0; t < data.size(); ++t) {
        EXPECT_TRUE(csr(reader.batch(t)) == csr(reference.batch(t)))
            << what << ", a range, table " << data[t].name;
      }
    }
  }
}

struct MeshCase {
  std::vector<std::pair<std::string, int>> axes;
  std::vector<std::string> row_axes;  // the row-wise spec's axes
};
std::vector<MeshCase> mesh_cases(int n) {
  if (n == 1) return {{{{"dp", 1}}, {"dp"}}};
  std::vector<MeshCase> cases = {{{{"dp", n}}, {"dp"}}, {{{"fsdp", n}}, {"fsdp"}}};
  if (n == 4) {
    cases.push_back({{{"fsdp", 2}, {"dp", 2}}, {"fsdp", "dp"}});
    cases.push_back({{{"dp", 2}, {"tp", 2}}, {"dp"}});
  }
  return cases;
}
std::string describe(const MeshCase& c) {
  std::string text;
  for (const auto& [axis, size] : c.axes) text += " " + axis + "=" + std::to_string(size);
  return text;
}

using IdsView = Kokkos::View<int64_t*, Kokkos::LayoutRight>;
IdsView device_ids(const std::vector<int64_t>& v, const char* label) {
  IdsView d(std::string(label), std::max<size_t>(v.size(), 1));
  auto h = Kokkos::create_mirror_view(d);
  for (size_t i = 0; i < v.size(); ++i) h(i) = v[i];
  Kokkos::deep_copy(d, h);
  return d;
}

// Integer weights and dy (in [-4, 4]) from their global index: every sum is exact in fp32.
float weight_value(int64_t i) {
  return static_cast<float>((i * 7 + 3) % 9 - 4);
}
float dy_value(int64_t i) {
  return static_cast<float>((i * 5 + 1) % 9 - 4);
}

struct Pooled {
  std::vector<float> out, grad;
  int64_t first_row = 0;  // of this rank's block of the table
};

// The `bags` table's layer on `comms` with `spec`, fed `bags` (this rank's rows of the batch,
// the global batch rows [first_bag, first_bag + rows)): its pooled rows and gradient block.
Pooled pool(MeshCommunicators& comms, const std::string& table, const PartitionSpec& spec,
            const Csr& bags, int64_t first_bag, int64_t max_ids) {
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const int64_t rows = static_cast<int64_t>(bags.offsets.size()) - 1, table_rows = 48;
  const std::string name = embedding_weight_name(table);
  ShardedTensor weight =
      ShardedTensor::allocate(name, {table_rows, kDim}, spec, comms.mesh(), comms.rank());
  ShardedTensor grad =
      ShardedTensor::allocate(name + "/grad", {table_rows, kDim}, spec, comms.mesh(), comms.rank());
  auto h = Kokkos::create_mirror_view(weight.local);
  const int64_t first = weight.box.offset[0];
  for (int64_t i = 0; i < weight.box.extent[0] * kDim; ++i) h(i) = weight_value(first * kDim + i);
  Kokkos::deep_copy(weight.local, h);
  EmbeddingBag layer(table, {&weight, &grad}, EmbeddingPooling::sum, rows, max_ids, context);
  const IdsView offsets = device_ids(bags.offsets, "offsets"), ids = device_ids(bags.values, "ids");
  const LayerPass pass;
  layer.forward({offsets, ids}, pass);
  const Matrix dy = testing::block_matrix(
      "dy", rows, kDim, first_bag, 0, [](int64_t b, int64_t c) { return dy_value(b * kDim + c); });
  layer.backward(dy, pass);
  const testing::Tensor out = testing::host_matrix(layer.output());
  const testing::Tensor g = testing::to_host(grad);
  return {std::vector<float>(out.begin(), out.end()), std::vector<float>(g.begin(), g.end()),
          first};
}

// max_ids < 0: the capacity is read from the file, max_rows times the largest bag of any
// table. The ranks scan equal shares of the rows and all-reduce the maximum, so the largest
// bag is put in each rank's share in turn (and in the last row): every rank must agree on it.
TEST(SparseHdf5Reader, CapacityFromTheFileIsTheLargestBagWhereverItLies) {
  testing::TempDir dir(true);
  const int ranks = world_size();
  std::vector<int64_t> rows_with_the_largest = {kRows - 1};
  for (int r = 0; r < ranks; ++r) rows_with_the_largest.push_back(kRows * r / ranks + 1);
  for (const int64_t big_row : rows_with_the_largest) {
    FileData data = make_data();
    TableData& bags = data[1];
    constexpr int64_t kLargest = kMostPerBag + 3;  // larger than any other bag of any table
    std::vector<int64_t> values, offsets = {0};
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t count = r == big_row ? kLargest : bags.offsets[r + 1] - bags.offsets[r];
      for (int64_t k = 0; k < count; ++k) values.push_back((r * 7 + k) % bags.table_rows);
      offsets.push_back(static_cast<int64_t>(values.size()));
    }
    bags.values = values;
    bags.offsets = offsets;
    const std::string path = dir.file("largest_" + std::to_string(big_row) + ".h5");
    write_file(path, data);
    constexpr int64_t kMaxRows = 3;
    SparseHdf5Reader reader(path, kTables, kMaxRows, -1, MPI_COMM_WORLD);
    EXPECT_EQ(reader.max_ids(), kMaxRows * kLargest) << "the largest bag at row " << big_row;
    // The plan's reading of the same file (dlrm_bags, no MPI): the same largest bag, and the
    // ids of a row on average, every table's ids over the rows.
    const DlrmBags bags_of_file = dlrm_bags(path, kTables, "/sparse");
    EXPECT_EQ(bags_of_file.largest * kMaxRows, reader.max_ids()) << "row " << big_row;
    double ids = 0.0;
    for (const TableData& t : data) ids += static_cast<double>(t.values.size());
    EXPECT_NEAR(bags_of_file.ids_per_row, ids / kRows, 1e-12) << "row " << big_row;
    // The batch holding it and its neighbours reads whole (it fits the capacity exactly).
    const int64_t first = std::min(big_row, kRows - kMaxRows);
    reader.read_range(first, kMaxRows);
    std::vector<int64_t> rows(kMaxRows);
    for (int64_t i = 0; i < kMaxRows; ++i) rows[i] = first + i;
    EXPECT_TRUE(csr(reader.batch(1)) == expected(bags, rows)) << "row " << big_row;
  }
}

TEST(SparseHdf5Reader, EveryMeshReadsItsSliceOfTheOneRankBatch) {
  testing::TempDir dir(true);
  const std::string path = dir.file("sparse.h5");
  const FileData data = make_data();
  write_file(path, data);
  const int n = world_size();
  const BatchSchedule schedule(kRows, kBatch, ShuffleMode::rows, 5);
  SparseHdf5Reader whole(path, kTables, kBatch, kBatch * kMostPerBag, MPI_COMM_SELF);
  MeshCommunicators single(Mesh::single(), MPI_COMM_SELF);
  for (const MeshCase& c : mesh_cases(n)) {
    SCOPED_TRACE(describe(c));
    const Mesh mesh = Mesh::create(c.axes, n);
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    const BatchSlice s = make_batch_slice(mesh, world_rank(), {"fsdp", "dp"}, kBatch);
    const int64_t max_ids = s.rows * kMostPerBag;
    SparseHdf5Reader reader(path, kTables, s.rows, max_ids, MPI_COMM_WORLD);
    std::vector<int64_t> rows(static_cast<size_t>(s.rows));
    const int64_t steps = 2 * schedule.steps_per_epoch() + 1;  // shuffled, over two epochs
    for (int64_t step = 0; step <= steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const bool range = step == steps;  // the last: a contiguous range of the file
      std::vector<int64_t> global = schedule.global_batch_samples(step);
      if (range) {
        for (int64_t i = 0; i < kBatch; ++i) global[i] = 13 + i;
        reader.read_range(13 + s.begin(), s.rows);
      } else {
        schedule.slice_samples(step, s, rows.data());
        reader.read(rows.data(), s.rows);
      }
      whole.read(global.data(), kBatch);
      for (size_t t = 0; t < kTables.size(); ++t) {
        const Csr want = slice(csr(whole.batch(t)), s.begin(), s.rows);
        EXPECT_TRUE(csr(reader.batch(t)) == want) << kTables[t];
        EXPECT_TRUE(csr(whole.batch(t)) == expected(data[t], global)) << kTables[t];
      }
      for (size_t t : {size_t{1}, size_t{2}}) {  // the 48-row tables: CSR and fixed hotness
        const Csr mine = csr(reader.batch(t));
        const Pooled ref =
            pool(single, kTables[t], PartitionSpec(), csr(whole.batch(t)), 0, kBatch * kMostPerBag);
        PartitionSpec row_wise;
        row_wise.entries.resize(2);
        row_wise.entries[0].axes = c.row_axes;
        for (const PartitionSpec& spec : {PartitionSpec(), row_wise}) {
          SCOPED_TRACE(kTables[t] + " " + spec.to_string());
          const Pooled got = pool(comms, kTables[t], spec, mine, s.begin(), max_ids);
          ASSERT_EQ(got.out.size(), static_cast<size_t>(s.rows * kDim));
          for (size_t i = 0; i < got.out.size(); ++i) {
            ASSERT_EQ(got.out[i], ref.out[s.begin() * kDim + i]) << "pooled element " << i;
          }
          for (size_t i = 0; i < got.grad.size(); ++i) {
            ASSERT_EQ(got.grad[i], ref.grad[got.first_row * kDim + i]) << "gradient element " << i;
          }
        }
      }
    }
  }
}

// The bad file's error, read on dp n: every rank reads its slice of all 40 rows (in order, or
// reversed so that every run is one row), so the bad row is one rank's.
std::string read_error(const std::string& path, const FileData& tables, bool reversed,
                       int64_t max_ids = kRows * kMostPerBag) {
  write_file(path, tables);
  const int n = world_size();
  const Mesh mesh = Mesh::create({{"dp", n}}, n);
  const BatchSlice s = make_batch_slice(mesh, world_rank(), {"fsdp", "dp"}, kRows);
  return testing::expect_agreed_error(
      [&] {
        SparseHdf5Reader reader(path, kTables, s.rows, max_ids, MPI_COMM_WORLD);
        std::vector<int64_t> rows;
        for (int64_t i = 0; i < s.rows; ++i) rows.push_back(s.begin() + i);
        if (reversed) std::reverse(rows.begin(), rows.end());
        reader.read(rows.data(), s.rows);
      },
      ErrorKind::bad_input);
}

void expect_names(const std::string& message, const std::string& path, const std::string& table,
                  const std::string& row, const std::string& what) {
  EXPECT_NE(message.find("'" + path + "'"), std::string::npos) << message;
  if (!table.empty())
    EXPECT_NE(message.find("table '" + table + "'"), std::string::npos) << message;
  if (!row.empty())
    EXPECT_NE(message.find("global row " + row + ":"), std::string::npos) << message;
  EXPECT_NE(message.find(what), std::string::npos) << message;
}

TEST(SparseHdf5Reader, BadFilesGiveOneSentenceOnEveryRank) {
  testing::TempDir dir(true);
  const std::string path = dir.file("bad.h5");
  for (bool reversed : {false, true}) {
    SCOPED_TRACE(reversed ? "rows reversed" : "rows in order");
    {  // ids outside the table at rows 33 (-1) and 29 (48): row 29 is named
      FileData d = make_data();
      ASSERT_GT(d[1].offsets[30], d[1].offsets[29]) << "row 29 needs an id";
      ASSERT_GT(d[1].offsets[34], d[1].offsets[33]) << "row 33 needs an id";
      d[1].values[d[1].offsets[29]] = 48;
      d[1].values[d[1].offsets[33]] = -1;
      expect_names(read_error(path, d, reversed), path, "bags", "29",
                   "id 48 is outside the table's rows [0, 48)");
    }
    {  // a fixed-hotness id outside its table at row 31
      FileData d = make_data();
      d[2].values[31 * 2 + 1] = 50;
      expect_names(read_error(path, d, reversed), path, "pair", "31",
                   "id 50 is outside the table's rows [0, 48)");
    }
    {  // row 13 of `one` ends before it starts
      FileData d = make_data();
      d[0].offsets[14] = d[0].offsets[13] - 1;
      expect_names(read_error(path, d, reversed), path, "one", "13", "the offsets decrease");
    }
    {  // an offset past the ids: row 20 of `one` ends at 100 (row 21 then decreases, later)
      FileData d = make_data();
      d[0].offsets[21] = 100;
      expect_names(read_error(path, d, reversed), path, "one", "20", "offset 100 lies outside");
    }
    {  // the capacity: 3 ids per rank and table (the row named depends on the mesh)
      expect_names(read_error(path, make_data(), reversed, 3), path, "", "",
                   "over the capacity of 3 ids");
    }
  }
  {  // at open: offsets[0] != 0
    FileData d = make_data();
    d[1].offsets[0] = 1;
    expect_names(read_error(path, d, false), path, "bags", "0", "offsets[0] is 1, not 0");
  }
  {  // at open: the last offset is not the number of ids
    FileData d = make_data();
    d[0].values.push_back(0);
    expect_names(read_error(path, d, false), path, "one", "39",
                 "the last offset is 40 but /sparse/one/values holds 41 ids");
  }
  {  // at open: a table the file lacks
    FileData d = make_data();
    d.erase(d.begin() + 1);  // `bags`
    const std::string message = read_error(path, d, false);
    expect_names(message, path, "bags", "", "is missing from sparse data file");
  }
}

// The caller's mistakes, on the last rank only, reach every rank as one runtime AgreedError (none
// is left waiting in the agreement): a row past the file, a read longer than max_rows.
TEST(SparseHdf5Reader, CallerMistakesOnOneRankReachEveryRank) {
  testing::TempDir dir(true);
  const std::string path = dir.file("sparse.h5");
  write_file(path, make_data());
  SparseHdf5Reader reader(path, kTables, 4, 16, MPI_COMM_WORLD);
  const bool last = world_rank() == world_size() - 1;
  std::vector<int64_t> rows = {1, 2, 3, last ? kRows : 4};
  std::string message =
      testing::expect_agreed_error([&] { reader.read(rows.data(), 4); }, ErrorKind::runtime);
  EXPECT_NE(message.find("global row 40 was asked for, outside its 40 rows"), std::string::npos)
      << message;
  message =
      testing::expect_agreed_error([&] { reader.read_range(0, last ? 5 : 4); }, ErrorKind::runtime);
  EXPECT_NE(message.find("a rank asked for 5 rows in one read"), std::string::npos) << message;
  reader.read_range(36, 4);  // and the reader still reads
  EXPECT_TRUE(csr(reader.batch(1)) == expected(make_data()[1], {36, 37, 38, 39}));
}

}  // namespace
}  // namespace meshtrain
