// A user dataset in HDF5, streamed: /x float [N, features], /y integer [N] labels or float
// [N, outputs] (or [N]) regression targets, in one or several files (shards).
//
// Nothing is read at open but each file's metadata. A batch's rows are sorted and
// coalesced into runs of consecutive rows; each shard is then read either
//  - with pread at the dataset's file offset (a contiguous dataset whose file type is the
//    native one): no HDF5 call, no lock, no copy but the scatter into batch order; or
//  - through HDF5, one H5Dread per dataset of a hyperslab union of the runs (chunked,
//    compressed or converted datasets): HDF5 reads and decompresses each chunk the
//    selection touches once, and keeps recent chunks in the chunk cache.
// Shards are opened when a batch reads them. The shards of the current batch are the
// window: their caches keep the chunks they read within one budget for all shards, the
// others' caches are released, and at most open_shards stay open. So memory does not grow
// with the number of shards.
// Every HDF5 call holds hdf5::global_mutex(): Debian's parallel HDF5 is not thread-safe,
// and the reader runs on a BatchStream's thread beside the checkpoint writer.

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <mutex>

#include "base/error.hpp"
#include "framework/io/data.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain {

namespace {

using hdf5::Handle;

// A set-up failure: bad input naming the file.
template <class... Parts>
[[noreturn]] void bad_file(const std::string& path, Parts&&... parts) {
  MESHTRAIN_BAD_INPUT("HDF5 data file '", path, "': ", std::forward<Parts>(parts)...);
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// One dataset (data.x_key or data.y_key, by default /x and /y) of a shard.
struct Column {
  std::string name;     // its path in the file: "/x", "/y" or the config's keys
  Handle dataset;       // open only while its shard is in the window (read through HDF5)
  int64_t offset = -1;  // file offset of row 0 when read with pread; -1: through HDF5
  int64_t width = 1;    // values per row
  int row_rank = 1;     // the dataset's rank - 1 (x with Hdf5SourceOptions::x_row_shape: 2)
  int64_t row_dims[2] = {1, 1};  // a row's shape (width = their product)
  H5T_class_t type_class = H5T_NO_CLASS;
  size_t type_size = 0;       // bytes per value in the file
  bool native_int32 = false;  // labels stored as native int32 (pread, widened); else int64
  int64_t chunk_rows = 0;     // rows per chunk; 0: not chunked (no chunk cache)
  int64_t cache_bytes = 0;    // of its chunk cache while open
  // The chunks the current batch reads: ranges of chunk indices (up to kRanges) and bytes.
  static constexpr int kRanges = 16;
  int64_t from[kRanges] = {}, to[kRanges] = {};
  int ranges = 0;  // > kRanges: too many to list
  int64_t need = 0;
  // The chunks its cache may hold (read since it was emptied), as the same ranges.
  int64_t held_from[kRanges] = {}, held_to[kRanges] = {};
  int held_ranges = 0;
  int64_t held_bytes = 0;
  bool empty_cache = false;  // the dataset is opened again before this batch's read
  bool present = true;       // false: /y of an inputs-only source (nothing to read)
  bool through_hdf5() const { return present && offset < 0; }
  int64_t chunk_bytes() const { return chunk_rows * width * static_cast<int64_t>(type_size); }
};

struct Shard {
  std::string path;
  int64_t first = 0;  // its row 0 in the whole data set
  int64_t rows = 0;
  off_t size_at_open = 0;  // to notice a file that changed size
  Column x, y;
  // Open only while the shard is among the last read (Hdf5SourceOptions::open_shards):
  int fd = -1;           // for pread and fstat
  Handle file;           // when a column is read through HDF5
  uint64_t read_at = 0;  // the batch that last read it (least recently read closes first)
  uint64_t window = 0;   // the batch whose window holds it
  bool through_hdf5() const { return x.through_hdf5() || y.through_hdf5(); }
};

// The type of a dataset, and whether it can be read with pread as `native` (contiguous,
// allocated, no external storage, the file type equal to the native type).
void describe_column(Shard& shard, Column& column, const char* name, hid_t native) {
  const std::string& path = shard.path;
  const std::string what = std::string(name) + " in '" + path + "'";
  Handle type = hdf5::make(H5Dget_type(column.dataset), H5Tclose, ErrorKind::bad_input,
                           "cannot read the type of " + what);
  column.type_class = H5Tget_class(type);
  column.type_size = H5Tget_size(type);
  Handle plist = hdf5::make(H5Dget_create_plist(column.dataset), H5Pclose, ErrorKind::bad_input,
                            "cannot read the storage of " + what);
  const H5D_layout_t layout = H5Pget_layout(plist);
  const bool contiguous = layout == H5D_CONTIGUOUS && H5Pget_external_count(plist) == 0;
  hsize_t chunk[H5S_MAX_RANK] = {};
  if (layout == H5D_CHUNKED && H5Pget_chunk(plist, H5S_MAX_RANK, chunk) > 0) {
    column.chunk_rows = static_cast<int64_t>(chunk[0]);
  }
  if (contiguous && native >= 0 && H5Tequal(type, native) > 0) {
    const haddr_t offset = H5Dget_offset(column.dataset);
    if (offset != HADDR_UNDEF) column.offset = static_cast<int64_t>(offset);
  }
  H5Eclear2(H5E_DEFAULT);
}

// Reads one shard's metadata and checks it alone (the shards are compared after); leaves
// nothing open (a shard is opened when a batch reads it). Call under the HDF5 lock.
Shard describe_shard(const std::string& path, const Hdf5SourceOptions& options) {
  const std::string& x_name = options.x_name;
  const std::string& y_name = options.y_name;
  Shard shard;
  shard.path = path;
  shard.x.name = x_name;
  shard.y.name = y_name;
  const char* x = x_name.c_str();
  const char* y = y_name.c_str();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    MESHTRAIN_BAD_INPUT("cannot read the HDF5 data file '", path, "': ", std::strerror(errno));
  }
  shard.size_at_open = st.st_size;
  hdf5::silence_errors();
  shard.file = hdf5::make(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose,
                          ErrorKind::bad_input, "HDF5 data file '" + path + "': cannot open it");
  const auto open = [&](const char* name, const char* expected, const char* key) {
    if (!hdf5::path_exists(shard.file, name, ErrorKind::bad_input, "'" + path + "'")) {
      bad_file(path, "has no dataset ", name, " (expected ", expected, "; data.", key,
               " names it)");
    }
    return hdf5::make(H5Dopen2(shard.file, name, H5P_DEFAULT), H5Dclose, ErrorKind::bad_input,
                      "HDF5 data file '" + path + "': cannot open " + name);
  };

  const std::vector<int64_t>& row_shape = options.x_row_shape;
  if (!row_shape.empty()) {  // x as float [N, row_shape...] (Sobolev training's dy_key)
    MESHTRAIN_REQUIRE(row_shape.size() <= 2, "open_hdf5_source: x_row_shape of rank > 2");
    std::vector<int64_t> expected{-1};
    expected.insert(expected.end(), row_shape.begin(), row_shape.end());
    shard.x.dataset = open(x, "the derivative targets", options.x_key_name.c_str());
    const std::vector<int64_t> xd =
        hdf5::dataset_shape(shard.x.dataset, ErrorKind::bad_input, x_name + " in '" + path + "'");
    describe_column(shard, shard.x, x, H5T_NATIVE_FLOAT);
    expected[0] = xd.empty() ? 0 : xd[0];
    if (xd != expected || shard.x.type_class != H5T_FLOAT) {
      bad_file(path, x, " (data.", options.x_key_name, ") must be float ", shape_text(expected),
               ", got ", shard.x.type_class == H5T_FLOAT ? "float " : "non-float ", shape_text(xd));
    }
    shard.rows = xd[0];
    shard.x.row_rank = static_cast<int>(row_shape.size());
    shard.x.width = 1;
    for (size_t i = 0; i < row_shape.size(); ++i) {
      shard.x.row_dims[i] = row_shape[i];
      shard.x.width *= row_shape[i];
    }
    MESHTRAIN_REQUIRE(y_name.empty(), "open_hdf5_source: x_row_shape needs y_name \"\"");
    shard.y.present = false;
    shard.y.width = 0;
    shard.x.dataset.reset();
    shard.file.reset();
    return shard;
  }
  // x: float [N, features]
  shard.x.dataset = open(x, "float inputs [N, features]", "x_key");
  const std::vector<int64_t> xd =
      hdf5::dataset_shape(shard.x.dataset, ErrorKind::bad_input, x_name + " in '" + path + "'");
  describe_column(shard, shard.x, x, H5T_NATIVE_FLOAT);
  if (xd.size() != 2 || shard.x.type_class != H5T_FLOAT) {
    bad_file(path, x, " must be a float dataset [N, features], got ",
             shard.x.type_class == H5T_FLOAT ? "float " : "non-float ", shape_text(xd));
  }
  if (xd[0] == 0 || xd[1] == 0) bad_file(path, x, " is empty ", shape_text(xd));
  shard.rows = xd[0];
  shard.x.width = xd[1];

  if (y_name.empty()) {  // inputs only
    shard.y.present = false;
    shard.y.width = 0;
    shard.x.dataset.reset();
    shard.file.reset();
    return shard;
  }
  // y: integer [N] labels, or float [N, outputs] / [N] targets
  shard.y.dataset = open(y, "integer class labels [N] or float targets [N, outputs]", "y_key");
  const std::vector<int64_t> yd =
      hdf5::dataset_shape(shard.y.dataset, ErrorKind::bad_input, y_name + " in '" + path + "'");
  {
    Handle type = hdf5::make(H5Dget_type(shard.y.dataset), H5Tclose, ErrorKind::bad_input,
                             "cannot read the type of " + y_name + " in '" + path + "'");
    const bool int32 = H5Tequal(type, H5T_NATIVE_INT32) > 0;
    const bool int64 = H5Tequal(type, H5T_NATIVE_INT64) > 0;
    const bool labels = H5Tget_class(type) == H5T_INTEGER;
    describe_column(shard, shard.y, y,
                    labels ? (int32   ? H5T_NATIVE_INT32
                              : int64 ? H5T_NATIVE_INT64
                                      : -1)
                           : H5T_NATIVE_FLOAT);
    shard.y.native_int32 = int32;
  }
  const bool labels = shard.y.type_class == H5T_INTEGER && yd.size() == 1;
  const bool targets = shard.y.type_class == H5T_FLOAT && (yd.size() == 1 || yd.size() == 2);
  if (!labels && !targets) {
    bad_file(path, y, " must be integer class labels [N] or float targets [N, outputs], got ",
             shard.y.type_class == H5T_INTEGER ? "integer "
             : shard.y.type_class == H5T_FLOAT ? "float "
                                               : "non-numeric ",
             shape_text(yd));
  }
  if (yd[0] != xd[0]) bad_file(path, x, " has ", xd[0], " samples but ", y, " has ", yd[0]);
  shard.y.width = yd.size() == 2 ? yd[1] : 1;
  if (shard.y.width == 0) bad_file(path, y, " is empty ", shape_text(yd));
  shard.x.dataset.reset();
  shard.y.dataset.reset();
  shard.file.reset();
  return shard;
}

std::string type_text(const Column& c) {
  return std::to_string(8 * c.type_size) + "-bit " +
         (c.type_class == H5T_FLOAT ? "floats" : "integers");
}

// The shards and what is open of them, closed under the HDF5 lock however the source ends
// (a bad later shard at set-up included).
struct ShardSet {
  std::vector<Shard> shards;
  std::vector<size_t> open;  // the shards with a descriptor open (at most open_shards)
  Handle access;             // dataset access properties (the chunk cache of the next open)
  ShardSet() = default;
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;
  ~ShardSet() {
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    for (Shard& s : shards) {
      if (s.fd >= 0) ::close(s.fd);
      s.x.dataset.reset();
      s.y.dataset.reset();
      s.file.reset();
    }
    access.reset();
  }
};

// The next run of sorted positions from k (before end): the rows first, first + 1, ...,
// first + length - 1, each possibly repeated; `next` is the position after it.
struct Run {
  int64_t first = 0;
  int64_t length = 0;
  int64_t next = 0;
};

class Hdf5Source final : public RowSource {
 public:
  Hdf5Source(const std::vector<std::string>& files, int64_t num_classes,
             const Hdf5SourceOptions& options)
      : block_rows_(options.block_rows),
        open_shards_(options.open_shards),
        random_rows_(options.random_rows) {
    MESHTRAIN_REQUIRE(num_classes > 0, "open_hdf5_source: num_classes must be positive");
    MESHTRAIN_REQUIRE(!files.empty(), "open_hdf5_source: no files");
    MESHTRAIN_REQUIRE(open_shards_ > 0, "open_hdf5_source: open_shards must be positive");
    {
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      set_.access = hdf5::make(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose, ErrorKind::runtime,
                               "cannot create a dataset access property list");
      for (const std::string& path : files) {
        set_.shards.push_back(describe_shard(path, options));
      }
    }
    set_.open.reserve(static_cast<size_t>(std::min<int64_t>(open_shards_, files.size())));
    window_.reserve(files.size());
    std::vector<Shard>& shards = set_.shards;
    const Shard& head = shards.front();
    const bool labels = head.y.type_class == H5T_INTEGER;
    const bool inputs_only = !head.y.present;
    int64_t first = 0;
    for (Shard& s : shards) {
      const auto differ = [&](const char* what, const std::string& here, const std::string& there) {
        bad_file(s.path, "has ", here, " but '", head.path, "', the first shard, has ", there, " (",
                 what, "): every shard of data.path must match");
      };
      if (s.x.width != head.x.width) {
        differ("the width", std::to_string(s.x.width) + " features per row",
               std::to_string(head.x.width));
      }
      if (s.x.type_size != head.x.type_size)
        differ(("the dtype of " + s.x.name).c_str(), type_text(s.x), type_text(head.x));
      if (inputs_only) {
        s.first = first;
        first += s.rows;
        continue;
      }
      if ((s.y.type_class == H5T_INTEGER) != labels) {
        differ(("the kind of " + s.y.name).c_str(), labels ? "float targets" : "integer labels",
               labels ? "integer labels" : "float targets");
      }
      if (s.y.type_class != head.y.type_class || s.y.type_size != head.y.type_size) {
        differ(("the dtype of " + s.y.name).c_str(), type_text(s.y), type_text(head.y));
      }
      if (!labels && s.y.width != head.y.width) {
        differ("the target width", std::to_string(s.y.width) + " targets per row",
               std::to_string(head.y.width));
      }
      s.first = first;
      first += s.rows;
    }
    shape_.num_samples = first;
    shape_.features = head.x.width;
    // chunk_cache_bytes split between the columns as their rows' bytes.
    const auto row_bytes = [](const Column& c) {
      return c.width * static_cast<double>(c.type_size);
    };
    budget_[0] = static_cast<int64_t>(static_cast<double>(options.chunk_cache_bytes) *
                                      row_bytes(head.x) / (row_bytes(head.x) + row_bytes(head.y)));
    budget_[1] = options.chunk_cache_bytes - budget_[0];
    if (inputs_only) {
      // No labels or targets: num_classes and target_width stay 0.
    } else if (labels) {
      shape_.num_classes = num_classes;
    } else {
      shape_.target_width = head.y.width;
    }
    shape_.description = shards.size() == 1
                             ? "HDF5 dataset '" + head.path + "'"
                             : "HDF5 dataset of " + std::to_string(shards.size()) + " files ('" +
                                   head.path + "' ... '" + shards.back().path + "')";
  }

  void read(const int64_t* rows, int64_t count, const RowBuffers& out) override {
    const int64_t f = shape_.features;
    const int64_t w = shape_.classification() ? 1 : shape_.target_width;
    if (count > capacity_) {  // grows once, to the largest batch asked for
      order_.resize(static_cast<size_t>(count));
      x_.resize(static_cast<size_t>(count * f));
      labels_.resize(shape_.classification() ? static_cast<size_t>(count) : 0);
      targets_.resize(shape_.classification() ? 0 : static_cast<size_t>(count * w));
      capacity_ = count;
    }
    bool in_order = true;  // increasing, each row once
    for (int64_t i = 0; i < count; ++i) {
      MESHTRAIN_REQUIRE(rows[i] >= 0 && rows[i] < shape_.num_samples, "row ", rows[i], " of the ",
                        shape_.description);
      order_[i] = i;
      in_order = in_order && (i == 0 || rows[i] > rows[i - 1]);
    }
    if (!in_order) {
      std::sort(order_.begin(), order_.begin() + count,
                [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
    }
    // Rows asked for in file order (evaluation, predict) are read straight into out.x; others
    // into the scratch buffer, in sorted order, and scattered into batch order below.
    x_rows_ = in_order ? out.x : x_.data();
    ++batch_;
    enter_window(rows, count);
    for_each_shard(rows, count,
                   [&](Shard& s, int64_t begin, int64_t end) { read_shard(s, rows, begin, end); });
    update_resident_bytes();
    // One pass over all values looks for a non-finite one; only then are rows checked one by
    // one, to name the first.
    const bool finite = all_finite(x_rows_, count * f) &&
                        (shape_.classification() || all_finite(targets_.data(), count * w));
    for (int64_t k = 0; k < count; ++k) {
      const int64_t dest = order_[k];
      check_row(rows[dest], k, !finite);
      if (!in_order) std::copy_n(x_.data() + k * f, f, out.x + dest * f);
      if (out.labels) out.labels[dest] = static_cast<int32_t>(labels_[k]);
      if (out.targets) std::copy_n(targets_.data() + k * w, w, out.targets + dest * w);
    }
  }

  // Written by the reader thread after each read, read by any thread.
  int64_t resident_bytes() const override { return resident_bytes_.load(); }

 private:
  size_t shard_index(int64_t row) const {
    const auto& shards = set_.shards;
    auto it = std::upper_bound(shards.begin(), shards.end(), row,
                               [](int64_t r, const Shard& s) { return r < s.first; });
    return static_cast<size_t>(it - shards.begin()) - 1;
  }
  const Shard& shard_of(int64_t row) const { return set_.shards[shard_index(row)]; }

  // f(shard, begin, end) for each shard the sorted positions [0, count) fall in.
  template <class F>
  void for_each_shard(const int64_t* rows, int64_t count, F f) {
    for (int64_t begin = 0; begin < count;) {
      Shard& s = set_.shards[shard_index(rows[order_[begin]])];
      int64_t end = begin + 1;
      while (end < count && rows[order_[end]] < s.first + s.rows) ++end;
      f(s, begin, end);
      begin = end;
    }
  }

  Run run_at(const int64_t* rows, int64_t k, int64_t end) const {
    Run run{rows[order_[k]], 1, k + 1};
    for (; run.next < end; ++run.next) {
      const int64_t row = rows[order_[run.next]];
      if (row == run.first + run.length) {
        ++run.length;
      } else if (row != run.first + run.length - 1) {  // not the same row again
        break;
      }
    }
    return run;
  }

  // f(first, end) for the rows of s that sorted positions [begin, end) read: their runs,
  // or with blocks the part in s of each block they fall in (each block once).
  template <class F>
  void for_each_range(const Shard& s, const int64_t* rows, int64_t begin, int64_t end, F f) const {
    int64_t last_block = -1;
    for (int64_t k = begin; k < end;) {
      const Run run = run_at(rows, k, end);
      k = run.next;
      if (block_rows_ <= 0) {
        f(run.first, run.first + run.length);
        continue;
      }
      const int64_t to = (run.first + run.length - 1) / block_rows_;
      for (int64_t b = std::max(run.first / block_rows_, last_block + 1); b <= to; ++b) {
        f(std::max(b * block_rows_, s.first), std::min((b + 1) * block_rows_, s.first + s.rows));
      }
      last_block = std::max(last_block, to);
    }
  }

  // The batch's shards are the window: the chunks each one's rows fall in are counted,
  // its rows asked of the kernel, and the caches of the other shards are released.
  void enter_window(const int64_t* rows, int64_t count) {
    window_need_[0] = window_need_[1] = 0;
    window_.clear();
    for_each_shard(rows, count, [&](Shard& s, int64_t begin, int64_t end) {
      s.window = batch_;
      window_.push_back(static_cast<size_t>(&s - set_.shards.data()));
      for (Column* c : {&s.x, &s.y}) {
        c->need = 0;
        c->ranges = 0;
        if (c->chunk_rows <= 0) continue;
        int64_t last = -1;
        for_each_range(s, rows, begin, end, [&](int64_t first, int64_t stop) {
          const int64_t from = std::max((first - s.first) / c->chunk_rows, last + 1);
          const int64_t to = (stop - 1 - s.first) / c->chunk_rows;
          if (to < from) return;
          c->need += (to - from + 1) * c->chunk_bytes();
          if (c->ranges < Column::kRanges) {
            c->from[c->ranges] = from;
            c->to[c->ranges] = to;
          }
          ++c->ranges;
          last = to;
        });
        window_need_[c == &s.y] += c->need;
      }
      for_each_range(s, rows, begin, end,
                     [&](int64_t first, int64_t stop) { advise(s, first, stop); });
    });
    for (size_t i : set_.open) {
      Shard& s = set_.shards[i];
      if (s.window != batch_ && (s.x.dataset.get() >= 0 || s.y.dataset.get() >= 0)) {
        std::lock_guard<std::mutex> lock(hdf5::global_mutex());
        close_datasets(s);
      }
    }
    for (int column : {0, 1}) plan_caches(column);
  }

  // Which caches of the window keep what they hold: one whose chunks this batch reads, or
  // that can add this batch's chunks within the column's budget (a rank's slice of a batch
  // may miss a block of the window that the next batch reads). The others are emptied to
  // this batch's chunks; if the caches would still hold more than the budget, all are.
  void plan_caches(int column) {
    int64_t held = 0;
    for_each_window_column(column, [&](Column& c) { held += c.held_bytes; });
    for_each_window_column(column, [&](Column& c) {
      c.empty_cache = c.dataset.get() < 0;
      if (c.empty_cache) return;
      if (c.ranges > Column::kRanges) {  // too many to list: random rows
        c.empty_cache = true;
        return;
      }
      bool covered[Column::kRanges] = {};
      int64_t added = 0;
      int more = 0;
      for (int r = 0; r < c.ranges; ++r) {
        for (int h = 0; h < c.held_ranges && !covered[r]; ++h) {
          covered[r] = c.held_from[h] <= c.from[r] && c.to[r] <= c.held_to[h];
        }
        if (covered[r]) continue;
        added += (c.to[r] - c.from[r] + 1) * c.chunk_bytes();
        ++more;
      }
      if (c.held_ranges + more > Column::kRanges || held + added > budget_[column]) {
        c.empty_cache = true;
        return;
      }
      for (int r = 0; r < c.ranges; ++r) {
        if (covered[r]) continue;
        c.held_from[c.held_ranges] = c.from[r];
        c.held_to[c.held_ranges++] = c.to[r];
      }
      c.held_bytes += added;
      held += added;
    });
    // The emptied caches hold this batch's chunks only.
    held = 0;
    for_each_window_column(column, [&](Column& c) {
      if (c.empty_cache) empty(c);
      held += c.held_bytes;
    });
    if (held <= budget_[column]) return;
    for_each_window_column(column, [&](Column& c) {
      c.empty_cache = true;
      empty(c);
    });
  }

  void empty(Column& c) {
    c.held_ranges = std::min(c.ranges, Column::kRanges);
    std::copy_n(c.from, c.held_ranges, c.held_from);
    std::copy_n(c.to, c.held_ranges, c.held_to);
    if (c.ranges > Column::kRanges) c.held_ranges = 0;  // not listed: emptied next time
    c.held_bytes = c.need;
  }

  // f(column) for the chunked columns `column` (0: /x, 1: /y) of the window's shards.
  template <class F>
  void for_each_window_column(int column, F f) {
    for (size_t i : window_) {
      Column& c = column == 0 ? set_.shards[i].x : set_.shards[i].y;
      if (c.through_hdf5() && c.chunk_rows > 0) f(c);
    }
  }

  // Asks the kernel for rows [first, stop) of s before the first pread, so the disk has a
  // batch's reads in flight together instead of one at a time (with blocks, whole blocks:
  // read once, sequentially, for the batches of their window). Advice only: a failure
  // changes nothing but speed. A shard not open yet is advised when it is opened.
  void advise(const Shard& s, int64_t first, int64_t stop) const {
    if (s.fd < 0) return;
    for (const Column* c : {&s.x, &s.y}) {
      if (!c->present || c->through_hdf5()) continue;
      const int64_t row_bytes = c->width * static_cast<int64_t>(c->type_size);
      ::posix_fadvise(s.fd, static_cast<off_t>(c->offset + (first - s.first) * row_bytes),
                      static_cast<off_t>((stop - first) * row_bytes), POSIX_FADV_WILLNEED);
    }
  }

  // Opens s to be read, closing the least recently read shard when open_shards are open.
  // Allocates nothing (the read rule covers the reader thread): messages only on failure.
  void open_shard(Shard& s) {
    if (s.fd >= 0) return;
    if (static_cast<int64_t>(set_.open.size()) >= open_shards_) {
      auto oldest = std::min_element(set_.open.begin(), set_.open.end(), [&](size_t a, size_t b) {
        return set_.shards[a].read_at < set_.shards[b].read_at;
      });
      close_shard(set_.shards[*oldest]);
      set_.open.erase(oldest);
    }
    s.fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (s.fd < 0) {
      MESHTRAIN_FAIL("cannot open the HDF5 data file '", s.path,
                     "' while training: ", std::strerror(errno));
    }
    set_.open.push_back(static_cast<size_t>(&s - set_.shards.data()));
    // Random rows: no read-ahead window per row (each would fetch pages no batch asks for).
    if (random_rows_) ::posix_fadvise(s.fd, 0, 0, POSIX_FADV_RANDOM);
    if (!s.through_hdf5()) return;
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    hdf5::silence_errors();
    s.file = Handle(H5Fopen(s.path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (s.file.get() < 0) hdf5::check(-1, ErrorKind::runtime, "reopening '" + s.path + "'");
  }

  void close_shard(Shard& s) {
    if (s.file.get() >= 0) {  // a shard read with pread alone takes no HDF5 lock
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      close_datasets(s);
      s.file.reset();
    }
    ::close(s.fd);
    s.fd = -1;
  }

  void close_datasets(Shard& s) {  // under the HDF5 lock
    for (Column* c : {&s.x, &s.y}) {
      c->dataset.reset();
      c->held_ranges = 0;
      c->held_bytes = 0;
    }
  }

  // The datasets read through HDF5, opened again to empty their chunk caches as
  // plan_caches decided. A cache may take the column's whole budget while the window's
  // chunks fit in it, as plan_caches keeps what the caches hold within it (HDF5 evicts well
  // before a cache is full: one sized to the chunks it was to hold missed most reads of
  // random rows among them); otherwise it gets its share, by the chunks it reads.
  void open_datasets(Shard& s) {
    for (Column* c : {&s.x, &s.y}) {
      if (!c->through_hdf5()) continue;
      const int64_t window = window_need_[c == &s.y], budget = budget_[c == &s.y];
      const int64_t capacity =
          window > budget ? static_cast<int64_t>(static_cast<double>(budget) * c->need / window)
                          : budget;
      if (c->dataset.get() >= 0 && !c->empty_cache && c->cache_bytes == capacity) continue;
      const char* name = c->name.c_str();
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      hdf5::silence_errors();
      c->dataset.reset();
      // w0 = 0.75 (HDF5's default): with 1.0 a chunk read in part is never evicted, and the
      // cache grew to the whole uncompressed dataset (776 MiB per rank after 40 random
      // batches of a gzip file).
      if (H5Pset_chunk_cache(set_.access, 12421, static_cast<size_t>(capacity), 0.75) < 0) {
        hdf5::check(-1, ErrorKind::runtime, "cannot set the chunk cache");
      }
      c->dataset = Handle(H5Dopen2(s.file, name, set_.access), H5Dclose);
      if (c->dataset.get() < 0) {
        hdf5::check(-1, ErrorKind::runtime,
                    std::string("opening ") + name + " of '" + s.path + "'");
      }
      c->cache_bytes = capacity;
    }
  }

  // Reads sorted positions [begin, end) (rows of shard s) into the scratch buffers.
  void read_shard(Shard& s, const int64_t* rows, int64_t begin, int64_t end) {
    if (s.fd < 0) {
      open_shard(s);
      for_each_range(s, rows, begin, end,
                     [&](int64_t first, int64_t stop) { advise(s, first, stop); });
    }
    s.read_at = batch_;
    struct stat st {};
    if (::fstat(s.fd, &st) != 0 || st.st_size != s.size_at_open) {
      MESHTRAIN_FAIL("HDF5 data file '", s.path, "' changed size while training (", s.size_at_open,
                     " bytes at set-up, ", st.st_size,
                     " now): data files must not change during a run");
    }
    if (s.through_hdf5()) open_datasets(s);
    const int64_t f = s.x.width;
    read_column(s, s.x, rows, begin, end, H5T_NATIVE_FLOAT, x_rows_ + begin * f);
    if (!s.y.present) return;
    if (shape_.classification()) {
      read_column(s, s.y, rows, begin, end, H5T_NATIVE_INT64, labels_.data() + begin);
    } else {
      read_column(s, s.y, rows, begin, end, H5T_NATIVE_FLOAT, targets_.data() + begin * s.y.width);
    }
  }

  // One column of positions [begin, end) into `out` (sorted order), `memory` the type the
  // values are wanted as (float, or int64 labels). The distinct rows are read packed (each
  // run one pread, or the union of the runs one H5Dread), then repeated where the batch
  // repeats them.
  void read_column(const Shard& s, const Column& c, const int64_t* rows, int64_t begin, int64_t end,
                   hid_t memory, void* out) {
    const char* name = c.name.c_str();
    const size_t value_bytes = memory == H5T_NATIVE_INT64 ? 8 : 4;
    auto* bytes = static_cast<char*>(out);
    int64_t distinct = 0;
    if (!c.through_hdf5()) {
      // Packed as stored; labels stored as int32 are widened after.
      const auto row_bytes = static_cast<int64_t>(c.width * c.type_size);
      for (int64_t k = begin; k < end;) {
        const Run run = run_at(rows, k, end);
        pread_all(s, bytes + distinct * row_bytes, static_cast<size_t>(run.length * row_bytes),
                  c.offset + (run.first - s.first) * row_bytes, name);
        distinct += run.length;
        k = run.next;
      }
      if (c.native_int32 && memory == H5T_NATIVE_INT64) {
        // The int32 values sit packed at the front: widen from the back.
        auto* values = static_cast<int64_t*>(out);
        const auto* packed = static_cast<const int32_t*>(out);
        for (int64_t i = distinct * c.width - 1; i >= 0; --i) values[i] = packed[i];
      }
    } else {
      distinct = read_hdf5_column(s, c, rows, begin, end, memory, out, name);
    }
    if (distinct == end - begin) return;
    // Spread from the back: distinct row j goes to every sorted position holding it (j is
    // never past the position, so nothing is overwritten before it is read).
    const size_t row_bytes = static_cast<size_t>(c.width) * value_bytes;
    int64_t j = distinct - 1;
    for (int64_t k = end - 1; k >= begin; --k) {
      std::memmove(bytes + (k - begin) * row_bytes, bytes + j * row_bytes, row_bytes);
      if (k > begin && rows[order_[k - 1]] != rows[order_[k]]) --j;
    }
  }

  // The distinct rows of positions [begin, end) through HDF5, packed; returns their number.
  int64_t read_hdf5_column(const Shard& s, const Column& c, const int64_t* rows, int64_t begin,
                           int64_t end, hid_t memory, void* out, const char* name) {
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    hdf5::silence_errors();
    // The message is made only on a failure: a read allocates nothing (the step's no-
    // allocation rule covers the reader thread).
    const auto check = [&](auto status) {
      if (status < 0) {
        hdf5::check(-1, ErrorKind::runtime,
                    std::string("reading ") + name + " of '" + s.path + "'");
      }
      return status;
    };
    Handle space(check(H5Dget_space(c.dataset)), H5Sclose);
    check(H5Sselect_none(space));
    int64_t distinct = 0;
    for (int64_t k = begin; k < end;) {
      const Run run = run_at(rows, k, end);
      // A row of rank row_rank (2 for x_row_shape's [N, outputs, k]): whole rows.
      const hsize_t start[3] = {static_cast<hsize_t>(run.first - s.first), 0, 0};
      const hsize_t count[3] = {static_cast<hsize_t>(run.length),
                                static_cast<hsize_t>(c.row_rank == 1 ? c.width : c.row_dims[0]),
                                static_cast<hsize_t>(c.row_dims[1])};
      check(H5Sselect_hyperslab(space, H5S_SELECT_OR, start, nullptr, count, nullptr));
      distinct += run.length;
      k = run.next;
    }
    const hsize_t values = static_cast<hsize_t>(distinct * c.width);
    Handle memory_space(check(H5Screate_simple(1, &values, nullptr)), H5Sclose);
    check(H5Dread(c.dataset, memory, memory_space, space, H5P_DEFAULT, out));
    return distinct;
  }

  void pread_all(const Shard& s, char* out, size_t bytes, int64_t offset, const char* name) const {
    while (bytes > 0) {
      const ssize_t got = ::pread(s.fd, out, bytes, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        MESHTRAIN_FAIL("HDF5 data file '", s.path, "': reading ", name, " at byte ", offset,
                       " failed: ", got < 0 ? std::strerror(errno) : "the file ends there");
      }
      out += got;
      bytes -= static_cast<size_t>(got);
      offset += got;
    }
  }

  // The scratch buffers and the chunk caches of the open datasets.
  void update_resident_bytes() {
    auto bytes = static_cast<int64_t>(order_.capacity() * 8 + x_.capacity() * 4 +
                                      labels_.capacity() * 8 + targets_.capacity() * 4);
    for (size_t i : set_.open) {
      const Shard& s = set_.shards[i];
      // What a cache can hold.
      for (const Column* c : {&s.x, &s.y}) {
        bytes += c->dataset.get() >= 0 ? std::min(c->cache_bytes, c->held_bytes) : 0;
      }
    }
    resident_bytes_.store(bytes);
  }

  // Whether the n values at x are all finite, in one pass without a branch per value (the
  // loop vectorizes): bit 31 of (exponent bits + 1 in the exponent's lowest bit) is set for
  // inf and NaN only, whose exponent bits are all ones.
  static bool all_finite(const float* x, int64_t n) {
    uint32_t special = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      special |= (bits & 0x7f800000u) + 0x00800000u;
    }
    return (special & 0x80000000u) == 0;
  }

  // Row `row` of the data set, at sorted position k of the buffers read into: its label, and
  // with `values` its inputs and targets are finite.
  void check_row(int64_t row, int64_t k, bool values) const {
    if (values) check_values(row, k);
    if (shape_.classification()) {
      const int64_t label = labels_[k];
      if (label < 0 || label >= shape_.num_classes) {
        const Shard& s = shard_of(row);
        MESHTRAIN_FAIL("HDF5 data file '", s.path, "': label ", s.y.name, "[", row - s.first,
                       "] = ", label, " is outside [0, ", shape_.num_classes,
                       ") (model.sizes[-1] = ", shape_.num_classes, " classes)");
      }
    }
  }

  void check_values(int64_t row, int64_t k) const {
    const int64_t f = shape_.features;
    const float* x = x_rows_ + k * f;
    for (int64_t c = 0; c < f; ++c) {
      if (!std::isfinite(x[c])) {
        const Shard& s = shard_of(row);
        MESHTRAIN_FAIL("HDF5 data file '", s.path, "': ", s.x.name, "[", row - s.first, ", ", c,
                       "] is ", x[c], "; inputs must be finite");
      }
    }
    if (shape_.classification()) return;
    const int64_t w = shape_.target_width;  // 0 for inputs only
    for (int64_t c = 0; c < w; ++c) {
      const float t = targets_[k * w + c];
      if (!std::isfinite(t)) {
        const Shard& s = shard_of(row);
        MESHTRAIN_FAIL("HDF5 data file '", s.path, "': ", s.y.name, "[", row - s.first, ", ", c,
                       "] is ", t, "; targets must be finite");
      }
    }
  }

  ShardSet set_;
  int64_t budget_[2] = {0, 0};  // chunk cache of /x and /y, shared by the window's shards
  int64_t block_rows_;          // > 0: rows are read in shuffled blocks of this many
  int64_t open_shards_;         // shards open at once, at most
  bool random_rows_;
  uint64_t batch_ = 0;               // reads so far
  int64_t window_need_[2] = {0, 0};  // the bytes of the chunks the window reads (/x, /y)
  std::vector<size_t> window_;       // the shards of the current batch
  std::atomic<int64_t> resident_bytes_{0};
  // Scratch of one read, in sorted row order (grown to the largest batch, then reused).
  int64_t capacity_ = 0;
  std::vector<int64_t> order_;  // sorted position -> the caller's row index
  std::vector<float> x_;
  float* x_rows_ = nullptr;  // where the batch being read puts its inputs: x_, or out.x
  std::vector<int64_t> labels_;
  std::vector<float> targets_;
};

}  // namespace

std::unique_ptr<RowSource> open_hdf5_source(const std::vector<std::string>& files,
                                            int64_t num_classes, const Hdf5SourceOptions& options) {
  return std::make_unique<Hdf5Source>(files, num_classes, options);
}

Dataset load_hdf5_dataset(const std::string& path, int64_t num_classes) {
  std::unique_ptr<RowSource> source = open_hdf5_source({path}, num_classes);
  return read_all(*source);
}

std::vector<std::string> expand_data_paths(const std::vector<std::string>& entries,
                                           const std::string& key) {
  std::vector<std::string> files;
  for (const std::string& entry : entries) {
    if (entry.find_first_of("*?[") == std::string::npos) {
      files.push_back(entry);
      continue;
    }
    glob_t matches{};
    const int status = ::glob(entry.c_str(), 0, nullptr, &matches);  // sorted by glob
    if (status == 0) {
      for (size_t i = 0; i < matches.gl_pathc; ++i) files.emplace_back(matches.gl_pathv[i]);
    }
    ::globfree(&matches);
    if (status == GLOB_NOMATCH) MESHTRAIN_BAD_INPUT(key, " entry '", entry, "' matches no file");
    if (status != 0)
      MESHTRAIN_BAD_INPUT(key, " entry '", entry, "': the glob failed (", status, ")");
  }
  return files;
}

}  // namespace meshtrain
