// Writes HDF5 classification data sets for the data-stream benchmark (bench/data_stream.sh)
// in the layout `meshtrain train` reads with data.source = "hdf5": /x float32 [N, F] and
// /y int32 [N] labels in [0, classes).
//
//   write_hdf5_dataset synthetic OUT.h5 --rows N --features F [--classes C] [--shards S]
//                      [--chunk-rows R] [--gzip LEVEL] [--shuffle-filter] [--seed K]
//   write_hdf5_dataset fashion-mnist OUT_TRAIN.h5 OUT_TEST.h5 [--dir IDX_DIR]
//                      [--chunk-rows R] [--gzip LEVEL] [--shuffle-filter]
//
// synthetic: values in [0, 1) from a counter-based hash of (seed, row, column), so a row's
// values do not depend on how the file is cut into shards or slabs; label of row i is a hash
// of i modulo C. The rows are generated and written in slabs of about 64 MiB, so a file of
// any size (tens of GB) is written in constant memory at about the disk's sequential rate.
// With --shards S > 1 the N rows are split into S files OUT-0.h5 ... OUT-(S-1).h5 (OUT
// without its .h5), in order, each with its share of the rows.
// fashion-mnist: the IDX gz files of Debian's dataset-fashion-mnist (default
// /usr/share/datasets/fashion-mnist) as float32 pixels x (1 / 255), the floats meshtrain
// makes of them in memory (so a run from either source has the same losses), and their
// int32 labels.
//
// Storage: contiguous by default (meshtrain reads it with pread); --chunk-rows R makes both
// datasets chunked (/x chunks of R rows x F, /y chunks of R rows; R defaults to 1024 when a
// filter is asked for), --gzip LEVEL adds the deflate filter and --shuffle-filter the byte
// shuffle filter before it (both read back through HDF5 hyperslabs). Contiguous datasets are
// written without a fill pass (fill time "never"), so each byte is written once.
//
// Prints one line per file written: its path, rows, bytes and seconds. Exit status 0, or 1
// with one line on stderr when an argument, a file or an HDF5 call fails.

#include <hdf5.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "write_hdf5_dataset: %s\n", message.c_str());
  std::exit(1);
}

template <class T>
T check(T status, const std::string& what) {
  if (status < 0) {
    H5Eprint2(H5E_DEFAULT, stderr);
    fail(what + " failed");
  }
  return status;
}

struct Storage {
  int64_t chunk_rows = 0;  // 0: contiguous
  int gzip = 0;            // deflate level, 0: none
  bool shuffle = false;    // byte shuffle filter
};

// splitmix64's finaliser: a good 64-bit mix of a counter.
inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// An HDF5 file with /x float [rows, features] and /y int32 [rows], written in row slabs.
class Writer {
 public:
  Writer(const std::string& path, int64_t rows, int64_t features, const Storage& storage)
      : path_(path), rows_(rows), features_(features) {
    file_ = check(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                  "creating " + path);
    x_ = create("/x", H5T_NATIVE_FLOAT, {hsize_t(rows), hsize_t(features)}, storage);
    y_ = create("/y", H5T_NATIVE_INT32, {hsize_t(rows)}, storage);
  }
  ~Writer() {
    check(H5Dclose(x_), "closing /x of " + path_);
    check(H5Dclose(y_), "closing /y of " + path_);
    check(H5Fclose(file_), "closing " + path_);
  }

  // Rows [first, first + count) from x [count, features] and y [count].
  void write(int64_t first, int64_t count, const float* x, const int32_t* y) {
    put(x_, H5T_NATIVE_FLOAT, first, count, features_, x, "/x");
    put(y_, H5T_NATIVE_INT32, first, count, 1, y, "/y");
  }

 private:
  hid_t create(const char* name, hid_t type, std::vector<hsize_t> dims, const Storage& s) {
    const hid_t space = check(H5Screate_simple(int(dims.size()), dims.data(), nullptr),
                              std::string("the dataspace of ") + name);
    const hid_t dcpl = check(H5Pcreate(H5P_DATASET_CREATE), "a dataset creation list");
    const bool chunked = s.chunk_rows > 0 || s.gzip > 0 || s.shuffle;
    if (chunked) {
      std::vector<hsize_t> chunk = dims;
      chunk[0] = hsize_t(std::min<int64_t>(s.chunk_rows > 0 ? s.chunk_rows : 1024, int64_t(dims[0])));
      check(H5Pset_chunk(dcpl, int(chunk.size()), chunk.data()), "setting the chunks");
      if (s.shuffle) check(H5Pset_shuffle(dcpl), "setting the shuffle filter");
      if (s.gzip > 0) check(H5Pset_deflate(dcpl, unsigned(s.gzip)), "setting the deflate filter");
    } else {
      check(H5Pset_layout(dcpl, H5D_CONTIGUOUS), "setting a contiguous layout");
      check(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY), "setting the allocation time");
    }
    check(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), "setting the fill time");
    const hid_t dataset = check(H5Dcreate2(file_, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                                std::string("creating ") + name + " in " + path_);
    H5Pclose(dcpl);
    H5Sclose(space);
    return dataset;
  }

  void put(hid_t dataset, hid_t type, int64_t first, int64_t count, int64_t width,
           const void* data, const char* name) {
    const std::string what = std::string("writing ") + name + " of " + path_;
    const hid_t file_space = check(H5Dget_space(dataset), what);
    const hsize_t start[2] = {hsize_t(first), 0};
    const hsize_t size[2] = {hsize_t(count), hsize_t(width)};
    check(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start, nullptr, size, nullptr), what);
    const hsize_t values = hsize_t(count * width);
    const hid_t memory_space = check(H5Screate_simple(1, &values, nullptr), what);
    check(H5Dwrite(dataset, type, memory_space, file_space, H5P_DEFAULT, data), what);
    H5Sclose(memory_space);
    H5Sclose(file_space);
  }

  std::string path_;
  int64_t rows_, features_;
  hid_t file_ = -1, x_ = -1, y_ = -1;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void report(const std::string& path, int64_t rows, double seconds) {
  struct stat st {};
  const long long bytes = ::stat(path.c_str(), &st) == 0 ? static_cast<long long>(st.st_size) : -1;
  std::printf("%s rows=%lld bytes=%lld seconds=%.1f\n", path.c_str(), static_cast<long long>(rows),
              bytes, seconds);
  std::fflush(stdout);
}

void write_synthetic(const std::string& out, int64_t rows, int64_t features, int64_t classes,
                     int64_t shards, uint64_t seed, const Storage& storage) {
  // Slabs of about 64 MiB of /x, a whole number of chunks when chunked.
  int64_t slab = std::max<int64_t>(1, (int64_t{64} << 20) / (4 * features));
  if (storage.chunk_rows > 0) slab = std::max<int64_t>(1, slab / storage.chunk_rows) * storage.chunk_rows;
  std::vector<float> x(size_t(std::min(slab, rows) * features));
  std::vector<int32_t> y(size_t(std::min(slab, rows)));
  const uint64_t key = mix(seed);
  std::string stem = out;
  if (stem.size() > 3 && stem.compare(stem.size() - 3, 3, ".h5") == 0) stem.resize(stem.size() - 3);
  int64_t row = 0;
  for (int64_t s = 0; s < shards; ++s) {
    const std::string path = shards == 1 ? out : stem + "-" + std::to_string(s) + ".h5";
    const int64_t shard_rows = rows / shards + (s < rows % shards ? 1 : 0);
    const auto start = std::chrono::steady_clock::now();
    {
      Writer writer(path, shard_rows, features, storage);
      for (int64_t first = 0; first < shard_rows; first += slab) {
        const int64_t count = std::min(slab, shard_rows - first);
        for (int64_t i = 0; i < count; ++i) {
          const uint64_t r = uint64_t(row + first + i);
          float* xr = x.data() + i * features;
          // Two 24-bit values in [0, 1) per hash.
          for (int64_t c = 0; c < features; c += 2) {
            const uint64_t h = mix(key ^ (r * uint64_t(features) + uint64_t(c)));
            xr[c] = float(h >> 40) * (1.0f / 16777216.0f);
            if (c + 1 < features) xr[c + 1] = float((h >> 8) & 0xffffff) * (1.0f / 16777216.0f);
          }
          y[size_t(i)] = int32_t(mix(key + 0x5bd1e995ull * (r + 1)) % uint64_t(classes));
        }
        writer.write(first, count, x.data(), y.data());
      }
    }
    report(path, shard_rows, seconds_since(start));
    row += shard_rows;
  }
}

// One IDX gz file, whole: the header dimensions checked against `magic`, the bytes after it.
std::vector<uint8_t> read_idx(const std::string& path, uint32_t magic, std::vector<int64_t>& dims) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) fail("cannot open " + path);
  const auto read = [&](void* buf, size_t n) {
    if (gzread(f, buf, unsigned(n)) != int(n)) fail(path + " is truncated or not gzip");
  };
  const auto be32 = [&] {
    uint8_t b[4];
    read(b, 4);
    return uint32_t(b[0]) << 24 | uint32_t(b[1]) << 16 | uint32_t(b[2]) << 8 | uint32_t(b[3]);
  };
  if (be32() != magic) fail(path + " has not the IDX magic number expected");
  dims.assign(magic & 0xff, 0);
  int64_t total = 1;
  for (int64_t& d : dims) total *= (d = be32());
  std::vector<uint8_t> bytes(static_cast<size_t>(total));
  read(bytes.data(), bytes.size());
  gzclose(f);
  return bytes;
}

void write_fashion_mnist(const std::string& dir, const std::string& train, const std::string& test,
                         const Storage& storage) {
  const struct {
    const char* prefix;
    const std::string& out;
  } splits[] = {{"train", train}, {"t10k", test}};
  for (const auto& split : splits) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<int64_t> image_dims, label_dims;
    const std::vector<uint8_t> pixels =
        read_idx(dir + "/" + split.prefix + "-images-idx3-ubyte.gz", 0x803, image_dims);
    const std::vector<uint8_t> labels =
        read_idx(dir + "/" + split.prefix + "-labels-idx1-ubyte.gz", 0x801, label_dims);
    const int64_t rows = image_dims[0], features = image_dims[1] * image_dims[2];
    if (label_dims[0] != rows) fail(std::string(split.prefix) + ": images and labels differ in count");
    std::vector<float> x(pixels.size());
    // As meshtrain scales pixels in memory (x 1/255), so both sources give the same floats.
    const float pixel_scale = 1.0f / 255.0f;
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(pixels[i]) * pixel_scale;
    std::vector<int32_t> y(labels.begin(), labels.end());
    {
      Writer writer(split.out, rows, features, storage);
      writer.write(0, rows, x.data(), y.data());
    }
    report(split.out, rows, seconds_since(start));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Writes HDF5 data sets (/x float32 [N, F], /y int32 [N]) for bench/data_stream.sh"};
  app.require_subcommand(1);
  Storage storage;
  const auto add_storage = [&](CLI::App* sub) {
    sub->add_option("--chunk-rows", storage.chunk_rows, "rows per chunk (0: contiguous)")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--gzip", storage.gzip, "deflate level 1-9 (0: none)")->check(CLI::Range(0, 9));
    sub->add_flag("--shuffle-filter", storage.shuffle, "byte shuffle filter before deflate");
  };

  std::string out, out_test, dir = "/usr/share/datasets/fashion-mnist";
  int64_t rows = 0, features = 0, classes = 10, shards = 1;
  uint64_t seed = 0;
  CLI::App* synthetic = app.add_subcommand("synthetic", "hash-generated rows, written in slabs");
  synthetic->add_option("out", out, "output file (with --shards: OUT-i.h5)")->required();
  synthetic->add_option("--rows", rows, "N, rows in all")->required()->check(CLI::PositiveNumber);
  synthetic->add_option("--features", features, "F, floats per row")->required()->check(CLI::PositiveNumber);
  synthetic->add_option("--classes", classes, "labels are in [0, C)")->check(CLI::PositiveNumber);
  synthetic->add_option("--shards", shards, "files to split the rows into")->check(CLI::PositiveNumber);
  synthetic->add_option("--seed", seed, "hash key");
  add_storage(synthetic);
  CLI::App* fmnist = app.add_subcommand("fashion-mnist", "Fashion-MNIST (IDX gz) as pixels / 255");
  fmnist->add_option("train", out, "output file of the 60000 training rows")->required();
  fmnist->add_option("test", out_test, "output file of the 10000 test rows")->required();
  fmnist->add_option("--dir", dir, "directory of the IDX gz files");
  add_storage(fmnist);
  CLI11_PARSE(app, argc, argv);

  if (synthetic->parsed()) {
    if (shards > rows) fail("--shards is larger than --rows");
    write_synthetic(out, rows, features, classes, shards, seed, storage);
  } else {
    write_fashion_mnist(dir, out, out_test, storage);
  }
  return 0;
}
