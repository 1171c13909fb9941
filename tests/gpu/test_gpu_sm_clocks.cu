// The phase clock's SM clocks (core/cuda/sm_clocks.h): a phase's clock is the one its kernel
// reads on its own SMs over the same time, an interval is charged to the phase its first
// mark began and to no other, and each take starts the sums afresh.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/cuda/device_clock.cuh"
#include "core/cuda/phase_clock.h"
#include "core/gpu.h"

namespace moe {
namespace {

// Spins for `ns` on each block's SM and writes the clock it counted there, in MHz.
__global__ void spin_kernel(unsigned long long ns, double* mhz_of_block) {
  const unsigned long long t0 = gpu::global_ns();
  const long long c0 = clock64();
  unsigned long long t = t0;
  while (t - t0 < ns) t = gpu::global_ns();
  const long long c1 = clock64();
  if (threadIdx.x == 0) mhz_of_block[blockIdx.x] = 1e3 * static_cast<double>(c1 - c0) / static_cast<double>(t - t0);
}

TEST(GpuSmClocks, APhasesClockIsWhatItsKernelCountsOnItsSms) {
  gpu::PhaseClock clock({"idle", "spin", "after"});
  EXPECT_TRUE(clock.take_sm_mhz().empty());  // off
  clock.set_enabled(true);
  clock.set_sm_clocks(true);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const int sms = gpu::multiprocessor_count();
  gpu::DeviceArray<double> kernel_mhz(static_cast<size_t>(sms));
  clock.mark(0, stream);
  clock.mark(1, stream);
  spin_kernel<<<sms, 128, 0, stream>>>(20'000'000ull, kernel_mhz.data());  // 20 ms on every SM
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  clock.mark(2, stream);
  const auto times = clock.take();
  const std::vector<double> mhz = clock.take_sm_mhz();
  std::vector<double> inside(static_cast<size_t>(sms));
  kernel_mhz.download(inside.data(), inside.size());
  std::sort(inside.begin(), inside.end());
  const double median = inside[inside.size() / 2];
  ASSERT_EQ(mhz.size(), 3u);
  EXPECT_GT(median, 300.0);
  EXPECT_NEAR(mhz[1], median, 0.03 * median) << "the spin phase's clock against the kernel's own count";
  EXPECT_GT(mhz[0], 0.0);    // the stamps' short interval between the first two marks
  EXPECT_EQ(mhz[2], 0.0);    // no mark after the last: no interval charged to it
  EXPECT_NEAR(times[1].second, 20.0, 2.0);

  // The sums start again after a take: the interval from the last mark to the next one
  // is the "after" phase's, nothing else has any.
  clock.mark(0, stream);
  clock.take();
  const std::vector<double> again = clock.take_sm_mhz();
  EXPECT_EQ(again[0], 0.0);
  EXPECT_EQ(again[1], 0.0);
  EXPECT_GT(again[2], 0.0);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace moe
