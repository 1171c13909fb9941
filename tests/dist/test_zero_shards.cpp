// plan_zero_shards (GPU ZeRO-1): on the real model's stage ranges, for 1-8 ranks, every
// element of a stage is either in one bucket or replicated, the buckets split into aligned
// equal pieces, the ranks' pieces partition the buckets, every rank steps the replicated
// ranges, and the ranks' norm ranges count each element exactly once.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "dist/gradient_stages.h"
#include "dist/zero_shards.h"
#include "model/transformer.h"
#include "odd_sized_model.h"

namespace moe::dist {
namespace {

// element -> how many times `ranges` hold it
void count(const RangeList& ranges, std::map<int64_t, int>& times) {
  for (const auto& [begin, n] : ranges)
    for (int64_t e = begin; e < begin + n; ++e) ++times[e];
}

TEST(ZeroShards, PartitionTheStagesForAnyRankCount) {
  Transformer<float> model(test::odd_sized_model(), 1);
  const auto& params = model.params();
  const auto stages = gradient_ranges_by_stage(
      params, [&](const std::string& name) { return model.backward_stage_of(name); }, model.backward_stages());
  // Keep two small parameters whole, as the fp32 router copies are.
  RangeList keep;
  for (int id = 0; id < params.size() && keep.size() < 2; ++id)
    if (params.numel(id) <= 64) keep.emplace_back(params.offset(id), (params.numel(id) + 15) / 16 * 16);
  ASSERT_EQ(keep.size(), 2u);
  for (int ranks : {1, 2, 3, 4, 8})
    for (int64_t bucket : {int64_t{1}, int64_t{200}, int64_t{1} << 20}) {
      SCOPED_TRACE(testing::Message() << ranks << " ranks, buckets of " << bucket);
      std::map<int64_t, int> updated, normed;
      int64_t sharded_elems = 0;
      for (int rank = 0; rank < ranks; ++rank) {
        const ZeroShardPlan plan = plan_zero_shards(stages, keep, bucket, ranks, rank);
        ASSERT_EQ(plan.sharded.size(), stages.size());
        for (size_t s = 0; s < stages.size(); ++s) {
          // A stage's buckets and replicated ranges are its ranges, each element once.
          std::map<int64_t, int> stage, planned;
          count(stages[s], stage);
          count(plan.sharded[s], planned);
          count(plan.replicated[s], planned);
          EXPECT_EQ(planned, stage) << "stage " << s;
          for (const auto& b : plan.sharded[s]) {
            EXPECT_EQ(b.count % (kZeroAlign * ranks), 0) << "bucket at " << b.offset;
            EXPECT_LE(b.count, std::max(bucket / (kZeroAlign * ranks), int64_t{1}) * kZeroAlign * ranks);
            EXPECT_EQ(plan.piece(b, rank).offset % kZeroAlign, 0);
            if (rank == 0) sharded_elems += b.count;
          }
        }
        // Kept ranges are replicated.
        std::map<int64_t, int> replicated;
        for (const auto& stage : plan.replicated) count(stage, replicated);
        for (const auto& [begin, n] : keep)
          for (int64_t e = begin; e < begin + n; ++e) EXPECT_EQ(replicated.count(e), 1u) << "kept element " << e;
        count(plan.update, updated);
        count(plan.norm, normed);
      }
      // Over the ranks: replicated elements stepped by every rank, sharded ones by one;
      // the norm counts every element once.
      std::map<int64_t, int> all;
      for (const auto& stage : stages) count(stage, all);
      int64_t once = 0;
      for (const auto& [e, n] : all) {
        EXPECT_EQ(normed[e], 1) << "element " << e;
        EXPECT_TRUE(updated[e] == 1 || updated[e] == ranks) << "element " << e << " stepped " << updated[e] << "x";
        if (updated[e] == 1) ++once;
      }
      if (ranks > 1) EXPECT_EQ(once, sharded_elems);
      // Most of the block is sharded (here: only stage ends and the kept parameters are not).
      if (bucket > 1) EXPECT_GT(sharded_elems, params.storage_numel() / 2);
    }
}

TEST(ZeroShards, RefusesMisalignedOrStraddlingRanges) {
  const std::vector<RangeList> stages = {{{0, 64}}, {{64, 128}}};
  EXPECT_THROW(plan_zero_shards({{{8, 64}}}, {}, 1024, 2, 0), Error);            // a stage not on 16
  EXPECT_THROW(plan_zero_shards(stages, {{48, 32}}, 1024, 2, 0), Error);         // kept range across two stages
  EXPECT_THROW(plan_zero_shards(stages, {{72, 16}}, 1024, 2, 0), Error);         // kept range not on 16
  EXPECT_THROW(plan_zero_shards(stages, {}, 1024, 2, 2), Error);                 // no rank 2 of 2
  EXPECT_THROW(plan_zero_shards(stages, {}, 0, 2, 0), Error);                    // no bucket size
  const ZeroShardPlan plan = plan_zero_shards(stages, {{80, 16}}, 1024, 2, 1);
  EXPECT_EQ(plan.sharded[0], (RangeList{{0, 64}}));
  EXPECT_EQ(plan.sharded[1], (RangeList{{96, 96}}));  // 64..80 too short for a unit of 32
  EXPECT_EQ(plan.replicated[1], (RangeList{{64, 32}}));
  EXPECT_EQ(plan.update, (RangeList{{32, 64}, {144, 48}}));  // its pieces and the replicated range, merged
  EXPECT_EQ(plan.norm, (RangeList{{32, 32}, {144, 48}}));
}

// Interleaved gate|up pairs (GpuParameterStore's hi halves): for 1-8 ranks and several
// bucket sizes, the buckets still partition the stages with the pairs cut at expert slices,
// and each rank's pieces of weight_gathers (the all-gathers of the new bf16 weights) are
// exactly the hi halves of its pieces of the reduce-scattered buckets, the gathers together
// the hi halves of every bucket.
TEST(ZeroShards, InterleavedPairsGatherTheHiHalvesEachRankSteps) {
  // Stage 1: a kept range, then a pair of 6 experts of 64 elements; stage 2: a pair of 4
  // experts of 256 with 16 plain elements on either side.
  const std::vector<HiInterleave> pairs = {{80, 6, 64}, {896, 4, 256}};
  const std::vector<RangeList> stages = {{{0, 64}}, {{64, 816}}, {{880, 2080}}};
  const auto hi = [&](int64_t e) {
    for (const HiInterleave& p : pairs)
      if (e >= p.first && e < p.end()) return p.hi_offset(e);
    return e;
  };
  for (int ranks : {1, 2, 3, 4, 8})
    for (int64_t bucket : {int64_t{1}, int64_t{200}, int64_t{1024}, int64_t{4096}, int64_t{1} << 20}) {
      SCOPED_TRACE(testing::Message() << ranks << " ranks, buckets of " << bucket);
      std::map<int64_t, int> gathered_by_all;
      for (int rank = 0; rank < ranks; ++rank) {
        const ZeroShardPlan plan = plan_zero_shards(stages, {{64, 16}}, bucket, ranks, rank, pairs);
        ASSERT_EQ(plan.weight_gathers.size(), stages.size());
        for (size_t s = 0; s < stages.size(); ++s) {
          std::map<int64_t, int> stage, planned, stepped_hi, gathered_hi, whole_hi, gathers_whole;
          count(stages[s], stage);
          count(plan.sharded[s], planned);
          count(plan.replicated[s], planned);
          EXPECT_EQ(planned, stage) << "stage " << s;
          for (const Range& b : plan.sharded[s]) {
            EXPECT_EQ(b.count % (kZeroAlign * ranks), 0) << "bucket at " << b.offset;
            for (const HiInterleave& p : pairs) {
              if (b.offset < p.first || b.offset >= p.end()) continue;
              const bool one_slice = b.count <= p.per_expert - (b.offset - p.first) % p.per_expert;
              EXPECT_TRUE(one_slice || ((b.offset - p.first) % p.per_expert == 0 &&
                                        b.count % (ranks * p.per_expert) == 0))
                  << "bucket at " << b.offset << " cuts an expert slice";
            }
            const Range piece = plan.piece(b, rank);
            for (int64_t e = piece.offset; e < piece.end(); ++e) ++stepped_hi[hi(e)];
            for (int64_t e = b.offset; e < b.end(); ++e) ++whole_hi[hi(e)];
          }
          for (const Range& g : plan.weight_gathers[s]) {
            const Range piece = plan.piece(g, rank);
            count({piece}, gathered_hi);
            count({g}, gathers_whole);
          }
          EXPECT_EQ(gathered_hi, stepped_hi) << "stage " << s << ", rank " << rank;
          EXPECT_EQ(gathers_whole, whole_hi) << "stage " << s;
          for (const auto& [e, n] : gathered_hi) gathered_by_all[e] += n;
        }
      }
      // Every rank's gathers together move each gathered element once.
      for (const auto& [e, n] : gathered_by_all) EXPECT_EQ(n, 1) << "hi element " << e;
    }
  // Without pairs the gathers are the buckets; a pair across two stages is refused.
  const ZeroShardPlan plain = plan_zero_shards(stages, {}, 200, 2, 0);
  EXPECT_EQ(plain.weight_gathers, plain.sharded);
  EXPECT_THROW(plan_zero_shards({{{0, 64}}, {{64, 64}}}, {}, 200, 2, 0, {{32, 1, 32}}), Error);
  EXPECT_THROW(plan_zero_shards(stages, {{80, 16}}, 200, 2, 0, pairs), Error);  // a kept range inside a pair
}

// ZeRO-0 and the other ranks' pieces (ZeRO-2/3 release them), on the plan above.
TEST(ZeroShards, ReplicatedPlanAndOthersPieces) {
  const std::vector<RangeList> stages = {{{0, 64}}, {{64, 128}}};
  const ZeroShardPlan plan = plan_zero_shards(stages, {{80, 16}}, 1024, 2, 1);
  EXPECT_EQ(others_pieces(plan), (std::vector<RangeList>{{{0, 32}}, {{96, 48}}}));
  const ZeroShardPlan whole = replicated_plan(plan);
  EXPECT_EQ(whole.ranks, 2);
  EXPECT_EQ(whole.rank, 1);
  EXPECT_EQ(whole.sharded, (std::vector<RangeList>{{}, {}}));
  // Each bucket stays a range of its own (all-reduced one at a time), in offset order.
  EXPECT_EQ(whole.replicated, (std::vector<RangeList>{{{0, 64}}, {{64, 32}, {96, 96}}}));
  EXPECT_EQ(whole.update, (RangeList{{0, 192}}));
  EXPECT_TRUE(whole.norm.empty());  // rank 0 counts the replicas
  EXPECT_EQ(replicated_plan(plan_zero_shards(stages, {{80, 16}}, 1024, 2, 0)).norm, (RangeList{{0, 192}}));
  EXPECT_EQ(others_pieces(whole), (std::vector<RangeList>{{}, {}}));
}

// ZeRO under expert parallelism (the GPU's two groups): over the world every shared element
// and every expert element is added to the norm exactly once; a shared element is stepped
// by one rank or all, an expert element by one of its replicas or all of them (never by a
// rank that does not hold it); each rank's held stages are its shared and own ranges.
TEST(ZeroShards, ExpertParallelPlansCountEveryElementOnce) {
  Transformer<float> model(test::odd_sized_model(), 1);
  const auto& params = model.params();
  const auto stage_of = [&](const std::string& name) { return model.backward_stage_of(name); };
  const int64_t E = 4;
  for (const auto& [world, ep] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{4, 4}, std::pair{8, 2}})
    for (int64_t bucket : {int64_t{64}, int64_t{1} << 20}) {
      SCOPED_TRACE(testing::Message() << world << " ranks, EP " << ep << ", buckets of " << bucket);
      std::map<int64_t, int> normed, updated;
      std::map<int64_t, int> shared_elems, expert_elems;
      RangeList keep;  // the router biases, as the GPU keeps them
      for (int id = 0; id < params.size(); ++id)
        if (params.spec(id).name.ends_with(".moe.router.bias"))
          keep.emplace_back(params.offset(id), (params.numel(id) + 15) / 16 * 16);
      for (int rank = 0; rank < world; ++rank) {
        const int p = rank % ep;
        const ExpertParallelRanges ranges =
            gradient_ranges_by_stage_ep(params, stage_of, model.backward_stages(), p * E / ep, E / ep);
        const ExpertParallelZero zero = plan_expert_parallel_zero(ranges, keep, bucket, world, rank, ep);
        EXPECT_EQ(zero.shared.ranks, world);
        EXPECT_EQ(zero.experts.ranks, world / ep);
        EXPECT_EQ(zero.experts.rank, rank / ep);
        RangeList held_all;
        for (size_t s = 0; s < ranges.shared.size(); ++s) {
          std::map<int64_t, int> want, got;
          count(ranges.shared[s], want);
          count(ranges.own_experts[s], want);
          count(zero.held[s], got);
          EXPECT_EQ(got, want) << "stage " << s;
          held_all.insert(held_all.end(), zero.held[s].begin(), zero.held[s].end());
          if (rank < ep) count(ranges.own_experts[s], expert_elems);
          if (rank == 0) count(ranges.shared[s], shared_elems);
        }
        EXPECT_TRUE(subtract_ranges(zero.update, merge_ranges(held_all)).empty()) << "rank " << rank << " steps what it does not hold";
        count(zero.norm, normed);
        count(zero.update, updated);
      }
      for (const auto& [e, n] : shared_elems) {
        EXPECT_EQ(normed[e], 1) << "shared element " << e;
        EXPECT_TRUE(updated[e] == 1 || updated[e] == world) << "shared element " << e << " stepped " << updated[e] << "x";
      }
      for (const auto& [e, n] : expert_elems) {
        EXPECT_EQ(n, 1) << "expert element " << e << " held by two EP ranks";
        EXPECT_EQ(normed[e], 1) << "expert element " << e;
        EXPECT_TRUE(updated[e] == 1 || updated[e] == world / ep) << "expert element " << e << " stepped " << updated[e] << "x";
      }
      EXPECT_EQ(normed.size(), shared_elems.size() + expert_elems.size());
    }
}

}  // namespace
}  // namespace moe::dist
