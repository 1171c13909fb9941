#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "../train/synthetic.h"
#include "core/rng.h"
#include "core/threads.h"
#include "moe/routing_cache.h"
#include "train/routing_cache_probe.h"
#include "train/trainer.h"

namespace moe {
namespace {

// Experts of layer l+1 as a fixed function of (token, layer l's pair): a perfectly
// predictable routing, learnt after one sight of each key.
std::vector<int32_t> next_of(const std::vector<int32_t>& tokens_T, const std::vector<int32_t>& prev_TK, int64_t E) {
  std::vector<int32_t> next(prev_TK.size());
  for (size_t t = 0; t < tokens_T.size(); ++t) {
    const int32_t a = std::min(prev_TK[2 * t], prev_TK[2 * t + 1]);
    next[2 * t] = static_cast<int32_t>((a * 7 + tokens_T[t]) % E);
    next[2 * t + 1] = static_cast<int32_t>((next[2 * t] + 1 + tokens_T[t] % 3) % E);
  }
  return next;
}

TEST(RoutingCache, PredictsAPredictableRoutingAfterOneSight) {
  const int64_t E = 16, T = 64;
  RoutingCache cache(E, 2, 2, 1 << 10);
  std::vector<int32_t> tokens(T), prev(2 * T);
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = static_cast<int32_t>(t % 11);
    prev[2 * t] = static_cast<int32_t>(t % E);
    prev[2 * t + 1] = static_cast<int32_t>((t * 5 + 3) % E == t % E ? (t + 1) % E : (t * 5 + 3) % E);
  }
  const std::vector<int32_t> next = next_of(tokens, prev, E);
  cache.step(tokens.data(), prev.data(), next.data(), T);
  EXPECT_EQ(cache.hits().assignments, 2 * T);
  EXPECT_LT(cache.hits().hit_rate(), 0.5);  // nothing learnt yet: the overall order only
  cache.reset_hits();
  // The same keys in the other order of the pair: still the same key.
  std::vector<int32_t> swapped(prev);
  for (int64_t t = 0; t < T; ++t) std::swap(swapped[2 * t], swapped[2 * t + 1]);
  cache.step(tokens.data(), swapped.data(), next.data(), T);
  EXPECT_EQ(cache.hits().hits, 2 * T);
  EXPECT_EQ(cache.hits().tokens_hit, T);
  EXPECT_DOUBLE_EQ(cache.hits().token_hit_rate(), 1.0);
}

TEST(RoutingCache, PredictionsAreDistinctValidAndBackOff) {
  const int64_t E = 8, P = 3;
  RoutingCache cache(E, 2, P, 1 << 10);
  std::vector<int32_t> pred(P);
  const int32_t token = 5, prev[2] = {1, 2};
  cache.predict(&token, prev, 1, pred.data());  // empty cache: still P distinct experts
  EXPECT_EQ(std::set<int32_t>(pred.begin(), pred.end()).size(), static_cast<size_t>(P));
  for (int32_t e : pred) EXPECT_TRUE(e >= 0 && e < E);
  // Learn (token 5, {1,2}) -> {6,7}; a new token after {1,2} backs off to the pair's table.
  const int32_t next[2] = {6, 7};
  cache.observe(&token, prev, next, 1);
  cache.predict(&token, prev, 1, pred.data());
  EXPECT_EQ(std::set<int32_t>(pred.begin(), pred.begin() + 2), (std::set<int32_t>{6, 7}));
  const int32_t other = 9;
  cache.predict(&other, prev, 1, pred.data());
  EXPECT_EQ(std::set<int32_t>(pred.begin(), pred.begin() + 2), (std::set<int32_t>{6, 7}));
}

TEST(RoutingCache, KeepsTheMostFrequentExpertsOfAKey) {
  const int64_t E = 32;
  RoutingCache cache(E, 1, 1, 16);
  const int32_t token = 1, prev = 0;
  // Expert 20 three times as often as each of 12 others (more than the key's 8 slots).
  for (int round = 0; round < 10; ++round)
    for (int32_t e = 0; e < 12; ++e) {
      const int32_t favourite = 20;
      cache.observe(&token, &prev, &e, 1);
      for (int r = 0; r < 3; ++r) cache.observe(&token, &prev, &favourite, 1);
    }
  int32_t pred = -1;
  cache.predict(&token, &prev, 1, &pred);
  EXPECT_EQ(pred, 20);
}

TEST(RoutingCache, BoundedKeysAndBadShapesRefused) {
  RoutingCache cache(8, 2, 2, 4);
  std::vector<int32_t> tokens(100), prev(200), next(200);
  for (int t = 0; t < 100; ++t) {
    tokens[t] = t;
    prev[2 * t] = t % 8;
    prev[2 * t + 1] = (t + 1) % 8;
    next[2 * t] = (t + 2) % 8;
    next[2 * t + 1] = (t + 3) % 8;
  }
  cache.observe(tokens.data(), prev.data(), next.data(), 100);
  EXPECT_EQ(cache.keys(), 4);
  EXPECT_THROW(RoutingCache(8, 2, 1, 4), Error);   // predict_k < top_k
  EXPECT_THROW(RoutingCache(8, 2, 9, 4), Error);   // predict_k > n_experts
}

// The cache only measures: training with it is bit-identical to training without, and
// every MoE layer after the first reports a hit rate that rises as it learns.
TEST(RoutingCache, TrainingUnchangedAndHitRatesReported) {
  set_num_threads(1);
  RunConfig config = test::lookback_config();
  config.model.n_layers = 3;
  config.model.moe.n_experts = 8;
  config.training.steps = 30;
  auto run = [&](bool cache) {
    RunConfig c = config;
    c.model.moe.route_cache = cache;
    const auto& m = c.model;
    Trainer trainer(c, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                    std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
    std::vector<StepStats> steps;
    for (int64_t step = 0; step < c.training.steps; ++step) steps.push_back(trainer.train_step(step));
    return steps;
  };
  const auto off = run(false), on = run(true);
  set_num_threads(0);
  ASSERT_EQ(off.size(), on.size());
  for (size_t s = 0; s < off.size(); ++s) {
    EXPECT_EQ(off[s].loss, on[s].loss) << "step " << s;
    ASSERT_EQ(on[s].layers.size(), 3u);
    EXPECT_EQ(off[s].layers[1].route_cache_hit_rate, -1);
    EXPECT_EQ(on[s].layers[0].route_cache_hit_rate, -1);  // nothing predicts the first MoE layer
    for (size_t l = 1; l < 3; ++l) {
      EXPECT_GE(on[s].layers[l].route_cache_hit_rate, 0);
      EXPECT_LE(on[s].layers[l].route_cache_hit_rate, 1);
      EXPECT_LE(on[s].layers[l].route_cache_token_hit_rate, on[s].layers[l].route_cache_hit_rate);
    }
  }
  // 16 token ids x 28 expert pairs, learnt while the routing itself moves: well above the
  // 2 of 8 a guess hits by chance (0.46 at this commit).
  EXPECT_GT(on.back().layers[2].route_cache_hit_rate, 0.35);
}

}  // namespace
}  // namespace moe
