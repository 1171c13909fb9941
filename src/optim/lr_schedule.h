// Learning rate: linear warmup to the peak, then cosine decay to peak * min_ratio at
// the last step.
#pragma once
#include <cstdint>

#include "config/optimizer_config.h"

namespace moe {

// lr for optimizer step `step` (0-based) of `total_steps`.
double learning_rate(const LrConfig& lr, int64_t step, int64_t total_steps);

}  // namespace moe
