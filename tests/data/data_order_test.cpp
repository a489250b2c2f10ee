// The training order (framework/io/data_order.hpp), computed per position: IndexShuffle is a
// bijection of [0, n) for every n (powers of two, their neighbours, primes, 1); the shuffled
// orders are bijections of the rows in every epoch, depend on (seed, epoch) alone and
// differ between epochs and seeds; blocks mode reads every global batch from at most
// `window` blocks (+1 for the partial last block); the names recorded in checkpoints.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "framework/io/data.hpp"
#include "framework/io/data_order.hpp"

namespace meshtrain {
namespace {

const std::vector<uint64_t> kSizes = {1, 2, 3, 4, 5, 7, 16, 17, 1000, 1024, 4097, 12345, 65539};

// True when values is a permutation of [0, n).
::testing::AssertionResult is_permutation_of_range(const std::vector<int64_t>& values, int64_t n) {
  if (static_cast<int64_t>(values.size()) != n) {
    return ::testing::AssertionFailure() << values.size() << " values for [0, " << n << ")";
  }
  std::vector<char> seen(static_cast<size_t>(n), 0);
  for (size_t i = 0; i < values.size(); ++i) {
    const int64_t v = values[i];
    if (v < 0 || v >= n) {
      return ::testing::AssertionFailure()
             << "position " << i << " maps to " << v << ", outside [0, " << n << ")";
    }
    if (seen[v]++)
      return ::testing::AssertionFailure() << v << " appears twice (position " << i << ")";
  }
  return ::testing::AssertionSuccess();
}

std::vector<int64_t> shuffle_values(const IndexShuffle& shuffle) {
  std::vector<int64_t> values(shuffle.size());
  for (uint64_t i = 0; i < shuffle.size(); ++i) values[i] = static_cast<int64_t>(shuffle(i));
  return values;
}

std::vector<int64_t> epoch_order(const DataOrder& order, int64_t epoch) {
  std::vector<int64_t> values(static_cast<size_t>(order.num_samples()));
  for (int64_t p = 0; p < order.num_samples(); ++p) values[p] = order.sample(epoch, p);
  return values;
}

std::vector<int64_t> identity(int64_t n) {
  std::vector<int64_t> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[i] = i;
  return values;
}

TEST(IndexShuffle, IsABijectionForEverySize) {
  for (uint64_t n : kSizes) {
    for (uint64_t key : {uint64_t{0}, uint64_t{1}, uint64_t{0xdeadbeefcafef00d}}) {
      const IndexShuffle shuffle(n, key);
      EXPECT_EQ(shuffle.size(), n);
      EXPECT_TRUE(is_permutation_of_range(shuffle_values(shuffle), static_cast<int64_t>(n)))
          << "n " << n << " key " << key;
    }
  }
}

TEST(IndexShuffle, DependsOnTheKeyAndLooksRandom) {
  const IndexShuffle a(1000, 7), b(1000, 7), c(1000, 8);
  const auto va = shuffle_values(a);
  EXPECT_EQ(va, shuffle_values(b));
  EXPECT_NE(va, shuffle_values(c));
  EXPECT_NE(va, identity(1000));
  // A random permutation has about one fixed point and rarely keeps neighbours together.
  int fixed = 0, neighbours = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    fixed += va[i] == i;
    if (i > 0) neighbours += std::abs(va[i] - va[i - 1]) == 1;
  }
  EXPECT_LT(fixed, 10);
  EXPECT_LT(neighbours, 20);
  // Every position can go anywhere: over many keys, position 0 reaches most values of a
  // small domain.
  std::set<uint64_t> reached;
  for (uint64_t key = 0; key < 200; ++key) reached.insert(IndexShuffle(10, key)(0));
  EXPECT_EQ(reached.size(), 10u);
}

TEST(DataOrder, NoneIsTheFileOrder) {
  const DataOrder order(37, ShuffleMode::none, 5);
  for (int64_t epoch : {0, 1, 9}) EXPECT_EQ(epoch_order(order, epoch), identity(37));
  EXPECT_EQ(order.name(), "sequential samples=37");
}

TEST(DataOrder, RowsIsABijectionOfEveryEpochFromSeedAndEpochAlone) {
  for (uint64_t n64 : kSizes) {
    const auto n = static_cast<int64_t>(n64);
    const DataOrder order(n, ShuffleMode::rows, 42);
    const DataOrder same(n, ShuffleMode::rows, 42);  // another object: nothing is cached
    for (int64_t epoch : {0, 1, 5}) {
      const auto values = epoch_order(order, epoch);
      EXPECT_TRUE(is_permutation_of_range(values, n)) << "n " << n << " epoch " << epoch;
      EXPECT_EQ(values, epoch_order(same, epoch)) << "n " << n << " epoch " << epoch;
    }
  }
  // Epochs and seeds differ; positions asked in any order give the same rows.
  const DataOrder order(1000, ShuffleMode::rows, 42);
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t epoch = 0; epoch < 4; ++epoch) epochs.push_back(epoch_order(order, epoch));
  for (size_t i = 0; i < epochs.size(); ++i) {
    EXPECT_NE(epochs[i], identity(1000)) << "epoch " << i;
    for (size_t j = i + 1; j < epochs.size(); ++j) EXPECT_NE(epochs[i], epochs[j]) << i << " " << j;
  }
  EXPECT_NE(epochs[0], epoch_order(DataOrder(1000, ShuffleMode::rows, 43), 0));
  for (int64_t p = 999; p >= 0; p -= 7) EXPECT_EQ(order.sample(3, p), epochs[3][p]);
  EXPECT_EQ(order.name(), "index-shuffle-v1 samples=1000");
  // The order of a row set does not depend on the block settings (they are for blocks).
  EXPECT_EQ(epoch_order(DataOrder(1000, ShuffleMode::rows, 42, 64, 4), 2), epochs[2]);
}

struct BlockCase {
  int64_t n, block_rows, window;
};

// Full blocks, a partial last block, fewer rows than a block, a window wider than the
// blocks, a window of one block, one row.
const std::vector<BlockCase> kBlockCases = {{1000, 100, 4}, {1000, 64, 3},  {10, 64, 8},
                                            {4097, 256, 8}, {130, 16, 100}, {777, 10, 1},
                                            {1, 1, 1},      {4096, 1, 8}};

TEST(DataOrder, BlocksIsABijectionOfEveryEpoch) {
  for (const BlockCase& c : kBlockCases) {
    const DataOrder order(c.n, ShuffleMode::blocks, 9, c.block_rows, c.window);
    const DataOrder same(c.n, ShuffleMode::blocks, 9, c.block_rows, c.window);
    for (int64_t epoch : {0, 1, 4}) {
      const auto values = epoch_order(order, epoch);
      EXPECT_TRUE(is_permutation_of_range(values, c.n))
          << "n " << c.n << " blocks of " << c.block_rows << " window " << c.window << " epoch "
          << epoch;
      EXPECT_EQ(values, epoch_order(same, epoch));
    }
  }
  const DataOrder order(1000, ShuffleMode::blocks, 9, 64, 3);
  EXPECT_EQ(order.name(), "blocks-v1 samples=1000 block_rows=64 window=3");
  const auto e0 = epoch_order(order, 0);
  EXPECT_NE(e0, identity(1000));
  EXPECT_NE(e0, epoch_order(order, 1));
  EXPECT_NE(e0, epoch_order(DataOrder(1000, ShuffleMode::blocks, 10, 64, 3), 0));
  EXPECT_NE(e0, epoch_order(DataOrder(1000, ShuffleMode::rows, 9, 64, 3), 0));
}

// The point of blocks: a global batch whose size divides a window's rows reads from the
// `window` blocks of its window only; the rows that the cycle walk moves off the padding
// of the partial last block come from one more block.
TEST(DataOrder, BlocksKeepEveryBatchInsideItsWindow) {
  struct Case {
    int64_t n, block_rows, window, batch;
  };
  const std::vector<Case> cases = {{1000, 100, 4, 50},  {1000, 64, 3, 64}, {1000, 64, 3, 96},
                                   {4097, 256, 8, 512}, {5000, 32, 2, 16}, {777, 10, 1, 5},
                                   {2000, 50, 4, 200},  {3001, 64, 8, 128}};
  for (const Case& c : cases) {
    ASSERT_EQ(c.block_rows * c.window % c.batch, 0);
    for (uint64_t seed : {1, 2, 3}) {
      const BatchSchedule schedule(c.n, c.batch, ShuffleMode::blocks, seed, c.block_rows, c.window);
      std::vector<int64_t> wide(2, 0);  // batches of more than `window` blocks, per epoch
      for (int64_t step = 0; step < 2 * schedule.steps_per_epoch(); ++step) {
        std::set<int64_t> blocks;
        for (int64_t s : schedule.global_batch_samples(step)) blocks.insert(s / c.block_rows);
        EXPECT_LE(static_cast<int64_t>(blocks.size()), c.window + 1)
            << "n " << c.n << " blocks of " << c.block_rows << " window " << c.window << " batch "
            << c.batch << " seed " << seed << " step " << step;
        wide[schedule.epoch_of(step)] += static_cast<int64_t>(blocks.size()) > c.window;
      }
      // Only the batches of the window holding the partial block read one more.
      for (int64_t count : wide) EXPECT_LE(count, c.block_rows * c.window / c.batch);
    }
  }
}

// The rows of a window are shuffled among themselves: a batch mixes several blocks, not
// one block's rows in file order.
TEST(DataOrder, BlocksShuffleRowsInsideTheWindow) {
  const BatchSchedule schedule(4096, 64, ShuffleMode::blocks, 5, 256, 4);
  for (int64_t step = 0; step < 8; ++step) {
    std::set<int64_t> blocks;
    int64_t ascending = 0;
    const auto batch = schedule.global_batch_samples(step);
    for (size_t r = 0; r < batch.size(); ++r) {
      blocks.insert(batch[r] / 256);
      if (r > 0) ascending += batch[r] == batch[r - 1] + 1;
    }
    EXPECT_GE(blocks.size(), 2u) << "step " << step;
    EXPECT_LT(ascending, 8) << "step " << step;
  }
}

TEST(DataOrder, SchedulePositionsFollowTheOrder) {
  // Step s is positions [(s mod steps) * B, +B) of epoch s / steps.
  for (ShuffleMode mode : {ShuffleMode::none, ShuffleMode::rows, ShuffleMode::blocks}) {
    const BatchSchedule schedule(103, 10, mode, 5, 8, 3);
    EXPECT_EQ(schedule.order().name(), DataOrder(103, mode, 5, 8, 3).name());
    for (int64_t step : {0, 3, 9, 10, 25, 4, 31}) {
      const auto perm = schedule.permutation(step / 10);
      EXPECT_TRUE(is_permutation_of_range(perm, 103));
      const auto batch = schedule.global_batch_samples(step);
      for (int r = 0; r < 10; ++r) {
        EXPECT_EQ(batch[r], perm[(step % 10) * 10 + r]) << "step " << step << " row " << r;
        EXPECT_EQ(schedule.sample(step, r), batch[r]);
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
