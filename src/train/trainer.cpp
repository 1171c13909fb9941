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

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds));
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  return fmt::format("{}m{:02d}s", s / 60, s % 60);
}

double load_imbalance(const std::vector<int64_t>& load_E) {
  int64_t total = 0, max_load = 0;
  for (int64_t l : load_E) {
    total += l;
    max_load = std::max(max_load, l);
  }
  if (total == 0) return 0;
  const double mean = static_cast<double>(total) / static_cast<double>(load_E.size());
  return static_cast<double>(max_load) / mean - 1.0;
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
  model_->plan(tc.micro_batch);
  optimizer_ = std::make_unique<AdamW>(config_.optimizer, model_->params());
  inputs_BS_.resize(static_cast<size_t>(tokens_per_micro));
  targets_BS_.resize(static_cast<size_t>(tokens_per_micro));
}

StepStats Trainer::train_step(int64_t step) {
  const TrainingConfig& tc = config_.training;
  StepStats stats;
  stats.step = step + 1;
  auto& params = model_->params();
  params.zero_grads();
  auto moe_layers = model_->moe_layers();
  for (auto* layer : moe_layers) layer->reset_load();
  const double scale = 1.0 / static_cast<double>(micro_steps_);
  for (int64_t micro = 0; micro < micro_steps_; ++micro) {
    train_data_->next_batch(tc.micro_batch, inputs_BS_.data(), targets_BS_.data());
    ForwardResult fwd = model_->forward(inputs_BS_.data(), targets_BS_.data());
    model_->backward(scale);
    stats.loss += fwd.ce_loss * scale;
    stats.aux_loss += fwd.aux_loss * scale;
    stats.z_loss += fwd.z_loss * scale;
    stats.dropped += fwd.dropped;
  }
  for (auto* layer : moe_layers)
    stats.load_imbalance = std::max(stats.load_imbalance, load_imbalance(layer->load_E()));
  ClipStats clip = clip_gradients(params, tc.grad_clip, tc.expert_grad_clip);
  stats.grad_norm = clip.global_norm;
  stats.max_expert_grad_norm = clip.max_expert_norm;
  stats.lr = learning_rate(config_.lr, step, tc.steps);
  if (!std::isfinite(clip.global_norm) || !std::isfinite(stats.loss)) {
    stats.skipped = true;  // a non-finite gradient never reaches the weights
  } else {
    optimizer_->step(stats.lr);
    if (config_.model.moe.bias_balancing)
      for (auto* layer : moe_layers) layer->update_balancing_bias();
  }
  for (auto* layer : moe_layers) layer->reset_load();
  return stats;
}

double Trainer::validate() {
  const TrainingConfig& tc = config_.training;
  val_data_->reset();
  double total = 0;
  for (int64_t b = 0; b < tc.val_batches; ++b) {
    val_data_->next_batch(tc.micro_batch, inputs_BS_.data(), targets_BS_.data());
    total += model_->forward(inputs_BS_.data(), targets_BS_.data()).ce_loss;
  }
  // Validation must not count towards the balancing load of the next step.
  for (auto* layer : model_->moe_layers()) layer->reset_load();
  return total / static_cast<double>(std::max<int64_t>(1, tc.val_batches));
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
  fmt::print(out, "batch: {} tokens/step = {} micro-batches x {} x {} tokens\n", tokens_per_step,
             micro_steps_, tc.micro_batch, config_.model.seq_len);
  out.flush();

  summary.val_loss_start = validate();
  fmt::print(out, "val step 0 | val_loss {:.4f}\n", summary.val_loss_start);
  out.flush();
  summary.val_loss_end = summary.val_loss_start;

  const auto start = Clock::now();
  auto interval_start = start;
  int64_t interval_tokens = 0;
  for (int64_t step = 0; step < tc.steps; ++step) {
    StepStats stats = train_step(step);
    summary.steps = step + 1;
    summary.tokens += tokens_per_step;
    summary.train_loss_end = stats.loss;
    interval_tokens += tokens_per_step;
    if (stats.skipped) {
      ++summary.skipped_steps;
      fmt::print(out, "warning: step {} skipped: non-finite loss or gradient (grad_norm {})\n",
                 stats.step, stats.grad_norm);
    }
    if (on_step) on_step(stats);
    const bool last = step + 1 == tc.steps;
    if ((step + 1) % config_.metrics.log_interval == 0 || last || step == 0) {
      const double interval_seconds = seconds_since(interval_start);
      const double elapsed = seconds_since(start);
      const double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(tc.steps - step - 1);
      fmt::print(out,
                 "step {:>{}}/{} | loss {:.4f} | aux {:.4f} | z {:.4f} | lr {:.2e} | grad_norm {:.3f} "
                 "| imbalance {:.2f} | tok/s {:.0f} | eta {}\n",
                 stats.step, std::to_string(tc.steps).size(), tc.steps, stats.loss, stats.aux_loss,
                 stats.z_loss, stats.lr, stats.grad_norm, stats.load_imbalance,
                 static_cast<double>(interval_tokens) / std::max(interval_seconds, 1e-9),
                 format_duration(eta));
      out.flush();
      interval_start = Clock::now();
      interval_tokens = 0;
    }
    if (last || (tc.val_interval > 0 && (step + 1) % tc.val_interval == 0)) {
      summary.val_loss_end = validate();
      fmt::print(out, "val step {} | val_loss {:.4f}\n", step + 1, summary.val_loss_end);
      out.flush();
      interval_start = Clock::now();  // tokens/s counts training time only
    }
  }
  summary.seconds = seconds_since(start);
  fmt::print(out,
             "summary: steps={} tokens={} seconds={:.1f} val_loss_start={:.4f} val_loss_end={:.4f} "
             "train_loss_end={:.4f} skipped_steps={}\n",
             summary.steps, summary.tokens, summary.seconds, summary.val_loss_start,
             summary.val_loss_end, summary.train_loss_end, summary.skipped_steps);
  out.flush();
  return summary;
}

}  // namespace moe
