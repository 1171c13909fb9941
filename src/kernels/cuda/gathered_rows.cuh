// Weighted sums of gathered 16-byte row vectors (the MoE combine's arithmetic), shared by
// the combine (moe/cuda/dispatch.cu) and the norm that sums a layer's expert rows itself
// (rmsnorm.cu, ResidualBranch): one definition, so both give the same bits.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace moe::cuda {

constexpr int kSlotChunk = 8;  // slots (k) in flight per thread: loads issued before the sums

// sum[e] += w_k * rows_RV[row_K[k]][i][e] over the kept slots (row >= 0), k = 0..K-1 in
// order; w_k = 1 when weight_K is null. Up to kSlotChunk loads in flight before the adds.
__device__ __forceinline__ void add_rows(float (&sum)[kVecElems], const uint4* rows_RV, const int32_t* row_K,
                                         const float* weight_K, int64_t K, int64_t V, int64_t i) {
  for (int64_t k0 = 0; k0 < K; k0 += kSlotChunk) {
    int32_t row[kSlotChunk];
    uint4 v[kSlotChunk];
#pragma unroll
    for (int j = 0; j < kSlotChunk; ++j) {
      row[j] = k0 + j < K ? row_K[k0 + j] : -1;
      v[j] = row[j] >= 0 ? __ldg(rows_RV + static_cast<int64_t>(row[j]) * V + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kSlotChunk; ++j) {
      if (row[j] < 0) continue;
      float f[kVecElems];
      unpack8(v[j], f);
      if (weight_K) {
        const float w = weight_K[k0 + j];
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) sum[e] += w * f[e];
      } else {
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) sum[e] += f[e];
      }
    }
  }
}

// The scalar kernels' element: sum over the kept slots of w_k * rows_RD[row_K[k]][i], k in
// order (the same multiply-adds as add_rows).
__device__ __forceinline__ float weighted_row_sum(const __nv_bfloat16* rows_RD, const int32_t* row_K,
                                                  const float* weight_K, int64_t K, int64_t D, int64_t i) {
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t row = row_K[k];
    if (row >= 0) sum += weight_K[k] * to_float(rows_RD[static_cast<int64_t>(row) * D + i]);
  }
  return sum;
}

}  // namespace moe::cuda
