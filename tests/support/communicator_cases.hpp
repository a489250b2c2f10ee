#pragma once
// Shared by the communicator, collective-matmul, ring, communication-thread and NCCL tests:
// deterministic data (every rank can rebuild any rank's operands from a seed), a reference GEMM
// in double, the communicators under test (the world and the tp groups of an fsdp x tp mesh),
// the ragged traffic of the all_to_all_v tests, and the signal of the proof-of-progress tests.
// Operands live in the default memory space (device memory with a CUDA Kokkos, which the
// host must not dereference): they are built in host views and deep-copied over, and
// results are copied back to host views (to_host) before the host reads them.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "partition/mesh.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {

using HostMatrix = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>;
using DeviceMatrix = Kokkos::View<float**, Kokkos::LayoutRight>;  // default memory space

// A value in [-1, 1) that depends only on (seed, row, col): operands are rebuilt identically
// on every rank, and different seeds (groups, ranks) give different data.
inline float value_at(uint64_t seed, std::size_t row, std::size_t col) {
  uint64_t x =
      seed * 0x9E3779B97F4A7C15ull + row * 0xBF58476D1CE4E5B9ull + col * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// A host copy of a 2-D view of the default memory space (possibly row-strided, e.g. a column
// block of a wider matrix: that is first copied to a contiguous view in its own space, since
// deep_copy between spaces needs contiguous views).
template <class View>
HostMatrix to_host(const View& v) {
  DeviceMatrix contiguous("to_host", v.extent(0), v.extent(1));
  Kokkos::deep_copy(contiguous, v);
  HostMatrix h("to_host", v.extent(0), v.extent(1));
  Kokkos::deep_copy(h, contiguous);
  return h;
}

// A copy of a host matrix in the default memory space.
inline DeviceMatrix to_device(const HostMatrix& h, const std::string& label = "to_device") {
  DeviceMatrix d(label, h.extent(0), h.extent(1));
  Kokkos::deep_copy(d, h);
  return d;
}

inline HostMatrix make_host_matrix(const std::string& label, std::size_t rows, std::size_t cols,
                                   uint64_t seed) {
  HostMatrix m(label, rows, cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) m(r, c) = value_at(seed, r, c);
  return m;
}

// The same matrix in the default memory space, the operand of communicators and GEMM.
inline DeviceMatrix make_matrix(const std::string& label, std::size_t rows, std::size_t cols,
                                uint64_t seed) {
  return to_device(make_host_matrix(label, rows, cols, seed), label);
}

// Stored rows [r0, r0+rows) x cols [c0, c0+cols) of m, as a new contiguous matrix.
inline DeviceMatrix copy_block(const DeviceMatrix& m, std::size_t r0, std::size_t rows,
                               std::size_t c0, std::size_t cols) {
  DeviceMatrix b("block", rows, cols);
  Kokkos::deep_copy(
      b, Kokkos::subview(m, std::make_pair(r0, r0 + rows), std::make_pair(c0, c0 + cols)));
  return b;
}

// op(A) @ op(B) in double, accumulated into `out` (same shape as the product).
template <class A, class B>
void reference_gemm(const A& a_view, bool ta, const B& b_view, bool tb, std::vector<double>& out) {
  const HostMatrix a = to_host(a_view), b = to_host(b_view);
  const std::size_t m = ta ? a.extent(1) : a.extent(0);
  const std::size_t k = ta ? a.extent(0) : a.extent(1);
  const std::size_t n = tb ? b.extent(0) : b.extent(1);
  out.resize(m * n, 0.0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (std::size_t l = 0; l < k; ++l) {
        const double av = ta ? a(l, i) : a(i, l);
        const double bv = tb ? b(j, l) : b(l, j);
        s += av * bv;
      }
      out[i * n + j] += s;
    }
}

// Tolerance of every comparison: |got - want| <= 1e-5 * (1 + max |want|). Inputs are in
// [-1, 1) and K is at most a few dozen, so float rounding stays far below it.
template <class View>
void expect_matches(const View& got_view, const std::vector<double>& want, std::size_t row0,
                    std::size_t col0, std::size_t full_cols, const std::string& what) {
  const HostMatrix got = to_host(got_view);
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  const double tol = 1e-5 * (1.0 + scale);
  int reported = 0;
  for (std::size_t r = 0; r < got.extent(0); ++r)
    for (std::size_t c = 0; c < got.extent(1); ++c) {
      const double w = want[(row0 + r) * full_cols + col0 + c];
      if (std::fabs(got(r, c) - w) > tol && reported++ < 3) {
        ADD_FAILURE() << what << ": element (" << r << ", " << c << ") is " << got(r, c)
                      << ", expected " << w << " (tolerance " << tol << ")";
      }
    }
}

// A group under test: its communicator and a seed distinct per group.
struct Group {
  std::string name;
  Communicator* comm = nullptr;
  uint64_t seed = 0;
};

// The communicators every test runs on: the whole world, and when the world size is even
// the tp groups (size 2) of an fsdp x tp mesh and the (tp, fsdp) tuple; with 4 or more
// ranks also the fsdp groups. Groups get different seeds, so a mix-up between groups
// shows as a wrong result.
class TestGroups {
 public:
  TestGroups() {
    const int size = world_size();
    const int tp = size % 2 == 0 ? 2 : 1;
    mesh_comms_ = std::make_unique<MeshCommunicators>(
        Mesh::create({{"fsdp", -1}, {"tp", tp}}, size, "test mesh"));
    const int rank = world_rank();
    const Mesh& mesh = mesh_comms_->mesh();
    const std::vector<std::vector<std::string>> tuples = {
        {"fsdp", "tp"}, {"tp"}, {"fsdp"}, {"tp", "fsdp"}};
    for (const auto& axes : tuples) {
      Communicator& c = mesh_comms_->get(axes);
      EXPECT_EQ(c.rank(), mesh.group_index(rank, axes)) << describe_axes(axes);
      EXPECT_EQ(c.size(), mesh.size_of(axes)) << describe_axes(axes);
      groups_.push_back(
          {describe_axes(axes), &c,
           1000u * (groups_.size() + 1) + static_cast<uint64_t>(mesh.group_color(rank, axes))});
    }
  }
  const std::vector<Group>& groups() const { return groups_; }

 private:
  std::unique_ptr<MeshCommunicators> mesh_comms_;
  std::vector<Group> groups_;
};

// fp32 and the 16-bit wire types, with their names.
inline const std::pair<Dtype, const char*> kWireTypes[] = {
    {Dtype::fp32, "fp32"}, {Dtype::bf16, "bf16"}, {Dtype::fp16, "fp16"}};

// The rows rank `src` sends rank `dst` in round `salt` of the all_to_all_v tests: 0 to 3, zero
// for some pairs (and for every pair on one rank in some rounds); in round 4 only rank 0 sends.
inline int64_t ragged_rows(int src, int dst, int salt) {
  if (salt == 4) return src == 0 ? dst % 3 + 1 : 0;
  return (3 * src + 5 * dst + salt) % 4;
}
// Element (row, col) of the block rank `src` sends rank `dst`: every element of every block a
// different float (exact in fp32; rounded on a 16-bit wire).
inline float ragged_value(int src, int dst, int row, int col) {
  return static_cast<float>(src * 1000 + dst * 100 + row * 10 + col) + 0.3f;
}

// Rank `me`'s part of round `salt` in a group of n ranks: the rows it sends each rank and
// receives from each, how many it receives in all, and its send matrix: the packed rows, then
// `extra` rows of a value never sent (a row sent by mistake shows as a wrong value).
struct RaggedRound {
  std::vector<int64_t> send_rows, recv_rows;
  std::size_t recv_total = 0;
  HostMatrix send;
};
inline RaggedRound ragged_round(int n, int me, int salt, std::size_t cols, std::size_t extra) {
  RaggedRound round;
  std::size_t send_total = 0;
  for (int j = 0; j < n; ++j) {
    round.send_rows.push_back(ragged_rows(me, j, salt));
    round.recv_rows.push_back(ragged_rows(j, me, salt));
    send_total += static_cast<std::size_t>(round.send_rows.back());
    round.recv_total += static_cast<std::size_t>(round.recv_rows.back());
  }
  round.send = HostMatrix("send", send_total + extra, cols);
  std::size_t at = 0;
  for (int j = 0; j < n; ++j)
    for (int r = 0; r < round.send_rows[j]; ++r, ++at)
      for (std::size_t c = 0; c < cols; ++c)
        round.send(at, c) = ragged_value(me, j, r, static_cast<int>(c));
  for (; at < round.send.extent(0); ++at)
    for (std::size_t c = 0; c < cols; ++c) round.send(at, c) = 99999.0f;
  return round;
}

// The first round.recv_total rows of `got`, received by rank `me`: each exactly what its
// sender packed for this rank, rounded to `wire`.
inline void expect_ragged_rows(const HostMatrix& got, const RaggedRound& round, int me, Dtype wire,
                               const std::string& where) {
  std::size_t row = 0;
  for (int j = 0; j < static_cast<int>(round.recv_rows.size()); ++j)
    for (int r = 0; r < round.recv_rows[j]; ++r, ++row)
      for (std::size_t c = 0; c < got.extent(1); ++c)
        ASSERT_EQ(got(row, c), round_to(ragged_value(j, me, r, static_cast<int>(c)), wire))
            << "row " << r << " from rank " << j << " at (" << row << ", " << c << ") " << where;
}

// The proof-of-progress tests' signal, through files in a directory every rank knows (no MPI
// call): a rank above 0 marks that its wait for operation `name` returned; rank 0 computes,
// without MPI calls, until every other rank of `size` has marked it or 30 s pass, and returns
// whether all had (so such a test fails rather than hangs).
inline void mark_wait_returned(const std::string& dir, const std::string& name, int rank) {
  std::ofstream(dir + "/" + name + "_" + std::to_string(rank)) << "done\n";
}
inline bool compute_until_every_wait_returned(const std::string& dir, const std::string& name,
                                              int size) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  volatile double work = 0.0;
  bool all_done = false;
  while (!all_done && std::chrono::steady_clock::now() < deadline) {
    for (int k = 0; k < 100000; ++k) work = work + std::sqrt(static_cast<double>(k));
    all_done = true;
    for (int j = 1; j < size; ++j) {
      all_done = all_done && std::filesystem::exists(dir + "/" + name + "_" + std::to_string(j));
    }
  }
  return all_done;
}

}  // namespace meshtrain::testing
