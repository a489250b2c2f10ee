#pragma once
// Resuming a run from a checkpoint: what the resumed run must share with the run that
// saved it. The data order of step s is a pure function of (run.seed, the training set,
// data.batch_size, data.shuffle) and the parameters' shapes follow model.sizes, so a
// change to any of those would silently train on another order (or fail later). The
// mesh, the partition and the world size may differ: a checkpoint is resharded on load.

#include <cstdint>
#include <limits>
#include <string>

#include "framework/io/checkpoint.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {

// Compares `config` with the config stored in the checkpoint `saved` (and its train
// state). Throws a bad_input Error naming the checkpoint, the key and both values when
// run.seed, data.source, data.path, data.synthetic_samples (synthetic data),
// data.batch_size, data.shuffle or model.sizes differ, or when the checkpoint's step is
// past `total_steps`, the last step of this run (naming train.steps / train.epochs).
// Not collective.
// `data_order` is this run's DataOrder::name(): a checkpoint that recorded another order
// (another shuffle, block size, window or number of training rows) is refused naming
// data.shuffle; one that recorded none (saved before orders were recorded) resumes only
// the unshuffled order, which has not changed.
void check_resume_compatible(const RunConfig& config, const CheckpointInfo& saved,
                             int64_t total_steps, const std::string& data_order);

// A warning, or "" when there is none: the checkpoint's run had another length (train.epochs
// or train.steps) and a schedule that depends on it (linear or cosine decay), so the
// resumed rate jumps instead of continuing (the saved run's rate at the saved step, against
// this run's). Names the keys and the length that continues the schedule. Not collective.
std::string learning_rate_change_warning(const RunConfig& config, const CheckpointInfo& saved,
                                         int64_t total_steps, int64_t steps_per_epoch);

// The best evaluation a resumed run continues from (train.early_stopping, checkpoint.keep_best).
struct ResumedBest {
  double metric = std::numeric_limits<double>::quiet_NaN();  // NaN: no evaluation yet
  int64_t evals_since = 0;
  // For the resume line: why the saved best was dropped ("" when it was kept).
  std::string note;
};
// The checkpoint's best when it was measured by `metric` (this run's checkpoint.keep_best, else
// test_loss); otherwise none, with a note saying so: the checkpoint's best measured another
// metric (keep_best changed between the runs), or it recorded no metric name (saved before the
// name was stored), so its value cannot be compared with this run's evaluations. Not collective.
ResumedBest resumed_best(const TrainState& saved, EvalMetric metric);

}  // namespace meshtrain
