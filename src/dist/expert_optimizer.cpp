#include "dist/expert_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "dist/zero_optimizer.h"
#include "optim/grad_clip.h"

namespace moe::dist {

ExpertOptimizer::ExpertOptimizer(ParameterStore<float>& params, std::vector<Layer> layers,
                                 const ExpertPlacement& placement, int ep_rank, Communicator& expert_data_parallel,
                                 const OptimizerConfig& config, CommStats& stats)
    : params_(params), placement_(placement), ep_rank_(ep_rank), edp_(expert_data_parallel), config_(config),
      stats_(stats) {
  const auto held = static_cast<int64_t>(placement_.experts_of(ep_rank_).size());
  for (Layer& layer : layers) {
    LayerState state;
    int64_t packed = 0;
    for (int id : layer.ids) {
      MOE_CHECK(params_.spec(id).shape[0] == placement_.n_experts(), "{} has {} experts, the placement {}",
                params_.spec(id).name, params_.spec(id).shape[0], placement_.n_experts());
      packed += held * per_expert(id);
      state.m.emplace_back(static_cast<size_t>(held * per_expert(id)), 0.0f);
      state.v.emplace_back(static_cast<size_t>(held * per_expert(id)), 0.0f);
    }
    state.buffer.assign(static_cast<size_t>(packed), 0.0f);
    state.layer = std::move(layer);
    layers_.push_back(std::move(state));
  }
}

template <class F>
void ExpertOptimizer::for_held(const LayerState& layer, F&& f) const {
  const auto& experts = placement_.experts_of(ep_rank_);
  for (size_t i = 0; i < layer.layer.ids.size(); ++i)
    for (size_t slot = 0; slot < experts.size(); ++slot) f(i, experts[slot], static_cast<int64_t>(slot));
}

void ExpertOptimizer::on_stage(int stage) {
  if (!armed_ || edp_.size() == 1) return;
  for (LayerState& layer : layers_) {
    if (layer.layer.stage != stage) continue;
    float* out = layer.buffer.data();
    for_held(layer, [&](size_t i, int64_t expert, int64_t) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id);
      std::memcpy(out, params_.grad(id) + expert * n, static_cast<size_t>(n) * sizeof(float));
      out += n;
    });
    layer.work = edp_.all_reduce_async(layer.buffer.data(), layer.buffer.size(), DType::f32, ReduceOp::sum);
  }
}

void ExpertOptimizer::finish() {
  armed_ = false;
  for (LayerState& layer : layers_) {
    if (!layer.work) continue;
    timed_wait(*layer.work, stats_);
    layer.work.reset();
    const float* in = layer.buffer.data();
    for_held(layer, [&](size_t i, int64_t expert, int64_t) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id);
      std::memcpy(params_.grad(id) + expert * n, in, static_cast<size_t>(n) * sizeof(float));
      in += n;
    });
  }
}

double ExpertOptimizer::clip_experts(double max_norm) {
  double max_seen = 0;
  for (const LayerState& layer : layers_)
    for (int64_t expert : placement_.experts_of(ep_rank_)) {
      double sq = 0;
      for (int id : layer.layer.ids) sq += moe::sum_of_squares(params_.grad(id) + expert * per_expert(id), per_expert(id));
      const double norm = std::sqrt(sq);
      max_seen = std::max(max_seen, norm);
      if (max_norm > 0 && norm > max_norm) {
        const auto factor = static_cast<float>(max_norm / (norm + 1e-6));
        for (int id : layer.layer.ids) {
          float* g = params_.grad(id) + expert * per_expert(id);
          for (int64_t i = 0; i < per_expert(id); ++i) g[i] *= factor;
        }
      }
    }
  return max_seen;
}

double ExpertOptimizer::sum_of_squares() const {
  double sq = 0;
  for (const LayerState& layer : layers_)
    for_held(layer, [&](size_t i, int64_t expert, int64_t) {
      const int id = layer.layer.ids[i];
      sq += moe::sum_of_squares(const_cast<ParameterStore<float>&>(params_).grad(id) + expert * per_expert(id),
                                per_expert(id));
    });
  return sq;
}

void ExpertOptimizer::scale_gradients(float factor) {
  for (const LayerState& layer : layers_)
    for_held(layer, [&](size_t i, int64_t expert, int64_t) {
      const int id = layer.layer.ids[i];
      float* g = params_.grad(id) + expert * per_expert(id);
      for (int64_t j = 0; j < per_expert(id); ++j) g[j] *= factor;
    });
}

void ExpertOptimizer::step(double lr) {
  ++steps_;
  const adamw_math::AdamWScalars c = adamw_scalars(config_, lr, steps_);
  const bool bf16 = config_.state_dtype == MomentDtype::Bf16;
  for (LayerState& layer : layers_)
    for_held(layer, [&](size_t i, int64_t expert, int64_t slot) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id);
      adamw_update(params_.value(id) + expert * n, params_.grad(id) + expert * n, layer.m[i].data() + slot * n,
                   layer.v[i].data() + slot * n, n, c, params_.spec(id).weight_decay, bf16);
    });
}

void ExpertOptimizer::gather_weights(Communicator& expert_parallel) {
  for (const LayerState& layer : layers_)
    for (int64_t expert = 0; expert < placement_.n_experts(); ++expert)
      for (int id : layer.layer.ids)
        timed_blocking(stats_, [&] {
          expert_parallel.broadcast(params_.value(id) + expert * per_expert(id), static_cast<size_t>(per_expert(id)),
                                    DType::f32, placement_.rank_of(expert));
        });
}

void ExpertOptimizer::migrate(const ExpertPlacement& next, Communicator& expert_parallel) {
  MOE_CHECK(next.n_experts() == placement_.n_experts() && next.ep_size() == placement_.ep_size(),
            "expert migration: a placement of {} experts over {} ranks replaces one of {} over {}", next.n_experts(),
            next.ep_size(), placement_.n_experts(), placement_.ep_size());
  const auto held_next = static_cast<int64_t>(next.experts_of(ep_rank_).size());
  for (LayerState& layer : layers_) {
    int64_t packed = 0;
    for (size_t i = 0; i < layer.layer.ids.size(); ++i) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id);
      std::vector<float> m(static_cast<size_t>(held_next * n)), v(static_cast<size_t>(held_next * n)), moving;
      for (int64_t expert = 0; expert < placement_.n_experts(); ++expert) {
        const int from = placement_.rank_of(expert), to = next.rank_of(expert);
        const int64_t old_slot = placement_.slot_of(expert), new_slot = next.slot_of(expert);
        if (from == to) {
          if (to == ep_rank_) {
            std::copy_n(layer.m[i].data() + old_slot * n, n, m.data() + new_slot * n);
            std::copy_n(layer.v[i].data() + old_slot * n, n, v.data() + new_slot * n);
          }
          continue;
        }
        // Weights (every rank's copy, as gather_weights) and the two moments, from the old holder.
        moving.assign(static_cast<size_t>(2 * n), 0.0f);
        if (from == ep_rank_) {
          std::copy_n(layer.m[i].data() + old_slot * n, n, moving.data());
          std::copy_n(layer.v[i].data() + old_slot * n, n, moving.data() + n);
        }
        timed_blocking(stats_, [&] {
          expert_parallel.broadcast(params_.value(id) + expert * n, static_cast<size_t>(n), DType::f32, from);
          expert_parallel.broadcast(moving.data(), moving.size(), DType::f32, from);
        });
        if (to == ep_rank_) {
          std::copy_n(moving.data(), n, m.data() + new_slot * n);
          std::copy_n(moving.data() + n, n, v.data() + new_slot * n);
        }
      }
      layer.m[i] = std::move(m);
      layer.v[i] = std::move(v);
      packed += held_next * n;
    }
    layer.buffer.assign(static_cast<size_t>(packed), 0.0f);
  }
}

void ExpertOptimizer::gather_moments(Communicator& expert_parallel, const std::function<int64_t(int)>& moment_offset,
                                     std::vector<float>& m, std::vector<float>& v) {
  for (const LayerState& layer : layers_)
    for_held(layer, [&](size_t i, int64_t expert, int64_t slot) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id), at = moment_offset(id) + expert * n;
      std::memcpy(m.data() + at, layer.m[i].data() + slot * n, static_cast<size_t>(n) * sizeof(float));
      std::memcpy(v.data() + at, layer.v[i].data() + slot * n, static_cast<size_t>(n) * sizeof(float));
    });
  for (const LayerState& layer : layers_)
    for (int64_t expert = 0; expert < placement_.n_experts(); ++expert)
      for (int id : layer.layer.ids) {
        const int64_t n = per_expert(id), at = moment_offset(id) + expert * n;
        timed_blocking(stats_, [&] {
          expert_parallel.broadcast(m.data() + at, static_cast<size_t>(n), DType::f32, placement_.rank_of(expert));
          expert_parallel.broadcast(v.data() + at, static_cast<size_t>(n), DType::f32, placement_.rank_of(expert));
        });
      }
}

void ExpertOptimizer::scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                                      const std::vector<float>& v) {
  for (LayerState& layer : layers_)
    for_held(layer, [&](size_t i, int64_t expert, int64_t slot) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id), at = moment_offset(id) + expert * n;
      std::memcpy(layer.m[i].data() + slot * n, m.data() + at, static_cast<size_t>(n) * sizeof(float));
      std::memcpy(layer.v[i].data() + slot * n, v.data() + at, static_cast<size_t>(n) * sizeof(float));
    });
}

}  // namespace moe::dist
