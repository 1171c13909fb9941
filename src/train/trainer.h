// The training loop on the CPU: micro-batches with gradient accumulation up to the
// global batch in tokens, clipping, AdamW, the LR schedule, balancing-bias updates,
// periodic validation and a line of output per logged step.
#pragma once
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>

#include "model/transformer.h"
#include "train/adamw.h"
#include "train/batch_source.h"
#include "train/config.h"

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
};

class Trainer {
 public:
  Trainer(const RunConfig& config, std::unique_ptr<BatchSource> train_data,
          std::unique_ptr<BatchSource> val_data);
  // Runs training.steps optimizer steps, writing progress lines to `out`.
  TrainSummary run(std::ostream& out);
  // One optimizer step (exposed for tests).
  StepStats train_step(int64_t step);
  // Mean cross-entropy over training.val_batches held-out micro-batches.
  double validate();
  Transformer<float>& model() { return *model_; }
  int64_t micro_batches_per_step() const { return micro_steps_; }
  // Called after every optimizer step (tests, metrics).
  std::function<void(const StepStats&)> on_step;

 private:
  RunConfig config_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<Transformer<float>> model_;
  std::unique_ptr<AdamW> optimizer_;
  int64_t micro_steps_ = 1;
  std::vector<int32_t> inputs_BS_, targets_BS_;
};

// Parameter counts for the log and MFU: total, and active per token (top-k experts).
struct ParameterCounts {
  int64_t total = 0;
  int64_t active = 0;
  int64_t embedding = 0;
};
ParameterCounts count_parameters(const ModelConfig& config, const ParameterStore<float>& params);

}  // namespace moe
