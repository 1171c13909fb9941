#include "train/expert_merging.h"

#include <algorithm>
#include <map>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "train/checkpoint_manifest.h"

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

std::vector<std::vector<ExpertMerge>> merge_sharded_experts(
    Transformer<float>& model, const MoEConfig& config, const SavedState& saved, const std::vector<StateTarget>& targets,
    const std::function<void(float*, int64_t)>& sum_over_world, const std::vector<std::vector<int64_t>>& load_LE,
    const std::vector<std::vector<int64_t>>& protected_LE, uint64_t training_seed, int64_t step) {
  const auto layers = model.moe_layers();
  const size_t n_layers = layers.size();
  MOE_CHECK(load_LE.size() == n_layers, "expert merging: loads of {} MoE layers for {}", load_LE.size(), n_layers);
  ParameterStore<float>& params = model.params();
  const int64_t E = config.n_experts;
  std::vector<std::vector<ExpertMerge>> merges(n_layers);
  for (size_t l = 0; l < n_layers; ++l) {
    MoELayer<float>& moe = *layers[l];
    // The layer's tensors in host_expert_rows's order: value, first and second moment of
    // each, one buffer, at the offsets below.
    std::vector<std::string> names{".experts.w1", ".experts.w3", ".experts.w2", ".router.weight"};
    if (config.router_bias) names.push_back(".router.bias");
    std::map<std::string, std::pair<int64_t, int64_t>> at;  // global tensor -> (offset in whole, numel)
    std::vector<int64_t> numel;
    int64_t total = 0;
    for (const std::string& name : names) {
      const int id = params.find(moe.prefix() + name);
      MOE_CHECK(id >= 0, "expert merging: no parameter {}{}", moe.prefix(), name);
      const int64_t n = params.numel(id);
      numel.push_back(n);
      for (const char* kind : {"param/", "adam_m/", "adam_v/"}) {
        at[kind + params.spec(id).name] = {total, n};
        total += n;
      }
    }
    std::vector<float> whole(static_cast<size_t>(total), 0.0f);
    for (const StatePiece& piece : saved.pieces) {
      const auto it = at.find(piece.tensor);
      if (it == at.end()) continue;
      const Range share = replica_share(piece.tensor, piece.begin, piece.count, piece.replicas, piece.replica);
      MOE_CHECK(share.offset + share.count <= it->second.second, "expert merging: piece of {} past its end",
                piece.tensor);
      std::copy_n(piece.data + (share.offset - piece.begin), share.count, whole.data() + it->second.first + share.offset);
    }
    // Each element is nonzero on at most one rank: the sum is that rank's bits.
    sum_over_world(whole.data(), total);
    std::vector<ExpertRows> rows;
    int64_t offset = 0;
    for (size_t t = 0; t < names.size(); ++t) {
      const bool expert_weight = t < 3;
      float* base = whole.data() + offset;
      rows.push_back({base, base + numel[t], base + 2 * numel[t], numel[t] / E, expert_weight, expert_weight});
      offset += 3 * numel[t];
    }
    if (config.bias_balancing) rows.push_back({moe.balance_bias_E().data(), nullptr, nullptr, 1, false, false});
    const std::vector<double> cosine = expert_cosine_EE(rows, E);
    const std::vector<int64_t> none;
    merges[l] = plan_expert_merges(cosine, load_LE[l], config.merge_similarity, config.merge_pairs,
                                   l < protected_LE.size() ? protected_LE[l] : none);
    apply_expert_merges(rows, merges[l], config.merge_noise, expert_merge_seed(training_seed, step, l));
    // Back into this rank's slices: only the rows that changed (kept and freed experts).
    std::vector<int64_t> changed;
    for (const ExpertMerge& m : merges[l]) {
      changed.push_back(m.kept);
      changed.push_back(m.freed);
    }
    if (changed.empty()) continue;
    for (const StateTarget& target : targets) {
      const auto it = at.find(target.tensor);
      if (it == at.end()) continue;
      const int64_t row = it->second.second / E;
      const float* from = whole.data() + it->second.first;
      for (int64_t e : changed) {
        const int64_t lo = std::max(target.begin, e * row), hi = std::min(target.begin + target.count, (e + 1) * row);
        if (lo < hi) std::copy(from + lo, from + hi, target.data + (lo - target.begin));
      }
    }
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
