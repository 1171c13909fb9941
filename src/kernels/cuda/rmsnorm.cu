// RMSNorm on the GPU, forward fused with the residual add before it (whose branch may be an MoE
// layer's expert rows, summed here: ResidualBranch). 16-byte vectors held
// in registers when the width allows, element by element otherwise. One block per row in
// the forward; the backward gives each block a fixed run of rows so the weight
// gradient is summed in a fixed order (deterministic, no atomics).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_row_tiles.cuh"
#include "kernels/cuda/gathered_rows.cuh"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowsPerBlock = 32;

// The branch's rows as the kernels read them (ResidualBranch's fields; rows null: none).
struct BranchRows {
  const void* rows;
  const float* weight_TK;
  const int32_t* row_TK;  // null: rows is the [T, D] branch itself
  int64_t K;
};

BranchRows branch_rows(const ResidualBranch& b) { return {b.rows, b.weight_TK, b.row_TK, b.K}; }

__global__ void rmsnorm_forward_kernel(__nv_bfloat16* y, float* rstd, __nv_bfloat16* residual_out,
                                       const __nv_bfloat16* x, BranchRows branch, const __nv_bfloat16* w,
                                       int64_t D, float eps) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* x_row = x + row * D;
  const auto* rows = static_cast<const __nv_bfloat16*>(branch.rows);
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float v = to_float(x_row[i]);
    if (rows) {
      // The branch as stored (bf16), then the residual stream as stored (bf16): normalise
      // the rounded sum, which is what the backward pass will read back.
      const float b = branch.row_TK
                          ? to_float(to_bf16(weighted_row_sum(rows, branch.row_TK + row * branch.K,
                                                              branch.weight_TK + row * branch.K, branch.K, D, i)))
                          : to_float(rows[row * D + i]);
      const __nv_bfloat16 sum = to_bf16(v + b);
      residual_out[row * D + i] = sum;
      v = to_float(sum);
    }
    sum_sq += v * v;
  }
  const float r = rsqrtf(block_sum(sum_sq) / static_cast<float>(D) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  const __nv_bfloat16* source = rows ? residual_out + row * D : x_row;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    y[row * D + i] = to_bf16(to_float(source[i]) * r * to_float(w[i]));
}

__global__ void rmsnorm_backward_kernel(__nv_bfloat16* dx, float* dw_partial, const __nv_bfloat16* dy,
                                        const __nv_bfloat16* dresidual, const __nv_bfloat16* x,
                                        const __nv_bfloat16* w, const float* rstd, int64_t T, int64_t D) {
  const int64_t first = blockIdx.x * kRowsPerBlock;
  const int64_t last = min(T, first + kRowsPerBlock);
  float* partial = dw_partial + blockIdx.x * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) partial[i] = 0.0f;
  for (int64_t row = first; row < last; ++row) {
    const float r = rstd[row];
    float dot = 0.0f;  // sum_i dy_i * w_i * x_i
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
      dot += to_float(dy[row * D + i]) * to_float(w[i]) * to_float(x[row * D + i]);
    dot = block_sum(dot) / static_cast<float>(D);
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const float xi = to_float(x[row * D + i]), dyi = to_float(dy[row * D + i]);
      float g = r * (to_float(w[i]) * dyi - xi * r * r * dot);
      if (dresidual) g += to_float(dresidual[row * D + i]);
      dx[row * D + i] = to_bf16(g);
      partial[i] += dyi * xi * r;  // each thread owns its columns: no race
    }
  }
}

// The weight gradient's column sums over the blocks' partial rows, in two fixed-order
// stages so that every SM takes part (one thread a column summing all rows ran on D / 256
// blocks: 58 us a call at olmoe-mini's 1,024 x 1,024 partials, 1.9 ms a step): first each
// group of kGroupRows rows, in row order, into the group's first row (its own column of
// its own rows: in place), then the groups in order onto dw.
constexpr int64_t kGroupRows = 32;
__global__ void sum_partial_groups_kernel(float* partial, int64_t blocks, int64_t D) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= D) return;
  const int64_t first = blockIdx.y * kGroupRows, last = min(blocks, first + kGroupRows);
  float sum = 0.0f;
  for (int64_t b = first; b < last; ++b) sum += partial[b * D + i];
  partial[first * D + i] = sum;
}
__global__ void sum_partials_kernel(float* dw, const float* partial, int64_t blocks, int64_t D) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= D) return;
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; b += kGroupRows) sum += partial[b * D + i];
  dw[i] += sum;
}

// Vector paths (D % 8 == 0, D <= 8192, aligned rows): thread v of a block holds columns
// 8v .. 8v + 7 of its rows in registers (the weight and, in the backward, its weight-gradient
// partial sums too). Same per-element math and column order as the scalar kernels.
constexpr int64_t kMaxVecD = 1024 * kVecElems;

// kCodes (D a multiple of 128: a tile's 16 threads all active or all not): y's e4m3 codes
// and scales too, from the bf16 values stored.
template <bool kCodes>
__global__ void rmsnorm_forward_vec_kernel(uint4* y, float* rstd, uint4* residual_out, const uint4* x,
                                           BranchRows branch, const uint4* w, int64_t Dv, float eps,
                                           RowCodes codes) {
  const int64_t row = blockIdx.x;
  const int64_t v = threadIdx.x, at = row * Dv + v;
  const bool active = v < Dv;
  const auto* rows = static_cast<const uint4*>(branch.rows);
  float f[kVecElems] = {};
  float sum_sq = 0.0f;
  if (active) {
    unpack8(x[at], f);
    if (rows) {
      // The branch as stored (bf16; gathered rows: the combine's sum rounded), then the
      // residual stream as stored: normalise the rounded sum, as the backward reads it.
      float b[kVecElems];
      if (branch.row_TK) {
        float sum[kVecElems] = {};
        add_rows(sum, rows, branch.row_TK + row * branch.K, branch.weight_TK + row * branch.K, branch.K, Dv, v);
        unpack8(pack8(sum), b);
      } else {
        unpack8(rows[at], b);
      }
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) f[j] += b[j];
      const uint4 rounded = pack8(f);
      residual_out[at] = rounded;
      unpack8(rounded, f);
    }
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += f[j] * f[j];
  }
  const float r = rsqrtf(block_sum(sum_sq) / static_cast<float>(Dv * kVecElems) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  if (!active) return;
  float wf[kVecElems];
  unpack8(w[v], wf);
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) f[j] = f[j] * r * wf[j];
  const uint4 packed = pack8(f);
  y[at] = packed;
  if constexpr (kCodes) {
    unpack8(packed, f);
    uint2 words;
    const float scale = tile_words_of_8(f, words);
    store_tile_codes(codes, words, scale, row, v, Dv);
  }
}

__global__ void rmsnorm_backward_vec_kernel(uint4* dx, float* dw_partial, const uint4* dy, const uint4* dresidual,
                                            const uint4* x, const uint4* w, const float* rstd, int64_t T,
                                            int64_t Dv) {
  const int64_t first = blockIdx.x * kRowsPerBlock;
  const int64_t last = min(T, first + kRowsPerBlock);
  const int64_t v = threadIdx.x;
  const bool active = v < Dv;
  const float inv_D = 1.0f / static_cast<float>(Dv * kVecElems);
  float wf[kVecElems] = {}, partial[kVecElems] = {};
  if (active) unpack8(w[v], wf);
  for (int64_t row = first; row < last; ++row) {
    const float r = rstd[row];
    const int64_t at = row * Dv + v;
    float dyf[kVecElems] = {}, xf[kVecElems] = {};
    float dot = 0.0f;  // sum_i dy_i * w_i * x_i
    if (active) {
      unpack8(dy[at], dyf);
      unpack8(x[at], xf);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) dot += dyf[j] * wf[j] * xf[j];
    }
    dot = block_sum(dot) * inv_D;
    if (!active) continue;
    float g[kVecElems], dr[kVecElems] = {};
    if (dresidual) unpack8(dresidual[at], dr);  // read before dx, which may alias it
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      g[j] = r * (wf[j] * dyf[j] - xf[j] * r * r * dot) + dr[j];
      partial[j] += dyf[j] * xf[j] * r;
    }
    dx[at] = pack8(g);
  }
  if (!active) return;
  float4* out = reinterpret_cast<float4*>(dw_partial + blockIdx.x * Dv * kVecElems + v * kVecElems);
  out[0] = make_float4(partial[0], partial[1], partial[2], partial[3]);
  out[1] = make_float4(partial[4], partial[5], partial[6], partial[7]);
}

unsigned vec_threads(int64_t D) { return static_cast<unsigned>(ceil_div(D / kVecElems, 32) * 32); }

}  // namespace

int64_t rmsnorm_backward_partial_rows(int64_t T) { return ceil_div(T, kRowsPerBlock); }

void rmsnorm_forward(bf16* y_TD, float* rstd_T, bf16* residual_out_TD, const bf16* x_TD,
                     const ResidualBranch& branch, const bf16* w_D, int64_t T, int64_t D, float eps,
                     Stream stream) {
  MOE_CHECKF(!branch || residual_out_TD, "rmsnorm_forward: a branch needs residual_out");
  if (T == 0) return;
  if (D <= kMaxVecD && vectorizable(D, {y_TD, residual_out_TD, x_TD, branch.rows, w_D})) {
    rmsnorm_forward_vec_kernel<false><<<static_cast<unsigned>(T), vec_threads(D), 0, stream>>>(
        reinterpret_cast<uint4*>(y_TD), rstd_T, reinterpret_cast<uint4*>(residual_out_TD),
        reinterpret_cast<const uint4*>(x_TD), branch_rows(branch), reinterpret_cast<const uint4*>(w_D),
        D / kVecElems, eps, RowCodes{});
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  rmsnorm_forward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
      as_cuda(y_TD), rstd_T, as_cuda(residual_out_TD), as_cuda(x_TD), branch_rows(branch), as_cuda(w_D), D, eps);
  MOE_CUDA_CHECK_LAUNCH();
}

void rmsnorm_forward_fp8(bf16* y_TD, const RowCodes& codes, float* rstd_T, bf16* residual_out_TD, const bf16* x_TD,
                         const ResidualBranch& branch, const bf16* w_D, int64_t T, int64_t D, float eps,
                         Stream stream) {
  MOE_CHECKF(!branch || residual_out_TD, "rmsnorm_forward: a branch needs residual_out");
  MOE_CHECKF(D % 128 == 0 && codes.offsets_E1 == nullptr && codes.R == T,
             "rmsnorm_forward with fp8 codes: D = %lld (a multiple of 128), codes of one group of the %lld rows",
             static_cast<long long>(D), static_cast<long long>(T));
  if (T == 0) return;
  if (D > kMaxVecD || !vectorizable(D, {y_TD, residual_out_TD, x_TD, branch.rows, w_D}) ||
      reinterpret_cast<uintptr_t>(codes.codes_RK) % 8 != 0) {  // the two kernels: the same bits
    rmsnorm_forward(y_TD, rstd_T, residual_out_TD, x_TD, branch, w_D, T, D, eps, stream);
    quantize_rows_blockwise(codes.codes_RK, codes.scales, y_TD, D, nullptr, 1, T, D, stream);
    return;
  }
  rmsnorm_forward_vec_kernel<true><<<static_cast<unsigned>(T), vec_threads(D), 0, stream>>>(
      reinterpret_cast<uint4*>(y_TD), rstd_T, reinterpret_cast<uint4*>(residual_out_TD),
      reinterpret_cast<const uint4*>(x_TD), branch_rows(branch), reinterpret_cast<const uint4*>(w_D), D / kVecElems,
      eps, codes);
  MOE_CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(bf16* dx_TD, float* dw_D, const bf16* dy_TD, const bf16* dresidual_TD,
                      const bf16* x_TD, const bf16* w_D, const float* rstd_T, int64_t T, int64_t D,
                      float* dw_partial, Stream stream) {
  if (T == 0) return;
  const int64_t blocks = rmsnorm_backward_partial_rows(T);
  if (D <= kMaxVecD && vectorizable(D, {dx_TD, dy_TD, dresidual_TD, x_TD, w_D, dw_partial})) {
    rmsnorm_backward_vec_kernel<<<static_cast<unsigned>(blocks), vec_threads(D), 0, stream>>>(
        reinterpret_cast<uint4*>(dx_TD), dw_partial, reinterpret_cast<const uint4*>(dy_TD),
        reinterpret_cast<const uint4*>(dresidual_TD), reinterpret_cast<const uint4*>(x_TD),
        reinterpret_cast<const uint4*>(w_D), rstd_T, T, D / kVecElems);
  } else {
    rmsnorm_backward_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        as_cuda(dx_TD), dw_partial, as_cuda(dy_TD), as_cuda(dresidual_TD), as_cuda(x_TD), as_cuda(w_D),
        rstd_T, T, D);
  }
  MOE_CUDA_CHECK_LAUNCH();
  const auto column_blocks = static_cast<unsigned>(ceil_div(D, kThreads));
  sum_partial_groups_kernel<<<dim3(column_blocks, static_cast<unsigned>(ceil_div(blocks, kGroupRows))), kThreads, 0,
                              stream>>>(dw_partial, blocks, D);
  MOE_CUDA_CHECK_LAUNCH();
  sum_partials_kernel<<<column_blocks, kThreads, 0, stream>>>(dw_D, dw_partial, blocks, D);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
