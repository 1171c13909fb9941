#include "moe/expert_merge.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/rng.h"

namespace moe {

std::vector<double> expert_cosine_EE(const std::vector<ExpertRows>& tensors, int64_t E) {
  const auto n = static_cast<size_t>(E);
  std::vector<double> dot(n * n, 0.0);
  for (const ExpertRows& t : tensors) {
    if (!t.similarity) continue;
    for (int64_t i = 0; i < E; ++i) {
      const float* a = t.value + i * t.row;
      for (int64_t j = i; j < E; ++j) {
        const float* b = t.value + j * t.row;
        double s = 0;
        for (int64_t k = 0; k < t.row; ++k) s += static_cast<double>(a[k]) * static_cast<double>(b[k]);
        dot[static_cast<size_t>(i) * n + static_cast<size_t>(j)] += s;
      }
    }
  }
  std::vector<double> cos(n * n, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i; j < n; ++j) {
      const double norms = std::sqrt(dot[i * n + i]) * std::sqrt(dot[j * n + j]);
      const double c = i == j ? 1.0 : (norms > 0 ? dot[i * n + j] / norms : 0.0);
      cos[i * n + j] = cos[j * n + i] = c;
    }
  return cos;
}

std::vector<ExpertMerge> plan_expert_merges(const std::vector<double>& cosine_EE, const std::vector<int64_t>& load_E,
                                            double min_similarity, int64_t max_pairs,
                                            const std::vector<int64_t>& protected_experts) {
  const auto E = static_cast<int64_t>(load_E.size());
  MOE_CHECK(static_cast<int64_t>(cosine_EE.size()) == E * E, "expert merging: {} similarities for {} experts",
            cosine_EE.size(), E);
  std::vector<ExpertMerge> merges;
  if (E < 3 || max_pairs <= 0) return merges;
  struct Pair {
    double cos;
    int64_t i, j;
  };
  std::vector<bool> shielded(static_cast<size_t>(E), false);
  for (const int64_t e : protected_experts)
    if (e >= 0 && e < E) shielded[static_cast<size_t>(e)] = true;
  std::vector<Pair> pairs;
  for (int64_t i = 0; i < E; ++i)
    for (int64_t j = i + 1; j < E; ++j) {
      if (shielded[static_cast<size_t>(i)] || shielded[static_cast<size_t>(j)]) continue;
      const double c = cosine_EE[static_cast<size_t>(i * E + j)];
      if (c >= min_similarity) pairs.push_back({c, i, j});
    }
  std::stable_sort(pairs.begin(), pairs.end(), [](const Pair& x, const Pair& y) { return x.cos > y.cos; });
  std::vector<bool> used(static_cast<size_t>(E), false);
  // Each merge needs a split source outside every pair of the event.
  for (const Pair& p : pairs) {
    if (static_cast<int64_t>(merges.size()) >= max_pairs) break;
    if (used[static_cast<size_t>(p.i)] || used[static_cast<size_t>(p.j)]) continue;
    const int64_t free_after = E - 2 * (static_cast<int64_t>(merges.size()) + 1);
    if (free_after < static_cast<int64_t>(merges.size()) + 1) break;  // a distinct split source per pair
    const int64_t li = load_E[static_cast<size_t>(p.i)], lj = load_E[static_cast<size_t>(p.j)];
    ExpertMerge m;
    m.kept = lj > li ? p.j : p.i;
    m.freed = lj > li ? p.i : p.j;
    m.similarity = p.cos;
    const int64_t la = load_E[static_cast<size_t>(m.kept)], lb = load_E[static_cast<size_t>(m.freed)];
    m.kept_share = la + lb > 0 ? static_cast<double>(la) / static_cast<double>(la + lb) : 0.5;
    used[static_cast<size_t>(p.i)] = used[static_cast<size_t>(p.j)] = true;
    merges.push_back(m);
  }
  // Split sources: the most loaded experts outside every pair, in order.
  std::vector<int64_t> rest;
  for (int64_t e = 0; e < E; ++e)
    if (!used[static_cast<size_t>(e)]) rest.push_back(e);
  std::stable_sort(rest.begin(), rest.end(), [&](int64_t x, int64_t y) {
    return load_E[static_cast<size_t>(x)] > load_E[static_cast<size_t>(y)];
  });
  for (size_t k = 0; k < merges.size(); ++k) merges[k].split_of = rest[k];
  return merges;
}

void apply_expert_merges(const std::vector<ExpertRows>& tensors, const std::vector<ExpertMerge>& merges,
                         double noise, uint64_t seed) {
  for (size_t t = 0; t < tensors.size(); ++t) {
    const ExpertRows& x = tensors[t];
    const CounterRng rng(seed, "expert_merge." + std::to_string(t));
    for (const ExpertMerge& m : merges) {
      const auto s = static_cast<float>(m.kept_share), r = static_cast<float>(1.0 - m.kept_share);
      for (float* base : {x.value, x.m, x.v}) {
        if (!base) continue;
        float* a = base + m.kept * x.row;
        const float* b = base + m.freed * x.row;
        for (int64_t k = 0; k < x.row; ++k) a[k] = s * a[k] + r * b[k];
        std::copy_n(base + m.split_of * x.row, x.row, base + m.freed * x.row);
      }
      if (x.perturb && noise > 0) {
        float* b = x.value + m.freed * x.row;
        for (int64_t k = 0; k < x.row; ++k) {
          const double u = 2.0 * rng.uniform(static_cast<uint64_t>(m.freed * x.row + k)) - 1.0;
          b[k] = static_cast<float>(static_cast<double>(b[k]) * (1.0 + noise * u));
        }
      }
    }
  }
}

}  // namespace moe
