// Device pieces of our fused kernels built on DeepGEMM's bf16 tiles (bf16_deepgemm_kernels.h):
// the tile sizes, the staged output tile's swizzled addressing, bf16 pairs and the warps'
// STSM. Included by bf16_deepgemm_swiglu.cu (the forward's gate|up + SwiGLU) and
// bf16_deepgemm_swiglu_backward.cu (the down projection's data gradient + SwiGLU's backward).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/bf16_deepgemm_instance.cuh"

namespace moe::cuda::bf16_deepgemm {

using Bf16 = cutlass::bfloat16_t;
constexpr auto kKMajor = cute::UMMA::Major::K;
constexpr uint32_t kSwizzle = 128;                        // bytes: every tile's rows are 64 bf16
constexpr uint32_t kAtomCols = kSwizzle / sizeof(Bf16);   // 64 columns a swizzle atom
constexpr uint32_t kHalfN = kBlockN / 2;                  // 128 gate (and up) columns a CTA
constexpr uint32_t kTileA = kBlockM * kBlockK * sizeof(Bf16), kTileB = kBlockN * kBlockK * sizeof(Bf16);
constexpr uint32_t kTileD = kBlockM * kBlockN * sizeof(Bf16);
static_assert(kTileD % 1024 == 0 && kTileA % 1024 == 0 && kTileB % 1024 == 0, "the 128-byte swizzle's alignment");
static_assert(kBlockM == 128 && kMathThreads == 256 && kBlockK == kAtomCols, "two warp groups of 64 rows, K in atoms");
constexpr uint32_t kActAtomBytes = kBlockM * kSwizzle;  // 16 KB: [128 rows][64 columns] of bf16
constexpr uint32_t kSwigluWarps = 3;                    // the TMA warp group's warps 0, 1 and 3
static_assert(swiglu_shared_bytes() == size_t{kTileD} + kStages * (kTileA + kTileB) + kActAtomBytes +
                                           (2 * kStages + 2) * 8,
              "bf16_deepgemm_kernels.h's count of the fused kernels' shared memory");
// The SwiGLU warps' index 0..95 (the TMA warp group's warps 0, 1 and 3; warp 2 loads).
__device__ __forceinline__ uint32_t swiglu_thread(uint32_t warp, uint32_t lane) {
  return (warp == kMathThreads / 32 + 3 ? 2 : warp - kMathThreads / 32) * 32 + lane;
}

// Where a warp's STSM of accumulator group i (8 columns of 16 rows: the warp's rows, lane l
// addressing row l) goes in a tile staged as atoms of [kBlockM][64] bf16, 128-byte swizzled.
__device__ __forceinline__ uint8_t* staged_at(uint8_t* tile, uint32_t warp, uint32_t lane, uint32_t i) {
  const uint32_t atom = i / 8, chunk = (i % 8) ^ (lane % 8);
  return tile + atom * kBlockM * kSwizzle + warp * 16 * kSwizzle + lane * kSwizzle + chunk * 16;
}

// Two floats rounded to bf16, a in the low half (one conversion for both), and back.
__device__ __forceinline__ uint32_t bf16_pair(float a, float b) {
  const __nv_bfloat162 pair = __float22bfloat162_rn({a, b});
  return *reinterpret_cast<const uint32_t*>(&pair);
}
__device__ __forceinline__ float bf16_half(uint32_t pair, uint32_t high) {
  return __uint_as_float(high ? pair & 0xffff0000u : pair << 16);
}
// One warp's two 8 x 8 bf16 matrices (rows 0-7 and 8-15 of its 16) into shared memory.
__device__ __forceinline__ void stsm_x2(const uint8_t* at, uint32_t rows_0_7, uint32_t rows_8_15) {
  asm volatile("stmatrix.sync.aligned.x2.m8n8.shared.b16 [%0], {%1, %2};\n" ::"l"(__cvta_generic_to_shared(at)),
               "r"(rows_0_7), "r"(rows_8_15));
}

}  // namespace moe::cuda::bf16_deepgemm
