// Learning-rate schedules: values at chosen steps against hand-computed ones (torchtitan's
// conventions), and names parsed with one sentence for a bad one.

#include "framework/train/lr_schedule.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

constexpr double kPi = 3.14159265358979323846;

TEST(LrSchedule, WarmupRisesLinearlyToThePeak) {
  // lr 0.4, 3 warm-up steps: 0.4 * 1/4, 2/4, 3/4, then the peak.
  LrSchedule s{LrScheduleKind::constant, 0.4, 0.0, 3, 100};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(1), 0.2);
  EXPECT_DOUBLE_EQ(s.at(2), 0.30000000000000004);
  EXPECT_DOUBLE_EQ(s.at(3), 0.4);
  EXPECT_DOUBLE_EQ(s.at(99), 0.4);
  EXPECT_DOUBLE_EQ(s.at(500), 0.4);
}

TEST(LrSchedule, LinearDecayFromPeakToMinLr) {
  // warm-up 2, total 12: decay over 10 steps, p = (s - 2) / 10.
  LrSchedule s{LrScheduleKind::linear, 1.0, 0.1, 2, 12};
  EXPECT_DOUBLE_EQ(s.at(0), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(s.at(2), 1.0);
  EXPECT_DOUBLE_EQ(s.at(7), 1.0 - 0.9 * 0.5);   // p = 0.5
  EXPECT_DOUBLE_EQ(s.at(11), 1.0 - 0.9 * 0.9);  // the last step, p = 0.9
  EXPECT_DOUBLE_EQ(s.at(12), 0.1);              // past the end: the final rate
  EXPECT_DOUBLE_EQ(s.at(40), 0.1);
}

TEST(LrSchedule, CosineDecayFromPeakToMinLr) {
  LrSchedule s{LrScheduleKind::cosine, 2e-3, 2e-4, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(4), 2e-3 * 5.0 / 11.0);
  EXPECT_DOUBLE_EQ(s.at(10), 2e-3);                   // p = 0: cos 0 = 1
  EXPECT_NEAR(s.at(60), 2e-4 + 1.8e-3 * 0.5, 1e-18);  // p = 0.5: halfway
  EXPECT_NEAR(s.at(35), 2e-4 + 1.8e-3 * 0.5 * (1.0 + std::cos(kPi * 0.25)), 1e-18);
  EXPECT_NEAR(s.at(110), 2e-4, 1e-18);  // p = 1
  // Monotone after warm-up.
  for (int64_t step = 10; step < 110; ++step) EXPECT_LE(s.at(step + 1), s.at(step)) << step;
}

TEST(LrSchedule, NoWarmupStartsAtThePeak) {
  LrSchedule s{LrScheduleKind::cosine, 0.5, 0.0, 0, 4};
  EXPECT_DOUBLE_EQ(s.at(0), 0.5);
  EXPECT_NEAR(s.at(2), 0.25, 1e-15);
}

TEST(LrSchedule, NamesParseAndBadOnesAreOneSentence) {
  EXPECT_EQ(parse_lr_schedule("cosine"), LrScheduleKind::cosine);
  EXPECT_EQ(parse_lr_schedule("linear"), LrScheduleKind::linear);
  EXPECT_EQ(parse_lr_schedule("constant"), LrScheduleKind::constant);
  EXPECT_STREQ(to_string(LrScheduleKind::cosine), "cosine");
  testing::expect_bad_input(
      [] { parse_lr_schedule("step"); },
      {"optimizer.schedule = 'step' is not one of constant | linear | cosine"});
}

}  // namespace
}  // namespace meshtrain
