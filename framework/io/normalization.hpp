#pragma once
// Normalization kept with the model ([data] normalize_inputs / normalize_targets = "standard").
// The statistics are per feature, computed once from the training data and stored in every
// checkpoint of the run:
//
//   /normalization/input_mean, /normalization/input_std    float64 [input features]
//   /normalization/target_mean, /normalization/target_std  float64 [outputs] (regression)
//
// A pair is absent when that side is not normalized (older checkpoints have no group). The
// model sees x' = (x - input_mean) / input_std and is trained on y' = (y - target_mean) /
// target_std; its outputs are returned to the user's units as y = y' * target_std +
// target_mean. A constant feature has std 1.

#include <string>
#include <vector>

namespace meshtrain {

struct Normalization {
  std::vector<double> input_mean, input_std;    // empty: inputs not normalized
  std::vector<double> target_mean, target_std;  // empty: targets not normalized
  bool inputs() const { return !input_mean.empty(); }
  bool targets() const { return !target_mean.empty(); }
};

// The dataset names above, relative to the file's root.
inline const char* normalization_group() { return "/normalization"; }

// Reads the statistics of a checkpoint file with the serial HDF5 driver (no MPI needed):
// empty vectors for pairs the file lacks. Throws bad_input naming the file and the dataset
// when a dataset is unreadable, not float64, not one-dimensional, or a mean and its std
// differ in length, or a std is not finite and positive.
Normalization read_normalization(const std::string& checkpoint_file);

}  // namespace meshtrain
