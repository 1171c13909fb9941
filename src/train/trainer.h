// The training loop on the CPU: micro-batches with gradient accumulation up to the
// global batch in tokens, clipping, AdamW, the LR schedule, balancing-bias updates,
// periodic validation and a line of output per logged step.
#pragma once
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>

#include "model/transformer.h"
#include "obs/observer.h"
#include "train/adamw.h"
#include "train/batch_controller.h"
#include "train/batch_source.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/fault_monitor.h"

namespace moe {

struct TrainSummary {
  int64_t steps = 0;
  int64_t tokens = 0;
  double seconds = 0;
  double val_loss_start = 0;
  double val_loss_end = 0;
  double train_loss_end = 0;  // mean cross-entropy of the last step
  int64_t skipped_steps = 0;  // updates skipped for a non-finite gradient
};

// One optimizer step's measurements.
struct StepStats {
  int64_t step = 0;
  double loss = 0, aux_loss = 0, z_loss = 0;  // means over the micro-batches
  double lr = 0;
  double grad_norm = 0, max_expert_grad_norm = 0;
  double load_imbalance = 0;  // max over MoE layers of max/mean - 1 of tokens per expert
  int64_t dropped = 0;
  bool skipped = false;
  StepTimes time;                    // step, data wait, compute, optimizer (no communication yet)
  std::vector<LayerRouting> layers;  // per MoE layer: tokens per expert, drops, entropy, bias
};

class GpuTransformer;
// Deletes the GPU model where its type is complete (src/train/trainer_gpu.cpp), so this
// header and CPU-only builds never need it.
struct GpuTransformerDeleter {
  void operator()(GpuTransformer* model) const;
};

class Trainer {
 public:
  Trainer(const RunConfig& config, std::unique_ptr<BatchSource> train_data,
          std::unique_ptr<BatchSource> val_data);
  ~Trainer();
  // Runs training.steps optimizer steps, writing progress lines to `out`.
  TrainSummary run(std::ostream& out);
  // One optimizer step (exposed for tests).
  StepStats train_step(int64_t step);
  // Mean cross-entropy over training.val_batches held-out micro-batches.
  double validate();
  // The host model: the CPU path trains it; on the GPU it holds the initial weights and,
  // after run(), the trained ones.
  Transformer<float>& model() { return *model_; }
  bool on_gpu() const { return gpu_ != nullptr; }
  int64_t micro_batches_per_step() const { return micro_steps_; }
  // Called after every optimizer step (tests, metrics).
  std::function<void(const StepStats&)> on_step;
  // Checkpoints and faults (src/train/checkpoint_trainer.cpp). Continues from a checkpoint
  // directory: refuses another model shape, warns on other config differences.
  void resume(const std::string& path, std::ostream& out);
  void save_checkpoint(std::ostream& out);
  const TrainProgress& progress() const { return progress_; }
  int64_t micro_batch() const { return micro_batch_; }  // after the memory controller
  // Progress bar and dashboard feed for run()'s metrics (src/obs/observer.h).
  ObserverOptions observer_options;

 private:
  RunConfig config_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<Transformer<float>> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<GpuTransformer, GpuTransformerDeleter> gpu_;  // set when training.device resolves to cuda
  int64_t gpu_steps_ = 0;                // AdamW steps taken on the GPU
  int64_t micro_steps_ = 1;
  std::vector<int32_t> inputs_BS_, targets_BS_;
  // Checkpoints and faults.
  int64_t micro_batch_ = 1;                // may be below training.micro_batch under memory pressure
  std::vector<std::string> batch_notes_;   // what the memory controller did, printed by run()
  TrainProgress progress_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<FaultMonitor> monitor_;
  int64_t furthest_step_ = 0, reloads_without_progress_ = 0;
  // Plans the model's arenas, halving the micro-batch while it does not fit.
  void plan_batches();
  // The GPU path (src/train/trainer_gpu.cpp): whether training.device asks for it, and
  // its step and validation.
  bool wants_gpu() const;
  void setup_gpu();
  // Plans the GPU buffers, halving the micro-batch while an allocation fails.
  BatchPlan plan_gpu_batches();
  StepStats gpu_train_step(int64_t step);
  double gpu_validate();
  // The host model gets the GPU's trained weights (no-op on the CPU path).
  void download_gpu_weights();
  // Checkpoints of GPU runs: the host model and AdamW take the GPU's state before a save,
  // and the GPU takes theirs after a restore (no-ops on the CPU path).
  void sync_state_from_gpu();
  void sync_state_to_gpu();
  // After each step: fault handling, checkpoints, preemption. True: stop the run.
  bool after_step(const StepStats& stats, std::ostream& out);
  void reload_after_faults(const StepStats& stats, std::ostream& out);
};

// Parameter counts for the log and MFU: total, and active per token (top-k experts).
struct ParameterCounts {
  int64_t total = 0;
  int64_t active = 0;
  int64_t embedding = 0;
};
ParameterCounts count_parameters(const ModelConfig& config, const ParameterStore<float>& params);

}  // namespace moe
