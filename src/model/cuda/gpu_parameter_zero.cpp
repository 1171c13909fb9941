#include "model/cuda/gpu_parameter_zero.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "core/error.h"
#include "core/cuda/resident_block.h"
#include "core/gpu.h"
#include "kernels/adamw_math.h"
#include "model/cuda/gpu_parameters_state.h"
#include "model/gpu_state_layout.h"

namespace moe {

void share_gradients(GpuParameterStore& store, const RangeList& kept, const std::vector<RangeList>& stage_ranges) {
  auto& s = GpuParameterStoreAccess::state(store);
  MOE_CHECK(s.grads_held.empty(), "GPU parameters: the gradients are shared already");
  MOE_CHECK(s.bf16_grads.empty(), "GPU parameters: ZeRO-2 gradient sharing does not support bf16 expert gradients");
  s.grads_held = s.share_stages(s.grads, 4, kept, stage_ranges, /*zero_new=*/true);
}

void share_weights(GpuParameterStore& store, const RangeList& kept, const std::vector<RangeList>& stage_ranges) {
  auto& s = GpuParameterStoreAccess::state(store);
  MOE_CHECK(s.weights_held.empty(), "GPU parameters: the weights are shared already");
  MOE_CHECK(s.packed(), "GPU parameters: sharing the weights needs the optimizer state packed first");
  // Interleaved gate|up: the own pieces' hi halves where interleave_hi put them (a pair lies
  // in one stage and keeps its extent, so the stages' ranges are the same sets).
  s.weights_held = s.share_stages(s.hi, 2, hi_ranges(s.interleaved, kept), stage_ranges, /*zero_new=*/false);
  ++s.weights_version;
}

void pack_optimizer_state(GpuParameterStore& store, const RangeList& ranges) {
  auto& s = GpuParameterStoreAccess::state(store);
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
      gpu::DeviceArray<uint8_t> packed = s.zeroed_scales(total, s.stream);
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

const RangeList& optimizer_ranges(const GpuParameterStore& store) {
  return GpuParameterStoreAccess::state(store).moment_ranges();
}

StepState step_state(GpuParameterStore& store) {
  auto& s = GpuParameterStoreAccess::state(store);
  if (!s.packed()) return {s.lo_data(), s.m.data(), s.v.data(), s.m_scales.data(), s.v_scales.data(), false};
  MOE_CHECK(s.lo_held.empty(), "GPU parameters: no AdamW step while hold_master holds the lo block");
  return {static_cast<int16_t*>(s.lo_packed.data()), s.m_packed.data(), s.v_packed.data(), s.m_scales.data(),
          s.v_scales.data(), true};
}

int64_t state_offset(const GpuParameterStore& store, int64_t offset) {
  return GpuParameterStoreAccess::state(store).state_offset(offset);
}

void hold_master(GpuParameterStore& store, const RangeList& ranges) {
  auto& s = GpuParameterStoreAccess::state(store);
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

}  // namespace moe
