// Cross-entropy and its gradient in one kernel from fp32 logits rows (the LM head writes
// them a chunk of rows at a time, so the whole [T, V] fp32 logits never exist).
#include <cuda_runtime.h>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kRowThreads = 1024;
constexpr int kLoadsInFlight = 4;  // float4 loads a thread issues before storing any

// Rows whose fp32 logits fit in shared memory (V = 50,304 is 201 KB): the row is read from
// memory once, its max, sum of exponentials and gradient are passes over shared memory.
// The logits are the kernel's big read (2x the bf16 gradient it writes); the plain kernel
// below reads them twice and, with several rows per SM, the second time from memory too.
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_row_in_smem_kernel(float* loss, __nv_bfloat16* dlogits, const float* logits,
                                     const int32_t* targets, int64_t V, float grad_scale) {
  extern __shared__ float4 row4[];
  const float* row = reinterpret_cast<const float*>(row4);
  const int64_t r = blockIdx.x, V4 = V / 4;
  const float4* z4 = reinterpret_cast<const float4*>(logits + r * V);
  float local_max = -INFINITY;
  for (int64_t base = threadIdx.x; base < V4; base += static_cast<int64_t>(kLoadsInFlight) * kRowThreads) {
    float4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kRowThreads;
      if (i < V4) v[u] = z4[i];
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kRowThreads;
      if (i < V4) {
        row4[i] = v[u];
        local_max = fmaxf(local_max, fmaxf(fmaxf(v[u].x, v[u].y), fmaxf(v[u].z, v[u].w)));
      }
    }
  }
  const float row_max = block_max(local_max);  // its barriers also publish the row
  float local_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += kRowThreads) local_sum += expf(row[i] - row_max);
  const float row_lse = row_max + logf(block_sum(local_sum));
  const int32_t target = targets[r];
  if (threadIdx.x == 0) loss[r] = target < 0 ? 0.0f : row_lse - row[target];
  uint2* d4 = reinterpret_cast<uint2*>(dlogits + r * V);
  for (int64_t i = threadIdx.x; i < V4; i += kRowThreads) {
    const float4 z = row4[i];
    const float zs[4] = {z.x, z.y, z.z, z.w};
    __nv_bfloat16 g[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      g[j] = to_bf16(target < 0 ? 0.0f : grad_scale * (expf(zs[j] - row_lse) - (4 * i + j == target ? 1.0f : 0.0f)));
    d4[i] = *reinterpret_cast<const uint2*>(g);
  }
}

// Any V: an online max / sum-exp pass, then the gradient pass, both from memory.
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

// The dynamic shared memory a block may take on the current device (beyond the reductions'
// static 256 bytes).
size_t row_smem_limit() {
  int device = 0, optin = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return static_cast<size_t>(optin) - 1024;
}

}  // namespace

void cross_entropy_fused(float* loss_T, bf16* dlogits_TV, const float* logits_TV, const int32_t* targets_T,
                         int64_t T, int64_t V, float grad_scale, Stream stream) {
  if (T == 0) return;
  const size_t row_bytes = static_cast<size_t>(V) * sizeof(float);
  const bool aligned = reinterpret_cast<uintptr_t>(logits_TV) % 16 == 0 && reinterpret_cast<uintptr_t>(dlogits_TV) % 8 == 0;
  if (V % 4 == 0 && aligned && row_bytes <= row_smem_limit()) {
    // Per call: the attribute is the current device's (thread ranks drive several).
    MOE_CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_row_in_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(row_bytes)));
    cross_entropy_row_in_smem_kernel<<<static_cast<unsigned>(T), kRowThreads, row_bytes, stream>>>(
        loss_T, as_cuda(dlogits_TV), logits_TV, targets_T, V, grad_scale);
  } else {
    cross_entropy_fused_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
        loss_T, as_cuda(dlogits_TV), logits_TV, targets_T, V, grad_scale);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
