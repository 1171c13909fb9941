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

// One thread per block of am::kMomentBlock moments (root: v's, quantised as sqrt(v)).
__global__ void quantize_moments_kernel(uint8_t* codes, uint8_t* scales, const float* in, int64_t first, int64_t index,
                                        int64_t n, bool root) {
  const int64_t blocks = (n + am::kMomentBlock - 1) / am::kMomentBlock;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < blocks;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = b * am::kMomentBlock;
    const int len = static_cast<int>(n - at < am::kMomentBlock ? n - at : am::kMomentBlock);
    scales[(first + at) / am::kMomentBlock] = am::moment_block_codes(in + at, len, root, index + at, 0, codes + at);
  }
}

__global__ void dequantize_moments_kernel(float* out, const uint8_t* codes, const uint8_t* scales, int64_t first,
                                          int64_t n, bool root) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = am::moment_value(codes[i], scales[(first + i) / am::kMomentBlock]);
    out[i] = root ? am::mul(x, x) : x;
  }
}

}  // namespace

void quantize_moments(uint8_t* codes, uint8_t* scales, const float* in, int64_t first, int64_t index, int64_t n,
                      bool root, Stream stream) {
  MOE_CHECKF(first % am::kMomentBlock == 0, "quantize_moments: state element %lld is not a block's first",
             static_cast<long long>(first));
  if (n == 0) return;
  quantize_moments_kernel<<<grid_for(ceil_div(n, am::kMomentBlock)), kThreads, 0, stream>>>(codes, scales, in, first,
                                                                                           index, n, root);
  MOE_CUDA_CHECK_LAUNCH();
}

void dequantize_moments(float* out, const uint8_t* codes, const uint8_t* scales, int64_t first, int64_t n, bool root,
                        Stream stream) {
  if (n == 0) return;
  dequantize_moments_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, codes, scales, first, n, root);
  MOE_CUDA_CHECK_LAUNCH();
}

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
