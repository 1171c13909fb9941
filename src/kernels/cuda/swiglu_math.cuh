// SwiGLU's element math, one definition for every kernel that computes it (swiglu.cu's, and
// fp8_quantize.cu's that fuse it with the fp8 quantisation): one expression, one set of bits.
#pragma once

#include <cmath>

#include "kernels/cuda/common.cuh"

namespace moe::cuda {

// 1 / d for d >= 1 without a branch: the hardware's rcp.approx.ftz (one MUFU.RCP, within 1
// ulp; nvcc's correctly rounded 1.0f / d adds two FFMAs, and SwiGLU's outputs are rounded to
// bf16, 2^-9, anyway) while d < 2^126. d >= 2^126 is scaled into range first (its
// reciprocal is subnormal: one more rounding); +inf gives 0. No branch and call around it,
// which kept the compiler from interleaving a thread's 8 values (the fused fp8 kernels are
// issue-bound).
__device__ __forceinline__ float reciprocal_approx(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}
__device__ __forceinline__ float reciprocal_of_at_least_one(float d) {
  const bool big = d >= 0x1p126f;
  const float r = reciprocal_approx(big ? d * 0.25f : d);
  return d == INFINITY ? 0.0f : big ? r * 0.25f : r;
}

// e^-g through the hardware's 2^x (common.cuh's exp_approx: 2 instructions against expf's
// 8; within 2 + 1.2 |g| ulp, a few thousandths of the bf16 rounding every SwiGLU output
// takes). At the ends as expf: +inf past 2^128 (the sigmoid's range check below), 0 for
// results below 2^-126 (1 + that rounds to 1 either way).
__device__ __forceinline__ float swiglu_exp_neg(float g) { return exp_approx(-g); }

__device__ __forceinline__ float swiglu_sigmoid(float g) {
  return reciprocal_of_at_least_one(1.0f + swiglu_exp_neg(g));
}

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

// The same for N values of a thread, the functions above bit for bit: the denominators'
// range check (g < -87 makes 1 + exp(-g) >= 2^126) once for all N, the plain reciprocal
// when none needs more (the kernels that fuse SwiGLU with the fp8 quantisation are
// issue-bound, and the check and its selects were ~4 of their ~56 instructions a value).
template <int N>
__device__ __forceinline__ void swiglu_sigmoid_n(const float (&g)[N], float (&sig)[N]) {
  float d[N];
  bool plain = true;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    d[j] = 1.0f + swiglu_exp_neg(g[j]);
    plain &= d[j] < 0x1p126f;  // false for +inf and NaN too
  }
  if (plain) {
#pragma unroll
    for (int j = 0; j < N; ++j) sig[j] = reciprocal_approx(d[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) sig[j] = reciprocal_of_at_least_one(d[j]);
  }
}
template <int N>
__device__ __forceinline__ void swiglu_value_n(const float (&g)[N], const float (&u)[N], float (&a)[N]) {
  float sig[N];
  swiglu_sigmoid_n(g, sig);
#pragma unroll
  for (int j = 0; j < N; ++j) a[j] = swiglu_value_of(g[j], sig[j], u[j]);
}
template <int N>
__device__ __forceinline__ void swiglu_grads_n(const float (&g)[N], const float (&u)[N], const float (&da)[N],
                                               float (&dg)[N], float (&du)[N]) {
  float sig[N];
  swiglu_sigmoid_n(g, sig);
#pragma unroll
  for (int j = 0; j < N; ++j) swiglu_grads_of(g[j], sig[j], u[j], da[j], dg[j], du[j]);
}
template <int N>
__device__ __forceinline__ void swiglu_value_and_grads_n(const float (&g)[N], const float (&u)[N],
                                                         const float (&da)[N], float (&a)[N], float (&dg)[N],
                                                         float (&du)[N]) {
  float sig[N];
  swiglu_sigmoid_n(g, sig);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    a[j] = swiglu_value_of(g[j], sig[j], u[j]);
    swiglu_grads_of(g[j], sig[j], u[j], da[j], dg[j], du[j]);
  }
}

}  // namespace moe::cuda
