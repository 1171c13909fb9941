// Watches each step's loss for faults: non-finite steps in a row (the trainer reloads the
// last checkpoint after training.nan_max_skips of them) and loss spikes (a step's loss
// above training.loss_spike_factor times the mean of the last kSpikeWindow finite losses,
// logged as a warning). The spike window is not checkpointed: it only steers warnings.
#pragma once
#include <cstdint>
#include <deque>
#include <iosfwd>

#include "config/training_config.h"

namespace moe {

class FaultMonitor {
 public:
  static constexpr int64_t kSpikeWindow = 20;
  static constexpr int64_t kSpikeMinSamples = 5;  // no spike verdicts before this many losses

  explicit FaultMonitor(const TrainingConfig& config) : config_(config) {}
  // Records one step; returns true when the last nan_max_skips steps were all skipped
  // (time to reload). Writes a warning line for a loss spike.
  bool observe(int64_t step, double loss, bool skipped, std::ostream& out);
  int64_t skip_streak() const { return streak_; }
  // After a reload: the streak and the loss history start over.
  void reset();

 private:
  TrainingConfig config_;
  int64_t streak_ = 0;
  std::deque<double> recent_;
  double recent_sum_ = 0;
};

}  // namespace moe
