// What the GPU board did during a run: its SM clock and power draw, sampled at a fixed
// period (obs/cuda/board_sampler.h reads them through NVML) and summarised. An H200 runs
// long training steps at its power limit, where the SM clock falls well below its
// maximum (BENCHMARKS.md, "Where the fp8 step's missing time goes"), so a step time or an
// MFU says little without the clock it ran at.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moe {

struct BoardSample {
  double sm_mhz = 0;
  double power_w = 0;
  bool power_capped = false;  // the driver held the clock down for the power limit
  bool thermal = false;       // ... or for temperature
};

struct BoardSummary {
  int64_t samples = 0;
  double sm_mhz_mean = 0, sm_mhz_min = 0, sm_mhz_max = 0;
  double power_w_mean = 0, power_w_max = 0;
  double power_capped = 0, thermal = 0;      // fractions of the samples
  double max_sm_mhz = 0, power_limit_w = 0;  // the board's (0: unknown)
  // The SM clock the SMs counted over the same time (their cycle counters against the GPU's
  // timer, core/cuda/sm_clocks.h; 0: not counted): under the power limit the GEMMs run ~10%
  // below the clock NVML reports (BENCHMARKS.md "Each phase's SM clock").
  double sm_mhz_counted = 0;
};

BoardSummary summarize_board(const std::vector<BoardSample>& samples, double max_sm_mhz, double power_limit_w);

// One line: "SM clock 1739 MHz mean (1395-1980, the board's maximum 1980; the SMs counted
// 1640), power 640 W mean (707 max) of a 700 W limit; held down by the power limit in 89% of
// 19 samples" (the count where there is one).
std::string describe_board(const BoardSummary& summary);

}  // namespace moe
