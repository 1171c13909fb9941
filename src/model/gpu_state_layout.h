// How GpuParameterStore (model/cuda/gpu_parameters.h) lays out a ZeRO rank's state, as host
// code: the store calls these, and the memory planner (train/state_memory.h) counts what
// they give, so the estimate follows the allocation when either changes.
#pragma once
#include <cstdint>
#include <vector>

#include "core/range.h"

namespace moe {

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

// Element ranges as byte ranges of `elem_bytes` per element.
RangeList byte_ranges(const RangeList& elements, int64_t elem_bytes);

}  // namespace moe
