// Router ops: scores, top-k selection, their backward, aux loss, z-loss, bias balancing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "moe/moe_fixtures.h"
#include "moe/router.h"

namespace moe {
namespace {

using test::dot;
using test::expect_gradient_close;
using test::random_vector;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

const char* name_of(ScoreFunc f) { return f == ScoreFunc::Softmax ? "softmax" : "sigmoid"; }

std::vector<double> scores_of(const std::vector<double>& logits, int64_t T_, int64_t E,
                              double temperature, ScoreFunc f) {
  std::vector<double> scores(logits.size());
  router_scores_forward(scores.data(), logits.data(), T_, E, temperature, f);
  return scores;
}

// ---------------------------------------------------------------------------------------
// Scores

TEST(RouterScores, HandComputedValues) {
  // softmax([0, ln 3]) = [1/4, 3/4]; the same after halving the logits at temperature 0.5.
  const double ln3 = std::log(3.0);
  auto s = scores_of({0.0, ln3, 0.0, ln3 / 2}, 2, 2, 1.0, ScoreFunc::Softmax);
  EXPECT_NEAR(s[0], 0.25, 1e-15);
  EXPECT_NEAR(s[1], 0.75, 1e-15);
  s = scores_of({0.0, ln3 / 2}, 1, 2, 0.5, ScoreFunc::Softmax);
  EXPECT_NEAR(s[0], 0.25, 1e-15);
  EXPECT_NEAR(s[1], 0.75, 1e-15);
  // sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(ln 3 / 0.5 * 0.5) = 3/4.
  s = scores_of({0.0, ln3, ln3 / 2}, 1, 3, 1.0, ScoreFunc::Sigmoid);
  EXPECT_NEAR(s[0], 0.5, 1e-15);
  EXPECT_NEAR(s[1], 0.75, 1e-15);
  s = scores_of({ln3 / 2}, 1, 1, 0.5, ScoreFunc::Sigmoid);
  EXPECT_NEAR(s[0], 0.75, 1e-15);
  // Large logits do not overflow the softmax.
  s = scores_of({1000.0, 1000.0}, 1, 2, 1.0, ScoreFunc::Softmax);
  EXPECT_EQ(s[0], 0.5);
  EXPECT_THROW(scores_of({0.0}, 1, 1, 0.0, ScoreFunc::Softmax), Error);
}

TEST(RouterScores, GradientMatchesFiniteDifferences) {
  const int64_t T_ = 5, E = 7;
  for (ScoreFunc f : {ScoreFunc::Softmax, ScoreFunc::Sigmoid}) {
    for (double temperature : {0.3, 1.0}) {
      SCOPED_TRACE(std::string(name_of(f)) + " temperature " + std::to_string(temperature));
      auto logits = random_vector(T_ * E, 11, "logits", 1.5);
      const auto probe = random_vector(T_ * E, 12, "probe");
      const auto scores = scores_of(logits, T_, E, temperature, f);
      std::vector<double> dlogits(T_ * E, kNaN);  // poisoned: backward must overwrite
      router_scores_backward(dlogits.data(), probe.data(), scores.data(), T_, E, temperature, f);
      expect_gradient_close("dlogits", logits, dlogits,
                            [&] { return dot(scores_of(logits, T_, E, temperature, f), probe); });
    }
  }
}

// ---------------------------------------------------------------------------------------
// Top-k selection

TEST(RouterSelect, OrdersByScoreAndBreaksTiesByLowerIndex) {
  const std::vector<double> scores = {0.1, 0.3, 0.3, 0.2, 0.1};
  std::vector<int32_t> expert(3);
  std::vector<double> weight(3);
  router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr, 1, 5, 3,
                false);
  EXPECT_EQ(expert, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(weight, (std::vector<double>{0.3, 0.3, 0.2}));

  router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr, 1, 5, 3,
                true);
  EXPECT_EQ(expert, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_NEAR(weight[0], 0.375, 1e-15);
  EXPECT_NEAR(weight[2], 0.25, 1e-15);

  // All equal: the lowest indices, in index order.
  const std::vector<double> flat(5, 0.2);
  router_select(expert.data(), weight.data(), flat.data(), (const double*)nullptr, 1, 5, 3, false);
  EXPECT_EQ(expert, (std::vector<int32_t>{0, 1, 2}));
}

TEST(RouterSelect, BiasSteersChoiceButNotWeights) {
  const std::vector<double> scores = {0.1, 0.3, 0.3, 0.2, 0.1};
  const std::vector<double> bias = {0.0, 0.0, -0.25, 0.15, 0.5};
  std::vector<int32_t> expert(3);
  std::vector<double> weight(3);
  // Keys: 0.1, 0.3, 0.05, 0.35, 0.6 -> experts 4, 3, 1.
  router_select(expert.data(), weight.data(), scores.data(), bias.data(), 1, 5, 3, false);
  EXPECT_EQ(expert, (std::vector<int32_t>{4, 3, 1}));
  EXPECT_EQ(weight, (std::vector<double>{0.1, 0.2, 0.3}));
  router_select(expert.data(), weight.data(), scores.data(), bias.data(), 1, 5, 3, true);
  EXPECT_NEAR(weight[0], 1.0 / 6, 1e-15);
  EXPECT_NEAR(weight[2], 0.5, 1e-15);
}

TEST(RouterSelect, NaNScoresAreChosenLastAndKMustFit) {
  const std::vector<double> scores = {kNaN, 0.2, kNaN, 0.1};
  std::vector<int32_t> expert(3);
  std::vector<double> weight(3);
  router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr, 1, 4, 3,
                false);
  EXPECT_EQ(expert, (std::vector<int32_t>{1, 3, 0}));
  EXPECT_THROW(router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr,
                             1, 4, 5, false),
               Error);
  EXPECT_THROW(router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr,
                             1, 4, 0, false),
               Error);
}

TEST(RouterSelect, BackwardMatchesFiniteDifferences) {
  const int64_t T_ = 6, E = 7, K = 3;
  const auto bias = random_vector(E, 21, "bias", 0.2);
  for (bool renormalize : {false, true}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(std::string("renormalize ") + (renormalize ? "on" : "off") + ", bias " +
                   (with_bias ? "on" : "off"));
      const double* b = with_bias ? bias.data() : nullptr;
      auto scores = test::separated_rows(T_, E, 22, "scores", 0.05, 0.12);
      // Keep the selection keys apart so a finite-difference step cannot reorder them.
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t i = 0; i < E; ++i)
          for (int64_t j = 0; j < i; ++j) {
            const double ki = scores[t * E + i] + (b ? b[i] : 0.0);
            const double kj = scores[t * E + j] + (b ? b[j] : 0.0);
            ASSERT_GT(std::abs(ki - kj), 1e-3) << "fixture has a near tie";
          }
      const auto probe = random_vector(T_ * K, 23, "probe");
      std::vector<int32_t> expert(T_ * K);
      std::vector<double> weight(T_ * K);
      auto loss = [&] {
        router_select(expert.data(), weight.data(), scores.data(), b, T_, E, K, renormalize);
        return dot(weight, probe);
      };
      loss();
      std::vector<double> dscores(T_ * E, kNaN);
      router_select_backward(dscores.data(), probe.data(), expert.data(), scores.data(), T_, E,
                             K, renormalize);
      expect_gradient_close("dscores", scores, dscores, loss);
    }
  }
}

// Group-limited routing: candidates come only from the top_groups groups whose two best
// keys sum highest.
TEST(RouterSelect, GroupLimitedByHand) {
  // 4 groups of 2. Sums: g0 0.9, g1 0.95, g2 0.6, g3 0.85 -> g1 and g0. Plain top-2 would
  // be e0 and e6 (g3); limited to g1 and g0 it is e0 and e2.
  const std::vector<double> scores = {0.9, 0.0, 0.5, 0.45, 0.3, 0.3, 0.8, 0.05};
  std::vector<int32_t> expert(2);
  std::vector<double> weight(2);
  router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr, 1, 8, 2, false);
  EXPECT_EQ(expert, (std::vector<int32_t>{0, 6}));
  router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr, 1, 8, 2, false, {4, 2});
  EXPECT_EQ(expert, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(weight, (std::vector<double>{0.9, 0.5}));
  // The bias steers the groups too: +0.5 on e5 makes g2 (0.3 + 0.8 = 1.1) the best group,
  // then g1 (0.95): the candidates are e2..e5, and e0 (key 0.9) is out. Weights unbiased.
  std::vector<double> bias(8, 0.0);
  bias[5] = 0.5;
  router_select(expert.data(), weight.data(), scores.data(), bias.data(), 1, 8, 2, false, {4, 2});
  EXPECT_EQ(expert, (std::vector<int32_t>{5, 2}));
  EXPECT_EQ(weight, (std::vector<double>{0.3, 0.5}));
  EXPECT_THROW(check_route_groups({3, 1}, 8, 2), Error);  // 3 groups of 8 experts
  EXPECT_THROW(check_route_groups({4, 5}, 8, 2), Error);  // top 5 of 4 groups
  EXPECT_THROW(check_route_groups({4, 1}, 8, 3), Error);  // one group of 2 cannot hold top-3
  EXPECT_NO_THROW(check_route_groups({0, 0}, 8, 8));      // off
}

// Against a direct statement of the rule on random scores: the chosen experts are the
// top-K of the chosen groups, the groups are the best by their top-2 sums; with one expert
// per group and top_groups = K it is plain top-K.
TEST(RouterSelect, GroupLimitedMatchesTheRule) {
  const int64_t T_ = 200, E = 16, K = 4;
  const auto scores = random_vector(T_ * E, 31, "group scores");
  const auto bias = random_vector(E, 32, "group bias", 0.1);
  for (const RouteGroups g : {RouteGroups{4, 2}, RouteGroups{8, 3}, RouteGroups{2, 1}}) {
    std::vector<int32_t> expert(T_ * K);
    std::vector<double> weight(T_ * K);
    router_select(expert.data(), weight.data(), scores.data(), bias.data(), T_, E, K, true, g);
    const int64_t per_group = E / g.groups;
    for (int64_t t = 0; t < T_; ++t) {
      std::vector<double> key(E);
      for (int64_t e = 0; e < E; ++e) key[e] = scores[t * E + e] + bias[e];
      std::vector<std::pair<double, int64_t>> group_sums;
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        std::vector<double> in(key.begin() + grp * per_group, key.begin() + (grp + 1) * per_group);
        std::sort(in.begin(), in.end(), std::greater<>());
        group_sums.push_back({-(in[0] + in[1]), grp});
      }
      std::sort(group_sums.begin(), group_sums.end());
      std::vector<std::pair<double, int64_t>> candidates;
      for (int64_t m = 0; m < g.top_groups; ++m)
        for (int64_t e = group_sums[m].second * per_group; e < (group_sums[m].second + 1) * per_group; ++e)
          candidates.push_back({-key[e], e});
      std::sort(candidates.begin(), candidates.end());
      for (int64_t k = 0; k < K; ++k) EXPECT_EQ(expert[t * K + k], candidates[k].second) << "token " << t;
    }
  }
  std::vector<int32_t> plain(T_ * K), grouped(T_ * K);
  std::vector<double> w1(T_ * K), w2(T_ * K);
  router_select(plain.data(), w1.data(), scores.data(), bias.data(), T_, E, K, true);
  router_select(grouped.data(), w2.data(), scores.data(), bias.data(), T_, E, K, true, {E, K});
  EXPECT_EQ(grouped, plain);
  EXPECT_EQ(w2, w1);
}

// ---------------------------------------------------------------------------------------
// Aux loss

TEST(AuxLoss, HandComputedValues) {
  const double coef = 0.01;
  // T = 2, E = 2, K = 1, both tokens sent to expert 0: f = [1, 0].
  const std::vector<int32_t> expert = {0, 0};
  // Softmax: P_0 = (0.7 + 0.4) / 2 = 0.55 -> coef * 2 * 0.55.
  const std::vector<double> softmax_scores = {0.7, 0.3, 0.4, 0.6};
  EXPECT_NEAR(aux_loss_forward(softmax_scores.data(), expert.data(), 2, 2, 1, ScoreFunc::Softmax,
                               coef),
              coef * 1.1, 1e-15);
  // Sigmoid, normalised per token: [0.8, 0.4] -> [2/3, 1/3], [0.5, 0.5] -> [1/2, 1/2];
  // P_0 = 7/12 -> coef * 2 * 7/12.
  const std::vector<double> sigmoid_scores = {0.8, 0.4, 0.5, 0.5};
  EXPECT_NEAR(aux_loss_forward(sigmoid_scores.data(), expert.data(), 2, 2, 1, ScoreFunc::Sigmoid,
                               coef),
              coef * 7.0 / 6.0, 1e-15);
  // T = 2, E = 3, K = 2: assignments {0,1}, {0,2} -> f = [1/2, 1/4, 1/4];
  // P = [(0.5+0.6)/2, (0.3+0.1)/2, (0.2+0.3)/2] = [0.55, 0.2, 0.25];
  // aux = coef * 3 * (0.275 + 0.05 + 0.0625) = coef * 1.1625.
  const std::vector<int32_t> expert2 = {0, 1, 0, 2};
  const std::vector<double> scores2 = {0.5, 0.3, 0.2, 0.6, 0.1, 0.3};
  EXPECT_NEAR(aux_loss_forward(scores2.data(), expert2.data(), 2, 3, 2, ScoreFunc::Softmax, coef),
              coef * 1.1625, 1e-15);
}

TEST(AuxLoss, UniformRoutingGivesCoef) {
  const double coef = 0.02;
  // Each expert gets the same number of assignments: sum_e P_e = 1 makes aux = coef,
  // whatever the (softmax) scores are.
  const int64_t T_ = 4, E = 4, K = 2;
  const std::vector<int32_t> expert = {0, 1, 2, 3, 1, 0, 3, 2};
  const auto logits = random_vector(T_ * E, 31, "logits");
  const auto scores = scores_of(logits, T_, E, 1.0, ScoreFunc::Softmax);
  EXPECT_NEAR(aux_loss_forward(scores.data(), expert.data(), T_, E, K, ScoreFunc::Softmax, coef),
              coef, 1e-15);
  const std::vector<double> flat(T_ * E, 0.3);
  EXPECT_NEAR(aux_loss_forward(flat.data(), expert.data(), T_, E, K, ScoreFunc::Sigmoid, coef),
              coef, 1e-15);
}

TEST(AuxLoss, GradientMatchesFiniteDifferencesAndAccumulates) {
  const int64_t T_ = 6, E = 5, K = 2;
  const double coef = 0.3, dloss = 1.7;
  for (ScoreFunc f : {ScoreFunc::Softmax, ScoreFunc::Sigmoid}) {
    SCOPED_TRACE(name_of(f));
    auto scores = scores_of(random_vector(T_ * E, 41, "logits"), T_, E, 1.0, f);
    std::vector<int32_t> expert(T_ * K);
    std::vector<double> weight(T_ * K);
    router_select(expert.data(), weight.data(), scores.data(), (const double*)nullptr, T_, E, K,
                  false);
    const double prior = 0.25;
    std::vector<double> dscores(T_ * E, prior);
    aux_loss_backward(dscores.data(), scores.data(), expert.data(), T_, E, K, f, coef, dloss);
    for (double& g : dscores) g -= prior;
    // The routing (f_e) stays fixed while the scores move: it carries no gradient.
    expect_gradient_close("dscores", scores, dscores, [&] {
      return dloss * aux_loss_forward(scores.data(), expert.data(), T_, E, K, f, coef);
    });
  }
}

// ---------------------------------------------------------------------------------------
// Z-loss

TEST(ZLoss, HandComputedValues) {
  const double ln2 = std::log(2.0), coef = 0.001;
  // logsumexp([0, 0]) = ln 2; logsumexp([ln 3, 0]) = ln 4.
  const std::vector<double> logits = {0.0, 0.0, std::log(3.0), 0.0};
  EXPECT_NEAR(z_loss_forward(logits.data(), 1, 2, 1.0, coef), coef * ln2 * ln2, 1e-18);
  EXPECT_NEAR(z_loss_forward(logits.data(), 2, 2, 1.0, coef), coef * 2.5 * ln2 * ln2, 1e-18);
  // Temperature 0.5 doubles the logits: [ln 3 / 2, 0] / 0.5 -> ln 4 again.
  const std::vector<double> halved = {std::log(3.0) / 2, 0.0};
  EXPECT_NEAR(z_loss_forward(halved.data(), 1, 2, 0.5, coef), coef * 4 * ln2 * ln2, 1e-18);
}

TEST(ZLoss, GradientMatchesFiniteDifferencesAndAccumulates) {
  const int64_t T_ = 5, E = 6;
  const double coef = 0.2, dloss = 0.8;
  for (double temperature : {0.3, 1.0}) {
    SCOPED_TRACE(temperature);
    auto logits = random_vector(T_ * E, 51, "logits", 2.0);
    const double prior = -0.5;
    std::vector<double> dlogits(T_ * E, prior);
    z_loss_backward(dlogits.data(), logits.data(), T_, E, temperature, coef, dloss);
    for (double& g : dlogits) g -= prior;
    expect_gradient_close("dlogits", logits, dlogits, [&] {
      return dloss * z_loss_forward(logits.data(), T_, E, temperature, coef);
    });
  }
}

// ---------------------------------------------------------------------------------------
// Bias balancing

TEST(BiasBalance, CountAndUpdateSigns) {
  const std::vector<int32_t> expert = {0, 1, 0, 2, 0, 3, 2, 3};  // T = 4, K = 2
  std::vector<int64_t> load = {1, 0, 0, 0};
  count_expert_load(load.data(), expert.data(), 4, 4, 2);
  EXPECT_EQ(load, (std::vector<int64_t>{4, 1, 2, 2}));  // accumulated onto the 1
  // mean = 9/4: expert 0 above, 1 below, 2 and 3 below.
  std::vector<float> bias = {0.0f, 0.0f, 0.5f, 0.0f};
  bias_balance_update(bias.data(), load.data(), 4, 0.25);
  EXPECT_EQ(bias, (std::vector<float>{-0.25f, 0.25f, 0.75f, 0.25f}));
  // Exactly at the mean: no change.
  const std::vector<int64_t> even = {3, 3, 3};
  std::vector<float> unchanged = {0.1f, -0.2f, 0.3f};
  bias_balance_update(unchanged.data(), even.data(), 3, 0.5);
  EXPECT_EQ(unchanged, (std::vector<float>{0.1f, -0.2f, 0.3f}));
  const std::vector<int32_t> bad = {0, 4};
  EXPECT_THROW(count_expert_load(load.data(), bad.data(), 1, 4, 2), Error);
}

double max_over_mean(const std::vector<int64_t>& load) {
  int64_t total = 0, max = 0;
  for (int64_t l : load) {
    total += l;
    max = std::max(max, l);
  }
  return double(max) * double(load.size()) / double(total);
}

TEST(BiasBalance, ReducesImbalanceOnSkewedRouter) {
  const int64_t T_ = 512, E = 8, K = 2, rounds = 200;
  const double rate = 0.01;
  // Fixed logits that favour the first experts strongly.
  const double offset[E] = {2.0, 1.5, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0};
  auto logits = random_vector(T_ * E, 61, "logits");
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t e = 0; e < E; ++e) logits[t * E + e] += offset[e];
  const auto scores = test::cast_vector<float>(scores_of(logits, T_, E, 1.0, ScoreFunc::Sigmoid));

  std::vector<float> bias(E, 0.0f);
  std::vector<int32_t> expert(T_ * K);
  std::vector<float> weight(T_ * K);
  auto route = [&](const float* b) {
    router_select(expert.data(), weight.data(), scores.data(), b, T_, E, K, false);
    std::vector<int64_t> load(E, 0);
    count_expert_load(load.data(), expert.data(), T_, E, K);
    return load;
  };
  const double before = max_over_mean(route(nullptr));
  const std::vector<int32_t> unbiased_choice = expert;
  for (int64_t round = 0; round < rounds; ++round)
    bias_balance_update(bias.data(), route(bias.data()).data(), E, rate);
  const double after = max_over_mean(route(bias.data()));
  EXPECT_GT(before, 2.5);
  EXPECT_LT(after, 1.25) << "imbalance before " << before;

  // The bias changed many choices, yet every weight is the chosen expert's unbiased score.
  int64_t changed = 0;
  for (int64_t i = 0; i < T_ * K; ++i) {
    changed += expert[i] != unbiased_choice[i];
    EXPECT_EQ(weight[i], scores[(i / K) * E + expert[i]]);
  }
  EXPECT_GT(changed, T_ / 4);
}

}  // namespace
}  // namespace moe
