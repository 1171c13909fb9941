// Cross-entropy and its gradient in one kernel from fp32 logits rows (the LM head writes
// them a chunk of rows at a time, so the whole [T, V] fp32 logits never exist).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 512;

// One block per row: an online max / sum-exp pass, then the gradient pass.
__global__ void cross_entropy_fused_kernel(float* loss, __nv_bfloat16* dlogits, const float* logits,
                                           const int32_t* targets, int64_t V, float grad_scale) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * V;
  float local_max = -INFINITY, local_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float v = z[i];
    if (v > local_max) {
      local_sum = local_sum * expf(local_max - v) + 1.0f;
      local_max = v;
    } else {
      local_sum += expf(v - local_max);
    }
  }
  const float row_max = block_max(local_max);
  // Threads without elements hold (-inf, 0) and add nothing.
  const float rescaled = local_sum == 0.0f ? 0.0f : local_sum * expf(local_max - row_max);
  const float row_lse = row_max + logf(block_sum(rescaled));
  const int32_t target = targets[row];
  if (threadIdx.x == 0) loss[row] = target < 0 ? 0.0f : row_lse - z[target];
  __nv_bfloat16* d = dlogits + row * V;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float g = target < 0 ? 0.0f : grad_scale * (expf(z[i] - row_lse) - (i == target ? 1.0f : 0.0f));
    d[i] = to_bf16(g);
  }
}

}  // namespace

void cross_entropy_fused(float* loss_T, bf16* dlogits_TV, const float* logits_TV, const int32_t* targets_T,
                         int64_t T, int64_t V, float grad_scale, Stream stream) {
  if (T == 0) return;
  cross_entropy_fused_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
      loss_T, as_cuda(dlogits_TV), logits_TV, targets_T, V, grad_scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
