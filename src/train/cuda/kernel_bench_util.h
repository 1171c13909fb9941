// What `moe bench --kernels` (kernel_bench.cpp, kernel_bench_fp8.cpp) times with: a median
// of CUDA-event timings and random device inputs.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <type_traits>
#include <vector>

#include "config/run_config.h"
#include "core/bf16.h"
#include "core/gpu.h"

namespace moe::bench {

constexpr int kWarmup = 3, kTimed = 10;

// Median milliseconds of `launch` (enqueued on the default stream).
inline double median_ms(const std::function<void()>& launch) {
  cudaEvent_t start, stop;
  MOE_CUDA_CHECK(cudaEventCreate(&start));
  MOE_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < kWarmup + kTimed; ++i) {
    MOE_CUDA_CHECK(cudaEventRecord(start));
    launch();
    MOE_CUDA_CHECK(cudaEventRecord(stop));
    MOE_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    if (i >= kWarmup) ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Uniform random values in [-scale, scale), as in training: the tensor cores draw more
// power on random bits than on constant ones, and the H200 lowers its clock under load
// (constant-byte inputs read 10-20% faster than a training step sees).
template <typename T>
gpu::DeviceArray<T> filled(size_t n, float scale, uint64_t seed) {
  std::vector<T> host(n);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float unit = static_cast<float>(state >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
    if constexpr (std::is_same_v<T, bf16>) host[i] = float_to_bf16(scale * unit);
    else host[i] = scale * unit;
  }
  gpu::DeviceArray<T> array(n);
  array.upload(host.data(), n);
  return array;
}

}  // namespace moe::bench

namespace moe {

// The FP8 half of `moe bench --kernels` (kernel_bench_fp8.cpp): the experts' FP8 grouped
// GEMMs beside the bf16 ones, the quantisation kernels, the dense FP8 GEMM beside cuBLASLt.
void run_fp8_kernel_bench(const RunConfig& config, std::ostream& out);

}  // namespace moe
