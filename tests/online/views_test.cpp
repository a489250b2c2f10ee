// The producer's Kokkos view sends (docs/online.md, "Producer API"): one program splits
// MPI_COMM_WORLD into producers and a trainer at every split the world allows (np 2: 1 + 1;
// np 3: 1 + 2 and 2 + 1; np 4: 2 + 2). Each producer sends the same rows twice, once through
// pointers and once through views of every layout (LayoutRight, LayoutLeft, a row-strided
// column block of a wider matrix, a LayoutStride view with strided columns; x and y of
// different layouts; the first rows of a longer view), float and double; each trainer rank's
// buffer must hold the same rows bit for bit from both streams. Registered EMULATED: with
// device memory emulated the views (in the default memory space) go through the producer's
// staging, the path a CUDA view takes (the deep copy of contiguous rows, the gather kernel of
// the others); without it they are packed straight from host memory. Shapes or a dtype that
// disagree with the stream: one sentence naming the stream and both shapes. A second float
// stream takes y of width 1 (the single-column paths: LayoutLeft y, a column of a LayoutRight
// matrix). No view send
// allocates (heap and Kokkos counted). The registration's
// timeout ends any hang.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/core/views.hpp"
#include "framework/stream/producer.hpp"
#include "framework/stream/stream_source.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kInputs = 5, kOutputs = 3;
constexpr int64_t kRows = 150;        // per producer
constexpr int64_t kMessageRows = 16;  // sends longer than a message are cut

// One split of the world: producers are world ranks [0, producers), the trainer the rest.
struct Split {
  int producers = 1, trainers = 1;
  bool producer = false;
  MPI_Comm comm = MPI_COMM_NULL;  // this side's
  int rank = 0;                   // in comm
  Split(int p, int t) : producers(p), trainers(t) {
    producer = world_rank() < producers;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, producer ? 0 : 1, world_rank(), &comm),
              "MPI_Comm_split");
    MPI_Comm_rank(comm, &rank);
  }
  ~Split() { MPI_Comm_free(&comm); }
  Split(const Split&) = delete;
  Split& operator=(const Split&) = delete;
};

std::vector<std::pair<int, int>> splits() {
  switch (world_size()) {
    case 2:
      return {{1, 1}};
    case 3:
      return {{1, 2}, {2, 1}};
    case 4:
      return {{2, 2}};
    default:
      return {};
  }
}

// Producer p's row r, element j of x (j < kInputs) or of y: distinct in every bit that float
// keeps (x[0] the row's id).
double value(int64_t p, int64_t r, int64_t j) {
  if (j == 0) return static_cast<double>(p * 100000 + r);
  return std::sin(0.013 * static_cast<double>(r) + 0.37 * static_cast<double>(p) +
                  0.71 * static_cast<double>(j));
}

// The sizes of the sends: irregular, some longer than a message.
std::vector<int64_t> send_sizes() {
  std::vector<int64_t> sizes;
  for (int64_t k = 0, r = 0; r < kRows; ++k) {
    sizes.push_back(std::min<int64_t>(1 + (k * 11) % 37, kRows - r));
    r += sizes.back();
  }
  return sizes;
}

StreamProducerOptions producer_options() {
  StreamProducerOptions options;
  options.message_rows = kMessageRows;
  options.ring_rows = 4 * kMessageRows;
  options.backpressure = StreamBackpressure::block;  // every row arrives
  return options;
}

// Rows through pointers, row-major.
template <class T>
void send_pointers(const Split& split, const std::string& name, StreamDtype dtype,
                   int64_t outputs) {
  StreamProducer producer;
  producer.connect(split.comm, name, kInputs, outputs, dtype, producer_options());
  std::vector<T> x(kRows * kInputs), y(kRows * outputs);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kInputs; ++j) x[r * kInputs + j] = T(value(split.rank, r, j));
    for (int64_t o = 0; o < outputs; ++o) y[r * outputs + o] = T(value(split.rank, r, kInputs + o));
  }
  int64_t r = 0;
  for (int64_t n : send_sizes()) {
    producer.send(x.data() + r * kInputs, y.data() + r * outputs, n);
    r += n;
  }
  producer.close();
  EXPECT_EQ(producer.rows_sent(), kRows);
}

// `view` (any layout, default memory space) holds rows [first, first + its extent 0) of x
// (column offset 0) or y (kInputs), filled through a host mirror as a simulation would.
template <class View>
void fill(const View& view, int64_t p, int64_t first, int64_t offset) {
  auto host = host_mirror(view);
  for (size_t i = 0; i < view.extent(0); ++i) {
    for (size_t j = 0; j < view.extent(1); ++j) {
      host(i, j) = typename View::non_const_value_type(
          value(p, first + static_cast<int64_t>(i), offset + static_cast<int64_t>(j)));
    }
  }
  Kokkos::deep_copy(view, host);
}

// The same rows through views, each send's x and y of another layout in turn.
template <class T>
void send_views(const Split& split, const std::string& name, StreamDtype dtype, int64_t outputs) {
  using Right = Kokkos::View<T**, Kokkos::LayoutRight>;
  using Left = Kokkos::View<T**, Kokkos::LayoutLeft>;
  using Strided = Kokkos::View<T**, Kokkos::LayoutStride>;
  StreamProducer producer;
  producer.connect(split.comm, name, kInputs, outputs, dtype, producer_options());
  const int64_t longest = 40;
  // Made before the sends, as a simulation's fields are.
  Right x_right("x_right", longest, kInputs), y_right("y_right", longest, outputs);
  Left x_left("x_left", longest, kInputs), y_left("y_left", longest, outputs);
  // Wider matrices whose column blocks are row-strided (LayoutRight, stride(0) > extent(1)).
  Right x_wide("x_wide", longest, kInputs + 3), y_wide("y_wide", longest, outputs + 2);
  // Every other column of a matrix twice as wide: a LayoutStride view.
  Right x_spread("x_spread", longest, 2 * kInputs), y_spread("y_spread", longest, 2 * outputs);
  // Each send's allocations, heap and Kokkos (the views' filling through mirrors left out).
  long heap = 0, kokkos = 0;
  const auto counted = [&](const auto& send) {
    testing::AllocationWindow window;
    send();
    heap += window.close();
    kokkos += window.kokkos_allocations();
  };
  int64_t r = 0, k = 0;
  for (int64_t n : send_sizes()) {
    const std::pair<int64_t, int64_t> rows(0, n);
    switch (k % 5) {
      case 0: {  // LayoutRight, exactly n rows
        auto x = Kokkos::subview(x_right, rows, Kokkos::ALL);
        auto y = Kokkos::subview(y_right, rows, Kokkos::ALL);
        fill(x, split.rank, r, 0);
        fill(y, split.rank, r, kInputs);
        counted([&] { producer.send(x, y); });
        break;
      }
      case 1: {  // LayoutLeft, the first n rows of longer views
        fill(x_left, split.rank, r, 0);
        fill(y_left, split.rank, r, kInputs);
        counted([&] { producer.send(x_left, y_left, n); });
        break;
      }
      case 2: {  // row-strided column blocks (x), LayoutLeft (y)
        auto x = Kokkos::subview(x_wide, rows, std::pair<int64_t, int64_t>(2, 2 + kInputs));
        auto y = Kokkos::subview(y_left, rows, Kokkos::ALL);
        fill(x, split.rank, r, 0);
        fill(y, split.rank, r, kInputs);
        counted([&] { producer.send(x, y); });
        break;
      }
      case 3: {  // strided columns
        Strided x(x_spread.data(), Kokkos::LayoutStride(n, 2 * kInputs, kInputs, 2));
        Strided y(y_spread.data() + 1, Kokkos::LayoutStride(n, 2 * outputs, outputs, 2));
        fill(x, split.rank, r, 0);
        fill(y, split.rank, r, kInputs);
        counted([&] { producer.send(x, y); });
        break;
      }
      default: {  // const views of LayoutRight (x) and row-strided (y)
        auto xm = Kokkos::subview(x_right, rows, Kokkos::ALL);
        auto ym = Kokkos::subview(y_wide, rows, std::pair<int64_t, int64_t>(1, 1 + outputs));
        fill(xm, split.rank, r, 0);
        fill(ym, split.rank, r, kInputs);
        Kokkos::View<const T**, Kokkos::LayoutRight> x = xm;
        Kokkos::View<const T**, Kokkos::LayoutStride> y = ym;
        counted([&] { producer.send(x, y); });
        break;
      }
    }
    r += n;
    ++k;
  }
  EXPECT_EQ(heap, 0) << "a view send allocated on the heap";
  EXPECT_EQ(kokkos, 0) << "a view send allocated a Kokkos view";
  if (outputs != kOutputs) {  // the refusals below are checked once, at kOutputs
    producer.close();
    EXPECT_EQ(producer.rows_sent(), kRows);
    EXPECT_EQ(producer.rows_dropped(), 0);
    return;
  }
  // Shapes or a dtype the stream does not take: one sentence, nothing sent.
  const std::string quoted = "stream \"" + name + "\"";
  testing::expect_bad_input(
      [&] { producer.send(x_right, Kokkos::subview(y_right, Kokkos::ALL, std::make_pair(0, 2))); },
      {quoted, "x of shape [40, 5]", "y of shape [40, 2]", "x [rows, 5]", "y [rows, 3]"});
  testing::expect_bad_input(
      [&] { producer.send(Kokkos::subview(x_wide, Kokkos::ALL, std::make_pair(0, 4)), y_right); },
      {quoted, "x of shape [40, 4]", "y of shape [40, 3]", "x [rows, 5]"});
  testing::expect_bad_input(
      [&] { producer.send(x_right, Kokkos::subview(y_right, std::make_pair(0, 3), Kokkos::ALL)); },
      {quoted, "x of shape [40, 5]", "y of shape [3, 3]"});
  testing::expect_bad_input([&] { producer.send(x_right, y_right, longest + 1); },
                            {quoted, "the first 41"});
  using Other = std::conditional_t<std::is_same<T, float>::value, double, float>;
  Kokkos::View<Other**> x_other("x_other", 2, kInputs), y_other("y_other", 2, outputs);
  testing::expect_bad_input([&] { producer.send(x_other, y_other); }, {quoted, "connected with"});
  producer.close();
  EXPECT_EQ(producer.rows_sent(), kRows);
  EXPECT_EQ(producer.rows_dropped(), 0);
}

// The rows this trainer rank's buffer holds, each [kInputs + outputs] floats as received,
// sorted (two producers' messages arrive in either order).
std::vector<std::vector<float>> receive(const Split& split, const std::string& name,
                                        StreamRowType dtype, int64_t outputs) {
  StreamSection section;
  section.name = name;
  section.buffer_rows = 2 * kRows;  // every row: nothing overwritten
  section.min_rows = 1;
  section.dtype = dtype;
  section.until = StreamUntil::closed;
  BatchSlice slice;
  slice.index = split.rank;
  slice.count = split.trainers;
  slice.global_batch = split.trainers;
  slice.rows = 1;
  StreamSource source(section, split.comm, slice, kInputs, outputs, 1, 7);
  do {
    source.pull();
  } while (!source.ended());
  source.finish();
  const StreamBuffer& buffer = source.buffer();
  EXPECT_EQ(buffer.overwritten(), 0);
  EXPECT_EQ(source.counters().rows_received, split.producers * kRows);
  std::vector<std::vector<float>> rows;
  for (int64_t s = 0; s < buffer.filled(); ++s) {
    std::vector<float> row(buffer.x(s), buffer.x(s) + kInputs);
    row.insert(row.end(), buffer.y(s), buffer.y(s) + outputs);
    rows.push_back(std::move(row));
  }
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) < 0;
  });
  return rows;
}

template <class T>
void views_equal_pointers(StreamDtype dtype, StreamRowType row_type, const char* tag,
                          int64_t outputs) {
  for (const auto& [p, t] : splits()) {
    SCOPED_TRACE(std::string(tag) + ": producers " + std::to_string(p) + " x trainers " +
                 std::to_string(t));
    Split split(p, t);
    const std::string pointers = std::string(tag) + "-pointers",
                      views = std::string(tag) + "-views";
    if (split.producer) {
      send_pointers<T>(split, pointers, dtype, outputs);
      send_views<T>(split, views, dtype, outputs);
      continue;
    }
    const auto from_pointers = receive(split, pointers, row_type, outputs);
    const auto from_views = receive(split, views, row_type, outputs);
    // Every row reached one trainer rank (dp: a batch group each).
    int64_t mine = static_cast<int64_t>(from_pointers.size()), all = 0;
    check_mpi(MPI_Allreduce(&mine, &all, 1, MPI_INT64_T, MPI_SUM, split.comm), "MPI_Allreduce");
    EXPECT_EQ(all, p * kRows);
    ASSERT_EQ(from_views.size(), from_pointers.size());
    for (size_t i = 0; i < from_views.size(); ++i) {
      ASSERT_EQ(std::memcmp(from_views[i].data(), from_pointers[i].data(),
                            from_views[i].size() * sizeof(float)),
                0)
          << "row " << i << " (id " << from_pointers[i][0] << ") differs";
    }
  }
}

TEST(StreamViews, FloatViewsOfEveryLayoutEqualPointers) {
  views_equal_pointers<float>(StreamDtype::float32, StreamRowType::float32, "f32", kOutputs);
}

TEST(StreamViews, DoubleViewsOfEveryLayoutEqualPointers) {
  views_equal_pointers<double>(StreamDtype::float64, StreamRowType::float64, "f64", kOutputs);
}

// y of width 1 (its own stream, connected with one output): LayoutLeft y (one span whatever
// the rows), one column of a LayoutRight matrix (row-strided: gathered, or one row per copy),
// every other column of a wider matrix; the pointer send's rows bit for bit.
TEST(StreamViews, FloatViewsOfWidthOneEqualPointers) {
  views_equal_pointers<float>(StreamDtype::float32, StreamRowType::float32, "f32w1", 1);
}

// Which path the views took, so that the emulated registration is known to stage them.
TEST(StreamViews, DefaultMemorySpaceViewsAreStagedWhereDeviceMemoryIsSeparate) {
  EXPECT_EQ(stream_detail::staged_view<Kokkos::View<float**>>(), device_memory_is_separate());
  using LeftView = Kokkos::View<const double**, Kokkos::LayoutLeft>;
  EXPECT_EQ(stream_detail::staged_view<LeftView>(), device_memory_is_separate());
}

}  // namespace
}  // namespace meshtrain
