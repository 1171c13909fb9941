#include "dist/gradient_stages.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace moe::dist {

std::vector<RangeList> gradient_ranges_by_stage(const ParameterStore<float>& params,
                                                  const std::function<int(const std::string&)>& stage_of,
                                                  int n_stages) {
  std::vector<int64_t> offsets(static_cast<size_t>(params.size()) + 1);
  for (int id = 0; id < params.size(); ++id) offsets[static_cast<size_t>(id)] = params.offset(id);
  offsets.back() = params.storage_numel();
  return gradient_ranges_by_stage(params, offsets, stage_of, n_stages);
}

std::vector<RangeList> gradient_ranges_by_stage(const ParameterStore<float>& params,
                                                  const std::vector<int64_t>& offsets,
                                                  const std::function<int(const std::string&)>& stage_of,
                                                  int n_stages) {
  MOE_CHECK(n_stages > 0, "gradient ranges: {} backward stages", n_stages);
  MOE_CHECK(offsets.size() == static_cast<size_t>(params.size()) + 1, "gradient ranges: {} offsets for {} parameters",
            offsets.size(), params.size());
  const auto offset = [&](int id) { return offsets[static_cast<size_t>(id)]; };
  std::vector<int> ids(static_cast<size_t>(params.size()));
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](int a, int b) { return offset(a) < offset(b); });
  std::vector<RangeList> ranges(static_cast<size_t>(n_stages));
  const int64_t block_end = offsets.back();
  for (size_t i = 0; i < ids.size(); ++i) {
    const int id = ids[i];
    const int stage = stage_of(params.spec(id).name);
    MOE_CHECK(stage >= 0 && stage < n_stages, "parameter {}: backward stage {} outside [0, {})", params.spec(id).name,
              stage, n_stages);
    // From this parameter to the next one (or the block's end): its padding comes along.
    const int64_t begin = i == 0 ? 0 : offset(id);
    const int64_t end = i + 1 < ids.size() ? offset(ids[i + 1]) : block_end;
    if (end <= begin) continue;
    RangeList& mine = ranges[static_cast<size_t>(stage)];
    append_merged(mine, begin, end - begin);
  }
  return ranges;
}

RangeList merged_ranges(const std::vector<std::vector<RangeList>>& stage_sets) {
  RangeList all;
  for (const auto& stages : stage_sets)
    for (const RangeList& stage : stages) all.insert(all.end(), stage.begin(), stage.end());
  std::sort(all.begin(), all.end());
  RangeList merged;
  for (const auto& [begin, count] : all) {
    MOE_CHECK(merged.empty() || merged.back().end() <= begin,
              "merged ranges: [{}, +{}) overlaps the range before it", begin, count);
    append_merged(merged, begin, count);
  }
  return merged;
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
  RangeList own;
  for (int id : expert_tensors_by_offset(params)) {
    const int64_t n_experts = params.spec(id).shape[0];
    MOE_CHECK(first_expert + local_experts <= n_experts, "parameter {}: experts [{}, {}) of {}", params.spec(id).name,
              first_expert, first_expert + local_experts, n_experts);
    const int64_t per_expert = params.numel(id) / n_experts;
    own.push_back({params.offset(id) + first_expert * per_expert, local_experts * per_expert});
  }
  return gradient_ranges_by_stage_ep(params, stage_of, n_stages, own);
}

ExpertParallelRanges gradient_ranges_by_stage_ep(const ParameterStore<float>& params,
                                                 const std::function<int(const std::string&)>& stage_of,
                                                 int n_stages, const RangeList& own_experts,
                                                 const RangeList& hinges) {
  RangeList tensors;
  for (int id : expert_tensors_by_offset(params)) tensors.push_back({params.offset(id), params.numel(id)});
  return split_expert_stages(gradient_ranges_by_stage(params, stage_of, n_stages), tensors, own_experts, hinges);
}

ExpertParallelRanges split_expert_stages(const std::vector<RangeList>& whole, const RangeList& expert_tensors,
                                         const RangeList& own_experts, const RangeList& hinges) {
  const auto n_stages = whole.size();
  ExpertParallelRanges split;
  split.shared.resize(n_stages);
  split.own_experts.resize(n_stages);
  // Every own and split range lies inside one expert tensor.
  for (const RangeList* set : {&own_experts, &hinges})
    for (const auto& [begin, count] : *set) {
      const bool inside = std::any_of(expert_tensors.begin(), expert_tensors.end(),
                                      [&](const Range& t) { return begin >= t.offset && begin + count <= t.end(); });
      MOE_CHECK(inside && count > 0, "gradient ranges: expert range [{}, {}) is not inside one expert tensor", begin,
                begin + count);
    }
  const RangeList own_unsplit = subtract_ranges(own_experts, hinges);
  std::vector<RangeList> plain(n_stages);  // the parameters without an expert_group
  // Every other element of a stage's ranges is shared.
  for (size_t s = 0; s < n_stages; ++s)
    for (const auto& [begin, count] : whole[s]) {
      int64_t at = begin;
      const int64_t end = begin + count;
      for (const auto& [offset, numel] : expert_tensors) {
        if (offset + numel <= at || offset >= end) continue;
        append_merged(split.shared[s], at, offset - at);
        append_merged(plain[s], at, offset - at);
        for (const auto& [hinge, hinge_count] : hinges)
          if (hinge >= offset && hinge < offset + numel) append_merged(split.shared[s], hinge, hinge_count);
        for (const auto& [own, own_count] : own_unsplit)
          if (own >= offset && own < offset + numel) append_merged(split.own_experts[s], own, own_count);
        at = offset + numel;
      }
      append_merged(split.shared[s], at, end - at);
      append_merged(plain[s], at, end - at);
    }
  split.stepped_ranges = merged_ranges({plain, {own_experts}});
  return split;
}

}  // namespace moe::dist
