// moe.route_cache on the training paths: one RoutingCache per pair of consecutive MoE
// layers, fed after each forward with the micro-batch's tokens and every MoE layer's
// top-k choices, and its hit rates put into the step's LayerRouting (docs/ROUTING_CACHE.md).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "config/model_config.h"
#include "moe/routing_cache.h"
#include "obs/metrics.h"

namespace moe {

class RoutingCacheProbe {
 public:
  RoutingCacheProbe(const MoEConfig& config, int64_t moe_layers);
  // One forward: tokens_T (T tokens) and experts_TK[i], the i-th MoE layer's choices.
  void forward(const int32_t* tokens_T, int64_t T, const std::vector<const int32_t*>& experts_TK);
  void forward(const int32_t* tokens_T, int64_t T, const std::vector<std::vector<int32_t>>& experts_TK);
  // Per MoE layer i: assignments, hits, tokens, tokens hit since the last take (layer 0:
  // zeros, nothing predicts it), then reset. 4 values per layer, summable over ranks.
  std::vector<double> take_counts();
  // Sets layers[i].route_cache_hit_rate / _token_hit_rate from take_counts()' values
  // (summed over ranks or not); the first MoE layer keeps -1 (not predicted).
  static void fill(std::vector<LayerRouting>& layers, const std::vector<double>& counts);
  // take_counts(), summed over the ranks by sum_over_ranks (null: one process), into layers.
  void report(std::vector<LayerRouting>& layers, const std::function<void(double*, int64_t)>& sum_over_ranks = {});
  // The cache guessing MoE layer i + 1 (moe.speculative_dispatch reads its guesses).
  const RoutingCache& cache(size_t i) const { return caches_.at(i); }

 private:
  std::vector<RoutingCache> caches_;  // caches_[i] predicts MoE layer i + 1
};

}  // namespace moe
