#pragma once
// Checkpoints (docs/design.md, "Checkpoints (HDF5)"): one HDF5 file per checkpoint, written
// collectively through MPI-IO. Layout of <dir>/ckpt-<step, 6+ digits>.h5:
//
//   /                       attributes: format, step, mesh ("dp=1 fsdp=4 ..."), mesh_axes,
//                           mesh_sizes, world_size, framework_version, config (TOML text)
//   /params/<name>          float32, the global shape; attribute spec = "P(fsdp, None)"
//   /opt_state/<slot>/<name> the same for each optimizer slot ("m", "v", "momentum")
//   /train_state            group; attributes step, epoch, batch_in_epoch, seed,
//                           rng_offset, optimizer_step
//
// Every dataset is chunked with a Fletcher32 checksum, so a flipped byte is an error on
// load. Each rank writes its own hyperslab (collective transfer); of the ranks holding the
// same replicated block only the one with coordinate 0 on every axis outside the spec
// writes it. A rank-0 (scalar) tensor is stored as shape [1] with attribute scalar = 1.
//
// A save goes to "<name>.tmp", is flushed (MPI_File_sync), closed, fsync'd and renamed;
// then <dir>/latest (the file name of the newest complete checkpoint, one line) is
// replaced atomically, and only then are checkpoints beyond `keep` removed. An
// interrupted save therefore leaves the previous checkpoint loadable.
//
// Loading reads each rank's block under the tensors' own (new) spec and mesh, so a
// checkpoint restores onto any mesh and world size with the same parameter names and
// shapes. All ranks agree on every failure: each function throws the same Error on every
// rank of the communicator (the message of the lowest failing rank).
//
// Fault injection (tests): env MESHTRAIN_FAULT_INJECT = after_dataset:<n> | before_close |
// before_rename | before_latest | before_cleanup makes save_checkpoint abort the process
// (std::abort) at that point.

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

// Where training stands, so a resumed run continues exactly.
struct TrainState {
  int64_t step = 0;            // optimizer steps completed (the checkpoint's step)
  int64_t epoch = 0;           // data cursor: the current epoch
  int64_t batch_in_epoch = 0;  // data cursor: the next batch within the epoch
  uint64_t seed = 0;           // the run's RNG seed
  uint64_t rng_offset = 0;     // draws made from the RNG stream so far (0 when unused)
  int64_t optimizer_step = 0;  // the optimizer's own counter (AdamW bias correction)
  bool operator==(const TrainState& o) const {
    return step == o.step && epoch == o.epoch && batch_in_epoch == o.batch_in_epoch &&
           seed == o.seed && rng_offset == o.rng_offset && optimizer_step == o.optimizer_step;
  }
};

// One optimizer state slot: one tensor per parameter, named like the parameter.
struct OptimizerSlot {
  std::string name;  // "m", "v", "momentum"
  std::vector<ShardedTensor> tensors;
};

// What a checkpoint holds. The tensors are shallow (Kokkos Views share their data), so a
// contents built from the trainer's tensors is saved without a copy, and a load writes
// straight into them. Tensor boxes must be those of this rank (comm rank) under `mesh`.
struct CheckpointContents {
  Mesh mesh;                // the mesh of the tensors; world size = size of the communicator
  TrainState train_state;   // its step names the file
  std::string config_text;  // the run's TOML text (saved; not changed by a load)
  std::vector<ShardedTensor> params;
  std::vector<OptimizerSlot> opt_state;
};

// What a load found besides the tensors.
struct CheckpointInfo {
  std::string path;  // the file that was read
  TrainState train_state;
  std::string mesh;               // the mesh it was saved on ("dp=1 fsdp=4 ep=1 tp=1 sp=1")
  int64_t world_size = 0;         // ranks that saved it
  std::string framework_version;  // meshtrain version that saved it
  std::string config_text;        // the run's config at save time
};

// "ckpt-000100.h5"
std::string checkpoint_file_name(int64_t step);

// The name of the pointer file in a checkpoint directory ("latest").
const char* latest_pointer_name();

// Writes a checkpoint of `contents` into `dir` (created when missing) and returns its
// path. Collective over `comm`. keep >= 1: checkpoints retained after this one is complete
// (this one included); keep <= 0 retains all. Throws runtime Errors (the same on every
// rank) with HDF5's / MPI's / the OS's own text when writing fails.
std::string save_checkpoint(const CheckpointContents& contents, const std::string& dir,
                            int64_t keep, MPI_Comm comm);

// The checkpoint that `dir`/latest names, or nullopt when `dir` has no latest pointer.
// Throws bad_input naming the pointer when it is unreadable, garbled, or names a file that
// does not exist. Not collective.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);

// Loads a checkpoint into preallocated tensors (for the NEW mesh: each tensor's spec, box
// and local block) and into.train_state. `path` is a checkpoint file or a directory (its
// latest pointer is followed). Collective over `comm`. Throws bad_input (the same on every
// rank) for a missing or garbled pointer or file, a file that is not a meshtrain
// checkpoint, a missing parameter or slot, a parameter in the file that the model lacks, a
// shape mismatch (naming the parameter and both shapes), and a dataset whose checksum
// fails (naming the dataset and the file).
CheckpointInfo load_checkpoint(const std::string& path, CheckpointContents& into, MPI_Comm comm);

// --- Reading without MPI (inspect) -------------------------------------------------------

struct DatasetListing {
  std::string path;            // "/params/layers/0/weight"
  std::vector<int64_t> shape;  // as stored
  std::string dtype;           // "float32", "int64", ...
  std::string spec;            // the spec attribute ("" when absent)
  std::vector<int64_t> chunk;  // empty when not chunked
  bool fletcher32 = false;
};

struct CheckpointListing {
  CheckpointInfo info;
  std::vector<DatasetListing> datasets;  // in name order
};

// Lists a checkpoint file with the serial HDF5 driver (no MPI needed). Throws bad_input
// naming the file when it cannot be opened or is not a meshtrain checkpoint.
CheckpointListing list_checkpoint(const std::string& path);

// Reads every dataset of a checkpoint fully (serial driver). Throws bad_input naming the
// dataset and the file when one fails its checksum or cannot be read. Returns the number
// of datasets read.
int64_t verify_checkpoint(const std::string& path);

}  // namespace meshtrain
