// AdamW on the GPU over one flat fp32 block, writing the bf16 weights the forward pass
// reads. The arithmetic mirrors the CPU AdamW (src/train/adamw.cpp) operation by operation.
#include <cmath>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void adamw_kernel(float* param, __nv_bfloat16* param_bf16, const float* grad, float* m,
                             float* v, int64_t count, float step_size, float beta1, float beta2,
                             float eps, float sqrt_bias2, float decay_factor, float grad_scale) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  const float g = grad[i] * grad_scale;
  const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(1.0f - beta1, g));
  const float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
  m[i] = mi;
  v[i] = vi;
  const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), sqrt_bias2), eps);
  const float p = __fsub_rn(__fmul_rn(param[i], decay_factor), __fdiv_rn(__fmul_rn(step_size, mi), denom));
  param[i] = p;
  if (param_bf16) param_bf16[i] = to_bf16(p);
}

}  // namespace

void adamw_step(float* param, bf16* param_bf16, const float* grad, float* m, float* v, int64_t count,
                double lr, double beta1, double beta2, float eps, float decay_factor, float grad_scale,
                int64_t step, Stream stream) {
  MOE_CHECKF(step >= 1, "adamw_step: step counts from 1, got %lld", static_cast<long long>(step));
  if (count == 0) return;
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  adamw_kernel<<<static_cast<unsigned>(ceil_div(count, kThreads)), kThreads, 0, stream>>>(
      param, as_cuda(param_bf16), grad, m, v, count, static_cast<float>(lr / bias1), static_cast<float>(beta1),
      static_cast<float>(beta2), eps,
      static_cast<float>(std::sqrt(bias2)), decay_factor, grad_scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
