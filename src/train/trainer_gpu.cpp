// The trainer's GPU path: a ModelBackend for the one step loop of trainer.cpp
// (micro-batches, accumulation, global clipping, AdamW, the LR schedule) with the model,
// gradients and optimizer state on the GPU (src/model/cuda/gpu_transformer.h). Builds without CUDA too: then asking
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
  gpu_.reset(new GpuTransformer(c.model, model_->params(), moment_dtype_from_name(c.optimizer.state_dtype)));
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
      gpu_.reset(new GpuTransformer(config_.model, model_->params(),
                                    moment_dtype_from_name(config_.optimizer.state_dtype)));
    }
  }
}

namespace {

// The model, gradients and AdamW state on the GPU.
class GpuBackend final : public ModelBackend {
 public:
  GpuBackend(const RunConfig& config, GpuTransformer& gpu, ParameterStore<float>& host_params, int64_t& steps)
      : config_(config), gpu_(gpu), host_params_(host_params), steps_(steps) {}
  void begin_step() override {
    gpu_.zero_grads();
    gpu_.reset_load();
  }
  ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS) override {
    return gpu_.forward(inputs_BS, targets_BS);
  }
  void backward(double loss_scale, bool) override { gpu_.backward(loss_scale); }
  void routing(StepStats& stats) override {
    const auto loads = gpu_.expert_load();
    for (size_t i = 0; i < loads.size(); ++i) {
      LayerRouting r;
      r.layer = config_.model.first_dense_layers + static_cast<int64_t>(i);
      r.tokens_E = loads[i];  // before dropping: the GPU path does not count kept rows per step yet
      for (int64_t load : loads[i]) r.assignments += load;
      stats.load_imbalance = std::max(stats.load_imbalance, r.imbalance());
      stats.layers.push_back(std::move(r));
    }
  }
  // The GPU scales the gradients inside the AdamW kernel (expert clipping is refused in setup_gpu).
  ClipStats clip_gradients(double max_global_norm, double) override {
    ClipStats clip;
    clip.global_norm = gpu_.grad_norm();
    clip.global_clipped = max_global_norm > 0 && clip.global_norm > max_global_norm;
    grad_scale_ = clip.global_clipped ? max_global_norm / (clip.global_norm + 1e-6) : 1.0;
    return clip;
  }
  void apply_update(double lr) override {
    const OptimizerConfig& o = config_.optimizer;
    gpu_.adamw_step(lr, o.beta1, o.beta2, o.eps, o.weight_decay, static_cast<float>(grad_scale_), ++steps_);
  }
  void end_step() override {}
  void end_validation() override { gpu_.reset_load(); }
  void sync_host_model() override { gpu_.download_params(host_params_); }

 private:
  const RunConfig& config_;
  GpuTransformer& gpu_;
  ParameterStore<float>& host_params_;
  int64_t& steps_;
  double grad_scale_ = 1.0;
};

}  // namespace

std::unique_ptr<ModelBackend> Trainer::make_gpu_backend() {
  return std::make_unique<GpuBackend>(config_, *gpu_, model_->params(), gpu_steps_);
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
std::unique_ptr<ModelBackend> Trainer::make_gpu_backend() { MOE_THROW("no CUDA backend in this build"); }
void Trainer::sync_state_from_gpu() {}
void Trainer::sync_state_to_gpu() {}

#endif

}  // namespace moe
