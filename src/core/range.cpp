#include "core/range.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

void append_merged(RangeList& ranges, int64_t offset, int64_t count) {
  if (count <= 0) return;
  if (!ranges.empty() && ranges.back().end() == offset)
    ranges.back().count += count;
  else
    ranges.push_back({offset, count});
}

RangeList merge_ranges(RangeList ranges) {
  std::sort(ranges.begin(), ranges.end());
  RangeList merged;
  for (const Range& r : ranges) {
    if (r.count <= 0) continue;
    if (!merged.empty() && r.offset <= merged.back().end())
      merged.back().count = std::max(merged.back().end(), r.end()) - merged.back().offset;
    else
      merged.push_back(r);
  }
  return merged;
}

RangeList subtract_ranges(const RangeList& from, const RangeList& minus) {
  RangeList out;
  size_t j = 0;
  for (const Range& range : from) {
    int64_t at = range.offset;
    while (j < minus.size() && minus[j].end() <= at) ++j;
    for (size_t k = j; k < minus.size() && minus[k].offset < range.end(); ++k) {
      append_merged(out, at, minus[k].offset - at);
      at = std::max(at, minus[k].end());
    }
    append_merged(out, at, range.end() - at);
  }
  return out;
}

RangeList intersect_ranges(const RangeList& from, const RangeList& with) {
  return subtract_ranges(from, subtract_ranges(from, with));
}

int64_t total_count(const RangeList& ranges) {
  int64_t total = 0;
  for (const Range& range : ranges) total += range.count;
  return total;
}

std::vector<SpanPiece> cut_spans(const RangeList& spans, const RangeList& ranges) {
  for (size_t i = 1; i < ranges.size(); ++i)
    MOE_CHECK(ranges[i].offset >= ranges[i - 1].end(),
              "cut_spans: ranges must be sorted and disjoint ([{}, +{}) after [{}, +{}))", ranges[i].offset,
              ranges[i].count, ranges[i - 1].offset, ranges[i - 1].count);
  std::vector<SpanPiece> pieces;
  for (size_t span = 0; span < spans.size(); ++span) {
    const int64_t begin = spans[span].offset, end = spans[span].end();
    // The first range that ends after the span begins.
    auto it = std::upper_bound(ranges.begin(), ranges.end(), begin,
                               [](int64_t at, const Range& r) { return at < r.end(); });
    for (; it != ranges.end() && it->offset < end; ++it) {
      const int64_t from = std::max(begin, it->offset), to = std::min(end, it->end());
      if (from < to) pieces.push_back({span, from, to - from});
    }
  }
  return pieces;
}

}  // namespace moe
