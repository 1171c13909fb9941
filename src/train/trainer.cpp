#include "train/trainer.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <cmath>
#include <ostream>

#include "core/threads.h"
#include "train/grad_clip.h"
#include "train/lr_schedule.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

RunInfo run_info(const RunConfig& config, const ParameterCounts& counts) {
  const ModelConfig& m = config.model;
  RunInfo info;
  info.steps = config.training.steps;
  info.tokens_per_step = config.training.global_batch_tokens;
  info.n_layers = m.n_layers;
  for (int64_t l = m.first_dense_layers; l < m.n_layers; ++l) info.moe_layers.push_back(l);
  info.n_experts = m.moe.n_experts;
  info.top_k = m.moe.top_k;
  info.params_total = counts.total;
  info.params_active = counts.active;
  info.bias_balancing = m.moe.bias_balancing;
  info.mfu = {counts.active - counts.embedding, m.n_layers, m.dim, m.seq_len, config.metrics.peak_tflops * 1e12};
  return info;
}

// One process holds every expert: rank 0, its load summed over the MoE layers.
StepMetrics step_metrics(const StepStats& s, const RunInfo& info, int64_t arena_bytes) {
  StepMetrics m;
  m.step = s.step;
  m.steps = info.steps;
  m.wall_time = unix_now();
  m.loss = s.loss, m.aux_loss = s.aux_loss, m.z_loss = s.z_loss;
  m.lr = s.lr;
  m.grad_norm = s.grad_norm, m.max_expert_grad_norm = s.max_expert_grad_norm;
  m.skipped = s.skipped;
  m.tokens = info.tokens_per_step;
  m.time = s.time;
  m.tokens_per_s = s.time.step > 0 ? static_cast<double>(m.tokens) / s.time.step : 0;
  m.mfu = info.mfu.mfu(m.tokens_per_s);
  m.arena_bytes = arena_bytes;
  m.rss_bytes = resident_set_bytes();
  m.layers = s.layers;
  RankLoad rank;
  rank.load.assign(static_cast<size_t>(info.n_experts), 0);
  for (int64_t e = 0; e < info.n_experts; ++e) rank.experts.push_back(e);
  for (const auto& layer : s.layers)
    for (size_t e = 0; e < layer.tokens_E.size(); ++e) rank.load[e] += layer.tokens_E[e];
  m.ranks.push_back(std::move(rank));
  return m;
}

}  // namespace

ParameterCounts count_parameters(const ModelConfig& config, const ParameterStore<float>& params) {
  ParameterCounts counts;
  for (int id = 0; id < params.size(); ++id) {
    const ParamSpec& spec = params.spec(id);
    const int64_t n = params.numel(id);
    counts.total += n;
    if (spec.name == "embedding") counts.embedding += n;
    // Routed experts: only top_k of n_experts are active for a token.
    counts.active += spec.expert_group.empty() ? n : n / spec.shape[0] * config.moe.top_k;
  }
  return counts;
}

Trainer::Trainer(const RunConfig& config, std::unique_ptr<BatchSource> train_data,
                 std::unique_ptr<BatchSource> val_data)
    : config_(config), train_data_(std::move(train_data)), val_data_(std::move(val_data)) {
  const TrainingConfig& tc = config_.training;
  const int64_t tokens_per_micro = tc.micro_batch * config_.model.seq_len;
  MOE_CHECK(tc.global_batch_tokens % tokens_per_micro == 0,
            "training.global_batch_tokens {} is not a multiple of micro_batch*seq_len = {}",
            tc.global_batch_tokens, tokens_per_micro);
  micro_steps_ = tc.global_batch_tokens / tokens_per_micro;
  model_ = std::make_unique<Transformer<float>>(config_.model, tc.seed);
  if (wants_gpu()) setup_gpu();
  plan_batches();  // checkpoint_trainer.cpp: may halve the micro-batch under training.memory_limit_mb
  optimizer_ = std::make_unique<AdamW>(config_.optimizer, model_->params());
  inputs_BS_.resize(static_cast<size_t>(tokens_per_micro));
  targets_BS_.resize(static_cast<size_t>(tokens_per_micro));
}

Trainer::~Trainer() = default;

StepStats Trainer::train_step(int64_t step) {
  if (gpu_) return gpu_train_step(step);
  const TrainingConfig& tc = config_.training;
  StepStats stats;
  stats.step = step + 1;
  const auto step_start = Clock::now();
  auto& params = model_->params();
  params.zero_grads();
  auto moe_layers = model_->moe_layers();
  for (auto* layer : moe_layers) layer->reset_load();
  const double scale = 1.0 / static_cast<double>(micro_steps_);
  for (int64_t micro = 0; micro < micro_steps_; ++micro) {
    auto t0 = Clock::now();
    train_data_->next_batch(micro_batch_, inputs_BS_.data(), targets_BS_.data());
    stats.time.data_wait += seconds_since(t0);
    t0 = Clock::now();
    ForwardResult fwd = model_->forward(inputs_BS_.data(), targets_BS_.data());
    model_->backward(scale);
    stats.time.compute += seconds_since(t0);
    stats.loss += fwd.ce_loss * scale;
    stats.aux_loss += fwd.aux_loss * scale;
    stats.z_loss += fwd.z_loss * scale;
    stats.dropped += fwd.dropped;
  }
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    auto* layer = moe_layers[i];
    stats.load_imbalance = std::max(stats.load_imbalance, load_imbalance(layer->load_E()));
    const MoERoutingStats& routing = layer->routing_stats();
    LayerRouting r;
    r.layer = config_.model.first_dense_layers + static_cast<int64_t>(i);  // MoE blocks follow the dense ones
    r.tokens_E = routing.kept_E;
    r.assignments = routing.tokens * config_.model.moe.top_k;
    r.dropped = routing.dropped;
    r.router_entropy = routing.tokens > 0 ? routing.entropy_sum / static_cast<double>(routing.tokens) : 0;
    if (config_.model.moe.bias_balancing) r.bias_E.assign(layer->balance_bias_E().begin(), layer->balance_bias_E().end());
    stats.layers.push_back(std::move(r));
  }
  const auto optimizer_start = Clock::now();
  ClipStats clip = clip_gradients(params, tc.grad_clip, tc.expert_grad_clip);
  stats.grad_norm = clip.global_norm;
  stats.max_expert_grad_norm = clip.max_expert_norm;
  stats.lr = learning_rate(config_.lr, step, tc.steps) * progress_.lr_scale;
  if (!std::isfinite(clip.global_norm) || !std::isfinite(stats.loss)) {
    stats.skipped = true;  // a non-finite gradient never reaches the weights
  } else {
    optimizer_->step(stats.lr);
    if (config_.model.moe.bias_balancing)
      for (auto* layer : moe_layers) layer->update_balancing_bias();
  }
  for (auto* layer : moe_layers) layer->reset_load();
  stats.time.optimizer = seconds_since(optimizer_start);
  stats.time.step = seconds_since(step_start);
  return stats;
}

double Trainer::validate() {
  if (gpu_) return gpu_validate();
  const TrainingConfig& tc = config_.training;
  val_data_->reset();
  double total = 0;
  // The same held-out sequences when the memory controller split the micro-batch.
  const int64_t batches = tc.val_batches * (tc.micro_batch / micro_batch_);
  for (int64_t b = 0; b < batches; ++b) {
    val_data_->next_batch(micro_batch_, inputs_BS_.data(), targets_BS_.data());
    total += model_->forward(inputs_BS_.data(), targets_BS_.data()).ce_loss;
  }
  // Validation must not count towards the balancing load of the next step.
  for (auto* layer : model_->moe_layers()) layer->reset_load();
  return total / static_cast<double>(std::max<int64_t>(1, batches));
}

TrainSummary Trainer::run(std::ostream& out) {
  const TrainingConfig& tc = config_.training;
  const int64_t tokens_per_step = tc.global_batch_tokens;
  TrainSummary summary;
  const ParameterCounts counts = count_parameters(config_.model, model_->params());
  fmt::print(out,
             "model: {} layers, dim {}, {} experts top-{} | params total {:.2f}M, active {:.2f}M "
             "| activations {:.1f} MB | threads {}\n",
             config_.model.n_layers, config_.model.dim, config_.model.moe.n_experts,
             config_.model.moe.top_k, static_cast<double>(counts.total) / 1e6,
             static_cast<double>(counts.active) / 1e6,
             static_cast<double>(model_->activation_bytes()) / 1e6, num_threads());
  for (const std::string& note : batch_notes_) fmt::print(out, "{}\n", note);
  fmt::print(out, "batch: {} tokens/step = {} micro-batches x {} x {} tokens\n", tokens_per_step,
             micro_steps_, micro_batch_, config_.model.seq_len);
  out.flush();
  Observer observer(config_.metrics, out, observer_options);
  RunInfo info = run_info(config_, counts);
  info.first_step = progress_.step;  // a resumed run appends to its metrics
  observer.start(info);
  // Values, gradients, two AdamW moments, activation and scratch arenas.
  const auto arena_bytes = static_cast<int64_t>(counts.total * 4 * static_cast<int64_t>(sizeof(float)) +
                                                static_cast<int64_t>(model_->activation_bytes()));

  summary.val_loss_start = validate();
  observer.validation(progress_.step, summary.val_loss_start);
  summary.val_loss_end = summary.val_loss_start;

  const auto start = Clock::now();
  // From a resumed step; training.stop_at ends early; a NaN reload moves progress_ back.
  const int64_t stop = tc.stop_at > 0 ? tc.stop_at : tc.steps;
  for (int64_t step = progress_.step; step < stop; step = progress_.step) {
    StepStats stats = train_step(step);
    progress_.step = step + 1;
    summary.steps = step + 1;
    summary.tokens += tokens_per_step;
    summary.train_loss_end = stats.loss;
    if (stats.skipped) ++summary.skipped_steps;
    observer.step(step_metrics(stats, info, arena_bytes));
    if (on_step) on_step(stats);
    const bool last = step + 1 == tc.steps;
    if (last || (tc.val_interval > 0 && (step + 1) % tc.val_interval == 0)) {
      summary.val_loss_end = validate();
      observer.validation(step + 1, summary.val_loss_end);
    }
    if (after_step(stats, out)) break;  // checkpoints, NaN recovery, preemption
  }
  summary.seconds = seconds_since(start);
  download_gpu_weights();
  observer.finish({summary.steps, summary.tokens, summary.skipped_steps, summary.seconds, summary.val_loss_start,
                   summary.val_loss_end, summary.train_loss_end});
  fmt::print(out,
             "summary: steps={} tokens={} seconds={:.1f} val_loss_start={:.4f} val_loss_end={:.4f} "
             "train_loss_end={:.4f} skipped_steps={}\n",
             summary.steps, summary.tokens, summary.seconds, summary.val_loss_start,
             summary.val_loss_end, summary.train_loss_end, summary.skipped_steps);
  out.flush();
  return summary;
}

}  // namespace moe
