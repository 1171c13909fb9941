// Model and MoE shape and behaviour: the [model] and [moe] sections of a run config
// (docs/CONFIG.md describes every key).
#pragma once
#include <array>
#include <cstdint>

#include "config/enum_names.h"

namespace moe {

enum class ScoreFunc { Softmax, Sigmoid };
inline constexpr std::array<EnumName<ScoreFunc>, 2> kScoreFuncNames{{{ScoreFunc::Softmax, "softmax"},
                                                                         {ScoreFunc::Sigmoid, "sigmoid"}}};
constexpr std::span<const EnumName<ScoreFunc>> enum_names(ScoreFunc) { return kScoreFuncNames; }

struct MoEConfig {
  int64_t n_experts = 8;          // routed experts per MoE layer (E)
  int64_t top_k = 2;              // experts chosen per token (K)
  int64_t expert_hidden = 256;    // SwiGLU hidden width of each expert (F)
  int64_t n_shared_experts = 0;   // experts every token goes through, hidden width expert_hidden
  ScoreFunc score_func = ScoreFunc::Softmax;
  double temperature = 1.0;       // router logits are divided by this before the score function
  bool renormalize = true;        // rescale the K chosen weights to sum to 1
  bool router_bias = true;        // a learned bias on the router logits (Mixtral, Qwen and OLMoE have none)
  double capacity_factor = 0.0;   // > 0: each expert keeps at most ceil(cf*T*K/E) tokens; 0: dropless
  double aux_loss_coef = 0.01;    // Switch-style load-balance loss
  double z_loss_coef = 0.001;     // router z-loss
  bool bias_balancing = false;    // DeepSeek-V3 aux-loss-free balancing
  double bias_update_rate = 0.001;
  // Gate temperature auto-tuning (docs/ROUTING.md): each MoE layer's temperature moves
  // after every step by its measured load imbalance towards metrics.alert_imbalance,
  // within [temperature_min, temperature_max]; `temperature` is where it starts.
  bool temperature_control = false;
  double temperature_min = 0.25;
  double temperature_max = 4.0;
  double temperature_gain = 0.05;  // log-temperature change per unit of (smoothed imbalance - target)
  // Group-limited ("node-first") routing: the experts form route_groups equal groups (the
  // experts of one node, say) and a token takes its K experts from its route_top_groups
  // best groups only; route_groups <= 1: off.
  int64_t route_groups = 0;
  int64_t route_top_groups = 0;
  // Routing cache (docs/ROUTING_CACHE.md): learns to guess each token's experts in the
  // next MoE layer; measured only (hit rates in the metrics), the routing is unchanged.
  bool route_cache = false;
  // Speculative dispatch (docs/ROUTING_CACHE.md): under expert parallelism each MoE layer
  // after the first sends the rows of the tokens the routing cache guessed for each peer
  // before its router runs, then only the corrections; the math is unchanged.
  bool speculative_dispatch = false;
  int64_t route_cache_predict = 0;        // experts guessed per token; 0: top_k
  int64_t route_cache_keys = 1 << 20;     // most (token, experts) keys kept per layer pair
  // Expert merging (docs/EXPERT_MERGING.md): every merge_interval steps, in each MoE layer,
  // up to merge_pairs disjoint pairs of experts whose weights' cosine is >= merge_similarity
  // are merged into the more loaded one (load-weighted average of weights and moments,
  // router rows alike); the freed expert restarts as a copy of the most loaded other one,
  // perturbed by merge_noise (relative). Shapes never change. merge_interval 0: off.
  int64_t merge_interval = 0;
  double merge_similarity = 0.5;
  int64_t merge_pairs = 1;
  double merge_noise = 0.01;
};

struct ModelConfig {
  int64_t vocab_size = 0;         // 0: taken from the tokenizer
  int64_t dim = 128;              // D
  int64_t n_layers = 4;
  int64_t n_heads = 4;            // H
  int64_t n_kv_heads = 2;         // grouped-query attention: H must be a multiple
  int64_t seq_len = 256;          // S
  int64_t first_dense_layers = 0; // the first N blocks use a dense SwiGLU FFN instead of MoE
  int64_t dense_hidden = 512;     // hidden width of those dense FFNs
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;    // LM head shares the token embedding
  double init_std = 0.02;
  MoEConfig moe;

  int64_t head_dim() const { return dim / n_heads; }
  // A token's fused q|k|v projection row: the query heads, then the key and value heads.
  int64_t qkv_width() const { return (n_heads + 2 * n_kv_heads) * head_dim(); }
};

}  // namespace moe
