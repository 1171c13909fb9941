// What `moe bench --kernels` (kernel_bench.cpp, kernel_bench_fp8.cpp) times with: a median
// of CUDA-event timings and random device inputs.
#pragma once
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <type_traits>
#include <vector>

#include "config/run_config.h"
#include "core/bf16.h"
#include "core/gpu.h"
#include "obs/board_power.h"
#include "obs/cuda/board_sampler.h"

namespace moe::bench {

constexpr int kWarmup = 3, kTimed = 10;

// How a bench times one kernel's launch: median_ms (warm board) or SustainedTimer::ms.
using TimeFn = std::function<double(const std::function<void()>&)>;

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

// A kernel's time under the power limit, as a training step sees it: `launch` back to back
// for `sustain_ms` of wall time, the median of the launches in the second half (the board
// settled at the clock its power limit allows), with the SM clock and power over that half.
// A kernel alone on a warm board (median_ms) runs at the full clock; in a step at 700 W it
// runs at the clock its energy per FLOP allows, so two kernels that tie alone can differ
// here (docs/PROFILING.md "Sustained kernel rates").
class SustainedTimer {
 public:
  explicit SustainedTimer(double sustain_ms) : sustain_ms_(sustain_ms), board_(std::chrono::milliseconds(25)) {}

  double ms(const std::function<void()>& launch) {
    constexpr int kBatch = 16;  // launches enqueued between waits: the queue stays full, the CPU does not run ahead
    std::vector<cudaEvent_t> events(kBatch + 1);
    for (auto& e : events) MOE_CUDA_CHECK(cudaEventCreate(&e));
    std::vector<float> first_half, second_half;
    const auto begin = std::chrono::steady_clock::now();
    auto elapsed_ms = [&] {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    };
    board_.start();
    bool second = false;
    while (elapsed_ms() < sustain_ms_) {
      if (!second && elapsed_ms() >= sustain_ms_ / 2) {
        second = true;
        board_.take_summary();  // drop the first half's samples
      }
      MOE_CUDA_CHECK(cudaEventRecord(events[0]));
      for (int i = 1; i <= kBatch; ++i) {
        launch();
        MOE_CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(i)]));
      }
      MOE_CUDA_CHECK(cudaEventSynchronize(events[kBatch]));
      for (int i = 1; i <= kBatch; ++i) {
        float t = 0;
        MOE_CUDA_CHECK(cudaEventElapsedTime(&t, events[static_cast<size_t>(i - 1)], events[static_cast<size_t>(i)]));
        (second ? second_half : first_half).push_back(t);
      }
    }
    board_.stop();
    last_board_ = board_.summary();
    for (auto& e : events) cudaEventDestroy(e);
    std::vector<float>& kept = second_half.empty() ? first_half : second_half;
    std::sort(kept.begin(), kept.end());
    return kept[kept.size() / 2];
  }

  // The SM clock and power over the last ms()'s second half ("" without NVML).
  std::string last_board() const {
    if (!board_.available() || last_board_.samples == 0) return "";
    return fmt::format("{:.0f} MHz {:.0f} W", last_board_.sm_mhz_mean, last_board_.power_w_mean);
  }

 private:
  double sustain_ms_;
  BoardSampler board_;
  BoardSummary last_board_;
};

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
// GEMMs beside the bf16 ones, the quantisation kernels, the dense FP8 GEMM beside cuBLASLt;
// each kernel timed by `time` (bench::median_ms, or a SustainedTimer's under --sustain-ms).
void run_fp8_kernel_bench(const RunConfig& config, std::ostream& out, const bench::TimeFn& time);

}  // namespace moe
