#include "framework/stream/stream_buffer.hpp"

#include <algorithm>

#include "base/error.hpp"

namespace meshtrain {

StreamBuffer::StreamBuffer(int64_t capacity, int64_t features, int64_t outputs, StreamPolicy policy,
                           uint64_t seed, int64_t group)
    : capacity_(capacity),
      features_(features),
      outputs_(outputs),
      policy_(policy),
      seed_(seed),
      group_(group),
      x_(static_cast<size_t>(capacity * features)),
      y_(static_cast<size_t>(capacity * outputs)) {}

void StreamBuffer::add(const float* x, const float* y) {
  const int64_t n = seen_++;
  int64_t slot = n;
  if (n >= capacity_) {
    if (policy_ == StreamPolicy::window) {
      slot = n % capacity_;
    } else {
      const uint64_t h = stream_hash(seed_ ^ stream_hash(static_cast<uint64_t>(group_) ^
                                                         stream_hash(static_cast<uint64_t>(n))));
      slot = static_cast<int64_t>(h % static_cast<uint64_t>(n + 1));
    }
    ++overwritten_;  // the row in `slot` replaced, or row n not kept
    if (slot >= capacity_) return;
  } else {
    ++filled_;
  }
  std::copy(x, x + features_, x_.begin() + slot * features_);
  std::copy(y, y + outputs_, y_.begin() + slot * outputs_);
}

int64_t StreamBuffer::run_slot(int64_t rows) const {
  if (rows < 1 || rows > capacity_) return -1;
  if (policy_ == StreamPolicy::window) {
    const int64_t first = seen_ % capacity_;
    return first + rows <= capacity_ ? first : -1;
  }
  return seen_ + rows <= capacity_ ? seen_ : -1;  // the reservoir before it is full
}

void StreamBuffer::add_run(int64_t rows) {
  const int64_t before = std::max<int64_t>(0, seen_ - capacity_);
  seen_ += rows;
  filled_ = std::min(seen_, capacity_);
  overwritten_ += std::max<int64_t>(0, seen_ - capacity_) - before;
}

void StreamBuffer::restore_seen(int64_t seen) {
  if (seen < 0) MESHTRAIN_BAD_INPUT("a stream buffer's row count ", seen, " is negative");
  seen_ = seen;
  filled_ = std::min(seen, capacity_);
  overwritten_ = std::max<int64_t>(0, seen - capacity_);
}

}  // namespace meshtrain
