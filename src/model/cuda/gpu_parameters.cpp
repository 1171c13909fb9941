#include "model/cuda/gpu_parameters.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "core/cuda/resident_block.h"
#include "core/gpu.h"
#include "kernels/adamw_math.h"
#include "model/gpu_state_layout.h"

namespace moe {
namespace {

template <typename T>
using Buffer = gpu::DeviceArray<T>;

// Host <-> device conversions (hi/lo split, bf16 moments) go through a device buffer of
// this many floats, so they need no full-size fp32 copy on either side.
constexpr int64_t kStagingFloats = int64_t{1} << 22;

}  // namespace

struct GpuParameterStore::State {
  cudaStream_t stream = nullptr;
  MomentDtype moments = MomentDtype::Fp32;
  int64_t storage = 0, total_numel = 0;
  std::vector<int64_t> offsets, numels, packed_offsets, mirror_offsets;  // per parameter id
  // The blocks, of which only the resident ranges hold memory (gpu::ResidentBlock).
  gpu::ResidentBlock hi, lo, grads, m, v;
  // bf16 expert gradients: grads16 holds the gradients of `bf16_grads` (the expert
  // tensors' extents), where grads then holds none.
  gpu::ResidentBlock grads16;
  RangeList bf16_grads;
  Buffer<float> mirror;  // fp32 copies
  RangeList resident;    // element ranges of the block that hold memory (sorted)
  // ZeRO (pack_optimizer_state): the lo halves and moments of `optimizer` (merged ranges)
  // only, range i's from packed_at[i] on (congruent to its offset modulo 16, so the AdamW
  // kernel's 16-byte accesses line up as in the block); empty: in the blocks above.
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
  void refresh_mirrors(const ParameterStore<float>& params) {
    for (size_t id = 0; id < mirror_offsets.size(); ++id)
      if (mirror_offsets[id] >= 0)
        MOE_CUDA_CHECK(cudaMemcpyAsync(mirror.data() + mirror_offsets[id], params.value(static_cast<int>(id)),
                                       static_cast<size_t>(numels[id]) * sizeof(float), cudaMemcpyHostToDevice,
                                       stream));
  }
  void check_layout(const ParameterStore<float>& params, const char* what) const {
    MOE_CHECK(params.storage_numel() == storage && static_cast<size_t>(params.size()) == offsets.size(),
              "{}: the parameter layouts differ ({} parameters in {} elements here, {} in {} on the device)", what,
              params.size(), params.storage_numel(), offsets.size(), storage);
  }
};

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

void GpuParameterStore::download_grads(ParameterStore<float>& params) const {
  const State& s = *state_;
  s.check_layout(params, "download_grads");
  // Where this rank holds nothing it computed no gradient: zeros.
  const RangeList& held = s.grads_held.empty() ? s.resident : s.grads_held;
  for (const Range& r : subtract_ranges({{0, s.storage}}, held))
    std::fill_n(params.grads_data() + r.offset, r.count, 0.0f);
  for (const Range& r : s.fp32_grad_ranges(held))
    MOE_CUDA_CHECK(cudaMemcpy(params.grads_data() + r.offset, s.grads_data() + r.offset,
                              static_cast<size_t>(r.count) * sizeof(float), cudaMemcpyDeviceToHost));
  const RangeList bf16_held = s.bf16_grad_ranges(held);
  if (bf16_held.empty()) return;
  Buffer<float> staging = s.staging();
  for (const Range& r : bf16_held)
    for (int64_t done = 0; done < r.count;) {
      const int64_t piece = std::min<int64_t>(r.count - done, static_cast<int64_t>(staging.size()));
      cuda::widen_bf16(staging.data(), s.grads16_data() + r.offset + done, piece, s.stream);
      MOE_CUDA_CHECK(cudaMemcpyAsync(params.grads_data() + r.offset + done, staging.data(),
                                     static_cast<size_t>(piece) * sizeof(float), cudaMemcpyDeviceToHost, s.stream));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));  // the staging buffer is reused
      done += piece;
    }
}

void GpuParameterStore::upload_grads(ParameterStore<float>& params) {
  const State& s = *state_;
  s.check_layout(params, "upload_grads");
  const RangeList& held = s.grads_held.empty() ? s.resident : s.grads_held;
  for (const Range& r : s.fp32_grad_ranges(held))
    MOE_CUDA_CHECK(cudaMemcpy(s.grads_data() + r.offset, params.grads_data() + r.offset,
                              static_cast<size_t>(r.count) * sizeof(float), cudaMemcpyHostToDevice));
  const RangeList bf16_held = s.bf16_grad_ranges(held);
  if (bf16_held.empty()) return;
  Buffer<float> staging = s.staging();
  for (const Range& r : bf16_held)
    for (int64_t done = 0; done < r.count;) {
      const int64_t piece = std::min<int64_t>(r.count - done, static_cast<int64_t>(staging.size()));
      MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), params.grads_data() + r.offset + done,
                                     static_cast<size_t>(piece) * sizeof(float), cudaMemcpyHostToDevice, s.stream));
      cuda::round_to_bf16(s.grads16_data() + r.offset + done, staging.data(), piece, s.stream);
      MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));  // the staging buffer is reused
      done += piece;
    }
}

void GpuParameterStore::download_params(ParameterStore<float>& params, const Range* only) const {
  State& s = *state_;
  s.check_layout(params, "download_params");
  Buffer<float> staging = s.staging();
  for (const SpanPiece& part : s.parts_held(only ? RangeList{*only} : s.resident, s.master_ranges(),
                                            "the master weights' lo halves")) {
    const int id = static_cast<int>(part.span);
    float* host = params.value(id) + (part.offset - s.offsets[part.span]);
    for (int64_t done = 0; done < part.count;) {
      const int64_t piece = std::min<int64_t>(part.count - done, static_cast<int64_t>(staging.size()));
      const int16_t* lo = s.lo_at(part.offset + done);
      s.for_hi_runs(part.offset + done, piece, [&](const bf16* hi, int64_t at, int64_t n) {
        const int64_t k = at - (part.offset + done);
        cuda::join_master(staging.data() + k, hi, lo + k, n, s.stream);
      });
      MOE_CUDA_CHECK(cudaMemcpyAsync(host + done, staging.data(), static_cast<size_t>(piece) * sizeof(float),
                                     cudaMemcpyDeviceToHost, s.stream));
      done += piece;
    }
  }
  s.sync();
}

void GpuParameterStore::download_state(ParameterStore<float>& params, std::vector<float>& m, std::vector<float>& v,
                                       const Range* only) const {
  State& s = *state_;
  download_params(params, only);
  m.resize(static_cast<size_t>(s.total_numel), 0.0f);
  v.resize(static_cast<size_t>(s.total_numel), 0.0f);
  Buffer<float> staging = s.moments != MomentDtype::Fp32 ? s.staging() : Buffer<float>();
  for (const SpanPiece& part :
       s.parts_held(only ? RangeList{*only} : s.resident, s.moment_ranges(), "the AdamW moments")) {
    const int64_t packed = s.packed_offsets[part.span] + (part.offset - s.offsets[part.span]);
    for (int moment = 0; moment < 2; ++moment) {
      float* out = (moment == 0 ? m.data() : v.data()) + packed;
      if (s.moments == MomentDtype::Fp32) {
        MOE_CUDA_CHECK(cudaMemcpyAsync(out, s.moment_at(moment, part.offset), static_cast<size_t>(part.count) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s.stream));
        continue;
      }
      for (int64_t done = 0; done < part.count;) {
        const int64_t piece = std::min<int64_t>(part.count - done, static_cast<int64_t>(staging.size()));
        s.widen_moments(staging.data(), moment, part.offset + done, piece);
        MOE_CUDA_CHECK(cudaMemcpyAsync(out + done, staging.data(), static_cast<size_t>(piece) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s.stream));
        done += piece;
      }
    }
  }
  s.sync();
}

void GpuParameterStore::upload_state(const ParameterStore<float>& params, const std::vector<float>& m,
                                     const std::vector<float>& v) {
  State& s = *state_;
  s.check_layout(params, "upload_state");
  const bool moments = !m.empty() || !v.empty();
  MOE_CHECK(!moments || (static_cast<int64_t>(m.size()) == s.total_numel && m.size() == v.size()),
            "upload_state: {} first and {} second moments for {} parameters", m.size(), v.size(), s.total_numel);
  Buffer<float> staging = s.staging();
  for (const Range& r : s.resident) s.upload_values(params.values_data() + r.offset, r.offset, r.count, staging);
  s.refresh_mirrors(params);
  const RangeList with_moments = moments ? s.moment_ranges() : RangeList{};
  for (const SpanPiece& part : s.parts_held(with_moments, with_moments, "the AdamW moments")) {
    const int64_t packed = s.packed_offsets[part.span] + (part.offset - s.offsets[part.span]);
    for (int moment = 0; moment < 2; ++moment) {
      const float* in = (moment == 0 ? m.data() : v.data()) + packed;
      if (s.moments == MomentDtype::Fp32) {
        MOE_CUDA_CHECK(cudaMemcpyAsync(s.moment_at(moment, part.offset), in, static_cast<size_t>(part.count) * sizeof(float),
                                       cudaMemcpyHostToDevice, s.stream));
        continue;
      }
      for (int64_t done = 0; done < part.count;) {  // pieces of kStagingFloats: whole fp8 blocks
        const int64_t piece = std::min<int64_t>(part.count - done, static_cast<int64_t>(staging.size()));
        MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), in + done, static_cast<size_t>(piece) * sizeof(float),
                                       cudaMemcpyHostToDevice, s.stream));
        s.store_moments(moment, part.offset + done, staging.data(), piece);
        done += piece;
      }
    }
  }
  s.sync();
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

void GpuParameterStore::download_range(Range r, float* values, float* m, float* v) const {
  const State& s = *state_;
  s.parts_held({r}, s.master_ranges(), "the master weights' lo halves");
  if (m || v) s.parts_held({r}, s.moment_ranges(), "the AdamW moments");
  Buffer<float>& staging = s.range_staging();
  const auto chunk = static_cast<int64_t>(staging.size());
  for (int64_t done = 0; done < r.count; done += chunk) {
    const int64_t n = std::min(chunk, r.count - done), at = r.offset + done;
    const int16_t* lo = s.lo_at(at);
    s.for_hi_runs(at, n, [&](const bf16* hi, int64_t run, int64_t count) {
      cuda::join_master(staging.data() + (run - at), hi, lo + (run - at), count, s.stream);
    });
    MOE_CUDA_CHECK(cudaMemcpyAsync(values + done, staging.data(), static_cast<size_t>(n) * sizeof(float),
                                   cudaMemcpyDeviceToHost, s.stream));
    for (int which = 0; which < 2; ++which) {
      float* out = which == 0 ? m : v;
      if (!out) continue;
      const char* in = s.moment_at(which, at);
      if (s.moments != MomentDtype::Fp32) {
        s.widen_moments(staging.data(), which, at, n);
        in = reinterpret_cast<const char*>(staging.data());
      }
      // The staging buffer is reused right after: this copy must finish first.
      MOE_CUDA_CHECK(cudaMemcpyAsync(out + done, in, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToHost,
                                     s.stream));
    }
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
}

void GpuParameterStore::upload_range(Range r, const float* values, const float* m, const float* v) {
  State& s = *state_;
  s.parts_held({r}, s.master_ranges(), "the master weights' lo halves");
  if (m || v) s.parts_held({r}, s.moment_ranges(), "the AdamW moments");
  Buffer<float>& staging = s.range_staging();
  const auto chunk = static_cast<int64_t>(staging.size());
  for (int64_t done = 0; done < r.count; done += chunk) {
    const int64_t n = std::min(chunk, r.count - done), at = r.offset + done;
    MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), values + done, static_cast<size_t>(n) * sizeof(float),
                                   cudaMemcpyHostToDevice, s.stream));
    int16_t* lo = s.lo_at(at);
    s.for_hi_runs(at, n, [&](bf16* hi, int64_t run, int64_t count) {
      cuda::split_master(hi, lo + (run - at), staging.data() + (run - at), count, s.stream);
    });
    ++s.weights_version;
    for (int which = 0; which < 2; ++which) {
      const float* in = which == 0 ? m : v;
      if (!in) continue;
      if (s.moments == MomentDtype::Fp32) {
        MOE_CUDA_CHECK(cudaMemcpyAsync(s.moment_at(which, at), in + done, static_cast<size_t>(n) * sizeof(float),
                                       cudaMemcpyHostToDevice, s.stream));
        continue;
      }
      MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), in + done, static_cast<size_t>(n) * sizeof(float),
                                     cudaMemcpyHostToDevice, s.stream));
      s.store_moments(which, at, staging.data(), n);
    }
  }
  // The fp32 copies of the parameters in r (router biases) take the same values.
  for (const SpanPiece& part : cut_spans(s.spans(), {r})) {
    const int64_t mirror_at = s.mirror_offsets[part.span];
    if (mirror_at < 0) continue;
    MOE_CUDA_CHECK(cudaMemcpyAsync(s.mirror.data() + mirror_at + (part.offset - s.offsets[part.span]),
                                   values + (part.offset - r.offset), static_cast<size_t>(part.count) * sizeof(float),
                                   cudaMemcpyHostToDevice, s.stream));
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
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
