#pragma once
// Shared by the communicator and collective-matmul tests: deterministic data (every rank
// can rebuild any rank's operands from a seed), a reference GEMM in double, and the
// communicators under test (the world and the tp groups of an fsdp x tp mesh).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "partition/mesh.hpp"
#include "tests/test_support.hpp"

namespace meshtrain::testing {

using HostMatrix = Kokkos::View<float**, Kokkos::LayoutRight>;

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

inline HostMatrix make_matrix(const std::string& label, std::size_t rows, std::size_t cols,
                              uint64_t seed) {
  HostMatrix m(label, rows, cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) m(r, c) = value_at(seed, r, c);
  return m;
}

// Stored rows [r0, r0+rows) x cols [c0, c0+cols) of m, as a new contiguous matrix.
inline HostMatrix copy_block(const HostMatrix& m, std::size_t r0, std::size_t rows, std::size_t c0,
                             std::size_t cols) {
  HostMatrix b("block", rows, cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) b(r, c) = m(r0 + r, c0 + c);
  return b;
}

// op(A) @ op(B) in double, accumulated into `out` (same shape as the product).
inline void reference_gemm(const HostMatrix& a, bool ta, const HostMatrix& b, bool tb,
                           std::vector<double>& out) {
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
void expect_matches(const View& got, const std::vector<double>& want, std::size_t row0,
                    std::size_t col0, std::size_t full_cols, const std::string& what) {
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

}  // namespace meshtrain::testing
