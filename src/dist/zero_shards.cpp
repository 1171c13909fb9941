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
                               int64_t bucket_elems, int ranks, int rank) {
  MOE_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "ZeRO shards: rank {} of {}", rank, ranks);
  MOE_CHECK(bucket_elems > 0, "ZeRO shards: {} elements per bucket", bucket_elems);
  const int64_t unit = kZeroAlign * ranks;
  const int64_t per_bucket = std::max(unit, bucket_elems / unit * unit);
  const RangeList whole = sorted_merged(keep_whole);

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
  for (size_t stage = 0; stage < stage_ranges.size(); ++stage)
    for (const auto& [begin, count] : stage_ranges[stage]) {
      MOE_CHECK(begin % kZeroAlign == 0 && count > 0, "ZeRO shards: stage {} range [{}, +{}) is not aligned to {}",
                stage, begin, count, kZeroAlign);
      const int64_t end = begin + count;
      int64_t at = begin;
      for (const auto& [keep, keep_count] : whole) {
        if (keep + keep_count <= at || keep >= end) continue;
        MOE_CHECK(keep >= at && keep + keep_count <= end && keep % kZeroAlign == 0,
                  "ZeRO shards: range [{}, +{}) to keep whole is not inside one stage's ranges, aligned to {}", keep,
                  keep_count, kZeroAlign);
        shard_span(stage, at, keep);
        append_merged(plan.replicated[stage], keep, keep_count);
        at = keep + keep_count;
      }
      shard_span(stage, at, end);
    }
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
