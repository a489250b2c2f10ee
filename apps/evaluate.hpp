#pragma once
// `meshtrain evaluate CHECKPOINT --data PATH... [--json FILE|-] [--set k=v ...]
// [--flight-dir DIR]`: the metrics of a checkpoint's model on labelled data (docs/running.md,
// "Evaluating a checkpoint").
//
// It is a TrainingRun of the checkpoint's stored config with data.test_path = --data (and
// data.path too: the run needs a training set's shape), nothing resumed and nothing written
// (the flight recorder off, or run.output_dir = --flight-dir; no trace), checkpoint.init_from = the checkpoint (TrainingRun::load_model at set-up: its parameters
// and normalization statistics, resharded) and one TrainingRun::evaluate(): so on
// the checkpoint config's mesh and evaluation batch (the defaults) it gives the run's own
// last evaluation to the bit. --set may change only what does not change the model or the
// data's meaning: mesh.*, partition.*, runtime.*, mixed_precision.* and data.batch_size,
// data.eval_batch_size, data.prefetch, data.x_key, data.y_key.

#include <string>
#include <vector>

namespace meshtrain {

struct EvaluateArgs {
  std::string checkpoint;              // a file, a latest/best pointer, or a directory
  std::vector<std::string> data;       // HDF5 files or globs, as data.path
  std::string json;                    // "" = none, "-" = standard output, else a file
  std::vector<std::string> overrides;  // --set section.key=value
  // --flight-dir DIR: the flight recorder (runtime.flight_records) writes DIR/flight/; empty:
  // no records. Never the training run's folder (run.output_dir of the checkpoint's config):
  // the records a hung run left there are what someone evaluating its checkpoint looks for.
  std::string flight_dir;
};

// Collective over MPI_COMM_WORLD (the Runtime must exist). Prints the metrics on rank 0 and
// writes the JSON object (rank 0; a file is written under a temporary name and renamed).
// Returns 0, or 2 / 1 when an error every rank agreed on (bad input, a failed read) was
// printed once on rank 0. Errors that strike only some ranks propagate (run_or_abort).
int evaluate_command(const EvaluateArgs& args);

// Throws bad_input naming the key when an override would change the model or what the data
// means (anything but the keys above). Exposed for tests.
void check_evaluate_overrides(const std::vector<std::string>& overrides);

}  // namespace meshtrain
