// The expert exchange's fp8 rows (core/fp8.h: [fp32 scale | D e4m3 codes | padding]) on
// the GPU: one quantiser (a block per row: the row's amax, then the codes) and one
// dequantiser, standalone and inside the row kernels that pack rows for the exchange and
// unpack them after it, each fused kernel bit for bit its unfused pair
// (docs/EXPERT_PARALLEL.md section 10).
#include <algorithm>
#include <cstdint>

#include <cuda_fp8.h>

#include "core/fp8.h"
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "moe/cuda/token_blocks.cuh"
#include "moe/gpu_ops.h"

namespace moe::cuda {
namespace {

unsigned row_threads(int64_t elements) {
  constexpr int64_t kThreads = 256;
  return static_cast<unsigned>(elements >= kThreads ? kThreads : ((elements + 31) / 32) * 32);
}

// One block of kFp8Threads per row: the row's amax (a block reduction), then every
// element's e4m3 code of x / (amax / 448) (core/fp8.h's format; a row of zeros: scale 0,
// codes 0). The one quantiser of the exchange's rows, standalone or inside packing.
constexpr int kFp8Threads = 128;
__device__ __forceinline__ float block_max(float amax) {
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  __shared__ float warp_max[kFp8Threads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int w = 0; w < kFp8Threads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  return amax;
}

__device__ void quantize_row_fp8_block(uint8_t* row, const __nv_bfloat16* x, int64_t D, int64_t row_bytes) {
  float amax = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) amax = fmaxf(amax, fabsf(__bfloat162float(x[d])));
  const float scale = block_max(amax) / 448.0f;
  if (threadIdx.x == 0) *reinterpret_cast<float*>(row) = scale;
  uint8_t* codes = row + 4;
  for (int64_t d = threadIdx.x; d < row_bytes - 4; d += blockDim.x)
    codes[d] = d < D && scale != 0.0f
                   ? static_cast<uint8_t>(__nv_cvt_float_to_fp8(__bfloat162float(x[d]) / scale, __NV_SATFINITE, __NV_E4M3))
                   : uint8_t{0};
}

// Element d of an fp8 row: decode(code) * scale in fp32, rounded to bf16 (the one dequantiser).
__device__ __forceinline__ __nv_bfloat16 dequantize_fp8_element(const uint8_t* row, float scale, int64_t d) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(row[4 + d]), __NV_E4M3);
  return __float2bfloat16_rn(__half2float(__half(h)) * scale);
}

__global__ void quantize_rows_fp8_kernel(uint8_t* dst_UB, const __nv_bfloat16* src_UD, int64_t D, int64_t row_bytes) {
  quantize_row_fp8_block(dst_UB + blockIdx.x * row_bytes, src_UD + blockIdx.x * D, D, row_bytes);
}

__global__ void dequantize_rows_fp8_kernel(__nv_bfloat16* dst_UD, const uint8_t* src_UB, int64_t D, int64_t row_bytes) {
  const uint8_t* row = src_UB + blockIdx.x * row_bytes;
  const float scale = *reinterpret_cast<const float*>(row);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dst_UD[blockIdx.x * D + d] = dequantize_fp8_element(row, scale, d);
}

// scatter_token_rows with the rows quantised on the way: one block per (token, rank).
__global__ void scatter_token_rows_fp8_kernel(uint8_t* dst_UB, const __nv_bfloat16* src_TD, const int32_t* pos_TP,
                                              const int32_t* tokens_P, int P, int64_t D, int64_t row_bytes) {
  const int64_t t = blockIdx.x / P;
  const int p = static_cast<int>(blockIdx.x % P);
  const int32_t pos = pos_TP[blockIdx.x];
  if (pos < 0) return;  // the whole block
  quantize_row_fp8_block(dst_UB + (block_start(tokens_P, p) + pos) * row_bytes, src_TD + t * D, D, row_bytes);
}

// sum_token_rows over fp8 rows: each rank's row dequantised to bf16 (as dequantize_rows_fp8)
// and added in rank order in fp32, so the result is the unfused pair's bit for bit.
__global__ void sum_token_rows_fp8_kernel(__nv_bfloat16* dst_TD, const uint8_t* src_UB, const int32_t* pos_TP,
                                          const int32_t* tokens_P, int P, int64_t D, int64_t row_bytes) {
  const int64_t t = blockIdx.x;
  __shared__ int64_t row_of[32];
  __shared__ float scale_of[32];
  if (threadIdx.x < P) {
    const int32_t pos = pos_TP[t * P + threadIdx.x];
    row_of[threadIdx.x] = pos < 0 ? -1 : block_start(tokens_P, threadIdx.x) + pos;
    scale_of[threadIdx.x] = pos < 0 ? 0.0f : *reinterpret_cast<const float*>(src_UB + row_of[threadIdx.x] * row_bytes);
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0;
    for (int p = 0; p < P; ++p)
      if (row_of[p] >= 0) sum += __bfloat162float(dequantize_fp8_element(src_UB + row_of[p] * row_bytes, scale_of[p], d));
    dst_TD[t * D + d] = __float2bfloat16_rn(sum);
  }
}


// A row computed in the kernel (value(d) in fp32, rounded to bf16 as the unfused kernel
// would store it) held in registers, kMaxFp8RowPerThread elements a thread, then quantised
// exactly as quantize_row_fp8_block does (the max is exact in any order).
constexpr int kMaxFp8RowPerThread = kMaxFusedFp8Dim / kFp8Threads;
template <class Value>
__device__ __forceinline__ void quantize_computed_row(uint8_t* row, int64_t D, int64_t row_bytes, Value value) {
  float x[kMaxFp8RowPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxFp8RowPerThread; ++j) {
    const int64_t d = threadIdx.x + static_cast<int64_t>(j) * kFp8Threads;
    x[j] = d < D ? __bfloat162float(__float2bfloat16_rn(value(d))) : 0.0f;
    amax = fmaxf(amax, fabsf(x[j]));
  }
  const float scale = block_max(amax) / 448.0f;
  if (threadIdx.x == 0) *reinterpret_cast<float*>(row) = scale;
  uint8_t* codes = row + 4;
#pragma unroll
  for (int j = 0; j < kMaxFp8RowPerThread; ++j) {
    const int64_t d = threadIdx.x + static_cast<int64_t>(j) * kFp8Threads;
    if (d < row_bytes - 4)
      codes[d] = d < D && scale != 0.0f
                     ? static_cast<uint8_t>(__nv_cvt_float_to_fp8(x[j] / scale, __NV_SATFINITE, __NV_E4M3))
                     : uint8_t{0};
  }
}

// combine_forward into fp8 rows: token u's weighted sum of its kept rows (k in order, fp32).
__global__ void combine_forward_fp8_kernel(uint8_t* dst_UB, const __nv_bfloat16* y_RD, const float* weight_UK,
                                           const int32_t* row_UK, int64_t K, int64_t D, int64_t row_bytes) {
  const int64_t u = blockIdx.x;
  quantize_computed_row(dst_UB + u * row_bytes, D, row_bytes, [&](int64_t d) {
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = row_UK[u * K + k];
      if (row >= 0) sum += weight_UK[u * K + k] * __bfloat162float(y_RD[static_cast<int64_t>(row) * D + d]);
    }
    return sum;
  });
}

// permute_backward (not accumulating) into fp8 rows: token u's kept rows added (k in order).
__global__ void permute_backward_fp8_kernel(uint8_t* dst_UB, const __nv_bfloat16* dx_RD, const int32_t* row_UK,
                                            int64_t K, int64_t D, int64_t row_bytes) {
  const int64_t u = blockIdx.x;
  quantize_computed_row(dst_UB + u * row_bytes, D, row_bytes, [&](int64_t d) {
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = row_UK[u * K + k];
      if (row >= 0) sum += __bfloat162float(dx_RD[static_cast<int64_t>(row) * D + d]);
    }
    return sum;
  });
}

// permute_forward from fp8 rows: local row r takes its token's row, dequantised.
__global__ void permute_forward_fp8_kernel(__nv_bfloat16* x_RD, const uint8_t* src_UB, const int32_t* token_of_row,
                                           const int32_t* offsets_E1, int64_t E, int64_t D, int64_t row_bytes) {
  const int64_t r = blockIdx.x;
  if (r >= offsets_E1[E]) return;  // rows past the kept ones stay untouched
  const uint8_t* row = src_UB + static_cast<int64_t>(token_of_row[r]) * row_bytes;
  const float scale = *reinterpret_cast<const float*>(row);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) x_RD[r * D + d] = dequantize_fp8_element(row, scale, d);
}

}  // namespace

void quantize_rows_fp8(uint8_t* dst_UB, const bf16* src_UD, int64_t U, int64_t D, Stream stream) {
  if (U == 0) return;
  quantize_rows_fp8_kernel<<<static_cast<unsigned>(U), kFp8Threads, 0, stream>>>(dst_UB, as_cuda(src_UD), D,
                                                                                 fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}

void dequantize_rows_fp8(bf16* dst_UD, const uint8_t* src_UB, int64_t U, int64_t D, Stream stream) {
  if (U == 0) return;
  dequantize_rows_fp8_kernel<<<static_cast<unsigned>(U), kFp8Threads, 0, stream>>>(as_cuda(dst_UD), src_UB, D,
                                                                                   fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}

void scatter_token_rows_fp8(uint8_t* dst_UB, const bf16* src_TD, const int32_t* pos_TP, const int32_t* tokens_P,
                            int64_t T, int P, int64_t D, Stream stream) {
  if (T == 0 || D == 0) return;
  scatter_token_rows_fp8_kernel<<<static_cast<unsigned>(T * P), kFp8Threads, 0, stream>>>(
      dst_UB, as_cuda(src_TD), pos_TP, tokens_P, P, D, fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}

void sum_token_rows_fp8(bf16* dst_TD, const uint8_t* src_UB, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                        int P, int64_t D, Stream stream) {
  MOE_CHECKF(P >= 1 && P <= 32, "sum_token_rows_fp8: %d ranks (1 to 32)", P);
  if (T == 0 || D == 0) return;
  sum_token_rows_fp8_kernel<<<static_cast<unsigned>(T), std::max(32u, row_threads(D)), 0, stream>>>(
      as_cuda(dst_TD), src_UB, pos_TP, tokens_P, P, D, fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}


void combine_forward_fp8(uint8_t* dst_UB, const bf16* y_RD, const float* weight_UK, const int32_t* row_UK, int64_t U,
                         int64_t K, int64_t D, Stream stream) {
  MOE_CHECKF(D <= kMaxFusedFp8Dim, "combine_forward_fp8: rows of %lld (at most %lld)", static_cast<long long>(D),
             static_cast<long long>(kMaxFusedFp8Dim));
  if (U == 0 || D == 0) return;
  combine_forward_fp8_kernel<<<static_cast<unsigned>(U), kFp8Threads, 0, stream>>>(
      dst_UB, as_cuda(y_RD), weight_UK, row_UK, K, D, fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_backward_fp8(uint8_t* dst_UB, const bf16* dx_RD, const int32_t* row_UK, int64_t U, int64_t K, int64_t D,
                          Stream stream) {
  MOE_CHECKF(D <= kMaxFusedFp8Dim, "permute_backward_fp8: rows of %lld (at most %lld)", static_cast<long long>(D),
             static_cast<long long>(kMaxFusedFp8Dim));
  if (U == 0 || D == 0) return;
  permute_backward_fp8_kernel<<<static_cast<unsigned>(U), kFp8Threads, 0, stream>>>(dst_UB, as_cuda(dx_RD), row_UK,
                                                                                   K, D, fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}

void permute_forward_fp8(bf16* x_RD, const uint8_t* src_UB, const int32_t* token_of_row_R, const int32_t* offsets_E1,
                         int64_t max_rows, int64_t E, int64_t D, Stream stream) {
  if (max_rows == 0 || D == 0) return;
  permute_forward_fp8_kernel<<<static_cast<unsigned>(max_rows), kFp8Threads, 0, stream>>>(
      as_cuda(x_RD), src_UB, token_of_row_R, offsets_E1, E, D, fp8_row_bytes(D));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
