// Reading checkpoints without MPI (the inspect command): listing and full verification.

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/error.hpp"
#include "framework/core/precision.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/checkpoint_checksums.hpp"
#include "framework/io/checkpoint_format.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain {

using hdf5::Handle;
using namespace checkpoint_format;

namespace {

std::string dtype_name(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  const size_t bits = H5Tget_size(type) * 8;
  switch (cls) {
    case H5T_FLOAT:
      return "float" + std::to_string(bits);
    case H5T_INTEGER:
      return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(bits);
    case H5T_STRING:
      return "string";
    default:
      return "other";
  }
}

// "crc32" when the dataset has the attribute, "fletcher32" when its filter is set, else "".
std::string checksum_kind(hid_t dataset, const std::string& what) {
  const ErrorKind bad = ErrorKind::bad_input;
  if (hdf5::has_attribute(dataset, kChecksumAttribute, bad, what)) return kChecksumAttribute;
  Handle dcpl = hdf5::make(H5Dget_create_plist(dataset), H5Pclose, bad, what);
  const int filters = H5Pget_nfilters(dcpl);
  if (filters < 0) hdf5::check(-1, bad, what);
  for (int i = 0; i < filters; ++i) {
    unsigned flags = 0;
    size_t n_values = 0;
    unsigned config = 0;
    const H5Z_filter_t id = H5Pget_filter2(dcpl, static_cast<unsigned>(i), &flags, &n_values,
                                           nullptr, 0, nullptr, &config);
    if (id < 0) hdf5::check(-1, bad, what);
    if (id == H5Z_FILTER_FLETCHER32) return "fletcher32";
  }
  return "";
}

std::vector<std::string> dataset_names(hid_t file, const std::string& where) {
  std::vector<std::string> names;
  collect_datasets(file, "/", "/", names, where);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

CheckpointListing list_checkpoint(const std::string& path) {
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  Handle file = open_serial(path);
  CheckpointListing listing;
  listing.info = read_metadata(file, path);
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  for (const auto& name : dataset_names(file, where)) {
    const std::string what = "cannot describe dataset '" + name + "' in " + where;
    Handle dataset = hdf5::make(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose, bad, what);
    DatasetListing d;
    d.path = name;
    d.shape = logical_shape(dataset, what);
    Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
    d.dtype = dtype_name(type);
    if (hdf5::has_attribute(dataset, "spec", bad, what))
      d.spec = hdf5::read_string_attribute(dataset, "spec", bad, what);
    Handle dcpl = hdf5::make(H5Dget_create_plist(dataset), H5Pclose, bad, what);
    if (H5Pget_layout(dcpl) == H5D_CHUNKED) {
      const int rank = H5Pget_chunk(dcpl, 0, nullptr);
      if (rank < 0) hdf5::check(-1, bad, what);
      std::vector<hsize_t> chunk(static_cast<size_t>(rank));
      if (H5Pget_chunk(dcpl, rank, chunk.data()) < 0) hdf5::check(-1, bad, what);
      d.chunk.assign(chunk.begin(), chunk.end());
    }
    d.checksum = checksum_kind(dataset, what);
    listing.datasets.push_back(std::move(d));
  }
  return listing;
}

namespace {

// Reads dataset `name` whole, as stored (the file's own type, so the bytes are those the
// CRC-32 covers), into `buffer`, and checks its checksum: the current format checks each
// dataset's CRC-32 (a missing one is refused, as load_checkpoint refuses it); format 1
// relies on HDF5's Fletcher-32 filter on read. Returns the dataset (open).
Handle read_checked(hid_t file, const std::string& name, const std::string& path, bool crc_format,
                    std::vector<char>& buffer) {
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  const std::string what = "cannot read dataset '" + name + "' in " + where;
  Handle dataset = hdf5::make(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose, bad, what);
  Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
  Handle space = hdf5::make(H5Dget_space(dataset), H5Sclose, bad, what);
  const hssize_t points = H5Sget_simple_extent_npoints(space);
  if (points < 0) hdf5::check(-1, bad, what);
  const size_t size = H5Tget_size(type);
  if (size == 0) hdf5::check(-1, bad, what);
  buffer.resize(static_cast<size_t>(points) * size);
  if (points > 0 && H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buffer.data()) < 0) {
    throw_read_failure(name, path);
  }
  const bool has_checksum = hdf5::has_attribute(dataset, kChecksumAttribute, bad, what);
  if (crc_format && !has_checksum) {
    MESHTRAIN_BAD_INPUT("dataset '", name, "' in ", where, " has no '", kChecksumAttribute,
                        "' attribute");
  }
  if (has_checksum) {
    const uint32_t stored =
        static_cast<uint32_t>(hdf5::read_uint_attribute(dataset, kChecksumAttribute, bad, what));
    const uint32_t computed = crc32_update(0, buffer.data(), buffer.size());
    if (computed != stored) {
      MESHTRAIN_BAD_INPUT("dataset '", name, "' in checkpoint '", path,
                          "' is corrupt: the CRC-32 of its bytes is ", computed,
                          " but the file records ", stored);
    }
  }
  return dataset;
}

}  // namespace

int64_t verify_checkpoint(const std::string& path) {
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  Handle file = open_serial(path);
  const std::vector<std::string> names = dataset_names(file, "checkpoint '" + path + "'");
  const bool crc_format = read_format(file, path) == kFormat;
  std::vector<char> buffer;
  for (const auto& name : names) read_checked(file, name, path, crc_format, buffer);
  return static_cast<int64_t>(names.size());
}

std::vector<CheckpointArray> read_checkpoint_arrays(const std::string& path,
                                                    const std::string& group) {
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  Handle file = open_serial(path);
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  read_metadata(file, path);  // refuses a file that is not a meshtrain checkpoint
  if (!hdf5::path_exists(file, group, bad, where)) {
    MESHTRAIN_BAD_INPUT(where, " has no group '", group, "'");
  }
  std::vector<std::string> names;
  collect_datasets(file, group, "", names, where);
  std::sort(names.begin(), names.end());
  const bool crc_format = read_format(file, path) == kFormat;
  std::vector<CheckpointArray> arrays;
  std::vector<char> buffer;
  for (const auto& name : names) {
    const std::string full = group + "/" + name;
    const std::string what = "cannot read dataset '" + full + "' in " + where;
    Handle dataset = read_checked(file, full, path, crc_format, buffer);
    Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
    CheckpointArray array;
    array.name = name;
    array.shape = logical_shape(dataset, what);
    // A bf16 tensor (uint16 bits with dtype = "bf16", checkpoint_format.hpp): its values
    // widened to float32 (exact); a big-endian or signed 16-bit dataset is refused below.
    if (stored_as_bf16(dataset, type, what)) {
      array.values.resize(buffer.size() / sizeof(uint16_t));
      for (size_t i = 0; i < array.values.size(); ++i) {
        uint16_t bits = 0;
        std::memcpy(&bits, buffer.data() + i * sizeof(uint16_t), sizeof bits);
        array.values[i] = bf16_to_float(bits);
      }
      arrays.push_back(std::move(array));
      continue;
    }
    if (H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != sizeof(float) ||
        H5Tget_order(type) != H5T_ORDER_LE) {
      MESHTRAIN_BAD_INPUT("dataset '", full, "' in ", where, " is ", dtype_name(type),
                          ", not little-endian float32 (nor bf16)");
    }
    array.values.resize(buffer.size() / sizeof(float));
    std::memcpy(array.values.data(), buffer.data(), buffer.size());
    arrays.push_back(std::move(array));
  }
  return arrays;
}

}  // namespace meshtrain
