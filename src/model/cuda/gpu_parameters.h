// The GPU model's parameters and optimizer state, in the CPU ParameterStore's layout
// (same offsets, alignment padding included):
// - the fp32 master weights as a bf16 "hi" block, which the matmuls read directly, plus
//   an int16 "lo" block that makes them exact (adamw_math::split_master): fp32 master
//   semantics without a separate bf16 copy;
// - fp32 gradients, or bf16 ones for the expert tensors (expert_grad_dtype = bf16: a
//   second block, resident on the expert tensors' ranges only, the fp32 one then not there);
// - the AdamW moments in fp32 or bf16 (optimizer.state_dtype);
// - fp32 copies of the few parameters the forward pass reads in fp32 (router biases).
// One exception to the layout: interleave_hi keeps the hi halves of an MoE layer's w1 | w3
// expert by expert (the gate|up GEMMs' one operand); everything else stays in place.
// Bytes per parameter: 2 + 2 + 4 + 2 x 4 = 16 with fp32 moments, 12 with bf16 ones; 2
// fewer for expert weights with bf16 gradients.
// The optimizer that steps this state is optim/cuda/gpu_optimizer.h; its host copies
// (tests, checkpoints) are model/cuda/gpu_parameter_io.h. Only the resident ranges hold
// memory (core/cuda/resident_block.h); offsets are always the full block's.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "config/optimizer_config.h"
#include "core/range.h"
#include "core/bf16.h"
#include "kernels/gpu_ops.h"
#include "model/gpu_state_layout.h"
#include "model/parameters.h"

namespace moe {

class GpuParameterStore {
 public:
  // Copies the values of `params` to the device; the moments start at zero. The
  // parameters in `fp32_copy_ids` are also kept as fp32 (fp32_values()). `resident`: the
  // element ranges of the block that hold memory (sorted, disjoint; empty: all of it); the
  // others keep their offsets but no memory (expert parallelism: other ranks' experts).
  // bf16_expert_grads: the gradients of the expert tensors (the parameters with an
  // expert_group) are kept in bf16 (grads_bf16()), the others in fp32 (grads()).
  GpuParameterStore(const ParameterStore<float>& params, MomentDtype moments, const std::vector<int>& fp32_copy_ids,
                    cuda::Stream stream, const RangeList& resident = {}, bool bf16_expert_grads = false);
  ~GpuParameterStore();
  GpuParameterStore(const GpuParameterStore&) = delete;
  GpuParameterStore& operator=(const GpuParameterStore&) = delete;

  // bf16 weights (the hi halves) and fp32 gradients, indexed like the CPU store (the hi
  // halves of interleaved pairs through hi_offset()).
  const bf16* weights() const;
  // training.interleave_gate_up: the hi halves of each pair's w1 | w3 kept expert by
  // expert (model/gpu_state_layout.h), permuted in place now; once, on a store whose every
  // element is resident and whose optimizer state is not packed yet. ZeRO-1/2 pack it after
  // (their all-gathers take the hi halves' order: dist::ZeroShardPlan::weight_gathers);
  // ZeRO-3's shared weights are refused (its pools hold stages in the parameters' order).
  void interleave_hi(std::vector<HiInterleave> pairs);
  const std::vector<HiInterleave>& hi_interleave() const;
  // Where block element `offset`'s hi half is (itself outside the interleaved pairs).
  int64_t hi_offset(int64_t offset) const;
  float* grads();
  // The bf16 gradient block (same offsets as grads()), valid on bf16_grad_ranges() only;
  // null without bf16 expert gradients. bf16_grad_ranges: the expert tensors' extents
  // [offset, numel) whose gradients are bf16 (sorted; empty: none), resident or not.
  bf16* grads_bf16();
  const RangeList& bf16_grad_ranges() const;
  // The master weights' two halves, writable (expert parallelism copies experts' weights
  // between ranks); fp32_values copies are not affected. weights_lo: in the block layout,
  // so not while the optimizer state is packed (unless hold_master).
  bf16* weights_hi();
  int16_t* weights_lo();
  // Counts the changes of the bf16 weights: bumped by every call that may write them
  // (weights_hi(), upload_state, upload_range, set_resident_ranges, share_weights), so a
  // copy derived from them (the fp8 experts' quantised weights) is stale when it differs.
  // ZeRO-3's stage gathers write through a pointer taken once (set_weight_sharding), but
  // only values the optimizer's weights_hi() already announced.
  uint64_t weights_version() const;
  // The AdamW moments' blocks (which = 0: first, 1: second), in the block layout, of
  // moment_bytes() per element (expert parallelism copies experts' moments between ranks);
  // not while the optimizer state is packed.
  void* moment_block(int which);
  size_t moment_bytes() const;
  // The fp32 values of a parameter registered in fp32_copy_ids.
  const float* fp32_values(int id) const;
  // The block of those fp32 copies, and where parameter `id`'s starts in it (-1: none);
  // the optimizer refreshes them as it steps.
  float* fp32_mirror();
  int64_t fp32_mirror_offset(int id) const;
  MomentDtype moment_dtype() const;
  int64_t storage_numel() const;

  // Zeroes the resident gradients (both blocks), except the element ranges in `written`
  // (sorted, disjoint): those the next backward writes whole without reading them
  // (GpuTransformer::begin_gradients). The resident bytes around them are still zeroed.
  void zero_grads(const RangeList& written = {});
  // The resident ranges; set_resident_ranges changes them (waits for the stream): ranges
  // that stay keep their contents, new ones hold undefined weights and zero gradients and
  // moments, the others' memory is released.
  const RangeList& resident_ranges() const;
  void set_resident_ranges(const RangeList& ranges);
  // ZeRO: the lo halves and the AdamW moments kept for `ranges` only (sorted, disjoint,
  // inside the resident ranges, each starting on a multiple of 16 elements), packed back
  // to back, so a rank stepping 1/N of the block holds 1/N of them; their values are kept,
  // the others' memory is released. optimizer_ranges: where they are kept (the resident
  // ranges unless packed). Expert re-placement needs them in the block layout (unpacked).
  void pack_optimizer_state(const RangeList& ranges);
  const RangeList& optimizer_ranges() const;
  // ZeRO-2: the fp32 gradients keep memory of their own for `kept` (the pieces this rank
  // sums into and steps), the first and last stage and the chunks at stage edges; the rest
  // of stage s lives in memory shared with every other stage of its parity (s % 2), which
  // the data-parallel group zeroes once a stage's sums have left (GpuDataParallel::
  // set_gradient_sharding). stage_ranges[s]: the element ranges stage s writes. Once.
  void share_gradients(const RangeList& kept, const std::vector<RangeList>& stage_ranges);
  // ZeRO-3: the same for the bf16 weights (hi halves), after pack_optimizer_state: the rest
  // of a stage's weights is gathered into its pool before each forward and backward of it
  // (GpuDataParallel::set_weight_sharding); only the own pieces stay valid between steps.
  void share_weights(const RangeList& kept, const std::vector<RangeList>& stage_ranges);
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
  StepState step_state();
  int64_t state_offset(int64_t offset) const;
  // Packed: maps the lo halves of `ranges` (resident ones) in the block layout again, the
  // own pieces' filled (weights_lo() is then valid there: an all-gather fills the rest
  // before download_params), releasing the rest of that block; empty: releases it all.
  // A stage at a time keeps the transient memory to one stage's (sync_host_model).
  void hold_master(const RangeList& ranges);
  // The extents of the parameters kept in fp32 too (their padding to 16 elements
  // included), sorted: a sharded optimizer must step them whole on every rank.
  RangeList fp32_copy_ranges() const;

  // Device bytes held by the blocks above (their resident chunks).
  size_t device_bytes() const;
  // Per parameter; bf16_grads: of one whose gradient is bf16 (an expert weight's).
  static double bytes_per_parameter(MomentDtype moments, bool bf16_grads = false);

 private:
  friend struct GpuParameterStoreAccess;  // the host copies (gpu_parameter_io.h)
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moe
