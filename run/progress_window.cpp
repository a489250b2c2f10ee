#include "run/progress_window.hpp"

#include <algorithm>
#include <chrono>

namespace meshtrain {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void ProgressWindow::start() {
  start_s_ = now();
  paused_s_ = 0.0;
  saving_s_ = 0.0;
  saved_ = false;
}

ProgressWindow::Times ProgressWindow::times() const {
  Times t;
  // Clamped: rounding of the parts may leave a hair below zero when the steps took no time.
  t.step_s = std::max(0.0, now() - start_s_ - paused_s_ - saving_s_);
  t.save_s = saving_s_;
  t.saved = saved_;
  return t;
}

}  // namespace meshtrain
