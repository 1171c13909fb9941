// The routing statistics counted on the device (accumulate_routing_stats) against the CPU
// reference (router_entropy_sum, kept rows per expert), over several micro-batches, with
// experts in placed slots, softmax and sigmoid scores, and ragged token counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"
#include "moe/router.h"

namespace moe {
namespace {

using test::to_device;
using test::to_host;

struct Case {
  int64_t T, E;
  ScoreFunc score_func;
  bool placed;
};

class GpuRoutingStats : public ::testing::TestWithParam<Case> {};

TEST_P(GpuRoutingStats, MatchesCpu) {
  MOE_REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t T = c.T, E = c.E;
  std::vector<int32_t> slot_of_expert(static_cast<size_t>(E));
  std::iota(slot_of_expert.begin(), slot_of_expert.end(), 0);
  if (c.placed) std::reverse(slot_of_expert.begin(), slot_of_expert.end());
  auto slots_d = to_device(slot_of_expert);
  gpu::DeviceArray<double> acc(static_cast<size_t>(E + 2)), scratch(static_cast<size_t>(cuda::routing_stats_scratch(T)));
  acc.fill_bytes(0);
  std::vector<double> want(static_cast<size_t>(E + 2), 0.0);
  for (int micro = 0; micro < 3; ++micro) {
    CounterRng rng(11 + micro, "routing stats");
    std::vector<float> logits(static_cast<size_t>(T * E)), scores(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(2.0 * rng.normal(i));
    router_scores_forward<float>(scores.data(), logits.data(), T, E, 0.7, c.score_func);
    if (T > 3) std::fill(scores.begin() + 3 * E, scores.begin() + 4 * E, 0.0f);  // a row summing to 0 adds nothing
    std::vector<int32_t> counts_slot(static_cast<size_t>(E));
    for (int64_t s = 0; s < E; ++s) counts_slot[static_cast<size_t>(s)] = static_cast<int32_t>(rng.bits(s)[2] % 97);
    auto scores_d = to_device(scores);
    auto counts_d = to_device(counts_slot);
    cuda::accumulate_routing_stats(acc.data(), scratch.data(), scores_d.data(), counts_d.data(),
                                   c.placed ? slots_d.data() : nullptr, T, E, nullptr);
    for (int64_t e = 0; e < E; ++e)
      want[static_cast<size_t>(e)] += counts_slot[static_cast<size_t>(slot_of_expert[static_cast<size_t>(e)])];
    want[static_cast<size_t>(E)] += router_entropy_sum<float>(scores.data(), T, E);
    want[static_cast<size_t>(E + 1)] += static_cast<double>(T);
  }
  const std::vector<double> got = to_host(acc);
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(got[static_cast<size_t>(e)], want[static_cast<size_t>(e)]) << "expert " << e;
  // The same double terms, summed in another order.
  EXPECT_NEAR(got[static_cast<size_t>(E)], want[static_cast<size_t>(E)], 1e-9 * want[static_cast<size_t>(E)]);
  EXPECT_GT(want[static_cast<size_t>(E)], 0.0);
  EXPECT_EQ(got[static_cast<size_t>(E + 1)], want[static_cast<size_t>(E + 1)]);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuRoutingStats,
                         ::testing::Values(Case{1, 8, ScoreFunc::Softmax, false}, Case{300, 8, ScoreFunc::Softmax, true},
                                           Case{1000, 64, ScoreFunc::Sigmoid, true},
                                           Case{4096, 128, ScoreFunc::Softmax, false},
                                           Case{777, 40, ScoreFunc::Sigmoid, false}));

// Uniform softmax scores over E experts: log E per token, exactly the known answer.
TEST(GpuRoutingStatsKnownAnswer, UniformScoresGiveLogE) {
  MOE_REQUIRE_GPU();
  const int64_t T = 513, E = 16;
  std::vector<float> scores(static_cast<size_t>(T * E), 1.0f / 16.0f);
  std::vector<int32_t> counts(static_cast<size_t>(E), 5);
  auto scores_d = to_device(scores);
  auto counts_d = to_device(counts);
  gpu::DeviceArray<double> acc(static_cast<size_t>(E + 2)), scratch(static_cast<size_t>(cuda::routing_stats_scratch(T)));
  acc.fill_bytes(0);
  cuda::accumulate_routing_stats(acc.data(), scratch.data(), scores_d.data(), counts_d.data(), nullptr, T, E, nullptr);
  const std::vector<double> got = to_host(acc);
  EXPECT_NEAR(got[static_cast<size_t>(E)] / static_cast<double>(T), std::log(16.0), 1e-12);
  EXPECT_EQ(got[0], 5.0);
}

}  // namespace
}  // namespace moe
