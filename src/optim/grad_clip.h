// Gradient-norm clipping: per expert (each expert's parameters in one MoE layer clipped
// to their own max norm) and global. Norms are summed in fp64 in a fixed order, so they
// do not depend on the thread count.
#pragma once
#include <cstdint>

#include "model/parameters.h"

namespace moe {

struct ClipStats {
  double global_norm = 0;       // before global clipping (after per-expert clipping)
  double max_expert_norm = 0;   // largest per-expert norm, before per-expert clipping
  int64_t experts_clipped = 0;  // experts whose gradients were scaled down
  bool global_clipped = false;
};

// Sum of squares of `count` values, in fixed-size chunks summed in order (each chunk in
// kernels/adamw_math.h's order, the GPU's).
double sum_of_squares(const float* values, int64_t count);

// Clips every expert's gradient (when max_expert_norm > 0), then the global gradient
// (when max_global_norm > 0). Returns the norms it saw.
ClipStats clip_gradients(ParameterStore<float>& params, double max_global_norm, double max_expert_norm);

}  // namespace moe
