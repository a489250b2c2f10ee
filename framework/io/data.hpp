#pragma once
// Training and test data (docs/design.md, "Training modes" and "Configuration (TOML)", issue 4).
//
// Every rank holds the whole dataset (Fashion-MNIST is 47 MB as bytes) and computes the
// same global batch of a step from (seed, step) alone; it then copies only its own rows,
// the slice chosen by its index in the group over the batch axes. So:
//  - the global batch of step s is the same on every mesh and every world size;
//  - the data state to checkpoint is the step alone: BatchSchedule is a pure function of
//    (seed, num_samples, batch_size, shuffle, step); there is no RNG state to save.
//
// Storage is host memory (std::vector). fill_batch() writes into views the caller
// allocated once; for views in a host-accessible space nothing is allocated per step.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/views.hpp"
#include "framework/train/config.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

enum class Split { train, test };
const char* split_name(Split split);  // "train" | "test"

// One split of a dataset, in sample order. Inputs are stored either as bytes (`pixels`,
// read as pixel / 255 in [0, 1]) or as floats (`inputs`); exactly one is non-empty unless
// num_samples is 0. Targets are either class labels (num_classes > 0) or float regression
// targets (target_width > 0).
struct Dataset {
  std::string description;  // for messages, e.g. "Fashion-MNIST train (<path>)"
  int64_t num_samples = 0;
  int64_t features = 0;
  std::vector<uint8_t> pixels;  // [num_samples, features] row-major, scaled by 1/255 on read
  std::vector<float> inputs;    // [num_samples, features] row-major
  int64_t num_classes = 0;      // > 0: classification
  std::vector<int32_t> labels;  // [num_samples], each in [0, num_classes)
  int64_t target_width = 0;     // > 0: regression
  std::vector<float> targets;   // [num_samples, target_width] row-major

  bool classification() const { return num_classes > 0; }
  // Width of the model output this dataset needs: num_classes or target_width.
  int64_t output_width() const { return classification() ? num_classes : target_width; }
};

// Debian's dataset-fashion-mnist; used when data.path is empty.
const std::string& default_fashion_mnist_dir();

// Reads {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz from `dir` with zlib. Checks the
// IDX magic numbers, the sizes (image and label counts agree, nothing truncated) and that
// labels are in [0, 10). A missing, bad or truncated file is a bad_input Error naming the
// path and what is wrong.
Dataset load_fashion_mnist(const std::string& dir, Split split);

// A learnable regression set in the spirit of the reference notebook: inputs ~ N(0, 1)
// of width `input_width`, targets = tanh(x W) + 0.05 * N(0, 1) with a teacher W
// [input_width, output_width] ~ N(0, 1/input_width). W depends on `seed` only (shared by
// both splits); the train split has `train_samples` rows and the test split
// max(1, train_samples / 4), drawn from independent streams. Deterministic from the
// arguments on every platform (own Box-Muller on a std::mt19937_64 stream), and
// independent of the world size (every rank generates the whole set).
Dataset make_synthetic(int64_t train_samples, int64_t input_width, int64_t output_width,
                       uint64_t seed, Split split);

// A user dataset: an HDF5 file with /x (float [N, features]) and /y, either integer [N]
// class labels in [0, num_classes) or float [N, outputs] regression targets. Checks
// ranks, N agreement, label range (naming the file, the index and the value) and that
// inputs and targets are finite. Every rank reads the whole file with the default file
// access property list (no MPI-IO: the file is small and read-only). HDF5 failures are
// bad_input Errors carrying HDF5's own error stack.
Dataset load_hdf5_dataset(const std::string& path, int64_t num_classes);

// The dataset of `split` described by `data`, checked against the model:
// input_width (model.sizes[0]) must equal the data's features and output_width
// (model.sizes[-1]) the number of classes / the target width; a mismatch is a bad_input
// Error naming model.sizes and the data source and its width.
//  - fashion_mnist: data.path is the IDX directory (empty: default_fashion_mnist_dir()).
//  - synthetic: data.synthetic_samples training rows, generated from `seed`.
//  - hdf5: data.path (train) / data.test_path (test). With no test_path the test split
//    is an empty dataset (num_samples 0): evaluation has nothing to do.
Dataset load_dataset(const DataSection& data, Split split, uint64_t seed, int64_t input_width,
                     int64_t output_width);

// model.loss against the kind of targets of a loaded split: cross_entropy needs class
// labels, mse regression targets. A mismatch is a bad_input Error naming model.loss and
// data.source, found at set-up rather than as a shape error at the first step. An empty
// split (no test file) has no targets and passes.
void check_loss_fits_data(const std::string& loss, const DataSection& data, const Dataset& split);

// Which rows of every global batch this rank copies. The batch is split over the batch
// axes (the mesh axes of the logical axis `batch`, e.g. {"fsdp", "dp"}); the rank's index
// in that group picks rows [index * rows, (index + 1) * rows) with rows = B / count.
// Ranks that differ only on other axes (a tp group) get the same slice.
struct BatchSlice {
  int64_t global_batch = 0;
  int64_t index = 0;  // the rank's index in its group over the batch axes
  int64_t count = 1;  // size of that group (k)
  int64_t rows = 0;   // global_batch / count
  // Where this batch starts in a schedule's larger batch: micro-batch m of a step with
  // gradient accumulation is rows [m * global_batch, +global_batch) of the step's batch.
  int64_t offset = 0;
  int64_t begin() const { return offset + index * rows; }
};

// Throws bad_input naming `key` (e.g. "data.batch_size"), B and k when B is not a
// positive multiple of k. Axes the mesh does not have count as size 1.
BatchSlice make_batch_slice(const Mesh& mesh, int rank, const std::vector<std::string>& batch_axes,
                            int64_t global_batch, const std::string& key = "data.batch_size");

// The training order. steps_per_epoch = num_samples / global_batch: the last
// num_samples % global_batch samples of each epoch's order are dropped, so every step has
// a full batch of the same shape (and with shuffling, a different remainder is dropped
// each epoch). Epoch e's order is a permutation drawn from (seed, e) alone, or the
// identity when shuffle is off. Step s uses rows perm_e[(s mod steps_per_epoch) * B, +B)
// of epoch e = s / steps_per_epoch.
class BatchSchedule {
 public:
  // Throws bad_input naming data.batch_size when it is not positive or exceeds the
  // number of samples.
  BatchSchedule(int64_t num_samples, int64_t global_batch, bool shuffle, uint64_t seed);

  int64_t num_samples() const { return num_samples_; }
  int64_t global_batch() const { return global_batch_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  int64_t epoch_of(int64_t step) const { return step / steps_per_epoch_; }

  // Epoch `epoch`'s sample order (allocates; for tests and tools).
  std::vector<int64_t> permutation(int64_t epoch) const;
  // Sample index of row `row` of the global batch of `step`. Recomputes the epoch's
  // permutation into a buffer held here when the epoch changes (no allocation after
  // construction); not thread-safe.
  int64_t sample(int64_t step, int64_t row) const;
  // The whole global batch of `step` (allocates; for tests).
  std::vector<int64_t> global_batch_samples(int64_t step) const;

 private:
  void permutation_into(int64_t epoch, std::vector<int64_t>& out) const;
  int64_t num_samples_;
  int64_t global_batch_;
  int64_t steps_per_epoch_;
  bool shuffle_;
  uint64_t seed_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

// Batch inputs and regression targets are Matrix [rows, width]; class labels are:
using BatchLabels = Kokkos::View<int32_t*>;

// Host memory a batch is assembled in before its one copy to Kokkos' memory: pinned host
// memory with a CUDA Kokkos (allocated once by make_batch_staging, reused every step), and
// the batch views themselves when Kokkos' memory is host memory (no copy at all).
struct BatchStaging {
  Kokkos::View<float**, Kokkos::LayoutRight, HostStagingSpace> x;
  Kokkos::View<int32_t*, BatchLabels::array_layout, HostStagingSpace> labels;
  Kokkos::View<float**, Kokkos::LayoutRight, HostStagingSpace> targets;
};
// Staging shaped like the batch views (labels or targets may be empty views).
BatchStaging make_batch_staging(const Matrix& x, const BatchLabels& labels, const Matrix& targets);

// Writes this rank's rows of the global batch of `step` into preallocated views:
// x [slice.rows, features] and labels [slice.rows] (classification) or targets
// [slice.rows, target_width] (regression), assembled in `staging` (made for these views)
// or, without it, in host mirrors made for the call. Wrong shapes or the wrong kind of
// target are internal errors (MESHTRAIN_REQUIRE).
void fill_batch(const Dataset& data, const BatchSchedule& schedule, int64_t step,
                const BatchSlice& slice, const Matrix& x, const BatchLabels& labels,
                const BatchStaging* staging = nullptr);
void fill_batch(const Dataset& data, const BatchSchedule& schedule, int64_t step,
                const BatchSlice& slice, const Matrix& x, const Matrix& targets,
                const BatchStaging* staging = nullptr);

// Evaluation over a (test) split in sample order, in global batches of `global_batch`
// rows (data.eval_batch_size), sharded over the batch axes like training batches. The last
// batch may be partial: it is padded, not dropped, so every sample is evaluated exactly
// once and every batch has the same shape. Padded rows
// are zeros (label 0, target 0) and always come after the valid rows, so in each rank's
// slice the valid rows are a prefix: fill_eval_batch returns their number, and the
// caller counts only those rows and reduces (correct, loss sum, count) over the batch
// axes. Summed over the ranks of one batch group, the counts give num_samples.
struct EvalSchedule {
  int64_t num_samples = 0;
  int64_t global_batch = 0;
  int64_t num_batches = 0;  // ceil(num_samples / global_batch); 0 for an empty split
  // Throws bad_input naming `key` when global_batch is not positive.
  static EvalSchedule create(int64_t num_samples, int64_t global_batch,
                             const std::string& key = "data.eval_batch_size");
};

// `staging` as for fill_batch (the training run passes its own, so evaluation allocates
// no host mirrors per batch either).
int64_t fill_eval_batch(const Dataset& data, const EvalSchedule& schedule, int64_t batch,
                        const BatchSlice& slice, const Matrix& x, const BatchLabels& labels,
                        const BatchStaging* staging = nullptr);
int64_t fill_eval_batch(const Dataset& data, const EvalSchedule& schedule, int64_t batch,
                        const BatchSlice& slice, const Matrix& x, const Matrix& targets,
                        const BatchStaging* staging = nullptr);

}  // namespace meshtrain
