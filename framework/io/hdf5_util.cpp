#include "framework/io/hdf5_util.hpp"

#include <sstream>

namespace meshtrain::hdf5 {

namespace {

[[noreturn]] void throw_error(ErrorKind kind, const std::string& message) {
  throw Error(kind, message, __FILE__, __LINE__);
}

herr_t collect_entry(unsigned /*n*/, const H5E_error2_t* err, void* data) {
  auto* lines = static_cast<std::vector<std::string>*>(data);
  std::string line;
  if (err->func_name != nullptr) line += std::string(err->func_name) + "(): ";
  if (err->desc != nullptr && err->desc[0] != '\0') {
    line += err->desc;
  } else {
    char minor[256] = {0};
    H5E_type_t type;
    if (H5Eget_msg(err->min_num, &type, minor, sizeof minor) > 0) line += minor;
  }
  lines->push_back(line);
  return 0;
}

}  // namespace

std::mutex& global_mutex() {
  static std::mutex mutex;
  return mutex;
}

void silence_errors() {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

std::string take_error_text() {
  std::vector<std::string> lines;
  // Downward: the API call that failed first, then its internal causes.
  if (H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_entry, &lines) < 0) {
    lines.assign(1, "(HDF5 error stack could not be read)");
  }
  H5Eclear2(H5E_DEFAULT);
  std::string text;
  for (const auto& line : lines) {
    if (!text.empty()) text += "; ";
    text += line;
  }
  return text;
}

Handle& Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    reset();
    id_ = o.id_;
    closer_ = o.closer_;
    o.id_ = H5I_INVALID_HID;
  }
  return *this;
}

void Handle::close(const std::string& what) {
  if (id_ < 0) return;
  const hid_t id = id_;
  id_ = H5I_INVALID_HID;
  check(closer_(id), ErrorKind::runtime, what);
}

void Handle::reset() {
  if (id_ >= 0 && closer_ != nullptr) {
    closer_(id_);
    H5Eclear2(H5E_DEFAULT);
  }
  id_ = H5I_INVALID_HID;
}

void check(herr_t status, ErrorKind kind, const std::string& what) {
  if (status >= 0) return;
  const std::string text = take_error_text();
  throw_error(kind, text.empty() ? what : what + ": " + text);
}

hid_t check_id(hid_t id, ErrorKind kind, const std::string& what) {
  if (id < 0) check(-1, kind, what);
  return id;
}

Handle make(hid_t id, Handle::Closer closer, ErrorKind kind, const std::string& what) {
  return Handle(check_id(id, kind, what), closer);
}

namespace {

void write_raw_attribute(hid_t object, const std::string& name, hid_t file_type, hid_t mem_type,
                         hid_t space, const void* data) {
  const std::string what = "cannot write HDF5 attribute '" + name + "'";
  Handle attr = make(H5Acreate2(object, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT),
                     H5Aclose, ErrorKind::runtime, what);
  check(H5Awrite(attr, mem_type, data), ErrorKind::runtime, what);
  attr.close(what);
}

Handle open_attribute(hid_t object, const std::string& name, ErrorKind kind,
                      const std::string& where) {
  if (!has_attribute(object, name, kind, where)) {
    throw_error(kind, where + " has no attribute '" + name + "'");
  }
  return make(H5Aopen(object, name.c_str(), H5P_DEFAULT), H5Aclose, kind,
              "cannot open attribute '" + name + "' of " + where);
}

H5T_class_t attribute_class(hid_t attr, ErrorKind kind, const std::string& what) {
  Handle type = make(H5Aget_type(attr), H5Tclose, kind, what);
  const H5T_class_t cls = H5Tget_class(type);
  if (cls == H5T_NO_CLASS) check(-1, kind, what);
  return cls;
}

int64_t attribute_elements(hid_t attr, ErrorKind kind, const std::string& what) {
  Handle space = make(H5Aget_space(attr), H5Sclose, kind, what);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  if (n < 0) check(-1, kind, what);
  return static_cast<int64_t>(n);
}

}  // namespace

void write_attribute(hid_t object, const std::string& name, const std::string& value) {
  const std::string what = "cannot write HDF5 attribute '" + name + "'";
  Handle type = make(H5Tcopy(H5T_C_S1), H5Tclose, ErrorKind::runtime, what);
  // Fixed-length, NUL-terminated: readable by h5dump and h5py alike (size >= 1).
  check(H5Tset_size(type, value.size() + 1), ErrorKind::runtime, what);
  check(H5Tset_strpad(type, H5T_STR_NULLTERM), ErrorKind::runtime, what);
  check(H5Tset_cset(type, H5T_CSET_UTF8), ErrorKind::runtime, what);
  Handle space = make(H5Screate(H5S_SCALAR), H5Sclose, ErrorKind::runtime, what);
  write_raw_attribute(object, name, type, type, space, value.c_str());
}

void write_attribute(hid_t object, const std::string& name, int64_t value) {
  Handle space = make(H5Screate(H5S_SCALAR), H5Sclose, ErrorKind::runtime, "H5Screate");
  write_raw_attribute(object, name, H5T_STD_I64LE, H5T_NATIVE_INT64, space, &value);
}

void write_attribute(hid_t object, const std::string& name, uint64_t value) {
  Handle space = make(H5Screate(H5S_SCALAR), H5Sclose, ErrorKind::runtime, "H5Screate");
  write_raw_attribute(object, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, space, &value);
}

void write_attribute(hid_t object, const std::string& name, double value) {
  Handle space = make(H5Screate(H5S_SCALAR), H5Sclose, ErrorKind::runtime, "H5Screate");
  write_raw_attribute(object, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, space, &value);
}

void write_attribute(hid_t object, const std::string& name, const std::vector<int64_t>& values) {
  const hsize_t n = values.size();
  Handle space = make(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr), H5Sclose,
                      ErrorKind::runtime, "H5Screate_simple");
  const int64_t none = 0;  // H5Awrite wants a buffer even for an empty (null) dataspace
  write_raw_attribute(object, name, H5T_STD_I64LE, H5T_NATIVE_INT64, space,
                      n == 0 ? &none : values.data());
}

bool has_attribute(hid_t object, const std::string& name, ErrorKind kind,
                   const std::string& where) {
  const htri_t exists = H5Aexists(object, name.c_str());
  if (exists < 0) check(-1, kind, "cannot look up attribute '" + name + "' of " + where);
  return exists > 0;
}

std::string read_string_attribute(hid_t object, const std::string& name, ErrorKind kind,
                                  const std::string& where) {
  const std::string what = "cannot read attribute '" + name + "' of " + where;
  Handle attr = open_attribute(object, name, kind, where);
  Handle type = make(H5Aget_type(attr), H5Tclose, kind, what);
  if (H5Tget_class(type) != H5T_STRING || attribute_elements(attr, kind, what) != 1) {
    throw_error(kind, "attribute '" + name + "' of " + where + " is not a string");
  }
  const htri_t variable = H5Tis_variable_str(type);
  if (variable < 0) check(-1, kind, what);
  if (variable > 0) {
    Handle mem = make(H5Tcopy(H5T_C_S1), H5Tclose, kind, what);
    check(H5Tset_size(mem, H5T_VARIABLE), kind, what);
    char* text = nullptr;
    check(H5Aread(attr, mem, &text), kind, what);
    std::string value = text != nullptr ? text : "";
    H5free_memory(text);
    return value;
  }
  const size_t size = H5Tget_size(type);
  if (size == 0) check(-1, kind, what);
  std::string buffer(size, '\0');
  check(H5Aread(attr, type, buffer.data()), kind, what);
  const size_t end = buffer.find('\0');
  if (end != std::string::npos) buffer.resize(end);
  return buffer;
}

namespace {

// One integer attribute read as `memory_type` (H5T_NATIVE_INT64 or H5T_NATIVE_UINT64, which
// are run-time handles and so cannot be template arguments); HDF5 converts the stored type.
template <class Integer>
Integer read_integer_attribute(hid_t object, const std::string& name, hid_t memory_type,
                               ErrorKind kind, const std::string& where) {
  const std::string what = "cannot read attribute '" + name + "' of " + where;
  Handle attr = open_attribute(object, name, kind, where);
  if (attribute_class(attr, kind, what) != H5T_INTEGER ||
      attribute_elements(attr, kind, what) != 1) {
    throw_error(kind, "attribute '" + name + "' of " + where + " is not an integer");
  }
  Integer value = 0;
  check(H5Aread(attr, memory_type, &value), kind, what);
  return value;
}

}  // namespace

int64_t read_int_attribute(hid_t object, const std::string& name, ErrorKind kind,
                           const std::string& where) {
  return read_integer_attribute<int64_t>(object, name, H5T_NATIVE_INT64, kind, where);
}

uint64_t read_uint_attribute(hid_t object, const std::string& name, ErrorKind kind,
                             const std::string& where) {
  return read_integer_attribute<uint64_t>(object, name, H5T_NATIVE_UINT64, kind, where);
}

double read_double_attribute(hid_t object, const std::string& name, ErrorKind kind,
                             const std::string& where) {
  const std::string what = "cannot read attribute '" + name + "' of " + where;
  Handle attr = open_attribute(object, name, kind, where);
  if (attribute_class(attr, kind, what) != H5T_FLOAT || attribute_elements(attr, kind, what) != 1) {
    throw_error(kind, "attribute '" + name + "' of " + where + " is not a number");
  }
  double value = 0.0;
  check(H5Aread(attr, H5T_NATIVE_DOUBLE, &value), kind, what);
  return value;
}

std::vector<int64_t> read_int_array_attribute(hid_t object, const std::string& name, ErrorKind kind,
                                              const std::string& where) {
  const std::string what = "cannot read attribute '" + name + "' of " + where;
  Handle attr = open_attribute(object, name, kind, where);
  if (attribute_class(attr, kind, what) != H5T_INTEGER) {
    throw_error(kind, "attribute '" + name + "' of " + where + " is not an integer array");
  }
  std::vector<int64_t> values(static_cast<size_t>(attribute_elements(attr, kind, what)));
  if (!values.empty()) check(H5Aread(attr, H5T_NATIVE_INT64, values.data()), kind, what);
  return values;
}

bool path_exists(hid_t file, const std::string& path, ErrorKind kind, const std::string& where) {
  std::string prefix;
  size_t start = 0;
  while (start < path.size()) {
    size_t slash = path.find('/', start);
    if (slash == std::string::npos) slash = path.size();
    if (slash > start) {
      prefix += "/" + path.substr(start, slash - start);
      const htri_t exists = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
      if (exists < 0) check(-1, kind, "cannot look up '" + prefix + "' in " + where);
      if (exists == 0) return false;
    }
    start = slash + 1;
  }
  return true;
}

std::vector<int64_t> dataset_shape(hid_t dataset, ErrorKind kind, const std::string& what) {
  Handle space = make(H5Dget_space(dataset), H5Sclose, kind, what);
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) check(-1, kind, what);
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0) check(H5Sget_simple_extent_dims(space, dims.data(), nullptr), kind, what);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

}  // namespace meshtrain::hdf5
