// SwiGLU's element math, one definition for every kernel that computes it (swiglu.cu's, and
// fp8_quantize.cu's that fuse it with the fp8 quantisation): one expression, one set of bits.
#pragma once

namespace moe::cuda {

__device__ __forceinline__ float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// The expressions, given the gate's sigmoid.
__device__ __forceinline__ float swiglu_value_of(float g, float sig, float u) { return g * sig * u; }
__device__ __forceinline__ void swiglu_grads_of(float g, float sig, float u, float da, float& dg, float& du) {
  dg = da * u * sig * (1.0f + g * (1.0f - sig));
  du = da * g * sig;
}

// act = silu(gate) * up
__device__ __forceinline__ float swiglu_value(float g, float u) { return swiglu_value_of(g, swiglu_sigmoid(g), u); }

// d gate and d up of act's gradient da.
__device__ __forceinline__ void swiglu_grads(float g, float u, float da, float& dg, float& du) {
  swiglu_grads_of(g, swiglu_sigmoid(g), u, da, dg, du);
}

// act, d gate and d up together (the backward to token columns needs all three): one sigmoid.
__device__ __forceinline__ void swiglu_value_and_grads(float g, float u, float da, float& a, float& dg, float& du) {
  const float sig = swiglu_sigmoid(g);
  a = swiglu_value_of(g, sig, u);
  swiglu_grads_of(g, sig, u, da, dg, du);
}

}  // namespace moe::cuda
