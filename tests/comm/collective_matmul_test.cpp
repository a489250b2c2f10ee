// all_gather_matmul and matmul_reduce_scatter, every algorithm, against the product of the
// full operands computed on one rank (double, reference_gemm): either gathered side and
// dim, transposed operands, odd blocks (3 rows per rank), square and non-square shapes, strided
// outputs, on the world and on sub-communicators of an fsdp x tp mesh whose groups hold
// different data. Also: workspace peak memory (ring/bidirectional: 2 blocks, not n) and
// reuse, non-divisible shapes, and gemm() on LayoutRight (strided) views. 16-bit operands (gathered
// blocks travelling as 2-byte elements) against fp32 buffers holding the same values: bit for bit.
// Tolerance: |got - want| <= 1e-5 * (1 + max |want|) (see tests/support/communicator_cases.hpp).

#include "framework/comm/collective_matmul.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "framework/comm/collective_matmul_16bit.hpp"
#include "tests/support/communicator_cases.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

const std::array<CollectiveMatmulAlgorithm, 4> kAlgorithms = {
    CollectiveMatmulAlgorithm::naive, CollectiveMatmulAlgorithm::ring,
    CollectiveMatmulAlgorithm::bidirectional, CollectiveMatmulAlgorithm::automatic};

std::string describe(const Group& g, CollectiveMatmulAlgorithm alg, const std::string& rest) {
  return std::string(to_string(alg)) + " on " + g.name + " " + rest;
}

// Stored shape of an operand whose op() is [rows, cols].
std::pair<std::size_t, std::size_t> stored(std::size_t rows, std::size_t cols, bool t) {
  return t ? std::make_pair(cols, rows) : std::make_pair(rows, cols);
}

// One all_gather_matmul case on group g; `strided_c` writes into a column block of a wider
// matrix.
void check_all_gather_case(const Group& g, CollectiveMatmulAlgorithm alg, GatherSide side,
                           int gather_dim, bool ta, bool tb, bool strided_c,
                           CollectiveMatmulWorkspace& ws, bool square = false) {
  Communicator& comm = *g.comm;
  const std::size_t n = static_cast<std::size_t>(comm.size());
  const std::size_t i = static_cast<std::size_t>(comm.rank());
  std::size_t m = 5, k = 4, cols = 6;
  const bool g_trans = side == GatherSide::left ? ta : tb;
  const int op_dim = g_trans ? 1 - gather_dim : gather_dim;
  std::size_t& gathered =
      side == GatherSide::left ? (op_dim == 0 ? m : k) : (op_dim == 0 ? k : cols);
  gathered = 3 * n;  // blocks of 3
  if (square) m = k = cols = 3 * n;
  const auto [ar, ac] = stored(m, k, ta);
  const auto [br, bc] = stored(k, cols, tb);
  // The gathered operand is the same on every rank of the group; the other one is local.
  const uint64_t full_seed = g.seed * 17 + 1, local_seed = g.seed * 17 + 2 + 100 * i;
  DeviceMatrix a_full = make_matrix("a", ar, ac, side == GatherSide::left ? full_seed : local_seed);
  DeviceMatrix b_full =
      make_matrix("b", br, bc, side == GatherSide::right ? full_seed : local_seed);
  DeviceMatrix& g_full = side == GatherSide::left ? a_full : b_full;
  const std::size_t gr = gather_dim == 0 ? g_full.extent(0) / n : g_full.extent(0);
  const std::size_t gc = gather_dim == 1 ? g_full.extent(1) / n : g_full.extent(1);
  DeviceMatrix block =
      copy_block(g_full, gather_dim == 0 ? i * gr : 0, gr, gather_dim == 1 ? i * gc : 0, gc);
  std::vector<double> want;
  reference_gemm(a_full, ta, b_full, tb, want);

  DeviceMatrix c_store("c", m, cols + (strided_c ? 3 : 0));
  MatrixView c = Kokkos::subview(
      c_store, Kokkos::ALL,
      std::make_pair<std::size_t, std::size_t>(strided_c ? 1 : 0, (strided_c ? 1 : 0) + cols));
  Kokkos::deep_copy(c_store, 7.0f);  // garbage that must be overwritten
  const GemmOperand a{side == GatherSide::left ? ConstMatrixView(block) : ConstMatrixView(a_full),
                      ta};
  const GemmOperand b{side == GatherSide::right ? ConstMatrixView(block) : ConstMatrixView(b_full),
                      tb};
  all_gather_matmul(comm, side, gather_dim, a, b, c, alg, ws);
  expect_matches(c, want, 0, 0, cols,
                 describe(g, alg,
                          std::string("all_gather_matmul side ") +
                              (side == GatherSide::left ? "left" : "right") + " dim " +
                              std::to_string(gather_dim) + " ta " + std::to_string(ta) + " tb " +
                              std::to_string(tb) + (strided_c ? " strided C" : "")));
  if (strided_c) {
    const HostMatrix store = to_host(c_store);
    for (std::size_t r = 0; r < m; ++r) {
      ASSERT_EQ(store(r, 0), 7.0f) << "wrote outside C";
      ASSERT_EQ(store(r, cols + 1), 7.0f) << "wrote outside C";
    }
  }
}

void check_reduce_scatter_case(const Group& g, CollectiveMatmulAlgorithm alg, int scatter_dim,
                               bool ta, bool tb, bool strided_c, CollectiveMatmulWorkspace& ws,
                               bool square = false) {
  Communicator& comm = *g.comm;
  const std::size_t n = static_cast<std::size_t>(comm.size());
  const std::size_t i = static_cast<std::size_t>(comm.rank());
  const std::size_t m = square || scatter_dim == 0 ? 3 * n : 5, k = square ? 3 * n : 7,
                    cols = square || scatter_dim == 1 ? 3 * n : 6;
  const auto [ar, ac] = stored(m, k, ta);
  const auto [br, bc] = stored(k, cols, tb);
  auto a_of = [&](std::size_t r) { return make_matrix("a", ar, ac, g.seed * 19 + 1 + 100 * r); };
  auto b_of = [&](std::size_t r) { return make_matrix("b", br, bc, g.seed * 19 + 2 + 100 * r); };
  std::vector<double> want;
  for (std::size_t r = 0; r < n; ++r) reference_gemm(a_of(r), ta, b_of(r), tb, want);
  const std::size_t c_rows = scatter_dim == 0 ? 3 : m, c_cols = scatter_dim == 1 ? 3 : cols;
  DeviceMatrix c_store("c", c_rows, c_cols + (strided_c ? 2 : 0));
  Kokkos::deep_copy(c_store, 7.0f);
  MatrixView c = Kokkos::subview(
      c_store, Kokkos::ALL,
      std::make_pair<std::size_t, std::size_t>(strided_c ? 1 : 0, (strided_c ? 1 : 0) + c_cols));
  DeviceMatrix a_mine = a_of(i), b_mine = b_of(i);
  matmul_reduce_scatter(comm, scatter_dim, {a_mine, ta}, {b_mine, tb}, c, alg, ws);
  expect_matches(c, want, scatter_dim == 0 ? i * 3 : 0, scatter_dim == 1 ? i * 3 : 0, cols,
                 describe(g, alg,
                          "matmul_reduce_scatter dim " + std::to_string(scatter_dim) + " ta " +
                              std::to_string(ta) + " tb " + std::to_string(tb) +
                              (strided_c ? " strided C" : "")));
  if (strided_c) {
    const HostMatrix store = to_host(c_store);
    for (std::size_t r = 0; r < c_rows; ++r) {
      ASSERT_EQ(store(r, 0), 7.0f) << "wrote outside C";
      ASSERT_EQ(store(r, c_cols + 1), 7.0f) << "wrote outside C";
    }
  }
}

TEST(CollectiveMatmul, AllGatherMatmulMatchesTheFullProduct) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    const bool world = g.comm->size() == world_size();
    for (CollectiveMatmulAlgorithm alg : kAlgorithms) {
      CollectiveMatmulWorkspace ws;
      for (GatherSide side : {GatherSide::left, GatherSide::right})
        for (int dim = 0; dim < 2; ++dim)
          for (bool ta : {false, true})
            for (bool tb : {false, true}) {
              check_all_gather_case(g, alg, side, dim, ta, tb, false, ws);
              if (world) check_all_gather_case(g, alg, side, dim, ta, tb, true, ws);
              if (world) check_all_gather_case(g, alg, side, dim, ta, tb, false, ws, true);
            }
    }
  }
}

TEST(CollectiveMatmul, MatmulReduceScatterMatchesTheFullProduct) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    const bool world = g.comm->size() == world_size();
    for (CollectiveMatmulAlgorithm alg : kAlgorithms) {
      CollectiveMatmulWorkspace ws;
      for (int dim = 0; dim < 2; ++dim)
        for (bool ta : {false, true})
          for (bool tb : {false, true}) {
            check_reduce_scatter_case(g, alg, dim, ta, tb, false, ws);
            if (world) check_reduce_scatter_case(g, alg, dim, ta, tb, true, ws);
            if (world) check_reduce_scatter_case(g, alg, dim, ta, tb, false, ws, true);
          }
    }
  }
}

// The TP layer's three products (docs/design.md, "Training modes") spelled as the layer will call
// them.
TEST(CollectiveMatmul, TensorParallelLinearProducts) {
  TestGroups tg;
  const Group& g = tg.groups()[1];  // the tp axis
  Communicator& tp = *g.comm;
  const std::size_t n = static_cast<std::size_t>(tp.size()),
                    i = static_cast<std::size_t>(tp.rank());
  const std::size_t batch = 4, in = 3 * n, out = 5 * n;
  DeviceMatrix x = make_matrix("x", batch, in, g.seed + 1),
               w = make_matrix("w", in, out, g.seed + 2);
  DeviceMatrix dy = make_matrix("dy", batch, out, g.seed + 3);
  DeviceMatrix x_local = copy_block(x, 0, batch, i * 3, 3),
               w_local = copy_block(w, i * 3, 3, 0, out);
  DeviceMatrix dy_local = copy_block(dy, 0, batch, i * 5, 5);
  for (CollectiveMatmulAlgorithm alg : kAlgorithms) {
    CollectiveMatmulWorkspace ws;
    // forward: Y_local = reduce_scatter(X_local @ W_local) over output features
    DeviceMatrix y_local("y", batch, 5);
    matmul_reduce_scatter(tp, 1, plain(x_local), plain(w_local), y_local, alg, ws);
    std::vector<double> y;
    reference_gemm(x, false, w, false, y);
    expect_matches(y_local, y, 0, i * 5, out, describe(g, alg, "TP forward"));
    // dX_local = all_gather(dY, dim 1) @ W_localᵀ
    DeviceMatrix dx_local("dx", batch, 3);
    all_gather_matmul(tp, GatherSide::left, 1, plain(dy_local), transposed(w_local), dx_local, alg,
                      ws);
    std::vector<double> dx;
    reference_gemm(dy, false, w, true, dx);
    expect_matches(dx_local, dx, 0, i * 3, in, describe(g, alg, "TP dX"));
    // dW_local = X_localᵀ @ all_gather(dY, dim 1)
    DeviceMatrix dw_local("dw", 3, out);
    all_gather_matmul(tp, GatherSide::right, 1, transposed(x_local), plain(dy_local), dw_local, alg,
                      ws);
    std::vector<double> dw;
    reference_gemm(x, true, dy, false, dw);
    expect_matches(dw_local, dw, i * 3, 0, out, describe(g, alg, "TP dW"));
  }
}

// 16-bit operands (elements of the wire dtype, read by the GEMMs as they are, gathered blocks
// travelling as 2-byte elements) give what fp32 buffers holding the same values give, bit for bit:
// both run the same GEMM kernel on the same pieces (gemm() widens 16-bit operands exactly where
// its kernel reads fp32; oneDNN's bf16 matmul reads both as bf16), and a wire of the operands'
// dtype rounds nothing on the way. Every algorithm, side, dim and transpose, bf16 and fp16, the
// gathered operand 16-bit with the other fp32 or 16-bit; the reduce-scatter with both 16-bit;
// even blocks and odd ones (3 x 5 per rank and the like: odd counts of 2-byte elements).

// m's values rounded to `dtype`, in place, and their 16-bit bits.
HalfMatrix round_and_pack(DeviceMatrix& m, Dtype dtype) {
  round_in_place(MatrixView(m), dtype);
  HalfMatrix bits("bits", m.extent(0), m.extent(1));
  pack_16bit(m.data(), bits.data(), m.span(), dtype);
  Kokkos::fence();
  return bits;
}

GemmOperand operand(const DeviceMatrix& m, const HalfMatrix& bits, bool sixteen_bit,
                    bool transpose) {
  GemmOperand x = sixteen_bit ? plain(ConstHalfMatrixView(bits)) : plain(ConstMatrixView(m));
  x.transpose = transpose;
  return x;
}

uint32_t bits_of(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

void expect_same_bits(const DeviceMatrix& got_view, const DeviceMatrix& want_view,
                      const std::string& what) {
  const HostMatrix got = to_host(got_view), want = to_host(want_view);
  for (std::size_t r = 0; r < got.extent(0); ++r)
    for (std::size_t c = 0; c < got.extent(1); ++c)
      ASSERT_EQ(bits_of(got(r, c)), bits_of(want(r, c)))
          << what << " at (" << r << ", " << c << "): " << got(r, c) << " vs " << want(r, c);
}

TEST(CollectiveMatmul, SixteenBitOperandsGiveTheFp32BuffersBits) {
  TestGroups tg;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const std::size_t i = static_cast<std::size_t>(comm.rank());
    for (Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
      for (CollectiveMatmulAlgorithm alg : kAlgorithms) {
        CollectiveMatmulWorkspace ws;
        // Even blocks, and odd ones: 3 x 5 or 3 x 7 per rank, an odd element count (the
        // bidirectional ring's lo and hi halves of unequal, odd lengths of 2-byte elements; the
        // workspace's 16-bit elements rounded up for an odd count).
        for (bool odd : {false, true})
          for (GatherSide side : {GatherSide::left, GatherSide::right})
            for (int dim = 0; dim < 2; ++dim)
              for (bool ta : {false, true})
                for (bool tb : {false, true}) {
                  // Even: K of 2 blocks of 8 per rank where K is gathered (several accumulating
                  // pieces). Odd: blocks of 3 along the gathered dim, the other dims 5 and 7.
                  std::size_t m = odd ? 5 : 6, k = odd ? 7 : 16, cols = odd ? 5 : 10;
                  const bool g_trans = side == GatherSide::left ? ta : tb;
                  const int op_dim = g_trans ? 1 - dim : dim;
                  std::size_t& gathered =
                      side == GatherSide::left ? (op_dim == 0 ? m : k) : (op_dim == 0 ? k : cols);
                  gathered = (odd ? 3 : 8) * n;
                  const auto [ar, ac] = stored(m, k, ta);
                  const auto [br, bc] = stored(k, cols, tb);
                  const uint64_t seed = g.seed * 23 + 5 + 100 * i;
                  DeviceMatrix a = make_matrix("a", ar, ac, seed),
                               b = make_matrix("b", br, bc, seed + 1);
                  // The gathered operand is this rank's block (different data on every rank).
                  DeviceMatrix& gm = side == GatherSide::left ? a : b;
                  const std::size_t gr = dim == 0 ? gm.extent(0) / n : gm.extent(0);
                  const std::size_t gc = dim == 1 ? gm.extent(1) / n : gm.extent(1);
                  gm = copy_block(gm, 0, gr, 0, gc);
                  const HalfMatrix a16 = round_and_pack(a, dtype), b16 = round_and_pack(b, dtype);
                  DeviceMatrix want("want", m, cols), got("got", m, cols);
                  all_gather_matmul(comm, side, dim, {a, ta}, {b, tb}, want, alg, ws, dtype);
                  for (bool other_16bit : {false, true}) {
                    const bool a_16 = side == GatherSide::left || other_16bit;
                    const bool b_16 = side == GatherSide::right || other_16bit;
                    Kokkos::deep_copy(got, 7.0f);
                    all_gather_matmul(comm, side, dim, operand(a, a16, a_16, ta),
                                      operand(b, b16, b_16, tb), got, alg, ws, dtype);
                    expect_same_bits(
                        got, want,
                        describe(g, alg,
                                 std::string("16-bit all_gather_matmul ") + to_string(dtype) +
                                     " side " + (side == GatherSide::left ? "left" : "right") +
                                     " dim " + std::to_string(dim) + " ta " + std::to_string(ta) +
                                     " tb " + std::to_string(tb) + " other 16-bit " +
                                     std::to_string(other_16bit) + (odd ? " odd blocks" : "")));
                  }
                }
        // Output blocks of 4 x 6 (6 x 4), and odd ones of 3 x 5 (5 x 3) with K = 7.
        for (bool odd : {false, true})
          for (int dim = 0; dim < 2; ++dim)
            for (bool ta : {false, true})
              for (bool tb : {false, true}) {
                const std::size_t blk = odd ? 3 : 4, other = odd ? 5 : 6, k = odd ? 7 : 12;
                const std::size_t m = dim == 0 ? blk * n : other, cols = dim == 1 ? blk * n : other;
                const auto [ar, ac] = stored(m, k, ta);
                const auto [br, bc] = stored(k, cols, tb);
                const uint64_t seed = g.seed * 29 + 7 + 100 * i;
                DeviceMatrix a = make_matrix("a", ar, ac, seed),
                             b = make_matrix("b", br, bc, seed + 1);
                const HalfMatrix a16 = round_and_pack(a, dtype), b16 = round_and_pack(b, dtype);
                const std::size_t c_rows = dim == 0 ? blk : m, c_cols = dim == 1 ? blk : cols;
                DeviceMatrix want("want", c_rows, c_cols), got("got", c_rows, c_cols);
                matmul_reduce_scatter(comm, dim, {a, ta}, {b, tb}, want, alg, ws, dtype);
                matmul_reduce_scatter(comm, dim, operand(a, a16, true, ta),
                                      operand(b, b16, true, tb), got, alg, ws, dtype);
                expect_same_bits(
                    got, want,
                    describe(g, alg,
                             std::string("16-bit matmul_reduce_scatter ") + to_string(dtype) +
                                 " dim " + std::to_string(dim) + " ta " + std::to_string(ta) +
                                 " tb " + std::to_string(tb) + (odd ? " odd blocks" : "")));
              }
      }
    }
  }
}

// all_gather_matmul_to_16bit (framework/comm/collective_matmul_16bit.hpp: a layer's weight
// gradient stored as 16 bits) writes the bits of all_gather_matmul's fp32 C rounded to nearest
// even (pack_16bit), bit for bit (gemm_to_16bit's bits; oneDNN's differ only for sums below
// 2^-126, which these products of values near 1 do not reach): the gathered dim not K, either
// side (right: naive alone, one GEMM on the gathered blocks laid out dense; left: naive and
// ring), transposed operands, the gathered operand fp32 or 16-bit, odd blocks. Where the blocks of
// C would accumulate (a gathered K, bidirectional), be row-strided column blocks (ring on the
// right) or automatic's choice: refused, as all_gather_matmul_writes_16bit says; a strided C too.
TEST(CollectiveMatmul, AllGatherMatmulTo16BitGivesTheFp32ProductsRoundedBits) {
  using A = CollectiveMatmulAlgorithm;
  TestGroups tg;
  std::size_t cases = 0;
  for (const Group& g : tg.groups()) {
    Communicator& comm = *g.comm;
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const std::size_t i = static_cast<std::size_t>(comm.rank());
    for (Dtype dtype : {Dtype::bf16, Dtype::fp16}) {
      for (A alg : {A::naive, A::ring}) {
        CollectiveMatmulWorkspace ws;
        for (bool odd : {false, true})
          for (GatherSide side : {GatherSide::left, GatherSide::right})
            for (int dim = 0; dim < 2; ++dim)
              for (bool ta : {false, true})
                for (bool tb : {false, true})
                  for (bool gathered_16bit : {false, true}) {
                    const bool g_trans = side == GatherSide::left ? ta : tb;
                    const int op_dim = g_trans ? 1 - dim : dim;
                    // The gathered dim must be M (left) or N (right), not K.
                    if ((side == GatherSide::left) != (op_dim == 0)) continue;
                    EXPECT_EQ(all_gather_matmul_writes_16bit(side, dim, g_trans, alg),
                              side == GatherSide::left || alg == A::naive);
                    if (side == GatherSide::right && alg == A::ring) continue;
                    std::size_t m = odd ? 5 : 6, k = odd ? 7 : 16, cols = odd ? 5 : 10;
                    (side == GatherSide::left ? m : cols) = (odd ? 3 : 8) * n;
                    const auto [ar, ac] = stored(m, k, ta);
                    const auto [br, bc] = stored(k, cols, tb);
                    const uint64_t seed = g.seed * 31 + 11 + 100 * i;
                    DeviceMatrix a = make_matrix("a", ar, ac, seed),
                                 b = make_matrix("b", br, bc, seed + 1);
                    DeviceMatrix& gm = side == GatherSide::left ? a : b;
                    const std::size_t gr = dim == 0 ? gm.extent(0) / n : gm.extent(0);
                    const std::size_t gc = dim == 1 ? gm.extent(1) / n : gm.extent(1);
                    gm = copy_block(gm, 0, gr, 0, gc);
                    const HalfMatrix a16 = round_and_pack(a, dtype), b16 = round_and_pack(b, dtype);
                    DeviceMatrix wide("wide", m, cols);
                    all_gather_matmul(comm, side, dim, {a, ta}, {b, tb}, wide, alg, ws, dtype);
                    HalfMatrix want("want", m, cols), got("got", m, cols);
                    pack_16bit(wide.data(), want.data(), wide.span(), dtype);
                    Kokkos::deep_copy(got, uint16_t{0x7777});
                    const bool a_16 = side == GatherSide::left && gathered_16bit;
                    const bool b_16 = side == GatherSide::right && gathered_16bit;
                    all_gather_matmul_to_16bit(comm, side, dim, operand(a, a16, a_16, ta),
                                               operand(b, b16, b_16, tb), got, alg, ws, dtype);
                    Kokkos::fence();
                    const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
                    const auto host_want =
                        Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), want);
                    const std::string what =
                        describe(g, alg,
                                 std::string("all_gather_matmul_to_16bit ") + to_string(dtype) +
                                     " side " + (side == GatherSide::left ? "left" : "right") +
                                     " dim " + std::to_string(dim) + " ta " + std::to_string(ta) +
                                     " tb " + std::to_string(tb) + " gathered 16-bit " +
                                     std::to_string(gathered_16bit) + (odd ? " odd blocks" : ""));
                    ++cases;
                    for (std::size_t r = 0; r < m; ++r)
                      for (std::size_t c = 0; c < cols; ++c)
                        ASSERT_EQ(host(r, c), host_want(r, c))
                            << what << " at (" << r << ", " << c << ")";
                  }
      }
    }
  }
  EXPECT_GT(cases, 0u);
  // Refused where blocks of C would accumulate, be row-strided, or C is strided.
  MeshCommunicators comms(Mesh::create({{"tp", -1}}, world_size()));
  Communicator& tp = comms.get({"tp"});
  const std::size_t n = static_cast<std::size_t>(tp.size());
  DeviceMatrix x = make_matrix("x", 4, 3, 1), dy = make_matrix("dy", 4, 5, 2);
  DeviceMatrix xk = make_matrix("xk", 4, 3, 3);  // K gathered: [4, 3n] @ [3n, 5]
  DeviceMatrix w = make_matrix("w", 3 * n, 5, 4);
  HalfMatrix dw("dw", 3, 5 * n), y("y", 4, 5), wider("wider", 3, 5 * n + 1);
  CollectiveMatmulWorkspace ws;
  for (A alg : {A::ring, A::bidirectional, A::automatic}) {
    EXPECT_FALSE(all_gather_matmul_writes_16bit(GatherSide::right, 1, false, alg));
    expect_error(
        [&] {
          all_gather_matmul_to_16bit(tp, GatherSide::right, 1, transposed(x), plain(dy), dw, alg,
                                     ws, Dtype::bf16);
        },
        ErrorKind::runtime, {"all_gather_matmul_to_16bit on", to_string(alg), "accumulate"});
  }
  EXPECT_FALSE(all_gather_matmul_writes_16bit(GatherSide::left, 1, false, A::naive));
  expect_error(
      [&] {
        all_gather_matmul_to_16bit(tp, GatherSide::left, 1, plain(xk), plain(w), y, A::naive, ws,
                                   Dtype::bf16);
      },
      ErrorKind::runtime, {"all_gather_matmul_to_16bit on", "accumulate"});
  expect_error(
      [&] {
        const HalfMatrixView strided(
            Kokkos::subview(wider, Kokkos::ALL, std::make_pair(std::size_t{1}, 5 * n + 1)));
        all_gather_matmul_to_16bit(tp, GatherSide::right, 1, transposed(x), plain(dy), strided,
                                   A::naive, ws, Dtype::bf16);
      },
      ErrorKind::runtime, {"all_gather_matmul_to_16bit on", "C must be contiguous"});
  // A C of the wrong extents: the error names the function called.
  HalfMatrix short_dw("short_dw", 2, 5 * n);
  expect_bad_input(
      [&] {
        all_gather_matmul_to_16bit(tp, GatherSide::right, 1, transposed(x), plain(dy), short_dw,
                                   A::naive, ws, Dtype::bf16);
      },
      {"all_gather_matmul_to_16bit on", "the output is [2, " + std::to_string(5 * n) + "]"});
}

// A split-output layer's weight gradient, dW = X_cᵀ @ all_gather(dY) (gathered on the right,
// naive), with a K of a layer's batch rows (512, an odd 777, 2048): all_gather_matmul_to_16bit runs
// ONE GEMM with a bf16 dst on the gathered bf16 dY laid out dense, where all_gather_matmul runs one
// GEMM with an fp32 dst per column block. Not bit for bit: on this build machine's AMX CPU
// (oneDNN 2.6's bf16 matmul) a bf16-dst GEMM and an fp32-dst GEMM of the same shape already differ
// once K >= 1536 and N >= 128 (one GEMM each at np 1: 2 of 24576 elements by one bf16 ulp at K 1536
// to 4096; none at K <= 1280, nor at N = 64): the two kernels sum K in different orders, so
// per-block 16-bit GEMMs (which this path avoids for their fp32 scratch) would restore the bits
// only where N stays small. Tolerance, per element, the bound for two fp32 sums of the same K exact
// products (bf16 x bf16 is exact in fp32) in any two orders: |got - C| <= 1/2 bf16 ulp of
// max(|got|, |C|) (got's rounding) + 2 (K - 1) 2^-24 sum_k |x_kr dy_kc| (each order's fp32 error
// is at most (K - 1) 2^-24 times that sum, to first order), C all_gather_matmul's fp32 product.
// The elements whose bits differ from C rounded (pack_16bit) are counted and printed on rank 0.
// The input X fp32 (holding bf16 values) or bf16; each rank's dY block is its own.
TEST(CollectiveMatmul, AllGatherMatmulTo16BitOnTheRightWithALongKStaysWithinTheFp32SumsBound) {
  MeshCommunicators comms(Mesh::create({{"tp", -1}}, world_size()));
  Communicator& tp = comms.get({"tp"});
  const std::size_t n = static_cast<std::size_t>(tp.size());
  const std::size_t i = static_cast<std::size_t>(tp.rank());
  const std::size_t in = 96, block = 256 / n;  // dW is [in, 256]
  CollectiveMatmulWorkspace ws;
  std::size_t cases = 0;
  for (std::size_t k : {std::size_t{512}, std::size_t{777}, std::size_t{2048}}) {
    // The same X_c on every rank, as a layer's; rank r's dY block from seed 43 + k + 100 r.
    DeviceMatrix x = make_matrix("x", k, in, 41 + k);
    const auto dy_of = [&](std::size_t r) { return make_matrix("dy", k, block, 43 + k + 100 * r); };
    DeviceMatrix dy = dy_of(i);
    const HalfMatrix x16 = round_and_pack(x, Dtype::bf16), dy16 = round_and_pack(dy, Dtype::bf16);
    DeviceMatrix wide("wide", in, block * n);
    all_gather_matmul(tp, GatherSide::right, 1, transposed(x), plain(ConstHalfMatrixView(dy16)),
                      wide, CollectiveMatmulAlgorithm::naive, ws, Dtype::bf16);
    HalfMatrix want("want", in, block * n), got("got", in, block * n);
    pack_16bit(wide.data(), want.data(), wide.span(), Dtype::bf16);
    // sum_k |x_kr| |dy_kc| of every element, from every rank's dY block (its values rounded).
    const HostMatrix hx = to_host(x), hwide = to_host(wide);
    std::vector<double> abs_sum(in * block * n, 0.0);
    for (std::size_t r = 0; r < n; ++r) {
      DeviceMatrix other = dy_of(r);
      round_and_pack(other, Dtype::bf16);
      const HostMatrix hdy = to_host(other);
      for (std::size_t row = 0; row < in; ++row)
        for (std::size_t c = 0; c < block; ++c) {
          double sum = 0.0;
          for (std::size_t t = 0; t < k; ++t)
            sum += std::abs(double(hx(t, row))) * std::abs(double(hdy(t, c)));
          abs_sum[row * block * n + r * block + c] = sum;
        }
    }
    const double reorder = 2.0 * double(k - 1) * std::ldexp(1.0, -24);
    for (bool x_16bit : {false, true}) {
      Kokkos::deep_copy(got, uint16_t{0x7777});
      all_gather_matmul_to_16bit(tp, GatherSide::right, 1, operand(x, x16, x_16bit, true),
                                 plain(ConstHalfMatrixView(dy16)), got,
                                 CollectiveMatmulAlgorithm::naive, ws, Dtype::bf16);
      Kokkos::fence();
      const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
      const auto host_want = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), want);
      std::size_t differing = 0;
      for (std::size_t r = 0; r < in; ++r)
        for (std::size_t c = 0; c < block * n; ++c) {
          differing += host(r, c) != host_want(r, c);
          const double g = from_16bit(host(r, c), Dtype::bf16), w = hwide(r, c);
          const double top = std::max(std::abs(g), std::abs(w));
          const double half_ulp = top > 0 ? std::ldexp(1.0, std::ilogb(top) - 8) : 0.0;
          const double bound = half_ulp + reorder * abs_sum[r * block * n + c];
          ASSERT_LE(std::abs(g - w), bound)
              << "K " << k << ", X " << (x_16bit ? "bf16" : "fp32") << " at (" << r << ", " << c
              << "): got " << g << ", the fp32 product " << w;
        }
      ++cases;
      if (world_rank() == 0) {
        std::cout << "K " << k << ", X " << (x_16bit ? "bf16" : "fp32") << ", " << n
                  << " ranks: " << differing << " of " << in * block * n
                  << " elements' bits differ from the fp32 product rounded\n";
      }
    }
  }
  EXPECT_EQ(cases, 6u);
}

TEST(CollectiveMatmul, SixteenBitGatheredOperandNeedsASixteenBitWire) {
  MeshCommunicators comms(Mesh::create({{"tp", -1}}, world_size()));
  Communicator& tp = comms.get({"tp"});
  const std::size_t n = static_cast<std::size_t>(tp.size());
  DeviceMatrix lhs = make_matrix("lhs", 4, 3 * n, 1), block = make_matrix("blk", 3, 5, 2);
  const HalfMatrix bits = round_and_pack(block, Dtype::bf16);
  DeviceMatrix out("out", 4, 5);
  CollectiveMatmulWorkspace ws;
  expect_bad_input(
      [&] {
        all_gather_matmul(tp, GatherSide::right, 0, plain(lhs), plain(ConstHalfMatrixView(bits)),
                          out, CollectiveMatmulAlgorithm::ring, ws);
      },
      {"all_gather_matmul on", "a 16-bit gathered operand needs a 16-bit wire dtype", "got fp32"});
}

TEST(CollectiveMatmul, RingAndBidirectionalHoldTwoBlocksNotN) {
  MeshCommunicators comms(Mesh::create({{"dp", -1}}, world_size()));
  Communicator& comm = comms.get({"dp"});
  const std::size_t n = static_cast<std::size_t>(comm.size());
  const std::size_t rows = 6, cols = 10;  // a block; the gathered operand is n blocks
  const std::size_t block_bytes = rows * cols * sizeof(float);
  DeviceMatrix lhs = make_matrix("lhs", 8, rows * n, 1), block = make_matrix("blk", rows, cols, 2);
  DeviceMatrix out("out", 8, cols);
  DeviceMatrix rs_a = make_matrix("rs_a", rows * n, 5, 3), rs_b = make_matrix("rs_b", 5, cols, 4);
  DeviceMatrix rs_out("rs_out", rows, cols);
  for (CollectiveMatmulAlgorithm alg : kAlgorithms) {
    CollectiveMatmulWorkspace ws;
    all_gather_matmul(comm, GatherSide::right, 0, plain(lhs), plain(block), out, alg, ws);
    const std::size_t ag_bytes = ws.last_call_bytes();
    matmul_reduce_scatter(comm, 0, plain(rs_a), plain(rs_b), rs_out, alg, ws);
    const std::size_t rs_bytes = ws.last_call_bytes();
    const std::size_t capacity = ws.capacity_bytes();
    const float* buffer = ws.acquire(0);
    // A second round of the same shapes allocates nothing.
    all_gather_matmul(comm, GatherSide::right, 0, plain(lhs), plain(block), out, alg, ws);
    matmul_reduce_scatter(comm, 0, plain(rs_a), plain(rs_b), rs_out, alg, ws);
    EXPECT_EQ(ws.capacity_bytes(), capacity) << to_string(alg);
    EXPECT_EQ(ws.acquire(0), buffer) << to_string(alg);
    // What the two calls above ran (the cost model's choice for `auto` depends on the shapes).
    const auto ag = resolve_collective_matmul_algorithm(
        alg, all_gather_matmul_shape(comm, GatherSide::right, 0, plain(lhs), plain(block), out));
    const auto rs = resolve_collective_matmul_algorithm(
        alg, matmul_reduce_scatter_shape(comm, 0, plain(rs_a), plain(rs_b), rs_out));
    if (ag == CollectiveMatmulAlgorithm::naive) {
      EXPECT_EQ(ag_bytes, n * block_bytes) << "naive holds the gathered operand";
    } else {
      EXPECT_LE(ag_bytes, 2 * block_bytes) << to_string(alg) << " all_gather_matmul at n " << n;
    }
    if (rs == CollectiveMatmulAlgorithm::naive) {
      EXPECT_EQ(rs_bytes, n * block_bytes) << "naive holds the full product";
    } else {
      EXPECT_LE(rs_bytes, 2 * block_bytes) << to_string(alg) << " matmul_reduce_scatter at n " << n;
    }
  }
}

TEST(CollectiveMatmul, NonDivisibleShapesAreBadInput) {
  MeshCommunicators comms(Mesh::create({{"tp", -1}}, world_size()));
  Communicator& tp = comms.get({"tp"});
  const std::size_t n = static_cast<std::size_t>(tp.size());
  if (n < 2) GTEST_SKIP() << "every shape divides one rank";
  CollectiveMatmulWorkspace ws;
  const std::string ranks = std::to_string(n) + " ranks";
  DeviceMatrix a("a", 3 * n + 1, 4), b("b", 4, 6), c("c", 3, 6);
  expect_bad_input(
      [&] {
        matmul_reduce_scatter(tp, 0, plain(a), plain(b), c, CollectiveMatmulAlgorithm::ring, ws);
      },
      {"matmul_reduce_scatter", "axis (tp)", "dimension 0", "M = " + std::to_string(3 * n + 1),
       ranks});
  DeviceMatrix a2("a2", 4, 5), b2("b2", 5, 2 * n + 1), c2("c2", 4, 2);
  expect_bad_input(
      [&] {
        matmul_reduce_scatter(tp, 1, plain(a2), plain(b2), c2, CollectiveMatmulAlgorithm::naive,
                              ws);
      },
      {"dimension 1", "N = " + std::to_string(2 * n + 1), ranks});
  DeviceMatrix lhs("lhs", 5, 3 * n + 1), blk("blk", 3, 6), out("out", 5, 6);
  expect_bad_input(
      [&] {
        all_gather_matmul(tp, GatherSide::right, 0, plain(lhs), plain(blk), out,
                          CollectiveMatmulAlgorithm::bidirectional, ws);
      },
      {"all_gather_matmul", "K = " + std::to_string(3 * n + 1), "not divisible", ranks});
  DeviceMatrix dy("dy", 4, 5), w("w", 3, 5 * n), dx_wrong("dx", 4, 7);
  expect_bad_input(
      [&] {
        all_gather_matmul(tp, GatherSide::left, 1, plain(dy), transposed(w), dx_wrong,
                          CollectiveMatmulAlgorithm::ring, ws);
      },
      {"output is [4, 7]", "expected [4, 3]"});
  expect_bad_input([] { parse_collective_matmul_algorithm("fast"); },
                   {"'fast'", "naive | ring | bidirectional | auto"});
  EXPECT_EQ(parse_collective_matmul_algorithm("bidirectional"),
            CollectiveMatmulAlgorithm::bidirectional);
}

// gemm() (CBLAS on host memory) on LayoutRight views,
// transposed and row-strided (column blocks), against the double reference.
TEST(CollectiveMatmul, GemmOnLayoutRightAndStridedViews) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const std::size_t m = 37, k = 29, n = 23;
      const auto [ar, ac] = stored(m, k, ta);
      const auto [br, bc] = stored(k, n, tb);
      // Operands as column blocks [1, 1+cols) of wider matrices: stride(0) > extent(1).
      DeviceMatrix a_store = make_matrix("a", ar, ac + 3, 11),
                   b_store = make_matrix("b", br, bc + 2, 12);
      ConstMatrixView a = Kokkos::subview(a_store, Kokkos::ALL,
                                          std::make_pair<std::size_t, std::size_t>(1, 1 + ac));
      ConstMatrixView b = Kokkos::subview(b_store, Kokkos::ALL,
                                          std::make_pair<std::size_t, std::size_t>(1, 1 + bc));
      ASSERT_EQ(a.stride(0), ac + 3);
      DeviceMatrix a_copy = copy_block(a_store, 0, ar, 1, ac),
                   b_copy = copy_block(b_store, 0, br, 1, bc);
      std::vector<double> want;
      reference_gemm(a_copy, ta, b_copy, tb, want);
      DeviceMatrix c_store("c", m, n + 4);
      MatrixView c =
          Kokkos::subview(c_store, Kokkos::ALL, std::make_pair<std::size_t, std::size_t>(2, 2 + n));
      gemm({a, ta}, {b, tb}, 0.0f, c);
      expect_matches(c, want, 0, 0, n,
                     "gemm ta " + std::to_string(ta) + " tb " + std::to_string(tb));
      DeviceMatrix c_plain("c_plain", m, n);
      gemm({a_copy, ta}, {b_copy, tb}, 0.0f, c_plain);
      expect_matches(c_plain, want, 0, 0, n, "contiguous gemm");
    }
}

// beta: C = beta * C + op(A) @ op(B), accumulating (beta 1, 0.5) and overwriting (beta 0,
// even over NaN, as BLAS does); K = 0 leaves beta * C; empty M or N is a no-op.
TEST(Gemm, BetaAccumulatesScalesAndOverwrites) {
  const std::size_t m = 5, k = 7, n = 3;
  DeviceMatrix a = make_matrix("a", m, k, 21), b = make_matrix("b", k, n, 22);
  std::vector<double> product;
  reference_gemm(a, false, b, false, product);
  for (float beta : {1.0f, 0.5f, 0.0f}) {
    DeviceMatrix c = make_matrix("c", m, n, 23);
    const HostMatrix c0 = to_host(c);
    if (beta == 0.0f) Kokkos::deep_copy(c, std::nanf(""));
    gemm(plain(a), plain(b), beta, c);
    std::vector<double> want(product);
    for (std::size_t r = 0; r < m; ++r)
      for (std::size_t col = 0; col < n; ++col) want[r * n + col] += beta * c0(r, col);
    expect_matches(c, want, 0, 0, n, "beta " + std::to_string(beta));
  }
  DeviceMatrix empty_a("empty_a", m, 0), empty_b("empty_b", 0, n);
  DeviceMatrix scaled = make_matrix("scaled", m, n, 24);
  const HostMatrix before = to_host(scaled);
  gemm(plain(empty_a), plain(empty_b), 0.5f, scaled);
  const HostMatrix after = to_host(scaled);
  for (std::size_t r = 0; r < m; ++r)
    for (std::size_t col = 0; col < n; ++col) EXPECT_EQ(after(r, col), 0.5f * before(r, col));
  DeviceMatrix cleared("cleared", m, n);
  Kokkos::deep_copy(cleared, std::nanf(""));
  gemm(plain(empty_a), plain(empty_b), 0.0f, cleared);
  const HostMatrix cleared_host = to_host(cleared);
  for (std::size_t r = 0; r < m; ++r)
    for (std::size_t col = 0; col < n; ++col) EXPECT_EQ(cleared_host(r, col), 0.0f);
  DeviceMatrix no_rows("no_rows", 0, n);
  gemm(plain(DeviceMatrix("a0", 0, k)), plain(b), 0.0f, no_rows);  // nothing to do, no error
}

TEST(Gemm, ShapesThatDoNotChainAreBadInput) {
  DeviceMatrix a("a", 4, 3), b("b", 2, 5), c("c", 4, 5);
  expect_bad_input([&] { gemm(plain(a), plain(b), 0.0f, c); },
                   {"gemm: op(A) is [4, 3], op(B) is [2, 5] and C is [4, 5]"});
  DeviceMatrix b_ok("b_ok", 3, 5), c_wrong("c_wrong", 5, 4);
  expect_bad_input([&] { gemm(plain(a), plain(b_ok), 0.0f, c_wrong); }, {"C is [5, 4]"});
}

// [runtime] matmul_precision: parsed by name; on host memory (CBLAS) tf32 computes in
// fp32, so both give the same bits.
TEST(Gemm, MatmulPrecision) {
  EXPECT_EQ(parse_matmul_precision("fp32"), MatmulPrecision::fp32);
  EXPECT_EQ(parse_matmul_precision("tf32"), MatmulPrecision::tf32);
  EXPECT_STREQ(to_string(MatmulPrecision::tf32), "tf32");
  expect_bad_input([] { parse_matmul_precision("bf16"); },
                   {"runtime.matmul_precision = 'bf16' is not one of fp32 | tf32"});
  EXPECT_EQ(matmul_precision(), MatmulPrecision::fp32);  // the default, as in PyTorch
  if (kDeviceMemoryIsHostInaccessible) GTEST_SKIP() << "tf32 rounds on a GPU";
  DeviceMatrix a = make_matrix("a", 33, 65, 31), b = make_matrix("b", 65, 17, 32);
  DeviceMatrix fp32("fp32", 33, 17), tf32("tf32", 33, 17);
  gemm(plain(a), plain(b), 0.0f, fp32);
  set_matmul_precision(MatmulPrecision::tf32);
  gemm(plain(a), plain(b), 0.0f, tf32);
  set_matmul_precision(MatmulPrecision::fp32);
  const HostMatrix fp32_host = to_host(fp32), tf32_host = to_host(tf32);
  for (std::size_t r = 0; r < 33; ++r)
    for (std::size_t col = 0; col < 17; ++col) EXPECT_EQ(fp32_host(r, col), tf32_host(r, col));
}

}  // namespace
}  // namespace meshtrain::testing
