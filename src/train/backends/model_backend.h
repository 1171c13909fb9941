// The interface between the step loop and the model it trains, and what a step measures.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/transformer.h"
#include "obs/metrics.h"
#include "optim/adamw.h"
#include "optim/grad_clip.h"
#include "train/batch_controller.h"
#include "train/expert_merging.h"
#include "train/state_pieces.h"

namespace moe {

// One optimizer step's measurements.
struct StepStats {
  int64_t step = 0;
  double loss = 0, aux_loss = 0, z_loss = 0;  // means over the micro-batches
  double lr = 0;
  double grad_norm = 0, max_expert_grad_norm = 0;
  double load_imbalance = 0;  // max over MoE layers of max/mean - 1 of tokens per expert
  int64_t dropped = 0;
  bool skipped = false;
  StepTimes time;                    // step, data wait, compute, communication wait, optimizer
  std::vector<LayerRouting> layers;  // per MoE layer: tokens per expert, drops, entropy, bias
  // Communication (0 in one process): gradient-sync latency, expert-parallel all-to-all
  // bytes sent to other ranks and the time those exchanges took (issue to completion).
  double grad_sync_ms = 0;
  int64_t a2a_bytes = 0;
  int64_t a2a_off_node_bytes = 0;  // the token rows of a2a_bytes sent to ranks of other (simulated) nodes
  double a2a_seconds = 0;
  std::vector<RankLoad> ranks;       // experts per rank and their load; empty: one rank holds all
  // GPU, metrics.phase_times or metrics.trace: ms per phase of the model's stream.
  std::vector<std::pair<std::string, double>> phase_ms;
  std::vector<PhaseSpan> spans;  // metrics.trace: the step's phases (train_step's host timers, then phase_ms)
  BoardSummary board;            // GPU: the SM clock and power during the step (take_board_stats)
};

// What the step loop (Trainer::train_step) needs from the model it trains: the CPU
// reference (cpu_backend.h), the CPU model spread over ranks (parallel_cpu_backend.h) or
// the GPU model on one or more GPUs (cuda/gpu_backend.h); backend_factory.h picks one.
// One loop drives all three; the Trainer knows no other type of them.
// The host copy of the trained state, in the single-process layout: the model (initial
// weights; what checkpoints and exports read and write) and its AdamW. Every backend owns
// one: the CPU reference trains it; the others fill it for exports and at the end of a run
// (sync_host_model) and, unless they save their own pieces (save_state), for checkpoints.
struct HostState {
  std::unique_ptr<Transformer<float>> model;
  std::unique_ptr<AdamW> optimizer;
};

class ModelBackend {
 public:
  explicit ModelBackend(HostState host) : host_(std::move(host)) {}
  virtual ~ModelBackend() = default;
  Transformer<float>& host_model() { return *host_.model; }
  AdamW& host_optimizer() { return *host_.optimizer; }
  // Once, before anything else: plans the model's memory for training.micro_batch, halving
  // the micro-batch (and doubling the accumulation) while it does not fit, and finishes
  // the set-up that depends on the micro-batch.
  virtual BatchPlan plan_batches() = 0;
  virtual bool on_gpu() const { return false; }
  // What trains, for the start-up line: "cpu", or the GPU's name.
  virtual std::string device_name() const { return "cpu"; }
  // Before the first micro-batch: zero the gradients, reset the expert loads.
  virtual void begin_step() = 0;
  virtual ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS) = 0;
  // Backward of the last forward, loss weighted by loss_scale; `last` marks the step's
  // last micro-batch (gradient communication starts during its backward).
  virtual void backward(double loss_scale, bool last) = 0;
  // After the micro-batches: stats.loss and .dropped summed over the ranks (one process: as is).
  virtual void reduce_losses(StepStats& stats) { (void)stats; }
  // Fills stats.layers and stats.load_imbalance from the step's routing.
  virtual void routing(StepStats& stats) = 0;
  // Norms (per expert, then global) and clipping of the gradients, applied by apply_update.
  virtual ClipStats clip_gradients(double max_global_norm, double max_expert_norm) = 0;
  // AdamW (and the balancing-bias update).
  virtual void apply_update(double lr) = 0;
  // After the step, applied or skipped.
  virtual void end_step() = 0;
  // A validation micro-batch's loss (a forward with validating() true: observers of
  // training's routing, such as the routing-cache probe, leave it alone), then the sum of
  // such values over the ranks.
  double eval_loss(const int32_t* inputs_BS, const int32_t* targets_BS) {
    validating_ = true;
    try {
      const double loss = forward(inputs_BS, targets_BS).ce_loss;
      validating_ = false;
      return loss;
    } catch (...) {
      validating_ = false;
      throw;
    }
  }
  virtual double sum_over_ranks(double value) { return value; }
  virtual void end_validation() = 0;
  // The step's communication measurements into stats (and reset them).
  virtual void take_comm_stats(StepStats& stats) { (void)stats; }
  // The board's SM clock and power sampled since the last call (GPU; none elsewhere).
  virtual void take_board_stats(StepStats& stats) { (void)stats; }
  // The finished step's times (stats.time.step set): parallel.a2a_compression = auto
  // decides from them which layers compress the next step's exchanges. Collective.
  virtual void observe_step(const StepStats& stats) { (void)stats; }
  // The trained weights into the host model (GPU download, expert gather across ranks).
  virtual void sync_host_model() {}
  // Checkpoints (train/checkpoint.h), each rank saving and restoring only its own state.
  // save_state (collective): this rank's current state as slices of the checkpoint's
  // global tensors, each with how many ranks hold the same bits (replicas) and which copy
  // this is; rank/world: this rank in the run's world. restore_targets: the slices this
  // rank needs and where they go; finish_restore (collective), once they are filled.
  // The defaults are for backends whose state is the host state (one copy of `world`
  // replicas); a backend that keeps its state elsewhere (GPU) or sharded overrides the three.
  virtual SavedState save_state(int rank, int world) {
    return {host_state_pieces(host_model(), host_optimizer(), world, rank), host_optimizer().steps_taken()};
  }
  virtual std::vector<StateTarget> restore_targets() { return host_state_targets(host_model(), host_optimizer()); }
  virtual void finish_restore(int64_t adam_steps) { host_optimizer().set_steps_taken(adam_steps); }
  // The experts' placement and the re-placement's state, as text a checkpoint keeps
  // (empty: nothing to keep), and taking it back after a restore (collective; ignored
  // where it does not fit this run, e.g. another EP size).
  virtual std::string placement_state() const { return {}; }
  // moe.merge_interval: one expert-merge event after step `step` (train/expert_merging.h)
  // on the trained state: by default the host state (the CPU reference trains it); the GPU
  // merges a host copy of its state and uploads it back. Per MoE layer, the merges made.
  virtual std::vector<std::vector<ExpertMerge>> merge_experts(const MoEConfig& config,
                                                              const std::vector<std::vector<int64_t>>& load_LE,
                                                              const std::vector<std::vector<int64_t>>& protected_LE,
                                                              uint64_t seed, int64_t step) {
    return merge_host_experts(host_model(), host_optimizer(), config, load_LE, protected_LE, seed, step);
  }
  virtual void restore_placement(const std::string& state) { (void)state; }

 protected:
  // Inside eval_loss's forward.
  bool validating() const { return validating_; }

 private:
  HostState host_;
  bool validating_ = false;
};

}  // namespace moe
