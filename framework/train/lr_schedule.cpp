#include "framework/train/lr_schedule.hpp"

#include <algorithm>
#include <cmath>

#include "partition/error.hpp"

namespace meshtrain {

LrScheduleKind parse_lr_schedule(const std::string& name, const std::string& key) {
  if (name == "constant") return LrScheduleKind::constant;
  if (name == "linear") return LrScheduleKind::linear;
  if (name == "cosine") return LrScheduleKind::cosine;
  MESHTRAIN_BAD_INPUT(key, " = \"", name,
                      "\" is not a schedule (expected constant, linear or cosine)");
}

const char* to_string(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::linear:
      return "linear";
    case LrScheduleKind::cosine:
      return "cosine";
    case LrScheduleKind::constant:
      break;
  }
  return "constant";
}

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
