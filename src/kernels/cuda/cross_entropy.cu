// Cross-entropy and its gradient in one kernel from fp32 logits rows (the LM head writes
// them a chunk of rows at a time, so the whole [T, V] fp32 logits never exist).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kLoadsInFlight = 4;  // float4 loads a thread issues before storing any

// Rows whose fp32 logits fit in the shared memory of a cluster of kParts CTAs (V = 50,304
// is 201 KB: four parts of 50 KB): each CTA takes a part of the row, read from memory
// once; the max, the sum of exponentials (exchanged through distributed shared memory) and
// the gradient are passes over shared memory. Several parts an SM let it load one while it
// computes another. The logits are the kernel's big read (2x the bf16 gradient it writes); the
// plain kernel below reads them twice.
template <int kParts, int kPartThreads = 1024 / kParts>
__global__ void __cluster_dims__(kParts, 1, 1) __launch_bounds__(kPartThreads)
    cross_entropy_row_in_smem_kernel(float* loss, __nv_bfloat16* dlogits, const float* logits,
                                     const int32_t* targets, int64_t V, int64_t part4_len, float grad_scale) {
  extern __shared__ float4 part4[];
  __shared__ float exchange[2];  // this CTA's max, then its sum, for the others
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int64_t r = blockIdx.x / kParts, first4 = rank * part4_len;
  const int64_t n4 = std::max<int64_t>(0, std::min(part4_len, V / 4 - first4));
  const float4* z4 = reinterpret_cast<const float4*>(logits + r * V) + first4;
  float local_max = -INFINITY;
  for (int64_t base = threadIdx.x; base < n4; base += static_cast<int64_t>(kLoadsInFlight) * kPartThreads) {
    float4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kPartThreads;
      if (i < n4) v[u] = z4[i];
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kPartThreads;
      if (i < n4) {
        part4[i] = v[u];
        local_max = fmaxf(local_max, fmaxf(fmaxf(v[u].x, v[u].y), fmaxf(v[u].z, v[u].w)));
      }
    }
  }
  const float my_max = block_max(local_max);  // its barriers also publish the part
  if (threadIdx.x == 0) exchange[0] = my_max;
  cluster.sync();
  float row_max = -INFINITY;
#pragma unroll
  for (int p = 0; p < kParts; ++p) row_max = fmaxf(row_max, cluster.map_shared_rank(exchange, p)[0]);
  const float* part = reinterpret_cast<const float*>(part4);
  float local_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < 4 * n4; i += kPartThreads) local_sum += exp_approx(part[i] - row_max);
  const float my_sum = block_sum(local_sum);
  if (threadIdx.x == 0) exchange[1] = my_sum;
  cluster.sync();
  // The parts' sums in rank order on every CTA: the same bits of the log-sum-exp.
  float row_sum = 0.0f;
#pragma unroll
  for (int p = 0; p < kParts; ++p) row_sum += cluster.map_shared_rank(exchange, p)[1];
  const float row_lse = row_max + logf(row_sum);
  const int32_t target = targets[r];
  const int64_t local_target = static_cast<int64_t>(target) - 4 * first4;
  if (threadIdx.x == 0 && (target < 0 ? rank == 0 : local_target >= 0 && local_target < 4 * n4))
    loss[r] = target < 0 ? 0.0f : row_lse - part[local_target];
  uint2* d4 = reinterpret_cast<uint2*>(dlogits + r * V) + first4;
  for (int64_t i = threadIdx.x; i < n4; i += kPartThreads) {
    const float4 z = part4[i];
    const float zs[4] = {z.x, z.y, z.z, z.w};
    __nv_bfloat16 g[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      g[j] = to_bf16(target < 0 ? 0.0f
                                : grad_scale * (exp_approx(zs[j] - row_lse) - (4 * i + j == local_target ? 1.0f : 0.0f)));
    d4[i] = *reinterpret_cast<const uint2*>(g);
  }
  cluster.sync();  // the others have read this CTA's exchange before it exits
}

template <int kParts>
void launch_row_in_smem(float* loss_T, bf16* dlogits_TV, const float* logits_TV, const int32_t* targets_T, int64_t T,
                        int64_t V, int64_t part4_len, float grad_scale, Stream stream) {
  const size_t bytes = static_cast<size_t>(part4_len) * sizeof(float4);
  // Per call: the attribute is the current device's (thread ranks drive several).
  MOE_CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_row_in_smem_kernel<kParts>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  cross_entropy_row_in_smem_kernel<kParts><<<static_cast<unsigned>(kParts * T), 1024 / kParts, bytes, stream>>>(
      loss_T, as_cuda(dlogits_TV), logits_TV, targets_T, V, part4_len, grad_scale);
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

// The dynamic shared memory a block may take on the current device (1 KB left for the
// reductions' and the exchange's static arrays).
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
  const int64_t V4 = V / 4;
  const bool aligned = reinterpret_cast<uintptr_t>(logits_TV) % 16 == 0 && reinterpret_cast<uintptr_t>(dlogits_TV) % 8 == 0;
  const size_t limit = row_smem_limit();
  // The fewest parts of at most ~56 KB (four CTAs an SM), else the fewest that fit. ncu,
  // olmoe-mini's 32,768 x 50,304 a step: 2 parts 3.83 ms, 4 parts 3.65, 8 parts 4.68.
  const auto part4 = [&](int parts) { return (V4 + parts - 1) / parts; };
  const auto fits = [&](int parts, size_t cap) { return static_cast<size_t>(part4(parts)) * sizeof(float4) <= cap; };
  int parts = 0;
  for (int p : {2, 4, 8})
    if (parts == 0 && fits(p, 56 * 1024)) parts = p;
  for (int p : {2, 4, 8})
    if (parts == 0 && fits(p, limit)) parts = p;
  if (V % 4 != 0 || !aligned) parts = 0;
  if (parts == 2) {
    launch_row_in_smem<2>(loss_T, dlogits_TV, logits_TV, targets_T, T, V, part4(2), grad_scale, stream);
  } else if (parts == 4) {
    launch_row_in_smem<4>(loss_T, dlogits_TV, logits_TV, targets_T, T, V, part4(4), grad_scale, stream);
  } else if (parts == 8) {
    launch_row_in_smem<8>(loss_T, dlogits_TV, logits_TV, targets_T, T, V, part4(8), grad_scale, stream);
  } else {
    cross_entropy_fused_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
        loss_T, as_cuda(dlogits_TV), logits_TV, targets_T, V, grad_scale);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
