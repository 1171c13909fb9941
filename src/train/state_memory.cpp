#include "train/state_memory.h"

#include <string>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/resident_chunks.h"
#include "dist/gradient_stages.h"
#include "dist/zero_shards.h"
#include "model/gpu_state_layout.h"
#include "model/transformer.h"

namespace moe {
namespace {

// The chunks of a ResidentBlock of `storage` elements of `elem` bytes covering `elements`.
int64_t resident_bytes(const RangeList& elements, int64_t elem, int64_t storage) {
  const int64_t chunk = resident_chunk_bytes(storage * elem, kResidentGranularity);
  return covering_chunk_count(byte_ranges(elements, elem), chunk) * chunk;
}

// share_stages over a block of `elem` bytes per element: its own chunks, and its pools.
struct SharedBlockBytes {
  int64_t own = 0, pools = 0;
};
SharedBlockBytes shared_block_bytes(const ParameterBlockLayout& block, const std::vector<RangeList>& stages,
                                    const RangeList& kept, int64_t elem) {
  const StageSharing sharing = share_by_stages(kept, stages);
  const int64_t bytes = block.storage * elem, chunk = resident_chunk_bytes(bytes, kResidentGranularity);
  std::vector<char> taken(static_cast<size_t>((bytes + chunk - 1) / chunk), 0);
  const RangeList own = byte_ranges(sharing.own, elem);
  mark_covering_chunks(own, chunk, taken);
  std::vector<RangeList> groups;
  for (const RangeList& group : sharing.groups) groups.push_back(byte_ranges(group, elem));
  SharedBlockBytes out;
  out.own = covering_chunk_count(own, chunk) * chunk;
  for (int64_t chunks : pool_chunk_counts(assign_shared_chunks(groups, chunk, taken), sharing.pools))
    out.pools += chunks * chunk;
  return out;
}

}  // namespace

ParameterBlockLayout parameter_block_layout(const ModelConfig& config, const ParameterStore<float>& specs) {
  const std::vector<int64_t> offsets = specs.planned_offsets();
  ParameterBlockLayout block;
  block.storage = offsets.back();
  block.stages = dist::gradient_ranges_by_stage(
      specs, offsets, [&](const std::string& name) { return Transformer<float>::backward_stage_of(config, name); },
      Transformer<float>::backward_stages(config));
  // GpuFp32Copies::ranges, as the store keeps them.
  for (const int id : fp32_copy_ids(specs))
    block.fp32_copies.push_back({offsets[static_cast<size_t>(id)], (specs.numel(id) + 15) / 16 * 16});
  return block;
}

int64_t split_gradient_bytes(const ParameterBlockLayout& block, const RangeList& bf16_ranges) {
  const int64_t n = block.storage;
  const RangeList bf16 = merge_ranges(bf16_ranges);
  return resident_bytes(subtract_ranges({{0, n}}, bf16), 4, n) + (bf16.empty() ? 0 : resident_bytes(bf16, 2, n));
}

StateBytes rank_state_bytes(const ParameterBlockLayout& block, const RangeList& resident, int64_t zero,
                            const RangeList& kept, int64_t moment_bytes, const std::vector<RangeList>* held_stages,
                            const std::vector<HiInterleave>& pairs) {
  const std::vector<RangeList>& stages = held_stages ? *held_stages : block.stages;
  const int64_t n = block.storage;
  StateBytes state;
  state.weights = resident_bytes(resident, 2, n);
  state.master_lo = resident_bytes(resident, 2, n);
  state.gradients = resident_bytes(resident, 4, n);
  state.moments = 2 * resident_bytes(resident, moment_bytes, n);
  if (zero <= 0) return state;
  // pack_optimizer_state: the lo, m and v blocks released, their kept pieces packed.
  // Packed into blocks of their own, mapped in whole chunks.
  const int64_t packed = packed_state_layout(merge_ranges(kept)).total;
  state.master_lo = resident_bytes({{0, packed}}, 2, packed);
  state.moments = 2 * resident_bytes({{0, packed}}, moment_bytes, packed);
  if (zero >= 2) {
    const SharedBlockBytes grads = shared_block_bytes(block, stages, kept, 4);
    state.gradients = grads.own;
    state.pools += grads.pools;
  }
  if (zero >= 3) {
    const SharedBlockBytes weights = shared_block_bytes(block, stages, hi_ranges(pairs, kept), 2);
    state.weights = weights.own;
    state.pools += weights.pools;
  }
  return state;
}

StateBytes expert_parallel_state_bytes(const ParameterBlockLayout& block, const RangeList& expert_tensors,
                                       const std::vector<RangeList>& own_experts, int64_t zero, int ranks,
                                       int64_t bucket_elems, int64_t moment_bytes) {
  const int ep = static_cast<int>(own_experts.size());
  MOE_CHECK(ep >= 1 && ranks % ep == 0, "memory plan: {} ranks in EP groups of {}", ranks, ep);
  // Each EP rank's level-0 state (cheap: chunk counts); at levels 1-3 (a plan per rank) the
  // EP ranks differ only where their ranges meet chunk and bucket edges: the largest at
  // level 0, the first and the last stand for them.
  std::vector<dist::ExpertParallelRanges> ranges_P;
  std::vector<RangeList> resident_P;
  StateBytes largest;
  int largest_p = 0;
  for (int p = 0; p < ep; ++p) {
    ranges_P.push_back(dist::split_expert_stages(block.stages, expert_tensors, own_experts[static_cast<size_t>(p)]));
    RangeList resident;
    for (const auto& stages : {&ranges_P.back().shared, &ranges_P.back().own_experts})
      for (const RangeList& stage : *stages) resident.insert(resident.end(), stage.begin(), stage.end());
    resident_P.push_back(merge_ranges(std::move(resident)));
    const StateBytes state = rank_state_bytes(block, resident_P.back(), 0, {}, moment_bytes);
    if (state.total() > largest.total()) std::tie(largest, largest_p) = std::pair{state, p};
  }
  if (zero <= 0 || ranks <= 1) return largest;
  largest = StateBytes{};
  for (int p : {0, largest_p, ep - 1}) {
    const dist::ExpertParallelRanges& ranges = ranges_P[static_cast<size_t>(p)];
    const RangeList& resident = resident_P[static_cast<size_t>(p)];
    const int replicas = ranks / ep;
    for (int replica : {0, replicas - 1}) {
      const dist::ExpertParallelZero plans = dist::plan_expert_parallel_zero(ranges, block.fp32_copies, bucket_elems,
                                                                             ranks, p + replica * ep, ep);
      const StateBytes state = rank_state_bytes(block, resident, zero, plans.update, moment_bytes, &plans.held);
      if (state.total() > largest.total()) largest = state;
    }
  }
  return largest;
}

StateBytes data_parallel_state_bytes(const ParameterBlockLayout& block, int64_t zero, int ranks, int64_t bucket_elems,
                                     int64_t moment_bytes, const std::vector<HiInterleave>& pairs) {
  const RangeList whole{{0, block.storage}};
  if (zero <= 0 || ranks <= 1) return rank_state_bytes(block, whole, 0, {}, moment_bytes);
  StateBytes largest;
  for (int rank : {0, ranks - 1}) {
    const dist::ZeroShardPlan plan =
        dist::plan_zero_shards(block.stages, block.fp32_copies, bucket_elems, ranks, rank, pairs);
    const StateBytes state = rank_state_bytes(block, whole, zero, plan.update, moment_bytes, nullptr, pairs);
    if (state.total() > largest.total()) largest = state;
  }
  return largest;
}

}  // namespace moe
