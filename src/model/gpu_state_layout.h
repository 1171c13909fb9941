// How GpuParameterStore (model/cuda/gpu_parameters.h) lays out a ZeRO rank's state, as host
// code: the store calls these, and the memory planner (train/state_memory.h) counts what
// they give, so the estimate follows the allocation when either changes.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/range.h"
#include "model/parameters.h"

namespace moe {

// The parameters the GPU model also keeps in fp32 (GpuFp32Copies): the MoE layers' router
// biases, which the forward adds to the fp32 logits. Ids in order.
std::vector<int> fp32_copy_ids(const ParameterStore<float>& specs);

// pack_optimizer_state: the lo halves and moments of `ranges` (sorted, disjoint) back to
// back, range i's from at[i] on, congruent to its offset modulo 16 (so the AdamW kernel's
// 16-byte accesses line up as in the block); `total` elements in all, a multiple of 16.
struct PackedState {
  std::vector<int64_t> at;
  int64_t total = 0;
};
PackedState packed_state_layout(const RangeList& ranges);

// share_gradients / share_weights (ZeRO-2/3): which element ranges keep memory of their
// own, and which share memory between uses. `own`: `kept` (the pieces this rank steps), the
// first and last stage whole (the LM head's and the embedding's: tied, one is used in
// both) and the first and last element of every middle stage's ranges (a chunk holding two
// stages' elements stays private). `groups[i]`: middle stage i + 1's ranges outside `own`,
// mapped onto pool `pools[i]` = (i + 1) % 2, the stage's parity: stages two apart are never
// in use at once.
struct StageSharing {
  RangeList own;
  std::vector<RangeList> groups;
  std::vector<int> pools;
};
StageSharing share_by_stages(const RangeList& kept, const std::vector<RangeList>& stage_ranges);

// training.interleave_gate_up: an MoE layer's w1 [E, F, D] at `first` and w3 right after it
// whose hi halves (the bf16 weights the GEMMs read) the store keeps expert by expert, w1_e
// then w3_e, so that [w1_e; w3_e] is one [2F, D] operand (docs/KERNEL_ROADMAP.md); the
// gradients, lo halves and moments keep the parameters' order. per_expert = F x D.
struct HiInterleave {
  int64_t first = 0, experts = 0, per_expert = 0;
  int64_t end() const { return first + 2 * experts * per_expert; }
  // Where block element `offset` (in [first, end())) has its hi half.
  int64_t hi_offset(int64_t offset) const;
};
// Block elements [offset, offset + count) whose hi halves lie back to back at `hi`.
struct HiRun {
  int64_t offset = 0, hi = 0, count = 0;
};
// The runs of block range r, in order, under `pairs` (sorted, disjoint): one run where r
// meets no pair, else one per expert slice (and per piece outside the pairs) it touches.
std::vector<HiRun> hi_runs(const std::vector<HiInterleave>& pairs, Range r);
// Where the hi halves of `ranges` lie under `pairs`: sorted, merged (share_weights: a ZeRO-3
// rank's own pieces of the bf16 weights).
RangeList hi_ranges(const std::vector<HiInterleave>& pairs, const RangeList& ranges);
// The pairs of an interleaved store: each MoE layer's (w1, w3) extents, of `experts` slices
// each; none unless every layer's w3 follows its w1 with as many elements and an expert's
// slice is a multiple of adamw_math::kNormChunk (a norm chunk then lies in one slice).
std::vector<HiInterleave> gate_up_pairs(const std::vector<std::pair<Range, Range>>& w1_w3, int64_t experts);

// Element ranges as byte ranges of `elem_bytes` per element.
RangeList byte_ranges(const RangeList& elements, int64_t elem_bytes);

}  // namespace moe
