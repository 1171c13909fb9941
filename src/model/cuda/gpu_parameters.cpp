#include "model/cuda/gpu_parameters.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "core/gpu.h"

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
  bool bf16_moments() const { return moments == MomentDtype::Bf16; }
  void* m() { return bf16_moments() ? static_cast<void*>(m16.data()) : static_cast<void*>(m32.data()); }
  void* v() { return bf16_moments() ? static_cast<void*>(v16.data()) : static_cast<void*>(v32.data()); }

  void sync() { MOE_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  // A host <-> device staging buffer: the block in pieces of at most kStagingFloats.
  Buffer<float> staging() const {
    return Buffer<float>(static_cast<size_t>(std::min(kStagingFloats, std::max<int64_t>(1, storage))));
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
  for (int id = 0; id < params.size(); ++id) {
    const int64_t offset = params.offset(id), numel = params.numel(id);
    // The AdamW kernel reads 4 elements at a time (16-byte gradient loads).
    MOE_CHECK(offset % 4 == 0, "GPU parameters: '{}' starts at element {}, not a multiple of 4",
              params.spec(id).name, offset);
    s.offsets.push_back(offset);
    s.numels.push_back(numel);
    s.total_numel += numel;
  }
  MOE_CHECK(params.size() > 0, "GPU parameters: the store has no parameters");
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
  Buffer<float> staging = s.staging();
  s.upload_values(params.values_data(), 0, s.storage, staging);
  s.refresh_mirrors(params);
  s.sync();
}

GpuParameterStore::~GpuParameterStore() = default;

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

float* GpuParameterStore::fp32_mirror() { return state_->mirror.data(); }

int64_t GpuParameterStore::fp32_mirror_offset(int id) const {
  MOE_CHECK(id >= 0 && static_cast<size_t>(id) < state_->mirror_offsets.size(), "GPU parameters: no parameter {}", id);
  return state_->mirror_offsets[static_cast<size_t>(id)];
}

void GpuParameterStore::zero_grads() {
  State& s = *state_;
  MOE_CUDA_CHECK(cudaMemsetAsync(s.grads.data(), 0, s.grads.size() * sizeof(float), s.stream));
}

RangeList GpuParameterStore::fp32_copy_ranges() const {
  const State& s = *state_;
  RangeList ranges;
  for (size_t id = 0; id < s.mirror_offsets.size(); ++id)
    if (s.mirror_offsets[id] >= 0) ranges.emplace_back(s.offsets[id], (s.numels[id] + 15) / 16 * 16);
  std::sort(ranges.begin(), ranges.end());
  return ranges;
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
  Buffer<float> staging = s.staging();
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
  Buffer<float> staging = s.bf16_moments() ? s.staging() : Buffer<float>();
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
  Buffer<float> staging = s.staging();
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
         s.mirror.size() * sizeof(float);
}

}  // namespace moe
