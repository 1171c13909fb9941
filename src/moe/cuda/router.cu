// Router on the GPU: one warp per token computes the temperature softmax (or sigmoid)
// in fp32, then picks the top-K of score + bias by K rounds of warp arg-max. Ties go to
// the lower expert index and NaN keys rank last, as in the CPU reference. Group-limited
// routing first ranks the groups (a lane per group: the sum of its two best keys) and
// marks the experts of the groups not taken as unavailable.
#include <algorithm>
#include <climits>

#include "core/gpu.h"
#include "kernels/cuda/common.cuh"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"

namespace moe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

// Arg-max over the warp of each lane's (value, index): the largest value, equal values to
// the lower index; every lane gets the result.
__device__ __forceinline__ void warp_argmax(float& best, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (other > best || (other == best && other_index < index)) {
      best = other;
      index = other_index;
    }
  }
}

__global__ void router_topk_kernel(float* scores, int32_t* expert, float* weight, const float* logits,
                                   const float* bias, int64_t T, int64_t E, int64_t K,
                                   float inv_temperature_arg, const float* temperature_1, bool sigmoid,
                                   bool renormalize, int groups, int top_groups) {
  extern __shared__ float keys_shared[];  // kWarpsPerBlock x E selection keys
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (t >= T) return;
  float* keys = keys_shared + warp * E;
  const float* z = logits + t * E;
  float* s = scores + t * E;
  const float inv_temperature = temperature_1 ? 1.0f / *temperature_1 : inv_temperature_arg;
  if (sigmoid) {
    for (int64_t e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + expf(-z[e] * inv_temperature));
  } else {
    float local_max = -INFINITY;
    for (int64_t e = lane; e < E; e += 32) local_max = fmaxf(local_max, z[e] * inv_temperature);
    const float row_max = warp_max(local_max);
    float local_sum = 0.0f;
    for (int64_t e = lane; e < E; e += 32) local_sum += expf(z[e] * inv_temperature - row_max);
    const float inv_sum = 1.0f / warp_sum(local_sum);
    for (int64_t e = lane; e < E; e += 32) s[e] = expf(z[e] * inv_temperature - row_max) * inv_sum;
  }
  for (int64_t e = lane; e < E; e += 32) {
    const float key = s[e] + (bias ? bias[e] : 0.0f);
    keys[e] = isnan(key) ? -INFINITY : key;
  }
  __syncwarp();
  if (groups > 1) {
    const int64_t per_group = E / groups;
    float group_score = -INFINITY;
    if (lane < groups) {
      float first = -INFINITY, second = -INFINITY;
      for (int64_t e = lane * per_group; e < (lane + 1) * per_group; ++e) {
        const float k = keys[e];
        if (k > first) second = first, first = k;
        else if (k > second) second = k;
      }
      group_score = per_group == 1 ? first : first + second;
    }
    bool taken = false;
    for (int m = 0; m < top_groups; ++m) {
      float best = -INFINITY;
      int best_group = INT_MAX;
      if (lane < groups && !taken) best = group_score, best_group = lane;
      warp_argmax(best, best_group);
      taken = taken || lane == best_group;
    }
    const unsigned taken_mask = __ballot_sync(0xffffffffu, taken);
    for (int64_t e = lane; e < E; e += 32)
      if (!((taken_mask >> (e / per_group)) & 1u)) keys[e] = NAN;  // NaN: not a candidate
    __syncwarp();
  }
  float chosen_sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    float best = -INFINITY;
    int best_index = INT_MAX;
    for (int64_t e = lane; e < E; e += 32) {
      const float key = keys[e];  // NaN marks an expert already taken
      if (!isnan(key) && (key > best || (key == best && e < best_index))) {
        best = key;
        best_index = static_cast<int>(e);
      }
    }
    warp_argmax(best, best_index);
    if (lane == 0) {
      expert[t * K + k] = best_index;
      weight[t * K + k] = s[best_index];
      keys[best_index] = NAN;
    }
    chosen_sum += s[best_index];
    __syncwarp();
  }
  if (renormalize && lane == 0)
    for (int64_t k = 0; k < K; ++k) weight[t * K + k] /= chosen_sum + 1e-20f;
}

constexpr int kStatsThreads = 256;

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// A thread per token: its entropy in double (router_entropy_sum's terms, in expert order),
// summed over the block in a fixed tree into partial_B[block]. A warp stages its 32
// tokens' scores 32 experts at a time through shared memory, so the loads are coalesced
// (a thread reading its own row strided the warp's loads over 32 rows: 30 -> 25 us a call at
// olmoe-mini's 32k x 64); the arithmetic and its order are unchanged.
__global__ void routing_entropy_partials_kernel(double* partial_B, const float* scores_TE, int64_t T, int64_t E) {
  constexpr int kWarps = kStatsThreads / 32;
  __shared__ float tile[kWarps][32][33];  // [token of the warp][expert of the tile], padded
  __shared__ double warp_partials[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t warp_first = static_cast<int64_t>(blockIdx.x) * kStatsThreads + warp * 32;
  const bool mine = warp_first + lane < T;
  float(&row)[33] = tile[warp][lane];
  const auto load_tile = [&](int64_t e0) {
    __syncwarp();
    for (int j = 0; j < 32; ++j)
      if (warp_first + j < T && e0 + lane < E) tile[warp][j][lane] = scores_TE[(warp_first + j) * E + e0 + lane];
    __syncwarp();
  };
  double total = 0;
  for (int64_t e0 = 0; e0 < E; e0 += 32) {
    load_tile(e0);
    const int n = static_cast<int>(E - e0 < 32 ? E - e0 : 32);
    if (mine)
      for (int k = 0; k < n; ++k) total += static_cast<double>(row[k]);
  }
  double entropy = 0;
  if (__any_sync(0xffffffffu, mine && total > 0))
    for (int64_t e0 = 0; e0 < E; e0 += 32) {
      load_tile(e0);
      const int n = static_cast<int>(E - e0 < 32 ? E - e0 : 32);
      if (mine && total > 0)
        for (int k = 0; k < n; ++k) {
          const double p = static_cast<double>(row[k]) / total;
          if (p > 0) entropy -= p * log(p);
        }
    }
  entropy = warp_sum_double(entropy);
  if (lane == 0) warp_partials[warp] = entropy;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int w = 0; w < kWarps; ++w) sum += warp_partials[w];
    partial_B[blockIdx.x] = sum;
  }
}

// One block: acc[e] += kept rows of expert e (its slot's count), acc[E] += the partials
// in block order, acc[E + 1] += T.
__global__ void routing_stats_add_kernel(double* acc, const double* partial_B, int64_t blocks, const int32_t* counts_slot,
                                         const int32_t* slot_of_expert, int64_t T, int64_t E) {
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t slot = slot_of_expert ? slot_of_expert[e] : e;
    acc[e] += static_cast<double>(counts_slot[slot]);
  }
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int64_t b = 0; b < blocks; ++b) sum += partial_B[b];
    acc[E] += sum;
    acc[E + 1] += static_cast<double>(T);
  }
}

}  // namespace

int64_t routing_stats_scratch(int64_t T) { return std::max<int64_t>(1, ceil_div(T, kStatsThreads)); }

void accumulate_routing_stats(double* acc, double* scratch, const float* scores_TE, const int32_t* counts_slot,
                              const int32_t* slot_of_expert, int64_t T, int64_t E, Stream stream) {
  if (T == 0) return;
  const int64_t blocks = routing_stats_scratch(T);
  routing_entropy_partials_kernel<<<static_cast<unsigned>(blocks), kStatsThreads, 0, stream>>>(scratch, scores_TE,
                                                                                               T, E);
  MOE_CUDA_CHECK_LAUNCH();
  routing_stats_add_kernel<<<1, 256, 0, stream>>>(acc, scratch, blocks, counts_slot, slot_of_expert, T, E);
  MOE_CUDA_CHECK_LAUNCH();
}

void router_topk(float* scores_TE, int32_t* expert_TK, float* weight_TK, const float* logits_TE,
                 const float* bias_E, int64_t T, int64_t E, int64_t K, float temperature,
                 ScoreFunc score_func, bool renormalize, Stream stream, int64_t route_groups,
                 int64_t route_top_groups, const float* temperature_1) {
  MOE_CHECKF(E >= 1 && E <= 1024 && K >= 1 && K <= E, "router_topk: E=%lld K=%lld unsupported",
             static_cast<long long>(E), static_cast<long long>(K));
  const bool grouped = route_groups > 1;
  MOE_CHECKF(!grouped || (route_groups <= 32 && E % route_groups == 0 && route_top_groups >= 1 &&
                          route_top_groups <= route_groups && K <= route_top_groups * (E / route_groups)),
             "router_topk: %lld route groups (top %lld) of %lld experts, top-%lld unsupported",
             static_cast<long long>(route_groups), static_cast<long long>(route_top_groups),
             static_cast<long long>(E), static_cast<long long>(K));
  if (T == 0) return;
  const size_t shared_bytes = static_cast<size_t>(kWarpsPerBlock * E) * sizeof(float);
  router_topk_kernel<<<static_cast<unsigned>(ceil_div(T, kWarpsPerBlock)), kWarpsPerBlock * 32,
                       shared_bytes, stream>>>(scores_TE, expert_TK, weight_TK, logits_TE, bias_E, T, E,
                                               K, 1.0f / temperature, temperature_1,
                                               score_func == ScoreFunc::Sigmoid,
                                               renormalize, grouped ? static_cast<int>(route_groups) : 0,
                                               static_cast<int>(route_top_groups));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::cuda
