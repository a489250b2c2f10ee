#pragma once
// The [data] section of a run (docs/data.md): what the data path reads and in which order.
// Apart from framework/train/config.hpp, which includes it, so that io depends on this
// section alone and not on the whole run configuration.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "framework/core/choices.hpp"  // DataSource, ShuffleMode, Normalize

namespace meshtrain {

struct DataSection {
  DataSource source = DataSource::fashion_mnist;
  // fashion_mnist: one directory of IDX files; hdf5: the training files (each entry a file
  // or a glob, expanded and sorted at set-up; the shards form one dataset in this order).
  std::vector<std::string> path;
  std::vector<std::string> test_path;  // hdf5: test files, as path (optional)
  int64_t batch_size = 128;            // global, of one micro-batch (see train.accumulation_steps)
  // Global rows of one evaluation batch; unset: data.batch_size. The batch axes must divide it.
  std::optional<int64_t> eval_batch_size;
  ShuffleMode shuffle = ShuffleMode::rows;  // data.shuffle = false | true | "blocks"
  int64_t block_rows = 1024;                // shuffle = "blocks": rows of one contiguous block
  int64_t shuffle_window = 8;  // shuffle = "blocks": blocks whose rows are shuffled together
  int64_t prefetch = 2;        // batches read ahead by a background thread; 0: read in the step
  int64_t synthetic_samples = 4096;
  // hdf5: the datasets of the inputs and of the labels or targets in every file (a leading
  // "/" is added when missing: "x" and "/x" are the same).
  std::string x_key = "/x";
  std::string y_key = "/y";
  // hdf5, Sobolev training (docs/derivatives.md): the dataset of the targets' derivatives
  // w.r.t. the inputs, float [N, outputs, k] with k = dy_inputs' count (all inputs, in order,
  // when dy_inputs is empty); "" (the default): no derivative targets.
  std::string dy_key;
  // hdf5, model.kind = "dlrm": the group of the sparse features, one subgroup per table
  // (<sparse_key>/<table>/values and offsets, or ids [rows, k]: docs/recsys.md); x_key then
  // names the dense features and y_key the click labels.
  std::string sparse_key = "/sparse";
  std::vector<int64_t> dy_inputs;  // the input columns dy_key holds, in its order; empty: all
  // "standard": the model sees (x - mean) / std per input feature, and for regression is
  // trained on (y - mean) / std per target, with statistics from one pass over the training
  // rows kept in every checkpoint (framework/io/normalization.hpp). "none": the rows as read.
  Normalize normalize_inputs = Normalize::none;
  Normalize normalize_targets = Normalize::none;
};

// The [stream] section (docs/online.md): rows sent by a simulation's producers while the run
// trains, with data.source = "stream".
struct StreamSection {
  std::string name = "samples";  // the producers connect to this name
  int64_t buffer_rows = 65536;   // rows each trainer rank keeps: its memory bound
  StreamPolicy policy = StreamPolicy::window;
  // Rows every trainer rank's buffer holds before the first step; 0: one batch's rows.
  int64_t min_rows = 0;
  StreamOrder order = StreamOrder::random;
  // How a batch group takes the messages of several producers: as they come (arrival), or
  // merged round robin by producer rank and message index (round_robin: the same rows in the
  // same order whatever the timing, a slow producer holding back the others' rows).
  StreamMerge merge = StreamMerge::arrival;
  StreamRowType dtype = StreamRowType::float32;
  StreamUntil until = StreamUntil::steps;
  // Every publish_every steps the trainer sends its parameters and normalization to the
  // producers (their LiveModel); 0: never.
  int64_t publish_every = 0;
  // The fraction of rows held out for evaluation (by a hash of producer rank and row number:
  // the same rows in every run), kept in a window of held_out_rows rows per trainer rank and
  // evaluated as the run's test set; 0: none.
  double test_fraction = 0.0;
  // Rows of each trainer rank's held-out window (its newest held-out rows), with
  // test_fraction > 0; 0: ceil(buffer_rows x test_fraction).
  int64_t held_out_rows = 0;
  // Checkpoints hold every trainer rank's buffer and held-out window (/stream), and a resumed
  // run continues with them; false: a resumed run starts with empty buffers.
  bool checkpoint_buffer = true;
  // Seconds a producer may send nothing without having closed before the trainer takes it for
  // gone (a process that ended without close()): one warning names it, the trainer goes on
  // with the others and no longer waits for its close. 0: wait for ever.
  double producer_timeout = 120.0;
  // Seconds the trainer's end (StreamSource's destructor) waits, once every producer has
  // closed, for its last words and publishes to be taken: a producer whose close() gave up
  // waiting (its close_timeout) never takes them, and they are then left to MPI. > 0.
  double last_word_timeout = 30.0;
};

// Rows of a trainer rank's held-out window: stream.held_out_rows when set, else
// ceil(buffer_rows x test_fraction), at least 1 (0 without test_fraction).
inline int64_t stream_held_out_rows(const StreamSection& stream) {
  if (stream.test_fraction <= 0.0) return 0;
  if (stream.held_out_rows > 0) return stream.held_out_rows;
  const double rows = static_cast<double>(stream.buffer_rows) * stream.test_fraction;
  const auto whole = static_cast<int64_t>(rows);
  return std::max<int64_t>(1, whole + (static_cast<double>(whole) < rows ? 1 : 0));
}

// A dataset key as written ("x" or "/x") in its canonical form ("/x"); "" when it names no
// dataset ("" or "/").
inline std::string canonical_dataset_key(const std::string& key) {
  if (key.empty() || key == "/") return "";
  return key[0] == '/' ? key : "/" + key;
}

}  // namespace meshtrain
