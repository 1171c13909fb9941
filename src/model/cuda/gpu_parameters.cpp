#include "model/cuda/gpu_parameters.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "core/gpu.h"
#include "core/span_cut.h"
#include "model/cuda/segment_set.h"

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
  std::vector<int64_t> offsets, numels, mirror_offsets;  // per parameter id
  Buffer<bf16> hi;
  Buffer<int16_t> lo;
  Buffer<float> grads;
  Buffer<float> m32, v32;  // fp32 moments, or
  Buffer<bf16> m16, v16;   // bf16 moments
  Buffer<float> mirror;    // fp32 copies
  // Every parameter whole; under ZeRO-1 (set_step_ranges) the parts this rank steps and
  // the parts it adds to the norm, as separate sets (null: the whole set).
  SegmentSet whole;
  std::unique_ptr<SegmentSet> update_part, norm_part;
  SegmentSet& update_set() { return update_part ? *update_part : whole; }
  SegmentSet& norm_set() { return norm_part ? *norm_part : whole; }
  Buffer<adamw_math::AdamWScalars> scalars;
  // Pinned: the step's scalars on their way in, and the norm on its way out.
  adamw_math::AdamWScalars* host_in = nullptr;
  adamw_math::AdamWScalars* host_out = nullptr;
  cudaEvent_t in_copied = nullptr, out_copied = nullptr;

  bool bf16_moments() const { return moments == MomentDtype::Bf16; }
  void* m() { return bf16_moments() ? static_cast<void*>(m16.data()) : static_cast<void*>(m32.data()); }
  void* v() { return bf16_moments() ? static_cast<void*>(v16.data()) : static_cast<void*>(v32.data()); }

  void sync() { MOE_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  // The previous copy must have read host_in before it is overwritten.
  void upload_scalars(const adamw_math::AdamWScalars& s) {
    MOE_CUDA_CHECK(cudaEventSynchronize(in_copied));
    *host_in = s;
    MOE_CUDA_CHECK(cudaMemcpyAsync(scalars.data(), host_in, sizeof s, cudaMemcpyHostToDevice, stream));
    MOE_CUDA_CHECK(cudaEventRecord(in_copied, stream));
  }
  void fetch_result() {
    MOE_CUDA_CHECK(cudaMemcpyAsync(host_out, scalars.data(), sizeof *host_out, cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_CHECK(cudaEventRecord(out_copied, stream));
  }
  void launch_norm(double max_norm) {
    SegmentSet& set = norm_set();
    cuda::grad_norm(scalars.data(), set.chunk_sq.data(), set.segment_sq.data(), grads.data(), set.segments.data(),
                    static_cast<int64_t>(set.host.size()), set.n_chunks, max_norm, stream);
  }
  void launch_adamw() {
    SegmentSet& set = update_set();
    cuda::multi_tensor_adamw(hi.data(), lo.data(), mirror.data(), grads.data(), m(), v(), bf16_moments(),
                             set.segments.data(), static_cast<int64_t>(set.host.size()), set.n_chunks,
                             scalars.data(), stream);
  }
  // The parameters' segments cut to `ranges` (sorted, disjoint): a piece of a parameter
  // keeps its decay flag and the matching part of its fp32 copy.
  std::unique_ptr<SegmentSet> cut_to(const std::vector<std::pair<int64_t, int64_t>>& ranges) const {
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const cuda::OptimizerSegment& seg : whole.host) spans.emplace_back(seg.offset, seg.numel);
    std::vector<cuda::OptimizerSegment> pieces;
    for (const SpanPiece& part : cut_spans(spans, ranges)) {
      const cuda::OptimizerSegment& seg = whole.host[part.span];
      cuda::OptimizerSegment piece = seg;
      piece.offset = part.offset;
      piece.numel = part.count;
      if (seg.mirror_offset >= 0) piece.mirror_offset = seg.mirror_offset + (part.offset - seg.offset);
      pieces.push_back(piece);
    }
    return std::make_unique<SegmentSet>(std::move(pieces));
  }
  // Host fp32 values [first, first + n) of the block -> hi/lo.
  void upload_values(const float* values, int64_t first, int64_t n, Buffer<float>& staging) {
    for (int64_t done = 0; done < n;) {
      const int64_t piece = std::min<int64_t>(n - done, static_cast<int64_t>(staging.size()));
      MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), values + done, static_cast<size_t>(piece) * sizeof(float),
                                     cudaMemcpyHostToDevice, stream));
      cuda::split_master(hi.data() + first + done, lo.data() + first + done, staging.data(), piece, stream);
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
                                     const std::vector<int>& fp32_copy_ids, cuda::Stream stream)
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
  std::vector<cuda::OptimizerSegment> segments;
  for (int id = 0; id < params.size(); ++id) {
    const int64_t offset = params.offset(id), numel = params.numel(id);
    // The AdamW kernel reads 4 elements at a time (16-byte gradient loads).
    MOE_CHECK(offset % 4 == 0, "GPU parameters: '{}' starts at element {}, not a multiple of 4",
              params.spec(id).name, offset);
    s.offsets.push_back(offset);
    s.numels.push_back(numel);
    s.total_numel += numel;
    cuda::OptimizerSegment seg;
    seg.offset = offset;
    seg.numel = numel;
    seg.mirror_offset = s.mirror_offsets[static_cast<size_t>(id)];
    seg.decay = params.spec(id).weight_decay ? 1 : 0;
    segments.push_back(seg);
  }
  MOE_CHECK(!segments.empty(), "GPU parameters: the store has no parameters");
  s.whole = SegmentSet(std::move(segments));
  const auto n = static_cast<size_t>(s.storage);
  s.hi = Buffer<bf16>(n);
  s.lo = Buffer<int16_t>(n);
  s.grads = Buffer<float>(n);
  s.grads.fill_bytes(0);
  if (s.bf16_moments()) {
    s.m16 = Buffer<bf16>(n);
    s.v16 = Buffer<bf16>(n);
    s.m16.fill_bytes(0);
    s.v16.fill_bytes(0);
  } else {
    s.m32 = Buffer<float>(n);
    s.v32 = Buffer<float>(n);
    s.m32.fill_bytes(0);
    s.v32.fill_bytes(0);
  }
  s.mirror = Buffer<float>(static_cast<size_t>(mirror_numel));
  s.scalars = Buffer<adamw_math::AdamWScalars>(1);
  MOE_CUDA_CHECK(cudaMallocHost(&s.host_in, sizeof *s.host_in));
  MOE_CUDA_CHECK(cudaMallocHost(&s.host_out, sizeof *s.host_out));
  *s.host_in = adamw_math::AdamWScalars{};
  *s.host_out = adamw_math::AdamWScalars{};
  MOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.in_copied, cudaEventDisableTiming));
  MOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.out_copied, cudaEventDisableTiming));
  s.scalars.upload(s.host_in, 1);
  Buffer<float> staging(static_cast<size_t>(std::min(kStagingFloats, std::max<int64_t>(1, s.storage))));
  s.upload_values(params.values_data(), 0, s.storage, staging);
  s.refresh_mirrors(params);
  s.sync();
}

GpuParameterStore::~GpuParameterStore() {
  State& s = *state_;
  if (s.in_copied) cudaEventDestroy(s.in_copied);
  if (s.out_copied) cudaEventDestroy(s.out_copied);
  if (s.host_in) cudaFreeHost(s.host_in);
  if (s.host_out) cudaFreeHost(s.host_out);
}

const bf16* GpuParameterStore::weights() const { return state_->hi.data(); }
float* GpuParameterStore::grads() { return state_->grads.data(); }
bf16* GpuParameterStore::weights_hi() { return state_->hi.data(); }
int16_t* GpuParameterStore::weights_lo() { return state_->lo.data(); }
MomentDtype GpuParameterStore::moment_dtype() const { return state_->moments; }
void* GpuParameterStore::moment_block(int which) {
  MOE_CHECK(which == 0 || which == 1, "moment_block: moment {} (0 or 1)", which);
  return which == 0 ? state_->m() : state_->v();
}
size_t GpuParameterStore::moment_bytes() const { return state_->bf16_moments() ? sizeof(bf16) : sizeof(float); }
int64_t GpuParameterStore::storage_numel() const { return state_->storage; }

const float* GpuParameterStore::fp32_values(int id) const {
  const State& s = *state_;
  MOE_CHECK(id >= 0 && static_cast<size_t>(id) < s.mirror_offsets.size() && s.mirror_offsets[static_cast<size_t>(id)] >= 0,
            "GPU parameters: parameter {} has no fp32 copy on the device", id);
  return s.mirror.data() + s.mirror_offsets[static_cast<size_t>(id)];
}

void GpuParameterStore::zero_grads() {
  State& s = *state_;
  MOE_CUDA_CHECK(cudaMemsetAsync(s.grads.data(), 0, s.grads.size() * sizeof(float), s.stream));
}

void GpuParameterStore::set_step_ranges(const std::vector<std::pair<int64_t, int64_t>>& update,
                                        const std::vector<std::pair<int64_t, int64_t>>& norm) {
  State& s = *state_;
  for (const auto* ranges : {&update, &norm}) {
    int64_t end = 0;
    for (const auto& [begin, count] : *ranges) {
      MOE_CHECK(begin >= end && count > 0 && begin + count <= s.storage,
                "GPU parameters: step ranges must be sorted, disjoint and inside the {}-element block; got [{}, +{})",
                s.storage, begin, count);
      end = begin + count;
    }
  }
  s.update_part = s.cut_to(update);
  s.norm_part = s.cut_to(norm);
}

std::vector<std::pair<int64_t, int64_t>> GpuParameterStore::fp32_copy_ranges() const {
  const State& s = *state_;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t id = 0; id < s.mirror_offsets.size(); ++id)
    if (s.mirror_offsets[id] >= 0) ranges.emplace_back(s.offsets[id], (s.numels[id] + 15) / 16 * 16);
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

double GpuParameterStore::grad_norm() {
  State& s = *state_;
  if (s.norm_set().host.empty()) return 0.0;  // ZeRO-1: nothing of the norm on this rank
  s.launch_norm(0.0);
  s.fetch_result();
  return last_grad_norm();
}

void GpuParameterStore::adamw_step(const AdamWStep& hyper, float grad_scale) {
  State& s = *state_;
  MOE_CHECK(hyper.step >= 1, "adamw_step: step counts from 1, got {}", hyper.step);
  adamw_math::AdamWScalars scalars =
      adamw_math::adamw_step_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step);
  scalars.grad_scale = grad_scale;
  s.upload_scalars(scalars);
  s.launch_adamw();
  s.sync();
}

void GpuParameterStore::clip_and_adamw_step(const AdamWStep& hyper, double max_norm) {
  State& s = *state_;
  MOE_CHECK(hyper.step >= 1, "clip_and_adamw_step: step counts from 1, got {}", hyper.step);
  MOE_CHECK(!s.norm_part, "clip_and_adamw_step: the optimizer is sharded (ZeRO-1): the norm must be summed over the "
                          "ranks first (grad_norm(), then adamw_step())");
  s.upload_scalars(
      adamw_math::adamw_step_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step));
  s.launch_norm(max_norm);
  s.fetch_result();
  s.launch_adamw();
}

double GpuParameterStore::last_grad_norm() {
  MOE_CUDA_CHECK(cudaEventSynchronize(state_->out_copied));
  return state_->host_out->norm;
}

bool GpuParameterStore::last_step_skipped() {
  MOE_CUDA_CHECK(cudaEventSynchronize(state_->out_copied));
  return state_->host_out->skip != 0;
}

void GpuParameterStore::download_grads(ParameterStore<float>& params) const {
  state_->check_layout(params, "download_grads");
  state_->grads.download(params.grads_data(), static_cast<size_t>(state_->storage));
}

void GpuParameterStore::upload_grads(ParameterStore<float>& params) {
  state_->check_layout(params, "upload_grads");
  state_->grads.upload(params.grads_data(), static_cast<size_t>(state_->storage));
}

void GpuParameterStore::download_params(ParameterStore<float>& params) const {
  State& s = *state_;
  s.check_layout(params, "download_params");
  Buffer<float> staging(static_cast<size_t>(std::min(kStagingFloats, std::max<int64_t>(1, s.storage))));
  for (int id = 0; id < params.size(); ++id) {
    const int64_t offset = s.offsets[static_cast<size_t>(id)], numel = s.numels[static_cast<size_t>(id)];
    for (int64_t done = 0; done < numel;) {
      const int64_t piece = std::min<int64_t>(numel - done, static_cast<int64_t>(staging.size()));
      cuda::join_master(staging.data(), s.hi.data() + offset + done, s.lo.data() + offset + done, piece, s.stream);
      MOE_CUDA_CHECK(cudaMemcpyAsync(params.value(id) + done, staging.data(), static_cast<size_t>(piece) * sizeof(float),
                                     cudaMemcpyDeviceToHost, s.stream));
      done += piece;
    }
  }
  s.sync();
}

void GpuParameterStore::download_state(ParameterStore<float>& params, std::vector<float>& m,
                                       std::vector<float>& v) const {
  State& s = *state_;
  download_params(params);
  m.assign(static_cast<size_t>(s.total_numel), 0.0f);
  v.assign(static_cast<size_t>(s.total_numel), 0.0f);
  Buffer<float> staging(s.bf16_moments() ? static_cast<size_t>(std::min(kStagingFloats, s.storage)) : 0);
  int64_t packed = 0;
  for (size_t id = 0; id < s.offsets.size(); ++id) {
    const int64_t offset = s.offsets[id], numel = s.numels[id];
    for (int moment = 0; moment < 2; ++moment) {
      float* out = (moment == 0 ? m.data() : v.data()) + packed;
      if (!s.bf16_moments()) {
        const float* in = (moment == 0 ? s.m32.data() : s.v32.data()) + offset;
        MOE_CUDA_CHECK(cudaMemcpyAsync(out, in, static_cast<size_t>(numel) * sizeof(float), cudaMemcpyDeviceToHost,
                                       s.stream));
        continue;
      }
      const bf16* in = (moment == 0 ? s.m16.data() : s.v16.data()) + offset;
      for (int64_t done = 0; done < numel;) {
        const int64_t piece = std::min<int64_t>(numel - done, static_cast<int64_t>(staging.size()));
        cuda::widen_bf16(staging.data(), in + done, piece, s.stream);
        MOE_CUDA_CHECK(cudaMemcpyAsync(out + done, staging.data(), static_cast<size_t>(piece) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s.stream));
        done += piece;
      }
    }
    packed += numel;
  }
  s.sync();
}

void GpuParameterStore::upload_state(const ParameterStore<float>& params, const std::vector<float>& m,
                                     const std::vector<float>& v) {
  State& s = *state_;
  s.check_layout(params, "upload_state");
  MOE_CHECK(static_cast<int64_t>(m.size()) == s.total_numel && m.size() == v.size(),
            "upload_state: {} first and {} second moments for {} parameters", m.size(), v.size(), s.total_numel);
  Buffer<float> staging(static_cast<size_t>(std::min(kStagingFloats, std::max<int64_t>(1, s.storage))));
  s.upload_values(params.values_data(), 0, s.storage, staging);
  s.refresh_mirrors(params);
  int64_t packed = 0;
  for (size_t id = 0; id < s.offsets.size(); ++id) {
    const int64_t offset = s.offsets[id], numel = s.numels[id];
    for (int moment = 0; moment < 2; ++moment) {
      const float* in = (moment == 0 ? m.data() : v.data()) + packed;
      if (!s.bf16_moments()) {
        float* out = (moment == 0 ? s.m32.data() : s.v32.data()) + offset;
        MOE_CUDA_CHECK(cudaMemcpyAsync(out, in, static_cast<size_t>(numel) * sizeof(float), cudaMemcpyHostToDevice,
                                       s.stream));
        continue;
      }
      bf16* out = (moment == 0 ? s.m16.data() : s.v16.data()) + offset;
      for (int64_t done = 0; done < numel;) {
        const int64_t piece = std::min<int64_t>(numel - done, static_cast<int64_t>(staging.size()));
        MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), in + done, static_cast<size_t>(piece) * sizeof(float),
                                       cudaMemcpyHostToDevice, s.stream));
        cuda::round_to_bf16(out + done, staging.data(), piece, s.stream);
        done += piece;
      }
    }
    packed += numel;
  }
  s.sync();
}

size_t GpuParameterStore::bytes_per_parameter(MomentDtype moments) {
  return sizeof(bf16) + sizeof(int16_t) + sizeof(float) + 2 * (moments == MomentDtype::Bf16 ? sizeof(bf16) : sizeof(float));
}

size_t GpuParameterStore::device_bytes() const {
  const State& s = *state_;
  return s.hi.size() * sizeof(bf16) + s.lo.size() * sizeof(int16_t) + s.grads.size() * sizeof(float) +
         (s.m32.size() + s.v32.size()) * sizeof(float) + (s.m16.size() + s.v16.size()) * sizeof(bf16) +
         s.mirror.size() * sizeof(float) + s.whole.bytes() + (s.update_part ? s.update_part->bytes() : 0) +
         (s.norm_part ? s.norm_part->bytes() : 0) + sizeof(adamw_math::AdamWScalars);
}

}  // namespace moe
