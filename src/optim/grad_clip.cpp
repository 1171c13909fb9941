#include "optim/grad_clip.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "kernels/adamw_math.h"

namespace moe {

namespace {

// One chunk in adamw_math's order (kNormParts partials, then the warp's combine).
double chunk_sum_of_squares(const float* values, int64_t count) {
  constexpr int kParts = adamw_math::kNormParts, kLanes = kParts / 4;
  double part[kParts] = {};
  for (int64_t base = 0; base < count; base += kParts) {
    const int64_t n = std::min<int64_t>(kParts, count - base);
    for (int64_t j = 0; j < n; ++j) part[j] += static_cast<double>(values[base + j]) * values[base + j];
  }
  double q[kLanes], next[kLanes];
  for (int l = 0; l < kLanes; ++l) q[l] = (part[4 * l] + part[4 * l + 1]) + (part[4 * l + 2] + part[4 * l + 3]);
  for (int k = kLanes / 2; k >= 1; k /= 2) {
    for (int l = 0; l < kLanes; ++l) next[l] = q[l] + q[l ^ k];
    std::copy(next, next + kLanes, q);
  }
  return q[0];
}

}  // namespace

double sum_of_squares(const float* values, int64_t count) {
  constexpr int64_t kChunk = adamw_math::kNormChunk;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    partial[static_cast<size_t>(c)] = chunk_sum_of_squares(values + c * kChunk, std::min(count - c * kChunk, kChunk));
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

namespace {

void scale(float* values, int64_t count, float factor) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) values[i] *= factor;
}

}  // namespace

ClipStats clip_gradients(ParameterStore<float>& params, double max_global_norm, double max_expert_norm) {
  ClipStats stats;
  // Expert groups: parameter ids sharing expert_group, each with the expert as dim 0.
  std::map<std::string, std::vector<int>> groups;
  for (int id = 0; id < params.size(); ++id)
    if (!params.spec(id).expert_group.empty()) groups[params.spec(id).expert_group].push_back(id);
  for (const auto& [group, ids] : groups) {
    const int64_t n_experts = params.spec(ids.front()).shape[0];
    for (int64_t e = 0; e < n_experts; ++e) {
      double sq = 0;
      for (int id : ids) {
        const int64_t per_expert = params.numel(id) / n_experts;
        sq += sum_of_squares(params.grad(id) + e * per_expert, per_expert);
      }
      const double norm = std::sqrt(sq);
      stats.max_expert_norm = std::max(stats.max_expert_norm, norm);
      if (max_expert_norm > 0 && norm > max_expert_norm) {
        ++stats.experts_clipped;
        const float factor = static_cast<float>(max_expert_norm / (norm + 1e-6));
        for (int id : ids) {
          const int64_t per_expert = params.numel(id) / n_experts;
          scale(params.grad(id) + e * per_expert, per_expert, factor);
        }
      }
    }
  }
  double sq = 0;
  for (int id = 0; id < params.size(); ++id) sq += sum_of_squares(params.grad(id), params.numel(id));
  stats.global_norm = std::sqrt(sq);
  if (max_global_norm > 0 && stats.global_norm > max_global_norm) {
    stats.global_clipped = true;
    const float factor = static_cast<float>(max_global_norm / (stats.global_norm + 1e-6));
    for (int id = 0; id < params.size(); ++id) scale(params.grad(id), params.numel(id), factor);
  }
  return stats;
}

}  // namespace moe
