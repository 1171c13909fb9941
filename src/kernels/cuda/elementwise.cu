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

// One block per column: each thread sums a fixed stride of rows, then the block's fixed
// reduction tree: deterministic, and parallel over the rows (a thread per column summing
// all 16k rows alone took a millisecond per MoE layer).
__global__ void column_sum_kernel(float* out, const float* x, int64_t rows, int64_t cols) {
  const int64_t c = blockIdx.x;
  float sum = 0.0f;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) sum += x[r * cols + c];
  sum = block_sum(sum);
  if (threadIdx.x == 0) out[c] += sum;
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

void cast_to_float(float* out, const bf16* in, int64_t n, Stream stream) {
  if (n == 0) return;
  widen_kernel<<<static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, stream>>>(out, as_cuda(in), n);
  MOE_CUDA_CHECK_LAUNCH();
}

void add_column_sums(float* out_C, const float* x_RC, int64_t rows, int64_t cols, Stream stream) {
  if (cols == 0) return;
  column_sum_kernel<<<static_cast<unsigned>(cols), kThreads, 0, stream>>>(out_C, x_RC, rows, cols);
  MOE_CUDA_CHECK_LAUNCH();
}

void ordered_sum(float* out, const float* values, int64_t n, float scale, Stream stream) {
  ordered_sum_kernel<<<1, 1024, 0, stream>>>(out, values, n, scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
