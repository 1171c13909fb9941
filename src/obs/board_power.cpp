#include "obs/board_power.h"

#include <fmt/format.h>

#include <algorithm>

namespace moe {

BoardSummary summarize_board(const std::vector<BoardSample>& samples, double max_sm_mhz, double power_limit_w) {
  BoardSummary s;
  s.max_sm_mhz = max_sm_mhz;
  s.power_limit_w = power_limit_w;
  s.samples = static_cast<int64_t>(samples.size());
  if (samples.empty()) return s;
  s.sm_mhz_min = s.sm_mhz_max = samples.front().sm_mhz;
  for (const BoardSample& b : samples) {
    s.sm_mhz_mean += b.sm_mhz;
    s.sm_mhz_min = std::min(s.sm_mhz_min, b.sm_mhz);
    s.sm_mhz_max = std::max(s.sm_mhz_max, b.sm_mhz);
    s.power_w_mean += b.power_w;
    s.power_w_max = std::max(s.power_w_max, b.power_w);
    s.power_capped += b.power_capped;
    s.thermal += b.thermal;
  }
  const double n = static_cast<double>(samples.size());
  s.sm_mhz_mean /= n;
  s.power_w_mean /= n;
  s.power_capped /= n;
  s.thermal /= n;
  return s;
}

std::string describe_board(const BoardSummary& s) {
  if (s.samples == 0)
    return s.sm_mhz_counted > 0 ? fmt::format("the SMs counted {:.0f} MHz; NVML not sampled", s.sm_mhz_counted)
                                : "no samples";
  std::string out = fmt::format("SM clock {:.0f} MHz mean ({:.0f}-{:.0f}", s.sm_mhz_mean, s.sm_mhz_min, s.sm_mhz_max);
  if (s.max_sm_mhz > 0) out += fmt::format(", the board's maximum {:.0f}", s.max_sm_mhz);
  if (s.sm_mhz_counted > 0) out += fmt::format("; the SMs counted {:.0f}", s.sm_mhz_counted);
  out += fmt::format("), power {:.0f} W mean ({:.0f} max)", s.power_w_mean, s.power_w_max);
  if (s.power_limit_w > 0) out += fmt::format(" of a {:.0f} W limit", s.power_limit_w);
  out += fmt::format("; held down by the power limit in {:.0f}%", 100 * s.power_capped);
  if (s.thermal > 0) out += fmt::format(", by temperature in {:.0f}%", 100 * s.thermal);
  out += fmt::format(" of {} samples", s.samples);
  return out;
}

}  // namespace moe
