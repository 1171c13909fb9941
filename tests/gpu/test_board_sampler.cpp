// BoardSampler on a real board: while the GPU copies memory for about a second it
// collects samples every period, each with an SM clock and a power draw within the
// board's maximum clock and about its limit; start() drops the earlier samples; stop()
// stops the collection.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "gpu_test_util.h"
#include "obs/cuda/board_sampler.h"

namespace moe {
namespace {

TEST(GpuBoardSampler, SamplesClockAndPowerWhileTheGpuWorks) {
  MOE_REQUIRE_GPU();
  BoardSampler sampler(std::chrono::milliseconds(20));
  ASSERT_TRUE(sampler.available()) << sampler.unavailable_reason();
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, bytes), cudaSuccess);
  sampler.start();
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(800);
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 20; ++i) ASSERT_EQ(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  sampler.stop();
  const std::vector<BoardSample> samples = sampler.samples();
  const BoardSummary s = sampler.summary();
  std::printf("  %s\n", describe_board(s).c_str());
  EXPECT_GE(samples.size(), 10u) << "20 ms period over at least 800 ms";
  EXPECT_EQ(s.samples, static_cast<int64_t>(samples.size()));
  EXPECT_GT(s.max_sm_mhz, 0.0);
  EXPECT_GT(s.power_limit_w, 0.0);
  for (const BoardSample& x : samples) {
    EXPECT_GT(x.sm_mhz, 0.0);
    EXPECT_LE(x.sm_mhz, s.max_sm_mhz);
    EXPECT_GT(x.power_w, 0.0);
    EXPECT_LT(x.power_w, 1.5 * s.power_limit_w);
  }
  // Stopped: nothing more comes in.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(sampler.samples().size(), samples.size());
  // start() drops the earlier samples.
  sampler.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  sampler.stop();
  EXPECT_GE(sampler.samples().size(), 1u);
  EXPECT_LT(sampler.samples().size(), samples.size());
  cudaFree(a);
  cudaFree(b);
}

}  // namespace
}  // namespace moe
