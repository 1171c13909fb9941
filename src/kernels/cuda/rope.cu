// RoPE on the GPU, rotate_half layout: pairs (i, i + d/2), angle pos * theta^(-2i/d). The
// cos/sin of every (position, i) come from a table made once per plan, so the kernels
// only move bytes; 16-byte vectors of 8 pairs when d/2 allows, pair by pair otherwise.
// Tokens are ld elements apart, so the q and k heads of a fused [T, (H + 2G) d] q|k|v
// projection turn in one launch (N = H + G heads from the row's start).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
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

// One thread per 8 pairs: i .. i + 7 and their partners i + half .. i + half + 7. ld_v:
// the row stride in 16-byte vectors.
__global__ void rope_vec_kernel(uint4* x, const int32_t* positions, const float4* cos_sin, int64_t T, int64_t N,
                                int64_t half_v, int64_t ld_v, float direction) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= T * N * half_v) return;
  const int64_t v = idx % half_v, tn = idx / half_v, t = tn / N, n = tn % N;
  uint4* head = x + t * ld_v + n * 2 * half_v;
  float a[kVecElems], b[kVecElems], c[kVecElems], s[kVecElems];
  unpack8(head[v], a);
  unpack8(head[v + half_v], b);
  // 8 (cos, sin) pairs = 4 float4 of the row's table.
  const float4* table = cos_sin + (static_cast<int64_t>(positions[t]) * half_v + v) * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 q = table[j];
    c[2 * j] = q.x;
    s[2 * j] = q.y * direction;
    c[2 * j + 1] = q.z;
    s[2 * j + 1] = q.w * direction;
  }
  float ya[kVecElems], yb[kVecElems];
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) {
    ya[j] = a[j] * c[j] - b[j] * s[j];
    yb[j] = b[j] * c[j] + a[j] * s[j];
  }
  head[v] = pack8(ya);
  head[v + half_v] = pack8(yb);
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

}  // namespace moe::cuda
