// moe.route_cache on the GPU: the probe reads each MoE layer's own top-k choices (kept
// apart from the activations a recomputed layer shares), so it measures the same hit
// rates in every step mode, and the training is unchanged by it.
#include <gtest/gtest.h>

#include <sstream>

#include "gpu_test_util.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

std::vector<StepStats> run(const RunConfig& config) {
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_TRUE(trainer.on_gpu());
  std::vector<StepStats> steps;
  trainer.on_step = [&](const StepStats& stats) { steps.push_back(stats); };
  std::ostringstream log;
  trainer.run(log);
  return steps;
}

TEST(GpuRoutingCache, SameHitRatesInEveryStepModeAndTrainingUnchanged) {
  MOE_REQUIRE_GPU();
  RunConfig config = test::tiny_gpu_run(8);
  config.model.n_layers = 3;
  config.model.moe.n_experts = 8;
  const std::vector<StepStats> off = run(config);
  config.model.moe.route_cache = true;
  const std::vector<StepStats> plain = run(config);
  config.training.cuda_graphs = true;
  config.training.recompute_layers = -1;
  const std::vector<StepStats> modes = run(config);
  ASSERT_EQ(plain.size(), off.size());
  ASSERT_EQ(modes.size(), off.size());
  for (size_t s = 0; s < off.size(); ++s) {
    EXPECT_EQ(plain[s].loss, off[s].loss) << "step " << s + 1;
    EXPECT_EQ(modes[s].loss, off[s].loss) << "step " << s + 1;
    ASSERT_EQ(plain[s].layers.size(), 3u);
    EXPECT_EQ(plain[s].layers[0].route_cache_hit_rate, -1);
    for (size_t l = 1; l < 3; ++l) {
      EXPECT_GE(plain[s].layers[l].route_cache_hit_rate, 0);
      EXPECT_LE(plain[s].layers[l].route_cache_hit_rate, 1);
      EXPECT_EQ(modes[s].layers[l].route_cache_hit_rate, plain[s].layers[l].route_cache_hit_rate) << "step " << s + 1;
      EXPECT_EQ(modes[s].layers[l].route_cache_token_hit_rate, plain[s].layers[l].route_cache_token_hit_rate);
    }
  }
}

}  // namespace
}  // namespace moe
