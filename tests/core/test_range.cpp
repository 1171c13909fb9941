// Ranges of a flat block: merging, subtracting, cutting spans to them.
#include <gtest/gtest.h>

#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/range.h"

namespace moe {
namespace {

TEST(Range, PartsOfEachSpanInsideTheRanges) {
  const RangeList ranges = {{10, 10}, {30, 5}, {40, 100}};
  // Spans out of offset order (as per-expert slices are), one across three ranges, one
  // outside all of them, one empty.
  const RangeList spans = {{50, 20}, {0, 45}, {20, 10}, {60, 0}};
  const std::vector<SpanPiece> pieces = cut_spans(spans, ranges);
  const std::vector<std::tuple<size_t, int64_t, int64_t>> want = {{0, 50, 20}, {1, 10, 10}, {1, 30, 5}, {1, 40, 5}};
  ASSERT_EQ(pieces.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(pieces[i].span, std::get<0>(want[i])) << i;
    EXPECT_EQ(pieces[i].offset, std::get<1>(want[i])) << i;
    EXPECT_EQ(pieces[i].count, std::get<2>(want[i])) << i;
  }
  EXPECT_TRUE(cut_spans(spans, {}).empty());
  EXPECT_THROW(cut_spans(spans, {{10, 10}, {15, 10}}), Error);  // overlapping ranges
}

TEST(Range, AppendMergesTouchingRangesAndSubtractLeavesTheRest) {
  RangeList ranges;
  append_merged(ranges, 0, 4);
  append_merged(ranges, 4, 2);   // touches: merged
  append_merged(ranges, 8, 0);   // empty: nothing
  append_merged(ranges, 10, 3);  // a gap: a new range
  EXPECT_EQ(ranges, (RangeList{{0, 6}, {10, 3}}));
  EXPECT_EQ(total_count(ranges), 9);
  EXPECT_EQ(ranges.back().end(), 13);
  EXPECT_EQ(subtract_ranges({{0, 10}, {20, 10}}, {{2, 3}, {9, 12}, {29, 5}}), (RangeList{{0, 2}, {5, 4}, {21, 8}}));
  EXPECT_EQ(subtract_ranges({{0, 10}}, {}), (RangeList{{0, 10}}));
  EXPECT_EQ(intersect_ranges({{0, 10}, {20, 10}}, {{2, 3}, {9, 12}, {29, 5}}), (RangeList{{2, 3}, {9, 1}, {20, 1}, {29, 1}}));
  EXPECT_TRUE(intersect_ranges({{0, 10}}, {}).empty());
  EXPECT_TRUE(subtract_ranges({{3, 4}}, {{0, 10}}).empty());
  // Union: any order, overlapping, touching and empty ranges.
  EXPECT_EQ(merge_ranges({{20, 5}, {0, 4}, {2, 3}, {5, 1}, {30, 0}, {24, 2}, {40, 1}}),
            (RangeList{{0, 6}, {20, 6}, {40, 1}}));
  EXPECT_TRUE(merge_ranges({}).empty());
}

}  // namespace
}  // namespace moe
