// A user dataset in HDF5: /x float [N, features], /y integer [N] labels or float
// [N, outputs] (or [N]) regression targets.
//
// Every rank opens and reads the whole file with the default file access property list
// (the sec2 driver, no MPI-IO): datasets that fit in memory are small next to the
// training run, and independent reads avoid making loading a collective operation.

#include <hdf5.h>
#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "framework/io/data.hpp"
#include "partition/error.hpp"

namespace meshtrain {

namespace {

// Silences HDF5's automatic error printing while alive (we report the stack ourselves)
// and restores the previous handler after.
class QuietHdf5Errors {
 public:
  QuietHdf5Errors() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5Errors() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  QuietHdf5Errors(const QuietHdf5Errors&) = delete;
  QuietHdf5Errors& operator=(const QuietHdf5Errors&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

herr_t append_error(unsigned n, const H5E_error2_t* err, void* out) {
  auto& text = *static_cast<std::string*>(out);
  if (n > 0) text += "; ";
  text += err->func_name ? err->func_name : "?";
  text += ": ";
  text += err->desc ? err->desc : "";
  char minor[128] = {0};
  if (H5Eget_msg(err->min_num, nullptr, minor, sizeof minor) > 0) {
    text += " (";
    text += minor;
    text += ")";
  }
  return 0;
}

// HDF5's error stack of this thread, innermost call first, then cleared.
std::string hdf5_error_stack() {
  std::string text;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, append_error, &text);
  H5Eclear2(H5E_DEFAULT);
  return text.empty() ? "no HDF5 error message" : text;
}

// Closes an HDF5 identifier with its close function when it goes out of scope.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// Throws bad_input naming the file and the failed step, with HDF5's stack, when status < 0.
template <class T>
T check(T status, const std::string& path, const std::string& what) {
  if (status < 0) {
    MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': ", what, " failed: ", hdf5_error_stack());
  }
  return status;
}

struct DatasetInfo {
  std::vector<hsize_t> dims;
  H5T_class_t type_class = H5T_NO_CLASS;
};

DatasetInfo describe(hid_t dataset, const std::string& path, const std::string& name) {
  DatasetInfo info;
  Handle space(check(H5Dget_space(dataset), path, "getting the dataspace of " + name), H5Sclose);
  const int rank =
      check(H5Sget_simple_extent_ndims(space.get()), path, "getting the rank of " + name);
  info.dims.resize(static_cast<size_t>(rank));
  check(H5Sget_simple_extent_dims(space.get(), info.dims.data(), nullptr), path,
        "getting the shape of " + name);
  Handle type(check(H5Dget_type(dataset), path, "getting the type of " + name), H5Tclose);
  info.type_class = H5Tget_class(type.get());
  check(static_cast<int>(info.type_class), path, "getting the type class of " + name);
  return info;
}

std::string shape_text(const std::vector<hsize_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

hid_t open_dataset(hid_t file, const std::string& path, const char* name, const char* expected) {
  const htri_t exists =
      check(H5Lexists(file, name, H5P_DEFAULT), path, std::string("looking up ") + name);
  if (exists == 0) {
    MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "' has no dataset ", name, " (expected ",
                        expected, ")");
  }
  return check(H5Dopen2(file, name, H5P_DEFAULT), path, std::string("opening ") + name);
}

}  // namespace

Dataset load_hdf5_dataset(const std::string& path, int64_t num_classes) {
  MESHTRAIN_REQUIRE(num_classes > 0, "load_hdf5_dataset: num_classes must be positive");
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    MESHTRAIN_BAD_INPUT("cannot read the HDF5 dataset file '", path, "': ", std::strerror(errno));
  }
  QuietHdf5Errors quiet;
  Handle file(check(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), path, "opening the file"),
              H5Fclose);

  Dataset d;
  d.description = "HDF5 dataset '" + path + "'";

  // /x: float [N, features]
  Handle x(open_dataset(file.get(), path, "/x", "float inputs [N, features]"), H5Dclose);
  const DatasetInfo xi = describe(x.get(), path, "/x");
  if (xi.dims.size() != 2 || xi.type_class != H5T_FLOAT) {
    MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path,
                        "': /x must be a float dataset [N, features], "
                        "got ",
                        xi.type_class == H5T_FLOAT ? "float " : "non-float ", shape_text(xi.dims));
  }
  if (xi.dims[0] == 0 || xi.dims[1] == 0) {
    MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': /x is empty ", shape_text(xi.dims));
  }
  d.num_samples = static_cast<int64_t>(xi.dims[0]);
  d.features = static_cast<int64_t>(xi.dims[1]);

  // /y: integer [N] labels, or float [N, outputs] / [N] targets
  Handle y(open_dataset(file.get(), path, "/y",
                        "integer class labels [N] or float targets [N, outputs]"),
           H5Dclose);
  const DatasetInfo yi = describe(y.get(), path, "/y");
  const bool labels = yi.type_class == H5T_INTEGER && yi.dims.size() == 1;
  const bool targets = yi.type_class == H5T_FLOAT && (yi.dims.size() == 1 || yi.dims.size() == 2);
  if (!labels && !targets) {
    MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path,
                        "': /y must be integer class labels [N] or "
                        "float targets [N, outputs], got ",
                        yi.type_class == H5T_INTEGER ? "integer "
                        : yi.type_class == H5T_FLOAT ? "float "
                                                     : "non-numeric ",
                        shape_text(yi.dims));
  }
  if (yi.dims[0] != xi.dims[0]) {
    MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': /x has ", xi.dims[0],
                        " samples but /y has ", yi.dims[0]);
  }

  d.inputs.resize(static_cast<size_t>(d.num_samples * d.features));
  check(H5Dread(x.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, d.inputs.data()), path,
        "reading /x");
  for (int64_t i = 0; i < d.num_samples; ++i) {
    for (int64_t f = 0; f < d.features; ++f) {
      const float v = d.inputs[i * d.features + f];
      if (!std::isfinite(v)) {
        MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': /x[", i, ", ", f, "] is ", v,
                            "; inputs must be finite");
      }
    }
  }

  if (labels) {
    d.num_classes = num_classes;
    std::vector<int64_t> raw(static_cast<size_t>(d.num_samples));
    check(H5Dread(y.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.data()), path,
          "reading /y");
    d.labels.resize(raw.size());
    for (int64_t i = 0; i < d.num_samples; ++i) {
      if (raw[i] < 0 || raw[i] >= num_classes) {
        MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': label /y[", i, "] = ", raw[i],
                            " is outside [0, ", num_classes, ") (model.sizes[-1] = ", num_classes,
                            " classes)");
      }
      d.labels[i] = static_cast<int32_t>(raw[i]);
    }
  } else {
    d.target_width = yi.dims.size() == 2 ? static_cast<int64_t>(yi.dims[1]) : 1;
    if (d.target_width == 0) {
      MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': /y is empty ", shape_text(yi.dims));
    }
    d.targets.resize(static_cast<size_t>(d.num_samples * d.target_width));
    check(H5Dread(y.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, d.targets.data()), path,
          "reading /y");
    for (size_t i = 0; i < d.targets.size(); ++i) {
      if (!std::isfinite(d.targets[i])) {
        MESHTRAIN_BAD_INPUT("HDF5 dataset file '", path, "': /y[", i / d.target_width, ", ",
                            i % d.target_width, "] is ", d.targets[i], "; targets must be finite");
      }
    }
  }
  return d;
}

}  // namespace meshtrain
