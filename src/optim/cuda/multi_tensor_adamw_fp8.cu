// The multi-tensor AdamW with fp8 moments (optimizer.state_dtype = fp8): the kernel and
// its launch; multi_tensor_adamw.cu dispatches here.
#include <cstdint>

#include "optim/cuda/multi_tensor_adamw_parts.cuh"

namespace moe::cuda::adamw_kernels {
namespace {

// A segment's state starts on a block of am::kMomentBlock = 16 (GpuOptimizer checks), and
// so does each chunk's: a thread updates 8 elements a pass as the bf16 kernel does, two
// adjacent lanes one block (its amax through one shuffle), and stages its next pass in
// shared memory (cp.async: hi, lo, the gradients, and m's and v's 8 codes together in one
// 16-byte slot); the two scale bytes of the next pass are loaded into registers early. The
// update computes in fp32 (adamw_moments8, adamw_parameters8), as adamw_update_range does,
// from v = the stored sqrt(v) squared; the new m is rounded to nearest, sqrt(v)
// stochastically (am::moment_random of the element's block offset and the step: one hash a
// lane), both before the division, whose fast path the blocks' largest values then bound;
// the lane(s) at a segment's ragged end load and store their few elements one by one.
constexpr int kFp8Threads = 512;
constexpr int kFp8Units = 5;  // hi, lo, m|v codes, the gradients (fp32: 2)
constexpr size_t kFp8StagedBytes = size_t{2} * kFp8Units * kFp8Threads * sizeof(uint4);

// min(a, b), NaN if either is (min.NaN.f32; fminf would drop it).
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// One block's scale byte from the lane's 8 values (the pair's 16 together) and the pair's
// largest magnitude.
__device__ __forceinline__ uint8_t pair_block_scale(const float (&x)[8], float& amax) {
  amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(x[j]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // every lane of the warp is here
  return am::moment_scale_byte(amax);
}
// m's codes (am::m_code, to nearest) for the lane's 8 values, packed in a uint2, with the
// converts in pairs (cvt.rn.satfinite.e4m3x2.f32: each value rounded on its own, the first
// in the low byte): half the converts, no byte packing.
__device__ __forceinline__ uint2 m_codes_pair_block(const float (&m)[8], uint8_t& scale, float& amax) {
  scale = pair_block_scale(m, amax);
  const float inverse = am::moment_inverse_scale(scale);
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < 8; j += 2)
    w[j / 4] |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(am::mul(m[j], inverse), am::mul(m[j + 1], inverse)),
                                                               __NV_SATFINITE, __NV_E4M3))
                << (8 * (j % 4));
  return make_uint2(w[0], w[1]);
}
// sqrt(v)'s codes (am::root_code, stochastic with the lane's random bits: am::moment_random's
// for element j, lane_random x multiplier j), packed in a uint2. Where every scaled root lies
// in e4m3's normals (am::root_code_in_normals, as one add-and-max a value) a code is an add
// and a shift (am::root_code_normal); else am::root_code value by value.
__device__ __forceinline__ uint2 root_codes_pair_block(const float (&root)[8], uint32_t lane_random, uint8_t& scale,
                                                       float& amax) {
  scale = pair_block_scale(root, amax);
  const float factor = am::root_code_factor(scale);
  uint32_t t[8], worst = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    t[j] = __float_as_uint(am::mul(root[j], factor));
    worst = max(worst, t[j] - am::kRootNormalsFirst);
  }
  uint32_t w[2] = {0, 0};
  if (worst <= am::kRootNormalsSpan) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      w[j / 4] |= am::root_code_normal(t[j], lane_random * (0u - am::moment_random_multiplier(j)) + 0xffffffffu)
                  << (8 * (j % 4));  // ~(lane_random x multiplier) in one multiply-add
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      w[j / 4] |= static_cast<uint32_t>(am::root_code(root[j], scale, lane_random * am::moment_random_multiplier(j)))
                  << (8 * (j % 4));
  }
  return make_uint2(w[0], w[1]);
}
// am::moment_value on 8 codes, decoded in pairs (cvt.rn.f16x2.e4m3x2: exact), then scaled.
__device__ __forceinline__ void decode8(uint2 codes, uint8_t scale, float (&out)[8]) {
  const uint32_t w[2] = {codes.x, codes.y};
  const float factor = am::moment_scale(scale);
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(w[j / 4] >> (8 * (j % 4)));
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    out[j] = am::mul(f.x, factor);
    out[j + 1] = am::mul(f.y, factor);
  }
}

__global__ void __launch_bounds__(kFp8Threads, 2)
    multi_tensor_adamw_fp8_kernel(uint16_t* __restrict__ hi, int16_t* __restrict__ lo, float* __restrict__ mirror,
                                  const float* __restrict__ grads, const uint16_t* __restrict__ grads16,
                                  uint8_t* __restrict__ m, uint8_t* __restrict__ v, uint8_t* __restrict__ m_scales,
                                  uint8_t* __restrict__ v_scales, const OptimizerSegment* segments, int64_t n_segments,
                                  const am::AdamWScalars* scalars) {
  constexpr int kB = am::kMomentBlock;
  static_assert(kB == 16, "a block is the 8 elements of two adjacent lanes");
  const auto [s, seg, begin, state, hi_begin, length, decay, mirror_out] =
      chunk_of_block(segments, n_segments, scalars, mirror);
  if (s.skip) return;
  // The chunk's arrays from its first element, indexed by 32-bit offsets (a chunk is 2^14):
  // opaque() keeps the compiler from folding the chunk's 64-bit offsets back into every
  // access (one wide multiply-add an address instead of four instructions); the bases stay
  // in uniform registers, a thread's offset in one register.
  uint16_t* const hi_c = opaque(hi + hi_begin);  // the hi halves (interleaved gate|up: elsewhere)
  int16_t* const lo_c = opaque(lo + state);
  uint8_t* const m_c = opaque(m + state);
  uint8_t* const v_c = opaque(v + state);
  uint8_t* const m_scales_c = opaque(m_scales + state / kB);
  uint8_t* const v_scales_c = opaque(v_scales + state / kB);
  const bool half = seg.bf16_grad != 0;
  const float* const g_c = opaque(grads + begin);
  const uint16_t* const g16_c = opaque(grads16 + begin);
  const int32_t blocks_end = (length + kB - 1) / kB * kB;
  const bool eps_in_range = s.eps >= 0.0f && s.eps < 0x1p60f;
  const float step_size_abs = fabsf(s.step_size);

  extern __shared__ uint4 staged[];  // [2 stages][kFp8Units][kFp8Threads]
  constexpr uint32_t kUnitBytes = kFp8Threads * sizeof(uint4), kStageBytes = kFp8Units * kUnitBytes;
  const auto my_slots = static_cast<uint32_t>(__cvta_generic_to_shared(staged + threadIdx.x));
  // Elements i.. (a whole 8, or nothing: the ragged end's lane loads its few directly) into
  // the stage at `slots` (this thread's first slot there).
  const auto stage_in = [&](int32_t i, uint32_t slots) {
    if (i + 8 <= length) {
      cp_async16(slots, hi_c + i);
      cp_async16(slots + kUnitBytes, lo_c + i);
      cp_async8(slots + 2 * kUnitBytes, m_c + i);
      cp_async8(slots + 2 * kUnitBytes + 8, v_c + i);
      if (half) {
        cp_async16(slots + 3 * kUnitBytes, g16_c + i);
      } else {
        cp_async16(slots + 3 * kUnitBytes, g_c + i);
        cp_async16(slots + 4 * kUnitBytes, g_c + i + 4);
      }
    }
    cp_async_commit();  // empty otherwise: the group count stays one a pass
  };
  // Every thread runs every pass (the pair's shuffle wants the whole warp); a lane with no
  // element left computes zeros (outside its block's amax) and stores nothing.
  constexpr int32_t kPass = kFp8Threads * 8;
  const int32_t first = static_cast<int32_t>(threadIdx.x) * 8;
  stage_in(first, my_slots);
  uint8_t xm = 0, xv = 0;  // this pass's scale bytes
  if (first < length) xm = m_scales_c[first / kB], xv = v_scales_c[first / kB];
  uint32_t this_stage = 0;  // the byte offset of this pass's stage; the next one's: kStageBytes - it
  for (int32_t i = first; i - first < blocks_end; i += kPass) {
    const int32_t next = i + kPass;
    const int n = length - i < 0 ? 0 : length - i < 8 ? length - i : 8;  // this lane's elements
    stage_in(next, my_slots + (kStageBytes - this_stage));
    const uint8_t this_xm = xm, this_xv = xv;
    if (next < length) {
      const uint32_t block = static_cast<uint32_t>(next) / kB;
      xm = m_scales_c[block], xv = v_scales_c[block];
    }
    cp_async_wait<1>();  // this pass's group is in
    const uint32_t slots = my_slots + this_stage;
    this_stage = kStageBytes - this_stage;
    float p[8], g[8], mm[8], vv[8];
    if (n == 8) {
      uint16_t h[8], l[8];
      unpack8(ld_shared16(slots), h);
      unpack8(ld_shared16(slots + kUnitBytes), l);
#pragma unroll
      for (int j = 0; j < 8; ++j) p[j] = am::join_master(h[j], static_cast<int16_t>(l[j]));
      const uint4 codes = ld_shared16(slots + 2 * kUnitBytes);
      decode8(make_uint2(codes.x, codes.y), this_xm, mm);
      decode8(make_uint2(codes.z, codes.w), this_xv, vv);  // sqrt(v): squared below
      if (half) {
        uint16_t g16[8];
        unpack8(ld_shared16(slots + 3 * kUnitBytes), g16);
#pragma unroll
        for (int j = 0; j < 8; ++j) g[j] = am::bf16_bits_to_float(g16[j]);
      } else {
        const uint4 pair[2] = {ld_shared16(slots + 3 * kUnitBytes), ld_shared16(slots + 4 * kUnitBytes)};
        unpack_floats8(pair, g);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool in = j < n;
        p[j] = in ? am::join_master(hi_c[i + j], lo_c[i + j]) : 0.0f;
        g[j] = !in ? 0.0f : half ? am::bf16_bits_to_float(g16_c[i + j]) : g_c[i + j];
        mm[j] = in ? am::moment_value(m_c[i + j], this_xm) : 0.0f;
        vv[j] = in ? am::moment_value(v_c[i + j], this_xv) : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) vv[j] = am::mul(vv[j], vv[j]);
    adamw_moments8(g, mm, vv, s, false);
    float root[8];
    const bool roots_fast = sqrt_rn_n(root, vv);
    uint8_t ym, yv;
    float m_amax, root_amax;
    const uint32_t lane_random = am::moment_random_lane(begin + i, s.step);  // a multiple of 8
    const uint2 cm = m_codes_pair_block(mm, ym, m_amax), cv = root_codes_pair_block(root, lane_random, yv, root_amax);
    // div_fast_path for all 8 from bounds: the denominators root + eps in [2^-60, 2^61) (roots
    // from sqrt's fast path are >= 2^-50.5, below their pair's amax < 2^60; eps_in_range);
    // the numerators step_size x m between |step_size| times the smallest |m| (min.NaN: a NaN
    // fails) and times the pair's largest (rounding is monotone).
    float m_min = fabsf(mm[0]);
#pragma unroll
    for (int j = 1; j < 8; ++j) m_min = min_nan(m_min, fabsf(mm[j]));
    const bool quotients_fast = roots_fast && eps_in_range && root_amax < 0x1p60f &&
                                am::mul(step_size_abs, m_amax) < 0x1p61f && am::mul(step_size_abs, m_min) >= 0x1p-60f;
    adamw_parameters8(p, mm, root, s, decay, quotients_fast ? QuotientRange::Fast : QuotientRange::Slow);
    if (n > 0) {
      // Both lanes of the pair store their block's scale bytes: the same bytes to the same
      // addresses, without a branch.
      m_scales_c[static_cast<uint32_t>(i) / kB] = ym;
      v_scales_c[static_cast<uint32_t>(i) / kB] = yv;
      uint4 hi8, lo8;
      split_master8(p, hi8, lo8);
      if (n == 8) {
        __stcs(reinterpret_cast<uint2*>(m_c + i), cm);
        __stcs(reinterpret_cast<uint2*>(v_c + i), cv);
        __stcs(reinterpret_cast<uint4*>(hi_c + i), hi8);
        __stcs(reinterpret_cast<uint4*>(lo_c + i), lo8);
      } else {
        uint16_t h[8], l[8];
        unpack8(hi8, h);
        unpack8(lo8, l);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j < n) {
            hi_c[i + j] = h[j];
            lo_c[i + j] = static_cast<int16_t>(l[j]);
            m_c[i + j] = static_cast<uint8_t>((j < 4 ? cm.x : cm.y) >> (8 * (j % 4)));
            v_c[i + j] = static_cast<uint8_t>((j < 4 ? cv.x : cv.y) >> (8 * (j % 4)));
          }
      }
      if (mirror_out)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j < n) mirror_out[i + j] = p[j];
    }
  }
  cp_async_wait<0>();
}

}  // namespace

void multi_tensor_adamw_fp8(uint16_t* hi, int16_t* lo, float* mirror, const float* grads, const uint16_t* grads16,
                            const MomentState& moments, const OptimizerSegment* segments, int64_t n_segments,
                            unsigned blocks, const am::AdamWScalars* scalars, Stream stream) {
  MOE_CUDA_CHECK(cudaFuncSetAttribute(multi_tensor_adamw_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kFp8StagedBytes)));
  multi_tensor_adamw_fp8_kernel<<<blocks, kFp8Threads, kFp8StagedBytes, stream>>>(
      hi, lo, mirror, grads, grads16, static_cast<uint8_t*>(moments.m), static_cast<uint8_t*>(moments.v),
      moments.m_scales, moments.v_scales, segments, n_segments, scalars);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda::adamw_kernels
