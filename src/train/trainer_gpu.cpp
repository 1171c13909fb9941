// The trainer's GPU path: the same step as the CPU path (micro-batches, accumulation,
// global clipping, AdamW, the LR schedule) with the model, gradients and optimizer state
// on the GPU (src/model/cuda/gpu_transformer.h). Builds without CUDA too: then asking
// for the GPU is a config error.
#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "train/batch_controller.h"
#include "train/lr_schedule.h"
#include "train/trainer.h"

#ifdef MOE_HAVE_CUDA
#include "core/gpu.h"
#include "model/cuda/gpu_transformer.h"
#endif

namespace moe {

namespace {

bool gpu_present() {
#ifdef MOE_HAVE_CUDA
  return gpu::device_count() > 0;
#else
  return false;
#endif
}

}  // namespace

bool Trainer::wants_gpu() const {
  const std::string& device = config_.training.device;
  if (device == "cpu") return false;
  if (device == "auto") return gpu_present();
#ifndef MOE_HAVE_CUDA
  MOE_CONFIG_ERROR("training.device = cuda, but this build has no CUDA backend (nvcc was not found at build time)");
#endif
  if (!gpu_present()) MOE_CONFIG_ERROR("training.device = cuda, but no CUDA device is visible");
  return true;
}

#ifdef MOE_HAVE_CUDA

void Trainer::setup_gpu() {
  const RunConfig& c = config_;
  // What the GPU path does not do yet is refused up front rather than silently ignored.
  if (c.model.moe.bias_balancing)
    MOE_CONFIG_ERROR("moe.bias_balancing is not implemented on the GPU yet; use --device=cpu");
  if (c.training.expert_grad_clip > 0)
    MOE_CONFIG_ERROR("training.expert_grad_clip is not implemented on the GPU yet; use --device=cpu");
  if (c.training.memory_limit_mb > 0)
    MOE_CONFIG_ERROR("training.memory_limit_mb applies to the CPU path; on the GPU the micro-batch is halved when "
                     "an allocation fails");
  gpu_.reset(new GpuTransformer(c.model, model_->params()));
}

BatchPlan Trainer::plan_gpu_batches() {
  const TrainingConfig& tc = config_.training;
  BatchPlan plan{tc.micro_batch, tc.global_batch_tokens / (tc.micro_batch * config_.model.seq_len), {}};
  for (;;) {
    try {
      gpu_->plan(plan.micro_batch);
      return plan;
    } catch (const gpu::OutOfMemory& e) {
      if (plan.micro_batch % 2 != 0) throw;  // halving would change the global batch
      plan.notes.push_back(fmt::format(
          "memory: a micro-batch of {} sequences does not fit on the GPU ({}); now {} x {} micro-batches, "
          "the same {} tokens per step",
          plan.micro_batch, e.what(), plan.micro_batch / 2, plan.micro_steps * 2, tc.global_batch_tokens));
      plan.micro_batch /= 2;
      plan.micro_steps *= 2;
      // Free every buffer before trying again, then start over from the host weights.
      gpu_.reset();
      gpu_.reset(new GpuTransformer(config_.model, model_->params()));
    }
  }
}

StepStats Trainer::gpu_train_step(int64_t step) {
  const TrainingConfig& tc = config_.training;
  StepStats stats;
  stats.step = step + 1;
  const auto step_start = std::chrono::steady_clock::now();
  auto seconds_from = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  gpu_->zero_grads();
  gpu_->reset_load();
  const double scale = 1.0 / static_cast<double>(micro_steps_);
  for (int64_t micro = 0; micro < micro_steps_; ++micro) {
    auto t0 = std::chrono::steady_clock::now();
    train_data_->next_batch(micro_batch_, inputs_BS_.data(), targets_BS_.data());
    stats.time.data_wait += seconds_from(t0);
    t0 = std::chrono::steady_clock::now();
    const ForwardResult fwd = gpu_->forward(inputs_BS_.data(), targets_BS_.data());
    gpu_->backward(scale);
    stats.time.compute += seconds_from(t0);
    stats.loss += fwd.ce_loss * scale;
    stats.aux_loss += fwd.aux_loss * scale;
    stats.z_loss += fwd.z_loss * scale;
    stats.dropped += fwd.dropped;
  }
  const auto loads = gpu_->expert_load();
  for (size_t i = 0; i < loads.size(); ++i) {
    LayerRouting r;
    r.layer = config_.model.first_dense_layers + static_cast<int64_t>(i);
    r.tokens_E = loads[i];  // before dropping: the GPU path does not count kept rows per step yet
    for (int64_t load : loads[i]) r.assignments += load;
    stats.load_imbalance = std::max(stats.load_imbalance, r.imbalance());
    stats.layers.push_back(std::move(r));
  }
  const auto optimizer_start = std::chrono::steady_clock::now();
  stats.grad_norm = gpu_->grad_norm();
  stats.lr = learning_rate(config_.lr, step, tc.steps) * progress_.lr_scale;
  if (!std::isfinite(stats.grad_norm) || !std::isfinite(stats.loss)) {
    stats.skipped = true;  // a non-finite gradient never reaches the weights
  } else {
    const double clip = tc.grad_clip > 0 && stats.grad_norm > tc.grad_clip ? tc.grad_clip / (stats.grad_norm + 1e-6) : 1.0;
    gpu_->adamw_step(stats.lr, config_.optimizer.beta1, config_.optimizer.beta2, config_.optimizer.eps,
                     config_.optimizer.weight_decay, static_cast<float>(clip), ++gpu_steps_);
  }
  stats.time.optimizer = seconds_from(optimizer_start);
  stats.time.step = seconds_from(step_start);
  return stats;
}

double Trainer::gpu_validate() {
  const TrainingConfig& tc = config_.training;
  val_data_->reset();
  double total = 0;
  for (int64_t b = 0; b < tc.val_batches; ++b) {
    val_data_->next_batch(micro_batch_, inputs_BS_.data(), targets_BS_.data());
    total += gpu_->forward(inputs_BS_.data(), targets_BS_.data()).ce_loss;
  }
  gpu_->reset_load();
  return total / static_cast<double>(std::max<int64_t>(1, tc.val_batches));
}

void Trainer::download_gpu_weights() {
  if (gpu_) gpu_->download_params(model_->params());
}

void Trainer::sync_state_from_gpu() {
  if (!gpu_) return;
  gpu_->download_state(model_->params(), optimizer_->first_moment(), optimizer_->second_moment());
  optimizer_->set_steps_taken(gpu_steps_);
}

void Trainer::sync_state_to_gpu() {
  if (!gpu_) return;
  gpu_->upload_state(model_->params(), optimizer_->first_moment(), optimizer_->second_moment());
  gpu_steps_ = optimizer_->steps_taken();
}

void GpuTransformerDeleter::operator()(GpuTransformer* model) const { delete model; }

#else

void GpuTransformerDeleter::operator()(GpuTransformer*) const {}
void Trainer::setup_gpu() { MOE_THROW("no CUDA backend in this build"); }
BatchPlan Trainer::plan_gpu_batches() { MOE_THROW("no CUDA backend in this build"); }
StepStats Trainer::gpu_train_step(int64_t) { MOE_THROW("no CUDA backend in this build"); }
double Trainer::gpu_validate() { MOE_THROW("no CUDA backend in this build"); }
void Trainer::download_gpu_weights() {}
void Trainer::sync_state_from_gpu() {}
void Trainer::sync_state_to_gpu() {}

#endif

}  // namespace moe
