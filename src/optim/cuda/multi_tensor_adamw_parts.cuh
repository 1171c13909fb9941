// The device pieces the multi-tensor AdamW kernels share (multi_tensor_adamw.cu: fp32 and
// bf16 moments; multi_tensor_adamw_fp8.cu: fp8 moments): finding a block's chunk and
// segment, the staged copies, 16-byte packing, and adamw_math::adamw_update on 8 elements.
// Internal to optim/cuda.
#pragma once
#include <cstdint>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/exact_math.cuh"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"

namespace moe::cuda::adamw_kernels {

namespace am = adamw_math;

// The segment holding chunk c, found by the whole warp (every lane gets it): a 32-way
// search, so a few dependent loads find it among thousands of segments. Invariant: the
// answer is in [lo, hi] and segments[lo].first_chunk <= c; first_chunk never decreases.
__device__ __forceinline__ int64_t warp_segment_of_chunk(const OptimizerSegment* segments, int64_t n_segments,
                                                         int64_t c) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int64_t lo = 0, hi = n_segments - 1;
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t probe = lo + 1 + lane * step;  // lane j probes lo + 1 + j * step
    const bool at_or_before = probe <= hi && segments[probe].first_chunk <= c;
    const int k = __popc(__ballot_sync(0xffffffffu, at_or_before));  // probes 0..k-1 qualify
    if (k == 0) {
      hi = lo;
    } else {
      const int64_t new_lo = lo + 1 + (k - 1) * step;
      if (k < 32 && lo + k * step < hi) hi = lo + k * step;  // probe k (lo + 1 + k * step) does not qualify
      lo = new_lo;
    }
  }
  return lo;
}

// p, which the compiler cannot see through (an empty asm that "changes" it).
template <class T>
__device__ __forceinline__ T* opaque(T* p) {
  asm("" : "+l"(p));
  return p;
}

// A thread's own 16 bytes copied from global to shared memory without passing through its
// registers (L2 only), in commit groups it waits on; the copy is visible to this thread
// after the wait. Both addresses 16-byte aligned (8 for the 8-byte copy); the shared one
// also as a 32-bit shared-window address, which a kernel can keep in one register.
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem);
}
__device__ __forceinline__ void cp_async8(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem), "l"(gmem) : "memory");
}
// A 16-byte read at a 32-bit shared address.
__device__ __forceinline__ uint4 ld_shared16(uint32_t smem) {
  uint4 q;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
               : "r"(smem)
               : "memory");
  return q;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Eight consecutive 16-bit values as one 16-byte access.
__device__ __forceinline__ void unpack8(const uint4 q, uint16_t out[8]) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = static_cast<uint16_t>(w[j] & 0xffffu);  // little-endian: the lower address first
    out[2 * j + 1] = static_cast<uint16_t>(w[j] >> 16);
  }
}
__device__ __forceinline__ uint4 pack8(const uint16_t in[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = static_cast<uint32_t>(in[2 * j]) | static_cast<uint32_t>(in[2 * j + 1]) << 16;
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Eight floats from two 16-byte units.
__device__ __forceinline__ void unpack_floats8(const uint4* unit, float out[8]) {
  const uint4 a = unit[0], b = unit[1];
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = __uint_as_float(w[j]);
}

// A block's chunk (blockIdx.x): the step's scalars and its segment, and where the chunk
// lies; the first warp finds the segment and its first thread works the rest out once, in
// shared memory (the other warps would each repeat ~100 instructions of 64-bit address
// arithmetic, a chunk being only a few passes a thread).
struct ChunkOfBlock {
  am::AdamWScalars s;
  OptimizerSegment seg;
  int64_t begin = 0, state = 0;  // where the chunk starts in the block and in the state arrays
  int64_t hi = 0;                 // and in the hi halves (interleaved gate|up: elsewhere)
  int32_t length = 0;
  float decay = 1.0f;
  float* mirror_out = nullptr;
};
__device__ __forceinline__ ChunkOfBlock chunk_of_block(const OptimizerSegment* segments, int64_t n_segments,
                                                       const am::AdamWScalars* scalars, float* mirror) {
  __shared__ ChunkOfBlock shared_chunk;
  if (threadIdx.x < 32) {
    const int64_t index = warp_segment_of_chunk(segments, n_segments, blockIdx.x);
    if (threadIdx.x == 0) {
      ChunkOfBlock c;
      c.s = *scalars;
      c.seg = segments[index];
      const int64_t within = (static_cast<int64_t>(blockIdx.x) - c.seg.first_chunk) * am::kNormChunk;
      c.begin = c.seg.offset + within;
      // The lo halves and moments of element begin + k are at state + k (packed under ZeRO).
      c.state = (c.seg.state_offset >= 0 ? c.seg.state_offset : c.seg.offset) + within;
      c.hi = c.seg.hi_run > 0 ? c.seg.hi_offset + within / c.seg.hi_run * c.seg.hi_stride + within % c.seg.hi_run
                              : c.begin;
      c.length = static_cast<int32_t>(c.seg.numel - within < am::kNormChunk ? c.seg.numel - within : am::kNormChunk);
      c.decay = c.seg.decay ? c.s.decay_factor : 1.0f;
      c.mirror_out = c.seg.mirror_offset >= 0 ? mirror + c.seg.mirror_offset + within : nullptr;
      shared_chunk = c;
    }
  }
  __syncthreads();
  return shared_chunk;
}

// The 8 new moments m and v rounded to bf16 as am::round_to_bf16 does: the hardware's
// convert (one instruction a value instead of ~7 integer ones: it is am's nearest-even on
// every value but a NaN, which it makes the canonical one), so one NaN check a group sends
// a group holding a NaN the integer way.
__device__ __forceinline__ void round_moments8_to_bf16(float (&m)[8], float (&v)[8]) {
  bool nan = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) nan |= (m[j] != m[j]) | (v[j] != v[j]);
  if (nan) {
#pragma unroll
    for (int j = 0; j < 8; ++j) m[j] = am::round_to_bf16(m[j]), v[j] = am::round_to_bf16(v[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    m[j] = __bfloat162float(__float2bfloat16_rn(m[j]));
    v[j] = __bfloat162float(__float2bfloat16_rn(v[j]));
  }
}

// am::split_master on 8 parameters, packed as the 16-byte units of their hi and lo halves
// (pack8's order). For any value but a NaN, split_master's hi is (u + 0x8000) >> 16 and its
// lo u's low half (u - (hi << 16) keeps it), so a group without NaN takes one add and half
// a byte permute a half (2.5 instructions a value instead of ~9: the fp8-moment kernel is
// issue-bound on the H200); one NaN check a group sends a group holding one the scalar way.
__device__ __forceinline__ void split_master8(const float (&p)[8], uint4& hi, uint4& lo) {
  bool nan = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) nan |= p[j] != p[j];
  if (nan) {
    uint16_t h[8], l[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const am::MasterSplit out = am::split_master(p[j]);
      h[j] = out.hi;
      l[j] = static_cast<uint16_t>(out.lo);
    }
    hi = pack8(h);
    lo = pack8(l);
    return;
  }
  uint32_t h[4], l[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t a = __float_as_uint(p[2 * j]), b = __float_as_uint(p[2 * j + 1]);
    h[j] = __byte_perm(a + 0x8000u, b + 0x8000u, 0x7632);  // the upper halves, a's first
    l[j] = __byte_perm(a, b, 0x5410);                      // the lower halves
  }
  hi = make_uint4(h[0], h[1], h[2], h[3]);
  lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// am::adamw_update on 8 elements, bit for bit, in three steps: the moments one by one
// (bf16 moments rounded 8 at a time), the square roots of the new v, then the parameters
// with the division 8 at a time (exact_math.cuh: one range check a group instead of a
// branch per element, so the 8 interleave). The fp8 kernel quantises the roots it also
// stores (sqrt(v)'s codes) between the last two.
__device__ __forceinline__ void adamw_moments8(const float (&g)[8], float (&m)[8], float (&v)[8],
                                               const am::AdamWScalars& s, bool bf16_moments) {
  // The bf16 moments come from bf16 storage: adamw_moments's read_exact, its rounding below.
#pragma unroll
  for (int j = 0; j < 8; ++j) am::adamw_moments(g[j], m[j], v[j], s, /*bf16_moments=*/false, true);
  if (bf16_moments) round_moments8_to_bf16(m, v);
}
// p: the parameters in, the new ones out; root: sqrt of the new v. `quotients`: whether
// every division's operands are in div_fast_path's range (Fast: the caller has bounded
// them; Check: checked here).
enum class QuotientRange { Check, Fast, Slow };
__device__ __forceinline__ void adamw_parameters8(float (&p)[8], const float (&m)[8], const float (&root)[8],
                                                  const am::AdamWScalars& s, float decay,
                                                  QuotientRange quotients = QuotientRange::Check) {
  float numerator[8], denom[8], update[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    denom[j] = am::add(root[j], s.eps);
    numerator[j] = am::mul(s.step_size, m[j]);
  }
  if (quotients == QuotientRange::Check)
    div_rn_n(update, numerator, denom);
  else
    div_rn_n(update, numerator, denom, quotients == QuotientRange::Fast);
#pragma unroll
  for (int j = 0; j < 8; ++j) p[j] = am::sub(am::mul(p[j], decay), update[j]);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// multi_tensor_adamw with fp8 moments (multi_tensor_adamw_fp8.cu): one block a chunk, its
// arrays 16-byte aligned (checked by the caller).
void multi_tensor_adamw_fp8(uint16_t* hi, int16_t* lo, float* mirror, const float* grads, const uint16_t* grads16,
                            const MomentState& moments, const OptimizerSegment* segments, int64_t n_segments,
                            unsigned blocks, const am::AdamWScalars* scalars, Stream stream);

}  // namespace moe::cuda::adamw_kernels
