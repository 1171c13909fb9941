// SwiGLU on the GPU over the fused [gate | up] projection output: 16-byte vectors when the
// width allows, element by element otherwise.
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/swiglu_math.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void swiglu_forward_kernel(__nv_bfloat16* act, const __nv_bfloat16* gate_up, int64_t T, int64_t F) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * F) return;
  const int64_t t = idx / F, f = idx % F;
  const float g = to_float(gate_up[t * 2 * F + f]), u = to_float(gate_up[t * 2 * F + F + f]);
  act[idx] = to_bf16(swiglu_value(g, u));
}

// act (when given): swiglu_forward's values, from the same read of gate|up.
__global__ void swiglu_backward_kernel(__nv_bfloat16* dgate_up, __nv_bfloat16* act, const __nv_bfloat16* dact,
                                       const __nv_bfloat16* gate_up, int64_t T, int64_t F) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * F) return;
  const int64_t t = idx / F, f = idx % F;
  const float g = to_float(gate_up[t * 2 * F + f]), u = to_float(gate_up[t * 2 * F + F + f]);
  float a, dg, du;
  swiglu_value_and_grads(g, u, to_float(dact[idx]), a, dg, du);
  dgate_up[t * 2 * F + f] = to_bf16(dg);
  dgate_up[t * 2 * F + F + f] = to_bf16(du);
  if (act) act[idx] = to_bf16(a);
}

// Vector path (F % 8 == 0, aligned rows): each thread does 8 consecutive columns of a row,
// one index division per 8 elements. Same math per element as the scalar kernels.
__global__ void swiglu_forward_vec_kernel(uint4* act, const uint4* gate_up, int64_t vectors, int64_t Fv) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= vectors) return;
  const int64_t t = idx / Fv, f = idx % Fv;
  float g[kVecElems], u[kVecElems], a[kVecElems];
  unpack8(gate_up[t * 2 * Fv + f], g);
  unpack8(gate_up[t * 2 * Fv + Fv + f], u);
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) a[j] = swiglu_value(g[j], u[j]);
  act[idx] = pack8(a);
}

template <bool kAct>
__global__ void swiglu_backward_vec_kernel(uint4* dgate_up, uint4* act, const uint4* dact, const uint4* gate_up,
                                           int64_t vectors, int64_t Fv) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= vectors) return;
  const int64_t t = idx / Fv, f = idx % Fv;
  float g[kVecElems], u[kVecElems], da[kVecElems], a[kVecElems], dg[kVecElems], du[kVecElems];
  unpack8(gate_up[t * 2 * Fv + f], g);
  unpack8(gate_up[t * 2 * Fv + Fv + f], u);
  unpack8(dact[idx], da);
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) {
    if constexpr (kAct) swiglu_value_and_grads(g[j], u[j], da[j], a[j], dg[j], du[j]);
    else swiglu_grads(g[j], u[j], da[j], dg[j], du[j]);
  }
  dgate_up[t * 2 * Fv + f] = pack8(dg);
  dgate_up[t * 2 * Fv + Fv + f] = pack8(du);
  if constexpr (kAct) act[idx] = pack8(a);
}

uint4* as_vec(bf16* p) { return reinterpret_cast<uint4*>(p); }
const uint4* as_vec(const bf16* p) { return reinterpret_cast<const uint4*>(p); }

}  // namespace

void swiglu_forward(bf16* act_TF, const bf16* gate_up_TF2, int64_t T, int64_t F, Stream stream) {
  if (T * F == 0) return;
  if (vectorizable(F, {act_TF, gate_up_TF2})) {
    const int64_t vectors = T * F / kVecElems;
    swiglu_forward_vec_kernel<<<static_cast<unsigned>(ceil_div(vectors, kThreads)), kThreads, 0, stream>>>(
        as_vec(act_TF), as_vec(gate_up_TF2), vectors, F / kVecElems);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  swiglu_forward_kernel<<<static_cast<unsigned>(ceil_div(T * F, kThreads)), kThreads, 0, stream>>>(
      as_cuda(act_TF), as_cuda(gate_up_TF2), T, F);
  MOE_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* dgate_up_TF2, const bf16* dact_TF, const bf16* gate_up_TF2, int64_t T, int64_t F,
                     Stream stream, bf16* act_TF) {
  if (T * F == 0) return;
  if (vectorizable(F, {dgate_up_TF2, dact_TF, gate_up_TF2, act_TF})) {
    const int64_t vectors = T * F / kVecElems;
    const auto blocks = static_cast<unsigned>(ceil_div(vectors, kThreads));
    if (act_TF)
      swiglu_backward_vec_kernel<true><<<blocks, kThreads, 0, stream>>>(
          as_vec(dgate_up_TF2), as_vec(act_TF), as_vec(dact_TF), as_vec(gate_up_TF2), vectors, F / kVecElems);
    else
      swiglu_backward_vec_kernel<false><<<blocks, kThreads, 0, stream>>>(
          as_vec(dgate_up_TF2), nullptr, as_vec(dact_TF), as_vec(gate_up_TF2), vectors, F / kVecElems);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  swiglu_backward_kernel<<<static_cast<unsigned>(ceil_div(T * F, kThreads)), kThreads, 0, stream>>>(
      as_cuda(dgate_up_TF2), act_TF ? as_cuda(act_TF) : nullptr, as_cuda(dact_TF), as_cuda(gate_up_TF2), T, F);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
