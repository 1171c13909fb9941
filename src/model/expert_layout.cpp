#include "model/expert_layout.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

RangeList own_expert_ranges(const ExpertLayout& layout, int ep_rank) {
  RangeList ranges;
  for (const MoeLayerExperts& layer : layout) {
    const int64_t first = layer.slots.window_first(ep_rank), count = layer.slots.window_size(ep_rank);
    if (count == 0) continue;
    for (const Range& tensor : layer.tensors) {
      const int64_t per_expert = tensor.count / layer.slots.n_experts();
      ranges.push_back({tensor.offset + first * per_expert, count * per_expert});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

RangeList resident_ranges(const ExpertLayout& layout, int ep_rank, int64_t storage) {
  RangeList experts;
  for (const MoeLayerExperts& layer : layout) experts.insert(experts.end(), layer.tensors.begin(), layer.tensors.end());
  std::sort(experts.begin(), experts.end());
  const RangeList others = subtract_ranges(experts, own_expert_ranges(layout, ep_rank));
  return subtract_ranges({{0, storage}}, others);
}

RangeList hinge_ranges(const ExpertLayout& layout) {
  RangeList ranges;
  for (const MoeLayerExperts& layer : layout) {
    if (!layer.slots.split) continue;
    const std::vector<std::vector<int>> holders = slot_holders(layer.slots);
    for (const Range& tensor : layer.tensors) {
      const int64_t per_expert = tensor.count / layer.slots.n_experts();
      for (size_t slot = 0; slot < holders.size(); ++slot)
        if (holders[slot].size() > 1)
          ranges.push_back({tensor.offset + static_cast<int64_t>(slot) * per_expert, per_expert});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

std::vector<char> hinge_flags(const ExpertLayout& layout) {
  std::vector<char> flags;
  for (const MoeLayerExperts& layer : layout) {
    const size_t at = flags.size();
    flags.resize(at + static_cast<size_t>(layer.slots.n_experts()), 0);
    if (!layer.slots.split) continue;
    const std::vector<std::vector<int>> holders = slot_holders(layer.slots);
    for (size_t slot = 0; slot < holders.size(); ++slot)
      flags[at + static_cast<size_t>(layer.slots.expert_of_slot[slot])] = holders[slot].size() > 1;
  }
  return flags;
}

std::vector<double> to_expert_order(const ExpertLayout& layout, const std::vector<double>& per_slot) {
  std::vector<double> by_expert(per_slot.size());
  size_t at = 0;
  for (const MoeLayerExperts& layer : layout) {
    const size_t n = static_cast<size_t>(layer.slots.n_experts());
    MOE_CHECK(at + n <= per_slot.size(), "per-expert values: {} for more expert slots", per_slot.size());
    for (size_t slot = 0; slot < n; ++slot)
      by_expert[at + static_cast<size_t>(layer.slots.expert_of_slot[slot])] = per_slot[at + slot];
    at += n;
  }
  MOE_CHECK(at == per_slot.size(), "per-expert values: {} values for {} expert slots", per_slot.size(), at);
  return by_expert;
}

}  // namespace moe
