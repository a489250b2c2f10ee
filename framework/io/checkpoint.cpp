#include "framework/io/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "framework/comm/communicator.hpp"  // checked_int
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/version.hpp"
#include "framework/io/hdf5_util.hpp"
#include "partition/error.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

namespace fs = std::filesystem;
using hdf5::Handle;

namespace {

constexpr const char* kFormat = "meshtrain-checkpoint-1";
constexpr const char* kFaultEnv = "MESHTRAIN_FAULT_INJECT";
// Chunks of at most 4 MiB: large enough for streaming I/O, small enough that a resharded
// read touches little more than it needs.
constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;

// --- MPI --------------------------------------------------------------------------------

// A private duplicate of the caller's communicator that returns MPI errors instead of
// aborting, so each can be reported with MPI_Error_string.
class PrivateComm {
 public:
  explicit PrivateComm(MPI_Comm comm) {
    check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup (checkpoint)");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  PrivateComm(const PrivateComm&) = delete;
  PrivateComm& operator=(const PrivateComm&) = delete;
  ~PrivateComm() { MPI_Comm_free(&comm_); }
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

// Runs one phase on every rank; if it failed on any, every rank throws the error of the
// lowest failing rank (see run_agreed), so no rank goes on into a collective call alone.
void collectively(const PrivateComm& comm, const std::function<void()>& phase) {
  if (auto error = run_agreed(comm.get(), phase)) throw *error;
}

void broadcast_string(const PrivateComm& comm, std::string& text, int root) {
  int length = checked_int(text.size(), "string length");
  check_mpi(MPI_Bcast(&length, 1, MPI_INT, root, comm.get()), "MPI_Bcast (checkpoint)");
  text.resize(static_cast<size_t>(length));
  if (length > 0)
    check_mpi(MPI_Bcast(text.data(), length, MPI_CHAR, root, comm.get()), "MPI_Bcast (checkpoint)");
}

void broadcast_train_state(const PrivateComm& comm, TrainState& s) {
  int64_t v[6] = {s.step,
                  s.epoch,
                  s.batch_in_epoch,
                  static_cast<int64_t>(s.seed),
                  static_cast<int64_t>(s.rng_offset),
                  s.optimizer_step};
  check_mpi(MPI_Bcast(v, 6, MPI_INT64_T, 0, comm.get()), "MPI_Bcast (train state)");
  s = TrainState{v[0], v[1], v[2], static_cast<uint64_t>(v[3]), static_cast<uint64_t>(v[4]), v[5]};
}

// --- fault injection ---------------------------------------------------------------------

enum class FaultKind {
  none,
  after_dataset,
  before_close,
  before_rename,
  before_latest,
  before_cleanup
};

struct FaultPoint {
  FaultKind kind = FaultKind::none;
  int64_t datasets = 0;  // after_dataset:<n>
};

FaultPoint fault_from_env() {
  const char* value = std::getenv(kFaultEnv);
  if (value == nullptr || value[0] == '\0') return {};
  const std::string text = value;
  static const std::map<std::string, FaultKind> simple = {
      {"before_close", FaultKind::before_close},
      {"before_rename", FaultKind::before_rename},
      {"before_latest", FaultKind::before_latest},
      {"before_cleanup", FaultKind::before_cleanup}};
  if (auto it = simple.find(text); it != simple.end()) return {it->second, 0};
  std::smatch m;
  static const std::regex after(R"(after_dataset:([0-9]{1,9}))");
  if (std::regex_match(text, m, after)) return {FaultKind::after_dataset, std::stoll(m[1].str())};
  MESHTRAIN_BAD_INPUT(kFaultEnv, "='", text,
                      "' is not a fault point (after_dataset:<n>, before_close, before_rename, "
                      "before_latest, before_cleanup)");
}

void inject(const FaultPoint& fault, FaultKind at, int64_t datasets_written = 0) {
  if (fault.kind != at) return;
  if (at == FaultKind::after_dataset && datasets_written != fault.datasets) return;
  std::fprintf(stderr, "meshtrain: %s: fault injected during checkpoint save, aborting\n",
               kFaultEnv);
  std::fflush(stderr);
  std::abort();
}

// --- files -------------------------------------------------------------------------------

std::string os_error(int err) {
  return std::strerror(err);
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) MESHTRAIN_FAIL("cannot open '", path, "' to sync it: ", os_error(errno));
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    MESHTRAIN_FAIL("fsync of '", path, "' failed: ", os_error(err));
  }
  if (::close(fd) != 0) MESHTRAIN_FAIL("closing '", path, "' failed: ", os_error(errno));
}

void rename_path(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    MESHTRAIN_FAIL("cannot rename '", from, "' to '", to, "': ", os_error(errno));
  }
}

// Replaces dir/latest with `file_name` atomically (temporary file, fsync, rename).
void write_latest(const std::string& dir, const std::string& file_name) {
  const std::string target = (fs::path(dir) / latest_pointer_name()).string();
  const std::string tmp = target + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) MESHTRAIN_FAIL("cannot create '", tmp, "': ", os_error(errno));
  const std::string line = file_name + "\n";
  const ssize_t written = ::write(fd, line.data(), line.size());
  const int write_err = errno;
  if (written != static_cast<ssize_t>(line.size()) || ::fsync(fd) != 0) {
    const int err = written < 0 ? write_err : errno;
    ::close(fd);
    MESHTRAIN_FAIL("cannot write '", tmp, "': ", os_error(err));
  }
  if (::close(fd) != 0) MESHTRAIN_FAIL("closing '", tmp, "' failed: ", os_error(errno));
  rename_path(tmp, target);
  fsync_path(dir, true);
}

const std::regex& checkpoint_name_pattern() {
  static const std::regex pattern(R"(ckpt-([0-9]+)\.h5)");
  return pattern;
}

// Removes checkpoints beyond `keep` (by step, never `current`) and leftovers of
// interrupted saves.
void remove_old_checkpoints(const std::string& dir, const std::string& current, int64_t keep) {
  static const std::regex leftover(R"(ckpt-[0-9]+\.h5\.tmp)");
  std::vector<std::pair<int64_t, std::string>> others;
  std::vector<std::string> remove;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (name == current) continue;
    if (std::regex_match(name, m, checkpoint_name_pattern())) {
      others.emplace_back(std::stoll(m[1].str()), name);
    } else if (std::regex_match(name, leftover)) {
      remove.push_back(name);
    }
  }
  if (ec) MESHTRAIN_FAIL("cannot list checkpoint directory '", dir, "': ", ec.message());
  if (keep > 0) {
    std::sort(others.begin(), others.end(), std::greater<>());
    for (size_t i = static_cast<size_t>(keep - 1); i < others.size(); ++i)
      remove.push_back(others[i].second);
  }
  for (const auto& name : remove) {
    const fs::path path = fs::path(dir) / name;
    if (!fs::remove(path, ec) && ec)
      MESHTRAIN_FAIL("cannot remove old checkpoint '", path.string(), "': ", ec.message());
  }
}

// --- tensors -----------------------------------------------------------------------------

struct DatasetEntry {
  std::string path;   // "/params/layers/0/weight"
  std::string label;  // "parameter 'layers/0/weight'" (for messages)
  ShardedTensor* tensor;
};

void check_name(const std::string& name, const std::string& what) {
  const bool bad = name.empty() || name.front() == '/' || name.back() == '/' ||
                   name.find("//") != std::string::npos || name.find('.') == 0;
  MESHTRAIN_REQUIRE(!bad, "checkpoint: ", what, " name '", name,
                    "' is not a valid '/'-joined name");
}

// Checks that a tensor's box and local block fit its global shape.
void check_tensor(const ShardedTensor& t, const std::string& label) {
  const size_t rank = t.global_shape.size();
  MESHTRAIN_REQUIRE(t.box.offset.size() == rank && t.box.extent.size() == rank,
                    "checkpoint: ", label, " has a box of rank ", t.box.extent.size(),
                    " for a global shape ", format_shape(t.global_shape));
  for (size_t d = 0; d < rank; ++d) {
    MESHTRAIN_REQUIRE(t.box.offset[d] >= 0 && t.box.extent[d] >= 0 &&
                          t.box.offset[d] + t.box.extent[d] <= t.global_shape[d],
                      "checkpoint: ", label, " has a box outside its shape ",
                      format_shape(t.global_shape));
  }
  MESHTRAIN_REQUIRE(static_cast<int64_t>(t.local.extent(0)) == t.box.elements(),
                    "checkpoint: ", label, " holds ", t.local.extent(0), " values but its box has ",
                    t.box.elements());
}

std::vector<DatasetEntry> dataset_entries(const CheckpointContents& c) {
  std::vector<DatasetEntry> entries;
  std::set<std::string> seen;
  auto add = [&](const std::string& path, const std::string& label, const ShardedTensor& t) {
    MESHTRAIN_REQUIRE(seen.insert(path).second, "checkpoint: ", label, " appears twice");
    check_tensor(t, label);
    entries.push_back({path, label, const_cast<ShardedTensor*>(&t)});
  };
  for (const auto& t : c.params) {
    check_name(t.name, "parameter");
    add("/params/" + t.name, "parameter '" + t.name + "'", t);
  }
  for (const auto& slot : c.opt_state) {
    check_name(slot.name, "optimizer slot");
    MESHTRAIN_REQUIRE(slot.name.find('/') == std::string::npos, "checkpoint: optimizer slot name '",
                      slot.name, "' contains '/'");
    for (const auto& t : slot.tensors) {
      check_name(t.name, "optimizer state");
      add("/opt_state/" + slot.name + "/" + t.name,
          "optimizer state '" + slot.name + "' of parameter '" + t.name + "'", t);
    }
  }
  return entries;
}

// The dataset shape of a tensor: rank-0 tensors are stored as [1].
std::vector<hsize_t> stored_dims(const std::vector<int64_t>& shape) {
  if (shape.empty()) return {1};
  return std::vector<hsize_t>(shape.begin(), shape.end());
}

// Chunks follow the saved block (so each chunk has one writer), cut to kMaxChunkBytes.
std::vector<hsize_t> chunk_dims(const ShardedTensor& t) {
  std::vector<int64_t> chunk = t.box.extent;
  if (chunk.empty()) chunk = {1};
  for (auto& c : chunk) c = std::max<int64_t>(c, 1);
  int64_t elements = 1;
  for (auto c : chunk) elements *= c;
  // Cut the leading dimensions first so chunks stay contiguous rows.
  for (size_t d = 0; d < chunk.size() && elements * 4 > kMaxChunkBytes; ++d) {
    const int64_t rest = elements / chunk[d];
    const int64_t fit = std::max<int64_t>(1, kMaxChunkBytes / 4 / rest);
    chunk[d] = std::min(chunk[d], fit);
    elements = rest * chunk[d];
  }
  return std::vector<hsize_t>(chunk.begin(), chunk.end());
}

// True when this rank writes its block: coordinate 0 on every mesh axis outside the spec,
// so each replicated block is written exactly once.
bool writes_block(const Mesh& mesh, int rank, const PartitionSpec& spec) {
  const std::vector<std::string> used = spec.axes();
  const std::vector<int> coords = mesh.coordinates(rank);
  for (size_t a = 0; a < mesh.axes().size(); ++a) {
    const bool in_spec = std::find(used.begin(), used.end(), mesh.axes()[a].name) != used.end();
    if (!in_spec && coords[a] != 0) return false;
  }
  return true;
}

// Selects a tensor's box in a file dataspace (none when `select` is false) and makes the
// matching memory space: the box's own shape (not 1-D), so HDF5 maps chunks to memory by
// shape instead of element by element.
void select_box(const ShardedTensor& t, bool select, hid_t file_space, Handle& mem_space,
                ErrorKind kind, const std::string& what) {
  std::vector<hsize_t> start(t.box.offset.begin(), t.box.offset.end());
  std::vector<hsize_t> count(t.box.extent.begin(), t.box.extent.end());
  if (start.empty()) start = {0}, count = {1};  // a scalar, stored as [1]
  std::vector<hsize_t> mem_dims(count);
  for (auto& d : mem_dims) d = std::max<hsize_t>(d, 1);
  mem_space =
      hdf5::make(H5Screate_simple(static_cast<int>(mem_dims.size()), mem_dims.data(), nullptr),
                 H5Sclose, kind, what);
  if (!select || t.box.elements() == 0) {
    hdf5::check(H5Sselect_none(file_space), kind, what);
    hdf5::check(H5Sselect_none(mem_space), kind, what);
    return;
  }
  hdf5::check(
      H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
      kind, what);
}

Handle mpio_file_access(const PrivateComm& comm, ErrorKind kind) {
  Handle fapl = hdf5::make(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, kind, "H5Pcreate(file access)");
  hdf5::check(H5Pset_fapl_mpio(fapl, comm.get(), MPI_INFO_NULL), kind, "H5Pset_fapl_mpio");
  // 1.8 file format: dense attribute storage (a long config text), readable by h5py/h5dump.
  hdf5::check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_V18), kind,
              "H5Pset_libver_bounds");
  return fapl;
}

Handle transfer_list(H5FD_mpio_xfer_t mode, ErrorKind kind) {
  Handle dxpl = hdf5::make(H5Pcreate(H5P_DATASET_XFER), H5Pclose, kind, "H5Pcreate(transfer)");
  hdf5::check(H5Pset_dxpl_mpio(dxpl, mode), kind, "H5Pset_dxpl_mpio");
  return dxpl;
}

void write_metadata(hid_t file, const CheckpointContents& c, const TrainState& state,
                    const std::string& config) {
  std::string axes;
  std::vector<int64_t> sizes;
  for (const auto& axis : c.mesh.axes()) {
    axes += (axes.empty() ? "" : ",") + axis.name;
    sizes.push_back(axis.size);
  }
  hdf5::write_attribute(file, "format", std::string(kFormat));
  hdf5::write_attribute(file, "step", state.step);
  hdf5::write_attribute(file, "mesh", c.mesh.describe());
  hdf5::write_attribute(file, "mesh_axes", axes);
  hdf5::write_attribute(file, "mesh_sizes", sizes);
  hdf5::write_attribute(file, "world_size", static_cast<int64_t>(c.mesh.world_size()));
  hdf5::write_attribute(file, "framework_version", std::string(framework_version()));
  hdf5::write_attribute(file, "config", config);

  Handle group = hdf5::make(H5Gcreate2(file, "/train_state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                            H5Gclose, ErrorKind::runtime, "cannot create group '/train_state'");
  hdf5::write_attribute(group, "step", state.step);
  hdf5::write_attribute(group, "epoch", state.epoch);
  hdf5::write_attribute(group, "batch_in_epoch", state.batch_in_epoch);
  hdf5::write_attribute(group, "seed", state.seed);
  hdf5::write_attribute(group, "rng_offset", state.rng_offset);
  hdf5::write_attribute(group, "optimizer_step", state.optimizer_step);
  group.close("cannot close group '/train_state'");
}

CheckpointInfo read_metadata(hid_t file, const std::string& path) {
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  if (!hdf5::has_attribute(file, "format", bad, where)) {
    MESHTRAIN_BAD_INPUT("'", path,
                        "' is not a meshtrain checkpoint (its root has no 'format' attribute)");
  }
  const std::string format = hdf5::read_string_attribute(file, "format", bad, where);
  if (format != kFormat) {
    MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has format '", format, "'; this meshtrain reads '",
                        kFormat, "'");
  }
  CheckpointInfo info;
  info.path = path;
  info.mesh = hdf5::read_string_attribute(file, "mesh", bad, where);
  info.world_size = hdf5::read_int_attribute(file, "world_size", bad, where);
  info.framework_version = hdf5::read_string_attribute(file, "framework_version", bad, where);
  info.config_text = hdf5::read_string_attribute(file, "config", bad, where);
  if (!hdf5::path_exists(file, "/train_state", bad, where)) {
    MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has no '/train_state' group");
  }
  Handle group = hdf5::make(H5Gopen2(file, "/train_state", H5P_DEFAULT), H5Gclose, bad,
                            "cannot open '/train_state' in " + where);
  const std::string gwhere = "'/train_state' in " + where;
  TrainState& s = info.train_state;
  s.step = hdf5::read_int_attribute(group, "step", bad, gwhere);
  s.epoch = hdf5::read_int_attribute(group, "epoch", bad, gwhere);
  s.batch_in_epoch = hdf5::read_int_attribute(group, "batch_in_epoch", bad, gwhere);
  s.seed = hdf5::read_uint_attribute(group, "seed", bad, gwhere);
  s.rng_offset = hdf5::read_uint_attribute(group, "rng_offset", bad, gwhere);
  s.optimizer_step = hdf5::read_int_attribute(group, "optimizer_step", bad, gwhere);
  return info;
}

// Every dataset below `group_path`, as paths relative to it ("layers/0/weight"), found by
// opening each link (portable across the HDF5 1.10 and 1.12+ visit APIs).
void collect_datasets(hid_t file, const std::string& group_path, const std::string& prefix,
                      std::vector<std::string>& out, const std::string& where) {
  const ErrorKind bad = ErrorKind::bad_input;
  Handle group = hdf5::make(H5Gopen2(file, group_path.c_str(), H5P_DEFAULT), H5Gclose, bad,
                            "cannot open group '" + group_path + "' in " + where);
  H5G_info_t info;
  hdf5::check(H5Gget_info(group, &info), bad, "cannot list group '" + group_path + "' in " + where);
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    const ssize_t length =
        H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (length < 0) hdf5::check(-1, bad, "cannot list group '" + group_path + "' in " + where);
    std::string name(static_cast<size_t>(length) + 1, '\0');
    if (H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(),
                           H5P_DEFAULT) < 0) {
      hdf5::check(-1, bad, "cannot list group '" + group_path + "' in " + where);
    }
    name.resize(static_cast<size_t>(length));
    const std::string child = (group_path == "/" ? "" : group_path) + "/" + name;
    Handle object = hdf5::make(H5Oopen(file, child.c_str(), H5P_DEFAULT), H5Oclose, bad,
                               "cannot open '" + child + "' in " + where);
    const H5I_type_t type = H5Iget_type(object);
    if (type == H5I_GROUP) {
      collect_datasets(file, child, prefix + name + "/", out, where);
    } else if (type == H5I_DATASET) {
      out.push_back(prefix + name);
    }
  }
}

// The shape a dataset stands for (a stored [1] with attribute scalar = 1 is rank 0).
std::vector<int64_t> logical_shape(hid_t dataset, const std::string& what) {
  std::vector<int64_t> shape = hdf5::dataset_shape(dataset, ErrorKind::bad_input, what);
  if (hdf5::has_attribute(dataset, "scalar", ErrorKind::bad_input, what) &&
      hdf5::read_int_attribute(dataset, "scalar", ErrorKind::bad_input, what) == 1) {
    shape.clear();
  }
  return shape;
}

bool is_checksum_failure(const std::string& hdf5_text) {
  return hdf5_text.find("Fletcher32") != std::string::npos ||
         hdf5_text.find("checksum") != std::string::npos;
}

[[noreturn]] void throw_read_failure(const std::string& dataset, const std::string& path) {
  const std::string text = hdf5::take_error_text();
  if (is_checksum_failure(text)) {
    MESHTRAIN_BAD_INPUT("dataset '", dataset, "' in checkpoint '", path,
                        "' is corrupt (Fletcher32 checksum mismatch): ", text);
  }
  MESHTRAIN_BAD_INPUT("cannot read dataset '", dataset, "' in checkpoint '", path, "': ", text);
}

// The model's parameters and the file's must be the same set.
void check_parameter_names(hid_t file, const CheckpointContents& into, const std::string& path) {
  const std::string where = "checkpoint '" + path + "'";
  std::vector<std::string> stored;
  if (hdf5::path_exists(file, "/params", ErrorKind::bad_input, where)) {
    collect_datasets(file, "/params", "", stored, where);
  }
  std::set<std::string> model;
  for (const auto& t : into.params) model.insert(t.name);
  const std::set<std::string> in_file(stored.begin(), stored.end());
  for (const auto& t : into.params) {
    if (in_file.count(t.name) == 0) {
      MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has no parameter '", t.name,
                          "' (the model's has shape ", format_shape(t.global_shape), ")");
    }
  }
  for (const auto& name : stored) {
    if (model.count(name) == 0) {
      Handle d = hdf5::make(H5Dopen2(file, ("/params/" + name).c_str(), H5P_DEFAULT), H5Dclose,
                            ErrorKind::bad_input, "cannot open '/params/" + name + "' in " + where);
      MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has parameter '", name, "' with shape ",
                          format_shape(logical_shape(d, where)), " that the model does not have");
    }
  }
  for (const auto& slot : into.opt_state) {
    if (!hdf5::path_exists(file, "/opt_state/" + slot.name, ErrorKind::bad_input, where)) {
      MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has no optimizer state '", slot.name,
                          "' (group '/opt_state/", slot.name, "')");
    }
  }
}

void read_dataset(hid_t file, const DatasetEntry& entry, const std::string& path, hid_t dxpl) {
  const ErrorKind bad = ErrorKind::bad_input;
  ShardedTensor& t = *entry.tensor;
  const std::string where = "checkpoint '" + path + "'";
  if (!hdf5::path_exists(file, entry.path, bad, where)) {
    MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has no dataset '", entry.path, "' for ",
                        entry.label, " (shape ", format_shape(t.global_shape), ")");
  }
  const std::string what = "cannot read dataset '" + entry.path + "' in " + where;
  Handle dataset = hdf5::make(H5Dopen2(file, entry.path.c_str(), H5P_DEFAULT), H5Dclose, bad, what);
  const std::vector<int64_t> shape = logical_shape(dataset, what);
  if (shape != t.global_shape) {
    MESHTRAIN_BAD_INPUT(entry.label, " has shape ", format_shape(shape), " in checkpoint '", path,
                        "' but ", format_shape(t.global_shape), " in the model");
  }
  {
    Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
    if (H5Tget_class(type) != H5T_FLOAT) {
      MESHTRAIN_BAD_INPUT("dataset '", entry.path, "' in checkpoint '", path,
                          "' is not floating point");
    }
  }
  Handle file_space = hdf5::make(H5Dget_space(dataset), H5Sclose, bad, what);
  Handle mem_space;
  select_box(t, true, file_space, mem_space, bad, what);
  auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), t.local);
  if (t.box.elements() > 0) {
    if (H5Dread(dataset, H5T_NATIVE_FLOAT, mem_space, file_space, dxpl, host.data()) < 0) {
      throw_read_failure(entry.path, path);
    }
  }
  Kokkos::deep_copy(t.local, host);
}

// Follows dir/latest, or takes a file path as it is; checks that the file exists.
std::string resolve_checkpoint_path(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::optional<std::string> latest = find_latest_checkpoint(path);
    if (!latest) {
      MESHTRAIN_BAD_INPUT("checkpoint directory '", path, "' has no '", latest_pointer_name(),
                          "' pointer (no complete checkpoint was saved there)");
    }
    return *latest;
  }
  if (!fs::exists(path, ec)) MESHTRAIN_BAD_INPUT("checkpoint '", path, "' does not exist");
  if (!fs::is_regular_file(path, ec)) MESHTRAIN_BAD_INPUT("checkpoint '", path, "' is not a file");
  return path;
}

Handle open_serial(const std::string& path) {
  hdf5::silence_errors();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    MESHTRAIN_BAD_INPUT("checkpoint '", path, "' does not exist or is not a file");
  return hdf5::make(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose,
                    ErrorKind::bad_input, "cannot open checkpoint '" + path + "' as an HDF5 file");
}

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

}  // namespace

std::string checkpoint_file_name(int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%06lld.h5", static_cast<long long>(step));
  return name;
}

const char* latest_pointer_name() {
  return "latest";
}

std::string save_checkpoint(const CheckpointContents& contents, const std::string& dir,
                            int64_t keep, MPI_Comm user_comm) {
  hdf5::silence_errors();
  PrivateComm comm(user_comm);
  const ErrorKind fail = ErrorKind::runtime;
  FaultPoint fault;
  std::vector<DatasetEntry> entries;
  TrainState state = contents.train_state;
  std::string config = contents.config_text;
  std::string file_name, final_path, tmp_path;

  collectively(comm, [&] {
    MESHTRAIN_REQUIRE(contents.mesh.world_size() == comm.size(), "checkpoint: the mesh (",
                      contents.mesh.describe(), ") has ", contents.mesh.world_size(),
                      " ranks but the communicator has ", comm.size());
    MESHTRAIN_REQUIRE(!dir.empty(), "checkpoint: the directory is empty");
    MESHTRAIN_REQUIRE(state.step >= 0, "checkpoint: negative step ", state.step);
    fault = fault_from_env();
    entries = dataset_entries(contents);
    file_name = checkpoint_file_name(state.step);
    final_path = (fs::path(dir) / file_name).string();
    tmp_path = final_path + ".tmp";
    if (comm.rank() == 0) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec) MESHTRAIN_FAIL("cannot create checkpoint directory '", dir, "': ", ec.message());
      fs::remove(tmp_path, ec);
      if (ec) MESHTRAIN_FAIL("cannot remove the stale '", tmp_path, "': ", ec.message());
    }
  });
  // Metadata must be identical on every rank: rank 0's is authoritative.
  broadcast_string(comm, config, 0);
  broadcast_train_state(comm, state);

  Handle fapl, file, dxpl, lcpl;
  collectively(comm, [&] {
    fapl = mpio_file_access(comm, fail);
    dxpl = transfer_list(H5FD_MPIO_COLLECTIVE, fail);
    lcpl = hdf5::make(H5Pcreate(H5P_LINK_CREATE), H5Pclose, fail, "H5Pcreate(link create)");
    hdf5::check(H5Pset_create_intermediate_group(lcpl, 1), fail,
                "H5Pset_create_intermediate_group");
    file = hdf5::make(H5Fcreate(tmp_path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), H5Fclose, fail,
                      "cannot create checkpoint file '" + tmp_path + "'");
  });
  collectively(comm, [&] { write_metadata(file, contents, state, config); });

  int64_t written = 0;
  for (const DatasetEntry& entry : entries) {
    const ShardedTensor& t = *entry.tensor;
    const std::string what =
        "cannot write dataset '" + entry.path + "' of checkpoint '" + tmp_path + "'";
    Handle dataset, file_space, mem_space;
    collectively(comm, [&] {
      const std::vector<hsize_t> dims = stored_dims(t.global_shape);
      Handle dcpl = hdf5::make(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, fail, what);
      const std::vector<hsize_t> chunk = chunk_dims(t);
      hdf5::check(H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()), fail, what);
      hdf5::check(H5Pset_fletcher32(dcpl), fail, what);
      // Every chunk is written below, so no fill values are needed. (HDF5 1.10 with MPI-IO
      // allocates chunks at creation and still fills filtered ones; newer HDF5 skips it.)
      hdf5::check(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), fail, what);
      Handle space =
          hdf5::make(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                     H5Sclose, fail, what);
      dataset = hdf5::make(
          H5Dcreate2(file, entry.path.c_str(), H5T_IEEE_F32LE, space, lcpl, dcpl, H5P_DEFAULT),
          H5Dclose, fail, what);
      hdf5::write_attribute(dataset, "spec", t.spec.to_string());
      if (t.global_shape.empty()) hdf5::write_attribute(dataset, "scalar", int64_t{1});
      file_space = hdf5::make(H5Dget_space(dataset), H5Sclose, fail, what);
      select_box(t, writes_block(contents.mesh, comm.rank(), t.spec), file_space, mem_space, fail,
                 what);
    });
    collectively(comm, [&] {
      auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.local);
      hdf5::check(H5Dwrite(dataset, H5T_NATIVE_FLOAT, mem_space, file_space, dxpl, host.data()),
                  fail, what);
      dataset.close(what);
    });
    inject(fault, FaultKind::after_dataset, ++written);
  }

  collectively(comm, [&] {
    // MPI_File_sync on every rank: each rank's data is on disk before the rename.
    hdf5::check(H5Fflush(file, H5F_SCOPE_GLOBAL), fail,
                "cannot flush checkpoint file '" + tmp_path + "'");
  });
  inject(fault, FaultKind::before_close);
  collectively(comm, [&] { file.close("cannot close checkpoint file '" + tmp_path + "'"); });

  collectively(comm, [&] {
    if (comm.rank() != 0) return;
    fsync_path(tmp_path, false);  // what the close wrote last
    inject(fault, FaultKind::before_rename);
    rename_path(tmp_path, final_path);
    fsync_path(dir, true);
    inject(fault, FaultKind::before_latest);
    write_latest(dir, file_name);
    inject(fault, FaultKind::before_cleanup);
    remove_old_checkpoints(dir, file_name, keep);
  });
  return final_path;
}

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  const fs::path pointer = fs::path(dir) / latest_pointer_name();
  std::error_code ec;
  if (!fs::exists(pointer, ec)) return std::nullopt;
  std::ifstream in(pointer, std::ios::binary);
  if (!in)
    MESHTRAIN_BAD_INPUT("cannot read the latest-checkpoint pointer '", pointer.string(), "'");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' '))
    text.pop_back();
  if (!std::regex_match(text, checkpoint_name_pattern())) {
    std::string shown = text.substr(0, 80);
    for (char& ch : shown) {
      if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
    }
    MESHTRAIN_BAD_INPUT("the latest-checkpoint pointer '", pointer.string(),
                        "' is garbled: it holds '", shown, "', not a checkpoint file name like '",
                        checkpoint_file_name(100), "'");
  }
  const fs::path file = fs::path(dir) / text;
  if (!fs::is_regular_file(file, ec)) {
    MESHTRAIN_BAD_INPUT("the latest-checkpoint pointer '", pointer.string(), "' names '", text,
                        "', which does not exist");
  }
  return file.string();
}

CheckpointInfo load_checkpoint(const std::string& path_in, CheckpointContents& into,
                               MPI_Comm user_comm) {
  hdf5::silence_errors();
  PrivateComm comm(user_comm);
  const ErrorKind bad = ErrorKind::bad_input;
  std::vector<DatasetEntry> entries;
  std::string path;
  collectively(comm, [&] {
    MESHTRAIN_REQUIRE(into.mesh.world_size() == comm.size(), "checkpoint: the mesh (",
                      into.mesh.describe(), ") has ", into.mesh.world_size(),
                      " ranks but the communicator has ", comm.size());
    entries = dataset_entries(into);
    if (comm.rank() == 0) path = resolve_checkpoint_path(path_in);
  });
  broadcast_string(comm, path, 0);

  Handle fapl, file, dxpl;
  collectively(comm, [&] {
    fapl = mpio_file_access(comm, bad);
    // Independent reads: each rank reads its own block, and a checksum failure on one
    // rank cannot leave the others waiting inside a collective read.
    dxpl = transfer_list(H5FD_MPIO_INDEPENDENT, bad);
    file = hdf5::make(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose, bad,
                      "cannot open checkpoint '" + path + "' as an HDF5 file");
  });
  CheckpointInfo info;
  collectively(comm, [&] {
    info = read_metadata(file, path);
    check_parameter_names(file, into, path);
  });
  for (const DatasetEntry& entry : entries) {
    collectively(comm, [&] { read_dataset(file, entry, path, dxpl); });
  }
  collectively(comm, [&] { file.close("cannot close checkpoint '" + path + "'"); });
  into.train_state = info.train_state;
  return info;
}

CheckpointListing list_checkpoint(const std::string& path) {
  Handle file = open_serial(path);
  CheckpointListing listing;
  listing.info = read_metadata(file, path);
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  std::vector<std::string> names;
  collect_datasets(file, "/", "/", names, where);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
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
    const int filters = H5Pget_nfilters(dcpl);
    if (filters < 0) hdf5::check(-1, bad, what);
    for (int i = 0; i < filters; ++i) {
      unsigned flags = 0;
      size_t n_values = 0;
      unsigned config = 0;
      const H5Z_filter_t id = H5Pget_filter2(dcpl, static_cast<unsigned>(i), &flags, &n_values,
                                             nullptr, 0, nullptr, &config);
      if (id < 0) hdf5::check(-1, bad, what);
      if (id == H5Z_FILTER_FLETCHER32) d.fletcher32 = true;
    }
    listing.datasets.push_back(std::move(d));
  }
  return listing;
}

int64_t verify_checkpoint(const std::string& path) {
  Handle file = open_serial(path);
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  std::vector<std::string> names;
  collect_datasets(file, "/", "/", names, where);
  std::sort(names.begin(), names.end());
  std::vector<char> buffer;
  for (const auto& name : names) {
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
  }
  return static_cast<int64_t>(names.size());
}

}  // namespace meshtrain
