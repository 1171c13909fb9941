#include "train/trainer.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <cmath>
#include <ostream>

#include <spdlog/spdlog.h>

#include "core/nvtx_range.h"
#include "core/threads.h"
#include "dist/communicator.h"
#include "data/rank_sliced_source.h"
#include "optim/grad_clip.h"
#include "model/gpu_buffer_sizes.h"
#include "optim/lr_schedule.h"
#include "train/backends/backend_factory.h"
#include "train/run_dirs.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

RunInfo run_info(const RunConfig& config, const ParameterCounts& counts) {
  const ModelConfig& m = config.model;
  RunInfo info;
  info.steps = config.training.steps;
  info.tokens_per_step = config.training.global_batch_tokens;
  info.n_layers = m.n_layers;
  for (int64_t l = m.first_dense_layers; l < m.n_layers; ++l) info.moe_layers.push_back(l);
  info.n_experts = m.moe.n_experts;
  info.top_k = m.moe.top_k;
  info.params_total = counts.total;
  info.params_active = counts.active;
  info.bias_balancing = m.moe.bias_balancing;
  info.temperature_control = m.moe.temperature_control;
  info.mfu = {counts.active - counts.embedding, m.n_layers, m.dim, m.seq_len, config.metrics.peak_tflops * 1e12};
  return info;
}

// Expert load per rank: from the parallel backend, or one process holding every expert
// (rank 0, its load summed over the MoE layers). The phase times reach the console only
// when metrics.phase_times asks (metrics.trace measures them too).
StepMetrics step_metrics(const StepStats& s, const RunInfo& info, int64_t arena_bytes, bool phase_times) {
  StepMetrics m;
  m.step = s.step;
  m.steps = info.steps;
  m.wall_time = unix_now();
  m.loss = s.loss, m.aux_loss = s.aux_loss, m.z_loss = s.z_loss;
  m.lr = s.lr;
  m.grad_norm = s.grad_norm, m.max_expert_grad_norm = s.max_expert_grad_norm;
  m.skipped = s.skipped;
  m.tokens = info.tokens_per_step;
  m.time = s.time;
  m.tokens_per_s = s.time.step > 0 ? static_cast<double>(m.tokens) / s.time.step : 0;
  m.mfu = info.mfu.mfu(m.tokens_per_s / static_cast<double>(info.world_size));  // per device
  m.arena_bytes = arena_bytes;
  m.rss_bytes = resident_set_bytes();
  m.grad_sync_ms = s.grad_sync_ms;
  m.a2a_bytes = s.a2a_bytes;
  m.a2a_off_node_bytes = s.a2a_off_node_bytes;
  m.a2a_bandwidth = s.a2a_seconds > 0 ? static_cast<double>(s.a2a_bytes) / s.a2a_seconds : 0;
  m.layers = s.layers;
  if (phase_times) m.phase_ms = s.phase_ms;
  m.board = s.board;
  m.spans = s.spans;
  if (!s.ranks.empty()) {
    m.ranks = s.ranks;
    return m;
  }
  RankLoad rank;
  rank.load.assign(static_cast<size_t>(info.n_experts), 0);
  for (int64_t e = 0; e < info.n_experts; ++e) rank.experts.push_back(e);
  for (const auto& layer : s.layers)
    for (size_t e = 0; e < layer.tokens_E.size(); ++e) rank.load[e] += layer.tokens_E[e];
  m.ranks.push_back(std::move(rank));
  return m;
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
    : Trainer(config, std::move(train_data), std::move(val_data),
              dist::make_world_communicator(resolve_comm_backend(config))) {}

Trainer::Trainer(const RunConfig& config, std::unique_ptr<BatchSource> train_data,
                 std::unique_ptr<BatchSource> val_data, std::unique_ptr<dist::Communicator> world)
    : config_(config), train_data_(std::move(train_data)), val_data_(std::move(val_data)) {
  run_id_ = new_run_id();
  const TrainingConfig& tc = config_.training;
  const int64_t tokens_per_micro = tc.micro_batch * config_.model.seq_len;
  MOE_CHECK(tc.global_batch_tokens % tokens_per_micro == 0,
            "training.global_batch_tokens {} is not a multiple of micro_batch*seq_len = {}",
            tc.global_batch_tokens, tokens_per_micro);
  MOE_CHECK(world != nullptr, "the trainer needs a world communicator");
  if (world->size() > 1) slice_data_over_ranks(world->rank(), world->size());
  // Several ranks: the model's MoE layers are wired to the others before planning
  // (capacity depends on the global micro-batch).
  backend_ = make_backend(config_, std::move(world));
  plan_batches();  // checkpoint_trainer.cpp: may halve the micro-batch under memory pressure
  micro_steps_ /= world_;  // each rank reads 1/world of the global batch (slice_data_over_ranks checked divisibility)
  inputs_BS_.resize(static_cast<size_t>(tokens_per_micro));
  targets_BS_.resize(static_cast<size_t>(tokens_per_micro));
}

Trainer::~Trainer() = default;

void Trainer::slice_data_over_ranks(int rank, int world) {
  const TrainingConfig& tc = config_.training;
  world_ = world;
  rank_ = rank;
  const int64_t per_step = world_ * tc.micro_batch * config_.model.seq_len;
  if (tc.global_batch_tokens % per_step != 0)
    MOE_CONFIG_ERROR("training.global_batch_tokens ({}) must be a multiple of ranks x training.micro_batch x "
                     "model.seq_len = {} x {} x {} = {}",
                     tc.global_batch_tokens, world_, tc.micro_batch, config_.model.seq_len, per_step);
  const int64_t S = config_.model.seq_len;
  train_data_ = std::make_unique<RankSlicedSource>(std::move(train_data_), S, rank_, world_);
  val_data_ = std::make_unique<RankSlicedSource>(std::move(val_data_), S, rank_, world_);
}

void Trainer::merge_experts(StepStats& stats) {
  const MoEConfig& moe = config_.model.moe;
  if (moe.merge_interval <= 0 || stats.step % moe.merge_interval != 0) return;
  // The step's tokens per expert (kept assignments) weigh the averages and pick the split
  // sources: no state beyond the checkpointed weights, so a resumed run merges alike.
  std::vector<std::vector<int64_t>> load_LE;
  for (const LayerRouting& layer : stats.layers) load_LE.push_back(layer.tokens_E);
  const auto merges = backend_->merge_experts(moe, load_LE, merge_protected_LE_, config_.training.seed, stats.step);
  merge_protected_LE_ = split_experts_of(merges);
  int64_t total = 0;
  double top = -1;
  for (size_t l = 0; l < merges.size() && l < stats.layers.size(); ++l)
    for (const ExpertMerge& m : merges[l]) {
      stats.layers[l].merges.push_back({m.kept, m.freed, m.split_of, m.similarity, m.kept_share});
      ++total;
      top = std::max(top, m.similarity);
    }
  if (rank_ == 0)
    spdlog::info("step {}: expert merging: {} pairs merged over {} MoE layers{}", stats.step, total, merges.size(),
                 total > 0 ? fmt::format(" (highest cosine {:.3f})", top) : "");
}

StepStats Trainer::train_step(int64_t step) {
  const TrainingConfig& tc = config_.training;
  ModelBackend& model = *backend_;
  StepStats stats;
  stats.step = step + 1;
  const NvtxRange step_range("step " + std::to_string(step + 1));
  const bool trace = config_.metrics.trace;
  const auto seconds = [](Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  };
  const auto span = [&](const char* name, Clock::time_point from, Clock::time_point to) {
    if (trace) stats.spans.push_back({name, "host", seconds(trace_origin_, from), seconds(from, to)});
  };
  // The host spans tile the step: each begins where the previous one ended.
  const auto step_start = Clock::now();
  model.begin_step();
  auto last = Clock::now();
  span("zero grads", step_start, last);
  const double scale = 1.0 / static_cast<double>(micro_steps_);
  for (int64_t micro = 0; micro < micro_steps_; ++micro) {
    const auto t0 = last;
    {
      const NvtxRange range("data");
      train_data_->next_batch(micro_batch_, inputs_BS_.data(), targets_BS_.data());
    }
    const auto t1 = Clock::now();
    ForwardResult fwd;
    {
      const NvtxRange range("forward");
      fwd = model.forward(inputs_BS_.data(), targets_BS_.data());
    }
    const auto t2 = Clock::now();
    {
      const NvtxRange range("backward");
      model.backward(scale, micro + 1 == micro_steps_);
    }
    const auto t3 = last = Clock::now();
    stats.time.data_wait += seconds(t0, t1);
    stats.time.compute += seconds(t1, t3);
    span("data", t0, t1);
    span("forward", t1, t2);
    span("backward", t2, t3);
    stats.loss += fwd.ce_loss * scale;
    stats.aux_loss += fwd.aux_loss * scale;
    stats.z_loss += fwd.z_loss * scale;
    stats.dropped += fwd.dropped;
  }
  // Time blocked on communication is counted apart from compute and optimizer time.
  model.take_comm_stats(stats);
  stats.time.compute = std::max(0.0, stats.time.compute - stats.time.comm_wait);
  const double compute_wait = stats.time.comm_wait;
  const auto optimizer_start = Clock::now();
  const NvtxRange optimizer_range("optimizer");
  model.reduce_losses(stats);
  model.routing(stats);
  const ClipStats clip = model.clip_gradients(tc.grad_clip, tc.expert_grad_clip);
  stats.grad_norm = clip.global_norm;
  stats.max_expert_grad_norm = clip.max_expert_norm;
  stats.lr = learning_rate(config_.lr, step, tc.steps) * progress_.lr_scale;
  // Norm and loss are global, so every rank takes the same decision.
  if (!std::isfinite(clip.global_norm) || !std::isfinite(stats.loss)) {
    stats.skipped = true;  // a non-finite gradient never reaches the weights
  } else {
    model.apply_update(stats.lr);
  }
  model.end_step();
  if (!stats.skipped) merge_experts(stats);
  model.take_comm_stats(stats);
  const auto step_end = Clock::now();
  stats.time.optimizer = std::max(0.0, seconds(optimizer_start, step_end) - (stats.time.comm_wait - compute_wait));
  stats.time.step = seconds(step_start, step_end);
  model.take_board_stats(stats);
  model.observe_step(stats);
  span("optimizer", last, step_end);
  // The GPU's CUDA-event time per phase, summed over the step: laid end to end from the
  // step's start in the phase table's order (nsys shows their true interleaving).
  if (trace) {
    double at = seconds(trace_origin_, step_start);
    for (const auto& [phase, ms] : stats.phase_ms) {
      stats.spans.push_back({phase, "gpu", at, ms * 1e-3});
      at += ms * 1e-3;
    }
  }
  return stats;
}

double Trainer::validate() { return evaluate(config_.training.val_batches); }

double Trainer::evaluate(int64_t val_batches, const std::function<void(int64_t, int64_t)>& progress) {
  MOE_CHECK(val_batches > 0, "evaluation over {} batches", val_batches);
  const NvtxRange range("validation");
  val_data_->reset();
  double total = 0;
  // The same held-out sequences when the memory controller split the micro-batch.
  const int64_t batches = val_batches * (config_.training.micro_batch / micro_batch_);
  for (int64_t b = 0; b < batches; ++b) {
    val_data_->next_batch(micro_batch_, inputs_BS_.data(), targets_BS_.data());
    total += backend_->eval_loss(inputs_BS_.data(), targets_BS_.data());
    if (progress) progress(b + 1, batches);
  }
  total = backend_->sum_over_ranks(total);
  // Validation must not count towards the balancing load of the next step.
  backend_->end_validation();
  return total / static_cast<double>(std::max<int64_t>(1, batches));
}

TrainSummary Trainer::run(std::ostream& rank_out) {
  const TrainingConfig& tc = config_.training;
  // In a multi-rank run rank 0 speaks for all: the others print and record nothing.
  std::ostream silent(nullptr);
  std::ostream& out = rank_ == 0 ? rank_out : silent;
  MetricsConfig metrics = config_.metrics;
  ObserverOptions options = observer_options;
  if (rank_ != 0) {
    metrics.dir = "";
    options = ObserverOptions{};
  }
  const int64_t tokens_per_step = tc.global_batch_tokens;
  TrainSummary summary;
  const ParameterCounts counts = count_parameters(config_.model, backend_->host_model().params());
  fmt::print(out,
             "model: {} layers, dim {}, {} experts top-{} | params total {:.2f}M, active {:.2f}M "
             "| activations {:.1f} MB | device {} | threads {}\n",
             config_.model.n_layers, config_.model.dim, config_.model.moe.n_experts,
             config_.model.moe.top_k, static_cast<double>(counts.total) / 1e6,
             static_cast<double>(counts.active) / 1e6,
             static_cast<double>(backend_->host_model().activation_bytes()) / 1e6, backend_->device_name(),
             num_threads());
  for (const std::string& note : batch_notes_) fmt::print(out, "{}\n", note);
  if (world_ > 1)
    fmt::print(out, "batch: {} tokens/step = {} ranks x {} micro-batches x {} x {} tokens | expert parallel {} "
               "({} all-to-all, {} chunks)\n", tokens_per_step, world_, micro_steps_, micro_batch_,
               config_.model.seq_len, config_.parallel.expert_parallel, name_of(config_.parallel.all_to_all),
               config_.parallel.a2a_chunks);
  else
    fmt::print(out, "batch: {} tokens/step = {} micro-batches x {} x {} tokens\n", tokens_per_step,
               micro_steps_, micro_batch_, config_.model.seq_len);
  if (tc.precision == TrainingPrecision::Fp8) {
    fmt::print(out, "{}\n", describe_fp8_projections(config_.model, micro_batch_ * config_.model.seq_len));
    fmt::print(out, "fp8 GEMM kernels: {}{}\n", name_of(tc.fp8_gemm_backend),
               tc.fp8_gemm_backend == GemmBackend::DeepGemm ? " (expert rows padded per expert to 128)" : "");
  } else if (tc.bf16_gemm_backend == GemmBackend::DeepGemm && config_.model.moe.n_experts > 0) {
    fmt::print(out, "bf16 expert GEMM kernels: deepgemm (expert rows padded per expert to 128)\n");
  }
  out.flush();
  prepare_run_dirs(out);  // before the metrics files are opened, and before step 1
  Observer observer(metrics, out, options);
  // Checkpoint lines and records go through the observer while it exists.
  struct ObserverScope {
    Observer*& slot;
    ~ObserverScope() { slot = nullptr; }
  } observer_scope{observer_ = &observer};
  checkpoint_pause_seconds_ = 0;
  RunInfo info = run_info(config_, counts);
  if (!backend_->on_gpu()) info.mfu.peak_flops = 0;  // metrics.peak_tflops is a GPU's: no MFU on the CPU
  info.run_id = run_id_;
  info.world_size = world_;
  info.first_step = progress_.step;  // a resumed run goes on in its metrics after this step
  info.val_interval = tc.val_interval;
  info.checkpoint_interval = config_.checkpoint.interval;
  info.checkpoints = checkpointer_->enabled();
  observer.start(info);
  // Values, gradients, two AdamW moments, activation and scratch arenas.
  const auto arena_bytes = static_cast<int64_t>(counts.total * 4 * static_cast<int64_t>(sizeof(float)) +
                                                static_cast<int64_t>(backend_->host_model().activation_bytes()));

  auto val_start = Clock::now();
  summary.val_loss_start = validate();
  observer.validation(progress_.step, summary.val_loss_start, seconds_since(val_start));
  summary.val_loss_end = summary.val_loss_start;

  const auto start = Clock::now();
  // From a resumed step; training.stop_at ends early; a NaN reload moves progress_ back.
  const int64_t stop = tc.stop_at > 0 ? tc.stop_at : tc.steps;
  for (int64_t step = progress_.step; step < stop; step = progress_.step) {
    StepStats stats = train_step(step);
    progress_.step = step + 1;
    summary.steps = step + 1;
    summary.tokens += tokens_per_step;
    summary.train_loss_end = stats.loss;
    if (stats.skipped) ++summary.skipped_steps;
    observer.step(step_metrics(stats, info, arena_bytes, config_.metrics.phase_times));
    if (on_step) on_step(stats);
    const bool last = step + 1 == tc.steps;
    if (last || (tc.val_interval > 0 && (step + 1) % tc.val_interval == 0)) {
      val_start = Clock::now();
      summary.val_loss_end = validate();
      const double seconds = seconds_since(val_start);
      summary.validation_seconds += seconds;
      observer.validation(step + 1, summary.val_loss_end, seconds);
    }
    if (after_step(stats, out)) break;  // checkpoints, NaN recovery, preemption
  }
  collect_background_save(/*wait=*/true, out);  // the last save is on disk (or its error thrown) before the summary
  summary.seconds = seconds_since(start);
  summary.checkpoint_seconds = checkpoint_pause_seconds_;
  backend_->sync_host_model();
  observer.finish({summary.steps, summary.tokens, summary.skipped_steps, summary.seconds, summary.val_loss_start,
                   summary.val_loss_end, summary.train_loss_end, summary.validation_seconds,
                   summary.checkpoint_seconds});
  fmt::print(out,
             "summary: steps={} tokens={} seconds={:.1f} val_loss_start={:.4f} val_loss_end={:.4f} "
             "train_loss_end={:.4f} skipped_steps={} validation_seconds={:.1f} checkpoint_seconds={:.1f}\n",
             summary.steps, summary.tokens, summary.seconds, summary.val_loss_start, summary.val_loss_end,
             summary.train_loss_end, summary.skipped_steps, summary.validation_seconds, summary.checkpoint_seconds);
  out.flush();
  return summary;
}

}  // namespace moe
