// The device bytes of one GPU rank's parameter state (bf16 weights, int16 lo halves, fp32
// gradients, AdamW moments) as GpuParameterStore allocates them, ZeRO included, computed
// on the host from the parameter layout: the memory planner's (train/memory_plan.h) state
// components. It calls what the GPU code calls: the backward stages
// (Transformer::backward_stage_of, dist::gradient_ranges_by_stage), the ZeRO plan
// (dist::plan_zero_shards), the packed optimizer state and the stage sharing
// (model/gpu_state_layout.h), the resident chunks and pools (core/resident_chunks.h).
// docs/MEMORY_PLAN.md.
#pragma once
#include <cstdint>
#include <vector>

#include "config/model_config.h"
#include "core/range.h"
#include "model/gpu_state_layout.h"
#include "model/parameters.h"

namespace moe {

// The parameter block as the GPU model lays it out, from the config alone: `specs` is
// Transformer<float>::parameter_specs(config) (registered, not allocated).
struct ParameterBlockLayout {
  int64_t storage = 0;             // elements, alignment padding included
  std::vector<RangeList> stages;   // per backward stage: the ranges it completes (padding included)
  RangeList fp32_copies;           // the router biases, each padded to 16: stepped whole under ZeRO
};
ParameterBlockLayout parameter_block_layout(const ModelConfig& config, const ParameterStore<float>& specs);

// ResidentBlock's mapping granularity the estimate assumes (2 MiB on Hopper).
constexpr int64_t kResidentGranularity = int64_t{2} << 20;

// GpuParameterStore's bytes on one rank.
struct StateBytes {
  int64_t weights = 0;    // the bf16 hi halves' block (ZeRO 3: the chunks of its own ranges)
  int64_t master_lo = 0;  // the int16 lo halves (ZeRO 1+: packed, its pieces only)
  int64_t gradients = 0;  // fp32 (ZeRO 2+: the chunks of its own ranges)
  int64_t moments = 0;    // m and v (ZeRO 1+: packed)
  int64_t pools = 0;      // ZeRO 2-3: the two parity pools of the gradients, and of the weights
  int64_t total() const { return weights + master_lo + gradients + moments + pools; }
};

// One GPU holding the whole block with bf16 gradients on `bf16_ranges` (the expert
// tensors; training.expert_grad_dtype = bf16): GpuParameterStore's fp32 gradient block
// resident elsewhere, its bf16 one there.
int64_t split_gradient_bytes(const ParameterBlockLayout& block, const RangeList& bf16_ranges);

// A rank whose blocks hold `resident` (element ranges, sorted; the whole block without
// expert parallelism) at ZeRO level `zero`, stepping `kept` (its ZeroShardPlan::update;
// unused at level 0): pack_optimizer_state(kept) at 1+, share_gradients at 2+,
// share_weights at 3, over the stages' ranges it holds (`held_stages`; null: block.stages,
// the whole block's); `pairs`: the store's interleaved gate|up (share_weights keeps the hi
// halves of `kept` where they lie: model/gpu_state_layout.h hi_ranges). `moment_bytes`: 4 (fp32 moments), 2 (bf16) or 1 (fp8 codes; memory_plan.cpp adds their scales).
StateBytes rank_state_bytes(const ParameterBlockLayout& block, const RangeList& resident, int64_t zero,
                            const RangeList& kept, int64_t moment_bytes,
                            const std::vector<RangeList>* held_stages = nullptr,
                            const std::vector<HiInterleave>& pairs = {});

// Data parallelism without expert parallelism (GpuBackend::make_data_parallel): ZeRO
// `zero` over `ranks` ranks, gradient buckets of `bucket_elems` (gradient_bucket_elems),
// the router biases kept whole. The larger of rank 0's and the last rank's state (the
// ranks differ only at the ends of the stages' ranges): two plans, whatever the ranks.
// `pairs`: the GPU store's interleaved gate|up (training.interleave_gate_up), which the
// ZeRO plan cuts at expert slices (dist::plan_zero_shards).
// Expert parallelism over `ranks` ranks in EP groups of `ep` (GpuBackend::make_data_parallel):
// EP rank p holds `own_experts[p]` (block ranges of its slots, own_expert_ranges) of the
// `expert_tensors` (sorted block ranges) and every other parameter; at ZeRO 1+ the shared
// parameters sharded over all ranks, its experts over their replicas
// (dist::plan_expert_parallel_zero). The largest rank's state (at ZeRO 1+ of the first, the
// last and the largest level-0 EP rank's first and last replicas).
StateBytes expert_parallel_state_bytes(const ParameterBlockLayout& block, const RangeList& expert_tensors,
                                       const std::vector<RangeList>& own_experts, int64_t zero, int ranks,
                                       int64_t bucket_elems, int64_t moment_bytes);

StateBytes data_parallel_state_bytes(const ParameterBlockLayout& block, int64_t zero, int ranks, int64_t bucket_elems,
                                     int64_t moment_bytes, const std::vector<HiInterleave>& pairs = {});

}  // namespace moe
