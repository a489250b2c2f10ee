#pragma once
// The order in which an epoch visits the training rows, computed per position and never
// stored: a billion rows cost no memory, and every rank of every mesh computes the same
// global batch from (seed, epoch, position) alone (docs/data.md, "The order").
//
//  - none:   the file's order.
//  - rows:   a pseudo-random bijection of [0, N) keyed by (seed, epoch): a 6-round
//            Feistel network on the smallest even power of two >= N, with cycle walking
//            back into [0, N) (the small-domain cipher of tf.random.experimental.index_shuffle
//            and Grain). Rows are read at random: fine from memory or a warm page cache.
//  - blocks: contiguous blocks of block_rows rows in shuffled order; each window of
//            `window` consecutive blocks is one shuffle buffer whose rows are shuffled
//            among themselves. A batch (of a size that divides a window's rows) then reads
//            from at most `window` blocks, plus one for the window that holds the partial
//            last block, so a cold disk or a compressed, chunked file is read almost
//            sequentially, at the price of rows that are only shuffled within a window (as
//            a tf.data shuffle buffer).

#include <cstdint>
#include <string>

#include "framework/core/choices.hpp"  // ShuffleMode

namespace meshtrain {

// SplitMix64's finalizer: a well-mixed 64-bit function of its argument (the order's keys
// and round functions, the synthetic set's generator seeds).
uint64_t mix64(uint64_t z);

// A keyed bijection of [0, n): operator()(i) is a pseudo-random permutation of i.
// Cheap to build (no table) and thread-safe.
class IndexShuffle {
 public:
  IndexShuffle(uint64_t n, uint64_t key);
  uint64_t operator()(uint64_t index) const;
  uint64_t size() const { return n_; }

 private:
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const;  // a permutation of [0, 4^half_bits_)
  uint64_t n_;
  int half_bits_;
  uint64_t half_mask_;
  uint64_t round_keys_[kRounds];
};

// The order of every epoch of a training set: sample(epoch, position) for position in
// [0, num_samples). Plain data; every method is const and thread-safe.
class DataOrder {
 public:
  DataOrder(int64_t num_samples, ShuffleMode mode, uint64_t seed, int64_t block_rows = 1,
            int64_t window = 1);

  int64_t sample(int64_t epoch, int64_t position) const;
  int64_t num_samples() const { return num_samples_; }
  ShuffleMode mode() const { return mode_; }
  // What a checkpoint records, so a resumed run can refuse an order it would not
  // reproduce: "sequential samples=N", "index-shuffle-v1 samples=N",
  // "blocks-v1 samples=N block_rows=B window=W".
  std::string name() const;

 private:
  int64_t block_sample(int64_t epoch, int64_t position) const;
  int64_t num_samples_;
  ShuffleMode mode_;
  uint64_t seed_;
  int64_t block_rows_;
  int64_t window_;
  int64_t num_blocks_;
};

}  // namespace meshtrain
