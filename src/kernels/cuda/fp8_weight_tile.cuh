// A 128 x 128 weight block's e4m3 codes (fp8::kBlock both ways): its power-of-two scale, the
// codes row-major and, through a shared-memory tile, transposed (kernels/fp8_blockwise.h's
// weight layouts). Shared by the weight quantiser (fp8_quantize.cu) and the AdamW that
// writes the expert weights' codes as it writes the weights (optim/cuda/), so both give
// quantize_weight_blocks' bits.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_row_tiles.cuh"
#include "kernels/fp8_blockwise.h"

namespace moe::cuda {

// Weights: one block of 256 threads per 128 x 128 weight block. The block's bf16 values are
// read once, 16 bytes a load (8 loads a thread in flight: 32 KB a block), kept in
// registers for the amax and the codes; the codes go out as they are (8 bytes a store)
// and through a shared-memory tile, transposed 4 x 4 bytes at a time in registers, to the
// transposed copy (4-byte stores, a warp writing 128 bytes of one row). The tile's 32-bit
// words are swizzled (word kw of row n at kw ^ (n / 4 % 32)) so that the transposing
// reads, 4 rows x 1 word a thread, hit 32 different banks. Edge blocks (N or K not a
// multiple of 128) and shapes whose rows break the vector alignment take bytewise paths.
constexpr int kWeightThreads = 256;
constexpr int kChunksPerRow = fp8::kBlock / 8;                // 16-byte chunks of a block row
constexpr int kRowsPerPass = kWeightThreads / kChunksPerRow;  // 16
constexpr int kWeightLoads = fp8::kBlock / kRowsPerPass;      // 8 a thread
constexpr int kTileWords = fp8::kBlock / 4;                   // 32-bit words of a tile row

__device__ __forceinline__ int tile_word(int n, int kw) { return n * kTileWords + (kw ^ (n / 4 % 32)); }

// The block (e, nb, kb) of NB x KB held by the kWeightThreads threads as
// quantize_weight_kernel loads it: thread (row = tid / 16, chunk = tid % 16) has rows
// row + 16 j (j < kWeightLoads) at columns chunk * 8 .. + 7 in packed[j], bf16 bits, zeros
// outside the matrix. Every thread of the block calls it (barriers inside).
__device__ __forceinline__ void store_weight_block_codes(const uint4 (&packed)[kWeightLoads], uint8_t* codes_ENK,
                                                         float* scales, uint8_t* codes_t_EKN, float* scales_t,
                                                         int64_t e, int64_t nb, int64_t kb, int64_t NB, int64_t KB,
                                                         int64_t N, int64_t K, bool vector_rows) {
  constexpr int kBlock = fp8::kBlock;
  const int64_t n0 = nb * kBlock, k0 = kb * kBlock;
  const int chunk = threadIdx.x % kChunksPerRow, row = threadIdx.x / kChunksPerRow;
  const int64_t k = k0 + chunk * 8;
  const bool whole_chunk = vector_rows && k + 8 <= K;
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kWeightLoads; ++j) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[j]);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      amax = fmaxf(amax, fmaxf(fabsf(__low2float(pairs[i])), fabsf(__high2float(pairs[i]))));
  }
  __shared__ float warp_amax[kWeightThreads / 32];
  __shared__ uint32_t tile[kBlock * kTileWords];  // [n][k] codes, 16 KB
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kWeightThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = fp8::block_scale(amax), inverse = fp8::block_scale_inverse(scale);
  if (threadIdx.x == 0) {
    if (scales != nullptr) scales[fp8::weight_scale_index(e, nb, kb, NB, KB)] = scale;
    if (scales_t != nullptr) scales_t[fp8::weight_t_scale_index(e, nb, kb, NB, KB)] = scale;
  }
#pragma unroll
  for (int j = 0; j < kWeightLoads; ++j) {
    const int dn = row + j * kRowsPerPass;
    const int64_t n = n0 + dn;
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[j]);
    uint32_t words[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      words[h] = pack4_e4m3(__low2float(pairs[2 * h]) * inverse, __high2float(pairs[2 * h]) * inverse,
                            __low2float(pairs[2 * h + 1]) * inverse, __high2float(pairs[2 * h + 1]) * inverse);
    tile[tile_word(dn, 2 * chunk)] = words[0];
    tile[tile_word(dn, 2 * chunk + 1)] = words[1];
    if (codes_ENK == nullptr || n >= N) continue;
    uint8_t* out = codes_ENK + (e * N + n) * K + k;
    if (whole_chunk) {
      *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
    } else {
      for (int i = 0; i < 8; ++i)
        if (k + i < K) out[i] = static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)));
    }
  }
  if (codes_t_EKN == nullptr) return;
  __syncthreads();
  // The transposed copy: codes_t[e][k][n] = tile[n][k]. Thread: 4 rows (n) x 4 columns (k).
  const bool full = vector_rows && N % 4 == 0 && n0 + kBlock <= N && k0 + kBlock <= K;
  const int ng = threadIdx.x % 32;  // n = 4 ng .. 4 ng + 3
#pragma unroll
  for (int q = 0; q < kBlock / 4 / (kWeightThreads / 32); ++q) {
    const int kg = threadIdx.x / 32 + q * (kWeightThreads / 32);  // k = 4 kg .. 4 kg + 3
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = tile[tile_word(4 * ng + i, kg)];
    // a[i] holds row 4 ng + i's bytes at k = 4 kg + 0..3; out[j] holds column 4 kg + j's at
    // n = 4 ng + 0..3.
    const uint32_t lo01 = __byte_perm(a[0], a[1], 0x5140), hi01 = __byte_perm(a[0], a[1], 0x7362);
    const uint32_t lo23 = __byte_perm(a[2], a[3], 0x5140), hi23 = __byte_perm(a[2], a[3], 0x7362);
    const uint32_t out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                             __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t kk = k0 + 4 * kg + j, n = n0 + 4 * ng;
      uint8_t* dst = codes_t_EKN + (e * K + kk) * N + n;
      if (full) {
        *reinterpret_cast<uint32_t*>(dst) = out[j];
      } else if (kk < K) {
        for (int i = 0; i < 4; ++i)
          if (n + i < N) dst[i] = static_cast<uint8_t>(out[j] >> (8 * i));
      }
    }
  }
}

}  // namespace moe::cuda
