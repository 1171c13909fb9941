// The multi-tensor optimizer on the GPU: the global gradient norm summed in the CPU's
// order (so clipping decides and scales exactly as on the CPU) and AdamW over every
// parameter in one launch. The per-element arithmetic is kernels/adamw_math.h's, the code
// the CPU AdamW runs.
#include <algorithm>
#include <cstdint>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/exact_math.cuh"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"

namespace moe::cuda {
namespace {

namespace am = adamw_math;

constexpr int kThreads = 256;
constexpr int kNormWarps = 8;  // warps per block of the chunk sums, one chunk each
constexpr int kFinalizeThreads = 1024;  // the one block that adds the chunk sums up

__device__ __forceinline__ int64_t chunk_count(int64_t numel) { return (numel + am::kNormChunk - 1) / am::kNormChunk; }

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

// Four consecutive gradients from element e of a chunk of len (zeros past its end), fp32
// or (a bf16_grad segment) bf16 widened exactly; 16- (8-) byte loads where aligned.
__device__ __forceinline__ float4 load_four(const float* at, const uint16_t* at16, bool half, bool vec, int32_t e,
                                            int32_t len) {
  float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (half) {
    if (vec && e + 4 <= len) {
      const uint2 q = __ldcs(reinterpret_cast<const uint2*>(at16 + e));
      x.x = am::bf16_bits_to_float(static_cast<uint16_t>(q.x & 0xffffu));
      x.y = am::bf16_bits_to_float(static_cast<uint16_t>(q.x >> 16));
      x.z = am::bf16_bits_to_float(static_cast<uint16_t>(q.y & 0xffffu));
      x.w = am::bf16_bits_to_float(static_cast<uint16_t>(q.y >> 16));
    } else if (e < len) {
      x.x = am::bf16_bits_to_float(at16[e]);
      if (e + 1 < len) x.y = am::bf16_bits_to_float(at16[e + 1]);
      if (e + 2 < len) x.z = am::bf16_bits_to_float(at16[e + 2]);
      if (e + 3 < len) x.w = am::bf16_bits_to_float(at16[e + 3]);
    }
  } else if (vec && e + 4 <= len) {
    x = __ldcs(reinterpret_cast<const float4*>(at + e));
  } else if (e < len) {  // a chunk's ragged end, or a segment not on a 16-byte boundary
    x.x = at[e];
    if (e + 1 < len) x.y = at[e + 1];
    if (e + 2 < len) x.z = at[e + 2];
    if (e + 3 < len) x.w = at[e + 3];
  }
  return x;
}

// A thread's own 16 bytes copied from global to shared memory without passing through its
// registers (L2 only), in commit groups it waits on; the copy is visible to this thread
// after the wait. Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One warp per chunk, in adamw_math's order (kNormParts partials): lane j keeps partials
// 4j..4j+3, i.e. elements 4j + 128 i + 0..3, added in element order; kNormUnroll
// strides' loads are issued before their squares are added, and lane 0 asks the L2 for the
// next pass meanwhile (prefetch_l2: one pass in flight a warp left DRAM idle; ncu,
// mixtral-mini: 3.65 -> 2.95 ms, 2.8 -> 3.56 TB/s; AdamW gained nothing from the same).
// Squares of floats are exact in fp64, so the only roundings are the additions, in the
// CPU's order; the zeros past a chunk's end add nothing (the sums are +0 or more, or NaN).
constexpr int kNormUnroll = 4;
static_assert(am::kNormParts == 4 * 32, "a warp's lanes hold the partials four each");
__global__ void __launch_bounds__(kNormWarps * 32)
    chunk_sum_of_squares_kernel(double* chunk_sq, const float* __restrict__ grads, const uint16_t* __restrict__ grads16,
                                const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (chunk >= n_chunks) return;  // the whole warp
  const OptimizerSegment& seg = segments[warp_segment_of_chunk(segments, n_segments, chunk)];
  const int64_t within = (chunk - seg.first_chunk) * am::kNormChunk;
  const int64_t start = seg.offset + within;
  const int32_t len = static_cast<int32_t>(seg.numel - within < am::kNormChunk ? seg.numel - within : am::kNormChunk);
  const bool half = seg.bf16_grad != 0;
  const float* at = grads + start;
  const uint16_t* at16 = half ? grads16 + start : nullptr;
  const bool vec = half ? (reinterpret_cast<uintptr_t>(at16) & 7) == 0 : (reinterpret_cast<uintptr_t>(at) & 15) == 0;
  double p0 = 0.0, p1 = 0.0, p2 = 0.0, p3 = 0.0;
  constexpr int32_t kPass = am::kNormParts * kNormUnroll;
  const int32_t elem_bytes = half ? 2 : 4;
  const char* bytes = half ? reinterpret_cast<const char*>(at16) : reinterpret_cast<const char*>(at);
  const bool aligned = (reinterpret_cast<uintptr_t>(bytes) & 15) == 0;  // passes keep it (1 KB or more each)
  const auto prefetch_pass = [&](int32_t from) {  // lane 0; whole 16-byte units of the pass
    if (lane != 0 || !aligned || from >= len) return;
    const int32_t n = ((from + kPass < len ? from + kPass : len) - from) * elem_bytes / 16 * 16;
    prefetch_l2(bytes + static_cast<int64_t>(from) * elem_bytes, static_cast<uint32_t>(n));
  };
  prefetch_pass(0);
  for (int32_t base = 0; base < len; base += kPass) {
    prefetch_pass(base + kPass);
    float4 x[kNormUnroll];
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) x[u] = load_four(at, at16, half, vec, base + u * am::kNormParts + 4 * lane, len);
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) {
      const double a = x[u].x, b = x[u].y, c = x[u].z, d = x[u].w;
      p0 = __dadd_rn(p0, __dmul_rn(a, a));
      p1 = __dadd_rn(p1, __dmul_rn(b, b));
      p2 = __dadd_rn(p2, __dmul_rn(c, c));
      p3 = __dadd_rn(p3, __dmul_rn(d, d));
    }
  }
  double q = __dadd_rn(__dadd_rn(p0, p1), __dadd_rn(p2, p3));
#pragma unroll
  for (int k = 16; k >= 1; k >>= 1) q = __dadd_rn(q, __shfl_xor_sync(0xffffffffu, q, k));
  if (lane == 0) chunk_sq[chunk] = q;
}

// One block: per segment its chunks in order, then the segments in order, the norm and
// the clip factor, computed as optim/grad_clip.cpp does in fp64. A warp per segment: the
// lanes load 128 of its chunk sums at a time (coalesced, independent loads) and every
// lane adds them in order from shuffles, so a segment of thousands of chunks (an MoE
// layer's experts) waits on a load latency per 128 chunks, not per chunk.
__global__ void __launch_bounds__(kFinalizeThreads)
    norm_finalize_kernel(am::AdamWScalars* scalars, double* segment_sq, const double* chunk_sq,
                         const OptimizerSegment* segments, int64_t n_segments, double max_norm) {
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int n_warps = static_cast<int>(blockDim.x >> 5);
  for (int64_t s = warp; s < n_segments; s += n_warps) {
    const int64_t first = segments[s].first_chunk, count = chunk_count(segments[s].numel);
    double total = 0.0;
    for (int64_t base = 0; base < count; base += 128) {
      double part[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t c = base + r * 32 + lane;
        part[r] = c < count ? chunk_sq[first + c] : 0.0;
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          const double x = __shfl_sync(0xffffffffu, part[r], k);
          if (base + r * 32 + k < count) total = __dadd_rn(total, x);
        }
    }
    if (lane == 0) segment_sq[s] = total;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double sq = 0.0;
  for (int64_t s = 0; s < n_segments; ++s) sq = __dadd_rn(sq, segment_sq[s]);
  const double norm = __dsqrt_rn(sq);
  scalars->sum_sq = sq;
  scalars->norm = norm;
  scalars->grad_scale =
      max_norm > 0 && norm > max_norm ? static_cast<float>(__ddiv_rn(max_norm, __dadd_rn(norm, 1e-6))) : 1.0f;
  scalars->skip = isfinite(norm) ? 0 : 1;
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

// A block's chunk (blockIdx.x): the step's scalars and its segment, read once into shared
// memory (the first warp finds the segment), and where the chunk lies.
struct ChunkOfBlock {
  am::AdamWScalars s;
  OptimizerSegment seg;
  int64_t begin = 0, state = 0;  // where the chunk starts in the block and in the state arrays
  int32_t length = 0;
  float decay = 1.0f;
  float* mirror_out = nullptr;
};
__device__ __forceinline__ ChunkOfBlock chunk_of_block(const OptimizerSegment* segments, int64_t n_segments,
                                                       const am::AdamWScalars* scalars, float* mirror) {
  __shared__ am::AdamWScalars shared_scalars;
  __shared__ OptimizerSegment shared_segment;
  if (threadIdx.x < 32) {
    const int64_t index = warp_segment_of_chunk(segments, n_segments, blockIdx.x);
    if (threadIdx.x == 0) {
      shared_scalars = *scalars;
      shared_segment = segments[index];
    }
  }
  __syncthreads();
  ChunkOfBlock c;
  c.s = shared_scalars;
  c.seg = shared_segment;
  const int64_t within = (static_cast<int64_t>(blockIdx.x) - c.seg.first_chunk) * am::kNormChunk;
  c.begin = c.seg.offset + within;
  // The lo halves and moments of element begin + k are at state + k (packed under ZeRO).
  c.state = (c.seg.state_offset >= 0 ? c.seg.state_offset : c.seg.offset) + within;
  c.length = static_cast<int32_t>(c.seg.numel - within < am::kNormChunk ? c.seg.numel - within : am::kNormChunk);
  c.decay = c.seg.decay ? c.s.decay_factor : 1.0f;
  c.mirror_out = c.seg.mirror_offset >= 0 ? mirror + c.seg.mirror_offset + within : nullptr;
  return c;
}

// Eight moments at once (16-byte units: kUnits of them; `at` a multiple of 8), fp32 or
// bf16 bits. Streaming stores: nothing here is read again before it leaves the L2.
template <bool kBf16>
struct Moments;

template <>
struct Moments<false> {
  __device__ static void store8(void* base, int64_t at, const float in[8]) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + at);
    __stcs(p, make_float4(in[0], in[1], in[2], in[3]));
    __stcs(p + 1, make_float4(in[4], in[5], in[6], in[7]));
  }
  __device__ static float load(const void* base, int64_t at) { return static_cast<const float*>(base)[at]; }
  __device__ static void store(void* base, int64_t at, float x) { static_cast<float*>(base)[at] = x; }
  static constexpr int kUnits = 2;  // 16-byte units of 8 moments
  __device__ static void unpack(const uint4* unit, float out[8]) {
    const uint4 a = unit[0], b = unit[1];
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __uint_as_float(w[j]);
  }
};

template <>
struct Moments<true> {
  // in[] are bf16 values already (adamw_update rounds the moments it returns): their
  // upper halves are their bf16 bits, NaNs included.
  __device__ static void store8(void* base, int64_t at, const float in[8]) {
    uint16_t b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = static_cast<uint16_t>(am::float_bits(in[j]) >> 16);
    __stcs(reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + at), pack8(b));
  }
  __device__ static float load(const void* base, int64_t at) {
    return am::bf16_bits_to_float(static_cast<const uint16_t*>(base)[at]);
  }
  static constexpr int kUnits = 1;
  __device__ static void unpack(const uint4* unit, float out[8]) {
    uint16_t b[8];
    unpack8(*unit, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = am::bf16_bits_to_float(b[j]);
  }
  __device__ static void store(void* base, int64_t at, float x) {
    static_cast<uint16_t*>(base)[at] = static_cast<uint16_t>(am::float_bits(x) >> 16);
  }
};

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

// am::adamw_update on 8 elements, bit for bit, in three steps: the moments one by one
// (bf16 moments rounded 8 at a time), the square roots of the new v, then the parameters
// with the two divisions 8 at a time (exact_math.cuh: one range check a group instead of a
// branch per element, so the 8 interleave). The fp8 kernel quantises the roots it also
// stores (sqrt(v)'s codes) between the last two.
__device__ __forceinline__ void adamw_moments8(const float (&g)[8], float (&m)[8], float (&v)[8],
                                               const am::AdamWScalars& s, bool bf16_moments) {
  // The bf16 moments come from bf16 storage: adamw_moments's read_exact, its rounding below.
#pragma unroll
  for (int j = 0; j < 8; ++j) am::adamw_moments(g[j], m[j], v[j], s, /*bf16_moments=*/false, true);
  if (bf16_moments) round_moments8_to_bf16(m, v);
}
// p: the parameters in, the new ones out; root: sqrt of the new v.
__device__ __forceinline__ void adamw_parameters8(float (&p)[8], const float (&m)[8], const float (&root)[8],
                                                  const am::AdamWScalars& s, float decay) {
  float corrected[8], numerator[8], denom[8], update[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) corrected[j] = root[j];
  if (s.sqrt_bias2 != 1.0f) {
    float bias[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) bias[j] = s.sqrt_bias2;
    div_rn_n(corrected, root, bias);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    denom[j] = am::add(corrected[j], s.eps);
    numerator[j] = am::mul(s.step_size, m[j]);
  }
  div_rn_n(update, numerator, denom);
#pragma unroll
  for (int j = 0; j < 8; ++j) p[j] = am::sub(am::mul(p[j], decay), update[j]);
}
__device__ __forceinline__ void adamw_update8(float (&p)[8], const float (&g)[8], float (&m)[8], float (&v)[8],
                                              const am::AdamWScalars& s, float decay, bool bf16_moments) {
  adamw_moments8(g, m, v, s, bf16_moments);
  float root[8];
  sqrt_rn_n(root, v);
  adamw_parameters8(p, m, root, s, decay);
}

// One block per chunk. Each thread updates 8 consecutive elements per pass with 16-byte
// accesses only (hi, lo and bf16 moments 1 each, gradient and fp32 moments 2 each: 128
// bytes in flight per thread), from the chunk's first element whose index is a multiple
// of 8; the few before it (a segment not on an 8-element boundary) and after the last
// whole 8 go one element per thread. With vectors false (a base pointer not 16-byte
// aligned) everything does. The arithmetic is am::adamw_update's (adamw_update8 is its
// vector form, bit for bit), so the split changes no bits.
// With bf16 moments the loads are staged through shared memory (96 KB a block of 512
// threads); with fp32 moments they go straight to registers (see the loop), 256 threads a
// block. 1024 threads an SM either way (64 registers; unbounded, the fp32 form takes 92
// and would fit half as many).
template <bool kBf16, int kBlock, bool kStaged = kBf16>
__global__ void __launch_bounds__(kBlock, 1024 / kBlock)
    multi_tensor_adamw_kernel(uint16_t* __restrict__ hi, int16_t* __restrict__ lo, float* __restrict__ mirror,
                              const float* __restrict__ grads, const uint16_t* __restrict__ grads16,
                              void* __restrict__ m, void* __restrict__ v, const OptimizerSegment* segments,
                              int64_t n_segments, const am::AdamWScalars* scalars, bool vectors) {
  const ChunkOfBlock chunk = chunk_of_block(segments, n_segments, scalars, mirror);
  const am::AdamWScalars& s = chunk.s;
  if (s.skip) return;
  const OptimizerSegment& seg = chunk.seg;
  const int64_t begin = chunk.begin, state = chunk.state;
  const int32_t length = chunk.length;
  const float decay = chunk.decay;
  float* mirror_out = chunk.mirror_out;
  using M = Moments<kBf16>;

  const int32_t to_boundary = static_cast<int32_t>((8 - (begin & 7)) & 7);
  const int32_t head = vectors && to_boundary < length ? to_boundary : length;
  const int32_t tail = head + (length - head) / 8 * 8;  // [head, tail): whole vectors of 8
  const int32_t n_single = head + (length - tail);
  for (int32_t t = static_cast<int32_t>(threadIdx.x); t < n_single; t += kBlock) {
    const int32_t k = t < head ? t : tail + (t - head);
    const int64_t e = begin + k, es = state + k;
    float mk = M::load(m, es), vk = M::load(v, es);
    const float gk = seg.bf16_grad ? am::bf16_bits_to_float(grads16[e]) : grads[e];
    const float p = am::adamw_update(am::join_master(hi[e], lo[es]), gk, mk, vk, s, decay, kBf16, kBf16);
    const am::MasterSplit split = am::split_master(p);
    hi[e] = split.hi;
    lo[es] = split.lo;
    M::store(m, es, mk);
    M::store(v, es, vk);
    if (mirror_out) mirror_out[k] = p;
  }
  const bool mirror_vectors = mirror_out && (reinterpret_cast<uintptr_t>(mirror_out + head) & 15) == 0;
  // kStaged (bf16 moments): the next pass's bytes are copied into shared memory while this
  // pass computes (a thread's own slots: no barrier), so every warp keeps its loads in
  // flight (ncu before: 12 of 16 cycles between a warp's instructions waited on its loads;
  // 26.3 -> 24.2 ms a mixtral-mini step). With fp32 moments the 64 KB of staging leaves 3
  // blocks an SM and the pass ran slower (41.9 -> 46.2 ms), so those load straight into
  // registers. Units a pass: hi, lo, m, v (fp32: 2 each), the gradient (fp32: 2).
  constexpr int kGradUnit = 2 + 2 * M::kUnits, kUnits = kGradUnit + 2;
  const auto source = [&](int unit, int32_t i) -> const uint4* {
    const int64_t at = begin + i, at_state = state + i;
    constexpr int kMomentBytes = kBf16 ? 2 : 4;
    if (unit == 0) return reinterpret_cast<const uint4*>(hi + at);
    if (unit == 1) return reinterpret_cast<const uint4*>(lo + at_state);
    if (unit < kGradUnit) {
      const void* moments = unit < 2 + M::kUnits ? m : v;
      return reinterpret_cast<const uint4*>(static_cast<const char*>(moments) + at_state * kMomentBytes) +
             (unit - 2) % M::kUnits;
    }
    return seg.bf16_grad ? reinterpret_cast<const uint4*>(grads16 + at)
                         : reinterpret_cast<const uint4*>(grads + at) + (unit - kGradUnit);
  };
  const int used_units = seg.bf16_grad ? kUnits - 1 : kUnits;
  extern __shared__ uint4 staged[];  // [2 stages][kUnits][kBlock]
  const auto slot = [&](int stage, int unit) { return staged + (stage * kUnits + unit) * kBlock + threadIdx.x; };
  const auto stage_in = [&](int32_t i, int stage) {
    if (i < tail) {
#pragma unroll
      for (int u = 0; u < kUnits; ++u)
        if (u < used_units) cp_async16(slot(stage, u), source(u, i));
    }
    cp_async_commit();  // empty past the end: the group count stays one a pass
  };
  const int32_t first = head + static_cast<int32_t>(threadIdx.x) * 8;
  if constexpr (kStaged) stage_in(first, 0);
  int stage = 0;
  for (int32_t i = first; i < tail; i += kBlock * 8, stage ^= 1) {
    uint4 unit[kUnits];
    if constexpr (kStaged) {
      stage_in(i + kBlock * 8, stage ^ 1);
      cp_async_wait<1>();  // this pass's group is in
#pragma unroll
      for (int u = 0; u < kUnits; ++u)
        if (u < used_units) unit[u] = *slot(stage, u);
    } else {
#pragma unroll
      for (int u = 0; u < kUnits; ++u)
        if (u < used_units) unit[u] = __ldcs(source(u, i));
    }
    const int64_t at = begin + i, at_state = state + i;
    float g[8];
    if (seg.bf16_grad) {
      uint16_t g16[8];
      unpack8(unit[kGradUnit], g16);
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] = am::bf16_bits_to_float(g16[j]);
    } else {
      Moments<false>::unpack(unit + kGradUnit, g);
    }
    uint16_t h[8], l[8];
    unpack8(unit[0], h);
    unpack8(unit[1], l);
    float mm[8], vv[8];
    M::unpack(unit + 2, mm);
    M::unpack(unit + 2 + M::kUnits, vv);
    float p[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = am::join_master(h[j], static_cast<int16_t>(l[j]));
    adamw_update8(p, g, mm, vv, s, decay, kBf16);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const am::MasterSplit out = am::split_master(p[j]);
      h[j] = out.hi;
      l[j] = static_cast<uint16_t>(out.lo);
    }
    M::store8(m, at_state, mm);
    M::store8(v, at_state, vv);
    __stcs(reinterpret_cast<uint4*>(hi + at), pack8(h));
    __stcs(reinterpret_cast<uint4*>(lo + at_state), pack8(l));
    if (mirror_vectors) {
      float4* out = reinterpret_cast<float4*>(mirror_out + i);
      out[0] = make_float4(p[0], p[1], p[2], p[3]);
      out[1] = make_float4(p[4], p[5], p[6], p[7]);
    } else if (mirror_out) {
#pragma unroll
      for (int j = 0; j < 8; ++j) mirror_out[i + j] = p[j];
    }
  }
  if constexpr (kStaged) cp_async_wait<0>();
}

// fp8 moments (optimizer.state_dtype = fp8). A segment's state starts on a block of
// am::kMomentBlock = 16 (GpuOptimizer checks), and so does each chunk's: a thread updates 8 elements a pass as the bf16 kernel does, two adjacent
// lanes one block (its amax through one shuffle), and stages its next pass in shared
// memory (cp.async: hi, lo, the gradients, and m's and v's 8 codes together in one 16-byte
// slot); the two scale bytes of the next pass are loaded into registers early. The update
// computes in fp32 (adamw_update8), as adamw_update_range does, from v = the stored sqrt(v)
// squared; the new m is rounded to nearest, sqrt(v) stochastically (am::moment_random of
// the element's block offset and the step: one hash a lane); the lane(s) at a segment's ragged end load and
// store their few elements one by one.
constexpr int kFp8Threads = 512;
constexpr int kFp8Units = 5;  // hi, lo, m|v codes, the gradients (fp32: 2)
constexpr size_t kFp8StagedBytes = size_t{2} * kFp8Units * kFp8Threads * sizeof(uint4);

__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(to), "l"(gmem) : "memory");
}

// One block's codes for the values in `x` (8 a lane, the pair's 16 together): the block's
// scale byte (both lanes) and the lane's 8 codes packed in a uint2: m's to nearest
// (am::m_code), sqrt(v)'s stochastically with the lane's random bits (am::root_code,
// am::moment_random's bits for element j: lane_random x multiplier j).
__device__ __forceinline__ uint2 quantize_pair_block(const float (&x)[8], bool root, uint32_t lane_random,
                                                     uint8_t& scale) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(x[j]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // every lane of the warp is here
  scale = am::moment_scale_byte(amax);
  uint32_t w[2] = {0, 0};
  if (root) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      w[j / 4] |= static_cast<uint32_t>(am::root_code(x[j], scale, lane_random * am::moment_random_multiplier(j)))
                  << (8 * (j % 4));
  } else {  // am::m_code with the converts in pairs (cvt.rn.satfinite.e4m3x2.f32: each value
            // rounded on its own, the first in the low byte): half the converts, no byte packing
    const float inverse = am::moment_inverse_scale(scale);
#pragma unroll
    for (int j = 0; j < 8; j += 2)
      w[j / 4] |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(
                      make_float2(am::mul(x[j], inverse), am::mul(x[j + 1], inverse)), __NV_SATFINITE, __NV_E4M3))
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
  const ChunkOfBlock chunk = chunk_of_block(segments, n_segments, scalars, mirror);
  const am::AdamWScalars& s = chunk.s;
  if (s.skip) return;
  const OptimizerSegment& seg = chunk.seg;
  const int64_t begin = chunk.begin, state = chunk.state;
  const int32_t length = chunk.length;
  const float decay = chunk.decay;
  float* mirror_out = chunk.mirror_out;
  const int32_t blocks_end = (length + kB - 1) / kB * kB;
  const bool half = seg.bf16_grad != 0;

  extern __shared__ uint4 staged[];  // [2 stages][kFp8Units][kFp8Threads]
  const auto slot = [&](int stage, int unit) { return staged + (stage * kFp8Units + unit) * kFp8Threads + threadIdx.x; };
  const auto stage_in = [&](int32_t i, int stage) {
    if (i + 8 <= length) {  // a whole 8 (the ragged end's lane loads its few directly)
      const int64_t at = begin + i, st = state + i;
      cp_async16(slot(stage, 0), hi + at);
      cp_async16(slot(stage, 1), lo + st);
      cp_async8(slot(stage, 2), m + st);
      cp_async8(reinterpret_cast<char*>(slot(stage, 2)) + 8, v + st);
      if (half) {
        cp_async16(slot(stage, 3), grads16 + at);
      } else {
        cp_async16(slot(stage, 3), grads + at);
        cp_async16(slot(stage, 4), grads + at + 4);
      }
    }
    cp_async_commit();  // empty otherwise: the group count stays one a pass
  };
  // Every thread runs every pass (the pair's shuffle wants the whole warp); a lane with no
  // element left computes zeros (outside its block's amax) and stores nothing.
  const int32_t first = static_cast<int32_t>(threadIdx.x) * 8;
  stage_in(first, 0);
  uint8_t xm = 0, xv = 0;  // this pass's scale bytes
  if (first < length) xm = m_scales[(state + first) / kB], xv = v_scales[(state + first) / kB];
  int stage = 0;
  for (int32_t base = 0; base < blocks_end; base += kFp8Threads * 8, stage ^= 1) {
    const int32_t i = base + first, next = i + kFp8Threads * 8;
    const int n = length - i < 0 ? 0 : length - i < 8 ? length - i : 8;  // this lane's elements
    stage_in(next, stage ^ 1);
    const uint8_t this_xm = xm, this_xv = xv;
    if (next < length) xm = m_scales[(state + next) / kB], xv = v_scales[(state + next) / kB];
    cp_async_wait<1>();  // this pass's group is in
    const int64_t at = begin + i, st = state + i;
    float p[8], g[8], mm[8], vv[8];
    if (n == 8) {
      uint16_t h[8], l[8];
      unpack8(*slot(stage, 0), h);
      unpack8(*slot(stage, 1), l);
#pragma unroll
      for (int j = 0; j < 8; ++j) p[j] = am::join_master(h[j], static_cast<int16_t>(l[j]));
      const uint4 codes = *slot(stage, 2);
      decode8(make_uint2(codes.x, codes.y), this_xm, mm);
      decode8(make_uint2(codes.z, codes.w), this_xv, vv);  // sqrt(v): squared below
      if (half) {
        uint16_t g16[8];
        unpack8(*slot(stage, 3), g16);
#pragma unroll
        for (int j = 0; j < 8; ++j) g[j] = am::bf16_bits_to_float(g16[j]);
      } else {
        const uint4 pair[2] = {*slot(stage, 3), *slot(stage, 4)};
        Moments<false>::unpack(pair, g);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool in = j < n;
        p[j] = in ? am::join_master(hi[at + j], lo[st + j]) : 0.0f;
        g[j] = !in ? 0.0f : half ? am::bf16_bits_to_float(grads16[at + j]) : grads[at + j];
        mm[j] = in ? am::moment_value(m[st + j], this_xm) : 0.0f;
        vv[j] = in ? am::moment_value(v[st + j], this_xv) : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) vv[j] = am::mul(vv[j], vv[j]);
    adamw_moments8(g, mm, vv, s, false);
    float root[8];
    sqrt_rn_n(root, vv);
    adamw_parameters8(p, mm, root, s, decay);
    uint8_t ym, yv;
    const uint32_t lane_random = am::moment_random_lane(at, s.step);  // at: a multiple of 8
    const uint2 cm = quantize_pair_block(mm, false, 0, ym), cv = quantize_pair_block(root, true, lane_random, yv);
    if (n == 0) continue;
    if ((threadIdx.x & 1) == 0) {
      m_scales[st / kB] = ym;
      v_scales[st / kB] = yv;
    }
    uint16_t h[8], l[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const am::MasterSplit out = am::split_master(p[j]);
      h[j] = out.hi;
      l[j] = static_cast<uint16_t>(out.lo);
    }
    if (n == 8) {
      __stcs(reinterpret_cast<uint2*>(m + st), cm);
      __stcs(reinterpret_cast<uint2*>(v + st), cv);
      __stcs(reinterpret_cast<uint4*>(hi + at), pack8(h));
      __stcs(reinterpret_cast<uint4*>(lo + st), pack8(l));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < n) {
          hi[at + j] = h[j];
          lo[st + j] = static_cast<int16_t>(l[j]);
          m[st + j] = static_cast<uint8_t>((j < 4 ? cm.x : cm.y) >> (8 * (j % 4)));
          v[st + j] = static_cast<uint8_t>((j < 4 ? cv.x : cv.y) >> (8 * (j % 4)));
        }
    }
    if (mirror_out)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < n) mirror_out[i + j] = p[j];
  }
  cp_async_wait<0>();
}

// Staged blocks of 512 threads (2 an SM): 23.5 ms a mixtral-mini fp8 step against 24.4 with
// 256 (4 an SM), 25.7 with 128 and 24.0 with 128 threads in 3 stages (ncu, 2026-12-04).
constexpr int kStagedThreads = 512;
constexpr size_t kStagedBytes = size_t{2} * (2 + 2 * Moments<true>::kUnits + 2) * kStagedThreads * sizeof(uint4);

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

void grad_norm(adamw_math::AdamWScalars* scalars, double* chunk_sq_C, double* segment_sq_S, const float* grads,
               const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks, double max_norm,
               Stream stream, const bf16* grads16) {
  MOE_CHECKF(n_segments > 0, "grad_norm: no segments");
  if (n_chunks > 0) {
    const int64_t per_block = kNormWarps;  // a warp per chunk
    chunk_sum_of_squares_kernel<<<static_cast<unsigned>(ceil_div(n_chunks, per_block)), kNormWarps * 32, 0,
                                  stream>>>(chunk_sq_C, grads, bits(grads16), segments, n_segments, n_chunks);
    MOE_CUDA_CHECK_LAUNCH();
  }
  norm_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(scalars, segment_sq_S, chunk_sq_C, segments, n_segments,
                                                          max_norm);
  MOE_CUDA_CHECK_LAUNCH();
}

void multi_tensor_adamw(bf16* hi, int16_t* lo, float* mirror, const float* grads, const MomentState& moments,
                        const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks,
                        const adamw_math::AdamWScalars* scalars, Stream stream, const bf16* grads16) {
  if (n_chunks == 0) return;
  MOE_CHECKF(n_chunks < (int64_t{1} << 31), "multi_tensor_adamw: %lld chunks", static_cast<long long>(n_chunks));
  // One block per chunk: a 4.76 B-parameter model has ~290 k of them, many waves of
  // blocks on any GPU. Element e of every array is then 16-byte aligned when e % 8 == 0.
  const auto blocks = static_cast<unsigned>(n_chunks);
  void* m = moments.m;
  void* v = moments.v;
  if (moments.dtype == MomentDtype::Fp8) {
    MOE_CHECKF(aligned16(hi) && aligned16(lo) && aligned16(grads) && aligned16(grads16) && aligned16(m) &&
                   aligned16(v) && moments.m_scales && moments.v_scales,
               "multi_tensor_adamw: fp8 moments need 16-byte aligned blocks and their scales");
    MOE_CUDA_CHECK(cudaFuncSetAttribute(multi_tensor_adamw_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kFp8StagedBytes)));
    multi_tensor_adamw_fp8_kernel<<<blocks, kFp8Threads, kFp8StagedBytes, stream>>>(
        bits(hi), lo, mirror, grads, bits(grads16), static_cast<uint8_t*>(m), static_cast<uint8_t*>(v),
        moments.m_scales, moments.v_scales, segments, n_segments, scalars);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  const bool bf16_moments = moments.dtype == MomentDtype::Bf16;
  const bool vectors =
      aligned16(hi) && aligned16(lo) && aligned16(grads) && aligned16(grads16) && aligned16(m) && aligned16(v);
  if (bf16_moments) {
    // 96 KB of staging a block: past the 48 KB default. Per call: the attribute is the
    // current device's (thread ranks drive several).
    MOE_CUDA_CHECK(cudaFuncSetAttribute(multi_tensor_adamw_kernel<true, kStagedThreads>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kStagedBytes)));
    multi_tensor_adamw_kernel<true, kStagedThreads><<<blocks, kStagedThreads, kStagedBytes, stream>>>(
        bits(hi), lo, mirror, grads, bits(grads16), m, v, segments, n_segments, scalars, vectors);
  } else {
    multi_tensor_adamw_kernel<false, kThreads><<<blocks, kThreads, 0, stream>>>(
        bits(hi), lo, mirror, grads, bits(grads16), m, v, segments, n_segments, scalars, vectors);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
