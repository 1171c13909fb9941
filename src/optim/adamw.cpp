#include "optim/adamw.h"

#include "core/error.h"
#include "kernels/adamw_math.h"

namespace moe {

AdamW::AdamW(const OptimizerConfig& config, ParameterStore<float>& params)
    : config_(config), params_(params) {
  bf16_moments_ = config.state_dtype == MomentDtype::Bf16;
  for (int id = 0; id < params.size(); ++id) {
    offsets_.push_back(total_);
    total_ += params.numel(id);
  }
}

void AdamW::ensure_moments() {
  if (static_cast<int64_t>(m_.size()) == total_) return;
  m_.assign(static_cast<size_t>(total_), 0.0f);
  v_.assign(static_cast<size_t>(total_), 0.0f);
}

void AdamW::step(double lr) {
  ++steps_;
  ensure_moments();
  const adamw_math::AdamWScalars s = adamw_math::adamw_step_scalars(lr, config_.beta1, config_.beta2, config_.eps,
                                                                    config_.weight_decay, steps_);
  const bool bf16 = bf16_moments_;
  for (int id = 0; id < params_.size(); ++id) {
    float* p = params_.value(id);
    const float* g = params_.grad(id);
    float* m = m_.data() + offsets_[static_cast<size_t>(id)];
    float* v = v_.data() + offsets_[static_cast<size_t>(id)];
    const float decay = params_.spec(id).weight_decay ? s.decay_factor : 1.0f;
    const int64_t n = params_.numel(id);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] = adamw_math::adamw_update(p[i], g[i], m[i], v[i], s, decay, bf16);
  }
}

}  // namespace moe
