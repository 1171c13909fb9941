// ZeRO-3 on the CPU path: between uses a rank keeps only its pieces of the parameters the
// ZeRO plan shards (and the replicated ranges, whole). Each backward stage's buckets are
// all-gathered in place just before the forward or the backward reads them, and the other
// ranks' pieces are given back to the OS after (ParameterStore::release_values); the next
// stage's gather is in flight meanwhile (non-blocking collectives: MPI, tcp's
// communication thread). The values gathered are those level 1 gathers after its step, so
// the losses are level 1's bit for bit (for the same gradients).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/comm_stats.h"
#include "dist/communicator.h"
#include "dist/zero_shards.h"
#include "model/parameters.h"

namespace moe::dist {

class ZeroParameterGather {
 public:
  // plan: the ZeroOptimizer's (level 3). reads[s]: the stages whose parameter values stage
  // s reads (s itself; with a tied head stage 0 also the embedding's). The forward runs
  // the stages from the last to 0, the backward from 0 to the last (Transformer).
  // Releases the other ranks' pieces now.
  ZeroParameterGather(ParameterStore<float>& params, const ZeroShardPlan& plan, Communicator& group,
                      CommStats& stats, std::vector<std::vector<int>> reads);
  ~ZeroParameterGather();

  // Transformer::on_parameters_needed / on_parameters_done.
  void needed(int stage, bool backward);
  void done(int stage, bool backward);
  // After a step or a restore only the own pieces are current: the rest goes.
  void release_all();
  // Every parameter current (the end of a run, host copies); collective.
  void gather_all();
  // Elements of the sharded buckets this rank holds gathered now, beyond its own pieces.
  int64_t gathered_elements() const;

 private:
  enum class State { Released, InFlight, Present };
  void issue(int stage);
  void wait(int stage);
  void release(int stage);
  // Whether a stage still to run in this pass after `stage` (or the backward's first,
  // at the end of the forward) reads `read`.
  bool read_later(int stage, bool backward, int read) const;

  ParameterStore<float>& params_;
  const ZeroShardPlan& plan_;
  Communicator& group_;
  CommStats& stats_;
  std::vector<std::vector<int>> reads_;
  std::vector<RangeList> others_;  // per stage: the other ranks' pieces
  std::vector<State> state_;
  std::vector<std::vector<std::unique_ptr<Work>>> gathers_;  // per stage, while in flight
};

}  // namespace moe::dist
