// Routing cache: predicts each token's experts in MoE layer l+1 from what is known while
// layer l runs (the token's id and the experts layer l chose for it), learned online from
// the router's own choices. A prediction is only a guess for starting the exchange early;
// the router still decides, so the math never depends on it. docs/ROUTING_CACHE.md.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace moe {

// Hits of one layer's predictions, summed over the forwards since reset.
struct RouteCacheHits {
  int64_t assignments = 0;   // tokens x top_k routed
  int64_t hits = 0;          // of them, experts the prediction contained
  int64_t tokens = 0;
  int64_t tokens_hit = 0;    // tokens all of whose experts were predicted (no correction needed)
  double hit_rate() const { return assignments > 0 ? static_cast<double>(hits) / static_cast<double>(assignments) : 0; }
  double token_hit_rate() const { return tokens > 0 ? static_cast<double>(tokens_hit) / static_cast<double>(tokens) : 0; }
};

// One transition (layer l -> l+1). Two frequency tables of next-layer experts: keyed by
// (token id, layer l's expert set), and backing off to layer l's expert set alone, then to
// the layer's overall expert frequency. Each key keeps its kSlots most frequent experts
// (space-saving counts), so memory is bounded by max_keys.
class RoutingCache {
 public:
  static constexpr int kSlots = 8;
  // n_experts E, top_k K of both layers, predict_k P >= K experts guessed per token,
  // max_keys: most (token, experts) keys kept (later new keys back off).
  RoutingCache(int64_t n_experts, int64_t top_k, int64_t predict_k, int64_t max_keys);

  // pred_TP[t] = the P experts guessed for token t (distinct, best first).
  void predict(const int32_t* tokens_T, const int32_t* prev_TK, int64_t T, int32_t* pred_TP) const;
  // Learns layer l+1's choices next_TK for tokens_T after layer l's prev_TK.
  void observe(const int32_t* tokens_T, const int32_t* prev_TK, const int32_t* next_TK, int64_t T);
  // predict(), count its hits against next_TK into hits(), then observe(): one forward.
  void step(const int32_t* tokens_T, const int32_t* prev_TK, const int32_t* next_TK, int64_t T);

  const RouteCacheHits& hits() const { return hits_; }
  void reset_hits() { hits_ = {}; }
  int64_t keys() const { return static_cast<int64_t>(by_token_.size()); }
  int64_t predict_k() const { return P_; }

 private:
  struct Counts {
    int32_t expert[kSlots];
    uint32_t count[kSlots];
    Counts();
    void add(int32_t e);
  };
  uint64_t set_key(const int32_t* experts_K) const;  // order-free key of K experts

  int64_t E_, K_, P_, max_keys_;
  std::unordered_map<uint64_t, Counts> by_token_;  // hash of (token, prev set)
  std::unordered_map<uint64_t, Counts> by_set_;    // prev set
  std::vector<uint64_t> overall_E_;                // every next-layer choice seen
  RouteCacheHits hits_;
};

}  // namespace moe
