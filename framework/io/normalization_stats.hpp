#pragma once
// The statistics of data.normalize_inputs / normalize_targets = "standard"
// (framework/io/normalization.hpp), from one pass over the training rows shared by the ranks,
// and the warning about raw inputs of very different scales.
//
// The same bits on any mesh and world size: the rows are cut into fixed global blocks of
// kNormalizationBlockRows rows in sample order; block b is read by rank b mod P alone, which
// sums it in float64 in row order (Welford: mean and the sum of squared deviations from it,
// sound for features far from 0 with a small spread); every rank then folds the blocks'
// partials in block order (Chan et al.'s pairwise update), exchanged by one all-gather per P
// blocks. So the result depends on the rows alone, never on P. Every value is taken relative
// to the first row (exact in float64), so a feature at 1e4 with a spread of 1e-3 is summed as
// accurately as one near 0 (about 1e-15 relative on its std, against 1e-10 unshifted).

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "framework/io/data.hpp"
#include "framework/io/normalization.hpp"

namespace meshtrain {

constexpr int64_t kNormalizationBlockRows = 4096;

struct NormalizationStats {
  Normalization normalization;           // the sides asked for; the others empty
  std::vector<int64_t> constant_inputs;  // features with std 0 in the data (given std 1)
  std::vector<int64_t> constant_targets;
};

// Collective over `comm`: the mean and population std of every input feature (`inputs`) and
// of every regression target (`targets`, only for a source with targets) over all the rows
// of `source`. Each rank must hold the same source. A row that cannot be read is an Error,
// the same on every rank (agreed). A source without rows is bad_input. `read_rows`: rows per
// read (the source's scratch grows to it; the result does not depend on it).
NormalizationStats compute_normalization(RowSource& source, bool inputs, bool targets,
                                         MPI_Comm comm, int64_t read_rows = 256);

// The note for constant features ("" when there are none): which ones, that their std is 1.
std::string constant_features_note(const NormalizationStats& stats);

// Not collective: looks at max |x| of each input feature over the first `sample_rows` rows
// of `source` (features that are 0 throughout the sample are left out). When the largest is
// more than `ratio` times the smallest, one sentence naming both features and their scales
// and the key that fixes it (data.normalize_inputs = "standard"); otherwise "". Read
// `read_rows` rows at a time. A sample that cannot be read gives "" (an advice, not a check:
// training reports the bad row when it reads it).
std::string input_scale_warning(RowSource& source, int64_t read_rows, int64_t sample_rows = 4096,
                                double ratio = 1e4);

}  // namespace meshtrain
