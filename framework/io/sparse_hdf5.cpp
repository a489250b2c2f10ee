#include "framework/io/sparse_hdf5.hpp"

#include <hdf5.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <tuple>
#include <utility>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain {

namespace {

// What a rank found wrong in a batch, ordered so that the lowest (global row, table, kind) of
// all ranks is the one reported: the same on every mesh.
enum ProblemKind : int64_t {
  read_failed = 0,       // an HDF5 read failed (row = the run's first row)
  row_outside = 1,       // a row asked for is not in the data set (the caller's bug)
  id_outside = 2,        // a = the id
  offsets_decrease = 3,  // a, b = the row's start and end offsets
  offset_past_ids = 4,   // a = the offset
  over_capacity = 5,     // a = the ids the rank's rows needed so far
  too_many_rows = 6,     // a = the rows asked for (row = -1: the caller's bug, first)
};
constexpr int64_t kNoRow = std::numeric_limits<int64_t>::max();
constexpr int kProblemFields = 5;

// MPI_Op over kProblemFields int64s: keeps the lexicographically lowest (row, table, kind).
void lowest_problem(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const int64_t*>(in);
  auto* b = static_cast<int64_t*>(inout);
  for (int i = 0; i < *len; ++i, a += kProblemFields, b += kProblemFields) {
    if (std::lexicographical_compare(a, a + 3, b, b + 3)) std::copy(a, a + kProblemFields, b);
  }
}

}  // namespace

static_assert(SparseHdf5Reader::Problem{}.row == kNoRow, "a Problem starts as none");

bool SparseHdf5Reader::Problem::operator<(const Problem& o) const {
  return std::tie(row, table, kind) < std::tie(o.row, o.table, o.kind);
}

struct SparseHdf5Reader::File {
  hdf5::Handle file;
};

struct SparseHdf5Reader::Table {
  std::string name;
  std::string values_name, offsets_name;  // their paths in the file
  hdf5::Handle values_dataset, offsets_dataset;
  hdf5::Handle values_space, offsets_space;  // their file dataspaces (selections change)
  hdf5::Handle memory;           // 1-D, long enough for either read into the buffers below
  int64_t rows = 0;              // the table's size
  int64_t ids = 0;               // length of values
  std::vector<int64_t> raw;      // [max_rows + 1]: one run's offsets as stored
  std::vector<int64_t> offsets;  // [max_rows + 1]: the batch's, rebased to 0
  std::vector<int64_t> values;   // [max_ids]
  int64_t batch_rows = 0;
  // The datasets held in memory whole (open_caches; empty: read through HDF5): values (or the
  // fixed ids, row-major) and offsets.
  std::vector<int64_t> values_resident, offsets_resident;
  // Fixed hotness: /sparse/<table>/ids [rows, hotness] (values_dataset, values_space), row r's
  // ids its row of that array; no offsets dataset.
  bool fixed = false;
  int64_t hotness = 0;
};

namespace {

hsize_t to_h(int64_t v) {
  return static_cast<hsize_t>(v);
}

// Reads elements [first, first + count) of a 1-D int64 dataset into `out` (through `memory`,
// whose selection is set to [0, count)).
void read_slab(hid_t dataset, hid_t file_space, hid_t memory, int64_t first, int64_t count,
               int64_t* out, ErrorKind kind, const std::string& what) {
  const hsize_t start = to_h(first), n = to_h(count), zero = 0;
  hdf5::check(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, &start, nullptr, &n, nullptr), kind,
              what);
  hdf5::check(H5Sselect_hyperslab(memory, H5S_SELECT_SET, &zero, nullptr, &n, nullptr), kind, what);
  hdf5::check(H5Dread(dataset, H5T_NATIVE_INT64, memory, file_space, H5P_DEFAULT, out), kind, what);
}

// Reads the elements of a 1-D or 2-D int64 dataset at `points` (n elements, each its rank's
// coordinates, in the order listed) into out[0, n) (through `memory`, selection [0, n)).
void read_points(hid_t dataset, hid_t file_space, hid_t memory, const hsize_t* points, int64_t n,
                 int64_t* out, const std::string& what) {
  const hsize_t zero = 0, count = to_h(n);
  hdf5::check(H5Sselect_elements(file_space, H5S_SELECT_SET, static_cast<size_t>(n), points),
              ErrorKind::runtime, what);
  hdf5::check(H5Sselect_hyperslab(memory, H5S_SELECT_SET, &zero, nullptr, &count, nullptr),
              ErrorKind::runtime, what);
  hdf5::check(H5Dread(dataset, H5T_NATIVE_INT64, memory, file_space, H5P_DEFAULT, out),
              ErrorKind::runtime, what);
}

// The bytes and the number of all the chunks of a chunked dataset ({0, 0} when it is not
// chunked: then HDF5 has no chunk cache for it).
std::pair<int64_t, int64_t> chunked_bytes(hid_t dataset, const std::string& what) {
  const hdf5::Handle plist = hdf5::make(H5Dget_create_plist(dataset), H5Pclose,
                                        ErrorKind::bad_input, what + ": its creation properties");
  const H5D_layout_t layout = H5Pget_layout(plist);
  if (layout < 0) hdf5::check(-1, ErrorKind::bad_input, what + ": its layout");
  if (layout != H5D_CHUNKED) return {0, 0};
  hsize_t chunk[H5S_MAX_RANK] = {};
  const int rank = H5Pget_chunk(plist, H5S_MAX_RANK, chunk);
  if (rank < 0) hdf5::check(-1, ErrorKind::bad_input, what + ": its chunk shape");
  const std::vector<int64_t> shape = hdf5::dataset_shape(dataset, ErrorKind::bad_input, what);
  const hdf5::Handle type =
      hdf5::make(H5Dget_type(dataset), H5Tclose, ErrorKind::bad_input, what + ": its type");
  int64_t bytes = static_cast<int64_t>(H5Tget_size(type));
  if (bytes <= 0) hdf5::check(-1, ErrorKind::bad_input, what + ": its type's size");
  int64_t chunks = 1;
  for (int d = 0; d < rank && d < static_cast<int>(shape.size()); ++d) {
    const int64_t c = static_cast<int64_t>(chunk[d]);
    chunks *= (shape[static_cast<size_t>(d)] + c - 1) / c;
    bytes *= c;
  }
  return {bytes * chunks, chunks};
}

// What holding a chunked dataset in memory whole costs (open_caches): its chunks' bytes at the
// stored size, or its elements as int64 (the resident copy, std::vector<int64_t>) when more
// (int32 and int16 id files: 2x and 4x their stored bytes). 0 for a dataset not chunked (never
// held). open_caches and dlrm_data_cache_bytes both count this against kSparseCacheBytes.
int64_t resident_bytes(hid_t dataset, const std::string& what) {
  const int64_t stored = chunked_bytes(dataset, what).first;
  if (stored == 0) return 0;
  int64_t elements = 1;
  for (int64_t extent : hdf5::dataset_shape(dataset, ErrorKind::bad_input, what)) {
    elements *= extent;
  }
  return std::max(stored, std::max<int64_t>(elements, 1) * int64_t{sizeof(int64_t)});
}

// The most ids of one row among rows [begin, end) of a CSR table: one pass over its offsets
// in pieces of kScanRows (decreasing offsets are left to the batches' checks).
int64_t largest_bag(hid_t dataset, hid_t file_space, int64_t begin, int64_t end,
                    const std::string& what) {
  constexpr int64_t kScanRows = int64_t{1} << 16;
  std::vector<int64_t> offsets(static_cast<size_t>(kScanRows + 1));
  const hsize_t memory_size = static_cast<hsize_t>(kScanRows + 1);
  const hdf5::Handle memory = hdf5::make(H5Screate_simple(1, &memory_size, nullptr), H5Sclose,
                                         ErrorKind::runtime, what + ": a memory dataspace");
  int64_t largest = 0;
  for (int64_t first = begin; first < end; first += kScanRows) {
    const int64_t n = std::min(kScanRows, end - first);
    read_slab(dataset, file_space, memory, first, n + 1, offsets.data(), ErrorKind::bad_input,
              what);
    for (int64_t i = 0; i < n; ++i) {
      largest =
          std::max(largest, offsets[static_cast<size_t>(i + 1)] - offsets[static_cast<size_t>(i)]);
    }
  }
  return largest;
}

}  // namespace

SparseHdf5Reader::SparseHdf5Reader(std::string path, std::vector<std::string> tables,
                                   int64_t max_rows, int64_t max_ids, MPI_Comm comm,
                                   std::string group, int64_t cache_bound)
    : path_(std::move(path)),
      tables_(std::move(tables)),
      group_(std::move(group)),
      max_rows_(max_rows),
      max_ids_(max_ids),
      cache_bound_(cache_bound),
      comm_(comm),
      file_(std::make_unique<File>()) {
  MESHTRAIN_REQUIRE(max_rows_ >= 0, "SparseHdf5Reader: negative capacity");
  // max_ids < 0: the capacity is found in the file (below), the largest bag times max_rows.
  const bool ids_from_file = max_ids_ < 0;
  if (ids_from_file) max_ids_ = 0;
  on_every_rank(comm_, [&] {
    const std::string file_text = "sparse data file '" + path_ + "'";
    if (tables_.empty()) MESHTRAIN_BAD_INPUT(file_text, ": no tables to read were named");
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    hdf5::silence_errors();
    file_->file = hdf5::make(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose,
                             ErrorKind::bad_input, file_text + ": cannot open it");
    for (size_t t = 0; t < tables_.size(); ++t) {
      auto table = std::make_unique<Table>();
      table->name = tables_[t];
      const std::string group = group_ + "/" + table->name;
      const std::string where = file_text + ", table '" + table->name + "'";
      auto exists = [&](const std::string& name) {
        return hdf5::path_exists(file_->file, name, ErrorKind::bad_input, file_text);
      };
      table->fixed = exists(group) && exists(group + "/ids");
      for (const char* member : {"", "/values", "/offsets"}) {
        if (table->fixed && *member) continue;
        if (!exists(group + member)) {
          MESHTRAIN_BAD_INPUT("table '", table->name, "' is missing from ", file_text, " (no ",
                              group, member, *member ? ", nor the fixed-hotness ids" : "", ")");
        }
      }
      auto open_ids = [&](const std::string& name, hdf5::Handle& dataset, hdf5::Handle& space,
                          size_t dims) {
        dataset = hdf5::make(H5Dopen2(file_->file, name.c_str(), H5P_DEFAULT), H5Dclose,
                             ErrorKind::bad_input, where + ": cannot open " + name);
        const hdf5::Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, ErrorKind::bad_input,
                                             where + ": the type of " + name);
        const std::vector<int64_t> shape =
            hdf5::dataset_shape(dataset, ErrorKind::bad_input, where + ": " + name);
        if (H5Tget_class(type) != H5T_INTEGER || shape.size() != dims) {
          MESHTRAIN_BAD_INPUT(where, ": ", name, " must be a ", dims, "-D integer dataset");
        }
        if (dims == 2) table->hotness = shape[1];
        space = hdf5::make(H5Dget_space(dataset), H5Sclose, ErrorKind::bad_input,
                           where + ": the dataspace of " + name);
        return shape[0];
      };
      // Rows of the data set + 1: the length of offsets (CSR), or of ids + 1 (fixed hotness).
      int64_t offsets = 0;
      if (table->fixed) {
        table->values_name = group + "/ids";
        offsets = open_ids(group + "/ids", table->values_dataset, table->values_space, 2) + 1;
        table->ids = (offsets - 1) * table->hotness;
      } else {
        table->values_name = group + "/values";
        table->offsets_name = group + "/offsets";
        table->ids = open_ids(group + "/values", table->values_dataset, table->values_space, 1);
        offsets = open_ids(group + "/offsets", table->offsets_dataset, table->offsets_space, 1);
      }
      const hdf5::Handle group_handle =
          hdf5::make(H5Gopen2(file_->file, group.c_str(), H5P_DEFAULT), H5Gclose,
                     ErrorKind::bad_input, where + ": cannot open " + group);
      table->rows = hdf5::read_int_attribute(group_handle, "rows", ErrorKind::bad_input,
                                             where + " (" + group + ")");
      if (table->rows <= 0) {
        MESHTRAIN_BAD_INPUT(where, ": the attribute rows of ", group, " is ", table->rows,
                            ", not a positive table size");
      }
      if (offsets < 1) MESHTRAIN_BAD_INPUT(where, ": ", group, "/offsets is empty");
      if (t == 0) num_rows_ = offsets - 1;
      if (offsets - 1 != num_rows_) {
        MESHTRAIN_BAD_INPUT(where, ": ", group, " describes ", offsets - 1, " rows, but table '",
                            tables_[0], "' describes ", num_rows_);
      }
      const size_t longest = static_cast<size_t>(std::max(max_rows_ + 1, max_ids_));
      const hsize_t memory_size = std::max<hsize_t>(longest, 1);
      table->memory = hdf5::make(H5Screate_simple(1, &memory_size, nullptr), H5Sclose,
                                 ErrorKind::runtime, where + ": a memory dataspace");
      table->raw.assign(static_cast<size_t>(max_rows_ + 1), 0);
      table->offsets.assign(static_cast<size_t>(max_rows_ + 1), 0);
      table->values.assign(static_cast<size_t>(std::max<int64_t>(max_ids_, 1)), 0);
      if (table->fixed) {
        state_.push_back(std::move(table));
        continue;  // no offsets to check
      }
      // The two ends of the offsets, once: every row's ids then lie inside values wherever
      // the offsets do not decrease (which each batch checks on its rows).
      int64_t first = 0, last = 0;
      read_slab(table->offsets_dataset, table->offsets_space, table->memory, 0, 1, &first,
                ErrorKind::bad_input, where + ": reading offsets[0]");
      read_slab(table->offsets_dataset, table->offsets_space, table->memory, num_rows_, 1, &last,
                ErrorKind::bad_input, where + ": reading the last offset");
      if (first != 0) {
        MESHTRAIN_BAD_INPUT(where, ", global row 0: offsets[0] is ", first, ", not 0");
      }
      if (last != table->ids) {
        MESHTRAIN_BAD_INPUT(where, ", global row ", num_rows_ - 1, ": the last offset is ", last,
                            " but ", group, "/values holds ", table->ids, " ids");
      }
      state_.push_back(std::move(table));
    }
  });
  if (ids_from_file) {
    // The capacity every rank's share of a batch may need: its rows times the largest bag of
    // any table in the whole file, the same on every rank. Each rank scans an equal share of
    // the rows' offsets and the maximum is all-reduced: a file of billions of rows is read
    // once across the ranks, not once per rank.
    int rank = 0, ranks = 1;
    check_mpi(MPI_Comm_rank(comm_, &rank), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &ranks), "MPI_Comm_size");
    const int64_t begin = num_rows_ * rank / ranks, end = num_rows_ * (rank + 1) / ranks;
    int64_t largest = 0;
    on_every_rank(comm_, [&] {
      const std::string file_text = "sparse data file '" + path_ + "'";
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      for (const auto& table : state_) {
        largest = std::max(
            largest, table->fixed
                         ? table->hotness
                         : largest_bag(table->offsets_dataset, table->offsets_space, begin, end,
                                       file_text + ", table '" + table->name + "': offsets"));
      }
    });
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &largest, 1, MPI_INT64_T, MPI_MAX, comm_),
              "MPI_Allreduce (the largest bag)");
    max_ids_ = std::max<int64_t>(largest * max_rows_, 1);
    on_every_rank(comm_, [&] {
      const std::string file_text = "sparse data file '" + path_ + "'";
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      const hsize_t memory_size = static_cast<hsize_t>(std::max(max_rows_ + 1, max_ids_));
      for (const auto& table : state_) {
        table->memory = hdf5::make(H5Screate_simple(1, &memory_size, nullptr), H5Sclose,
                                   ErrorKind::runtime, file_text + ": a memory dataspace");
        table->values.assign(static_cast<size_t>(max_ids_), 0);
      }
    });
  }
  // read()'s buffers and the memory spaces (long enough for the offsets of max_rows distinct
  // rows, 2 per row, and for max_ids ids), and the chunk caches.
  on_every_rank(comm_, [&] {
    const std::string file_text = "sparse data file '" + path_ + "'";
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    const size_t rows = static_cast<size_t>(max_rows_), ids = static_cast<size_t>(max_ids_);
    const hsize_t memory_size = std::max<hsize_t>({2 * rows + 1, ids, 1});
    for (const auto& table : state_) {
      table->memory = hdf5::make(H5Screate_simple(1, &memory_size, nullptr), H5Sclose,
                                 ErrorKind::runtime, file_text + ": a memory dataspace");
    }
    for (auto* v : {&order_, &distinct_, &slot_, &at_, &begin_}) v->assign(rows, 0);
    points_.assign(2 * rows, 0);
    raw_.assign(2 * rows, 0);
    id_points_.assign(2 * std::max<size_t>(ids, 1), 0);
    gathered_.assign(std::max<size_t>(ids, 1), 0);
    open_caches();
  });
  check_mpi(MPI_Type_contiguous(kProblemFields, MPI_INT64_T, &problem_type_),
            "MPI_Type_contiguous");
  check_mpi(MPI_Type_commit(&problem_type_), "MPI_Type_commit");
  check_mpi(MPI_Op_create(&lowest_problem, 1, &lowest_problem_), "MPI_Op_create");
  agreement_buffer_.resize(2 * kProblemFields * sizeof(int64_t));
}

int64_t SparseHdf5Reader::buffer_bytes(int64_t tables, int64_t max_rows, int64_t max_ids) {
  const int64_t ids = std::max<int64_t>(max_ids, 1);
  // Per table raw, offsets [max_rows + 1] and values [max_ids]; shared order_, distinct_, slot_,
  // at_, begin_ [max_rows], points_ and raw_ [2 max_rows], id_points_ [2 ids], gathered_ [ids].
  return 8 * (tables * (2 * (max_rows + 1) + ids) + 9 * max_rows + 3 * ids);
}

DlrmDataCaches dlrm_data_cache_bytes(const std::string& path,
                                     const std::vector<std::string>& tables,
                                     const std::string& group,
                                     const std::vector<std::string>& dense, int64_t sparse_bound) {
  DlrmDataCaches caches;
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  hdf5::silence_errors();
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) return caches;
  const hdf5::Handle file(id, H5Fclose);
  const std::string what = "sparse data file '" + path + "'";
  auto chunks_of = [&](const std::string& name) -> int64_t {
    if (!hdf5::path_exists(file, name, ErrorKind::bad_input, what)) return 0;
    const hid_t d = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
    if (d < 0) return 0;
    const hdf5::Handle dataset(d, H5Dclose);
    return chunked_bytes(dataset, what + ": " + name).first;
  };
  auto resident_of = [&](const std::string& name) -> int64_t {
    if (!hdf5::path_exists(file, name, ErrorKind::bad_input, what)) return 0;
    const hid_t d = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
    if (d < 0) return 0;
    const hdf5::Handle dataset(d, H5Dclose);
    return resident_bytes(dataset, what + ": " + name);
  };
  for (const std::string& table : tables) {
    const std::string g = group + "/" + table;
    if (!hdf5::path_exists(file, g, ErrorKind::bad_input, what)) continue;
    const bool fixed = hdf5::path_exists(file, g + "/ids", ErrorKind::bad_input, what);
    for (const char* member : {"/values", "/offsets"}) {
      if (fixed && std::string(member) == "/offsets") continue;
      const int64_t bytes = resident_of(g + (fixed ? std::string("/ids") : std::string(member)));
      // As open_caches: a dataset past the bound keeps HDF5's default cache (not counted).
      if (bytes > 0 && caches.sparse_bytes + bytes <= sparse_bound) {
        caches.sparse_bytes += bytes;
      }
    }
  }
  for (const std::string& name : dense) {
    if (!name.empty()) caches.dense_bytes += chunks_of(name.front() == '/' ? name : "/" + name);
  }
  return caches;
}

DlrmBags dlrm_bags(const std::string& path, const std::vector<std::string>& tables,
                   const std::string& group) {
  DlrmBags bags;
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  hdf5::silence_errors();
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) return bags;
  const hdf5::Handle file(id, H5Fclose);
  const std::string what = "sparse data file '" + path + "'";
  auto open = [&](const std::string& name) -> hid_t {
    if (!hdf5::path_exists(file, name, ErrorKind::bad_input, what)) return -1;
    return H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  };
  for (const std::string& table : tables) {
    const std::string g = group + "/" + table;
    if (!hdf5::path_exists(file, g, ErrorKind::bad_input, what)) continue;
    const hid_t fixed_id = open(g + "/ids");
    if (fixed_id >= 0) {
      const hdf5::Handle ids(fixed_id, H5Dclose);
      const std::vector<int64_t> shape =
          hdf5::dataset_shape(ids, ErrorKind::bad_input, what + ": " + g + "/ids");
      if (shape.size() != 2) continue;
      bags.largest = std::max(bags.largest, shape[1]);
      bags.ids_per_row += static_cast<double>(shape[1]);
      continue;
    }
    if (!hdf5::path_exists(file, g + "/values", ErrorKind::bad_input, what)) continue;
    const hid_t offsets_id = open(g + "/offsets");
    if (offsets_id < 0) continue;
    const hdf5::Handle offsets(offsets_id, H5Dclose);
    const std::string name = what + ": " + g + "/offsets";
    const std::vector<int64_t> shape = hdf5::dataset_shape(offsets, ErrorKind::bad_input, name);
    if (shape.size() != 1 || shape[0] < 2) continue;
    const hdf5::Handle space =
        hdf5::make(H5Dget_space(offsets), H5Sclose, ErrorKind::bad_input, name + ": its dataspace");
    const int64_t rows = shape[0] - 1;
    bags.largest = std::max(bags.largest, largest_bag(offsets, space, 0, rows, name));
    const hsize_t one = 1;
    const hdf5::Handle memory = hdf5::make(H5Screate_simple(1, &one, nullptr), H5Sclose,
                                           ErrorKind::runtime, name + ": a memory dataspace");
    int64_t first = 0, last = 0;
    read_slab(offsets, space, memory, 0, 1, &first, ErrorKind::bad_input, name);
    read_slab(offsets, space, memory, rows, 1, &last, ErrorKind::bad_input, name);
    bags.ids_per_row += static_cast<double>(last - first) / static_cast<double>(rows);
  }
  return bags;
}

SparseHdf5Reader::~SparseHdf5Reader() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    if (lowest_problem_ != MPI_OP_NULL) MPI_Op_free(&lowest_problem_);
    if (problem_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&problem_type_);
  }
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  state_.clear();
  file_.reset();
}

void SparseHdf5Reader::open_caches() {
  // Each chunked dataset read into memory whole while the total stays within kSparseCacheBytes
  // (in table order): a batch's point selections are then gathers from memory instead of
  // HDF5's per-element work over its chunk cache (1.7 us an element on the build machine:
  // docs/recsys.md, "Reading the sparse data"). Past the bound a dataset is read through HDF5
  // with its default chunk cache.
  const std::string file_text = "sparse data file '" + path_ + "'";
  for (const auto& table : state_) {
    const std::string where = file_text + ", table '" + table->name + "'";
    auto load = [&](const std::string& name, hdf5::Handle& dataset, std::vector<int64_t>& into) {
      const int64_t bytes = resident_bytes(dataset, where + ": " + name);
      if (bytes == 0 || cache_bytes_ + bytes > cache_bound_) return;
      const std::vector<int64_t> shape =
          hdf5::dataset_shape(dataset, ErrorKind::bad_input, where + ": " + name);
      int64_t elements = 1;
      for (int64_t extent : shape) elements *= extent;
      into.assign(static_cast<size_t>(std::max<int64_t>(elements, 1)), 0);
      if (elements > 0) {
        hdf5::check(H5Dread(dataset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, into.data()),
                    ErrorKind::runtime, where + ": reading " + name);
      }
      cache_bytes_ += bytes;
    };
    load(table->values_name, table->values_dataset, table->values_resident);
    if (!table->fixed) {
      load(table->offsets_name, table->offsets_dataset, table->offsets_resident);
    }
  }
}

int64_t SparseHdf5Reader::table_rows(size_t table) const {
  return state_.at(table)->rows;
}

SparseTableRows SparseHdf5Reader::batch(size_t table) const {
  const Table& t = *state_.at(table);
  return {t.offsets.data(), t.values.data(), t.batch_rows};
}

void SparseHdf5Reader::read(const int64_t* rows, int64_t count) {
  agree(read_unagreed(rows, count));
}

SparseHdf5Reader::Problem SparseHdf5Reader::read_unagreed(const int64_t* rows, int64_t count) {
  return read_gathered(rows, count);
}

SparseHdf5Reader::Problem SparseHdf5Reader::read_gathered(const int64_t* rows, int64_t count) {
  reads_ = 0;
  Problem lowest;
  if (count < 0 || count > max_rows_) {
    return Problem{-1, 0, too_many_rows, count, 0};  // agreed, as in read_runs
  }
  // The positions asked for in file order (a repeated row: its first position first), the
  // distinct rows, each position's distinct row.
  for (int64_t i = 0; i < count; ++i) order_[static_cast<size_t>(i)] = i;
  std::sort(order_.begin(), order_.begin() + count, [rows](int64_t a, int64_t b) {
    return rows[a] < rows[b] || (rows[a] == rows[b] && a < b);
  });
  int64_t distinct = 0;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t i = order_[static_cast<size_t>(k)];
    if (distinct == 0 || distinct_[static_cast<size_t>(distinct - 1)] != rows[i]) {
      distinct_[static_cast<size_t>(distinct++)] = rows[i];
    }
    slot_[static_cast<size_t>(i)] = distinct - 1;
  }
  // The offsets to read: r and r + 1 of every distinct row inside the file, each once, in
  // increasing order (at_[j]: where row j's start lies among them, its end the next).
  int64_t points = 0;
  for (int64_t j = 0; j < distinct; ++j) {
    const int64_t r = distinct_[static_cast<size_t>(j)];
    if (r < 0 || r >= num_rows_) {
      const Problem p{r, 0, row_outside, 0, 0};
      if (p < lowest) lowest = p;
      at_[static_cast<size_t>(j)] = -1;
      continue;
    }
    if (points == 0 || points_[static_cast<size_t>(points - 1)] != to_h(r)) {
      points_[static_cast<size_t>(points++)] = to_h(r);
    }
    at_[static_cast<size_t>(j)] = points - 1;
    points_[static_cast<size_t>(points++)] = to_h(r + 1);
  }
  {
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    hdf5::silence_errors();
    for (size_t t = 0; t < state_.size(); ++t) {
      const Problem p = gather_table(*state_[t], t, rows, count, distinct, points);
      if (p < lowest) lowest = p;
    }
  }
  return lowest;
}

SparseHdf5Reader::Problem SparseHdf5Reader::gather_table(Table& table, size_t index,
                                                         const int64_t* rows, int64_t count,
                                                         int64_t distinct, int64_t points) {
  // begin_[j] of distinct row j: where its ids lie in gathered_, or one of these.
  constexpr int64_t kUnread = -1, kBad = -2, kNeeded = -3;
  Problem lowest;
  auto note = [&](int64_t row, int64_t kind, int64_t a = 0, int64_t b = 0) {
    const Problem p{row, static_cast<int64_t>(index), kind, a, b};
    if (p < lowest) lowest = p;
  };
  const size_t d = static_cast<size_t>(distinct);
  table.batch_rows = count;
  table.offsets[0] = 0;
  auto all_empty = [&] {  // every row an empty bag, so that the CSR stays well formed
    for (int64_t i = 0; i < count; ++i) table.offsets[static_cast<size_t>(i + 1)] = 0;
    return lowest;
  };
  auto first_row = [&] {  // the lowest row inside the file (for a failed read)
    for (size_t j = 0; j < d; ++j) {
      if (at_[j] >= 0) return distinct_[j];
    }
    return int64_t{0};
  };
  // Each distinct row's ids: [raw_[at], raw_[at + 1]) (CSR) or k of them (fixed hotness).
  if (!table.fixed && points > 0) {
    try {
      ++reads_;
      if (!table.offsets_resident.empty()) {
        for (int64_t p = 0; p < points; ++p) {
          raw_[static_cast<size_t>(p)] = table.offsets_resident[points_[static_cast<size_t>(p)]];
        }
      } else {
        read_points(table.offsets_dataset, table.offsets_space, table.memory, points_.data(),
                    points, raw_.data(), "reading offsets");
      }
    } catch (const Error&) {
      note(first_row(), read_failed);
      return all_empty();
    }
  }
  auto length = [&](size_t j) {
    if (begin_[j] == kBad) return int64_t{0};
    if (table.fixed) return table.hotness;
    const size_t at = static_cast<size_t>(at_[j]);
    return raw_[at + 1] - raw_[at];
  };
  for (size_t j = 0; j < d; ++j) {
    begin_[j] = kUnread;
    if (at_[j] < 0) {
      begin_[j] = kBad;  // outside the file: noted above
      continue;
    }
    if (table.fixed) continue;
    const int64_t r = distinct_[j];
    const int64_t s = raw_[static_cast<size_t>(at_[j])], e = raw_[static_cast<size_t>(at_[j] + 1)];
    // As read_table's checks: an offset outside the ids (the start first), then decreasing.
    if (s < 0 || s > table.ids) note(r, offset_past_ids, s);
    if (e < 0 || e > table.ids) note(r, offset_past_ids, e);
    if (e < s) note(r, offsets_decrease, s, e);
    if (s < 0 || s > table.ids || e < 0 || e > table.ids || e < s) begin_[j] = kBad;
  }
  // The capacity, in the order asked for: the first position whose ids no longer fit, and the
  // rows before it are the ones read.
  int64_t limit = count, total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const size_t j = static_cast<size_t>(slot_[static_cast<size_t>(i)]);
    const int64_t n = length(j);
    if (total + n > max_ids_) {
      note(rows[i], over_capacity, total + n);
      limit = i;
      break;
    }
    total += n;
  }
  for (int64_t i = 0; i < limit; ++i) {
    const size_t j = static_cast<size_t>(slot_[static_cast<size_t>(i)]);
    if (begin_[j] == kUnread) begin_[j] = kNeeded;
  }
  // The ids of the rows needed, in file order: one read.
  int64_t n = 0;
  for (size_t j = 0; j < d; ++j) {
    if (begin_[j] != kNeeded) continue;
    begin_[j] = n;
    if (table.fixed) {
      for (int64_t c = 0; c < table.hotness; ++c, ++n) {
        id_points_[static_cast<size_t>(2 * n)] = to_h(distinct_[j]);
        id_points_[static_cast<size_t>(2 * n + 1)] = to_h(c);
      }
    } else {
      const size_t at = static_cast<size_t>(at_[j]);
      for (int64_t v = raw_[at]; v < raw_[at + 1]; ++v)
        id_points_[static_cast<size_t>(n++)] = to_h(v);
    }
  }
  if (n > 0) {
    try {
      ++reads_;
      if (!table.values_resident.empty()) {
        // The points as read_points takes them: ids positions, or (row, column) pairs.
        const std::vector<int64_t>& from = table.values_resident;
        for (int64_t v = 0; v < n; ++v) {
          const auto at = static_cast<size_t>(v);
          gathered_[at] = table.fixed
                              ? from[id_points_[2 * at] * static_cast<hsize_t>(table.hotness) +
                                     id_points_[2 * at + 1]]
                              : from[id_points_[at]];
        }
      } else {
        read_points(table.values_dataset, table.values_space, table.memory, id_points_.data(), n,
                    gathered_.data(), table.fixed ? "reading ids" : "reading values");
      }
    } catch (const Error&) {
      note(first_row(), read_failed);
      return all_empty();
    }
  }
  for (size_t j = 0; j < d; ++j) {
    if (begin_[j] < 0) continue;
    for (int64_t v = begin_[j]; v < begin_[j] + length(j); ++v) {
      const int64_t id = gathered_[static_cast<size_t>(v)];
      if (id < 0 || id >= table.rows) note(distinct_[j], id_outside, id);
    }
  }
  // Back into the order asked for.
  int64_t out = 0;
  for (int64_t i = 0; i < count; ++i) {
    const size_t j = static_cast<size_t>(slot_[static_cast<size_t>(i)]);
    if (i < limit && begin_[j] >= 0) {
      const int64_t len = length(j);
      std::copy(gathered_.begin() + begin_[j], gathered_.begin() + begin_[j] + len,
                table.values.begin() + out);
      out += len;
    }
    table.offsets[static_cast<size_t>(i + 1)] = out;
  }
  return lowest;
}

void SparseHdf5Reader::read_range(int64_t first, int64_t count) {
  read_runs(nullptr, first, count);
}

void SparseHdf5Reader::read_runs(const int64_t* rows, int64_t first, int64_t count) {
  reads_ = 0;
  Problem lowest;
  if (count < 0 || count > max_rows_) {
    // Agreed like the data's problems, so that a rank asking for too many rows (a bug of the
    // caller) leaves none waiting in the all-reduce.
    lowest = Problem{-1, 0, too_many_rows, count, 0};
  } else {
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    hdf5::silence_errors();
    for (size_t t = 0; t < state_.size(); ++t) {
      const Problem p = read_table(*state_[t], t, rows, first, count);
      if (p < lowest) lowest = p;
    }
  }
  agree(lowest);
}

SparseHdf5Reader::Problem SparseHdf5Reader::read_table(Table& table, size_t index,
                                                       const int64_t* rows, int64_t first,
                                                       int64_t count) {
  Problem lowest;
  auto note = [&](int64_t row, int64_t kind, int64_t a = 0, int64_t b = 0) {
    const Problem p{row, static_cast<int64_t>(index), kind, a, b};
    if (p < lowest) lowest = p;
  };
  auto row_at = [&](int64_t i) { return rows ? rows[i] : first + i; };
  table.batch_rows = count;
  table.offsets[0] = 0;
  int64_t out_ids = 0;
  bool full = false;  // the capacity ran out: later runs check their offsets only
  int64_t i = 0;
  while (i < count) {
    // The run of consecutive global rows starting at position i.
    const int64_t start = row_at(i);
    int64_t len = 1;
    while (i + len < count && row_at(i + len) == start + len) ++len;
    auto skip = [&] {  // the run's rows as empty bags, so the CSR stays well formed
      for (int64_t k = 0; k < len; ++k) table.offsets[static_cast<size_t>(i + k + 1)] = out_ids;
      i += len;
    };
    if (start < 0 || start + len > num_rows_) {
      note(start < 0 ? start : std::max(start, num_rows_), row_outside);
      skip();
      continue;
    }
    if (table.fixed) {
      // Rows [start, start + len) of ids [rows, hotness]: one read, hotness ids per row.
      const int64_t k = table.hotness;
      if (!full && out_ids + len * k > max_ids_) {
        const int64_t fit = (max_ids_ - out_ids) / k;  // k > 0 here: the rows that still fit
        note(start + fit, over_capacity, out_ids + (fit + 1) * k);
        full = true;
      }
      if (full) {
        skip();
        continue;
      }
      if (len * k > 0) {
        const hsize_t file_start[2] = {to_h(start), 0}, file_count[2] = {to_h(len), to_h(k)};
        const hsize_t zero = 0, n = to_h(len * k);
        try {
          ++reads_;
          hdf5::check(H5Sselect_hyperslab(table.values_space, H5S_SELECT_SET, file_start, nullptr,
                                          file_count, nullptr),
                      ErrorKind::runtime, "selecting ids");
          hdf5::check(
              H5Sselect_hyperslab(table.memory, H5S_SELECT_SET, &zero, nullptr, &n, nullptr),
              ErrorKind::runtime, "selecting ids");
          hdf5::check(H5Dread(table.values_dataset, H5T_NATIVE_INT64, table.memory,
                              table.values_space, H5P_DEFAULT, table.values.data() + out_ids),
                      ErrorKind::runtime, "reading ids");
        } catch (const Error&) {
          note(start, read_failed);
          skip();
          continue;
        }
      }
      for (int64_t r = 0; r < len; ++r) {
        for (int64_t v = out_ids + r * k; v < out_ids + (r + 1) * k; ++v) {
          const int64_t id = table.values[static_cast<size_t>(v)];
          if (id < 0 || id >= table.rows) note(start + r, id_outside, id);
        }
        table.offsets[static_cast<size_t>(i + r + 1)] = out_ids + (r + 1) * k;
      }
      out_ids += len * k;
      i += len;
      continue;
    }
    try {
      ++reads_;
      read_slab(table.offsets_dataset, table.offsets_space, table.memory, start, len + 1,
                table.raw.data(), ErrorKind::runtime, "reading offsets");
    } catch (const Error&) {
      note(start, read_failed);
      skip();
      continue;
    }
    const int64_t* raw = table.raw.data();
    bool bad = false;
    for (int64_t k = 0; k <= len; ++k) {
      if (raw[k] < 0 || raw[k] > table.ids) {
        // Offset k ends row k - 1 and starts row k: the lower of them that was asked for (so
        // that the row named depends on the batch, not on how it is split into runs).
        note(start + std::max<int64_t>(k - 1, 0), offset_past_ids, raw[k]);
        bad = true;
      }
      if (k > 0 && raw[k] < raw[k - 1]) {
        note(start + k - 1, offsets_decrease, raw[k - 1], raw[k]);
        bad = true;
      }
    }
    if (bad) {
      skip();
      continue;
    }
    if (!full && out_ids + (raw[len] - raw[0]) > max_ids_) {
      // The first row of the run whose ids no longer fit.
      int64_t k = 0;
      while (out_ids + (raw[k + 1] - raw[0]) <= max_ids_) ++k;
      note(start + k, over_capacity, out_ids + (raw[k + 1] - raw[0]));
      full = true;
    }
    if (full) {
      skip();
      continue;
    }
    const int64_t n = raw[len] - raw[0];
    if (n > 0) {
      try {
        ++reads_;
        read_slab(table.values_dataset, table.values_space, table.memory, raw[0], n,
                  table.values.data() + out_ids, ErrorKind::runtime, "reading values");
      } catch (const Error&) {
        note(start, read_failed);
        skip();
        continue;
      }
    }
    for (int64_t k = 0; k < len; ++k) {
      const int64_t begin = out_ids + raw[k] - raw[0], end = out_ids + raw[k + 1] - raw[0];
      for (int64_t v = begin; v < end; ++v) {
        const int64_t id = table.values[static_cast<size_t>(v)];
        if (id < 0 || id >= table.rows) note(start + k, id_outside, id);
      }
      table.offsets[static_cast<size_t>(i + k + 1)] = end;
    }
    out_ids += n;
    i += len;
  }
  return lowest;
}

void SparseHdf5Reader::agree(Problem problem) {
  int64_t mine[kProblemFields] = {problem.row, problem.table, problem.kind, problem.a, problem.b};
  // Under the collective timeout, through a buffer sized at open: no allocation per batch.
  all_reduce_collective(mine, 1, problem_type_, lowest_problem_, comm_,
                        "MPI_Iallreduce (sparse data checks)", agreement_buffer_);
  const Problem p{mine[0], mine[1], mine[2], mine[3], mine[4]};
  if (p.none()) return;
  const Table& table = *state_.at(static_cast<size_t>(p.table));
  const std::string where = "sparse data file '" + path_ + "', table '" + table.name +
                            "', global row " + std::to_string(p.row) + ": ";
  const std::string group = group_ + "/" + table.name;
  auto agreed_error = [](ErrorKind kind, const std::string& message) {
    return AgreedError(Error(kind, message, __FILE__, __LINE__));
  };
  switch (p.kind) {
    case id_outside:
      throw agreed_error(ErrorKind::bad_input, where + "id " + std::to_string(p.a) +
                                                   " is outside the table's rows [0, " +
                                                   std::to_string(table.rows) + ")");
    case offsets_decrease:
      throw agreed_error(ErrorKind::bad_input, where + "the offsets decrease (the row starts at " +
                                                   std::to_string(p.a) + " and ends at " +
                                                   std::to_string(p.b) + ")");
    case offset_past_ids:
      throw agreed_error(ErrorKind::bad_input,
                         where + "offset " + std::to_string(p.a) + " lies outside the " +
                             std::to_string(table.ids) + " ids of " + group + "/values");
    case over_capacity:
      throw agreed_error(ErrorKind::bad_input,
                         where + "a rank's rows of the batch hold " + std::to_string(p.a) +
                             " ids or more, over the capacity of " + std::to_string(max_ids_) +
                             " ids per table the reader was opened with");
    case too_many_rows:
      throw agreed_error(ErrorKind::runtime,
                         "sparse data file '" + path_ + "': a rank asked for " +
                             std::to_string(p.a) + " rows in one read, outside the 0 to " +
                             std::to_string(max_rows_) + " the reader was opened for");
    case row_outside:
      throw agreed_error(ErrorKind::runtime,
                         "sparse data file '" + path_ + "': global row " + std::to_string(p.row) +
                             " was asked for, outside its " + std::to_string(num_rows_) + " rows");
    default:
      throw agreed_error(ErrorKind::runtime,
                         where + "reading the rows from this one failed on some rank (HDF5)");
  }
}

}  // namespace meshtrain
