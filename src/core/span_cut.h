// Cutting spans of a flat block to a set of ranges: a sharded optimizer's segments and
// per-expert slices are its parameters' spans cut to the ranges one rank steps.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace moe {

struct SpanPiece {
  size_t span = 0;  // index into the spans given
  int64_t offset = 0, count = 0;
};

// The parts of each span [offset, offset + count) that lie inside `ranges` (sorted,
// disjoint [offset, count) pairs): span after span in the given order, each span's parts
// in offset order.
std::vector<SpanPiece> cut_spans(const std::vector<std::pair<int64_t, int64_t>>& spans,
                                 const std::vector<std::pair<int64_t, int64_t>>& ranges);

}  // namespace moe
