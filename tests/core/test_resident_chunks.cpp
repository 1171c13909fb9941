// ResidentBlock's chunk arithmetic as host code (core/resident_chunks.h), which the GPU
// block and the memory planner share: the chunk of a block, the chunks a set of ranges
// covers, and which chunks share_chunks maps onto which pool.
#include "core/resident_chunks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace moe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(ResidentChunks, ChunksGrowOnlyPastAMillionOfThem) {
  EXPECT_EQ(resident_chunk_bytes(1, 2 * kMiB), 2 * kMiB);
  EXPECT_EQ(resident_chunk_bytes(int64_t{2} << 40, 2 * kMiB), 2 * kMiB);  // 2 TiB: 2^20 chunks of 2 MiB
  EXPECT_EQ(resident_chunk_bytes((int64_t{2} << 40) + 1, 2 * kMiB), 4 * kMiB);
  EXPECT_EQ(resident_chunk_bytes(int64_t{5} << 40, 2 * kMiB), 6 * kMiB);  // 2.5 x 2^20 pages
}

TEST(ResidentChunks, CoveringChunksCountedAndMarkedAlike) {
  const int64_t chunk = 100;
  // [0, 1) and [99, 101) share chunk 0; [250, 250) is empty; [300, 700) covers 3-6.
  const RangeList ranges = {{0, 1}, {99, 2}, {250, 0}, {300, 400}, {950, 50}};
  std::vector<char> marked(10, 0);
  mark_covering_chunks(ranges, chunk, marked);
  EXPECT_EQ(marked, (std::vector<char>{1, 1, 0, 1, 1, 1, 1, 0, 0, 1}));
  EXPECT_EQ(covering_chunk_count(ranges, chunk), 7);
  EXPECT_EQ(covering_chunk_count({}, chunk), 0);
  EXPECT_THROW(mark_covering_chunks({{950, 51}}, chunk, marked), Error);  // past the last chunk
}

TEST(ResidentChunks, ASharedChunkGoesToTheFirstGroupNamingIt) {
  const int64_t chunk = 10;
  std::vector<char> taken(8, 0);
  taken[2] = 1;  // memory of its own
  // Group 0: chunks 0-3 (2 is taken); group 1: 3 (group 0's already) and 5-6; group 2: 7.
  const std::vector<RangeList> groups = {{{0, 40}}, {{35, 5}, {50, 20}}, {{75, 1}}};
  const std::vector<std::vector<int64_t>> chunks = assign_shared_chunks(groups, chunk, taken);
  EXPECT_EQ(chunks, (std::vector<std::vector<int64_t>>{{0, 1, 3}, {5, 6}, {7}}));
  EXPECT_EQ(taken, (std::vector<char>{1, 1, 1, 1, 0, 1, 1, 1}));
  // Pools by parity: pool 0 holds the larger of groups 0 and 2, pool 1 group 1's.
  EXPECT_EQ(pool_chunk_counts(chunks, {0, 1, 0}), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(pool_chunk_counts(chunks, {1, 1, 1}), (std::vector<int64_t>{0, 3}));
  EXPECT_THROW(pool_chunk_counts(chunks, {0, 1}), Error);
}

}  // namespace
}  // namespace moe
