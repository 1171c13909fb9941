// AdamW's per-element arithmetic, shared by the CPU AdamW (src/optim/adamw.cpp) and the
// GPU optimizer (src/optim/cuda/multi_tensor_adamw.cu, adamw.cu): one source for both, so that
// they agree bit for bit. Every operation rounds on its own (no fused multiply-add: the
// CPU reference is built for x86-64-v2, which has none), hence the _rn intrinsics on
// the device, where nvcc would otherwise contract a * b + c.
//
// Also here, for the same reason:
// - bf16 rounding of the AdamW moments (optimizer.state_dtype = "bf16"), round to
//   nearest even, the same bits as float_to_bf16 in core/bf16.h;
// - the hi/lo split in which the GPU keeps its fp32 master weights: a bf16 "hi" half the
//   matmuls read directly, plus a 16-bit "lo" remainder that makes the fp32 value exact;
// - fp8 moments (optimizer.state_dtype = "fp8"): e4m3 codes in blocks of 16 elements with
//   a power-of-two scale per block and moment (docs/FP8.md section 6).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#include "core/fp8.h"

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOE_HOST_DEVICE inline
#endif

namespace moe::adamw_math {

// The fixed-order gradient sum of squares (sum_of_squares in src/optim/grad_clip.cpp, and
// the GPU's chunk kernel, bit for bit): chunks of kNormChunk elements; in a chunk, element
// i adds its square (fp64) to partial i % kNormParts in element order; the partials then
// combine as a warp of 32 lanes holding 4 each would: (p0 + p1) + (p2 + p3) per lane,
// then a butterfly over lane ^ 16, 8, 4, 2, 1 (each step q[l] + q[l ^ k]).
constexpr int64_t kNormChunk = int64_t{1} << 14;
constexpr int kNormParts = 128;

MOE_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

MOE_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

MOE_HOST_DEVICE bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// Correctly rounded fp32 operations, never fused.
MOE_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MOE_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MOE_HOST_DEVICE float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MOE_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MOE_HOST_DEVICE float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// bf16 bits of x, round to nearest even; NaN stays a quiet NaN (as float_to_bf16).
MOE_HOST_DEVICE uint16_t bf16_bits_rne(float x) {
  const uint32_t u = float_bits(x);
  if (is_nan_bits(u)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
MOE_HOST_DEVICE float bf16_bits_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }
MOE_HOST_DEVICE float round_to_bf16(float x) { return bf16_bits_to_float(bf16_bits_rne(x)); }

// The hi/lo split of an fp32 master weight x (bits u):
//   hi = (u + 0x8000) >> 16   (bf16 bits: x rounded to nearest, ties away from zero)
//   lo = int16(u - (hi << 16)) (the low 16 bits of u; always fits: u - (hi << 16) is in
//                               [-0x8000, 0x7fff])
// and back: u = (hi << 16) + lo, bit-exact for every non-NaN pattern: zeros of both signs,
// denormals (hi 0 or the smallest normal), infinities (lo 0) and the largest finite
// values (hi rounds to inf as bf16 rounding does; lo < 0 brings back the finite value).
// NaN: the formula would wrap (0x7fff8000 and up become -0, 0xffff8000 and up +0) or turn
// small-payload NaNs into inf, so a NaN's hi is the quiet NaN of its sign; joined back it
// is again a NaN of that sign (the payload is not kept).
struct MasterSplit {
  uint16_t hi;
  int16_t lo;
};

MOE_HOST_DEVICE MasterSplit split_master(float x) {
  const uint32_t u = float_bits(x);
  if (is_nan_bits(u))
    return {static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u), static_cast<int16_t>(static_cast<uint16_t>(u))};
  const uint32_t hi = (u + 0x8000u) >> 16;
  return {static_cast<uint16_t>(hi), static_cast<int16_t>(static_cast<uint16_t>(u - (hi << 16)))};
}

MOE_HOST_DEVICE float join_master(uint16_t hi, int16_t lo) {
  return bits_float((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo)));
}

// fp8 moments. A parameter's elements are cut into blocks of kMomentBlock from its first
// element (the GPU block's parameters start on 16-element boundaries and ZeRO's pieces on
// multiples of 16, so the block of state index i is i / kMomentBlock everywhere). Stored per
// block: m's e4m3 codes and sqrt(v)'s (half of v's range in bits: a block whose gradients
// span 4 decades keeps its small elements' v), each with one scale byte x: the scale
// 2^(x - 127), the smallest power of two with amax / scale <= 448, so dividing by it is
// exact. m's codes are rounded to nearest even; sqrt(v)'s stochastically (up with the
// probability of the value's fraction of its grid step), the random bits from the element's
// block offset and the step: unbiased where rounding to nearest lost v's small decays (steps
// 0.83x fp32 AdamW's; m's changes go both ways and lose nothing on average: 1.001x with m to
// nearest, bench/probes/fp8_moments_rounding.cpp), and the same bits on CPU and GPU and under
// any ZeRO layout. sqrt(v)'s codes never make a positive value 0 (the smallest code instead:
// else m / eps). Stored values: decode(code) x scale, and v = that squared, exact in fp32.
constexpr int kMomentBlock = 16;

// The scale byte of a block whose largest magnitude is amax (finite, >= 0); 1 for tiny or
// zero blocks (2^-126: every code below it is 0).
MOE_HOST_DEVICE uint8_t moment_scale_byte(float amax) {
  const uint32_t u = float_bits(amax);
  const int e = static_cast<int>(u >> 23) - 8 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);  // amax / 2^(e-127) <= 448
  return static_cast<uint8_t>(e < 1 ? 1 : e);
}
MOE_HOST_DEVICE float moment_scale(uint8_t x) { return bits_float(static_cast<uint32_t>(x) << 23); }
// 1 / scale, exact: x <= 247 for any finite amax, so 2^(127 - x) is a normal float.
MOE_HOST_DEVICE float moment_inverse_scale(uint8_t x) { return bits_float(static_cast<uint32_t>(254 - x) << 23); }

// The random bits of sqrt(v)'s rounding: for the 8 block elements from `first` (a multiple
// of 8: a GPU lane's) at AdamW step `step`, one hash (murmur3's finaliser over a mix of the
// two), then element first + j's bits = hash x an odd multiplier of j: each uniform on its
// own (a multiply by an odd number permutes 32 bits), fresh at every step, one multiply an
// element after the lane's hash.
MOE_HOST_DEVICE uint32_t moment_random_lane(int64_t first, uint32_t step) {
  const auto i = static_cast<uint64_t>(first) >> 3;
  uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u + static_cast<uint32_t>(i >> 32) * 0x85ebca77u + step * 0xc2b2ae3du;
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
MOE_HOST_DEVICE constexpr uint32_t moment_random_multiplier(int j) {
  switch (j & 7) {
    case 0: return 0x9e3779b1u;
    case 1: return 0x85ebca77u;
    case 2: return 0xc2b2ae3du;
    case 3: return 0x27d4eb2fu;
    case 4: return 0x165667b1u;
    case 5: return 0xd3a2646du;
    case 6: return 0xfd7046c5u;
    default: return 0xb55a4f09u;
  }
}
MOE_HOST_DEVICE uint32_t moment_random(int64_t index, uint32_t step) {
  return moment_random_lane(index & ~int64_t{7}, step) * moment_random_multiplier(static_cast<int>(index & 7));
}

// e4m3's code of y (|y| <= 448, finite), to nearest even: the hardware's convert on the
// GPU, core/fp8.h's on the CPU (test_gpu_fp8 holds them equal).
MOE_HOST_DEVICE uint8_t e4m3_code(float y) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
#else
  return float_to_fp8_e4m3(y);
#endif
}

// e4m3's code of |y| (<= 448), rounded up when the fraction of its grid step that y
// lies past the lower grid value, as 32 bits, exceeds r. That fraction has 20 bits: exact
// for normals (their mantissa bits below e4m3's 3); below 2^-6 (the subnormals' grid of
// 2^-9) it is taken to 20 bits by the float add that moves y onto 2^-6's binade (nearest
// even), so both ranges decode with the same integer steps.
MOE_HOST_DEVICE uint8_t e4m3_code_stochastic(float y, uint32_t r) {
  const uint32_t u = float_bits(y) & 0x7fffffffu;  // sqrt(-0) is -0
  // Bits whose exponent field is e4m3's + 120 and whose next 3 bits are its mantissa: a
  // subnormal code m (y = (m + f) 2^-9) as 2^-6 + y's bits one binade down.
  const uint32_t w = u < 0x3c800000u ? float_bits(add(y, 0.015625f)) - 0x800000u : u;
  // Rounded up when w's 20 low bits exceed r's 20 high ones (w << 12 > r): then and only
  // then they and ~r's 20 high bits (2^20 - 1 - r's) carry into bit 20, a carry that may
  // step into the exponent.
  const uint32_t code = ((w + (~r >> 12)) >> 20) - 960u;
  return static_cast<uint8_t>(code > 0x7eu ? 0x7eu : code);  // 448 at most
}

// The same code where y = root / scale lies in e4m3's normals, in the few integer steps the
// GPU's AdamW takes for a whole block (a CPU test holds them equal to root_code's):
// root_code_factor(x) = 2^-120 / scale (x <= 133; else 0, which no range admits), so
// t = root x factor carries e4m3's exponent and mantissa in its bits 20-26 and the
// fraction below them (exact: a power of two, t normal); root_code_in_normals(t): y in
// (2^-6, 448] (2^-6 itself excluded: t = 2^-126 may be a rounded-up subnormal); then the
// code is one add of ~r's 20 high bits and one shift (the GPU makes ~r in the random
// multiply: lane_random x -multiplier - 1), never above 448's 0x7e and never 0.
MOE_HOST_DEVICE float root_code_factor(uint8_t x) {
  return x <= 133 ? bits_float(static_cast<uint32_t>(134 - x) << 23) : 0.0f;
}
inline constexpr uint32_t kRootNormalsFirst = 0x00800001u, kRootNormalsSpan = 0x07e00000u - kRootNormalsFirst;
MOE_HOST_DEVICE bool root_code_in_normals(uint32_t t) { return t - kRootNormalsFirst <= kRootNormalsSpan; }
MOE_HOST_DEVICE uint32_t root_code_normal(uint32_t t, uint32_t not_r) { return (t + (not_r >> 12)) >> 20; }
MOE_HOST_DEVICE float e4m3_value(uint8_t code) {
#if defined(__CUDA_ARCH__)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
#else
  return fp8_e4m3_to_float(code);
#endif
}

// m's code in a block of scale byte x (to nearest even).
MOE_HOST_DEVICE uint8_t m_code(float m, uint8_t x) { return e4m3_code(mul(m, moment_inverse_scale(x))); }
// sqrt(v)'s code (root >= 0) in a block of scale byte x with random bits r; a positive root
// never becomes 0 (the smallest code instead).
MOE_HOST_DEVICE uint8_t root_code(float root, uint8_t x, uint32_t r) {
  const uint8_t code = e4m3_code_stochastic(mul(root, moment_inverse_scale(x)), r);
  return code == 0 && root > 0.0f ? uint8_t{1} : code;
}
MOE_HOST_DEVICE float moment_value(uint8_t code, uint8_t x) { return mul(e4m3_value(code), moment_scale(x)); }

// One block's n (<= kMomentBlock) moments x, from block element `index` on, at `step`, as
// codes; returns the block's scale byte (the store's upload and the CPU optimizers; the GPU
// AdamW kernel splits a block over two lanes). `root`: x are v's, coded as sqrt(v).
MOE_HOST_DEVICE uint8_t moment_block_codes(const float* x, int n, bool root, int64_t index, uint32_t step,
                                           uint8_t* codes) {
  float y[kMomentBlock], amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    y[i] = root ? sqrt(x[i]) : x[i];
    amax = fmaxf(amax, fabsf(y[i]));
  }
  const uint8_t scale = moment_scale_byte(amax);
  for (int i = 0; i < n; ++i)
    codes[i] = root ? root_code(y[i], scale, moment_random(index + i, step)) : m_code(y[i], scale);
  return scale;
}

// Host: one block's n (<= kMomentBlock) stored moments, from block element `index` on, at
// `step`: m's replaced by the values they are stored as; v's by the square of sqrt(v)'s.
inline void quantize_moment_block(float* m, float* v, int n, int64_t index, uint32_t step) {
  uint8_t codes[kMomentBlock];
  const uint8_t xm = moment_block_codes(m, n, false, index, step, codes);
  for (int i = 0; i < n; ++i) m[i] = moment_value(codes[i], xm);
  const uint8_t xv = moment_block_codes(v, n, true, index, step, codes);
  for (int i = 0; i < n; ++i) {
    const float r = moment_value(codes[i], xv);
    v[i] = mul(r, r);
  }
}

// The scalars of one AdamW step. The per-step values come from the host
// (adamw_step_scalars, the CPU AdamW's arithmetic); on the GPU they sit in device memory,
// where the gradient-norm kernel also writes grad_scale, skip and the norm, so a whole
// step can be captured in a CUDA graph.
struct AdamWScalars {
  float step_size = 0;        // lr sqrt(1 - beta2^t) / (1 - beta1^t): both bias corrections
  float eps = 0;              // eps sqrt(1 - beta2^t)
  float beta1 = 0, beta2 = 0;
  float one_minus_beta1 = 1, one_minus_beta2 = 1;
  float decay_factor = 1;     // 1 - lr * weight_decay, for parameters with weight decay
  float grad_scale = 1;       // gradients are multiplied by this first (global clipping)
  int32_t skip = 0;           // 1: the step changes nothing (non-finite gradient norm)
  uint32_t step = 0;          // the step's number: fp8 moments' rounding bits
  double sum_sq = 0, norm = 0;  // the step's global gradient sum of squares and norm
};

// Host only. Both bias corrections fold into the step size and epsilon (Kingma & Ba's
// efficient form): lr / b1 * m / (sqrt(v) / sqrt(b2) + eps) = (lr sqrt(b2) / b1) m /
// (sqrt(v) + eps sqrt(b2)), one division an element instead of torch's two. The products are
// taken in fp32, so once sqrt(b2) rounds to 1 (beta2 0.95: t > 338) the bits are torch's.
inline AdamWScalars adamw_step_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                       int64_t step) {
  AdamWScalars s;
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float sqrt_bias2 = static_cast<float>(std::sqrt(bias2));
  s.step_size = static_cast<float>(lr / bias1) * sqrt_bias2;
  s.eps = static_cast<float>(eps) * sqrt_bias2;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = 1.0f - s.beta1;
  s.one_minus_beta2 = 1.0f - s.beta2;
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.step = static_cast<uint32_t>(step);
  return s;
}

// The moments of one element: m and v updated in place (with bf16 moments read and stored
// rounded to bf16). read_exact: m and v come from bf16 storage, so rounding them on the way
// in is the identity and is skipped (the GPU kernels: fewer instructions, the same bits).
MOE_HOST_DEVICE void adamw_moments(float g, float& m, float& v, const AdamWScalars& s, bool bf16_moments,
                                   bool read_exact) {
  g = mul(g, s.grad_scale);
  float m_old = m, v_old = v;
  if (bf16_moments && !read_exact) {
    m_old = round_to_bf16(m_old);
    v_old = round_to_bf16(v_old);
  }
  float mi = add(mul(s.beta1, m_old), mul(s.one_minus_beta1, g));
  float vi = add(mul(s.beta2, v_old), mul(mul(s.one_minus_beta2, g), g));
  if (bf16_moments) {
    mi = round_to_bf16(mi);
    vi = round_to_bf16(vi);
  }
  m = mi;
  v = vi;
}

// One element: updates m and v in place (adamw_moments) and returns the new parameter.
// `decay` is s.decay_factor or 1 (no weight decay). The GPU's multi-tensor kernel does the
// same operations 8 elements at a time (its adamw_update8), bit for bit.
MOE_HOST_DEVICE float adamw_update(float p, float g, float& m, float& v, const AdamWScalars& s, float decay,
                                   bool bf16_moments, bool read_exact = false) {
  adamw_moments(g, m, v, s, bf16_moments, read_exact);
  const float denom = add(adamw_math::sqrt(v), s.eps);
  return sub(mul(p, decay), div(mul(s.step_size, m), denom));
}

}  // namespace moe::adamw_math
