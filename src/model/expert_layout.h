// Where the experts lie in a parameter block: per MoE layer, its placement (ExpertSlots;
// the expert tensors' leading dimension is its slots) and the expert tensors' ranges. The
// ranges an expert-parallel rank's gradients and optimizer cover, and the conversion of
// per-slot values to expert order, are pure functions of it (the GPU model hands it out:
// GpuTransformer::expert_layout; host code, tested without a GPU).
#pragma once
#include <cstdint>
#include <vector>

#include "core/range.h"
#include "moe/expert_slots.h"

namespace moe {

struct MoeLayerExperts {
  ExpertSlots slots;
  RangeList tensors;  // each expert tensor (w1, w3, w2): [offset, numel), E slots of numel / E
};
// The model's MoE layers in order (also the expert groups' order of the optimizer).
using ExpertLayout = std::vector<MoeLayerExperts>;

// The ranges of EP rank `ep_rank`'s window (its slots) in every expert tensor, sorted: the
// gradients it sums over the ranks holding the same experts.
RangeList own_expert_ranges(const ExpertLayout& layout, int ep_rank);
// The ranges of a `storage`-element block that EP rank `ep_rank` keeps memory for: all of
// it but the expert tensors' slots outside its window (the other ranks' experts).
RangeList resident_ranges(const ExpertLayout& layout, int ep_rank, int64_t storage);
// With split experts, the ranges of every hinge slot (held by two or more ranks), sorted,
// the same on every rank: partial gradients summed over all ranks. Empty without.
RangeList hinge_ranges(const ExpertLayout& layout);
// Per expert, MoE layer after layer in expert order: whether it sits in a hinge slot.
std::vector<char> hinge_flags(const ExpertLayout& layout);
// Per-slot values (MoE layer after layer, slot by slot; GpuOptimizer::clip_expert_grads)
// -> the same in expert order. Throws unless there is one value per slot.
std::vector<double> to_expert_order(const ExpertLayout& layout, const std::vector<double>& per_slot);

}  // namespace moe
