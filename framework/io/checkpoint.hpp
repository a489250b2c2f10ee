#pragma once
// Checkpoints: one HDF5 file per checkpoint. Layout of <dir>/ckpt-<step, 6+ digits>.h5:
//
//   /                       attributes: format, step, mesh ("dp=1 fsdp=4 ..."), mesh_axes,
//                           mesh_sizes, world_size, framework_version, config (TOML text)
//   /params/<name>          float32, the global shape, contiguous; attributes spec =
//                           "P(fsdp, None)" and crc32 (of its raw bytes, as zlib.crc32)
//   /opt_state/<slot>/<name> the same for each optimizer slot ("m", "v", "momentum")
//   /train_state            group; attributes step, epoch, batch_in_epoch, seed,
//                           rng_offset, optimizer_step, data_order
//   /normalization/...      float64 statistics of data.normalize_inputs / normalize_targets
//                           with a crc32 attribute each (normalization.hpp; absent when off).
//                           Written whole by rank 0 with the structure; read with
//                           read_normalization, not by load_checkpoint
//   /stream/<name>          an online run's buffers (docs/online.md): float32 tensors as
//                           /params (x, y, held_out_x, held_out_y: [groups, rows, width]);
//   /stream/rows_seen       int64 [groups, 2], written whole by rank 0 with the structure
//                           (read with read_stream_rows_seen); absent when none
//
// A rank-0 (scalar) tensor is stored as shape [1] with attribute scalar = 1. A flipped byte
// fails the dataset's CRC-32 on load and in verify_checkpoint. Of the ranks holding the same
// replicated block only the one with coordinate 0 on every axis outside the spec writes it.
//
// How a save runs (checkpoint_save.cpp): rank 0 creates the file's structure (serial HDF5,
// space allocated, no data) as "<name>.tmp"; every rank then writes its blocks' bytes at their
// offsets with POSIX pwrite, computing CRC-32s as it goes, and fsyncs; rank 0 combines the
// CRC-32s, stores them, fsyncs and renames the file; then <dir>/best when this save is the
// best evaluation's, then <dir>/latest (the file name of the newest complete checkpoint, one
// line) are replaced atomically, and only then are checkpoints beyond `keep` removed. An
// interrupted or failed save therefore leaves the previous checkpoint as latest, loadable,
// and `best` naming a complete checkpoint (the new one only when it was renamed).
//
// Asynchronous saves (Checkpointer with async = true): save() returns once the write is
// started; a writer thread per rank copies the tensors into a staging buffer allocated once
// (pinned host memory on CUDA builds, where the copy is made before save() returns), then
// writes the file. Every MPI call is made by the thread that calls the Checkpointer (so
// MPI_THREAD_FUNNELED suffices); the writer threads make no MPI and no HDF5 call; rank 0's
// finisher thread (checksums, rename, latest) calls HDF5 only under hdf5::global_mutex(),
// which the checkpoint functions all hold around their HDF5 calls. The caller must call
// wait_snapshot() before it changes the tensors (the optimizer step), and poll() each step or
// wait() to finish the checkpoint.
//
// Loading reads each rank's block under the tensors' own (new) spec and mesh, so a
// checkpoint restores onto any mesh and world size with the same parameter names and
// shapes. All ranks agree on every failure: each function throws the same Error on every
// rank of the communicator (the message of the lowest failing rank). No collective call
// follows a point where one rank alone can fail without the ranks agreeing first.

#include <mpi.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "framework/core/sharded_tensor.hpp"
#include "framework/io/normalization.hpp"
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
  // The data order's name (DataOrder::name()); empty in checkpoints saved before it was
  // recorded, whose shuffled order was a Fisher-Yates table of every row.
  std::string data_order;
  // fp16 loss scaling (framework/train/loss_scaler.hpp): the scale and the clean steps since
  // it last changed; 0 and 0 in runs without it (and in checkpoints saved before it).
  double loss_scale = 0.0;
  int64_t loss_scale_clean_steps = 0;
  // The best evaluation so far by the run's metric (checkpoint.keep_best, else the test
  // loss; NaN before the first) and the evaluations since it (train.early_stopping).
  double best_metric = std::numeric_limits<double>::quiet_NaN();
  int64_t evals_since_best = 0;
  // What best_metric measures ("test_loss", "test_accuracy": to_string(EvalMetric)), so that a
  // resume under another checkpoint.keep_best does not compare an accuracy as a loss; empty in
  // checkpoints saved before it was recorded.
  std::string best_metric_name;
  bool operator==(const TrainState& o) const {
    const bool same_best =
        best_metric == o.best_metric || (std::isnan(best_metric) && std::isnan(o.best_metric));
    return step == o.step && epoch == o.epoch && batch_in_epoch == o.batch_in_epoch &&
           seed == o.seed && rng_offset == o.rng_offset && optimizer_step == o.optimizer_step &&
           data_order == o.data_order && loss_scale == o.loss_scale &&
           loss_scale_clean_steps == o.loss_scale_clean_steps && same_best &&
           evals_since_best == o.evals_since_best && best_metric_name == o.best_metric_name;
  }
};

// One optimizer state slot: one tensor per parameter, named like the parameter.
struct OptimizerSlot {
  std::string name;  // "m", "v", "momentum"
  std::vector<ShardedTensor> tensors;
};

// An online run's buffers (data.source = "stream", stream.checkpoint_buffer): saved under
// /stream, loaded by load_checkpoint as the other tensors when `tensors` is not empty.
struct StreamCheckpoint {
  std::vector<ShardedTensor> tensors;  // /stream/<name>
  // Rank 0's, for a save: per batch group the rows its training buffer and its held-out
  // window have seen, [groups x 2] (the rest of the buffers' state follows from them).
  std::vector<int64_t> rows_seen;
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
  Normalization normalization;  // saved under /normalization (none: no group)
  StreamCheckpoint stream;      // saved under /stream (no tensors: no group)
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

// The names of the pointer files in a checkpoint directory: "latest" (the newest complete
// checkpoint) and "best" (the best evaluation's, with checkpoint.keep_best; never removed
// by rotation).
const char* latest_pointer_name();
const char* best_pointer_name();

// Writes a checkpoint of `contents` into `dir` (created when missing) and returns its
// path, synchronously (a Checkpointer with async = false). Collective over `comm`. keep >= 1:
// checkpoints retained after this one is complete (this one included); keep <= 0 retains all.
// Throws runtime Errors (the same on every rank) with HDF5's / MPI's / the OS's own text when
// writing fails.
std::string save_checkpoint(const CheckpointContents& contents, const std::string& dir,
                            int64_t keep, MPI_Comm comm);

namespace checkpoint_format {
struct SaveJob;
class PrivateComm;
}  // namespace checkpoint_format

// Saves checkpoints of one run, synchronously or in the background. Every member function is
// collective over the communicator unless it says otherwise, and must be called from the
// thread that makes the program's MPI calls.
// Whether a save copies the tensors to a host staging buffer first: asynchronous saves
// always do (the next step changes the tensors), synchronous ones when the tensors live in
// device memory (a CUDA build). What `meshtrain plan` counts as checkpoint staging.
bool checkpoint_stages_tensors(bool async);

class Checkpointer {
 public:
  Checkpointer(MPI_Comm comm, bool async);
  // Waits for the writer thread (not collective: the checkpoint in flight stays a .tmp file
  // and `latest` keeps naming the previous one). Call wait() first to complete it.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Starts a checkpoint of `contents` into `dir` (see save_checkpoint) and returns the path it
  // will have. Waits for (and completes) the one in flight first. With async = false it
  // returns when the checkpoint is complete. Throws as save_checkpoint, on every rank.
  // `best`: once complete it is also the checkpoint the "best" pointer names (rotation keeps
  // that file whatever `keep` says).
  std::string save(const CheckpointContents& contents, const std::string& dir, int64_t keep,
                   bool best = false);

  // Not collective: returns once the tensors given to the last save() have been copied (at
  // once when no save is in flight). Call it before changing them.
  void wait_snapshot();

  // Moves the write in flight on when every rank has finished its part (as every rank saw it
  // at the previous poll: one MPI_Iallreduce of an int per call, read at the next, so no poll
  // waits for a slower rank) and returns the checkpoint's path once it is complete (CRC-32s,
  // rename, latest, clean-up); nullopt otherwise, and at once when nothing is in flight.
  // Throws the save's error.
  std::optional<std::string> poll();

  // Waits for the write in flight and completes it; returns its path (nullopt when none was
  // in flight). Throws the save's error (the same on every rank; the checkpoint is not made).
  std::optional<std::string> wait();

  bool in_flight() const { return job_ != nullptr; }
  bool async() const { return async_; }

 private:
  std::unique_ptr<checkpoint_format::PrivateComm> comm_;
  bool async_ = true;
  // The staging buffer (this rank's blocks), allocated by the first asynchronous save and
  // kept; grown only when a later save holds more.
  struct Staging;
  std::unique_ptr<Staging> staging_;
  std::unique_ptr<checkpoint_format::SaveJob> job_;
};

// The checkpoint that `dir`/latest names, or nullopt when `dir` has no latest pointer.
// Throws bad_input naming the pointer when it is unreadable, garbled, or names a file that
// does not exist. Not collective.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);
// The same for the "best" pointer.
std::optional<std::string> find_best_checkpoint(const std::string& dir);

// The checkpoint file that `path` names: a checkpoint file itself, a directory (the file its
// latest pointer names) or a `latest` / `best` pointer file (the file it names). Throws
// bad_input naming the path when it does not exist, the directory has no latest pointer, or
// a pointer is garbled or names a missing file. Not collective (load_checkpoint resolves
// on rank 0 and broadcasts).
std::string resolve_checkpoint_path(const std::string& path);

// Loads a checkpoint into preallocated tensors (for the NEW mesh: each tensor's spec, box
// and local block) and into.train_state. `path` is a checkpoint file or a directory (its
// latest pointer is followed). Collective over `comm`. Throws bad_input (the same on every
// rank) for a missing or garbled pointer or file, a file that is not a meshtrain
// checkpoint, a missing parameter or slot, a parameter in the file that the model lacks, a
// shape mismatch (naming the parameter and both shapes), and a dataset whose checksum
// fails (naming the dataset and the file).
CheckpointInfo load_checkpoint(const std::string& path, CheckpointContents& into, MPI_Comm comm);

// /stream/rows_seen of a checkpoint file ([groups x 2], row-major), read with the serial driver
// and checked against its crc32 attribute; empty when the file holds no stream buffer. Throws
// bad_input naming the file when it cannot be read. Not collective.
std::vector<int64_t> read_stream_rows_seen(const std::string& path);

// --- Reading without MPI (inspect) -------------------------------------------------------

struct DatasetListing {
  std::string path;            // "/params/layers/0/weight"
  std::vector<int64_t> shape;  // as stored
  std::string dtype;           // "float32", "int64", ...
  std::string spec;            // the spec attribute ("" when absent)
  std::vector<int64_t> chunk;  // empty when not chunked
  std::string checksum;        // "crc32", "fletcher32" (format 1) or "" (none)
};

struct CheckpointListing {
  CheckpointInfo info;
  std::vector<DatasetListing> datasets;  // in name order
};

// Lists a checkpoint file with the serial HDF5 driver (no MPI needed). Throws bad_input
// naming the file when it cannot be opened or is not a meshtrain checkpoint.
CheckpointListing list_checkpoint(const std::string& path);

// Reads every dataset of a checkpoint fully (serial driver) and checks its checksum. Throws
// bad_input naming the dataset and the file when one fails its checksum or cannot be read.
// Returns the number of datasets read.
int64_t verify_checkpoint(const std::string& path);

// One dataset read whole: its name below the group read ("layers/0/weight"), its logical
// shape and its values (row-major).
struct CheckpointArray {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Reads every dataset below `group` ("/params") of a checkpoint file fully with the serial
// driver (no MPI needed), checking each one's checksum as verify_checkpoint does, in name
// order. Throws bad_input naming the file when it is not a checkpoint or has no such group,
// and naming the dataset when one fails its checksum, cannot be read or is not float32.
std::vector<CheckpointArray> read_checkpoint_arrays(const std::string& path,
                                                    const std::string& group);

}  // namespace meshtrain
