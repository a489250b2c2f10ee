#include "framework/io/checkpoint_format.hpp"

#include <filesystem>
#include <mutex>
#include <set>

#include "base/error.hpp"
#include "framework/core/tensor_values.hpp"
#include "framework/core/version.hpp"
#include "framework/io/checkpoint_checksums.hpp"
#include "partition/planner.hpp"

namespace meshtrain::checkpoint_format {

namespace fs = std::filesystem;
using hdf5::Handle;

// --- tensors -----------------------------------------------------------------------------

namespace {

void check_name(const std::string& name, const std::string& what) {
  const bool bad = name.empty() || name.front() == '/' || name.back() == '/' ||
                   name.find("//") != std::string::npos || name.find('.') == 0;
  MESHTRAIN_REQUIRE(!bad, "checkpoint: ", what, " name '", name,
                    "' is not a valid '/'-joined name");
}

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
  // A tensor stored as bf16 holds its block in `bits` (checkpoint_format.hpp, kBf16Dtype).
  const int64_t held = held_elements(t);
  MESHTRAIN_REQUIRE(held == t.box.elements(), "checkpoint: ", label, " holds ", held,
                    " values but its box has ", t.box.elements());
}

}  // namespace

std::vector<DatasetEntry> dataset_entries(const CheckpointContents& c, int rank) {
  std::vector<DatasetEntry> entries;
  std::set<std::string> seen;
  auto add = [&](const std::string& path, const std::string& label, const ShardedTensor& t) {
    MESHTRAIN_REQUIRE(seen.insert(path).second, "checkpoint: ", label, " appears twice");
    check_tensor(t, label);
    entries.push_back(
        {path, label, const_cast<ShardedTensor*>(&t), owns_block(c.mesh, rank, t.spec)});
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
  for (const auto& t : c.stream.tensors) {
    check_name(t.name, "stream buffer");
    add("/stream/" + t.name, "stream buffer '" + t.name + "'", t);
  }
  return entries;
}

std::vector<hsize_t> stored_dims(const std::vector<int64_t>& shape) {
  if (shape.empty()) return {1};
  return std::vector<hsize_t>(shape.begin(), shape.end());
}

int64_t global_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void for_each_run(const ShardedTensor& t,
                  const std::function<void(int64_t local, int64_t global, int64_t count)>& fn) {
  const int64_t elements = t.box.elements();
  if (elements == 0) return;
  const size_t rank = t.global_shape.size();
  if (rank == 0) return fn(0, 0, 1);
  // The trailing dimensions the box covers whole are one run with the first one it splits.
  size_t split = rank - 1;
  while (split > 0 && t.box.extent[split] == t.global_shape[split]) --split;
  int64_t run = 1;
  for (size_t d = split; d < rank; ++d) run *= t.box.extent[d];
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * t.global_shape[d];
  std::vector<int64_t> index(split, 0);  // position in the leading dimensions of the box
  for (int64_t local = 0; local < elements; local += run) {
    int64_t global = 0;
    for (size_t d = 0; d < rank; ++d)
      global += (t.box.offset[d] + (d < split ? index[d] : 0)) * stride[d];
    fn(local, global, run);
    for (size_t d = split; d-- > 0;) {
      if (++index[d] < t.box.extent[d]) break;
      index[d] = 0;
    }
  }
}

// --- metadata ----------------------------------------------------------------------------

void write_metadata(hid_t file, const CheckpointContents& c) {
  const TrainState& state = c.train_state;
  const std::string& config = c.config_text;
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
  hdf5::write_attribute(group, "data_order", state.data_order);
  hdf5::write_attribute(group, "loss_scale", state.loss_scale);
  hdf5::write_attribute(group, "loss_scale_clean_steps", state.loss_scale_clean_steps);
  hdf5::write_attribute(group, "best_metric", state.best_metric);
  hdf5::write_attribute(group, "evals_since_best", state.evals_since_best);
  hdf5::write_attribute(group, "best_metric_name", state.best_metric_name);
  group.close("cannot close group '/train_state'");
}

std::string read_format(hid_t file, const std::string& path) {
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  if (!hdf5::has_attribute(file, "format", bad, where)) {
    MESHTRAIN_BAD_INPUT("'", path,
                        "' is not a meshtrain checkpoint (its root has no 'format' attribute)");
  }
  const std::string format = hdf5::read_string_attribute(file, "format", bad, where);
  if (format != kFormat && format != kFormatFletcher) {
    MESHTRAIN_BAD_INPUT("checkpoint '", path, "' has format '", format, "'; this meshtrain reads '",
                        kFormat, "' and '", kFormatFletcher, "'");
  }
  return format;
}

CheckpointInfo read_metadata(hid_t file, const std::string& path) {
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string where = "checkpoint '" + path + "'";
  read_format(file, path);
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
  if (hdf5::has_attribute(group, "data_order", bad, gwhere)) {
    s.data_order = hdf5::read_string_attribute(group, "data_order", bad, gwhere);
  }
  if (hdf5::has_attribute(group, "loss_scale", bad, gwhere)) {
    s.loss_scale = hdf5::read_double_attribute(group, "loss_scale", bad, gwhere);
    s.loss_scale_clean_steps =
        hdf5::read_int_attribute(group, "loss_scale_clean_steps", bad, gwhere);
  }
  if (hdf5::has_attribute(group, "best_metric", bad, gwhere)) {
    s.best_metric = hdf5::read_double_attribute(group, "best_metric", bad, gwhere);
    s.evals_since_best = hdf5::read_int_attribute(group, "evals_since_best", bad, gwhere);
  }
  if (hdf5::has_attribute(group, "best_metric_name", bad, gwhere)) {
    s.best_metric_name = hdf5::read_string_attribute(group, "best_metric_name", bad, gwhere);
  }
  return info;
}

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

bool stored_as_bf16(hid_t dataset, hid_t type, const std::string& what) {
  const ErrorKind bad = ErrorKind::bad_input;
  return H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == 2 &&
         H5Tget_sign(type) == H5T_SGN_NONE && H5Tget_order(type) == H5T_ORDER_LE &&
         hdf5::has_attribute(dataset, kDtypeAttribute, bad, what) &&
         hdf5::read_string_attribute(dataset, kDtypeAttribute, bad, what) == kBf16Dtype;
}

std::vector<int64_t> logical_shape(hid_t dataset, const std::string& what) {
  std::vector<int64_t> shape = hdf5::dataset_shape(dataset, ErrorKind::bad_input, what);
  if (hdf5::has_attribute(dataset, "scalar", ErrorKind::bad_input, what) &&
      hdf5::read_int_attribute(dataset, "scalar", ErrorKind::bad_input, what) == 1) {
    shape.clear();
  }
  return shape;
}

namespace {
bool is_checksum_failure(const std::string& hdf5_text) {
  return hdf5_text.find("Fletcher32") != std::string::npos ||
         hdf5_text.find("checksum") != std::string::npos;
}
}  // namespace

[[noreturn]] void throw_read_failure(const std::string& dataset, const std::string& path) {
  const std::string text = hdf5::take_error_text();
  if (is_checksum_failure(text)) {
    MESHTRAIN_BAD_INPUT("dataset '", dataset, "' in checkpoint '", path,
                        "' is corrupt (Fletcher32 checksum mismatch): ", text);
  }
  MESHTRAIN_BAD_INPUT("cannot read dataset '", dataset, "' in checkpoint '", path, "': ", text);
}

Handle open_serial(const std::string& path, unsigned flags) {
  hdf5::silence_errors();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    MESHTRAIN_BAD_INPUT("checkpoint '", path, "' does not exist or is not a file");
  return hdf5::make(H5Fopen(path.c_str(), flags, H5P_DEFAULT), H5Fclose, ErrorKind::bad_input,
                    "cannot open checkpoint '" + path + "' as an HDF5 file");
}

// --- an online run's buffers ---------------------------------------------------------------

namespace {
constexpr const char* kRowsSeen = "/stream/rows_seen";
}

void write_stream_rows_seen(hid_t file, const std::vector<int64_t>& rows_seen,
                            const std::string& path) {
  if (rows_seen.empty()) return;
  const ErrorKind fail = ErrorKind::runtime;
  const std::string what =
      std::string("cannot write '") + kRowsSeen + "' in checkpoint file '" + path + "'";
  Handle lcpl = hdf5::make(H5Pcreate(H5P_LINK_CREATE), H5Pclose, fail, what);
  hdf5::check(H5Pset_create_intermediate_group(lcpl, 1), fail, what);
  const hsize_t dims[2] = {rows_seen.size() / 2, 2};
  Handle space = hdf5::make(H5Screate_simple(2, dims, nullptr), H5Sclose, fail, what);
  Handle dataset =
      hdf5::make(H5Dcreate2(file, kRowsSeen, H5T_STD_I64LE, space, lcpl, H5P_DEFAULT, H5P_DEFAULT),
                 H5Dclose, fail, what);
  hdf5::check(H5Dwrite(dataset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows_seen.data()),
              fail, what);
  hdf5::write_attribute(
      dataset, kChecksumAttribute,
      static_cast<uint64_t>(crc32_update(0, rows_seen.data(), rows_seen.size() * sizeof(int64_t))));
  dataset.close(what);
}

}  // namespace meshtrain::checkpoint_format

namespace meshtrain {

std::vector<int64_t> read_stream_rows_seen(const std::string& path) {
  using namespace checkpoint_format;
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  hdf5::silence_errors();
  Handle file = open_serial(path);
  const ErrorKind bad = ErrorKind::bad_input;
  const std::string what =
      std::string("cannot read '") + kRowsSeen + "' in checkpoint '" + path + "'";
  if (!hdf5::path_exists(file, kRowsSeen, bad, what)) return {};
  Handle dataset = hdf5::make(H5Dopen2(file, kRowsSeen, H5P_DEFAULT), H5Dclose, bad, what);
  const std::vector<int64_t> shape = hdf5::dataset_shape(dataset, bad, what);
  if (shape.size() != 2 || shape[1] != 2) {
    MESHTRAIN_BAD_INPUT(what, ": expected shape [groups, 2], found ", format_shape(shape));
  }
  std::vector<int64_t> values(static_cast<size_t>(shape[0] * 2));
  if (!values.empty() &&
      H5Dread(dataset, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0) {
    throw_read_failure(kRowsSeen, path);
  }
  const uint32_t stored =
      static_cast<uint32_t>(hdf5::read_uint_attribute(dataset, kChecksumAttribute, bad, what));
  const uint32_t computed = crc32_update(0, values.data(), values.size() * sizeof(int64_t));
  if (computed != stored) {
    MESHTRAIN_BAD_INPUT("dataset '", kRowsSeen, "' in checkpoint '", path,
                        "' is corrupt: the CRC-32 of its bytes is ", computed,
                        " but the file records ", stored);
  }
  return values;
}

}  // namespace meshtrain
