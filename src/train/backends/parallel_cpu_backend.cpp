#include "train/backends/parallel_cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moe {
using namespace dist;  // the process groups, exchanges and ZeRO this backend drives


ParallelCpuBackend::ParallelCpuBackend(const RunConfig& config, Transformer<float>& model,
                                       std::unique_ptr<Communicator> world)
    : config_(config), model_(model) {
  const ParallelConfig& pc = config.parallel;
  const auto ep = static_cast<int>(pc.expert_parallel);
  if (world->size() % ep != 0)
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} must divide the number of ranks ({})", ep, world->size());
  if (pc.split_experts)
    MOE_CONFIG_ERROR("parallel.split_experts is for GPU expert parallelism (training.device = cuda); the CPU path "
                     "places whole experts");
  groups_ = make_process_groups(std::move(world), ep);
  batch_ = std::make_unique<BatchGroupOverComm>(*groups_.data_parallel, stats_);
  std::vector<ExpertExchange*> exchanges;
  const auto moe_layers = model_.moe_layers();
  if (ep > 1) {
    a2a_ = make_all_to_all(pc.all_to_all, *groups_.expert_parallel, groups_);
    placement_ = std::make_unique<ExpertPlacement>(ExpertPlacement::contiguous(config.model.moe.n_experts, ep));
    for (size_t i = 0; i < moe_layers.size(); ++i) {
      exchanges_.push_back(
          std::make_unique<ExpertExchangeOverComm>(*a2a_, *placement_, static_cast<int>(pc.a2a_chunks), stats_));
      exchanges.push_back(exchanges_.back().get());
    }
  }
  model_.set_moe_parallel(batch_.get(), exchanges);

  // Expert weights go to the EP owners when EP > 1; everything else is ZeRO-sharded in the
  // GPU's layout: the router biases, which the GPU keeps whole for its fp32 copies, are
  // kept whole here too, so that both paths shard the same block the same way.
  auto& params = model_.params();
  auto stage_of = [&](int id) { return model_.backward_stage_of(params.spec(id).name); };
  std::vector<int> router_biases, experts_elsewhere;
  std::map<std::string, std::vector<int>> expert_ids;  // expert_group -> ids, in id order
  std::vector<std::string> group_order;
  for (int id = 0; id < params.size(); ++id) {
    const std::string& group = params.spec(id).expert_group;
    if (!group.empty()) {
      if (!expert_ids.count(group)) group_order.push_back(group);
      expert_ids[group].push_back(id);
      if (ep > 1) experts_elsewhere.push_back(id);
    }
    if (params.spec(id).name.ends_with(".moe.router.bias")) router_biases.push_back(id);
  }
  const dist::Communicator& dp = *groups_.data_parallel;
  zero_ = std::make_unique<ZeroOptimizer>(
      params,
      plan_zero_for_store(
          params, [&](const std::string& name) { return model_.backward_stage_of(name); }, model_.backward_stages(),
          router_biases, experts_elsewhere, pc.bucket_mb, dp.size(), dp.rank()),
      *groups_.data_parallel, config.optimizer, stats_);
  if (ep > 1) {
    std::vector<ExpertOptimizer::Layer> layers;
    for (const auto& group : group_order) layers.push_back({expert_ids[group], stage_of(expert_ids[group].front())});
    experts_ = std::make_unique<ExpertOptimizer>(params, std::move(layers), *placement_, groups_.expert_parallel->rank(),
                                                 *groups_.expert_data_parallel, config.optimizer, stats_);
  } else {
    expert_group_of_id_.assign(static_cast<size_t>(params.size()), -1);
    for (size_t g = 0; g < group_order.size(); ++g)
      for (int id : expert_ids[group_order[g]]) expert_group_of_id_[static_cast<size_t>(id)] = static_cast<int>(g);
    n_expert_groups_ = static_cast<int64_t>(group_order.size());
  }
  model_.on_backward_stage = [this](int stage) {
    zero_->on_stage(stage);
    if (experts_) experts_->on_stage(stage);
  };
}

ParallelCpuBackend::~ParallelCpuBackend() {
  model_.on_backward_stage = nullptr;
  model_.set_moe_parallel(nullptr, {});
}

double ParallelCpuBackend::world_sum(double value) {
  batch_->sum(&value, 1);
  return value;
}

void ParallelCpuBackend::begin_step() {
  model_.params().zero_grads();
  for (auto* layer : model_.moe_layers()) layer->reset_load();
}

ForwardResult ParallelCpuBackend::forward(const int32_t* inputs_BS, const int32_t* targets_BS) {
  const int64_t tokens = model_.planned_batch() * config_.model.seq_len;
  const auto local = static_cast<double>(std::count_if(targets_BS, targets_BS + tokens, [](int32_t t) { return t >= 0; }));
  const double total = world_sum(local);
  ForwardResult fwd = model_.forward(inputs_BS, targets_BS);
  ce_weight_ = total > 0 ? local / total : 0.0;
  fwd.ce_loss *= ce_weight_;  // the sum over the ranks is the global micro-batch's mean
  return fwd;
}

void ParallelCpuBackend::backward(double loss_scale, bool last) {
  if (last) {
    zero_->arm();
    if (experts_) experts_->arm();
  }
  model_.backward(loss_scale * ce_weight_, loss_scale);
}

void ParallelCpuBackend::reduce_losses(StepStats& stats) {
  // aux and z losses are already global (the same on every rank); cross-entropy and drops are shares.
  double values[2] = {stats.loss, static_cast<double>(stats.dropped)};
  batch_->sum(values, 2);
  stats.loss = values[0];
  stats.dropped = std::llround(values[1]);
}

void ParallelCpuBackend::routing(StepStats& stats) {
  const ModelConfig& m = config_.model;
  const auto E = static_cast<size_t>(m.moe.n_experts);
  auto layers = model_.moe_layers();
  // Per layer: kept per expert, load per expert, dropped, entropy sum, tokens.
  const size_t per_layer = 2 * E + 3;
  std::vector<double> sums(per_layer * layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    double* s = sums.data() + i * per_layer;
    const MoERoutingStats& r = layers[i]->routing_stats();
    for (size_t e = 0; e < E; ++e) {
      s[e] = static_cast<double>(r.kept_E[e]);
      s[E + e] = static_cast<double>(layers[i]->load_E()[e]);
    }
    s[2 * E] = static_cast<double>(r.dropped);
    s[2 * E + 1] = r.entropy_sum;
    s[2 * E + 2] = static_cast<double>(r.tokens);
  }
  batch_->sum(sums.data(), static_cast<int64_t>(sums.size()));
  global_load_.assign(layers.size(), std::vector<int64_t>(E));
  stats.load_imbalance = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const double* s = sums.data() + i * per_layer;
    LayerRouting r;
    r.layer = m.first_dense_layers + static_cast<int64_t>(i);
    r.tokens_E.resize(E);
    for (size_t e = 0; e < E; ++e) {
      r.tokens_E[e] = std::llround(s[e]);
      global_load_[i][e] = std::llround(s[E + e]);
    }
    r.dropped = std::llround(s[2 * E]);
    const double tokens = s[2 * E + 2];
    r.assignments = std::llround(tokens) * m.moe.top_k;
    r.router_entropy = tokens > 0 ? s[2 * E + 1] / tokens : 0;
    if (m.moe.bias_balancing) r.bias_E.assign(layers[i]->balance_bias_E().begin(), layers[i]->balance_bias_E().end());
    stats.load_imbalance = std::max(stats.load_imbalance, load_imbalance(global_load_[i]));
    stats.layers.push_back(std::move(r));
  }
  if (placement_) {
    for (int p = 0; p < placement_->ep_size(); ++p) {
      RankLoad rank;
      rank.rank = p;
      for (int64_t e : placement_->experts_of(p)) {
        rank.experts.push_back(e);
        int64_t load = 0;
        for (const auto& layer : stats.layers) load += layer.tokens_E[static_cast<size_t>(e)];
        rank.load.push_back(load);
      }
      stats.ranks.push_back(std::move(rank));
    }
  }
}

ClipStats ParallelCpuBackend::clip_gradients(double max_global_norm, double max_expert_norm) {
  zero_->finish();
  if (experts_) experts_->finish();
  ClipStats clip;
  if (experts_) {
    double max_seen = experts_->clip_experts(max_expert_norm);
    timed_blocking(stats_, [&] { groups_.world->all_reduce(&max_seen, 1, dist::DType::f64, ReduceOp::max); });
    clip.max_expert_norm = max_seen;
  } else if (n_expert_groups_ > 0) {
    // Expert weights are spread over the shards: sum each expert's squares over the ranks.
    const int64_t E = config_.model.moe.n_experts;
    std::vector<double> sums(static_cast<size_t>(n_expert_groups_ * E), 0.0);
    zero_->add_expert_sums_of_squares(expert_group_of_id_, sums);
    batch_->sum(sums.data(), static_cast<int64_t>(sums.size()));
    std::vector<float> factors(sums.size(), 1.0f);
    for (size_t i = 0; i < sums.size(); ++i) {
      const double norm = std::sqrt(sums[i]);
      clip.max_expert_norm = std::max(clip.max_expert_norm, norm);
      if (max_expert_norm > 0 && norm > max_expert_norm) {
        factors[i] = static_cast<float>(max_expert_norm / (norm + 1e-6));
        ++clip.experts_clipped;
      }
    }
    if (clip.experts_clipped > 0) zero_->scale_experts(expert_group_of_id_, factors);
  }
  // Shards are disjoint; replicas of an expert are counted on the first EP group only.
  double sq = zero_->shard_sum_of_squares();
  if (experts_ && groups_.expert_data_parallel->rank() == 0) sq += experts_->sum_of_squares();
  clip.global_norm = std::sqrt(world_sum(sq));
  if (max_global_norm > 0 && clip.global_norm > max_global_norm) {
    clip.global_clipped = true;
    const auto factor = static_cast<float>(max_global_norm / (clip.global_norm + 1e-6));
    zero_->scale_gradients(factor);
    if (experts_) experts_->scale_gradients(factor);
  }
  return clip;
}

void ParallelCpuBackend::apply_update(double lr) {
  zero_->step(lr);
  if (experts_) experts_->step(lr);
  if (config_.model.moe.bias_balancing) {
    auto layers = model_.moe_layers();
    for (size_t i = 0; i < layers.size(); ++i) {
      if (i < global_load_.size()) layers[i]->set_load(global_load_[i]);
      layers[i]->update_balancing_bias();
    }
  }
}

void ParallelCpuBackend::end_step() {
  for (auto* layer : model_.moe_layers()) layer->reset_load();
  if (experts_ && config_.parallel.rebalance_interval > 0) rebalance_experts();
}

// Dynamic load balancing: the global loads are the same on every rank, so every rank
// computes the same placement; moved experts take their weights and moments along.
void ParallelCpuBackend::rebalance_experts() {
  load_since_placement_.resize(static_cast<size_t>(config_.model.moe.n_experts), 0);
  for (const auto& layer : global_load_)
    for (size_t e = 0; e < layer.size(); ++e) load_since_placement_[e] += layer[e];
  if (++steps_since_placement_ < config_.parallel.rebalance_interval) return;
  // With node-first routing over groups that map onto blocks of EP ranks, experts stay in
  // their group's block (so a token still reaches only route_top_groups of them).
  const int64_t groups = config_.model.moe.route_groups;
  const int ep = placement_->ep_size();
  const bool grouped = groups > 1 && ep % groups == 0;
  const ExpertPlacement next = ExpertPlacement::balanced(load_since_placement_, ep, grouped ? groups : 1,
                                                         config_.parallel.rebalance_max_experts);
  // Only a better spread is worth the moves (ties keep the experts where they are).
  const auto now = placement_->rank_loads(load_since_placement_), then = next.rank_loads(load_since_placement_);
  if (*std::max_element(then.begin(), then.end()) < *std::max_element(now.begin(), now.end())) {
    experts_->migrate(next, *groups_.expert_parallel);
    *placement_ = next;
  }
  std::fill(load_since_placement_.begin(), load_since_placement_.end(), 0);
  steps_since_placement_ = 0;
}

std::string ParallelCpuBackend::placement_state() const {
  if (!experts_ || config_.parallel.rebalance_interval <= 0) return {};
  nlohmann::json state;
  state["ep_size"] = placement_->ep_size();
  std::vector<int> rank_of_expert;
  for (int64_t e = 0; e < placement_->n_experts(); ++e) rank_of_expert.push_back(placement_->rank_of(e));
  state["rank_of_expert"] = rank_of_expert;
  state["steps_since_placement"] = steps_since_placement_;
  state["load_since_placement"] = load_since_placement_;
  return state.dump();
}

// After scatter_state (the contiguous blocks hold the checkpoint's values): the saved
// placement's experts move to their ranks as a re-placement moves them.
void ParallelCpuBackend::restore_placement(const std::string& text) {
  if (!experts_ || text.empty() || config_.parallel.rebalance_interval <= 0) return;
  const nlohmann::json state = nlohmann::json::parse(text, nullptr, false);
  MOE_CHECK(!state.is_discarded() && state.is_object(), "checkpoint: expert_placement is not JSON");
  const auto rank_of_expert = state.value("rank_of_expert", std::vector<int>{});
  if (state.value("ep_size", 0) != placement_->ep_size() ||
      static_cast<int64_t>(rank_of_expert.size()) != placement_->n_experts())
    return;  // another EP layout (or a GPU run's record): the contiguous blocks
  const ExpertPlacement saved(rank_of_expert, placement_->ep_size());
  experts_->migrate(saved, *groups_.expert_parallel);
  *placement_ = saved;
  steps_since_placement_ = state.value("steps_since_placement", int64_t{0});
  load_since_placement_ = state.value("load_since_placement", std::vector<int64_t>{});
}

double ParallelCpuBackend::sum_over_ranks(double value) { return world_sum(value); }

void ParallelCpuBackend::end_validation() {
  for (auto* layer : model_.moe_layers()) layer->reset_load();
  stats_ = CommStats{};  // validation's exchanges are not a training step's
}

void ParallelCpuBackend::take_comm_stats(StepStats& stats) {
  stats.time.comm_wait += stats_.wait_s;
  stats.grad_sync_ms += stats_.grad_sync_s * 1e3;
  stats.a2a_bytes += stats_.a2a_bytes;
  stats.a2a_seconds += stats_.a2a_s;
  stats_ = CommStats{};
}

void ParallelCpuBackend::sync_host_model() {
  if (experts_) experts_->gather_weights(*groups_.expert_parallel);
  stats_ = CommStats{};
}

void ParallelCpuBackend::gather_state(AdamW& optimizer) {
  // ZeRO all-gathers the dense parameters after every step; the experts live on their holders.
  sync_host_model();
  const auto offset = [&optimizer](int id) { return optimizer.moment_offset(id); };
  zero_->gather_moments(offset, optimizer.first_moment(), optimizer.second_moment());
  if (experts_)
    experts_->gather_moments(*groups_.expert_parallel, offset, optimizer.first_moment(), optimizer.second_moment());
  optimizer.set_steps_taken(zero_->steps_taken());
  stats_ = CommStats{};
}

void ParallelCpuBackend::scatter_state(AdamW& optimizer) {
  const auto offset = [&optimizer](int id) { return optimizer.moment_offset(id); };
  zero_->scatter_moments(offset, optimizer.first_moment(), optimizer.second_moment());
  zero_->set_steps_taken(optimizer.steps_taken());
  if (experts_) {
    experts_->scatter_moments(offset, optimizer.first_moment(), optimizer.second_moment());
    experts_->set_steps_taken(optimizer.steps_taken());
  }
}

}  // namespace moe
