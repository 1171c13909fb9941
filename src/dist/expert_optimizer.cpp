#include "dist/expert_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "dist/zero_optimizer.h"
#include "optim/grad_clip.h"

namespace moe::dist {

ExpertOptimizer::ExpertOptimizer(ParameterStore<float>& params, std::vector<Layer> layers,
                                 const std::vector<ExpertSlots>& slots, int ep_rank, Communicator& expert_data_parallel,
                                 Communicator& world, const OptimizerConfig& config, CommStats& stats)
    : params_(params), slots_(slots), ep_rank_(ep_rank), edp_(expert_data_parallel), world_(world), config_(config),
      stats_(stats) {
  MOE_CHECK(layers.size() == slots.size(), "expert optimizer: {} MoE layers, slots for {}", layers.size(), slots.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    LayerState state;
    for (int id : layers[l].ids)
      MOE_CHECK(params_.spec(id).shape[0] == slots[l].n_experts(), "{} has {} experts, the slots {}",
                params_.spec(id).name, params_.spec(id).shape[0], slots[l].n_experts());
    const auto E = static_cast<size_t>(slots[l].n_experts());
    state.m.assign(layers[l].ids.size(), std::vector<std::vector<float>>(E));
    state.v = state.m;
    state.layer = std::move(layers[l]);
    layers_.push_back(std::move(state));
    for_window(l, [&](size_t i, int64_t expert) {
      const auto n = static_cast<size_t>(per_expert(layers_[l].layer.ids[i]));
      layers_[l].m[i][static_cast<size_t>(expert)].assign(n, 0.0f);
      layers_[l].v[i][static_cast<size_t>(expert)].assign(n, 0.0f);
    });
  }
}

template <class F>
void ExpertOptimizer::for_window(size_t l, F&& f) const {
  const std::vector<int64_t> experts = window_experts(slots_[l], ep_rank_);
  for (size_t i = 0; i < layers_[l].layer.ids.size(); ++i)
    for (int64_t expert : experts) f(i, expert);
}

void ExpertOptimizer::pack(const LayerState& layer, const std::vector<int64_t>& experts,
                           std::vector<float>& buffer) const {
  buffer.clear();
  for (int id : layer.layer.ids)
    for (int64_t expert : experts) {
      const float* g = const_cast<ParameterStore<float>&>(params_).grad(id) + expert * per_expert(id);
      buffer.insert(buffer.end(), g, g + per_expert(id));
    }
}

void ExpertOptimizer::unpack(const LayerState& layer, const std::vector<int64_t>& experts,
                             const std::vector<float>& buffer) {
  const float* in = buffer.data();
  for (int id : layer.layer.ids)
    for (int64_t expert : experts) {
      std::memcpy(params_.grad(id) + expert * per_expert(id), in, static_cast<size_t>(per_expert(id)) * sizeof(float));
      in += per_expert(id);
    }
}

void ExpertOptimizer::on_stage(int stage) {
  if (!armed_) return;
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerState& layer = layers_[l];
    if (layer.layer.stage != stage) continue;
    // The same lists on every rank of a group, as its collective needs: own experts are
    // the same for one EP rank, hinges for all.
    const ExpertSlots& slots = slots_[l];
    const std::vector<std::vector<int>> holders = slot_holders(slots);
    layer.own.clear();
    layer.hinges.clear();
    for (int64_t slot = 0; slot < slots.n_experts(); ++slot) {
      const auto& who = holders[static_cast<size_t>(slot)];
      const int64_t expert = slots.expert_of_slot[static_cast<size_t>(slot)];
      if (who.size() > 1) layer.hinges.push_back(expert);
      else if (!who.empty() && who.front() == ep_rank_) layer.own.push_back(expert);
    }
    if (edp_.size() > 1 && !layer.own.empty()) {
      pack(layer, layer.own, layer.own_buffer);
      layer.own_work = edp_.all_reduce_async(layer.own_buffer.data(), layer.own_buffer.size(), DType::f32, ReduceOp::sum);
    }
    if (world_.size() > 1 && !layer.hinges.empty()) {
      pack(layer, layer.hinges, layer.hinge_buffer);
      layer.hinge_work =
          world_.all_reduce_async(layer.hinge_buffer.data(), layer.hinge_buffer.size(), DType::f32, ReduceOp::sum);
    }
  }
}

void ExpertOptimizer::finish() {
  armed_ = false;
  for (LayerState& layer : layers_) {
    if (layer.own_work) {
      timed_wait(*layer.own_work, stats_);
      layer.own_work.reset();
      unpack(layer, layer.own, layer.own_buffer);
    }
    if (layer.hinge_work) {
      timed_wait(*layer.hinge_work, stats_);
      layer.hinge_work.reset();
      unpack(layer, layer.hinges, layer.hinge_buffer);
    }
  }
}

double ExpertOptimizer::clip_experts(double max_norm) {
  double max_seen = 0;
  for (size_t l = 0; l < layers_.size(); ++l)
    for (int64_t expert : window_experts(slots_[l], ep_rank_)) {
      const auto& ids = layers_[l].layer.ids;
      double sq = 0;
      for (int id : ids) sq += moe::sum_of_squares(params_.grad(id) + expert * per_expert(id), per_expert(id));
      const double norm = std::sqrt(sq);
      max_seen = std::max(max_seen, norm);
      if (max_norm > 0 && norm > max_norm) {
        const auto factor = static_cast<float>(max_norm / (norm + 1e-6));
        for (int id : ids) {
          float* g = params_.grad(id) + expert * per_expert(id);
          for (int64_t i = 0; i < per_expert(id); ++i) g[i] *= factor;
        }
      }
    }
  return max_seen;
}

double ExpertOptimizer::sum_of_squares() const {
  double sq = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const ExpertSlots& slots = slots_[l];
    for (int id : layers_[l].layer.ids)
      for (int64_t slot = slots.first_slot_P1[static_cast<size_t>(ep_rank_)];
           slot < slots.first_slot_P1[static_cast<size_t>(ep_rank_) + 1]; ++slot)
        sq += moe::sum_of_squares(const_cast<ParameterStore<float>&>(params_).grad(id) +
                                      slots.expert_of_slot[static_cast<size_t>(slot)] * per_expert(id),
                                  per_expert(id));
  }
  return sq;
}

void ExpertOptimizer::scale_gradients(float factor) {
  for (size_t l = 0; l < layers_.size(); ++l)
    for_window(l, [&](size_t i, int64_t expert) {
      const int id = layers_[l].layer.ids[i];
      float* g = params_.grad(id) + expert * per_expert(id);
      for (int64_t j = 0; j < per_expert(id); ++j) g[j] *= factor;
    });
}

void ExpertOptimizer::step(double lr) {
  ++steps_;
  const adamw_math::AdamWScalars c = adamw_scalars(config_, lr, steps_);
  const bool bf16 = config_.state_dtype == MomentDtype::Bf16;
  for (size_t l = 0; l < layers_.size(); ++l)
    for_window(l, [&](size_t i, int64_t expert) {
      LayerState& layer = layers_[l];
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id);
      adamw_update(params_.value(id) + expert * n, params_.grad(id) + expert * n,
                   layer.m[i][static_cast<size_t>(expert)].data(), layer.v[i][static_cast<size_t>(expert)].data(), n, c,
                   params_.spec(id).weight_decay, bf16);
    });
}

void ExpertOptimizer::gather_weights(Communicator& expert_parallel) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    const ExpertSlots& slots = slots_[l];
    for (int64_t slot = 0; slot < slots.n_experts(); ++slot) {
      const int64_t expert = slots.expert_of_slot[static_cast<size_t>(slot)];
      const int from = block_rank(slots, slot);
      for (int id : layers_[l].layer.ids)
        timed_blocking(stats_, [&] {
          expert_parallel.broadcast(params_.value(id) + expert * per_expert(id), static_cast<size_t>(per_expert(id)),
                                    DType::f32, from);
        });
    }
  }
}

void ExpertOptimizer::migrate(const std::vector<ExpertSlots>& next, Communicator& expert_parallel) {
  MOE_CHECK(next.size() == layers_.size(), "expert migration: slots of {} layers for {}", next.size(), layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const ExpertSlots &now = slots_[l], &then = next[l];
    MOE_CHECK(then.n_experts() == now.n_experts() && then.ep_size() == now.ep_size(),
              "expert migration: slots of {} experts over {} ranks replace {} over {}", then.n_experts(),
              then.ep_size(), now.n_experts(), now.ep_size());
    LayerState& layer = layers_[l];
    const std::vector<std::vector<int>> had_of_slot = slot_holders(now), will_of_slot = slot_holders(then);
    const std::vector<int32_t> slot_now = slot_of_expert(now), slot_then = slot_of_expert(then);
    std::vector<float> moving, passing;
    for (int64_t expert = 0; expert < now.n_experts(); ++expert) {
      const std::vector<int>& had = had_of_slot[static_cast<size_t>(slot_now[static_cast<size_t>(expert)])];
      const std::vector<int>& will = will_of_slot[static_cast<size_t>(slot_then[static_cast<size_t>(expert)])];
      const bool holds_now = std::count(had.begin(), had.end(), ep_rank_) > 0;
      const bool holds_then = std::count(will.begin(), will.end(), ep_rank_) > 0;
      for (size_t i = 0; i < layer.layer.ids.size(); ++i) {
        std::vector<float>& m = layer.m[i][static_cast<size_t>(expert)];
        std::vector<float>& v = layer.v[i][static_cast<size_t>(expert)];
        if (!std::includes(had.begin(), had.end(), will.begin(), will.end())) {
          // Weights and the two moments, from the block rank.
          const int id = layer.layer.ids[i];
          const int64_t n = per_expert(id);
          const int from = block_rank(now, slot_now[static_cast<size_t>(expert)]);
          moving.assign(static_cast<size_t>(2 * n), 0.0f);
          if (ep_rank_ == from) {
            std::copy_n(m.data(), n, moving.data());
            std::copy_n(v.data(), n, moving.data() + n);
          }
          // The weights land in place only where the expert is held: a rank keeps memory
          // for its own experts only (ParameterStore::set_resident).
          float* weights = params_.value(id) + expert * n;
          if (!holds_now && !holds_then) {
            passing.assign(static_cast<size_t>(n), 0.0f);
            weights = passing.data();
          }
          timed_blocking(stats_, [&] {
            expert_parallel.broadcast(weights, static_cast<size_t>(n), DType::f32, from);
            expert_parallel.broadcast(moving.data(), moving.size(), DType::f32, from);
          });
          if (holds_then && !holds_now) {
            m.assign(moving.begin(), moving.begin() + n);
            v.assign(moving.begin() + n, moving.end());
          }
        }
        if (!holds_then) {
          m = {};
          v = {};
        }
      }
    }
  }
}

void ExpertOptimizer::gather_moments(Communicator& expert_parallel, const std::function<int64_t(int)>& moment_offset,
                                     std::vector<float>& m, std::vector<float>& v) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerState& layer = layers_[l];
    for_window(l, [&](size_t i, int64_t expert) {
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id), at = moment_offset(id) + expert * n;
      std::copy_n(layer.m[i][static_cast<size_t>(expert)].data(), n, m.data() + at);
      std::copy_n(layer.v[i][static_cast<size_t>(expert)].data(), n, v.data() + at);
    });
    const ExpertSlots& slots = slots_[l];
    for (int64_t slot = 0; slot < slots.n_experts(); ++slot) {
      const int64_t expert = slots.expert_of_slot[static_cast<size_t>(slot)];
      const int from = block_rank(slots, slot);
      for (int id : layer.layer.ids) {
        const int64_t n = per_expert(id), at = moment_offset(id) + expert * n;
        timed_blocking(stats_, [&] {
          expert_parallel.broadcast(m.data() + at, static_cast<size_t>(n), DType::f32, from);
          expert_parallel.broadcast(v.data() + at, static_cast<size_t>(n), DType::f32, from);
        });
      }
    }
  }
}

std::vector<ExpertOptimizer::ExpertMoments> ExpertOptimizer::window_moments() {
  std::vector<ExpertMoments> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int32_t> slot = slot_of_expert(slots_[l]);
    for_window(l, [&](size_t i, int64_t expert) {
      LayerState& layer = layers_[l];
      const int id = layer.layer.ids[i];
      const bool in_block = block_rank(slots_[l], slot[static_cast<size_t>(expert)]) == ep_rank_;
      out.push_back({id, expert, per_expert(id), layer.m[i][static_cast<size_t>(expert)].data(),
                     layer.v[i][static_cast<size_t>(expert)].data(), in_block});
    });
  }
  return out;
}

void ExpertOptimizer::scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                                      const std::vector<float>& v) {
  for (size_t l = 0; l < layers_.size(); ++l)
    for_window(l, [&](size_t i, int64_t expert) {
      LayerState& layer = layers_[l];
      const int id = layer.layer.ids[i];
      const int64_t n = per_expert(id), at = moment_offset(id) + expert * n;
      layer.m[i][static_cast<size_t>(expert)].assign(m.begin() + at, m.begin() + at + n);
      layer.v[i][static_cast<size_t>(expert)].assign(v.begin() + at, v.begin() + at + n);
    });
}

}  // namespace moe::dist
