// The CPU model trained over several ranks: data parallelism with ZeRO (parallel.zero 0-3)
// for the non-expert parameters (src/dist/zero_optimizer.h, zero_parameter_gather.h) and,
// with parallel.expert_parallel > 1, expert parallelism on the GPU path's semantics (per
// MoE layer slots, each token once per peer, partial combines, split experts:
// model/expert_parallel_dispatcher.h over src/dist/expert_exchange.h; the experts' steps in
// src/dist/expert_optimizer.h, at parallel.zero 1-3 ZeRO over their replicas with the same
// level: expert_shares.h, expert_parameter_gather.h). A ModelBackend, so Trainer::train_step's
// one loop drives it.
//
// What "the same as one process" means here: N ranks with micro-batch B reproduce the
// single-process run with micro-batch N x B and the same global batch (rank r's local
// sequence b is sequence b * N + r of that run's micro-batch). Cross-entropy is weighted
// so the sum over ranks is the mean over the global micro-batch's targets; the MoE layers
// compute the aux loss, z-loss and capacity over the global micro-batch (MoEBatchGroup).
// Only the order of floating-point sums differs (with expert parallelism also how a
// token's expert outputs are grouped into partial combines).
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "dist/a2a_compression.h"
#include "dist/communicator.h"
#include "dist/expert_exchange.h"
#include "dist/hierarchical_all_to_all.h"
#include "dist/expert_optimizer.h"
#include "dist/expert_parameter_gather.h"
#include "dist/comm_stats.h"
#include "dist/process_groups.h"
#include "dist/zero_optimizer.h"
#include "dist/zero_parameter_gather.h"
#include "train/backends/cpu_backend.h"
#include "train/backends/model_backend.h"
#include "train/backends/placement_record.h"
#include "train/routing_cache_probe.h"

namespace moe {

class ParallelCpuBackend final : public ModelBackend {
 public:
  // Collective over world. Wires the model's MoE layers to the other ranks (call before
  // planning the model).
  ParallelCpuBackend(const RunConfig& config, HostState host, std::unique_ptr<dist::Communicator> world);
  ~ParallelCpuBackend() override;

  int rank() const { return groups_.world->rank(); }
  int world_size() const { return groups_.world->size(); }
  // Expert parallelism: each MoE layer's slots (empty without).
  const std::vector<ExpertSlots>& expert_slots() const { return slots_; }
  const dist::ZeroOptimizer& zero() const { return *zero_; }
  const dist::ExpertOptimizer* experts() const { return experts_.get(); }  // null without expert parallelism

  BatchPlan plan_batches() override { return plan_host_batches(config_, host_model()); }
  void begin_step() override;
  ForwardResult forward(const int32_t* inputs_BS, const int32_t* targets_BS) override;
  void backward(double loss_scale, bool last) override;
  void reduce_losses(StepStats& stats) override;
  void routing(StepStats& stats) override;
  ClipStats clip_gradients(double max_global_norm, double max_expert_norm) override;
  void apply_update(double lr) override;
  void end_step() override;
  double sum_over_ranks(double value) override;
  void end_validation() override;
  void take_comm_stats(StepStats& stats) override;
  void observe_step(const StepStats& stats) override;
  const dist::A2aCompressionSwitch& a2a_compression() const { return *compression_; }
  void sync_host_model() override;
  // Checkpoints: each rank's own pieces (no gather), and back from any layout.
  SavedState save_state(int rank, int world) override;
  std::vector<StateTarget> restore_targets() override;
  void finish_restore(int64_t adam_steps) override;
  // With re-placement: each MoE layer's experts per EP rank and the loads since the last
  // placement (the GPU backend's record, so either resumes the other's).
  std::string placement_state() const override;
  void restore_placement(const std::string& state) override;
  // moe.merge_interval: every rank rebuilds the MoE layers' state whole from the ranks'
  // pieces, takes the same merges, and keeps its own part (merge_sharded_experts).
  std::vector<std::vector<ExpertMerge>> merge_experts(const MoEConfig& config,
                                                      const std::vector<std::vector<int64_t>>& load_LE,
                                                      const std::vector<std::vector<int64_t>>& protected_LE,
                                                      uint64_t seed, int64_t step) override;

 private:
  double world_sum(double value);

  const RunConfig& config_;
  dist::ProcessGroups groups_;
  dist::CommStats stats_;
  std::unique_ptr<dist::BatchGroupOverComm> batch_;
  std::unique_ptr<dist::AllToAll> a2a_;
  std::vector<ExpertSlots> slots_;  // per MoE layer; the layers and experts_ read them
  std::vector<std::unique_ptr<dist::ExpertExchangeOverComm>> exchanges_;
  std::optional<RoutingCacheProbe> route_cache_;  // moe.route_cache: each rank's own tokens
  std::unique_ptr<dist::A2aCompressionSwitch> compression_;  // parallel.a2a_compression, per MoE layer
  void apply_compression();
  std::unique_ptr<dist::ZeroOptimizer> zero_;
  std::unique_ptr<dist::ZeroParameterGather> gather_;  // parallel.zero = 3
  std::unique_ptr<dist::ExpertOptimizer> experts_;  // expert_parallel > 1
  std::unique_ptr<dist::ExpertParameterGather> expert_gather_;  // expert_parallel > 1, parallel.zero = 3, replicas
  // expert_parallel == 1: expert weights are sharded with the rest; per-expert clipping
  // needs their expert group per parameter id (-1: not an expert weight).
  std::vector<int> expert_group_of_id_;
  int64_t n_expert_groups_ = 0;
  PlacementSchedule placement_schedule_;  // parallel.rebalance_interval
  void rebalance_experts();
  // Moves the experts to `next` (weights, moments) and makes it the layers' slots.
  void place_experts(const std::vector<ExpertSlots>& next);
  // Expert parallelism: memory for this rank's window experts, every hinge (their
  // gradients are summed into every rank's block) and the non-expert parameters only
  // (ParameterStore::set_resident); the other experts' pages go.
  void keep_own_experts_resident();
  // Startup log: the bytes of parameter state (values, gradients, moments) this rank keeps.
  void log_state_bytes();
  bool in_zero_plan(int id) const;
  std::vector<std::vector<int>> expert_ids_by_layer_;  // per MoE layer: its expert tensors' ids
  double ce_weight_ = 1;                            // this rank's share of the micro-batch's targets
  std::vector<std::vector<int64_t>> global_load_;   // per MoE layer: the step's load summed over ranks
};

}  // namespace moe
