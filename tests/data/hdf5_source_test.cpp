// HDF5 streaming (open_hdf5_source) reads exactly the rows of the in-memory data set: whole
// (read_all) and by random rows (repeats, runs, any order, across shards), from contiguous
// files (pread), gzip-chunked files with the shuffle filter and float64 inputs (through
// HDF5), int32 and int64 labels, regression targets [N, w] and [N]; several shards equal
// one file; globs expand sorted; a shard that does not match the first is bad input naming
// it and leaves nothing open; a bad row or a file that changed size is a runtime error
// naming the file and row; 8 gzip shards hold the memory of one file, and at most
// open_shards shards are open at once.

#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "framework/io/data.hpp"
#include "tests/support/datasets.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/hdf5_files.hpp"
#include "tests/support/temp_dir.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;
using testing::H5Layout;
using testing::numbered_classes;
using testing::numbered_targets;
using testing::TempDir;
using testing::write_h5;
using testing::write_h5_shards;

// Rows read from `source` (x and labels or targets), in the order asked.
struct Rows {
  std::vector<float> x;
  std::vector<int32_t> labels;
  std::vector<float> targets;
};

Rows read_rows(RowSource& source, const std::vector<int64_t>& rows) {
  const DataShape& shape = source.shape();
  const auto n = static_cast<int64_t>(rows.size());
  Rows out;
  out.x.assign(static_cast<size_t>(n * shape.features), -7.0f);
  RowBuffers buffers{out.x.data(), nullptr, nullptr};
  if (shape.classification()) {
    out.labels.assign(static_cast<size_t>(n), -7);
    buffers.labels = out.labels.data();
  } else {
    out.targets.assign(static_cast<size_t>(n * shape.target_width), -7.0f);
    buffers.targets = out.targets.data();
  }
  source.read(rows.data(), n, buffers);
  return out;
}

// Row lists that a batch reader asks for: one row, a run, the whole set backwards, random
// rows with repeats (more than the set), runs broken across shard boundaries.
std::vector<std::vector<int64_t>> row_lists(int64_t n) {
  std::vector<std::vector<int64_t>> lists = {{0}, {n - 1}, {n / 2, n / 2 + 1, n / 2 + 2}};
  std::vector<int64_t> backwards;
  for (int64_t i = n - 1; i >= 0; --i) backwards.push_back(i);
  lists.push_back(backwards);
  std::mt19937_64 gen(5);
  for (int64_t count : {int64_t{5}, int64_t{33}, 3 * n}) {
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < count; ++i) rows.push_back(static_cast<int64_t>(gen() % n));
    lists.push_back(rows);
  }
  std::vector<int64_t> runs;  // runs of 4 starting at every 9th row, shuffled
  for (int64_t start = 0; start + 4 <= n; start += 9) {
    for (int64_t i = 0; i < 4; ++i) runs.push_back(start + i);
  }
  std::shuffle(runs.begin(), runs.end(), gen);
  lists.push_back(runs);
  return lists;
}

// The source reads what the in-memory set holds, bit for bit.
void expect_same_rows(RowSource& source, const Dataset& d) {
  const DataShape& shape = source.shape();
  EXPECT_EQ(shape.num_samples, d.num_samples);
  EXPECT_EQ(shape.features, d.features);
  EXPECT_EQ(shape.num_classes, d.num_classes);
  EXPECT_EQ(shape.target_width, d.target_width);
  const Dataset all = read_all(source);
  EXPECT_EQ(all.inputs, d.inputs);
  EXPECT_EQ(all.labels, d.labels);
  EXPECT_EQ(all.targets, d.targets);
  auto memory = make_memory_source(d);
  for (const auto& rows : row_lists(d.num_samples)) {
    SCOPED_TRACE(std::to_string(rows.size()) + " rows from " + std::to_string(rows.front()));
    const Rows got = read_rows(source, rows);
    const Rows want = read_rows(*memory, rows);
    EXPECT_EQ(got.x, want.x);
    EXPECT_EQ(got.labels, want.labels);
    EXPECT_EQ(got.targets, want.targets);
  }
}

struct Variant {
  std::string name;
  H5Layout layout;
  int shards;
};

std::vector<Variant> variants() {
  H5Layout contiguous;
  H5Layout chunked;
  chunked.chunked = true;
  H5Layout f64 = contiguous;
  f64.x_double = true;
  H5Layout i64 = contiguous;
  i64.labels_int64 = true;
  H5Layout chunked_i64 = chunked;
  chunked_i64.labels_int64 = true;
  H5Layout chunked_f64 = chunked;
  chunked_f64.x_double = true;
  return {{"contiguous", contiguous, 1},
          {"gzip-chunked", chunked, 1},
          {"contiguous, 3 shards", contiguous, 3},
          {"gzip-chunked, 3 shards", chunked, 3},
          {"float64 /x", f64, 1},
          {"int64 /y", i64, 1},
          {"gzip-chunked int64 /y", chunked_i64, 1},
          {"gzip-chunked float64 /x, 3 shards", chunked_f64, 3}};
}

TEST(Hdf5Source, StreamsTheRowsOfTheInMemorySet) {
  ASSERT_GT(H5Zfilter_avail(H5Z_FILTER_DEFLATE), 0) << "HDF5 without gzip";
  ASSERT_GT(H5Zfilter_avail(H5Z_FILTER_SHUFFLE), 0) << "HDF5 without the shuffle filter";
  TempDir dir;
  const Dataset d = numbered_classes(103, 5, 7);
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    const auto files = write_h5_shards(dir.path(), "set", d, v.shards, v.layout);
    auto source = open_hdf5_source(files, 7);
    expect_same_rows(*source, d);
    // A tiny chunk cache changes nothing but speed.
    Hdf5SourceOptions small;
    small.chunk_cache_bytes = 64;
    auto uncached = open_hdf5_source(files, 7, small);
    expect_same_rows(*uncached, d);
  }
}

TEST(Hdf5Source, StreamsRegressionTargets) {
  TempDir dir;
  for (int64_t width : {3, 1}) {
    const Dataset d = numbered_targets(61, 4, width);
    for (Variant v : variants()) {
      if (v.layout.labels_int64) continue;
      v.layout.targets_1d = width == 1;  // /y [N]
      SCOPED_TRACE(v.name + ", width " + std::to_string(width));
      const auto files = write_h5_shards(dir.path(), "reg", d, v.shards, v.layout);
      auto source = open_hdf5_source(files, 1);
      EXPECT_FALSE(source->shape().classification());
      expect_same_rows(*source, d);
    }
  }
}

TEST(Hdf5Source, SeveralShardsAreOneDataSet) {
  TempDir dir;
  const Dataset d = numbered_classes(100, 3, 4);
  const std::string whole = dir.file("whole.h5");
  write_h5(whole, d);
  // Shards of very different sizes, one of a single row.
  const std::string a = dir.file("a.h5"), b = dir.file("b.h5"), c = dir.file("c.h5");
  write_h5(a, d, {}, 0, 1);
  write_h5(b, d, {}, 1, 70);
  write_h5(c, d, {}, 71, 29);
  auto one = open_hdf5_source({whole}, 4);
  auto three = open_hdf5_source({a, b, c}, 4);
  EXPECT_EQ(three->shape().num_samples, 100);
  for (const auto& rows : row_lists(100)) {
    const Rows x = read_rows(*one, rows), y = read_rows(*three, rows);
    EXPECT_EQ(x.x, y.x);
    EXPECT_EQ(x.labels, y.labels);
  }
  EXPECT_NE(three->shape().description.find("3 files"), std::string::npos)
      << three->shape().description;
  EXPECT_NE(one->shape().description.find(whole), std::string::npos);
  // The order given is the order of the rows.
  auto reversed = open_hdf5_source({c, b, a}, 4);
  const Rows first = read_rows(*reversed, {0});
  EXPECT_EQ(first.x[0], d.inputs[71 * 3]);
  // load_hdf5_dataset reads one file whole.
  const Dataset loaded = load_hdf5_dataset(whole, 4);
  EXPECT_EQ(loaded.inputs, d.inputs);
  EXPECT_EQ(loaded.labels, d.labels);
}

TEST(Hdf5Source, GlobsExpandSorted) {
  TempDir dir;
  const Dataset d = numbered_classes(60, 2, 3);
  // Names whose sorted order is not their creation order: part-10 sorts before part-2.
  const std::vector<std::string> names = {"part-2.h5", "part-10.h5", "part-1.h5"};
  for (size_t i = 0; i < names.size(); ++i) {
    write_h5(dir.file(names[i]), d, {}, static_cast<int64_t>(i) * 20, 20);
  }
  { std::ofstream(dir.file("notes.txt")) << "not data"; }
  const std::vector<std::string> sorted = {dir.file("part-1.h5"), dir.file("part-10.h5"),
                                           dir.file("part-2.h5")};
  EXPECT_EQ(expand_data_paths({dir.file("part-*.h5")}, "data.path"), sorted);
  EXPECT_EQ(expand_data_paths({dir.file("part-?.h5")}, "data.path"),
            (std::vector<std::string>{dir.file("part-1.h5"), dir.file("part-2.h5")}));
  EXPECT_EQ(expand_data_paths({dir.file("part-[12]0.h5")}, "data.path"),
            std::vector<std::string>{dir.file("part-10.h5")});
  // Plain names stay as given (and in the order given), a glob among them expands in place.
  EXPECT_EQ(expand_data_paths({dir.file("part-2.h5"), dir.file("part-1*.h5")}, "data.path"),
            (std::vector<std::string>{dir.file("part-2.h5"), dir.file("part-1.h5"),
                                      dir.file("part-10.h5")}));
  EXPECT_EQ(expand_data_paths({dir.file("missing.h5")}, "data.path"),
            std::vector<std::string>{dir.file("missing.h5")});
  expect_bad_input([&] { expand_data_paths({dir.file("nothing-*.h5")}, "data.test_path"); },
                   {"data.test_path", dir.file("nothing-*.h5"), "matches no file"});

  // Through the config: the glob's files in sorted order are the training set.
  DataSection section;
  section.source = DataSource::hdf5;
  section.path = {dir.file("part-*.h5")};
  section.test_path = {dir.file("part-1.h5")};
  auto train = open_data_source(section, Split::train, 0, 2, 3);
  auto listed = open_hdf5_source(sorted, 3);
  EXPECT_EQ(read_all(*train).inputs, read_all(*listed).inputs);
  EXPECT_EQ(open_data_source(section, Split::test, 0, 2, 3)->shape().num_samples, 20);
  section.path = {dir.file("none-*.h5")};
  expect_bad_input([&] { open_data_source(section, Split::train, 0, 2, 3); },
                   {"data.path", "none-*.h5", "matches no file"});
}

// data.x_key / data.y_key name the datasets ("inputs" means "/inputs"), in contiguous and
// chunked files; a file without them is bad input naming the dataset and the key.
TEST(Hdf5Source, DatasetNamesFromTheConfig) {
  TempDir dir;
  const Dataset d = numbered_targets(29, 3, 2);
  for (bool chunked : {false, true}) {
    H5Layout layout;
    layout.chunked = chunked;
    layout.x_name = "/inputs";
    layout.y_name = "/outputs";
    write_h5(dir.file("named.h5"), d, layout);
    DataSection section;
    section.source = DataSource::hdf5;
    section.path = {dir.file("named.h5")};
    section.x_key = "/inputs";
    section.y_key = "/outputs";
    auto source = open_data_source(section, Split::train, 0, 3, 2);
    expect_same_rows(*source, d);
    section.x_key = "/x";  // the default, absent from this file
    expect_bad_input([&] { open_data_source(section, Split::train, 0, 3, 2); },
                     {dir.file("named.h5"), "has no dataset /x", "data.x_key"});
    section.x_key = "/inputs";
    section.y_key = "/y";
    expect_bad_input([&] { open_data_source(section, Split::train, 0, 3, 2); },
                     {"has no dataset /y", "data.y_key"});
  }
}

// Class labels stored as floats read as targets of width 1: under cross_entropy with 5
// classes the error says to store them as integers (the loss is checked before the widths),
// not that 5 does not match a target width of 1.
TEST(Hdf5Source, FloatLabelsAreToldToBeIntegers) {
  TempDir dir;
  Dataset d = numbered_targets(12, 3, 1);
  H5Layout layout;
  layout.targets_1d = true;
  write_h5(dir.file("float_labels.h5"), d, layout);
  DataSection section;
  section.source = DataSource::hdf5;
  section.path = {dir.file("float_labels.h5")};
  expect_bad_input(
      [&] { open_data_source(section, Split::train, 0, 3, 5, LossKind::cross_entropy); },
      {"model.loss = \"cross_entropy\" needs class labels", "regression targets of width 1",
       "store class labels as integers"});
  expect_bad_input([&] { open_data_source(section, Split::train, 0, 3, 5); },
                   {"model.sizes[-1] = 5", "target width 1"});  // no loss given: the widths
}

// Every shard must match the first: the message names the odd shard, the first shard and
// what differs. Set-up errors are bad input.
TEST(Hdf5Source, AShardUnlikeTheFirstIsBadInput) {
  TempDir dir;
  const Dataset d = numbered_classes(20, 3, 4);
  const std::string first = dir.file("first.h5");
  write_h5(first, d);

  const std::string missing = dir.file("missing.h5");
  expect_bad_input([&] { open_hdf5_source({first, missing}, 4); }, {missing, "No such file"});

  const std::string wide = dir.file("wide.h5");
  write_h5(wide, numbered_classes(20, 4, 4));
  expect_bad_input(
      [&] {
        open_hdf5_source({first, wide}, 4);
      },
      {wide, first, "4 features per row", "width"});

  const std::string f64 = dir.file("f64.h5");
  H5Layout f64_layout;
  f64_layout.x_double = true;
  write_h5(f64, d, f64_layout);
  expect_bad_input(
      [&] {
        open_hdf5_source({first, f64}, 4);
      },
      {f64, first, "dtype of /x", "64-bit floats", "32-bit floats"});

  const std::string i64 = dir.file("i64.h5");
  H5Layout i64_layout;
  i64_layout.labels_int64 = true;
  write_h5(i64, d, i64_layout);
  expect_bad_input(
      [&] {
        open_hdf5_source({first, i64}, 4);
      },
      {i64, "dtype of /y", "64-bit integers"});

  const std::string targets = dir.file("targets.h5");
  write_h5(targets, numbered_targets(20, 3, 4));
  expect_bad_input(
      [&] {
        open_hdf5_source({first, targets}, 4);
      },
      {targets, "kind of /y", "float targets"});

  // Alone, each of them opens.
  for (const std::string& file : {wide, f64, i64, targets}) {
    EXPECT_NO_THROW(open_hdf5_source({file}, 4)) << file;
  }

  // An empty /x, and /y of another row count, name the file.
  const std::string empty = dir.file("empty.h5");
  write_h5(empty, d, {}, 0, 0);
  expect_bad_input([&] { open_hdf5_source({empty}, 4); }, {empty, "/x is empty"});
}

// A row that fails its checks is found when it is read: a runtime error naming the shard
// and the row within it. The other rows read fine.
TEST(Hdf5Source, ABadRowIsARuntimeErrorNamingFileAndRow) {
  TempDir dir;
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "contiguous");
    H5Layout layout;
    layout.chunked = chunked;
    Dataset d = numbered_classes(30, 3, 4);
    d.inputs[17 * 3 + 2] = std::numeric_limits<float>::quiet_NaN();  // shard 1, row 7
    d.labels[25] = 9;                                                // shard 2, row 5
    const auto files = write_h5_shards(dir.path(), chunked ? "bad-c" : "bad", d, 3, layout);
    auto source = open_hdf5_source(files, 4);
    testing::expect_error(
        [&] {
          read_rows(*source, {3, 17, 4});
        },
        ErrorKind::runtime, {files[1], "/x[7, 2]", "finite"});
    testing::expect_error([&] { read_rows(*source, {25}); }, ErrorKind::runtime,
                          {files[2], "/y[5] = 9", "[0, 4)"});
    const Rows fine = read_rows(*source, {3, 16, 18, 24, 26});
    EXPECT_EQ(fine.x[3], d.inputs[16 * 3]);
    EXPECT_EQ(fine.labels[4], d.labels[26]);
  }
  // Non-finite regression targets too.
  Dataset r = numbered_targets(10, 2, 2);
  r.targets[6 * 2 + 1] = std::numeric_limits<float>::infinity();
  const std::string path = dir.file("targets.h5");
  write_h5(path, r);
  auto source = open_hdf5_source({path}, 1);
  testing::expect_error([&] { read_rows(*source, {6}); }, ErrorKind::runtime,
                        {path, "/y[6, 1]", "finite"});
}

// A data file must not change during a run: reads after it grew or shrank are runtime
// errors naming it, whichever way the shard is read.
TEST(Hdf5Source, AFileThatChangedSizeIsARuntimeError) {
  TempDir dir;
  const Dataset d = numbered_classes(40, 3, 4);
  for (const bool chunked : {false, true}) {
    for (const bool grow : {false, true}) {
      SCOPED_TRACE(std::string(chunked ? "chunked" : "contiguous") + (grow ? ", grown" : ", cut"));
      H5Layout layout;
      layout.chunked = chunked;
      const auto files = write_h5_shards(dir.path(), "change", d, 2, layout);
      auto source = open_hdf5_source(files, 4);
      EXPECT_EQ(read_rows(*source, {1, 30}).x[3], d.inputs[30 * 3]);
      const auto size = std::filesystem::file_size(files[1]);
      std::filesystem::resize_file(files[1], grow ? size + 4096 : size / 2);
      // Rows of the unchanged shard still read.
      EXPECT_EQ(read_rows(*source, {2}).x[0], d.inputs[2 * 3]);
      testing::expect_error(
          [&] {
            read_rows(*source, {1, 30});
          },
          ErrorKind::runtime, {files[1], "changed size"});
    }
  }
}

// A compressed chunk that no longer inflates (a damaged file of the same size): the read
// through HDF5 is a runtime error naming the dataset and the file.
TEST(Hdf5Source, ADamagedChunkIsARuntimeErrorNamingTheFile) {
  TempDir dir;
  const Dataset d = numbered_classes(400, 16, 4);
  const std::string path = dir.file("damaged.h5");
  H5Layout layout;
  layout.chunked = true;
  layout.chunk_rows = 50;
  write_h5(path, d, layout);
  EXPECT_EQ(read_all(*open_hdf5_source({path}, 4)).inputs, d.inputs);
  {
    // /x's chunks fill most of the file, after its metadata: damage the middle.
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(std::filesystem::file_size(path));
    file.seekp(size / 2);
    const std::string garbage(256, '\x5a');
    file.write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
  }
  auto damaged = open_hdf5_source({path}, 4);
  testing::expect_error([&] { read_all(*damaged); }, ErrorKind::runtime,
                        {"reading /x of '" + path + "'", "H5Dread"});
}

// A stream holds its scratch (and chunk caches), not the data set.
TEST(Hdf5Source, HoldsScratchNotRows) {
  TempDir dir;
  const Dataset d = numbered_classes(5000, 16, 4);  // 320 KB of inputs
  const std::string path = dir.file("big.h5");
  write_h5(path, d);
  auto source = open_hdf5_source({path}, 4);
  const Rows some = read_rows(*source, {10, 4000, 77, 2500});
  EXPECT_EQ(some.x[16], d.inputs[4000 * 16]);
  EXPECT_LT(source->resident_bytes(), 4 * (16 * 4 + 8 + 8) + 1024);
  EXPECT_GT(make_memory_source(d)->resident_bytes(), 5000 * 16 * 4);
}

// This process's resident memory, from /proc/self/status (VmRSS, KiB).
int64_t resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// The chunk cache of a compressed file stays at its size (1 MiB) however many
// chunks random batches touch: with HDF5's w0 = 1.0 a chunk read in part was never evicted
// and the cache grew towards the whole uncompressed dataset (here 64 MiB).
TEST(Hdf5Source, TheChunkCacheOfACompressedFileStaysBounded) {
  TempDir dir;
  const int64_t n = 1 << 17, f = 128;  // 64 MiB of inputs, in chunks of 64 rows (32 KiB)
  Dataset d = numbered_classes(n, f, 4);
  const std::string path = dir.file("gzip.h5");
  H5Layout chunked;
  chunked.chunked = true;
  chunked.chunk_rows = 64;
  write_h5(path, d, chunked);
  d = Dataset{};  // only the file holds the rows now
  auto source = open_hdf5_source({path}, 4);
  std::mt19937_64 random(3);
  std::vector<int64_t> rows(64);
  std::vector<float> x(64 * f);
  std::vector<int32_t> labels(64);
  const auto read_batches = [&](int batches) {
    for (int b = 0; b < batches; ++b) {
      for (int64_t& r : rows) r = static_cast<int64_t>(random() % n);
      source->read(rows.data(), 64, RowBuffers{x.data(), labels.data(), nullptr});
    }
  };
  read_batches(20);  // scratch and a full cache
  const int64_t before = resident_kib();
  read_batches(300);  // about 19,000 chunks touched: every chunk of the file, many times
  const int64_t grown = resident_kib() - before;
  ASSERT_GE(before, 0) << "no VmRSS in /proc/self/status";
  EXPECT_LT(grown, 16 * 1024) << "resident memory grew by " << grown << " KiB";
}

// Descriptors this process has open.
int open_descriptors() {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++count;
  }
  return count;
}

// HDF5 identifiers open in the library (files, datasets, ...).
ssize_t open_hdf5_ids() {
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  return H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
}

// A shard that fails at set-up after good ones (another width, not HDF5, missing) leaves
// nothing open: the good shards' descriptors and HDF5 identifiers are released.
TEST(Hdf5Source, ABadLaterShardReleasesTheEarlierOnes) {
  TempDir dir;
  const Dataset d = numbered_classes(40, 3, 4);
  H5Layout chunked;
  chunked.chunked = true;
  const auto good = write_h5_shards(dir.path(), "good", d, 2);
  const auto good_chunked = write_h5_shards(dir.path(), "good-c", d, 2, chunked);
  const std::string wide = dir.file("wide.h5"), junk = dir.file("junk.h5");
  write_h5(wide, numbered_classes(20, 4, 4), chunked);
  { std::ofstream(junk) << "not an HDF5 file"; }
  const int descriptors = open_descriptors();
  const ssize_t ids = open_hdf5_ids();
  for (const std::string& bad : {wide, junk, dir.file("missing.h5")}) {
    SCOPED_TRACE(bad);
    std::vector<std::string> files = good;
    files.insert(files.end(), good_chunked.begin(), good_chunked.end());
    files.push_back(bad);
    expect_bad_input([&] { open_hdf5_source(files, 4); }, {bad});
    EXPECT_EQ(open_descriptors(), descriptors);
    EXPECT_EQ(open_hdf5_ids(), ids);
  }
}

// However many shards, at most open_shards hold a descriptor and an HDF5 file open (the
// least recently read closing first), and the rows read are the same.
TEST(Hdf5Source, OpenShardsStayWithinTheirBound) {
  TempDir dir;
  const Dataset d = numbered_classes(120, 3, 4);
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "gzip-chunked" : "contiguous");
    H5Layout layout;
    layout.chunked = chunked;
    const auto files = write_h5_shards(dir.path(), chunked ? "c" : "p", d, 12, layout);
    const int descriptors = open_descriptors();
    const ssize_t ids = open_hdf5_ids();
    Hdf5SourceOptions options;
    options.open_shards = 3;
    auto source = open_hdf5_source(files, 4, options);
    expect_same_rows(*source, d);
    // A descriptor each, and an HDF5 file (with its own descriptor) and /x, /y if chunked.
    EXPECT_LE(open_descriptors(), descriptors + (chunked ? 2 * 3 : 3));
    EXPECT_LE(open_hdf5_ids(), ids + (chunked ? 3 * 3 : 0));
    source.reset();
    EXPECT_EQ(open_descriptors(), descriptors);
    EXPECT_EQ(open_hdf5_ids(), ids);
  }
}

// The same rows as 8 gzip shards hold the memory of 1 file (issue 25: 242 MB instead of
// 84 MB): the shards a batch reads share one chunk-cache budget, and the caches of
// the others are released. Random batches, then batches of shuffled blocks.
TEST(Hdf5Source, ManyShardsHoldTheMemoryOfOneFile) {
  TempDir dir;
  const int64_t n = 1 << 17, f = 64;  // 32 MiB of inputs, chunks of 64 rows (16 KiB)
  Dataset d = numbered_classes(n, f, 4);
  H5Layout chunked;
  chunked.chunked = true;
  chunked.chunk_rows = 64;
  const auto one = write_h5_shards(dir.path(), "one", d, 1, chunked);
  const auto eight = write_h5_shards(dir.path(), "eight", d, 8, chunked);
  d = Dataset{};
  std::mt19937_64 random(11);
  std::vector<int64_t> rows(256);
  std::vector<float> x(rows.size() * f);
  std::vector<int32_t> labels(rows.size());
  // Batches of random rows, then of rows from 8 random blocks of 1024 rows.
  const auto read_batches = [&](RowSource& source, int batches, int64_t block_rows) {
    for (int b = 0; b < batches; ++b) {
      int64_t blocks[8];
      for (int64_t& block : blocks) block = static_cast<int64_t>(random() % (n / 1024));
      for (int64_t& r : rows) {
        r = block_rows > 0
                ? blocks[random() % 8] * block_rows + static_cast<int64_t>(random() % 1024)
                : static_cast<int64_t>(random() % n);
      }
      source.read(rows.data(), static_cast<int64_t>(rows.size()),
                  RowBuffers{x.data(), labels.data(), nullptr});
    }
  };
  Hdf5SourceOptions options;
  options.chunk_cache_bytes = 4 << 20;
  for (const int64_t block_rows : {int64_t{0}, int64_t{1024}}) {
    SCOPED_TRACE(block_rows > 0 ? "blocks" : "random rows");
    options.block_rows = block_rows;
    options.random_rows = block_rows == 0;
    auto single = open_hdf5_source(one, 4, options);
    read_batches(*single, 1, block_rows);
    const int64_t before_single = resident_kib();
    read_batches(*single, 80, block_rows);
    const int64_t grown_single = resident_kib() - before_single;
    const int64_t single_bytes = single->resident_bytes();
    single.reset();
    auto sharded = open_hdf5_source(eight, 4, options);
    read_batches(*sharded, 1, block_rows);  // the scratch
    const int64_t before = resident_kib();
    read_batches(*sharded, 80, block_rows);
    const int64_t grown = resident_kib() - before;
    // The counted caches: chunk_cache_bytes at most, as one file's.
    const int64_t scratch = 256 * (8 + 4 * f + 8);
    EXPECT_LE(sharded->resident_bytes(), options.chunk_cache_bytes + scratch);
    EXPECT_LE(single_bytes, options.chunk_cache_bytes + scratch);
    // Resident memory: 8 caches of 4 MiB would hold all 32 MiB, one 4 MiB.
    EXPECT_LT(grown, 16 * 1024) << "resident memory grew by " << grown << " KiB";
    std::cout << "[ measured ] " << (block_rows > 0 ? "blocks" : "random rows")
              << ": resident memory grew by " << grown_single << " KiB with 1 file, " << grown
              << " KiB with 8 shards\n";
  }
}

}  // namespace
}  // namespace meshtrain
