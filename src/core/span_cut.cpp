#include "core/span_cut.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

std::vector<SpanPiece> cut_spans(const std::vector<std::pair<int64_t, int64_t>>& spans,
                                 const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  for (size_t i = 1; i < ranges.size(); ++i)
    MOE_CHECK(ranges[i].first >= ranges[i - 1].first + ranges[i - 1].second,
              "cut_spans: ranges must be sorted and disjoint ([{}, +{}) after [{}, +{}))", ranges[i].first,
              ranges[i].second, ranges[i - 1].first, ranges[i - 1].second);
  std::vector<SpanPiece> pieces;
  for (size_t span = 0; span < spans.size(); ++span) {
    const int64_t begin = spans[span].first, end = begin + spans[span].second;
    // The first range that ends after the span begins.
    auto it = std::upper_bound(ranges.begin(), ranges.end(), begin,
                               [](int64_t at, const std::pair<int64_t, int64_t>& r) { return at < r.first + r.second; });
    for (; it != ranges.end() && it->first < end; ++it) {
      const int64_t from = std::max(begin, it->first), to = std::min(end, it->first + it->second);
      if (from < to) pieces.push_back({span, from, to - from});
    }
  }
  return pieces;
}

}  // namespace moe
