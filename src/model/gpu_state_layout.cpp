#include "model/gpu_state_layout.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/adamw_math.h"

namespace moe {

std::vector<int> fp32_copy_ids(const ParameterStore<float>& specs) {
  std::vector<int> ids;
  for (int id = 0; id < specs.size(); ++id)
    if (specs.spec(id).name.ends_with(".moe.router.bias")) ids.push_back(id);
  return ids;
}

PackedState packed_state_layout(const RangeList& ranges) {
  PackedState packed;
  int64_t next = 0;
  for (const Range& r : ranges) {
    next = (next + 15) / 16 * 16 + r.offset % 16;
    packed.at.push_back(next);
    next += r.count;
  }
  packed.total = (next + 15) / 16 * 16;
  return packed;
}

StageSharing share_by_stages(const RangeList& kept, const std::vector<RangeList>& stage_ranges) {
  MOE_CHECK(stage_ranges.size() >= 3, "GPU parameters: sharing a block by stages needs 3+ stages, got {}",
            stage_ranges.size());
  StageSharing sharing;
  RangeList own = kept;
  const size_t last = stage_ranges.size() - 1;
  for (size_t stage = 0; stage <= last; ++stage)
    for (const Range& r : stage_ranges[stage]) {
      if (stage == 0 || stage == last) {
        own.push_back(r);
      } else {
        own.push_back({r.offset, 1});
        own.push_back({r.end() - 1, 1});
      }
    }
  sharing.own = merge_ranges(std::move(own));
  for (size_t stage = 1; stage < last; ++stage) {
    sharing.groups.push_back(subtract_ranges(stage_ranges[stage], sharing.own));
    sharing.pools.push_back(static_cast<int>(stage % 2));
  }
  return sharing;
}

RangeList byte_ranges(const RangeList& elements, int64_t elem_bytes) {
  RangeList out;
  out.reserve(elements.size());
  for (const Range& r : elements) out.push_back({r.offset * elem_bytes, r.count * elem_bytes});
  return out;
}

int64_t HiInterleave::hi_offset(int64_t offset) const {
  MOE_CHECK(offset >= first && offset < end(), "interleaved gate|up: element {} outside [{}, {})", offset, first, end());
  const int64_t within = offset - first, tensor_numel = experts * per_expert;
  const int64_t t = within / tensor_numel, e = within % tensor_numel / per_expert, k = within % per_expert;
  return first + (2 * e + t) * per_expert + k;
}

std::vector<HiRun> hi_runs(const std::vector<HiInterleave>& pairs, Range r) {
  std::vector<HiRun> runs;
  int64_t at = r.offset;
  const int64_t end = r.end();
  for (const HiInterleave& pair : pairs) {
    if (at >= end) break;
    if (pair.end() <= at) continue;
    if (at < pair.first) {  // the piece before the pair: in place
      const int64_t n = std::min(end, pair.first) - at;
      runs.push_back({at, at, n});
      at += n;
    }
    while (at < end && at < pair.end()) {  // up to the end of at's expert slice
      const int64_t n = std::min({end, pair.end(), at + pair.per_expert - (at - pair.first) % pair.per_expert}) - at;
      runs.push_back({at, pair.hi_offset(at), n});
      at += n;
    }
  }
  if (at < end) runs.push_back({at, at, end - at});
  return runs;
}

RangeList hi_ranges(const std::vector<HiInterleave>& pairs, const RangeList& ranges) {
  RangeList out;
  for (const Range& r : ranges)
    for (const HiRun& run : hi_runs(pairs, r)) out.push_back({run.hi, run.count});
  std::sort(out.begin(), out.end());
  return merge_ranges(out);
}

std::vector<HiInterleave> gate_up_pairs(const std::vector<std::pair<Range, Range>>& w1_w3, int64_t experts) {
  std::vector<HiInterleave> pairs;
  if (experts <= 0) return pairs;
  for (const auto& [w1, w3] : w1_w3) {
    const int64_t per_expert = w1.count / experts;
    if (w3.offset != w1.end() || w3.count != w1.count || per_expert <= 0 || per_expert * experts != w1.count ||
        per_expert % adamw_math::kNormChunk != 0)
      return {};
    pairs.push_back({w1.offset, experts, per_expert});
  }
  return pairs;
}

}  // namespace moe
