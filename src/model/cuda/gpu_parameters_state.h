// GpuParameterStore's state (model/cuda/gpu_parameters.h): the device blocks and the
// helpers its sources use. Internal: included by gpu_parameters.cpp, gpu_parameter_io.cpp
// and gpu_parameter_zero.cpp only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "core/cuda/resident_block.h"
#include "core/gpu.h"
#include "kernels/adamw_math.h"
#include "model/cuda/gpu_parameters.h"
#include "model/gpu_state_layout.h"

namespace moe {

struct GpuParameterStore::State {
  template <typename T>
  using Buffer = gpu::DeviceArray<T>;
  // Host <-> device conversions (hi/lo split, bf16 moments) go through a device buffer of
  // this many floats, so they need no full-size fp32 copy on either side.
  static constexpr int64_t kStagingFloats = int64_t{1} << 22;

  cudaStream_t stream = nullptr;
  MomentDtype moments = MomentDtype::Fp32;
  int64_t storage = 0, total_numel = 0;
  std::vector<int64_t> offsets, numels, packed_offsets;  // per parameter id
  // The blocks, of which only the resident ranges hold memory (gpu::ResidentBlock).
  gpu::ResidentBlock hi, lo, grads, m, v;
  // bf16 expert gradients: grads16 holds the gradients of `bf16_grads` (the expert
  // tensors' extents), where grads then holds none.
  gpu::ResidentBlock grads16;
  RangeList bf16_grads;
  GpuFp32Copies fp32;   // the router biases' fp32 copies
  RangeList resident;   // element ranges of the block that hold memory (sorted)
  // ZeRO (pack_optimizer_state, model/cuda/gpu_parameter_zero.h): the lo halves and moments
  // of `optimizer` (merged ranges) only, range i's from packed_at[i] on (congruent to its
  // offset modulo 16, so the AdamW kernel's 16-byte accesses line up as in the block);
  // empty: in the blocks above.
  RangeList optimizer;
  std::vector<int64_t> packed_at;
  // Reserved whole, mapped as pack_optimizer_state fills them (its peak stays near the result).
  gpu::ResidentBlock lo_packed, m_packed, v_packed;
  // fp8 moments: the scale byte of each block of adamw_math::kMomentBlock state elements
  // (index state / 16), m's and v's, in the block layout or (packed) the packed one.
  Buffer<uint8_t> m_scales, v_scales;
  RangeList lo_held;  // hold_master: where the lo block is mapped, filled from the packed halves
  RangeList grads_held;   // share_gradients: the gradients with memory of their own (empty: resident)
  RangeList weights_held;  // share_weights: the hi halves with memory of their own (empty: resident)
  uint64_t weights_version = 1;  // weights_version(): bumped by every writer of hi
  std::vector<HiInterleave> interleaved;  // interleave_hi
  mutable Buffer<float> staging_buffer;     // download_range / upload_range
  mutable Buffer<int16_t> lo_scratch;       // lo halves of uploaded values no rank keeps here
  bool bf16_moments() const { return moments == MomentDtype::Bf16; }
  bool fp8_moments() const { return moments == MomentDtype::Fp8; }
  size_t moment_bytes() const { return fp8_moments() ? 1 : bf16_moments() ? sizeof(bf16) : sizeof(float); }
  // The scale bytes of fp8 moment `which` (null otherwise), indexed by state element / 16.
  uint8_t* moment_scales(int which) const { return (which == 0 ? m_scales : v_scales).data(); }
  static Buffer<uint8_t> zeroed_scales(int64_t elements, cudaStream_t stream) {
    Buffer<uint8_t> out(static_cast<size_t>((elements + adamw_math::kMomentBlock - 1) / adamw_math::kMomentBlock));
    if (out.size() > 0) MOE_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, out.size(), stream));
    return out;
  }
  // bf16 or fp8 moment `which` of block elements [offset, offset + n) as fp32 into `out`
  // (device; fp32 moments are copied by the callers straight to and from the host).
  void widen_moments(float* out, int which, int64_t offset, int64_t n) const {
    const char* at = moment_at(which, offset);
    if (fp8_moments())
      cuda::dequantize_moments(out, reinterpret_cast<const uint8_t*>(at), moment_scales(which), state_offset(offset), n,
                               /*root=*/which == 1, stream);
    else
      cuda::widen_bf16(out, reinterpret_cast<const bf16*>(at), n, stream);
  }
  // fp32 moments `in` (device) stored as bf16 or fp8 moment `which` of block elements
  // [offset, offset + n) (fp8: whole blocks from a block's first element on; the last may end
  // at a parameter's end).
  void store_moments(int which, int64_t offset, const float* in, int64_t n) {
    char* at = moment_at(which, offset);
    if (fp8_moments())
      cuda::quantize_moments(reinterpret_cast<uint8_t*>(at), moment_scales(which), in, state_offset(offset), offset, n,
                             /*root=*/which == 1, stream);
    else
      cuda::round_to_bf16(reinterpret_cast<bf16*>(at), in, n, stream);
  }
  bf16* hi_data() const { return static_cast<bf16*>(hi.data()); }
  // f(hi, at, n) over the runs of block elements [at, at + n) whose hi halves lie back to
  // back (one run unless gate|up is interleaved): hi = where element at's is.
  template <class F>
  void for_hi_runs(int64_t at, int64_t n, F&& f) const {
    if (interleaved.empty()) {
      f(hi_data() + at, at, n);
      return;
    }
    for (const HiRun& run : hi_runs(interleaved, {at, n})) f(hi_data() + run.hi, run.offset, run.count);
  }
  int16_t* lo_data() const { return static_cast<int16_t*>(lo.data()); }
  float* grads_data() const { return static_cast<float*>(grads.data()); }
  bf16* grads16_data() const { return static_cast<bf16*>(grads16.data()); }
  // The resident ranges whose gradients are fp32, and bf16.
  RangeList fp32_grad_ranges(const RangeList& of) const { return subtract_ranges(of, bf16_grads); }
  RangeList bf16_grad_ranges(const RangeList& of) const { return intersect_ranges(of, bf16_grads); }
  bool packed() const { return !optimizer.empty(); }
  // Where block element `offset`'s lo half and moments are (packed: inside `optimizer`).
  int64_t state_offset(int64_t offset) const {
    if (!packed()) return offset;
    auto it = std::upper_bound(optimizer.begin(), optimizer.end(), offset,
                               [](int64_t x, const Range& r) { return x < r.offset; });
    MOE_CHECK(it != optimizer.begin() && offset < std::prev(it)->end(),
              "GPU parameters: element {} has no optimizer state on this rank (ZeRO keeps its own pieces' only)",
              offset);
    const auto i = static_cast<size_t>(std::prev(it) - optimizer.begin());
    return packed_at[i] + (offset - optimizer[i].offset);
  }
  int16_t* lo_at(int64_t offset) const {
    return packed() && lo_held.empty() ? static_cast<int16_t*>(lo_packed.data()) + state_offset(offset) : lo_data() + offset;
  }
  char* moment_at(int which, int64_t offset) const {
    if (packed())
      return static_cast<char*>((which == 0 ? m_packed : v_packed).data()) +
             state_offset(offset) * static_cast<int64_t>(moment_bytes());
    return static_cast<char*>(which == 0 ? m.data() : v.data()) + offset * static_cast<int64_t>(moment_bytes());
  }
  // Ranges whose fp32 / bf16 gradients have memory here (ZeRO-2: the own ones).
  const RangeList& gradient_ranges() const { return grads_held.empty() ? resident : grads_held; }
  // Ranges whose lo halves (master) or moments are held here.
  const RangeList& master_ranges() const { return !packed() ? resident : lo_held.empty() ? optimizer : lo_held; }
  const RangeList& moment_ranges() const { return packed() ? optimizer : resident; }
  // The parameters' parts inside `wanted`, each inside one range of `held` (or refused
  // naming what is missing).
  std::vector<SpanPiece> parts_held(const RangeList& wanted, const RangeList& held, const char* what) const {
    const RangeList missing = subtract_ranges(wanted, held);
    MOE_CHECK(missing.empty(), "GPU parameters: {} of elements [{}, {}) are not on this rank", what,
              missing.front().offset, missing.front().end());
    return cut_spans(spans(), intersect_ranges(wanted, held));
  }
  // ZeRO-2/3: `block` (elem bytes per element) keeps memory of its own for `kept`, the first
  // and last stage and the chunks at stage edges; the rest of stage s is mapped onto the
  // pool of its parity (share_by_stages, model/gpu_state_layout.h: the memory planner
  // counts the same). Returns the element ranges with memory of their own.
  RangeList share_stages(gpu::ResidentBlock& block, int64_t elem, const RangeList& kept,
                         const std::vector<RangeList>& stage_ranges, bool zero_new) {
    const StageSharing sharing = share_by_stages(kept, stage_ranges);
    const RangeList outside = subtract_ranges(sharing.own, resident);
    MOE_CHECK(outside.empty(), "GPU parameters: elements [{}, {}) to keep are not resident", outside.front().offset,
              outside.front().end());
    sync();
    block.set_resident(byte_ranges(sharing.own, elem), zero_new);
    std::vector<RangeList> groups;
    for (const RangeList& group : sharing.groups) groups.push_back(byte_ranges(group, elem));
    block.share_chunks(groups, sharing.pools);
    return sharing.own;
  }
  Buffer<float>& range_staging() const {
    if (staging_buffer.size() == 0) staging_buffer = staging();
    return staging_buffer;
  }

  void sync() { MOE_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  // A host <-> device staging buffer: the block in pieces of at most kStagingFloats.
  Buffer<float> staging() const {
    return Buffer<float>(static_cast<size_t>(std::min(kStagingFloats, std::max<int64_t>(1, storage))));
  }
  // Makes `ranges` of every block resident (new gradients and moments zeroed).
  void set_resident(RangeList ranges) {
    MOE_CHECK(!packed(), "GPU parameters: the resident ranges cannot change while the optimizer state is packed");
    MOE_CHECK(interleaved.empty(), "GPU parameters: the resident ranges cannot change with gate|up interleaved");
    const auto bytes = [&](size_t element) {
      RangeList out;
      for (const Range& r : ranges)
        out.push_back({r.offset * static_cast<int64_t>(element), r.count * static_cast<int64_t>(element)});
      return out;
    };
    hi.set_resident(bytes(sizeof(bf16)));
    lo.set_resident(bytes(sizeof(int16_t)));
    grads.set_resident(byte_ranges(fp32_grad_ranges(ranges), sizeof(float)), /*zero_new=*/true);
    if (!bf16_grads.empty()) grads16.set_resident(byte_ranges(bf16_grad_ranges(ranges), sizeof(bf16)), true);
    m.set_resident(bytes(moment_bytes()), true);
    v.set_resident(bytes(moment_bytes()), true);
    resident = std::move(ranges);
  }
  RangeList spans() const {
    RangeList all;
    for (size_t id = 0; id < offsets.size(); ++id) all.push_back({offsets[id], numels[id]});
    return all;
  }
  // Host fp32 values [first, first + n) of the block -> hi/lo (where no lo half is held
  // here, the hi halves only).
  void upload_values(const float* values, int64_t first, int64_t n, Buffer<float>& staging) {
    if (packed()) {
      const Range whole{first, n};
      for (const Range& r : subtract_ranges({whole}, optimizer)) upload_split(values + (r.offset - first), r, staging, false);
      for (const Range& r : intersect_ranges({whole}, optimizer))
        upload_split(values + (r.offset - first), r, staging, true);
      return;
    }
    upload_split(values, {first, n}, staging, true);
  }
  void upload_split(const float* values, Range r, Buffer<float>& staging, bool keep_lo) {
    ++weights_version;
    if (!keep_lo && lo_scratch.size() == 0) lo_scratch = Buffer<int16_t>(staging.size());
    for (int64_t done = 0; done < r.count;) {
      const int64_t piece = std::min<int64_t>(r.count - done, static_cast<int64_t>(staging.size()));
      MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), values + done, static_cast<size_t>(piece) * sizeof(float),
                                     cudaMemcpyHostToDevice, stream));
      int16_t* lo_out = keep_lo ? lo_at(r.offset + done) : lo_scratch.data();
      for_hi_runs(r.offset + done, piece, [&](bf16* hi_out, int64_t at, int64_t n) {
        const int64_t k = at - (r.offset + done);
        cuda::split_master(hi_out, lo_out + k, staging.data() + k, n, stream);
      });
      done += piece;
    }
  }
  void check_layout(const ParameterStore<float>& params, const char* what) const {
    MOE_CHECK(params.storage_numel() == storage && static_cast<size_t>(params.size()) == offsets.size(),
              "{}: the parameter layouts differ ({} parameters in {} elements here, {} in {} on the device)", what,
              params.size(), params.storage_numel(), offsets.size(), storage);
  }
};

// The host copies (gpu_parameter_io.h) reach the state through this (as the store's own
// const methods do: its device blocks are not the store's logical state).
struct GpuParameterStoreAccess {
  static GpuParameterStore::State& state(const GpuParameterStore& store) { return *store.state_; }
};

}  // namespace moe
