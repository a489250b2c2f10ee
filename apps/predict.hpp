#pragma once
// `meshtrain predict CHECKPOINT --input PATH... --output FILE.h5 [--overwrite] [--set k=v ...]
// [--batch-size N] [--flight-dir DIR] [--jacobian [--jacobian-mode auto|forward|reverse]]`: a
// Predictor (run/predictor.hpp) over HDF5 inputs, streamed in file order, written as one HDF5
// file by all ranks (docs/running.md, "predict"); with --jacobian also /jacobian [N, outputs,
// inputs], the derivatives of each row's outputs by its inputs (docs/derivatives.md).

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain {

// What a completed predict did (for benchmarks).
struct PredictSummary {
  int64_t rows = 0;
  double seconds = 0.0;  // the batches' loop: reading, predicting and writing, no set-up
};

struct PredictOptions {
  std::string checkpoint;              // a file, a latest/best pointer or a checkpoint directory
  std::vector<std::string> inputs;     // HDF5 files or globs (as data.path)
  std::string output;                  // FILE.h5: written as FILE.h5.tmp, renamed when complete
  bool overwrite = false;              // replace an existing output
  std::vector<std::string> overrides;  // --set: only keys that do not change the model
  // --flight-dir DIR: the flight recorder (runtime.flight_records) writes DIR/flight/; empty:
  // no records (never the training run's folder named in the checkpoint's config).
  std::string flight_dir;
  int64_t batch_size = 0;             // global rows per batch; 0: the checkpoint's
  double progress_seconds = 2.0;      // rank 0 prints a progress line this often
  PredictSummary* summary = nullptr;  // filled when the output is complete (may be null)
  // --jacobian: also /jacobian; --jacobian-mode: auto | forward | reverse (parse_jacobian_mode).
  bool jacobian = false;
  std::string jacobian_mode = "auto";
};

// Collective over MPI_COMM_WORLD. Returns the exit status: 0, or 2 / 1 when an error every
// rank agreed on (bad input, a failed read or write) was printed once on rank 0; the output
// is then absent (no FILE, no FILE.tmp). Errors that strike only some ranks propagate as
// exceptions: the caller ends every rank (run_or_abort).
int predict_command(const PredictOptions& options);

}  // namespace meshtrain
