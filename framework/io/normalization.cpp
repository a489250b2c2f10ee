// Reading a checkpoint's normalization statistics (framework/io/normalization.hpp).

#include "framework/io/normalization.hpp"

#include <cmath>
#include <mutex>

#include "base/error.hpp"
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
  if (shape.size() != 1) MESHTRAIN_BAD_INPUT(what, ": expected one dimension, found ", shape.size());
  Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
  if (H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != sizeof(double)) {
    MESHTRAIN_BAD_INPUT(what, ": expected float64 values");
  }
  std::vector<double> values(static_cast<size_t>(shape[0]));
  if (H5Dread(dataset, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0) {
    checkpoint_format::throw_read_failure(name, path);
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

}  // namespace meshtrain
