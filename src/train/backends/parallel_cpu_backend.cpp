#include "train/backends/parallel_cpu_backend.h"
#include "train/backends/rank_loads.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <spdlog/spdlog.h>

#include "core/error.h"
#include "moe/expert_placement.h"

namespace moe {
using namespace dist;  // the process groups, exchanges and ZeRO this backend drives


ParallelCpuBackend::ParallelCpuBackend(const RunConfig& config, HostState host, std::unique_ptr<Communicator> world)
    : ModelBackend(std::move(host)), config_(config) {
  const ParallelConfig& pc = config.parallel;
  const auto ep = static_cast<int>(pc.expert_parallel);
  if (config.model.moe.route_cache)
    route_cache_.emplace(config.model.moe, static_cast<int64_t>(host_model().moe_layers().size()));
  if (world->size() % ep != 0)
    MOE_CONFIG_ERROR("parallel.expert_parallel = {} must divide the number of ranks ({})", ep, world->size());
  groups_ = make_process_groups(std::move(world), ep);
  batch_ = std::make_unique<BatchGroupOverComm>(*groups_.data_parallel, stats_);
  std::vector<ExpertExchange*> exchanges;
  std::vector<const ExpertSlots*> slots;
  const auto moe_layers = host_model().moe_layers();
  if (ep > 1) {
    a2a_ = make_all_to_all(pc.all_to_all, *groups_.expert_parallel, groups_);
    // Equal blocks in expert order until a re-placement; never resized, so the layers'
    // pointers stay valid.
    slots_.assign(moe_layers.size(), equal_expert_slots(config.model.moe.n_experts, ep, pc.split_experts));
    for (size_t i = 0; i < moe_layers.size(); ++i) {
      // EP blocks of consecutive ranks: they span nodes when larger than a node.
      const int ep_per_node = ep > groups_.ranks_per_node ? groups_.ranks_per_node : 0;
      exchanges_.push_back(
          std::make_unique<ExpertExchangeOverComm>(*a2a_, static_cast<int>(pc.a2a_chunks), stats_, ep_per_node));
      exchanges.push_back(exchanges_.back().get());
      slots.push_back(&slots_[i]);
    }
  }
  host_model().set_moe_parallel(batch_.get(), exchanges, slots);
  if (config.model.moe.speculative_dispatch && ep > 1) {
    MOE_CHECK(route_cache_.has_value(), "moe.speculative_dispatch without moe.route_cache");
    for (size_t i = 1; i < moe_layers.size(); ++i) moe_layers[i]->set_route_predictor(&route_cache_->cache(i - 1));
  }
  compression_ = std::make_unique<A2aCompressionSwitch>(pc.a2a_compression, static_cast<int>(exchanges_.size()),
                                                        config.metrics.alert_comm_wait);
  apply_compression();

  // Expert weights go to the EP owners when EP > 1; everything else is ZeRO-sharded in the
  // GPU's layout: the router biases, which the GPU keeps whole for its fp32 copies, are
  // kept whole here too, so that both paths shard the same block the same way.
  auto& params = host_model().params();
  auto stage_of = [&](int id) { return host_model().backward_stage_of(params.spec(id).name); };
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
  const int n_stages = host_model().backward_stages();
  ZeroShardPlan plan = plan_zero_for_store(
      params, [&](const std::string& name) { return host_model().backward_stage_of(name); }, n_stages, router_biases,
      experts_elsewhere, pc.bucket_mb, dp.size(), dp.rank());
  const auto level = static_cast<int>(pc.zero);
  zero_ = std::make_unique<ZeroOptimizer>(params, level == 0 ? replicated_plan(plan) : std::move(plan),
                                          *groups_.data_parallel, config.optimizer, stats_, level);
  if (level == 3) {
    // Each stage reads its own parameters; a tied head (stage 0) the embedding's too.
    std::vector<std::vector<int>> reads(static_cast<size_t>(n_stages));
    for (int s = 0; s < n_stages; ++s) reads[static_cast<size_t>(s)] = {s};
    if (config.model.tie_embeddings) reads[0].push_back(n_stages - 1);
    gather_ = std::make_unique<ZeroParameterGather>(params, zero_->plan(), *groups_.data_parallel, stats_,
                                                    std::move(reads));
  }
  if (ep > 1) {
    std::vector<ExpertOptimizer::Layer> layers;
    for (const auto& group : group_order) {
      layers.push_back({expert_ids[group], stage_of(expert_ids[group].front())});
      expert_ids_by_layer_.push_back(expert_ids[group]);
    }
    experts_ = std::make_unique<ExpertOptimizer>(params, layers, slots_, groups_.expert_parallel->rank(),
                                                 *groups_.expert_data_parallel, *groups_.world, config.optimizer, stats_,
                                                 level);
    // ZeRO-3 of the own experts over their replicas (a group of one shards nothing).
    if (level == 3 && groups_.expert_data_parallel->size() > 1)
      expert_gather_ = std::make_unique<ExpertParameterGather>(params, std::move(layers), *experts_,
                                                               *groups_.expert_data_parallel, stats_);
  } else {
    expert_group_of_id_.assign(static_cast<size_t>(params.size()), -1);
    for (size_t g = 0; g < group_order.size(); ++g)
      for (int id : expert_ids[group_order[g]]) expert_group_of_id_[static_cast<size_t>(id)] = static_cast<int>(g);
    n_expert_groups_ = static_cast<int64_t>(group_order.size());
  }
  host_model().on_backward_stage = [this](int stage) {
    zero_->on_stage(stage);
    if (experts_) experts_->on_stage(stage);
  };
  if (gather_) {
    host_model().on_parameters_needed = [this](int stage, bool backward) {
      gather_->needed(stage, backward);
      if (expert_gather_) expert_gather_->needed(stage, backward);
    };
    host_model().on_parameters_done = [this](int stage, bool backward) {
      gather_->done(stage, backward);
      if (expert_gather_) expert_gather_->done(stage, backward);
    };
  }
  keep_own_experts_resident();
  log_state_bytes();
}

ParallelCpuBackend::~ParallelCpuBackend() {
  host_model().on_backward_stage = nullptr;
  host_model().on_parameters_needed = nullptr;
  host_model().on_parameters_done = nullptr;
  for (auto* layer : host_model().moe_layers()) layer->set_route_predictor(nullptr);
  host_model().set_moe_parallel(nullptr, {});
}

double ParallelCpuBackend::world_sum(double value) {
  batch_->sum(&value, 1);
  return value;
}

void ParallelCpuBackend::begin_step() {
  auto& params = host_model().params();
  // ZeRO-2/3: the other ranks' pieces are released (zero) since the last reduce-scatter,
  // and so are the other replicas' shares of the experts.
  if (zero_->level() >= 2) {
    RangeList keep = zero_->gradients_to_zero(params.resident());
    if (experts_) keep = subtract_ranges(keep, experts_->others_shares());
    params.zero_grads(keep);
  } else {
    params.zero_grads();
  }
  for (auto* layer : host_model().moe_layers()) layer->reset_load();
  for (auto& exchange : exchanges_) exchange->take_dispatch_wait_s();  // the validation's since the last step
}

ForwardResult ParallelCpuBackend::forward(const int32_t* inputs_BS, const int32_t* targets_BS) {
  const int64_t tokens = host_model().planned_batch() * config_.model.seq_len;
  const auto local = static_cast<double>(std::count_if(targets_BS, targets_BS + tokens, [](int32_t t) { return t >= 0; }));
  const double total = world_sum(local);
  ForwardResult fwd = host_model().forward(inputs_BS, targets_BS);
  if (route_cache_ && !validating()) probe_routing(host_model(), *route_cache_, inputs_BS);
  ce_weight_ = total > 0 ? local / total : 0.0;
  fwd.ce_loss *= ce_weight_;  // the sum over the ranks is the global micro-batch's mean
  return fwd;
}

void ParallelCpuBackend::backward(double loss_scale, bool last) {
  if (last) {
    zero_->arm();
    if (experts_) experts_->arm();
  }
  host_model().backward(loss_scale * ce_weight_, loss_scale);
  zero_->end_micro_batch();
  if (experts_) experts_->end_micro_batch();
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
  auto layers = host_model().moe_layers();
  // Per layer: kept per expert, load per expert, dropped, entropy sum, tokens, the
  // speculation's rows used, wasted, corrected, and the dispatch's wait.
  const size_t per_layer = 2 * E + 7;
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
    s[2 * E + 3] = static_cast<double>(r.speculation.used);
    s[2 * E + 4] = static_cast<double>(r.speculation.wasted);
    s[2 * E + 5] = static_cast<double>(r.speculation.corrected);
    s[2 * E + 6] = i < exchanges_.size() ? exchanges_[i]->take_dispatch_wait_s() : 0.0;
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
    if (i < exchanges_.size()) {
      r.a2a_fp8 = exchanges_[i]->fp8() ? 1 : 0;
      r.a2a_dispatch_wait_ms = s[2 * E + 6] * 1e3 / static_cast<double>(batch_->size());
    }
    if (m.moe.speculative_dispatch && i > 0 && !exchanges_.empty()) {
      r.spec_rows_used = std::llround(s[2 * E + 3]);
      r.spec_rows_wasted = std::llround(s[2 * E + 4]);
      r.spec_rows_corrected = std::llround(s[2 * E + 5]);
    }
    r.temperature = layers[i]->temperature();
    stats.load_imbalance = std::max(stats.load_imbalance, load_imbalance(global_load_[i]));
    stats.layers.push_back(std::move(r));
  }
  if (route_cache_) route_cache_->report(stats.layers, [&](double* v, int64_t n) { batch_->sum(v, n); });
  if (!slots_.empty()) {
    std::vector<const ExpertSlots*> slots_L;
    for (const ExpertSlots& slots : slots_) slots_L.push_back(&slots);
    stats.ranks = rank_loads(slots_L, stats.layers);
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
  // Shards are disjoint; the expert optimizer counts each expert element once over the world.
  double sq = zero_->shard_sum_of_squares();
  if (experts_) sq += experts_->sum_of_squares();
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
  if (gather_) gather_->release_all();  // only the own pieces are current now
  if (experts_) experts_->step(lr);
  if (expert_gather_) expert_gather_->release_all();
  // Both controllers read the loads summed over the ranks: every rank keeps the same state.
  const MoEConfig& moe = config_.model.moe;
  if (moe.bias_balancing || moe.temperature_control) {
    auto layers = host_model().moe_layers();
    for (size_t i = 0; i < layers.size(); ++i) {
      if (i < global_load_.size()) layers[i]->set_load(global_load_[i]);
      if (moe.bias_balancing) layers[i]->update_balancing_bias();
      if (moe.temperature_control) layers[i]->update_temperature(config_.metrics.alert_imbalance);
    }
  }
}

void ParallelCpuBackend::end_step() {
  for (auto* layer : host_model().moe_layers()) layer->reset_load();
  if (experts_ && config_.parallel.rebalance_interval > 0) rebalance_experts();
}

// Dynamic load balancing, per MoE layer as on the GPU (GpuBackend::rebalance_experts):
// the global loads are the same on every rank, so every rank computes the same slots;
// experts that a rank newly holds take their weights and moments along.
void ParallelCpuBackend::rebalance_experts() {
  std::vector<std::vector<std::vector<int64_t>>> current;
  for (const ExpertSlots& layer : slots_) current.push_back(expert_blocks(layer));
  const auto next = placement_schedule_.step(global_load_, current, slots_.front().ep_size(), config_.parallel,
                                             config_.model.moe.route_groups);
  if (!next) return;
  std::vector<ExpertSlots> placed;
  for (const auto& blocks : next->experts_of_rank)
    placed.push_back(expert_slots_from_blocks(blocks, config_.parallel.split_experts));
  place_experts(placed);
  if (rank() == 0)
    spdlog::info("re-placed experts by load: busiest EP rank's assignments summed over the MoE layers {} -> {}",
                 next->busiest_before, next->busiest_after);
}

void ParallelCpuBackend::place_experts(const std::vector<ExpertSlots>& next) {
  if (expert_gather_) expert_gather_->gather_all();  // ZeRO-3: the block ranks send whole experts
  experts_->migrate(next, *groups_.expert_parallel);
  for (size_t l = 0; l < slots_.size(); ++l) slots_[l] = next[l];  // in place: the layers hold pointers
  keep_own_experts_resident();
  // Levels 2-3: begin_step leaves the other replicas' shares of the own experts alone (they
  // were released after the last scatter); an expert that was a hinge still holds its
  // gradient there.
  if (zero_->level() >= 2) host_model().params().release_grads(experts_->others_shares());
  if (expert_gather_) expert_gather_->release_all();  // the new own experts' other shares
}

void ParallelCpuBackend::keep_own_experts_resident() {
  if (!experts_) return;
  auto& params = host_model().params();
  const int me = groups_.expert_parallel->rank();
  RangeList experts, own;
  for (size_t l = 0; l < expert_ids_by_layer_.size(); ++l)
    for (int id : expert_ids_by_layer_[l]) {
      const int64_t per_expert = params.numel(id) / slots_[l].n_experts();
      experts.push_back({params.offset(id), params.numel(id)});
      for (int64_t expert : window_experts(slots_[l], me)) own.push_back({params.offset(id) + expert * per_expert, per_expert});
      // Every hinge too: their gradients are summed over all ranks, into every rank's block.
      const std::vector<std::vector<int>> holders = slot_holders(slots_[l]);
      for (size_t slot = 0; slot < holders.size(); ++slot)
        if (holders[slot].size() > 1)
          own.push_back({params.offset(id) + slots_[l].expert_of_slot[slot] * per_expert, per_expert});
    }
  // A held hinge is listed twice: the union merges it.
  params.set_resident(subtract_ranges({{0, params.storage_numel()}},
                                      subtract_ranges(merge_ranges(std::move(experts)), merge_ranges(std::move(own)))));
}

bool ParallelCpuBackend::in_zero_plan(int id) const {
  return std::binary_search(zero_->ids().begin(), zero_->ids().end(), id);
}

void ParallelCpuBackend::log_state_bytes() {
  if (rank() != 0) return;
  auto& params = host_model().params();
  auto elements = [](const RangeList& ranges) {
    int64_t n = 0;
    for (const Range& r : ranges) n += r.count;
    return n;
  };
  const RangeList resident = params.resident();
  // The other ranks' pieces, and the other replicas' shares of the own experts.
  const RangeList others =
      merged_ranges({others_pieces(zero_->plan()), {experts_ ? experts_->others_shares() : RangeList{}}});
  const int level = zero_->level();
  const int64_t values = elements(level == 3 ? subtract_ranges(resident, others) : resident);
  const int64_t grads = elements(level >= 2 ? subtract_ranges(resident, others) : resident);
  int64_t moments = 0;
  for (const auto& s : zero_->moment_slices()) moments += 2 * s.count;
  if (experts_)
    for (const auto& e : experts_->window_moments()) moments += 2 * e.share_count;
  const double GB = 1e9 / sizeof(float);
  spdlog::info("ZeRO {} over {} data-parallel ranks: {:.3f} GB of parameter state on rank 0 (values {:.3f}, "
               "gradients {:.3f}, moments {:.3f})",
               level, groups_.data_parallel->size(), static_cast<double>(values + grads + moments) / GB,
               static_cast<double>(values) / GB, static_cast<double>(grads) / GB, static_cast<double>(moments) / GB);
}

std::string ParallelCpuBackend::placement_state() const {
  PlacementRecord record;
  if (config_.parallel.a2a_compression == A2aCompression::Auto && compression_)
    record.a2a_compression = compression_->save();
  if (experts_ && config_.parallel.rebalance_interval > 0) {
    record.has_placement = true;
    record.ep_size = slots_.front().ep_size();
    for (const ExpertSlots& layer : slots_) record.experts_of_rank.push_back(expert_blocks(layer));
    placement_schedule_.save(record);
  }
  return record.dump();
}

// After finish_restore (the equal blocks hold the checkpoint's values): the saved slots'
// experts move to their ranks as a re-placement moves them. A record of another EP size
// or layer count (or none) leaves the equal blocks.
void ParallelCpuBackend::restore_placement(const std::string& text) {
  if (text.empty()) return;
  const PlacementRecord record = PlacementRecord::parse(text);
  if (config_.parallel.a2a_compression == A2aCompression::Auto && compression_ && !record.a2a_compression.empty()) {
    if (compression_->restore(record.a2a_compression)) apply_compression();
    else if (rank() == 0) spdlog::warn("resume: the checkpoint's a2a compression state does not fit: starts uncompressed");
  }
  if (!experts_ || config_.parallel.rebalance_interval <= 0) return;
  if (record.ep_size != slots_.front().ep_size() || record.experts_of_rank.size() != slots_.size()) {
    if (rank() == 0) spdlog::info("resume: the checkpoint's expert placement does not apply here (equal blocks)");
    return;
  }
  std::vector<ExpertSlots> saved;
  try {  // everything checked before anything moves
    for (const auto& blocks : record.experts_of_rank) {
      saved.push_back(expert_slots_from_blocks(blocks, config_.parallel.split_experts));
      MOE_CHECK(saved.back().n_experts() == config_.model.moe.n_experts, "{} experts placed, the model has {}",
                saved.back().n_experts(), config_.model.moe.n_experts);
    }
  } catch (const Error& e) {
    if (rank() == 0) spdlog::warn("resume: the checkpoint's expert placement does not fit ({}): equal blocks", e.what());
    return;
  }
  place_experts(saved);
  placement_schedule_.restore(record);
}

// After apply_update (ZeRO-3 gathers released: only the own pieces are current) and
// end_step (a re-placement done): the pieces are what a checkpoint would save, the targets
// what a resume would fill, so every layout (ZeRO 0-3, expert windows, hinges, replicas)
// is covered by the code that checkpoints already trust.
std::vector<std::vector<ExpertMerge>> ParallelCpuBackend::merge_experts(
    const MoEConfig& config, const std::vector<std::vector<int64_t>>& load_LE,
    const std::vector<std::vector<int64_t>>& protected_LE, uint64_t seed, int64_t step) {
  const CommStats step_stats = stats_;  // save_state resets them; the step's are not taken yet
  const SavedState saved = save_state(rank(), world_size());
  stats_ = step_stats;
  const std::vector<StateTarget> targets = restore_targets();
  return merge_sharded_experts(
      host_model(), config, saved, targets,
      [this](float* data, int64_t n) {
        timed_blocking(stats_, [&] { groups_.world->all_reduce(data, static_cast<size_t>(n), dist::DType::f32); });
      },
      load_LE, protected_LE, seed, step);
}

double ParallelCpuBackend::sum_over_ranks(double value) { return world_sum(value); }

void ParallelCpuBackend::end_validation() {
  for (auto* layer : host_model().moe_layers()) layer->reset_load();
  stats_ = CommStats{};  // validation's exchanges are not a training step's
  for (auto& exchange : exchanges_) exchange->take_wait_s();
}

void ParallelCpuBackend::take_comm_stats(StepStats& stats) {
  stats.time.comm_wait += stats_.wait_s;
  stats.grad_sync_ms += stats_.grad_sync_s * 1e3;
  stats.a2a_bytes += stats_.a2a_bytes;
  stats.a2a_off_node_bytes += stats_.a2a_off_node_bytes;
  stats.a2a_seconds += stats_.a2a_s;
  stats_ = CommStats{};
}

void ParallelCpuBackend::apply_compression() {
  for (size_t i = 0; i < exchanges_.size(); ++i) exchanges_[i]->set_fp8(compression_->fp8(static_cast<int>(i)));
}

// auto: every rank feeds the switch the max over the world of the step's comm wait
// fraction and of each layer's exchange wait, so all take the same decision.
void ParallelCpuBackend::observe_step(const StepStats& stats) {
  std::vector<double> waits;
  for (auto& exchange : exchanges_) waits.push_back(exchange->take_wait_s());
  if (config_.parallel.a2a_compression != A2aCompression::Auto || exchanges_.empty()) return;
  const double fraction = stats.time.step > 0 ? stats.time.comm_wait / stats.time.step : 0.0;
  auto max_over_world = [this](std::vector<double>& values) {
    groups_.world->all_reduce(values.data(), values.size(), dist::DType::f64, dist::ReduceOp::max);
  };
  if (compression_->observe(fraction, waits, max_over_world, rank() == 0)) apply_compression();
}

void ParallelCpuBackend::sync_host_model() {
  if (gather_) gather_->gather_all();
  if (expert_gather_) expert_gather_->gather_all();
  if (experts_) experts_->gather_weights(*groups_.expert_parallel);
  stats_ = CommStats{};
}

// Checkpoints without a gather: each rank saves what it holds current. Dense parameters
// and balancing biases are the same on every rank (ZeRO all-gathers the parameters after
// each step): split over the world. ZeRO moments: each rank's pieces, the replicated ranges
// split over the group. Experts (EP > 1): weights and moments from the rank whose block
// holds their slot, split over its expert replicas.
SavedState ParallelCpuBackend::save_state(int, int) {
  SavedState state;
  state.adam_steps = zero_->steps_taken();
  auto& params = host_model().params();
  const int world = groups_.world->size(), rank = groups_.world->rank();
  auto shape_of = [&](int id) { return tensor_shape(params.spec(id).shape); };
  // ZeRO-3: a rank holds only its pieces of the parameters, saved as the moments are.
  const bool own_pieces = gather_ != nullptr;
  for (int id = 0; id < params.size(); ++id)
    if ((!experts_ || params.spec(id).expert_group.empty()) && !(own_pieces && in_zero_plan(id)))
      state.pieces.push_back({"param/" + params.spec(id).name, shape_of(id), 0, params.numel(id), params.value(id),
                              world, rank});
  const Communicator& dp = *groups_.data_parallel;
  for (const auto& s : zero_->moment_slices()) {
    const std::string& name = params.spec(s.id).name;
    const int replicas = s.replicated ? dp.size() : 1, replica = s.replicated ? dp.rank() : 0;
    if (own_pieces)
      state.pieces.push_back({"param/" + name, shape_of(s.id), s.begin, s.count, s.value, replicas, replica});
    state.pieces.push_back({"adam_m/" + name, shape_of(s.id), s.begin, s.count, s.m, replicas, replica});
    state.pieces.push_back({"adam_v/" + name, shape_of(s.id), s.begin, s.count, s.v, replicas, replica});
  }
  if (experts_) {
    const Communicator& edp = *groups_.expert_data_parallel;
    for (const auto& e : experts_->window_moments()) {
      if (!e.in_block) continue;  // a hinge: its block rank saves it
      const std::string& name = params.spec(e.id).name;
      const int64_t begin = e.expert * e.count;
      // A sharded expert's moments (and at ZeRO-3 its weights): this rank's share, a piece
      // no other rank holds; whole ones are split over the replicas.
      const int replicas = e.sharded ? 1 : edp.size(), replica = e.sharded ? 0 : edp.rank();
      const int64_t share = begin + e.share_begin;
      if (e.sharded && expert_gather_)
        state.pieces.push_back({"param/" + name, shape_of(e.id), share, e.share_count, params.value(e.id) + share,
                                replicas, replica});
      else
        state.pieces.push_back({"param/" + name, shape_of(e.id), begin, e.count, params.value(e.id) + begin,
                                edp.size(), edp.rank()});
      state.pieces.push_back({"adam_m/" + name, shape_of(e.id), share, e.share_count, e.m, replicas, replica});
      state.pieces.push_back({"adam_v/" + name, shape_of(e.id), share, e.share_count, e.v, replicas, replica});
    }
  }
  append_router_state_pieces(host_model(), world, rank, state.pieces);
  stats_ = CommStats{};
  return state;
}

// Every parameter (the ranks hold all of them), the moments of this rank's ZeRO ranges and
// window's experts, and the balancing biases: from whatever layout wrote them.
std::vector<StateTarget> ParallelCpuBackend::restore_targets() {
  std::vector<StateTarget> targets;
  auto& params = host_model().params();
  auto shape_of = [&](int id) { return tensor_shape(params.spec(id).shape); };
  // The parameters this rank holds (all but the other ranks' experts under expert parallelism).
  // ZeRO-3: only the own pieces of the parameters the plan covers.
  const bool own_pieces = gather_ != nullptr;
  std::vector<int64_t> span_ids;
  RangeList spans;
  for (int id = 0; id < params.size(); ++id)
    if (!(own_pieces && in_zero_plan(id))) {
      span_ids.push_back(id);
      spans.push_back({params.offset(id), params.numel(id)});
    }
  // Expert ZeRO-3: the other replicas' shares of the own experts are theirs to read.
  const RangeList held =
      expert_gather_ ? subtract_ranges(params.resident(), experts_->others_shares()) : params.resident();
  for (const SpanPiece& part : cut_spans(spans, held)) {
    const auto id = static_cast<int>(span_ids[static_cast<size_t>(part.span)]);
    const int64_t begin = part.offset - params.offset(id);
    targets.push_back({"param/" + params.spec(id).name, shape_of(id), begin, part.count, params.value(id) + begin});
  }
  for (const auto& s : zero_->moment_slices()) {
    if (own_pieces) targets.push_back({"param/" + params.spec(s.id).name, shape_of(s.id), s.begin, s.count, s.value});
    targets.push_back({"adam_m/" + params.spec(s.id).name, shape_of(s.id), s.begin, s.count, s.m});
    targets.push_back({"adam_v/" + params.spec(s.id).name, shape_of(s.id), s.begin, s.count, s.v});
  }
  if (experts_)
    for (const auto& e : experts_->window_moments()) {
      const int64_t begin = e.expert * e.count + e.share_begin;
      targets.push_back({"adam_m/" + params.spec(e.id).name, shape_of(e.id), begin, e.share_count, e.m});
      targets.push_back({"adam_v/" + params.spec(e.id).name, shape_of(e.id), begin, e.share_count, e.v});
    }
  append_router_state_targets(host_model(), targets);
  return targets;
}

void ParallelCpuBackend::finish_restore(int64_t adam_steps) {
  zero_->set_steps_taken(adam_steps);
  if (experts_) experts_->set_steps_taken(adam_steps);
  keep_own_experts_resident();  // a restored placement may have moved the window
  if (gather_) gather_->release_all();  // the other ranks' pieces are stale now
  if (expert_gather_) expert_gather_->release_all();
}

}  // namespace moe
