// The GPU router losses and fused router backward against the CPU chain
// select_backward -> aux_loss_backward -> scores_backward -> z_loss_backward.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"
#include "moe/router.h"

namespace moe {
namespace {

struct Case {
  int64_t T, E, K;
  ScoreFunc f;
  bool renormalize;
  float temperature;
};

class GpuRouterBackward : public ::testing::TestWithParam<Case> {};

std::vector<float> random_floats(size_t n, const char* name, double scale) {
  CounterRng rng(11, name);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(scale * rng.normal(i));
  return v;
}

TEST_P(GpuRouterBackward, LossesAndGradientsMatchCpu) {
  MOE_REQUIRE_GPU();
  const Case c = GetParam();
  const double aux_coef = 0.01, z_coef = 0.001, dloss = 0.25;
  auto logits = random_floats(c.T * c.E, "logits", 1.0);
  auto dweight = random_floats(c.T * c.K, "dweight", 1.0);
  std::vector<float> scores(c.T * c.E), weight(c.T * c.K);
  std::vector<int32_t> expert(c.T * c.K);
  router_scores_forward<float>(scores.data(), logits.data(), c.T, c.E, c.temperature, c.f);
  router_select<float>(expert.data(), weight.data(), scores.data(), nullptr, c.T, c.E, c.K, c.renormalize);
  const double aux_ref = aux_loss_forward<float>(scores.data(), expert.data(), c.T, c.E, c.K, c.f, aux_coef);
  const double z_ref = z_loss_forward<float>(logits.data(), c.T, c.E, c.temperature, z_coef);
  std::vector<float> dscores(c.T * c.E), dlogits_ref(c.T * c.E);
  router_select_backward<float>(dscores.data(), dweight.data(), expert.data(), scores.data(), c.T, c.E, c.K,
                                c.renormalize);
  aux_loss_backward<float>(dscores.data(), scores.data(), expert.data(), c.T, c.E, c.K, c.f, aux_coef, dloss);
  router_scores_backward<float>(dlogits_ref.data(), dscores.data(), scores.data(), c.T, c.E, c.temperature, c.f);
  z_loss_backward<float>(dlogits_ref.data(), logits.data(), c.T, c.E, c.temperature, z_coef, dloss);

  // The GPU gets the same scores and choices, so only the backward is compared.
  auto scores_d = to_device(scores), logits_d = to_device(logits), dweight_d = to_device(dweight);
  auto expert_d = to_device(expert);
  auto counts_d = poisoned<int32_t>(c.E);
  cuda::expert_counts(counts_d.data(), expert_d.data(), c.T, c.E, c.K, nullptr);
  auto counts = to_host(counts_d);
  for (int64_t e = 0; e < c.E; ++e)
    EXPECT_EQ(counts[e], std::count(expert.begin(), expert.end(), static_cast<int32_t>(e)));
  auto aux_term_d = poisoned<float>(c.T), z_term_d = poisoned<float>(c.T), sums_d = poisoned<float>(2);
  cuda::router_loss_terms(aux_term_d.data(), z_term_d.data(), scores_d.data(), logits_d.data(), counts_d.data(), c.T,
                          c.E, c.K, c.temperature, c.f, nullptr);
  cuda::ordered_sum(sums_d.data(), aux_term_d.data(), c.T, static_cast<float>(aux_coef * c.E / c.T), nullptr);
  cuda::ordered_sum(sums_d.data() + 1, z_term_d.data(), c.T, static_cast<float>(z_coef / c.T), nullptr);
  auto sums = to_host(sums_d);
  EXPECT_NEAR(sums[0], aux_ref, 1e-5 * std::abs(aux_ref));
  EXPECT_NEAR(sums[1], z_ref, 1e-5 * std::abs(z_ref));

  auto dlogits_d = poisoned<float>(c.T * c.E);
  cuda::router_backward(dlogits_d.data(), dweight_d.data(), scores_d.data(), logits_d.data(), expert_d.data(),
                        counts_d.data(), c.T, c.E, c.K, c.temperature, c.f, c.renormalize,
                        static_cast<float>(dloss * aux_coef), static_cast<float>(dloss * z_coef), nullptr);
  double max_abs = 0;
  for (float g : dlogits_ref) max_abs = std::max(max_abs, static_cast<double>(std::abs(g)));
  expect_close("dlogits", to_host(dlogits_d), dlogits_ref, 1e-4, 1e-5 * max_abs);
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuRouterBackward,
                         ::testing::Values(Case{1, 8, 2, ScoreFunc::Softmax, true, 1.0f},
                                           Case{1000, 8, 2, ScoreFunc::Softmax, false, 0.3f},
                                           Case{4097, 128, 2, ScoreFunc::Softmax, true, 0.3f},
                                           Case{999, 64, 8, ScoreFunc::Sigmoid, true, 1.0f},
                                           Case{333, 16, 3, ScoreFunc::Sigmoid, false, 0.5f}));

}  // namespace
}  // namespace moe
