// One MoE layer's expert placement as slots: the leading (expert) dimension of the
// layer's expert tensors in the order the EP ranks compute it, each rank one contiguous
// block of slots, whatever experts sit there. The value the GPU model keeps per MoE layer
// (expert_of_slot, first_slot_P1, window_end_P) and the CPU path reads per MoE layer; a
// re-placement (rebalance_layers) gives a new one. Pure functions of the value: every
// rank holding the same ExpertSlots computes the same holders, windows and cuts.
//
// Window: the slots rank p computes, [first_slot_P1[p], window_end_P[p]): its block, and
// with split experts the next block's first slot (a hinge, shared with that block's rank;
// a hinge after empty blocks is shared by three or more ranks). docs/EXPERT_PARALLEL.md
// section 1 has the vocabulary.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe {

struct ExpertSlots {
  std::vector<int64_t> expert_of_slot;  // E: the expert in each slot
  std::vector<int64_t> first_slot_P1;   // P + 1: rank p's block is [first_slot_P1[p], first_slot_P1[p + 1])
  std::vector<int64_t> window_end_P;    // P: rank p computes [first_slot_P1[p], window_end_P[p])
  bool split = false;                   // parallel.split_experts: the windows take the next block's first slot

  int ep_size() const { return static_cast<int>(window_end_P.size()); }
  int64_t n_experts() const { return static_cast<int64_t>(expert_of_slot.size()); }
  int64_t window_first(int p) const { return first_slot_P1[static_cast<size_t>(p)]; }
  int64_t window_size(int p) const { return window_end_P[static_cast<size_t>(p)] - window_first(p); }
  bool operator==(const ExpertSlots&) const = default;
};

// Equal blocks in expert order: the placement before any re-placement. P must divide E.
ExpertSlots equal_expert_slots(int64_t n_experts, int ep_size, bool split);
// Each rank's block of experts (rebalance_layers' and the checkpoints' form) as slots:
// the blocks one after the other. Throws unless every expert of [0, E) is placed once.
ExpertSlots expert_slots_from_blocks(const std::vector<std::vector<int64_t>>& experts_of_rank, bool split);
// The other way: each rank's block of experts, in slot order.
std::vector<std::vector<int64_t>> expert_blocks(const ExpertSlots& slots);
// slot_of_expert[e]: the slot holding expert e (the inverse of expert_of_slot).
std::vector<int32_t> slot_of_expert(const ExpertSlots& slots);
// Whether every expert sits in its own slot (no lookup needed).
bool slots_in_expert_order(const ExpertSlots& slots);
// The experts rank p computes (its window), in slot order.
std::vector<int64_t> window_experts(const ExpertSlots& slots, int p);
// The ranks whose windows hold each slot, lowest first: two or more for a hinge.
std::vector<std::vector<int>> slot_holders(const ExpertSlots& slots);
// The rank whose block holds the slot: every slot has exactly one (the copy that is sent
// when others need the expert, and that counts it once in a norm).
int block_rank(const ExpertSlots& slots, int64_t slot);
// The boundary cuts at the block edges (boundary_cuts' form, in 1 / kSlotParts of a slot):
// the cuts of every micro-batch without split experts.
std::vector<int32_t> edge_cuts(const ExpertSlots& slots);

}  // namespace moe
