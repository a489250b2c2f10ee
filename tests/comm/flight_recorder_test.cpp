// The flight recorder (framework/comm/flight_recorder.hpp): it holds exactly the collectives
// this rank ran (operation, per-group sequence, the operand's bytes in the wire dtype, wire,
// state), wraps after its capacity, writes a file that reads back the same, and SIGUSR1
// writes it while the program goes on. The comparison of records (flight_report.hpp) names
// the ranks behind, those without a record, and those that entered. The fault cases (a rank
// stopped, killed, skipping) are flight_fault_test.sh's.

#include <gtest/gtest.h>
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/flight_recorder.hpp"
#include "framework/comm/flight_report.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using Floats = Kokkos::View<float*, Kokkos::LayoutRight>;

// A directory of this job (every rank of a job has mpirun's process as its parent).
std::string job_dir(const std::string& name) {
  return std::filesystem::temp_directory_path().string() + "/meshtrain_flight_" + name + "_" +
         std::to_string(getppid());
}

// After every rank is done with it.
void remove_job_dir(const std::string& dir) {
  MPI_Barrier(MPI_COMM_WORLD);
  std::error_code ignored;
  if (world_rank() == 0) std::filesystem::remove_all(dir, ignored);
}

std::string own_file(const std::string& dir) {
  return dir + "/flight/rank-" + std::to_string(world_rank()) + ".json";
}

struct Expected {
  const char* op;
  int64_t bytes;
  const char* wire;
};

TEST(FlightRecorder, HoldsExactlyTheCollectivesRun) {
  const std::string dir = job_dir("exact");
  flight_recorder().configure(64, dir, world_rank(), world_size());
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "flight test world");
  const int64_t n = comm.size();
  Floats a("a", 16), gathered("gathered", 8 * n), scatter_in("scatter_in", 4 * n),
      scattered("scattered", 4), b("b", 10), started("started", 12), shift_out("shift_out", 6),
      shift_in("shift_in", 6);
  Kokkos::View<double*, Kokkos::LayoutRight> d("d", 3);
  comm.all_reduce(VectorView(a.data(), 16));
  comm.all_gather(ConstVectorView(a.data(), 8), VectorView(gathered.data(), 8 * n), Dtype::bf16);
  comm.reduce_scatter(ConstVectorView(scatter_in.data(), 4 * n), VectorView(scattered.data(), 4));
  comm.broadcast(VectorView(b.data(), 10), 0);
  comm.barrier();
  Request reduce = comm.start_all_reduce(VectorView(started.data(), 12));
  // Started, not waited for yet.
  const std::vector<FlightEntry> before_wait = flight_recorder().entries();
  ASSERT_EQ(before_wait.size(), 6u);
  EXPECT_EQ(before_wait.back().state, FlightState::started);
  reduce.wait();
  comm.shift(ConstVectorView(shift_out.data(), 6), VectorView(shift_in.data(), 6), 1).wait();
  comm.all_reduce(DoubleVectorView(d.data(), 3));

  // Bytes: the operand in the wire dtype (the gathered tensor, the reduced one; a broadcast's
  // or a shift's buffer), as a trace span's operand_bytes.
  const std::vector<Expected> expected = {{"all_reduce", 16 * 4, "fp32"},
                                          {"all_gather", 8 * n * 2, "bf16"},
                                          {"reduce_scatter", 4 * n * 4, "fp32"},
                                          {"broadcast", 10 * 4, "fp32"},
                                          {"barrier", 0, ""},
                                          {"all_reduce", 12 * 4, "fp32"},
                                          {"shift", 6 * 4, "fp32"},
                                          {"all_reduce", 3 * 8, "f64"}};
  const std::vector<FlightEntry> entries = flight_recorder().entries();
  ASSERT_EQ(entries.size(), expected.size());
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const FlightEntry& e = entries[k];
    EXPECT_STREQ(e.op, expected[k].op) << k;
    EXPECT_EQ(e.bytes, expected[k].bytes) << k;
    EXPECT_STREQ(e.wire, expected[k].wire) << k;
    EXPECT_EQ(e.sequence, k + 1) << k;
    EXPECT_EQ(e.serial, k + 1) << k;
    EXPECT_EQ(e.state, FlightState::completed) << k;
    EXPECT_EQ(flight_recorder().group_description(e.group), "flight test world");
    EXPECT_GE(e.end_ns, e.begin_ns) << k;
    if (k > 0) EXPECT_GE(e.begin_ns, entries[k - 1].begin_ns) << k;
  }
  std::vector<int> everyone(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) everyone[static_cast<std::size_t>(r)] = r;
  EXPECT_EQ(flight_recorder().world_ranks(entries[0].group), everyone);

  // The file holds the same, in order.
  ASSERT_TRUE(flight_recorder().write("test"));
  const FlightRecordFile file = read_flight_record(own_file(dir));
  EXPECT_EQ(file.rank, world_rank());
  EXPECT_EQ(file.world_size, world_size());
  EXPECT_EQ(file.reason, "test");
  ASSERT_EQ(file.entries.size(), expected.size());
  for (std::size_t k = 0; k < expected.size(); ++k) {
    EXPECT_EQ(file.entries[k].op, expected[k].op) << k;
    EXPECT_EQ(file.entries[k].bytes, expected[k].bytes) << k;
    EXPECT_EQ(file.entries[k].sequence, k + 1) << k;
    EXPECT_EQ(file.entries[k].state, "completed") << k;
    EXPECT_EQ(file.entries[k].group, "flight test world") << k;
  }
  const FlightRecordFile::Group& group =
      file.groups[static_cast<std::size_t>(file.entries[0].group_id)];
  EXPECT_EQ(group.entered, expected.size());
  EXPECT_EQ(group.world_ranks, everyone);
  EXPECT_EQ(group.rank, comm.rank());
  remove_job_dir(dir);
  flight_recorder().configure(0, "", world_rank(), world_size());
}

TEST(FlightRecorder, WrapsAfterItsCapacity) {
  const std::string dir = job_dir("wrap");
  flight_recorder().configure(5, dir, world_rank(), world_size());
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "flight test wrap");
  for (int k = 0; k < 12; ++k) comm.barrier();
  const std::vector<FlightEntry> entries = flight_recorder().entries();
  ASSERT_EQ(entries.size(), 5u);
  for (std::size_t k = 0; k < 5; ++k) {
    EXPECT_EQ(entries[k].sequence, 8 + k);  // the last five of twelve
    EXPECT_EQ(entries[k].serial, 8 + k);
  }
  ASSERT_TRUE(flight_recorder().write("test"));
  const FlightRecordFile file = read_flight_record(own_file(dir));
  ASSERT_EQ(file.entries.size(), 5u);
  EXPECT_EQ(file.entries.front().sequence, 8u);
  EXPECT_EQ(file.entries.back().sequence, 12u);
  EXPECT_EQ(file.groups[static_cast<std::size_t>(file.entries[0].group_id)].entered, 12u);
  remove_job_dir(dir);
  flight_recorder().configure(0, "", world_rank(), world_size());
}

TEST(FlightRecorder, SigusrWritesTheRecordAndTheProgramGoesOn) {
  const std::string dir = job_dir("sigusr1");
  flight_recorder().configure(16, dir, world_rank(), world_size());
  auto comm = MpiCommunicator::duplicate(MPI_COMM_WORLD, "flight test signal");
  Floats a("a", 4);
  comm.all_reduce(VectorView(a.data(), 4));
  comm.barrier();
  comm.all_reduce(VectorView(a.data(), 4));
  ASSERT_EQ(raise(SIGUSR1), 0);
  const FlightRecordFile first = read_flight_record(own_file(dir));
  EXPECT_EQ(first.reason, "SIGUSR1");
  ASSERT_EQ(first.entries.size(), 3u);
  EXPECT_EQ(first.entries[1].op, "barrier");
  // Still running: more collectives, and a second signal sees them.
  comm.barrier();
  comm.all_reduce(VectorView(a.data(), 4));
  ASSERT_EQ(raise(SIGUSR1), 0);
  const FlightRecordFile second = read_flight_record(own_file(dir));
  ASSERT_EQ(second.entries.size(), 5u);
  EXPECT_EQ(second.entries.back().sequence, 5u);
  EXPECT_GE(second.written_ns, first.written_ns);
  remove_job_dir(dir);
  flight_recorder().configure(0, "", world_rank(), world_size());
}

TEST(FlightRecorder, ConfigureRemovesTheRecordsOfAnEarlierRun) {
  const std::string dir = job_dir("stale");
  if (world_rank() == 0) {
    std::filesystem::create_directories(dir + "/flight");
    for (const char* name : {"rank-0.json", "rank-1.json", "rank-99.json", "rank-3.json.tmp"}) {
      std::ofstream(dir + "/flight/" + name) << "{}";
    }
    std::ofstream(dir + "/flight/notes.txt") << "kept";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  flight_recorder().configure(8, dir, world_rank(), world_size());
  MPI_Barrier(MPI_COMM_WORLD);
  for (const char* name : {"rank-0.json", "rank-1.json", "rank-99.json", "rank-3.json.tmp"}) {
    EXPECT_FALSE(std::filesystem::exists(dir + "/flight/" + name)) << name;
  }
  EXPECT_TRUE(std::filesystem::exists(dir + "/flight/notes.txt"));
  remove_job_dir(dir);
  flight_recorder().configure(0, "", world_rank(), world_size());
}

// Records as four ranks would leave them: ranks 0 and 2 entered all_reduce #3 of the world,
// rank 1 stopped after #2 (its last: all_gather), rank 3 wrote nothing.
FlightRecordFile record_of(int rank, uint64_t entered) {
  FlightRecordFile file;
  file.rank = rank;
  file.world_size = 4;
  file.groups.push_back({"world", 4, rank, {0, 1, 2, 3}, entered});
  const char* ops[] = {"all_reduce", "all_gather", "all_reduce"};
  for (uint64_t s = 1; s <= entered; ++s) {
    FlightRecordFile::Entry e;
    e.sequence = s;
    e.op = ops[s - 1];
    e.group = "world";
    e.group_id = 0;
    e.state = s == entered && entered == 3 ? "entered" : "completed";
    file.entries.push_back(e);
  }
  return file;
}

TEST(FlightReport, NamesTheRanksBehindAndThoseWithoutARecord) {
  const std::vector<FlightRecordFile> records = {record_of(0, 3), record_of(1, 2), record_of(2, 3)};
  const FlightFinding finding = compare_flight_records(records, "world", {0, 1, 2, 3}, 3);
  EXPECT_EQ(finding.op, "all_reduce");
  EXPECT_EQ(finding.entered, (std::vector<int>{0, 2}));
  ASSERT_EQ(finding.never_entered.size(), 1u);
  EXPECT_EQ(finding.never_entered[0].rank, 1);
  EXPECT_EQ(finding.never_entered[0].last_sequence, 2u);
  EXPECT_EQ(finding.never_entered[0].last_op, "all_gather");
  EXPECT_EQ(finding.no_record, (std::vector<int>{3}));
  EXPECT_EQ(finding.sentence(),
            "all_reduce #3 on world: rank 1 never entered it (its last on that group: "
            "all_gather #2); rank 3 wrote no flight record (stopped, killed, or busy outside a "
            "collective); ranks 0, 2 entered it");
  // After the fact: the first collective not entered by all.
  const std::vector<FlightFinding> stuck = find_stuck_collectives(records);
  ASSERT_EQ(stuck.size(), 1u);
  EXPECT_EQ(stuck[0].sentence(), finding.sentence());
  // Everyone at #2, completed: nothing to report.
  EXPECT_TRUE(
      find_stuck_collectives({record_of(0, 2), record_of(1, 2), record_of(2, 2), record_of(3, 2)})
          .empty());
}

}  // namespace
}  // namespace meshtrain
