#include "dist/expert_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "dist/zero_optimizer.h"
#include "optim/adamw.h"
#include "optim/grad_clip.h"

namespace moe::dist {

ExpertOptimizer::ExpertOptimizer(ParameterStore<float>& params, std::vector<Layer> layers,
                                 const std::vector<ExpertSlots>& slots, int ep_rank, Communicator& expert_data_parallel,
                                 Communicator& world, const OptimizerConfig& config, CommStats& stats, int zero_level)
    : params_(params), slots_(slots), ep_rank_(ep_rank), edp_(expert_data_parallel), world_(world), config_(config),
      stats_(stats), shares_(params, expert_data_parallel.size(), expert_data_parallel.rank()), level_(zero_level),
      shards_(zero_level >= 1 && expert_data_parallel.size() > 1) {
  MOE_CHECK(zero_level >= 0 && zero_level <= 3, "expert optimizer: no ZeRO level {}", zero_level);
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
    shard_moments(l, slots[l]);
  }
}

std::vector<int64_t> ExpertOptimizer::own_experts(const ExpertSlots& slots) const {
  const std::vector<std::vector<int>> holders = slot_holders(slots);
  std::vector<int64_t> own;
  for (int64_t slot = 0; slot < slots.n_experts(); ++slot) {
    const auto& who = holders[static_cast<size_t>(slot)];
    if (who.size() == 1 && who.front() == ep_rank_) own.push_back(slots.expert_of_slot[static_cast<size_t>(slot)]);
  }
  return own;
}

std::vector<int64_t> ExpertOptimizer::sharded_experts(size_t l) const {
  return shards_ ? own_experts(slots_[l]) : std::vector<int64_t>{};
}

ExpertShares::Share ExpertOptimizer::kept(int id, int64_t expert, const std::vector<int64_t>& sharded) const {
  if (std::count(sharded.begin(), sharded.end(), expert) > 0) return shares_.mine(id);
  return {0, per_expert(id), per_expert(id)};
}

RangeList ExpertOptimizer::others_shares() const {
  RangeList ranges;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const RangeList layer = shares_.others(layers_[l].layer.ids, sharded_experts(l));
    ranges.insert(ranges.end(), layer.begin(), layer.end());
  }
  return merge_ranges(std::move(ranges));
}

void ExpertOptimizer::shard_moments(size_t l, const ExpertSlots& slots) {
  if (!shards_) return;
  LayerState& layer = layers_[l];
  for (size_t i = 0; i < layer.layer.ids.size(); ++i)
    for (int64_t expert : own_experts(slots)) {
      const ExpertShares::Share mine = shares_.mine(layer.layer.ids[i]);
      for (auto* moments : {&layer.m, &layer.v}) {
        std::vector<float>& whole = (*moments)[i][static_cast<size_t>(expert)];
        whole = std::vector<float>(whole.begin() + mine.begin, whole.begin() + mine.begin + mine.count);
      }
    }
}

void ExpertOptimizer::unshard_moments(size_t l, const ExpertSlots& slots) {
  if (!shards_) return;
  LayerState& layer = layers_[l];
  for (size_t i = 0; i < layer.layer.ids.size(); ++i)
    for (int64_t expert : own_experts(slots)) {
      const int64_t n = per_expert(layer.layer.ids[i]);
      const ExpertShares::Share mine = shares_.mine(layer.layer.ids[i]);
      for (auto* moments : {&layer.m, &layer.v}) {
        std::vector<float>& part = (*moments)[i][static_cast<size_t>(expert)];
        // Rank r's share lands at r * padded = its begin: the first n elements are the whole.
        std::vector<float> send(static_cast<size_t>(mine.padded), 0.0f), whole(static_cast<size_t>(mine.padded * edp_.size()));
        std::copy(part.begin(), part.end(), send.begin());
        timed_blocking(stats_, [&] { edp_.all_gather(send.data(), whole.data(), send.size(), DType::f32); });
        whole.resize(static_cast<size_t>(n));
        part = std::move(whole);
      }
    }
}

std::vector<float*> ExpertOptimizer::grads_of(const LayerState& layer) {
  std::vector<float*> grads;
  for (int id : layer.layer.ids) grads.push_back(params_.grad(id));
  return grads;
}

std::vector<float*> ExpertOptimizer::values_of(const LayerState& layer) {
  std::vector<float*> values;
  for (int id : layer.layer.ids) values.push_back(params_.value(id));
  return values;
}

// After step() below level 3: every rank's updated shares of the own experts' weights, into every replica.
void ExpertOptimizer::gather_updated_shares(LayerState& layer, const std::vector<int64_t>& experts) {
  const std::vector<float*> values = values_of(layer);
  const int64_t per_rank = shares_.per_rank(layer.layer.ids, experts);
  std::vector<float> all(static_cast<size_t>(per_rank * edp_.size()));
  float* mine = all.data() + edp_.rank() * per_rank;
  shares_.pack(layer.layer.ids, experts, values, edp_.rank(), mine);
  timed_blocking(stats_, [&] { edp_.all_gather(mine, all.data(), static_cast<size_t>(per_rank), DType::f32); });
  for (int r = 0; r < edp_.size(); ++r)
    if (r != edp_.rank()) shares_.unpack(layer.layer.ids, experts, all.data() + r * per_rank, r, values);
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
  // Level 2-3 reduce-scatter the own experts on every micro-batch (the hinges still once a step).
  const bool every_micro_batch = shards_ && level_ >= 2;
  if (!armed_ && !every_micro_batch) return;
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
    if (shards_ && !layer.own.empty()) {
      // Level 2-3: this rank's shares hold the running sum plus this micro-batch's
      // gradient, the others only this micro-batch's (released since the last scatter),
      // so the scatter leaves the sum of the step so far.
      const int64_t per_rank = shares_.per_rank(layer.layer.ids, layer.own);
      const std::vector<float*> grads = grads_of(layer);
      layer.own_buffer.resize(static_cast<size_t>(per_rank * edp_.size()));
      for (int r = 0; r < edp_.size(); ++r)
        shares_.pack(layer.layer.ids, layer.own, grads, r, layer.own_buffer.data() + r * per_rank);
      layer.own_share.resize(static_cast<size_t>(per_rank));
      layer.own_work = edp_.reduce_scatter_async(layer.own_buffer.data(), layer.own_share.data(), layer.own_share.size(),
                                                 DType::f32, ReduceOp::sum);
      if (every_micro_batch) scattering_.push_back(l);
    } else if (edp_.size() > 1 && !layer.own.empty()) {
      pack(layer, layer.own, layer.own_buffer);
      layer.own_work = edp_.all_reduce_async(layer.own_buffer.data(), layer.own_buffer.size(), DType::f32, ReduceOp::sum);
    }
    if (armed_ && world_.size() > 1 && !layer.hinges.empty()) {
      pack(layer, layer.hinges, layer.hinge_buffer);
      layer.hinge_work =
          world_.all_reduce_async(layer.hinge_buffer.data(), layer.hinge_buffer.size(), DType::f32, ReduceOp::sum);
    }
  }
  // One layer in flight while the next computes: at most two layers' whole expert gradients live.
  if (every_micro_batch) retire_scatters(1);
}

void ExpertOptimizer::retire_scatters(size_t keep) {
  while (scattering_.size() > keep) {
    LayerState& layer = layers_[scattering_.front()];
    scattering_.erase(scattering_.begin());
    timed_wait(*layer.own_work, stats_);
    layer.own_work.reset();
    shares_.unpack(layer.layer.ids, layer.own, layer.own_share.data(), edp_.rank(), grads_of(layer));
    params_.release_grads(shares_.others(layer.layer.ids, layer.own));
    std::vector<float>().swap(layer.own_buffer);  // give the packed copies back too
    std::vector<float>().swap(layer.own_share);
  }
}

void ExpertOptimizer::end_micro_batch() { retire_scatters(0); }

void ExpertOptimizer::finish() {
  armed_ = false;
  retire_scatters(0);
  for (LayerState& layer : layers_) {
    if (layer.own_work) {
      timed_wait(*layer.own_work, stats_);
      layer.own_work.reset();
      // Sharded: only this rank's shares are summed, the rest of the own experts' gradients is stale.
      if (shards_) shares_.unpack(layer.layer.ids, layer.own, layer.own_share.data(), edp_.rank(), grads_of(layer));
      else unpack(layer, layer.own, layer.own_buffer);
    }
    if (layer.hinge_work) {
      timed_wait(*layer.hinge_work, stats_);
      layer.hinge_work.reset();
      unpack(layer, layer.hinges, layer.hinge_buffer);
    }
    // The packed copies live only while the sums are in flight (the size of the window's gradients).
    for (auto* buffer : {&layer.own_buffer, &layer.own_share, &layer.hinge_buffer}) std::vector<float>().swap(*buffer);
  }
}

double ExpertOptimizer::clip_experts(double max_norm) {
  // Each window expert's squares; a sharded expert's are its shares' partial sums, summed
  // over the group (every rank of it has the same own experts, in the same order).
  struct Entry {
    size_t l;
    int64_t expert;
    bool sharded;
    double sq = 0;
  };
  std::vector<Entry> entries;
  std::vector<double> shared_sq;
  std::vector<std::vector<int64_t>> sharded(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    sharded[l] = sharded_experts(l);
    for (int64_t expert : window_experts(slots_[l], ep_rank_)) {
      Entry e{l, expert, std::count(sharded[l].begin(), sharded[l].end(), expert) > 0};
      for (int id : layers_[l].layer.ids) {
        const ExpertShares::Share part = kept(id, expert, sharded[l]);
        e.sq += moe::sum_of_squares(params_.grad(id) + expert * per_expert(id) + part.begin, part.count);
      }
      if (e.sharded) shared_sq.push_back(e.sq);
      entries.push_back(e);
    }
  }
  if (!shared_sq.empty())
    timed_blocking(stats_, [&] { edp_.all_reduce(shared_sq.data(), shared_sq.size(), DType::f64, ReduceOp::sum); });
  double max_seen = 0;
  size_t next_shared = 0;
  for (const Entry& e : entries) {
    const double norm = std::sqrt(e.sharded ? shared_sq[next_shared++] : e.sq);
    max_seen = std::max(max_seen, norm);
    if (max_norm > 0 && norm > max_norm) {
      const auto factor = static_cast<float>(max_norm / (norm + 1e-6));
      for (int id : layers_[e.l].layer.ids) {
        // A sharded expert: its share only (the rest is stale, or released at level 2-3).
        const ExpertShares::Share part = kept(id, e.expert, sharded[e.l]);
        float* g = params_.grad(id) + e.expert * per_expert(id) + part.begin;
        for (int64_t i = 0; i < part.count; ++i) g[i] *= factor;
      }
    }
  }
  return max_seen;
}

double ExpertOptimizer::sum_of_squares() const {
  double sq = 0;
  auto& params = const_cast<ParameterStore<float>&>(params_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const ExpertSlots& slots = slots_[l];
    const std::vector<int64_t> sharded = sharded_experts(l);
    for (int id : layers_[l].layer.ids)
      for (int64_t slot = slots.first_slot_P1[static_cast<size_t>(ep_rank_)];
           slot < slots.first_slot_P1[static_cast<size_t>(ep_rank_) + 1]; ++slot) {
        const int64_t expert = slots.expert_of_slot[static_cast<size_t>(slot)];
        const bool is_sharded = std::count(sharded.begin(), sharded.end(), expert) > 0;
        if (!is_sharded && edp_.rank() != 0) continue;  // whole on every replica: the first counts it
        const ExpertShares::Share part = kept(id, expert, sharded);
        sq += moe::sum_of_squares(params.grad(id) + expert * per_expert(id) + part.begin, part.count);
      }
  }
  return sq;
}

void ExpertOptimizer::scale_gradients(float factor) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int64_t> sharded = sharded_experts(l);
    for_window(l, [&](size_t i, int64_t expert) {
      const int id = layers_[l].layer.ids[i];
      const ExpertShares::Share part = kept(id, expert, sharded);
      float* g = params_.grad(id) + expert * per_expert(id) + part.begin;
      for (int64_t j = 0; j < part.count; ++j) g[j] *= factor;
    });
  }
}

void ExpertOptimizer::step(double lr) {
  ++steps_;
  const adamw_math::AdamWScalars c = adamw_scalars(config_, lr, steps_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerState& layer = layers_[l];
    const std::vector<int64_t> sharded = sharded_experts(l);
    for_window(l, [&](size_t i, int64_t expert) {
      const int id = layer.layer.ids[i];
      const int64_t at = expert * per_expert(id) + kept(id, expert, sharded).begin;
      adamw_update_range(params_.value(id) + at, params_.grad(id) + at, layer.m[i][static_cast<size_t>(expert)].data(),
                         layer.v[i][static_cast<size_t>(expert)].data(), kept(id, expert, sharded).count, params_.offset(id) + at, c,
                         params_.spec(id).weight_decay ? c.decay_factor : 1.0f, config_.state_dtype);
    });
    // Level 3 leaves the updated shares where they were stepped (ExpertParameterGather).
    if (!sharded.empty() && level_ < 3) gather_updated_shares(layer, sharded);
  }
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
    unshard_moments(l, now);  // whole around the move; cut again to `then`'s own experts below
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
    shard_moments(l, then);
  }
}

std::vector<ExpertOptimizer::ExpertMoments> ExpertOptimizer::window_moments() {
  std::vector<ExpertMoments> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int32_t> slot = slot_of_expert(slots_[l]);
    const std::vector<int64_t> own = sharded_experts(l);
    for_window(l, [&](size_t i, int64_t expert) {
      LayerState& layer = layers_[l];
      const int id = layer.layer.ids[i];
      const bool in_block = block_rank(slots_[l], slot[static_cast<size_t>(expert)]) == ep_rank_;
      const bool sharded = std::count(own.begin(), own.end(), expert) > 0;
      const ExpertShares::Share part = kept(id, expert, own);
      out.push_back({id, expert, per_expert(id), part.begin, part.count, layer.m[i][static_cast<size_t>(expert)].data(),
                     layer.v[i][static_cast<size_t>(expert)].data(), in_block, sharded});
    });
  }
  return out;
}

int64_t ExpertOptimizer::moment_elements() const {
  int64_t n = 0;
  for (const LayerState& layer : layers_)
    for (const auto* moments : {&layer.m, &layer.v})
      for (const auto& of_id : *moments)
        for (const auto& of_expert : of_id) n += static_cast<int64_t>(of_expert.size());
  return n;
}

}  // namespace moe::dist
