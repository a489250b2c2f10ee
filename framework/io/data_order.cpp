#include "framework/io/data_order.hpp"

#include <algorithm>

#include "base/error.hpp"

namespace meshtrain {

uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
namespace {

// The key of one permutation: the run's seed, the epoch, and which permutation of the
// epoch (the row order, the block order, or window w's rows).
uint64_t order_key(uint64_t seed, int64_t epoch, uint64_t stream) {
  return mix64(mix64(seed ^ 0x6f72646572ULL) + static_cast<uint64_t>(epoch)) ^
         mix64(stream + 0x5851f42d4c957f2dULL);
}

constexpr uint64_t kRowStream = 0;
constexpr uint64_t kBlockStream = 1;
constexpr uint64_t kWindowStreamBase = 2;

}  // namespace

IndexShuffle::IndexShuffle(uint64_t n, uint64_t key) : n_(n) {
  MESHTRAIN_REQUIRE(n >= 1 && n < (uint64_t{1} << 62), "IndexShuffle of ", n, " elements");
  int bits = 2;
  while ((uint64_t{1} << bits) < n) ++bits;
  half_bits_ = (bits + 1) / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  for (int r = 0; r < kRounds; ++r) round_keys_[r] = mix64(key + 0x9e3779b97f4a7c15ULL * (r + 1));
}

uint64_t IndexShuffle::encrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_;
  uint64_t right = x & half_mask_;
  for (uint64_t key : round_keys_) {
    const uint64_t mixed = left ^ (mix64(right ^ key) & half_mask_);
    left = right;
    right = mixed;
  }
  return (left << half_bits_) | right;
}

uint64_t IndexShuffle::operator()(uint64_t index) const {
  MESHTRAIN_REQUIRE(index < n_, "IndexShuffle: index ", index, " of ", n_);
  // Cycle walking: the cipher permutes a domain of up to 4n; applying it again until the
  // value falls in [0, n) follows index's cycle, so the result is a bijection of [0, n).
  uint64_t x = encrypt(index);
  while (x >= n_) x = encrypt(x);
  return x;
}

DataOrder::DataOrder(int64_t num_samples, ShuffleMode mode, uint64_t seed, int64_t block_rows,
                     int64_t window)
    : num_samples_(num_samples),
      mode_(mode),
      seed_(seed),
      block_rows_(block_rows),
      window_(window),
      num_blocks_(0) {
  MESHTRAIN_REQUIRE(num_samples >= 1 && block_rows >= 1 && window >= 1, "DataOrder of ",
                    num_samples, " samples, blocks of ", block_rows, ", window ", window);
  num_blocks_ = (num_samples + block_rows - 1) / block_rows;
}

std::string DataOrder::name() const {
  const std::string samples = " samples=" + std::to_string(num_samples_);
  switch (mode_) {
    case ShuffleMode::none:
      return "sequential" + samples;
    case ShuffleMode::rows:
      return "index-shuffle-v1" + samples;
    case ShuffleMode::blocks:
      return "blocks-v1" + samples + " block_rows=" + std::to_string(block_rows_) +
             " window=" + std::to_string(window_);
  }
  return "unknown";
}

int64_t DataOrder::sample(int64_t epoch, int64_t position) const {
  MESHTRAIN_REQUIRE(epoch >= 0 && position >= 0 && position < num_samples_, "DataOrder: epoch ",
                    epoch, " position ", position, " of ", num_samples_);
  switch (mode_) {
    case ShuffleMode::none:
      return position;
    case ShuffleMode::rows:
      return static_cast<int64_t>(
          IndexShuffle(static_cast<uint64_t>(num_samples_),
                       order_key(seed_, epoch, kRowStream))(static_cast<uint64_t>(position)));
    case ShuffleMode::blocks:
      return block_sample(epoch, position);
  }
  return position;
}

// Position -> row: window w holds the shuffled block slots [w x window, (w + 1) x window);
// its rows are shuffled among themselves. The partial last block (N not a multiple of
// block_rows) has `padding` rows fewer than a block, wherever its slot falls: the last
// window therefore has `padding` fewer positions than rows and leaves out the last
// `padding` rows of its last slot's block, and a position that lands on a padding row of
// the partial block takes one of those instead. So a window's positions read its own
// blocks and at most one more, and the epoch is a bijection of [0, N) without walking.
int64_t DataOrder::block_sample(int64_t epoch, int64_t position) const {
  const int64_t window_rows = window_ * block_rows_;
  const int64_t padding = num_blocks_ * block_rows_ - num_samples_;  // in [0, block_rows)
  const int64_t w = position / window_rows;
  const int64_t blocks_here = std::min(window_, num_blocks_ - w * window_);
  const bool last_window = (w + 1) * window_ >= num_blocks_;
  const int64_t pool = blocks_here * block_rows_ - (last_window ? padding : 0);
  const IndexShuffle within(static_cast<uint64_t>(pool),
                            order_key(seed_, epoch, kWindowStreamBase + static_cast<uint64_t>(w)));
  const auto pooled =
      static_cast<int64_t>(within(static_cast<uint64_t>(position - w * window_rows)));
  const IndexShuffle blocks(static_cast<uint64_t>(num_blocks_),
                            order_key(seed_, epoch, kBlockStream));
  const auto block =
      static_cast<int64_t>(blocks(static_cast<uint64_t>(w * window_ + pooled / block_rows_)));
  const int64_t offset = pooled % block_rows_;
  const int64_t rows_in_block = block == num_blocks_ - 1 ? block_rows_ - padding : block_rows_;
  if (offset < rows_in_block) return block * block_rows_ + offset;
  // A padding row of the partial block: the row the last window left out.
  const auto last_slot_block = static_cast<int64_t>(blocks(static_cast<uint64_t>(num_blocks_ - 1)));
  return last_slot_block * block_rows_ + (block_rows_ - padding) + (offset - rows_in_block);
}

}  // namespace meshtrain
