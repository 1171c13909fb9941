// Sampling rules on known distributions: greedy and its ties, top-k 1 is greedy, top-p
// keeps the smallest most-likely-first set with mass >= p, top-k before top-p, the
// temperature, and draws whose frequencies match the distribution (chi-square, fixed seed).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "expect_error.h"
#include "model/sampler.h"

namespace moe {
namespace {

// Logits whose softmax is `probabilities` exactly (up to rounding).
std::vector<float> logits_of(const std::vector<double>& probabilities) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

std::vector<int32_t> tokens_of(const std::vector<std::pair<int32_t, double>>& kept) {
  std::vector<int32_t> tokens;
  for (const auto& [token, probability] : kept) tokens.push_back(token);
  return tokens;
}

// Probabilities by id: 0.15, 0.05, 0.5, 0.1, 0.2 (most likely first: 2, 4, 0, 3, 1).
const std::vector<double> kFive = {0.15, 0.05, 0.5, 0.1, 0.2};

TEST(Sampler, GreedyTakesTheArgmaxAndTheLowestIdOfATie) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  const SamplingOptions greedy{0.0, 0, 1.0};
  EXPECT_EQ(sampling_distribution(logits, greedy), (std::vector<std::pair<int32_t, double>>{{1, 1.0}}));
  for (double u : {0.01, 0.5, 0.99}) EXPECT_EQ(sample_token(logits, greedy, u), 1);
}

TEST(Sampler, TopKOneIsGreedyAtAnyTemperature) {
  CounterRng rng(5, "logits");
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> logits;
    for (int v = 0; v < 50; ++v) logits.push_back(static_cast<float>(3 * rng.normal(static_cast<uint64_t>(trial * 50 + v))));
    const int32_t greedy = sample_token(logits, {0.0, 0, 1.0}, 0.5);
    for (double temperature : {0.3, 1.0, 4.0})
      for (double u : {0.001, 0.5, 0.999}) EXPECT_EQ(sample_token(logits, {temperature, 1, 1.0}, u), greedy);
  }
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  const std::vector<float> logits = logits_of(kFive);
  auto kept = [&](double p) { return tokens_of(sampling_distribution(logits, {1.0, 0, p})); };
  // Boundaries a little either side of the cumulative masses 0.5, 0.7, 0.85, 0.95 (the
  // logits are floats, so a sum is p only to float rounding).
  EXPECT_EQ(kept(0.3), (std::vector<int32_t>{2}));
  EXPECT_EQ(kept(0.499), (std::vector<int32_t>{2}));
  EXPECT_EQ(kept(0.501), (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(kept(0.699), (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(kept(0.701), (std::vector<int32_t>{2, 4, 0}));
  EXPECT_EQ(kept(0.86), (std::vector<int32_t>{2, 4, 0, 3}));
  EXPECT_EQ(kept(0.951), (std::vector<int32_t>{2, 4, 0, 3, 1}));
  EXPECT_EQ(kept(1.0), (std::vector<int32_t>{2, 4, 0, 3, 1}));
  // What is kept is renormalised.
  const auto two = sampling_distribution(logits, {1.0, 0, 0.69});
  EXPECT_NEAR(two[0].second, 0.5 / 0.7, 1e-6);
  EXPECT_NEAR(two[1].second, 0.2 / 0.7, 1e-6);
}

// Top-k first, then top-p of the renormalised top-k: k = 3 leaves 0.5, 0.2, 0.15 (mass
// 0.85); p = 0.8 needs 0.68 of it: 0.5 + 0.2.
TEST(Sampler, TopKThenTopPThenTemperature) {
  const std::vector<float> logits = logits_of(kFive);
  const auto top3 = sampling_distribution(logits, {1.0, 3, 1.0});
  EXPECT_EQ(tokens_of(top3), (std::vector<int32_t>{2, 4, 0}));
  EXPECT_NEAR(top3[2].second, 0.15 / 0.85, 1e-6);
  EXPECT_EQ(tokens_of(sampling_distribution(logits, {1.0, 3, 0.8})), (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(tokens_of(sampling_distribution(logits, {1.0, 100, 1.0})).size(), 5u);  // k past V: all
  // Temperature 2: probabilities proportional to sqrt(p).
  double norm = 0;
  for (double p : kFive) norm += std::sqrt(p);
  for (const auto& [token, probability] : sampling_distribution(logits, {2.0, 0, 1.0}))
    EXPECT_NEAR(probability, std::sqrt(kFive[static_cast<size_t>(token)]) / norm, 1e-6) << token;
}

// 20000 draws with CounterRng uniforms: the frequencies pass a chi-square test at the 0.1%
// level (fixed seed, so the outcome is fixed); with top-k 2 only the two most likely
// tokens appear, in proportion 0.5 : 0.2.
TEST(Sampler, DrawFrequenciesMatchTheDistribution) {
  const std::vector<float> logits = logits_of(kFive);
  const CounterRng rng(2026, "sampler-test");
  constexpr int kDraws = 20000;
  auto chi_square = [&](const SamplingOptions& options, const std::vector<double>& expected_p) {
    std::vector<int> counts(kFive.size(), 0);
    for (int i = 0; i < kDraws; ++i) ++counts[static_cast<size_t>(sample_token(logits, options, rng.uniform(static_cast<uint64_t>(i))))];
    double chi2 = 0;
    for (size_t v = 0; v < counts.size(); ++v) {
      if (expected_p[v] == 0) {
        EXPECT_EQ(counts[v], 0) << "token " << v << " is outside the kept set";
        continue;
      }
      const double expected = expected_p[v] * kDraws;
      chi2 += (counts[v] - expected) * (counts[v] - expected) / expected;
    }
    return chi2;
  };
  EXPECT_LT(chi_square({1.0, 0, 1.0}, kFive), 18.47);  // 4 degrees of freedom, p = 0.001
  EXPECT_LT(chi_square({1.0, 2, 1.0}, {0, 0, 0.5 / 0.7, 0, 0.2 / 0.7}), 10.83);  // 1 degree of freedom
  // A wrong distribution fails the same test: the check has teeth.
  EXPECT_GT(chi_square({1.0, 0, 1.0}, {0.2, 0.05, 0.45, 0.1, 0.2}), 18.47);
}

TEST(Sampler, OptionsOutOfRangeAreOneLineErrors) {
  using test::expect_one_line_error;
  expect_one_line_error<ConfigError>([] { check_sampling_options({-0.5, 0, 1.0}); }, {"--temperature", "-0.5"});
  expect_one_line_error<ConfigError>([] { check_sampling_options({NAN, 0, 1.0}); }, {"--temperature"});
  expect_one_line_error<ConfigError>([] { check_sampling_options({1.0, -1, 1.0}); }, {"--top-k", "-1"});
  expect_one_line_error<ConfigError>([] { check_sampling_options({1.0, 0, 0.0}); }, {"--top-p must be in (0, 1]"});
  expect_one_line_error<ConfigError>([] { check_sampling_options({1.0, 0, 1.5}); }, {"--top-p", "1.5"});
  EXPECT_NO_THROW(check_sampling_options({0.0, 0, 1.0}));
}

}  // namespace
}  // namespace moe
