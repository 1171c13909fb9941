// Correctly rounded fp32 square roots and quotients of N values at a time, the same bits as
// __fsqrt_rn / __fdiv_rn, without a branch per value. nvcc compiles each IEEE operation to
// a fast sequence guarded by a range check that branches to a called slow path; the
// branches keep it from interleaving independent values, which leaves kernels that do one
// per element (AdamW) issue-bound. Here the check covers all N values once (one branch a
// group), the fast sequences run straight for the group, and any group with a value out
// of range takes the IEEE operations as before.
#pragma once

#include <cstdint>

namespace moe::cuda {

// sqrt.rn's fast path: v in [2^-101, FLT_MAX] (nvcc's own check, on the bits: v's bits +
// kSqrtFastOffset at most kSqrtFastLimit, mod 2^32), then the reciprocal square root's
// approximation and one correction, exactly as nvcc emits it.
inline constexpr uint32_t kSqrtFastOffset = 0xf3000000u, kSqrtFastLimit = 0x727fffffu;
__device__ __forceinline__ bool sqrt_fast_path(float v) { return __float_as_uint(v) + kSqrtFastOffset <= kSqrtFastLimit; }
__device__ __forceinline__ float sqrt_fast(float v) {
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  const float s = __fmul_rn(v, r), half_r = __fmul_rn(r, 0.5f);
  return __fmaf_rn(__fmaf_rn(-s, s, v), half_r, s);
}

// 1.0f / d's fast path (nvcc emits a reciprocal sequence for a numerator of 1): d's biased
// exponent in [1, 252] (nvcc's own check, on the bits), then the reciprocal's approximation
// and one Newton step, exactly as nvcc emits it.
__device__ __forceinline__ bool reciprocal_fast_path(float d) {
  return ((__float_as_uint(d) + 0x1800000u) & 0x7f800000u) > 0x1ffffffu;
}
__device__ __forceinline__ float reciprocal_fast(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmaf_rn(r, -__fmaf_rn(d, r, -1.0f), r);
}

// div.rn's fast path (the reciprocal refined once, the quotient corrected once by its
// remainder: nvcc's sequence), taken where nvcc's hardware check would let it through; the
// check here is stricter: both operands normal with exponents in [-60, 60], so the quotient
// and every intermediate stay far from overflow, underflow and subnormals.
__device__ __forceinline__ bool div_fast_path(float a, float b) {
  // Biased exponents 67..187 (|x| in [2^-60, 2^61); NaN fails), as two float compares
  // with the absolute value for free: half the instructions of the exponent's bit field.
  const float x = fabsf(a), y = fabsf(b);
  return x >= 0x1p-60f && x < 0x1p61f && y >= 0x1p-60f && y < 0x1p61f;
}
__device__ __forceinline__ float div_fast(float a, float b) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(b));
  const float r1 = __fmaf_rn(r0, __fmaf_rn(r0, -b, 1.0f), r0);
  const float q0 = __fmul_rn(a, r1);
  return __fmaf_rn(r1, __fmaf_rn(q0, -b, a), q0);
}

// out[j] = sqrt(v[j]), correctly rounded (out may be v). Returns whether every v took the
// fast path (then each is in [2^-101, FLT_MAX] and each root in [2^-50.5, 2^64)).
template <int N>
__device__ __forceinline__ bool sqrt_rn_n(float (&out)[N], const float (&v)[N]) {
  uint32_t worst = 0;  // sqrt_fast_path for all N as one add-and-max a value
#pragma unroll
  for (int j = 0; j < N; ++j) worst = max(worst, __float_as_uint(v[j]) + kSqrtFastOffset);
  const bool fast = worst <= kSqrtFastLimit;
  if (fast) {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = sqrt_fast(v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = __fsqrt_rn(v[j]);
  }
  return fast;
}

// q[j] = a[j] / b[j], correctly rounded (q may be a or b); `fast`: div_fast_path holds for
// every pair, as the caller has established from bounds on a and b.
template <int N>
__device__ __forceinline__ void div_rn_n(float (&q)[N], const float (&a)[N], const float (&b)[N], bool fast) {
  if (fast) {
#pragma unroll
    for (int j = 0; j < N; ++j) q[j] = div_fast(a[j], b[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) q[j] = __fdiv_rn(a[j], b[j]);
  }
}
template <int N>
__device__ __forceinline__ void div_rn_n(float (&q)[N], const float (&a)[N], const float (&b)[N]) {
  bool fast = true;
#pragma unroll
  for (int j = 0; j < N; ++j) fast &= div_fast_path(a[j], b[j]);
  div_rn_n(q, a, b, fast);
}

}  // namespace moe::cuda
