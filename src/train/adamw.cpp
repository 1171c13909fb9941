#include "train/adamw.h"

#include <cmath>

namespace moe {

AdamW::AdamW(const OptimizerConfig& config, ParameterStore<float>& params)
    : config_(config), params_(params) {
  int64_t total = 0;
  for (int id = 0; id < params.size(); ++id) {
    offsets_.push_back(total);
    total += params.numel(id);
  }
  m_.assign(static_cast<size_t>(total), 0.0f);
  v_.assign(static_cast<size_t>(total), 0.0f);
}

void AdamW::step(double lr) {
  ++steps_;
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bias2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  // Folding the bias corrections into the step size and epsilon, as torch does.
  const float step_size = static_cast<float>(lr / bias1);
  const float sqrt_bias2 = static_cast<float>(std::sqrt(bias2));
  const float eps = static_cast<float>(config_.eps);
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
  for (int id = 0; id < params_.size(); ++id) {
    float* p = params_.value(id);
    const float* g = params_.grad(id);
    float* m = m_.data() + offsets_[static_cast<size_t>(id)];
    float* v = v_.data() + offsets_[static_cast<size_t>(id)];
    const float decay = params_.spec(id).weight_decay
                            ? static_cast<float>(1.0 - lr * config_.weight_decay)
                            : 1.0f;
    const int64_t n = params_.numel(id);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      m[i] = fb1 * m[i] + (1.0f - fb1) * g[i];
      v[i] = fb2 * v[i] + (1.0f - fb2) * g[i] * g[i];
      const float denom = std::sqrt(v[i]) / sqrt_bias2 + eps;
      p[i] = p[i] * decay - step_size * m[i] / denom;
    }
  }
}

}  // namespace moe
