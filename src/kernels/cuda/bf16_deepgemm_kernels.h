// The instantiations of DeepGEMM's Hopper bf16 GEMM (sm90_bf16_gemm_impl) behind
// PaddedExpertGemmBf16 (bf16_deepgemm.cu), one file per role so that they compile in
// parallel: bf16_deepgemm_forward.cu, _data.cu, _weight.cu; and our own fused kernels with
// SwiGLU (bf16_deepgemm_swiglu.cu) and its backward (_swiglu_backward.cu) in their epilogues.
// Kept free of DeepGEMM's headers.
#pragma once
#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"

namespace moe::cuda::bf16_deepgemm {

using Kernel = void (*)(int*, uint32_t, uint32_t, uint32_t, CUtensorMap, CUtensorMap, CUtensorMap);

// Every role's tiles: 128 rows x 256 columns x 64 of K (the 128-byte swizzle of bf16),
// 3 stages, 128 TMA + 256 math threads (two warp groups of 64 rows).
inline constexpr uint32_t kBlockM = 128, kBlockN = 256, kBlockK = 64, kStages = 3;
inline constexpr uint32_t kTmaThreads = 128, kMathThreads = 256;

// D's tile, the stages' A and B tiles, two barriers a stage.
constexpr size_t shared_bytes() {
  return (size_t{kBlockM} * kBlockN * 2 + 1023) / 1024 * 1024 + size_t{kStages} * (kBlockM + kBlockN) * kBlockK * 2 +
         2 * kStages * 8;
}

// The group count a kernel is compiled for: the smallest of 8, 64, 256 that holds the
// experts (each CTA walks every compiled group, empty ones too).
constexpr uint32_t compiled_groups(int64_t experts) { return experts <= 8 ? 8 : experts <= 64 ? 64 : 256; }

// Our fused kernels' (gate|up + SwiGLU, and the down data gradient + SwiGLU's backward): the
// same, one spare 64-column atom (the forward's staged act) and two more barriers (the staged
// tile's hand-over between the math warps and the SwiGLU warps).
constexpr size_t swiglu_shared_bytes() { return shared_bytes() + size_t{kBlockM} * 128 + 2 * 8; }

// The m-grouped "psum" layout: D [R, N] = A [R, K] (K-major) @ B_g, B [E][N][K] (K-major,
// the forward's weights as stored); `pairs`: 2-CTA clusters sharing B's tile (an even count
// of N tiles).
Kernel forward_kernel(int64_t experts, bool pairs);
// The same with B [E][K][N] (MN-major, the data gradients' weights as stored); `accumulate`:
// D reduce-added (TMA) instead of stored.
Kernel data_kernel(int64_t experts, bool pairs, bool accumulate);
// The k-grouped layout: D_g [M, N] = A_g^T B_g with A [R, M] and B [R, N] both MN-major
// (the expert rows themselves), group g's K its padded rows; bf16 D stored; `pairs`: 2-CTA
// clusters sharing B's tile (an even count of D's row tiles, so that a pair never straddles
// two groups).
Kernel weight_kernel(int64_t experts, bool pairs);

// Our gate|up + SwiGLU kernel (bf16_deepgemm_swiglu.cu): (group ends, R, 2F, K, x, the
// interleaved [w1_e; w3_e] weights in boxes of 128 rows, gate|up [R, 2F], act [R, F]).
using SwigluKernel = void (*)(int*, uint32_t, uint32_t, uint32_t, CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap);
SwigluKernel gate_up_swiglu_kernel_for(int64_t experts, bool pairs);
// Our down-projection data gradient + SwiGLU backward kernel (bf16_deepgemm_swiglu_backward.cu):
// (group ends, R, F, K = D, dy, W2 [E][D][F] in boxes of 64 x 64, gate|up, d gate|up, act or null,
// the rows of a tile the math warps take: a multiple of 8, at most 128).
using SwigluBackwardKernel = void (*)(int*, uint32_t, uint32_t, uint32_t, CUtensorMap, CUtensorMap, const bf16*, bf16*,
                                      bf16*, uint32_t);
SwigluBackwardKernel data_swiglu_backward_kernel_for(int64_t experts, bool pairs);

}  // namespace moe::cuda::bf16_deepgemm
