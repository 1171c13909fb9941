// fp32 copies of the few parameters the GPU model reads in fp32 (the router biases:
// GpuTransformer's fp32 ids), kept beside GpuParameterStore's bf16 hi / int16 lo halves;
// the optimizer writes the values it steps into them too (multi_tensor_adamw's mirror).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/gpu.h"
#include "core/range.h"
#include "model/parameters.h"

namespace moe {

class GpuFp32Copies {
 public:
  GpuFp32Copies() = default;
  // Copies of the parameters `ids` of `params` (each padded to 16 floats, back to back),
  // their values uploaded on `stream` (not waited for).
  GpuFp32Copies(const ParameterStore<float>& params, const std::vector<int>& ids, cudaStream_t stream);

  // A kept parameter's values.
  const float* values(int id) const;
  // The copies back to back, and where parameter `id`'s starts in it (-1: not kept).
  float* block() { return block_.data(); }
  int64_t offset(int id) const;
  // The kept parameters' extents in the parameter block (padded to 16), sorted: a sharded
  // optimizer steps them whole on every rank.
  const RangeList& ranges() const { return ranges_; }
  size_t bytes() const { return block_.size() * sizeof(float); }

  // Every copy from `params` (upload_state), or the part of parameter `id` from its
  // element `from` on (upload_range: `count` host values); async on `stream`.
  void upload(const ParameterStore<float>& params, cudaStream_t stream);
  void upload(int id, int64_t from, const float* values, int64_t count, cudaStream_t stream);

 private:
  std::vector<int64_t> at_;     // per parameter id: where its copy starts in block_, -1: none
  std::vector<int64_t> numel_;  // per parameter id
  RangeList ranges_;
  gpu::DeviceArray<float> block_;
};

}  // namespace moe
