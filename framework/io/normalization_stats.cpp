// The statistics of data.normalize_inputs / normalize_targets (normalization_stats.hpp).

#include "framework/io/normalization_stats.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "base/error.hpp"
#include "framework/comm/communicator.hpp"  // checked_int
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"

namespace meshtrain {
namespace {

// Mean and sum of squared deviations of `width` columns over `count` rows; a block's partial
// as sent: [count, mean[width], m2[width]].
struct Moments {
  double count = 0;
  std::vector<double> mean, m2;
  explicit Moments(int64_t width = 0)
      : mean(static_cast<size_t>(width), 0.0), m2(static_cast<size_t>(width), 0.0) {}

  // Welford: one row, in order, shifted by `shift` (the first row: exact in float64, and it
  // keeps a feature far from 0 with a small spread as well conditioned as one near 0).
  void add_row(const float* row, const double* shift) {
    count += 1.0;
    for (size_t c = 0; c < mean.size(); ++c) {
      const double x = static_cast<double>(row[c]) - shift[c];
      const double delta = x - mean[c];
      mean[c] += delta / count;
      m2[c] += delta * (x - mean[c]);
    }
  }

  // Chan et al.: this (the blocks before) followed by `other` (the next block).
  void merge(const double* other) {
    const double other_count = other[0];
    if (other_count == 0) return;
    const size_t width = mean.size();
    const double* other_mean = other + 1;
    const double* other_m2 = other + 1 + width;
    if (count == 0) {
      count = other_count;
      std::copy(other_mean, other_mean + width, mean.begin());
      std::copy(other_m2, other_m2 + width, m2.begin());
      return;
    }
    const double total = count + other_count;
    const double weight = other_count / total;
    const double cross = count * other_count / total;
    for (size_t c = 0; c < width; ++c) {
      const double delta = other_mean[c] - mean[c];
      mean[c] += delta * weight;
      m2[c] += other_m2[c] + delta * delta * cross;
    }
    count = total;
  }

  void pack(double* out) const {
    out[0] = count;
    std::copy(mean.begin(), mean.end(), out + 1);
    std::copy(m2.begin(), m2.end(), out + 1 + mean.size());
  }
};

// mean and population std; a constant column gets std 1 (and is listed).
void finish(const Moments& m, const std::vector<double>& shift, std::vector<double>& mean,
            std::vector<double>& std_dev, std::vector<int64_t>& constant) {
  mean.resize(m.mean.size());
  for (size_t c = 0; c < mean.size(); ++c) mean[c] = shift[c] + m.mean[c];
  std_dev.resize(m.m2.size());
  for (size_t c = 0; c < m.m2.size(); ++c) {
    const double variance = m.m2[c] / m.count;
    if (variance > 0) {
      std_dev[c] = std::sqrt(variance);
    } else {
      std_dev[c] = 1.0;
      constant.push_back(static_cast<int64_t>(c));
    }
  }
}

std::string feature_list(const std::vector<int64_t>& features) {
  std::ostringstream out;
  const size_t shown = std::min<size_t>(features.size(), 10);
  for (size_t i = 0; i < shown; ++i) out << (i ? ", " : "") << features[i];
  if (features.size() > shown) out << " and " << features.size() - shown << " more";
  return out.str();
}

}  // namespace

NormalizationStats compute_normalization(RowSource& source, bool inputs, bool targets,
                                         MPI_Comm comm, int64_t read_rows) {
  const int64_t chunk = std::max<int64_t>(read_rows, 1);
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  const DataShape& shape = source.shape();
  targets = targets && !shape.classification() && shape.target_width > 0;
  const int64_t features = inputs ? shape.features : 0;
  const int64_t outputs = targets ? shape.target_width : 0;
  const int64_t width = features + outputs;
  const int64_t n = shape.num_samples;
  const int64_t blocks = (n + kNormalizationBlockRows - 1) / kNormalizationBlockRows;
  const int64_t partial = 1 + 2 * width;  // doubles per block
  on_every_rank(comm, [&] {
    if (n == 0) {
      MESHTRAIN_BAD_INPUT("cannot standardize the ", shape.description,
                          ": it has no rows to compute the mean and std from");
    }
    checked_int(static_cast<size_t>(partial * size),
                "the normalization statistics of one round (doubles)");
  });

  // This rank's scratch: the rows of one read, and its block's partial of a round.
  std::vector<float> x(static_cast<size_t>(chunk * shape.features));
  std::vector<float> y(targets ? static_cast<size_t>(chunk * outputs) : 0);
  std::vector<int32_t> labels(shape.classification() ? static_cast<size_t>(chunk) : 0);
  std::vector<int64_t> rows(static_cast<size_t>(chunk));
  std::vector<double> mine(static_cast<size_t>(partial));
  std::vector<double> all(static_cast<size_t>(partial * size));
  Moments in_total(features), out_total(outputs);
  // The shift: the first row, read by every rank (the same values everywhere).
  std::vector<double> in_shift(static_cast<size_t>(features)),
      out_shift(static_cast<size_t>(outputs));
  on_every_rank(comm, [&] {
    const int64_t first_row = 0;
    source.read(&first_row, 1,
                RowBuffers{x.data(), labels.empty() ? nullptr : labels.data(),
                           y.empty() ? nullptr : y.data()});
    for (int64_t c = 0; c < features; ++c) in_shift[c] = x[c];
    for (int64_t o = 0; o < outputs; ++o) out_shift[o] = y[o];
  });

  for (int64_t first = 0; first < blocks; first += size) {
    // Round: block first + rank on this rank (or none past the end), read and summed alone.
    const int64_t block = first + rank;
    on_every_rank(comm, [&] {
      Moments in(features), out(outputs);
      const int64_t begin = block * kNormalizationBlockRows;
      const int64_t end = std::min(n, begin + kNormalizationBlockRows);
      for (int64_t at = begin; at < end; at += chunk) {
        const int64_t count = std::min(chunk, end - at);
        for (int64_t r = 0; r < count; ++r) rows[static_cast<size_t>(r)] = at + r;
        RowBuffers buffers{x.data(), labels.empty() ? nullptr : labels.data(),
                           y.empty() ? nullptr : y.data()};
        source.read(rows.data(), count, buffers);
        for (int64_t r = 0; r < count; ++r) {
          if (inputs) in.add_row(x.data() + r * shape.features, in_shift.data());
          if (targets) out.add_row(y.data() + r * outputs, out_shift.data());
        }
      }
      // [count, input means, target means, input m2, target m2]: one Moments of width
      // features + outputs, as sent.
      Moments both(width);
      both.count = std::max(in.count, out.count);
      std::copy(in.mean.begin(), in.mean.end(), both.mean.begin());
      std::copy(out.mean.begin(), out.mean.end(), both.mean.begin() + features);
      std::copy(in.m2.begin(), in.m2.end(), both.m2.begin());
      std::copy(out.m2.begin(), out.m2.end(), both.m2.begin() + features);
      both.pack(mine.data());
    });
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Iallgather(mine.data(), static_cast<int>(partial), MPI_DOUBLE, all.data(),
                             static_cast<int>(partial), MPI_DOUBLE, comm, &request),
              "MPI_Iallgather (the normalization statistics)");
    wait_collective_or_give_up(&request, 1, "MPI_Iallgather (the normalization statistics)", mine,
                               all);
    // Every rank folds the round's blocks in block order: the same operations everywhere.
    std::vector<double> piece(static_cast<size_t>(1 + 2 * std::max(features, outputs)));
    for (int r = 0; r < size && first + r < blocks; ++r) {
      const double* p = all.data() + static_cast<int64_t>(r) * partial;
      const double* means = p + 1;
      const double* m2s = p + 1 + width;
      if (inputs) {
        piece[0] = p[0];
        std::copy(means, means + features, piece.begin() + 1);
        std::copy(m2s, m2s + features, piece.begin() + 1 + features);
        in_total.merge(piece.data());
      }
      if (targets) {
        piece[0] = p[0];
        std::copy(means + features, means + width, piece.begin() + 1);
        std::copy(m2s + features, m2s + width, piece.begin() + 1 + outputs);
        out_total.merge(piece.data());
      }
    }
  }

  NormalizationStats stats;
  if (inputs) {
    finish(in_total, in_shift, stats.normalization.input_mean, stats.normalization.input_std,
           stats.constant_inputs);
  }
  if (targets) {
    finish(out_total, out_shift, stats.normalization.target_mean, stats.normalization.target_std,
           stats.constant_targets);
  }
  return stats;
}

std::string constant_features_note(const NormalizationStats& stats) {
  std::ostringstream out;
  const auto side = [&](const std::vector<int64_t>& constant, const char* what) {
    if (constant.empty()) return;
    out << (out.tellp() > 0 ? "; " : "") << what << (constant.size() > 1 ? "s " : " ")
        << feature_list(constant) << (constant.size() > 1 ? " are" : " is");
  };
  side(stats.constant_inputs, "input feature");
  side(stats.constant_targets, "target");
  if (out.tellp() == 0) return "";
  out << " constant in the training data (std 0): standardized with std 1, i.e. only "
         "shifted by the mean";
  return out.str();
}

std::string input_scale_warning(RowSource& source, int64_t read_rows, int64_t sample_rows,
                                double ratio) {
  const int64_t chunk = std::max<int64_t>(read_rows, 1);
  const DataShape& shape = source.shape();
  const int64_t count = std::min(sample_rows, shape.num_samples);
  if (count <= 0 || shape.features < 2) return "";
  std::vector<float> x(static_cast<size_t>(chunk * shape.features));
  std::vector<float> y(static_cast<size_t>(chunk * std::max<int64_t>(shape.target_width, 1)));
  std::vector<int32_t> labels(static_cast<size_t>(chunk));
  std::vector<int64_t> rows(static_cast<size_t>(chunk));
  std::vector<double> scale(static_cast<size_t>(shape.features), 0.0);  // max |x|
  for (int64_t at = 0; at < count; at += chunk) {
    const int64_t n = std::min(chunk, count - at);
    for (int64_t r = 0; r < n; ++r) rows[static_cast<size_t>(r)] = at + r;
    RowBuffers buffers{x.data(), shape.classification() ? labels.data() : nullptr,
                       shape.classification() ? nullptr : y.data()};
    try {
      source.read(rows.data(), n, buffers);
    } catch (const Error&) {
      return "";
    }
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < shape.features; ++c) {
        scale[c] = std::max(scale[c], std::fabs(static_cast<double>(x[r * shape.features + c])));
      }
    }
  }
  int64_t largest = -1, smallest = -1;
  for (int64_t c = 0; c < shape.features; ++c) {
    if (scale[c] == 0) continue;  // zero throughout the sample: no scale to compare
    if (largest < 0 || scale[c] > scale[largest]) largest = c;
    if (smallest < 0 || scale[c] < scale[smallest]) smallest = c;
  }
  if (largest < 0 || !(scale[largest] > ratio * scale[smallest])) return "";
  std::ostringstream out;
  out.precision(3);
  out << "the input features' scales differ by a factor of " << scale[largest] / scale[smallest]
      << " (max |x| over the first " << count << " training rows): feature " << largest
      << " reaches " << scale[largest] << " and feature " << smallest << " only " << scale[smallest]
      << ", which slows or stalls training on raw inputs; set data.normalize_inputs = "
         "\"standard\" to train on standardized features (kept in the checkpoints)";
  return out.str();
}

}  // namespace meshtrain
