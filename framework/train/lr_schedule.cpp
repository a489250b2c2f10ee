#include "framework/train/lr_schedule.hpp"

#include <algorithm>
#include <cmath>

namespace meshtrain {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) {
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps + 1);
  }
  if (kind == LrScheduleKind::constant) return lr;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
  if (kind == LrScheduleKind::linear) return lr + (min_lr - lr) * progress;
  const double pi = 3.14159265358979323846;
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(pi * progress));
}

}  // namespace meshtrain
