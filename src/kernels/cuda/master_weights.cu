// The fp32 master weights as bf16 hi + int16 lo halves and back, and the bf16 rounding
// of the AdamW moments: the storage conversions of the GPU parameter store
// (model/cuda/gpu_parameters.h). The per-element arithmetic is kernels/adamw_math.h's.
#include <algorithm>
#include <cstdint>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

namespace am = adamw_math;

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), 1 << 20)); }

__global__ void split_kernel(uint16_t* hi, int16_t* lo, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const am::MasterSplit s = am::split_master(x[i]);
    hi[i] = s.hi;
    lo[i] = s.lo;
  }
}

__global__ void join_kernel(float* x, const uint16_t* hi, const int16_t* lo, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = am::join_master(hi[i], lo[i]);
}

__global__ void round_bf16_kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = am::bf16_bits_rne(in[i]);
}

__global__ void widen_bf16_kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = am::bf16_bits_to_float(in[i]);
}

}  // namespace

void split_master(bf16* hi, int16_t* lo, const float* x, int64_t n, Stream stream) {
  if (n == 0) return;
  split_kernel<<<grid_for(n), kThreads, 0, stream>>>(bits(hi), lo, x, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void join_master(float* x, const bf16* hi, const int16_t* lo, int64_t n, Stream stream) {
  if (n == 0) return;
  join_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, bits(hi), lo, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void round_to_bf16(bf16* out, const float* in, int64_t n, Stream stream) {
  if (n == 0) return;
  round_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(bits(out), in, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void widen_bf16(float* out, const bf16* in, int64_t n, Stream stream) {
  if (n == 0) return;
  widen_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, bits(in), n);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
