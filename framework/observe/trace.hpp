#pragma once
// Step traces ([runtime] trace_steps). While the tracer is on, each span (a step, its phases,
// a layer's forward or backward, a GEMM, a collective, the start of a non-blocking operation
// and the wait for it) becomes one event in memory reserved when tracing starts: recording
// allocates nothing. Off, a span costs one branch. write_chrome_trace turns a rank's events
// into Chrome trace event JSON (Perfetto, chrome://tracing): one track per rank, timestamps on
// rank 0's clock (clock_offset_to_rank0_ns in framework/comm/mpi_util.hpp). Spans are recorded by
// the thread that runs the steps (the one that started the window, without a lock) and by the
// background threads that name themselves with a TraceLaneScope (a checkpoint's writer and
// finisher, the data reader, the communication thread: each into a lane of its own, under the
// lane's lock, written as a thread of its own in the file). Where the build times
// the device (device_timer.hpp), every span but a wait also gets device markers, and the file
// a second track of the same spans as the device ran them.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "framework/observe/device_timer.hpp"

namespace meshtrain {

enum class TraceKind : uint8_t {
  step,        // one training step; `number` is its step number
  phase,       // a part of the step: data wait, forward, loss, backward, optimizer, ...
  layer,       // one layer's forward or backward (`name` is the layer's)
  gemm,        // one GEMM: m x k times k x n
  collective,  // a blocking collective, or the start of a non-blocking one (`flow` set)
  wait,        // the wait for a non-blocking collective (`flow` names its start)
};

const char* to_string(TraceKind kind);

struct TraceEvent {
  const char* name = "";    // static text, or text that outlives the trace (a layer's name)
  const char* group = "";   // a collective's group (its communicator's description)
  const char* detail = "";  // static text: the wire or GEMM dtype, the algorithm, the pass
  TraceKind kind = TraceKind::phase;
  int64_t begin_ns = 0;  // this rank's steady clock
  int64_t end_ns = 0;
  int64_t bytes = 0;            // a collective's bytes moved per rank (as the plan counts them)
  int64_t operand_bytes = 0;    // and its whole operand's bytes (the gathered or reduced tensor)
  int64_t m = 0, n = 0, k = 0;  // a GEMM's shape
  int64_t number = 0;           // a step's number
  int64_t flow = 0;             // non-zero: the non-blocking operation a start and a wait share
  int32_t device_begin = -1;    // the device markers of the span (device_timer.hpp), -1: none
  int32_t device_end = -1;
};

// A background thread's events (TraceLaneScope): its own buffer, reserved when the lane is
// made, behind its own lock (the lane's thread records, the window's owner reads).
struct TraceLane {
  static constexpr std::size_t kCapacity = 4096;
  std::string name;  // the thread's name in the file ("checkpoint writer", ...)
  std::mutex mutex;
  std::vector<TraceEvent> events;  // guarded by mutex
  std::size_t dropped = 0;         // guarded by mutex
  bool attached = false;           // a thread records into it now; guarded by the tracer's lock
};

// A copy of a lane's events (write_chrome_trace).
struct TraceLaneEvents {
  std::string name;
  std::vector<TraceEvent> events;
  std::size_t dropped = 0;
};

class Tracer {
 public:
  static int64_t now_ns();

  // Starts recording with room for `capacity` events (reserved here, not while recording;
  // events beyond it are counted in dropped()) and their device markers (at most
  // kDeviceMarkers; spans beyond them have no device times). Clears what an earlier window kept.
  static constexpr std::size_t kDeviceMarkers = std::size_t{1} << 16;
  void start(std::size_t capacity);
  void stop() { on_.store(false, std::memory_order_release); }
  // On, and called from the thread that started it or from a thread in a lane; spans of
  // other threads are not recorded.
  bool on() const {
    if (!on_.load(std::memory_order_acquire)) return false;
    return this_thread_lane() != nullptr ||
           std::this_thread::get_id() == owner_.load(std::memory_order_relaxed);
  }

  void record(const TraceEvent& event) {
    if (TraceLane* lane = this_thread_lane()) {
      std::lock_guard<std::mutex> lock(lane->mutex);
      if (lane->events.size() < lane->events.capacity()) {
        lane->events.push_back(event);
      } else {
        ++lane->dropped;
      }
      return;
    }
    if (events_.size() < events_.capacity()) {
      events_.push_back(event);
    } else {
      ++dropped_;
    }
  }
  int64_t next_flow() { return ++last_flow_; }

  const std::vector<TraceEvent>& events() const { return events_; }
  std::size_t dropped() const { return dropped_; }
  // Copies of the lanes' events of this window, in the order the lanes were made.
  std::vector<TraceLaneEvents> lane_events();
  // Whether the calling thread records into a lane (a background thread).
  static bool in_lane() { return this_thread_lane() != nullptr; }

 private:
  friend class TraceLaneScope;
  static TraceLane*& this_thread_lane_slot();
  static TraceLane* this_thread_lane() { return this_thread_lane_slot(); }
  // A lane named `name` that no thread records into now (made when there is none).
  TraceLane* attach_lane(const char* name);
  void detach_lane(TraceLane* lane);

  std::atomic<bool> on_{false};
  std::atomic<std::thread::id> owner_{};
  std::vector<TraceEvent> events_;
  std::size_t dropped_ = 0;
  int64_t last_flow_ = 0;
  std::mutex lanes_mutex_;
  std::vector<std::unique_ptr<TraceLane>> lanes_;  // guarded by lanes_mutex_; never shrinks
};

// This process's tracer (one per rank).
Tracer& tracer();

// For the life of the scope, the spans of the calling thread (a background thread: a
// checkpoint writer, the data reader, the communication thread) go into a lane named `name`
// (static text) whenever a trace window is on. Making the scope may allocate (the lane's
// buffer, once per name and concurrent thread): make it where the thread starts.
class TraceLaneScope {
 public:
  explicit TraceLaneScope(const char* name);
  ~TraceLaneScope();
  TraceLaneScope(const TraceLaneScope&) = delete;
  TraceLaneScope& operator=(const TraceLaneScope&) = delete;

 private:
  TraceLane* lane_;
  TraceLane* outer_;  // the thread's lane before this scope (nested scopes)
};

// On a CUDA build with NVTX (framework/CMakeLists.txt), a traced span is also an NVTX range;
// a no-op elsewhere.
void nvtx_push(const char* name);
void nvtx_pop();

// Records [construction, destruction) as one event when the tracer is on at construction.
class TraceSpan {
 public:
  explicit TraceSpan(const char* name, TraceKind kind = TraceKind::phase) : on_(tracer().on()) {
    if (on_) {
      event_.name = name;
      event_.kind = kind;
      nvtx_push(name);
      event_.begin_ns = Tracer::now_ns();
      if (kind != TraceKind::wait && !Tracer::in_lane()) {
        event_.device_begin = device_timer::record();
      }
    }
  }
  ~TraceSpan() {
    if (on_) {
      if (event_.device_begin >= 0) event_.device_end = device_timer::record();
      event_.end_ns = Tracer::now_ns();
      nvtx_pop();
      tracer().record(event_);
    }
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  bool on() const { return on_; }
  // The event's fields (set only while on; the setters are no-ops otherwise).
  TraceSpan& group(const std::string& text) {
    if (on_) event_.group = text.c_str();
    return *this;
  }
  TraceSpan& detail(const char* text) {
    if (on_) event_.detail = text;
    return *this;
  }
  TraceSpan& bytes(int64_t moved, int64_t operand) {
    if (on_) {
      event_.bytes = moved;
      event_.operand_bytes = operand;
    }
    return *this;
  }
  TraceSpan& shape(int64_t m, int64_t n, int64_t k) {
    if (on_) {
      event_.m = m;
      event_.n = n;
      event_.k = k;
    }
    return *this;
  }
  TraceSpan& number(int64_t value) {
    if (on_) event_.number = value;
    return *this;
  }
  TraceSpan& flow(int64_t id) {
    if (on_) event_.flow = id;
    return *this;
  }

 private:
  bool on_;
  TraceEvent event_;
};

// Writes `events` of rank `rank` (of `ranks` traced) as Chrome trace event JSON to `path`:
// one "X" event per span (ts and dur in microseconds from `origin_ns` on rank 0's clock, sorted
// by start) on the rank's "host" thread (tid 0), "s"/"f" flow events from each start to its
// wait, and the rank's name. `device_ns` (device_timer::resolve(); empty on a build without
// device spans) gives each span with device markers a second "X" event on the rank's "device"
// thread (tid 1), category "device", its kind in args.kind. Each of `lanes` is a thread of its
// own (tid 2, 3, ... in order, named after the lane), its spans of category "background" with
// their kind in args.kind. The metadata (otherData) holds the rank, `ranks`, `origin_ns` (the
// same on every rank of one trace window: how a reader tells an earlier run's file apart) and
// the `dropped` events (the lanes' included). Written through a temporary file and a rename
// (write_trace_file). Throws Error naming the path when it cannot be written.
void write_chrome_trace(const std::vector<TraceEvent>& events,
                        const std::vector<int64_t>& device_ns,
                        const std::vector<TraceLaneEvents>& lanes, std::size_t dropped, int rank,
                        int ranks, int64_t clock_offset_ns, int64_t origin_ns,
                        const std::string& path);

// Writes one file holding the events of the `paths` (written by write_chrome_trace) to
// `merged`, a track per rank, through a temporary file and a rename. Throws Error naming the
// file that cannot be read or written.
void merge_chrome_traces(const std::vector<std::string>& paths, const std::string& merged);

// Writes `text` to `path` as a whole: into "<path>.tmp", then renamed over `path`, so that a
// reader (trace-report, Perfetto) never sees half a file and a failed write leaves the
// earlier file as it was. Throws Error naming the path when it cannot.
void write_trace_file(const std::string& path, const std::string& text);

// Removes what a trace window writes into `trace_dir` (rank-<k>.json, all-ranks.json,
// passes.json, config.toml and their temporaries), so that an earlier run's files, of more ranks,
// are not read as this one's. Errors are ignored (nothing there to remove).
void remove_trace_files(const std::string& trace_dir);

}  // namespace meshtrain
