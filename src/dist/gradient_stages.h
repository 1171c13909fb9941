// Which parts of the gradient block are complete after each stage of the backward
// (Transformer::backward_stage_of: stage 0 the LM head and final norm, 1 + i block
// n_layers - 1 - i, n_layers + 1 the embedding), for reductions that start while the
// backward goes on (GPU data parallelism).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "model/parameters.h"

namespace moe::dist {

// [offset, count) ranges of the gradient block.
using BlockRanges = std::vector<std::pair<int64_t, int64_t>>;

// Appends [begin, begin + count) (nothing when count <= 0), merged into the last range
// when the two touch.
void append_merged(BlockRanges& ranges, int64_t begin, int64_t count);
// All the ranges of all the stages, sorted, touching ones merged (they must not overlap).
BlockRanges merged_ranges(const std::vector<std::vector<BlockRanges>>& stage_sets);

// Per stage 0 .. n_stages - 1, the ranges of the parameters whose gradients that stage
// completes, each with the alignment padding behind it (zeros, so summing it is harmless)
// and adjacent ones merged; together the stages cover [0, params.storage_numel()) exactly
// once. Throws if stage_of names a stage outside [0, n_stages).
std::vector<BlockRanges> gradient_ranges_by_stage(const ParameterStore<float>& params,
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
  std::vector<BlockRanges> shared, own_experts;
  // What this rank's optimizer steps: the parameters without an expert_group and its own
  // experts, the hinges it holds included (the other experts get no gradient here; their
  // holders step them).
  BlockRanges stepped_ranges;
  const BlockRanges& stepped() const { return stepped_ranges; }
};
ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, int64_t first_expert, int64_t local_experts);
// The same with this rank's part of the expert tensors given as block ranges (sorted,
// disjoint, each inside one expert tensor): after a re-placement by load an EP rank's
// slots differ per MoE layer (GpuTransformer::own_expert_ranges). `split_expert_ranges`:
// the hinge slots of every rank (GpuTransformer::split_expert_ranges; the same on all).
ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, const BlockRanges& own_expert_ranges,
                                                 const BlockRanges& split_expert_ranges = {});

// The parts of sorted, disjoint ranges `from` outside sorted, disjoint ranges `minus`.
BlockRanges subtract_ranges(const BlockRanges& from, const BlockRanges& minus);

}  // namespace moe::dist
