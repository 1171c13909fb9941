// GPU time of tagged spans of a stream's work, from pairs of CUDA events recorded around
// them (a pool reused between takes): the per-MoE-layer exchange times that
// parallel.a2a_compression = auto weighs, and the dispatch waits of the metrics.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace moe::gpu {

class SpanTimer {
 public:
  SpanTimer() = default;
  ~SpanTimer();
  SpanTimer(const SpanTimer&) = delete;
  SpanTimer& operator=(const SpanTimer&) = delete;

  // A span tagged `key` begins on `stream` now (after the work enqueued so far); returns
  // its index for end().
  size_t begin(int key, cudaStream_t stream);
  // Span `index` ends on `stream` now.
  void end(size_t index, cudaStream_t stream);
  // Seconds per key in [0, keys) summed over the spans since the last take (waits for
  // them; other keys are dropped), then forgets them.
  std::vector<double> take_seconds(int keys);

 private:
  struct Span {
    cudaEvent_t start = nullptr, stop = nullptr;
    int key = -1;
  };
  std::vector<Span> spans_;  // the first used_ are since the last take
  size_t used_ = 0;
};

}  // namespace moe::gpu
