#include "train/backends/rank_loads.h"

#include <algorithm>

namespace moe {

std::vector<RankLoad> rank_loads(const std::vector<const ExpertSlots*>& slots_L, const std::vector<LayerRouting>& layers) {
  std::vector<RankLoad> ranks;
  if (slots_L.empty() || layers.empty()) return ranks;
  const int P = slots_L.front()->ep_size();
  const size_t E = layers.front().tokens_E.size();
  std::vector<std::vector<int64_t>> load_PE(static_cast<size_t>(P), std::vector<int64_t>(E, -1));  // -1: not held
  for (size_t i = 0; i < slots_L.size() && i < layers.size(); ++i) {
    const auto blocks = expert_blocks(*slots_L[i]);
    for (size_t p = 0; p < blocks.size(); ++p)
      for (int64_t e : blocks[p]) {
        int64_t& load = load_PE[p][static_cast<size_t>(e)];
        load = std::max<int64_t>(load, 0) + layers[i].tokens_E[static_cast<size_t>(e)];
      }
  }
  for (int p = 0; p < P; ++p) {
    RankLoad rank;
    rank.rank = p;
    for (size_t e = 0; e < E; ++e)
      if (load_PE[static_cast<size_t>(p)][e] >= 0) {
        rank.experts.push_back(static_cast<int64_t>(e));
        rank.load.push_back(load_PE[static_cast<size_t>(p)][e]);
      }
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

}  // namespace moe
