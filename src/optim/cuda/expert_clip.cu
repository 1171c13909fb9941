// Per-expert gradient clipping on the GPU: optim/grad_clip.cpp's first half. The sums of
// squares per slice (one expert's part of one expert tensor) come from grad_norm's chunk
// kernels (optimizer.cu), so they are the CPU's sums bit for bit; here they are summed
// per expert in order, turned into norms and clip factors, and the slices are scaled.
#include <algorithm>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per expert: its slices in order, as the CPU's `sq += sum_of_squares(...)`.
__global__ void expert_clip_factors_kernel(double* norm_X, float* factor_X, const double* slice_sq_S,
                                           const int32_t* first_slice_X1, int64_t n_experts, double max_norm) {
  const int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (x >= n_experts) return;
  double sq = 0.0;
  for (int32_t s = first_slice_X1[x]; s < first_slice_X1[x + 1]; ++s) sq = __dadd_rn(sq, slice_sq_S[s]);
  const double norm = __dsqrt_rn(sq);
  norm_X[x] = norm;
  // A NaN norm is never clipped (norm > max_norm is false), as on the CPU.
  factor_X[x] = max_norm > 0 && norm > max_norm ? static_cast<float>(__ddiv_rn(max_norm, __dadd_rn(norm, 1e-6))) : 1.0f;
}

// One block per slice (grid-strided over slices), its threads over the elements.
__global__ void scale_expert_slices_kernel(float* grads, const OptimizerSegment* slices, const int32_t* expert_of_slice_S,
                                           int64_t n_slices, const float* factor_X, uint16_t* grads16) {
  for (int64_t s = blockIdx.x; s < n_slices; s += gridDim.x) {
    const float factor = factor_X[expert_of_slice_S[s]];
    if (factor == 1.0f) continue;  // x * 1 is x: nothing to do
    const int64_t n = slices[s].numel;
    if (slices[s].bf16_grad) {  // bf16 expert gradients: scaled in fp32, rounded once
      uint16_t* g = grads16 + slices[s].offset;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        g[i] = adamw_math::bf16_bits_rne(__fmul_rn(adamw_math::bf16_bits_to_float(g[i]), factor));
      continue;
    }
    float* g = grads + slices[s].offset;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) g[i] = __fmul_rn(g[i], factor);
  }
}

}  // namespace

void expert_clip_factors(double* norm_X, float* factor_X, const double* slice_sq_S, const int32_t* first_slice_X1,
                         int64_t n_experts, double max_norm, Stream stream) {
  if (n_experts == 0) return;
  expert_clip_factors_kernel<<<static_cast<unsigned>(ceil_div(n_experts, kThreads)), kThreads, 0, stream>>>(
      norm_X, factor_X, slice_sq_S, first_slice_X1, n_experts, max_norm);
  MOE_CUDA_CHECK_LAUNCH();
}

void scale_expert_slices(float* grads, const OptimizerSegment* slices, const int32_t* expert_of_slice_S,
                         int64_t n_slices, const float* factor_X, Stream stream, bf16* grads16) {
  if (n_slices == 0) return;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(n_slices, 1 << 16));
  scale_expert_slices_kernel<<<blocks, kThreads, 0, stream>>>(grads, slices, expert_of_slice_S, n_slices, factor_X,
                                                              bits(grads16));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
