#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace moe {

double learning_rate(const LrConfig& lr, int64_t step, int64_t total_steps) {
  if (step < lr.warmup_steps)
    return lr.peak * static_cast<double>(step + 1) / static_cast<double>(lr.warmup_steps);
  const double floor = lr.peak * lr.min_ratio;
  const int64_t decay_steps = total_steps - lr.warmup_steps - 1;
  if (decay_steps <= 0) return lr.peak;
  const double progress =
      std::clamp(static_cast<double>(step - lr.warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return floor + (lr.peak - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace moe
