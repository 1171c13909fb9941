// The training loop on the CPU: micro-batches with gradient accumulation up to the
// global batch in tokens, clipping, AdamW, the LR schedule, balancing-bias updates,
// periodic validation and a line of output per logged step.
#pragma once
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

#include "model/transformer.h"
#include "obs/observer.h"
#include "train/adamw.h"
#include "train/batch_controller.h"
#include "train/batch_source.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/fault_monitor.h"
#include "train/grad_clip.h"

namespace moe {

struct TrainSummary {
  int64_t steps = 0;
  int64_t tokens = 0;
  double seconds = 0;
  double val_loss_start = 0;
  double val_loss_end = 0;
  double train_loss_end = 0;  // mean cross-entropy of the last step
  int64_t skipped_steps = 0;  // updates skipped for a non-finite gradient
  // Parts of `seconds`: validations after steps, and training held up by checkpoint saves.
  double validation_seconds = 0;
  double checkpoint_seconds = 0;
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
  StepTimes time;                    // step, data wait, compute, communication wait, optimizer
  std::vector<LayerRouting> layers;  // per MoE layer: tokens per expert, drops, entropy, bias
  // Communication (0 in one process): gradient-sync latency, expert-parallel all-to-all
  // bytes sent to other ranks and the time those exchanges took (issue to completion).
  double grad_sync_ms = 0;
  int64_t a2a_bytes = 0;
  double a2a_seconds = 0;
  std::vector<RankLoad> ranks;       // experts per rank and their load; empty: one rank holds all
  std::vector<std::pair<std::string, double>> phase_ms;  // GPU, metrics.phase_times: ms per phase of the model's stream
};

// What the step loop (Trainer::train_step) needs from the model it trains: the CPU
// reference (Transformer + AdamW), the GPU model, or the CPU model spread over ranks
// (src/dist/parallel_trainer.h). One loop drives all three.
class ModelBackend {
 public:
  virtual ~ModelBackend() = default;
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
  // A validation micro-batch's loss, then the sum of such values over the ranks.
  virtual double eval_loss(const int32_t* inputs_BS, const int32_t* targets_BS) { return forward(inputs_BS, targets_BS).ce_loss; }
  virtual double sum_over_ranks(double value) { return value; }
  virtual void end_validation() = 0;
  // The step's communication measurements into stats (and reset them).
  virtual void take_comm_stats(StepStats& stats) { (void)stats; }
  // The trained weights into the host model (GPU download, expert gather across ranks).
  virtual void sync_host_model() {}
  // Checkpoints of multi-rank runs. gather_state (collective): afterwards this rank's host
  // model holds every parameter's current value and `optimizer` every moment and the step
  // count, in the single-process layout, whatever the backend shards over the ranks.
  // scatter_state: the reverse, once every rank has loaded the same checkpoint into its
  // host model and `optimizer`. No-ops where the host model and `optimizer` are the state.
  virtual void gather_state(AdamW& optimizer) { (void)optimizer; }
  virtual void scatter_state(AdamW& optimizer) { (void)optimizer; }
  // The experts' placement and the re-placement's state, as text a checkpoint keeps
  // (empty: nothing to keep), and taking it back after a restore (collective; ignored
  // where it does not fit this run, e.g. another EP size).
  virtual std::string placement_state() const { return {}; }
  virtual void restore_placement(const std::string& state) { (void)state; }
};

namespace dist {
class Communicator;
class GpuExpertExchangeOverComm;
class GpuDataParallel;
}

class GpuTransformer;
// Deletes the GPU model where its type is complete (src/train/trainer_gpu.cpp), so this
// header and CPU-only builds never need it.
struct GpuTransformerDeleter {
  void operator()(GpuTransformer* model) const;
};

class Trainer {
 public:
  // The ranks come from the launch environment and parallel.backend.
  Trainer(const RunConfig& config, std::unique_ptr<BatchSource> train_data,
          std::unique_ptr<BatchSource> val_data);
  // Over the ranks of `world` (tests; a world of one trains in this process).
  Trainer(const RunConfig& config, std::unique_ptr<BatchSource> train_data, std::unique_ptr<BatchSource> val_data,
          std::unique_ptr<dist::Communicator> world);
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
  // Data/expert-parallel run: this rank and the number of ranks (1 in one process).
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int64_t micro_batches_per_step() const { return micro_steps_; }
  // Called after every optimizer step (tests, metrics).
  std::function<void(const StepStats&)> on_step;
  // Checkpoints and faults (src/train/checkpoint_trainer.cpp). Continues from a checkpoint
  // directory: refuses another model shape, warns on other config differences; the run
  // takes over the checkpoint's run id (src/train/run_dirs.h).
  // A checkpoint.dir holding later checkpoints than the resumed one (another timeline) is
  // refused, or with `discard_later` they are deleted before step 1.
  void resume(const std::string& path, std::ostream& out, bool discard_later = false);
  // --resume found no checkpoint: the run starts at step 0 but continues the run whose
  // files metrics.dir holds (its metrics start over).
  void continue_run();
  const std::string& run_id() const { return run_id_; }
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
  std::unique_ptr<ModelBackend> backend_;  // what train_step drives
  int rank_ = 0, world_ = 1;
  int64_t micro_steps_ = 1;
  std::vector<int32_t> inputs_BS_, targets_BS_;
  // Checkpoints and faults.
  int64_t micro_batch_ = 1;                // may be below training.micro_batch under memory pressure
  std::vector<std::string> batch_notes_;   // what the memory controller did, printed by run()
  TrainProgress progress_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<FaultMonitor> monitor_;
  int64_t furthest_step_ = 0, reloads_without_progress_ = 0;
  // The run's identity and whether this session continues it (src/train/run_dirs.h).
  std::string run_id_;
  bool resumed_ = false;
  std::optional<int64_t> discard_after_;  // resume(..., discard_later): checkpoints after this step go
  // Before step 1 (rank 0 decides, every rank stops): the output folders belong to this
  // run (run_dirs.h); then a discarded timeline's checkpoints go, and metrics.dir gets
  // run.json and config.toml.
  void prepare_run_dirs(std::ostream& out);
  // run()'s observer while it runs (checkpoint lines and records go through it), else null.
  Observer* observer_ = nullptr;
  double checkpoint_pause_seconds_ = 0;   // training held up by saves in this run()
  std::optional<CheckpointSave> background_save_;  // queued by checkpoint.async, not yet reported written
  // A checkpoint line (and record) through the observer, or onto `out` outside run().
  void report_checkpoint(const CheckpointSave& save, std::ostream& out);
  // Reports a background save that has finished; with `wait`, waits for one in flight.
  void collect_background_save(bool wait, std::ostream& out);
  // Plans the model's arenas, halving the micro-batch while it does not fit.
  void plan_batches();
  // The GPU path (src/train/trainer_gpu.cpp): whether training.device asks for it, and
  // its step and validation.
  bool wants_gpu() const;
  void setup_gpu();
  void configure_gpu_model();  // recompute and graph settings of training.* onto the GPU model
  // Plans the GPU buffers, halving the micro-batch while an allocation fails.
  BatchPlan plan_gpu_batches();
  std::unique_ptr<ModelBackend> make_gpu_backend();
  // Data/expert parallelism over the ranks of the launch (src/dist/parallel_trainer.cpp):
  // slices the data per rank and makes the CPU backend; false in a world of one. An NCCL
  // world is kept in gpu_world_ for the GPU's data-parallel backend (false as well).
  bool setup_parallel(std::unique_ptr<dist::Communicator> world);
  // parallel.backend = nccl: what the GPU data-parallel path refuses (trainer_gpu.cpp).
  void check_gpu_data_parallel() const;
  std::unique_ptr<dist::Communicator> gpu_world_;  // until make_gpu_backend takes it
  // parallel.expert_parallel > 1 on the GPU: the EP group's exchange (kept across re-plans).
  std::shared_ptr<dist::GpuExpertExchangeOverComm> gpu_expert_exchange_;
  dist::GpuDataParallel* gpu_dp_ = nullptr;  // the GPU backend's data-parallel group (it owns it), or null
  // Checkpoints of GPU runs: the host model and AdamW take the GPU's state before a save,
  // and the GPU takes theirs after a restore (no-ops on the CPU path).
  void sync_state_from_gpu();
  void sync_state_to_gpu();
  // Loads a read checkpoint into the model, optimizer and data (every rank), then into the
  // backend's shards and the GPU.
  void restore_from(const LoadedCheckpoint& checkpoint);
  // This rank's checkpoint writer is done and, with several ranks, so is rank 0's.
  void wait_for_saved_checkpoints(std::ostream& out);
  // After each step: fault handling, checkpoints, preemption. True: stop the run.
  bool after_step(const StepStats& stats, std::ostream& out);
  void reload_after_faults(const StepStats& stats, std::ostream& out);
};

// parallel.backend as the launch resolves it: auto becomes nccl when the launch has
// several ranks and training.device resolves to the GPU (src/train/trainer_gpu.cpp).
std::string resolve_parallel_backend(const RunConfig& config);

// Parameter counts for the log and MFU: total, and active per token (top-k experts).
struct ParameterCounts {
  int64_t total = 0;
  int64_t active = 0;
  int64_t embedding = 0;
};
ParameterCounts count_parameters(const ModelConfig& config, const ParameterStore<float>& params);

}  // namespace moe
