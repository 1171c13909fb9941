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

// share_chunks: groups of one pool map their chunks without memory onto the same physical
// memory, in order (what one writes the other reads); other pools and private chunks are
// apart; the pools' bytes count as resident; the resident chunks are then fixed.
TEST(ResidentBlock, SharedChunksOfOnePoolAreOneMemory) {
  MOE_REQUIRE_GPU();
  constexpr int64_t kMiB = 1 << 20;
  gpu::ResidentBlock block(64 * kMiB);
  const int64_t chunk = static_cast<int64_t>(block.chunk_bytes());
  ASSERT_EQ(64 * kMiB % chunk, 0) << "the test assumes chunks that divide 64 MiB";
  ASSERT_GE(64 * kMiB / chunk, 16) << "the test needs 16 chunks";
  block.set_resident({{0, chunk}}, /*zero_new=*/true);  // private
  // Groups 0 and 2 share pool 0 (two chunks each), group 1 has pool 1; group 0 names the
  // private chunk too, which stays private.
  block.share_chunks({{{0, 3 * chunk}}, {{3 * chunk, chunk}}, {{6 * chunk, 2 * chunk}}}, {0, 1, 0});
  EXPECT_EQ(block.resident_bytes(), static_cast<size_t>(4 * chunk));  // 1 private + 2 + 1 pooled
  EXPECT_EQ(block.resident_ranges(), (RangeList{{0, 4 * chunk}, {6 * chunk, 2 * chunk}}));
  for (const Range& mapped : RangeList{{chunk, 3 * chunk}, {6 * chunk, 2 * chunk}})
    for (unsigned char byte : read(block, mapped.offset, mapped.count)) ASSERT_EQ(byte, 0) << "shared chunks start at zero";
  char* base = static_cast<char*>(block.data());
  ASSERT_EQ(cudaMemset(base + chunk, 0x11, static_cast<size_t>(chunk)), cudaSuccess);      // group 0, pool chunk 0
  ASSERT_EQ(cudaMemset(base + 3 * chunk, 0x33, static_cast<size_t>(chunk)), cudaSuccess);  // group 1
  ASSERT_EQ(cudaMemset(base + 7 * chunk, 0x77, static_cast<size_t>(chunk)), cudaSuccess);  // group 2, pool chunk 1
  for (unsigned char byte : read(block, 6 * chunk, chunk)) ASSERT_EQ(byte, 0x11) << "group 2's first chunk is group 0's";
  for (unsigned char byte : read(block, 2 * chunk, chunk)) ASSERT_EQ(byte, 0x77) << "group 0's second chunk is group 2's";
  for (unsigned char byte : read(block, 0, chunk)) ASSERT_EQ(byte, 0) << "the private chunk is apart";
  for (unsigned char byte : read(block, 3 * chunk, chunk)) ASSERT_EQ(byte, 0x33) << "pool 1 is apart";
  EXPECT_THROW(block.set_resident({{0, chunk}}), Error);
  EXPECT_THROW(block.share_chunks({}, {}), Error);
}

}  // namespace
}  // namespace moe
