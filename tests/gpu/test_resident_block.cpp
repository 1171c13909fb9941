// gpu::ResidentBlock: addresses for the whole block, memory for the resident chunks only;
// chunks that stay keep their contents, new ones can start at zero.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/cuda/resident_block.h"
#include "core/error.h"
#include "core/gpu.h"
#include "gpu_test_util.h"

namespace moe {
namespace {

std::vector<unsigned char> read(const gpu::ResidentBlock& block, int64_t offset, int64_t bytes) {
  std::vector<unsigned char> host(static_cast<size_t>(bytes));
  EXPECT_EQ(cudaMemcpy(host.data(), static_cast<const char*>(block.data()) + offset, host.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

TEST(ResidentBlock, MapsTheChunksOfTheRangesAndKeepsWhatStays) {
  MOE_REQUIRE_GPU();
  constexpr int64_t kMiB = 1 << 20;
  gpu::ResidentBlock block(64 * kMiB);
  const int64_t chunk = static_cast<int64_t>(block.chunk_bytes());
  ASSERT_GT(chunk, 0);
  ASSERT_EQ(64 * kMiB % chunk, 0) << "the test assumes chunks that divide 64 MiB";
  EXPECT_EQ(block.resident_bytes(), 0u);
  const size_t before = gpu::device_bytes_in_use();
  // One and a half chunks: two chunks resident.
  block.set_resident({{0, chunk + chunk / 2}});
  EXPECT_EQ(block.resident_bytes(), static_cast<size_t>(2 * chunk));
  EXPECT_EQ(block.resident_ranges(), (RangeList{{0, 2 * chunk}}));
  EXPECT_GE(gpu::device_bytes_in_use(), before + static_cast<size_t>(2 * chunk));
  ASSERT_EQ(cudaMemset(block.data(), 0x5a, static_cast<size_t>(2 * chunk)), cudaSuccess);
  // Keep the first chunk, drop the second, take one further on (zeroed).
  block.set_resident({{10, 20}, {5 * chunk + 7, 3}}, /*zero_new=*/true);
  EXPECT_EQ(block.resident_ranges(), (RangeList{{0, chunk}, {5 * chunk, chunk}}));
  EXPECT_EQ(block.resident_bytes(), static_cast<size_t>(2 * chunk));
  for (unsigned char byte : read(block, 0, chunk)) ASSERT_EQ(byte, 0x5a) << "a chunk that stays keeps its contents";
  for (unsigned char byte : read(block, 5 * chunk, chunk)) ASSERT_EQ(byte, 0) << "a new chunk starts at zero";
  block.set_resident({});
  EXPECT_EQ(block.resident_bytes(), 0u);
  EXPECT_THROW(block.set_resident({{60 * kMiB, 8 * kMiB}}), Error);  // past the end
  EXPECT_EQ(block.resident_bytes(), 0u);
}

}  // namespace
}  // namespace moe
