#include "core/cuda/span_timer.h"

#include <algorithm>

#include "core/gpu.h"

namespace moe::gpu {

SpanTimer::~SpanTimer() {
  for (Span& s : spans_) {
    cudaEventDestroy(s.start);
    cudaEventDestroy(s.stop);
  }
}

size_t SpanTimer::begin(int key, cudaStream_t stream) {
  if (used_ == spans_.size()) {
    Span s;
    MOE_CUDA_CHECK(cudaEventCreate(&s.start));
    MOE_CUDA_CHECK(cudaEventCreate(&s.stop));
    spans_.push_back(s);
  }
  Span& s = spans_[used_];
  s.key = key;
  MOE_CUDA_CHECK(cudaEventRecord(s.start, stream));
  return used_++;
}

void SpanTimer::end(size_t index, cudaStream_t stream) { MOE_CUDA_CHECK(cudaEventRecord(spans_[index].stop, stream)); }

std::vector<double> SpanTimer::take_seconds(int keys) {
  std::vector<double> seconds(static_cast<size_t>(std::max(keys, 0)), 0.0);
  for (size_t i = 0; i < used_; ++i) {
    const Span& s = spans_[i];
    MOE_CUDA_CHECK(cudaEventSynchronize(s.stop));
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.stop));
    if (s.key >= 0 && s.key < keys) seconds[static_cast<size_t>(s.key)] += static_cast<double>(ms) * 1e-3;
  }
  used_ = 0;
  return seconds;
}

}  // namespace moe::gpu
