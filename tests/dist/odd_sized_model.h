// A small model of odd sizes for tests of the parameter block's ranges: padding between
// parameters, ragged stage ends, router biases and experts (gradient stages, ZeRO plans).
#pragma once
#include "config/model_config.h"

namespace moe::test {

inline ModelConfig odd_sized_model(bool tied = false) {
  ModelConfig c;
  c.vocab_size = 97;
  c.dim = 20;
  c.n_layers = 3;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.seq_len = 8;
  c.first_dense_layers = 1;
  c.dense_hidden = 36;
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 12;
  c.tie_embeddings = tied;
  return c;
}

}  // namespace moe::test
