// training.expert_grad_dtype: the key reads and writes (test_config.cpp's round trip) and,
// here, its refusal over several ranks (one line naming the key) and that the CPU path,
// which keeps fp32 gradients, ignores it. The GPU side: tests/gpu/test_gpu_bf16_grads.cpp.
#include <gtest/gtest.h>

#include <sstream>

#include "expect_error.h"
#include "test_resume_fixtures.h"
#include "dist/tcp_ranks.h"
#include "train/trainer.h"

namespace moe {
namespace {

RunConfig bf16_config() {
  RunConfig config = test::tiny_config();
  config.training.expert_grad_dtype = GradDtype::Bf16;
  return config;
}

// The data-parallel sums, ZeRO and expert parallelism do not cover the bf16 block.
TEST(ExpertGradDtype, MultiRankRunsAreRefusedWithOneLine) {
  const RunConfig config = bf16_config();
  dist::run_tcp_ranks(2, [&](std::unique_ptr<dist::Communicator>& world, int) {
    const auto& m = config.model;
    test::expect_one_line_error<ConfigError>(
        [&] {
          Trainer trainer(config, std::make_unique<test::ResumableTask>(16, m.seq_len, 1),
                          std::make_unique<test::ResumableTask>(16, m.seq_len, 2), std::move(world));
        },
        {"training.expert_grad_dtype", "2 ranks"});
  });
}

// On the CPU the key changes nothing: the same losses as fp32.
TEST(ExpertGradDtype, CpuPathIgnoresIt) {
  RunConfig fp32 = test::tiny_config();
  fp32.training.device = TrainingDevice::Cpu;
  fp32.training.steps = 2;
  RunConfig bf16 = fp32;
  bf16.training.expert_grad_dtype = GradDtype::Bf16;
  std::vector<double> losses[2];
  for (int i = 0; i < 2; ++i) {
    auto trainer = test::make_trainer(i == 0 ? fp32 : bf16);
    trainer->on_step = [&](const StepStats& stats) { losses[i].push_back(stats.loss); };
    std::ostringstream log;
    trainer->run(log);
  }
  ASSERT_EQ(losses[0].size(), 2u);
  EXPECT_EQ(losses[0], losses[1]);
}

}  // namespace
}  // namespace moe
