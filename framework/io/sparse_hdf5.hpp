#pragma once
// Sparse features from HDF5 (issue 39 items 3 and 6; docs/recsys.md, "Reading the sparse data"):
// for a list of embedding tables, this rank's rows of a batch as CSR per table, read from one
// file of scripts/make_recsys_data's layout:
//   /sparse/<table>/values   int64 [ids]       every row's ids, row after row
//   /sparse/<table>/offsets  int64 [rows + 1]  row r's ids are values[offsets[r], offsets[r + 1])
//   attribute `rows` on /sparse/<table>: the table's size (ids must lie in [0, rows))
// or, for a table of fixed hotness k, /sparse/<table>/ids int64 [rows, k] instead of the pair
// (taken when that dataset is present; one read of the rows' ids per batch).
// The rows asked for are the ones the dense stream gives this rank (BatchSchedule::
// slice_samples, or a contiguous range): only they are read. read() (any order, repeats) makes
// per table one read of the rows' offsets (a point selection of offsets r and r + 1 of every
// distinct row, in file order) and one of their ids (a point selection, in file order; fixed
// hotness: the one read of the rows' ids), then puts the rows back in the order asked for in
// memory; read_range() one hyperslab read of the offsets and one of the ids per table.
// Resident tables: every chunked sparse dataset is read whole into memory at open while the
// reader's datasets together take at most kSparseCacheBytes (1 GiB, each dataset counted as its
// whole chunks or its elements at 8 bytes, the larger: the copy is int64; in table order), and a
// batch's offsets and ids are gathered from there at the positions the point selections would name
// (HDF5's point selection over cached chunks cost ~1.7 us an element); past that bound a dataset is
// read through HDF5 with its default 1 MiB cache.
//
// Checks, each a bad_input AgreedError whose one sentence names the file, the table and the
// global row, thrown by EVERY rank of the communicator at the same call:
//  - at open (collective, agreed by on_every_rank): the file cannot be opened, a table's group,
//    datasets or `rows` attribute is missing or of another shape or type, tables of different
//    row counts, offsets[0] != 0, the last offset != the number of ids in values;
//  - per batch (read: collective, one small all-reduce of the lowest failing (global row,
//    table, problem) of every rank, so the sentence does not depend on the mesh): an id outside
//    [0, table rows), offsets that decrease, an offset past the ids, and a batch whose ids
//    exceed the capacity `max_ids` given at open.
// A failed HDF5 read is a runtime AgreedError on every rank.
//
// Buffers: every table's offsets [max_rows + 1] and values [max_ids] and HDF5's memory space are
// made at open; read() allocates nothing of its own (HDF5 may, inside its calls). Not thread
// safe: one caller at a time; HDF5 calls hold hdf5::global_mutex().

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {

// One table's CSR of the rows last read: offsets [rows + 1] (offsets[0] = 0) and ids
// values[0, offsets[rows]). Pointers into the reader's buffers, valid until the next read.
struct SparseTableRows {
  const int64_t* offsets = nullptr;
  const int64_t* values = nullptr;
  int64_t rows = 0;
  int64_t ids() const { return offsets[rows]; }
};

// What the chunk caches of the DLRM data readers of `path` hold at most (`meshtrain plan`, from
// the file's metadata alone; no MPI): `tables`' datasets as a SparseHdf5Reader caches them (all
// their chunks while the total stays within SparseHdf5Reader::kSparseCacheBytes, in table
// order, each counted as its chunks' bytes or its elements at 8 bytes, the larger), and `dense`
// (data.x_key and data.y_key: every chunk of each, run/dlrm_run.cpp's dense_chunk_cache_bytes). A
// missing file, group or dataset counts 0 (the run names it). sparse_bound: the readers'
// cache_bound (kSparseCacheBytes, 1 GiB; tests give a smaller one).
struct DlrmDataCaches {
  int64_t sparse_bytes = 0;
  int64_t dense_bytes = 0;
  // The budget a DLRM run gives its dense training source's chunk caches (Hdf5SourceOptions::
  // chunk_cache_bytes) so that they keep every chunk once read: dense_bytes and a quarter more
  // and 1 MiB (the source splits its budget between x and y by their rows' bytes, not their
  // chunks'), at most kDenseCacheBytes (past it the source keeps the batch's chunks only); what
  // the caches hold is at most dense_bytes. Never below the source's default 1 MiB.
  static constexpr int64_t kDenseCacheBytes = int64_t{256} << 20;
  int64_t dense_budget() const {
    const int64_t budget = dense_bytes + dense_bytes / 4 + (int64_t{1} << 20);
    return budget > kDenseCacheBytes ? kDenseCacheBytes : budget;
  }
};
DlrmDataCaches dlrm_data_cache_bytes(const std::string& path,
                                     const std::vector<std::string>& tables,
                                     const std::string& group,
                                     const std::vector<std::string>& dense,
                                     int64_t sparse_bound = int64_t{1} << 30);

// The bags of `tables` in `path` (`meshtrain plan`, no MPI): the most ids of one row in any of
// them (CSR: one pass over each table's offsets, as a reader opened with max_ids < 0 finds it;
// fixed hotness: the hotness), and the ids of one row of all of them on average (each table's
// ids over its rows, summed). A missing file, group or dataset counts 0 (the run names it).
struct DlrmBags {
  int64_t largest = 0;
  double ids_per_row = 0.0;
};
DlrmBags dlrm_bags(const std::string& path, const std::vector<std::string>& tables,
                   const std::string& group);

class SparseHdf5Reader {
 public:
  // Opens `path` and checks `tables` (collective over `comm`, which every later read() is
  // too). max_rows: the most rows one read() asks for; max_ids: the most ids of one table that
  // one read() may return (per rank, the same for every table). bad_input AgreedError as the
  // header says.
  // max_ids < 0: found in the file at open, max_rows times the largest bag of any table (one
  // pass over every table's offsets, each rank an equal share of the rows, the maximum
  // all-reduced). `group`: where the tables are
  // (data.sparse_key), <group>/<table>/values and offsets, or ids. `cache_bound`: the bytes of
  // the datasets held in memory whole (kSparseCacheBytes; tests give a smaller one).
  SparseHdf5Reader(std::string path, std::vector<std::string> tables, int64_t max_rows,
                   int64_t max_ids, MPI_Comm comm, std::string group = "/sparse",
                   int64_t cache_bound = kSparseCacheBytes);
  ~SparseHdf5Reader();
  SparseHdf5Reader(const SparseHdf5Reader&) = delete;
  SparseHdf5Reader& operator=(const SparseHdf5Reader&) = delete;

  // Reads global rows rows[0, count) (any order, repeats allowed) of every table. Collective.
  void read(const int64_t* rows, int64_t count);
  // What the checks of one read found on this rank: the lowest (global row, table, kind) of its
  // problems (none() when the rows passed). Opaque to callers: they hand it to agree().
  struct Problem {
    int64_t row = std::numeric_limits<int64_t>::max(), table = 0, kind = 0, a = 0, b = 0;
    bool none() const { return row == std::numeric_limits<int64_t>::max(); }
    bool operator<(const Problem& o) const;
  };
  // read() in two halves, for a reader thread (run/dlrm_run.cpp's read-ahead): read_unagreed()
  // reads the rows as read() does and returns what its checks found, without MPI (any one
  // thread may call it, one at a time; batch() then holds the rows); agree(), collective, turns
  // every rank's finding into the one AgreedError every rank throws, or returns when none
  // found one. read() is read_unagreed() then agree().
  Problem read_unagreed(const int64_t* rows, int64_t count);
  void agree(Problem problem);
  // Reads global rows [first, first + count). Collective.
  void read_range(int64_t first, int64_t count);

  const std::string& path() const { return path_; }
  const std::vector<std::string>& tables() const { return tables_; }
  int64_t num_rows() const { return num_rows_; }  // rows of the data set
  int64_t max_ids() const { return max_ids_; }    // the capacity of ids per table and read
  int64_t table_rows(size_t table) const;         // the table's size (attribute rows)
  SparseTableRows batch(size_t table) const;      // of the last read
  // HDF5 reads (H5Dread calls) the last read() or read_range() made, over all tables (for
  // tests: two per CSR table and one per fixed one, whatever the rows).
  int64_t reads_last_batch() const { return reads_; }
  // The bytes of the datasets held in memory whole (each its whole chunks or its elements at 8
  // bytes, the larger), from open on.
  int64_t chunk_cache_bytes() const { return cache_bytes_; }
  static constexpr int64_t kSparseCacheBytes = int64_t{1} << 30;
  // The bytes of the buffers a reader of `tables` tables opened for (max_rows, max_ids) makes at
  // open (the header's "Buffers"; `meshtrain plan`).
  static int64_t buffer_bytes(int64_t tables, int64_t max_rows, int64_t max_ids);

 private:
  struct File;
  struct Table;
  // The runs of consecutive rows in `rows` (or the one run [first, first + count)).
  void read_runs(const int64_t* rows, int64_t first, int64_t count);
  Problem read_table(Table& table, size_t index, const int64_t* rows, int64_t first, int64_t count);
  // read(): the rows sorted by file position, one point-selection read per dataset.
  Problem read_gathered(const int64_t* rows, int64_t count);
  Problem gather_table(Table& table, size_t index, const int64_t* rows, int64_t count,
                       int64_t distinct, int64_t points);
  void open_caches();  // reopens the datasets with their chunk caches (at open)

  std::string path_;
  std::vector<std::string> tables_;
  std::string group_;
  int64_t max_rows_ = 0;
  int64_t max_ids_ = 0;
  int64_t cache_bound_ = kSparseCacheBytes;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int64_t num_rows_ = 0;
  int64_t reads_ = 0;
  int64_t cache_bytes_ = 0;
  // read()'s buffers, made at open, shared by the tables: the positions asked for sorted by
  // row, the distinct rows, each position's distinct row, each distinct row's first offset in
  // the offsets read (its end is the next), its ids' place among the ids read (-1: not read),
  // the point coordinates and the ids read in file order.
  std::vector<int64_t> order_, distinct_, slot_, at_, begin_;
  std::vector<hsize_t> points_, id_points_;
  std::vector<int64_t> raw_, gathered_;
  std::unique_ptr<File> file_;
  std::vector<std::unique_ptr<Table>> state_;
  MPI_Datatype problem_type_ = MPI_DATATYPE_NULL;
  MPI_Op lowest_problem_ = MPI_OP_NULL;
  std::vector<char> agreement_buffer_;  // all_reduce_collective's copy, sized at open
};

}  // namespace meshtrain
