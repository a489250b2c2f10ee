#pragma once
// The communication thread: one per process, it steps "progress tasks" (started operations)
// while the thread that started them computes. With MPI on a CPU, a started transfer moves
// only inside an MPI call (docs/limits.md); this thread makes those calls (MPI_Testall on
// each pending operation's requests) so that an FSDP prefetch or a DP gradient bucket
// advances during a GEMM. Generic: a task is anything with a step() that says whether it is
// done (a ring reduction's segments can be stepped the same way).
//
// Ownership hand-off (the reason for the design):
// - submit(task): from then on only this thread calls task.step(), always under the
//   thread's mutex, until step() returns true or the submitter reclaims the task.
// - When step() returns true the thread unlinks the task and sets its finished flag with a
//   release store; finished() is an acquire load, so whatever step() wrote before is visible
//   to the submitter once it sees the flag.
// - reclaim(task) takes the mutex: when it returns, the thread is not inside the task's
//   step() and never calls it again. It returns false when the task had finished first.
// So a task's state is touched by one thread at a time, and a Request whose wait times out
// (it reclaims first, then waits itself) is never touched again by this thread.
//
// Idle cost: with nothing queued the thread sleeps on a condition variable. With tasks
// queued it steps them all, then yields the core (sched_yield) for the first polls and
// after that sleeps kPollSleepMicroseconds between passes.
// Nothing allocates: tasks are linked intrusively (their own prev/next pointers).
//
// The object lives for the whole process (comm_progress(), never destroyed, so a task
// queued when the thread stops can still be reclaimed); its OS thread runs between start()
// and stop(). CommThreadLease starts it for as long as someone holds one.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace meshtrain {

class ProgressTask {
 public:
  // Called on the progress thread only, under its mutex: advances the operation without
  // blocking; true once it needs no more steps (complete or failed: the task records which).
  // Must not throw and must not allocate.
  virtual bool step() noexcept = 0;

  // True once the thread has seen step() return true (acquire: step()'s writes are visible).
  bool finished() const { return finished_.load(std::memory_order_acquire); }

 protected:
  ProgressTask() = default;
  ~ProgressTask() = default;

 private:
  friend class ProgressThread;
  ProgressTask* prev_ = nullptr;
  ProgressTask* next_ = nullptr;
  bool queued_ = false;       // guarded by the thread's mutex
  int64_t submitted_ns_ = 0;  // Tracer::now_ns() at submit; guarded by the thread's mutex
  std::atomic<bool> finished_{false};
};

class ProgressThread {
 public:
  // Passes of yield-polling before the thread sleeps between passes, and the sleep.
  static constexpr int kYieldPolls = 64;
  static constexpr int kPollSleepMicroseconds = 50;

  ProgressThread() = default;
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Starts / stops (joins) the OS thread. Tasks still queued at stop() stay queued, untouched,
  // until reclaimed or the thread starts again.
  void start();
  void stop();
  bool running() const { return running_.load(std::memory_order_acquire); }

  // Queues `task` (not queued now); the thread steps it from now on. Never allocates.
  void submit(ProgressTask& task);
  // Takes `task` back: true when it was still queued (unlinked now, never stepped again),
  // false when it had finished (or was never submitted). After it returns the thread does not
  // touch the task.
  bool reclaim(ProgressTask& task);

  // Tasks queued now and passes made so far (tests and benchmarks).
  std::size_t queued_count();
  std::size_t passes() const { return passes_.load(std::memory_order_relaxed); }

 private:
  void loop();
  void unlink(ProgressTask& task);

  std::mutex mutex_;
  std::condition_variable wake_;
  ProgressTask* head_ = nullptr;  // guarded by mutex_
  std::size_t count_ = 0;         // guarded by mutex_
  bool stopping_ = false;         // guarded by mutex_
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<std::size_t> passes_{0};
};

// The process's communication thread object (made on first use, never destroyed).
ProgressThread& comm_progress();
// The process's communication thread when it runs, else nullptr (what backends ask before
// they submit a started operation).
ProgressThread* running_comm_progress();

// Holds the communication thread on: the first lease starts it, the last one gone stops it.
// The caller has checked that MPI provides MPI_THREAD_MULTIPLE (require_comm_thread_level in
// runtime.hpp). Used by one thread (the main one).
class CommThreadLease {
 public:
  CommThreadLease();
  ~CommThreadLease();
  CommThreadLease(const CommThreadLease&) = delete;
  CommThreadLease& operator=(const CommThreadLease&) = delete;
};

}  // namespace meshtrain
