#include "dist/gradient_stages.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace moe::dist {

std::vector<BlockRanges> gradient_ranges_by_stage(const ParameterStore<float>& params,
                                                  const std::function<int(const std::string&)>& stage_of,
                                                  int n_stages) {
  MOE_CHECK(n_stages > 0, "gradient ranges: {} backward stages", n_stages);
  std::vector<int> ids(static_cast<size_t>(params.size()));
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](int a, int b) { return params.offset(a) < params.offset(b); });
  std::vector<BlockRanges> ranges(static_cast<size_t>(n_stages));
  const int64_t block_end = params.storage_numel();
  for (size_t i = 0; i < ids.size(); ++i) {
    const int id = ids[i];
    const int stage = stage_of(params.spec(id).name);
    MOE_CHECK(stage >= 0 && stage < n_stages, "parameter {}: backward stage {} outside [0, {})", params.spec(id).name,
              stage, n_stages);
    // From this parameter to the next one (or the block's end): its padding comes along.
    const int64_t begin = i == 0 ? 0 : params.offset(id);
    const int64_t end = i + 1 < ids.size() ? params.offset(ids[i + 1]) : block_end;
    if (end <= begin) continue;
    BlockRanges& mine = ranges[static_cast<size_t>(stage)];
    if (!mine.empty() && mine.back().first + mine.back().second == begin)
      mine.back().second += end - begin;
    else
      mine.emplace_back(begin, end - begin);
  }
  return ranges;
}

}  // namespace moe::dist
