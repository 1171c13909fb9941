#include "train/routing_cache_probe.h"

#include "core/error.h"

namespace moe {

RoutingCacheProbe::RoutingCacheProbe(const MoEConfig& config, int64_t moe_layers) {
  const int64_t P = config.route_cache_predict > 0 ? config.route_cache_predict : config.top_k;
  for (int64_t i = 1; i < moe_layers; ++i)
    caches_.emplace_back(config.n_experts, config.top_k, P, config.route_cache_keys);
}

void RoutingCacheProbe::forward(const int32_t* tokens_T, int64_t T, const std::vector<const int32_t*>& experts_TK) {
  MOE_CHECK(experts_TK.size() == caches_.size() + 1, "routing cache: {} MoE layers' choices for {} caches",
            experts_TK.size(), caches_.size());
  for (size_t i = 0; i < caches_.size(); ++i) caches_[i].step(tokens_T, experts_TK[i], experts_TK[i + 1], T);
}

void RoutingCacheProbe::forward(const int32_t* tokens_T, int64_t T, const std::vector<std::vector<int32_t>>& experts_TK) {
  std::vector<const int32_t*> pointers;
  for (const auto& choices : experts_TK) pointers.push_back(choices.data());
  forward(tokens_T, T, pointers);
}

std::vector<double> RoutingCacheProbe::take_counts() {
  std::vector<double> counts(4 * (caches_.size() + 1), 0.0);
  for (size_t i = 0; i < caches_.size(); ++i) {
    const RouteCacheHits& h = caches_[i].hits();
    double* c = counts.data() + 4 * (i + 1);
    c[0] = static_cast<double>(h.assignments);
    c[1] = static_cast<double>(h.hits);
    c[2] = static_cast<double>(h.tokens);
    c[3] = static_cast<double>(h.tokens_hit);
    caches_[i].reset_hits();
  }
  return counts;
}

void RoutingCacheProbe::fill(std::vector<LayerRouting>& layers, const std::vector<double>& counts) {
  for (size_t i = 1; i < layers.size() && 4 * i + 3 < counts.size(); ++i) {
    const double* c = counts.data() + 4 * i;
    layers[i].route_cache_hit_rate = c[0] > 0 ? c[1] / c[0] : 0;
    layers[i].route_cache_token_hit_rate = c[2] > 0 ? c[3] / c[2] : 0;
  }
}

void RoutingCacheProbe::report(std::vector<LayerRouting>& layers,
                               const std::function<void(double*, int64_t)>& sum_over_ranks) {
  std::vector<double> counts = take_counts();  // each rank's own cache; the hits summed
  if (sum_over_ranks) sum_over_ranks(counts.data(), static_cast<int64_t>(counts.size()));
  fill(layers, counts);
}

}  // namespace moe
