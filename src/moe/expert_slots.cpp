#include "moe/expert_slots.h"

#include <numeric>

#include "core/error.h"
#include "moe/token_exchange.h"

namespace moe {

ExpertSlots equal_expert_slots(int64_t n_experts, int ep_size, bool split) {
  ExpertSlots slots;
  slots.expert_of_slot.resize(static_cast<size_t>(n_experts));
  std::iota(slots.expert_of_slot.begin(), slots.expert_of_slot.end(), int64_t{0});
  slots.first_slot_P1 = equal_slot_bounds(n_experts, ep_size);
  slots.window_end_P = slot_window_ends(slots.first_slot_P1, split);
  slots.split = split;
  return slots;
}

ExpertSlots expert_slots_from_blocks(const std::vector<std::vector<int64_t>>& experts_of_rank, bool split) {
  MOE_CHECK(!experts_of_rank.empty(), "expert slots: no ranks");
  ExpertSlots slots;
  slots.first_slot_P1 = {0};
  for (const auto& block : experts_of_rank) {
    slots.expert_of_slot.insert(slots.expert_of_slot.end(), block.begin(), block.end());
    slots.first_slot_P1.push_back(static_cast<int64_t>(slots.expert_of_slot.size()));
  }
  const int64_t E = slots.n_experts();
  std::vector<char> seen(static_cast<size_t>(E), 0);
  for (int64_t expert : slots.expert_of_slot) {
    MOE_CHECK(expert >= 0 && expert < E && !seen[static_cast<size_t>(expert)],
              "expert slots: expert {} out of [0, {}) or placed twice", expert, E);
    seen[static_cast<size_t>(expert)] = 1;
  }
  slots.window_end_P = slot_window_ends(slots.first_slot_P1, split);
  slots.split = split;
  return slots;
}

std::vector<std::vector<int64_t>> expert_blocks(const ExpertSlots& slots) {
  std::vector<std::vector<int64_t>> blocks;
  for (int p = 0; p < slots.ep_size(); ++p)
    blocks.emplace_back(slots.expert_of_slot.begin() + slots.first_slot_P1[static_cast<size_t>(p)],
                        slots.expert_of_slot.begin() + slots.first_slot_P1[static_cast<size_t>(p) + 1]);
  return blocks;
}

std::vector<int32_t> slot_of_expert(const ExpertSlots& slots) {
  std::vector<int32_t> slot_of(slots.expert_of_slot.size());
  for (size_t slot = 0; slot < slots.expert_of_slot.size(); ++slot)
    slot_of[static_cast<size_t>(slots.expert_of_slot[slot])] = static_cast<int32_t>(slot);
  return slot_of;
}

bool slots_in_expert_order(const ExpertSlots& slots) {
  for (size_t slot = 0; slot < slots.expert_of_slot.size(); ++slot)
    if (slots.expert_of_slot[slot] != static_cast<int64_t>(slot)) return false;
  return true;
}

std::vector<int64_t> window_experts(const ExpertSlots& slots, int p) {
  return {slots.expert_of_slot.begin() + slots.window_first(p),
          slots.expert_of_slot.begin() + slots.window_end_P[static_cast<size_t>(p)]};
}

std::vector<std::vector<int>> slot_holders(const ExpertSlots& slots) {
  std::vector<std::vector<int>> holders(slots.expert_of_slot.size());
  for (int p = 0; p < slots.ep_size(); ++p)
    for (int64_t slot = slots.window_first(p); slot < slots.window_end_P[static_cast<size_t>(p)]; ++slot)
      holders[static_cast<size_t>(slot)].push_back(p);
  return holders;
}

int block_rank(const ExpertSlots& slots, int64_t slot) {
  MOE_CHECK(slot >= 0 && slot < slots.n_experts(), "expert slots: slot {} of {}", slot, slots.n_experts());
  int p = 0;
  while (slots.first_slot_P1[static_cast<size_t>(p) + 1] <= slot) ++p;
  return p;
}

std::vector<int32_t> edge_cuts(const ExpertSlots& slots) {
  std::vector<int32_t> cuts;
  for (int64_t first : slots.first_slot_P1) cuts.push_back(static_cast<int32_t>(first * kSlotParts));
  return cuts;
}

}  // namespace moe
