// Time per phase of GPU work, from CUDA events recorded on a stream at phase boundaries:
// each interval between two marks is charged to the phase the first mark began. Shared
// by the parts of a training step that enqueue work (model, optimizer), owned by whoever
// reports the times. Phases are small integers with names given at construction. Each
// mark also begins an NVTX range of the phase's name (always, enabled or not), so that
// an Nsight Systems timeline shows the same phases. With SM clocks on, each mark also
// stamps every SM's cycle counter (core/cuda/sm_clocks.h): each phase's mean SM clock.
#pragma once
#include <cuda_runtime.h>

#include "core/nvtx_range.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace moe::gpu {

class SmClocks;

class PhaseClock {
 public:
  explicit PhaseClock(std::vector<std::string> phase_names);
  ~PhaseClock();
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;

  // Off (the default), mark() records no events; CUDA graph capture turns it off meanwhile.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  // Also a stamp kernel (one block an SM) at each mark while enabled: a few microseconds of
  // GPU time a mark.
  void set_sm_clocks(bool on);
  // `phase` begins now on `stream` (the work enqueued after this call).
  void mark(int phase, cudaStream_t stream);
  // Milliseconds per phase since the last call, every phase named, in phase order (waits
  // for the last mark).
  std::vector<std::pair<std::string, double>> take();
  // With SM clocks on: each phase's mean SM clock in MHz since the last call, in phase
  // order (0 where none was measured); empty with them off. Synchronises the device.
  std::vector<double> take_sm_mhz();

 private:
  void collect();
  std::vector<std::string> names_;
  NvtxPhases nvtx_;
  bool enabled_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<int> phase_of_;
  size_t used_ = 0;
  std::vector<double> ms_;
  std::unique_ptr<SmClocks> sm_clocks_;
  int last_phase_ = -1;    // the phase the last mark began
};

}  // namespace moe::gpu
