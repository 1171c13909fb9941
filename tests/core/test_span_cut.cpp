// cut_spans: each span's parts inside sorted disjoint ranges, span order kept.
#include <gtest/gtest.h>

#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/span_cut.h"

namespace moe {
namespace {

TEST(SpanCut, PartsOfEachSpanInsideTheRanges) {
  const std::vector<std::pair<int64_t, int64_t>> ranges = {{10, 10}, {30, 5}, {40, 100}};
  // Spans out of offset order (as per-expert slices are), one across three ranges, one
  // outside all of them, one empty.
  const std::vector<std::pair<int64_t, int64_t>> spans = {{50, 20}, {0, 45}, {20, 10}, {60, 0}};
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

}  // namespace
}  // namespace moe
