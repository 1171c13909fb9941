// The multi-tensor optimizer on the GPU: the global gradient norm summed in the CPU's
// order (so clipping decides and scales exactly as on the CPU), AdamW over every
// parameter in one launch, and the hi/lo split of the fp32 master weights. The
// per-element arithmetic is kernels/adamw_math.h's, the code the CPU AdamW runs.
#include <algorithm>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

namespace am = adamw_math;

constexpr int kThreads = 256;
constexpr int kNormWarps = 8;  // warps per block of the chunk sums; each warp sums 32 chunks

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), 1 << 20)); }

// The segment holding chunk c: the last one whose first_chunk <= c (an empty segment
// shares its first_chunk with the next one, which then wins).
__device__ __forceinline__ int64_t segment_of_chunk(const OptimizerSegment* segments, int64_t n_segments, int64_t c) {
  int64_t lo = 0, hi = n_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (segments[mid].first_chunk <= c) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int64_t chunk_count(int64_t numel) { return (numel + am::kNormChunk - 1) / am::kNormChunk; }

__global__ void split_kernel(uint16_t* hi, int16_t* lo, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const am::MasterSplit s = am::split_master(x[i]);
    hi[i] = s.hi;
    lo[i] = s.lo;
  }
}

__global__ void join_kernel(float* x, const uint16_t* hi, const int16_t* lo, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = am::join_master(hi[i], lo[i]);
}

__global__ void round_bf16_kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = am::bf16_bits_rne(in[i]);
}

__global__ void widen_bf16_kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = am::bf16_bits_to_float(in[i]);
}

// Each warp sums 32 chunks, lane j chunk first + j, each in element order as the CPU's
// sum_of_squares does. The chunks' elements pass through shared memory 32 at a time so
// the loads stay coalesced: the warp reads 32 consecutive floats of one chunk per load,
// then every lane adds the 32 of its own chunk. Squares of floats are exact in fp64, so
// the only roundings are the additions, in the CPU's order; the zeros past a chunk's end
// add nothing (the sums are +0 or more, or NaN).
__global__ void __launch_bounds__(kNormWarps * 32)
    chunk_sum_of_squares_kernel(double* chunk_sq, const float* grads, const OptimizerSegment* segments,
                                int64_t n_segments, int64_t n_chunks) {
  __shared__ float tile[kNormWarps][32][33];
  __shared__ int64_t start[kNormWarps][32];
  __shared__ int32_t length[kNormWarps][32];
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kNormWarps + warp) * 32;
  if (first >= n_chunks) return;  // the whole warp
  const int64_t chunk = first + lane;
  int64_t chunk_start = 0;
  int32_t chunk_length = 0;
  if (chunk < n_chunks) {
    const OptimizerSegment& seg = segments[segment_of_chunk(segments, n_segments, chunk)];
    const int64_t within = (chunk - seg.first_chunk) * am::kNormChunk;
    chunk_start = seg.offset + within;
    chunk_length = static_cast<int32_t>(seg.numel - within < am::kNormChunk ? seg.numel - within : am::kNormChunk);
  }
  start[warp][lane] = chunk_start;
  length[warp][lane] = chunk_length;
  __syncwarp();
  const int32_t longest = static_cast<int32_t>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(chunk_length)));
  double sum = 0.0;
  for (int32_t base = 0; base < longest; base += 32) {
    const int32_t e = base + lane;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) tile[warp][c][lane] = e < length[warp][c] ? grads[start[warp][c] + e] : 0.0f;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const double x = tile[warp][lane][k];
      sum = __dadd_rn(sum, __dmul_rn(x, x));
    }
    __syncwarp();
  }
  if (chunk < n_chunks) chunk_sq[chunk] = sum;
}

// One block: per segment its chunks in order (one thread per segment), then the segments
// in order, the norm and the clip factor, computed as train/grad_clip.cpp does in fp64.
__global__ void norm_finalize_kernel(am::AdamWScalars* scalars, double* segment_sq, const double* chunk_sq,
                                     const OptimizerSegment* segments, int64_t n_segments, double max_norm) {
  for (int64_t s = threadIdx.x; s < n_segments; s += blockDim.x) {
    const int64_t first = segments[s].first_chunk, count = chunk_count(segments[s].numel);
    double total = 0.0;
    for (int64_t c = 0; c < count; ++c) total = __dadd_rn(total, chunk_sq[first + c]);
    segment_sq[s] = total;
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

// Four moments at once, fp32 or bf16 bits.
template <bool kBf16>
struct Moments;

template <>
struct Moments<false> {
  __device__ static void load4(const void* base, int64_t at, float out[4]) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + at);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
  }
  __device__ static void store4(void* base, int64_t at, const float in[4]) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + at) = make_float4(in[0], in[1], in[2], in[3]);
  }
  __device__ static float load(const void* base, int64_t at) { return static_cast<const float*>(base)[at]; }
  __device__ static void store(void* base, int64_t at, float x) { static_cast<float*>(base)[at] = x; }
};

template <>
struct Moments<true> {
  __device__ static void load4(const void* base, int64_t at, float out[4]) {
    const ushort4 q = *reinterpret_cast<const ushort4*>(static_cast<const uint16_t*>(base) + at);
    out[0] = am::bf16_bits_to_float(q.x), out[1] = am::bf16_bits_to_float(q.y);
    out[2] = am::bf16_bits_to_float(q.z), out[3] = am::bf16_bits_to_float(q.w);
  }
  __device__ static void store4(void* base, int64_t at, const float in[4]) {
    *reinterpret_cast<ushort4*>(static_cast<uint16_t*>(base) + at) =
        make_ushort4(am::bf16_bits_rne(in[0]), am::bf16_bits_rne(in[1]), am::bf16_bits_rne(in[2]),
                     am::bf16_bits_rne(in[3]));
  }
  __device__ static float load(const void* base, int64_t at) {
    return am::bf16_bits_to_float(static_cast<const uint16_t*>(base)[at]);
  }
  __device__ static void store(void* base, int64_t at, float x) {
    static_cast<uint16_t*>(base)[at] = am::bf16_bits_rne(x);
  }
};

// One block per chunk; each thread updates 4 consecutive elements per pass (16-byte
// gradient and fp32-moment loads: segments start on 16-element boundaries).
template <bool kBf16>
__global__ void __launch_bounds__(kThreads)
    multi_tensor_adamw_kernel(uint16_t* hi, int16_t* lo, float* mirror, const float* grads, void* m, void* v,
                              const OptimizerSegment* segments, int64_t n_segments,
                              const am::AdamWScalars* scalars) {
  __shared__ am::AdamWScalars shared_scalars;
  __shared__ OptimizerSegment shared_segment;
  if (threadIdx.x == 0) {
    shared_scalars = *scalars;
    shared_segment = segments[segment_of_chunk(segments, n_segments, blockIdx.x)];
  }
  __syncthreads();
  const am::AdamWScalars s = shared_scalars;
  if (s.skip) return;
  const OptimizerSegment seg = shared_segment;
  const int64_t within = (static_cast<int64_t>(blockIdx.x) - seg.first_chunk) * am::kNormChunk;
  const int64_t begin = seg.offset + within;
  const int32_t length = static_cast<int32_t>(seg.numel - within < am::kNormChunk ? seg.numel - within : am::kNormChunk);
  const float decay = seg.decay ? s.decay_factor : 1.0f;
  float* mirror_out = seg.mirror_offset >= 0 ? mirror + seg.mirror_offset + within : nullptr;
  using M = Moments<kBf16>;
  for (int32_t i = static_cast<int32_t>(threadIdx.x) * 4; i < length; i += kThreads * 4) {
    const int64_t at = begin + i;
    if (i + 4 <= length) {
      const float4 g4 = *reinterpret_cast<const float4*>(grads + at);
      const ushort4 h4 = *reinterpret_cast<const ushort4*>(hi + at);
      const short4 l4 = *reinterpret_cast<const short4*>(lo + at);
      const float g[4] = {g4.x, g4.y, g4.z, g4.w};
      float p[4] = {am::join_master(h4.x, l4.x), am::join_master(h4.y, l4.y), am::join_master(h4.z, l4.z),
                    am::join_master(h4.w, l4.w)};
      float mm[4], vv[4];
      M::load4(m, at, mm);
      M::load4(v, at, vv);
      am::MasterSplit out[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        p[j] = am::adamw_update(p[j], g[j], mm[j], vv[j], s, decay, kBf16);
        out[j] = am::split_master(p[j]);
      }
      M::store4(m, at, mm);
      M::store4(v, at, vv);
      *reinterpret_cast<ushort4*>(hi + at) = make_ushort4(out[0].hi, out[1].hi, out[2].hi, out[3].hi);
      *reinterpret_cast<short4*>(lo + at) = make_short4(out[0].lo, out[1].lo, out[2].lo, out[3].lo);
      if (mirror_out)
        for (int j = 0; j < 4; ++j) mirror_out[i + j] = p[j];
    } else {
      for (int32_t k = i; k < length; ++k) {
        const int64_t e = begin + k;
        float mk = M::load(m, e), vk = M::load(v, e);
        const float p = am::adamw_update(am::join_master(hi[e], lo[e]), grads[e], mk, vk, s, decay, kBf16);
        const am::MasterSplit split = am::split_master(p);
        hi[e] = split.hi;
        lo[e] = split.lo;
        M::store(m, e, mk);
        M::store(v, e, vk);
        if (mirror_out) mirror_out[k] = p;
      }
    }
  }
}

uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }
const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }

}  // namespace

void split_master(bf16* hi, int16_t* lo, const float* x, int64_t n, Stream stream) {
  if (n == 0) return;
  split_kernel<<<grid_for(n), kThreads, 0, stream>>>(bits(hi), lo, x, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void join_master(float* x, const bf16* hi, const int16_t* lo, int64_t n, Stream stream) {
  if (n == 0) return;
  join_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, bits(hi), lo, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void round_to_bf16(bf16* out, const float* in, int64_t n, Stream stream) {
  if (n == 0) return;
  round_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(bits(out), in, n);
  MOE_CUDA_CHECK_LAUNCH();
}

void widen_bf16(float* out, const bf16* in, int64_t n, Stream stream) {
  if (n == 0) return;
  widen_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, bits(in), n);
  MOE_CUDA_CHECK_LAUNCH();
}

void grad_norm(adamw_math::AdamWScalars* scalars, double* chunk_sq_C, double* segment_sq_S, const float* grads,
               const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks, double max_norm,
               Stream stream) {
  MOE_CHECKF(n_segments > 0, "grad_norm: no segments");
  if (n_chunks > 0) {
    const int64_t per_block = int64_t{kNormWarps} * 32;
    chunk_sum_of_squares_kernel<<<static_cast<unsigned>(ceil_div(n_chunks, per_block)), kNormWarps * 32, 0,
                                  stream>>>(chunk_sq_C, grads, segments, n_segments, n_chunks);
    MOE_CUDA_CHECK_LAUNCH();
  }
  norm_finalize_kernel<<<1, kThreads, 0, stream>>>(scalars, segment_sq_S, chunk_sq_C, segments, n_segments, max_norm);
  MOE_CUDA_CHECK_LAUNCH();
}

void multi_tensor_adamw(bf16* hi, int16_t* lo, float* mirror, const float* grads, void* m, void* v, bool bf16_moments,
                        const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks,
                        const adamw_math::AdamWScalars* scalars, Stream stream) {
  if (n_chunks == 0) return;
  MOE_CHECKF(n_chunks < (int64_t{1} << 31), "multi_tensor_adamw: %lld chunks", static_cast<long long>(n_chunks));
  const auto blocks = static_cast<unsigned>(n_chunks);
  if (bf16_moments)
    multi_tensor_adamw_kernel<true>
        <<<blocks, kThreads, 0, stream>>>(bits(hi), lo, mirror, grads, m, v, segments, n_segments, scalars);
  else
    multi_tensor_adamw_kernel<false>
        <<<blocks, kThreads, 0, stream>>>(bits(hi), lo, mirror, grads, m, v, segments, n_segments, scalars);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
