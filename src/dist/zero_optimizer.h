// ZeRO-1 for the replicated ("dense") parameters on the CPU path: gradients are
// reduce-scattered over the data-parallel group in buckets of whole layers, each issued
// (non-blocking) as soon as backward has finished its layers on the last micro-batch of a
// step; every rank keeps the AdamW moments of its shard only, updates it, and the
// parameters are all-gathered back.
//
// Layout: bucket b holds its parameters' gradients back to back (numel_b values), padded
// to N * shard_b; rank r owns elements [r * shard_b, (r + 1) * shard_b) of every bucket.
// Buckets follow the order in which backward completes gradients (Transformer's stages).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "config/optimizer_config.h"
#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "kernels/adamw_math.h"
#include "model/parameters.h"

namespace moe::dist {

// AdamW::step's per-element arithmetic (kernels/adamw_math.h, shared with the CPU AdamW
// and the GPU) on n elements, so a sharded update computes the same floats as the
// single-process one. `decay`: the parameter takes weight decay; `bf16_moments`:
// optimizer.state_dtype = "bf16".
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const adamw_math::AdamWScalars& s,
                  bool decay, bool bf16_moments);
adamw_math::AdamWScalars adamw_scalars(const OptimizerConfig& config, double lr, int64_t step);

class ZeroOptimizer {
 public:
  // ids: the parameters this optimizer owns. stage_of(id): the backward stage after which
  // id's gradient is complete; stages run 0 .. n_stages - 1. bucket_mb = 0: one bucket per stage.
  ZeroOptimizer(ParameterStore<float>& params, std::vector<int> ids, const std::function<int(int)>& stage_of,
                int n_stages, double bucket_mb, Communicator& group, const OptimizerConfig& config, CommStats& stats);

  // The next backward is the step's last micro-batch: reduce buckets as its stages finish.
  void arm() { armed_ = true; }
  void on_stage(int stage);
  // Waits for every bucket; the shard then holds the summed gradients. Adds the latency
  // from the first issue to the last completion into stats.grad_sync_s.
  void finish();

  double shard_sum_of_squares() const;
  void scale_gradients(float factor);
  // Per-expert clipping of expert weights sharded here: sums[g * E + e] += squares of
  // expert e of expert group g (group_of_id: id -> group index, or -1; E = leading dim).
  void add_expert_sums_of_squares(const std::vector<int>& group_of_id, std::vector<double>& sums) const;
  void scale_experts(const std::vector<int>& group_of_id, const std::vector<float>& factors);

  // AdamW on this rank's shard, then the parameters are all-gathered.
  void step(double lr);
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }

  // Checkpoints: the moments of every parameter here, gathered from the ranks' shards into
  // the single-process AdamW layout (id's moments start at moment_offset(id)); collective.
  // scatter_moments takes this rank's shard back from such a layout.
  void gather_moments(const std::function<int64_t(int)>& moment_offset, std::vector<float>& m, std::vector<float>& v);
  void scatter_moments(const std::function<int64_t(int)>& moment_offset, const std::vector<float>& m,
                       const std::vector<float>& v);

  int64_t n_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  int64_t shard_numel() const { return static_cast<int64_t>(grad_.size()); }
  int64_t total_numel() const;

 private:
  struct Piece {
    int id = 0;
    int64_t offset = 0;  // of the parameter's first element inside the bucket
    int64_t numel = 0;
  };
  struct Bucket {
    int last_stage = 0;
    std::vector<Piece> pieces;
    int64_t numel = 0, shard = 0, state_offset = 0;
    std::vector<float> send, gathered, mine;
    std::unique_ptr<Work> work;
    bool complete = false;
  };
  // Calls f(piece, first, count, shard_index) for the elements of each piece in this
  // rank's part of bucket b: parameter elements [first, first + count), shard position.
  template <class F>
  void for_my_part(const Bucket& b, F&& f) const;
  void poll();

  ParameterStore<float>& params_;
  Communicator& group_;
  OptimizerConfig config_;
  CommStats& stats_;
  std::vector<Bucket> buckets_;
  std::vector<float> grad_, m_, v_;  // this rank's shard of every bucket, back to back
  int64_t steps_ = 0;
  bool armed_ = false;
  bool issued_ = false;
  CommClock::time_point first_issue_, last_complete_;
};

}  // namespace moe::dist
