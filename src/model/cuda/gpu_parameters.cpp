#include "model/cuda/gpu_parameters.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "core/cuda/resident_block.h"
#include "core/gpu.h"
#include "model/cuda/gpu_parameters_state.h"
#include "model/gpu_state_layout.h"

namespace moe {
namespace {

template <typename T>
using Buffer = gpu::DeviceArray<T>;

}  // namespace

GpuParameterStore::GpuParameterStore(const ParameterStore<float>& params, MomentDtype moments,
                                     const std::vector<int>& fp32_copy_ids, cuda::Stream stream,
                                     const RangeList& resident, bool bf16_expert_grads)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.stream = stream;
  s.moments = moments;
  s.storage = params.storage_numel();
  for (int id = 0; id < params.size(); ++id) {
    const int64_t offset = params.offset(id), numel = params.numel(id);
    // The AdamW kernel reads 4 elements at a time (16-byte gradient loads).
    MOE_CHECK(offset % 4 == 0, "GPU parameters: '{}' starts at element {}, not a multiple of 4",
              params.spec(id).name, offset);
    s.offsets.push_back(offset);
    s.numels.push_back(numel);
    s.packed_offsets.push_back(s.total_numel);
    s.total_numel += numel;
  }
  MOE_CHECK(params.size() > 0, "GPU parameters: the store has no parameters");
  const auto n = static_cast<size_t>(s.storage);
  s.hi = gpu::ResidentBlock(n * sizeof(bf16));
  s.lo = gpu::ResidentBlock(n * sizeof(int16_t));
  s.grads = gpu::ResidentBlock(n * sizeof(float));
  if (bf16_expert_grads) {
    for (int id = 0; id < params.size(); ++id)
      if (!params.spec(id).expert_group.empty()) s.bf16_grads.push_back({params.offset(id), params.numel(id)});
    s.bf16_grads = merge_ranges(s.bf16_grads);
    if (!s.bf16_grads.empty()) s.grads16 = gpu::ResidentBlock(n * sizeof(bf16));
  }
  s.m = gpu::ResidentBlock(n * s.moment_bytes());
  s.v = gpu::ResidentBlock(n * s.moment_bytes());
  if (s.fp8_moments()) {
    s.m_scales = State::zeroed_scales(s.storage, stream);
    s.v_scales = State::zeroed_scales(s.storage, stream);
  }
  for (const Range& r : resident)
    MOE_CHECK(r.offset >= 0 && r.end() <= s.storage, "GPU parameters: resident range [{}, {}) outside the block of {}",
              r.offset, r.end(), s.storage);
  s.set_resident(resident.empty() ? RangeList{{0, s.storage}} : resident);
  s.fp32 = GpuFp32Copies(params, fp32_copy_ids, stream);
  Buffer<float> staging = s.staging();
  for (const Range& r : s.resident) s.upload_values(params.values_data() + r.offset, r.offset, r.count, staging);
  s.sync();
}

GpuParameterStore::~GpuParameterStore() = default;

const bf16* GpuParameterStore::weights() const { return state_->hi_data(); }
float* GpuParameterStore::grads() { return state_->grads_data(); }
bf16* GpuParameterStore::grads_bf16() { return state_->bf16_grads.empty() ? nullptr : state_->grads16_data(); }
const RangeList& GpuParameterStore::bf16_grad_ranges() const { return state_->bf16_grads; }
bf16* GpuParameterStore::weights_hi() {
  ++state_->weights_version;  // the caller may write them
  return state_->hi_data();
}
uint64_t GpuParameterStore::weights_version() const { return state_->weights_version; }

void GpuParameterStore::interleave_hi(std::vector<HiInterleave> pairs) {
  State& s = *state_;
  MOE_CHECK(s.interleaved.empty(), "GPU parameters: gate|up is interleaved already");
  const RangeList whole{{0, s.storage}};
  MOE_CHECK(!s.packed() && s.resident == whole,
            "GPU parameters: gate|up interleaved needs every element resident and the optimizer state unpacked");
  std::sort(pairs.begin(), pairs.end(), [](const HiInterleave& a, const HiInterleave& b) { return a.first < b.first; });
  int64_t largest = 0;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const HiInterleave& p = pairs[i];
    MOE_CHECK(p.experts > 0 && p.per_expert > 0 && p.first >= 0 && p.end() <= s.storage &&
                  (i == 0 || pairs[i - 1].end() <= p.first),
              "GPU parameters: interleaved gate|up pair [{}, {}) is empty, outside the block or overlaps another",
              p.first, p.end());
    largest = std::max(largest, p.per_expert);
  }
  // [w1_0 .. w1_E-1, w3_0 .. w3_E-1] -> [w1_0, w3_0, w1_1, w3_1, ...]: a permutation of the
  // 2E expert slices, walked cycle by cycle through one slice of staging (not a copy of the pair).
  Buffer<bf16> staging(static_cast<size_t>(largest));
  for (const HiInterleave& p : pairs) {
    const int64_t slices = 2 * p.experts;
    const auto bytes = static_cast<size_t>(p.per_expert) * sizeof(bf16);
    const auto slice = [&](int64_t k) { return s.hi_data() + p.first + k * p.per_expert; };
    const auto from = [&](int64_t k) { return k % 2 * p.experts + k / 2; };  // the slice that moves to k
    const auto copy = [&](bf16* to, const bf16* in) {
      MOE_CUDA_CHECK(cudaMemcpyAsync(to, in, bytes, cudaMemcpyDeviceToDevice, s.stream));
    };
    std::vector<char> placed(static_cast<size_t>(slices), 0);
    for (int64_t start = 0; start < slices; ++start) {
      if (placed[static_cast<size_t>(start)] || from(start) == start) continue;  // w1_0 and w3_E-1 stay
      copy(staging.data(), slice(start));
      for (int64_t k = start;;) {
        placed[static_cast<size_t>(k)] = 1;
        const int64_t in = from(k);
        if (in == start) {
          copy(slice(k), staging.data());
          break;
        }
        copy(slice(k), slice(in));
        k = in;
      }
    }
  }
  s.sync();  // before the staging goes
  s.interleaved = std::move(pairs);
  ++s.weights_version;
}
const std::vector<HiInterleave>& GpuParameterStore::hi_interleave() const { return state_->interleaved; }
int64_t GpuParameterStore::hi_offset(int64_t offset) const {
  for (const HiInterleave& p : state_->interleaved)
    if (offset >= p.first && offset < p.end()) return p.hi_offset(offset);
  return offset;
}
int16_t* GpuParameterStore::weights_lo() {
  MOE_CHECK(!state_->packed() || !state_->lo_held.empty(),
            "GPU parameters: the lo halves are packed (ZeRO), not in the block layout");
  return state_->lo_data();
}
MomentDtype GpuParameterStore::moment_dtype() const { return state_->moments; }
void* GpuParameterStore::moment_block(int which) {
  MOE_CHECK(which == 0 || which == 1, "moment_block: moment {} (0 or 1)", which);
  MOE_CHECK(!state_->packed(), "GPU parameters: the AdamW moments are packed (ZeRO), not in the block layout");
  MOE_CHECK(!state_->fp8_moments(), "GPU parameters: fp8 moments are not bytes per element (their scales are per 16)");
  return which == 0 ? state_->m.data() : state_->v.data();
}
size_t GpuParameterStore::moment_bytes() const { return state_->moment_bytes(); }
int64_t GpuParameterStore::storage_numel() const { return state_->storage; }

const GpuFp32Copies& GpuParameterStore::fp32_copies() const { return state_->fp32; }
GpuFp32Copies& GpuParameterStore::fp32_copies() { return state_->fp32; }

void GpuParameterStore::zero_grads(const RangeList& written) {
  State& s = *state_;
  const auto zero = [&](const gpu::ResidentBlock& block, int64_t elem) {
    // The resident chunks (shared ones included) but the written elements' bytes.
    for (const Range& r : subtract_ranges(block.resident_ranges(), byte_ranges(written, elem)))
      MOE_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(block.data()) + r.offset, 0, static_cast<size_t>(r.count),
                                     s.stream));
  };
  zero(s.grads, sizeof(float));
  if (!s.bf16_grads.empty()) zero(s.grads16, sizeof(bf16));
}

const RangeList& GpuParameterStore::resident_ranges() const { return state_->resident; }

void GpuParameterStore::set_resident_ranges(const RangeList& ranges) {
  State& s = *state_;
  s.sync();
  s.set_resident(ranges);
  ++s.weights_version;  // new ranges hold undefined weights until written
}

double GpuParameterStore::bytes_per_parameter(MomentDtype moments, bool bf16_grads) {
  return static_cast<double>(sizeof(bf16) + sizeof(int16_t) + (bf16_grads ? sizeof(bf16) : sizeof(float))) +
         2 * moment_bytes_per_element(moments);
}

size_t GpuParameterStore::device_bytes() const {
  const State& s = *state_;
  return s.hi.resident_bytes() + s.lo.resident_bytes() + s.grads.resident_bytes() + s.grads16.resident_bytes() +
         s.m.resident_bytes() +
         s.v.resident_bytes() + s.fp32.bytes() + s.lo_packed.resident_bytes() +
         s.m_packed.resident_bytes() + s.v_packed.resident_bytes() + s.m_scales.size() + s.v_scales.size();
}

}  // namespace moe
