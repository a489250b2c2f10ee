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
// target_mean. A constant feature has std 1. The std is the population standard deviation
// (numpy's default, ddof = 0): sqrt(sum((x - mean)^2) / N) over the N training rows.
//
// Computed by compute_normalization (normalization_stats.hpp) and applied by the BatchStream
// to each batch as it is read (standardize_rows); written into every checkpoint by the
// checkpoint writer (CheckpointContents::normalization), each dataset with a crc32 attribute
// as the tensors have.

#include <cstdint>
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
// A dataset that carries a crc32 attribute (all that meshtrain writes do) is checked against
// it: a mismatch is bad_input naming the dataset and the file.
Normalization read_normalization(const std::string& checkpoint_file);

// values[r, c] = (values[r, c] - mean[c]) / std_dev[c] for `rows` row-major rows of `width`,
// computed in float64 and rounded to float once. mean and std_dev have `width` entries.
void standardize_rows(float* values, int64_t rows, int64_t width, const std::vector<double>& mean,
                      const std::vector<double>& std_dev);

}  // namespace meshtrain
