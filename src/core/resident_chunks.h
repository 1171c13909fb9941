// gpu::ResidentBlock's chunk arithmetic as host code (core/cuda/resident_block.h): how
// large a block's chunks are, which chunks a set of byte ranges covers, and which chunks
// share_chunks maps onto its pools. The GPU block calls these, and the memory planner
// (train/state_memory.h) counts the same chunks without a GPU.
#pragma once
#include <cstdint>
#include <vector>

#include "core/range.h"

namespace moe {

// At most this many chunks per block (2 TiB at the usual 2 MiB granularity): larger chunks
// would waste up to a chunk at each edge of every resident range.
constexpr int64_t kMaxResidentChunks = int64_t{1} << 20;

// The chunk of a block of `block_bytes`: the smallest multiple of the device's mapping
// `granularity` that keeps the block within kMaxResidentChunks chunks.
int64_t resident_chunk_bytes(int64_t block_bytes, int64_t granularity);

// Marks in `chunks` (one flag per chunk) the chunks of `chunk_bytes` that cover
// `byte_ranges` (empty ranges cover none).
void mark_covering_chunks(const RangeList& byte_ranges, int64_t chunk_bytes, std::vector<char>& chunks);

// The number of chunks mark_covering_chunks marks for `byte_ranges` (sorted, disjoint),
// without a flag per chunk: the planner counts blocks of every EP rank of huge models.
int64_t covering_chunk_count(const RangeList& byte_ranges, int64_t chunk_bytes);

// share_chunks' assignment: for each group in order, the chunks covering its byte ranges
// that are not `taken` yet, in order; each is then marked taken, so a chunk goes to the
// first group naming it. `taken` comes in with the chunks that hold memory of their own.
std::vector<std::vector<int64_t>> assign_shared_chunks(const std::vector<RangeList>& group_byte_ranges,
                                                       int64_t chunk_bytes, std::vector<char>& taken);

// Per pool 0 .. max(pool_of_group), the chunks it needs: the most any of its groups has.
std::vector<int64_t> pool_chunk_counts(const std::vector<std::vector<int64_t>>& chunks_of_group,
                                       const std::vector<int>& pool_of_group);

}  // namespace moe
