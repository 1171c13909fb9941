// Offset-count ranges of a flat block (the parameter, gradient and moment blocks): what a
// backward stage completes, a ZeRO rank's pieces, an expert-parallel rank's experts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe {

// [offset, offset + count).
struct Range {
  int64_t offset = 0, count = 0;
  int64_t end() const { return offset + count; }
  bool operator==(const Range&) const = default;
  auto operator<=>(const Range&) const = default;
};

// Ranges of one block; sorted and disjoint wherever a function below asks for it.
using RangeList = std::vector<Range>;

// Appends [offset, offset + count) (nothing when count <= 0), merged into the last range
// when the two touch.
void append_merged(RangeList& ranges, int64_t offset, int64_t count);

// The union of `ranges` (any order, overlaps allowed): sorted, disjoint, touching ones
// merged, empty ones dropped.
RangeList merge_ranges(RangeList ranges);

// The parts of sorted, disjoint `from` outside sorted, disjoint `minus`.
RangeList subtract_ranges(const RangeList& from, const RangeList& minus);
// The parts of sorted, disjoint `from` inside sorted, disjoint `with`.
RangeList intersect_ranges(const RangeList& from, const RangeList& with);

// Sum of the counts.
int64_t total_count(const RangeList& ranges);

struct SpanPiece {
  size_t span = 0;  // index into the spans given
  int64_t offset = 0, count = 0;
};

// The parts of each span that lie inside `ranges` (sorted, disjoint): span after span in
// the given order, each span's parts in offset order. A sharded optimizer's segments and
// per-expert slices are its parameters' spans cut to the ranges one rank steps.
std::vector<SpanPiece> cut_spans(const RangeList& spans, const RangeList& ranges);

}  // namespace moe
