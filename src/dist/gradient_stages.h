// Which parts of the gradient block are complete after each stage of the backward
// (Transformer::backward_stage_of: stage 0 the LM head and final norm, 1 + i block
// n_layers - 1 - i, n_layers + 1 the embedding), for reductions that start while the
// backward goes on (GPU data parallelism).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/range.h"
#include "model/parameters.h"

namespace moe::dist {

// All the ranges of all the stages, sorted, touching ones merged (they must not overlap).
RangeList merged_ranges(const std::vector<std::vector<RangeList>>& stage_sets);

// Per stage 0 .. n_stages - 1, the ranges of the parameters whose gradients that stage
// completes, each with the alignment padding behind it (zeros, so summing it is harmless)
// and adjacent ones merged; together the stages cover [0, params.storage_numel()) exactly
// once. Throws if stage_of names a stage outside [0, n_stages).
std::vector<RangeList> gradient_ranges_by_stage(const ParameterStore<float>& params,
                                                  const std::function<int(const std::string&)>& stage_of,
                                                  int n_stages);
// The same over a layout known before allocating (`params` registered only):
// `offsets` as ParameterStore::planned_offsets gives them, size() + 1 entries, the block's
// size last (the memory planner builds the GPU's stages from it, train/state_memory.h).
std::vector<RangeList> gradient_ranges_by_stage(const ParameterStore<float>& params,
                                                  const std::vector<int64_t>& offsets,
                                                  const std::function<int(const std::string&)>& stage_of,
                                                  int n_stages);

// Expert parallelism: the same ranges per stage, split into the part every rank sums over
// all data-parallel ranks (`shared`: every parameter without an expert_group, padding
// included, and with split experts every hinge slot, whose holders each computed part of
// its gradient) and this EP rank's other experts (`own_experts`: experts [first_expert,
// first_expert + local_experts) of each tensor with an expert_group, whose leading
// dimension is the experts, less the hinges), summed only over the ranks holding the same
// experts. The other experts' gradients are in neither: this rank does not compute them.
struct ExpertParallelRanges {
  std::vector<RangeList> shared, own_experts;
  // What this rank's optimizer steps: the parameters without an expert_group and its own
  // experts, the hinges it holds included (the other experts get no gradient here; their
  // holders step them).
  RangeList stepped_ranges;
  const RangeList& stepped() const { return stepped_ranges; }
};
ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, int64_t first_expert, int64_t local_experts);
// The same with this rank's part of the expert tensors given as block ranges (sorted,
// disjoint, each inside one expert tensor): after a re-placement by load an EP rank's
// slots differ per MoE layer (own_expert_ranges in model/expert_layout.h). `hinges`: the
// hinge slots of every rank (hinge_ranges there; the same on all).
ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, const RangeList& own_experts,
                                                 const RangeList& hinges = {});
// The same split of `whole` (gradient_ranges_by_stage's) given the expert tensors' block
// ranges (sorted): for layouts known before allocating (the memory planner).
ExpertParallelRanges split_expert_stages(const std::vector<RangeList>& whole, const RangeList& expert_tensors,
                                         const RangeList& own_experts, const RangeList& hinges = {});

}  // namespace moe::dist
