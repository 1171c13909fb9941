// The multi-tensor optimizer on the GPU: the global gradient norm summed in the CPU's
// order (so clipping decides and scales exactly as on the CPU) and AdamW over every
// parameter in one launch. The per-element arithmetic is kernels/adamw_math.h's, the code
// the CPU AdamW runs.
// The fp8-moment kernel is multi_tensor_adamw_fp8.cu; the pieces both use,
// multi_tensor_adamw_parts.cuh.
#include <algorithm>
#include <cstdint>

#include "optim/cuda/multi_tensor_adamw_parts.cuh"

namespace moe::cuda {
namespace {

using namespace adamw_kernels;

constexpr int kThreads = 256;
constexpr int kNormWarps = 8;  // warps per block of the chunk sums, one chunk each

__device__ __forceinline__ int64_t chunk_count(int64_t numel) { return (numel + am::kNormChunk - 1) / am::kNormChunk; }

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

// Per segment its chunks in order, a warp a segment spread over the GPU (kSegmentWarps a
// block): the lanes load 128 of its chunk sums at a time (coalesced, independent loads) and
// every lane adds them in order from shuffles, so a segment of thousands of chunks (an
// embedding, an MoE layer's experts) waits on a load latency per 128 chunks, not per
// chunk. One block of 32 warps took 0.46-0.52 ms a mixtral-mini step (ncu, H100): the
// additions' chains of every segment queued on one SM while the rest of the GPU idled.
constexpr int kSegmentWarps = 4;
__global__ void __launch_bounds__(kSegmentWarps * 32)
    segment_sums_kernel(double* segment_sq, const double* chunk_sq, const OptimizerSegment* segments,
                        int64_t n_segments) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kSegmentWarps + (threadIdx.x >> 5);
  if (s >= n_segments) return;  // the whole warp
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

// One thread: the segments in order, the norm and the clip factor, computed as
// optim/grad_clip.cpp does in fp64.
__global__ void norm_finalize_kernel(am::AdamWScalars* scalars, const double* segment_sq, int64_t n_segments,
                                     double max_norm) {
  double sq = 0.0;
  for (int64_t s = 0; s < n_segments; ++s) sq = __dadd_rn(sq, segment_sq[s]);
  const double norm = __dsqrt_rn(sq);
  scalars->sum_sq = sq;
  scalars->norm = norm;
  scalars->grad_scale =
      max_norm > 0 && norm > max_norm ? static_cast<float>(__ddiv_rn(max_norm, __dadd_rn(norm, 1e-6))) : 1.0f;
  scalars->skip = isfinite(norm) ? 0 : 1;
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
  __device__ static void unpack(const uint4* unit, float out[8]) { unpack_floats8(unit, out); }
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

// am::adamw_update on 8 elements, bit for bit (the three steps: multi_tensor_adamw_parts.cuh).
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
  const auto [s, seg, begin, state, hi_begin, length, decay, mirror_out] =
      chunk_of_block(segments, n_segments, scalars, mirror);
  if (s.skip) return;
  using M = Moments<kBf16>;
  constexpr int kMomentBytes = kBf16 ? 2 : 4;
  // The chunk's arrays from its first element, indexed by 32-bit offsets (a chunk is 2^14):
  // opaque() keeps the compiler from folding the chunk's 64-bit offsets back into every
  // access (as in the fp8 kernel).
  uint16_t* const hi_c = opaque(hi + hi_begin);  // the hi halves (interleaved gate|up: elsewhere)
  int16_t* const lo_c = opaque(lo + state);
  void* const m_c = opaque(static_cast<char*>(m) + state * kMomentBytes);
  void* const v_c = opaque(static_cast<char*>(v) + state * kMomentBytes);
  const float* const g_c = opaque(grads + begin);
  const uint16_t* const g16_c = opaque(grads16 + begin);

  const int32_t to_boundary = static_cast<int32_t>((8 - (begin & 7)) & 7);
  const int32_t head = vectors && to_boundary < length ? to_boundary : length;
  const int32_t tail = head + (length - head) / 8 * 8;  // [head, tail): whole vectors of 8
  const int32_t n_single = head + (length - tail);
  for (int32_t t = static_cast<int32_t>(threadIdx.x); t < n_single; t += kBlock) {
    const int32_t k = t < head ? t : tail + (t - head);
    float mk = M::load(m_c, k), vk = M::load(v_c, k);
    const float gk = seg.bf16_grad ? am::bf16_bits_to_float(g16_c[k]) : g_c[k];
    const float p = am::adamw_update(am::join_master(hi_c[k], lo_c[k]), gk, mk, vk, s, decay, kBf16, kBf16);
    const am::MasterSplit split = am::split_master(p);
    hi_c[k] = split.hi;
    lo_c[k] = split.lo;
    M::store(m_c, k, mk);
    M::store(v_c, k, vk);
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
    if (unit == 0) return reinterpret_cast<const uint4*>(hi_c + i);
    if (unit == 1) return reinterpret_cast<const uint4*>(lo_c + i);
    if (unit < kGradUnit) {
      const void* moments = unit < 2 + M::kUnits ? m_c : v_c;
      return reinterpret_cast<const uint4*>(static_cast<const char*>(moments) + i * kMomentBytes) +
             (unit - 2) % M::kUnits;
    }
    return seg.bf16_grad ? reinterpret_cast<const uint4*>(g16_c + i)
                         : reinterpret_cast<const uint4*>(g_c + i) + (unit - kGradUnit);
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
    uint4 hi8, lo8;
    split_master8(p, hi8, lo8);
    M::store8(m_c, i, mm);
    M::store8(v_c, i, vv);
    __stcs(reinterpret_cast<uint4*>(hi_c + i), hi8);
    __stcs(reinterpret_cast<uint4*>(lo_c + i), lo8);
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

// Staged blocks of 512 threads (2 an SM): 23.5 ms a mixtral-mini fp8 step against 24.4 with
// 256 (4 an SM), 25.7 with 128 and 24.0 with 128 threads in 3 stages (ncu, 2026-12-04).
constexpr int kStagedThreads = 512;
constexpr size_t kStagedBytes = size_t{2} * (2 + 2 * Moments<true>::kUnits + 2) * kStagedThreads * sizeof(uint4);

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
  segment_sums_kernel<<<static_cast<unsigned>(ceil_div(n_segments, int64_t{kSegmentWarps})), kSegmentWarps * 32, 0,
                        stream>>>(segment_sq_S, chunk_sq_C, segments, n_segments);
  MOE_CUDA_CHECK_LAUNCH();
  norm_finalize_kernel<<<1, 1, 0, stream>>>(scalars, segment_sq_S, n_segments, max_norm);
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
    adamw_kernels::multi_tensor_adamw_fp8(bits(hi), lo, mirror, grads, bits(grads16), moments, segments, n_segments,
                                          blocks, scalars, stream);
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
