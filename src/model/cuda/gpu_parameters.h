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
// (tests, checkpoints) are model/cuda/gpu_parameter_io.h, ZeRO's layouts of it
// model/cuda/gpu_parameter_zero.h. Only the resident ranges hold memory
// (core/cuda/resident_block.h); offsets are always the full block's.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "config/optimizer_config.h"
#include "core/range.h"
#include "core/bf16.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_fp32_copies.h"
#include "model/gpu_state_layout.h"
#include "model/parameters.h"

namespace moe {

class GpuParameterStore {
 public:
  // Copies the values of `params` to the device; the moments start at zero. The
  // parameters in `fp32_copy_ids` are also kept as fp32 (fp32_copies()). `resident`: the
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
  // element is resident and whose optimizer state is not packed yet. ZeRO packs it after
  // (its all-gathers take the hi halves' order: dist::ZeroShardPlan::weight_gathers; ZeRO-3
  // keeps each rank's pieces' hi halves where this put them: gpu_parameter_zero.h).
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
  // between ranks); the fp32 copies are not affected. weights_lo: in the block layout,
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
  // The fp32 copies of the parameters registered in fp32_copy_ids
  // (model/cuda/gpu_fp32_copies.h); the optimizer refreshes them as it steps.
  const GpuFp32Copies& fp32_copies() const;
  GpuFp32Copies& fp32_copies();
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
  // ZeRO's layouts of the state (packed optimizer state, shared gradients and weights,
  // what AdamW steps): model/cuda/gpu_parameter_zero.h.

  // Device bytes held by the blocks above (their resident chunks).
  size_t device_bytes() const;
  // Per parameter; bf16_grads: of one whose gradient is bf16 (an expert weight's).
  static double bytes_per_parameter(MomentDtype moments, bool bf16_grads = false);

 private:
  friend struct GpuParameterStoreAccess;  // gpu_parameter_io.h, gpu_parameter_zero.h
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moe
