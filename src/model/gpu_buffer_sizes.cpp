#include "model/gpu_buffer_sizes.h"

#include <algorithm>

#include "kernels/fp8_blockwise.h"
#include "moe/dispatch.h"

namespace moe {

ExpertRowBounds expert_row_bounds(const MoEConfig& moe, int64_t tokens, int64_t ep_size, bool split_experts,
                                  int64_t local_experts_cap) {
  ExpertRowBounds b;
  const int64_t T = tokens, E = moe.n_experts, K = moe.top_k, P = std::max<int64_t>(1, ep_size);
  b.capacity = E > 0 ? expert_capacity(moe.capacity_factor, T, K, E) : 0;
  b.max_rows = b.capacity > 0 ? std::min(T * K, E * b.capacity) : T * K;
  if (P == 1 || E <= 0) {
    b.max_local_experts = E;
    b.max_tokens = T;
    b.max_local_rows = b.max_rows;
    return b;
  }
  b.max_local_experts = std::min(E, std::max(E / P + (split_experts ? 1 : 0), local_experts_cap));
  b.max_tokens = P * T;
  b.max_local_rows = expert_parallel_local_rows(P, T, K, b.max_local_experts, b.capacity);
  return b;
}

int64_t expert_parallel_local_rows(int64_t ep_size, int64_t tokens, int64_t top_k, int64_t local_experts,
                                   int64_t capacity) {
  const int64_t all = ep_size * tokens * top_k;
  return capacity > 0 ? std::min(all, ep_size * local_experts * capacity) : all;
}

int64_t lm_head_chunk_rows(int64_t tokens, int64_t vocab_size) {
  return std::min<int64_t>(tokens, std::max<int64_t>(128, ((int64_t{64} << 20) / vocab_size) / 128 * 128));
}

Fp8ExpertWeightSizes fp8_expert_weight_sizes(int64_t local_experts, int64_t dim, int64_t hidden) {
  Fp8ExpertWeightSizes sizes;
  sizes.codes_per_copy = local_experts * dim * hidden;
  sizes.scales_per_copy = (local_experts * fp8::blocks(dim) * fp8::blocks(hidden) + 3) / 4 * 4;
  return sizes;
}

}  // namespace moe
