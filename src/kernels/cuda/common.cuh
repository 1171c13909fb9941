// Helpers shared by the CUDA kernels: bf16 conversion and warp/block reductions.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <initializer_list>

#include "core/bf16.h"

namespace moe::cuda {

// Our bf16 and CUDA's __nv_bfloat16 have the same 16-bit layout.
static_assert(sizeof(bf16) == sizeof(__nv_bfloat16));
inline __nv_bfloat16* as_cuda(bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const __nv_bfloat16* as_cuda(const bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
// The same values as raw bits (adamw_math works on bf16 bit patterns).
inline uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }
inline const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }

// e^x as 2^(x log2 e) through the hardware's ex2.approx.ftz: a multiply and one MUFU.EX2
// against expf's 8 instructions, within 2 + 1.2 |x| ulp (the CUDA guide's bound for __expf,
// which is this with subnormal results kept; expf: 2 ulp). For values rounded to bf16 (2^-9:
// 65,536 ulp of fp32) or summed into a loss (its fp64 comparisons hold 1e-5), in
// kernels whose time is their instructions (SwiGLU's fused kernels, the cross-entropy's
// passes over a row in shared memory). +inf past 2^128; 0 below 2^-126.
__device__ __forceinline__ float exp_approx(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * 1.44269504088896341f));
  return e;
}

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf16(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  v = lane < warps ? partial[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  v = lane < warps ? partial[lane] : -INFINITY;
  return warp_max(v);
}

// Inclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread also gets the block's total.
__device__ __forceinline__ int block_inclusive_scan(int value, int* block_total) {
  __shared__ int warp_totals[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  __syncthreads();
  if (lane == 31) warp_totals[warp] = value;
  __syncthreads();
  if (warp == 0) {
    int total = lane < (blockDim.x >> 5) ? warp_totals[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, total, offset);
      if (lane >= offset) total += other;
    }
    warp_totals[lane] = total;
  }
  __syncthreads();
  if (warp > 0) value += warp_totals[warp - 1];
  *block_total = warp_totals[(blockDim.x >> 5) - 1];
  return value;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 16-byte vectors of 8 bf16: memory-bound kernels need 16-byte accesses to reach the
// GPU's bandwidth (2-byte accesses reach about a third of it).
constexpr int kVecElems = 8;

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[kVecElems]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < kVecElems / 2; ++j) {
    const float2 p = __bfloat1622float2(pairs[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[kVecElems]) {
  uint4 v;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < kVecElems / 2; ++j) pairs[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return v;
}

// Asks the L2 to fetch [p, p + bytes) from memory (sm_90 bulk prefetch): issued by one
// thread, it holds no registers, so a kernel can request bytes it will load later while it
// computes. p 16-byte aligned, bytes a multiple of 16 (0: nothing).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  if (bytes > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Rows of n bf16 can be read as 16-byte vectors: n % 8 == 0 and every base 16-byte aligned.
inline bool vectorizable(int64_t n, std::initializer_list<const void*> rows) {
  if (n % kVecElems != 0) return false;
  for (const void* p : rows)
    if (p && reinterpret_cast<uintptr_t>(p) % sizeof(uint4) != 0) return false;
  return true;
}

}  // namespace moe::cuda
