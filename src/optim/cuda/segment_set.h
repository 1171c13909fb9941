// Optimizer segments on the device (offset, numel, first_chunk of the norm's chunks), with
// buffers for the norm's per-chunk and per-segment partial sums: the optimizer's
// parameter segments and the per-expert clipping's slices, whole or cut to the ranges one
// ZeRO-1 rank covers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/gpu.h"
#include "kernels/adamw_math.h"
#include "kernels/gpu_ops.h"
#include "optim/gpu_ops.h"

namespace moe {

struct SegmentSet {
  std::vector<cuda::OptimizerSegment> host;
  gpu::DeviceArray<cuda::OptimizerSegment> segments;
  int64_t n_chunks = 0;
  gpu::DeviceArray<double> chunk_sq, segment_sq;
  bool fp8_blocks_checked = false;  // GpuOptimizer: every segment's state starts on an fp8 moment block

  SegmentSet() = default;
  // first_chunk is numbered here, in order.
  explicit SegmentSet(std::vector<cuda::OptimizerSegment> segs) : host(std::move(segs)) {
    for (cuda::OptimizerSegment& seg : host) {
      seg.first_chunk = n_chunks;
      n_chunks += (seg.numel + adamw_math::kNormChunk - 1) / adamw_math::kNormChunk;
    }
    segments = gpu::DeviceArray<cuda::OptimizerSegment>(std::max<size_t>(1, host.size()));
    if (!host.empty()) segments.upload(host.data(), host.size());
    chunk_sq = gpu::DeviceArray<double>(static_cast<size_t>(std::max<int64_t>(1, n_chunks)));
    segment_sq = gpu::DeviceArray<double>(std::max<size_t>(1, host.size()));
  }
  size_t bytes() const {
    return segments.size() * sizeof(cuda::OptimizerSegment) + (chunk_sq.size() + segment_sq.size()) * sizeof(double);
  }
};

}  // namespace moe
