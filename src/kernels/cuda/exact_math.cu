// exact_math_mismatches: the fast paths of exact_math.cuh checked against __fsqrt_rn and
// __fdiv_rn (1.0f / b for the reciprocal) value by value (GPU test: millions of bit patterns, none may differ).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/exact_math.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

__global__ void exact_math_mismatches_kernel(unsigned long long* counts, const float* a, const float* b, int64_t n) {
  unsigned long long sqrt_bad = 0, div_bad = 0, sqrt_fast = 0, div_fast_taken = 0, rcp_bad = 0, rcp_fast = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = a[i], y = b[i];
    if (sqrt_fast_path(x)) {
      ++sqrt_fast;
      sqrt_bad += __float_as_uint(moe::cuda::sqrt_fast(x)) != __float_as_uint(__fsqrt_rn(x));
    }
    if (div_fast_path(x, y)) {
      ++div_fast_taken;
      div_bad += __float_as_uint(div_fast(x, y)) != __float_as_uint(__fdiv_rn(x, y));
    }
    if (reciprocal_fast_path(y)) {
      ++rcp_fast;
      rcp_bad += __float_as_uint(reciprocal_fast(y)) != __float_as_uint(__fdiv_rn(1.0f, y));
    }
  }
  atomicAdd(counts + 0, sqrt_bad);
  atomicAdd(counts + 1, div_bad);
  atomicAdd(counts + 2, sqrt_fast);
  atomicAdd(counts + 3, div_fast_taken);
  atomicAdd(counts + 4, rcp_bad);
  atomicAdd(counts + 5, rcp_fast);
}

}  // namespace

void exact_math_mismatches(unsigned long long* counts_6, const float* a, const float* b, int64_t n, Stream stream) {
  if (n == 0) return;
  exact_math_mismatches_kernel<<<264, 256, 0, stream>>>(counts_6, a, b, n);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
