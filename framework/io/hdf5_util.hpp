#pragma once
// Small helpers over the HDF5 C API for checkpoints and the inspect command: owning
// handles, error checks that carry HDF5's own error stack text, and typed attributes.
// Every call whose return code matters goes through check()/check_id(), which throw
// meshtrain::Error of the given kind with "<what>: <HDF5 messages>".

#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "base/error.hpp"

namespace meshtrain::hdf5 {

// HDF5 as Debian builds it (parallel) is not thread safe: the checkpoint code, whose rank-0
// finisher thread stores checksums while the main thread may open another file, holds this
// lock around every HDF5 call it makes.
std::mutex& global_mutex();

// Turns off HDF5's automatic printing of error stacks (we collect them instead). Cheap;
// called at the start of every public entry point.
void silence_errors();

// The messages on the current HDF5 error stack, innermost last, joined by "; ". Clears
// the stack. Empty when the stack is empty.
std::string take_error_text();

// Owns one HDF5 identifier and closes it with the matching H5*close on destruction.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept;
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // NOLINT: handles pass straight to the C API
  // Closes now; throws (kind runtime) with HDF5's text when the close fails.
  void close(const std::string& what);
  void reset();  // closes, ignoring errors (for unwinding)

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Throws Error(kind) "<what>: <HDF5 error text>" when status < 0.
void check(herr_t status, ErrorKind kind, const std::string& what);
// Returns id when valid, throws as check() otherwise.
hid_t check_id(hid_t id, ErrorKind kind, const std::string& what);
// Wraps a freshly created identifier (checked) in a Handle with the given closer.
Handle make(hid_t id, Handle::Closer closer, ErrorKind kind, const std::string& what);

// Attribute helpers on any object (file, group, dataset). Writers create the attribute.
void write_attribute(hid_t object, const std::string& name, const std::string& value);
void write_attribute(hid_t object, const std::string& name, int64_t value);
void write_attribute(hid_t object, const std::string& name, uint64_t value);
void write_attribute(hid_t object, const std::string& name, double value);
void write_attribute(hid_t object, const std::string& name, const std::vector<int64_t>& values);

bool has_attribute(hid_t object, const std::string& name, ErrorKind kind, const std::string& where);
// Readers throw Error(kind) naming `where` and the attribute when it is missing or of
// another type class.
std::string read_string_attribute(hid_t object, const std::string& name, ErrorKind kind,
                                  const std::string& where);
int64_t read_int_attribute(hid_t object, const std::string& name, ErrorKind kind,
                           const std::string& where);
double read_double_attribute(hid_t object, const std::string& name, ErrorKind kind,
                             const std::string& where);
uint64_t read_uint_attribute(hid_t object, const std::string& name, ErrorKind kind,
                             const std::string& where);
std::vector<int64_t> read_int_array_attribute(hid_t object, const std::string& name, ErrorKind kind,
                                              const std::string& where);

// True when `path` ("/params/layers/0/weight") names an existing link, checking every
// component (H5Lexists alone fails on a missing intermediate group).
bool path_exists(hid_t file, const std::string& path, ErrorKind kind, const std::string& where);

// The dimensions of a dataset's dataspace (empty for a scalar dataspace).
std::vector<int64_t> dataset_shape(hid_t dataset, ErrorKind kind, const std::string& what);

}  // namespace meshtrain::hdf5
