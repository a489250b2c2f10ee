#include "framework/io/data.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "base/error.hpp"

namespace meshtrain {

namespace {

// mix64 (data_order.hpp) turns (seed, stream) pairs into well-mixed generator seeds.
// std::mt19937_64's sequence is fixed by the standard; the distributions are not, so
// the few we need are written here to keep data identical across standard libraries.
std::mt19937_64 make_generator(uint64_t seed, uint64_t stream) {
  return std::mt19937_64(mix64(mix64(seed) ^ mix64(stream + 0x5851f42d4c957f2dULL)));
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
// In-memory rows

namespace {

class MemorySource final : public RowSource {
 public:
  explicit MemorySource(Dataset data) : data_(std::move(data)) {
    shape_ = static_cast<const DataShape&>(data_);
  }

  void read(const int64_t* rows, int64_t count, const RowBuffers& out) override {
    const int64_t f = data_.features;
    const float pixel_scale = 1.0f / 255.0f;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t s = rows[r];
      MESHTRAIN_REQUIRE(s >= 0 && s < data_.num_samples, "row ", s, " of the ", data_.description);
      float* dst = out.x + r * f;
      if (!data_.pixels.empty()) {
        const uint8_t* src = data_.pixels.data() + s * f;
        for (int64_t c = 0; c < f; ++c) dst[c] = static_cast<float>(src[c]) * pixel_scale;
      } else {
        std::copy_n(data_.inputs.data() + s * f, f, dst);
      }
      if (out.labels) out.labels[r] = data_.labels[s];
      if (out.targets) {
        const int64_t w = data_.target_width;
        std::copy_n(data_.targets.data() + s * w, w, out.targets + r * w);
      }
    }
  }

  int64_t resident_bytes() const override {
    return static_cast<int64_t>(data_.pixels.size() + data_.inputs.size() * sizeof(float) +
                                data_.labels.size() * sizeof(int32_t) +
                                data_.targets.size() * sizeof(float));
  }

 private:
  Dataset data_;
};

}  // namespace

std::unique_ptr<RowSource> make_memory_source(Dataset data) {
  const bool has_inputs = !data.pixels.empty() || !data.inputs.empty();
  MESHTRAIN_REQUIRE(data.num_samples == 0 || has_inputs, "the ", data.description,
                    " has no inputs");
  MESHTRAIN_REQUIRE(data.num_samples == 0 || !data.classification() ||
                        static_cast<int64_t>(data.labels.size()) == data.num_samples,
                    "the ", data.description, " has ", data.labels.size(), " labels for ",
                    data.num_samples, " samples");
  return std::make_unique<MemorySource>(std::move(data));
}

Dataset read_all(RowSource& source) {
  Dataset d;
  static_cast<DataShape&>(d) = source.shape();
  const int64_t n = d.num_samples;
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows[i] = i;
  d.inputs.resize(static_cast<size_t>(n * d.features));
  RowBuffers out{d.inputs.data(), nullptr, nullptr};
  if (d.classification()) {
    d.labels.resize(static_cast<size_t>(n));
    out.labels = d.labels.data();
  } else {
    d.targets.resize(static_cast<size_t>(n * d.target_width));
    out.targets = d.targets.data();
  }
  if (n > 0) source.read(rows.data(), n, out);
  return d;
}

// ---------------------------------------------------------------------------------------
// The data of a config: pick the source, then check it against the model's sizes

namespace {
// The chunk caches an HDF5 source gets for this config, at most (open_data_source).
int64_t hdf5_chunk_cache_bytes(const DataSection& data, int64_t input_width, int64_t output_width) {
  if (data.shuffle != ShuffleMode::blocks) return Hdf5SourceOptions{}.chunk_cache_bytes;
  // A window of blocks is one shuffle buffer: the chunks it spans stay cached while its
  // batches are read, so each is decompressed once per window (at most 256 MiB). Three
  // times its rows' bytes: a block that starts mid-chunk (or crosses into another shard)
  // reads up to two chunks more, and a cache short of a chunk misses every time.
  const int64_t row_bytes = 4 * (input_width + output_width);
  return std::clamp<int64_t>(3 * data.block_rows * data.shuffle_window * row_bytes,
                             int64_t{1} << 20, int64_t{256} << 20);
}
}  // namespace

void check_data_fits_model(const DataShape& d, int64_t input_width, int64_t output_width,
                           const ModelWidthKeys& keys) {
  if (d.num_samples == 0) return;  // no test set
  if (d.features != input_width) {
    MESHTRAIN_BAD_INPUT(keys.input, " = ", input_width, " does not match the ", d.features,
                        " input features per sample of the ", d.description);
  }
  if (d.output_width() != output_width) {
    if (d.classification()) {
      MESHTRAIN_BAD_INPUT(keys.output, " = ", output_width, " does not match the ", d.num_classes,
                          " classes of the ", d.description);
    }
    MESHTRAIN_BAD_INPUT(keys.output, " = ", output_width, " does not match the target width ",
                        d.target_width, " of the ", d.description);
  }
}

std::unique_ptr<RowSource> open_data_source(const DataSection& data, Split split, uint64_t seed,
                                            int64_t input_width, int64_t output_width,
                                            std::optional<LossKind> loss,
                                            const ModelWidthKeys& keys) {
  std::unique_ptr<RowSource> source;
  if (data.source == DataSource::fashion_mnist) {
    const std::string dir = data.path.empty() ? default_fashion_mnist_dir() : data.path.front();
    source = make_memory_source(load_fashion_mnist(dir, split));
  } else if (data.source == DataSource::synthetic) {
    source = make_memory_source(
        make_synthetic(data.synthetic_samples, input_width, output_width, seed, split));
  } else if (data.source == DataSource::stream) {
    // The trainer's TrainingRun opens a stream (framework/stream/stream_source.hpp); no
    // command reads one as a data set.
    MESHTRAIN_BAD_INPUT("data.source = \"stream\" is read by a training run only (its rows ",
                        "come from a running simulation); give this command an HDF5 file");
  } else {
    const std::vector<std::string>& entries = split == Split::train ? data.path : data.test_path;
    const char* key = split == Split::train ? "data.path" : "data.test_path";
    if (split == Split::train && entries.empty()) {
      MESHTRAIN_BAD_INPUT("data.path must name an HDF5 file when data.source = \"hdf5\"");
    }
    if (entries.empty()) {
      Dataset none;
      none.description = "no test set (data.test_path is empty)";
      none.features = input_width;
      return make_memory_source(std::move(none));
    }
    Hdf5SourceOptions options;
    options.chunk_cache_bytes = hdf5_chunk_cache_bytes(data, input_width, output_width);
    options.random_rows = data.shuffle != ShuffleMode::none;
    options.block_rows = data.shuffle == ShuffleMode::blocks ? data.block_rows : 0;
    options.x_name = data.x_key;
    options.y_name = data.y_key;
    source = open_hdf5_source(expand_data_paths(entries, key), output_width, options);
  }
  if (loss) check_loss_fits_data(*loss, data, source->shape());
  check_data_fits_model(source->shape(), input_width, output_width, keys);
  return source;
}

std::unique_ptr<RowSource> open_derivative_source(const DataSection& data, Split split,
                                                  int64_t outputs, int64_t directions) {
  if (data.dy_key.empty()) return nullptr;
  MESHTRAIN_REQUIRE(data.source == DataSource::hdf5, "data.dy_key needs data.source = \"hdf5\"");
  const std::vector<std::string>& entries = split == Split::train ? data.path : data.test_path;
  if (entries.empty()) return nullptr;
  const std::vector<std::string> files =
      expand_data_paths(entries, split == Split::train ? "data.path" : "data.test_path");
  Hdf5SourceOptions options;
  options.random_rows = data.shuffle != ShuffleMode::none;
  options.block_rows = data.shuffle == ShuffleMode::blocks ? data.block_rows : 0;
  options.x_name = data.dy_key;
  options.y_name = "";
  options.x_row_shape = {outputs, directions};
  options.x_key_name = "dy_key";
  std::unique_ptr<RowSource> source = open_hdf5_source(files, 1, options);
  // Each file's rows against its x's: the row numbers must mean the same samples.
  Hdf5SourceOptions x_only;
  x_only.x_name = data.x_key;
  x_only.y_name = "";
  for (const std::string& file : files) {
    Hdf5SourceOptions dy_only = options;
    const int64_t dy_rows = open_hdf5_source({file}, 1, dy_only)->shape().num_samples;
    const int64_t x_rows = open_hdf5_source({file}, 1, x_only)->shape().num_samples;
    if (dy_rows != x_rows) {
      MESHTRAIN_BAD_INPUT("HDF5 data file '", file, "': ", data.dy_key, " (data.dy_key) has ",
                          dy_rows, " rows but ", data.x_key, " has ", x_rows,
                          "; each needs one derivative row per sample");
    }
  }
  return source;
}

Dataset load_dataset(const DataSection& data, Split split, uint64_t seed, int64_t input_width,
                     int64_t output_width) {
  return read_all(*open_data_source(data, split, seed, input_width, output_width));
}

void check_loss_fits_data(LossKind loss, const DataSection& data, const DataShape& split) {
  if (split.num_samples == 0) return;
  const bool wants_labels = loss == LossKind::cross_entropy;
  if (wants_labels == split.classification()) return;
  const std::string targets =
      split.classification() ? std::to_string(split.num_classes) + " class labels"
                             : "regression targets of width " + std::to_string(split.target_width);
  // Labels stored as floats read as targets of width 1.
  const char* stored_as_floats =
      wants_labels && split.target_width == 1 ? ", or store class labels as integers" : "";
  const bool binary = loss == LossKind::binary_cross_entropy;
  MESHTRAIN_BAD_INPUT(
      "model.loss = \"", to_string(loss), "\" needs ",
      wants_labels ? "class labels"
      : binary     ? "float targets in [0, 1], one per output"
                   : "regression targets",
      ", but data.source = \"", to_string(data.source), "\" gives ", targets, " (the ",
      split.description, "): ",
      binary ? "store the 0/1 targets as floats [rows, outputs]"
             : std::string("set model.loss = \"") + (wants_labels ? "mse" : "cross_entropy") + "\"",
      stored_as_floats);
}

// ---------------------------------------------------------------------------------------
// What the plan counts

DataFootprint data_footprint(const DataSection& data, const DataUse& use, int64_t rows,
                             int64_t eval_rows) {
  const int64_t features = use.features;
  const int64_t outputs = use.outputs;
  const bool labels = use.labels;
  const int64_t target_bytes = labels ? 4 : 4 * outputs;
  DataFootprint f;
  f.read.rows = rows * use.accumulation_steps;
  f.read.global_rows = data.batch_size * use.accumulation_steps;
  f.read.block_rows = data.block_rows;
  f.read.prefetch = data.prefetch;
  const int64_t slots = std::max<int64_t>(data.prefetch, 1);
  const int64_t slot_row = 4 * features + target_bytes + 8;  // x, target, sample index
  f.staging_bytes = slots * (rows + eval_rows) * slot_row;
  if (data.source == DataSource::hdf5) {
    f.source = "streamed from HDF5";
    f.read.row_bytes = 4 * features + target_bytes;
    f.read.pattern = data.shuffle == ShuffleMode::none   ? ReadPattern::sequential
                     : data.shuffle == ShuffleMode::rows ? ReadPattern::random_rows
                                                         : ReadPattern::blocks;
    // Scratch in sorted order: the order (8), x, and labels widened to 8 bytes.
    const int64_t scratch_row = 8 + 4 * features + (labels ? 8 : 4 * outputs);
    f.source_bytes = (rows + (data.test_path.empty() ? 0 : eval_rows)) * scratch_row;
    // The shards a batch reads share the caches, in the train and test sources.
    const int64_t sources = data.test_path.empty() ? 1 : 2;
    f.cache_bytes = sources * hdf5_chunk_cache_bytes(data, features, outputs);
    return f;
  }
  if (data.source == DataSource::stream) {
    // The buffer and the held-out window, float32 rows; the staging of the producers'
    // messages (4 per producer) depends on the producers, unknown to the plan.
    f.source = "a stream's buffer and held-out window (not its message staging)";
    f.read.pattern = ReadPattern::memory;
    f.read.row_bytes = 4 * (features + outputs);
    f.source_bytes = (use.stream_buffer_rows + use.stream_held_out_rows) * f.read.row_bytes;
    return f;
  }
  f.source = "in memory";
  f.read.pattern = ReadPattern::memory;
  if (data.source == DataSource::fashion_mnist) {
    const std::string dir = data.path.empty() ? default_fashion_mnist_dir() : data.path.front();
    f.read.row_bytes = features + 4;  // pixels as bytes, an int32 label
    try {
      const DataShape train = fashion_mnist_shape(dir, Split::train);
      f.read.row_bytes = train.features + 4;
      f.source_bytes = (train.num_samples + fashion_mnist_shape(dir, Split::test).num_samples) *
                       f.read.row_bytes;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::bad_input) throw;
      f.source = "in memory (not counted: " + std::string(e.what()) + ")";
    }
  } else {
    const int64_t train = data.synthetic_samples;
    f.read.row_bytes = 4 * (features + outputs);
    f.source_bytes = (train + std::max<int64_t>(1, train / 4)) * f.read.row_bytes;
  }
  return f;
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

namespace {

// The checked sample count: a batch larger than the data set is bad input, not a crash.
int64_t checked_samples(int64_t num_samples, int64_t global_batch) {
  if (global_batch < 1) {
    MESHTRAIN_BAD_INPUT("data.batch_size = ", global_batch, " must be positive");
  }
  if (global_batch > num_samples) {
    MESHTRAIN_BAD_INPUT("data.batch_size = ", global_batch, " is larger than the ", num_samples,
                        " training samples");
  }
  return num_samples;
}

}  // namespace

BatchSchedule::BatchSchedule(int64_t num_samples, int64_t global_batch, ShuffleMode shuffle,
                             uint64_t seed, int64_t block_rows, int64_t shuffle_window)
    : order_(checked_samples(num_samples, global_batch), shuffle, seed, block_rows, shuffle_window),
      global_batch_(global_batch),
      steps_per_epoch_(num_samples / global_batch) {}

std::vector<int64_t> BatchSchedule::permutation(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(num_samples()));
  for (int64_t i = 0; i < num_samples(); ++i) order[i] = order_.sample(epoch, i);
  return order;
}

int64_t BatchSchedule::sample(int64_t step, int64_t row) const {
  MESHTRAIN_REQUIRE(step >= 0 && row >= 0 && row < global_batch_, "BatchSchedule: step ", step,
                    " row ", row, " out of range");
  return order_.sample(epoch_of(step), (step % steps_per_epoch_) * global_batch_ + row);
}

std::vector<int64_t> BatchSchedule::global_batch_samples(int64_t step) const {
  std::vector<int64_t> rows(static_cast<size_t>(global_batch_));
  for (int64_t r = 0; r < global_batch_; ++r) rows[r] = sample(step, r);
  return rows;
}

void BatchSchedule::slice_samples(int64_t step, const BatchSlice& slice, int64_t* rows) const {
  MESHTRAIN_REQUIRE(slice.offset >= 0 && slice.offset + slice.global_batch <= global_batch_,
                    "BatchSchedule: rows [", slice.offset, ", +", slice.global_batch, ") of a ",
                    global_batch_, "-row batch");
  const int64_t begin = slice.begin();
  for (int64_t r = 0; r < slice.rows; ++r) rows[r] = sample(step, begin + r);
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

int64_t eval_slice_samples(const EvalSchedule& schedule, int64_t batch, const BatchSlice& slice,
                           int64_t* rows) {
  MESHTRAIN_REQUIRE(batch >= 0 && batch < schedule.num_batches, "evaluation batch ", batch, " of ",
                    schedule.num_batches);
  MESHTRAIN_REQUIRE(slice.global_batch == schedule.global_batch, "slice of a ", slice.global_batch,
                    "-row batch used with a ", schedule.global_batch, "-row evaluation schedule");
  const int64_t first = batch * schedule.global_batch + slice.begin();
  const int64_t valid = std::clamp<int64_t>(schedule.num_samples - first, 0, slice.rows);
  for (int64_t r = 0; r < valid; ++r) rows[r] = first + r;
  return valid;
}

}  // namespace meshtrain
