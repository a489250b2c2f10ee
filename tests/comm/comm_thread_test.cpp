// The communication thread (framework/comm/progress_thread.hpp, [runtime] comm_thread):
// started all-gathers, all-reduces and shifts give the values a reference gives while it runs;
// they move while the rank that started them computes without calling MPI (the proof of
// progress below); a rank that never joins times out with the same Error as without the
// thread; and the generic progress queue hands tasks over and back.

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/comm/runtime.hpp"
#include "tests/support/communicator_cases.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {
namespace {

using HostVector = Kokkos::View<float*, Kokkos::HostSpace>;

Kokkos::View<float*> filled(const char* label, std::size_t n, uint64_t seed) {
  HostVector host("host", n);
  for (std::size_t k = 0; k < n; ++k) host(k) = value_at(seed, k, 0);
  Kokkos::View<float*> v(std::string(label), n);
  Kokkos::deep_copy(v, host);
  return v;
}

HostVector host_copy(const Kokkos::View<float*>& v) {
  HostVector host("host", v.extent(0));
  Kokkos::deep_copy(host, v);
  return host;
}

// A counting task: done after `steps` steps.
class CountingTask final : public ProgressTask {
 public:
  explicit CountingTask(int steps) : left_(steps) {}
  bool step() noexcept override {
    ++stepped_;
    return --left_ <= 0;
  }
  int stepped_ = 0;  // read by the test only after finished() or a reclaim

 private:
  int left_;
};

TEST(ProgressThread, StepsTasksUntilDoneAndHandsThemBack) {
  ProgressThread thread;
  thread.start();
  CountingTask quick(3), never(1 << 30);
  thread.submit(quick);
  thread.submit(never);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!quick.finished() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ASSERT_TRUE(quick.finished());
  EXPECT_EQ(quick.stepped_, 3);         // never stepped again once done
  EXPECT_FALSE(thread.reclaim(quick));  // already finished: nothing to take back
  EXPECT_TRUE(thread.reclaim(never));   // still pending: taken back
  const int stepped = never.stepped_;   // the thread no longer touches it
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(never.stepped_, stepped);
  EXPECT_FALSE(never.finished());
  EXPECT_EQ(thread.queued_count(), 0u);
  // Stopped with a task queued: the task stays queued, untouched, and can be taken back.
  CountingTask late(1 << 30);
  thread.submit(late);
  thread.stop();
  const int late_steps = late.stepped_;
  EXPECT_EQ(thread.queued_count(), 1u);
  EXPECT_TRUE(thread.reclaim(late));
  EXPECT_EQ(late.stepped_, late_steps);
}

// The hand-off under stress, as the MPI backend uses it: tasks write their data in step() on
// the thread; the submitter reads it after finished() (as test() does) or after taking the
// task back and finishing it itself (as wait() does). Every task's data must then hold exactly
// its steps. Also built with -fsanitize=thread by hand (docs/testing.md): no report.
class StressTask final : public ProgressTask {
 public:
  bool step() noexcept override {
    for (int& d : data) ++d;
    return --left <= 0;
  }
  int left = 0;
  int data[32] = {};
};

TEST(ProgressThread, HandsDataOverWithoutRaces) {
  ProgressThread thread;
  thread.start();
  std::vector<StressTask> tasks(16);
  for (int round = 0; round < 300; ++round) {
    for (std::size_t k = 0; k < tasks.size(); ++k) {
      tasks[k].left = 1 + static_cast<int>((round + k) % 5);
      for (int& d : tasks[k].data) d = 0;
      thread.submit(tasks[k]);
    }
    for (std::size_t k = 0; k < tasks.size(); ++k) {
      StressTask& task = tasks[k];
      const int steps = 1 + static_cast<int>((round + k) % 5);
      if (k % 2 == 0) {
        if (thread.reclaim(task)) {
          while (!task.step()) {
          }
        }
      } else {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!task.finished() && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::yield();
        }
        ASSERT_TRUE(task.finished());
      }
      for (int d : task.data) ASSERT_EQ(d, steps) << "round " << round << ", task " << k;
    }
  }
  thread.stop();
}

// All three started operations, several in flight at once, against references built from
// every rank's seeded data: all-gather and shift exactly; the all-reduce within the rounding
// of n float additions (relative 1e-6 of the sum of absolute values, n <= 8).
void check_started_operations(Communicator& comm, std::size_t n) {
  const int size = comm.size(), rank = comm.rank();
  auto send = filled("send", n, 100 + rank);
  Kokkos::View<float*> gathered("gathered", n * size);
  auto reduced = filled("reduced", n, 200 + rank);
  auto shift_send = filled("shift_send", n, 300 + rank);
  Kokkos::View<float*> shifted("shifted", n);
  Request gather = comm.start_all_gather(send, gathered);
  Request reduce = comm.start_all_reduce(reduced);
  Request shift = comm.shift(ConstVectorView(shift_send), VectorView(shifted), 1);
  shift.wait();
  reduce.wait();
  gather.wait();
  const HostVector g = host_copy(gathered), r = host_copy(reduced), s = host_copy(shifted);
  const int from = (rank - 1 + size) % size;
  for (std::size_t k = 0; k < n; ++k) {
    double sum = 0.0, magnitude = 0.0;
    for (int j = 0; j < size; ++j) {
      ASSERT_EQ(g(j * n + k), value_at(100 + j, k, 0)) << "gathered element " << j * n + k;
      sum += value_at(200 + j, k, 0);
      magnitude += std::fabs(value_at(200 + j, k, 0));
    }
    ASSERT_NEAR(r(k), sum, 1e-6 * magnitude + 1e-30) << "reduced element " << k;
    ASSERT_EQ(s(k), value_at(300 + from, k, 0)) << "shifted element " << k;
  }
}

TEST(CommThread, StartedOperationsMatchTheReference) {
  CommThreadLease lease;
  ASSERT_NE(running_comm_progress(), nullptr);
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 18}) {
    SCOPED_TRACE("elements per rank " + std::to_string(n));
    check_started_operations(comm, n);
  }
  // test() on this thread makes no MPI call while the thread runs; polling it completes.
  auto data = filled("data", 4096, 7 + comm.rank());
  Request r = comm.start_all_reduce(data);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!r.test() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_FALSE(r.pending());
}

// The proof of progress. Rank 0 starts an operation, then computes without any MPI call
// until every other rank has signalled (through a file: no MPI) that its own wait for the
// same operation returned. Those waits need rank 0's side to move (its large messages go by
// rendezvous, which the sender's or receiver's MPI progress must drive), so they return only
// if rank 0's communication thread drives it. Rank 0 gives up after 30 s (then fails) and
// waits, so the test cannot hang; with the thread off it fails this way (checked by hand:
// MESHTRAIN_TEST_COMM_THREAD=0).
TEST(CommThread, StartedOperationsMoveWhileTheStarterComputes) {
  const char* env = std::getenv("MESHTRAIN_TEST_COMM_THREAD");
  const bool with_thread = env == nullptr || std::string(env) != "0";
  std::optional<CommThreadLease> lease;
  if (with_thread) lease.emplace();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
  comm.set_timeout_seconds(120.0);
  const int size = comm.size(), rank = comm.rank();
  const TempDir tmp(/*shared=*/true, "meshtrain_comm_thread");
  const std::string& dir = tmp.path();
  const std::size_t n = std::size_t{1} << 20;  // 4 MiB per rank: rendezvous, not eager
  for (const char* op : {"all_gather", "all_reduce", "shift"}) {
    SCOPED_TRACE(op);
    auto send = filled("send", n, 11 + rank);
    Kokkos::View<float*> recv("recv", std::string(op) == "all_gather" ? n * size : n);
    auto start = [&]() -> Request {
      if (std::string(op) == "all_gather") return comm.start_all_gather(send, recv);
      if (std::string(op) == "all_reduce") return comm.start_all_reduce(send);
      return comm.shift(ConstVectorView(send), VectorView(recv), 1);
    };
    MPI_Barrier(MPI_COMM_WORLD);
    Request request = start();
    if (rank != 0) {
      request.wait();
      mark_wait_returned(dir, op, rank);
    } else {
      // Compute, no MPI, until every peer's wait has returned (or 30 s).
      const bool all_done = compute_until_every_wait_returned(dir, op, size);
      EXPECT_TRUE(all_done) << "the other ranks' " << op
                            << " did not complete while rank 0 computed without MPI calls";
      request.wait();
    }
    // Values: the same references as above.
    const HostVector out = host_copy(std::string(op) == "all_reduce" ? send : recv);
    for (std::size_t k = 0; k < n; k += 997) {
      if (std::string(op) == "all_gather") {
        for (int j = 0; j < size; ++j) ASSERT_EQ(out(j * n + k), value_at(11 + j, k, 0));
      } else if (std::string(op) == "shift") {
        ASSERT_EQ(out(k), value_at(11 + (rank - 1 + size) % size, k, 0));
      } else {
        double sum = 0.0, magnitude = 0.0;
        for (int j = 0; j < size; ++j) {
          sum += value_at(11 + j, k, 0);
          magnitude += std::fabs(value_at(11 + j, k, 0));
        }
        ASSERT_NEAR(out(k), sum, 1e-6 * magnitude + 1e-30);
      }
    }
  }
}

// A started operation a rank never joins: the same Error as without the thread (wait takes
// the requests back from the thread first, then times out as before), the communicator is
// refused afterwards, and nothing is touched after the wait gave up (the late rank's data
// lands in buffers kept alive here; the test ends without a crash at exit).
TEST(CommThread, ARankThatNeverJoinsTimesOutWithTheSameError) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  CommThreadLease lease;
  const int rank = world_rank();
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "axis (fsdp)");
  Kokkos::View<float*> send("send", 4096), recv("recv", 4096 * world_size());
  if (rank != 1) {
    comm.set_timeout_seconds(1.0);
    expect_error([&] { comm.start_all_gather(send, recv).wait(); }, ErrorKind::runtime,
                 {"all_gather on axis (fsdp) did not complete within 1 s", "a rank did not join"});
    expect_error([&] { comm.start_all_reduce(send).wait(); }, ErrorKind::runtime, {"unusable"});
    EXPECT_EQ(comm_progress().queued_count(), 0u);  // nothing left with the thread
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1) {
    comm.set_timeout_seconds(60.0);
    comm.start_all_gather(send, recv).wait();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// comm_thread = true where MPI lacks MPI_THREAD_MULTIPLE is bad input naming the key; false
// is off; auto is off without overlap or on one rank.
TEST(CommThread, WhenItRuns) {
  std::string note;
  EXPECT_FALSE(want_comm_thread(CommThreadChoice::off, true, MPI_COMM_WORLD, "k", note));
  EXPECT_FALSE(want_comm_thread(CommThreadChoice::automatic, false, MPI_COMM_WORLD, "k", note));
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided >= MPI_THREAD_MULTIPLE) {
    EXPECT_TRUE(want_comm_thread(CommThreadChoice::on, false, MPI_COMM_WORLD, "k", note));
  } else {
    expect_bad_input(
        [&] {
          want_comm_thread(CommThreadChoice::on, false, MPI_COMM_WORLD,
                           "run.toml: runtime.comm_thread", note);
        },
        {"runtime.comm_thread", "MPI_THREAD_MULTIPLE"});
  }
  if (world_size() == 1) {
    EXPECT_FALSE(want_comm_thread(CommThreadChoice::automatic, true, MPI_COMM_WORLD, "k", note));
  }
  EXPECT_TRUE(note.empty());
}

}  // namespace
}  // namespace meshtrain::testing
