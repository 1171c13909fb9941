// The training loop: micro-batches with gradient accumulation up to the global batch in
// tokens, clipping, AdamW, the LR schedule, periodic validation, checkpoints, faults and a
// line of output per logged step, over whichever ModelBackend the config asks for
// (train/backends/: CPU, CPU ranks, GPUs).
#pragma once
#include <chrono>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

#include "config/run_config.h"
#include "data/batch_source.h"
#include "model/transformer.h"
#include "obs/observer.h"
#include "optim/adamw.h"
#include "train/backends/model_backend.h"
#include "train/checkpoint.h"
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
  // Parts of `seconds`: validations after steps, and training held up by checkpoint saves.
  double validation_seconds = 0;
  double checkpoint_seconds = 0;
};

namespace dist {
class Communicator;
}

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
  // The same over `batches` micro-batches (of training.micro_batch sequences) of the
  // held-out source from its first (`moe eval`); progress(done, total) after each one this
  // rank computes.
  double evaluate(int64_t batches, const std::function<void(int64_t done, int64_t total)>& progress = {});
  // The host model (the backend's): the CPU path trains it; on the GPU it holds the
  // initial weights and, after run(), the trained ones.
  Transformer<float>& model() { return backend_->host_model(); }
  bool on_gpu() const { return backend_->on_gpu(); }
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
  // A checkpoint's weights (from any layout, as resume reads them) for evaluation; the data
  // position, progress and run id stay this run's. Returns the checkpoint's step.
  int64_t load_weights(const std::string& path, std::ostream& out);
  // Continued pretraining: the parameters from a Hugging Face Mixtral folder
  // (train/hf_import.h), before step 1; the optimizer starts fresh.
  void init_from_hf(const std::string& dir, std::ostream& out);
  // --resume found no checkpoint: the run starts at step 0 but continues the run whose
  // files metrics.dir holds (its metrics start over).
  void continue_run();
  const std::string& run_id() const { return run_id_; }
  void save_checkpoint(std::ostream& out);
  const TrainProgress& progress() const { return progress_; }
  int64_t micro_batch() const { return micro_batch_; }  // after the memory controller
  // Progress bar and dashboard feed for run()'s metrics (src/obs/observer.h).
  ObserverOptions observer_options;
  // The run's tokenizer as a tokenizer.json (Tokenizer::hf_tokenizer_json), kept in every
  // checkpoint so that export, eval and generate decode as the run did; "": none.
  std::string tokenizer_json;

 private:
  // moe.merge_interval: after every merge_interval-th applied step, the merge event on the
  // step's loads; its merges into stats.layers (metrics) and the log.
  void merge_experts(StepStats& stats);
  void restore_merge_state(const std::string& text);

  // The experts the next merge event leaves alone (the last event's split pairs, per MoE
  // layer); checkpoints keep it (expert_merge_state).
  std::vector<std::vector<int64_t>> merge_protected_LE_;

  RunConfig config_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<ModelBackend> backend_;  // what train_step drives; it owns the model state
  int rank_ = 0, world_ = 1;
  int64_t micro_steps_ = 1;
  std::vector<int32_t> inputs_BS_, targets_BS_;
  // metrics.trace's time zero: each step's phases are placed after it.
  std::chrono::steady_clock::time_point trace_origin_ = std::chrono::steady_clock::now();
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
  // Several ranks: each reads its slice of the global batch (checks the batch divides).
  void slice_data_over_ranks(int rank, int world);
  // Loads a read checkpoint's slices this rank needs into the backend
  // (ModelBackend::restore_targets, finish_restore), the data position and the progress.
  SliceReadStats restore_from(const LoadedCheckpoint& checkpoint);
  // This rank's checkpoint writer is done and, with several ranks, so is rank 0's.
  void wait_for_saved_checkpoints(std::ostream& out);
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
