#include "core/resident_chunks.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

int64_t resident_chunk_bytes(int64_t block_bytes, int64_t granularity) {
  MOE_CHECK(granularity > 0 && block_bytes >= 0, "resident chunks: {} bytes at a granularity of {}", block_bytes,
            granularity);
  const int64_t pages = (block_bytes + granularity - 1) / granularity;
  return granularity * std::max<int64_t>(1, (pages + kMaxResidentChunks - 1) / kMaxResidentChunks);
}

void mark_covering_chunks(const RangeList& byte_ranges, int64_t chunk_bytes, std::vector<char>& chunks) {
  for (const Range& range : byte_ranges) {
    if (range.count <= 0) continue;
    const auto last = static_cast<size_t>((range.end() - 1) / chunk_bytes);
    MOE_CHECK(range.offset >= 0 && last < chunks.size(), "resident chunks: bytes [{}, {}) outside {} chunks of {}",
              range.offset, range.end(), chunks.size(), chunk_bytes);
    for (auto c = static_cast<size_t>(range.offset / chunk_bytes); c <= last; ++c) chunks[c] = 1;
  }
}

int64_t covering_chunk_count(const RangeList& byte_ranges, int64_t chunk_bytes) {
  int64_t chunks = 0, next_free = 0;  // chunks before next_free are counted
  for (const Range& r : byte_ranges) {
    if (r.count <= 0) continue;
    const int64_t first = std::max(r.offset / chunk_bytes, next_free);
    const int64_t end = (r.end() + chunk_bytes - 1) / chunk_bytes;
    chunks += std::max<int64_t>(0, end - first);
    next_free = std::max(next_free, end);
  }
  return chunks;
}

std::vector<std::vector<int64_t>> assign_shared_chunks(const std::vector<RangeList>& group_byte_ranges,
                                                       int64_t chunk_bytes, std::vector<char>& taken) {
  std::vector<std::vector<int64_t>> chunks_of(group_byte_ranges.size());
  for (size_t g = 0; g < group_byte_ranges.size(); ++g)
    for (const Range& range : group_byte_ranges[g]) {
      if (range.count <= 0) continue;
      const auto last = static_cast<size_t>((range.end() - 1) / chunk_bytes);
      MOE_CHECK(range.offset >= 0 && last < taken.size(), "resident chunks: bytes [{}, {}) outside {} chunks of {}",
                range.offset, range.end(), taken.size(), chunk_bytes);
      for (auto c = static_cast<size_t>(range.offset / chunk_bytes); c <= last; ++c)
        if (!taken[c]) {
          taken[c] = 1;
          chunks_of[g].push_back(static_cast<int64_t>(c));
        }
    }
  return chunks_of;
}

std::vector<int64_t> pool_chunk_counts(const std::vector<std::vector<int64_t>>& chunks_of_group,
                                       const std::vector<int>& pool_of_group) {
  MOE_CHECK(chunks_of_group.size() == pool_of_group.size(), "resident chunks: {} groups, {} pool indices",
            chunks_of_group.size(), pool_of_group.size());
  std::vector<int64_t> counts;
  for (size_t g = 0; g < pool_of_group.size(); ++g) {
    MOE_CHECK(pool_of_group[g] >= 0, "resident chunks: pool {} for group {}", pool_of_group[g], g);
    const auto pool = static_cast<size_t>(pool_of_group[g]);
    if (counts.size() <= pool) counts.resize(pool + 1, 0);
    counts[pool] = std::max(counts[pool], static_cast<int64_t>(chunks_of_group[g].size()));
  }
  return counts;
}

}  // namespace moe
