#pragma once
// The flight recorder ([runtime] flight_records, docs/running.md): every rank keeps the last N
// collectives it entered on any Communicator, in a ring of plain fixed-size entries reserved
// when the recorder is configured. Recording allocates nothing: a few stores and two relaxed
// atomic increments per collective; off (capacity 0, the default until configure()) it is one
// branch.
//
// An entry: the collective's sequence number on its group (the count of collectives this
// rank entered on communicators of that description), the operation, the group, the
// operand's bytes (the gathered or reduced tensor in the wire dtype, a broadcast's or a
// shift's buffer, as a trace span's operand_bytes), the wire dtype, the state (entered: a
// blocking one running; started: a non-blocking one not yet waited for; completed; failed:
// it threw, a timeout included) and wall-clock times (CLOCK_REALTIME, comparable across
// ranks of a host and across hosts to NTP's precision).
//
// write() dumps the record as JSON to <output_dir>/flight/rank-<k>.json (through a temporary
// file and rename, so a reader never sees half a file). It is async-signal-safe (open, write,
// rename and close, integers formatted by hand, no allocation), and is called
//   - by a collective that timed out on this rank (Communicator, before it throws),
//   - by abort_all_ranks (framework/comm/exit_policy.hpp) before MPI_Abort,
//   - on SIGUSR1 and SIGTERM (mpirun sends it to the other ranks when one dies or aborts).
// The signal handlers chain the program's own: configure() keeps the SIGUSR1 and SIGTERM
// dispositions it replaces, and after writing the record the handler does what the program
// had asked for: calls its handler (SA_SIGINFO ones with the signal's information), ignores
// the signal (SIG_IGN), or for SIG_DFL ends the process on SIGTERM (after 0.3 s, so the other
// ranks of the node write theirs too) and goes on after SIGUSR1 (whose default would end it:
// with the recorder on SIGUSR1 means "write the record"). configure(0, ...) and the
// destructor put the program's dispositions back (unless it replaced the recorder's since).
// The entries a signal interrupts in the middle of an update may show the older values.
//
// Which ranks never entered a collective: flight_report.hpp compares the files.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {

enum class FlightState : uint8_t { entered, started, completed, failed };
const char* to_string(FlightState state);

struct FlightEntry {
  uint64_t serial = 0;    // 1-based over every group on this rank; 0: an empty slot
  uint64_t sequence = 0;  // 1-based on its group
  int64_t bytes = 0;
  int64_t begin_ns = 0;  // CLOCK_REALTIME
  int64_t end_ns = 0;    // 0 until completed or failed
  int32_t group = -1;    // index into the recorder's groups
  FlightState state = FlightState::entered;
  char op[24] = {};
  char wire[8] = {};
};

class FlightRecorder {
 public:
  static constexpr int kMaxGroups = 128;
  static constexpr std::size_t kDescriptionChars = 96;

  FlightRecorder() = default;
  // Puts back the signal dispositions configure() replaced (when its handlers are still
  // installed) and waits for a write in progress.
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // Keeps the last `capacity` collectives from now on (0: off) and writes to
  // <output_dir>/flight/rank-<world_rank>.json; removes the files of an earlier run there
  // (this rank's own; rank 0: all). On with an output_dir, installs the SIGUSR1 and SIGTERM
  // handlers (chaining the program's, above); off, puts the program's back. Call before the
  // collectives to record, from one thread (not while another records). A signal may arrive
  // meanwhile, on any thread: the ring is replaced only while no write() runs (one in
  // progress is waited for; one that begins meanwhile writes nothing).
  void configure(std::size_t capacity, const std::string& output_dir, int world_rank,
                 int world_size);
  bool on() const { return capacity_ != 0; }
  std::size_t capacity() const { return capacity_; }
  // "<output_dir>/flight" ("" before configure).
  std::string directory() const { return dir_; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

  // The group of communicators with this description, this rank's place in it and its size
  // (made at the first call, found after): its index, or -1 when the table is full
  // (collectives on it are not recorded). Communicators share the sequence numbers of their
  // description.
  int register_group(const std::string& description, int size, int rank);
  // The group's members as world ranks (group rank order), when the backend knows them.
  void set_world_ranks(int group, const std::vector<int>& world_ranks);
  // The group's members as world ranks; empty when unknown.
  std::vector<int> world_ranks(int group) const;
  std::string group_description(int group) const;

  // A collective entered (started: a non-blocking one) on `group`: its serial, for finish();
  // 0 when off or the group is not recorded. `op` and `wire` are truncated to the fields.
  uint64_t enter(int group, const char* op, int64_t bytes, const char* wire, bool started) {
    if (capacity_ == 0 || group < 0) return 0;
    return record(group, op, bytes, wire, started);
  }
  void finish(uint64_t serial, FlightState state) {
    if (serial != 0) set_state(serial, state);
  }
  // A copy of the entry `serial` (serial 0 when it was overwritten since).
  FlightEntry entry(uint64_t serial) const;
  // The entries held, oldest first (tests, reports).
  std::vector<FlightEntry> entries() const;

  // Writes the record (reason: "timeout", "failure", "SIGUSR1", "SIGTERM", ...); false when
  // off, not configured with a directory, already being written by another caller, or a
  // system call failed. Async-signal-safe.
  bool write(const char* reason) noexcept;

  // A backend's collective timed out: the backend calls mark_timeout() just before it throws
  // (on whichever thread saw it); the Communicator takes the mark (take_timeout()) when the
  // error reaches it, and then adds what the other ranks' records say (timeout_report).
  static void mark_timeout();
  static bool take_timeout();

  // After the collective `serial` timed out (waiting `timeout_seconds`): writes this rank's
  // record, waits up to min(timeout_seconds, 10 s) for the records, written since it began,
  // of the other ranks of its group and of every rank those wait on in turn (the wait chain),
  // reads any other rank's written by then, and returns one sentence naming the ranks that
  // never entered it and the rank at the root of the wait (flight_report.hpp), or "" when the
  // recorder is off. Never throws.
  std::string timeout_report(uint64_t serial, double timeout_seconds);

 private:
  struct Group {
    char description[kDescriptionChars] = {};
    int size = 0;
    int rank = 0;
    std::atomic<uint64_t> entered{0};
    std::unique_ptr<int[]> world_ranks;  // size entries once known; made once, never freed
  };

  uint64_t record(int group, const char* op, int64_t bytes, const char* wire, bool started);
  void set_state(uint64_t serial, FlightState state);
  // The process's SIGUSR1 and SIGTERM handlers write this recorder's record (one recorder at
  // a time); release: the dispositions they replaced come back, when this one held them.
  void take_signal_handlers();
  void release_signal_handlers();

  std::size_t capacity_ = 0;
  std::unique_ptr<FlightEntry[]> entries_;
  std::atomic<uint64_t> serials_{0};
  Group groups_[kMaxGroups];
  std::atomic<int> group_count_{0};
  // Held by write() and by configure() (which replaces what write() reads): lock-free, so a
  // signal handler can take it (or see it taken and give up).
  std::atomic<bool> writing_{false};
  int world_rank_ = 0;
  int world_size_ = 1;
  std::string dir_;
  // Rendered at configure(): written by a signal handler, which must not format strings.
  char run_dir_path_[4096] = {};
  char dir_path_[4096] = {};
  char file_path_[4096] = {};
  char temp_path_[4096] = {};
};

// This process's recorder.
FlightRecorder& flight_recorder();

}  // namespace meshtrain
