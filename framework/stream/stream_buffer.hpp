#pragma once
// A trainer rank's bounded buffer of streamed rows (docs/online.md): at most `capacity` rows
// of x [features] and y [outputs], kept by policy window (row n to slot n mod capacity: the
// newest rows) or reservoir (algorithm R: a uniform sample of every row seen, its choices a
// hash of (seed, group, n), so there is no random state to keep). Allocates at construction
// only.

#include <cstdint>
#include <vector>

#include "framework/core/choices.hpp"  // StreamPolicy

namespace meshtrain {

// splitmix64's finalizer: the stream's hashes (reservoir slots, random batch rows).
inline uint64_t stream_hash(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class StreamBuffer {
 public:
  StreamBuffer(int64_t capacity, int64_t features, int64_t outputs, StreamPolicy policy,
               uint64_t seed, int64_t group);

  // Row n = seen(): kept, replacing a row (counted in overwritten()), or not kept (counted
  // there too).
  void add(const float* x, const float* y);
  // Rows n = seen() .. seen() + rows - 1 as one run of consecutive slots, filled in place by
  // the caller (a receive straight into x_data() and y_data()) and then counted by add_run:
  // the first slot, or -1 when they would not be consecutive (the window wraps within them;
  // the reservoir is full, so its rows go to hashed slots): add() them one by one then.
  int64_t run_slot(int64_t rows) const;
  // Counts the run run_slot gave as add() would count its rows one by one.
  void add_run(int64_t rows);
  int64_t capacity() const { return capacity_; }
  int64_t filled() const { return filled_; }  // min(seen, capacity)
  int64_t seen() const { return seen_; }
  int64_t overwritten() const { return overwritten_; }
  const float* x(int64_t slot) const { return x_.data() + slot * features_; }
  const float* y(int64_t slot) const { return y_.data() + slot * outputs_; }
  int64_t features() const { return features_; }
  int64_t outputs() const { return outputs_; }
  int64_t bytes() const { return static_cast<int64_t>((x_.size() + y_.size()) * sizeof(float)); }

  // A checkpoint's copy (docs/online.md): the slots' bits ([capacity, features] and
  // [capacity, outputs], written in place by a load) and seen(). filled() and overwritten()
  // follow from seen(), and the reservoir's choices are a hash of the row count, so a buffer
  // restored with restore_seen() continues exactly as the one saved.
  float* x_data() { return x_.data(); }
  float* y_data() { return y_.data(); }
  // Throws bad_input when `seen` is negative (a damaged checkpoint).
  void restore_seen(int64_t seen);

 private:
  int64_t capacity_, features_, outputs_;
  StreamPolicy policy_;
  uint64_t seed_;
  int64_t group_;
  std::vector<float> x_, y_;
  int64_t filled_ = 0, seen_ = 0, overwritten_ = 0;
};

}  // namespace meshtrain
