// The small two-layer MoE config the memory-plan tests estimate (test_memory_plan*.cpp).
#pragma once

#include "config/run_config.h"

namespace moe::test {

inline RunConfig small_config() {
  RunConfig c;
  ModelConfig& m = c.model;
  m.vocab_size = 1024;
  m.dim = 512;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.seq_len = 256;
  m.moe.n_experts = 8;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 1024;
  m.moe.capacity_factor = 0;
  c.training.micro_batch = 4;
  c.training.global_batch_tokens = 4 * 256 * 8;
  c.training.recompute_layers = 0;
  c.training.recompute_experts = ExpertRecompute::None;
  c.parallel.zero = 0;
  return c;
}

}  // namespace moe::test
