#include "model/cuda/gpu_parameters.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "core/cuda/resident_block.h"
#include "core/gpu.h"
#include "kernels/adamw_math.h"
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
  s.mirror_offsets.assign(static_cast<size_t>(params.size()), -1);
  int64_t mirror_numel = 0;
  for (int id : fp32_copy_ids) {
    MOE_CHECK(id >= 0 && id < params.size(), "GPU parameters: no parameter {} to keep in fp32", id);
    if (s.mirror_offsets[static_cast<size_t>(id)] >= 0) continue;
    s.mirror_offsets[static_cast<size_t>(id)] = mirror_numel;
    mirror_numel += (params.numel(id) + 15) / 16 * 16;
  }
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
  s.mirror = Buffer<float>(static_cast<size_t>(mirror_numel));
  Buffer<float> staging = s.staging();
  for (const Range& r : s.resident) s.upload_values(params.values_data() + r.offset, r.offset, r.count, staging);
  s.refresh_mirrors(params);
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

const float* GpuParameterStore::fp32_values(int id) const {
  const State& s = *state_;
  MOE_CHECK(id >= 0 && static_cast<size_t>(id) < s.mirror_offsets.size() && s.mirror_offsets[static_cast<size_t>(id)] >= 0,
            "GPU parameters: parameter {} has no fp32 copy on the device", id);
  return s.mirror.data() + s.mirror_offsets[static_cast<size_t>(id)];
}

float* GpuParameterStore::fp32_mirror() { return state_->mirror.data(); }

int64_t GpuParameterStore::fp32_mirror_offset(int id) const {
  MOE_CHECK(id >= 0 && static_cast<size_t>(id) < state_->mirror_offsets.size(), "GPU parameters: no parameter {}", id);
  return state_->mirror_offsets[static_cast<size_t>(id)];
}

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

void GpuParameterStore::share_gradients(const RangeList& kept, const std::vector<RangeList>& stage_ranges) {
  State& s = *state_;
  MOE_CHECK(s.grads_held.empty(), "GPU parameters: the gradients are shared already");
  MOE_CHECK(s.bf16_grads.empty(), "GPU parameters: ZeRO-2 gradient sharing does not support bf16 expert gradients");
  s.grads_held = s.share_stages(s.grads, 4, kept, stage_ranges, /*zero_new=*/true);
}

void GpuParameterStore::share_weights(const RangeList& kept, const std::vector<RangeList>& stage_ranges) {
  State& s = *state_;
  MOE_CHECK(s.weights_held.empty(), "GPU parameters: the weights are shared already");
  MOE_CHECK(s.packed(), "GPU parameters: sharing the weights needs the optimizer state packed first");
  MOE_CHECK(s.interleaved.empty(),
            "GPU parameters: ZeRO-3 shares the hi halves by the parameters' ranges: not with gate|up interleaved");
  s.weights_held = s.share_stages(s.hi, 2, kept, stage_ranges, /*zero_new=*/false);
  ++s.weights_version;
}

const RangeList& GpuParameterStore::resident_ranges() const { return state_->resident; }

void GpuParameterStore::set_resident_ranges(const RangeList& ranges) {
  State& s = *state_;
  s.sync();
  s.set_resident(ranges);
  ++s.weights_version;  // new ranges hold undefined weights until written
}

RangeList GpuParameterStore::fp32_copy_ranges() const {
  const State& s = *state_;
  RangeList ranges;
  for (size_t id = 0; id < s.mirror_offsets.size(); ++id)
    if (s.mirror_offsets[id] >= 0) ranges.push_back({s.offsets[id], (s.numels[id] + 15) / 16 * 16});
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

void GpuParameterStore::pack_optimizer_state(const RangeList& ranges) {
  State& s = *state_;
  MOE_CHECK(!s.packed(), "GPU parameters: the optimizer state is packed already");
  const RangeList merged = merge_ranges(ranges);
  if (merged.empty()) return;
  const RangeList outside = subtract_ranges(merged, s.resident);
  MOE_CHECK(outside.empty(), "GPU parameters: optimizer range [{}, {}) is not resident", outside.front().offset,
            outside.front().end());
  PackedState layout = packed_state_layout(merged);  // model/gpu_state_layout.h
  std::vector<int64_t>& at = layout.at;
  const int64_t total = layout.total;
  const size_t mb = s.moment_bytes();
  // The packed blocks are mapped range by range, and every kPackBatch elements the source
  // chunks no later range needs are released: the copy never holds both whole (an EP rank
  // whose experts are its own would otherwise need twice their optimizer state at once).
  constexpr int64_t kPackBatch = int64_t{1} << 27;
  const auto mbytes = static_cast<int64_t>(mb);
  s.lo_packed = gpu::ResidentBlock(static_cast<size_t>(total) * sizeof(int16_t));
  s.m_packed = gpu::ResidentBlock(static_cast<size_t>(total) * mb);
  s.v_packed = gpu::ResidentBlock(static_cast<size_t>(total) * mb);
  const auto release_packed = [&](size_t next) {
    s.sync();  // the copies out of the chunks released here are done
    const RangeList rest(merged.begin() + static_cast<std::ptrdiff_t>(next), merged.end());
    s.lo.set_resident(byte_ranges(rest, sizeof(int16_t)));
    s.m.set_resident(byte_ranges(rest, mbytes));
    s.v.set_resident(byte_ranges(rest, mbytes));
  };
  for (size_t i = 0, next = 0; i < merged.size(); i = next) {
    int64_t batch = 0;  // ranges [i, next): at least one, at most kPackBatch elements unless one is more
    while (next < merged.size() && (next == i || batch + merged[next].count <= kPackBatch)) batch += merged[next++].count;
    const int64_t end = at[next - 1] + merged[next - 1].count;
    s.lo_packed.set_resident({{0, end * static_cast<int64_t>(sizeof(int16_t))}});
    s.m_packed.set_resident({{0, end * mbytes}});
    s.v_packed.set_resident({{0, end * mbytes}});
    for (size_t k = i; k < next; ++k) {
      const Range& r = merged[k];
      const auto n = static_cast<size_t>(r.count);
      MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<int16_t*>(s.lo_packed.data()) + at[k], s.lo_data() + r.offset,
                                     n * sizeof(int16_t), cudaMemcpyDeviceToDevice, s.stream));
      MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(s.m_packed.data()) + at[k] * mbytes,
                                     static_cast<const char*>(s.m.data()) + r.offset * mbytes, n * mb,
                                     cudaMemcpyDeviceToDevice, s.stream));
      MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(s.v_packed.data()) + at[k] * mbytes,
                                     static_cast<const char*>(s.v.data()) + r.offset * mbytes, n * mb,
                                     cudaMemcpyDeviceToDevice, s.stream));
    }
    if (next < merged.size()) release_packed(next);
  }
  for (gpu::ResidentBlock* block : {&s.lo_packed, &s.m_packed, &s.v_packed})
    block->set_resident({{0, static_cast<int64_t>(block->bytes())}});  // the layout's padding at the end
  if (s.fp8_moments()) {  // the blocks' scales: range k's first block starts at at[k] / 16 (at[k] = its offset mod 16)
    constexpr int64_t kB = adamw_math::kMomentBlock;
    for (int which = 0; which < 2; ++which) {
      Buffer<uint8_t> packed = State::zeroed_scales(total, s.stream);
      const uint8_t* from = s.moment_scales(which);
      for (size_t k = 0; k < merged.size(); ++k) {
        const Range& r = merged[k];
        MOE_CHECK(r.offset % kB == 0, "GPU parameters: fp8 moments: optimizer range [{}, {}) starts inside a block of {}",
                  r.offset, r.end(), kB);
        const int64_t first = r.offset / kB, blocks = (r.end() + kB - 1) / kB - first;
        MOE_CUDA_CHECK(cudaMemcpyAsync(packed.data() + at[k] / kB, from + first, static_cast<size_t>(blocks),
                                       cudaMemcpyDeviceToDevice, s.stream));
      }
      s.sync();
      (which == 0 ? s.m_scales : s.v_scales) = std::move(packed);
    }
  }
  s.sync();
  s.optimizer = merged;
  s.packed_at = std::move(at);
  s.lo.set_resident({});
  s.m.set_resident({});
  s.v.set_resident({});
}

const RangeList& GpuParameterStore::optimizer_ranges() const { return state_->moment_ranges(); }

GpuParameterStore::StepState GpuParameterStore::step_state() {
  State& s = *state_;
  if (!s.packed()) return {s.lo_data(), s.m.data(), s.v.data(), s.m_scales.data(), s.v_scales.data(), false};
  MOE_CHECK(s.lo_held.empty(), "GPU parameters: no AdamW step while hold_master holds the lo block");
  return {static_cast<int16_t*>(s.lo_packed.data()), s.m_packed.data(), s.v_packed.data(), s.m_scales.data(),
          s.v_scales.data(), true};
}

int64_t GpuParameterStore::state_offset(int64_t offset) const { return state_->state_offset(offset); }

void GpuParameterStore::hold_master(const RangeList& ranges) {
  State& s = *state_;
  MOE_CHECK(s.packed(), "GPU parameters: hold_master without packed optimizer state");
  const RangeList held = merge_ranges(ranges);
  const RangeList outside = subtract_ranges(held, s.resident);
  MOE_CHECK(outside.empty(), "GPU parameters: elements [{}, {}) to hold the master of are not resident",
            outside.front().offset, outside.front().end());
  s.sync();
  s.lo.set_resident(byte_ranges(held, sizeof(int16_t)));
  s.lo_held = held;
  // The own pieces' lo halves inside `held`, from the packed ones.
  for (size_t i = 0; i < s.optimizer.size(); ++i)
    for (const Range& part : intersect_ranges({s.optimizer[i]}, held))
      MOE_CUDA_CHECK(cudaMemcpyAsync(s.lo_data() + part.offset,
                                     static_cast<int16_t*>(s.lo_packed.data()) + s.packed_at[i] +
                                         (part.offset - s.optimizer[i].offset),
                                     static_cast<size_t>(part.count) * sizeof(int16_t), cudaMemcpyDeviceToDevice,
                                     s.stream));
  s.sync();
}

double GpuParameterStore::bytes_per_parameter(MomentDtype moments, bool bf16_grads) {
  return static_cast<double>(sizeof(bf16) + sizeof(int16_t) + (bf16_grads ? sizeof(bf16) : sizeof(float))) +
         2 * moment_bytes_per_element(moments);
}

size_t GpuParameterStore::device_bytes() const {
  const State& s = *state_;
  return s.hi.resident_bytes() + s.lo.resident_bytes() + s.grads.resident_bytes() + s.grads16.resident_bytes() +
         s.m.resident_bytes() +
         s.v.resident_bytes() + s.mirror.size() * sizeof(float) + s.lo_packed.resident_bytes() +
         s.m_packed.resident_bytes() + s.v_packed.resident_bytes() + s.m_scales.size() + s.v_scales.size();
}

}  // namespace moe
