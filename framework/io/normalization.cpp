// Reading a checkpoint's normalization statistics (framework/io/normalization.hpp).

#include "framework/io/normalization.hpp"

#include <cmath>
#include <mutex>

#include "base/error.hpp"
#include "framework/io/checkpoint_checksums.hpp"
#include "framework/io/checkpoint_format.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain {
namespace {

using hdf5::Handle;

// The float64 vector at `name`, or empty when the file has no such dataset.
std::vector<double> read_optional_vector(hid_t file, const std::string& name,
                                         const std::string& path) {
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string what = "cannot read '" + name + "' in checkpoint '" + path + "'";
  if (!hdf5::path_exists(file, name, bad, what)) return {};
  Handle dataset = hdf5::make(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose, bad, what);
  const std::vector<int64_t> shape = hdf5::dataset_shape(dataset, bad, what);
  if (shape.size() != 1)
    MESHTRAIN_BAD_INPUT(what, ": expected one dimension, found ", shape.size());
  Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
  if (H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != sizeof(double)) {
    MESHTRAIN_BAD_INPUT(what, ": expected float64 values");
  }
  std::vector<double> values(static_cast<size_t>(shape[0]));
  if (H5Dread(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0) {
    checkpoint_format::throw_read_failure(name, path);
  }
  // The CRC-32 of the little-endian bytes, as the tensors' (checkpoint_format.hpp).
  if (hdf5::has_attribute(dataset, checkpoint_format::kChecksumAttribute, bad, what)) {
    const uint32_t stored = static_cast<uint32_t>(
        hdf5::read_uint_attribute(dataset, checkpoint_format::kChecksumAttribute, bad, what));
    const uint32_t computed =
        checkpoint_format::crc32_update(0, values.data(), values.size() * sizeof(double));
    if (computed != stored) {
      MESHTRAIN_BAD_INPUT("dataset '", name, "' in checkpoint '", path,
                          "' is corrupt: the CRC-32 of its bytes is ", computed,
                          " but the file records ", stored);
    }
  }
  return values;
}

void check_pair(const std::vector<double>& mean, const std::vector<double>& std_dev,
                const std::string& side, const std::string& path) {
  const std::string where = "checkpoint '" + path + "': /normalization/" + side;
  if (mean.size() != std_dev.size()) {
    MESHTRAIN_BAD_INPUT(where, "_mean has ", mean.size(), " values but ", side, "_std has ",
                        std_dev.size());
  }
  for (size_t i = 0; i < std_dev.size(); ++i) {
    if (!(std::isfinite(std_dev[i]) && std_dev[i] > 0.0) || !std::isfinite(mean[i])) {
      MESHTRAIN_BAD_INPUT(where, " of feature ", i, " is not usable (mean ", mean[i], ", std ",
                          std_dev[i], ")");
    }
  }
}

}  // namespace

Normalization read_normalization(const std::string& checkpoint_file) {
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  hdf5::silence_errors();
  Handle file = checkpoint_format::open_serial(checkpoint_file);
  const std::string group = normalization_group();
  Normalization n;
  n.input_mean = read_optional_vector(file, group + "/input_mean", checkpoint_file);
  n.input_std = read_optional_vector(file, group + "/input_std", checkpoint_file);
  n.target_mean = read_optional_vector(file, group + "/target_mean", checkpoint_file);
  n.target_std = read_optional_vector(file, group + "/target_std", checkpoint_file);
  check_pair(n.input_mean, n.input_std, "input", checkpoint_file);
  check_pair(n.target_mean, n.target_std, "target", checkpoint_file);
  return n;
}

void standardize_rows(float* values, int64_t rows, int64_t width, const std::vector<double>& mean,
                      const std::vector<double>& std_dev) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = values + r * width;
    for (int64_t c = 0; c < width; ++c) {
      row[c] = static_cast<float>((static_cast<double>(row[c]) - mean[c]) / std_dev[c]);
    }
  }
}

namespace checkpoint_format {

void write_normalization(hid_t file, const Normalization& n, const std::string& path) {
  if (!n.inputs() && !n.targets()) return;
  const ErrorKind fail = ErrorKind::runtime;
  const std::string group_name = normalization_group();
  const std::string where = "checkpoint file '" + path + "'";
  hdf5::Handle group =
      hdf5::make(H5Gcreate2(file, group_name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                 H5Gclose, fail, "cannot create '" + group_name + "' in " + where);
  const auto write = [&](const char* name, const std::vector<double>& values) {
    if (values.empty()) return;
    const std::string what = "cannot write '" + group_name + "/" + name + "' in " + where;
    const hsize_t dims[1] = {values.size()};
    hdf5::Handle space = hdf5::make(H5Screate_simple(1, dims, nullptr), H5Sclose, fail, what);
    hdf5::Handle dataset = hdf5::make(
        H5Dcreate2(group, name, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
        H5Dclose, fail, what);
    hdf5::check(H5Dwrite(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()),
                fail, what);
    hdf5::write_attribute(
        dataset, kChecksumAttribute,
        static_cast<uint64_t>(crc32_update(0, values.data(), values.size() * sizeof(double))));
    dataset.close(what);
  };
  write("input_mean", n.input_mean);
  write("input_std", n.input_std);
  write("target_mean", n.target_mean);
  write("target_std", n.target_std);
  group.close("cannot close '" + group_name + "' in " + where);
}

}  // namespace checkpoint_format
}  // namespace meshtrain
