// ZeRO on the CPU path, in the GPU's layout (src/dist/zero_shards.h): the parameter
// store's gradient block keeps its layout; each bucket of the plan is reduce-scattered in
// place (non-blocking) as soon as backward has finished its stage on the last micro-batch
// of a step, so rank r holds the sums of its piece of every bucket; the replicated ranges
// are all-reduced whole. Every rank keeps the AdamW moments of its `update` ranges only,
// steps them, and the pieces of the new parameters are all-gathered in place.
// Levels (parallel.zero; docs/PARALLELISM.md): 0 is level 1 over replicated_plan (every
// range all-reduced and stepped everywhere); 2 reduce-scatters on every micro-batch and
// gives the other ranks' pieces of the gradients back to the OS once summed (the running
// sum stays in the own piece); 3 also leaves the new parameters' pieces where they were
// stepped: ZeroParameterGather (zero_parameter_gather.h) gathers them stage by stage.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/optimizer_config.h"
#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "dist/zero_shards.h"
#include "kernels/adamw_math.h"
#include "model/parameters.h"

namespace moe::dist {

adamw_math::AdamWScalars adamw_scalars(const OptimizerConfig& config, double lr, int64_t step);

// The plan the CPU path shards with: plan_zero_shards over gradient_ranges_by_stage of the
// store, the padded extents of `keep_whole` replicated, buckets of gradient_bucket_elems
// (bucket_mb), as GpuBackend plans the GPU store (whose keep_whole are its fp32 copies: the
// router biases). `left_out`: parameters stepped elsewhere (expert weights under expert
// parallelism), taken out of the stage ranges with their padding.
ZeroShardPlan plan_zero_for_store(const ParameterStore<float>& params,
                                  const std::function<int(const std::string&)>& stage_of, int n_stages,
                                  const std::vector<int>& keep_whole, const std::vector<int>& left_out,
                                  double bucket_mb, int ranks, int rank);

class ZeroOptimizer {
 public:
  // plan: for this rank of `group` over params' block (plan_zero_for_store); its stages are
  // the backward stages on_stage() is called with.
  // level: parallel.zero (0 and 1 differ only in the plan).
  ZeroOptimizer(ParameterStore<float>& params, ZeroShardPlan plan, Communicator& group, const OptimizerConfig& config,
                CommStats& stats, int level = 1);

  // The next backward is the step's last micro-batch: reduce buckets as its stages finish.
  void arm() { armed_ = true; }
  void on_stage(int stage);
  // ZeRO-2/3, after each micro-batch's backward: waits for its reduce-scatters and gives
  // the other ranks' pieces of the gradients back (zero for the next backward to add to).
  void end_micro_batch();
  // ZeRO-2/3: what begin_step zeroes instead of the whole block: `resident` without the
  // other ranks' pieces (already zero).
  RangeList gradients_to_zero(const RangeList& resident) const;
  int level() const { return level_; }
  // Waits for every reduction; the gradient block then holds the summed gradients at the
  // plan's `update` ranges. Adds the latency from the first issue to the last completion
  // into stats.grad_sync_s.
  void finish();

  // This rank's part of the global squared norm (the plan's `norm` ranges).
  double shard_sum_of_squares() const;
  void scale_gradients(float factor);
  // Per-expert clipping of expert weights sharded here: sums[g * E + e] += squares of
  // expert e of expert group g over the `norm` ranges (group_of_id: id -> group index, or
  // -1; E = leading dim); scale_experts scales them over the `update` ranges.
  void add_expert_sums_of_squares(const std::vector<int>& group_of_id, std::vector<double>& sums) const;
  void scale_experts(const std::vector<int>& group_of_id, const std::vector<float>& factors);

  // AdamW on this rank's `update` ranges, then the pieces are all-gathered (below level 3).
  void step(double lr);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }

  // Checkpoints: the moments of every parameter of the plan, gathered from the ranks into
  // the single-process AdamW layout (id's moments start at moment_offset(id)); collective.
  // scatter_moments takes this rank's part back from such a layout.
  void gather_moments(const std::function<int64_t(int)>& moment_offset, std::vector<float>& m, std::vector<float>& v);
  void scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                       const std::vector<float>& v);

  // Checkpoints without a gather: this rank's moments as elements [begin, begin + count)
  // of parameter id (counted in the parameter, not the block), in m_ / v_; `replicated`:
  // every rank of the group steps these (the plan's replicated ranges), else this rank only.
  struct MomentSlice {
    int id = 0;
    int64_t begin = 0, count = 0;
    float* m = nullptr;
    float* v = nullptr;
    float* value = nullptr;  // the parameter's values there (ZeRO-3 saves these pieces)
    bool replicated = false;
  };
  std::vector<MomentSlice> moment_slices();

  const ZeroShardPlan& plan() const { return plan_; }
  // The parameters the plan covers, in id order.
  const std::vector<int>& ids() const { return ids_; }

 private:
  // A parameter's elements [begin, begin + count) of the block inside one of a plan's
  // range sets (padding left out); `state`: where their moments start in m_ / v_.
  struct Segment {
    int id = 0;
    int64_t begin = 0, count = 0, state = 0;
  };
  std::vector<Segment> segments_of(const RangeList& ranges) const;
  // Calls f(block element, g * E + e) for each element of expert weights in `segments`
  // (g: its expert group, e: its expert).
  template <class F>
  void for_expert_elements(const std::vector<Segment>& segments, const std::vector<int>& group_of_id, F&& f) const;
  void poll();
  // Waits for the reduce-scatters of the stages issued before the newest `keep` ones and
  // releases the other ranks' pieces of their gradients.
  void retire_scatters(size_t keep);
  // grad_sync_s: from the first issue to the last completion of a round of reductions.
  void settle_timing();
  // All-gathers every rank's piece of each bucket of a block in the gradient block's layout, in place.
  void gather_pieces(float* block);

  ParameterStore<float>& params_;
  ZeroShardPlan plan_;
  Communicator& group_;
  OptimizerConfig config_;
  CommStats& stats_;
  std::vector<int> ids_;
  std::vector<Segment> update_, norm_;
  std::vector<float> m_, v_;  // the moments of update_'s elements, back to back
  std::vector<std::unique_ptr<Work>> in_flight_;
  int level_ = 1;
  std::vector<RangeList> others_;  // per stage: the other ranks' pieces (others_pieces)
  struct Scatter {
    int stage = 0;
    std::vector<std::unique_ptr<Work>> works;
  };
  std::vector<Scatter> scattering_;  // ZeRO-2/3: this micro-batch's reduce-scatters by stage
  int64_t steps_ = 0;
  bool armed_ = false;
  bool issued_ = false;
  CommClock::time_point first_issue_, last_complete_;
};

}  // namespace moe::dist
