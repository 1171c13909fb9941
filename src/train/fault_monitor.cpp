#include "train/fault_monitor.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <ostream>

namespace moe {

bool FaultMonitor::observe(int64_t step, double loss, bool skipped, std::ostream& out) {
  if (skipped) {
    ++streak_;
    return config_.nan_max_skips > 0 && streak_ >= config_.nan_max_skips;
  }
  streak_ = 0;
  const int64_t n = static_cast<int64_t>(recent_.size());
  if (config_.loss_spike_factor > 0 && n >= kSpikeMinSamples) {
    const double mean = recent_sum_ / static_cast<double>(n);
    if (loss > config_.loss_spike_factor * mean)
      fmt::print(out, "warning: step {} loss spike: {:.4f} is over {} x the running mean {:.4f}\n", step, loss,
                 config_.loss_spike_factor, mean);
  }
  recent_.push_back(loss);
  recent_sum_ += loss;
  if (static_cast<int64_t>(recent_.size()) > kSpikeWindow) {
    recent_sum_ -= recent_.front();
    recent_.pop_front();
  }
  return false;
}

void FaultMonitor::reset() {
  streak_ = 0;
  recent_.clear();
  recent_sum_ = 0;
}

}  // namespace moe
