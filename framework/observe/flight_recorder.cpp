#include "framework/observe/flight_recorder.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "base/error.hpp"
#include "framework/observe/flight_report.hpp"

namespace meshtrain {

const char* to_string(FlightState state) {
  switch (state) {
    case FlightState::entered:
      return "entered";
    case FlightState::started:
      return "started";
    case FlightState::completed:
      return "completed";
    case FlightState::failed:
      return "failed";
  }
  return "unknown";
}

namespace {

int64_t wall_clock_ns() {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);  // async-signal-safe
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

template <std::size_t N>
void copy_truncated(char (&field)[N], const char* text) {
  std::size_t k = 0;
  if (text != nullptr) {
    for (; k + 1 < N && text[k] != '\0'; ++k) field[k] = text[k];
  }
  field[k] = '\0';
}

// JSON onto a file descriptor through a fixed buffer, with only async-signal-safe calls.
class SignalSafeJson {
 public:
  explicit SignalSafeJson(int fd) : fd_(fd) {}
  ~SignalSafeJson() { flush(); }

  SignalSafeJson& raw(const char* text) {
    while (*text != '\0') put(*text++);
    return *this;
  }
  SignalSafeJson& string(const char* text) {
    put('"');
    for (; *text != '\0'; ++text) {
      const unsigned char c = static_cast<unsigned char>(*text);
      if (c == '"' || c == '\\') {
        put('\\');
        put(static_cast<char>(c));
      } else if (c < 0x20) {
        static const char hex[] = "0123456789abcdef";
        raw("\\u00");
        put(hex[c >> 4]);
        put(hex[c & 15]);
      } else {
        put(static_cast<char>(c));
      }
    }
    put('"');
    return *this;
  }
  SignalSafeJson& integer(int64_t value) {
    char digits[24];
    int n = 0;
    // Negative values through their magnitude as unsigned (INT64_MIN included).
    uint64_t magnitude =
        value < 0 ? 0 - static_cast<uint64_t>(value) : static_cast<uint64_t>(value);
    do {
      digits[n++] = static_cast<char>('0' + magnitude % 10);
      magnitude /= 10;
    } while (magnitude != 0);
    if (value < 0) put('-');
    while (n > 0) put(digits[--n]);
    return *this;
  }
  SignalSafeJson& unsigned_integer(uint64_t value) {
    char digits[24];
    int n = 0;
    do {
      digits[n++] = static_cast<char>('0' + value % 10);
      value /= 10;
    } while (value != 0);
    while (n > 0) put(digits[--n]);
    return *this;
  }
  bool ok() {
    flush();
    return ok_;
  }

 private:
  void put(char c) {
    if (used_ == sizeof(buffer_)) flush();
    buffer_[used_++] = c;
  }
  void flush() {
    std::size_t done = 0;
    while (ok_ && done < used_) {
      const ssize_t n = ::write(fd_, buffer_ + done, used_ - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ok_ = false;
        break;
      }
      done += static_cast<std::size_t>(n);
    }
    used_ = 0;
  }

  int fd_;
  char buffer_[2048];
  std::size_t used_ = 0;
  bool ok_ = true;
};

// Set by a backend's timeout (whichever thread saw it), taken by the Communicator.
std::atomic<bool> timeout_marked{false};

// The process's SIGUSR1 and SIGTERM dispositions from before the recorder's handler was
// installed (chained by the handler, restored when the recorder is turned off), and the
// recorder whose record the handler writes (null: none; the handler then only chains).
// Written only while the handler is not installed for that signal, read by the handler.
struct sigaction previous_usr1 {};
struct sigaction previous_term {};
std::atomic<FlightRecorder*> handler_owner{nullptr};

struct sigaction& previous_action(int signal_number) {
  return signal_number == SIGTERM ? previous_term : previous_usr1;
}

extern "C" void flight_signal_handler(int signal_number, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  if (FlightRecorder* recorder = handler_owner.load(std::memory_order_acquire)) {
    recorder->write(signal_number == SIGTERM ? "SIGTERM" : "SIGUSR1");
  }
  // Then what the program had asked for before the recorder came.
  struct sigaction& previous = previous_action(signal_number);
  if (previous.sa_handler == SIG_IGN) {
    // Ignored: the program goes on.
  } else if (previous.sa_handler == SIG_DFL) {
    if (signal_number == SIGTERM) {
      // Linger a moment first: Open MPI's daemon signals every rank of the node at once and
      // SIGKILLs those left as soon as the first one exits, so the quick ones would cut the
      // others' writing short.
      timespec linger{0, 300 * 1000 * 1000};
      while (nanosleep(&linger, &linger) != 0 && errno == EINTR) {
      }
      // The default action (termination), with the record written.
      struct sigaction action {};
      action.sa_handler = SIG_DFL;
      sigemptyset(&action.sa_mask);
      sigaction(SIGTERM, &action, nullptr);
      raise(SIGTERM);
    }
    // SIGUSR1's default would end the process; with the recorder on it means "write the
    // record", and the program goes on.
  } else {
    const bool siginfo = (previous.sa_flags & SA_SIGINFO) != 0;
    void (*handler)(int) = previous.sa_handler;
    void (*siginfo_handler)(int, siginfo_t*, void*) = previous.sa_sigaction;
    if ((previous.sa_flags & SA_RESETHAND) != 0) {
      // A one-shot handler: the kernel would have reset it to the default on delivery.
      previous.sa_handler = SIG_DFL;
      previous.sa_flags &= ~(SA_RESETHAND | SA_SIGINFO);
    }
    errno = saved_errno;
    if (siginfo) {
      siginfo_handler(signal_number, info, context);
    } else {
      handler(signal_number);
    }
    return;  // the previous handler's errno stands, as without the recorder
  }
  errno = saved_errno;
}

bool is_ours(const struct sigaction& action) {
  return (action.sa_flags & SA_SIGINFO) != 0 && action.sa_sigaction == flight_signal_handler;
}

// Installs the handler for `signal_number` unless it is installed, keeping the disposition
// it replaces. The previous handler's mask is blocked while ours runs (it calls that handler),
// and its SA_RESTART choice kept (a program may rely on EINTR to see its signal).
void install_handler(int signal_number) {
  struct sigaction current {};
  sigaction(signal_number, nullptr, &current);
  if (is_ours(current)) return;
  previous_action(signal_number) = current;
  struct sigaction action {};
  action.sa_sigaction = flight_signal_handler;
  sigemptyset(&action.sa_mask);
  sigaddset(&action.sa_mask, SIGUSR1);
  sigaddset(&action.sa_mask, SIGTERM);
  const bool handled = current.sa_handler != SIG_DFL && current.sa_handler != SIG_IGN;
  if (handled) {
    for (int other = 1; other < NSIG; ++other) {
      if (sigismember(&current.sa_mask, other) == 1) sigaddset(&action.sa_mask, other);
    }
  }
  action.sa_flags = SA_SIGINFO | (handled ? (current.sa_flags & SA_RESTART) : SA_RESTART);
  sigaction(signal_number, &action, nullptr);
}

// Puts back the disposition install_handler replaced, unless the program has replaced ours
// since (then its own stays).
void restore_handler(int signal_number) {
  struct sigaction current {};
  sigaction(signal_number, nullptr, &current);
  if (is_ours(current)) sigaction(signal_number, &previous_action(signal_number), nullptr);
}

// A path into a fixed field (its length checked by the caller).
template <std::size_t N>
void copy_path(char (&field)[N], const std::string& path) {
  std::memcpy(field, path.c_str(), std::min(path.size() + 1, N));
  field[N - 1] = '\0';
}

// Holds the recorder's writer flag: taken by write() (which gives up when it is held) and by
// configure() and the destructor (which wait for it). Lock-free, so a signal handler may take
// it; waiting is for threads only.
class WriterLock {
 public:
  explicit WriterLock(std::atomic<bool>& flag) : flag_(flag) {
    for (int tries = 0;; ++tries) {
      bool expected = false;
      if (flag_.compare_exchange_weak(expected, true, std::memory_order_acquire)) return;
      if (tries < 100) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  ~WriterLock() { flag_.store(false, std::memory_order_release); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  std::atomic<bool>& flag_;
};

// Every rank-<k>.json (and its temporary) in `dir`; errors ignored (nothing to remove).
void remove_earlier_records(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::directory_iterator entries(dir, error);
  if (error) return;
  for (const fs::directory_entry& entry : entries) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank-", 0) == 0 && name.find(".json") != std::string::npos) {
      fs::remove(entry.path(), error);
    }
  }
}

}  // namespace

FlightRecorder& flight_recorder() {
  // Never destroyed: communicators destroyed at exit and a signal at exit still find it.
  static FlightRecorder* const recorder = new FlightRecorder;
  return *recorder;
}

FlightRecorder::~FlightRecorder() {
  release_signal_handlers();
  WriterLock wait_for_a_write_in_progress(writing_);
}

void FlightRecorder::configure(std::size_t capacity, const std::string& output_dir, int world_rank,
                               int world_size) {
  const std::string dir =
      capacity == 0 || output_dir.empty() ? std::string() : output_dir + "/flight";
  const std::string file =
      dir.empty() ? std::string() : dir + "/rank-" + std::to_string(world_rank) + ".json";
  const std::string temp = file.empty() ? std::string() : file + ".tmp";
  for (const std::string* path : {&output_dir, &dir, &file, &temp}) {
    MESHTRAIN_REQUIRE(path->size() < sizeof(file_path_), "flight recorder: the path '", *path,
                      "' is longer than ", sizeof(file_path_) - 1, " characters");
  }
  std::unique_ptr<FlightEntry[]> ring;
  if (capacity != 0) ring = std::make_unique<FlightEntry[]>(capacity);
  std::unique_ptr<FlightEntry[]> old_ring;  // freed after the lock: nothing reads it then
  {
    // write() reads the ring, its capacity and the paths, on any thread (a signal handler):
    // they change only while no write runs. A write in progress is waited for; one that
    // begins meanwhile (a signal now) writes nothing.
    WriterLock lock(writing_);
    world_rank_ = world_rank;
    world_size_ = world_size;
    old_ring = std::move(entries_);
    entries_ = std::move(ring);
    capacity_ = capacity;
    serials_.store(0, std::memory_order_relaxed);
    dir_ = dir;
    copy_path(run_dir_path_, capacity == 0 ? std::string() : output_dir);
    copy_path(dir_path_, dir);
    copy_path(file_path_, file);
    copy_path(temp_path_, temp);
  }
  if (!dir.empty()) {
    // The files of an earlier run in this folder must not be taken for this one's: each rank
    // removes its own, and rank 0 every other one (the others have written nothing yet: no
    // collective of this run can have timed out before rank 0 got here).
    ::unlink(file.c_str());
    if (world_rank == 0) remove_earlier_records(dir);
    take_signal_handlers();
  } else {
    release_signal_handlers();  // off (or nowhere to write): the program's own handlers again
  }
}

void FlightRecorder::take_signal_handlers() {
  handler_owner.store(this, std::memory_order_release);
  install_handler(SIGUSR1);
  install_handler(SIGTERM);
}

void FlightRecorder::release_signal_handlers() {
  FlightRecorder* expected = this;
  if (!handler_owner.compare_exchange_strong(expected, nullptr)) return;  // not ours
  restore_handler(SIGUSR1);
  restore_handler(SIGTERM);
}

int FlightRecorder::register_group(const std::string& description, int size, int rank) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const int count = group_count_.load(std::memory_order_relaxed);
  char name[kDescriptionChars];
  copy_truncated(name, description.c_str());
  for (int g = 0; g < count; ++g) {
    if (std::strcmp(groups_[g].description, name) == 0 && groups_[g].size == size &&
        groups_[g].rank == rank) {
      return g;
    }
  }
  if (count == kMaxGroups) return -1;
  Group& group = groups_[count];
  std::memcpy(group.description, name, sizeof(name));
  group.size = size;
  group.rank = rank;
  group_count_.store(count + 1, std::memory_order_release);
  return count;
}

void FlightRecorder::set_world_ranks(int group, const std::vector<int>& world_ranks) {
  if (group < 0 || group >= group_count_.load(std::memory_order_acquire)) return;
  Group& g = groups_[group];
  if (world_ranks.size() != static_cast<std::size_t>(g.size)) return;
  if (!g.world_ranks) {
    auto ranks = std::make_unique<int[]>(world_ranks.size());
    std::copy(world_ranks.begin(), world_ranks.end(), ranks.get());
    g.world_ranks = std::move(ranks);
  }
}

std::vector<int> FlightRecorder::world_ranks(int group) const {
  if (group < 0 || group >= group_count_.load(std::memory_order_acquire)) return {};
  const Group& g = groups_[group];
  if (!g.world_ranks) return {};
  return std::vector<int>(g.world_ranks.get(), g.world_ranks.get() + g.size);
}

std::string FlightRecorder::group_description(int group) const {
  if (group < 0 || group >= group_count_.load(std::memory_order_acquire)) return "";
  return groups_[group].description;
}

uint64_t FlightRecorder::record(int group, const char* op, int64_t bytes, const char* wire,
                                bool started) {
  const uint64_t serial = serials_.fetch_add(1, std::memory_order_relaxed) + 1;
  FlightEntry& e = entries_[(serial - 1) % capacity_];
  e.serial = 0;  // a signal reading this slot now skips it
  e.sequence = groups_[group].entered.fetch_add(1, std::memory_order_relaxed) + 1;
  e.bytes = bytes;
  e.begin_ns = wall_clock_ns();
  e.end_ns = 0;
  e.group = group;
  e.state = started ? FlightState::started : FlightState::entered;
  copy_truncated(e.op, op);
  copy_truncated(e.wire, wire);
  std::atomic_signal_fence(std::memory_order_release);
  e.serial = serial;
  return serial;
}

void FlightRecorder::set_state(uint64_t serial, FlightState state) {
  if (capacity_ == 0) return;
  FlightEntry& e = entries_[(serial - 1) % capacity_];
  if (e.serial != serial) return;  // overwritten since
  e.end_ns = wall_clock_ns();
  e.state = state;
}

FlightEntry FlightRecorder::entry(uint64_t serial) const {
  if (capacity_ == 0 || serial == 0) return {};
  const FlightEntry& e = entries_[(serial - 1) % capacity_];
  if (e.serial != serial) return {};
  return e;
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  std::vector<FlightEntry> out;
  if (capacity_ == 0) return out;
  const uint64_t last = serials_.load(std::memory_order_relaxed);
  const uint64_t first = last > capacity_ ? last - capacity_ + 1 : 1;
  for (uint64_t s = first; s <= last; ++s) {
    const FlightEntry e = entry(s);
    if (e.serial != 0) out.push_back(e);
  }
  return out;
}

bool FlightRecorder::write(const char* reason) noexcept {
  bool expected = false;
  // Being written now, or configure() is replacing what a write reads.
  if (!writing_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
  if (capacity_ == 0 || file_path_[0] == '\0') {
    writing_.store(false, std::memory_order_release);
    return false;
  }
  bool ok = false;
  ::mkdir(run_dir_path_, 0777);  // when the run has not made it yet (an error at start)
  if (::mkdir(dir_path_, 0777) == 0 || errno == EEXIST) {
    const int fd = ::open(temp_path_, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      {
        SignalSafeJson json(fd);
        const int groups = group_count_.load(std::memory_order_acquire);
        const uint64_t last = serials_.load(std::memory_order_relaxed);
        json.raw("{\"rank\": ").integer(world_rank_);
        json.raw(", \"world_size\": ").integer(world_size_);
        json.raw(", \"reason\": ").string(reason);
        json.raw(", \"written_unix_ns\": ").integer(wall_clock_ns());
        json.raw(", \"capacity\": ").unsigned_integer(capacity_);
        json.raw(", \"recorded\": ").unsigned_integer(last);
        json.raw(",\n\"groups\": [");
        for (int g = 0; g < groups; ++g) {
          const Group& group = groups_[g];
          json.raw(g == 0 ? "\n  " : ",\n  ");
          json.raw("{\"id\": ").integer(g);
          json.raw(", \"group\": ").string(group.description);
          json.raw(", \"size\": ").integer(group.size);
          json.raw(", \"rank\": ").integer(group.rank);
          json.raw(", \"entered\": ")
              .unsigned_integer(group.entered.load(std::memory_order_relaxed));
          json.raw(", \"world_ranks\": [");
          if (const int* ranks = group.world_ranks.get()) {
            for (int k = 0; k < group.size; ++k) json.raw(k == 0 ? "" : ", ").integer(ranks[k]);
          }
          json.raw("]}");
        }
        json.raw("],\n\"entries\": [");
        const uint64_t first = last > capacity_ ? last - capacity_ + 1 : 1;
        bool any = false;
        for (uint64_t s = first; s <= last && last != 0; ++s) {
          const FlightEntry& e = entries_[(s - 1) % capacity_];
          if (e.serial != s || e.group < 0 || e.group >= groups) continue;
          json.raw(any ? ",\n  " : "\n  ");
          any = true;
          json.raw("{\"serial\": ").unsigned_integer(e.serial);
          json.raw(", \"sequence\": ").unsigned_integer(e.sequence);
          json.raw(", \"op\": ").string(e.op);
          json.raw(", \"group\": ").string(groups_[e.group].description);
          json.raw(", \"group_id\": ").integer(e.group);
          json.raw(", \"bytes\": ").integer(e.bytes);
          json.raw(", \"wire\": ").string(e.wire);
          json.raw(", \"state\": ").string(to_string(e.state));
          json.raw(", \"begin_unix_ns\": ").integer(e.begin_ns);
          json.raw(", \"end_unix_ns\": ").integer(e.end_ns);
          json.raw("}");
        }
        json.raw("]}\n");
        ok = json.ok();
      }
      ok = (::close(fd) == 0) && ok;
      ok = ok && ::rename(temp_path_, file_path_) == 0;
    }
  }
  writing_.store(false, std::memory_order_release);
  return ok;
}

void FlightRecorder::mark_timeout() {
  timeout_marked.store(true);
}

bool FlightRecorder::take_timeout() {
  return timeout_marked.exchange(false);
}

std::string FlightRecorder::timeout_report(uint64_t serial, double timeout_seconds) {
  if (capacity_ == 0 || dir_.empty()) return "";
  try {
    const FlightEntry stuck = entry(serial);
    if (stuck.serial == 0) return "";
    write("timeout");
    const std::vector<int> members = world_ranks(stuck.group);
    // The records of other ranks written since this collective began (ranks stuck in it, or
    // in collectives of the wait chain, time out at about the same moment and write theirs;
    // an older one is a SIGUSR1 dump).
    std::map<int, FlightRecordFile> fresh;
    const auto read_fresh = [&](int rank) {
      if (fresh.count(rank) != 0 || rank < 0 || rank >= world_size_) return;
      const std::string path = dir_ + "/rank-" + std::to_string(rank) + ".json";
      struct stat info {};
      if (::stat(path.c_str(), &info) != 0) return;
      try {
        FlightRecordFile file = read_flight_record(path);
        if (file.written_ns >= stuck.begin_ns) fresh.emplace(rank, std::move(file));
      } catch (const Error&) {
        // Not readable yet; try again.
      }
    };
    const auto records = [&] {
      std::vector<FlightRecordFile> out;
      for (const auto& [rank, file] : fresh) out.push_back(file);
      return out;
    };
    // Wanted: the group's members and every rank a record read so far waits on; bounded.
    const double grace = std::min(timeout_seconds, 10.0);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(grace));
    const auto wanted = [&] {
      std::set<int> ranks(members.begin(), members.end());
      ranks.insert(world_rank_);
      for (const auto& [rank, targets] : find_hang_roots(records()).waits_on) {
        ranks.insert(targets.begin(), targets.end());
      }
      return ranks;
    };
    for (;;) {
      // Each record read may want more (the ranks it waits on): read until none is new.
      std::set<int> ranks = wanted();
      for (std::size_t before = SIZE_MAX; before != fresh.size(); ranks = wanted()) {
        before = fresh.size();
        for (const int rank : ranks) read_fresh(rank);
      }
      const bool complete =
          std::all_of(ranks.begin(), ranks.end(), [&](int rank) { return fresh.count(rank) != 0; });
      if (complete || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // Any other rank's, written by now: the ranks waiting on the root outside this chain.
    for (int rank = 0; rank < world_size_; ++rank) read_fresh(rank);
    const std::vector<FlightRecordFile> all = records();
    FlightFinding finding =
        compare_flight_records(all, groups_[stuck.group].description, members, stuck.sequence);
    if (finding.op.empty()) finding.op = stuck.op;
    const std::string roots = find_hang_roots(all).sentence();
    return finding.sentence() + (roots.empty() ? "" : "; " + roots) + "; flight records in " +
           dir_ + "/";
  } catch (const std::exception& e) {
    return std::string("(the flight records could not be compared: ") + e.what() + ")";
  }
}

}  // namespace meshtrain
