#pragma once
// The checkpoint file format, shared by checkpoint_save.cpp, checkpoint_load.cpp and
// checkpoint_inspect.cpp: names, metadata attributes, the datasets and where a block's bytes
// lie in them. Internal to the checkpoint code; the public interface is
// framework/io/checkpoint.hpp. The rest of the checkpoint internals: checkpoint_checksums.hpp
// (per-dataset CRC-32 and how ranks combine theirs), checkpoint_comm.hpp (the private
// communicator), checkpoint_files.hpp (file helpers).
//
// Format 2 (written now): every dataset is contiguous (no chunks, no filter), allocated when
// the file is created, and carries attribute crc32 = the CRC-32 (zlib's polynomial, as
// Python's zlib.crc32) of its raw little-endian bytes in row-major order. Rank 0 creates the
// file's structure with serial HDF5; each rank then writes its blocks' bytes at the dataset's
// file offset with POSIX I/O, computing the CRC-32 of each contiguous run; rank 0 combines the
// runs of all ranks into each dataset's CRC-32 (crc32_combine) and stores it before the
// rename. Format 1 (read only): chunked datasets with HDF5's Fletcher32 filter.

#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "framework/io/checkpoint.hpp"
#include "framework/io/hdf5_util.hpp"

namespace meshtrain::checkpoint_format {

constexpr const char* kFormat = "meshtrain-checkpoint-2";
constexpr const char* kFormatFletcher = "meshtrain-checkpoint-1";  // read only
constexpr const char* kChecksumAttribute = "crc32";
// A tensor stored as bf16 (ShardedTensor::storage; a DLRM's tables under model.table_dtype =
// "bf16"): a uint16 dataset of its bf16 bits with attribute dtype = "bf16" (h5py reads it as
// uint16; (bits.astype(uint32) << 16).view(float32) are its values). Every other dataset is
// float32 without the attribute.
constexpr const char* kDtypeAttribute = "dtype";
constexpr const char* kBf16Dtype = "bf16";

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

// Rank 0, creating a file: the normalization statistics (normalization.hpp) as float64
// datasets under /normalization, each with its crc32 attribute; nothing when there are none.
void write_normalization(hid_t file, const Normalization& normalization, const std::string& path);

// Rank 0, creating a file: an online run's /stream/rows_seen (int64 [groups, 2], with its
// crc32 attribute); nothing when `rows_seen` is empty.
void write_stream_rows_seen(hid_t file, const std::vector<int64_t>& rows_seen,
                            const std::string& path);

// --- metadata ----------------------------------------------------------------------------

void write_metadata(hid_t file, const CheckpointContents& c);
CheckpointInfo read_metadata(hid_t file, const std::string& path);
std::string read_format(hid_t file, const std::string& path);

// Every dataset below `group_path`, as paths relative to it, prefixed by `prefix`.
void collect_datasets(hid_t file, const std::string& group_path, const std::string& prefix,
                      std::vector<std::string>& out, const std::string& where);

// The shape a dataset stands for (a stored [1] with attribute scalar = 1 is rank 0).
std::vector<int64_t> logical_shape(hid_t dataset, const std::string& what);

// Whether a dataset of type `type` holds a bf16 tensor: unsigned little-endian 16-bit integers
// (the bits, as the format-2 reads take them raw) with attribute dtype = "bf16" (kDtypeAttribute,
// kBf16Dtype).
bool stored_as_bf16(hid_t dataset, hid_t type, const std::string& what);

// A failed H5Dread of `dataset`: bad_input, "corrupt" when HDF5 says a checksum failed.
[[noreturn]] void throw_read_failure(const std::string& dataset, const std::string& path);

// Opens a checkpoint read-only with the serial driver; bad_input naming it otherwise.
hdf5::Handle open_serial(const std::string& path, unsigned flags = H5F_ACC_RDONLY);

}  // namespace meshtrain::checkpoint_format
