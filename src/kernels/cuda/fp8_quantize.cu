// Blockwise e4m3 quantisation on the GPU: activation rows per 1 x 128 tile, weights per
// 128 x 128 block (and their transpose), the formats of kernels/fp8_blockwise.h, whose
// CPU functions these match bit for bit (tests/gpu/test_gpu_fp8_gemm.cpp).
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/error_base.h"
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_row_tiles.cuh"
#include "kernels/cuda/swiglu_math.cuh"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe::cuda {
namespace {

using fp8::kBlock;

// Row and 128-column block of a tile (tile = r * KB + kb) by 32-bit division, several times
// cheaper than a 64-bit one in kernels this short; the launches keep tiles below 2^30.
struct TileAt {
  int64_t r, kb;
};
__device__ __forceinline__ TileAt tile_at(int64_t tile, int64_t KB) {
  const uint32_t t = static_cast<uint32_t>(tile), blocks = static_cast<uint32_t>(KB), r = t / blocks;
  return {r, t - r * blocks};
}

// Activation rows: each thread quantises V consecutive values of a 1 x 128 tile (V = 8:
// one 16-byte load and an 8-byte store; V = 4 when the row stride allows only 8-byte
// loads), 128 / V threads a tile, and kRowTiles tiles of the grid's stride each: every
// thread issues all its loads before its first reduction, so each SM keeps enough bytes in
// flight to run at the memory's bandwidth. Only the tile's first thread finds its expert
// (a binary search over the offsets) and writes its scale.
constexpr int kRowThreads = 256, kRowTiles = 4;
template <int V>
__global__ void __launch_bounds__(kRowThreads) quantize_rows_kernel(uint8_t* codes_RK, float* scales,
                                                                    const __nv_bfloat16* x, int64_t ld_x,
                                                                    const int32_t* offsets_E1, int64_t E, int64_t R,
                                                                    int64_t K) {
  constexpr int kLanes = kBlock / V;                   // threads per tile
  constexpr int kTilesPerPass = kRowThreads / kLanes;  // tiles a block covers in one pass
  using Load = std::conditional_t<V == 8, uint4, uint2>;
  const int64_t KB = K / kBlock, tiles = R * KB;
  const int lane = threadIdx.x % kLanes;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * kRowTiles * kTilesPerPass + threadIdx.x / kLanes;
  const int64_t end_row = offsets_E1 != nullptr ? offsets_E1[E] : R;
  Load packed[kRowTiles];
#pragma unroll
  for (int u = 0; u < kRowTiles; ++u) {
    const int64_t tile = first_tile + u * kTilesPerPass;
    const auto [r, kb] = tile_at(tile, KB);
    if (tile < tiles && r < end_row)
      packed[u] = *reinterpret_cast<const Load*>(x + r * ld_x + kb * kBlock + lane * V);
  }
#pragma unroll
  for (int u = 0; u < kRowTiles; ++u) {
    const int64_t tile = first_tile + u * kTilesPerPass;
    const auto [r, kb] = tile_at(tile, KB);
    // The condition is the same for a tile's threads, which stay together in the shuffles.
    if (tile >= tiles || r >= end_row) continue;
    float v[V];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed[u]);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      v[2 * i] = __low2float(pairs[i]);
      v[2 * i + 1] = __high2float(pairs[i]);
      amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
    }
    // The tile's threads are kLanes consecutive lanes of one warp.
    const unsigned mask = tile_lane_mask<kLanes>();
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, offset));
    const float scale = fp8::block_scale(amax), inverse = fp8::block_scale_inverse(scale);
    write_tile_scale_together<kLanes>(scales, scale, offsets_E1, E, R, r, kb, KB, lane);
    uint32_t words[V / 4];
#pragma unroll
    for (int w = 0; w < V / 4; ++w)
      words[w] = pack4_e4m3(v[4 * w] * inverse, v[4 * w + 1] * inverse, v[4 * w + 2] * inverse, v[4 * w + 3] * inverse);
    uint8_t* out = codes_RK + r * K + kb * kBlock + lane * V;
    if constexpr (V == 8) *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
    else *reinterpret_cast<uint32_t*>(out) = words[0];
  }
}

// SwiGLU fused with the quantisation of its output (swiglu_forward_fp8): a tile's 16
// threads each compute 8 values of act = silu(gate) * up exactly as swiglu.cu's vector
// kernel does (swiglu_math.cuh, rounded to bf16 to nearest even), write them as bf16 when
// asked, and quantise those bf16 values as quantize_rows_blockwise would read them back:
// the same codes and scales without the round trip through memory.
constexpr int kSwigluTiles = 2;
__global__ void __launch_bounds__(kRowThreads) swiglu_quantize_kernel(__nv_bfloat16* act, uint8_t* codes_RF,
                                                                      float* scales, const __nv_bfloat16* gate_up,
                                                                      const int32_t* offsets_E1, int64_t E, int64_t R,
                                                                      int64_t F) {
  constexpr int kLanes = kBlock / kVecElems, kTilesPerPass = kRowThreads / kLanes;
  const int64_t FB = F / kBlock, tiles = R * FB;
  const int lane = threadIdx.x % kLanes;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * kSwigluTiles * kTilesPerPass + threadIdx.x / kLanes;
  const int64_t end_row = offsets_E1 != nullptr ? offsets_E1[E] : R;
  uint4 g_packed[kSwigluTiles], u_packed[kSwigluTiles];
#pragma unroll
  for (int u = 0; u < kSwigluTiles; ++u) {
    const int64_t tile = first_tile + u * kTilesPerPass;
    const auto [r, fb] = tile_at(tile, FB);
    const int64_t f = fb * kBlock + lane * 8;
    if (tile < tiles && (act != nullptr || r < end_row)) {
      g_packed[u] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + f);
      u_packed[u] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + F + f);
    }
  }
#pragma unroll
  for (int u = 0; u < kSwigluTiles; ++u) {
    const int64_t tile = first_tile + u * kTilesPerPass;
    const auto [r, fb] = tile_at(tile, FB);
    const int64_t f = fb * kBlock + lane * 8;
    if (tile >= tiles) continue;
    float g[kVecElems], up[kVecElems], a[kVecElems];
    unpack8(g_packed[u], g);
    unpack8(u_packed[u], up);
    swiglu_value_n(g, up, a);
    const uint4 rounded = pack8(a);
    if (act != nullptr) *reinterpret_cast<uint4*>(act + r * F + f) = rounded;
    if (r >= end_row) continue;  // the same for a tile's threads
    float v[kVecElems];
    unpack8(rounded, v);
    quantize_tile_of_8(v, codes_RF + r * F + f, scales, offsets_E1, E, R, r, fb, FB, lane);
  }
}

// SwiGLU's backward fused with the quantisation of both its outputs (swiglu_backward_fp8):
// d gate and d up as swiglu.cu's vector kernel computes them, written as bf16 (the weight
// gradients' input), and each quantised as quantize_rows_blockwise would quantise those bf16
// values (the data gradients' input): d gate's codes at row r * code_ld, d up's at up_codes
// + r * code_ld (two sets, or one [R, 2F] operand: GateUpRowCodes), their scales d up's after
// d gate's.
struct GateUpRowCodes {
  int64_t code_ld, up_codes;
  // One group of R rows: d gate | d up side by side; per expert: two sets of [R, F].
  __host__ __device__ static GateUpRowCodes of(bool one_group, int64_t R, int64_t F) {
    return one_group ? GateUpRowCodes{2 * F, F} : GateUpRowCodes{F, R * F};
  }
};
__global__ void __launch_bounds__(kRowThreads) swiglu_backward_quantize_kernel(
    __nv_bfloat16* dgate_up, uint8_t* codes_2RF, float* scales_2, const __nv_bfloat16* dact,
    const __nv_bfloat16* gate_up, const int32_t* offsets_E1, int64_t E, int64_t R, int64_t F, GateUpRowCodes rc) {
  constexpr int kLanes = kBlock / kVecElems, kTilesPerPass = kRowThreads / kLanes;
  const int64_t FB = F / kBlock, tiles = R * FB;
  const int lane = threadIdx.x % kLanes;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * kSwigluTiles * kTilesPerPass + threadIdx.x / kLanes;
  const int64_t end_row = offsets_E1 != nullptr ? offsets_E1[E] : R;
  uint4 g_packed[kSwigluTiles], u_packed[kSwigluTiles], da_packed[kSwigluTiles];
#pragma unroll
  for (int u = 0; u < kSwigluTiles; ++u) {
    const int64_t tile = first_tile + u * kTilesPerPass;
    const auto [r, fb] = tile_at(tile, FB);
    const int64_t f = fb * kBlock + lane * 8;
    if (tile < tiles) {
      g_packed[u] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + f);
      u_packed[u] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + F + f);
      da_packed[u] = *reinterpret_cast<const uint4*>(dact + r * F + f);
    }
  }
#pragma unroll
  for (int u = 0; u < kSwigluTiles; ++u) {
    const int64_t tile = first_tile + u * kTilesPerPass;
    const auto [r, fb] = tile_at(tile, FB);
    const int64_t f = fb * kBlock + lane * 8;
    if (tile >= tiles) continue;
    float g[kVecElems], up[kVecElems], da[kVecElems], dg[kVecElems], du[kVecElems];
    unpack8(g_packed[u], g);
    unpack8(u_packed[u], up);
    unpack8(da_packed[u], da);
    // Per value: swiglu_grads_n took 78 registers here, and held to 64 (a spill) it ran 10.35
    // against 10.08 ms a mixtral-mini step (ncu, 2026-12-04). The same bits either way.
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) swiglu_grads(g[j], up[j], da[j], dg[j], du[j]);
    const uint4 dg_rounded = pack8(dg), du_rounded = pack8(du);
    *reinterpret_cast<uint4*>(dgate_up + r * 2 * F + f) = dg_rounded;
    *reinterpret_cast<uint4*>(dgate_up + r * 2 * F + F + f) = du_rounded;
    if (r >= end_row) continue;  // the same for a tile's threads
    float v[kVecElems];
    unpack8(dg_rounded, v);
    quantize_tile_of_8(v, codes_2RF + r * rc.code_ld + f, scales_2, offsets_E1, E, R, r, fb, FB, lane);
    unpack8(du_rounded, v);
    quantize_tile_of_8(v, codes_2RF + rc.up_codes + r * rc.code_ld + f, scales_2 + R * FB, offsets_E1, E, R, r, fb,
                       FB, lane);
  }
}

// Token columns (quantize_token_columns): one block of 256 threads per 128 tokens of one
// expert x 128 features. The tile goes through shared memory (16-byte loads along the
// features, rows padded by 16 bytes against bank conflicts; tokens past the expert's rows
// read as zeros); two threads per feature take the amax of 64 tokens each; then each
// writes its 64 codes of the feature's column as four 16-byte stores.
constexpr int kColumnThreads = 256;
constexpr int kColumnPad = 8;  // bf16 per tile row beyond the 128

__global__ void padded_token_offsets_kernel(int64_t* P_E1, const int32_t* offsets_E1, int64_t E) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t P = 0;
  P_E1[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    P += (static_cast<int64_t>(offsets_E1[e + 1] - offsets_E1[e]) + kBlock - 1) / kBlock * kBlock;
    P_E1[e + 1] = P;
  }
}

// The padded token block `column` (a multiple of 128) of the padded offsets: its expert, the
// expert's first padded column, the block's index in it, its first row and the rows left
// from there (more than 128 when the expert goes on).
struct TokenBlock {
  int64_t e, P_e, tb, first, rows;
};
__device__ __forceinline__ TokenBlock token_block(int64_t column, const int32_t* offsets_E1, const int64_t* P_E1,
                                                  int64_t E) {
  int64_t lo = 0, hi = E - 1;  // the last e with P_E1[e] <= column
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (P_E1[mid] <= column) lo = mid;
    else hi = mid - 1;
  }
  const int64_t tb = (column - P_E1[lo]) / kBlock;
  return {lo, P_E1[lo], tb, offsets_E1[lo] + tb * kBlock, offsets_E1[lo + 1] - offsets_E1[lo] - tb * kBlock};
}

// A 128-token x 128-feature tile in shared memory (tokens past the expert's rows zero) to
// its token columns, by a block of `Threads`: each thread takes two adjacent features (one
// 4-byte load a token) over one part of the tokens (kParts parts); a feature pair's kParts
// threads are adjacent lanes, so their amax meet by shuffles and their 16-byte stores of a
// feature's column fill whole 128-byte lines (the parts in separate warps wrote 16 or 32
// bytes of 32 lines a store instruction). The tile's 16-byte chunks are swizzled by part
// (tile_chunk) so that a warp's reads, kParts rows at once, hit 32 banks. The tile's
// features start at f0 of W (even); columns from `column` of codes_t [W, ld_t].
// kBlockScale: one scale for the whole tile (the amax of its 128 features too;
// fp8::ColumnScales::Block), else one per feature.
template <int Threads>
struct ColumnParts {
  static constexpr int kParts = Threads / (kBlock / 2);  // 4 for 256 threads, 8 for 512
  static constexpr int kTokens = kBlock / kParts;        // tokens a thread takes: 32 or 16
  static_assert(kTokens % 16 == 0, "whole 16-byte stores");
  static_assert(32 % kParts == 0, "a feature pair's parts in one warp");
};
// The 16-byte chunk of tile row t where chunk c is stored: c XOR (part of t) x (8 / kParts),
// so that the kParts parts x (32 / kParts) pairs of a warp's read are on 32 banks.
template <int Threads>
__device__ __forceinline__ int tile_chunk(int t, int c) {
  using Parts = ColumnParts<Threads>;
  return c ^ (t / Parts::kTokens * (8 / Parts::kParts));
}
template <int Threads, bool kBlockScale = false>
__device__ __forceinline__ void tile_to_token_columns(const __nv_bfloat16 (*tile)[kBlock + kColumnPad],
                                                      uint8_t* codes_t, int64_t ld_t, float* scales_t,
                                                      const TokenBlock& b, int64_t column, int64_t f0, int64_t W) {
  using Parts = ColumnParts<Threads>;
  const int part = threadIdx.x % Parts::kParts, pair = threadIdx.x / Parts::kParts;
  float v[2][Parts::kTokens];
  float m[2] = {0.0f, 0.0f};
#pragma unroll
  for (int t = 0; t < Parts::kTokens; ++t) {
    const int row = part * Parts::kTokens + t;
    const int at = tile_chunk<Threads>(row, pair / 4) * 8 + 2 * (pair % 4);
    const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&tile[row][at]);
    v[0][t] = __low2float(h);
    v[1][t] = __high2float(h);
    m[0] = fmaxf(m[0], fabsf(v[0][t]));
    m[1] = fmaxf(m[1], fabsf(v[1][t]));
  }
  // Each feature's amax over the 128 tokens (features past W: zeros), over the pair's lanes.
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int o = 1; o < Parts::kParts; o <<= 1) m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], o));
  if constexpr (kBlockScale) {
    m[0] = m[1] = block_max(fmaxf(m[0], m[1]));
    if (threadIdx.x == 0) scales_t[fp8::token_column_block_scale_index(b.P_e, b.tb, f0, W)] = fp8::block_scale(m[0]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int f = 2 * pair + h;
    if (f0 + f >= W) continue;
    const float scale = fp8::block_scale(m[h]), inverse = fp8::block_scale_inverse(scale);
    if (!kBlockScale && part == 0) scales_t[fp8::token_column_scale_index(b.P_e, b.tb, f0 + f, W)] = scale;
    uint8_t* out = codes_t + (f0 + f) * ld_t + column + part * Parts::kTokens;
    const float* x = v[h];
#pragma unroll
    for (int q = 0; q < Parts::kTokens / 16; ++q) {
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int t = q * 16 + w * 4;
        words[w] = pack4_e4m3(x[t] * inverse, x[t + 1] * inverse, x[t + 2] * inverse, x[t + 3] * inverse);
      }
      *reinterpret_cast<uint4*>(out + q * 16) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

template <bool kBlockScale>
__global__ void __launch_bounds__(kColumnThreads)
    quantize_token_columns_kernel(uint8_t* codes_t, int64_t ld_t, float* scales_t, const __nv_bfloat16* x,
                                  int64_t ld_x, const int32_t* offsets_E1, const int64_t* P_E1, int64_t E, int64_t W) {
  __shared__ __align__(16) __nv_bfloat16 tile[kBlock][kBlock + kColumnPad];
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kBlock;  // the block's first padded token
  if (column >= P_E1[E]) return;
  const TokenBlock b = token_block(column, offsets_E1, P_E1, E);
  const int64_t f0 = static_cast<int64_t>(blockIdx.y) * kBlock;
  const int chunk = threadIdx.x % 16, row0 = threadIdx.x / 16;
#pragma unroll
  for (int j = 0; j < kBlock / 16; ++j) {
    const int t = row0 + 16 * j;
    const int64_t f = f0 + chunk * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (t < b.rows && f < W) v = *reinterpret_cast<const uint4*>(x + (b.first + t) * ld_x + f);
    *reinterpret_cast<uint4*>(&tile[t][tile_chunk<kColumnThreads>(t, chunk) * 8]) = v;
  }
  __syncthreads();
  tile_to_token_columns<kColumnThreads, kBlockScale>(tile, codes_t, ld_t, scales_t, b, column, f0, W);
}

// SwiGLU's backward for the fp8 weight gradients (swiglu_backward_fp8_columns): per 128
// padded tokens of one expert x 128 features, 16 threads a row of the tile as
// swiglu_backward_quantize_kernel's (the same values, row codes and scales), and act
// (swiglu_forward's values), d gate and d up as bf16 through three shared tiles to their
// token columns. 512 threads a block, two blocks an SM (the tiles' 104 KB each): 32 warps
// an SM to hide the latency of the loads and of the per-value arithmetic.
constexpr int kSwigluColumnThreads = 512;
constexpr int kSwigluColumnTiles = 3;
constexpr int kSwigluColumnRowStep = kSwigluColumnThreads / 16;  // rows a pass: 32
constexpr int kSwigluColumnRowsInFlight = 2;  // rows of a thread's loads issued before the first is used
constexpr size_t kSwigluColumnSmem = kSwigluColumnTiles * kBlock * (kBlock + kColumnPad) * sizeof(__nv_bfloat16);
// kActBlock: act's columns with one scale per 128 x 128 tile (fp8::ColumnScales::Block).
template <bool kActBlock>
__global__ void __launch_bounds__(kSwigluColumnThreads, 2) swiglu_backward_columns_kernel(
    uint8_t* codes_2RF, float* scales_2, uint8_t* columns_3FP, float* column_scales_3, int64_t ld_t,
    int64_t column_scale_stride, const __nv_bfloat16* dact, const __nv_bfloat16* gate_up, const int32_t* offsets_E1,
    const int64_t* P_E1, int64_t E, int64_t R, int64_t F, bool rows_one_group) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto tiles = reinterpret_cast<__nv_bfloat16(*)[kBlock][kBlock + kColumnPad]>(smem);  // act, d gate, d up
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kBlock;
  if (column >= P_E1[E]) return;
  const TokenBlock b = token_block(column, offsets_E1, P_E1, E);
  const int64_t rows_e = offsets_E1[b.e + 1] - offsets_E1[b.e], FB = F / kBlock, fb = blockIdx.y;
  const GateUpRowCodes rc = GateUpRowCodes::of(rows_one_group, R, F);
  const int64_t f0 = fb * kBlock;
  const int chunk = threadIdx.x % 16, row0 = threadIdx.x / 16;
  const int64_t f = f0 + chunk * 8;
  // Rows row0 + 32 j, kSwigluColumnRowsInFlight at a time: every load of a group issued
  // before the first value is used.
  for (int j0 = 0; j0 < kBlock / kSwigluColumnRowStep; j0 += kSwigluColumnRowsInFlight) {
    uint4 g_packed[kSwigluColumnRowsInFlight], u_packed[kSwigluColumnRowsInFlight],
        da_packed[kSwigluColumnRowsInFlight];
#pragma unroll
    for (int i = 0; i < kSwigluColumnRowsInFlight; ++i) {
      const int t = row0 + kSwigluColumnRowStep * (j0 + i);
      if (t < b.rows) {
        const int64_t r = b.first + t;
        g_packed[i] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + f);
        u_packed[i] = *reinterpret_cast<const uint4*>(gate_up + r * 2 * F + F + f);
        da_packed[i] = *reinterpret_cast<const uint4*>(dact + r * F + f);
      }
    }
#pragma unroll
    for (int i = 0; i < kSwigluColumnRowsInFlight; ++i) {
      const int t = row0 + kSwigluColumnRowStep * (j0 + i);
      uint4 a_rounded = make_uint4(0, 0, 0, 0), dg_rounded = a_rounded, du_rounded = a_rounded;
      if (t < b.rows) {  // the same for a row's 16 threads
        const int64_t r = b.first + t;
        float g[kVecElems], up[kVecElems], da[kVecElems], a[kVecElems], dg[kVecElems], du[kVecElems];
        unpack8(g_packed[i], g);
        unpack8(u_packed[i], up);
        unpack8(da_packed[i], da);
        swiglu_value_and_grads_n(g, up, da, a, dg, du);
        a_rounded = pack8(a);
        dg_rounded = pack8(dg);
        du_rounded = pack8(du);
        float v[kVecElems];
        unpack8(dg_rounded, v);
        const float dg_scale = tile_codes_of_8(v, codes_2RF + r * rc.code_ld + f);
        unpack8(du_rounded, v);
        const float du_scale = tile_codes_of_8(v, codes_2RF + rc.up_codes + r * rc.code_ld + f);
        if (chunk == 0) {
          const int64_t scale_at = rows_one_group ? fp8::activation_scale_index(0, R, r, fb, FB)
                                                  : fp8::activation_scale_index(offsets_E1[b.e], rows_e, r, fb, FB);
          scales_2[scale_at] = dg_scale;
          scales_2[R * FB + scale_at] = du_scale;
        }
      }
      const int at = tile_chunk<kSwigluColumnThreads>(t, chunk) * 8;
      *reinterpret_cast<uint4*>(&tiles[0][t][at]) = a_rounded;
      *reinterpret_cast<uint4*>(&tiles[1][t][at]) = dg_rounded;
      *reinterpret_cast<uint4*>(&tiles[2][t][at]) = du_rounded;
    }
  }
  __syncthreads();
  tile_to_token_columns<kSwigluColumnThreads, kActBlock>(tiles[0], columns_3FP, ld_t, column_scales_3, b, column,
                                                         f0, F);
  for (int o = 1; o < kSwigluColumnTiles; ++o)
    tile_to_token_columns<kSwigluColumnThreads>(tiles[o], columns_3FP + o * F * ld_t, ld_t,
                                                column_scales_3 + o * column_scale_stride, b, column, f0, F);
}

// Weights: one block of 256 threads per 128 x 128 weight block. The block's bf16 values are
// read once, 16 bytes a load (8 loads a thread in flight: 32 KB a block), kept in
// registers for the amax and the codes; the codes go out as they are (8 bytes a store)
// and through a shared-memory tile, transposed 4 x 4 bytes at a time in registers, to the
// transposed copy (4-byte stores, a warp writing 128 bytes of one row). The tile's 32-bit
// words are swizzled (word kw of row n at kw ^ (n / 4 % 32)) so that the transposing
// reads, 4 rows x 1 word a thread, hit 32 different banks. Edge blocks (N or K not a
// multiple of 128) and shapes whose rows break the vector alignment take bytewise paths.
constexpr int kWeightThreads = 256;
constexpr int kChunksPerRow = kBlock / 8;                       // 16-byte chunks of a block row
constexpr int kRowsPerPass = kWeightThreads / kChunksPerRow;    // 16
constexpr int kWeightLoads = kBlock / kRowsPerPass;             // 8 a thread
constexpr int kTileWords = kBlock / 4;                          // 32-bit words of a tile row

__device__ __forceinline__ int tile_word(int n, int kw) { return n * kTileWords + (kw ^ (n / 4 % 32)); }

// place / place_t: where each copy goes (fp8::WeightBlocksPlace, resolved).
__global__ void __launch_bounds__(kWeightThreads) quantize_weight_kernel(uint8_t* codes_ENK, float* scales,
                                                                         uint8_t* codes_t_EKN, float* scales_t,
                                                                         const __nv_bfloat16* w_ENK, int64_t N,
                                                                         int64_t K, fp8::WeightBlocksPlace place,
                                                                         fp8::WeightBlocksPlace place_t,
                                                                         bool vector_rows, bool vector_rows_t) {
  const int64_t kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z;
  const int64_t n0 = nb * kBlock, k0 = kb * kBlock;
  const __nv_bfloat16* w = w_ENK + e * N * K;
  const int chunk = threadIdx.x % kChunksPerRow, row = threadIdx.x / kChunksPerRow;
  const int64_t k = k0 + chunk * 8;
  // vector_rows: K a multiple of 8 and w 16-byte aligned, so a chunk inside the matrix is
  // one aligned 16-byte load (and its codes one aligned 8-byte store).
  const bool whole_chunk = vector_rows && k + 8 <= K;
  uint4 packed[kWeightLoads];
#pragma unroll
  for (int j = 0; j < kWeightLoads; ++j) {
    const int64_t n = n0 + row + j * kRowsPerPass;
    packed[j] = make_uint4(0, 0, 0, 0);  // zeros outside the matrix: no effect on the amax
    if (n >= N) continue;
    if (whole_chunk) {
      packed[j] = *reinterpret_cast<const uint4*>(w + n * K + k);
    } else {
      uint16_t* h = reinterpret_cast<uint16_t*>(&packed[j]);
      const uint16_t* src = reinterpret_cast<const uint16_t*>(w + n * K);
      for (int i = 0; i < 8; ++i)
        if (k + i < K) h[i] = src[k + i];
    }
  }
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
    if (scales != nullptr) scales[place.scale(e, kb, nb)] = scale;
    if (scales_t != nullptr) scales_t[place_t.scale(e, nb, kb)] = scale;
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
    uint8_t* out = codes_ENK + place.code(e, n, k);
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
  const bool full = vector_rows_t && n0 + kBlock <= N && k0 + kBlock <= K;
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
      uint8_t* dst = codes_t_EKN + place_t.code(e, kk, n);
      if (full) {
        *reinterpret_cast<uint32_t*>(dst) = out[j];
      } else if (kk < K) {
        for (int i = 0; i < 4; ++i)
          if (n + i < N) dst[i] = static_cast<uint8_t>(out[j] >> (8 * i));
      }
    }
  }
}

// The row kernels index tiles in 32 bits (tile_at).
void check_tiles(int64_t tiles, const char* what) {
  MOE_CHECKF(tiles < (int64_t{1} << 30), "%s: %lld tiles of 128 values (at most 2^30)", what,
             static_cast<long long>(tiles));
}

}  // namespace

void quantize_rows_blockwise(uint8_t* codes_RK, float* scales, const bf16* x, int64_t ld_x,
                             const int32_t* offsets_E1, int64_t E, int64_t R, int64_t K, Stream stream) {
  MOE_CHECKF(K > 0 && K % kBlock == 0, "fp8 blockwise quantisation: K = %lld is not a multiple of %lld",
             static_cast<long long>(K), static_cast<long long>(kBlock));
  MOE_CHECKF(ld_x % 4 == 0 && ld_x >= K, "fp8 blockwise quantisation: row stride %lld (a multiple of 4, >= K)",
             static_cast<long long>(ld_x));
  MOE_CHECKF(offsets_E1 == nullptr || E >= 1, "fp8 blockwise quantisation: offsets of %lld experts",
             static_cast<long long>(E));
  const int64_t tiles = R * (K / kBlock);
  check_tiles(tiles, "fp8 blockwise quantisation");
  if (tiles == 0) return;
  // 16-byte loads when every row starts 16-byte aligned, else 8-byte ones.
  const bool wide = ld_x % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(codes_RK) % 8 == 0;
  const int64_t per_block = kRowTiles * (kRowThreads / (kBlock / (wide ? 8 : 4)));
  const int64_t grid = (tiles + per_block - 1) / per_block;
  if (wide)
    quantize_rows_kernel<8><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(codes_RK, scales, as_cuda(x),
                                                                                    ld_x, offsets_E1, E, R, K);
  else
    quantize_rows_kernel<4><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(codes_RK, scales, as_cuda(x),
                                                                                    ld_x, offsets_E1, E, R, K);
  MOE_CUDA_CHECK_LAUNCH();
}

void swiglu_forward_fp8(bf16* act_RF, uint8_t* codes_RF, float* scales, const bf16* gate_up_RF2,
                        const int32_t* offsets_E1, int64_t E, int64_t R, int64_t F, Stream stream) {
  MOE_CHECKF(F > 0 && F % kBlock == 0, "fp8 SwiGLU: F = %lld is not a multiple of %lld", static_cast<long long>(F),
             static_cast<long long>(kBlock));
  MOE_CHECKF(offsets_E1 == nullptr || E >= 1, "fp8 SwiGLU: offsets of %lld experts", static_cast<long long>(E));
  MOE_CHECKF(reinterpret_cast<uintptr_t>(gate_up_RF2) % 16 == 0 && reinterpret_cast<uintptr_t>(act_RF) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(codes_RF) % 8 == 0,
             "fp8 SwiGLU: gate|up and act 16-byte aligned, the codes 8-byte aligned");
  const int64_t tiles = R * (F / kBlock);
  check_tiles(tiles, "fp8 SwiGLU");
  if (tiles == 0) return;
  const int64_t per_block = kSwigluTiles * (kRowThreads / (kBlock / 8));
  swiglu_quantize_kernel<<<static_cast<unsigned>((tiles + per_block - 1) / per_block), kRowThreads, 0, stream>>>(
      act_RF ? as_cuda(act_RF) : nullptr, codes_RF, scales, as_cuda(gate_up_RF2), offsets_E1, E, R, F);
  MOE_CUDA_CHECK_LAUNCH();
}

void swiglu_backward_fp8(bf16* dgate_up_RF2, uint8_t* codes_2RF, float* scales_2, const bf16* dact_RF,
                         const bf16* gate_up_RF2, const int32_t* offsets_E1, int64_t E, int64_t R, int64_t F,
                         Stream stream) {
  MOE_CHECKF(F > 0 && F % kBlock == 0, "fp8 SwiGLU backward: F = %lld is not a multiple of %lld",
             static_cast<long long>(F), static_cast<long long>(kBlock));
  MOE_CHECKF(offsets_E1 == nullptr || E >= 1, "fp8 SwiGLU backward: offsets of %lld experts",
             static_cast<long long>(E));
  MOE_CHECKF(reinterpret_cast<uintptr_t>(gate_up_RF2) % 16 == 0 && reinterpret_cast<uintptr_t>(dgate_up_RF2) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(dact_RF) % 16 == 0 && reinterpret_cast<uintptr_t>(codes_2RF) % 8 == 0,
             "fp8 SwiGLU backward: gate|up, its gradient and d act 16-byte aligned, the codes 8-byte aligned");
  const int64_t tiles = R * (F / kBlock);
  check_tiles(tiles, "fp8 SwiGLU backward");
  if (tiles == 0) return;
  const int64_t per_block = kSwigluTiles * (kRowThreads / (kBlock / kVecElems));
  swiglu_backward_quantize_kernel<<<static_cast<unsigned>((tiles + per_block - 1) / per_block), kRowThreads, 0,
                                    stream>>>(as_cuda(dgate_up_RF2), codes_2RF, scales_2, as_cuda(dact_RF),
                                              as_cuda(gate_up_RF2), offsets_E1, E, R, F,
                                              GateUpRowCodes::of(offsets_E1 == nullptr, R, F));
  MOE_CUDA_CHECK_LAUNCH();
}

void padded_token_offsets(int64_t* P_E1, const int32_t* offsets_E1, int64_t E, Stream stream) {
  MOE_CHECKF(E >= 1, "fp8 token columns: offsets of %lld experts", static_cast<long long>(E));
  padded_token_offsets_kernel<<<1, 32, 0, stream>>>(P_E1, offsets_E1, E);
  MOE_CUDA_CHECK_LAUNCH();
}

void quantize_token_columns(uint8_t* codes_t_WP, int64_t ld_t, float* scales_t, const bf16* x, int64_t ld_x,
                            const int32_t* offsets_E1, const int64_t* P_E1, int64_t E, int64_t R, int64_t W,
                            Stream stream, fp8::ColumnScales kind) {
  MOE_CHECKF(E >= 1 && W > 0 && W % 8 == 0 && ld_x >= W && ld_x % 8 == 0 && ld_t % 16 == 0 &&
                 ld_t >= R + E * (kBlock - 1),
             "fp8 token columns: %lld experts, %lld features (a multiple of 8) in rows of %lld, codes rows of %lld "
             "(a multiple of 16, at least R + 127 E = %lld)",
             static_cast<long long>(E), static_cast<long long>(W), static_cast<long long>(ld_x),
             static_cast<long long>(ld_t), static_cast<long long>(R + E * (kBlock - 1)));
  MOE_CHECKF(reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(codes_t_WP) % 16 == 0,
             "fp8 token columns: x and the codes 16-byte aligned");
  // Padded tokens are at most R + 127 E; blocks past the routing's own exit at once.
  const int64_t token_blocks = (R + E * (kBlock - 1) + kBlock - 1) / kBlock;
  const dim3 grid(static_cast<unsigned>(token_blocks), static_cast<unsigned>((W + kBlock - 1) / kBlock));
  if (token_blocks == 0) return;
  if (kind == fp8::ColumnScales::Block)
    quantize_token_columns_kernel<true><<<grid, kColumnThreads, 0, stream>>>(codes_t_WP, ld_t, scales_t, as_cuda(x),
                                                                             ld_x, offsets_E1, P_E1, E, W);
  else
    quantize_token_columns_kernel<false><<<grid, kColumnThreads, 0, stream>>>(codes_t_WP, ld_t, scales_t, as_cuda(x),
                                                                              ld_x, offsets_E1, P_E1, E, W);
  MOE_CUDA_CHECK_LAUNCH();
}

void swiglu_backward_fp8_columns(uint8_t* codes_2RF, float* scales_2, uint8_t* columns_3FP, float* column_scales_3,
                                 int64_t ld_t, const bf16* dact_RF, const bf16* gate_up_RF2, const int32_t* offsets_E1,
                                 const int64_t* P_E1, int64_t E, int64_t R, int64_t F, Stream stream,
                                 fp8::ColumnScales act_kind, fp8::RowScales row_scales) {
  MOE_CHECKF(E >= 1 && F > 0 && F % kBlock == 0 && ld_t % 16 == 0 && ld_t >= R + E * (kBlock - 1),
             "fp8 SwiGLU backward to token columns: %lld experts, F = %lld (a multiple of 128), codes rows of %lld "
             "(a multiple of 16, at least R + 127 E = %lld)",
             static_cast<long long>(E), static_cast<long long>(F), static_cast<long long>(ld_t),
             static_cast<long long>(R + E * (kBlock - 1)));
  MOE_CHECKF(reinterpret_cast<uintptr_t>(gate_up_RF2) % 16 == 0 && reinterpret_cast<uintptr_t>(dact_RF) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(codes_2RF) % 8 == 0 && reinterpret_cast<uintptr_t>(columns_3FP) % 16 == 0,
             "fp8 SwiGLU backward to token columns: gate|up, d act and the columns 16-byte aligned, the codes 8");
  check_tiles(R * (F / kBlock), "fp8 SwiGLU backward to token columns");
  const int64_t token_blocks = (R + E * (kBlock - 1) + kBlock - 1) / kBlock;
  if (token_blocks == 0) return;
  const auto kernel = act_kind == fp8::ColumnScales::Block ? swiglu_backward_columns_kernel<true>
                                                           : swiglu_backward_columns_kernel<false>;
  // Per call: the attribute is the current device's (thread ranks drive several).
  MOE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSwigluColumnSmem)));
  const dim3 grid(static_cast<unsigned>(token_blocks), static_cast<unsigned>(F / kBlock));
  kernel<<<grid, kSwigluColumnThreads, kSwigluColumnSmem, stream>>>(
      codes_2RF, scales_2, columns_3FP, column_scales_3, ld_t, F * fp8::blocks(ld_t), as_cuda(dact_RF),
      as_cuda(gate_up_RF2), offsets_E1, P_E1, E, R, F, row_scales == fp8::RowScales::OneGroup);
  MOE_CUDA_CHECK_LAUNCH();
}

void quantize_weight_blocks(uint8_t* codes_ENK, float* scales, uint8_t* codes_t_EKN, float* scales_t,
                            const bf16* w_ENK, int64_t E, int64_t N, int64_t K, Stream stream,
                            fp8::WeightBlocksPlace place, fp8::WeightBlocksPlace place_t) {
  MOE_CHECKF(E >= 0 && N > 0 && K > 0 && E <= 65535, "fp8 weight quantisation: bad shape [%lld, %lld, %lld]",
             static_cast<long long>(E), static_cast<long long>(N), static_cast<long long>(K));
  MOE_CHECKF((codes_ENK == nullptr) == (scales == nullptr) && (codes_t_EKN == nullptr) == (scales_t == nullptr) &&
                 (codes_ENK != nullptr || codes_t_EKN != nullptr),
             "fp8 weight quantisation: codes go with their scales, and at least one of the two copies");
  const fp8::WeightBlocksPlaces p = fp8::resolve_weight_places(N, K, place, place_t);
  if (E == 0) return;
  const dim3 grid(static_cast<unsigned>(fp8::blocks(K)), static_cast<unsigned>(fp8::blocks(N)),
                  static_cast<unsigned>(E));
  // The vector paths need every row 16-byte aligned (the codes' rows then 8-byte aligned,
  // the transposed codes' 4-byte).
  const bool vector_rows = K % 8 == 0 && reinterpret_cast<uintptr_t>(w_ENK) % 16 == 0 &&
                           (codes_ENK == nullptr || (reinterpret_cast<uintptr_t>(codes_ENK) % 8 == 0 &&
                                                     p.stored.codes_ld % 8 == 0 && p.stored.expert_codes % 8 == 0));
  const bool vector_rows_t = codes_t_EKN != nullptr && N % 4 == 0 &&
                             reinterpret_cast<uintptr_t>(codes_t_EKN) % 4 == 0 && p.transposed.codes_ld % 4 == 0 &&
                             p.transposed.expert_codes % 4 == 0;
  quantize_weight_kernel<<<grid, kWeightThreads, 0, stream>>>(codes_ENK, scales, codes_t_EKN, scales_t, as_cuda(w_ENK),
                                                              N, K, p.stored, p.transposed, vector_rows,
                                                              vector_rows_t);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
