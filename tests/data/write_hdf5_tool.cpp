// Writes a small classification data file for the `meshtrain train` data tests: /x [N,
// FEATURES] (values in [0, 1)) and /y [N] labels i % CLASSES, with options that make it
// unlike the other shards or bad in one row.
//
//   data_write_hdf5 OUT.h5 N FEATURES CLASSES [--x-float64] [--labels-int64] [--chunked]
//                   [--nan ROW COL] [--label ROW VALUE]
//
// Exit status 0, or 1 with one line on stderr when an argument or an HDF5 call fails.

#include <hdf5.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "data_write_hdf5: %s\n", message.c_str());
  std::exit(1);
}

long long parse(const char* text, const char* what, long long min) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < min) {
    fail(std::string(what) + " '" + text + "' is not an integer >= " + std::to_string(min));
  }
  return value;
}

template <class T>
T check(T status, const std::string& what) {
  if (status < 0) {
    H5Eprint2(H5E_DEFAULT, stderr);
    fail(what + " failed");
  }
  return status;
}

void write(hid_t file, const char* name, hid_t type, const std::vector<hsize_t>& dims,
           const void* data, bool chunked) {
  const hid_t space = check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                            std::string("creating the dataspace of ") + name);
  const hid_t create = check(H5Pcreate(H5P_DATASET_CREATE), "creating a property list");
  if (chunked) {
    std::vector<hsize_t> chunk = dims;
    chunk[0] = std::min<hsize_t>(dims[0], 5);
    check(H5Pset_chunk(create, static_cast<int>(chunk.size()), chunk.data()), "H5Pset_chunk");
    check(H5Pset_shuffle(create), "H5Pset_shuffle");
    check(H5Pset_deflate(create, 4), "H5Pset_deflate");
  }
  const hid_t dataset = check(H5Dcreate2(file, name, type, space, H5P_DEFAULT, create, H5P_DEFAULT),
                              std::string("creating ") + name);
  check(H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data),
        std::string("writing ") + name);
  check(H5Dclose(dataset), std::string("closing ") + name);
  check(H5Pclose(create), "closing a property list");
  check(H5Sclose(space), std::string("closing the dataspace of ") + name);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    fail(
        "usage: data_write_hdf5 OUT.h5 N FEATURES CLASSES [--x-float64] [--labels-int64] "
        "[--chunked] [--nan ROW COL] [--label ROW VALUE]");
  }
  const std::string path = argv[1];
  const long long n = parse(argv[2], "N", 1);
  const long long features = parse(argv[3], "FEATURES", 1);
  const long long classes = parse(argv[4], "CLASSES", 1);
  if (n > (1 << 20) || features > (1 << 16)) fail("N or FEATURES is too large for a test file");

  std::vector<double> x(static_cast<size_t>(n * features));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<double>((i * 2654435761u) % 1000) / 1000;
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (long long i = 0; i < n; ++i) y[static_cast<size_t>(i)] = i % classes;
  bool x_float64 = false, labels_int64 = false, chunked = false;
  for (int a = 5; a < argc; ++a) {
    const std::string option = argv[a];
    if (option == "--x-float64") {
      x_float64 = true;
    } else if (option == "--labels-int64") {
      labels_int64 = true;
    } else if (option == "--chunked") {
      chunked = true;
    } else if (option == "--nan" && a + 2 < argc) {
      const long long row = parse(argv[a + 1], "ROW", 0), col = parse(argv[a + 2], "COL", 0);
      if (row >= n || col >= features) fail("--nan " + std::to_string(row) + " is outside /x");
      x[static_cast<size_t>(row * features + col)] = std::numeric_limits<double>::quiet_NaN();
      a += 2;
    } else if (option == "--label" && a + 2 < argc) {
      const long long row = parse(argv[a + 1], "ROW", 0);
      if (row >= n) fail("--label " + std::to_string(row) + " is not below N");
      y[static_cast<size_t>(row)] = parse(argv[a + 2], "VALUE", INT32_MIN);
      a += 2;
    } else {
      fail("unknown or incomplete option '" + option + "'");
    }
  }

  const hid_t file =
      check(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), "creating " + path);
  const std::vector<hsize_t> x_dims = {static_cast<hsize_t>(n), static_cast<hsize_t>(features)};
  if (x_float64) {
    write(file, "/x", H5T_NATIVE_DOUBLE, x_dims, x.data(), chunked);
  } else {
    std::vector<float> xf(x.begin(), x.end());
    write(file, "/x", H5T_NATIVE_FLOAT, x_dims, xf.data(), chunked);
  }
  if (labels_int64) {
    write(file, "/y", H5T_NATIVE_INT64, {static_cast<hsize_t>(n)}, y.data(), chunked);
  } else {
    std::vector<int32_t> y32(y.begin(), y.end());
    write(file, "/y", H5T_NATIVE_INT32, {static_cast<hsize_t>(n)}, y32.data(), chunked);
  }
  check(H5Fclose(file), "closing " + path);
  return 0;
}
