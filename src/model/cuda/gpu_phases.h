// The phases of a GPU training step that the phase clock (core/cuda/phase_clock.h)
// charges time to: the model's parts, the optimizer and the host's gaps between them.
#pragma once
#include <string>
#include <vector>

namespace moe {

enum GpuPhase : int {
  kAttention, kRouter, kDispatch, kExperts, kCombine, kAllToAll, kDenseFfn, kNorms, kEmbedding, kHeadLoss, kOptimizer,
  kHost, kPhaseCount
};

inline std::vector<std::string> gpu_phase_names() {
  return {"attention", "router",    "dispatch",     "experts",      "combine",   "all-to-all",
          "dense FFN", "norms+residual", "embedding", "LM head+loss", "optimizer", "host gaps"};
}

}  // namespace moe
