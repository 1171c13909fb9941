#include "obs/observer.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>

namespace moe {

Observer::Observer(const MetricsConfig& config, std::ostream& out, ObserverOptions options)
    : console_(out, config.log_interval, options.progress_bar),
      alerts_(AlertThresholds{config.alert_imbalance, config.alert_comm_wait, config.alert_grad_sync_ms}),
      options_(options),
      dir_(config.dir),
      tensorboard_on_(config.tensorboard),
      trace_on_(config.trace) {
}

void Observer::record(const nlohmann::json& r) {
  if (jsonl_) jsonl_->write(r);
  if (options_.feed) options_.feed->add(r);
}

void Observer::start(const RunInfo& info) {
  if (!dir_.empty()) {
    // The run goes on after step first_step (0: a new run): what it will write again goes first.
    const std::string path = (std::filesystem::path(dir_) / "metrics.jsonl").string();
    truncate_metrics_after(path, info.first_step);
    jsonl_ = std::make_unique<JsonlWriter>(path, /*append=*/true);
    if (tensorboard_on_) tensorboard_ = std::make_unique<TensorBoardWriter>(dir_, info.first_step);
    if (trace_on_)
      trace_ = std::make_unique<TraceWriter>((std::filesystem::path(dir_) / trace_file_name(info.first_step)).string(), 0);
  }
  console_.set_schedule(info.val_interval, info.checkpoint_interval, info.checkpoints);
  console_.line("mfu: " + info.mfu.describe());
  const nlohmann::json run = to_json(info);
  if (jsonl_) jsonl_->write(run);
  if (options_.feed) options_.feed->set_run(run);
}

void Observer::validation(int64_t step, double loss, double seconds) {
  console_.validation_done(step, seconds);
  console_.line(fmt::format("val step {} | val_loss {:.4f} | {:.1f} s", step, loss, seconds));
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  record({{"type", "val"}, {"step", step}, {"wall_time", now}, {"val_loss", loss}, {"seconds", seconds}});
  if (tensorboard_) tensorboard_->add_scalars(step, {{"val/loss", static_cast<float>(loss)}});
}

void Observer::step(const StepMetrics& m) {
  if (m.skipped)
    console_.line(fmt::format("warning: step {} skipped: non-finite loss or gradient (grad_norm {})", m.step,
                              m.grad_norm));
  record(to_json(m));
  if (tensorboard_) tensorboard_->add_scalars(m.step, tensorboard_scalars(m));
  if (trace_) trace_->step(m.step, m.spans);
  console_.step(m);
  for (const AlertEvent& alert : alerts_.check(m)) {
    console_.line(alert.message);
    record(to_json(alert));
  }
}

std::string describe(const CheckpointSave& save) {
  const double bytes = static_cast<double>(save.bytes);
  const std::string size = bytes >= 1e9 ? fmt::format("{:.2f} GB", bytes / 1e9) : fmt::format("{:.1f} MB", bytes / 1e6);
  std::string written = fmt::format("{} in {:.2f} s, {:.2f} GB/s", size, save.write_seconds,
                                    save.write_seconds > 0 ? bytes / 1e9 / save.write_seconds : 0.0);
  // Per rank: this rank's own shard (each rank writes one in parallel).
  if (save.shard_bytes > 0 && save.shard_bytes != save.bytes)
    written += fmt::format(" (this rank's shard {:.1f} MB at {:.2f} GB/s)", static_cast<double>(save.shard_bytes) / 1e6,
                           save.shard_seconds > 0 ? static_cast<double>(save.shard_bytes) / 1e9 / save.shard_seconds : 0.0);
  // Saves that come faster than the disk writes wait for the one before: said apart.
  const std::string waited =
      save.waited_seconds >= 0.05 ? fmt::format(" ({:.1f} s of it waiting for the previous save)", save.waited_seconds) : "";
  if (!save.background)
    return fmt::format("checkpoint: step {} saved to {} | {} | training paused {:.1f} s{}", save.step, save.path, written,
                       save.paused_seconds, waited);
  if (!save.written)
    return fmt::format("checkpoint: step {} saving to {} in the background | training paused {:.1f} s{}", save.step,
                       save.path, save.paused_seconds, waited);
  return fmt::format("checkpoint: step {} saved to {} | {} (in the background)", save.step, save.path, written);
}

void Observer::checkpoint(const CheckpointSave& save) {
  // The pause is counted once: when training goes on.
  if (!save.background || !save.written) console_.checkpoint_done(save.step, save.paused_seconds);
  console_.line(describe(save));
  if (!save.written) return;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  record({{"type", "checkpoint"},
          {"step", save.step},
          {"wall_time", now},
          {"path", save.path},
          {"bytes", save.bytes},
          {"write_seconds", save.write_seconds},
          {"shard_bytes", save.shard_bytes},
          {"shard_seconds", save.shard_seconds},
          {"paused_seconds", save.paused_seconds},
          {"waited_seconds", save.waited_seconds},
          {"background", save.background}});
}

void Observer::finish(const RunEnd& end) {
  console_.finish();
  record({{"type", "summary"},
          {"steps", end.steps},
          {"tokens", end.tokens},
          {"seconds", end.seconds},
          {"val_loss_start", end.val_loss_start},
          {"val_loss_end", end.val_loss_end},
          {"train_loss_end", end.train_loss_end},
          {"skipped_steps", end.skipped_steps},
          {"validation_seconds", end.validation_seconds},
          {"checkpoint_seconds", end.checkpoint_seconds}});
  if (options_.feed) options_.feed->set_done();
  if (jsonl_) jsonl_->sync();
  if (tensorboard_) tensorboard_->sync();
  if (trace_) trace_->close();
}

std::vector<std::pair<std::string, float>> tensorboard_scalars(const StepMetrics& m) {
  auto f = [](auto v) { return static_cast<float>(v); };
  std::vector<std::pair<std::string, float>> s = {
      {"train/loss", f(m.loss)},
      {"train/aux_loss", f(m.aux_loss)},
      {"train/z_loss", f(m.z_loss)},
      {"train/lr", f(m.lr)},
      {"train/grad_norm", f(m.grad_norm)},
      {"train/max_expert_grad_norm", f(m.max_expert_grad_norm)},
      {"perf/tokens_per_s", f(m.tokens_per_s)},
      {"perf/mfu", f(m.mfu)},
      {"time/step_s", f(m.time.step)},
      {"time/compute_s", f(m.time.compute)},
      {"time/comm_wait_s", f(m.time.comm_wait)},
      {"time/data_wait_s", f(m.time.data_wait)},
      {"time/optimizer_s", f(m.time.optimizer)},
      {"comm/wait_fraction", f(m.comm_wait_fraction())},
      {"comm/grad_sync_ms", f(m.grad_sync_ms)},
      {"comm/a2a_bytes", f(m.a2a_bytes)},
      {"comm/a2a_gb_per_s", f(m.a2a_bandwidth / 1e9)},
      {"memory/arena_bytes", f(m.arena_bytes)},
      {"memory/rss_bytes", f(m.rss_bytes)},
      {"moe/max_imbalance", f(m.max_imbalance())},
  };
  if (m.board.samples > 0) {
    s.push_back({"gpu/sm_clock_mhz", f(m.board.sm_mhz_mean)});
    s.push_back({"gpu/power_w", f(m.board.power_w_mean)});
    s.push_back({"gpu/power_capped", f(m.board.power_capped)});
  }
  if (m.board.sm_mhz_counted > 0) s.push_back({"gpu/sm_clock_counted_mhz", f(m.board.sm_mhz_counted)});
  for (const auto& l : m.layers) {
    const std::string p = fmt::format("moe/layer{}/", l.layer);
    s.push_back({p + "imbalance", f(l.imbalance())});
    s.push_back({p + "cv", f(l.cv())});
    s.push_back({p + "dropped_fraction", f(l.dropped_fraction())});
    s.push_back({p + "router_entropy", f(l.router_entropy)});
    if (l.route_cache_hit_rate >= 0) {
      s.push_back({p + "route_cache_hit_rate", f(l.route_cache_hit_rate)});
      s.push_back({p + "route_cache_token_hit_rate", f(l.route_cache_token_hit_rate)});
    }
    if (l.a2a_fp8 >= 0) s.push_back({p + "a2a_fp8", f(l.a2a_fp8)});
    if (l.a2a_dispatch_wait_ms >= 0) s.push_back({p + "a2a_dispatch_wait_ms", f(l.a2a_dispatch_wait_ms)});
    if (l.spec_rows_used >= 0) {
      s.push_back({p + "spec_used_share", f(l.spec_used_share())});
      s.push_back({p + "spec_rows_wasted", f(static_cast<double>(l.spec_rows_wasted))});
      s.push_back({p + "spec_rows_corrected", f(static_cast<double>(l.spec_rows_corrected))});
    }
    if (l.temperature > 0) s.push_back({p + "temperature", f(l.temperature)});
    // Expert merging: only at a merge event (a sparse series).
    if (!l.merges.empty()) {
      s.push_back({p + "merges", f(static_cast<double>(l.merges.size()))});
      s.push_back({p + "merge_similarity", f(l.merges.front().similarity)});
    }
  }
  return s;
}

}  // namespace moe
