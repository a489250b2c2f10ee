// The communication thread's hand-off (framework/comm/progress_thread.hpp) under
// ThreadSanitizer: built with -fsanitize=thread (tests/comm.cmake), no MPI. Tasks write their
// data in step() on the progress thread; the submitter reads it after finished() (as the MPI
// backend's test() does) or after taking the task back and finishing it itself (as wait()
// does), and stops the thread with tasks still queued. A data race makes ThreadSanitizer fail
// the program; wrong data makes it exit 1.

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "framework/comm/progress_thread.hpp"

namespace {

struct Task final : meshtrain::ProgressTask {
  bool step() noexcept override {
    for (int& d : data) ++d;
    return --left <= 0;
  }
  int left = 0;
  int data[32] = {};
};

}  // namespace

int main() {
  meshtrain::ProgressThread thread;
  thread.start();
  std::vector<Task> tasks(16);
  for (int round = 0; round < 1000; ++round) {
    for (std::size_t k = 0; k < tasks.size(); ++k) {
      tasks[k].left = 1 + static_cast<int>((round + k) % 5);
      for (int& d : tasks[k].data) d = 0;
      thread.submit(tasks[k]);
    }
    for (std::size_t k = 0; k < tasks.size(); ++k) {
      Task& task = tasks[k];
      const int steps = 1 + static_cast<int>((round + k) % 5);
      if (k % 2 == 0) {
        if (thread.reclaim(task)) {
          while (!task.step()) {
          }
        }
      } else {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (!task.finished() && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::yield();
        }
      }
      for (int d : task.data) {
        if (d != steps) {
          std::fprintf(stderr, "round %d task %zu: data %d, want %d\n", round, k, d, steps);
          return 1;
        }
      }
    }
  }
  Task left_queued;
  left_queued.left = 1 << 30;
  thread.submit(left_queued);
  thread.stop();
  if (!thread.reclaim(left_queued)) return 1;
  std::printf("progress_thread_tsan: 16000 hand-offs, no wrong data\n");
  return 0;
}
