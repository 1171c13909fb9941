// ZeRO-3 of the experts over their replicas on CPU ranks: between uses a rank keeps only
// its share (expert_shares.h) of the weights of each MoE layer's sharded experts (the own
// experts, ExpertOptimizer::sharded_experts; hinges and the other ranks' experts as
// before). Before the layer's forward, and again before its backward, the shares are
// all-gathered over the expert-data-parallel group into the whole window, and the other
// shares are given back to the OS after (ParameterStore::release_values); the pass's next
// MoE layer's gather is in flight meanwhile. The values gathered are those level 2's step
// all-gathers, so the runs agree bit for bit. The dense counterpart: zero_parameter_gather.h.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "dist/expert_optimizer.h"
#include "model/parameters.h"

namespace moe::dist {

class ExpertParameterGather {
 public:
  // layers: the optimizer's (MoE layer l's tensors and backward stage); experts says which
  // experts are sharded (it reads the current slots each time). Releases the other shares now.
  ExpertParameterGather(ParameterStore<float>& params, std::vector<ExpertOptimizer::Layer> layers,
                        const ExpertOptimizer& experts, Communicator& expert_data_parallel, CommStats& stats);
  ~ExpertParameterGather();

  // Transformer::on_parameters_needed / on_parameters_done (stages without a MoE layer: nothing).
  void needed(int stage, bool backward);
  void done(int stage, bool backward);
  // After a step, a restore or a re-placement only the own shares are current: the rest goes.
  void release_all();
  // Every sharded expert whole (re-placement, the end of a run); collective.
  void gather_all();

 private:
  enum class State { Released, InFlight, Present };
  struct LayerState {
    ExpertOptimizer::Layer layer;
    State state = State::Released;
    std::vector<int64_t> experts;  // sharded when issued
    std::vector<float> packed;     // rank-major shares while in flight
    std::unique_ptr<Work> work;
  };
  // The MoE layer whose tensors complete at `stage`, or -1.
  int layer_at(int stage) const;
  void issue(int l);
  void wait(int l);
  void release(int l);
  std::vector<float*> values_of(const LayerState& layer);

  ParameterStore<float>& params_;
  const ExpertOptimizer& experts_;
  Communicator& edp_;
  CommStats& stats_;
  std::vector<LayerState> layers_;
};

}  // namespace moe::dist
