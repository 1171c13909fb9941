// AdamW on the GPU over one flat fp32 block, writing the bf16 copy the forward pass
// reads. The per-element arithmetic is kernels/adamw_math.h's, the code the CPU AdamW
// (src/optim/adamw.cpp) runs. The GPU model uses the multi-tensor version (multi_tensor_adamw.cu).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void adamw_kernel(float* param, __nv_bfloat16* param_bf16, const float* grad, float* m, float* v,
                             int64_t count, adamw_math::AdamWScalars s) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  float mi = m[i], vi = v[i];
  const float p = adamw_math::adamw_update(param[i], grad[i], mi, vi, s, s.decay_factor, false);
  m[i] = mi;
  v[i] = vi;
  param[i] = p;
  if (param_bf16) param_bf16[i] = to_bf16(p);
}

}  // namespace

void adamw_step(float* param, bf16* param_bf16, const float* grad, float* m, float* v, int64_t count,
                double lr, double beta1, double beta2, float eps, float decay_factor, float grad_scale,
                int64_t step, Stream stream) {
  MOE_CHECKF(step >= 1, "adamw_step: step counts from 1, got %lld", static_cast<long long>(step));
  if (count == 0) return;
  adamw_math::AdamWScalars s = adamw_math::adamw_step_scalars(lr, beta1, beta2, eps, 0.0, step);
  s.decay_factor = decay_factor;
  s.grad_scale = grad_scale;
  adamw_kernel<<<static_cast<unsigned>(ceil_div(count, kThreads)), kThreads, 0, stream>>>(
      param, as_cuda(param_bf16), grad, m, v, count, s);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
