#include "train/expert_merging.h"

#include <string>

#include "core/error.h"
#include "core/rng.h"

namespace moe {

std::vector<ExpertRows> host_expert_rows(Transformer<float>& model, AdamW& optimizer, size_t layer,
                                         const MoEConfig& config) {
  auto layers = model.moe_layers();
  MOE_CHECK(layer < layers.size(), "expert merging: MoE layer {} of {}", layer, layers.size());
  MoELayer<float>& moe = *layers[layer];
  ParameterStore<float>& params = model.params();
  const int64_t E = moe.n_experts();
  float* m = optimizer.first_moment().data();
  float* v = optimizer.second_moment().data();
  std::vector<ExpertRows> rows;
  const auto add = [&](const std::string& name, bool expert_weight) {
    const int id = params.find(moe.prefix() + name);
    MOE_CHECK(id >= 0, "expert merging: no parameter {}{}", moe.prefix(), name);
    const int64_t at = optimizer.moment_offset(id);
    rows.push_back({params.value(id), m + at, v + at, params.numel(id) / E, expert_weight, expert_weight});
  };
  add(".experts.w1", true);
  add(".experts.w3", true);
  add(".experts.w2", true);
  add(".router.weight", false);
  if (config.router_bias) add(".router.bias", false);
  if (config.bias_balancing) rows.push_back({moe.balance_bias_E().data(), nullptr, nullptr, 1, false, false});
  return rows;
}

uint64_t expert_merge_seed(uint64_t training_seed, int64_t step, size_t layer) {
  return training_seed ^ fnv1a64("expert_merge." + std::to_string(step) + "." + std::to_string(layer));
}

std::vector<std::vector<ExpertMerge>> merge_host_experts(Transformer<float>& model, AdamW& optimizer,
                                                         const MoEConfig& config,
                                                         const std::vector<std::vector<int64_t>>& load_LE,
                                                         const std::vector<std::vector<int64_t>>& protected_LE,
                                                         uint64_t training_seed, int64_t step) {
  const size_t n_layers = model.moe_layers().size();
  MOE_CHECK(load_LE.size() == n_layers, "expert merging: loads of {} MoE layers for {}", load_LE.size(), n_layers);
  std::vector<std::vector<ExpertMerge>> merges(n_layers);
  for (size_t l = 0; l < n_layers; ++l) {
    const std::vector<ExpertRows> rows = host_expert_rows(model, optimizer, l, config);
    const std::vector<double> cosine = expert_cosine_EE(rows, config.n_experts);
    const std::vector<int64_t> none;
    merges[l] = plan_expert_merges(cosine, load_LE[l], config.merge_similarity, config.merge_pairs,
                                   l < protected_LE.size() ? protected_LE[l] : none);
    apply_expert_merges(rows, merges[l], config.merge_noise, expert_merge_seed(training_seed, step, l));
  }
  return merges;
}

std::vector<std::vector<int64_t>> split_experts_of(const std::vector<std::vector<ExpertMerge>>& merges) {
  std::vector<std::vector<int64_t>> split(merges.size());
  for (size_t l = 0; l < merges.size(); ++l)
    for (const ExpertMerge& m : merges[l]) {
      split[l].push_back(m.freed);
      split[l].push_back(m.split_of);
    }
  return split;
}

}  // namespace moe
