// The GPU decoder's fp32 kernels (decode_kernels.h).
#include <cmath>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "model/cuda/decode_kernels.h"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t count, int threads = kThreads) {
  return static_cast<unsigned>((count + threads - 1) / threads);
}

__global__ void embedding_kernel(float* out, const int32_t* ids, const float* table, int64_t n, int64_t D) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * D) return;
  out[i] = table[static_cast<int64_t>(ids[i / D]) * D + i % D];
}

__global__ void rmsnorm_kernel(float* out, const float* x, const float* w, int64_t D, float eps) {
  const float* row = x + blockIdx.x * D;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) sum_sq += row[i] * row[i];
  const float rstd = rsqrtf(block_sum(sum_sq) / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) out[blockIdx.x * D + i] = row[i] * rstd * w[i];
}

// One warp per output element (token t, output o).
__global__ void linear_kernel(float* y, const float* x, const float* w, const float* b, int64_t n, int64_t I,
                              int64_t O, bool accumulate) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= n * O) return;
  const int64_t t = warp / O, o = warp % O;
  const float* xr = x + t * I;
  const float* wr = w + o * I;
  float sum = 0.0f;
  for (int64_t i = lane; i < I; i += 32) sum += xr[i] * wr[i];
  sum = warp_sum(sum);
  if (lane == 0) {
    if (b) sum += b[o];
    y[t * O + o] = accumulate ? y[t * O + o] + sum : sum;
  }
}

__global__ void rope_kernel(float* x, int64_t n, int64_t N, int64_t d, int64_t start, double theta) {
  const int64_t half = d / 2;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * N * half) return;
  const int64_t t = i / (N * half), head = (i / half) % N, k = i % half;
  // The angle in double, as the CPU computes it, then rounded to fp32 cos / sin.
  const double angle = static_cast<double>(start + t) * pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(d));
  const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
  float* v = x + (t * N + head) * d;
  const float a = v[k], bb = v[k + half];
  v[k] = a * c - bb * s;
  v[k + half] = bb * c + a * s;
}

// One block per (token, head): scores over the visible keys in shared memory, softmax, V.
__global__ void attention_kernel(float* out, const float* q, const float* k, const float* v, int64_t start,
                                 int64_t H, int64_t G, int64_t d, float scale) {
  extern __shared__ float p[];
  const int64_t t = blockIdx.x / H, h = blockIdx.x % H, g = h / (H / G);
  const int64_t L = start + t + 1;  // keys 0..start + t
  const float* qr = q + (t * H + h) * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t j = warp; j < L; j += warps) {
    const float* kr = k + (j * G + g) * d;
    float s = 0.0f;
    for (int64_t i = lane; i < d; i += 32) s += qr[i] * kr[i];
    s = warp_sum(s);
    if (lane == 0) p[j] = s * scale;
  }
  __syncthreads();
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, p[j]);
  m = block_max(m);
  float z = 0.0f;
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x) z += expf(p[j] - m);
  z = block_sum(z);
  __syncthreads();
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x) p[j] = expf(p[j] - m) / z;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < L; ++j) acc += p[j] * v[(j * G + g) * d + i];
    out[(t * H + h) * d + i] = acc;
  }
}

__global__ void silu_mul_kernel(float* act, const float* gate, const float* up, int64_t count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  const float g = gate[i];
  act[i] = g / (1.0f + expf(-g)) * up[i];
}

__global__ void add_kernel(float* y, const float* x, int64_t count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) y[i] += x[i];
}

__global__ void gather_kernel(float* x_m, const float* x_n, const int32_t* rows, int64_t m, int64_t D) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= m * D) return;
  x_m[i] = x_n[static_cast<int64_t>(rows[i / D]) * D + i % D];
}

// One expert's rows in order, so a token gets at most one add from this launch.
__global__ void scatter_add_kernel(float* y_n, const float* ye_m, const int32_t* rows, const float* weight, int64_t m,
                                   int64_t D) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= m * D) return;
  y_n[static_cast<int64_t>(rows[i / D]) * D + i % D] += weight[i / D] * ye_m[i];
}

}  // namespace

void decode_embedding(float* out_nD, const int32_t* ids_n, const float* table_VD, int64_t n, int64_t D, Stream stream) {
  embedding_kernel<<<blocks_for(n * D), kThreads, 0, stream>>>(out_nD, ids_n, table_VD, n, D);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_rmsnorm(float* out_nD, const float* x_nD, const float* w_D, int64_t n, int64_t D, float eps, Stream stream) {
  rmsnorm_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(out_nD, x_nD, w_D, D, eps);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_linear(float* y_nO, const float* x_nI, const float* w_OI, const float* b_O, int64_t n, int64_t I,
                   int64_t O, bool accumulate, Stream stream) {
  linear_kernel<<<blocks_for(n * O * 32), kThreads, 0, stream>>>(y_nO, x_nI, w_OI, b_O, n, I, O, accumulate);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_rope(float* x_nNd, int64_t n, int64_t N, int64_t d, int64_t start, double theta, Stream stream) {
  rope_kernel<<<blocks_for(n * N * (d / 2)), kThreads, 0, stream>>>(x_nNd, n, N, d, start, theta);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_attention(float* out_nHd, const float* q_nHd, const float* k_LGd, const float* v_LGd, int64_t n,
                      int64_t start, int64_t H, int64_t G, int64_t d, Stream stream) {
  const size_t shared = static_cast<size_t>(start + n) * sizeof(float);
  if (shared > 48 * 1024)
    MOE_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared)));
  attention_kernel<<<static_cast<unsigned>(n * H), kThreads, shared, stream>>>(
      out_nHd, q_nHd, k_LGd, v_LGd, start, H, G, d, static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_silu_mul(float* act_nF, const float* gate_nF, const float* up_nF, int64_t count, Stream stream) {
  silu_mul_kernel<<<blocks_for(count), kThreads, 0, stream>>>(act_nF, gate_nF, up_nF, count);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_add(float* y, const float* x, int64_t count, Stream stream) {
  add_kernel<<<blocks_for(count), kThreads, 0, stream>>>(y, x, count);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_gather_rows(float* x_mD, const float* x_nD, const int32_t* rows_m, int64_t m, int64_t D, Stream stream) {
  gather_kernel<<<blocks_for(m * D), kThreads, 0, stream>>>(x_mD, x_nD, rows_m, m, D);
  MOE_CUDA_CHECK_LAUNCH();
}

void decode_scatter_add(float* y_nD, const float* ye_mD, const int32_t* rows_m, const float* weight_m, int64_t m,
                        int64_t D, Stream stream) {
  scatter_add_kernel<<<blocks_for(m * D), kThreads, 0, stream>>>(y_nD, ye_mD, rows_m, weight_m, m, D);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
