#include "framework/io/data.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "partition/error.hpp"

namespace meshtrain {

namespace {

// SplitMix64 finalizer: turns (seed, stream) pairs into well-mixed generator seeds.
uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// std::mt19937_64's sequence is fixed by the standard; the distributions are not, so
// the few we need are written here to keep data identical across standard libraries.
std::mt19937_64 make_generator(uint64_t seed, uint64_t stream) {
  return std::mt19937_64(mix64(mix64(seed) ^ mix64(stream + 0x5851f42d4c957f2dULL)));
}

// Uniform integer in [0, n), unbiased (rejection of the incomplete last block).
uint64_t uniform_below(std::mt19937_64& gen, uint64_t n) {
  const uint64_t limit =
      std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
  uint64_t r = gen();
  while (r >= limit) r = gen();
  return r % n;
}

constexpr double kTwoPi = 6.283185307179586476925286766559;

// Standard normal by Box-Muller (one value per call; simple and deterministic).
double standard_normal(std::mt19937_64& gen) {
  const double u1 = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

// Streams of make_generator: one per purpose, so splits and epochs never share draws.
constexpr uint64_t kTeacherStream = 1;
constexpr uint64_t kTrainStream = 2;
constexpr uint64_t kTestStream = 3;
constexpr uint64_t kShuffleStreamBase = 1000;

}  // namespace

const char* split_name(Split split) {
  return split == Split::train ? "train" : "test";
}

const std::string& default_fashion_mnist_dir() {
  static const std::string dir = "/usr/share/datasets/fashion-mnist";
  return dir;
}

// ---------------------------------------------------------------------------------------
// Synthetic regression set

Dataset make_synthetic(int64_t train_samples, int64_t input_width, int64_t output_width,
                       uint64_t seed, Split split) {
  if (train_samples < 1) {
    MESHTRAIN_BAD_INPUT("data.synthetic_samples must be positive, got ", train_samples);
  }
  if (input_width < 1 || output_width < 1) {
    MESHTRAIN_BAD_INPUT(
        "the synthetic dataset needs positive model.sizes[0] and model.sizes[-1], got ",
        input_width, " and ", output_width);
  }
  Dataset d;
  d.num_samples = split == Split::train ? train_samples : std::max<int64_t>(1, train_samples / 4);
  d.features = input_width;
  d.target_width = output_width;
  d.description = "synthetic " + std::string(split_name(split)) + " set (seed " +
                  std::to_string(seed) + ", " + std::to_string(d.num_samples) + " samples)";

  // Teacher W [in, out] ~ N(0, 1/in), from the seed alone so both splits share it.
  std::vector<double> teacher(static_cast<size_t>(input_width * output_width));
  {
    auto gen = make_generator(seed, kTeacherStream);
    const double scale = 1.0 / std::sqrt(static_cast<double>(input_width));
    for (auto& w : teacher) w = standard_normal(gen) * scale;
  }

  auto gen = make_generator(seed, split == Split::train ? kTrainStream : kTestStream);
  d.inputs.resize(static_cast<size_t>(d.num_samples * input_width));
  d.targets.resize(static_cast<size_t>(d.num_samples * output_width));
  std::vector<double> row(static_cast<size_t>(input_width));
  for (int64_t i = 0; i < d.num_samples; ++i) {
    for (int64_t f = 0; f < input_width; ++f) {
      row[f] = standard_normal(gen);
      d.inputs[i * input_width + f] = static_cast<float>(row[f]);
    }
    for (int64_t o = 0; o < output_width; ++o) {
      double z = 0.0;
      for (int64_t f = 0; f < input_width; ++f) z += row[f] * teacher[f * output_width + o];
      const double noise = 0.05 * standard_normal(gen);
      d.targets[i * output_width + o] = static_cast<float>(std::tanh(z) + noise);
    }
  }
  return d;
}

// ---------------------------------------------------------------------------------------
// load_dataset: pick the source, then check it against the model's sizes

Dataset load_dataset(const DataSection& data, Split split, uint64_t seed, int64_t input_width,
                     int64_t output_width) {
  Dataset d;
  if (data.source == "fashion_mnist") {
    d = load_fashion_mnist(data.path.empty() ? default_fashion_mnist_dir() : data.path, split);
  } else if (data.source == "synthetic") {
    d = make_synthetic(data.synthetic_samples, input_width, output_width, seed, split);
  } else if (data.source == "hdf5") {
    const std::string& path = split == Split::train ? data.path : data.test_path;
    if (split == Split::train && path.empty()) {
      MESHTRAIN_BAD_INPUT("data.path must name an HDF5 file when data.source = \"hdf5\"");
    }
    if (path.empty()) {
      d.description = "no test set (data.test_path is empty)";
      d.features = input_width;
      return d;
    }
    d = load_hdf5_dataset(path, output_width);
  } else {
    MESHTRAIN_BAD_INPUT("data.source = \"", data.source,
                        "\" is not one of fashion_mnist, synthetic, hdf5");
  }

  if (d.features != input_width) {
    MESHTRAIN_BAD_INPUT("model.sizes[0] = ", input_width, " does not match the ", d.features,
                        " input features per sample of the ", d.description);
  }
  if (d.output_width() != output_width) {
    if (d.classification()) {
      MESHTRAIN_BAD_INPUT("model.sizes[-1] = ", output_width, " does not match the ", d.num_classes,
                          " classes of the ", d.description);
    }
    MESHTRAIN_BAD_INPUT("model.sizes[-1] = ", output_width, " does not match the target width ",
                        d.target_width, " of the ", d.description);
  }
  return d;
}

void check_loss_fits_data(const std::string& loss, const DataSection& data, const Dataset& split) {
  if (split.num_samples == 0) return;
  const bool wants_labels = loss == "cross_entropy";
  if (wants_labels == split.classification()) return;
  const std::string targets =
      split.classification() ? std::to_string(split.num_classes) + " class labels"
                             : "regression targets of width " + std::to_string(split.target_width);
  MESHTRAIN_BAD_INPUT(
      "model.loss = \"", loss, "\" needs ", wants_labels ? "class labels" : "regression targets",
      ", but data.source = \"", data.source, "\" gives ", targets, " (the ", split.description,
      "): set model.loss = \"", wants_labels ? "mse" : "cross_entropy", "\"");
}

// ---------------------------------------------------------------------------------------
// Slices and schedules

BatchSlice make_batch_slice(const Mesh& mesh, int rank, const std::vector<std::string>& batch_axes,
                            int64_t global_batch, const std::string& key) {
  std::vector<std::string> axes;
  for (const auto& a : batch_axes) {
    if (mesh.has_axis(a)) axes.push_back(a);
  }
  BatchSlice s;
  s.global_batch = global_batch;
  s.count = mesh.size_of(axes);
  s.index = mesh.group_index(rank, axes);
  if (global_batch < 1) MESHTRAIN_BAD_INPUT(key, " = ", global_batch, " must be positive");
  if (global_batch % s.count != 0) {
    std::string names;
    for (const auto& a : axes) names += (names.empty() ? "" : ", ") + a;
    MESHTRAIN_BAD_INPUT(key, " = ", global_batch, " is not divisible by k = ", s.count,
                        ", the number of batch shards (mesh axes ", names, ")");
  }
  s.rows = global_batch / s.count;
  return s;
}

BatchSchedule::BatchSchedule(int64_t num_samples, int64_t global_batch, bool shuffle, uint64_t seed)
    : num_samples_(num_samples),
      global_batch_(global_batch),
      steps_per_epoch_(0),
      shuffle_(shuffle),
      seed_(seed) {
  if (global_batch < 1)
    MESHTRAIN_BAD_INPUT("data.batch_size = ", global_batch, " must be positive");
  if (global_batch > num_samples) {
    MESHTRAIN_BAD_INPUT("data.batch_size = ", global_batch, " is larger than the ", num_samples,
                        " training samples");
  }
  steps_per_epoch_ = num_samples / global_batch;
  cached_order_.resize(static_cast<size_t>(num_samples));
}

void BatchSchedule::permutation_into(int64_t epoch, std::vector<int64_t>& out) const {
  MESHTRAIN_REQUIRE(epoch >= 0, "BatchSchedule: negative epoch ", epoch);
  out.resize(static_cast<size_t>(num_samples_));
  for (int64_t i = 0; i < num_samples_; ++i) out[i] = i;
  if (!shuffle_) return;
  // Fisher-Yates from (seed, epoch) only: the same order on every rank and world size.
  auto gen = make_generator(seed_, kShuffleStreamBase + static_cast<uint64_t>(epoch));
  for (int64_t i = num_samples_ - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_below(gen, static_cast<uint64_t>(i + 1)));
    std::swap(out[i], out[j]);
  }
}

std::vector<int64_t> BatchSchedule::permutation(int64_t epoch) const {
  std::vector<int64_t> order;
  permutation_into(epoch, order);
  return order;
}

int64_t BatchSchedule::sample(int64_t step, int64_t row) const {
  MESHTRAIN_REQUIRE(step >= 0 && row >= 0 && row < global_batch_, "BatchSchedule: step ", step,
                    " row ", row, " out of range");
  const int64_t epoch = epoch_of(step);
  if (epoch != cached_epoch_) {
    permutation_into(epoch, cached_order_);
    cached_epoch_ = epoch;
  }
  return cached_order_[(step % steps_per_epoch_) * global_batch_ + row];
}

std::vector<int64_t> BatchSchedule::global_batch_samples(int64_t step) const {
  std::vector<int64_t> rows(static_cast<size_t>(global_batch_));
  for (int64_t r = 0; r < global_batch_; ++r) rows[r] = sample(step, r);
  return rows;
}

EvalSchedule EvalSchedule::create(int64_t num_samples, int64_t global_batch,
                                  const std::string& key) {
  if (global_batch < 1) {
    MESHTRAIN_BAD_INPUT(key, " = ", global_batch, " must be positive (the evaluation batch)");
  }
  EvalSchedule s;
  s.num_samples = num_samples;
  s.global_batch = global_batch;
  s.num_batches = (num_samples + global_batch - 1) / global_batch;
  return s;
}

// ---------------------------------------------------------------------------------------
// Filling batches

namespace {

// Copies `valid` samples (sample_of(r) for r < valid) into rows [0, valid) of x and of
// the labels/targets, and zeros rows [valid, x.extent(0)). Works in `staging` or, without
// it, in host mirrors made for the call; either is the views themselves when Kokkos' memory
// is host memory (no allocation, and the deep_copy below is a no-op).
template <class SampleOf>
void copy_rows(const Dataset& d, int64_t valid, SampleOf sample_of, const Matrix& x,
               const BatchLabels* labels, const Matrix* targets,
               const BatchStaging* staging = nullptr) {
  const int64_t rows = static_cast<int64_t>(x.extent(0));
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(1)) == d.features, "fill_batch: x has ",
                    x.extent(1), " columns but the ", d.description, " has ", d.features,
                    " features");
  MESHTRAIN_REQUIRE(valid >= 0 && valid <= rows, "fill_batch: ", valid, " valid rows for ", rows,
                    " rows");
  const int64_t f = d.features;
  using StagedMatrix = decltype(BatchStaging::x);
  const StagedMatrix hx =
      staging ? staging->x : StagedMatrix(Kokkos::create_mirror_view(HostStagingSpace(), x));
  const float pixel_scale = 1.0f / 255.0f;
  for (int64_t r = 0; r < valid; ++r) {
    const int64_t s = sample_of(r);
    if (!d.pixels.empty()) {
      const uint8_t* src = d.pixels.data() + s * f;
      for (int64_t c = 0; c < f; ++c) hx(r, c) = static_cast<float>(src[c]) * pixel_scale;
    } else {
      const float* src = d.inputs.data() + s * f;
      for (int64_t c = 0; c < f; ++c) hx(r, c) = src[c];
    }
  }
  for (int64_t r = valid; r < rows; ++r) {
    for (int64_t c = 0; c < f; ++c) hx(r, c) = 0.0f;
  }
  Kokkos::deep_copy(x, hx);

  if (labels != nullptr) {
    MESHTRAIN_REQUIRE(d.classification(), "fill_batch: labels requested from the ", d.description,
                      ", which has regression targets");
    MESHTRAIN_REQUIRE(static_cast<int64_t>(labels->extent(0)) == rows, "fill_batch: labels have ",
                      labels->extent(0), " rows, x has ", rows);
    using StagedLabels = decltype(BatchStaging::labels);
    const StagedLabels hl =
        staging ? staging->labels
                : StagedLabels(Kokkos::create_mirror_view(HostStagingSpace(), *labels));
    for (int64_t r = 0; r < rows; ++r) hl(r) = r < valid ? d.labels[sample_of(r)] : 0;
    Kokkos::deep_copy(*labels, hl);
  }
  if (targets != nullptr) {
    MESHTRAIN_REQUIRE(!d.classification(), "fill_batch: regression targets requested from the ",
                      d.description, ", which has class labels");
    const int64_t w = d.target_width;
    MESHTRAIN_REQUIRE(static_cast<int64_t>(targets->extent(0)) == rows &&
                          static_cast<int64_t>(targets->extent(1)) == w,
                      "fill_batch: targets are ", targets->extent(0), "x", targets->extent(1),
                      ", expected ", rows, "x", w);
    const StagedMatrix ht =
        staging ? staging->targets
                : StagedMatrix(Kokkos::create_mirror_view(HostStagingSpace(), *targets));
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = r < valid ? d.targets.data() + sample_of(r) * w : nullptr;
      for (int64_t c = 0; c < w; ++c) ht(r, c) = src ? src[c] : 0.0f;
    }
    Kokkos::deep_copy(*targets, ht);
  }
}

void check_train_slice(const Dataset& d, const BatchSchedule& schedule, const BatchSlice& slice,
                       const Matrix& x) {
  MESHTRAIN_REQUIRE(schedule.num_samples() == d.num_samples, "fill_batch: the schedule is for ",
                    schedule.num_samples(), " samples but the ", d.description, " has ",
                    d.num_samples);
  MESHTRAIN_REQUIRE(
      slice.offset >= 0 && slice.offset + slice.global_batch <= schedule.global_batch(),
      "fill_batch: rows [", slice.offset, ", +", slice.global_batch, ") of the batch used with a ",
      schedule.global_batch(), "-row schedule");
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == slice.rows, "fill_batch: x has ",
                    x.extent(0), " rows, the slice ", slice.rows);
}

void check_eval_slice(const Dataset& d, const EvalSchedule& schedule, int64_t batch,
                      const BatchSlice& slice, const Matrix& x) {
  MESHTRAIN_REQUIRE(schedule.num_samples == d.num_samples, "fill_eval_batch: the schedule is for ",
                    schedule.num_samples, " samples but the ", d.description, " has ",
                    d.num_samples);
  MESHTRAIN_REQUIRE(batch >= 0 && batch < schedule.num_batches, "fill_eval_batch: batch ", batch,
                    " of ", schedule.num_batches);
  MESHTRAIN_REQUIRE(slice.global_batch == schedule.global_batch, "fill_eval_batch: slice of a ",
                    slice.global_batch, "-row batch used with a ", schedule.global_batch,
                    "-row schedule");
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == slice.rows, "fill_eval_batch: x has ",
                    x.extent(0), " rows, the slice ", slice.rows);
}

int64_t eval_valid_rows(const EvalSchedule& schedule, int64_t batch, const BatchSlice& slice) {
  const int64_t first = batch * schedule.global_batch + slice.begin();
  return std::clamp<int64_t>(schedule.num_samples - first, 0, slice.rows);
}

}  // namespace

BatchStaging make_batch_staging(const Matrix& x, const BatchLabels& labels, const Matrix& targets) {
  return {Kokkos::create_mirror_view(HostStagingSpace(), x),
          Kokkos::create_mirror_view(HostStagingSpace(), labels),
          Kokkos::create_mirror_view(HostStagingSpace(), targets)};
}

void fill_batch(const Dataset& data, const BatchSchedule& schedule, int64_t step,
                const BatchSlice& slice, const Matrix& x, const BatchLabels& labels,
                const BatchStaging* staging) {
  check_train_slice(data, schedule, slice, x);
  const int64_t begin = slice.begin();
  copy_rows(
      data, slice.rows, [&](int64_t r) { return schedule.sample(step, begin + r); }, x, &labels,
      nullptr, staging);
}

void fill_batch(const Dataset& data, const BatchSchedule& schedule, int64_t step,
                const BatchSlice& slice, const Matrix& x, const Matrix& targets,
                const BatchStaging* staging) {
  check_train_slice(data, schedule, slice, x);
  const int64_t begin = slice.begin();
  copy_rows(
      data, slice.rows, [&](int64_t r) { return schedule.sample(step, begin + r); }, x, nullptr,
      &targets, staging);
}

int64_t fill_eval_batch(const Dataset& data, const EvalSchedule& schedule, int64_t batch,
                        const BatchSlice& slice, const Matrix& x, const BatchLabels& labels,
                        const BatchStaging* staging) {
  check_eval_slice(data, schedule, batch, slice, x);
  const int64_t first = batch * schedule.global_batch + slice.begin();
  const int64_t valid = eval_valid_rows(schedule, batch, slice);
  copy_rows(
      data, valid, [&](int64_t r) { return first + r; }, x, &labels, nullptr, staging);
  return valid;
}

int64_t fill_eval_batch(const Dataset& data, const EvalSchedule& schedule, int64_t batch,
                        const BatchSlice& slice, const Matrix& x, const Matrix& targets,
                        const BatchStaging* staging) {
  check_eval_slice(data, schedule, batch, slice, x);
  const int64_t first = batch * schedule.global_batch + slice.begin();
  const int64_t valid = eval_valid_rows(schedule, batch, slice);
  copy_rows(
      data, valid, [&](int64_t r) { return first + r; }, x, nullptr, &targets, staging);
  return valid;
}

}  // namespace meshtrain
