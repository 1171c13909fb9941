// Expert parallelism without duplicate rows: the token blocks sent to each EP rank, the
// routing that goes with them, and the sums of the partial rows coming back
// (moe/token_exchange.h holds the CPU references and the layout).
#include <algorithm>
#include <cstdint>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"
#include "moe/cuda/token_blocks.cuh"
#include "moe/gpu_ops.h"
#include "moe/token_exchange.h"

namespace moe::cuda {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kThreads = 256;

// The global rows per slot (threads over the slots), then one thread places the
// boundaries as moe::balanced_boundaries does (E <= kMaxCutSlots, P <= 32: a binary search
// of a few dozen walks over P boundaries, microseconds).
constexpr int kMaxCutSlots = 1536;
__global__ void boundary_cuts_kernel(int32_t* cut_P1, const int32_t* counts_PE, const int32_t* slot_bounds_P1,
                                     bool split, int64_t E, int P) {
  __shared__ int64_t before[kMaxCutSlots + 1];  // rows before each slot
  __shared__ int64_t at[33];
  for (int64_t s = threadIdx.x; s < E; s += blockDim.x) {
    int64_t sum = 0;
    for (int p = 0; p < P; ++p) sum += counts_PE[p * E + s];
    before[s + 1] = sum;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  before[0] = 0;
  for (int64_t s = 0; s < E; ++s) before[s + 1] += before[s];
  const int64_t total = before[E];
  auto edge = [&](int p, int64_t extra) { return before[min(static_cast<int64_t>(slot_bounds_P1[p]) + extra, E)]; };
  auto walk = [&](int64_t most) {
    at[0] = 0;
    for (int p = 1; p < P; ++p) at[p] = max(edge(p, 0), min(edge(p, split ? 1 : 0), at[p - 1] + most));
    at[P] = total;
    for (int p = 1; p <= P; ++p)
      if (at[p] - at[p - 1] > most) return false;
    return true;
  };
  int64_t low = (total + P - 1) / P, high = max(total, low);
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (walk(mid)) high = mid;
    else low = mid + 1;
  }
  walk(low);
  cut_P1[0] = 0;
  cut_P1[P] = static_cast<int32_t>(E * kSlotParts);
  for (int p = 1; p < P; ++p) {
    const int64_t slot = slot_bounds_P1[p];
    const int64_t rows = slot < E ? before[slot + 1] - before[slot] : 0;
    const int64_t into = rows > 0 ? (at[p] - before[slot]) * kSlotParts / rows : 0;
    cut_P1[p] = static_cast<int32_t>(slot * kSlotParts + into);
  }
}

__global__ void route_ranks_kernel(int32_t* rank_TK, const int32_t* row_TK, const int32_t* slot_TK,
                                   const int32_t* offsets_E1, const int32_t* cut_P1, int64_t n_entries, int P) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_entries) return;
  const int32_t row = row_TK[i], slot = slot_TK[i];
  if (row < 0) {
    rank_TK[i] = -1;
    return;
  }
  const int64_t n = offsets_E1[slot + 1] - offsets_E1[slot], place = row - offsets_E1[slot];
  int p = 0;
  while (p + 1 < P && rows_before(n, cut_P1[p + 1] - static_cast<int64_t>(slot) * kSlotParts) <= place) ++p;
  rank_TK[i] = p;
}

// One block per rank p walks the tokens in order; a token's place is its rank among the
// tokens with an assignment going to p.
__global__ void token_blocks_kernel(int32_t* pos_TP, int32_t* tokens_P, const int32_t* rank_TK, int64_t T, int64_t K,
                                    int P) {
  const int p = blockIdx.x;
  int64_t seen = 0;
  for (int64_t base = 0; base < T; base += blockDim.x) {
    const int64_t t = base + threadIdx.x;
    int here = 0;
    if (t < T)
      for (int64_t k = 0; k < K; ++k) here |= rank_TK[t * K + k] == p;
    int chunk_total;
    const int inclusive = block_inclusive_scan(here, &chunk_total);
    if (t < T) pos_TP[t * P + p] = here ? static_cast<int32_t>(seen + inclusive - 1) : -1;
    seen += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) tokens_P[p] = static_cast<int32_t>(seen);
}

__global__ void pack_routing_kernel(int32_t* slot_UK, float* weight_UK, const int32_t* pos_TP,
                                    const int32_t* tokens_P, const int32_t* rank_TK, const int32_t* slot_TK,
                                    const float* weight_TK, const int32_t* slot_bounds_P1, int64_t T, int64_t K,
                                    int P) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= T * P) return;
  const int64_t t = item / P;
  const int p = static_cast<int>(item % P);
  const int32_t pos = pos_TP[item];
  if (pos < 0) return;
  const int64_t u = block_start(tokens_P, p) + pos;
  for (int64_t k = 0; k < K; ++k) {
    slot_UK[u * K + k] = rank_TK[t * K + k] == p ? slot_TK[t * K + k] - slot_bounds_P1[p] : -1;
    weight_UK[u * K + k] = weight_TK[t * K + k];
  }
}

__global__ void pack_counts_kernel(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P,
                                   const int32_t* slot_bounds_P1, const int32_t* window_end_P, const int32_t* cut_P1,
                                   int P) {
  int64_t part = 0;  // where peer p's part starts
  for (int p = 0; p < P; ++p) {
    const int32_t first = slot_bounds_P1[p], end = window_end_P[p];
    for (int32_t slot = first + static_cast<int32_t>(threadIdx.x); slot < end; slot += blockDim.x) {
      const int64_t start = static_cast<int64_t>(slot) * kSlotParts;
      out[part + slot - first] = static_cast<int32_t>(rows_before(counts_E[slot], cut_P1[p + 1] - start) -
                                                      rows_before(counts_E[slot], cut_P1[p] - start));
    }
    if (threadIdx.x == 0) out[part + end - first] = tokens_P[p];
    part += end - first + 1;
  }
}

// One block per (token, rank), threads over the row's elements (16-byte vectors when Vec).
template <bool Vec>
__global__ void scatter_token_rows_kernel(__nv_bfloat16* dst_UD, const __nv_bfloat16* src_TD, const int32_t* pos_TP,
                                          const int32_t* tokens_P, int P, int64_t D) {
  const int64_t t = blockIdx.x / P;
  const int p = static_cast<int>(blockIdx.x % P);
  const int32_t pos = pos_TP[blockIdx.x];
  if (pos < 0) return;
  const int64_t u = block_start(tokens_P, p) + pos;
  if constexpr (Vec) {
    const int64_t V = D / kVecElems;
    const uint4* src = reinterpret_cast<const uint4*>(src_TD + t * D);
    uint4* dst = reinterpret_cast<uint4*>(dst_UD + u * D);
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) dst[v] = src[v];
  } else {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dst_UD[u * D + d] = src_TD[t * D + d];
  }
}

// One block per token, the ranks' partial rows added in rank order in fp32.
template <bool Vec>
__global__ void sum_token_rows_kernel(__nv_bfloat16* dst_TD, const __nv_bfloat16* src_UD, const int32_t* pos_TP,
                                      const int32_t* tokens_P, int P, int64_t D) {
  const int64_t t = blockIdx.x;
  __shared__ int64_t row_of[32];  // the token's block row on each rank, -1 where none (P <= 32)
  if (threadIdx.x < P) {
    const int32_t pos = pos_TP[t * P + threadIdx.x];
    row_of[threadIdx.x] = pos < 0 ? -1 : block_start(tokens_P, threadIdx.x) + pos;
  }
  __syncthreads();
  if constexpr (Vec) {
    const int64_t V = D / kVecElems;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      float sum[kVecElems] = {};
      for (int p = 0; p < P; ++p) {
        if (row_of[p] < 0) continue;
        float part[kVecElems];
        unpack8(reinterpret_cast<const uint4*>(src_UD + row_of[p] * D)[v], part);
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) sum[j] += part[j];
      }
      reinterpret_cast<uint4*>(dst_TD + t * D)[v] = pack8(sum);
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float sum = 0;
      for (int p = 0; p < P; ++p)
        if (row_of[p] >= 0) sum += to_float(src_UD[row_of[p] * D + d]);
      dst_TD[t * D + d] = to_bf16(sum);
    }
  }
}

__global__ void sum_token_values_kernel(float* dst_TK, const float* src_UK, const int32_t* pos_TP,
                                        const int32_t* tokens_P, int64_t T, int64_t K, int P) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= T * K) return;
  const int64_t t = item / K, k = item % K;
  float sum = 0;
  for (int p = 0; p < P; ++p) {
    const int32_t pos = pos_TP[t * P + p];
    if (pos >= 0) sum += src_UK[(block_start(tokens_P, p) + pos) * K + k];
  }
  dst_TK[item] = sum;
}

unsigned row_threads(int64_t elements) {
  return static_cast<unsigned>(elements >= kThreads ? kThreads : ((elements + 31) / 32) * 32);
}

}  // namespace

void boundary_cuts(int32_t* cut_P1, const int32_t* counts_PE, const int32_t* slot_bounds_P1, bool split, int64_t E,
                   int P, Stream stream) {
  MOE_CHECKF(P >= 1 && P <= 32 && E >= 1 && E <= kMaxCutSlots, "boundary_cuts: %d ranks, %lld slots", P,
             static_cast<long long>(E));
  boundary_cuts_kernel<<<1, kThreads, 0, stream>>>(cut_P1, counts_PE, slot_bounds_P1, split, E, P);
  MOE_CUDA_CHECK_LAUNCH();
}

void route_ranks(int32_t* rank_TK, const int32_t* row_TK, const int32_t* slot_TK, const int32_t* offsets_E1,
                 const int32_t* cut_P1, int64_t T, int64_t K, int P, Stream stream) {
  if (T * K == 0) return;
  route_ranks_kernel<<<static_cast<unsigned>(ceil_div(T * K, kThreads)), kThreads, 0, stream>>>(
      rank_TK, row_TK, slot_TK, offsets_E1, cut_P1, T * K, P);
  MOE_CUDA_CHECK_LAUNCH();
}

void token_blocks(int32_t* pos_TP, int32_t* tokens_P, const int32_t* rank_TK, int64_t T, int64_t K, int P,
                  Stream stream) {
  MOE_CHECKF(P >= 1 && P <= 32, "token_blocks: %d ranks (1 to 32)", P);
  token_blocks_kernel<<<static_cast<unsigned>(P), kScanThreads, 0, stream>>>(pos_TP, tokens_P, rank_TK, T, K, P);
  MOE_CUDA_CHECK_LAUNCH();
}

void pack_routing(int32_t* slot_UK, float* weight_UK, const int32_t* pos_TP, const int32_t* tokens_P,
                  const int32_t* rank_TK, const int32_t* slot_TK, const float* weight_TK,
                  const int32_t* slot_bounds_P1, int64_t T, int64_t K, int P, Stream stream) {
  if (T == 0) return;
  pack_routing_kernel<<<static_cast<unsigned>(ceil_div(T * P, kThreads)), kThreads, 0, stream>>>(
      slot_UK, weight_UK, pos_TP, tokens_P, rank_TK, slot_TK, weight_TK, slot_bounds_P1, T, K, P);
  MOE_CUDA_CHECK_LAUNCH();
}

void pack_counts(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P, const int32_t* slot_bounds_P1,
                 const int32_t* window_end_P, const int32_t* cut_P1, int P, Stream stream) {
  pack_counts_kernel<<<1, kThreads, 0, stream>>>(out, counts_E, tokens_P, slot_bounds_P1, window_end_P, cut_P1, P);
  MOE_CUDA_CHECK_LAUNCH();
}

void scatter_token_rows(bf16* dst_UD, const bf16* src_TD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                        int P, int64_t D, Stream stream) {
  if (T == 0 || D == 0) return;
  const bool vec = vectorizable(D, {dst_UD, src_TD});
  const unsigned blocks = static_cast<unsigned>(T * P), threads = row_threads(vec ? D / kVecElems : D);
  if (vec)
    scatter_token_rows_kernel<true><<<blocks, threads, 0, stream>>>(as_cuda(dst_UD), as_cuda(src_TD), pos_TP,
                                                                    tokens_P, P, D);
  else
    scatter_token_rows_kernel<false><<<blocks, threads, 0, stream>>>(as_cuda(dst_UD), as_cuda(src_TD), pos_TP,
                                                                     tokens_P, P, D);
  MOE_CUDA_CHECK_LAUNCH();
}

void sum_token_rows(bf16* dst_TD, const bf16* src_UD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                    int P, int64_t D, Stream stream) {
  MOE_CHECKF(P >= 1 && P <= 32, "sum_token_rows: %d ranks (1 to 32)", P);
  if (T == 0 || D == 0) return;
  const bool vec = vectorizable(D, {dst_TD, src_UD});
  const unsigned threads = std::max(32u, row_threads(vec ? D / kVecElems : D));
  if (vec)
    sum_token_rows_kernel<true><<<static_cast<unsigned>(T), threads, 0, stream>>>(as_cuda(dst_TD), as_cuda(src_UD),
                                                                                  pos_TP, tokens_P, P, D);
  else
    sum_token_rows_kernel<false><<<static_cast<unsigned>(T), threads, 0, stream>>>(as_cuda(dst_TD), as_cuda(src_UD),
                                                                                   pos_TP, tokens_P, P, D);
  MOE_CUDA_CHECK_LAUNCH();
}

void sum_token_values(float* dst_TK, const float* src_UK, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                      int64_t K, int P, Stream stream) {
  if (T * K == 0) return;
  sum_token_values_kernel<<<static_cast<unsigned>(ceil_div(T * K, kThreads)), kThreads, 0, stream>>>(
      dst_TK, src_UK, pos_TP, tokens_P, T, K, P);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
