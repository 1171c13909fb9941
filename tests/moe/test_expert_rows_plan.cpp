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

TEST(ExpertRowsPlan, BadShapesAreErrors) {
  EXPECT_THROW(plan_expert_rows({1, 2, 3}, {1, 2, 3}, 2), Error);      // 3 experts over 2 ranks
  EXPECT_THROW(plan_expert_rows({1, 2, 3, 4}, {1, 2, 3}, 2), Error);   // received counts of the wrong size
  EXPECT_THROW(plan_expert_rows({1, -2, 3, 4}, {1, 2, 3, 4}, 2), Error);
}

}  // namespace
}  // namespace moe
