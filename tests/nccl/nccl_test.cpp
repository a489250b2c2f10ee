// The NCCL backend (framework/comm/backends/nccl_communicator.hpp): every operation on device
// buffers against the same operation done by MPI on host copies of the same data; the
// View API; bad input; a timeout that aborts the communicator; the factory on mesh axes.
//
// One GPU per rank: each rank uses device (local rank % device count). Without a CUDA
// device every GPU test is skipped with "no CUDA device: NCCL backend compiled but not
// run" (and the one test that checks the no-device error runs instead); with fewer
// devices than ranks on a node they are skipped too, since NCCL cannot put two ranks of
// one communicator on one GPU, unless NCCL_HOSTID makes each rank a host of its own
// (tests/nccl/share_gpu.sh, as ctest starts these ranks). The decision is reduced over all
// ranks so that no rank enters a collective that another rank skipped.
//
// all_to_all_v and start_all_reduce are compared with the MPI backend on the same Views
// (the View API over NCCL needs a CUDA Kokkos: with a host-only one they skip).
//
// Tolerances: the data are multiples of 1/8 below 16, so gathers, broadcasts, shifts and
// all-to-all are compared exactly and sums of up to 8 ranks are exact in float; the mean
// (ncclAvg) is compared with a relative tolerance of 1e-6.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/backends/nccl_communicator.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "partition/mesh.hpp"
#include "tests/support/communicator_cases.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

constexpr const char* kNoDevice = "no CUDA device: NCCL backend compiled but not run";

// Whether the GPU tests run, decided identically on every rank (collective on first use;
// every rank runs the tests in the same order).
struct GpuPlan {
  bool any_device = false;  // some rank sees a CUDA device
  bool run = false;         // every rank has a GPU of its own
  std::string why;          // the skip message when !run
};

const GpuPlan& gpu_plan() {
  static const GpuPlan plan = [] {
    GpuPlan p;
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      devices = 0;
    }
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_ranks = 1;
    MPI_Comm_size(node, &local_ranks);
    MPI_Comm_free(&node);
    if (std::getenv("NCCL_HOSTID")) local_ranks = 1;  // every rank a host of its own to NCCL
    const int has_device = devices > 0 ? 1 : 0;
    const int has_own_gpu = devices >= local_ranks ? 1 : 0;
    int all_have_device = 0, any_has_device = 0, all_have_own_gpu = 0;
    MPI_Allreduce(&has_device, &all_have_device, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&has_device, &any_has_device, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&has_own_gpu, &all_have_own_gpu, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    p.any_device = any_has_device != 0;
    if (!all_have_device) {
      p.why = kNoDevice;
    } else if (!all_have_own_gpu) {
      p.why = std::to_string(local_ranks) + " ranks on a node but " + std::to_string(devices) +
              " CUDA device(s): NCCL needs one GPU per rank, so the NCCL tests do not run";
    } else {
      select_cuda_device(MPI_COMM_WORLD);
      p.run = true;
    }
    return p;
  }();
  return plan;
}

#define MESHTRAIN_REQUIRE_GPU_PER_RANK()       \
  do {                                         \
    const GpuPlan& plan_ = gpu_plan();         \
    if (!plan_.run) GTEST_SKIP() << plan_.why; \
  } while (0)

// The View operations hand NCCL the Views' pointers: Kokkos' memory must be on the GPU.
constexpr bool kKokkosOnDevice =
    !std::is_same<Kokkos::DefaultExecutionSpace::memory_space, Kokkos::HostSpace>::value;
constexpr const char* kKokkosOnHost =
    "host-only Kokkos: the View operations over NCCL need CUDA memory "
    "(ViewApiNeedsDeviceMemory checks the error)";

void cuda_ok(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(code));
  }
}

// A device array of floats with host copies in and out.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(float)), "cudaMalloc");
    cuda_ok(cudaMemset(data_, 0, count * sizeof(float)), "cudaMemset");
  }
  explicit DeviceBuffer(const std::vector<float>& host) : DeviceBuffer(host.size()) {
    upload(host);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  float* get() { return data_; }
  void upload(const std::vector<float>& host) {
    ASSERT_EQ(host.size(), count_);
    cuda_ok(cudaMemcpy(data_, host.data(), count_ * sizeof(float), cudaMemcpyHostToDevice),
            "cudaMemcpy to the device");
  }
  std::vector<float> download() const {
    std::vector<float> host(count_);
    cuda_ok(cudaMemcpy(host.data(), data_, count_ * sizeof(float), cudaMemcpyDeviceToHost),
            "cudaMemcpy from the device");
    return host;
  }

 private:
  float* data_ = nullptr;
  std::size_t count_ = 0;
};

// count floats of rank `rank`, multiples of 1/8 in [0, 12): exact in sums of a few ranks.
std::vector<float> rank_data(int rank, std::size_t count, int salt = 0) {
  std::vector<float> v(count);
  for (std::size_t k = 0; k < count; ++k) {
    v[k] = static_cast<float>((static_cast<std::size_t>(rank + 1) * 37 + k * 11 +
                               static_cast<std::size_t>(salt) * 5) %
                              96) /
           8.0f;
  }
  return v;
}

NcclCommunicator world_nccl() {
  return NcclCommunicator::create(MPI_COMM_WORLD, "world");
}

void expect_equal(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t k = 0; k < got.size(); ++k) {
    ASSERT_EQ(got[k], want[k]) << what << " at element " << k << " on rank " << world_rank();
  }
}

TEST(NcclBackend, WithoutDeviceConstructionIsAClearError) {
  if (gpu_plan().any_device) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(nccl_device_available());
  expect_error([] { select_cuda_device(MPI_COMM_WORLD); }, ErrorKind::runtime,
               {"needs a CUDA device", "cudaGetDeviceCount"});
  MPI_Comm group = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_dup(MPI_COMM_WORLD, &group), MPI_SUCCESS);
  expect_error([group] { make_nccl_communicator(group, "axis (tp)"); }, ErrorKind::runtime,
               {"NCCL communicator of axis (tp)", "needs a CUDA device", "cudaGetDeviceCount"});
  // A factory owns the group only when it succeeds.
  MPI_Comm_free(&group);
}

TEST(NcclBackend, AllGatherMatchesMpi) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  const int n = comm.size();
  for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
    const std::vector<float> mine = rank_data(comm.rank(), count);
    std::vector<float> want(count * static_cast<std::size_t>(n));
    MPI_Allgather(mine.data(), static_cast<int>(count), MPI_FLOAT, want.data(),
                  static_cast<int>(count), MPI_FLOAT, MPI_COMM_WORLD);
    DeviceBuffer send(mine), recv(want.size());
    comm.all_gather_device(send.get(), recv.get(), count);
    expect_equal(recv.download(), want, "all_gather of " + std::to_string(count));
  }
}

TEST(NcclBackend, ReduceScatterMatchesMpi) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  const std::size_t n = static_cast<std::size_t>(comm.size());
  for (std::size_t count : {std::size_t{1}, std::size_t{5}, std::size_t{999}}) {
    const std::vector<float> mine = rank_data(comm.rank(), n * count, 1);
    std::vector<float> want(count);
    MPI_Reduce_scatter_block(mine.data(), want.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                             MPI_COMM_WORLD);
    DeviceBuffer send(mine), recv(count);
    comm.reduce_scatter_device(send.get(), recv.get(), count);
    expect_equal(recv.download(), want, "reduce_scatter of " + std::to_string(count));
  }
}

TEST(NcclBackend, AllReduceSumAndMeanMatchMpi) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  const std::size_t count = 513;
  const std::vector<float> mine = rank_data(comm.rank(), count, 2);
  std::vector<float> sum(count);
  MPI_Allreduce(mine.data(), sum.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                MPI_COMM_WORLD);
  DeviceBuffer data(mine);
  comm.all_reduce_device(data.get(), count, ReduceOp::sum);
  expect_equal(data.download(), sum, "all_reduce sum");

  data.upload(mine);
  comm.all_reduce_device(data.get(), count, ReduceOp::mean);
  const std::vector<float> mean = data.download();
  for (std::size_t k = 0; k < count; ++k) {
    const double want = static_cast<double>(sum[k]) / comm.size();
    ASSERT_NEAR(mean[k], want, 1e-6 * std::max(1.0, std::fabs(want))) << "all_reduce mean at " << k;
  }
}

TEST(NcclBackend, BroadcastFromEveryRoot) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  const std::size_t count = 77;
  for (int root = 0; root < comm.size(); ++root) {
    std::vector<float> want = rank_data(comm.rank(), count, 3);
    MPI_Bcast(want.data(), static_cast<int>(count), MPI_FLOAT, root, MPI_COMM_WORLD);
    DeviceBuffer data(rank_data(comm.rank(), count, 3));
    comm.broadcast_device(data.get(), count, root);
    expect_equal(data.download(), want, "broadcast from root " + std::to_string(root));
  }
}

TEST(NcclBackend, ShiftEveryOffsetAndTwoInFlight) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  const int n = comm.size(), i = comm.rank();
  const std::size_t count = 301;
  auto reference = [&](int offset) {
    const int k = ((offset % n) + n) % n;
    std::vector<float> mine = rank_data(i, count, 4), got(count);
    MPI_Sendrecv(mine.data(), static_cast<int>(count), MPI_FLOAT, (i + k) % n, 7, got.data(),
                 static_cast<int>(count), MPI_FLOAT, (i - k + n) % n, 7, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    return got;
  };
  DeviceBuffer send(rank_data(i, count, 4)), recv(count), back(count);
  for (int offset : {1, -1, 2, 0, n + 1}) {
    Request request = comm.shift_device(send.get(), recv.get(), count, offset);
    request.wait();
    expect_equal(recv.download(), reference(offset), "shift by " + std::to_string(offset));
  }
  // Two shifts in opposite directions in flight at once (a bidirectional ring step).
  Request forward = comm.shift_device(send.get(), recv.get(), count, 1);
  Request backward = comm.shift_device(send.get(), back.get(), count, -1);
  backward.wait();
  forward.wait();
  expect_equal(recv.download(), reference(1), "forward shift with another in flight");
  expect_equal(back.download(), reference(-1), "backward shift with another in flight");
}

TEST(NcclBackend, AllToAllMatchesMpi) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  const std::size_t n = static_cast<std::size_t>(comm.size()), block = 33;
  const std::vector<float> mine = rank_data(comm.rank(), n * block, 5);
  std::vector<float> want(n * block);
  MPI_Alltoall(mine.data(), static_cast<int>(block), MPI_FLOAT, want.data(),
               static_cast<int>(block), MPI_FLOAT, MPI_COMM_WORLD);
  DeviceBuffer send(mine), recv(n * block);
  comm.all_to_all_device(send.get(), recv.get(), block);
  expect_equal(recv.download(), want, "all_to_all");
  comm.barrier();
}

// all_to_all_v (the MoE layer's token exchange: NCCL grouped send/recv) with a different
// number of rows between every pair of ranks (tests/support/communicator_cases.hpp), in fp32 and on
// 16-bit wires: the rows received equal the MPI backend's from the same send View, and what
// their sender packed (rounded to the wire's type).
TEST(NcclBackend, AllToAllVMatchesMpi) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  if (!kKokkosOnDevice) GTEST_SKIP() << kKokkosOnHost;
  NcclCommunicator nccl = world_nccl();
  MpiCommunicator mpi = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const int n = nccl.size(), me = nccl.rank();
  const std::size_t cols = 5;
  for (int salt = 0; salt <= 4; ++salt) {
    const RaggedRound round = ragged_round(n, me, salt, cols, 0);
    const DeviceMatrix send = to_device(round.send, "send");
    for (const auto& [wire, wire_name] : kWireTypes) {
      const std::string where = std::string("all_to_all_v round ") + std::to_string(salt) + " " +
                                wire_name + " on rank " + std::to_string(me);
      DeviceMatrix over_nccl("over_nccl", round.recv_total, cols);
      DeviceMatrix over_mpi("over_mpi", round.recv_total, cols);
      nccl.all_to_all_v(send, round.send_rows, over_nccl, round.recv_rows, wire);
      mpi.all_to_all_v(send, round.send_rows, over_mpi, round.recv_rows, wire);
      const HostMatrix got = to_host(over_nccl), want = to_host(over_mpi);
      expect_ragged_rows(got, round, me, wire, where);
      for (std::size_t k = 0; k < got.size(); ++k)
        ASSERT_EQ(got.data()[k], want.data()[k]) << "element " << k << " against MPI, " << where;
    }
  }
}

// count floats of rank `rank`, multiples of 1/2 in [0, 8): exact in bf16 and fp16, and so
// are their sums over up to 8 ranks in any order, so every backend and wire gives one result.
std::vector<float> wire_exact_data(int rank, std::size_t count, int salt) {
  std::vector<float> v(count);
  for (std::size_t k = 0; k < count; ++k)
    v[k] = static_cast<float>(
               (static_cast<std::size_t>(rank + 1) * 7 + k * 3 + static_cast<std::size_t>(salt)) %
               16) /
           2.0f;
  return v;
}
Vector device_vector(const std::vector<float>& host) {
  Vector v("device_vector", host.size());
  Kokkos::deep_copy(v, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(
                           host.data(), host.size()));
  return v;
}
std::vector<float> host_vector(const Vector& v) {
  std::vector<float> host(v.extent(0));
  Kokkos::deep_copy(
      Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(host.data(), host.size()),
      v);
  return host;
}

// start_all_reduce (the DP gradient buckets under runtime.overlap): three in flight at once, a
// blocking all-reduce on the same communicator between them, completed out of order, in fp32
// and on 16-bit wires: each equals the MPI backend's started all-reduce of the same data and
// the sum over every rank's data.
TEST(NcclBackend, StartedAllReduceMatchesMpi) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  if (!kKokkosOnDevice) GTEST_SKIP() << kKokkosOnHost;
  NcclCommunicator nccl = world_nccl();
  MpiCommunicator mpi = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  const int n = nccl.size();
  const std::size_t counts[3] = {7, 1, 4099};
  for (const auto& [wire, wire_name] : kWireTypes) {
    Vector over_nccl[3], over_mpi[3];
    Request started[3];
    Vector ones = device_vector(std::vector<float>(4, 1.0f));
    for (int b = 0; b < 3; ++b) {
      over_nccl[b] = device_vector(wire_exact_data(nccl.rank(), counts[b], b));
      over_mpi[b] = device_vector(wire_exact_data(nccl.rank(), counts[b], b));
      started[b] = nccl.start_all_reduce(over_nccl[b], wire);
      if (b == 0) nccl.all_reduce(VectorView(ones));  // a blocking one while it is in flight
    }
    EXPECT_EQ(host_vector(ones)[3], static_cast<float>(n)) << wire_name;
    while (!started[2].test()) {
    }
    EXPECT_FALSE(started[2].pending());
    started[0].wait();
    started[1].wait();
    for (int b = 0; b < 3; ++b) {
      mpi.start_all_reduce(over_mpi[b], wire).wait();
      std::vector<float> sum(counts[b], 0.0f);
      for (int j = 0; j < n; ++j) {
        const std::vector<float> theirs = wire_exact_data(j, counts[b], b);
        for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += theirs[k];
      }
      const std::string what =
          std::string("started all_reduce ") + std::to_string(b) + " " + wire_name;
      expect_equal(host_vector(over_nccl[b]), host_vector(over_mpi[b]), what + " against MPI");
      expect_equal(host_vector(over_nccl[b]), sum, what + " against the sum");
    }
  }
  // An empty buffer completes at once.
  nccl.start_all_reduce(VectorView()).wait();
}

TEST(NcclBackend, ViewApiNeedsDeviceMemory) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  Communicator& base = comm;
  const std::size_t n = static_cast<std::size_t>(comm.size());
  Kokkos::View<float**, Kokkos::LayoutRight> send("send", 2, 3), recv("recv", 2, 3 * n);
  using MemorySpace = Kokkos::DefaultExecutionSpace::memory_space;
  if (std::is_same<MemorySpace, Kokkos::HostSpace>::value) {
    // Host-only Kokkos: a clear error, not a crash inside NCCL.
    expect_bad_input([&] { base.all_gather(send, recv, 1); },
                     {"all_gather on world", "host memory", "needs CUDA device memory"});
    return;
  }
  // Device Kokkos: the dim-1 gather through the scratch buffer.
  auto send_host = Kokkos::create_mirror_view(send);
  for (std::size_t r = 0; r < 2; ++r)
    for (std::size_t c = 0; c < 3; ++c) send_host(r, c) = rank_data(comm.rank(), 6)[r * 3 + c];
  Kokkos::deep_copy(send, send_host);
  base.all_gather(send, recv, 1);
  auto recv_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
  for (std::size_t j = 0; j < n; ++j) {
    const std::vector<float> block = rank_data(static_cast<int>(j), 6);
    for (std::size_t r = 0; r < 2; ++r)
      for (std::size_t c = 0; c < 3; ++c)
        ASSERT_EQ(recv_host(r, j * 3 + c), block[r * 3 + c]) << "View all_gather dim 1";
  }
}

TEST(NcclBackend, BadInputNamesTheProblem) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  NcclCommunicator comm = world_nccl();
  std::vector<float> host(4 * static_cast<std::size_t>(comm.size()));
  DeviceBuffer device(host.size());
  expect_bad_input([&] { comm.all_reduce_device(host.data(), host.size()); },
                   {"all_reduce on world", "data buffer is host memory", "all_reduce_device"});
  expect_bad_input([&] { comm.all_gather_device(host.data(), device.get(), 4); },
                   {"all_gather on world", "send buffer is host memory"});
  expect_bad_input([&] { comm.broadcast_device(device.get(), 4, comm.size()); },
                   {"broadcast on world", "root " + std::to_string(comm.size())});
  expect_bad_input([&] { comm.all_gather_device(device.get(), device.get(), 4); },
                   {"all_gather on world", "overlap"});
  expect_bad_input([&] { comm.all_reduce_device(nullptr, 4); }, {"null pointer"});
  // Nothing was enqueued: the communicator still works.
  DeviceBuffer word(std::vector<float>{1.0f});
  comm.all_reduce_device(word.get(), 1);
  EXPECT_EQ(word.download()[0], static_cast<float>(comm.size()));
}

TEST(NcclBackend, TimeoutAbortsAndNamesTheOperation) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  if (world_size() < 2) GTEST_SKIP() << "a timeout needs a second rank that does not join";
  NcclCommunicator comm = world_nccl();
  comm.set_timeout_seconds(1.0);  // also bounds the other ranks' finalize of the aborted comm
  DeviceBuffer data(std::vector<float>(16, 1.0f));
  if (comm.rank() == 0) {
    expect_error([&] { comm.all_reduce_device(data.get(), 16); }, ErrorKind::runtime,
                 {"all_reduce on world", "did not complete within 1 s"});
    expect_error([&] { comm.all_reduce_device(data.get(), 16); }, ErrorKind::runtime,
                 {"all_reduce on world refused", "unusable"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(NcclBackend, FactoryBuildsMeshAxes) {
  MESHTRAIN_REQUIRE_GPU_PER_RANK();
  const int size = world_size();
  const int tp = size % 2 == 0 ? 2 : 1;
  MeshCommunicators comms(Mesh::create({{"fsdp", -1}, {"tp", tp}}, size, "test mesh"),
                          MPI_COMM_WORLD, make_nccl_communicator);
  for (const std::vector<std::string>& axes :
       {std::vector<std::string>{"tp"}, std::vector<std::string>{"fsdp"},
        std::vector<std::string>{"fsdp", "tp"}}) {
    auto* comm = dynamic_cast<NcclCommunicator*>(&comms.get(axes));
    ASSERT_NE(comm, nullptr) << describe_axes(axes) << " is not an NCCL communicator";
    EXPECT_EQ(comm->description(), describe_axes(axes));
    DeviceBuffer word(std::vector<float>{static_cast<float>(comm->rank() + 1)});
    comm->all_reduce_device(word.get(), 1);
    const int m = comm->size();
    EXPECT_EQ(word.download()[0], static_cast<float>(m * (m + 1) / 2)) << describe_axes(axes);
  }
}

}  // namespace
}  // namespace meshtrain::testing
