// Device helpers shared by the kernels that write e4m3 activation rows (1 x 128 tiles,
// kernels/fp8_blockwise.h's format): the quantiser itself (fp8_quantize.cu) and the
// kernels that quantise rows as they write them (SwiGLU's, the dispatch's permute and
// combine backward in moe/cuda/dispatch.cu). Each gives quantize_rows_blockwise's bits.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {

// Four e4m3 codes in a word (a in the low byte; saturating, to nearest even), converted in
// pairs: the instruction a single conversion issues too, half as many times.
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// The first expert whose rows reach past row r (offsets ascending; empty experts skipped).
__device__ inline int64_t expert_of(const int32_t* offsets_E1, int64_t E, int64_t r) {
  int64_t lo = 0, hi = E;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets_E1[mid + 1] <= r) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The scale of tile kb of row r where fp8::activation_scale_index puts it for r's expert
// (a binary search over the offsets; null offsets: one group of all R rows).
__device__ __forceinline__ void write_tile_scale(float* scales, float scale, const int32_t* offsets_E1, int64_t E,
                                                 int64_t R, int64_t r, int64_t kb, int64_t KB) {
  int64_t first = 0, rows = R;
  if (offsets_E1 != nullptr) {
    const int64_t e = expert_of(offsets_E1, E, r);
    first = offsets_E1[e];
    rows = offsets_E1[e + 1] - first;
  }
  scales[fp8::activation_scale_index(first, rows, r, kb, KB)] = scale;
}

// The lanes of the kLanes-lane group (aligned to kLanes in the warp) this thread is in.
template <int kLanes>
__device__ __forceinline__ unsigned tile_lane_mask() {
  return kLanes == 32 ? 0xffffffffu : ((1u << (kLanes % 32)) - 1u) << (threadIdx.x % 32 / kLanes * kLanes);
}

// The power-of-two scale of a 1 x 128 tile held by kLanes consecutive lanes (aligned to
// kLanes in the warp; all of them call) from each lane's amax of its values.
template <int kLanes>
__device__ __forceinline__ float tile_scale(float amax) {
  const unsigned mask = tile_lane_mask<kLanes>();
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, offset));
  return fp8::block_scale(amax);
}

// 8 values times a scale's inverse as e4m3 codes, in two words.
__device__ __forceinline__ uint2 codes_of_8(const float (&v)[kVecElems], float inverse) {
  return make_uint2(pack4_e4m3(v[0] * inverse, v[1] * inverse, v[2] * inverse, v[3] * inverse),
                    pack4_e4m3(v[4] * inverse, v[5] * inverse, v[6] * inverse, v[7] * inverse));
}

// write_tile_scale by a tile's kLanes consecutive lanes together (aligned to kLanes in the
// warp, every one of them calling): up to 64 experts, lane l checks experts l, l + kLanes,
// ... in rounds of one load pair and a ballot, and the tile's first lane writes. One lane's
// binary search issued ~25 instructions a step (a dependent load each) for the whole warp;
// this is ~15 a round, one round up to kLanes experts. More experts: that search.
template <int kLanes>
__device__ __forceinline__ void write_tile_scale_together(float* scales, float scale, const int32_t* offsets_E1,
                                                          int64_t E, int64_t R, int64_t r, int64_t kb, int64_t KB,
                                                          int lane) {
  if (offsets_E1 != nullptr && E > 64) {
    if (lane == 0) write_tile_scale(scales, scale, offsets_E1, E, R, r, kb, KB);
    return;
  }
  int64_t first = 0, rows = R;
  if (offsets_E1 != nullptr) {
    const int group_base = threadIdx.x % 32 / kLanes * kLanes;
    const unsigned mask = tile_lane_mask<kLanes>();
    // r is below offsets_E1[E] (callers skip the rows past the last expert): one expert
    // holds it, empty ones never.
    for (int64_t base = 0; base < E; base += kLanes) {
      const int64_t e = base + lane;
      const int32_t lo = e < E ? offsets_E1[e] : 0, hi = e < E ? offsets_E1[e + 1] : 0;
      const unsigned hit = (__ballot_sync(mask, lo <= r && r < hi) & mask) >> group_base;
      if (hit != 0) {  // the same for the tile's lanes
        const int at = __ffs(static_cast<int>(hit)) - 1;
        first = __shfl_sync(mask, lo, at, kLanes);
        rows = __shfl_sync(mask, hi - lo, at, kLanes);
        break;
      }
    }
  }
  if (lane == 0) scales[fp8::activation_scale_index(first, rows, r, kb, KB)] = scale;
}

// A 1 x 128 tile held by 16 consecutive lanes (aligned to 16 in the warp; all 16 call),
// 8 bf16-exact values each: its power-of-two scale (returned) and this lane's 8 codes
// (words). tile_codes_of_8 stores the codes at `out`; quantize_tile_of_8 also has the
// tile's first lane write the scale where fp8::activation_scale_index puts it for row r's
// expert.
__device__ __forceinline__ float tile_words_of_8(const float (&v)[kVecElems], uint2& words) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) amax = fmaxf(amax, fabsf(v[j]));
  const float scale = tile_scale<fp8::kBlock / kVecElems>(amax);
  words = codes_of_8(v, fp8::block_scale_inverse(scale));
  return scale;
}
__device__ __forceinline__ float tile_codes_of_8(const float (&v)[kVecElems], uint8_t* out) {
  uint2 words;
  const float scale = tile_words_of_8(v, words);
  *reinterpret_cast<uint2*>(out) = words;
  return scale;
}
__device__ __forceinline__ void quantize_tile_of_8(const float (&v)[kVecElems], uint8_t* out, float* scales,
                                                   const int32_t* offsets_E1, int64_t E, int64_t R, int64_t r,
                                                   int64_t kb, int64_t KB, int lane) {
  const float scale = tile_codes_of_8(v, out);
  write_tile_scale_together<fp8::kBlock / kVecElems>(scales, scale, offsets_E1, E, R, r, kb, KB, lane);
}

// Row `row`'s codes for vector i (8 values; V vectors a row) and, from the first lane of
// the vector's 1 x 128 tile, its scale where quantize_rows_blockwise puts it.
__device__ __forceinline__ void store_tile_codes(const RowCodes& codes, uint2 words, float scale, int64_t row,
                                                 int64_t i, int64_t V) {
  constexpr int64_t kTileVecs = fp8::kBlock / kVecElems;
  *reinterpret_cast<uint2*>(codes.codes_RK + (row * V + i) * kVecElems) = words;
  if (i % kTileVecs == 0)
    write_tile_scale(codes.scales, scale, codes.offsets_E1, codes.E, codes.R, row, i / kTileVecs, V / kTileVecs);
}

}  // namespace moe::cuda
