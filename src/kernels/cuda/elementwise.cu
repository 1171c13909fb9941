// Small glue kernels of the GPU model: bias rows, dtype casts, column sums.
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_bias_kernel(float* x, const float* bias, int64_t rows, int64_t cols) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < rows * cols) x[i] += bias[i % cols];
}

__global__ void cast_kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = to_bf16(in[i]);
}

__global__ void widen_kernel(float* out, const __nv_bfloat16* in, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = __bfloat162float(in[i]);
}

// Column sums in two fixed-order stages, so that every SM takes part and every load is
// coalesced (one block a column, reading a float every `cols` floats, took 38 us at
// olmoe-mini's 32k x 64 router gradient). Stage 1: block (x, g) sums rows
// [g kColumnGroupRows, (g + 1) kColumnGroupRows) of 32 columns; a warp reads 32 adjacent
// columns of a row, its 8 warps rows r = w mod 8, then the 8 warps' sums in warp order.
constexpr int64_t kColumnGroupRows = 256;
constexpr int kColumnWarps = 8;
__global__ void column_group_sums_kernel(float* partial_GC, const float* x, int64_t rows, int64_t cols) {
  __shared__ float warp_sums[kColumnWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * 32 + lane;
  const int64_t first = blockIdx.y * kColumnGroupRows, last = min(rows, first + kColumnGroupRows);
  float sum = 0.0f;
  if (c < cols)
#pragma unroll 4
    for (int64_t r = first + warp; r < last; r += kColumnWarps) sum += x[r * cols + c];
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && c < cols) {
    float total = 0.0f;
    for (int w = 0; w < kColumnWarps; ++w) total += warp_sums[w][lane];
    partial_GC[blockIdx.y * cols + c] = total;
  }
}

// Stage 2: a warp a column adds its groups (lane l: groups l, l + 32, ...; then the warp's
// fixed tree) onto out.
__global__ void column_sums_of_groups_kernel(float* out, const float* partial_GC, int64_t groups, int64_t cols) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(kThreads / 32) + (threadIdx.x >> 5);
  if (c >= cols) return;
  float sum = 0.0f;
  for (int64_t g = threadIdx.x & 31; g < groups; g += 32) sum += partial_GC[g * cols + c];
  sum = warp_sum(sum);
  if ((threadIdx.x & 31) == 0) out[c] += sum;
}

// One block a row (blockIdx.x) of a batch (blockIdx.y); 8 bf16 a thread step where every
// row starts 16-byte aligned (vec), else one.
template <bool vec>
__global__ void add_batched_rows_kernel(__nv_bfloat16* dst, int64_t ld_dst, const __nv_bfloat16* src, int64_t ld_src,
                                        int64_t S, int64_t cols) {
  const int64_t row = (static_cast<int64_t>(blockIdx.y) * S + blockIdx.x);
  __nv_bfloat16* d = dst + row * ld_dst;
  const __nv_bfloat16* s = src + row * ld_src;
  if constexpr (vec) {
    for (int64_t c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
      uint4 a = *reinterpret_cast<const uint4*>(d + c);
      const uint4 b = *reinterpret_cast<const uint4*>(s + c);
      __nv_bfloat162* a2 = reinterpret_cast<__nv_bfloat162*>(&a);
      const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(a2[i]), y = __bfloat1622float2(b2[i]);
        a2[i] = __floats2bfloat162_rn(x.x + y.x, x.y + y.y);
      }
      *reinterpret_cast<uint4*>(d + c) = a;
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      d[c] = __float2bfloat16_rn(__bfloat162float(d[c]) + __bfloat162float(s[c]));
  }
}

// Sums n floats in a fixed order (one block): deterministic loss reductions.
__global__ void ordered_sum_kernel(float* out, const float* values, int64_t n, float scale) {
  float local = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) local += values[i];
  const float total = block_sum(local);
  if (threadIdx.x == 0) *out = total * scale;
}

}  // namespace

void add_bias_rows(float* x_RC, const float* bias_C, int64_t rows, int64_t cols, Stream stream) {
  if (rows * cols == 0) return;
  add_bias_kernel<<<static_cast<unsigned>(ceil_div(rows * cols, kThreads)), kThreads, 0, stream>>>(x_RC, bias_C, rows,
                                                                                                  cols);
  MOE_CUDA_CHECK_LAUNCH();
}

void cast_to_bf16(bf16* out, const float* in, int64_t n, Stream stream) {
  if (n == 0) return;
  cast_kernel<<<static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream>>>(as_cuda(out), in, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void add_batched_rows(bf16* dst, int64_t ld_dst, const bf16* src, int64_t ld_src, int64_t B, int64_t S, int64_t rows,
                      int64_t cols, Stream stream) {
  if (B == 0 || rows == 0 || cols == 0) return;
  MOE_CHECKF(rows <= S && rows <= 0x7fffffff && B <= 65535, "add_batched_rows: %lld rows of %lld, %lld batches",
             static_cast<long long>(rows), static_cast<long long>(S), static_cast<long long>(B));
  // Batch b's row r at (b * S + r) * ld: the row index the kernel forms.
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(B));
  const bool vec = cols % 8 == 0 && ld_dst % 8 == 0 && ld_src % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (vec) add_batched_rows_kernel<true><<<grid, 128, 0, stream>>>(as_cuda(dst), ld_dst, as_cuda(src), ld_src, S, cols);
  else add_batched_rows_kernel<false><<<grid, 128, 0, stream>>>(as_cuda(dst), ld_dst, as_cuda(src), ld_src, S, cols);
  MOE_CUDA_CHECK_LAUNCH();
}

void cast_to_float(float* out, const bf16* in, int64_t n, Stream stream) {
  if (n == 0) return;
  widen_kernel<<<static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream>>>(out, as_cuda(in), n);
  MOE_CUDA_CHECK_LAUNCH();
}

int64_t column_sums_partial_count(int64_t rows, int64_t cols) { return ceil_div(rows, kColumnGroupRows) * cols; }

void add_column_sums(float* out_C, const float* x_RC, int64_t rows, int64_t cols, float* partial, Stream stream) {
  if (cols == 0 || rows == 0) return;
  MOE_CHECKF(partial, "add_column_sums: no scratch for the partial sums");
  const int64_t groups = ceil_div(rows, kColumnGroupRows);
  MOE_CHECKF(groups < 65536, "add_column_sums: %lld rows", static_cast<long long>(rows));
  column_group_sums_kernel<<<dim3(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(groups)),
                             kColumnWarps * 32, 0, stream>>>(partial, x_RC, rows, cols);
  MOE_CUDA_CHECK_LAUNCH();
  column_sums_of_groups_kernel<<<static_cast<unsigned>(ceil_div(cols, kThreads / 32)), kThreads, 0, stream>>>(
      out_C, partial, groups, cols);
  MOE_CUDA_CHECK_LAUNCH();
}

void ordered_sum(float* out, const float* values, int64_t n, float scale, Stream stream) {
  ordered_sum_kernel<<<1, 1024, 0, stream>>>(out, values, n, scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
