#pragma once
// What checkpoint_save.cpp, checkpoint_load.cpp and checkpoint_inspect.cpp share: the file
// format (names, metadata attributes, where a block's bytes lie in a dataset), the per-dataset
// CRC-32 and how ranks combine theirs, the private communicator and small file helpers.
// Internal to the checkpoint code; the public interface is framework/checkpoint.hpp.
//
// Format 2 (written now): every dataset is contiguous (no chunks, no filter), allocated when
// the file is created, and carries attribute crc32 = the CRC-32 (zlib's polynomial, as
// Python's zlib.crc32) of its raw little-endian bytes in row-major order. Rank 0 creates the
// file's structure with serial HDF5; each rank then writes its blocks' bytes at the dataset's
// file offset with POSIX I/O, computing the CRC-32 of each contiguous run; rank 0 combines the
// runs of all ranks into each dataset's CRC-32 (crc32_combine) and stores it before the
// rename. Format 1 (read only): chunked datasets with HDF5's Fletcher32 filter.

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <regex>
#include <string>
#include <vector>

#include "framework/io/checkpoint.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain::checkpoint_format {

constexpr const char* kFormat = "meshtrain-checkpoint-2";
constexpr const char* kFormatFletcher = "meshtrain-checkpoint-1";  // read only
constexpr const char* kChecksumAttribute = "crc32";

// --- MPI -------------------------------------------------------------------------------

// A private duplicate of the caller's communicator that returns MPI errors instead of
// aborting, so each can be reported with MPI_Error_string. Collective to make.
class PrivateComm {
 public:
  explicit PrivateComm(MPI_Comm comm);
  PrivateComm(const PrivateComm&) = delete;
  PrivateComm& operator=(const PrivateComm&) = delete;
  ~PrivateComm();
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

// --- tensors and their bytes in the file ------------------------------------------------

struct DatasetEntry {
  std::string path;   // "/params/layers/0/weight"
  std::string label;  // "parameter 'layers/0/weight'" (for messages)
  ShardedTensor* tensor;
  bool owner = false;  // this rank writes (and on load checksums) its block: see owns_block
};

// The datasets of `c` in file order (params, then each slot), checked for names, duplicates
// and boxes; owner set for `rank` of c.mesh.
std::vector<DatasetEntry> dataset_entries(const CheckpointContents& c, int rank);

// The dataset shape of a tensor: rank-0 tensors are stored as [1].
std::vector<hsize_t> stored_dims(const std::vector<int64_t>& shape);
int64_t global_elements(const std::vector<int64_t>& shape);

// Calls fn(local_element, dataset_element, count) for each contiguous run of a tensor's box
// in the row-major dataset, in increasing order of both offsets.
void for_each_run(const ShardedTensor& t,
                  const std::function<void(int64_t local, int64_t global, int64_t count)>& fn);

// --- checksums ---------------------------------------------------------------------------

// CRC-32 of `bytes` continuing from `crc` (0 to start): ISA-L's when built with it, zlib's
// otherwise (the same value).
uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes);

// The CRC-32 of one contiguous byte range of a dataset, computed by one rank.
struct Piece {
  int64_t dataset = 0;  // index in dataset_entries order
  int64_t offset = 0;   // bytes from the dataset's start
  int64_t length = 0;   // bytes
  uint32_t crc = 0;
  uint32_t pad = 0;
};

// Appends a piece, merging it into the last one when it continues it.
void append_piece(std::vector<Piece>& pieces, const Piece& piece);

// Collective: gathers every rank's pieces at rank 0. `count` must have been checked by
// checked_int before (no local failure point may precede this call).
std::vector<Piece> gather_pieces(const PrivateComm& comm, const std::vector<Piece>& mine);

// Rank 0: each dataset's CRC-32 from the pieces of all ranks, which must tile every dataset
// (dataset_bytes[i] long) exactly; a runtime Error naming the dataset otherwise.
std::vector<uint32_t> combine_pieces(std::vector<Piece> pieces,
                                     const std::vector<int64_t>& dataset_bytes,
                                     const std::vector<DatasetEntry>& entries);

// --- metadata ----------------------------------------------------------------------------

void write_metadata(hid_t file, const CheckpointContents& c);
CheckpointInfo read_metadata(hid_t file, const std::string& path);
std::string read_format(hid_t file, const std::string& path);

// Every dataset below `group_path`, as paths relative to it, prefixed by `prefix`.
void collect_datasets(hid_t file, const std::string& group_path, const std::string& prefix,
                      std::vector<std::string>& out, const std::string& where);

// The shape a dataset stands for (a stored [1] with attribute scalar = 1 is rank 0).
std::vector<int64_t> logical_shape(hid_t dataset, const std::string& what);

// A failed H5Dread of `dataset`: bad_input, "corrupt" when HDF5 says a checksum failed.
[[noreturn]] void throw_read_failure(const std::string& dataset, const std::string& path);

// Opens a checkpoint read-only with the serial driver; bad_input naming it otherwise.
hdf5::Handle open_serial(const std::string& path, unsigned flags = H5F_ACC_RDONLY);

// --- files -------------------------------------------------------------------------------

// "ckpt-<digits>.h5", the step in group 1.
const std::regex& checkpoint_name_pattern();
std::string os_error(int err);
void fsync_path(const std::string& path, bool directory);
void rename_path(const std::string& from, const std::string& to);

}  // namespace meshtrain::checkpoint_format
