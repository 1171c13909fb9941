#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "core/error.h"
#include "moe/expert_rows_plan.h"

namespace moe {
namespace {

TEST(ExpertRowsPlan, TwoRanksByHand) {
  // 4 experts over 2 ranks: we hold experts 0 and 1 (L = 2).
  const std::vector<int32_t> kept_E = {3, 0, 2, 5};
  // Source 0 (us) keeps 3 and 0 rows for our experts; source 1 keeps 1 and 2.
  const std::vector<int32_t> recv_PL = {3, 0, 1, 2};
  const ExpertRowsPlan plan = plan_expert_rows(kept_E, recv_PL, 2);
  EXPECT_EQ(plan.send_rows_P, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(plan.recv_rows_P, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(plan.local_offsets_L1, (std::vector<int32_t>{0, 4, 6}));
  // Received: s0e0 x3 (0,1,2), s1e0 (3), s1e1 x2 (4,5). Expert-major: e0 = 0,1,2,3; e1 = 4,5.
  EXPECT_EQ(plan.source_of_local, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  // A case where the orders differ: source 0 has rows for expert 1 too.
  const ExpertRowsPlan mixed = plan_expert_rows({1, 2, 0, 0}, {1, 2, 2, 1}, 2);
  // Received: s0e0 (0), s0e1 (1,2), s1e0 (3,4), s1e1 (5). Expert-major: e0 = 0,3,4; e1 = 1,2,5.
  EXPECT_EQ(mixed.local_offsets_L1, (std::vector<int32_t>{0, 3, 6}));
  EXPECT_EQ(mixed.source_of_local, (std::vector<int32_t>{0, 3, 4, 1, 2, 5}));
  EXPECT_EQ(mixed.local_of_source, (std::vector<int32_t>{0, 3, 4, 1, 2, 5}));
}

// Random counts: the gathers are inverse permutations, each local expert's rows arrive from
// the sources in order, and the row totals add up.
TEST(ExpertRowsPlan, RandomCountsGiveInversePermutations) {
  std::mt19937 rng(7);
  for (int P : {1, 2, 4, 8}) {
    const int64_t L = 1 + static_cast<int64_t>(rng() % 4), E = P * L;
    std::vector<int32_t> kept(static_cast<size_t>(E)), recv(static_cast<size_t>(E));
    for (auto& c : kept) c = static_cast<int32_t>(rng() % 9);
    for (auto& c : recv) c = static_cast<int32_t>(rng() % 9);
    recv[0] = 0;  // an empty group
    const ExpertRowsPlan plan = plan_expert_rows(kept, recv, P);
    const int64_t total = std::accumulate(recv.begin(), recv.end(), int64_t{0});
    ASSERT_EQ(plan.local_rows(), total);
    EXPECT_EQ(std::accumulate(plan.send_rows_P.begin(), plan.send_rows_P.end(), int64_t{0}),
              std::accumulate(kept.begin(), kept.end(), int64_t{0}));
    for (int64_t i = 0; i < total; ++i) {
      EXPECT_EQ(plan.source_of_local[static_cast<size_t>(plan.local_of_source[static_cast<size_t>(i)])], i);
    }
    // Local rows of expert l, in order, come from source 0's rows for l, then source 1's, ...
    std::vector<int64_t> source_start(static_cast<size_t>(P * L));
    int64_t at = 0;
    for (int64_t pl = 0; pl < P * L; ++pl) source_start[static_cast<size_t>(pl)] = at, at += recv[static_cast<size_t>(pl)];
    for (int64_t l = 0; l < L; ++l) {
      int64_t local = plan.local_offsets_L1[static_cast<size_t>(l)];
      for (int p = 0; p < P; ++p)
        for (int32_t i = 0; i < recv[static_cast<size_t>(p * L + l)]; ++i, ++local)
          EXPECT_EQ(plan.source_of_local[static_cast<size_t>(local)], source_start[static_cast<size_t>(p * L + l)] + i);
      EXPECT_EQ(local, plan.local_offsets_L1[static_cast<size_t>(l + 1)]);
    }
  }
}

// Unequal slot counts (a re-placement by load): rank 0 computes slot 0 alone, rank 1
// slots 1..3, rank 2 none.
TEST(ExpertRowsPlan, UnequalSlotCountsByHand) {
  const std::vector<int64_t> bounds = {0, 1, 4, 4};
  const std::vector<int32_t> kept_E = {5, 1, 0, 2};
  // Rank 1: three local slots; sources 0, 1, 2 keep {1, 0, 2}, {0, 3, 1}, {2, 0, 0} for them.
  const ExpertRowsPlan plan = plan_expert_rows(kept_E, {1, 0, 2, 0, 3, 1, 2, 0, 0}, bounds, 1);
  EXPECT_EQ(plan.send_rows_P, (std::vector<int64_t>{5, 3, 0}));
  EXPECT_EQ(plan.recv_rows_P, (std::vector<int64_t>{3, 4, 2}));
  EXPECT_EQ(plan.local_offsets_L1, (std::vector<int32_t>{0, 3, 6, 9}));
  // Received: s0l0 (0), s0l2 (1,2), s1l1 (3,4,5), s1l2 (6), s2l0 (7,8).
  // Expert-major: l0 = 0,7,8; l1 = 3,4,5; l2 = 1,2,6.
  EXPECT_EQ(plan.source_of_local, (std::vector<int32_t>{0, 7, 8, 3, 4, 5, 1, 2, 6}));
  // Rank 2 holds no slot: it sends by the bounds and receives nothing.
  const ExpertRowsPlan empty = plan_expert_rows(kept_E, {}, bounds, 2);
  EXPECT_EQ(empty.send_rows_P, (std::vector<int64_t>{5, 3, 0}));
  EXPECT_EQ(empty.recv_rows_P, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(empty.local_rows(), 0);
  // The equal-block form is the bounds form with equal bounds.
  EXPECT_EQ(equal_slot_bounds(6, 3), (std::vector<int64_t>{0, 2, 4, 6}));
  const ExpertRowsPlan equal = plan_expert_rows({1, 2, 0, 0}, {1, 2, 2, 1}, 2);
  const ExpertRowsPlan bounded = plan_expert_rows({1, 2, 0, 0}, {1, 2, 2, 1}, {0, 2, 4}, 0);
  EXPECT_EQ(equal.source_of_local, bounded.source_of_local);
  EXPECT_EQ(equal.send_rows_P, bounded.send_rows_P);
}

TEST(ExpertRowsPlan, BadShapesAreErrors) {
  EXPECT_THROW(plan_expert_rows({1, 2, 3}, {1, 2, 3}, 2), Error);      // 3 experts over 2 ranks
  EXPECT_THROW(plan_expert_rows({1, 2, 3, 4}, {1, 2, 3}, 2), Error);   // received counts of the wrong size
  EXPECT_THROW(plan_expert_rows({1, -2, 3, 4}, {1, 2, 3, 4}, 2), Error);
  EXPECT_THROW(plan_expert_rows({1, 2, 3, 4}, {1, 2}, {0, 3, 2, 4}, 0), Error);  // falling bounds
  EXPECT_THROW(plan_expert_rows({1, 2, 3, 4}, {1, 2}, {0, 1, 3}, 0), Error);     // bounds end before E
  EXPECT_THROW(plan_expert_rows({1, 2, 3, 4}, {1, 2}, {0, 1, 4}, 2), Error);     // no rank 2
}

}  // namespace
}  // namespace moe
