// Cross-entropy straight from bf16 logits: one block per row, fp32 max and sum-exp,
// never an fp32 copy of the [T, V] logits.
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void cross_entropy_forward_kernel(float* loss, float* lse, const __nv_bfloat16* logits,
                                             const int32_t* targets, int64_t V) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* z = logits + row * V;
  float local_max = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) local_max = fmaxf(local_max, to_float(z[i]));
  const float row_max = block_max(local_max);
  float local_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) local_sum += expf(to_float(z[i]) - row_max);
  const float row_lse = row_max + logf(block_sum(local_sum));
  if (threadIdx.x == 0) {
    lse[row] = row_lse;
    const int32_t target = targets[row];
    loss[row] = target < 0 ? 0.0f : row_lse - to_float(z[target]);
  }
}

__global__ void cross_entropy_backward_kernel(__nv_bfloat16* dlogits, const __nv_bfloat16* logits,
                                              const float* lse, const int32_t* targets, int64_t V,
                                              float scale) {
  const int64_t row = blockIdx.x;
  const int32_t target = targets[row];
  const float row_lse = lse[row];
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    // Read before write: dlogits may alias logits.
    const float p = expf(to_float(logits[row * V + i]) - row_lse);
    const float g = target < 0 ? 0.0f : scale * (p - (i == target ? 1.0f : 0.0f));
    dlogits[row * V + i] = to_bf16(g);
  }
}


}  // namespace

void cross_entropy_forward(float* loss_T, float* lse_T, const bf16* logits_TV, const int32_t* targets_T,
                           int64_t T, int64_t V, Stream stream) {
  if (T == 0) return;
  cross_entropy_forward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
      loss_T, lse_T, as_cuda(logits_TV), targets_T, V);
  MOE_CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(bf16* dlogits_TV, const bf16* logits_TV, const float* lse_T,
                            const int32_t* targets_T, int64_t T, int64_t V, float scale, Stream stream) {
  if (T == 0) return;
  cross_entropy_backward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
      as_cuda(dlogits_TV), as_cuda(logits_TV), lse_T, targets_T, V, scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
