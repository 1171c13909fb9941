// Token dispatch on the GPU, with no host synchronisation: capacity and row layout
// (dropping by position, exactly as moe/dispatch.h on the CPU), permute into
// expert-contiguous rows, and the weighted combine, each with its backward.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_row_tiles.cuh"
#include "kernels/cuda/gathered_rows.cuh"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kScanThreads = 1024;


// The row layout as a stable counting sort in tiles of kTile assignments, so that the work
// spreads over T*K / kTile blocks instead of one block per expert walking all of them.
// 1. tile_ranks: per tile, each assignment's rank among the tile's assignments of its
//    expert (warps match equal experts; per-warp counts scanned over the tile's warps),
//    and the tile's count per expert.
// 2. expert_tile_bases: per expert, the counts scanned over the tiles (where each tile's
//    assignments of it start), its total (the load) and its kept rows (the capacity).
// 3. offsets, then place_rows: rank = tile base + rank in tile, kept iff below the capacity.
constexpr int kTile = 256;
constexpr int64_t kMaxTileExperts = 48 * 1024 / (kTile / 32) / 4;  // the warps' counts in 48 KB of shared memory
constexpr int kTileWarps = kTile / 32;

__global__ void tile_ranks_kernel(int32_t* rank_TK, int32_t* tile_counts_ET, const int32_t* expert_TK, int64_t slots,
                                  int64_t E, int64_t n_tiles) {
  extern __shared__ int32_t warp_counts[];  // [kTileWarps][E], then the warps' bases
  const int64_t tile = blockIdx.x, i = tile * kTile + threadIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t j = threadIdx.x; j < kTileWarps * E; j += blockDim.x) warp_counts[j] = 0;
  __syncthreads();
  const int32_t e = i < slots ? expert_TK[i] : -1;
  const unsigned same = __match_any_sync(0xffffffffu, e);
  const int rank_in_warp = __popc(same & ((1u << lane) - 1));
  if (e >= 0 && rank_in_warp == 0) warp_counts[warp * E + e] = __popc(same);
  __syncthreads();
  // Each expert's counts over the warps, in warp order: the warps' bases; the tile's total.
  for (int64_t x = threadIdx.x; x < E; x += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < kTileWarps; ++w) {
      const int32_t count = warp_counts[w * E + x];
      warp_counts[w * E + x] = running;
      running += count;
    }
    tile_counts_ET[x * n_tiles + tile] = running;
  }
  __syncthreads();
  if (i < slots && e >= 0) rank_TK[i] = warp_counts[warp * E + e] + rank_in_warp;
}

// One block per expert: exclusive prefix of its tile counts, in place (tile bases).
__global__ void expert_tile_bases_kernel(int32_t* tile_counts_ET, int32_t* counts_E, int64_t* load_E, int64_t n_tiles,
                                         int64_t capacity) {
  const int64_t e = blockIdx.x;
  int32_t* counts = tile_counts_ET + e * n_tiles;
  int64_t seen = 0;
  for (int64_t base = 0; base < n_tiles; base += blockDim.x) {
    const int64_t tile = base + threadIdx.x;
    const int count = tile < n_tiles ? counts[tile] : 0;
    int chunk_total;
    const int inclusive = block_inclusive_scan(count, &chunk_total);
    if (tile < n_tiles) counts[tile] = static_cast<int32_t>(seen + inclusive - count);
    seen += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    counts_E[e] = static_cast<int32_t>(min(seen, capacity));
    if (load_E) load_E[e] += seen;
  }
}

// Offsets (E + 1) from counts, each expert's rows rounded up to row_align, and (kept_1 not
// null) the rows' count without that padding; one block.
__global__ void offsets_kernel(int32_t* offsets_E1, int32_t* kept_1, const int32_t* counts_E, int64_t E,
                               int row_align) {
  int running = 0, kept = 0;
  for (int64_t base = 0; base < E; base += blockDim.x) {
    const int64_t e = base + threadIdx.x;
    const int raw = e < E ? counts_E[e] : 0;
    const int count = (raw + row_align - 1) / row_align * row_align;
    int chunk_total;
    const int inclusive = block_inclusive_scan(count, &chunk_total);
    if (e < E) offsets_E1[e + 1] = running + inclusive;
    running += chunk_total;
    __syncthreads();
    if (kept_1) {
      block_inclusive_scan(raw, &chunk_total);
      kept += chunk_total;
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) {
    offsets_E1[0] = 0;
    if (kept_1) *kept_1 = kept;
  }
}

__global__ void place_rows_kernel(int32_t* row_TK, int32_t* token_of_row, const int32_t* rank_TK,
                                  const int32_t* tile_bases_ET, const int32_t* expert_TK, const int32_t* offsets_E1,
                                  int64_t slots, int64_t K, int64_t n_tiles, int64_t capacity) {
  const int64_t slot = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (slot >= slots) return;
  // An expert < 0 (routed to another rank) has no row; tile_ranks never ranked it.
  const int32_t e = expert_TK[slot];
  const int64_t rank = e < 0 ? -1 : tile_bases_ET[e * n_tiles + slot / kTile] + rank_TK[slot];
  if (rank < 0 || rank >= capacity) {
    row_TK[slot] = -1;
    return;
  }
  const int32_t row = offsets_E1[e] + static_cast<int32_t>(rank);
  row_TK[slot] = row;
  token_of_row[row] = static_cast<int32_t>(slot / K);
}

// Scalar fallback, one block per row (permute) or per token (combine): used when D is not a
// multiple of 8 or a row pointer is not 16-byte aligned.
__global__ void permute_scalar_kernel(__nv_bfloat16* x_RD, const __nv_bfloat16* x_TD,
                                      const int32_t* token_of_row, const int32_t* offsets_E1, int64_t E, int64_t D) {
  const int64_t row = blockIdx.x;
  if (row >= offsets_E1[E]) return;  // rows past the kept ones stay untouched
  const __nv_bfloat16* src = x_TD + static_cast<int64_t>(token_of_row[row]) * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) x_RD[row * D + i] = src[i];
}

__global__ void permute_by_token_scalar_kernel(__nv_bfloat16* x_RD, const __nv_bfloat16* x_TD, const int32_t* row_TK,
                                               int64_t K, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const __nv_bfloat16 v = x_TD[t * D + i];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = row_TK[t * K + k];
      if (row >= 0) x_RD[static_cast<int64_t>(row) * D + i] = v;
    }
  }
}

__global__ void permute_backward_scalar_kernel(__nv_bfloat16* dx_TD, const __nv_bfloat16* dx_RD,
                                               const int32_t* row_TK, int64_t K, int64_t D, bool accumulate) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float sum = accumulate ? to_float(dx_TD[t * D + i]) : 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = row_TK[t * K + k];
      if (row >= 0) sum += to_float(dx_RD[static_cast<int64_t>(row) * D + i]);
    }
    dx_TD[t * D + i] = to_bf16(sum);
  }
}

__global__ void combine_scalar_kernel(__nv_bfloat16* out_TD, const __nv_bfloat16* y_RD, const float* weight_TK,
                                      const int32_t* row_TK, int64_t K, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    out_TD[t * D + i] = to_bf16(weighted_row_sum(y_RD, row_TK + t * K, weight_TK + t * K, K, D, i));
}

// One block per token: dy rows for its kept slots, and the weight gradients as dot products.
__global__ void combine_backward_scalar_kernel(__nv_bfloat16* dy_RD, float* dweight_TK,
                                               const __nv_bfloat16* dout_TD, const __nv_bfloat16* y_RD,
                                               const float* weight_TK, const int32_t* row_TK, int64_t K, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t row = row_TK[t * K + k];
    if (row < 0) {
      if (threadIdx.x == 0) dweight_TK[t * K + k] = 0.0f;
      continue;
    }
    const float w = weight_TK[t * K + k];
    float dot = 0.0f;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const float g = to_float(dout_TD[t * D + i]);
      dy_RD[static_cast<int64_t>(row) * D + i] = to_bf16(w * g);
      dot += g * to_float(y_RD[static_cast<int64_t>(row) * D + i]);
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) dweight_TK[t * K + k] = dot;
  }
}

// Vector path: rows as 16-byte vectors of 8 bf16 (V = D / 8 per row). Each row or token
// gets a group of `lanes` threads (a power of two up to the block, 1 << lane_bits), so a
// block serves several tokens when D is small. Sums keep the order of the scalar kernels:
// k = 0..K-1 for every element, fp32.
constexpr int kVecThreads = 256;

struct GroupIndex {
  int64_t item;  // row or token of this thread's group
  int lane, lanes;
};

__device__ __forceinline__ GroupIndex group_index(int lane_bits) {
  const int lanes = 1 << lane_bits;
  return {static_cast<int64_t>(blockIdx.x) * (blockDim.x >> lane_bits) + (threadIdx.x >> lane_bits),
          static_cast<int>(threadIdx.x) & (lanes - 1), lanes};
}

__global__ void permute_vec_kernel(uint4* x_RV, const uint4* x_TV, const int32_t* token_of_row,
                                   const int32_t* offsets_E1, int64_t E, int64_t max_rows, int64_t V, int lane_bits) {
  const GroupIndex g = group_index(lane_bits);
  const int64_t row = g.item;
  if (row >= max_rows || row >= offsets_E1[E]) return;  // rows past the kept ones stay untouched
  const uint4* src = x_TV + static_cast<int64_t>(token_of_row[row]) * V;
  uint4* dst = x_RV + row * V;
#pragma unroll 4
  for (int64_t i = g.lane; i < V; i += g.lanes) dst[i] = __ldg(src + i);
}

// permute_forward_by_token: a token's row read once (streamed) and stored to each of its
// kept rows; every kept row has exactly one slot, so no two threads write one row. kCodes
// (D % 128 == 0, so a group holds whole 1 x 128 tiles, 16 lanes each): the row's e4m3
// codes and scales too, as quantize_rows_blockwise of the rows written gives them.
template <bool kCodes>
__global__ void permute_by_token_vec_kernel(uint4* x_RV, const uint4* x_TV, const int32_t* row_TK, int64_t T,
                                            int64_t K, int64_t V, int lane_bits, RowCodes codes) {
  const GroupIndex g = group_index(lane_bits);
  const int64_t t = g.item;
  if (t >= T) return;
  const int32_t* row_K = row_TK + t * K;
  for (int64_t i = g.lane; i < V; i += g.lanes) {
    const uint4 v = __ldcs(x_TV + t * V + i);
    uint2 words;
    float scale = 0.0f;
    if constexpr (kCodes) {
      float f[kVecElems];
      unpack8(v, f);
      scale = tile_words_of_8(f, words);
    }
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = __ldg(row_K + k);
      if (row < 0) continue;
      x_RV[static_cast<int64_t>(row) * V + i] = v;
      if constexpr (kCodes) store_tile_codes(codes, words, scale, row, i, V);
    }
  }
}

__global__ void permute_backward_vec_kernel(uint4* dx_TV, const uint4* dx_RV, const int32_t* row_TK, int64_t T,
                                            int64_t K, int64_t V, bool accumulate, int lane_bits) {
  const GroupIndex g = group_index(lane_bits);
  const int64_t t = g.item;
  if (t >= T) return;
  for (int64_t i = g.lane; i < V; i += g.lanes) {
    float sum[kVecElems];
    if (accumulate) {
      unpack8(dx_TV[t * V + i], sum);
    } else {
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) sum[e] = 0.0f;
    }
    add_rows(sum, dx_RV, row_TK + t * K, nullptr, K, V, i);
    dx_TV[t * V + i] = pack8(sum);
  }
}

__global__ void combine_vec_kernel(uint4* out_TV, const uint4* y_RV, const float* weight_TK, const int32_t* row_TK,
                                   int64_t T, int64_t K, int64_t V, int lane_bits) {
  const GroupIndex g = group_index(lane_bits);
  const int64_t t = g.item;
  if (t >= T) return;
  for (int64_t i = g.lane; i < V; i += g.lanes) {
    float sum[kVecElems] = {};
    add_rows(sum, y_RV, row_TK + t * K, weight_TK + t * K, K, V, i);
    out_TV[t * V + i] = pack8(sum);
  }
}

// Sums v[j], j < slots, over the lanes of each group (at most a warp: combine_backward's
// launch) in a fixed order, an xor butterfly; the result is valid at every lane. Every lane
// of the warp must call it (lane_bits and slots are uniform over the block).
template <int kChunk>
__device__ __forceinline__ void group_sum(float (&v)[kChunk], int lane_bits, int64_t slots) {
  for (int offset = (1 << lane_bits) >> 1; offset > 0; offset >>= 1) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      if (j < slots) v[j] += __shfl_xor_sync(0xffffffffu, v[j], offset);
  }
}

// dy rows for a token's kept slots and the weight gradients; dout is read once per chunk
// of kChunk slots (2, 4 or 8: the fewest covering K, so top-2 holds no registers for 8),
// the dot products reduced deterministically by group_sum (each slot's alone: the chunk
// changes no bits). kCodes: the dy rows' e4m3 codes and scales too (as
// permute_by_token_vec_kernel's).
template <bool kCodes, int kChunk>
__global__ void combine_backward_vec_kernel(uint4* dy_RV, float* dweight_TK, const uint4* dout_TV,
                                            const uint4* y_RV, const float* weight_TK, const int32_t* row_TK,
                                            int64_t T, int64_t K, int64_t V, int lane_bits, RowCodes codes) {
  const GroupIndex g = group_index(lane_bits);
  const int64_t t = g.item;
  const bool active = t < T;  // inactive lanes still join group_sum's shuffles
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    int32_t row[kChunk];
    float w[kChunk], dot[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      row[j] = active && k0 + j < K ? row_TK[t * K + k0 + j] : -1;
      w[j] = row[j] >= 0 ? weight_TK[t * K + k0 + j] : 0.0f;
      dot[j] = 0.0f;
    }
    if (active) {
      for (int64_t i = g.lane; i < V; i += g.lanes) {
        float grad[kVecElems];
        unpack8(__ldg(dout_TV + t * V + i), grad);
        uint4 y[kChunk];
#pragma unroll
        for (int j = 0; j < kChunk; ++j)
          y[j] = row[j] >= 0 ? __ldg(y_RV + static_cast<int64_t>(row[j]) * V + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          if (row[j] < 0) continue;  // the same for the token's whole group
          float f[kVecElems], dy[kVecElems];
          unpack8(y[j], f);
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) {
            dy[e] = w[j] * grad[e];
            dot[j] += grad[e] * f[e];
          }
          const uint4 packed = pack8(dy);
          dy_RV[static_cast<int64_t>(row[j]) * V + i] = packed;
          if constexpr (kCodes) {
            unpack8(packed, dy);  // the bf16 values written are what gets quantised
            uint2 words;
            const float scale = tile_words_of_8(dy, words);
            store_tile_codes(codes, words, scale, row[j], i, V);
          }
        }
      }
    }
    group_sum(dot, lane_bits, K - k0);
    if (active && g.lane == 0) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
        if (k0 + j < K) dweight_TK[t * K + k0 + j] = row[j] >= 0 ? dot[j] : 0.0f;
    }
  }
}

constexpr int kRowThreads = 256;

__global__ void lookup_kernel(int32_t* out, const int32_t* table, const int32_t* index, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = table[index[i]];
}

}  // namespace

void lookup(int32_t* out_N, const int32_t* table, const int32_t* index_N, int64_t n, Stream stream) {
  if (n == 0) return;
  lookup_kernel<<<static_cast<unsigned>(ceil_div(n, kRowThreads)), kRowThreads, 0, stream>>>(out_N, table, index_N,
                                                                                            n);
  MOE_CUDA_CHECK_LAUNCH();
}

int64_t assign_rows_scratch(int64_t T, int64_t K, int64_t E) { return T * K + E * std::max<int64_t>(1, ceil_div(T * K, kTile)); }

void assign_rows(int32_t* row_TK, int32_t* counts_E, int32_t* offsets_E1, int32_t* token_of_row_R,
                 int64_t* load_E, int32_t* scratch, const int32_t* expert_TK, int64_t T, int64_t E,
                 int64_t K, int64_t capacity, Stream stream, int64_t row_align, int32_t* kept_1) {
  const int64_t slots = T * K, n_tiles = std::max<int64_t>(1, ceil_div(slots, kTile));
  MOE_CHECKF(E >= 1 && E <= kMaxTileExperts, "assign_rows: E=%lld (1 to %lld)", static_cast<long long>(E),
             static_cast<long long>(kMaxTileExperts));
  MOE_CHECKF(row_align >= 1 && row_align <= 1024, "assign_rows: rows aligned to %lld (1 to 1024)",
             static_cast<long long>(row_align));
  int32_t* rank_TK = scratch;
  int32_t* tile_counts_ET = scratch + slots;
  const size_t shared = static_cast<size_t>(kTileWarps * E) * sizeof(int32_t);
  tile_ranks_kernel<<<static_cast<unsigned>(n_tiles), kTile, shared, stream>>>(rank_TK, tile_counts_ET, expert_TK,
                                                                               slots, E, n_tiles);
  MOE_CUDA_CHECK_LAUNCH();
  expert_tile_bases_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, stream>>>(tile_counts_ET, counts_E, load_E,
                                                                                  n_tiles, capacity);
  MOE_CUDA_CHECK_LAUNCH();
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(offsets_E1, kept_1, counts_E, E, static_cast<int>(row_align));
  MOE_CUDA_CHECK_LAUNCH();
  if (slots == 0) return;
  place_rows_kernel<<<static_cast<unsigned>(ceil_div(slots, kRowThreads)), kRowThreads, 0, stream>>>(
      row_TK, token_of_row_R, rank_TK, tile_counts_ET, expert_TK, offsets_E1, slots, K, n_tiles, capacity);
  MOE_CUDA_CHECK_LAUNCH();
}

namespace {

struct VecLaunch {
  int lane_bits;    // threads per row or token: 1 << lane_bits, at least the vectors per row up to the block
  unsigned blocks;
};

// max_lanes: a power of two up to the block.
VecLaunch vec_launch(int64_t items, int64_t V, int max_lanes = kVecThreads) {
  int lane_bits = 0;
  while ((int64_t{1} << lane_bits) < V && (1 << lane_bits) < max_lanes) ++lane_bits;
  const int64_t per_block = kVecThreads >> lane_bits;
  return {lane_bits, static_cast<unsigned>(ceil_div(items, per_block))};
}

const uint4* as_vec(const bf16* p) { return reinterpret_cast<const uint4*>(p); }
uint4* as_vec(bf16* p) { return reinterpret_cast<uint4*>(p); }

// At most a warp a token (several vectors a lane): the weights' dot products then reduce
// inside the warp (group_sum's bound), with no block-wide stage and barrier per token; with
// codes, at least the 16 lanes of a tile, as V >= 16 there.
template <bool kCodes>
void launch_combine_backward(bf16* dy_RD, const RowCodes& codes, float* dweight_TK, const bf16* dout_TD,
                             const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T, int64_t K,
                             int64_t D, Stream stream) {
  const int64_t V = D / kVecElems;
  const VecLaunch launch = vec_launch(T, V, 32);
  const auto kernel = K <= 2   ? combine_backward_vec_kernel<kCodes, 2>
                      : K <= 4 ? combine_backward_vec_kernel<kCodes, 4>
                               : combine_backward_vec_kernel<kCodes, 8>;
  kernel<<<launch.blocks, kVecThreads, 0, stream>>>(as_vec(dy_RD), dweight_TK, as_vec(dout_TD), as_vec(y_RD),
                                                    weight_TK, row_TK, T, K, V, launch.lane_bits, codes);
}

// The fp8 row kernels: whole 1 x 128 tiles on the vector path.
bool row_codes_fit(int64_t D, std::initializer_list<const void*> rows, const RowCodes& codes) {
  return D % fp8::kBlock == 0 && vectorizable(D, rows) && reinterpret_cast<uintptr_t>(codes.codes_RK) % 8 == 0 &&
         codes.scales != nullptr && (codes.offsets_E1 == nullptr || codes.E >= 1);
}

}  // namespace

void permute_forward(bf16* x_RD, const bf16* x_TD, const int32_t* token_of_row_R, const int32_t* offsets_E1,
                     int64_t max_rows, int64_t E, int64_t D, Stream stream) {
  if (max_rows == 0) return;
  if (vectorizable(D, {x_RD, x_TD})) {
    const int64_t V = D / kVecElems;
    const VecLaunch launch = vec_launch(max_rows, V);
    permute_vec_kernel<<<launch.blocks, kVecThreads, 0, stream>>>(as_vec(x_RD), as_vec(x_TD), token_of_row_R,
                                                                  offsets_E1, E, max_rows, V, launch.lane_bits);
  } else {
    permute_scalar_kernel<<<static_cast<unsigned>(max_rows), kRowThreads, 0, stream>>>(
        as_cuda(x_RD), as_cuda(x_TD), token_of_row_R, offsets_E1, E, D);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_forward_by_token(bf16* x_RD, const bf16* x_TD, const int32_t* row_TK, int64_t T, int64_t K, int64_t D,
                              Stream stream) {
  if (T == 0) return;
  if (vectorizable(D, {x_RD, x_TD})) {
    const int64_t V = D / kVecElems;
    const VecLaunch launch = vec_launch(T, V);
    permute_by_token_vec_kernel<false><<<launch.blocks, kVecThreads, 0, stream>>>(
        as_vec(x_RD), as_vec(x_TD), row_TK, T, K, V, launch.lane_bits, RowCodes{});
  } else {
    permute_by_token_scalar_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(as_cuda(x_RD),
                                                                                         as_cuda(x_TD), row_TK, K, D);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_forward_by_token_fp8(bf16* x_RD, const RowCodes& codes, const bf16* x_TD, const int32_t* row_TK,
                                  int64_t T, int64_t K, int64_t D, Stream stream) {
  MOE_CHECKF(row_codes_fit(D, {x_RD, x_TD}, codes),
             "fp8 permute: D = %lld (a multiple of 128), rows 16-byte aligned, codes 8, offsets of experts",
             static_cast<long long>(D));
  if (T == 0) return;
  const int64_t V = D / kVecElems;
  const VecLaunch launch = vec_launch(T, V);
  permute_by_token_vec_kernel<true><<<launch.blocks, kVecThreads, 0, stream>>>(as_vec(x_RD), as_vec(x_TD), row_TK, T,
                                                                               K, V, launch.lane_bits, codes);
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_backward(bf16* dx_TD, const bf16* dx_RD, const int32_t* row_TK, int64_t T, int64_t K, int64_t D,
                      bool accumulate, Stream stream) {
  if (T == 0) return;
  if (vectorizable(D, {dx_TD, dx_RD})) {
    const int64_t V = D / kVecElems;
    const VecLaunch launch = vec_launch(T, V);
    permute_backward_vec_kernel<<<launch.blocks, kVecThreads, 0, stream>>>(as_vec(dx_TD), as_vec(dx_RD), row_TK, T,
                                                                           K, V, accumulate, launch.lane_bits);
  } else {
    permute_backward_scalar_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(
        as_cuda(dx_TD), as_cuda(dx_RD), row_TK, K, D, accumulate);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void combine_forward(bf16* out_TD, const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T,
                     int64_t K, int64_t D, Stream stream) {
  if (T == 0) return;
  if (vectorizable(D, {out_TD, y_RD})) {
    const int64_t V = D / kVecElems;
    const VecLaunch launch = vec_launch(T, V);
    combine_vec_kernel<<<launch.blocks, kVecThreads, 0, stream>>>(as_vec(out_TD), as_vec(y_RD), weight_TK, row_TK, T,
                                                                  K, V, launch.lane_bits);
  } else {
    combine_scalar_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(as_cuda(out_TD), as_cuda(y_RD),
                                                                               weight_TK, row_TK, K, D);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void combine_backward(bf16* dy_RD, float* dweight_TK, const bf16* dout_TD, const bf16* y_RD, const float* weight_TK,
                      const int32_t* row_TK, int64_t T, int64_t K, int64_t D, Stream stream) {
  if (T == 0) return;
  if (vectorizable(D, {dy_RD, dout_TD, y_RD})) {
    launch_combine_backward<false>(dy_RD, RowCodes{}, dweight_TK, dout_TD, y_RD, weight_TK, row_TK, T, K, D, stream);
  } else {
    combine_backward_scalar_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(
        as_cuda(dy_RD), dweight_TK, as_cuda(dout_TD), as_cuda(y_RD), weight_TK, row_TK, K, D);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void combine_backward_fp8(bf16* dy_RD, const RowCodes& codes, float* dweight_TK, const bf16* dout_TD,
                          const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T, int64_t K,
                          int64_t D, Stream stream) {
  MOE_CHECKF(row_codes_fit(D, {dy_RD, dout_TD, y_RD}, codes),
             "fp8 combine backward: D = %lld (a multiple of 128), rows 16-byte aligned, codes 8, offsets of experts",
             static_cast<long long>(D));
  if (T == 0) return;
  launch_combine_backward<true>(dy_RD, codes, dweight_TK, dout_TD, y_RD, weight_TK, row_TK, T, K, D, stream);
  MOE_CUDA_CHECK_LAUNCH();
}

namespace {

// One block per (padding row j of expert e): row offsets_E1[e] + counts_E[e] + j while
// below offsets_E1[e + 1].
__global__ void zero_padding_rows_kernel(__nv_bfloat16* rows_RD, RowCodes codes, const int32_t* offsets_E1,
                                         const int32_t* counts_E, int64_t D) {
  const int64_t e = blockIdx.y, row = offsets_E1[e] + counts_E[e] + blockIdx.x;
  if (row >= offsets_E1[e + 1]) return;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) rows_RD[row * D + i] = to_bf16(0.0f);
  if (codes.codes_RK == nullptr) return;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) codes.codes_RK[row * D + i] = 0;
  const int64_t KB = D / fp8::kBlock;
  for (int64_t kb = threadIdx.x; kb < KB; kb += blockDim.x)
    write_tile_scale(codes.scales, fp8::block_scale(0.0f), codes.offsets_E1, codes.E, codes.R, row, kb, KB);
}

}  // namespace

void zero_padding_rows(bf16* rows_RD, const RowCodes& codes, const int32_t* offsets_E1, const int32_t* counts_E,
                       int64_t E, int64_t D, int64_t row_align, Stream stream) {
  MOE_CHECKF(E >= 1 && E <= 65535 && row_align >= 1 && row_align <= 1024 &&
                 (codes.codes_RK == nullptr || (D % fp8::kBlock == 0 && codes.scales != nullptr)),
             "zero_padding_rows: %lld experts, rows aligned to %lld, D = %lld (a multiple of 128 with codes)",
             static_cast<long long>(E), static_cast<long long>(row_align), static_cast<long long>(D));
  if (row_align == 1 || D == 0) return;
  const dim3 grid(static_cast<unsigned>(row_align - 1), static_cast<unsigned>(E));
  zero_padding_rows_kernel<<<grid, kRowThreads, 0, stream>>>(as_cuda(rows_RD), codes, offsets_E1, counts_E, D);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
