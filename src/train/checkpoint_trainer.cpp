// The Trainer's checkpoint and fault handling, kept out of trainer.cpp: planning under a
// memory limit, saving and resuming, NaN recovery by reload, preemption.
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <ostream>

#include "core/error.h"
#include "train/batch_controller.h"
#include "train/checkpoint.h"
#include "train/hf_import.h"
#include "train/run_dirs.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace moe {
namespace {

// Reloads that did not get training past the furthest step before giving up.
constexpr int64_t kMaxReloadsWithoutProgress = 5;

const char* signal_name(int sig) {
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGINT) return "SIGINT";
  return "a stop request";
}

}  // namespace

void Trainer::plan_batches() {
  const TrainingConfig& tc = config_.training;
  BatchPlan plan = backend_->plan_batches();
  micro_batch_ = plan.micro_batch;
  micro_steps_ = plan.micro_steps;
  batch_notes_ = std::move(plan.notes);
  checkpointer_ = std::make_unique<Checkpointer>(config_.checkpoint);
  monitor_ = std::make_unique<FaultMonitor>(tc);
}

// Every rank saves its own state (ModelBackend::save_state: pieces of the global tensors)
// into its own shard, in parallel; rank 0 writes the manifest once every rank has reported
// (train/checkpoint.h). The ranks agree on the save's id first (one collective), which
// names the temporary directory they share.
void Trainer::save_checkpoint(std::ostream& out) {
  MOE_CHECK(checkpointer_->enabled(), "save_checkpoint needs checkpoint.dir");
  const auto start = std::chrono::steady_clock::now();
  collect_background_save(/*wait=*/true, out);  // one save at a time
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const SavedState state = backend_->save_state(rank_, world_);
  CheckpointSnapshot snapshot = capture_state(config_, state, *train_data_, progress_);
  if (rank_ == 0) snapshot.tokenizer_json = tokenizer_json;
  if (world_ > 1) {
    // Rank 0's random id (48 bits: exact in a double's sum) to every rank.
    const uint64_t mine = rank_ == 0 ? std::stoull(snapshot.save_id, nullptr, 16) >> 16 : 0;
    snapshot.save_id = fmt::format("{:012x}", static_cast<uint64_t>(backend_->sum_over_ranks(static_cast<double>(mine))));
  }
  snapshot.expert_placement = backend_->placement_state();
  if (config_.model.moe.merge_interval > 0) snapshot.expert_merge = nlohmann::json{{"protected", merge_protected_LE_}}.dump();
  snapshot.run_id = run_id_;
  snapshot.rank = rank_;
  snapshot.world_size = world_;
  snapshot.expert_parallel = config_.parallel.expert_parallel;
  snapshot.zero = world_ > 1 ? config_.parallel.zero : 0;
  CheckpointSave save;
  save.step = progress_.step;
  save.path = checkpoint_path(config_.checkpoint.dir, progress_.step).string();
  save.background = checkpointer_->async();
  if (const std::optional<CheckpointWrite> written = checkpointer_->save(std::move(snapshot))) {
    save.written = true;
    save.bytes = written->bytes;
    save.write_seconds = written->seconds;
    save.shard_bytes = written->shard_bytes;
    save.shard_seconds = written->shard_seconds;
  }
  save.paused_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  save.waited_seconds = waited;
  checkpoint_pause_seconds_ += save.paused_seconds;
  if (save.background) background_save_ = save;
  report_checkpoint(save, out);
}

void Trainer::report_checkpoint(const CheckpointSave& save, std::ostream& out) {
  if (observer_) {
    observer_->checkpoint(save);
  } else if (rank_ == 0) {
    fmt::print(out, "{}\n", describe(save));
    out.flush();
  }
}

void Trainer::collect_background_save(bool wait, std::ostream& out) {
  const std::optional<CheckpointWrite> written = wait ? checkpointer_->wait() : checkpointer_->take_finished();
  if (!written || !background_save_) return;
  CheckpointSave save = *std::exchange(background_save_, std::nullopt);
  save.written = true;
  save.bytes = written->bytes;
  save.write_seconds = written->seconds;
  save.shard_bytes = written->shard_bytes;
  save.shard_seconds = written->shard_seconds;
  report_checkpoint(save, out);
}

// Each rank reads the slices it needs, whichever layout wrote them.
SliceReadStats Trainer::restore_from(const LoadedCheckpoint& checkpoint) {
  const SliceReadStats read = read_slices(checkpoint, backend_->restore_targets());
  backend_->finish_restore(checkpoint.manifest.adam_steps);
  train_data_->restore(checkpoint.manifest.source_state);
  progress_ = checkpoint_progress(checkpoint);
  backend_->restore_placement(checkpoint.expert_placement);
  restore_merge_state(checkpoint.expert_merge);
  return read;
}

// The experts the next merge event leaves alone, as saved; none when the checkpoint has no record.
void Trainer::restore_merge_state(const std::string& text) {
  merge_protected_LE_.clear();
  if (text.empty()) return;
  const nlohmann::json state = nlohmann::json::parse(text, nullptr, false);
  MOE_CHECK(!state.is_discarded() && state.is_object(), "checkpoint: expert_merge is not JSON");
  merge_protected_LE_ = state.value("protected", std::vector<std::vector<int64_t>>{});
}

void Trainer::wait_for_saved_checkpoints(std::ostream& out) {
  collect_background_save(/*wait=*/true, out);
  if (world_ > 1) backend_->sum_over_ranks(0.0);  // a barrier: rank 0's last save is on disk
}

void Trainer::resume(const std::string& path, std::ostream& out, bool discard_later) {
  wait_for_saved_checkpoints(out);
  LoadedCheckpoint checkpoint = read_checkpoint(path);
  check_resume_compatible(checkpoint, config_, out);
  // Later checkpoints belong to a timeline this run leaves: pruning by step, a NaN reload
  // and --resume auto would mix the two.
  std::vector<std::string> later;
  if (checkpointer_->enabled())
    for (const CheckpointListing& c : list_checkpoints(config_.checkpoint.dir))
      if (c.step > checkpoint.step) later.push_back(c.path.filename().string());
  if (!later.empty() && !discard_later)
    MOE_CONFIG_ERROR("--resume {}: checkpoint.dir \"{}\" holds later checkpoints ({}): going on from step {} would mix "
                     "two timelines; add --discard-newer-checkpoints to delete them, or resume into another "
                     "checkpoint.dir",
                     path, config_.checkpoint.dir, later.size() == 1 ? later[0] : later.front() + " ... " + later.back(),
                     checkpoint.step);
  const SliceReadStats read = restore_from(checkpoint);
  if (!checkpoint.run_id.empty()) run_id_ = checkpoint.run_id;  // else written before run ids: a new id
  resumed_ = true;
  if (!later.empty()) discard_after_ = checkpoint.step;
  furthest_step_ = progress_.step;
  reloads_without_progress_ = 0;
  monitor_->reset();
  fmt::print(out, "resume: {} (step {}, lr x{}; written by {} rank{}, EP {}; this rank read {:.1f} MB in {:.2f} s, {:.2f} GB/s)\n",
             checkpoint.path.string(), progress_.step, progress_.lr_scale, checkpoint.manifest.world_size,
             checkpoint.manifest.world_size == 1 ? "" : "s", checkpoint.manifest.expert_parallel,
             static_cast<double>(read.bytes) / 1e6, read.seconds,
             read.seconds > 0 ? static_cast<double>(read.bytes) / 1e9 / read.seconds : 0.0);
}

int64_t Trainer::load_weights(const std::string& path, std::ostream& out) {
  LoadedCheckpoint checkpoint = read_checkpoint(path);
  check_resume_compatible(checkpoint, config_, out);
  read_slices(checkpoint, backend_->restore_targets());
  backend_->finish_restore(checkpoint.manifest.adam_steps);
  backend_->restore_placement(checkpoint.expert_placement);
  return checkpoint.step;
}

void Trainer::init_from_hf(const std::string& dir, std::ostream& out) {
  const HfWeights hf(dir, config_.model);
  // The parameters from the folder, this rank's slices of them; AdamW moments and balancing
  // biases start at zero, as in a fresh run.
  for (const StateTarget& target : backend_->restore_targets()) {
    if (target.tensor.starts_with("param/")) hf.read(target.tensor.substr(6), target.begin, target.count, target.data);
    else std::fill(target.data, target.data + target.count, 0.0f);
  }
  backend_->finish_restore(0);
  fmt::print(out, "init: parameters from {} (Hugging Face Mixtral); AdamW state fresh\n", dir);
}

void Trainer::continue_run() {
  resumed_ = true;
  if (rank_ != 0) return;  // only rank 0 writes metrics
  if (const std::string id = metrics_run_id(config_.metrics.dir); !id.empty()) run_id_ = id;
}

void Trainer::prepare_run_dirs(std::ostream& out) {
  std::string refusal;
  if (rank_ == 0) {
    try {
      check_run_dirs(config_, run_id_, resumed_);
    } catch (const ConfigError& e) {
      refusal = e.what();
    }
  }
  // Every rank stops, not only rank 0 (the others would wait for it in the next collective).
  const bool refused = world_ > 1 ? backend_->sum_over_ranks(refusal.empty() ? 0.0 : 1.0) > 0 : !refusal.empty();
  if (refused && rank_ == 0) throw ConfigError(refusal);
  if (refused) MOE_CONFIG_ERROR("rank 0 refused the run's output folders (its error says why)");
  if (rank_ != 0) return;
  if (discard_after_) {
    std::vector<std::string> deleted;
    for (const CheckpointListing& c : list_checkpoints(config_.checkpoint.dir))
      if (c.step > *discard_after_) {
        std::filesystem::remove_all(c.path);
        deleted.push_back(c.path.filename().string());
      }
    if (!deleted.empty())
      fmt::print(out, "resume: deleted {} later checkpoint{} of the discarded timeline ({})\n", deleted.size(),
                 deleted.size() == 1 ? "" : "s",
                 deleted.size() == 1 ? deleted[0] : deleted.front() + " ... " + deleted.back());
    discard_after_.reset();
  }
  write_run_files(config_, run_id_);
}

bool Trainer::after_step(const StepStats& stats, std::ostream& out) {
  const TrainingConfig& tc = config_.training;
  const int64_t done = progress_.step;
  collect_background_save(/*wait=*/false, out);
  if (stats.skipped) ++progress_.skipped_steps;
  if (monitor_->observe(stats.step, stats.loss, stats.skipped, out)) {
    reload_after_faults(stats, out);
    return false;
  }
  if (!stats.skipped && done > furthest_step_) {
    furthest_step_ = done;
    reloads_without_progress_ = 0;
  }
  // A signal may reach only some ranks: they all stop (and save) together.
  bool signalled = stop_requested();
  if (world_ > 1) signalled = backend_->sum_over_ranks(signalled ? 1.0 : 0.0) > 0;
  const bool stopping = signalled || done == tc.stop_at;
  const int64_t interval = config_.checkpoint.interval;
  if (checkpointer_->enabled() && (stopping || done == tc.steps || (interval > 0 && done % interval == 0))) {
    // A skipped step may have come from non-finite weights: never save those.
    if (monitor_->skip_streak() == 0) save_checkpoint(out);
    else fmt::print(out, "warning: checkpoint at step {} not saved: the step was skipped\n", done);
  }
  if (!stopping) return false;
  collect_background_save(/*wait=*/true, out);  // the process may exit right after run()
  const std::string why = signalled ? signal_name(stop_signal()) : "training.stop_at";
  fmt::print(out, "stopping after step {} ({}){}\n", done, why,
             checkpointer_->enabled() ? "" : "; checkpoint.dir is empty, nothing saved");
  out.flush();
  return true;
}

void Trainer::reload_after_faults(const StepStats& stats, std::ostream& out) {
  const TrainingConfig& tc = config_.training;
  wait_for_saved_checkpoints(out);
  const auto latest =
      checkpointer_->enabled() ? latest_checkpoint(config_.checkpoint.dir) : std::optional<std::filesystem::path>();
  if (!latest)
    MOE_THROW("{} non-finite steps in a row (up to step {}) and no checkpoint to reload (checkpoint.dir {})",
              monitor_->skip_streak(), stats.step,
              config_.checkpoint.dir.empty() ? "is empty" : "\"" + config_.checkpoint.dir + "\" holds none");
  if (++reloads_without_progress_ > kMaxReloadsWithoutProgress)
    MOE_THROW("training diverges: {} reloads without getting past step {}", kMaxReloadsWithoutProgress,
              furthest_step_);
  const double lr_scale = progress_.lr_scale * tc.nan_lr_factor;
  const int64_t reloads = progress_.nan_reloads + 1;
  const int64_t skipped = progress_.skipped_steps;
  LoadedCheckpoint checkpoint = read_checkpoint(*latest);
  restore_from(checkpoint);
  progress_.lr_scale = lr_scale;
  progress_.nan_reloads = reloads;
  progress_.skipped_steps = skipped;
  const int64_t streak = monitor_->skip_streak();
  monitor_->reset();
  fmt::print(out, "warning: {} non-finite steps in a row (up to step {}): reloaded {} (step {}), learning rate x{}\n",
             streak, stats.step, checkpoint.path.string(), progress_.step, lr_scale);
  out.flush();
}

}  // namespace moe
