// The board summary (obs/board_power.h): means, extremes and the capped fractions of a
// hand-made run, and the line `moe bench` prints from it.
#include <gtest/gtest.h>

#include "obs/board_power.h"

namespace moe {
namespace {

TEST(BoardPower, SummaryOfHandMadeSamples) {
  // Idle-to-busy at 1980 MHz, then held down by the power limit, one thermal sample.
  const std::vector<BoardSample> samples = {
      {1980, 300, false, false}, {1740, 690, true, false}, {1500, 705, true, false}, {1620, 698, true, true}};
  const BoardSummary s = summarize_board(samples, 1980, 700);
  EXPECT_EQ(s.samples, 4);
  EXPECT_DOUBLE_EQ(s.sm_mhz_mean, (1980.0 + 1740 + 1500 + 1620) / 4);
  EXPECT_DOUBLE_EQ(s.sm_mhz_min, 1500);
  EXPECT_DOUBLE_EQ(s.sm_mhz_max, 1980);
  EXPECT_DOUBLE_EQ(s.power_w_mean, (300.0 + 690 + 705 + 698) / 4);
  EXPECT_DOUBLE_EQ(s.power_w_max, 705);
  EXPECT_DOUBLE_EQ(s.power_capped, 0.75);
  EXPECT_DOUBLE_EQ(s.thermal, 0.25);
  EXPECT_EQ(describe_board(s),
            "SM clock 1710 MHz mean (1500-1980, the board's maximum 1980), power 598 W mean (705 max) of a 700 W "
            "limit; held down by the power limit in 75%, by temperature in 25% of 4 samples");
}

TEST(BoardPower, UnknownLimitsAndNoSamples) {
  const BoardSummary none = summarize_board({}, 1980, 700);
  EXPECT_EQ(none.samples, 0);
  EXPECT_EQ(describe_board(none), "no samples");
  const BoardSummary s = summarize_board({{1410, 120, false, false}}, 0, 0);
  EXPECT_EQ(describe_board(s),
            "SM clock 1410 MHz mean (1410-1410), power 120 W mean (120 max); held down by the power limit in 0% of 1 "
            "samples");
}

TEST(BoardPower, TheSmsCountBesideNvmlsClock) {
  BoardSummary s = summarize_board({{1500, 690, true, false}}, 1980, 700);
  s.sm_mhz_counted = 1393.4;
  EXPECT_EQ(describe_board(s),
            "SM clock 1500 MHz mean (1500-1500, the board's maximum 1980; the SMs counted 1393), power 690 W mean (690 "
            "max) of a 700 W limit; held down by the power limit in 100% of 1 samples");
  BoardSummary counted_only;
  counted_only.sm_mhz_counted = 1700;
  EXPECT_EQ(describe_board(counted_only), "the SMs counted 1700 MHz; NVML not sampled");
}

}  // namespace
}  // namespace moe
