// Each phase's mean SM clock, read on the GPU: at every phase-clock mark (core/cuda/
// phase_clock.h) a small kernel stamps each multiprocessor's cycle counter and the global
// timer, and the cycles and nanoseconds between two consecutive stamps of one SM are
// summed for the phase that interval belongs to. Under the board's power limit the clock
// follows the work (GEMMs at the limit, memory-bound passes below it), which the sampled
// mean over a whole step (obs/cuda/board_sampler.h) cannot show. docs/PROFILING.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/gpu.h"

namespace moe::gpu {

class SmClocks {
 public:
  explicit SmClocks(int n_phases);

  // Stamps the SMs; the interval since an SM's stamp of the previous call is charged to
  // `phase_before` (< 0: to none).
  void stamp(int phase_before, cudaStream_t stream);
  // The mean SM clock in MHz per phase over the intervals charged since the last call (0
  // where none), and the sums zeroed: read after the work on `stream` (where the last
  // stamp was), waiting for it.
  std::vector<double> take_mhz(cudaStream_t stream);

 private:
  int n_phases_;
  int blocks_;                              // one a multiprocessor
  uint64_t marks_ = 0;                      // the stamps so far: the next one's number less 1
  DeviceArray<unsigned long long> state_;  // per SM: last mark, cycles, ns; per phase: cycles, ns
};

}  // namespace moe::gpu
