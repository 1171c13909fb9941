// The small MoE layer the expert-parallel layer tests run over thread ranks (dim 8, 4
// tokens per sequence, experts of hidden 6, aux and z losses on).
#pragma once
#include <cstdint>

#include "config/model_config.h"

namespace moe::test {

inline ModelConfig small_moe_layer_config(int64_t n_experts, int64_t top_k, double capacity_factor,
                                          int64_t shared_experts = 1) {
  ModelConfig config;
  config.dim = 8;
  config.seq_len = 4;
  config.moe.n_experts = n_experts;
  config.moe.top_k = top_k;
  config.moe.expert_hidden = 6;
  config.moe.n_shared_experts = shared_experts;
  config.moe.capacity_factor = capacity_factor;
  config.moe.aux_loss_coef = 0.1;
  config.moe.z_loss_coef = 0.01;
  return config;
}

}  // namespace moe::test
