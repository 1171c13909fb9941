// fp32 kernels of the GPU decoder (model/cuda/gpu_decoder.h): the CPU decode path's ops
// (kernels/cpu/*) one to one, in fp32 so that decoded logits match the CPU's to rounding.
// Sizes are small (n new tokens, one sequence): plain kernels, no tensor cores.
#pragma once
#include <cstdint>

#include "kernels/gpu_ops.h"  // Stream

namespace moe::cuda {

void decode_embedding(float* out_nD, const int32_t* ids_n, const float* table_VD, int64_t n, int64_t D, Stream stream);
void decode_rmsnorm(float* out_nD, const float* x_nD, const float* w_D, int64_t n, int64_t D, float eps, Stream stream);
// y_nO (+)= x_nI W_OI^T (+ b_O); one warp per output element.
void decode_linear(float* y_nO, const float* x_nI, const float* w_OI, const float* b_O, int64_t n, int64_t I,
                   int64_t O, bool accumulate, Stream stream);
// Rotates heads of n tokens at positions start.. (rotate_half, as kernels/cpu/rope.cpp).
void decode_rope(float* x_nNd, int64_t n, int64_t N, int64_t d, int64_t start, double theta, Stream stream);
// out_nHd: token i (position start + i) attends to keys 0..start + i of k/v_LGd.
void decode_attention(float* out_nHd, const float* q_nHd, const float* k_LGd, const float* v_LGd, int64_t n,
                      int64_t start, int64_t H, int64_t G, int64_t d, Stream stream);
void decode_silu_mul(float* act_nF, const float* gate_nF, const float* up_nF, int64_t count, Stream stream);
void decode_add(float* y, const float* x, int64_t count, Stream stream);
// x_mD = x_nD[rows_m]; y_nD[rows_m] += weight_m * ye_mD (one expert's tokens, in order).
void decode_gather_rows(float* x_mD, const float* x_nD, const int32_t* rows_m, int64_t m, int64_t D, Stream stream);
void decode_scatter_add(float* y_nD, const float* ye_mD, const int32_t* rows_m, const float* weight_m, int64_t m,
                        int64_t D, Stream stream);

}  // namespace moe::cuda
