#include "model/cuda/gpu_fp32_copies.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

GpuFp32Copies::GpuFp32Copies(const ParameterStore<float>& params, const std::vector<int>& ids, cudaStream_t stream)
    : at_(static_cast<size_t>(params.size()), -1), numel_(static_cast<size_t>(params.size()), 0) {
  int64_t total = 0;
  for (int id : ids) {
    MOE_CHECK(id >= 0 && id < params.size(), "GPU parameters: no parameter {} to keep in fp32", id);
    if (at_[static_cast<size_t>(id)] >= 0) continue;
    at_[static_cast<size_t>(id)] = total;
    numel_[static_cast<size_t>(id)] = params.numel(id);
    const int64_t padded = (params.numel(id) + 15) / 16 * 16;
    ranges_.push_back({params.offset(id), padded});
    total += padded;
  }
  std::sort(ranges_.begin(), ranges_.end());
  block_ = gpu::DeviceArray<float>(static_cast<size_t>(total));
  upload(params, stream);
}

const float* GpuFp32Copies::values(int id) const {
  MOE_CHECK(id >= 0 && static_cast<size_t>(id) < at_.size() && at_[static_cast<size_t>(id)] >= 0,
            "GPU parameters: parameter {} has no fp32 copy on the device", id);
  return block_.data() + at_[static_cast<size_t>(id)];
}

int64_t GpuFp32Copies::offset(int id) const {
  MOE_CHECK(id >= 0 && static_cast<size_t>(id) < at_.size(), "GPU parameters: no parameter {}", id);
  return at_[static_cast<size_t>(id)];
}

void GpuFp32Copies::upload(const ParameterStore<float>& params, cudaStream_t stream) {
  for (size_t id = 0; id < at_.size(); ++id)
    if (at_[id] >= 0) upload(static_cast<int>(id), 0, params.value(static_cast<int>(id)), numel_[id], stream);
}

void GpuFp32Copies::upload(int id, int64_t from, const float* values, int64_t count, cudaStream_t stream) {
  const int64_t at = offset(id);
  if (at < 0) return;
  MOE_CHECK(from >= 0 && count >= 0 && from + count <= numel_[static_cast<size_t>(id)],
            "GPU parameters: elements [{}, {}) of a parameter of {} to copy in fp32", from, from + count,
            numel_[static_cast<size_t>(id)]);
  MOE_CUDA_CHECK(cudaMemcpyAsync(block_.data() + at + from, values, static_cast<size_t>(count) * sizeof(float),
                                 cudaMemcpyHostToDevice, stream));
}

}  // namespace moe
