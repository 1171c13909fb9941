// ZeRO's layouts of a GpuParameterStore's state (model/cuda/gpu_parameters.h): the lo halves
// and AdamW moments packed to the pieces a rank steps (ZeRO-1), the gradients (ZeRO-2) and
// the bf16 weights (ZeRO-3) in memory shared between backward stages, the master lo halves
// mapped back for a stage's host copy, and what the AdamW kernel steps. Called by the
// data-parallel setup (train/backends/cuda/gpu_backend.cpp) and the optimizer
// (optim/cuda/gpu_optimizer.cpp); the plans come from dist/zero_shards.h.
#pragma once
#include <cstdint>
#include <vector>

#include "core/range.h"
#include "model/cuda/gpu_parameters.h"

namespace moe {

// The lo halves and the AdamW moments kept for `ranges` only (sorted, disjoint, inside the
// resident ranges, each starting on a multiple of 16 elements), packed back to back, so a
// rank stepping 1/N of the block holds 1/N of them; their values are kept, the others'
// memory is released. Once. Expert re-placement needs them in the block layout (unpacked).
void pack_optimizer_state(GpuParameterStore& store, const RangeList& ranges);
// Where the lo halves and moments are kept: the resident ranges unless packed.
const RangeList& optimizer_ranges(const GpuParameterStore& store);

// ZeRO-2: the fp32 gradients keep memory of their own for `kept` (the pieces this rank
// sums into and steps), the first and last stage and the chunks at stage edges; the rest
// of stage s lives in memory shared with every other stage of its parity (s % 2), which
// the data-parallel group zeroes once a stage's sums have left (GpuDataParallel::
// set_gradient_sharding). stage_ranges[s]: the element ranges stage s writes. Once.
void share_gradients(GpuParameterStore& store, const RangeList& kept, const std::vector<RangeList>& stage_ranges);
// ZeRO-3: the same for the bf16 weights (hi halves), after pack_optimizer_state: the rest
// of a stage's weights is gathered into its pool before each forward and backward of it
// (GpuDataParallel::set_weight_sharding); only the own pieces stay valid between steps.
// `kept` in the parameters' order; with gate|up interleaved their hi halves are kept where
// interleave_hi put them (the gathers follow: dist::ZeroShardPlan::weight_gathers).
void share_weights(GpuParameterStore& store, const RangeList& kept, const std::vector<RangeList>& stage_ranges);

// Packed: maps the lo halves of `ranges` (resident ones) in the block layout again, the
// own pieces' filled (weights_lo() is then valid there: an all-gather fills the rest
// before download_params), releasing the rest of that block; empty: releases it all.
// A stage at a time keeps the transient memory to one stage's (sync_host_model).
void hold_master(GpuParameterStore& store, const RangeList& ranges);

// What the AdamW kernel steps: the lo halves and moments, and where block element
// `offset`'s state is in them (itself unless packed; inside optimizer_ranges()).
struct StepState {
  int16_t* lo;
  void* m;
  void* v;
  uint8_t* m_scales;  // fp8 moments: a scale byte per 16 state elements (null otherwise)
  uint8_t* v_scales;
  bool packed;
};
StepState step_state(GpuParameterStore& store);
int64_t state_offset(const GpuParameterStore& store, int64_t offset);

}  // namespace moe
