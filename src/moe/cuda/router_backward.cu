// The router's losses and backward on the GPU: per-expert assignment counts, the
// per-token terms of the aux load-balance loss and the z-loss, and one fused backward
// that takes the combine-weight gradients through the renormalisation, adds the aux
// loss gradient, goes through the temperature softmax (or sigmoid) and adds the z-loss
// gradient. Mirrors moe/router.cpp operation by operation (fp32 here, fp64 there).
#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = 256;
constexpr float kNormEps = 1e-20f;  // as the CPU's renormalisation epsilon

// Each block counts kCountSlots slots into its own shared histogram, then adds its nonzero
// bins to counts_E: one global atomic a bin and block instead of one a slot (a global atomic
// a slot on 64 counters took 75 us at olmoe-mini's 262 k slots). Integer adds: the order
// does not matter.
constexpr int64_t kCountSlots = 16 * kThreads;
__global__ void expert_counts_kernel(int32_t* counts_E, const int32_t* expert_TK, int64_t slots, int64_t E) {
  extern __shared__ int32_t histogram_E[];
  for (int64_t e = threadIdx.x; e < E; e += kThreads) histogram_E[e] = 0;
  __syncthreads();
  const int64_t first = blockIdx.x * kCountSlots, last = min(slots, first + kCountSlots);
  for (int64_t i = first + threadIdx.x; i < last; i += kThreads) atomicAdd(&histogram_E[expert_TK[i]], 1);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += kThreads)
    if (histogram_E[e] != 0) atomicAdd(&counts_E[e], histogram_E[e]);
}

// Token t's log-sum-exp of logits / temperature, over the warp.
__device__ float warp_logsumexp(const float* z, int64_t E, float inv_temperature) {
  const int lane = threadIdx.x & 31;
  float local_max = -INFINITY;
  for (int64_t e = lane; e < E; e += 32) local_max = fmaxf(local_max, z[e] * inv_temperature);
  const float row_max = warp_max(local_max);
  float local_sum = 0.0f;
  for (int64_t e = lane; e < E; e += 32) local_sum += expf(z[e] * inv_temperature - row_max);
  return row_max + logf(warp_sum(local_sum));
}

__global__ void loss_terms_kernel(float* aux_term_T, float* z_term_T, const float* scores, const float* logits,
                                  const int32_t* counts_E, int64_t T, int64_t E, int64_t K,
                                  float inv_temperature_arg, const float* temperature_1, bool sigmoid) {
  const int lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* s = scores + t * E;
  const float inv_temperature = temperature_1 ? 1.0f / *temperature_1 : inv_temperature_arg;
  float norm = 1.0f;
  if (sigmoid) {
    float local = 0.0f;
    for (int64_t e = lane; e < E; e += 32) local += s[e];
    norm = 1.0f / (warp_sum(local) + kNormEps);
  }
  const float inv_slots = 1.0f / static_cast<float>(T * K);
  float term = 0.0f;
  for (int64_t e = lane; e < E; e += 32) term += static_cast<float>(counts_E[e]) * inv_slots * s[e] * norm;
  term = warp_sum(term);
  const float lse = warp_logsumexp(logits + t * E, E, inv_temperature);
  if (lane == 0) {
    aux_term_T[t] = term;
    z_term_T[t] = lse * lse;
  }
}

__global__ void router_backward_kernel(float* dlogits, const float* dweight, const float* scores, const float* logits,
                                       const int32_t* expert, const int32_t* counts_E, int64_t T, int64_t E, int64_t K,
                                       float inv_temperature_arg, const float* temperature_1, bool sigmoid,
                                       bool renormalize, float aux_scale, float z_scale) {
  extern __shared__ float dscores_shared[];  // kWarpsPerBlock x E
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (t >= T) return;
  float* ds = dscores_shared + warp * E;
  const float* s = scores + t * E;
  const float inv_temperature = temperature_1 ? 1.0f / *temperature_1 : inv_temperature_arg;
  const int32_t* chosen = expert + t * K;
  const float* dw = dweight + t * K;
  for (int64_t e = lane; e < E; e += 32) ds[e] = 0.0f;
  __syncwarp();
  // Combine weights -> scores, through w_k = s_k / sum (when renormalising).
  if (lane == 0) {
    if (!renormalize) {
      for (int64_t k = 0; k < K; ++k) ds[chosen[k]] += dw[k];
    } else {
      float sum = kNormEps;
      for (int64_t k = 0; k < K; ++k) sum += s[chosen[k]];
      float dot = 0.0f;
      for (int64_t k = 0; k < K; ++k) dot += dw[k] * s[chosen[k]] / sum;
      for (int64_t k = 0; k < K; ++k) ds[chosen[k]] += (dw[k] - dot) / sum;
    }
  }
  __syncwarp();
  // Aux loss: dL/dp_te = aux_scale * E * f_e / T, with f_e = count_e / (T K).
  const float g_factor = aux_scale * static_cast<float>(E) / static_cast<float>(T) / static_cast<float>(T * K);
  if (aux_scale != 0.0f) {
    if (!sigmoid) {
      for (int64_t e = lane; e < E; e += 32) ds[e] += g_factor * static_cast<float>(counts_E[e]);
    } else {
      float local_sum = 0.0f;
      for (int64_t e = lane; e < E; e += 32) local_sum += s[e];
      const float sum = warp_sum(local_sum) + kNormEps;
      float local_dot = 0.0f;
      for (int64_t e = lane; e < E; e += 32) local_dot += g_factor * static_cast<float>(counts_E[e]) * s[e] / sum;
      const float dot = warp_sum(local_dot);
      for (int64_t e = lane; e < E; e += 32) ds[e] += (g_factor * static_cast<float>(counts_E[e]) - dot) / sum;
    }
  }
  __syncwarp();
  // Scores -> logits.
  float* dz = dlogits + t * E;
  if (!sigmoid) {
    float local_dot = 0.0f;
    for (int64_t e = lane; e < E; e += 32) local_dot += ds[e] * s[e];
    const float dot = warp_sum(local_dot);
    for (int64_t e = lane; e < E; e += 32) dz[e] = s[e] * (ds[e] - dot) * inv_temperature;
  } else {
    for (int64_t e = lane; e < E; e += 32) dz[e] = ds[e] * s[e] * (1.0f - s[e]) * inv_temperature;
  }
  // z-loss: d/dz_te of coef/T lse_t^2 = coef/T * 2 lse_t * softmax_te / temperature.
  if (z_scale != 0.0f) {
    const float* z = logits + t * E;
    const float lse = warp_logsumexp(z, E, inv_temperature);
    const float factor = z_scale * 2.0f / static_cast<float>(T) * inv_temperature * lse;
    for (int64_t e = lane; e < E; e += 32) dz[e] += factor * expf(z[e] * inv_temperature - lse);
  }
}

}  // namespace

void expert_counts(int32_t* counts_E, const int32_t* expert_TK, int64_t T, int64_t E, int64_t K, Stream stream) {
  MOE_CUDA_CHECK(cudaMemsetAsync(counts_E, 0, static_cast<size_t>(E) * sizeof(int32_t), stream));
  if (T * K == 0) return;
  MOE_CHECKF(E >= 1 && E <= 8192, "expert_counts: %lld experts unsupported", static_cast<long long>(E));
  expert_counts_kernel<<<static_cast<unsigned>(ceil_div(T * K, kCountSlots)), kThreads,
                         static_cast<size_t>(E) * sizeof(int32_t), stream>>>(counts_E, expert_TK, T * K, E);
  MOE_CUDA_CHECK_LAUNCH();
}

void router_loss_terms(float* aux_term_T, float* z_term_T, const float* scores_TE, const float* logits_TE,
                       const int32_t* counts_E, int64_t T, int64_t E, int64_t K, float temperature,
                       ScoreFunc score_func, Stream stream, const float* temperature_1) {
  if (T == 0) return;
  loss_terms_kernel<<<static_cast<unsigned>(ceil_div(T, kWarpsPerBlock)), kWarpsPerBlock * 32, 0, stream>>>(
      aux_term_T, z_term_T, scores_TE, logits_TE, counts_E, T, E, K, 1.0f / temperature, temperature_1,
      score_func == ScoreFunc::Sigmoid);
  MOE_CUDA_CHECK_LAUNCH();
}

void router_backward(float* dlogits_TE, const float* dweight_TK, const float* scores_TE, const float* logits_TE,
                     const int32_t* expert_TK, const int32_t* counts_E, int64_t T, int64_t E, int64_t K,
                     float temperature, ScoreFunc score_func, bool renormalize, float aux_scale, float z_scale,
                     Stream stream, const float* temperature_1) {
  MOE_CHECKF(E >= 1 && E <= 1024, "router_backward: E=%lld unsupported", static_cast<long long>(E));
  if (T == 0) return;
  const size_t shared_bytes = static_cast<size_t>(kWarpsPerBlock * E) * sizeof(float);
  router_backward_kernel<<<static_cast<unsigned>(ceil_div(T, kWarpsPerBlock)), kWarpsPerBlock * 32, shared_bytes,
                           stream>>>(dlogits_TE, dweight_TK, scores_TE, logits_TE, expert_TK, counts_E, T, E, K,
                                     1.0f / temperature, temperature_1, score_func == ScoreFunc::Sigmoid,
                                     renormalize, aux_scale,
                                     z_scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
