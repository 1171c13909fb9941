// Small model shapes shared by the GPU tests of whole steps.
#pragma once
#include "config/model_config.h"

namespace moe::test {

// 4 layers (the first dense), 8 experts top-2 and a shared expert, dim 128, 64 tokens per
// sequence: every MoE path at a size that runs in milliseconds.
inline ModelConfig small_moe_model(double capacity_factor) {
  ModelConfig c;
  c.vocab_size = 512;
  c.dim = 128;
  c.n_layers = 4;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.seq_len = 64;
  c.first_dense_layers = 1;
  c.dense_hidden = 192;
  c.moe.n_experts = 8;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 128;
  c.moe.n_shared_experts = 1;
  c.moe.capacity_factor = capacity_factor;
  return c;
}

}  // namespace moe::test
