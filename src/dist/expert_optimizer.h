// Expert weights under expert parallelism (EP > 1) on the CPU path. Every rank stores
// the full expert tensors (the CPU model's layout), but only the slices of the experts
// its EP rank holds are computed, have gradients and are updated there. Their gradients
// are all-reduced (not sharded) over the expert-data-parallel group, the ranks holding
// the same experts, as soon as backward finishes the layer on the last micro-batch; each
// rank keeps the AdamW moments of its own experts, whole.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "config/optimizer_config.h"
#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "model/parameters.h"
#include "moe/expert_placement.h"

namespace moe::dist {

class ExpertOptimizer {
 public:
  // One entry per MoE layer: its expert parameter ids (sharing an expert_group, leading
  // dim = experts) and the backward stage after which their gradients are complete.
  struct Layer {
    std::vector<int> ids;
    int stage = 0;
  };
  ExpertOptimizer(ParameterStore<float>& params, std::vector<Layer> layers, const ExpertPlacement& placement,
                  int ep_rank, Communicator& expert_data_parallel, const OptimizerConfig& config, CommStats& stats);

  void arm() { armed_ = true; }
  void on_stage(int stage);
  void finish();

  // Per-expert clipping of the held experts (max_norm 0: none). Returns the largest
  // per-expert norm seen before clipping.
  double clip_experts(double max_norm);
  double sum_of_squares() const;
  void scale_gradients(float factor);
  void step(double lr);
  // Every rank of the EP group gets every expert's current weights (broadcast from its holder).
  void gather_weights(Communicator& expert_parallel);
  // Before the placement this optimizer reads changes to `next` (dynamic load balancing):
  // each expert that changes rank takes its current weights and AdamW moments from its
  // old holder to its new one. Collective over the EP group; the caller then assigns
  // `next` to the placement.
  void migrate(const ExpertPlacement& next, Communicator& expert_parallel);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // Checkpoints: every expert's moments into the single-process AdamW layout (id's moments
  // start at moment_offset(id)), broadcast from the rank holding it (collective over the
  // EP group); scatter_moments takes the held experts' back from such a layout.
  void gather_moments(Communicator& expert_parallel, const std::function<int64_t(int)>& moment_offset,
                      std::vector<float>& m, std::vector<float>& v);
  void scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                       const std::vector<float>& v);

 private:
  struct LayerState {
    Layer layer;
    std::vector<float> buffer;  // held experts' gradients, packed for the all-reduce
    std::unique_ptr<Work> work;
    std::vector<std::vector<float>> m, v;  // per id: held experts back to back
  };
  int64_t per_expert(int id) const { return params_.numel(id) / params_.spec(id).shape[0]; }
  template <class F>
  void for_held(const LayerState& layer, F&& f) const;  // f(id, expert, slot)

  ParameterStore<float>& params_;
  const ExpertPlacement& placement_;
  int ep_rank_;
  Communicator& edp_;
  OptimizerConfig config_;
  CommStats& stats_;
  std::vector<LayerState> layers_;
  int64_t steps_ = 0;
  bool armed_ = false;
};

}  // namespace moe::dist
