#include "train/backends/cpu_backend.h"

#include <algorithm>
#include <optional>

#include "moe/router.h"
#include "train/routing_cache_probe.h"

namespace moe {

// The step's routing per MoE layer, and the largest load imbalance before dropping.
std::vector<LayerRouting> host_routing(Transformer<float>& model, const ModelConfig& config, double& load_imbalance) {
  std::vector<LayerRouting> layers;
  auto moe_layers = model.moe_layers();
  load_imbalance = 0;
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    auto* layer = moe_layers[i];
    load_imbalance = std::max(load_imbalance, moe::load_imbalance(layer->load_E()));
    const MoERoutingStats& routing = layer->routing_stats();
    LayerRouting r;
    r.layer = config.first_dense_layers + static_cast<int64_t>(i);  // MoE blocks follow the dense ones
    r.tokens_E = routing.kept_E;
    r.assignments = routing.tokens * config.moe.top_k;
    r.dropped = routing.dropped;
    r.router_entropy = routing.tokens > 0 ? routing.entropy_sum / static_cast<double>(routing.tokens) : 0;
    if (config.moe.bias_balancing) r.bias_E.assign(layer->balance_bias_E().begin(), layer->balance_bias_E().end());
    r.temperature = layer->temperature();
    layers.push_back(std::move(r));
  }
  return layers;
}

void probe_routing(Transformer<float>& model, RoutingCacheProbe& probe, const int32_t* inputs_BS) {
  std::vector<const int32_t*> experts_TK;
  for (const auto* layer : model.moe_layers()) experts_TK.push_back(layer->experts_TK());
  probe.forward(inputs_BS, model.planned_batch() * model.config().seq_len, experts_TK);
}

BatchPlan plan_host_batches(const RunConfig& config, Transformer<float>& model) {
  const TrainingConfig& tc = config.training;
  const size_t limit = static_cast<size_t>(tc.memory_limit_mb) * 1000000u;
  return fit_micro_batch(
      tc.global_batch_tokens, config.model.seq_len, tc.micro_batch, limit,
      [&](int64_t batch) { return model.planned_bytes(batch); }, [&](int64_t batch) { model.plan(batch); });
}

namespace {

// The CPU reference: Transformer<float> and AdamW in this process.
class CpuBackend final : public ModelBackend {
 public:
  CpuBackend(const RunConfig& config, HostState host)
      : ModelBackend(std::move(host)), config_(config) {
    if (config.model.moe.route_cache)
      route_cache_.emplace(config.model.moe, static_cast<int64_t>(host_model().moe_layers().size()));
  }
  BatchPlan plan_batches() override { return plan_host_batches(config_, host_model()); }
  void begin_step() override {
    host_model().params().zero_grads();
    for (auto* layer : host_model().moe_layers()) layer->reset_load();
  }
  ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS) override {
    ForwardResult result = host_model().forward(inputs_BS, targets_BS);
    if (route_cache_ && !validating()) probe_routing(host_model(), *route_cache_, inputs_BS);
    return result;
  }
  void backward(double loss_scale, bool) override { host_model().backward(loss_scale); }
  void routing(StepStats& stats) override {
    stats.layers = host_routing(host_model(), config_.model, stats.load_imbalance);
    if (route_cache_) route_cache_->report(stats.layers);
  }
  ClipStats clip_gradients(double max_global_norm, double max_expert_norm) override {
    return moe::clip_gradients(host_model().params(), max_global_norm, max_expert_norm);
  }
  void apply_update(double lr) override {
    host_optimizer().step(lr);
    if (config_.model.moe.bias_balancing)
      for (auto* layer : host_model().moe_layers()) layer->update_balancing_bias();
    if (config_.model.moe.temperature_control)
      for (auto* layer : host_model().moe_layers()) layer->update_temperature(config_.metrics.alert_imbalance);
  }
  void end_step() override { end_validation(); }
  void end_validation() override {
    for (auto* layer : host_model().moe_layers()) layer->reset_load();
  }

 private:
  const RunConfig& config_;
  std::optional<RoutingCacheProbe> route_cache_;  // moe.route_cache
};

}  // namespace

std::unique_ptr<ModelBackend> make_cpu_backend(const RunConfig& config, HostState host) {
  return std::make_unique<CpuBackend>(config, std::move(host));
}

}  // namespace moe
