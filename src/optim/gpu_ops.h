// GPU versions of the optimizer ops: the global gradient norm in the CPU's order, the
// multi-tensor AdamW, per-expert clipping and the single-tensor AdamW. Tested against
// optim/adamw.h and optim/grad_clip.h (tests/gpu/test_gpu_optimizer.cpp,
// test_gpu_balancing.cpp, test_gpu_kernels.cpp); the kernels are in optim/cuda/.
// Declared without CUDA headers, as kernels/gpu_ops.h.
#pragma once
#include <cstdint>

#include "config/optimizer_config.h"
#include "core/bf16.h"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {

// One AdamW step over a flat fp32 parameter block, writing the bf16 copy used by the
// forward pass. beta1/beta2 are the config's doubles (the bias corrections use them as
// the CPU AdamW does). decay_factor = 1 - lr * weight_decay (1 for no decay); grad_scale
// multiplies the gradient first (global clipping folded in).
void adamw_step(float* param, bf16* param_bf16, const float* grad, float* m, float* v,
                int64_t count, double lr, double beta1, double beta2, float eps, float decay_factor,
                float grad_scale, int64_t step, Stream stream);

// The multi-tensor optimizer over one contiguous parameter block (optim/cuda/multi_tensor_adamw.cu).
// A segment is one parameter: its place in the block, whether weight decay applies, and
// where an fp32 copy of its values is kept (mirror_offset, -1: none). The block is walked
// in chunks of adamw_math::kNormChunk elements that never straddle two segments;
// first_chunk numbers them over all segments in order (n_chunks in all).
struct OptimizerSegment {
  int64_t offset = 0, numel = 0;
  int64_t first_chunk = 0;
  int64_t mirror_offset = -1;
  // Where the segment's lo halves and moments start in their arrays (ZeRO packs them;
  // congruent to offset modulo 8); -1: at offset, as the gradients and hi halves.
  int64_t state_offset = -1;
  int32_t decay = 0;
  // 1: the segment's gradients are bf16, in the grads16 block (same offsets as the fp32
  // one; training.expert_grad_dtype = bf16), read widened (exactly).
  int32_t bf16_grad = 0;
  // Interleaved gate|up (GpuParameterStore::interleave_hi): the segment's hi halves in runs
  // of hi_run elements hi_stride apart from hi_offset (hi_run a multiple of
  // adamw_math::kNormChunk, so a chunk lies in one run, or, for a ZeRO piece from inside an
  // expert slice, its numel: one run); hi_run 0: at offset, as the gradients.
  int64_t hi_offset = 0, hi_run = 0, hi_stride = 0;
};

// The global gradient norm, the CPU's (optim/grad_clip.cpp) bit for bit: per chunk an fp64
// sum of squares in element order (chunk_sq_C), per segment the chunks in order
// (segment_sq_S), then the segments in order. Writes scalars->sum_sq, ->norm and, for the
// AdamW kernel, ->grad_scale = norm > max_norm > 0 ? float(max_norm / (norm + 1e-6)) : 1
// and ->skip = the norm is not finite. Three launches, no host synchronisation. Segments
// with bf16_grad read grads16 (the CPU's norm over the bf16 values widened).
void grad_norm(adamw_math::AdamWScalars* scalars, double* chunk_sq_C, double* segment_sq_S, const float* grads,
               const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks, double max_norm,
               Stream stream, const bf16* grads16 = nullptr);

// Where the AdamW moments are, indexed by state element (OptimizerSegment::state_offset):
// m and v as float*, bf16* or (fp8) e4m3 codes with a scale byte per 16 elements
// (adamw_math's format; the scales at state / 16).
struct MomentState {
  void* m = nullptr;
  void* v = nullptr;
  uint8_t* m_scales = nullptr;
  uint8_t* v_scales = nullptr;
  MomentDtype dtype = MomentDtype::Fp32;
};

// AdamW over every segment in one launch, reading its scalars from device memory
// (nothing when scalars->skip): master weights as hi/lo (both rewritten), fp32
// gradients, the moments, and the fp32 mirrors refreshed. The arithmetic is
// adamw_math::adamw_update's (fp8 moments: adamw_update_range's, every segment's state
// starting on a block of 16). Segments with bf16_grad read their gradients from grads16,
// widened.
void multi_tensor_adamw(bf16* hi, int16_t* lo, float* mirror, const float* grads, const MomentState& moments,
                        const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks,
                        const adamw_math::AdamWScalars* scalars, Stream stream, const bf16* grads16 = nullptr);

// Per-expert gradient clipping (optim/cuda/expert_clip.cu), optim/grad_clip.cpp's order
// and rounding. A slice is one expert's part of one expert tensor (an OptimizerSegment:
// offset, numel, first_chunk); grad_norm over the slices gives their sums of squares
// (segment_sq_S). Expert x owns slices first_slice_X1[x] .. first_slice_X1[x+1] - 1:
// norm_X[x] = sqrt of their sums added in order, and factor_X[x] =
// float(max_norm / (norm + 1e-6)) where norm > max_norm > 0, else 1.
void expert_clip_factors(double* norm_X, float* factor_X, const double* slice_sq_S, const int32_t* first_slice_X1,
                         int64_t n_experts, double max_norm, Stream stream);
// grads[slice] *= factor_X[expert_of_slice_S[slice]] (fp32, as the CPU scales); slices with
// bf16_grad: grads16[slice] = bf16(float(grads16[slice]) * factor) (nearest even).
void scale_expert_slices(float* grads, const OptimizerSegment* slices, const int32_t* expert_of_slice_S,
                         int64_t n_slices, const float* factor_X, Stream stream, bf16* grads16 = nullptr);

}  // namespace moe::cuda
