// BatchStream (framework/io/batch_stream.hpp): batches read ahead by a reader thread (depth
// > 0) or in take() (depth 0) are the batches of the sequence asked for: in order, after an
// out-of-order take (a restart), with padding rows zeroed; a source that throws on a row
// makes take() of that batch throw, on the caller's thread, and the batches after it are
// read as before; the reader reads ahead, and a stream is destroyed without waiting for
// batches nobody takes.

#include "framework/io/batch_stream.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "framework/io/data.hpp"
#include "tests/support/datasets.hpp"
#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::numbered_classes;
using testing::numbered_targets;

// An in-memory source that records who asks for which rows, throws a runtime Error on the
// rows in `bad`, and may sleep in every read.
class ProbeSource final : public RowSource {
 public:
  explicit ProbeSource(const Dataset& d, std::set<int64_t> bad = {},
                       std::chrono::milliseconds delay = std::chrono::milliseconds(0))
      : inner_(make_memory_source(d)), bad_(std::move(bad)), delay_(delay) {
    shape_ = inner_->shape();
  }
  void read(const int64_t* rows, int64_t count, const RowBuffers& out) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++reads_;
      threads_.insert(std::this_thread::get_id());
      for (int64_t i = 0; i < count; ++i) asked_.insert(rows[i]);
    }
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    for (int64_t i = 0; i < count; ++i) {
      if (bad_.count(rows[i])) MESHTRAIN_FAIL("probe source: row ", rows[i], " is bad");
    }
    inner_->read(rows, count, out);
  }
  int64_t resident_bytes() const override { return inner_->resident_bytes(); }

  int64_t reads() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reads_;
  }
  std::set<std::thread::id> threads() {
    std::lock_guard<std::mutex> lock(mutex_);
    return threads_;
  }
  bool asked_for(int64_t row) {
    std::lock_guard<std::mutex> lock(mutex_);
    return asked_.count(row) > 0;
  }

 private:
  std::unique_ptr<RowSource> inner_;
  std::set<int64_t> bad_;
  std::chrono::milliseconds delay_;
  std::mutex mutex_;
  int64_t reads_ = 0;
  std::set<std::thread::id> threads_;
  std::set<int64_t> asked_;
};

// Batch seq of `rows` rows: samples (seq * 3 + r) mod n, with valid = rows except every
// fourth batch, which has seq % rows valid rows (some have none).
int64_t test_batch(int64_t seq, int64_t rows, int64_t n, int64_t* out) {
  const int64_t valid = seq % 4 == 3 ? seq % rows : rows;
  for (int64_t r = 0; r < valid; ++r) out[r] = (seq * 3 + r) % n;
  return valid;
}

// Takes batch seq and checks every row: valid rows carry their sample, the rest zeros.
void expect_batch(BatchStream& stream, const Dataset& d, int64_t seq, int64_t rows) {
  SCOPED_TRACE("batch " + std::to_string(seq));
  Matrix x("x", rows, d.features);
  BatchLabels labels;
  Matrix targets;
  if (d.classification()) {
    labels = BatchLabels("labels", rows);
    Kokkos::deep_copy(labels, -5);
  } else {
    targets = Matrix("targets", rows, d.target_width);
    Kokkos::deep_copy(targets, -5.0f);
  }
  Kokkos::deep_copy(x, -5.0f);  // stale values that padding must overwrite
  const int64_t valid = stream.take(seq, x, labels, targets);
  std::vector<int64_t> expected(static_cast<size_t>(rows), -1);
  ASSERT_EQ(valid, test_batch(seq, rows, d.num_samples, expected.data()));
  const auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = r < valid ? expected[r] : -1;
    for (int64_t c = 0; c < d.features; ++c) {
      ASSERT_EQ(xh(r, c), s < 0 ? 0.0f : d.inputs[s * d.features + c]) << "row " << r;
    }
  }
  if (d.classification()) {
    const auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), labels);
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_EQ(lh(r), r < valid ? d.labels[expected[r]] : 0) << "row " << r;
    }
  } else {
    const auto th = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), targets);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < d.target_width; ++c) {
        ASSERT_EQ(th(r, c), r < valid ? d.targets[expected[r] * d.target_width + c] : 0.0f)
            << "row " << r;
      }
    }
  }
}

BatchSamples samples_of(int64_t rows, int64_t n) {
  return [rows, n](int64_t seq, int64_t* out) { return test_batch(seq, rows, n, out); };
}

TEST(BatchStream, BatchesInOrderWithPaddingZeroed) {
  for (const Dataset& d : {numbered_classes(50, 3, 7), numbered_targets(50, 4, 2)}) {
    for (int64_t depth : {0, 1, 2, 5}) {
      SCOPED_TRACE(d.description + ", depth " + std::to_string(depth));
      ProbeSource source(d);
      BatchStream stream(source, 6, samples_of(6, d.num_samples), depth);
      EXPECT_EQ(stream.depth(), depth);
      EXPECT_GT(stream.staging_bytes(), 0);
      for (int64_t seq = 0; seq < 24; ++seq) expect_batch(stream, d, seq, 6);
    }
  }
}

// Another batch than the next one: what was read ahead is dropped and reading starts again
// from it (a resumed run, a benchmark reloading a batch), forwards and backwards, also
// while the reader is in the middle of a slow read.
TEST(BatchStream, OutOfOrderTakeRestarts) {
  const Dataset d = numbered_classes(40, 2, 5);
  for (int64_t depth : {0, 1, 2, 3}) {
    for (int delay_ms : {0, 3}) {
      SCOPED_TRACE("depth " + std::to_string(depth) + ", delay " + std::to_string(delay_ms));
      ProbeSource source(d, {}, std::chrono::milliseconds(delay_ms));
      BatchStream stream(source, 4, samples_of(4, d.num_samples), depth, /*first_seq=*/5);
      for (int64_t seq : {5, 6, 7, 20, 21, 2, 3, 3, 3, 9, 0, 1, 2, 30, 31, 32, 33}) {
        expect_batch(stream, d, seq, 4);
      }
    }
  }
}

// The rows of one batch fail (a bad row, a changed file): take() of that batch throws the
// source's error, on the caller's thread; the batches before and after it are unharmed.
TEST(BatchStream, AReadErrorIsThrownByTheTakeOfItsBatch) {
  const Dataset d = numbered_classes(60, 3, 4);
  // Batch 4 (rows 12..17 of 60) holds row 14: only batch 4 reads it in seqs 0..9.
  for (int64_t depth : {0, 1, 2, 4}) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    ProbeSource source(d, {14});
    BatchStream stream(source, 6, samples_of(6, d.num_samples), depth);
    for (int64_t seq = 0; seq < 10; ++seq) {
      if (seq != 4) {
        expect_batch(stream, d, seq, 6);
        continue;
      }
      Matrix x("x", 6, 3);
      BatchLabels labels("labels", 6);
      testing::expect_error([&] { stream.take(seq, x, labels, Matrix()); }, ErrorKind::runtime,
                            {"probe source: row 14 is bad"});
    }
    // Asked again, the batch is read again, and fails again; then the stream goes on.
    Matrix x("x", 6, 3);
    BatchLabels labels("labels", 6);
    testing::expect_error([&] { stream.take(4, x, labels, Matrix()); }, ErrorKind::runtime,
                          {"row 14"});
    expect_batch(stream, d, 5, 6);
    expect_batch(stream, d, 6, 6);
  }
}

// With a reader thread the source is read on that thread, ahead of take(); without one,
// on the caller's thread, inside take().
TEST(BatchStream, ReadsAheadOnItsOwnThread) {
  const Dataset d = numbered_classes(64, 2, 3);
  {
    ProbeSource source(d);
    BatchStream stream(source, 4, samples_of(4, d.num_samples), 0);
    EXPECT_EQ(source.reads(), 0);
    expect_batch(stream, d, 0, 4);
    EXPECT_EQ(source.reads(), 1);
    EXPECT_EQ(source.threads(), std::set<std::thread::id>{std::this_thread::get_id()});
  }
  {
    ProbeSource source(d);
    BatchStream stream(source, 4, samples_of(4, d.num_samples), 3);
    // The first three batches are read without anyone asking.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (source.reads() < 3 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(source.reads(), 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(source.reads(), 3) << "read further than its depth";
    EXPECT_TRUE(source.asked_for(2 * 3));  // batch 2's first sample
    expect_batch(stream, d, 0, 4);
    const auto threads = source.threads();
    EXPECT_EQ(threads.size(), 1u);
    EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
    stream.take_wait_seconds();
    EXPECT_EQ(stream.take_wait_seconds(), 0.0);  // reset by the call before
  }
}

// take() waits for a slow source and says how long.
TEST(BatchStream, CountsTheTimeTakeWaited) {
  const Dataset d = numbered_classes(16, 2, 3);
  ProbeSource source(d, {}, std::chrono::milliseconds(20));
  BatchStream stream(source, 4, samples_of(4, d.num_samples), 2);
  stream.take_wait_seconds();
  for (int64_t seq = 0; seq < 3; ++seq) expect_batch(stream, d, seq, 4);
  EXPECT_GT(stream.take_wait_seconds(), 0.01);
}

// A stream whose reader is blocked (all slots full) or in a slow read is destroyed
// promptly.
TEST(BatchStream, IsDestroyedWithoutTakingItsBatches) {
  const Dataset d = numbered_classes(16, 2, 3);
  const auto start = std::chrono::steady_clock::now();
  for (int delay_ms : {0, 30}) {
    ProbeSource source(d, {}, std::chrono::milliseconds(delay_ms));
    { BatchStream stream(source, 4, samples_of(4, d.num_samples), 2); }
    {
      BatchStream stream(source, 4, samples_of(4, d.num_samples), 2);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace meshtrain
