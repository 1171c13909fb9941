#include "model/cuda/gpu_parameter_io.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/gpu_ops.h"
#include "model/cuda/gpu_parameters_state.h"

namespace moe {
namespace {

template <typename T>
using Buffer = gpu::DeviceArray<T>;

// f(done, n) over [0, count) in pieces of at most `most` elements (a staging buffer's), in
// order: each piece's copies reuse the buffer after the last piece's, in stream order.
template <class F>
void in_pieces(int64_t count, int64_t most, F&& f) {
  MOE_CHECK(most > 0 || count == 0, "parameter copies: {} elements through an empty staging buffer", count);
  for (int64_t done = 0; done < count; done += most) f(done, std::min(most, count - done));
}

// f(offset, n) over `ranges` in pieces of at most `staging` elements, the stream waited for
// after each (the host side of the next piece may not overwrite what this one reads).
template <class F>
void in_staged_pieces(const RangeList& ranges, const Buffer<float>& staging, cudaStream_t stream, F&& f) {
  for (const Range& r : ranges)
    in_pieces(r.count, static_cast<int64_t>(staging.size()), [&](int64_t done, int64_t n) {
      f(r.offset + done, n);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    });
}

// The held gradients between the device and the host's `grads`: the fp32 ones copied, the
// bf16 ones through the staging buffer (widened on the way to the host, rounded to nearest
// even on the way to the device). `State`: GpuParameterStore::State, deduced.
template <class State>
void copy_held_grads(State& s, float* grads, bool to_host) {
  const RangeList& held = s.gradient_ranges();
  for (const Range& r : s.fp32_grad_ranges(held)) {
    float *device = s.grads_data() + r.offset, *host = grads + r.offset;
    const auto bytes = static_cast<size_t>(r.count) * sizeof(float);
    MOE_CUDA_CHECK(to_host ? cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost)
                           : cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  }
  const RangeList bf16_held = s.bf16_grad_ranges(held);
  if (bf16_held.empty()) return;
  const Buffer<float> staging = s.staging();
  in_staged_pieces(bf16_held, staging, s.stream, [&](int64_t at, int64_t n) {
    const auto bytes = static_cast<size_t>(n) * sizeof(float);
    if (to_host) {
      cuda::widen_bf16(staging.data(), s.grads16_data() + at, n, s.stream);
      MOE_CUDA_CHECK(cudaMemcpyAsync(grads + at, staging.data(), bytes, cudaMemcpyDeviceToHost, s.stream));
    } else {
      MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), grads + at, bytes, cudaMemcpyHostToDevice, s.stream));
      cuda::round_to_bf16(s.grads16_data() + at, staging.data(), n, s.stream);
    }
  });
}

// f(at, done, n) over block range r in pieces of the range staging's size (at = r.offset +
// done), after checking that this rank holds r's master weights and, with `moments`, its
// AdamW moments (download_range, upload_range: a rank's own checkpoint pieces).
template <class State, class F>
void in_range_pieces(State& s, Range r, bool moments, F&& f) {
  s.parts_held({r}, s.master_ranges(), "the master weights' lo halves");
  if (moments) s.parts_held({r}, s.moment_ranges(), "the AdamW moments");
  in_pieces(r.count, static_cast<int64_t>(s.range_staging().size()),
            [&](int64_t done, int64_t n) { f(r.offset + done, done, n); });
}

}  // namespace

void download_grads(const GpuParameterStore& store, ParameterStore<float>& params) {
  auto& s = GpuParameterStoreAccess::state(store);
  s.check_layout(params, "download_grads");
  // Where this rank holds nothing it computed no gradient: zeros.
  for (const Range& r : subtract_ranges({{0, s.storage}}, s.gradient_ranges()))
    std::fill_n(params.grads_data() + r.offset, r.count, 0.0f);
  copy_held_grads(s, params.grads_data(), /*to_host=*/true);
}

void upload_grads(GpuParameterStore& store, ParameterStore<float>& params) {
  auto& s = GpuParameterStoreAccess::state(store);
  s.check_layout(params, "upload_grads");
  copy_held_grads(s, params.grads_data(), /*to_host=*/false);
}

void download_params(const GpuParameterStore& store, ParameterStore<float>& params, const Range* only) {
  auto& s = GpuParameterStoreAccess::state(store);
  s.check_layout(params, "download_params");
  Buffer<float> staging = s.staging();
  for (const SpanPiece& part : s.parts_held(only ? RangeList{*only} : s.resident, s.master_ranges(),
                                            "the master weights' lo halves")) {
    const int id = static_cast<int>(part.span);
    float* host = params.value(id) + (part.offset - s.offsets[part.span]);
    in_pieces(part.count, static_cast<int64_t>(staging.size()), [&](int64_t done, int64_t piece) {
      const int16_t* lo = s.lo_at(part.offset + done);
      s.for_hi_runs(part.offset + done, piece, [&](const bf16* hi, int64_t at, int64_t n) {
        const int64_t k = at - (part.offset + done);
        cuda::join_master(staging.data() + k, hi, lo + k, n, s.stream);
      });
      MOE_CUDA_CHECK(cudaMemcpyAsync(host + done, staging.data(), static_cast<size_t>(piece) * sizeof(float),
                                     cudaMemcpyDeviceToHost, s.stream));
    });
  }
  s.sync();
}

void download_state(const GpuParameterStore& store, ParameterStore<float>& params, std::vector<float>& m,
                    std::vector<float>& v, const Range* only) {
  auto& s = GpuParameterStoreAccess::state(store);
  download_params(store, params, only);
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
      in_pieces(part.count, static_cast<int64_t>(staging.size()), [&](int64_t done, int64_t piece) {
        s.widen_moments(staging.data(), moment, part.offset + done, piece);
        MOE_CUDA_CHECK(cudaMemcpyAsync(out + done, staging.data(), static_cast<size_t>(piece) * sizeof(float),
                                       cudaMemcpyDeviceToHost, s.stream));
      });
    }
  }
  s.sync();
}

void upload_state(GpuParameterStore& store, const ParameterStore<float>& params, const std::vector<float>& m,
                  const std::vector<float>& v) {
  auto& s = GpuParameterStoreAccess::state(store);
  s.check_layout(params, "upload_state");
  const bool moments = !m.empty() || !v.empty();
  MOE_CHECK(!moments || (static_cast<int64_t>(m.size()) == s.total_numel && m.size() == v.size()),
            "upload_state: {} first and {} second moments for {} parameters", m.size(), v.size(), s.total_numel);
  Buffer<float> staging = s.staging();
  for (const Range& r : s.resident) s.upload_values(params.values_data() + r.offset, r.offset, r.count, staging);
  s.fp32.upload(params, s.stream);
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
      // Pieces of kStagingFloats: whole fp8 blocks.
      in_pieces(part.count, static_cast<int64_t>(staging.size()), [&](int64_t done, int64_t piece) {
        MOE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), in + done, static_cast<size_t>(piece) * sizeof(float),
                                       cudaMemcpyHostToDevice, s.stream));
        s.store_moments(moment, part.offset + done, staging.data(), piece);
      });
    }
  }
  s.sync();
}

void download_range(const GpuParameterStore& store, Range r, float* values, float* m, float* v) {
  auto& s = GpuParameterStoreAccess::state(store);
  Buffer<float>& staging = s.range_staging();
  in_range_pieces(s, r, m || v, [&](int64_t at, int64_t done, int64_t n) {
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
  });
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
}

void upload_range(GpuParameterStore& store, Range r, const float* values, const float* m, const float* v) {
  auto& s = GpuParameterStoreAccess::state(store);
  Buffer<float>& staging = s.range_staging();
  in_range_pieces(s, r, m || v, [&](int64_t at, int64_t done, int64_t n) {
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
  });
  // The fp32 copies of the parameters in r (router biases) take the same values.
  for (const SpanPiece& part : cut_spans(s.spans(), {r}))
    s.fp32.upload(static_cast<int>(part.span), part.offset - s.offsets[part.span], values + (part.offset - r.offset),
                  part.count, s.stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s.stream));
}

}  // namespace moe
