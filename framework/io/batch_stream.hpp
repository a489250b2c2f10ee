#pragma once
// Batches read ahead: a reader thread fills the next `depth` batches of a sequence into
// host staging buffers (pinned memory with a CUDA Kokkos) while the step computes; take()
// copies one into the batch views, waiting only when it is not there yet.
//
// A sequence is numbered 0, 1, 2, ...: for training, seq = step x accumulation + micro;
// for evaluation, seq = round x batches + batch. Asking for a batch other than the next
// one starts reading again from it (a resumed run, a benchmark that reloads a batch).
//
// The reader thread calls RowSource::read only: no MPI, no Kokkos (the buffers are made
// and copied from on the caller's thread), HDF5 only under hdf5::global_mutex(). Nothing is
// allocated after construction (but by a source's first read of a batch size). A read that
// throws (bad data, a file changed) is rethrown by the take() of that batch, on this rank.
// With depth 0 there is no thread: take() reads the batch itself.
//
// Normalization (data.normalize_inputs / normalize_targets): the rows just read are
// standardized in the staging slot, (x - mean) / std in float64 rounded once to float
// (standardize_rows), by whoever reads them (the reader thread when depth > 0), while they
// are in cache: no pass over the data set of its own. Padding rows stay zeros.

#include <Kokkos_Core.hpp>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "framework/core/views.hpp"
#include "framework/io/data.hpp"
#include "framework/io/normalization.hpp"

namespace meshtrain {

// Batch inputs and regression targets are Matrix [rows, width]; class labels are:
using BatchLabels = Kokkos::View<int32_t*>;

// The samples of batch `seq`: writes the sample of each of this rank's rows into
// rows[0, valid) and returns valid (rows after it are padding: zeros). Must be thread-safe.
using BatchSamples = std::function<int64_t(int64_t seq, int64_t* rows)>;

class BatchStream {
 public:
  // `rows`: this rank's rows of every batch. The reader thread (depth > 0) starts at
  // batch `first_seq` at once. `normalization`: the statistics applied to every batch (its
  // empty sides: none); widths checked against the source.
  BatchStream(RowSource& source, int64_t rows, BatchSamples samples, int64_t depth,
              int64_t first_seq = 0, Normalization normalization = {});
  ~BatchStream();
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // Copies batch `seq` into x [rows, features] and labels [rows] (classification) or
  // targets [rows, width] (the other an empty view); returns its valid rows.
  int64_t take(int64_t seq, const Matrix& x, const BatchLabels& labels, const Matrix& targets);
  // Seconds take() waited for the reader since the last call (and resets the count).
  double take_wait_seconds();
  int64_t depth() const { return depth_; }
  // Host bytes of the staging buffers and the sample lists.
  int64_t staging_bytes() const;

 private:
  using StagedMatrix = Kokkos::View<float**, Kokkos::LayoutRight, HostStagingSpace>;
  // The batch views' own layouts (a CUDA build's default is LayoutLeft): one contiguous copy.
  using StagedLabels = Kokkos::View<int32_t*, BatchLabels::array_layout, HostStagingSpace>;
  struct Slot {
    StagedMatrix x;
    StagedLabels labels;
    StagedMatrix targets;
    std::vector<int64_t> samples;
    int64_t seq = -1;
    int64_t valid = 0;
    bool ready = false;
    std::exception_ptr error;
  };

  void read_into(Slot& slot, int64_t seq);
  void reader_loop();

  RowSource& source_;
  const int64_t rows_;
  BatchSamples samples_;
  const int64_t depth_;
  const Normalization normalization_;  // immutable: read by the reader thread
  std::vector<Slot> slots_;  // depth_ of them (one without a thread)

  std::mutex mutex_;
  std::condition_variable filled_;  // a slot became ready
  std::condition_variable freed_;   // a slot was taken, or the sequence restarted, or stop
  int64_t next_take_ = 0;           // the batch take() expects next
  int64_t next_fill_ = 0;           // the batch the reader reads next
  uint64_t generation_ = 0;         // bumped by a restart: a read in flight is discarded
  bool stop_ = false;
  double wait_s_ = 0.0;
  std::thread reader_;
};

}  // namespace meshtrain
