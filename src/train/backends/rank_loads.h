// The metrics' live view of load per expert-parallel rank (StepMetrics::ranks): the experts
// EP rank p holds in any MoE layer (equal blocks, or per layer after a re-placement), each
// with its assignments summed over the layers where p holds it. One rule for the CPU ranks
// and the GPU backend.
#pragma once
#include <vector>

#include "moe/expert_slots.h"
#include "obs/metrics.h"

namespace moe {

// slots_L[i]: MoE layer i's slots; layers[i].tokens_E: its assignments per expert.
std::vector<RankLoad> rank_loads(const std::vector<const ExpertSlots*>& slots_L, const std::vector<LayerRouting>& layers);

}  // namespace moe
