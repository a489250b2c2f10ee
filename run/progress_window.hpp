#pragma once
// The time of one progress window of TrainingRun::train() (the steps between two progress
// lines), split into the steps' own time and the time spent saving checkpoints, so that a
// window's samples/s counts its steps alone and the saving is reported beside it. On a clock a
// test may replace.

#include <functional>
#include <utility>

namespace meshtrain {

// Seconds on a monotonic clock.
using SecondsClock = std::function<double()>;
// std::chrono::steady_clock in seconds: the default clock.
double steady_seconds();

class ProgressWindow {
 public:
  explicit ProgressWindow(SecondsClock clock = steady_seconds) : clock_(std::move(clock)) {}

  double now() const { return clock_(); }
  // A new window from now: nothing paused or saved yet.
  void start();
  // Seconds of the window that are not its steps' and not saving (evaluation, the memory
  // figures): left out of both.
  void add_paused(double seconds) { paused_s_ += seconds; }
  // Seconds of the window spent saving (starting a save, completing one, waiting for an
  // asynchronous save's snapshot inside a step): left out of the steps, reported apart.
  void add_saving(double seconds) { saving_s_ += seconds; }
  // A checkpoint was started or completed in the window: its saving time is reported.
  void mark_save() { saved_ = true; }

  struct Times {
    double step_s = 0.0;  // wall time since start() less the paused and saving time
    double save_s = 0.0;  // saving time
    bool saved = false;   // mark_save() was called in the window
  };
  Times times() const;

 private:
  SecondsClock clock_;
  double start_s_ = 0.0;
  double paused_s_ = 0.0;
  double saving_s_ = 0.0;
  bool saved_ = false;
};

}  // namespace meshtrain
