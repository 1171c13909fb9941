// RoPE on the GPU, rotate_half layout: pairs (i, i + d/2), angle pos * theta^(-2i/d). The
// cos/sin of every (position, i) come from a table made once per plan, so the kernels
// only move bytes; 16-byte vectors of 8 pairs when d/2 allows, pair by pair otherwise.
// Tokens are ld elements apart, so the q and k heads of a fused [T, (H + 2G) d] q|k|v
// projection turn in one launch (N = H + G heads from the row's start).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_row_tiles.cuh"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rope_table_kernel(float2* cos_sin, int64_t S, int64_t half, int64_t d, float log2_theta) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= S * half) return;
  const int64_t pos = idx / half, i = idx % half;
  const float inv_freq = exp2f(-2.0f * static_cast<float>(i) / static_cast<float>(d) * log2_theta);
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  cos_sin[idx] = make_float2(c, s);
}

// direction +1 rotates (forward), -1 rotates back (the transpose, for the backward).
__global__ void rope_kernel(__nv_bfloat16* x, const int32_t* positions, const float2* cos_sin, int64_t T, int64_t N,
                            int64_t d, int64_t ld, float direction) {
  const int64_t half = d / 2;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * N * half) return;
  const int64_t i = idx % half, tn = idx / half, t = tn / N, n = tn % N;
  const float2 cs = cos_sin[positions[t] * half + i];
  const float c = cs.x, s = cs.y * direction;
  __nv_bfloat16* head = x + t * ld + n * d;
  const float a = to_float(head[i]), b = to_float(head[i + half]);
  head[i] = to_bf16(a * c - b * s);
  head[i + half] = to_bf16(b * c + a * s);
}

// Pairs v * 8 .. v * 8 + 7 of a head (a: the first half's, b: their partners) rotated by
// the angles of position pos (half_v vectors a half head; direction -1 rotates back).
__device__ __forceinline__ void rotate8(float (&ya)[kVecElems], float (&yb)[kVecElems], const float (&a)[kVecElems],
                                        const float (&b)[kVecElems], const float4* cos_sin, int64_t pos,
                                        int64_t half_v, int64_t v, float direction) {
  float c[kVecElems], s[kVecElems];
  // 8 (cos, sin) pairs = 4 float4 of the row's table.
  const float4* table = cos_sin + (pos * half_v + v) * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 q = table[j];
    c[2 * j] = q.x;
    s[2 * j] = q.y * direction;
    c[2 * j + 1] = q.z;
    s[2 * j + 1] = q.w * direction;
  }
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) {
    ya[j] = a[j] * c[j] - b[j] * s[j];
    yb[j] = b[j] * c[j] + a[j] * s[j];
  }
}

// One thread per 8 pairs: i .. i + 7 and their partners i + half .. i + half + 7. ld_v:
// the row stride in 16-byte vectors.
__global__ void rope_vec_kernel(uint4* x, const int32_t* positions, const float4* cos_sin, int64_t T, int64_t N,
                                int64_t half_v, int64_t ld_v, float direction) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * N * half_v) return;
  const int64_t v = idx % half_v, tn = idx / half_v, t = tn / N, n = tn % N;
  uint4* head = x + t * ld_v + n * 2 * half_v;
  float a[kVecElems], b[kVecElems], ya[kVecElems], yb[kVecElems];
  unpack8(head[v], a);
  unpack8(head[v + half_v], b);
  rotate8(ya, yb, a, b, cos_sin, positions[t], half_v, v, direction);
  head[v] = pack8(ya);
  head[v + half_v] = pack8(yb);
}

// rope_backward_fp8, heads of d = 128: one thread per 8 pairs as above over all N_all
// heads of a row, so a head's 8 threads (adjacent lanes) hold its 1 x 128 tile, 16 values
// each, and its amax meets by shuffles; heads past N_rope are only read.
constexpr int64_t kHeadVecs = 128 / 2 / kVecElems;
__global__ void rope_backward_codes_kernel(uint4* x, RowCodes codes, const int32_t* positions, const float4* cos_sin,
                                           int64_t T, int64_t N_rope, int64_t N_all) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * N_all * kHeadVecs) return;  // whole heads: their lanes leave together
  const int64_t v = idx % kHeadVecs, tn = idx / kHeadVecs, t = tn / N_all, n = tn % N_all;
  uint4* head = x + tn * 2 * kHeadVecs;
  float a[kVecElems], b[kVecElems];
  unpack8(head[v], a);
  unpack8(head[v + kHeadVecs], b);
  if (n < N_rope) {
    float ya[kVecElems], yb[kVecElems];
    rotate8(ya, yb, a, b, cos_sin, positions[t], kHeadVecs, v, -1.0f);
    const uint4 pa = pack8(ya), pb = pack8(yb);
    head[v] = pa;
    head[v + kHeadVecs] = pb;
    unpack8(pa, a);  // the bf16 values stored are what gets quantised
    unpack8(pb, b);
  }
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) amax = fmaxf(amax, fmaxf(fabsf(a[j]), fabsf(b[j])));
  const float scale = tile_scale<kHeadVecs>(amax), inverse = fp8::block_scale_inverse(scale);
  uint8_t* out = codes.codes_RK + tn * 128 + v * kVecElems;
  *reinterpret_cast<uint2*>(out) = codes_of_8(a, inverse);
  *reinterpret_cast<uint2*>(out + 64) = codes_of_8(b, inverse);
  if (v == 0) write_tile_scale(codes.scales, scale, nullptr, 1, T, t, n, N_all);
}

void launch(bf16* x, const int32_t* positions, const float* cos_sin, int64_t T, int64_t N, int64_t d, int64_t ld,
            float direction, Stream stream) {
  MOE_CHECKF(d % 2 == 0, "rope: head dim %lld must be even", static_cast<long long>(d));
  if (ld == 0) ld = N * d;
  MOE_CHECKF(ld >= N * d, "rope: row stride %lld below the %lld elements of a token's heads",
             static_cast<long long>(ld), static_cast<long long>(N * d));
  const int64_t half = d / 2;
  if (T * N * half == 0) return;
  if (vectorizable(half, {x}) && ld % kVecElems == 0) {
    const int64_t work = T * N * half / kVecElems;
    rope_vec_kernel<<<static_cast<unsigned>(ceil_div(work, kThreads)), kThreads, 0, stream>>>(
        reinterpret_cast<uint4*>(x), positions, reinterpret_cast<const float4*>(cos_sin), T, N, half / kVecElems,
        ld / kVecElems, direction);
  } else {
    rope_kernel<<<static_cast<unsigned>(ceil_div(T * N * half, kThreads)), kThreads, 0, stream>>>(
        as_cuda(x), positions, reinterpret_cast<const float2*>(cos_sin), T, N, d, ld, direction);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_table(float* cos_sin_Sh2, int64_t S, int64_t d, float theta, Stream stream) {
  MOE_CHECKF(d % 2 == 0, "rope: head dim %lld must be even", static_cast<long long>(d));
  const int64_t work = S * (d / 2);
  if (work == 0) return;
  rope_table_kernel<<<static_cast<unsigned>(ceil_div(work, kThreads)), kThreads, 0, stream>>>(
      reinterpret_cast<float2*>(cos_sin_Sh2), S, d / 2, d, log2f(theta));
  MOE_CUDA_CHECK_LAUNCH();
}

void rope_forward(bf16* x_TNd, const int32_t* positions_T, const float* cos_sin_Sh2, int64_t T, int64_t N, int64_t d,
                  Stream stream, int64_t ld) {
  launch(x_TNd, positions_T, cos_sin_Sh2, T, N, d, ld, 1.0f, stream);
}

void rope_backward(bf16* dx_TNd, const int32_t* positions_T, const float* cos_sin_Sh2, int64_t T, int64_t N,
                   int64_t d, Stream stream, int64_t ld) {
  launch(dx_TNd, positions_T, cos_sin_Sh2, T, N, d, ld, -1.0f, stream);
}

void rope_backward_fp8(bf16* dx_TNd, const RowCodes& codes, const int32_t* positions_T, const float* cos_sin_Sh2,
                       int64_t T, int64_t N_rope, int64_t N_all, int64_t d, Stream stream) {
  MOE_CHECKF(N_rope <= N_all && codes.offsets_E1 == nullptr && codes.R == T,
             "rope backward with fp8 codes: %lld of %lld heads, codes of one group of the %lld rows",
             static_cast<long long>(N_rope), static_cast<long long>(N_all), static_cast<long long>(T));
  if (d != 2 * kHeadVecs * kVecElems || reinterpret_cast<uintptr_t>(dx_TNd) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(codes.codes_RK) % 8 != 0) {  // the two kernels: the same bits
    rope_backward(dx_TNd, positions_T, cos_sin_Sh2, T, N_rope, d, stream, N_all * d);
    quantize_rows_blockwise(codes.codes_RK, codes.scales, dx_TNd, N_all * d, nullptr, 1, T, N_all * d, stream);
    return;
  }
  const int64_t work = T * N_all * kHeadVecs;
  if (work == 0) return;
  rope_backward_codes_kernel<<<static_cast<unsigned>(ceil_div(work, kThreads)), kThreads, 0, stream>>>(
      reinterpret_cast<uint4*>(dx_TNd), codes, positions_T, reinterpret_cast<const float4*>(cos_sin_Sh2), T, N_rope,
      N_all);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
