// The flight recorder (framework/observe/flight_recorder.hpp): it holds exactly the collectives
// this rank ran (operation, per-group sequence, the operand's bytes in the wire dtype, wire,
// state), wraps after its capacity, writes a file that reads back the same, and SIGUSR1
// writes it while the program goes on. The program's own SIGTERM and SIGUSR1 handlers (plain,
// SA_SIGINFO, SIG_IGN) are called after the record is written and put back when the recorder
// is turned off or destroyed; configure() does not replace the ring while a write reads it.
// The comparison of records (flight_report.hpp) names the ranks behind, those without a
// record, and those that entered; the wait-chain analysis (find_hang_roots) names the rank at
// the root of a hang, or says there is none (a cycle). The fault cases (a rank stopped,
// killed, skipping; a chain on a 2-D mesh) are flight_fault_test.sh's.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/observe/flight_report.hpp"
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

// configure() on every rank, then a barrier: rank 0's configure() removes earlier records from
// the shared folder, so no rank may write one (a signal, a write()) before every rank is past it.
void configure_everywhere(std::size_t records, const std::string& dir) {
  flight_recorder().configure(records, dir, world_rank(), world_size());
  MPI_Barrier(MPI_COMM_WORLD);
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
  configure_everywhere(5, dir);
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
  configure_everywhere(16, dir);
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
  configure_everywhere(8, dir);
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

// --- the program's own signal handlers -------------------------------------------------

volatile sig_atomic_t plain_calls = 0;
volatile sig_atomic_t siginfo_calls = 0;
volatile sig_atomic_t siginfo_signal = 0;

extern "C" void count_plain(int) {
  plain_calls = plain_calls + 1;
}

extern "C" void count_siginfo(int signal_number, siginfo_t* info, void*) {
  siginfo_calls = siginfo_calls + 1;
  siginfo_signal = info != nullptr ? info->si_signo : -signal_number;
}

// The disposition of `signal_number` for the scope, put back at its end.
class KeepDisposition {
 public:
  explicit KeepDisposition(int signal_number) : signal_(signal_number) {
    sigaction(signal_, nullptr, &saved_);
  }
  ~KeepDisposition() { sigaction(signal_, &saved_, nullptr); }

 private:
  int signal_;
  struct sigaction saved_ {};
};

struct sigaction disposition(int signal_number) {
  struct sigaction now {};
  sigaction(signal_number, nullptr, &now);
  return now;
}

void set_plain(int signal_number, void (*handler)(int), int flags) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = flags;
  ASSERT_EQ(sigaction(signal_number, &action, nullptr), 0);
}

// A program with its own SIGTERM handler (a checkpoint on preemption, say): the recorder writes
// its record, then calls that handler, and the program goes on as the handler decides; turned
// off, the recorder puts the handler back. Configured twice, it still chains the program's
// handler, not its own.
TEST(FlightRecorder, ChainsTheProgramsSigtermHandlerAndPutsItBack) {
  const std::string dir = job_dir("chain_term");
  KeepDisposition keep(SIGTERM);
  set_plain(SIGTERM, count_plain, 0);  // no SA_RESTART: the program may rely on EINTR
  plain_calls = 0;
  configure_everywhere(8, dir);
  configure_everywhere(8, dir);
  const struct sigaction installed = disposition(SIGTERM);
  EXPECT_NE(installed.sa_handler, &count_plain) << "the recorder's handler is not installed";
  EXPECT_EQ(installed.sa_flags & SA_RESTART, 0) << "the program's choice of SA_RESTART is lost";
  ASSERT_EQ(raise(SIGTERM), 0);  // the program's handler returns: the process goes on
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(read_flight_record(own_file(dir)).reason, "SIGTERM");

  flight_recorder().configure(0, "", world_rank(), world_size());
  EXPECT_EQ(disposition(SIGTERM).sa_handler, &count_plain);
  ASSERT_EQ(raise(SIGTERM), 0);
  EXPECT_EQ(plain_calls, 2);
  remove_job_dir(dir);
}

// An SA_SIGINFO handler gets the signal's information; SIGUSR1's record is written first.
TEST(FlightRecorder, ChainsAnSaSiginfoHandlerOfSigusr1) {
  const std::string dir = job_dir("chain_siginfo");
  KeepDisposition keep(SIGUSR1);
  struct sigaction mine {};
  mine.sa_sigaction = count_siginfo;
  sigemptyset(&mine.sa_mask);
  mine.sa_flags = SA_SIGINFO | SA_RESTART;
  ASSERT_EQ(sigaction(SIGUSR1, &mine, nullptr), 0);
  siginfo_calls = 0;
  siginfo_signal = 0;
  configure_everywhere(8, dir);
  ASSERT_EQ(raise(SIGUSR1), 0);
  EXPECT_EQ(siginfo_calls, 1);
  EXPECT_EQ(siginfo_signal, SIGUSR1);
  EXPECT_EQ(read_flight_record(own_file(dir)).reason, "SIGUSR1");
  flight_recorder().configure(0, "", world_rank(), world_size());
  const struct sigaction back = disposition(SIGUSR1);
  EXPECT_NE(back.sa_flags & SA_SIGINFO, 0);
  EXPECT_EQ(back.sa_sigaction, &count_siginfo);
  remove_job_dir(dir);
}

// SIGTERM ignored by the program stays ignored (after the record), and ignored again after.
TEST(FlightRecorder, AnIgnoredSigtermStaysIgnored) {
  const std::string dir = job_dir("chain_ignore");
  KeepDisposition keep(SIGTERM);
  set_plain(SIGTERM, SIG_IGN, 0);
  configure_everywhere(8, dir);
  ASSERT_EQ(raise(SIGTERM), 0);  // the process goes on
  EXPECT_EQ(read_flight_record(own_file(dir)).reason, "SIGTERM");
  flight_recorder().configure(0, "", world_rank(), world_size());
  EXPECT_EQ(disposition(SIGTERM).sa_handler, SIG_IGN);
  remove_job_dir(dir);
}

// A recorder destroyed while on puts the program's handlers back too.
TEST(FlightRecorder, DestroyingARecorderPutsTheHandlersBack) {
  const std::string dir = job_dir("chain_destroy");
  KeepDisposition keep_term(SIGTERM);
  KeepDisposition keep_usr1(SIGUSR1);
  set_plain(SIGTERM, count_plain, SA_RESTART);
  set_plain(SIGUSR1, SIG_IGN, 0);
  {
    auto recorder = std::make_unique<FlightRecorder>();
    recorder->configure(4, dir, world_rank(), world_size());
    EXPECT_NE(disposition(SIGTERM).sa_handler, &count_plain);
    EXPECT_NE(disposition(SIGUSR1).sa_handler, SIG_IGN);
  }
  EXPECT_EQ(disposition(SIGTERM).sa_handler, &count_plain);
  EXPECT_EQ(disposition(SIGUSR1).sa_handler, SIG_IGN);
  remove_job_dir(dir);
}

// configure() replaces the ring only when no write reads it: a write blocked in the middle of
// the record (a FIFO for its temporary file, full until read) keeps configure() waiting, and
// the record it writes is whole.
TEST(FlightRecorder, ConfigureWaitsForAWriteInProgress) {
  const std::string dir = job_dir("configure_during_write");
  constexpr int kCollectives = 4096;  // a record of about 1 MB: more than a pipe holds
  configure_everywhere(kCollectives, dir);
  auto self = MpiCommunicator::duplicate(MPI_COMM_SELF, "flight test fifo");
  for (int k = 0; k < kCollectives; ++k) self.barrier();
  std::filesystem::create_directories(dir + "/flight");
  const std::string temp = own_file(dir) + ".tmp";
  ASSERT_EQ(mkfifo(temp.c_str(), 0600), 0) << std::strerror(errno);
  const int reader = ::open(temp.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0) << std::strerror(errno);

  std::atomic<bool> written{false}, wrote_ok{false}, configured{false};
  std::thread writer([&] {
    wrote_ok = flight_recorder().write("test");
    written = true;
  });
  // The pipe full: the writer is blocked in the middle of the record.
  int queued = 0;
  for (int k = 0; k < 2000 && !written; ++k) {
    ASSERT_EQ(ioctl(reader, FIONREAD, &queued), 0);
    if (queued >= 60 * 1024) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(queued, 60 * 1024) << "the writer did not fill the pipe";
  ASSERT_FALSE(written);
  std::thread reconfigure([&] {
    flight_recorder().configure(0, "", world_rank(), world_size());
    configured = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(configured) << "configure() replaced the ring while a write was reading it";

  // Read the record to its end: the write completes, then configure().
  ASSERT_EQ(fcntl(reader, F_SETFL, 0), 0);
  std::string text;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(reader, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    ASSERT_GE(n, 0) << std::strerror(errno);
    if (n == 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(reader);
  writer.join();
  reconfigure.join();
  EXPECT_TRUE(wrote_ok);
  EXPECT_TRUE(configured);
  EXPECT_FALSE(flight_recorder().on());
  try {
    const nlohmann::json record = nlohmann::json::parse(text);
    ASSERT_EQ(record.at("entries").size(), static_cast<std::size_t>(kCollectives));
    EXPECT_EQ(record.at("entries").back().at("sequence").get<int>(), kCollectives);
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << "the record is not whole JSON: " << e.what();
  }
  remove_job_dir(dir);
}

// --- the root of a hang (find_hang_roots) on synthetic records ---------------------------

// A group of a record: its description, members (world ranks), the count this rank entered
// and the state of the last of them.
struct GroupState {
  std::string description;
  std::vector<int> members;
  uint64_t entered = 0;
  std::string last_state = "completed";
};

FlightRecordFile record_with(int rank, const std::vector<GroupState>& groups) {
  FlightRecordFile file;
  file.rank = rank;
  file.world_size = 4;
  file.reason = "timeout";
  for (const GroupState& g : groups) {
    const int place =
        static_cast<int>(std::find(g.members.begin(), g.members.end(), rank) - g.members.begin());
    file.groups.push_back(
        {g.description, static_cast<int>(g.members.size()), place, g.members, g.entered});
    for (uint64_t s = 1; s <= g.entered; ++s) {
      FlightRecordFile::Entry e;
      e.sequence = s;
      e.op = "all_gather";
      e.group = g.description;
      e.group_id = static_cast<int>(file.groups.size()) - 1;
      e.state = s == g.entered ? g.last_state : "completed";
      file.entries.push_back(e);
    }
  }
  return file;
}

const std::string kFsdp = "axis (fsdp)", kTp = "axis (tp)";

// fsdp 2 x tp 2 (rank = 2 fsdp + tp): world rank 3 stopped before fsdp all-gather #3. Rank 1
// waits on it there (and timed out: failed); ranks 0 and 2 finished fsdp #3 and went on to tp
// #3: rank 0 waits on rank 1 (a victim), rank 2 on rank 3. Rank 3 wrote no record.
TEST(FlightReport, FollowsAChainOfLengthTwoToARootOnTheFsdpAxis) {
  const std::vector<FlightRecordFile> records = {
      record_with(0, {{kFsdp, {0, 2}, 3}, {kTp, {0, 1}, 3, "entered"}}),
      record_with(1, {{kFsdp, {1, 3}, 3, "failed"}, {kTp, {0, 1}, 2}}),
      record_with(2, {{kFsdp, {0, 2}, 3}, {kTp, {2, 3}, 3, "entered"}})};
  // What rank 0's error said before: the victim it waits on directly.
  EXPECT_EQ(compare_flight_records(records, kTp, {0, 1}, 3).sentence(),
            "all_gather #3 on axis (tp): rank 1 never entered it (its last on that group: "
            "all_gather #2); rank 0 entered it");
  const HangRoots roots = find_hang_roots(records);
  EXPECT_EQ(roots.waits_on, (std::map<int, std::vector<int>>{{0, {1}}, {1, {3}}, {2, {3}}}));
  ASSERT_EQ(roots.roots.size(), 1u);
  EXPECT_EQ(roots.roots[0].rank, 3);
  EXPECT_FALSE(roots.roots[0].has_record);
  EXPECT_EQ(roots.roots[0].waiting, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(roots.cycle.empty());
  EXPECT_EQ(roots.sentence(),
            "rank 3 is the root: ranks 0, 1, 2 wait on it directly or through another rank (it "
            "wrote no flight record)");
}

// The same mesh, rank 3 stopped before tp all-gather #3, its record written later (SIGTERM)
// and showing it outside any collective: rank 2 waits on it in tp #3; ranks 0 and 1 finished
// tp #3 and went on to fsdp #4: rank 0 waits on rank 2, rank 1 on rank 3.
TEST(FlightReport, FollowsAChainToARootOnTheTpAxisThatWroteARecord) {
  const std::vector<FlightRecordFile> records = {
      record_with(0, {{kTp, {0, 1}, 3}, {kFsdp, {0, 2}, 4, "entered"}}),
      record_with(1, {{kTp, {0, 1}, 3}, {kFsdp, {1, 3}, 4, "entered"}}),
      record_with(2, {{kTp, {2, 3}, 3, "entered"}, {kFsdp, {0, 2}, 3}}),
      record_with(3, {{kTp, {2, 3}, 2}, {kFsdp, {1, 3}, 3}})};
  const HangRoots roots = find_hang_roots(records);
  EXPECT_EQ(roots.waits_on, (std::map<int, std::vector<int>>{{0, {2}}, {1, {3}}, {2, {3}}}));
  ASSERT_EQ(roots.roots.size(), 1u);
  EXPECT_EQ(roots.roots[0].rank, 3);
  EXPECT_TRUE(roots.roots[0].has_record);
  EXPECT_FALSE(roots.roots[0].in_collective);
  EXPECT_EQ(roots.sentence(),
            "rank 3 is the root: ranks 0, 1, 2 wait on it directly or through another rank (its "
            "record shows it in no collective)");
}

// Rank 1 skipped world all-reduce #3 and waits in tp #3, which rank 0 (in world #3) never
// entered: ranks 0 and 1 wait on each other, ranks 2 and 3 on rank 1. No rank is at the root,
// and the sentence says so rather than naming one.
TEST(FlightReport, SaysACycleHasNoRoot) {
  const std::vector<int> world = {0, 1, 2, 3};
  const std::vector<FlightRecordFile> records = {
      record_with(0, {{"world", world, 3, "entered"}, {kTp, {0, 1}, 2}}),
      record_with(1, {{"world", world, 2}, {kTp, {0, 1}, 3, "failed"}}),
      record_with(2, {{"world", world, 3, "entered"}, {kTp, {2, 3}, 2}}),
      record_with(3, {{"world", world, 3, "failed"}, {kTp, {2, 3}, 2}})};
  const HangRoots roots = find_hang_roots(records);
  EXPECT_TRUE(roots.roots.empty());
  EXPECT_EQ(roots.cycle, (std::vector<int>{0, 1}));
  EXPECT_EQ(roots.behind_cycle, (std::vector<int>{2, 3}));
  EXPECT_EQ(roots.sentence(),
            "no rank is at the root of the wait of ranks 0, 1, 2, 3: ranks 0, 1 wait on each "
            "other in a cycle (each is in a collective another has not entered: collectives in "
            "different orders on different ranks), and ranks 2, 3 wait on them");
}

// Two tp pairs, each waiting on a partner without a record: two roots, each with its waiter.
// Nobody waiting (all completed, or all in a collective every member entered): nothing said.
TEST(FlightReport, NamesEveryRootAndNothingWhenNoRankWaits) {
  const HangRoots two = find_hang_roots({record_with(0, {{kTp, {0, 1}, 5, "entered"}}),
                                         record_with(2, {{kTp, {2, 3}, 5, "entered"}})});
  ASSERT_EQ(two.roots.size(), 2u);
  EXPECT_EQ(two.sentence(),
            "rank 1 is a root: rank 0 waits on it directly or through another rank (it wrote no "
            "flight record); rank 3 is a root: rank 2 waits on it directly or through another "
            "rank (it wrote no flight record)");
  const HangRoots none = find_hang_roots({record_with(0, {{kTp, {0, 1}, 5, "entered"}}),
                                          record_with(1, {{kTp, {0, 1}, 5, "entered"}})});
  EXPECT_TRUE(none.waits_on.empty());
  EXPECT_EQ(none.sentence(), "");
  EXPECT_EQ(find_hang_roots({record_of(0, 2), record_of(1, 2)}).sentence(), "");
}

}  // namespace
}  // namespace meshtrain
