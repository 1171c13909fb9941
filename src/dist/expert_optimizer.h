// Expert weights under expert parallelism (EP > 1) on the CPU path. Every rank stores the
// full expert tensors (the CPU model's layout, in expert order), but only the experts of
// its window in each MoE layer's slots (moe/expert_slots.h) are computed, have gradients
// and are updated there; each rank keeps the AdamW moments of its window's experts.
// Gradients are summed as soon as backward finishes the layer:
//   own experts (the window less its hinges): over the expert-data-parallel group, the
//     ranks with the same EP rank, the only ones that computed them;
//   hinges (split experts, a slot in two or more windows): over all ranks (zeros where a
//     rank holds none), as its holders are different EP ranks; every holder then takes the
//     same step on the same sum, so their copies stay identical.
// Each expert is counted once in the global norm: by the rank whose block holds its slot.
// ZeRO over the expert replicas (zero_level >= 1, the group larger than one), for own
// experts only (hinges stay whole), in the shares of expert_shares.h:
//   1: the gradients are reduce-scattered (on the step's last micro-batch) instead of
//      all-reduced, each rank keeps the moments of and steps its share only, and the
//      updated shares are all-gathered back, so every replica holds the whole weights;
//   2: also reduce-scattered on every micro-batch (the own share keeps the running sum),
//      the other shares' gradients given back to the OS (others_shares());
//   3: also only the own share of the weights between uses: ExpertParameterGather
//      (expert_parameter_gather.h) gathers a layer's for its forward and its backward.
// Norms sum the shares' partial squares over the group. migrate() gathers the moments
// whole around the move (the caller makes the weights whole first at level 3);
// checkpoints save each rank's share as a piece of the global tensor.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "config/optimizer_config.h"
#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "dist/expert_shares.h"
#include "model/parameters.h"
#include "moe/expert_slots.h"

namespace moe::dist {

class ExpertOptimizer {
 public:
  // One entry per MoE layer: its expert parameter ids (sharing an expert_group, leading
  // dim = experts) and the backward stage after which their gradients are complete.
  struct Layer {
    std::vector<int> ids;
    int stage = 0;
  };
  // slots[l]: MoE layer l's slots (outlives this; migrate() before it changes).
  // expert_data_parallel: the ranks with this EP rank; world: every rank (hinges).
  ExpertOptimizer(ParameterStore<float>& params, std::vector<Layer> layers, const std::vector<ExpertSlots>& slots,
                  int ep_rank, Communicator& expert_data_parallel, Communicator& world, const OptimizerConfig& config,
                  CommStats& stats, int zero_level = 0);

  void arm() { armed_ = true; }
  void on_stage(int stage);
  // Level 2-3, after each micro-batch's backward: waits for its reduce-scatters, keeps the
  // own shares' sums and gives the other shares' gradients back.
  void end_micro_batch();
  void finish();

  // Per-expert clipping of the window's experts (max_norm 0: none). Returns the largest
  // per-expert norm seen before clipping.
  double clip_experts(double max_norm);
  // This rank's part of the experts' squared norm: summed over all ranks, each expert
  // counted once (whole experts by the first rank of the expert-data-parallel group whose
  // block holds their slot, sharded ones' shares by every rank of that group).
  double sum_of_squares() const;
  void scale_gradients(float factor);
  void step(double lr);
  // Every rank of the EP group gets every expert's current weights (broadcast from its
  // slot's block rank): the whole model on every rank (the end of a run), so the other
  // experts' memory is committed again.
  void gather_weights(Communicator& expert_parallel);
  // Before the slots this optimizer reads change to `next` (a re-placement): each expert
  // that a rank newly holds takes its current weights and AdamW moments from its block
  // rank (ranks that neither hold nor take it receive them aside). Collective over the EP group; the caller then assigns `next`.
  void migrate(const std::vector<ExpertSlots>& next, Communicator& expert_parallel);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // Checkpoints without a gather: the moments this rank keeps, of expert `expert` of
  // parameter `id` (count values each), elements [share_begin, share_begin + share_count)
  // of it (the whole expert unless `sharded`: this rank's share, no other rank keeps it);
  // `in_block`: its slot lies in this rank's block (one rank of each EP group), else it is
  // the next block's hinge.
  struct ExpertMoments {
    int id = 0;
    int64_t expert = 0, count = 0;
    int64_t share_begin = 0, share_count = 0;
    float* m = nullptr;
    float* v = nullptr;
    bool in_block = false;
    bool sharded = false;
  };
  std::vector<ExpertMoments> window_moments();
  // The moment elements (m and v) this rank keeps for experts.
  int64_t moment_elements() const;
  // Layer l's experts sharded over the replicas: its own experts at ZeRO >= 1 over a group
  // of two or more (the same list on every rank of the group), else none.
  std::vector<int64_t> sharded_experts(size_t l) const;
  const ExpertShares& shares() const { return shares_; }
  // The other replicas' shares of every layer's sharded experts (ranges of the block): at
  // level 2 and 3 their gradients are released between uses, at 3 their weights too.
  RangeList others_shares() const;

 private:
  struct LayerState {
    Layer layer;
    std::vector<int64_t> own, hinges;             // at on_stage: window experts summed over edp / the layer's hinges
    std::vector<float> own_buffer, hinge_buffer;  // their gradients, packed for the sums
    std::vector<float> own_share;                 // sharded: this rank's summed shares of own_buffer
    std::unique_ptr<Work> own_work, hinge_work;  // own_work at level 2: every micro-batch
    std::vector<std::vector<std::vector<float>>> m, v;  // [id][expert]: the window's, empty for the others
  };
  int64_t per_expert(int id) const { return shares_.per_expert(id); }
  // Experts of a layer that only this EP rank holds (the same list on every rank of the
  // expert-data-parallel group).
  std::vector<int64_t> own_experts(const ExpertSlots& slots) const;
  // The elements of expert `expert` of tensor id this rank keeps summed and steps: its
  // share when the expert is among `sharded`, else the whole slice.
  ExpertShares::Share kept(int id, int64_t expert, const std::vector<int64_t>& sharded) const;
  void shard_moments(size_t l, const ExpertSlots& slots);    // cut the own experts' whole moments to this rank's share
  void unshard_moments(size_t l, const ExpertSlots& slots);  // all-gather them whole (collective over edp)
  std::vector<float*> grads_of(const LayerState& layer);
  std::vector<float*> values_of(const LayerState& layer);
  void gather_updated_shares(LayerState& layer, const std::vector<int64_t>& experts);
  // Level 2: waits for the oldest layers' reduce-scatters until `keep` are in flight.
  void retire_scatters(size_t keep);
  void pack(const LayerState& layer, const std::vector<int64_t>& experts, std::vector<float>& buffer) const;
  void unpack(const LayerState& layer, const std::vector<int64_t>& experts, const std::vector<float>& buffer);
  template <class F>
  void for_window(size_t l, F&& f) const;  // f(id index, expert)

  ParameterStore<float>& params_;
  const std::vector<ExpertSlots>& slots_;
  int ep_rank_;
  Communicator& edp_;
  Communicator& world_;
  OptimizerConfig config_;
  CommStats& stats_;
  std::vector<LayerState> layers_;
  ExpertShares shares_;
  int level_ = 0;
  bool shards_ = false;  // ZeRO >= 1 over an expert-data-parallel group of two or more
  std::vector<size_t> scattering_;  // level 2-3: layers whose reduce-scatter is in flight, oldest first
  int64_t steps_ = 0;
  bool armed_ = false;
};

}  // namespace moe::dist
