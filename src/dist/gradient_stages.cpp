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

BlockRanges merged_ranges(const std::vector<std::vector<BlockRanges>>& stage_sets) {
  BlockRanges all;
  for (const auto& stages : stage_sets)
    for (const BlockRanges& stage : stages) all.insert(all.end(), stage.begin(), stage.end());
  std::sort(all.begin(), all.end());
  BlockRanges merged;
  for (const auto& [begin, count] : all) {
    MOE_CHECK(merged.empty() || merged.back().first + merged.back().second <= begin,
              "merged ranges: [{}, +{}) overlaps the range before it", begin, count);
    append_merged(merged, begin, count);
  }
  return merged;
}

void append_merged(BlockRanges& ranges, int64_t begin, int64_t count) {
  if (count <= 0) return;
  if (!ranges.empty() && ranges.back().first + ranges.back().second == begin)
    ranges.back().second += count;
  else
    ranges.emplace_back(begin, count);
}

namespace {

// The expert tensors (a parameter with an expert_group), by offset.
std::vector<int> expert_tensors_by_offset(const ParameterStore<float>& params) {
  std::vector<int> experts;
  for (int id = 0; id < params.size(); ++id)
    if (!params.spec(id).expert_group.empty()) experts.push_back(id);
  std::sort(experts.begin(), experts.end(), [&](int a, int b) { return params.offset(a) < params.offset(b); });
  return experts;
}

}  // namespace

ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, int64_t first_expert, int64_t local_experts) {
  MOE_CHECK(first_expert >= 0 && local_experts > 0, "gradient ranges: experts [{}, {} + {})", first_expert,
            first_expert, local_experts);
  BlockRanges own;
  for (int id : expert_tensors_by_offset(params)) {
    const int64_t n_experts = params.spec(id).shape[0];
    MOE_CHECK(first_expert + local_experts <= n_experts, "parameter {}: experts [{}, {}) of {}", params.spec(id).name,
              first_expert, first_expert + local_experts, n_experts);
    const int64_t per_expert = params.numel(id) / n_experts;
    own.emplace_back(params.offset(id) + first_expert * per_expert, local_experts * per_expert);
  }
  return gradient_ranges_by_stage_ep(params, stage_of, n_stages, own);
}

BlockRanges subtract_ranges(const BlockRanges& from, const BlockRanges& minus) {
  BlockRanges out;
  size_t j = 0;
  for (const auto& [begin, count] : from) {
    int64_t at = begin;
    const int64_t end = begin + count;
    while (j < minus.size() && minus[j].first + minus[j].second <= at) ++j;
    for (size_t k = j; k < minus.size() && minus[k].first < end; ++k) {
      append_merged(out, at, minus[k].first - at);
      at = std::max(at, minus[k].first + minus[k].second);
    }
    append_merged(out, at, end - at);
  }
  return out;
}

ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, const BlockRanges& own_expert_ranges,
                                                 const BlockRanges& split_expert_ranges) {
  const std::vector<BlockRanges> whole = gradient_ranges_by_stage(params, stage_of, n_stages);
  ExpertParallelRanges split;
  split.shared.resize(static_cast<size_t>(n_stages));
  split.own_experts.resize(static_cast<size_t>(n_stages));
  const std::vector<int> experts = expert_tensors_by_offset(params);
  // Every own and split range lies inside one expert tensor.
  for (const BlockRanges* set : {&own_expert_ranges, &split_expert_ranges})
    for (const auto& [begin, count] : *set) {
      const bool inside = std::any_of(experts.begin(), experts.end(), [&](int id) {
        return begin >= params.offset(id) && begin + count <= params.offset(id) + params.numel(id);
      });
      MOE_CHECK(inside && count > 0, "gradient ranges: expert range [{}, {}) is not inside one expert tensor", begin,
                begin + count);
    }
  const BlockRanges own_unsplit = subtract_ranges(own_expert_ranges, split_expert_ranges);
  std::vector<BlockRanges> plain(static_cast<size_t>(n_stages));  // the parameters without an expert_group
  // Every other element of a stage's ranges is shared.
  for (int s = 0; s < n_stages; ++s)
    for (const auto& [begin, count] : whole[static_cast<size_t>(s)]) {
      int64_t at = begin;
      const int64_t end = begin + count;
      for (int id : experts) {
        const int64_t offset = params.offset(id), numel = params.numel(id);
        if (offset + numel <= at || offset >= end) continue;
        append_merged(split.shared[static_cast<size_t>(s)], at, offset - at);
        append_merged(plain[static_cast<size_t>(s)], at, offset - at);
        for (const auto& [hinge, hinge_count] : split_expert_ranges)
          if (hinge >= offset && hinge < offset + numel) append_merged(split.shared[static_cast<size_t>(s)], hinge, hinge_count);
        for (const auto& [own, own_count] : own_unsplit)
          if (own >= offset && own < offset + numel)
            append_merged(split.own_experts[static_cast<size_t>(s)], own, own_count);
        at = offset + numel;
      }
      append_merged(split.shared[static_cast<size_t>(s)], at, end - at);
      append_merged(plain[static_cast<size_t>(s)], at, end - at);
    }
  split.stepped_ranges = merged_ranges({plain, {own_expert_ranges}});
  return split;
}

}  // namespace moe::dist
