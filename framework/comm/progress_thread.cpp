#include "framework/comm/progress_thread.hpp"

#include <sched.h>

#include <chrono>

#include "framework/observe/trace.hpp"

namespace meshtrain {

void ProgressThread::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (running_.load(std::memory_order_relaxed)) return;
  stopping_ = false;
  thread_ = std::thread([this] { loop(); });
  running_.store(true, std::memory_order_release);
}

void ProgressThread::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!running_.load(std::memory_order_relaxed)) return;
    stopping_ = true;
    running_.store(false, std::memory_order_release);
  }
  wake_.notify_all();
  thread_.join();
}

void ProgressThread::submit(ProgressTask& task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task.finished_.store(false, std::memory_order_relaxed);
    task.prev_ = nullptr;
    task.next_ = head_;
    if (head_ != nullptr) head_->prev_ = &task;
    head_ = &task;
    task.queued_ = true;
    task.submitted_ns_ = Tracer::now_ns();
    ++count_;
  }
  wake_.notify_one();
}

bool ProgressThread::reclaim(ProgressTask& task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!task.queued_) return false;
  unlink(task);
  return true;
}

std::size_t ProgressThread::queued_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_;
}

void ProgressThread::unlink(ProgressTask& task) {
  if (task.prev_ != nullptr) {
    task.prev_->next_ = task.next_;
  } else {
    head_ = task.next_;
  }
  if (task.next_ != nullptr) task.next_->prev_ = task.prev_;
  task.prev_ = task.next_ = nullptr;
  task.queued_ = false;
  --count_;
}

void ProgressThread::loop() {
  // In a trace window, each operation this thread completes is a span from its hand-over to
  // the pass that saw it complete: when it really moved, beside the step's start and wait.
  const TraceLaneScope lane("communication thread");
  int polls = 0;  // passes since the queue was last empty
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (head_ == nullptr) {
      polls = 0;
      wake_.wait(lock, [&] { return stopping_ || head_ != nullptr; });
    }
    if (stopping_) return;
    for (ProgressTask* task = head_; task != nullptr;) {
      ProgressTask* next = task->next_;
      if (task->step()) {
        unlink(*task);
        if (tracer().on()) {
          TraceEvent event;
          event.name = "operation in flight";
          event.kind = TraceKind::collective;
          event.begin_ns = task->submitted_ns_;
          event.end_ns = Tracer::now_ns();
          tracer().record(event);
        }
        task->finished_.store(true, std::memory_order_release);
      }
      task = next;
    }
    passes_.fetch_add(1, std::memory_order_relaxed);
    if (head_ == nullptr) continue;
    // Tasks still pending: give the core away before the next pass (the submitter may be
    // waiting for the mutex; computing threads may need the core).
    lock.unlock();
    if (++polls <= kYieldPolls) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(kPollSleepMicroseconds));
    }
    lock.lock();
  }
}

ProgressThread& comm_progress() {
  static ProgressThread* const thread = new ProgressThread();  // never destroyed (see header)
  return *thread;
}

ProgressThread* running_comm_progress() {
  ProgressThread& thread = comm_progress();
  return thread.running() ? &thread : nullptr;
}

namespace {
int lease_count = 0;  // main thread only
}  // namespace

CommThreadLease::CommThreadLease() {
  if (lease_count++ == 0) comm_progress().start();
}

CommThreadLease::~CommThreadLease() {
  if (--lease_count == 0) comm_progress().stop();
}

}  // namespace meshtrain
