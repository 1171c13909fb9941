// Token dispatch on the GPU, with no host synchronisation: capacity and row layout
// (dropping by position, exactly as moe/dispatch.h on the CPU), permute into
// expert-contiguous rows, and the weighted combine, each with its backward.
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kScanThreads = 1024;

// Inclusive prefix sum over the block (blockDim.x = kScanThreads).
__device__ int block_inclusive_scan(int value, int* block_total) {
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

// One block per expert walks the T*K slots in (t, k) order; a slot's rank among the
// slots choosing this expert decides whether it fits under the capacity.
__global__ void rank_slots_kernel(int32_t* rank_TK, int32_t* counts_E, int64_t* load_E,
                                  const int32_t* expert_TK, int64_t slots, int64_t capacity) {
  const int e = blockIdx.x;
  int64_t seen = 0;
  for (int64_t base = 0; base < slots; base += blockDim.x) {
    const int64_t slot = base + threadIdx.x;
    const int mine = slot < slots && expert_TK[slot] == e;
    int chunk_total;
    const int inclusive = block_inclusive_scan(mine, &chunk_total);
    if (mine) {
      const int64_t rank = seen + inclusive - 1;
      rank_TK[slot] = rank < capacity ? static_cast<int32_t>(rank) : -1;
    }
    seen += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    counts_E[e] = static_cast<int32_t>(min(seen, capacity));
    if (load_E) load_E[e] += seen;
  }
}

// Offsets (E + 1) from counts; one block.
__global__ void offsets_kernel(int32_t* offsets_E1, const int32_t* counts_E, int64_t E) {
  int running = 0;
  for (int64_t base = 0; base < E; base += blockDim.x) {
    const int64_t e = base + threadIdx.x;
    const int count = e < E ? counts_E[e] : 0;
    int chunk_total;
    const int inclusive = block_inclusive_scan(count, &chunk_total);
    if (e < E) offsets_E1[e + 1] = running + inclusive;
    running += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets_E1[0] = 0;
}

__global__ void place_rows_kernel(int32_t* row_TK, int32_t* token_of_row, const int32_t* rank_TK,
                                  const int32_t* expert_TK, const int32_t* offsets_E1, int64_t slots, int64_t K) {
  const int64_t slot = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (slot >= slots) return;
  const int32_t rank = rank_TK[slot];
  if (rank < 0) {
    row_TK[slot] = -1;
    return;
  }
  const int32_t row = offsets_E1[expert_TK[slot]] + rank;
  row_TK[slot] = row;
  token_of_row[row] = static_cast<int32_t>(slot / K);
}

// One block per row (permute) or per token (combine); D in 16-byte-friendly loops.
__global__ void permute_kernel(__nv_bfloat16* x_RD, const __nv_bfloat16* x_TD, const int32_t* token_of_row,
                               const int32_t* offsets_E1, int64_t E, int64_t D) {
  const int64_t row = blockIdx.x;
  if (row >= offsets_E1[E]) return;  // rows past the kept ones stay untouched
  const __nv_bfloat16* src = x_TD + static_cast<int64_t>(token_of_row[row]) * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) x_RD[row * D + i] = src[i];
}

__global__ void permute_backward_kernel(__nv_bfloat16* dx_TD, const __nv_bfloat16* dx_RD, const int32_t* row_TK,
                                        int64_t K, int64_t D, bool accumulate) {
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

__global__ void combine_kernel(__nv_bfloat16* out_TD, const __nv_bfloat16* y_RD, const float* weight_TK,
                               const int32_t* row_TK, int64_t K, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = row_TK[t * K + k];
      if (row >= 0) sum += weight_TK[t * K + k] * to_float(y_RD[static_cast<int64_t>(row) * D + i]);
    }
    out_TD[t * D + i] = to_bf16(sum);
  }
}

// One block per token: dy rows for its kept slots, and the weight gradients as dot products.
__global__ void combine_backward_kernel(__nv_bfloat16* dy_RD, float* dweight_TK, const __nv_bfloat16* dout_TD,
                                        const __nv_bfloat16* y_RD, const float* weight_TK, const int32_t* row_TK,
                                        int64_t K, int64_t D) {
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

constexpr int kRowThreads = 256;

}  // namespace

void assign_rows(int32_t* row_TK, int32_t* counts_E, int32_t* offsets_E1, int32_t* token_of_row_R,
                 int64_t* load_E, int32_t* rank_scratch_TK, const int32_t* expert_TK, int64_t T, int64_t E,
                 int64_t K, int64_t capacity, Stream stream) {
  const int64_t slots = T * K;
  MOE_CHECKF(E >= 1, "assign_rows: E=%lld", static_cast<long long>(E));
  rank_slots_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, stream>>>(rank_scratch_TK, counts_E, load_E,
                                                                           expert_TK, slots, capacity);
  MOE_CUDA_CHECK_LAUNCH();
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(offsets_E1, counts_E, E);
  MOE_CUDA_CHECK_LAUNCH();
  if (slots == 0) return;
  place_rows_kernel<<<static_cast<unsigned>(ceil_div(slots, kRowThreads)), kRowThreads, 0, stream>>>(
      row_TK, token_of_row_R, rank_scratch_TK, expert_TK, offsets_E1, slots, K);
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_forward(bf16* x_RD, const bf16* x_TD, const int32_t* token_of_row_R, const int32_t* offsets_E1,
                     int64_t max_rows, int64_t E, int64_t D, Stream stream) {
  if (max_rows == 0) return;
  permute_kernel<<<static_cast<unsigned>(max_rows), kRowThreads, 0, stream>>>(
      as_cuda(x_RD), as_cuda(x_TD), token_of_row_R, offsets_E1, E, D);
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_backward(bf16* dx_TD, const bf16* dx_RD, const int32_t* row_TK, int64_t T, int64_t K, int64_t D,
                      bool accumulate, Stream stream) {
  if (T == 0) return;
  permute_backward_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(as_cuda(dx_TD), as_cuda(dx_RD),
                                                                                 row_TK, K, D, accumulate);
  MOE_CUDA_CHECK_LAUNCH();
}

void combine_forward(bf16* out_TD, const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T,
                     int64_t K, int64_t D, Stream stream) {
  if (T == 0) return;
  combine_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(as_cuda(out_TD), as_cuda(y_RD), weight_TK,
                                                                        row_TK, K, D);
  MOE_CUDA_CHECK_LAUNCH();
}

void combine_backward(bf16* dy_RD, float* dweight_TK, const bf16* dout_TD, const bf16* y_RD, const float* weight_TK,
                      const int32_t* row_TK, int64_t T, int64_t K, int64_t D, Stream stream) {
  if (T == 0) return;
  combine_backward_kernel<<<static_cast<unsigned>(T), kRowThreads, 0, stream>>>(
      as_cuda(dy_RD), dweight_TK, as_cuda(dout_TD), as_cuda(y_RD), weight_TK, row_TK, K, D);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
