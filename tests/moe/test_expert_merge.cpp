// Expert merging's CPU reference (moe/expert_merge.h): the cosine measure, the plan (which
// pairs, which expert is kept, which one is split) and the merge arithmetic against hand
// computation.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moe/expert_merge.h"

namespace moe {
namespace {

// Experts as 2-vectors (one tensor of rows of 2): cosines by hand.
TEST(ExpertMerge, CosineOfFlattenedWeights) {
  std::vector<float> w = {1, 0, 0, 1, 1, 1, 0, 0};  // e0 = x, e1 = y, e2 = x + y, e3 = 0
  std::vector<float> other = {2, 2, 2, 2};          // not part of the measure
  const std::vector<ExpertRows> rows = {{w.data(), nullptr, nullptr, 2, true, true},
                                        {other.data(), nullptr, nullptr, 1, false, false}};
  const std::vector<double> c = expert_cosine_EE(rows, 4);
  EXPECT_DOUBLE_EQ(c[0 * 4 + 0], 1.0);
  EXPECT_DOUBLE_EQ(c[0 * 4 + 1], 0.0);
  EXPECT_NEAR(c[0 * 4 + 2], std::sqrt(0.5), 1e-15);
  EXPECT_NEAR(c[2 * 4 + 1], std::sqrt(0.5), 1e-15);
  EXPECT_DOUBLE_EQ(c[3 * 4 + 0], 0.0);  // a zero expert is like no other
  // Two tensors concatenate: e0 = (1, 0 | 1), e1 = (0, 1 | 1): cosine 1/2.
  std::vector<float> bias = {1, 1, 0, 0};
  const std::vector<ExpertRows> two = {{w.data(), nullptr, nullptr, 2, true, true},
                                       {bias.data(), nullptr, nullptr, 1, true, false}};
  EXPECT_NEAR(expert_cosine_EE(two, 4)[0 * 4 + 1], 0.5, 1e-15);
}

std::vector<double> cosines(int64_t E, const std::vector<std::tuple<int, int, double>>& set) {
  std::vector<double> c(static_cast<size_t>(E * E), 0.0);
  for (int64_t e = 0; e < E; ++e) c[static_cast<size_t>(e * E + e)] = 1;
  for (const auto& [i, j, v] : set) c[static_cast<size_t>(i * E + j)] = c[static_cast<size_t>(j * E + i)] = v;
  return c;
}

TEST(ExpertMerge, PlanTakesTheMostSimilarDisjointPairsAboveTheThreshold) {
  const int64_t E = 8;
  const auto c = cosines(E, {{1, 2, 0.9}, {2, 3, 0.95}, {4, 5, 0.8}, {6, 7, 0.3}});
  const std::vector<int64_t> load = {50, 10, 40, 30, 20, 25, 5, 60};
  // 0.95 (2,3) first; (1,2) overlaps it; then (4,5); (6,7) is below 0.5.
  const auto merges = plan_expert_merges(c, load, 0.5, 4);
  ASSERT_EQ(merges.size(), 2u);
  EXPECT_EQ(merges[0].kept, 2);  // load 40 > 30
  EXPECT_EQ(merges[0].freed, 3);
  EXPECT_DOUBLE_EQ(merges[0].similarity, 0.95);
  EXPECT_DOUBLE_EQ(merges[0].kept_share, 40.0 / 70.0);
  EXPECT_EQ(merges[1].kept, 5);  // 25 > 20
  EXPECT_EQ(merges[1].freed, 4);
  // Split sources: the most loaded outside the pairs, in order: 7 (60), then 0 (50).
  EXPECT_EQ(merges[0].split_of, 7);
  EXPECT_EQ(merges[1].split_of, 0);
  // At most merge_pairs; a higher threshold leaves one; none above 0.99.
  EXPECT_EQ(plan_expert_merges(c, load, 0.5, 1).size(), 1u);
  EXPECT_EQ(plan_expert_merges(c, load, 0.9, 4).size(), 1u);
  EXPECT_TRUE(plan_expert_merges(c, load, 0.99, 4).empty());
  // Protected experts (the last event's split pairs) are in no pair: (1,2) then.
  const auto guarded = plan_expert_merges(c, load, 0.5, 1, {3});
  ASSERT_EQ(guarded.size(), 1u);
  EXPECT_EQ(guarded[0].kept, 2);
  EXPECT_EQ(guarded[0].freed, 1);
  // Equal loads: the lower index is kept, and both weigh half.
  const auto even = plan_expert_merges(cosines(4, {{1, 3, 0.7}}), {0, 0, 0, 0}, 0.5, 1);
  ASSERT_EQ(even.size(), 1u);
  EXPECT_EQ(even[0].kept, 1);
  EXPECT_EQ(even[0].freed, 3);
  EXPECT_DOUBLE_EQ(even[0].kept_share, 0.5);
  EXPECT_EQ(even[0].split_of, 0);
}

TEST(ExpertMerge, PlanLeavesASplitSourceForEveryPair) {
  // 4 experts, two similar pairs: the second pair would leave nothing to split.
  const auto c = cosines(4, {{0, 1, 0.9}, {2, 3, 0.8}});
  const auto merges = plan_expert_merges(c, {1, 2, 3, 4}, 0.5, 2);
  ASSERT_EQ(merges.size(), 1u);
  EXPECT_EQ(merges[0].split_of, 3);  // the most loaded of {2, 3}
  EXPECT_TRUE(plan_expert_merges(cosines(2, {{0, 1, 1.0}}), {1, 1}, 0.0, 1).empty());
}

// 4 experts, rows of 3: merge (a=1, b=2, share 0.75), split c=0 into 2.
TEST(ExpertMerge, ArithmeticMatchesHandComputation) {
  std::vector<float> w(12), m(12), v(12), r(4), rm(4), rv(4);
  for (int i = 0; i < 12; ++i) w[i] = 0.5f * i - 2, m[i] = 0.01f * i, v[i] = 0.001f * (i + 1);
  for (int i = 0; i < 4; ++i) r[i] = float(i + 1), rm[i] = -float(i), rv[i] = 2.0f * i;
  const std::vector<float> w0 = w, m0 = m, v0 = v, r0 = r, rm0 = rm, rv0 = rv;
  const std::vector<ExpertRows> rows = {{w.data(), m.data(), v.data(), 3, true, true},
                                        {r.data(), rm.data(), rv.data(), 1, false, false}};
  ExpertMerge merge{1, 2, 0, 0.9, 0.75};
  apply_expert_merges(rows, {merge}, 0.0, 7);
  for (int k = 0; k < 3; ++k) {
    EXPECT_FLOAT_EQ(w[3 + k], 0.75f * w0[3 + k] + 0.25f * w0[6 + k]);
    EXPECT_FLOAT_EQ(m[3 + k], 0.75f * m0[3 + k] + 0.25f * m0[6 + k]);
    EXPECT_FLOAT_EQ(v[3 + k], 0.75f * v0[3 + k] + 0.25f * v0[6 + k]);
    EXPECT_EQ(w[6 + k], w0[k]);  // the split copy of expert 0, moments included
    EXPECT_EQ(m[6 + k], m0[k]);
    EXPECT_EQ(v[6 + k], v0[k]);
    EXPECT_EQ(w[k], w0[k]);  // the others untouched
    EXPECT_EQ(w[9 + k], w0[9 + k]);
  }
  EXPECT_FLOAT_EQ(r[1], 0.75f * 2 + 0.25f * 3);
  EXPECT_FLOAT_EQ(rm[1], 0.75f * -1 + 0.25f * -2);
  EXPECT_FLOAT_EQ(rv[1], 0.75f * 2 + 0.25f * 4);
  EXPECT_EQ(r[2], r0[0]);
  EXPECT_EQ(rm[2], rm0[0]);
  EXPECT_EQ(rv[2], rv0[0]);
  EXPECT_EQ(r[3], r0[3]);
}

// The split copy's perturbation: relative, within +-noise, only on the `perturb` tensors,
// keyed by the seed (same seed: same bits; another seed: other bits).
TEST(ExpertMerge, PerturbationIsSeededAndBounded) {
  const auto run = [](uint64_t seed, std::vector<float>& w, std::vector<float>& r) {
    for (int i = 0; i < 40; ++i) w[i] = 0.1f * float(i + 1);
    for (int i = 0; i < 4; ++i) r[i] = float(i + 1);
    const std::vector<ExpertRows> rows = {{w.data(), nullptr, nullptr, 10, true, true},
                                          {r.data(), nullptr, nullptr, 1, false, false}};
    apply_expert_merges(rows, {ExpertMerge{0, 1, 3, 1.0, 0.5}}, 0.01, seed);
  };
  std::vector<float> w(40), r(4), w2(40), r2(4), w3(40), r3(4);
  run(11, w, r);
  run(11, w2, r2);
  run(12, w3, r3);
  EXPECT_EQ(w, w2);
  EXPECT_NE(w, w3);
  int changed = 0;
  for (int k = 0; k < 10; ++k) {
    const float c = 0.1f * float(30 + k + 1);
    EXPECT_LE(std::abs(w[10 + k] - c), 0.01f * c * 1.0001f);
    changed += w[10 + k] != c;
  }
  EXPECT_GT(changed, 5);
  EXPECT_EQ(r[1], 4.0f);  // router rows are copied exactly: b takes c's tokens
}

}  // namespace
}  // namespace moe
