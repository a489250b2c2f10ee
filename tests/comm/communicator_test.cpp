// Every collective of Communicator (MPI backend) against the same result computed on one
// rank from the full data, on the world and on sub-communicators of an fsdp x tp mesh;
// the same with a 16-bit wire (bf16, fp16: rounded blocks, sums rounded per addition);
// the timeout of a collective a rank never joins; bad input.

#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/device_memory_emulation.hpp"
#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/exit_policy.hpp"
#include "tests/support/communicator_cases.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

// Block of group rank j as sent by that rank: rows x cols from (seed, j), in the default
// memory space (what the communicator takes) or on the host (what the test reads).
uint64_t block_seed(const Group& g, int j, int salt) {
  return g.seed * 131 + static_cast<uint64_t>(j) * 7 + salt;
}
DeviceMatrix rank_block(const Group& g, int j, std::size_t rows, std::size_t cols, int salt = 0) {
  return make_matrix("block", rows, cols, block_seed(g, j, salt));
}
HostMatrix host_block(const Group& g, int j, std::size_t rows, std::size_t cols, int salt = 0) {
  return make_host_matrix("block", rows, cols, block_seed(g, j, salt));
}

// A host copy of a 1-D view of the default memory space.
template <class View>
auto host_vector(const View& v) {
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
}

TEST(Communicator, AllGatherBothDimsAndVectors) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const std::size_t r = 3, c = 5;  // odd blocks
    DeviceMatrix mine = rank_block(g, comm.rank(), r, c);
    for (int dim = 0; dim < 2; ++dim) {
      DeviceMatrix out("out", dim == 0 ? n * r : r, dim == 1 ? n * c : c);
      comm.all_gather(mine, out, dim);
      std::vector<double> want(out.extent(0) * out.extent(1));
      for (std::size_t j = 0; j < n; ++j) {
        HostMatrix b = host_block(g, static_cast<int>(j), r, c);
        for (std::size_t x = 0; x < r; ++x)
          for (std::size_t y = 0; y < c; ++y) {
            const std::size_t row = dim == 0 ? j * r + x : x, col = dim == 1 ? j * c + y : y;
            want[row * out.extent(1) + col] = b(x, y);
          }
      }
      expect_matches(out, want, 0, 0, out.extent(1),
                     "all_gather dim " + std::to_string(dim) + " on " + g.name);
    }
    // 1-D: the flat block.
    Kokkos::View<float*> flat("flat", n * r * c);
    comm.all_gather(ConstVectorView(mine.data(), r * c), flat);
    auto flat_host = host_vector(flat);
    for (std::size_t j = 0; j < n; ++j) {
      HostMatrix b = host_block(g, static_cast<int>(j), r, c);
      for (std::size_t k = 0; k < r * c; ++k) {
        ASSERT_EQ(flat_host(j * r * c + k), b.data()[k]) << "1-D all_gather on " << g.name;
      }
    }
  }
}

TEST(Communicator, ReduceScatterBothDimsAndVectors) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const std::size_t i = static_cast<std::size_t>(comm.rank());
    const std::size_t r = 3, c = 5;
    for (int dim = 0; dim < 2; ++dim) {
      const std::size_t rows = dim == 0 ? n * r : r, cols = dim == 1 ? n * c : c;
      DeviceMatrix mine = rank_block(g, comm.rank(), rows, cols, 1);
      DeviceMatrix out("out", r, c);
      comm.reduce_scatter(mine, out, dim);
      std::vector<double> sum(rows * cols, 0.0);
      for (std::size_t j = 0; j < n; ++j) {
        HostMatrix b = host_block(g, static_cast<int>(j), rows, cols, 1);
        for (std::size_t k = 0; k < rows * cols; ++k) sum[k] += b.data()[k];
      }
      expect_matches(out, sum, dim == 0 ? i * r : 0, dim == 1 ? i * c : 0, cols,
                     "reduce_scatter dim " + std::to_string(dim) + " on " + g.name);
    }
    DeviceMatrix flat_in = rank_block(g, comm.rank(), 1, n * 4, 2);
    Kokkos::View<float*> flat_out("flat_out", 4);
    comm.reduce_scatter(ConstVectorView(flat_in.data(), n * 4), flat_out);
    auto flat_out_host = host_vector(flat_out);
    for (std::size_t k = 0; k < 4; ++k) {
      double s = 0;
      for (std::size_t j = 0; j < n; ++j)
        s += host_block(g, static_cast<int>(j), 1, n * 4, 2)(0, i * 4 + k);
      EXPECT_NEAR(flat_out_host(k), s, 1e-5 * (1 + std::fabs(s)))
          << "1-D reduce_scatter on " << g.name;
    }
  }
}

TEST(Communicator, AllReduceBroadcastAllToAll) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    const std::size_t i = static_cast<std::size_t>(comm.rank());
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean}) {
      DeviceMatrix data = rank_block(g, comm.rank(), 3, 7, 3);
      comm.all_reduce(MatrixView(data), op);
      std::vector<double> want(21, 0.0);
      for (int j = 0; j < n; ++j) {
        HostMatrix b = host_block(g, j, 3, 7, 3);
        for (std::size_t k = 0; k < 21; ++k) want[k] += b.data()[k];
      }
      if (op == ReduceOp::mean)
        for (double& w : want) w /= n;
      expect_matches(
          data, want, 0, 0, 7,
          std::string("all_reduce ") + (op == ReduceOp::mean ? "mean" : "sum") + " on " + g.name);
    }
    // broadcast from the last rank
    DeviceMatrix data = rank_block(g, comm.rank(), 2, 5, 4);
    comm.broadcast(MatrixView(data), n - 1);
    HostMatrix got = to_host(data), root = host_block(g, n - 1, 2, 5, 4);
    for (std::size_t k = 0; k < 10; ++k) ASSERT_EQ(got.data()[k], root.data()[k]) << g.name;
    // all_to_all: block j of my send goes to rank j
    const std::size_t b = 3, c = 2;
    DeviceMatrix send = rank_block(g, comm.rank(), n * b, c, 5);
    DeviceMatrix recv("recv", n * b, c);
    comm.all_to_all(send, recv);
    const HostMatrix recv_host = to_host(recv);
    for (int j = 0; j < n; ++j) {
      HostMatrix theirs = host_block(g, j, n * b, c, 5);
      for (std::size_t x = 0; x < b; ++x)
        for (std::size_t y = 0; y < c; ++y)
          ASSERT_EQ(recv_host(j * b + x, y), theirs(i * b + x, y)) << "all_to_all on " << g.name;
    }
    comm.barrier();
  }
}

TEST(Communicator, ShiftIsNonBlockingAndRoutesByOffset) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    for (int offset : {1, -1, 2, n + 1}) {
      DeviceMatrix send = rank_block(g, comm.rank(), 3, 4, 6);
      DeviceMatrix recv("recv", 3, 4);
      Request request = comm.shift(send, recv, offset);
      request.wait();
      EXPECT_FALSE(request.pending());
      const int from = ((comm.rank() - offset) % n + n) % n;
      HostMatrix got = to_host(recv), want = host_block(g, from, 3, 4, 6);
      for (std::size_t k = 0; k < 12; ++k)
        ASSERT_EQ(got.data()[k], want.data()[k]) << "shift " << offset << " on " << g.name;
    }
    // Two shifts in flight in opposite directions (as the bidirectional ring does).
    DeviceMatrix up_send = rank_block(g, comm.rank(), 2, 3, 7),
                 dn_send = rank_block(g, comm.rank(), 2, 3, 8);
    DeviceMatrix up_recv("up", 2, 3), dn_recv("dn", 2, 3);
    Request up = comm.shift(up_send, up_recv, +1);
    Request dn = comm.shift(dn_send, dn_recv, -1);
    while (!up.test()) {
    }
    dn.wait();
    HostMatrix up_want = host_block(g, (comm.rank() - 1 + n) % n, 2, 3, 7);
    HostMatrix dn_want = host_block(g, (comm.rank() + 1) % n, 2, 3, 8);
    const HostMatrix up_got = to_host(up_recv), dn_got = to_host(dn_recv);
    for (std::size_t k = 0; k < 6; ++k) {
      ASSERT_EQ(up_got.data()[k], up_want.data()[k]) << g.name;
      ASSERT_EQ(dn_got.data()[k], dn_want.data()[k]) << g.name;
    }
  }
}

// start_all_gather: the blocks of the blocking gather, in rank order, while a blocking
// collective runs on the same communicator; place_gathered_columns turns the blocks of a
// dim-1 gather into the matrix all_gather(dim 1) gives.
TEST(Communicator, StartedAllGatherMatchesTheBlockingOne) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    const std::size_t r = 3, c = 5;
    DeviceMatrix mine = rank_block(g, comm.rank(), r, c, 9);
    Kokkos::View<float*> blocks("blocks", n * r * c);
    Request started = comm.start_all_gather(ConstVectorView(mine.data(), r * c), blocks);
    // A blocking collective on the same group while the gather is in flight.
    Kokkos::View<float*> ones("ones", 4);
    Kokkos::deep_copy(ones, 1.0f);
    comm.all_reduce(VectorView(ones.data(), 4));
    started.wait();
    EXPECT_FALSE(started.pending());
    EXPECT_EQ(host_vector(ones)(3), static_cast<float>(n)) << g.name;

    Kokkos::View<float*> flat("flat", n * r * c);
    comm.all_gather(ConstVectorView(mine.data(), r * c), flat);
    const auto got = host_vector(blocks), want = host_vector(flat);
    for (std::size_t k = 0; k < n * r * c; ++k)
      ASSERT_EQ(got(k), want(k)) << "started all_gather on " << g.name << " at " << k;

    DeviceMatrix placed("placed", r, n * c), gathered("gathered", r, n * c);
    place_gathered_columns(blocks, placed, n);
    comm.all_gather(mine, gathered, 1);
    const HostMatrix placed_host = to_host(placed), gathered_host = to_host(gathered);
    for (std::size_t k = 0; k < r * n * c; ++k)
      ASSERT_EQ(placed_host.data()[k], gathered_host.data()[k]) << "dim-1 blocks on " << g.name;
  }
}

// start_all_reduce: several in flight at once (as DP gradient buckets are), a blocking
// all-reduce on the same group between them, completed out of order; each equals the
// blocking all_reduce of the same data bit for bit and the one-rank sum of every rank's block.
TEST(Communicator, StartedAllReduceMatchesTheBlockingOne) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    const std::size_t rows[3] = {3, 1, 40}, cols = 7;  // odd sizes, one of them 280 floats
    DeviceMatrix started_data[3], blocking_data[3];
    Request started[3];
    Kokkos::View<float*> ones("ones", 4);
    Kokkos::deep_copy(ones, 1.0f);
    for (int b = 0; b < 3; ++b) {
      started_data[b] = rank_block(g, comm.rank(), rows[b], cols, 10 + b);
      blocking_data[b] = rank_block(g, comm.rank(), rows[b], cols, 10 + b);
      started[b] = comm.start_all_reduce(VectorView(started_data[b].data(), rows[b] * cols));
      // A blocking collective on the same group while the first is in flight.
      if (b == 0) comm.all_reduce(VectorView(ones.data(), 4));
    }
    EXPECT_EQ(host_vector(ones)(3), static_cast<float>(n)) << g.name;
    while (!started[2].test()) {
    }
    EXPECT_FALSE(started[2].pending());
    started[0].wait();
    started[1].wait();
    for (int b = 0; b < 3; ++b) {
      comm.all_reduce(MatrixView(blocking_data[b]));
      const HostMatrix got = to_host(started_data[b]), want = to_host(blocking_data[b]);
      for (std::size_t k = 0; k < rows[b] * cols; ++k)
        ASSERT_EQ(got.data()[k], want.data()[k]) << "started all_reduce " << b << " on " << g.name;
      std::vector<double> sum(rows[b] * cols, 0.0);
      for (int j = 0; j < n; ++j) {
        HostMatrix block = host_block(g, j, rows[b], cols, 10 + b);
        for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += block.data()[k];
      }
      expect_matches(started_data[b], sum, 0, 0, cols,
                     "started all_reduce " + std::to_string(b) + " on " + g.name);
    }
    // An empty buffer completes at once.
    Request none = comm.start_all_reduce(VectorView());
    none.wait();
  }
}

// ------------------------------------------------------------- 16-bit wire (bf16, fp16)

// A 16-bit wire dtype under test: its unit roundoff (half the spacing of its values at 1:
// the largest relative error of one rounding) and its smallest subnormal (the largest
// absolute error of one rounding below the normal range is half of it).
struct Wire {
  Dtype dtype;
  const char* name;
  double unit_roundoff;
  double smallest_subnormal;
};
const Wire kWires[] = {{Dtype::bf16, "bf16", 0x1p-8, 0x1p-133},
                       {Dtype::fp16, "fp16", 0x1p-11, 0x1p-24}};

// host_block rounded to `dtype` element by element: what rank j puts on a 16-bit wire.
HostMatrix rounded_host_block(const Group& g, int j, std::size_t rows, std::size_t cols, int salt,
                              Dtype dtype) {
  HostMatrix b = host_block(g, j, rows, cols, salt);
  for (std::size_t k = 0; k < rows * cols; ++k) b.data()[k] = round_to(b.data()[k], dtype);
  return b;
}

// `got` is a 16-bit sum of `terms` (the ranks' contributions, already rounded): a value of
// the dtype, and close to the one-rank reference that adds the terms in rank order in fp32
// and rounds to the dtype after every addition. MPI's reduction order is its own, so the
// bound covers any order: n - 1 roundings, each off by at most unit_roundoff times a partial
// sum (at most sum |terms|) or half a subnormal, in both got and the reference. With one or
// two terms there is at most one addition, which commutes, so the sum must be exact.
::testing::AssertionResult is_wire_sum(float got, const std::vector<float>& terms,
                                       const Wire& wire) {
  float want = terms[0];
  double sum_abs = std::fabs(terms[0]);
  for (std::size_t j = 1; j < terms.size(); ++j) {
    want = round_to(want + terms[j], wire.dtype);
    sum_abs += std::fabs(terms[j]);
  }
  const double roundings = static_cast<double>(terms.size() - 1);
  const double tol =
      terms.size() <= 2
          ? 0.0
          : 2 * roundings * (wire.unit_roundoff * sum_abs + wire.smallest_subnormal / 2);
  if (round_to(got, wire.dtype) != got) {
    return ::testing::AssertionFailure() << got << " is not a " << wire.name << " value";
  }
  if (!(std::fabs(static_cast<double>(got) - want) <= tol)) {
    return ::testing::AssertionFailure() << "got " << got << ", want " << want << " (tolerance "
                                         << tol << ", " << terms.size() << " terms)";
  }
  return ::testing::AssertionSuccess();
}

// The 16-bit gathers move each rank's block rounded to the dtype: data already rounded
// arrives exactly, other data arrives rounded (nearest even), on both dims and flat.
TEST(Communicator, WireAllGatherMovesRoundedBlocks) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const std::size_t r = 3, c = 5;
    for (const Wire& wire : kWires) {
      const std::string where = std::string(wire.name) + " on " + g.name;
      const HostMatrix mine_rounded = rounded_host_block(g, comm.rank(), r, c, 20, wire.dtype);
      const DeviceMatrix mine = to_device(mine_rounded);
      for (int dim = 0; dim < 2; ++dim) {
        DeviceMatrix out("out", dim == 0 ? n * r : r, dim == 1 ? n * c : c);
        comm.all_gather(mine, out, dim, wire.dtype);
        const HostMatrix got = to_host(out);
        for (std::size_t j = 0; j < n; ++j) {
          const HostMatrix b = rounded_host_block(g, static_cast<int>(j), r, c, 20, wire.dtype);
          for (std::size_t x = 0; x < r; ++x)
            for (std::size_t y = 0; y < c; ++y)
              ASSERT_EQ(got(dim == 0 ? j * r + x : x, dim == 1 ? j * c + y : y), b(x, y))
                  << "all_gather dim " << dim << " " << where;
        }
      }
      // Flat, from data that is not rounded: the wire rounds it.
      const DeviceMatrix raw = rank_block(g, comm.rank(), 1, r * c, 21);
      Kokkos::View<float*> flat("flat", n * r * c);
      comm.all_gather(ConstVectorView(raw.data(), r * c), flat, wire.dtype);
      const auto flat_host = host_vector(flat);
      for (std::size_t j = 0; j < n; ++j) {
        const HostMatrix b = rounded_host_block(g, static_cast<int>(j), 1, r * c, 21, wire.dtype);
        for (std::size_t k = 0; k < r * c; ++k)
          ASSERT_EQ(flat_host(j * r * c + k), b.data()[k]) << "1-D all_gather " << where;
      }
    }
  }
}

// 16-bit reduce_scatter and all_reduce: every element a 16-bit sum of the ranks' rounded
// contributions (is_wire_sum).
TEST(Communicator, WireReductionsSumIn16Bits) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    const std::size_t i = static_cast<std::size_t>(comm.rank());
    const std::size_t r = 3, c = 5;
    for (const Wire& wire : kWires) {
      const std::string where = std::string(wire.name) + " on " + g.name;
      std::vector<float> terms(static_cast<std::size_t>(n));
      // reduce_scatter along dim 0 and dim 1: this rank's [r, c] block of the sum.
      for (int dim = 0; dim < 2; ++dim) {
        const std::size_t rows = dim == 0 ? n * r : r, cols = dim == 1 ? n * c : c;
        DeviceMatrix mine = rank_block(g, comm.rank(), rows, cols, 22);
        DeviceMatrix out("out", r, c);
        comm.reduce_scatter(mine, out, dim, wire.dtype);
        const HostMatrix got = to_host(out);
        std::vector<HostMatrix> blocks;
        for (int j = 0; j < n; ++j)
          blocks.push_back(rounded_host_block(g, j, rows, cols, 22, wire.dtype));
        for (std::size_t x = 0; x < r; ++x)
          for (std::size_t y = 0; y < c; ++y) {
            for (int j = 0; j < n; ++j)
              terms[j] = blocks[j](dim == 0 ? i * r + x : x, dim == 1 ? i * c + y : y);
            ASSERT_TRUE(is_wire_sum(got(x, y), terms, wire))
                << "reduce_scatter dim " << dim << " " << where << " at (" << x << ", " << y << ")";
          }
      }
      // Flat reduce_scatter.
      DeviceMatrix flat_in = rank_block(g, comm.rank(), 1, n * 4, 23);
      Kokkos::View<float*> flat_out("flat_out", 4);
      comm.reduce_scatter(ConstVectorView(flat_in.data(), n * 4), flat_out, wire.dtype);
      const auto flat_host = host_vector(flat_out);
      for (std::size_t k = 0; k < 4; ++k) {
        for (int j = 0; j < n; ++j)
          terms[j] = rounded_host_block(g, j, 1, n * 4, 23, wire.dtype)(0, i * 4 + k);
        ASSERT_TRUE(is_wire_sum(flat_host(k), terms, wire)) << "1-D reduce_scatter " << where;
      }
      // all_reduce, in place.
      DeviceMatrix data = rank_block(g, comm.rank(), 3, 7, 24);
      comm.all_reduce(MatrixView(data), ReduceOp::sum, wire.dtype);
      const HostMatrix got = to_host(data);
      for (std::size_t k = 0; k < 21; ++k) {
        for (int j = 0; j < n; ++j)
          terms[j] = rounded_host_block(g, j, 3, 7, 24, wire.dtype).data()[k];
        ASSERT_TRUE(is_wire_sum(got.data()[k], terms, wire)) << "all_reduce " << where;
      }
    }
  }
}

// all_reduce_from_wire sums the 16-bit elements a producer wrote into the buffer all_reduce_wire
// handed out (each element a 16-bit sum of the ranks' rounded contributions, is_wire_sum), and
// refuses what would sum anything else: elements elsewhere, a buffer a blocking 16-bit operation
// has used since, one summed already, and a second hand-out while the first is unsummed.
TEST(Communicator, AllReduceFromWireSumsOnlyTheBufferHandedOut) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    const std::size_t r = 3, c = 7;
    for (const Wire& wire : kWires) {
      const std::string where = std::string(wire.name) + " on " + g.name;
      SCOPED_TRACE(where);
      const DeviceMatrix mine = rank_block(g, comm.rank(), r, c, 25);
      DeviceMatrix out("out", r, c);
      uint16_t* bits = comm.all_reduce_wire(r * c);
      pack_16bit(mine.data(), bits, r * c, wire.dtype);  // the producer
      const ConstHalfMatrixView written(bits, r, c);
      comm.all_reduce_from_wire(written, out, wire.dtype);
      const HostMatrix got = to_host(out);
      std::vector<float> terms(static_cast<std::size_t>(n));
      for (std::size_t k = 0; k < r * c; ++k) {
        for (int j = 0; j < n; ++j)
          terms[j] = rounded_host_block(g, j, r, c, 25, wire.dtype).data()[k];
        ASSERT_TRUE(is_wire_sum(got.data()[k], terms, wire)) << "element " << k;
      }
      // Summed already.
      expect_error([&] { comm.all_reduce_from_wire(written, out, wire.dtype); }, ErrorKind::runtime,
                   {"all_reduce on", "ran since all_reduce_wire"});
      // Not the buffer handed out (nor its shape).
      const ConstHalfMatrixView fresh(comm.all_reduce_wire(r * c), r, c);
      HalfMatrix elsewhere("elsewhere", r, c);
      expect_error([&] { comm.all_reduce_from_wire(elsewhere, out, wire.dtype); },
                   ErrorKind::runtime, {"not its 16-bit buffer"});
      expect_error(
          [&] {
            comm.all_reduce_from_wire(ConstHalfMatrixView(fresh.data(), c, r),
                                      MatrixView(out.data(), r, c), wire.dtype);
          },
          ErrorKind::runtime, {"7 x 3 elements written as 16 bits, summed into 3 x 7"});
      // Handed out twice before it is summed.
      expect_error([&] { comm.all_reduce_wire(r * c); }, ErrorKind::runtime,
                   {"already handed out"});
      // A blocking 16-bit operation on the same communicator in between.
      DeviceMatrix other = rank_block(g, comm.rank(), 2, 5, 26);
      comm.all_reduce(MatrixView(other), ReduceOp::sum, wire.dtype);
      expect_error([&] { comm.all_reduce_from_wire(fresh, out, wire.dtype); }, ErrorKind::runtime,
                   {"a blocking 16-bit operation ran since all_reduce_wire"});
    }
  }
}

// A 16-bit sum beyond the dtype's largest value is inf (fp16 overflows at 65520, bf16 near
// 3.4e38); a contribution beyond it is inf already on the wire.
TEST(Communicator, WireSumsOverflowToInf) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    for (const Wire& wire : kWires) {
      // Every rank adds `big` (exact in the dtype), whose double overflows; and `huge`,
      // beyond the dtype's range, overflows as it is packed.
      const float big = wire.dtype == Dtype::fp16 ? 40000.0f : 0x1.8p127f;
      const float huge = wire.dtype == Dtype::fp16 ? 70000.0f : FLT_MAX;
      Kokkos::View<float*, Kokkos::HostSpace> host("host", 4);
      host(0) = big;
      host(1) = -big;
      host(2) = huge;
      host(3) = 1.0f;
      for (bool started : {false, true}) {
        Kokkos::View<float*> data("data", 4);
        Kokkos::deep_copy(data, host);
        if (started) {
          comm.start_all_reduce(data, wire.dtype).wait();
        } else {
          comm.all_reduce(VectorView(data), ReduceOp::sum, wire.dtype);
        }
        const auto got = host_vector(data);
        const std::string where =
            std::string(wire.name) + (started ? " started" : "") + " on " + g.name;
        if (n == 1) {
          EXPECT_EQ(got(0), big) << where;
        } else {
          EXPECT_TRUE(std::isinf(got(0)) && got(0) > 0) << got(0) << " " << where;
          EXPECT_TRUE(std::isinf(got(1)) && got(1) < 0) << got(1) << " " << where;
        }
        EXPECT_TRUE(std::isinf(got(2)) && got(2) > 0) << got(2) << " " << where;
        EXPECT_EQ(got(3), static_cast<float>(n)) << where;
      }
    }
  }
}

// A 16-bit shift delivers the sender's block rounded to the dtype, for several offsets and
// with two shifts in flight in opposite directions (one polled with test()).
TEST(Communicator, WireShiftDeliversTheRoundedBlock) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    for (const Wire& wire : kWires) {
      const std::string where = std::string(wire.name) + " on " + g.name;
      for (int offset : {1, -1, n + 1}) {
        DeviceMatrix send = rank_block(g, comm.rank(), 3, 4, 25);
        DeviceMatrix recv("recv", 3, 4);
        Request request = comm.shift(send, recv, offset, wire.dtype);
        request.wait();
        EXPECT_FALSE(request.pending());
        const int from = ((comm.rank() - offset) % n + n) % n;
        const HostMatrix got = to_host(recv),
                         want = rounded_host_block(g, from, 3, 4, 25, wire.dtype);
        for (std::size_t k = 0; k < 12; ++k)
          ASSERT_EQ(got.data()[k], want.data()[k]) << "shift " << offset << " " << where;
      }
      DeviceMatrix up_send = rank_block(g, comm.rank(), 2, 3, 26),
                   dn_send = rank_block(g, comm.rank(), 2, 3, 27);
      DeviceMatrix up_recv("up", 2, 3), dn_recv("dn", 2, 3);
      Request up = comm.shift(up_send, up_recv, +1, wire.dtype);
      Request dn = comm.shift(dn_send, dn_recv, -1, wire.dtype);
      while (!up.test()) {
      }
      EXPECT_FALSE(up.pending());
      dn.wait();
      const HostMatrix up_want =
                           rounded_host_block(g, (comm.rank() - 1 + n) % n, 2, 3, 26, wire.dtype),
                       dn_want = rounded_host_block(g, (comm.rank() + 1) % n, 2, 3, 27, wire.dtype);
      const HostMatrix up_got = to_host(up_recv), dn_got = to_host(dn_recv);
      for (std::size_t k = 0; k < 6; ++k) {
        ASSERT_EQ(up_got.data()[k], up_want.data()[k]) << "shift +1 " << where;
        ASSERT_EQ(dn_got.data()[k], dn_want.data()[k]) << "shift -1 " << where;
      }
    }
  }
}

// Started 16-bit gathers and sums, three of each in flight at once with a blocking 16-bit
// all_reduce on the same group between them (its buffers are not theirs), completed out of
// order with wait() and with test() polling: each equals the blocking operation bit for bit.
TEST(Communicator, StartedWireOperationsMatchTheBlockingOnes) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const std::size_t n = static_cast<std::size_t>(comm.size());
    for (const Wire& wire : kWires) {
      const std::string where = std::string(wire.name) + " on " + g.name;
      const std::size_t rows[3] = {3, 1, 40}, cols = 7;
      DeviceMatrix gather_send[3], reduce_data[3];
      Kokkos::View<float*> gathered[3];
      Request gathers[3], reductions[3];
      Kokkos::View<float*> ones("ones", 5);
      Kokkos::deep_copy(ones, 1.0f);
      for (int b = 0; b < 3; ++b) {
        const std::size_t count = rows[b] * cols;
        gather_send[b] = rank_block(g, comm.rank(), rows[b], cols, 30 + b);
        gathered[b] = Kokkos::View<float*>("gathered", n * count);
        reduce_data[b] = rank_block(g, comm.rank(), rows[b], cols, 40 + b);
        gathers[b] = comm.start_all_gather(ConstVectorView(gather_send[b].data(), count),
                                           gathered[b], wire.dtype);
        reductions[b] = comm.start_all_reduce(VectorView(reduce_data[b].data(), count), wire.dtype);
        if (b == 0) comm.all_reduce(VectorView(ones), ReduceOp::sum, wire.dtype);
      }
      EXPECT_EQ(host_vector(ones)(4), static_cast<float>(n)) << where;
      while (!reductions[2].test()) {
      }
      while (!gathers[1].test()) {
      }
      for (Request* request : {&gathers[2], &reductions[0], &gathers[0], &reductions[1]})
        request->wait();
      for (int b = 0; b < 3; ++b) {
        EXPECT_FALSE(gathers[b].pending() || reductions[b].pending()) << where;
        const std::size_t count = rows[b] * cols;
        Kokkos::View<float*> gather_want("gather_want", n * count);
        comm.all_gather(ConstVectorView(gather_send[b].data(), count), gather_want, wire.dtype);
        DeviceMatrix reduce_want = rank_block(g, comm.rank(), rows[b], cols, 40 + b);
        comm.all_reduce(MatrixView(reduce_want), ReduceOp::sum, wire.dtype);
        const auto gather_got = host_vector(gathered[b]), gather_ref = host_vector(gather_want);
        for (std::size_t k = 0; k < n * count; ++k)
          ASSERT_EQ(gather_got(k), gather_ref(k)) << "started all_gather " << b << " " << where;
        const HostMatrix reduce_got = to_host(reduce_data[b]), reduce_ref = to_host(reduce_want);
        for (std::size_t k = 0; k < count; ++k)
          ASSERT_EQ(reduce_got.data()[k], reduce_ref.data()[k])
              << "started all_reduce " << b << " " << where;
      }
    }
  }
}

// A started 16-bit operation whose Request is dropped while pending (destroyed, or assigned
// over) completes inside the destructor without crashing, and its pooled buffers serve the
// next operations, larger ones included. A Request may also outlive its communicator.
TEST(Communicator, DroppedWireRequestsLeaveTheCommunicatorUsable) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size();
    for (const Wire& wire : kWires) {
      const std::string where = std::string(wire.name) + " on " + g.name;
      {
        Kokkos::View<float*> a("a", 6), b("b", 6), c("c", 6), d("d", 6);
        Kokkos::View<float*> gathered("gathered", 6 * n), shifted("shifted", 6);
        Request dropped_reduce = comm.start_all_reduce(a, wire.dtype);
        Request dropped_gather = comm.start_all_gather(b, gathered, wire.dtype);
        Request dropped_shift = comm.shift(c, shifted, 1, wire.dtype);
        // Assigning over a pending request drops it too.
        dropped_shift = comm.start_all_reduce(d, wire.dtype);
      }  // destroyed while (possibly) pending: the buffers stay alive until here
      // Later operations, larger than the dropped ones, reuse the pool.
      DeviceMatrix data = rank_block(g, comm.rank(), 5, 9, 50);
      Request request = comm.start_all_reduce(VectorView(data.data(), 45), wire.dtype);
      request.wait();
      const HostMatrix got = to_host(data);
      std::vector<float> terms(static_cast<std::size_t>(n));
      for (std::size_t k = 0; k < 45; ++k) {
        for (int j = 0; j < n; ++j)
          terms[j] = rounded_host_block(g, j, 5, 9, 50, wire.dtype).data()[k];
        ASSERT_TRUE(is_wire_sum(got.data()[k], terms, wire)) << "after drops " << where;
      }
    }
  }
  // The communicator destroyed while its 16-bit request is pending: wait() still delivers.
  for (const Wire& wire : kWires) {
    const int n = world_size();
    Kokkos::View<float*> data("data", 3);
    Kokkos::deep_copy(data, 1.5f);
    Request request;
    {
      auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
      request = comm.start_all_reduce(data, wire.dtype);
    }
    request.wait();
    const auto got = host_vector(data);
    const float want = static_cast<float>(round_to(1.5f * n, wire.dtype));
    for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(got(k), want) << wire.name;
  }
}

// ------------------------------------------------------------------------ all_to_all_v

// Every rank sends a different number of rows to every rank (zero to some), packed in rank
// order, on the world and the mesh's sub-axis groups: each received row is exactly what its
// sender packed for this rank (fp32), or that rounded to the wire dtype (bf16, fp16); the rows
// of send and recv beyond the packed totals are neither sent nor written.
TEST(Communicator, AllToAllVRoutesRaggedRows) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const int n = comm.size(), me = comm.rank();
    const std::size_t cols = 5;
    const float untouched = -7.5f;
    for (int salt = 0; salt <= 4; ++salt) {
      // Extra rows past the packed ones; none in round 4, where most ranks' send is empty.
      const std::size_t extra = salt == 4 ? 0 : 2;
      const RaggedRound round = ragged_round(n, me, salt, cols, extra);
      const DeviceMatrix send = to_device(round.send, "send");
      for (const auto& [wire, wire_name] : kWireTypes) {
        const std::string where =
            "round " + std::to_string(salt) + " " + wire_name + " on " + g.name;
        DeviceMatrix recv("recv", round.recv_total + extra, cols);
        Kokkos::deep_copy(recv, untouched);
        comm.all_to_all_v(send, round.send_rows, recv, round.recv_rows, wire);
        const HostMatrix got = to_host(recv);
        expect_ragged_rows(got, round, me, wire, where);
        for (std::size_t row = round.recv_total; row < got.extent(0); ++row)
          for (std::size_t c = 0; c < cols; ++c)
            ASSERT_EQ(got(row, c), untouched) << "row " << row << " past the packed ones " << where;
      }
    }
  }
}

// Bad counts and shapes are bad_input naming the operation and the group, thrown on every
// rank before anything is sent: no rank is left waiting (a short timeout turns a rank that
// did go on into a failure, not a hang), and the communicator stays usable.
TEST(Communicator, AllToAllVRejectsBadCountsOnEveryRank) {
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (ep)");
  comm.set_timeout_seconds(10.0);
  const int n = comm.size();
  const std::size_t rows = 2 * static_cast<std::size_t>(n);
  const std::string group = "all_to_all_v on axis (ep)";
  DeviceMatrix send("send", rows, 3), recv("recv", rows, 3), narrow("narrow", rows, 2);
  const std::vector<int64_t> two(n, 2);
  expect_bad_input([&] { comm.all_to_all_v(send, std::vector<int64_t>(n + 1, 1), recv, two); },
                   {group, "send_rows has " + std::to_string(n + 1) + " entries",
                    "one per rank of the group (" + std::to_string(n) + ")"});
  expect_bad_input([&] { comm.all_to_all_v(send, two, recv, std::vector<int64_t>{}); },
                   {group, "recv_rows has 0 entries"});
  std::vector<int64_t> negative = two;
  negative[n - 1] = -1;
  expect_bad_input([&] { comm.all_to_all_v(send, negative, recv, two); },
                   {group, "send_rows[" + std::to_string(n - 1) + "] is -1", "negative"});
  expect_bad_input([&] { comm.all_to_all_v(send, two, recv, negative, Dtype::bf16); },
                   {group, "recv_rows[" + std::to_string(n - 1) + "] is -1"});
  std::vector<int64_t> too_many = two;
  too_many[0] = 3;
  expect_bad_input([&] { comm.all_to_all_v(send, too_many, recv, two); },
                   {group, "send_rows add up to " + std::to_string(rows + 1) + " rows",
                    "more than the " + std::to_string(rows) + " rows of the send matrix"});
  expect_bad_input([&] { comm.all_to_all_v(send, two, recv, too_many, Dtype::fp16); },
                   {group, "recv_rows add up to", "rows of the receive matrix"});
  // Counts whose sum overflows 64 bits are too many, not a wrapped-around small number.
  const std::vector<int64_t> huge(n, INT64_MAX);
  expect_bad_input([&] { comm.all_to_all_v(send, huge, recv, two); },
                   {group, "send_rows add up to", "more than the"});
  expect_bad_input([&] { comm.all_to_all_v(send, two, narrow, two); },
                   {group, "same number of columns"});
  DeviceMatrix wide("wide", rows, 6);
  MatrixView column_block = Kokkos::subview(wide, Kokkos::ALL, std::make_pair(0, 3));
  expect_bad_input([&] { comm.all_to_all_v(send, two, column_block, two); },
                   {group, "not contiguous"});
  expect_bad_input([&] { comm.all_to_all_v(send, two, MatrixView(send), two); },
                   {group, "overlap"});
  // Every rank threw before sending: the next call pairs up with the others' next call.
  const HostMatrix mine = host_block(Group{"world", nullptr, 77}, comm.rank(), rows, 3);
  const DeviceMatrix good = to_device(mine);
  comm.all_to_all_v(good, two, recv, two);
  const HostMatrix got = to_host(recv);
  for (int j = 0; j < n; ++j) {
    const HostMatrix theirs = host_block(Group{"world", nullptr, 77}, j, rows, 3);
    for (std::size_t r = 0; r < 2; ++r)
      for (std::size_t c = 0; c < 3; ++c)
        ASSERT_EQ(got(2 * j + r, c), theirs(2 * comm.rank() + r, c)) << "from rank " << j;
  }
}

// all_to_all_v honours the collective timeout like the other blocking operations.
TEST(Communicator, AllToAllVTimesOutWhenARankDoesNotJoin) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const int rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (ep)");
  const int n = comm.size();
  const std::vector<int64_t> one(n, 1);
  DeviceMatrix send("send", n, 4), recv("recv", n, 4);  // alive until the late rank has joined
  if (rank != 1) {
    comm.set_timeout_seconds(1.0);
    expect_error([&] { comm.all_to_all_v(send, one, recv, one); }, ErrorKind::runtime,
                 {"all_to_all_v on axis (ep) did not complete within 1 s", "a rank did not join"});
    expect_error([&] { comm.all_to_all_v(send, one, recv, one); }, ErrorKind::runtime,
                 {"all_to_all_v", "unusable"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) {
    comm.set_timeout_seconds(60.0);
    comm.all_to_all_v(send, one, recv, one);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

int64_t g_kokkos_allocations = 0;
void count_kokkos_allocation(const Kokkos::Profiling::SpaceHandle, const char*, const void*,
                             const uint64_t) {
  ++g_kokkos_allocations;
}

// After reserve_wire, 16-bit all_to_all_v calls up to the reserved sizes allocate no Kokkos
// memory (nor do repeated fp32 calls); without it the first 16-bit call allocates its buffers
// (so the counter can see an allocation).
TEST(Communicator, AllToAllVAllocatesNothingAfterReserveWire) {
  const int n = world_size();
  const std::size_t rows = 3 * static_cast<std::size_t>(n), cols = 4;
  const std::vector<int64_t> three(n, 3), ragged = [&] {
    std::vector<int64_t> r(n);
    // Fewer rows (within the reserve), the same both ways between two ranks.
    for (int j = 0; j < n; ++j) r[j] = (world_rank() + j) % 3;
    return r;
  }();
  DeviceMatrix send = rank_block(Group{"world", nullptr, 5}, world_rank(), rows, cols);
  DeviceMatrix recv("recv", rows, cols);
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  comm.reserve_wire(rows * cols, rows * cols);
  // fp32 first: with device memory, its host staging (twice the bytes of a 16-bit call) grows.
  comm.all_to_all_v(send, three, recv, three);
  g_kokkos_allocations = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_kokkos_allocation);
  comm.all_to_all_v(send, three, recv, three, Dtype::bf16);
  comm.all_to_all_v(send, ragged, recv, ragged, Dtype::fp16);
  comm.all_to_all_v(send, three, recv, three);
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  EXPECT_EQ(g_kokkos_allocations, 0) << "Kokkos allocations in all_to_all_v after reserve_wire";

  auto fresh = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  g_kokkos_allocations = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_kokkos_allocation);
  fresh.all_to_all_v(send, three, recv, three, Dtype::bf16);
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  EXPECT_GT(g_kokkos_allocations, 0) << "the first 16-bit call grows its buffers";
}

TEST(Communicator, MeshCommunicatorsCacheAndRejectUnknownAxes) {
  MeshCommunicators comms(Mesh::create({{"dp", -1}}, world_size()));
  Communicator& a = comms.get({"dp"});
  Communicator& b = comms.get({"dp"});
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(a.size(), world_size());
  EXPECT_EQ(a.description(), "axis (dp)");
  Communicator& none = comms.get({});
  EXPECT_EQ(none.size(), 1);
  expect_bad_input([&] { comms.get({"tp", "dp"}); }, {"'tp'", "axes (tp, dp)"});
  expect_bad_input(
      [&] {
        MeshCommunicators wrong(Mesh::create({{"dp", world_size() + 1}}, world_size() + 1));
      },
      {"needs", std::to_string(world_size() + 1), "ranks"});
}

TEST(Communicator, BadShapesAndCounts) {
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const std::size_t n = static_cast<std::size_t>(comm.size());
  DeviceMatrix send("send", 3, 4), wrong("wrong", 3 * n + 1, 4);
  expect_bad_input([&] { comm.all_gather(send, wrong, 0); }, {"all_gather", "dim 0", "[3, 4]"});
  expect_bad_input([&] { comm.all_gather(send, wrong, 2); }, {"dim must be 0 or 1"});
  expect_bad_input([&] { comm.reduce_scatter(wrong, send, 1); }, {"reduce_scatter", "dim 1"});
  DeviceMatrix big("big", 4, 8);
  MatrixView column_block = Kokkos::subview(big, Kokkos::ALL, std::make_pair(0, 4));
  expect_bad_input([&] { comm.all_reduce(column_block); }, {"all_reduce", "not contiguous"});
  expect_bad_input([&] { comm.broadcast(MatrixView(send), static_cast<int>(n)); }, {"root"});
  Kokkos::View<float*> shared("shared", 2 * n);
  expect_bad_input(
      [&] { comm.all_gather(ConstVectorView(shared.data(), 2), VectorView(shared.data(), 2 * n)); },
      {"overlap"});
  // The same check on 16-bit elements (in bytes): blocks one element apart overlap.
  Kokkos::View<uint16_t*> halves("halves", 3);
  expect_bad_input([&] { comm.shift_16bit(halves.data(), halves.data() + 1, 2, 1, Dtype::bf16); },
                   {"shift on world", "overlap"});
  expect_error([] { checked_int(std::size_t{1} << 33, "all_gather count"); }, ErrorKind::runtime,
               {"all_gather count", "8589934592"});
  expect_bad_input([&] { comm.set_timeout_seconds(0); }, {"timeout"});
}

TEST(Communicator, TimeoutFromEnvironmentAndHelpers) {
  ::setenv("MESHTRAIN_COLLECTIVE_TIMEOUT", "2.5", 1);
  EXPECT_EQ(collective_timeout_from_env(), 2.5);
  EXPECT_EQ(MpiCommunicator::duplicate(MPI_COMM_WORLD, "world").timeout_seconds(), 2.5);
  ::setenv("MESHTRAIN_COLLECTIVE_TIMEOUT", "soon", 1);
  expect_bad_input([] { collective_timeout_from_env(); },
                   {"MESHTRAIN_COLLECTIVE_TIMEOUT", "'soon'"});
  ::unsetenv("MESHTRAIN_COLLECTIVE_TIMEOUT");
  EXPECT_EQ(collective_timeout_from_env(), 300.0);
  EXPECT_EQ(describe_axes({"tp"}), "axis (tp)");
  EXPECT_EQ(describe_axes({"fsdp", "dp"}), "axes (fsdp, dp)");
  EXPECT_EQ(exit_status_for(Error(ErrorKind::bad_input, "x", __FILE__, __LINE__)), 2);
  EXPECT_EQ(exit_status_for(Error(ErrorKind::runtime, "x", __FILE__, __LINE__)), 1);
  EXPECT_EQ(exit_status_for(std::runtime_error("x")), 1);
}

TEST(Communicator, TimeoutNamesTheOperationWhenARankDoesNotJoin) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const int rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (tp)");
  Kokkos::View<float*> data("data", 4);  // alive until the late rank has joined
  if (rank != 1) {
    comm.set_timeout_seconds(1.0);
    expect_error([&] { comm.all_reduce(data); }, ErrorKind::runtime,
                 {"all_reduce on axis (tp) did not complete within 1 s", "a rank did not join"});
    // The communicator refuses further work instead of mixing up messages.
    expect_error([&] { comm.barrier(); }, ErrorKind::runtime, {"barrier", "unusable"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) {
    // Rank 1 joins late: its all_reduce matches the others' abandoned one (they progress it
    // in the barrier below), so nothing is left pending when the test ends.
    comm.set_timeout_seconds(60.0);
    comm.all_reduce(data);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The same with a 16-bit wire, blocking and started: the MPI request given up on may still
// write into the communicator's 16-bit buffers when the late rank arrives, so the refused
// call that follows (larger, so its buffers would have to grow) must neither free nor reuse
// them. (Under valgrind, reusing them shows as an invalid write into freed memory.)
TEST(Communicator, WireTimeoutKeepsTheAbandonedBuffers) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const int rank = world_rank();
  for (bool started : {false, true}) {
    SCOPED_TRACE(started ? "start_all_reduce" : "all_reduce");
    auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (tp)");
    auto reduce = [&](Kokkos::View<float*> data) {
      if (started) {
        comm.start_all_reduce(data, Dtype::bf16).wait();
      } else {
        comm.all_reduce(VectorView(data), ReduceOp::sum, Dtype::bf16);
      }
    };
    Kokkos::View<float*> data("data", 1000);  // alive until the late rank has joined
    if (rank != 1) {
      comm.set_timeout_seconds(1.0);
      expect_error([&] { reduce(data); }, ErrorKind::runtime, {"did not complete within 1 s"});
      Kokkos::View<float*> larger("larger", 100000);
      expect_error([&] { reduce(larger); }, ErrorKind::runtime, {"unusable"});
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1) {
      comm.set_timeout_seconds(60.0);
      reduce(data);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// A collective whose completion fails (MPI_Testall reports an error; here the ranks
// disagree on the broadcast's count, so the receivers' messages are truncated) leaves the
// communicator unusable, as a timeout does (issue 9, bug 6): a later call is refused
// instead of matching the failed call's leftovers. Open MPI reports a request's error
// through MPI_COMM_WORLD's handler, which Runtime sets to MPI_ERRORS_RETURN as done here.
TEST(Communicator, FailedCompletionMakesTheCommunicatorUnusable) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const int rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (tp)");
  comm.set_timeout_seconds(3.0);
  Kokkos::View<float*> data("data", rank == 0 ? 16 : 1);
  if (rank == 0) {
    comm.broadcast(data, 0);  // the root's sends complete
  } else {
    // Truncated (MPI_Testall fails), or never reached by a truncated forwarding rank.
    expect_error([&] { comm.broadcast(data, 0); }, ErrorKind::runtime, {"broadcast on axis (tp)"});
    expect_error([&] { comm.barrier(); }, ErrorKind::runtime, {"barrier", "unusable"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
}

// all_reduce already sends in pieces, so a count above INT_MAX is fine (issue 9, bug 7);
// start_all_reduce refuses it.
// One rank only: 8 GiB of floats per rank is more than a test machine holds, but on one
// rank the buffer is mapped without being touched (MAP_NORESERVE) and MPI leaves an
// in-place reduction over one rank alone, so only the pages written here are used.
TEST(Communicator, AllReduceTakesMoreThanIntMaxElements) {
  if (world_size() != 1) GTEST_SKIP() << "one rank: the buffer is 8 GiB per rank";
  // With device memory emulated, MPI is staged through an 8 GiB host copy each way (16 GiB
  // written, about a minute of a CI run): counts above INT_MAX stay covered by the plain (mpi)
  // registration, and their staged path by a GPU build's (the real device buffer below).
  if (device_memory_emulated())
    GTEST_SKIP() << "device memory emulated: the 8 GiB buffer would be staged through host copies";
  const std::size_t count = static_cast<std::size_t>(INT_MAX) + 17;
  const std::size_t bytes = count * sizeof(float);
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  if (kDeviceMemoryIsHostInaccessible) {
    // Device memory: a real 8 GiB view (a GPU holds it); its two end elements are set and
    // read back through copies, since the host cannot dereference it.
    Kokkos::View<float*> data(Kokkos::view_alloc("big", Kokkos::WithoutInitializing), count);
    auto first = Kokkos::subview(data, 0), last = Kokkos::subview(data, count - 1);
    Kokkos::deep_copy(first, 1.0f);
    Kokkos::deep_copy(last, 2.0f);
    EXPECT_NO_THROW(comm.all_reduce(VectorView(data.data(), count)));
    float got_first = 0.0f, got_last = 0.0f;
    Kokkos::deep_copy(got_first, first);
    Kokkos::deep_copy(got_last, last);
    EXPECT_EQ(got_first, 1.0f);
    EXPECT_EQ(got_last, 2.0f);
    return;
  }
  void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (memory == MAP_FAILED) GTEST_SKIP() << "cannot map " << bytes << " bytes";
  float* data = static_cast<float*>(memory);
  data[0] = 1.0f;
  data[count - 1] = 2.0f;
  EXPECT_NO_THROW(comm.all_reduce(VectorView(data, count)));
  EXPECT_EQ(data[0], 1.0f);
  EXPECT_EQ(data[count - 1], 2.0f);
  // A started all-reduce is one MPI call: more than INT_MAX elements is refused before
  // anything starts (a DP bucket is split below that).
  expect_error([&] { comm.start_all_reduce(VectorView(data, count)); }, ErrorKind::runtime,
               {"started all_reduce count", "split"});
  munmap(memory, bytes);
}

}  // namespace
}  // namespace meshtrain::testing
