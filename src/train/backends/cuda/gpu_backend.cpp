// The GPU backend: the model, gradients and optimizer state on the GPU
// (src/model/cuda/gpu_transformer.h), on one GPU or over the ranks of an NCCL world
// (data parallel with ZeRO-1, expert parallel), behind the one step loop of trainer.cpp.
#include "train/backends/cuda/gpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <list>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/cuda/sm_clocks.h"
#include "core/gpu.h"
#include "dist/a2a_compression.h"
#include "dist/communicator.h"
#include "dist/cuda/gpu_data_parallel.h"
#include "dist/cuda/gpu_expert_exchange.h"
#include "dist/gradient_stages.h"
#include "dist/launch_env.h"
#include "dist/zero_shards.h"
#include "kernels/fp8_gpu_ops.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_parameter_zero.h"
#include "model/cuda/gpu_phases.h"
#include "model/cuda/gpu_transformer.h"
#include "model/expert_layout.h"
#include "moe/expert_placement.h"
#include "obs/cuda/board_sampler.h"
#include "optim/cuda/gpu_optimizer.h"
#include "train/backends/cuda/gpu_router_control.h"
#include "train/backends/cuda/gpu_routing_report.h"
#include "train/backends/cuda/owned_pieces.h"
#include "train/backends/placement_record.h"
#include "train/backends/rank_loads.h"
#include "train/routing_cache_probe.h"

namespace moe {

bool gpu_present() { return gpu::device_count() > 0; }

bool deepgemm_present() { return gpu_present() && cuda::deepgemm_available(); }

size_t gpu_memory_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes;
}

namespace {

// The model, gradients and AdamW state on the GPU. With `dp` (parallel.backend = nccl)
// every rank holds a full replica and the gradients are summed over the ranks after the
// step's last backward (src/dist/cuda/gpu_data_parallel.h).
//
// As on the CPU path (train/backends/parallel_cpu_backend.h), each rank's cross-entropy is weighted
// by its share of the global micro-batch's targets, so the sum over the ranks is the
// global mean and N ranks with micro-batch B follow one GPU with micro-batch N x B. The
// GPU backward takes one scale for all loss terms, so the aux and z losses, which are
// computed over the rank's own micro-batch (not the global one as on the CPU path), get
// that weight too: 1/N when the ranks have as many targets. Over one rank every weight
// is exactly 1 and the all-reduce is the identity: the plain GPU run, bit for bit.
class GpuBackend final : public ModelBackend {
 public:
  // world: an NCCL (or threads) world for data/expert parallelism, or null (one GPU).
  GpuBackend(const RunConfig& config, HostState host, std::unique_ptr<dist::Communicator> world)
      : ModelBackend(std::move(host)), config_(config), world_(std::move(world)) {
    // The configuration was checked by the factory (backend_factory.cpp: check_gpu_config).
    const RunConfig& c = config_;
    const int64_t ep = c.parallel.expert_parallel;
    if (c.model.moe.route_cache)
      route_cache_.emplace(c.model.moe, static_cast<int64_t>(host_model().moe_layers().size()));
    if (world_ && ep > 1) {
      const dist::LaunchEnv env = dist::read_launch_env();
      int per_node = env.world_size == world_->size() ? env.local_size : world_->size();
      if (world_->ranks_per_node() > 0) per_node = world_->ranks_per_node();  // simulated nodes (threads)
      ep_ = std::make_shared<dist::GpuExpertExchangeOverComm>(*world_, static_cast<int>(ep), c.parallel.all_to_all,
                                                              per_node);
      ep_->set_fp8(c.parallel.a2a_compression == A2aCompression::Fp8);
      if (c.parallel.a2a_compression == A2aCompression::Auto) {
        ep_->allow_fp8();
        ep_->time_layers(true);
        compression_ = std::make_unique<dist::A2aCompressionSwitch>(
            A2aCompression::Auto, static_cast<int>(host_model().moe_layers().size()), c.metrics.alert_comm_wait);
      }
    }
    build_model();
  }
  ~GpuBackend() override {
    if (gpu_) gpu_->set_forward_stage_hook({});  // it points into dp_
  }
  bool on_gpu() const override { return true; }
  std::string device_name() const override {
    int device = 0;
    cudaDeviceProp props{};
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
    return fmt::format("{} (GPU {})", props.name, device);
  }

  // Plans the GPU buffers, halving the micro-batch while an allocation fails; then the
  // data-parallel groups, whose loss weights depend on the micro-batch.
  BatchPlan plan_batches() override {
    const TrainingConfig& tc = config_.training;
    BatchPlan plan{tc.micro_batch, tc.global_batch_tokens / (tc.micro_batch * config_.model.seq_len), {}};
    for (;;) {
      try {
        gpu_->plan(plan.micro_batch);
        break;
      } catch (const gpu::OutOfMemory& e) {
        if (plan.micro_batch % 2 != 0) throw;  // halving would change the global batch
        plan.notes.push_back(fmt::format(
            "memory: a micro-batch of {} sequences does not fit on the GPU ({}); now {} x {} micro-batches, "
            "the same {} tokens per step",
            plan.micro_batch, e.what(), plan.micro_batch / 2, plan.micro_steps * 2, tc.global_batch_tokens));
        plan.micro_batch /= 2;
        plan.micro_steps *= 2;
        // Free every buffer before trying again, then start over from the host weights.
        optimizer_.reset();
        gpu_.reset();
        build_model();
      }
    }
    tokens_ = plan.micro_batch * config_.model.seq_len;
    micro_scale_ = static_cast<double>(tokens_) / static_cast<double>(tc.global_batch_tokens);
    const bool first_rank = !world_ || world_->rank() == 0;
    if (world_) make_data_parallel();  // hands world_ over to dp_
    if (first_rank) {
      // Under expert parallelism a rank holds its own experts only; under ZeRO its pieces'
      // lo halves and moments only.
      const GpuParameterStore& store = gpu_->parameters();
      int64_t bf16_grads = 0;  // expert weights with bf16 gradients: 2 bytes fewer each
      for (const Range& r : store.bf16_grad_ranges()) bf16_grads += r.count;
      const double whole = static_cast<double>(store.storage_numel()) *
                               static_cast<double>(GpuParameterStore::bytes_per_parameter(config_.optimizer.state_dtype)) -
                           2.0 * static_cast<double>(bf16_grads);
      spdlog::info("device state (weights, gradients, AdamW moments): {:.3f} GB on this GPU, {:.3f} GB for the "
                   "whole model",
                   static_cast<double>(store.device_bytes()) / 1e9, whole / 1e9);
    }
    // The exchanges' time is the "all-to-all" phase of the GPU model's clock.
    if (ep_ || config_.metrics.phase_times || config_.metrics.trace) clock_.set_enabled(true);
    if (!config_.checkpoint.dir.empty()) reserve_save_buffers(first_rank);
    // The board's SM clock and power during each step (metrics: board).
    board_ = std::make_unique<BoardSampler>(std::chrono::milliseconds(50));
    board_->start();
    step_clock_ = std::make_unique<gpu::SmClocks>(1);
    if (!board_->available() && first_rank)
      spdlog::info("board clock and power not sampled: {}", board_->unavailable_reason());
    return plan;
  }
  void take_board_stats(StepStats& stats) override {
    if (board_) stats.board = board_->take_summary();  // no samples without NVML
    if (step_clock_) {  // the SMs' own count since begin_step
      const auto stream = static_cast<cudaStream_t>(gpu_->stream());
      step_clock_->stamp(0, stream);
      stats.board.sm_mhz_counted = step_clock_->take_mhz(stream)[0];
    }
  }
  void begin_step() override {
    gpu_->begin_gradients();  // the first backward writes the expert gradients: no memset of them
    gpu_->routing().reset_stats();
    if (board_) board_->take_summary();  // drops what came between steps (validation, saves)
    // The SMs' count starts here: the time since the last step's end (validation, saves) is not charged.
    if (step_clock_) step_clock_->stamp(-1, static_cast<cudaStream_t>(gpu_->stream()));
  }
  ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS) override {
    if (dp_) {
      const auto local =
          static_cast<double>(std::count_if(targets_BS, targets_BS + tokens_, [](int32_t t) { return t >= 0; }));
      const double total = dp_->sum(local);
      ce_weight_ = total > 0 ? local / total : 0.0;
    }
    ForwardResult fwd;
    if (config_.training.cuda_graphs) {
      // The graph holds forward and backward together: the backward runs here, with the
      // scale the step loop is about to pass (1 / micro-batches per step), checked there.
      fwd = gpu_->forward_backward(inputs_BS, targets_BS, dp_ ? micro_scale_ * ce_weight_ : micro_scale_);
      backward_done_ = true;
    } else {
      // ZeRO-1: the weights' all-gathers run beside this forward; the GEMMs leave them SMs.
      // ZeRO-3: every forward gathers them, stage by stage.
      bool gathers = false;
      for (dist::GpuDataParallel* group : zero_groups()) {
        group->begin_forward_gathers();
        gathers = gathers || group->gathers_pending();
      }
      if (gathers) gpu_->reserve_sms(static_cast<int>(config_.parallel.comm_sms));
      gpu_->routing().set_speculating(!validating());  // validation forwards neither guess nor teach the cache
      fwd = gpu_->forward(inputs_BS, targets_BS);
      if (gathers) gpu_->reserve_sms(0);
    }
    if (dp_) fwd.ce_loss *= ce_weight_;  // the sum over the ranks is the global micro-batch's mean
    if (route_cache_ && !validating()) route_cache_->forward(inputs_BS, tokens_, gpu_->routing().expert_choices());
    return fwd;
  }
  void backward(double loss_scale, bool last) override {
    if (backward_done_) {
      MOE_CHECK(std::abs(loss_scale - micro_scale_) <= 1e-12 * micro_scale_,
                "CUDA graph step: backward scale {} differs from the captured {}", loss_scale, micro_scale_);
      backward_done_ = false;
      if (dp_ && last) dp_->all_reduce_grads();  // a graph holds the backward: reduce after it
      return;
    }
    const double scale = dp_ ? loss_scale * ce_weight_ : loss_scale;
    // ZeRO-2 reduce-scatters every micro-batch's gradients (its buckets hold no others).
    const bool every_micro_batch = sharded() && config_.parallel.zero >= 2;
    if (every_micro_batch)
      for (dist::GpuDataParallel* group : zero_groups()) group->begin_micro_batch(last);
    if (dp_ && (last || every_micro_batch) && dp_->overlaps()) {
      // Each stage's gradients are reduced while the backward of the layers below runs
      // (under expert parallelism: the shared ones over all ranks, this rank's experts'
      // over the ranks holding the same experts).
      // The GEMMs leave parallel.comm_sms multiprocessors to NCCL meanwhile (persistent
      // kernels would otherwise hold every SM until they end); over one rank nothing moves.
      if (dp_->size() > 1) gpu_->reserve_sms(static_cast<int>(config_.parallel.comm_sms));
      gpu_->backward(scale, [this](int stage) {
        dp_->launch_stage(stage);
        if (edp_) edp_->launch_stage(stage);
        for (dist::GpuDataParallel* group : zero_groups()) group->backward_stage_done(stage);  // ZeRO-3: the next stages' weights
      });
      gpu_->reserve_sms(0);
      dp_->finish_overlapped();
      if (edp_) edp_->finish_overlapped();
      return;
    }
    gpu_->backward(scale);
    if (dp_ && last) dp_->all_reduce_grads();
  }
  void reduce_losses(StepStats& stats) override {
    if (!dp_) return;
    // Cross-entropy and drops are shares; the aux and z losses are per rank: their mean.
    double values[4] = {stats.loss, static_cast<double>(stats.dropped), stats.aux_loss, stats.z_loss};
    dp_->sum(values, 4);
    stats.loss = values[0];
    stats.dropped = std::llround(values[1]);
    stats.aux_loss = values[2] / dp_->size();
    stats.z_loss = values[3] / dp_->size();
  }
  void routing(StepStats& stats) override {
    GpuRoutingStats routing = gpu_->routing().stats();
    loads_ = std::move(routing.load);
    if (dp_) {
      sum_routing_over_ranks(routing, loads_, [this](double* v, int64_t n) { dp_->sum(v, n); });
      for (double& wait : routing.dispatch_wait_s) wait /= dp_->size();  // the ranks' mean
    }
    stats.layers = gpu_layer_routing(routing, loads_, host_model().moe_layers(), config_.model,
                                     ep_ ? std::function<int(int)>([this](int l) { return ep_->fp8(l) ? 1 : 0; })
                                         : std::function<int(int)>(),
                                     stats.load_imbalance);
    if (route_cache_) route_cache_->report(stats.layers, dp_ ? [this](double* v, int64_t n) { dp_->sum(v, n); }
                                                             : std::function<void(double*, int64_t)>());
    // The live view of load per GPU (rank_loads.h).
    if (ep_) {
      const ExpertLayout layout = gpu_->expert_layout();
      std::vector<const ExpertSlots*> slots_L;
      for (const auto& layer : layout) slots_L.push_back(&layer.slots);
      stats.ranks = rank_loads(slots_L, stats.layers);
    }
  }
  // As optim/grad_clip.cpp: each expert clipped to max_expert_norm on the device first
  // (the same norms and factors, bit for bit), then the global norm of the result; the
  // global clip factor is applied inside the AdamW kernel. The per-expert norms cost a
  // pass over the expert gradients, so they are only computed when expert clipping is on.
  ClipStats clip_gradients(double max_global_norm, double max_expert_norm) override {
    ClipStats clip;
    double own_experts_sq = 0;  // expert parallelism: this rank's experts' squared norm, after clipping
    // ZeRO-1: each rank holds its pieces' sums only; the experts' squares add up over the ranks.
    // Under expert parallelism the experts' pieces are over their replicas (edp_), if any.
    std::function<void(std::vector<double>&)> sum_squares;
    dist::GpuDataParallel* expert_group = ep_ ? edp_.get() : dp_.get();
    if (sharded() && expert_group)
      sum_squares = [expert_group](std::vector<double>& squares) {
        expert_group->sum(squares.data(), static_cast<int64_t>(squares.size()));
      };
    else if (ep_)  // its own experts' norms are whole here; the others' are zero (summed below)
      sum_squares = [](std::vector<double>&) {};
    // Split experts: a hinge's summed gradient is on every EP rank; each counts 1 / P of it.
    double counted_experts_sq = 0;
    const ExpertLayout layout = gpu_->expert_layout();
    const std::vector<char> hinge = ep_ ? hinge_flags(layout) : std::vector<char>();
    if (max_expert_norm > 0 || ep_) {
      const std::vector<double> norms = to_expert_order(layout, optimizer_->clip_expert_grads(max_expert_norm, sum_squares));
      if (ep_) report_expert_norms(norms, hinge, max_expert_norm, clip);
      for (size_t x = 0; x < norms.size(); ++x) {
        const double norm = norms[x];
        const bool clipped = max_expert_norm > 0 && norm > max_expert_norm;
        if (!ep_) {
          clip.max_expert_norm = std::max(clip.max_expert_norm, norm);
          if (clipped) ++clip.experts_clipped;
        }
        const double kept = clipped ? norm * (max_expert_norm / (norm + 1e-6)) : norm;
        own_experts_sq += kept * kept;
        counted_experts_sq += x < hinge.size() && hinge[x] ? kept * kept / ep_->size() : kept * kept;
      }
    }
    clip.global_norm = optimizer_->grad_norm();
    if (sharded()) {
      // ZeRO-1: each rank holds the sums of its pieces only; its norm covers them (and, on
      // rank 0, the ranges every rank keeps whole), so the squares add up over the ranks.
      clip.global_norm = std::sqrt(dp_->sum(clip.global_norm * clip.global_norm));
    }
    if (ep_ && !sharded()) {
      // This rank's block holds the shared gradients (summed over all ranks) and its own
      // experts' (zero elsewhere): the global norm is the shared part once plus every
      // EP rank's experts, the same double on every rank.
      const double total_sq = clip.global_norm * clip.global_norm;
      double parts[2] = {std::max(0.0, total_sq - own_experts_sq), counted_experts_sq};
      dp_->sum(parts, 2);
      const double expert_replicas = static_cast<double>(dp_->size() / ep_->size());
      clip.global_norm = std::sqrt(parts[0] / dp_->size() + parts[1] / expert_replicas);
    }
    clip.global_clipped = max_global_norm > 0 && clip.global_norm > max_global_norm;
    grad_scale_ = clip.global_clipped ? max_global_norm / (clip.global_norm + 1e-6) : 1.0;
    return clip;
  }
  void apply_update(double lr) override {
    const OptimizerConfig& o = config_.optimizer;
    optimizer_->adamw_step(AdamWStep{lr, o.beta1, o.beta2, o.eps, o.weight_decay, ++steps_}, static_cast<float>(grad_scale_));
    // ZeRO-1: this rank stepped its pieces; the others' new bf16 weights come from them
    // (the lo halves and moments stay with their owners until a checkpoint gathers them).
    constexpr auto kWeights = dist::GpuDataParallel::Layout::Weights;  // in the hi halves' order
    for (dist::GpuDataParallel* group : zero_groups()) {
      // Without graphs the next forward waits for each stage's weights as it reaches them.
      if (config_.training.cuda_graphs)
        group->gather_pieces(gpu_->parameters().weights_hi(), dist::DType::bf16, kWeights);
      else if (!group->shards_weights())  // ZeRO-3: the next forward gathers them
        group->gather_pieces_by_stage(gpu_->parameters().weights_hi(), dist::DType::bf16, kWeights);
    }
    update_router_state(host_model().moe_layers(), loads_, config_.model, config_.metrics.alert_imbalance,
                        gpu_->routing());
  }
  void end_step() override {
    if (ep_ && config_.parallel.rebalance_interval > 0) rebalance_experts();
  }
  bool sharded() const { return dp_ && dp_->zero_plan() != nullptr; }
  // The data-parallel groups with a ZeRO plan: dp_ (all ranks: every parameter, or the
  // shared ones under expert parallelism) and edp_ (this rank's experts over their replicas).
  std::vector<dist::GpuDataParallel*> zero_groups() const {
    std::vector<dist::GpuDataParallel*> groups;
    for (dist::GpuDataParallel* group : {dp_.get(), edp_.get()})
      if (group && group->zero_plan()) groups.push_back(group);
    return groups;
  }
  double sum_over_ranks(double value) override { return dp_ ? dp_->sum(value) : value; }
  void end_validation() override {
    gpu_->routing().reset_stats();
    if (dp_) dp_->take_stats();  // validation's sums are not a training step's
    if (edp_) edp_->take_stats();
    clock_.take();  // validation's are not a step's
    if (ep_) {
      ep_->take_bytes_sent();
      ep_->take_off_node_bytes_sent();
    }
  }
  // parallel.a2a_compression = auto: CPU ranks' rule (dist/a2a_compression.h) on each MoE
  // layer's exchange time from CUDA events, the max over the world.
  void observe_step(const StepStats& stats) override {
    if (!compression_) return;
    const double fraction = stats.time.step > 0 ? stats.time.comm_wait / stats.time.step : 0.0;
    auto max_over_world = [this](std::vector<double>& v) {
      if (dp_) dp_->reduce(v.data(), static_cast<int64_t>(v.size()), dist::ReduceOp::max);
    };
    if (compression_->observe(fraction, ep_->take_layer_seconds(compression_->layers()), max_over_world,
                              rank_of_world() == 0))
      apply_compression();
  }
  void take_comm_stats(StepStats& stats) override {
    std::vector<std::pair<std::string, double>> phases;
    if (clock_.enabled()) phases = clock_.take();
    // Called after the micro-batches and after the update: add up.
    if (config_.metrics.phase_times || config_.metrics.trace)
      for (const auto& [phase, ms] : phases) {
        auto it = std::find_if(stats.phase_ms.begin(), stats.phase_ms.end(),
                               [&](const auto& entry) { return entry.first == phase; });
        if (it == stats.phase_ms.end())
          stats.phase_ms.emplace_back(phase, ms);
        else
          it->second += ms;
      }
    if (ep_) {
      // The exchanges run on the model's stream (nothing overlaps them yet): all wait.
      double a2a_ms = 0;
      for (const auto& [phase, ms] : phases)
        if (phase == "all-to-all") a2a_ms = ms;
      stats.a2a_bytes += ep_->take_bytes_sent();
      stats.a2a_off_node_bytes += ep_->take_off_node_bytes_sent();
      stats.a2a_seconds += a2a_ms * 1e-3;
      stats.time.comm_wait += a2a_ms * 1e-3;
    }
    if (!dp_) return;
    for (dist::GpuDataParallel* group : {dp_.get(), edp_.get()}) {
      if (!group) continue;
      const dist::CommStats comm = group->take_stats();
      stats.time.comm_wait += comm.wait_s;
      stats.grad_sync_ms += comm.grad_sync_s * 1e3;
    }
  }
  // With re-placement by load under expert parallelism: each MoE layer's experts per EP
  // rank and what the next re-placement will weigh (loads and steps since the last), so a
  // resumed run continues with the same placement, bit for bit.
  std::string placement_state() const override {
    PlacementRecord record;
    if (compression_) record.a2a_compression = compression_->save();
    if (ep_ && config_.parallel.rebalance_interval > 0) {
      record.has_placement = true;
      record.ep_size = ep_->size();
      for (const MoeLayerExperts& layer : gpu_->expert_layout()) record.experts_of_rank.push_back(expert_blocks(layer.slots));
      placement_schedule_.save(record);
    }
    return record.dump();
  }
  void restore_placement(const std::string& text) override {
    if (!ep_ || text.empty()) return;
    const PlacementRecord record = PlacementRecord::parse(text);
    if (compression_ && !record.a2a_compression.empty()) {
      if (compression_->restore(record.a2a_compression)) apply_compression();
      else if (rank_of_world() == 0) spdlog::warn("resume: the checkpoint's a2a compression state does not fit: starts uncompressed");
    }
    if (!record.has_placement) return;
    const bool fits = config_.parallel.rebalance_interval > 0 && record.ep_size == ep_->size() &&
                      record.experts_of_rank.size() == host_model().moe_layers().size();
    if (!fits) {
      // Another EP size or no re-placement now: equal blocks, as a run without the record.
      if (rank_of_world() == 0) spdlog::info("resume: the checkpoint's expert placement does not apply here (equal blocks)");
      return;
    }
    try {
      gpu_->place_experts(record.experts_of_rank);  // checks everything before anything moves
    } catch (const Error& e) {
      if (rank_of_world() == 0) spdlog::warn("resume: the checkpoint's expert placement does not fit ({}): equal blocks", e.what());
      return;
    }
    apply_own_expert_ranges();
    placement_schedule_.restore(record);
  }
  // Expert merging. One GPU: the whole state to the host, the CPU reference's merge there,
  // and back. Over ranks: what a checkpoint saves and a resume fills (merge_sharded_experts,
  // as the CPU ranks do), the resume's targets first filled from the device, then uploaded
  // as a resume does. Merges are rare (every moe.merge_interval steps).
  std::vector<std::vector<ExpertMerge>> merge_experts(const MoEConfig& moe, const std::vector<std::vector<int64_t>>& load_LE,
                                                      const std::vector<std::vector<int64_t>>& protected_LE, uint64_t seed,
                                                      int64_t step) override {
    GpuParameterStore& store = gpu_->parameters();
    if (!dp_ || dp_->size() == 1) {
      std::vector<float>& m = host_optimizer().first_moment();
      std::vector<float>& v = host_optimizer().second_moment();
      download_state(store, host_model().params(), m, v);
      auto merges = merge_host_experts(host_model(), host_optimizer(), moe, load_LE, protected_LE, seed, step);
      upload_state(store, host_model().params(), m, v);
      upload_router_state(host_model().moe_layers(), config_.model, gpu_->routing());
      return merges;
    }
    if (sharded()) sync_host_model();  // the targets of the weights are the host copy
    const SavedState saved = save_state(dp_->rank(), dp_->size());
    const std::vector<StateTarget> targets = restore_targets();
    for (const OwnedPieces::Piece& p : restored_.pieces)
      download_range(store, p.block, restored_.values_of(p), restored_.m_of(p), restored_.v_of(p));
    auto merges = merge_sharded_experts(
        host_model(), moe, saved, targets, [this](float* v, int64_t n) { dp_->sum(v, n); }, load_LE, protected_LE,
        seed, step);
    finish_restore(steps_);
    return merges;
  }
  void sync_host_model() override {
    if (sharded()) {
      // Stage by stage, the lo halves of every piece from its owner (2 bytes per parameter of
      // the stage for a moment); ZeRO-3: the stage's weights gathered into its pool and
      // downloaded before the stage two on takes the pool over.
      GpuParameterStore& store = gpu_->parameters();
      const std::vector<dist::GpuDataParallel*> groups = zero_groups();
      for (dist::GpuDataParallel* group : groups) group->join_stage_gathers();
      const bool by_stage = dp_->shards_weights();
      if (by_stage)
        for (dist::GpuDataParallel* group : groups) group->begin_forward_gathers();
      for (size_t stage = zero_held_.size(); stage-- > 0;) {
        hold_master(store, zero_held_[stage]);
        for (dist::GpuDataParallel* group : groups) {
          group->gather_pieces(store.weights_lo(), dist::DType::bf16,  // int16 bits: moved
                               dist::GpuDataParallel::Layout::Parameters, static_cast<int>(stage));
          if (by_stage) group->forward_stage(static_cast<int>(stage));
        }
        for (const Range& range : zero_held_[stage]) download_params(store, host_model().params(), &range);
      }
      hold_master(store, {});
      if (ep_) gpu_->share_expert_values(host_model().params());  // the other EP ranks' experts
    } else {
      gpu_->download_params(host_model().params());
    }
    for (dist::GpuDataParallel* group : {dp_.get(), edp_.get()})
      if (group) group->take_stats();
  }

  // Checkpoints, each rank its own pieces (no gather, no host copy of the model): ZeRO the
  // master weights and moments of its pieces (those every rank steps as replicas); expert
  // parallelism the shared parameters (its share of them) and its block's experts;
  // replicas (one GPU, ZeRO 0) the share of every tensor it writes. Saving downloads into
  // pinned host buffers that the checkpoint keeps (SavedState::owner) until its write is
  // done, reused by the next save: training waits only for the device-to-host copy.
  // Restoring, ZeRO takes the whole weights (each rank needs every bf16 hi half) and its
  // pieces' state; expert parallelism the shared parameters and its window's experts (a
  // hinge included), in the current placement's slots (restore_placement moves them
  // afterwards); replicas everything.
  OwnedPieces own_pieces(bool restoring) {
    const int world = dp_ ? dp_->size() : 1, rank = dp_ ? dp_->rank() : 0;
    if (sharded() && ep_)
      return expert_zero_pieces(host_model().params(), gpu_->expert_layout(), world, rank, ep_->size(), ep_zero_);
    if (sharded()) return zero_pieces(host_model().params(), *dp_->zero_plan());
    if (ep_) return expert_pieces(host_model().params(), gpu_->expert_layout(), world, rank, ep_->size(), restoring);
    return replica_pieces(host_model().params(), world, rank, restoring);
  }
  // Pinning tens of GB takes seconds: done once, at the start, so that no save waits for it.
  void reserve_save_buffers(bool report) {
    const auto start = std::chrono::steady_clock::now();
    const OwnedPieces* before = save_buffers_.last();
    const std::shared_ptr<OwnedPieces> pieces = save_buffers_.take(own_pieces(/*restoring=*/false));
    if (report && pieces.get() != before)  // planned again: the same buffers
      spdlog::info("checkpoint: {:.2f} GB of pinned host memory for this rank's saves, in {:.1f} s",
                   static_cast<double>(pieces->elements()) * 12e-9,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  SavedState save_state(int rank, int world) override {
    if (dp_) dp_->join_stage_gathers();
    auto& params = host_model().params();
    const std::shared_ptr<OwnedPieces> pieces = save_buffers_.take(own_pieces(/*restoring=*/false));
    SavedState state;
    state.adam_steps = steps_;
    for (const OwnedPieces::Piece& p : pieces->pieces) {
      download_range(gpu_->parameters(), p.block, pieces->values_of(p), pieces->m_of(p), pieces->v_of(p));
      const std::string& name = params.spec(p.id).name;
      const std::vector<int64_t> shape = tensor_shape(params.spec(p.id).shape);
      const int64_t n = p.block.count;
      state.pieces.push_back({"param/" + name, shape, p.begin, n, pieces->values_of(p), p.replicas, p.replica});
      state.pieces.push_back({"adam_m/" + name, shape, p.begin, n, pieces->m_of(p), p.replicas, p.replica});
      state.pieces.push_back({"adam_v/" + name, shape, p.begin, n, pieces->v_of(p), p.replicas, p.replica});
    }
    // The router state is small: the checkpoint keeps copies of it (it changes every step).
    auto biases = std::make_shared<std::list<std::vector<float>>>();
    std::vector<StatePiece> router;
    append_router_state_pieces(host_model(), world, rank, router);
    for (StatePiece& piece : router) {
      piece.data = biases->emplace_back(piece.data, piece.data + piece.count).data();
      state.pieces.push_back(std::move(piece));
    }
    state.owner = std::make_shared<std::pair<std::shared_ptr<OwnedPieces>, decltype(biases)>>(pieces, biases);
    return state;
  }
  std::vector<StateTarget> restore_targets() override {
    auto& params = host_model().params();
    restored_ = own_pieces(/*restoring=*/true);
    restored_.allocate(/*pinned=*/false);
    std::vector<StateTarget> targets;
    if (sharded()) {
      // Every weight it holds whole (under expert parallelism its experts' slices), into
      // the host copy: the bf16 hi halves of every piece come from it.
      for (int id = 0; id < params.size(); ++id)
        if (!ep_ || params.spec(id).expert_group.empty())
          targets.push_back({"param/" + params.spec(id).name, tensor_shape(params.spec(id).shape), 0,
                             params.numel(id), params.value(id)});
      if (ep_)
        for (const OwnedPieces::Piece& p :
             expert_slot_pieces(params, gpu_->expert_layout(), dp_->size(), dp_->rank(), ep_->size()).pieces)
          targets.push_back({"param/" + params.spec(p.id).name, tensor_shape(params.spec(p.id).shape), p.begin,
                             p.block.count, params.values_data() + p.block.offset});
    }
    for (const OwnedPieces::Piece& p : restored_.pieces) {
      const std::string& name = params.spec(p.id).name;
      const std::vector<int64_t> shape = tensor_shape(params.spec(p.id).shape);
      const int64_t n = p.block.count;
      if (!sharded()) targets.push_back({"param/" + name, shape, p.begin, n, restored_.values_of(p)});
      targets.push_back({"adam_m/" + name, shape, p.begin, n, restored_.m_of(p)});
      targets.push_back({"adam_v/" + name, shape, p.begin, n, restored_.v_of(p)});
    }
    append_router_state_targets(host_model(), targets);
    return targets;
  }
  void finish_restore(int64_t adam_steps) override {
    if (dp_) dp_->join_stage_gathers();  // none may still write the weights
    auto& params = host_model().params();
    GpuParameterStore& store = gpu_->parameters();
    if (sharded()) upload_state(store, params, {}, {});  // every weight's hi half, the own pieces' lo halves
    for (const OwnedPieces::Piece& p : restored_.pieces) {
      const float* values = sharded() ? params.values_data() + p.block.offset : restored_.values_of(p);
      upload_range(store, p.block, values, restored_.m_of(p), restored_.v_of(p));
    }
    restored_ = OwnedPieces{};
    upload_router_state(host_model().moe_layers(), config_.model, gpu_->routing());
    steps_ = adam_steps;
    host_optimizer().set_steps_taken(adam_steps);
  }


 private:
  // The GPU model from the host model's weights, with training.*'s recompute and graph
  // settings and the expert-parallel exchange.
  void build_model() {
    const RunConfig& c = config_;
    GpuModelOptions options = GpuModelOptions::from_config(c.training, c.optimizer.state_dtype);
    options.expert_exchange = ep_;
    options.split_experts = ep_ && c.parallel.split_experts;
    // Dynamic load balancing may give an EP rank more than E / P experts (up to this many).
    if (ep_ && c.parallel.rebalance_interval > 0) options.max_local_experts = c.parallel.rebalance_max_experts;
    gpu_ = std::make_unique<GpuTransformer>(c.model, host_model().params(), options);
    if (options.bf16_deepgemm && c.training.interleave_gate_up && (!world_ || world_->rank() == 0))
      spdlog::info("training.interleave_gate_up: {}",
                   gpu_->parameters().hi_interleave().empty()
                       ? "off (an expert's moe.expert_hidden x model.dim is not a multiple of 16,384)"
                       : "w1 | w3 kept expert by expert, the experts' gate|up one GEMM each way");
    if (gpu_->swiglu_in_gemm() && (!world_ || world_->rank() == 0))
      spdlog::info("training.swiglu_in_gemm: SwiGLU in the gate|up GEMM, its backward in the down data gradient");
    gpu_->enable_graphs(c.training.cuda_graphs);
    optimizer_ = std::make_unique<GpuOptimizer>(gpu_->parameters(), host_model().params(), gpu_->stream());
    gpu_->set_phase_clock(&clock_);
    optimizer_->set_phase_clock(&clock_);
    upload_router_state(host_model().moe_layers(), config_.model, gpu_->routing());
    if (c.model.moe.speculative_dispatch && ep_) {  // each MoE layer but the first guessed from the one before
      MOE_CHECK(route_cache_.has_value(), "moe.speculative_dispatch without moe.route_cache");
      std::vector<const RoutingCache*> predictors;
      for (size_t i = 0; i + 1 < host_model().moe_layers().size(); ++i) predictors.push_back(&route_cache_->cache(i));
      gpu_->routing().set_predictors(std::move(predictors));
    }
  }
  // The data-parallel groups over world_: gradient sums overlapped with the backward stage
  // by stage; ZeRO-1 or, under expert parallelism, the shared gradients over all ranks and
  // each rank's experts over the ranks holding the same experts.
  void make_data_parallel() {
    const RunConfig& c = config_;
    GpuParameterStore& params = gpu_->parameters();
    const int64_t ep = ep_ ? ep_->size() : 1;
    const dist::DType reduce_dtype = c.parallel.grad_reduce_dtype == ReduceDtype::Bf16 ? dist::DType::bf16 : dist::DType::f32;
    // Expert parallelism: the ranks holding the same experts (collective over the world).
    std::unique_ptr<dist::Communicator> expert_replicas;
    if (ep > 1) expert_replicas = world_->split(world_->rank() % static_cast<int>(ep), world_->rank());
    dp_ = std::make_unique<dist::GpuDataParallel>(std::move(world_), gpu_->stream(), params.grads(),
                                                  params.storage_numel(), c.parallel.bucket_mb, reduce_dtype);
    // Overlap the all-reduce with the backward, stage by stage (not inside a CUDA graph).
    const auto stage_of = [this](const std::string& name) { return host_model().backward_stage_of(name); };
    if (ep > 1) {
      // Only the shared gradients over all ranks; this rank's experts over their replicas
      // (none when the EP group is the world). Graphs are refused with EP, so this always overlaps.
      if (expert_replicas->size() > 1)
        edp_ = std::make_unique<dist::GpuDataParallel>(std::move(expert_replicas), gpu_->stream(), params.grads(),
                                                       params.storage_numel(), c.parallel.bucket_mb, reduce_dtype);
      if (c.parallel.zero >= 1) {
        // ZeRO: the shared parameters sharded over all ranks, the experts over their replicas.
        const dist::ExpertParallelRanges ranges = dist::gradient_ranges_by_stage_ep(
            host_model().params(), stage_of, host_model().backward_stages(),
            own_expert_ranges(gpu_->expert_layout(), ep_->rank()));
        ep_zero_ = dist::plan_expert_parallel_zero(ranges, params.fp32_copies().ranges(), dp_->bucket_elems(), dp_->size(),
                                                   dp_->rank(), static_cast<int>(ep));
        shard_state(ep_zero_.update, ep_zero_.norm, ep_zero_.held);
        shard_group(*dp_, ep_zero_.shared);
        if (edp_) shard_group(*edp_, ep_zero_.experts);
      } else {
        apply_own_expert_ranges();
      }
    } else if (c.parallel.zero >= 1 && dp_->size() > 1) {
      // ZeRO-1: reduce-scatter, each rank steps its pieces, the bf16 weights all-gathered.
      const std::vector<RangeList> stages =
          dist::gradient_ranges_by_stage(host_model().params(), stage_of, host_model().backward_stages());
      // Interleaved gate|up pairs cut at expert slices, their weights gathered in the hi halves' order.
      dist::ZeroShardPlan plan = dist::plan_zero_shards(stages, params.fp32_copies().ranges(), dp_->bucket_elems(),
                                                        dp_->size(), dp_->rank(), params.hi_interleave());
      shard_state(plan.update, plan.norm, stages);
      shard_group(*dp_, std::move(plan));
    } else if (!c.training.cuda_graphs) {
      dp_->set_stage_ranges(dist::gradient_ranges_by_stage(host_model().params(), stage_of, host_model().backward_stages()));
    }
    if (sharded() && !c.training.cuda_graphs)
      gpu_->set_forward_stage_hook([this](int stage) {
        for (dist::GpuDataParallel* group : zero_groups()) group->forward_stage(stage);
      });
  }
  // ZeRO 1+ on the store and the optimizer: this rank keeps the lo halves and moments of
  // `update` only and steps them, adds `norm` to the global norm; at 2+ the gradients and at
  // 3 the weights of the rest of each stage (`held`: per stage the ranges it holds) live in
  // memory the stages share.
  void shard_state(const RangeList& update, const RangeList& norm, const std::vector<RangeList>& held) {
    GpuParameterStore& params = gpu_->parameters();
    pack_optimizer_state(params, update);
    optimizer_->set_step_ranges(update, norm);
    optimizer_->shard_expert_clip(norm, update);
    if (config_.parallel.zero >= 2) share_gradients(params, update, held);
    if (config_.parallel.zero >= 3) share_weights(params, update, held);
    zero_held_ = held;
  }
  // ZeRO on one data-parallel group: `plan`'s buckets reduce-scattered (overlapped with the
  // backward unless inside a CUDA graph); at 2+ the gradients outside its pieces zeroed once
  // their stage's sums have left; at 3 the weights gathered stage by stage for every
  // forward and backward.
  void shard_group(dist::GpuDataParallel& group, dist::ZeroShardPlan plan) {
    const int64_t zero = config_.parallel.zero;
    std::vector<RangeList> zero_after;
    if (zero >= 2)
      for (const RangeList& buckets : plan.sharded) zero_after.push_back(subtract_ranges(buckets, plan.update));
    group.set_zero_plan(std::move(plan), /*overlap=*/!config_.training.cuda_graphs);
    if (zero >= 2) group.set_gradient_sharding(std::move(zero_after));
    if (zero >= 3) group.set_weight_sharding(gpu_->parameters().weights_hi());
  }
  // Expert parallelism: the true norm of every expert, whose gradients only its holders
  // have (the others' norms are zero here), for the reported largest norm and the count
  // clipped: the squares summed over all ranks, each over the ranks that hold its whole
  // norm (its replicas; every rank for a split expert's hinge).
  void report_expert_norms(const std::vector<double>& norms, const std::vector<char>& hinge, double max_norm,
                           ClipStats& clip) {
    std::vector<double> squares(norms.size());
    for (size_t x = 0; x < norms.size(); ++x) squares[x] = norms[x] * norms[x];
    dp_->sum(squares.data(), static_cast<int64_t>(squares.size()));
    const auto world = static_cast<double>(dp_->size()), replicas = world / ep_->size();
    for (size_t x = 0; x < norms.size(); ++x) {
      const double norm = std::sqrt(squares[x] / (x < hinge.size() && hinge[x] ? world : replicas));
      clip.max_expert_norm = std::max(clip.max_expert_norm, norm);
      if (max_norm > 0 && norm > max_norm) ++clip.experts_clipped;
    }
  }
  // Dynamic load balancing (parallel.rebalance_interval; PlacementSchedule) on the global loads.
  void rebalance_experts() {
    MOE_CHECK(!sharded(), "expert re-placement: not with a sharded optimizer (ZeRO-1)");
    std::vector<std::vector<std::vector<int64_t>>> current;
    for (const MoeLayerExperts& layer : gpu_->expert_layout()) current.push_back(expert_blocks(layer.slots));
    const auto next = placement_schedule_.step(loads_, current, ep_->size(), config_.parallel,
                                               config_.model.moe.route_groups);
    if (!next) return;
    gpu_->place_experts(next->experts_of_rank);
    apply_own_expert_ranges();
    if (rank_of_world() == 0)
      spdlog::info("re-placed experts by load: busiest EP rank's assignments summed over the MoE layers {} -> {}",
                   next->busiest_before, next->busiest_after);
  }
  int rank_of_world() const { return dp_ ? dp_->rank() : 0; }
  // This rank's experts (its slots, per MoE layer; they change with a re-placement) are the
  // ones its optimizer steps and, over more ranks than one EP group, whose gradients it
  // sums over the ranks holding the same experts; the shared gradients (the hinges'
  // included) are summed over all ranks.
  void apply_own_expert_ranges() {
    const auto stage_of = [this](const std::string& name) { return host_model().backward_stage_of(name); };
    const ExpertLayout layout = gpu_->expert_layout();
    const dist::ExpertParallelRanges ranges =
        dist::gradient_ranges_by_stage_ep(host_model().params(), stage_of, host_model().backward_stages(),
                                          own_expert_ranges(layout, ep_->rank()), hinge_ranges(layout));
    // AdamW, the norm and the per-expert norms over the shared parameters and this rank's
    // experts only: the other experts hold no memory here.
    optimizer_->set_step_ranges(ranges.stepped(), ranges.stepped());
    optimizer_->shard_expert_clip(ranges.stepped(), ranges.stepped());
    dp_->set_stage_ranges(ranges.shared);  // the hinges moved with the placement
    if (edp_) edp_->set_stage_ranges(ranges.own_experts);
  }

  const RunConfig& config_;
  std::unique_ptr<dist::Communicator> world_;  // until make_data_parallel hands it to dp_
  gpu::PhaseClock clock_{gpu_phase_names()};  // step time by phase (before gpu_: it points here)
  std::unique_ptr<GpuTransformer> gpu_;
  std::unique_ptr<GpuOptimizer> optimizer_;  // steps gpu_'s parameter store (declared after it: goes first)
  int64_t steps_ = 0;  // AdamW steps taken
  int64_t tokens_ = 0;  // per micro-batch (targets counted for the loss weights)
  std::unique_ptr<dist::GpuDataParallel> dp_;
  std::shared_ptr<dist::GpuExpertExchangeOverComm> ep_;  // expert parallelism, or null (kept across re-plans)
  std::unique_ptr<dist::A2aCompressionSwitch> compression_;  // parallel.a2a_compression = auto, per MoE layer
  void apply_compression() {
    for (int l = 0; l < compression_->layers(); ++l) ep_->set_layer_fp8(l, compression_->fp8(l));
  }
  std::unique_ptr<dist::GpuDataParallel> edp_;  // with ep_ over more ranks than one EP group: own experts' sums
  double ce_weight_ = 1.0;  // this rank's share of the micro-batch's targets
  double micro_scale_ = 1;  // the step loop's loss scale: 1 / micro-batches per step
  bool backward_done_ = false;  // forward() ran the backward too (CUDA graph)
  std::optional<RoutingCacheProbe> route_cache_;  // moe.route_cache: this rank's tokens
  double grad_scale_ = 1.0;
  std::vector<std::vector<int64_t>> loads_;  // this step's assignments per expert, per MoE layer
  PlacementSchedule placement_schedule_;  // parallel.rebalance_interval
  SaveBufferPool save_buffers_;  // checkpoints: the last save's pieces (pinned buffers, reused)
  std::unique_ptr<BoardSampler> board_;  // after plan_batches
  std::unique_ptr<gpu::SmClocks> step_clock_;  // the step's SM clock as the SMs count it
  OwnedPieces restored_;                // the pieces a restore fills
  std::vector<RangeList> zero_held_;    // ZeRO: per backward stage, the ranges this rank holds
  dist::ExpertParallelZero ep_zero_;    // ZeRO under expert parallelism: the two groups' plans
};

}  // namespace

std::unique_ptr<ModelBackend> make_gpu_backend(const RunConfig& config, HostState host,
                                               std::unique_ptr<dist::Communicator> world) {
  return std::make_unique<GpuBackend>(config, std::move(host), std::move(world));
}

}  // namespace moe
