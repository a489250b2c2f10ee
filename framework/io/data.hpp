#pragma once
// Training and test data (docs/data.md).
//
// A data set is a RowSource: its shape, and read(rows), which fills host buffers with the
// rows asked for. Fashion-MNIST and the synthetic set live in memory (make_memory_source);
// HDF5 files are streamed (open_hdf5_source): a rank reads only the rows of its slice of
// each batch, so its memory does not grow with the data set.
//
// Every rank computes the same global batch of a step from (seed, step) alone and reads
// only its own rows, the slice chosen by its index in the group over the batch axes. So:
//  - the global batch of step s is the same on every mesh and every world size;
//  - the data state to checkpoint is the step alone: BatchSchedule is a pure function of
//    (seed, num_samples, batch_size, shuffle, step); there is no RNG state to save.
// BatchStream (batch_stream.hpp) reads the batches ahead on a background thread.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/io/data_config.hpp"
#include "framework/io/data_order.hpp"
#include "partition/cost_model.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

enum class Split { train, test };
const char* split_name(Split split);  // "train" | "test"

// What a data set is, without its rows: inputs are float [num_samples, features];
// targets are class labels (num_classes > 0) or float regression targets (target_width > 0).
struct DataShape {
  std::string description;  // for messages, e.g. "Fashion-MNIST train (<path>)"
  int64_t num_samples = 0;
  int64_t features = 0;
  int64_t num_classes = 0;   // > 0: classification
  int64_t target_width = 0;  // > 0: regression

  bool classification() const { return num_classes > 0; }
  // Width of the model output this dataset needs: num_classes or target_width.
  int64_t output_width() const { return classification() ? num_classes : target_width; }
};

// One split of a dataset in memory, in sample order. Inputs are stored either as bytes
// (`pixels`, read as pixel / 255 in [0, 1]) or as floats (`inputs`); exactly one is
// non-empty unless num_samples is 0.
struct Dataset : DataShape {
  std::vector<uint8_t> pixels;  // [num_samples, features] row-major, scaled by 1/255 on read
  std::vector<float> inputs;    // [num_samples, features] row-major
  std::vector<int32_t> labels;  // [num_samples], each in [0, num_classes)
  std::vector<float> targets;   // [num_samples, target_width] row-major
};

// Host memory one batch is read into, row-major: x [rows, features] and either labels
// [rows] or targets [rows, target_width] (the other null).
struct RowBuffers {
  float* x = nullptr;
  int32_t* labels = nullptr;
  float* targets = nullptr;
};

// Where rows come from. read() is called by one thread at a time (a BatchStream's reader
// thread) and makes no MPI or Kokkos calls; HDF5 calls hold hdf5::global_mutex().
class RowSource {
 public:
  virtual ~RowSource() = default;
  const DataShape& shape() const { return shape_; }
  // Fills row i of `out` with sample rows[i], for i in [0, count); rows may repeat and come
  // in any order. A row that fails its checks (a non-finite input or target, a label out of
  // range) or a failed read throws a runtime Error naming the file and the row. Allocates
  // only the first time it is asked for more rows than before.
  virtual void read(const int64_t* rows, int64_t count, const RowBuffers& out) = 0;
  // Host bytes the source holds (rows in memory; scratch buffers and caches of a stream).
  // Safe to call while another thread reads.
  virtual int64_t resident_bytes() const = 0;

 protected:
  DataShape shape_;
};

// The rows of an in-memory data set (owned), checked when they were made.
std::unique_ptr<RowSource> make_memory_source(Dataset data);

// HDF5 shards read as one data set (framework/io/data_hdf5.cpp): each file has /x float
// [N_i, features] and /y, integer [N_i] labels in [0, num_classes) or float [N_i, outputs]
// (or [N_i]) targets; the shards' rows follow each other in the order given. Contiguous
// datasets stored as native floats (or integers) are read with pread at their file offsets;
// others (chunked, compressed, another type) through HDF5, one read per shard and batch
// (each chunk decompressed at most once per batch). Memory does not grow with the number of
// shards: the shards a batch reads are its window; each of their chunked datasets keeps
// the chunks it read (with blocks: of the blocks a batch reads) while all the caches hold at
// most `chunk_cache_bytes` (split between /x and /y as their rows' bytes), and is emptied to
// the batch's chunks past it; the other shards' caches are released, and at most
// `open_shards` shards hold a descriptor (and an HDF5 file) open, the least recently read
// closing first.
// At open: a missing file, a shard of another width, type or kind of target is a bad_input
// Error naming the file. While reading: a row that fails its checks, or a file that changed
// size, is a runtime Error naming the file.
// How the rows will be read, so the kernel and HDF5 can be told: with `random_rows` the
// kernel's read-ahead is turned off (POSIX_FADV_RANDOM: a random row costs one page, not a
// read-ahead window), and with `block_rows` > 0 (data.shuffle = "blocks") each block a batch
// touches is asked for whole (POSIX_FADV_WILLNEED), so it is read once, sequentially, in the
// background. Either way a batch's rows are asked for all at once before they are read, so
// the disk has many reads in flight.
struct Hdf5SourceOptions {
  int64_t chunk_cache_bytes = int64_t{1} << 20;  // of all the chunk caches; HDF5's per dataset
  int64_t open_shards = 32;  // beyond a window of 8 blocks over shards of a block or more
  bool random_rows = false;
  int64_t block_rows = 0;
  std::string x_name = "/x";  // the datasets' paths in each file (data.x_key, data.y_key)
  std::string y_name = "/y";  // "": inputs only (predict): no labels or targets are read, and
                              // the shape has num_classes = target_width = 0
  // Non-empty: x_name holds rows of this shape, float [N, x_row_shape...] (Sobolev training's
  // dy_key, [N, outputs, k] with y_name ""), read as [N, product] row-major; another rank or
  // shape is a bad_input Error naming the file, data.<x_key_name> and both shapes.
  std::vector<int64_t> x_row_shape;
  std::string x_key_name = "x_key";
};
std::unique_ptr<RowSource> open_hdf5_source(const std::vector<std::string>& files,
                                            int64_t num_classes,
                                            const Hdf5SourceOptions& options = {});

// The files of data.path / data.test_path: each entry a file name, or a glob (with *, ? or
// [) replaced by its matches in sorted order. A glob that matches nothing is a bad_input
// Error naming `key` and the pattern.
std::vector<std::string> expand_data_paths(const std::vector<std::string>& entries,
                                           const std::string& key);

// Every row of a source, in order, in memory (allocates the whole set; for tests and tools).
Dataset read_all(RowSource& source);

// Debian's dataset-fashion-mnist; used when data.path is empty.
const std::string& default_fashion_mnist_dir();

// Reads {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz from `dir` with zlib. Checks the
// IDX magic numbers, the sizes (image and label counts agree, nothing truncated) and that
// labels are in [0, 10). A missing, bad or truncated file is a bad_input Error naming the
// path and what is wrong.
Dataset load_fashion_mnist(const std::string& dir, Split split);
// The same files' shape, from their headers alone (checked as load_fashion_mnist does).
DataShape fashion_mnist_shape(const std::string& dir, Split split);

// A learnable regression set in the spirit of the reference notebook: inputs ~ N(0, 1)
// of width `input_width`, targets = tanh(x W) + 0.05 * N(0, 1) with a teacher W
// [input_width, output_width] ~ N(0, 1/input_width). W depends on `seed` only (shared by
// both splits); the train split has `train_samples` rows and the test split
// max(1, train_samples / 4), drawn from independent streams. Deterministic from the
// arguments on every platform (own Box-Muller on a std::mt19937_64 stream), and
// independent of the world size (every rank generates the whole set).
Dataset make_synthetic(int64_t train_samples, int64_t input_width, int64_t output_width,
                       uint64_t seed, Split split);

// A user dataset in one HDF5 file, read whole into memory (open_hdf5_source + read_all).
Dataset load_hdf5_dataset(const std::string& path, int64_t num_classes);

// The data set of `split` described by `data`, checked against the model: input_width
// (model.sizes[0]) must equal the data's features and output_width (model.sizes[-1]) the
// number of classes / the target width; a mismatch is a bad_input Error naming model.sizes
// and the data source and its width.
//  - fashion_mnist: data.path is the IDX directory (empty: default_fashion_mnist_dir()).
//  - synthetic: data.synthetic_samples training rows, generated from `seed`.
//  - hdf5: data.path (train) / data.test_path (test), streamed. With no test_path the
//    test split is an empty source (num_samples 0): evaluation has nothing to do.
// `loss` (model.loss; empty while it is "auto"): checked against the split first
// (check_loss_fits_data), so that float labels under cross_entropy are told to be integers
// rather than of another width.
// The model keys a width mismatch names (kind = "residual_mlp": model.inputs, model.outputs).
struct ModelWidthKeys {
  const char* input = "model.sizes[0]";
  const char* output = "model.sizes[-1]";
};
std::unique_ptr<RowSource> open_data_source(const DataSection& data, Split split, uint64_t seed,
                                            int64_t input_width, int64_t output_width,
                                            std::optional<LossKind> loss = std::nullopt,
                                            const ModelWidthKeys& keys = {});
// Sobolev training (data.dy_key, docs/derivatives.md): the derivative targets of `split`'s
// files, streamed as rows of outputs x directions floats (dy[r, o, d] at column o *
// directions + d), in the same row numbers as open_data_source's; nullptr when data.dy_key is
// unset or the split has no files. Each file's dataset must be float [N, outputs, directions]
// with N its x's rows: a missing dataset or another shape is a bad_input Error naming the
// file, data.dy_key and both shapes. data.source must be "hdf5".
std::unique_ptr<RowSource> open_derivative_source(const DataSection& data, Split split,
                                                  int64_t outputs, int64_t directions);
// The same, read into memory (allocates the whole split; for tests and tools).
Dataset load_dataset(const DataSection& data, Split split, uint64_t seed, int64_t input_width,
                     int64_t output_width);
// A data set's shape against the model's widths, as open_data_source checks it.
void check_data_fits_model(const DataShape& shape, int64_t input_width, int64_t output_width,
                           const ModelWidthKeys& keys = {});

// model.loss against the kind of targets of a loaded split: cross_entropy needs class
// labels, mse regression targets. A mismatch is a bad_input Error naming model.loss and
// data.source, found at set-up rather than as a shape error at the first step. An empty
// split (no test file) has no targets and passes.
void check_loss_fits_data(LossKind loss, const DataSection& data, const DataShape& split);

// What the data path costs one rank: what `meshtrain plan` reports. Fashion-MNIST's rows are
// counted from its files' headers (not counted, and said so, where they cannot be read);
// an HDF5 stream's from the config alone (its files are not opened). `rows` / `eval_rows`:
// this rank's rows of a (micro-)batch and of an evaluation batch.
struct DataFootprint {
  std::string source;         // "in memory" or "streamed from HDF5" (and what is not counted)
  int64_t source_bytes = 0;   // rows in memory, or a stream's scratch (train and test)
  int64_t cache_bytes = 0;    // HDF5 chunk caches, at most, however many shards
  int64_t staging_bytes = 0;  // the staging slots of the train and evaluation streams
  int64_t total_bytes() const { return source_bytes + cache_bytes + staging_bytes; }
  DataRead read;  // one optimizer step's reads (for the cost model)
};
// The model's side of the data path: model.sizes' first and last widths, whether model.loss
// (resolved) reads class labels rather than targets, train.accumulation_steps.
struct DataUse {
  int64_t features = 0;
  int64_t outputs = 0;
  bool labels = false;
  int64_t accumulation_steps = 1;
  // data.source = "stream": a trainer rank's buffer and held-out window, in rows.
  int64_t stream_buffer_rows = 0;
  int64_t stream_held_out_rows = 0;
};
DataFootprint data_footprint(const DataSection& data, const DataUse& use, int64_t rows,
                             int64_t eval_rows);

// Which rows of every global batch this rank reads. The batch is split over the batch
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
// each epoch). Epoch e's order is DataOrder's (data_order.hpp), a function of (seed, e)
// alone. Step s uses positions [(s mod steps_per_epoch) * B, +B) of epoch s /
// steps_per_epoch. Holds no table; every method is const and thread-safe.
class BatchSchedule {
 public:
  // Throws bad_input naming data.batch_size when it is not positive or exceeds the
  // number of samples.
  BatchSchedule(int64_t num_samples, int64_t global_batch, ShuffleMode shuffle, uint64_t seed,
                int64_t block_rows = 1024, int64_t shuffle_window = 8);

  int64_t num_samples() const { return order_.num_samples(); }
  int64_t global_batch() const { return global_batch_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  const DataOrder& order() const { return order_; }
  int64_t epoch_of(int64_t step) const { return step / steps_per_epoch_; }

  // Epoch `epoch`'s sample order (allocates; for tests and tools).
  std::vector<int64_t> permutation(int64_t epoch) const;
  // Sample index of row `row` of the global batch of `step`.
  int64_t sample(int64_t step, int64_t row) const;
  // The whole global batch of `step` (allocates; for tests).
  std::vector<int64_t> global_batch_samples(int64_t step) const;
  // This rank's rows of (micro-)batch `slice` of `step`: their samples into rows[0,
  // slice.rows).
  void slice_samples(int64_t step, const BatchSlice& slice, int64_t* rows) const;

 private:
  DataOrder order_;
  int64_t global_batch_;
  int64_t steps_per_epoch_;
};

// Evaluation over a (test) split in sample order, in global batches of `global_batch`
// rows (data.eval_batch_size), sharded over the batch axes like training batches. The last
// batch may be partial: it is padded, not dropped, so every sample is evaluated exactly
// once and every batch has the same shape. Padded rows are zeros (label 0, target 0) and
// always come after the valid rows, so in each rank's slice the valid rows are a prefix:
// eval_slice_samples returns their number, and the caller counts only those rows and
// reduces (correct, loss sum, count) over the batch axes. Summed over the ranks of one
// batch group, the counts give num_samples.
struct EvalSchedule {
  int64_t num_samples = 0;
  int64_t global_batch = 0;
  int64_t num_batches = 0;  // ceil(num_samples / global_batch); 0 for an empty split
  // Throws bad_input naming `key` when global_batch is not positive.
  static EvalSchedule create(int64_t num_samples, int64_t global_batch,
                             const std::string& key = "data.eval_batch_size");
};

// This rank's rows of evaluation batch `batch`: their samples into rows[0, valid); returns
// valid (the rows after it are padding).
int64_t eval_slice_samples(const EvalSchedule& schedule, int64_t batch, const BatchSlice& slice,
                           int64_t* rows);

}  // namespace meshtrain
