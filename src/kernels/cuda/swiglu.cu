// SwiGLU on the GPU over the fused [gate | up] projection output.
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void swiglu_forward_kernel(__nv_bfloat16* act, const __nv_bfloat16* gate_up, int64_t T, int64_t F) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * F) return;
  const int64_t t = idx / F, f = idx % F;
  const float g = to_float(gate_up[t * 2 * F + f]), u = to_float(gate_up[t * 2 * F + F + f]);
  const float sig = 1.0f / (1.0f + expf(-g));
  act[idx] = to_bf16(g * sig * u);
}

__global__ void swiglu_backward_kernel(__nv_bfloat16* dgate_up, const __nv_bfloat16* dact,
                                       const __nv_bfloat16* gate_up, int64_t T, int64_t F) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * F) return;
  const int64_t t = idx / F, f = idx % F;
  const float g = to_float(gate_up[t * 2 * F + f]), u = to_float(gate_up[t * 2 * F + F + f]);
  const float sig = 1.0f / (1.0f + expf(-g));
  const float da = to_float(dact[idx]);
  dgate_up[t * 2 * F + f] = to_bf16(da * u * sig * (1.0f + g * (1.0f - sig)));
  dgate_up[t * 2 * F + F + f] = to_bf16(da * g * sig);
}

}  // namespace

void swiglu_forward(bf16* act_TF, const bf16* gate_up_TF2, int64_t T, int64_t F, Stream stream) {
  if (T * F == 0) return;
  swiglu_forward_kernel<<<static_cast<unsigned>(ceil_div(T * F, kThreads)), kThreads, 0, stream>>>(
      as_cuda(act_TF), as_cuda(gate_up_TF2), T, F);
  MOE_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* dgate_up_TF2, const bf16* dact_TF, const bf16* gate_up_TF2, int64_t T,
                     int64_t F, Stream stream) {
  if (T * F == 0) return;
  swiglu_backward_kernel<<<static_cast<unsigned>(ceil_div(T * F, kThreads)), kThreads, 0, stream>>>(
      as_cuda(dgate_up_TF2), as_cuda(dact_TF), as_cuda(gate_up_TF2), T, F);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
