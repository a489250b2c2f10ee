#pragma once
// Small HDF5 data files for the data-path tests: rows of an in-memory Dataset written as
// /x [N, features] and /y (labels [N] or targets [N, width]), contiguous or gzip-chunked
// with the shuffle filter, as float32 or float64 inputs and int32 or int64 labels, in one file
// or in shards. Only one rank should write; the others wait at a barrier.

#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "framework/io/data.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain::testing {

struct H5Layout {
  bool chunked = false;       // chunked + shuffle filter + gzip; else contiguous
  hsize_t chunk_rows = 7;     // rows per chunk (a prime: chunks straddle batches)
  bool x_double = false;      // /x as float64 (read through HDF5's conversion)
  bool labels_int64 = false;  // /y as int64 (else int32)
  bool targets_1d = false;    // regression with width 1: /y [N] instead of [N, 1]
  const char* x_name = "/x";  // the datasets' names (data.x_key, data.y_key)
  const char* y_name = "/y";
};

inline void write_h5_column(hid_t file, const char* name, hid_t type,
                            const std::vector<hsize_t>& dims, const void* data,
                            const H5Layout& layout) {
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  ASSERT_GE(space, 0);
  hid_t create = H5Pcreate(H5P_DATASET_CREATE);
  ASSERT_GE(create, 0);
  if (layout.chunked) {
    std::vector<hsize_t> chunk = dims;
    chunk[0] = std::min<hsize_t>(layout.chunk_rows, dims[0]);
    ASSERT_GE(H5Pset_chunk(create, static_cast<int>(chunk.size()), chunk.data()), 0);
    ASSERT_GE(H5Pset_shuffle(create), 0);
    ASSERT_GE(H5Pset_deflate(create, 6), 0);
  }
  const hid_t dataset = H5Dcreate2(file, name, type, space, H5P_DEFAULT, create, H5P_DEFAULT);
  ASSERT_GE(dataset, 0) << "creating " << name;
  ASSERT_GE(H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0) << "writing " << name;
  H5Dclose(dataset);
  H5Pclose(create);
  H5Sclose(space);
}

// Writes rows [first, first + count) of `d` to `path` (count -1: to the end).
inline void write_h5(const std::string& path, const Dataset& d, const H5Layout& layout = {},
                     int64_t first = 0, int64_t count = -1) {
  if (count < 0) count = d.num_samples - first;
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());  // a reader thread may be running
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(file, 0) << "creating " << path;
  const hsize_t n = static_cast<hsize_t>(count);
  const hsize_t f = static_cast<hsize_t>(d.features);
  if (layout.x_double) {
    std::vector<double> x(d.inputs.begin() + first * d.features,
                          d.inputs.begin() + (first + count) * d.features);
    write_h5_column(file, layout.x_name, H5T_NATIVE_DOUBLE, {n, f}, x.data(), layout);
  } else {
    write_h5_column(file, layout.x_name, H5T_NATIVE_FLOAT, {n, f},
                    d.inputs.data() + first * d.features, layout);
  }
  if (d.classification()) {
    if (layout.labels_int64) {
      std::vector<int64_t> y(d.labels.begin() + first, d.labels.begin() + first + count);
      write_h5_column(file, layout.y_name, H5T_NATIVE_INT64, {n}, y.data(), layout);
    } else {
      write_h5_column(file, layout.y_name, H5T_NATIVE_INT32, {n}, d.labels.data() + first, layout);
    }
  } else {
    const hsize_t w = static_cast<hsize_t>(d.target_width);
    std::vector<hsize_t> dims = {n, w};
    if (layout.targets_1d) dims = {n};
    write_h5_column(file, layout.y_name, H5T_NATIVE_FLOAT, dims,
                    d.targets.data() + first * d.target_width, layout);
  }
  ASSERT_GE(H5Fclose(file), 0);
}

// Writes `d` as `shards` files dir/<stem>-<i>.h5 of nearly equal rows; returns their names.
inline std::vector<std::string> write_h5_shards(const std::string& dir, const std::string& stem,
                                                const Dataset& d, int shards,
                                                const H5Layout& layout = {}) {
  std::vector<std::string> files;
  int64_t first = 0;
  for (int i = 0; i < shards; ++i) {
    const int64_t rows = d.num_samples / shards + (i < d.num_samples % shards ? 1 : 0);
    files.push_back(dir + "/" + stem + "-" + std::to_string(i) + ".h5");
    write_h5(files.back(), d, layout, first, rows);
    first += rows;
  }
  return files;
}

}  // namespace meshtrain::testing
