#include "model/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moe {

void check_sampling_options(const SamplingOptions& options) {
  if (!std::isfinite(options.temperature) || options.temperature < 0)
    MOE_CONFIG_ERROR("--temperature must be >= 0 (0: greedy), got {}", options.temperature);
  if (options.top_k < 0) MOE_CONFIG_ERROR("--top-k must be >= 0 (0: every token), got {}", options.top_k);
  if (!(options.top_p > 0 && options.top_p <= 1))
    MOE_CONFIG_ERROR("--top-p must be in (0, 1], got {}", options.top_p);
}

std::vector<std::pair<int32_t, double>> sampling_distribution(std::span<const float> logits,
                                                              const SamplingOptions& options) {
  check_sampling_options(options);
  const auto V = static_cast<int64_t>(logits.size());
  MOE_CHECK(V > 0, "sampling from no logits");
  if (options.temperature == 0) {
    // max_element keeps the first of equal maxima: the lowest id.
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    return {{static_cast<int32_t>(best), 1.0}};
  }
  // Softmax at the temperature, in fp64.
  const double max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v)
    p[static_cast<size_t>(v)] = std::exp((static_cast<double>(logits[static_cast<size_t>(v)]) - max) / options.temperature);
  std::vector<int32_t> order(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) order[static_cast<size_t>(v)] = static_cast<int32_t>(v);
  auto more_likely = [&](int32_t a, int32_t b) {
    const double pa = p[static_cast<size_t>(a)], pb = p[static_cast<size_t>(b)];
    return pa > pb || (pa == pb && a < b);
  };
  const int64_t k = options.top_k > 0 ? std::min(options.top_k, V) : V;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), more_likely);
  order.resize(static_cast<size_t>(k));
  double kept_mass = 0;
  for (int32_t v : order) kept_mass += p[static_cast<size_t>(v)];
  // Nucleus: the shortest most-likely-first prefix holding >= top_p of the top-k mass (a
  // relative 1e-12 forgives rounding of a prefix that sums to p exactly).
  size_t keep = order.size();
  if (options.top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      mass += p[static_cast<size_t>(order[i])];
      if (mass >= options.top_p * kept_mass * (1 - 1e-12)) {
        keep = i + 1;
        break;
      }
    }
  }
  std::vector<std::pair<int32_t, double>> kept;
  kept.reserve(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += p[static_cast<size_t>(order[i])];
  for (size_t i = 0; i < keep; ++i) kept.emplace_back(order[i], p[static_cast<size_t>(order[i])] / total);
  return kept;
}

int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, double uniform) {
  MOE_CHECK(uniform > 0 && uniform < 1, "sampling needs a uniform number in (0, 1), got {}", uniform);
  const std::vector<std::pair<int32_t, double>> kept = sampling_distribution(logits, options);
  double cumulative = 0;
  for (const auto& [token, probability] : kept) {
    cumulative += probability;
    if (uniform < cumulative) return token;
  }
  return kept.back().first;  // rounding left the sum just below uniform
}

}  // namespace moe
