// parallel.a2a_compression's per-MoE-layer state: which layers' expert exchanges send
// fp8 rows (core/fp8.h). none / fp8: fixed. auto: fed once per step with numbers that are
// the same on every rank (the trainer reduces them first), so every rank switches the
// same layers at the same step:
// - the step's communication wait fraction (the max over the ranks): after kPatience
//   steps in a row above `threshold` (metrics.alert_comm_wait), the uncompressed layer
//   whose exchange waited longest this step is switched to fp8; after kPatience steps in a
//   row below threshold / 2 (hysteresis: compression roughly halves the wait, which must
//   not switch it straight back), the compressed layer that waited least goes back to
//   uncompressed. One layer per switch, the step counters restart after each.
// docs/EXPERT_PARALLEL.md section 10.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/parallel_config.h"

namespace moe::dist {

class A2aCompressionSwitch {
 public:
  static constexpr int kPatience = 3;
  A2aCompressionSwitch(A2aCompression mode, int layers, double threshold);
  // One step's numbers: the comm wait fraction and each layer's exchange wait (seconds).
  // Returns whether a layer switched.
  bool update(double wait_fraction, const std::vector<double>& layer_wait_s);
  // auto, once per step on every rank: this rank's numbers made the max over the ranks by
  // `max_over_ranks` (in place: the wait fraction, then the layers' waits), then update();
  // a switch is logged when `log` (rank 0). Returns whether a layer switched.
  bool observe(double wait_fraction, const std::vector<double>& layer_wait_s,
               const std::function<void(std::vector<double>&)>& max_over_ranks, bool log);
  A2aCompression mode() const { return mode_; }
  bool fp8(int layer) const { return fp8_[static_cast<size_t>(layer)] != 0; }
  int layers() const { return static_cast<int>(fp8_.size()); }
  int compressed_layers() const;
  // The state for checkpoints (JSON: the layers' flags and the two counters); restore
  // ignores a state of another layer count or mode (a warning is the caller's).
  std::string save() const;
  bool restore(const std::string& state);

 private:
  A2aCompression mode_;
  double threshold_;
  std::vector<char> fp8_;
  int above_ = 0, below_ = 0;
};

}  // namespace moe::dist
