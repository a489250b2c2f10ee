// Loading checkpoints: finding the latest, and reading each rank's blocks under the new mesh
// (resharding) with every dataset's checksum checked.

#include <fcntl.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>

#include "base/error.hpp"
#include "framework/comm/communicator.hpp"  // checked_int
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/precision.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/checkpoint_checksums.hpp"
#include "framework/io/checkpoint_comm.hpp"
#include "framework/io/checkpoint_files.hpp"
#include "framework/io/checkpoint_format.hpp"
#include "framework/io/hdf5_util.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

namespace fs = std::filesystem;
using hdf5::Handle;
using namespace checkpoint_format;

namespace {

// Reads of at most this many bytes, each checksummed right after it arrives (while the
// kernel's read-ahead fetches the next).
constexpr int64_t kSliceBytes = int64_t{4} << 20;

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

// One tensor's block on the host as a load fills it: the tensor's own host view (the tensor
// itself on a host build), or, when the file's dtype is not the tensor's storage, the file's
// elements first (converted after the read: a bf16 dataset into an fp32 tensor exactly, an fp32
// one into a bf16 tensor to the nearest bf16).
struct HostBlock {
  typename Vector::HostMirror floats;  // a tensor stored as fp32
  HalfBits::HostMirror bits;           // a tensor stored as bf16
  std::vector<char> file_elements;     // the dataset's elements, when converted
  Dtype file = Dtype::fp32;            // the dataset's dtype
  bool convert = false;
  int64_t elements = 0;  // of the block

  int64_t file_element_bytes() const { return file == Dtype::fp32 ? 4 : 2; }
  // Where the read puts the dataset's elements (a converted block's buffer is made here, just
  // before its read).
  char* target() {
    if (convert) {
      file_elements.resize(static_cast<size_t>(elements * file_element_bytes()));
      return file_elements.data();
    }
    return floats.size() > 0 ? reinterpret_cast<char*>(floats.data())
                             : reinterpret_cast<char*>(bits.data());
  }
  // The file's elements into the tensor's storage (convert only; their buffer is released),
  // then the host block into the tensor. Called as soon as the block is read, so a load holds
  // one converted block's file elements at a time.
  void finish(ShardedTensor& t) {
    if (convert && t.stored_16bit()) {
      const float* from = reinterpret_cast<const float*>(file_elements.data());
      for (size_t i = 0; i < bits.size(); ++i) bits(i) = float_to_bf16(from[i]);
    } else if (convert) {
      const uint16_t* from = reinterpret_cast<const uint16_t*>(file_elements.data());
      for (size_t i = 0; i < floats.size(); ++i) floats(i) = bf16_to_float(from[i]);
    }
    std::vector<char>().swap(file_elements);
    if (t.stored_16bit()) {
      Kokkos::deep_copy(t.bits, bits);
    } else {
      Kokkos::deep_copy(t.local, floats);
    }
  }
};

HostBlock host_block(const ShardedTensor& t, Dtype file) {
  HostBlock block;
  block.file = file;
  block.convert = file != t.storage;
  if (t.stored_16bit()) {
    block.bits = host_mirror(t.bits);
  } else {
    block.floats = host_mirror(t.local);
  }
  block.elements = t.box.elements();
  return block;
}

// Checks a dataset against the model's tensor: present, the same shape, float32 or bf16 (uint16
// with attribute dtype = "bf16"); `stored` is set to which.
Handle open_dataset(hid_t file, const DatasetEntry& entry, const std::string& path, Dtype& stored) {
  const ErrorKind bad = ErrorKind::bad_input;
  const ShardedTensor& t = *entry.tensor;
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
  Handle type = hdf5::make(H5Dget_type(dataset), H5Tclose, bad, what);
  // Little-endian IEEE only: format 2 reads the stored bytes raw, so another float would load
  // as wrong values rather than be converted.
  const htri_t ieee_f32le = H5Tequal(type, H5T_IEEE_F32LE);
  hdf5::check(ieee_f32le < 0 ? -1 : 0, bad, what);  // names HDF5's own error
  if (ieee_f32le > 0) {
    stored = Dtype::fp32;
    return dataset;
  }
  if (stored_as_bf16(dataset, type, what)) {
    stored = Dtype::bf16;
    return dataset;
  }
  MESHTRAIN_BAD_INPUT("dataset '", entry.path, "' in checkpoint '", path,
                      "' is neither little-endian float32 nor bf16 (little-endian uint16 with "
                      "attribute ",
                      kDtypeAttribute, " = \"", kBf16Dtype, "\")");
}

// Format 1: HDF5 reads the box (Fletcher32 checked by its filter).
void read_with_hdf5(hid_t dataset, const DatasetEntry& entry, const std::string& path, char* host) {
  const ErrorKind bad = ErrorKind::bad_input;
  const ShardedTensor& t = *entry.tensor;
  if (t.box.elements() == 0) return;
  const std::string what = "cannot read dataset '" + entry.path + "' in checkpoint '" + path + "'";
  std::vector<hsize_t> start(t.box.offset.begin(), t.box.offset.end());
  std::vector<hsize_t> count(t.box.extent.begin(), t.box.extent.end());
  if (start.empty()) start = {0}, count = {1};  // a scalar, stored as [1]
  Handle file_space = hdf5::make(H5Dget_space(dataset), H5Sclose, bad, what);
  hdf5::check(
      H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
      bad, what);
  Handle mem_space = hdf5::make(
      H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose, bad, what);
  if (H5Dread(dataset, H5T_NATIVE_FLOAT, mem_space, file_space, H5P_DEFAULT, host) < 0) {
    throw_read_failure(entry.path, path);
  }
}

// Format 2: pread of the box's runs at the dataset's offset, with their CRC-32s when this rank
// owns the block.
// `host` receives the dataset's elements of `size` bytes each.
void read_with_posix(int fd, int64_t base, int64_t dataset_index, const DatasetEntry& entry,
                     const std::string& path, char* host, int64_t size,
                     std::vector<Piece>& pieces) {
  for_each_run(*entry.tensor, [&](int64_t local, int64_t global, int64_t count) {
    char* bytes = host + local * size;
    const int64_t length = count * size;
    uint32_t crc = 0;
    for (int64_t done = 0; done < length;) {
      const int64_t want = std::min(kSliceBytes, length - done);
      const ssize_t n = ::pread(fd, bytes + done, static_cast<size_t>(want),
                                static_cast<off_t>(base + global * size + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        MESHTRAIN_BAD_INPUT("cannot read dataset '", entry.path, "' in checkpoint '", path,
                            "': ", os_error(errno));
      }
      if (n == 0) {
        MESHTRAIN_BAD_INPUT("checkpoint '", path, "' is truncated: dataset '", entry.path,
                            "' ends past the end of the file");
      }
      if (entry.owner) crc = crc32_update(crc, bytes + done, static_cast<size_t>(n));
      done += n;
    }
    if (entry.owner) append_piece(pieces, Piece{dataset_index, global * size, length, crc, 0});
  });
}

}  // namespace

namespace {
// The checkpoint the pointer `name` in `dir` names; `what` says which ("latest-checkpoint").
std::optional<std::string> find_pointed_checkpoint(const std::string& dir, const char* name,
                                                   const char* what) {
  const std::optional<std::string> text = read_pointer(dir, name);
  if (!text) return std::nullopt;
  const std::string pointer = (fs::path(dir) / name).string();
  if (!std::regex_match(*text, checkpoint_name_pattern())) {
    std::string shown = text->substr(0, 80);
    for (char& ch : shown) {
      if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
    }
    MESHTRAIN_BAD_INPUT("the ", what, " pointer '", pointer, "' is garbled: it holds '", shown,
                        "', not a checkpoint file name like '", checkpoint_file_name(100), "'");
  }
  const fs::path file = fs::path(dir) / *text;
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) {
    MESHTRAIN_BAD_INPUT("the ", what, " pointer '", pointer, "' names '", *text,
                        "', which does not exist");
  }
  return file.string();
}
}  // namespace

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  return find_pointed_checkpoint(dir, latest_pointer_name(), "latest-checkpoint");
}

std::optional<std::string> find_best_checkpoint(const std::string& dir) {
  return find_pointed_checkpoint(dir, best_pointer_name(), "best-checkpoint");
}

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
  // A pointer file (".../latest", ".../best") stands for the checkpoint it names.
  const std::string name = fs::path(path).filename().string();
  const std::string dir = fs::path(path).parent_path().string();
  if (name == latest_pointer_name()) return *find_latest_checkpoint(dir.empty() ? "." : dir);
  if (name == best_pointer_name()) return *find_best_checkpoint(dir.empty() ? "." : dir);
  return path;
}

CheckpointInfo load_checkpoint(const std::string& path_in, CheckpointContents& into,
                               MPI_Comm user_comm) {
  PrivateComm comm(user_comm);
  const ErrorKind bad = ErrorKind::bad_input;
  std::vector<DatasetEntry> entries;
  std::string path;
  on_every_rank(comm.get(), [&] {
    MESHTRAIN_REQUIRE(into.mesh.world_size() == comm.size(), "checkpoint: the mesh (",
                      into.mesh.describe(), ") has ", into.mesh.world_size(),
                      " ranks but the communicator has ", comm.size());
    entries = dataset_entries(into, comm.rank());
    if (comm.rank() == 0) path = resolve_checkpoint_path(path_in);
  });
  broadcast_string(path, 0, comm.get(), "MPI_Ibcast (the checkpoint path)");

  // Every rank opens the file on its own (serial HDF5, read only) and reads its blocks: no
  // collective call until all have agreed that they succeeded.
  CheckpointInfo info;
  bool crc_format = false;
  std::vector<Piece> pieces;
  std::vector<uint32_t> stored;  // rank 0: each dataset's stored CRC-32
  std::vector<int64_t> dataset_bytes;
  on_every_rank(comm.get(), [&] {
    const std::string where = "checkpoint '" + path + "'";
    std::vector<int64_t> offsets;
    std::vector<HostBlock> hosts;
    {
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      Handle file = open_serial(path);
      info = read_metadata(file, path);
      crc_format = read_format(file, path) == kFormat;
      check_parameter_names(file, into, path);
      for (const DatasetEntry& entry : entries) {
        const ShardedTensor& t = *entry.tensor;
        const std::string what = "cannot read dataset '" + entry.path + "' in " + where;
        MESHTRAIN_REQUIRE(t.storage != Dtype::fp16, "checkpoint: tensor '", t.name,
                          "' is stored as fp16, which checkpoints do not hold");
        Dtype file_dtype = Dtype::fp32;
        Handle dataset = open_dataset(file, entry, path, file_dtype);
        hosts.push_back(host_block(t, file_dtype));
        dataset_bytes.push_back(global_elements(t.global_shape) *
                                hosts.back().file_element_bytes());
        if (!crc_format) {
          MESHTRAIN_REQUIRE(file_dtype == Dtype::fp32, "dataset '", entry.path, "' in ", where,
                            ": format 1 holds float32 only");
          read_with_hdf5(dataset, entry, path, hosts.back().target());
          hosts.back().finish(*entry.tensor);
          continue;
        }
        const haddr_t address = H5Dget_offset(dataset);
        if (address == HADDR_UNDEF && dataset_bytes.back() > 0) {
          MESHTRAIN_BAD_INPUT("dataset '", entry.path, "' in ", where,
                              " is not stored contiguously (or holds no data)");
        }
        offsets.push_back(static_cast<int64_t>(address));
        if (comm.rank() == 0) {
          if (!hdf5::has_attribute(dataset, kChecksumAttribute, bad, what)) {
            MESHTRAIN_BAD_INPUT("dataset '", entry.path, "' in ", where, " has no '",
                                kChecksumAttribute, "' attribute");
          }
          stored.push_back(static_cast<uint32_t>(
              hdf5::read_uint_attribute(dataset, kChecksumAttribute, bad, what)));
        }
      }
      file.close("cannot close " + where);
    }
    if (crc_format) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) MESHTRAIN_BAD_INPUT("cannot open ", where, ": ", os_error(errno));
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint: its failure changes nothing
      try {
        for (size_t i = 0; i < entries.size(); ++i) {
          read_with_posix(fd, offsets[i], static_cast<int64_t>(i), entries[i], path,
                          hosts[i].target(), hosts[i].file_element_bytes(), pieces);
          hosts[i].finish(*entries[i].tensor);
        }
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
    }
    checked_int(pieces.size() * sizeof(Piece), "the checksums of a checkpoint (bytes)");
  });
  if (crc_format) {
    const std::vector<Piece> all = gather_pieces(comm, pieces);
    on_every_rank(comm.get(), [&] {
      if (comm.rank() != 0) return;
      const std::vector<uint32_t> crcs = combine_pieces(all, dataset_bytes, entries);
      for (size_t i = 0; i < crcs.size(); ++i) {
        if (crcs[i] != stored[i]) {
          MESHTRAIN_BAD_INPUT("dataset '", entries[i].path, "' in checkpoint '", path,
                              "' is corrupt: the CRC-32 of its bytes is ", crcs[i],
                              " but the file records ", stored[i]);
        }
      }
    });
  }
  into.train_state = info.train_state;
  return info;
}

}  // namespace meshtrain
