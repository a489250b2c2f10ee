#pragma once
// The learning rate of each optimizer step ([optimizer] schedule, warmup_steps, min_lr),
// following torchtitan's schedulers:
//
//   warmup   steps s = 0 .. warmup_steps-1:  lr * (s + 1) / (warmup_steps + 1)
//   then, with p = (s - warmup_steps) / (total_steps - warmup_steps) going 0 -> 1:
//     constant  lr
//     linear    lr + (min_lr - lr) * p
//     cosine    min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
//
// s is the 0-based index of the step about to be taken. It depends on nothing but the
// step index, so a resumed run continues the schedule exactly.

#include <cstdint>

#include "framework/core/choices.hpp"

namespace meshtrain {

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::constant;
  double lr = 1e-3;          // the peak rate, reached after warm-up
  double min_lr = 0.0;       // where linear and cosine end
  int64_t warmup_steps = 0;  // 0: no warm-up
  int64_t total_steps = 1;   // the run's last step index + 1

  // The rate of step `step` (0-based). Steps past total_steps keep the final rate.
  double at(int64_t step) const;
};

}  // namespace meshtrain
