#include "dist/zero_shards.h"

#include <algorithm>

#include "core/error.h"

namespace moe::dist {
namespace {

RangeList sorted_merged(RangeList ranges) {
  std::sort(ranges.begin(), ranges.end());
  RangeList out;
  for (const auto& [begin, count] : ranges) append_merged(out, begin, count);
  return out;
}

// The buckets of `sharded` where the store's hi halves keep them (ZeroShardPlan::weight_gathers):
// outside the pairs themselves; inside one expert slice their hi image; whole slices of w1,
// [e, e + n), the hi range of w1_e .. w3_{e+n-1}, which also holds w3's twin bucket's.
RangeList weight_gathers(const RangeList& sharded, const std::vector<HiInterleave>& pairs, int ranks) {
  RangeList gathers;
  for (const Range& b : sharded) {
    const auto pair = std::find_if(pairs.begin(), pairs.end(),
                                   [&](const HiInterleave& p) { return b.offset >= p.first && b.offset < p.end(); });
    if (pair == pairs.end()) {
      gathers.push_back(b);
      continue;
    }
    const int64_t within = b.offset - pair->first, tensor = pair->experts * pair->per_expert;
    const int64_t phase = within % pair->per_expert;
    if (b.count <= pair->per_expert - phase) {
      gathers.push_back({pair->hi_offset(b.offset), b.count});
      continue;
    }
    MOE_CHECK(phase == 0 && b.count % (pair->per_expert * ranks) == 0 && b.end() <= pair->end(),
              "ZeRO shards: bucket [{}, +{}) crosses an expert slice of the interleaved pair at {} in part", b.offset,
              b.count, pair->first);
    if (within < tensor) gathers.push_back({pair->hi_offset(b.offset), 2 * b.count});
  }
  std::sort(gathers.begin(), gathers.end());
  return gathers;
}

}  // namespace

int64_t gradient_bucket_elems(double bucket_mb, int64_t block_numel) {
  MOE_CHECK(bucket_mb >= 0, "parallel.bucket_mb must be >= 0, got {}", bucket_mb);
  MOE_CHECK(block_numel > 0, "gradient buckets over a block of {} elements", block_numel);
  constexpr int64_t kBucketAlign = 64;
  if (bucket_mb == 0) return block_numel;
  const int64_t per_bucket = static_cast<int64_t>(bucket_mb * 1e6 / sizeof(float)) / kBucketAlign * kBucketAlign;
  return std::min(std::max(per_bucket, kBucketAlign), block_numel);
}

ZeroShardPlan plan_zero_shards(const std::vector<RangeList>& stage_ranges, const RangeList& keep_whole,
                               int64_t bucket_elems, int ranks, int rank, const std::vector<HiInterleave>& pairs) {
  MOE_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "ZeRO shards: rank {} of {}", rank, ranks);
  MOE_CHECK(bucket_elems > 0, "ZeRO shards: {} elements per bucket", bucket_elems);
  const int64_t unit = kZeroAlign * ranks;
  const int64_t per_bucket = std::max(unit, bucket_elems / unit * unit);
  // What a stage's ranges are cut around: ranges kept whole, and interleaved pairs.
  struct Cut {
    Range range;
    const HiInterleave* pair = nullptr;
    bool operator<(const Cut& o) const { return range < o.range; }
  };
  std::vector<Cut> cuts;
  for (const Range& keep : sorted_merged(keep_whole)) cuts.push_back({keep});
  for (const HiInterleave& pair : pairs) {
    MOE_CHECK(pair.experts > 0 && pair.per_expert > 0 && pair.per_expert % kZeroAlign == 0,
              "ZeRO shards: interleaved pair at {}: {} experts of {} elements (a multiple of {} needed)", pair.first,
              pair.experts, pair.per_expert, kZeroAlign);
    cuts.push_back({{pair.first, pair.end() - pair.first}, &pair});
  }
  std::sort(cuts.begin(), cuts.end());
  for (size_t i = 1; i < cuts.size(); ++i)
    MOE_CHECK(cuts[i - 1].range.end() <= cuts[i].range.offset,
              "ZeRO shards: [{}, +{}) overlaps [{}, +{}) (ranges kept whole and interleaved pairs must be disjoint)",
              cuts[i - 1].range.offset, cuts[i - 1].range.count, cuts[i].range.offset, cuts[i].range.count);

  ZeroShardPlan plan;
  plan.ranks = ranks;
  plan.rank = rank;
  plan.sharded.resize(stage_ranges.size());
  plan.replicated.resize(stage_ranges.size());
  // A span to shard: whole units become buckets, what is left over is replicated.
  const auto shard_span = [&](size_t stage, int64_t begin, int64_t end) {
    const int64_t usable = (end - begin) / unit * unit;
    for (int64_t at = begin; at < begin + usable; at += per_bucket)
      plan.sharded[stage].emplace_back(at, std::min(per_bucket, begin + usable - at));
    append_merged(plan.replicated[stage], begin + usable, end - begin - usable);
  };
  // A pair: groups of a multiple of `ranks` whole expert slices where they fit a bucket (the
  // same groups in w1 and w3), each other slice on its own.
  const auto shard_pair = [&](size_t stage, const HiInterleave& pair) {
    const int64_t slice = pair.per_expert;
    const int64_t group = ranks * slice <= per_bucket ? per_bucket / (ranks * slice) * ranks : 0;
    const int64_t grouped = group > 0 ? pair.experts / ranks * ranks : 0;
    for (int64_t tensor = 0; tensor < 2; ++tensor) {
      const int64_t base = pair.first + tensor * pair.experts * slice;
      for (int64_t e = 0; e < grouped; e += group)
        plan.sharded[stage].emplace_back(base + e * slice, std::min(group, grouped - e) * slice);
      for (int64_t e = grouped; e < pair.experts; ++e) shard_span(stage, base + e * slice, base + (e + 1) * slice);
    }
  };
  for (size_t stage = 0; stage < stage_ranges.size(); ++stage)
    for (const auto& [begin, count] : stage_ranges[stage]) {
      MOE_CHECK(begin % kZeroAlign == 0 && count > 0, "ZeRO shards: stage {} range [{}, +{}) is not aligned to {}",
                stage, begin, count, kZeroAlign);
      const int64_t end = begin + count;
      int64_t at = begin;
      for (const Cut& cut : cuts) {
        const auto [keep, keep_count] = cut.range;
        if (keep + keep_count <= at || keep >= end) continue;
        MOE_CHECK(keep >= at && keep + keep_count <= end && keep % kZeroAlign == 0,
                  "ZeRO shards: {} [{}, +{}) is not inside one stage's ranges, aligned to {}",
                  cut.pair ? "interleaved pair" : "range to keep whole", keep, keep_count, kZeroAlign);
        shard_span(stage, at, keep);
        if (cut.pair) shard_pair(stage, *cut.pair);
        else append_merged(plan.replicated[stage], keep, keep_count);
        at = keep + keep_count;
      }
      shard_span(stage, at, end);
    }
  for (const RangeList& buckets : plan.sharded) plan.weight_gathers.push_back(weight_gathers(buckets, pairs, ranks));
  RangeList update, norm;
  for (size_t stage = 0; stage < stage_ranges.size(); ++stage) {
    for (const auto& bucket : plan.sharded[stage]) {
      update.push_back(plan.piece(bucket, rank));
      norm.push_back(plan.piece(bucket, rank));
    }
    for (const auto& range : plan.replicated[stage]) {
      update.push_back(range);
      if (rank == 0) norm.push_back(range);
    }
  }
  plan.update = sorted_merged(std::move(update));
  plan.norm = sorted_merged(std::move(norm));
  return plan;
}

ExpertParallelZero plan_expert_parallel_zero(const ExpertParallelRanges& ranges, const RangeList& keep_whole,
                                             int64_t bucket_elems, int world, int rank, int ep) {
  MOE_CHECK(ep >= 1 && world % ep == 0 && rank >= 0 && rank < world, "ZeRO shards: rank {} of {} in EP groups of {}",
            rank, world, ep);
  MOE_CHECK(ranges.shared.size() == ranges.own_experts.size(), "ZeRO shards: {} shared stages, {} expert stages",
            ranges.shared.size(), ranges.own_experts.size());
  ExpertParallelZero zero;
  zero.shared = plan_zero_shards(ranges.shared, keep_whole, bucket_elems, world, rank);
  zero.experts = plan_zero_shards(ranges.own_experts, {}, bucket_elems, world / ep, rank / ep);
  RangeList update = zero.shared.update, norm = zero.shared.norm;
  update.insert(update.end(), zero.experts.update.begin(), zero.experts.update.end());
  norm.insert(norm.end(), zero.experts.norm.begin(), zero.experts.norm.end());
  zero.update = sorted_merged(std::move(update));
  zero.norm = sorted_merged(std::move(norm));
  for (size_t stage = 0; stage < ranges.shared.size(); ++stage) {
    RangeList held = ranges.shared[stage];
    held.insert(held.end(), ranges.own_experts[stage].begin(), ranges.own_experts[stage].end());
    zero.held.push_back(sorted_merged(std::move(held)));
  }
  return zero;
}

ZeroShardPlan replicated_plan(const ZeroShardPlan& plan) {
  ZeroShardPlan out;
  out.ranks = plan.ranks;
  out.rank = plan.rank;
  out.sharded.resize(plan.sharded.size());
  out.replicated.resize(plan.sharded.size());
  out.weight_gathers.resize(plan.sharded.size());
  RangeList all;
  for (size_t stage = 0; stage < plan.sharded.size(); ++stage) {
    RangeList& whole = out.replicated[stage];
    whole = plan.sharded[stage];
    whole.insert(whole.end(), plan.replicated[stage].begin(), plan.replicated[stage].end());
    std::sort(whole.begin(), whole.end());
    all.insert(all.end(), whole.begin(), whole.end());
  }
  out.update = sorted_merged(std::move(all));
  if (plan.rank == 0) out.norm = out.update;
  return out;
}

std::vector<RangeList> others_pieces(const ZeroShardPlan& plan) {
  std::vector<RangeList> others(plan.sharded.size());
  for (size_t stage = 0; stage < plan.sharded.size(); ++stage)
    for (const Range& bucket : plan.sharded[stage]) {
      const Range own = plan.piece(bucket, plan.rank);
      append_merged(others[stage], bucket.offset, own.offset - bucket.offset);
      append_merged(others[stage], own.end(), bucket.end() - own.end());
    }
  return others;
}

}  // namespace moe::dist
