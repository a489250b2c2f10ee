#include "framework/io/batch_stream.hpp"

#include <chrono>
#include <cstring>

#include "base/error.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/observe/trace.hpp"

namespace meshtrain {

BatchStream::BatchStream(RowSource& source, int64_t rows, BatchSamples samples, int64_t depth,
                         int64_t first_seq, Normalization normalization)
    : source_(source),
      rows_(rows),
      samples_(std::move(samples)),
      depth_(depth),
      normalization_(std::move(normalization)),
      next_take_(first_seq),
      next_fill_(first_seq) {
  MESHTRAIN_REQUIRE(rows >= 0 && depth >= 0 && first_seq >= 0, "BatchStream of ", rows,
                    " rows, depth ", depth, ", from batch ", first_seq);
  const DataShape& shape = source.shape();
  MESHTRAIN_REQUIRE(!normalization_.inputs() ||
                        static_cast<int64_t>(normalization_.input_mean.size()) == shape.features,
                    "BatchStream: ", normalization_.input_mean.size(), " input statistics for the ",
                    shape.features, " features of the ", shape.description);
  MESHTRAIN_REQUIRE(
      !normalization_.targets() ||
          (!shape.classification() &&
           static_cast<int64_t>(normalization_.target_mean.size()) == shape.target_width),
      "BatchStream: ", normalization_.target_mean.size(),
      " target statistics for the targets of the ", shape.description);
  slots_.resize(static_cast<size_t>(std::max<int64_t>(depth, 1)));
  for (Slot& slot : slots_) {
    slot.x = StagedMatrix("meshtrain::staged_x", rows, shape.features);
    if (shape.classification()) {
      slot.labels = StagedLabels("meshtrain::staged_labels", rows);
    } else if (shape.target_width > 0) {
      slot.targets = StagedMatrix("meshtrain::staged_targets", rows, shape.target_width);
    }
    slot.samples.resize(static_cast<size_t>(rows));
  }
  if (depth_ > 0) reader_ = std::thread([this] { reader_loop(); });
}

BatchStream::~BatchStream() {
  if (!reader_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  freed_.notify_all();
  reader_.join();
}

int64_t BatchStream::staging_bytes() const {
  const DataShape& shape = source_.shape();
  const int64_t per_slot = rows_ * (shape.features + shape.target_width) * 4 +
                           rows_ * (shape.classification() ? 4 : 0) + rows_ * 8;
  return per_slot * static_cast<int64_t>(slots_.size());
}

// Reads batch `seq` into `slot` (its samples, then its rows; padding rows zeroed).
void BatchStream::read_into(Slot& slot, int64_t seq) {
  slot.error = nullptr;
  try {
    const int64_t valid = samples_(seq, slot.samples.data());
    MESHTRAIN_REQUIRE(valid >= 0 && valid <= rows_, "batch ", seq, " has ", valid,
                      " valid rows of ", rows_);
    const RowBuffers out{slot.x.data(), slot.labels.data(), slot.targets.data()};
    if (valid > 0) source_.read(slot.samples.data(), valid, out);
    const int64_t features = static_cast<int64_t>(slot.x.extent(1));
    if (normalization_.inputs()) {
      standardize_rows(out.x, valid, features, normalization_.input_mean, normalization_.input_std);
    }
    if (normalization_.targets() && out.targets) {
      standardize_rows(out.targets, valid, static_cast<int64_t>(slot.targets.extent(1)),
                       normalization_.target_mean, normalization_.target_std);
    }
    std::memset(out.x + valid * features, 0, sizeof(float) * (rows_ - valid) * features);
    if (out.labels) std::memset(out.labels + valid, 0, sizeof(int32_t) * (rows_ - valid));
    if (out.targets) {
      const int64_t width = static_cast<int64_t>(slot.targets.extent(1));
      std::memset(out.targets + valid * width, 0, sizeof(float) * (rows_ - valid) * width);
    }
    slot.valid = valid;
  } catch (...) {
    slot.error = std::current_exception();
    slot.valid = 0;
  }
  slot.seq = seq;
}

void BatchStream::reader_loop() {
  const TraceLaneScope lane("data reader");
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    freed_.wait(lock, [&] { return stop_ || next_fill_ < next_take_ + depth_; });
    if (stop_) return;
    const int64_t seq = next_fill_;
    const uint64_t generation = generation_;
    Slot& slot = slots_[static_cast<size_t>(seq % depth_)];
    lock.unlock();
    // The slot is the reader's alone: take() reads only ready slots, and a restart waits
    // for no read but discards this one (by its generation) before the slot is handed out.
    {
      const TraceSpan span("read batch");
      read_into(slot, seq);
    }
    lock.lock();
    if (generation != generation_) continue;  // restarted meanwhile: read again
    slot.ready = true;
    ++next_fill_;
    filled_.notify_all();
  }
}

int64_t BatchStream::take(int64_t seq, const Matrix& x, const BatchLabels& labels,
                          const Matrix& targets) {
  Slot* slot = &slots_.front();
  if (depth_ == 0) {
    read_into(*slot, seq);
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    if (seq != next_take_) {
      // Out of sequence: drop what was read ahead and read from `seq` on.
      ++generation_;
      for (Slot& s : slots_) s.ready = false;
      next_take_ = next_fill_ = seq;
      freed_.notify_all();
    }
    slot = &slots_[static_cast<size_t>(seq % depth_)];
    if (!slot->ready) {
      const auto start = std::chrono::steady_clock::now();
      filled_.wait(lock, [&] { return slot->ready; });
      wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  MESHTRAIN_REQUIRE(slot->seq == seq, "BatchStream: slot holds batch ", slot->seq, ", not ", seq);
  // The slot stays the caller's until it is released below: the reader fills it only after.
  std::exception_ptr error = slot->error;
  const int64_t valid = slot->valid;
  if (!error) {
    copy_view(x, slot->x);
    if (labels.extent(0) > 0) copy_view(labels, slot->labels);
    if (targets.extent(0) > 0) copy_view(targets, slot->targets);
  }
  if (depth_ > 0) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot->ready = false;
      ++next_take_;
    }
    freed_.notify_all();
  }
  if (error) std::rethrow_exception(error);
  return valid;
}

double BatchStream::take_wait_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  const double waited = wait_s_;
  wait_s_ = 0.0;
  return waited;
}

}  // namespace meshtrain
