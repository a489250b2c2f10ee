// The MPI backend's ring reductions (framework/comm/backends/mpi_ring.hpp) through the public
// Communicator API: reduce_scatter (dim 0 and dim 1) and all_reduce, fp32 and 16-bit wires,
// counts 0, 1, not divisible by the group and spanning several segments. Each result is
// checked three ways:
// - bit for bit against a host emulation of the documented summation order (block b summed
//   from rank (b + 1) mod n around the ring, each partial sum rounded to the wire type);
// - against a float64 sum within the rounding bound of that order: for fp32,
//   (n - 1) * 2^-24 * sum_j |x_j| per element; for a 16-bit wire with unit roundoff u
//   (bf16 2^-8, fp16 2^-11), (2n - 1) * u * 1.01 * sum_j |x_j| (each input rounded once when
//   packed, each of the n - 1 partial sums once), plus (2n - 1) * 2^-25 for fp16's subnormals;
// - the same bits on every rank (all_reduce) and in a second run.
// Also: a rank that never joins turns into the MPI path's timeout error; repeated calls
// allocate nothing.

#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>
#include <Kokkos_Core.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/backends/mpi_ring.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/comm/reduction_choice.hpp"
#include "framework/core/precision.hpp"
#include "tests/support/communicator_cases.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

using HostVector = Kokkos::View<float*, Kokkos::HostSpace>;
using DeviceVector = Kokkos::View<float*>;

// Rank r's input: `count` values in [-1, 1) from seed (salt, r).
std::vector<float> input_of(int rank, std::size_t count, uint64_t salt) {
  std::vector<float> x(count);
  for (std::size_t k = 0; k < count; ++k) x[k] = value_at(salt * 131 + rank + 1, 0, k);
  return x;
}

DeviceVector to_device(const std::vector<float>& x) {
  HostVector h("host", x.size());
  for (std::size_t k = 0; k < x.size(); ++k) h(k) = x[k];
  DeviceVector d("device", x.size());
  Kokkos::deep_copy(d, h);
  return d;
}

std::vector<float> to_vector(const DeviceVector& d) {
  HostVector h("host", d.extent(0));
  Kokkos::deep_copy(h, d);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

const char* wire_name(Dtype wire) {
  return wire == Dtype::fp32 ? "fp32" : wire == Dtype::bf16 ? "bf16" : "fp16";
}

double unit_roundoff(Dtype wire) {
  switch (wire) {
    case Dtype::bf16:
      return std::ldexp(1.0, -8);
    case Dtype::fp16:
      return std::ldexp(1.0, -11);
    default:
      return std::ldexp(1.0, -24);
  }
}

// Element `k` of block `b` of every rank's input summed in the documented ring order.
float ring_order_sum(const std::vector<std::vector<float>>& inputs, int b, std::size_t index,
                     Dtype wire) {
  const int n = static_cast<int>(inputs.size());
  float sum = round_to(inputs[(b + 1) % n][index], wire);
  for (int j = 2; j <= n; ++j) {
    sum = round_to(sum + round_to(inputs[(b + j) % n][index], wire), wire);
  }
  return sum;
}

// Checks `got` (the sum of element `index` of every rank's input) against the ring order bit
// for bit and against a float64 sum within the bound stated at the top.
void expect_ring_sum(const std::vector<std::vector<float>>& inputs, int block, std::size_t index,
                     float got, Dtype wire) {
  const int n = static_cast<int>(inputs.size());
  const float ordered = ring_order_sum(inputs, block, index, wire);
  double exact = 0.0, magnitude = 0.0;
  for (const auto& x : inputs) {
    exact += x[index];
    magnitude += std::fabs(x[index]);
  }
  const double u = unit_roundoff(wire);
  // fp16 rounds to a fixed spacing of 2^-24 below 2^-14 (subnormals): half of it per rounding.
  const double subnormal = wire == Dtype::fp16 ? (2 * n - 1) * std::ldexp(1.0, -25) : 0.0;
  const double bound = wire == Dtype::fp32 ? (n - 1) * u * magnitude
                                           : (2 * n - 1) * u * 1.01 * magnitude + subnormal;
  uint32_t got_bits = 0, ordered_bits = 0;
  std::memcpy(&got_bits, &got, 4);
  std::memcpy(&ordered_bits, &ordered, 4);
  ASSERT_EQ(got_bits, ordered_bits) << "element " << index << " of block " << block << ": " << got
                                    << " vs the ring order's " << ordered;
  ASSERT_LE(std::fabs(got - exact), bound) << "element " << index << ": " << got << " vs " << exact;
}

uint64_t bits_hash(const std::vector<float>& x) {
  uint64_t h = 1469598103934665603ull;
  for (float v : x) {
    uint32_t b = 0;
    std::memcpy(&b, &v, 4);
    h = (h ^ b) * 1099511628211ull;
  }
  return h;
}

// True when every rank of the world passed the same hash.
bool same_on_every_rank(uint64_t hash) {
  uint64_t low = hash, high = hash;
  MPI_Allreduce(MPI_IN_PLACE, &low, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &high, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return low == hash && high == hash;
}

// One segment is kRingSegmentBytes: 262,144 floats or 524,288 16-bit values.
constexpr std::size_t kSeveralSegments = 300007;

TEST(Ring, ReduceScatterFollowsTheDocumentedOrder) {
  const int n = world_size(), rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (fsdp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  for (Dtype wire : {Dtype::fp32, Dtype::bf16, Dtype::fp16}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, kSeveralSegments}) {
      SCOPED_TRACE(std::string(wire_name(wire)) + " count per rank " + std::to_string(count));
      const std::size_t total = count * n;
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, total, count));
      const DeviceVector send = to_device(inputs[rank]);
      DeviceVector recv("recv", count);
      comm.reduce_scatter(send, recv, wire);
      const std::vector<float> first = to_vector(recv);
      for (std::size_t k = 0; k < count; ++k) {
        expect_ring_sum(inputs, rank, rank * count + k, first[k], wire);
      }
      Kokkos::deep_copy(recv, 0.0f);
      comm.reduce_scatter(send, recv, wire);
      EXPECT_EQ(bits_hash(to_vector(recv)), bits_hash(first)) << "a second run differs";
    }
  }
}

// Both all-gathers of the all-reduce: the library's MPI_Iallgatherv (default) and the ring of
// copies (MESHTRAIN_RING_ALL_GATHER=ring, what counts beyond an int's bytes use).
class RingAllReduce : public ::testing::TestWithParam<const char*> {};

TEST_P(RingAllReduce, IsTheSameOnEveryRankForAnyCount) {
  ::setenv("MESHTRAIN_RING_ALL_GATHER", GetParam(), 1);
  ASSERT_EQ(ring_all_gather_from_env(), std::string(GetParam()) == "ring");
  const int n = world_size(), rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  const std::size_t uneven = 2 * static_cast<std::size_t>(n) + 1;
  for (Dtype wire : {Dtype::fp32, Dtype::bf16}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, uneven, 2 * kSeveralSegments + 1}) {
      SCOPED_TRACE(std::string(wire_name(wire)) + " count " + std::to_string(count));
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, count, count + 3));
      DeviceVector data = to_device(inputs[rank]);
      comm.all_reduce(data, ReduceOp::sum, wire);
      const std::vector<float> got = to_vector(data);
      // Blocks of ceil/floor(count / n): the first count mod n one element longer.
      const std::size_t base = count / n, extra = count % n;
      std::size_t k = 0;
      for (int b = 0; b < n; ++b) {
        const std::size_t length = base + (static_cast<std::size_t>(b) < extra ? 1 : 0);
        for (std::size_t e = 0; e < length; ++e, ++k) expect_ring_sum(inputs, b, k, got[k], wire);
      }
      EXPECT_TRUE(same_on_every_rank(bits_hash(got))) << "ranks hold different bits";
      DeviceVector again = to_device(inputs[rank]);
      comm.all_reduce(again, ReduceOp::sum, wire);
      EXPECT_EQ(bits_hash(to_vector(again)), bits_hash(got)) << "a second run differs";
    }
  }
  // mean divides the ring's sum.
  DeviceVector ones = to_device(std::vector<float>(5, 1.0f));
  comm.all_reduce(ones, ReduceOp::mean);
  for (float v : to_vector(ones)) EXPECT_EQ(v, 1.0f);
  ::unsetenv("MESHTRAIN_RING_ALL_GATHER");
}

INSTANTIATE_TEST_SUITE_P(Ring, RingAllReduce, ::testing::Values("library", "ring"));

TEST(Ring, AllGatherChoiceFromEnvironment) {
  ::setenv("MESHTRAIN_RING_ALL_GATHER", "fast", 1);
  expect_bad_input([] { ring_all_gather_from_env(); }, {"MESHTRAIN_RING_ALL_GATHER", "'fast'"});
  ::unsetenv("MESHTRAIN_RING_ALL_GATHER");
  EXPECT_FALSE(ring_all_gather_from_env());
}

// Dim-1 reduce_scatter packs column blocks and then runs the ring: column block i of the
// sum, as the library gives it within the fp32 bound.
TEST(Ring, ReduceScatterAlongDimOneMatchesTheLibrary) {
  const int n = world_size(), rank = world_rank();
  const std::size_t rows = 5, cols = 3;
  auto ring = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (tp)");
  ring.set_reduction_choice(ReductionChoice::ring());
  auto library = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (tp)");
  const DeviceMatrix send = make_matrix("send", rows, n * cols, 17 + rank);
  DeviceMatrix by_ring("ring", rows, cols), by_library("library", rows, cols);
  ring.reduce_scatter(send, by_ring, 1);
  library.reduce_scatter(send, by_library, 1);
  const HostMatrix a = to_host(by_ring), b = to_host(by_library);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) {
      double exact = 0.0;
      for (int j = 0; j < n; ++j) exact += value_at(17 + j, r, rank * cols + c);
      const double bound = (n - 1) * std::ldexp(1.0, -24) * n;  // |x| < 1
      EXPECT_LE(std::fabs(a(r, c) - exact), bound) << "ring at " << r << ", " << c;
      EXPECT_LE(std::fabs(a(r, c) - b(r, c)), 2 * bound) << "ring vs library at " << r << ", " << c;
    }
  }
}

// A choice by size: below the threshold the library runs, from it on the ring (the ring's
// scratch grows only when it runs).
TEST(Ring, ThresholdPicksTheAlgorithmBySize) {
  if (world_size() < 2) GTEST_SKIP() << "one rank never reduces";
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  ReductionChoice choice;
  choice.all_reduce_ring_from = 4096;  // bytes
  comm.set_reduction_choice(choice);
  int64_t allocations = 0;
  static int64_t* counter = nullptr;
  counter = &allocations;
  Kokkos::Tools::Experimental::set_allocate_data_callback(
      [](const Kokkos::Profiling::SpaceHandle, const char* label, const void*, const uint64_t) {
        if (std::string(label) == "meshtrain::ring_partial_sums") ++*counter;
      });
  DeviceVector small("small", 1023), large("large", 1024);
  comm.all_reduce(small);
  EXPECT_EQ(allocations, 0) << "1023 floats went through the ring";
  comm.all_reduce(large);
  EXPECT_GT(allocations, 0) << "1024 floats did not go through the ring";
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
}

// ring_from: the smallest measured size from which the ring is faster at every larger one.
TEST(Ring, RingFromIsTheSizeFromWhichTheRingStaysFaster) {
  const std::vector<std::size_t> bytes = {1024, 65536, 1 << 20};
  EXPECT_EQ(ring_from(bytes, {1, 1, 1}, {2, 0.5, 0.5}), 65536u);
  EXPECT_EQ(ring_from(bytes, {1, 1, 1}, {0.5, 2, 0.5}), std::size_t{1} << 20);
  EXPECT_EQ(ring_from(bytes, {1, 1, 1}, {0.5, 0.5, 0.5}), 1024u);
  EXPECT_EQ(ring_from(bytes, {1, 1, 1}, {0.5, 0.5, 2}), ReductionChoice::kNever);
  EXPECT_EQ(describe(ReductionChoice::ring()), "ring");
  EXPECT_EQ(describe(ReductionChoice::library()), "library");
}

// reductions = "measure" times both at start: every rank of the group ends with rank 0's
// choice, and sums still come out right with it. "auto" takes a calibrated link's sizes, else
// the fixed default, without measuring; mpi and ring are fixed.
TEST(Ring, MeasuredChoiceIsAgreedByEveryRank) {
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  const HardwareProfile defaults = default_hardware_profile();
  const ReductionChoice chosen =
      choose_reductions(ReductionAlgorithm::measure, comm, {"dp"}, defaults);
  uint64_t mine[2] = {chosen.reduce_scatter_ring_from, chosen.all_reduce_ring_from};
  uint64_t low[2], high[2];
  MPI_Allreduce(mine, low, 2, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(mine, high, 2, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(low[0], high[0]);
  EXPECT_EQ(low[1], high[1]);
  if (world_size() == 1) EXPECT_EQ(chosen, ReductionChoice::library());
  comm.set_reduction_choice(chosen);
  DeviceVector data = to_device(std::vector<float>(300000, 1.0f));
  comm.all_reduce(data);
  for (float v : to_vector(data)) ASSERT_EQ(v, static_cast<float>(world_size()));

  HardwareProfile calibrated = defaults;
  calibrated.links["dp"].ring_reduce_scatter_bandwidth = 1e9;
  calibrated.links["dp"].ring_all_reduce_bandwidth = 1e9;
  calibrated.links["dp"].ring_reduce_scatter_from = 4096;
  const ReductionChoice from_file =
      choose_reductions(ReductionAlgorithm::automatic, comm, {"dp"}, calibrated);
  EXPECT_EQ(from_file.reduce_scatter_ring_from, 4096u);
  EXPECT_EQ(from_file.all_reduce_ring_from, ReductionChoice::kNever);
  const ReductionChoice fixed =
      choose_reductions(ReductionAlgorithm::automatic, comm, {"dp"}, defaults);
  EXPECT_EQ(fixed.reduce_scatter_ring_from, kDefaultRingFrom);
  EXPECT_EQ(fixed.all_reduce_ring_from, kDefaultRingFrom);
  EXPECT_EQ(choose_reductions(ReductionAlgorithm::ring, comm, {"dp"}, defaults),
            ReductionChoice::ring());
  EXPECT_EQ(choose_reductions(ReductionAlgorithm::mpi, comm, {"dp"}, calibrated),
            ReductionChoice::library());
}

int64_t g_allocations = 0;
void count_allocation(const Kokkos::Profiling::SpaceHandle, const char*, const void*,
                      const uint64_t) {
  ++g_allocations;
}

TEST(Ring, RepeatedCallsAllocateNothing) {
  const int n = world_size();
  const std::size_t count = 2 * kSeveralSegments;
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (fsdp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  const DeviceVector send = to_device(input_of(world_rank(), count * n, 1));
  DeviceVector recv("recv", count), data("data", count * n);
  comm.reserve_wire(count * n, count * n);
  for (int pass = 0; pass < 3; ++pass) {
    if (pass == 1) {
      g_allocations = 0;
      Kokkos::Tools::Experimental::set_allocate_data_callback(count_allocation);
    }
    comm.reduce_scatter(send, recv);
    comm.reduce_scatter(send, recv, Dtype::bf16);
    comm.all_reduce(data);
    comm.all_reduce(data, ReduceOp::sum, Dtype::fp16);
  }
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  EXPECT_EQ(g_allocations, 0) << "Kokkos allocations in repeated ring reductions";
}

// A rank that never joins: the others fail with the MPI path's error naming the operation and
// the group, and refuse further work. The absent rank then joins a barrier only; what the
// others abandoned (receives from it into the ring's scratch) their communicators keep.
TEST(Ring, TimeoutNamesTheOperationWhenARankDoesNotJoin) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const int rank = world_rank(), n = world_size();
  for (bool scatter : {true, false}) {
    SCOPED_TRACE(scatter ? "reduce_scatter" : "all_reduce");
    auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (fsdp)");
    comm.set_reduction_choice(ReductionChoice::ring());
    DeviceVector send("send", 4 * n), recv("recv", 4);
    if (rank != 1) {
      comm.set_timeout_seconds(1.0);
      const char* op = scatter ? "reduce_scatter" : "all_reduce";
      expect_error(
          [&] {
            if (scatter) {
              comm.reduce_scatter(send, recv);
            } else {
              comm.all_reduce(send);
            }
          },
          ErrorKind::runtime,
          {std::string(op) + " on axis (fsdp) did not complete within 1 s", "a rank did not join"});
      expect_error([&] { comm.all_reduce(send); }, ErrorKind::runtime, {"all_reduce", "unusable"});
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// ---------------------------------------------------------------- started ring all-reduce
// start_all_reduce where the reduction choice picks the ring (DP gradient buckets under
// overlap): the same bits as the blocking ring all-reduce (the same blocks, hops and
// summation order), checked as above; several in flight on one communicator, waited for in
// any order (each rank its own); with the communication thread, progress while the starter
// computes; a rank that never starts times out; reserved at build, nothing allocated.

// Checks `got` (an all-reduce of every rank's `inputs`) element by element against the ring
// order bit for bit and the float64 bound.
void expect_ring_all_reduce(const std::vector<std::vector<float>>& inputs,
                            const std::vector<float>& got, Dtype wire) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t count = got.size();
  const std::size_t base = count / n, extra = count % n;
  std::size_t k = 0;
  for (int b = 0; b < n; ++b) {
    const std::size_t length = base + (static_cast<std::size_t>(b) < extra ? 1 : 0);
    for (std::size_t e = 0; e < length; ++e, ++k) expect_ring_sum(inputs, b, k, got[k], wire);
  }
}

TEST(StartedRing, EqualsTheBlockingRingForAnyCount) {
  const int n = world_size(), rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  const std::size_t uneven = 2 * static_cast<std::size_t>(n) + 1;
  for (Dtype wire : {Dtype::fp32, Dtype::bf16}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, uneven, 2 * kSeveralSegments + 1}) {
      SCOPED_TRACE(std::string(wire_name(wire)) + " count " + std::to_string(count));
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, count, count + 5));
      DeviceVector started = to_device(inputs[rank]);
      Request request = comm.start_all_reduce(started, wire);
      request.wait();
      EXPECT_FALSE(request.pending());
      const std::vector<float> got = to_vector(started);
      expect_ring_all_reduce(inputs, got, wire);
      DeviceVector blocking = to_device(inputs[rank]);
      comm.all_reduce(blocking, ReduceOp::sum, wire);
      EXPECT_EQ(bits_hash(to_vector(blocking)), bits_hash(got))
          << "the started ring differs from the blocking one";
      EXPECT_TRUE(same_on_every_rank(bits_hash(got))) << "ranks hold different bits";
    }
  }
}

// Started ring all-reduces number their tags modulo 1024 (kStartedRingTags in
// mpi_communicator.cpp). Operations whose tags would meet are never refused: the start that
// needs a tag still held by an unfinished operation completes that one first, on every rank
// alike. Each case runs well inside the communicator's timeout (set to 60 s: a rank left
// waiting for the others would fail by it, not hang).
constexpr int kRingTags = 1024;

// One operation left pending while 1023 more start and complete: the 1024th start takes its
// tag. It and the pending one both sum right, on every rank.
TEST(StartedRing, ATagStillHeldIsTakenOnceItsOperationCompletes) {
  const int n = world_size(), rank = world_rank();
  if (n == 1) GTEST_SKIP() << "one rank runs no ring";
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  comm.set_timeout_seconds(60.0);
  const std::size_t count = 2 * static_cast<std::size_t>(n) + 1;
  std::vector<std::vector<float>> first, reused;
  for (int r = 0; r < n; ++r) {
    first.push_back(input_of(r, count, 7));
    reused.push_back(input_of(r, count, 11));
  }
  DeviceVector pending_data = to_device(first[rank]);
  Request pending = comm.start_all_reduce(pending_data);
  DeviceVector zeros = to_device(std::vector<float>(count, 0.0f));  // sums stay zero
  for (int k = 1; k < kRingTags; ++k) comm.start_all_reduce(zeros).wait();
  DeviceVector reused_data = to_device(reused[rank]);
  std::string error;
  try {
    comm.start_all_reduce(reused_data).wait();  // the pending one's tag
    pending.wait();
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "");
  EXPECT_TRUE(same_on_every_rank(error.empty() ? 0u : 1u));
  if (!error.empty()) return;
  expect_ring_all_reduce(first, to_vector(pending_data), Dtype::fp32);
  expect_ring_all_reduce(reused, to_vector(reused_data), Dtype::fp32);
}

// The case of issue 36: rank 0 polls the first operation with test() until it completes
// (released there, as DP gradient buckets poll theirs), the other ranks leave it pending, and
// 1023 more start and complete. At the 1024th start the ranks hold the tag differently; they
// must still agree: every rank starts it and it completes (it used to throw on the ranks that
// still held the tag while rank 0 waited for them until the timeout).
TEST(StartedRing, RanksThatReleasedATagAtDifferentTimesAgree) {
  const int n = world_size(), rank = world_rank();
  if (n == 1) GTEST_SKIP() << "one rank runs no ring";
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  comm.set_timeout_seconds(60.0);
  const std::size_t count = 2 * static_cast<std::size_t>(n) + 1;
  std::vector<std::vector<float>> first, reused;
  for (int r = 0; r < n; ++r) {
    first.push_back(input_of(r, count, 17));
    reused.push_back(input_of(r, count, 19));
  }
  const auto began = std::chrono::steady_clock::now();
  DeviceVector first_data = to_device(first[rank]);
  Request held = comm.start_all_reduce(first_data);
  if (rank == 0) {
    while (!held.test()) std::this_thread::yield();  // released here, pending elsewhere
  }
  DeviceVector zeros = to_device(std::vector<float>(count, 0.0f));
  for (int k = 1; k < kRingTags; ++k) comm.start_all_reduce(zeros).wait();
  DeviceVector reused_data = to_device(reused[rank]);
  std::string error;
  try {
    comm.start_all_reduce(reused_data).wait();
    held.wait();
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  EXPECT_EQ(error, "");
  EXPECT_TRUE(same_on_every_rank(error.empty() ? 0u : 1u));
  EXPECT_LT(seconds, 50.0) << "a rank waited for the timeout";
  if (!error.empty()) return;
  expect_ring_all_reduce(first, to_vector(first_data), Dtype::fp32);
  expect_ring_all_reduce(reused, to_vector(reused_data), Dtype::fp32);
  EXPECT_TRUE(same_on_every_rank(bits_hash(to_vector(reused_data))));
}

// More operations in flight at once than there are tags (1024 + 8, each a few elements: the
// last 8 take the tags of the first 8), then waited for in reverse: every one sums right. Also
// with the communication thread running, which holds the started operations the starts must
// take back (where MPI offers MPI_THREAD_MULTIPLE).
TEST(StartedRing, MoreInFlightThanTags) {
  const int n = world_size(), rank = world_rank();
  if (n == 1) GTEST_SKIP() << "one rank runs no ring";
  int provided = 0;
  MPI_Query_thread(&provided);
  for (bool thread : {false, true}) {
    if (thread && provided < MPI_THREAD_MULTIPLE) continue;
    SCOPED_TRACE(thread ? "with the communication thread" : "without a communication thread");
    std::optional<CommThreadLease> lease;
    if (thread) lease.emplace();
    auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
    comm.set_reduction_choice(ReductionChoice::ring());
    comm.set_timeout_seconds(60.0);
    const std::size_t count = 2 * static_cast<std::size_t>(n) + 1;
    const int operations = kRingTags + 8;
    std::vector<std::vector<std::vector<float>>> inputs(operations);
    std::vector<DeviceVector> data;
    std::vector<Request> requests;
    std::string error;
    try {
      for (int op = 0; op < operations; ++op) {
        for (int r = 0; r < n; ++r) inputs[op].push_back(input_of(r, count, 100 + op));
        data.push_back(to_device(inputs[op][rank]));
        requests.push_back(comm.start_all_reduce(data.back()));
      }
      for (int op = operations - 1; op >= 0; --op) requests[op].wait();
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_EQ(error, "");
    EXPECT_TRUE(same_on_every_rank(error.empty() ? 0u : 1u));
    if (!error.empty()) return;
    for (int op : {0, 1, 7, 8, kRingTags - 1, kRingTags, kRingTags + 1, operations - 1}) {
      SCOPED_TRACE("operation " + std::to_string(op));
      expect_ring_all_reduce(inputs[op], to_vector(data[op]), Dtype::fp32);
    }
  }
}

// Three in flight at once (sizes of several segments, one of a few elements, one not
// divisible), completed in start order, in reverse, and each rank in its own order (even ranks
// forward, odd ranks backward: a wait advances the others too, so neither order stalls);
// also by polling test() alone.
TEST(StartedRing, SeveralInFlightCompleteInAnyOrder) {
  const int n = world_size(), rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  const std::size_t counts[3] = {kSeveralSegments, 3, 1000 * static_cast<std::size_t>(n) + 1};
  for (const char* order : {"forward", "backward", "by rank", "by test"}) {
    for (Dtype wire : {Dtype::fp32, Dtype::bf16}) {
      SCOPED_TRACE(std::string(order) + " " + wire_name(wire));
      std::vector<std::vector<std::vector<float>>> inputs(3);
      std::vector<DeviceVector> data;
      std::vector<Request> requests;
      for (int op = 0; op < 3; ++op) {
        for (int r = 0; r < n; ++r) inputs[op].push_back(input_of(r, counts[op], 40 + op));
        data.push_back(to_device(inputs[op][rank]));
      }
      for (int op = 0; op < 3; ++op) requests.push_back(comm.start_all_reduce(data[op], wire));
      const bool backward =
          std::string(order) == "backward" || (std::string(order) == "by rank" && rank % 2 == 1);
      if (std::string(order) == "by test") {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        bool all = false;
        while (!all && std::chrono::steady_clock::now() < deadline) {
          all = true;
          for (int op = 2; op >= 0; --op) all = requests[op].test() && all;
        }
        ASSERT_TRUE(all) << "test() alone did not complete them within 30 s";
      } else {
        for (int k = 0; k < 3; ++k) requests[backward ? 2 - k : k].wait();
      }
      for (int op = 0; op < 3; ++op) {
        SCOPED_TRACE("operation " + std::to_string(op));
        const std::vector<float> got = to_vector(data[op]);
        expect_ring_all_reduce(inputs[op], got, wire);
        EXPECT_TRUE(same_on_every_rank(bits_hash(got)));
      }
    }
  }
}

// A started ring and the started library all-reduce of the same communicator (sizes on both
// sides of all_reduce_ring_from) in flight together, with a blocking ring all-reduce between
// the start and the wait: all three right.
TEST(StartedRing, MixesWithTheLibraryAndTheBlockingRing) {
  const int n = world_size(), rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  ReductionChoice choice;
  choice.all_reduce_ring_from = 4096;  // bytes
  comm.set_reduction_choice(choice);
  std::vector<std::vector<float>> big, small, middle;
  for (int r = 0; r < n; ++r) {
    big.push_back(input_of(r, 70001, 61));
    small.push_back(input_of(r, 100, 62));
    middle.push_back(input_of(r, 5000, 63));
  }
  DeviceVector a = to_device(big[rank]), b = to_device(small[rank]), c = to_device(middle[rank]);
  Request ring = comm.start_all_reduce(a);
  Request library = comm.start_all_reduce(b);
  comm.all_reduce(c);
  library.wait();
  ring.wait();
  expect_ring_all_reduce(big, to_vector(a), Dtype::fp32);
  expect_ring_all_reduce(middle, to_vector(c), Dtype::fp32);
  const std::vector<float> got = to_vector(b);
  for (std::size_t k = 0; k < got.size(); ++k) {
    double exact = 0.0, magnitude = 0.0;
    for (int r = 0; r < n; ++r) {
      exact += small[r][k];
      magnitude += std::fabs(small[r][k]);
    }
    ASSERT_LE(std::fabs(got[k] - exact), n * std::ldexp(1.0, -24) * magnitude) << k;
  }
}

int64_t g_ring_partials = 0;
void count_ring_partials(const Kokkos::Profiling::SpaceHandle, const char* label, const void*,
                         const uint64_t) {
  ++g_allocations;
  if (std::string(label) == "meshtrain::started_ring_partial_sums") ++g_ring_partials;
}

// reserve_started_all_reduces makes the started ring's buffers where the ring will run (the
// library's request slots where it will not), so that started all-reduces up to that size,
// as many in flight as reserved, allocate nothing, whichever order they complete in.
TEST(StartedRing, ReservedAtBuildAllocatesNothingWhenStarted) {
  const int n = world_size();
  g_allocations = g_ring_partials = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_ring_partials);
  auto library = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  library.reserve_started_all_reduces(2, kSeveralSegments);
  EXPECT_EQ(g_ring_partials, 0) << "the library's choice reserved ring buffers";
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  comm.reserve_started_all_reduces(2, kSeveralSegments);
  comm.reserve_started_all_reduces(1, kSeveralSegments / 3, Dtype::bf16);
  if (n > 1) EXPECT_GT(g_ring_partials, 0) << "the ring's buffers were not reserved";
  // Without a reservation the first started all-reduce makes them: the ring runs.
  auto unreserved = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  unreserved.set_reduction_choice(ReductionChoice::ring());
  g_ring_partials = 0;
  DeviceVector w("w", 3 * static_cast<std::size_t>(n));
  unreserved.start_all_reduce(w).wait();
  if (n > 1) EXPECT_GT(g_ring_partials, 0) << "start_all_reduce did not run the ring";
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  DeviceVector x = to_device(input_of(world_rank(), kSeveralSegments, 71));
  DeviceVector y = to_device(input_of(world_rank(), kSeveralSegments - 9, 72));
  DeviceVector z = to_device(input_of(world_rank(), kSeveralSegments / 3, 73));
  g_allocations = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_ring_partials);
  for (int pass = 0; pass < 3; ++pass) {
    Request first = comm.start_all_reduce(x);
    Request second = comm.start_all_reduce(y);
    Request third = comm.start_all_reduce(z, Dtype::bf16);
    if (pass % 2 == 0) {
      third.wait();
      second.wait();
      first.wait();
    } else {
      first.wait();
      second.wait();
      third.wait();
    }
  }
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  EXPECT_EQ(g_allocations, 0) << "Kokkos allocations in started ring all-reduces";
}

// The proof of progress, as tests/comm/comm_thread_test.cpp's for the library: rank 0 starts a
// ring all-reduce of 4 MiB per rank and computes without any MPI call until every other rank
// has signalled (through a file) that its wait returned. The ring's segments are added and its
// steps posted by software, so the others' waits return only if rank 0's communication thread
// runs the ring. Rank 0 gives up after 30 s (then fails), so the test cannot hang.
TEST(StartedRing, MovesOnTheCommunicationThreadWhileTheStarterComputes) {
  if (world_size() < 2) GTEST_SKIP() << "one rank does not communicate";
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) GTEST_SKIP() << "MPI lacks MPI_THREAD_MULTIPLE";
  CommThreadLease lease;
  ASSERT_NE(running_comm_progress(), nullptr);
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
  comm.set_reduction_choice(ReductionChoice::ring());
  comm.set_timeout_seconds(120.0);
  const int n = world_size(), rank = world_rank();
  const TempDir tmp(/*shared=*/true, "meshtrain_started_ring");
  const std::string& dir = tmp.path();
  const std::size_t count = std::size_t{1} << 20;
  for (Dtype wire : {Dtype::fp32, Dtype::bf16}) {
    SCOPED_TRACE(wire_name(wire));
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, count, 81));
    DeviceVector data = to_device(inputs[rank]);
    const std::string name = wire_name(wire);
    MPI_Barrier(MPI_COMM_WORLD);
    Request request = comm.start_all_reduce(data, wire);
    if (rank != 0) {
      request.wait();
      mark_wait_returned(dir, name, rank);
    } else {
      const bool all_done = compute_until_every_wait_returned(dir, name, n);
      EXPECT_TRUE(all_done)
          << "the other ranks' started ring all-reduce did not complete while rank 0 computed";
      request.wait();
    }
    const std::vector<float> got = to_vector(data);
    expect_ring_all_reduce(inputs, got, wire);
    DeviceVector blocking = to_device(inputs[rank]);
    comm.all_reduce(blocking, ReduceOp::sum, wire);
    EXPECT_EQ(bits_hash(to_vector(blocking)), bits_hash(got));
  }
}

// A rank that never starts the operation: the others' wait throws the MPI path's timeout
// error within the bound, the communicator refuses further work, and nothing is left with the
// communication thread. With and without the thread.
TEST(StartedRing, ARankThatNeverStartsTimesOut) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  int provided = 0;
  MPI_Query_thread(&provided);
  const int rank = world_rank();
  for (bool with_thread : {false, true}) {
    if (with_thread && provided < MPI_THREAD_MULTIPLE) continue;
    SCOPED_TRACE(with_thread ? "with the communication thread" : "without");
    std::optional<CommThreadLease> lease;
    if (with_thread) lease.emplace();
    auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (dp)");
    comm.set_reduction_choice(ReductionChoice::ring());
    // Small (eager) messages: nothing the absent rank never receives is left pending a
    // rendezvous at the end of the program.
    DeviceVector data("data", 64 * static_cast<std::size_t>(world_size()) + 1);
    if (rank != 1) {
      comm.set_timeout_seconds(0.5);
      const auto start = std::chrono::steady_clock::now();
      expect_error(
          [&] { comm.start_all_reduce(data).wait(); }, ErrorKind::runtime,
          {"all_reduce on axis (dp) did not complete within 0.5 s", "a rank did not join"});
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(took, 10.0) << "the timeout took " << took << " s";
      expect_error([&] { comm.start_all_reduce(data); }, ErrorKind::runtime, {"unusable"});
      EXPECT_EQ(comm_progress().queued_count(), 0u);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

}  // namespace
}  // namespace meshtrain::testing
