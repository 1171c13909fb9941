#include "optim/adamw.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/adamw_math.h"

namespace moe {

void adamw_update_range(float* p, const float* g, float* m, float* v, int64_t n, int64_t index,
                        const adamw_math::AdamWScalars& s, float decay, MomentDtype moments) {
  namespace am = adamw_math;
  if (moments != MomentDtype::Fp8) {
    const bool bf16 = moments == MomentDtype::Bf16;
#pragma omp parallel for schedule(static) if (n >= (1 << 14))
    for (int64_t i = 0; i < n; ++i) p[i] = am::adamw_update(p[i], g[i], m[i], v[i], s, decay, bf16);
    return;
  }
  MOE_CHECK(index % am::kMomentBlock == 0, "fp8 moments: a range starts at block element {}, not on a block of {}",
            index, am::kMomentBlock);
  const int64_t blocks = (n + am::kMomentBlock - 1) / am::kMomentBlock;
#pragma omp parallel for schedule(static) if (n >= (1 << 14))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * am::kMomentBlock;
    const int len = static_cast<int>(std::min<int64_t>(n - at, am::kMomentBlock));
    // Read as stored (the identity on values this loop stored; fp32 ones from a
    // checkpoint take the values the GPU's upload gives them: step 0's rounding bits).
    am::quantize_moment_block(m + at, v + at, len, index + at, 0);
    for (int i = 0; i < len; ++i) p[at + i] = am::adamw_update(p[at + i], g[at + i], m[at + i], v[at + i], s, decay, false);
    am::quantize_moment_block(m + at, v + at, len, index + at, s.step);
  }
}

AdamW::AdamW(const OptimizerConfig& config, ParameterStore<float>& params)
    : config_(config), params_(params) {
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
  for (int id = 0; id < params_.size(); ++id) {
    float* p = params_.value(id);
    const float* g = params_.grad(id);
    float* m = m_.data() + offsets_[static_cast<size_t>(id)];
    float* v = v_.data() + offsets_[static_cast<size_t>(id)];
    const float decay = params_.spec(id).weight_decay ? s.decay_factor : 1.0f;
    adamw_update_range(p, g, m, v, params_.numel(id), params_.offset(id), s, decay, config_.state_dtype);
  }
}

}  // namespace moe
