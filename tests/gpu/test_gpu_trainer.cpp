// The trainer on the GPU: a run stopped at a checkpoint and resumed continues like the
// uninterrupted run (the GPU state goes through the same safetensors checkpoint as on
// the CPU), and it learns the synthetic look-back task; every step reports the SM clock
// its SMs counted.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include "gpu_test_util.h"
#include "thread_trainers.h"
#include "train/checkpoint.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

RunConfig gpu_config(const std::filesystem::path& checkpoint_dir) {
  RunConfig config = test::tiny_gpu_run(6);
  config.training.val_batches = 2;
  config.checkpoint.dir = checkpoint_dir.string();
  return config;
}

std::vector<double> run(const RunConfig& config, const std::string& resume_from = "") {
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_TRUE(trainer.on_gpu());
  std::vector<double> losses;
  trainer.on_step = [&](const StepStats& stats) { losses.push_back(stats.loss); };
  std::ostringstream log;
  if (!resume_from.empty()) trainer.resume(resume_from, log);
  trainer.run(log);
  return losses;
}

// training.cuda_graphs and training.recompute_layers change how the step runs, never
// its numbers: the same losses, bit for bit, as the plain GPU run.
TEST(GpuTrainer, GraphsAndRecomputeTrainLikeThePlainRun) {
  MOE_REQUIRE_GPU();
  RunConfig config = gpu_config("");
  config.checkpoint.dir = "";
  const std::vector<double> plain = run(config);
  config.training.cuda_graphs = true;
  config.training.recompute_layers = -1;
  const std::vector<double> modes = run(config);
  ASSERT_EQ(modes.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(modes[i], plain[i]) << "step " << i + 1;
}

// training.expert_grad_dtype = bf16 through the trainer (two micro-batches a step, so two
// roundings of the expert gradients): the losses follow the fp32 run's closely and fall;
// with CUDA graphs the same losses bit for bit as without.
// Every step carries the SM clock its SMs counted (metrics board.sm_clock_counted_mhz),
// with CUDA graphs too: within what the device can run at.
TEST(GpuTrainer, EveryStepCarriesTheClockItsSmsCounted) {
  MOE_REQUIRE_GPU();
  int device = 0, max_khz = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&max_khz, cudaDevAttrClockRate, device), cudaSuccess);
  for (const bool graphs : {false, true}) {
    RunConfig config = gpu_config("");
    config.checkpoint.dir = "";
    config.training.cuda_graphs = graphs;
    const auto& m = config.model;
    Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                    std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
    std::vector<double> counted;
    trainer.on_step = [&](const StepStats& stats) { counted.push_back(stats.board.sm_mhz_counted); };
    std::ostringstream log;
    trainer.run(log);
    ASSERT_EQ(counted.size(), 6u);
    for (size_t i = 0; i < counted.size(); ++i) {
      EXPECT_GT(counted[i], 100.0) << "step " << i + 1 << (graphs ? " with graphs" : "");
      EXPECT_LT(counted[i], 1.02e-3 * max_khz) << "step " << i + 1;
    }
  }
}

// Over thread ranks too (expert parallel 2, data parallel over the same two): each rank's
// steps carry the clock its own stamps counted on its own stream, within what the device
// can run at (the ranks share one GPU here, each counting the SMs its stamps land on).
TEST(GpuTrainer, EveryRanksStepsCarryTheClockItsSmsCounted) {
  MOE_REQUIRE_GPU();
  int device = 0, max_khz = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&max_khz, cudaDevAttrClockRate, device), cudaSuccess);
  RunConfig config = gpu_config("");
  config.checkpoint.dir = "";
  config.training.micro_batch = 2;  // per rank
  config.parallel.expert_parallel = 2;
  std::vector<std::vector<double>> counted(2);
  const std::vector<std::string> errors = test::run_thread_trainers(config, 2, [&](int rank, Trainer& trainer) {
    trainer.on_step = [&counted, rank](const StepStats& stats) {
      counted[static_cast<size_t>(rank)].push_back(stats.board.sm_mhz_counted);
    };
  });
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    ASSERT_EQ(counted[r].size(), 6u) << "rank " << r;
    for (size_t i = 0; i < counted[r].size(); ++i) {
      EXPECT_GT(counted[r][i], 100.0) << "rank " << r << " step " << i + 1;
      EXPECT_LT(counted[r][i], 1.02e-3 * max_khz) << "rank " << r << " step " << i + 1;
    }
  }
}

TEST(GpuTrainer, Bf16ExpertGradientsTrainLikeFp32) {
  MOE_REQUIRE_GPU();
  RunConfig config = gpu_config("");
  config.checkpoint.dir = "";
  const std::vector<double> fp32 = run(config);
  config.training.expert_grad_dtype = GradDtype::Bf16;
  const std::vector<double> bf16 = run(config);
  ASSERT_EQ(bf16.size(), fp32.size());
  for (size_t i = 0; i < fp32.size(); ++i) EXPECT_NEAR(bf16[i], fp32[i], 1e-2 * fp32[i]) << "step " << i + 1;
  EXPECT_LT(bf16.back(), bf16.front());
  config.training.cuda_graphs = true;
  EXPECT_EQ(run(config), bf16) << "CUDA graphs changed the bf16 run";
}

// training.precision = fp8 with fp8 AdamW moments (the optimizer's state and the GEMMs'
// precision are independent; the fp8 weight codes come from the weights AdamW writes):
// the losses stay finite, fall, and follow the bf16-moment run's within 5% a step; with
// CUDA graphs the same losses bit for bit.
TEST(GpuTrainer, Fp8GemmsWithFp8MomentsTrainLikeBf16Moments) {
  MOE_REQUIRE_GPU();
  RunConfig config = gpu_config("");
  config.checkpoint.dir = "";
  config.training.precision = TrainingPrecision::Fp8;
  config.training.expert_grad_dtype = GradDtype::Bf16;
  config.optimizer.state_dtype = MomentDtype::Bf16;
  const std::vector<double> bf16_moments = run(config);
  config.optimizer.state_dtype = MomentDtype::Fp8;
  const std::vector<double> fp8_moments = run(config);
  ASSERT_EQ(fp8_moments.size(), bf16_moments.size());
  for (size_t i = 0; i < fp8_moments.size(); ++i) {
    ASSERT_TRUE(std::isfinite(fp8_moments[i])) << "step " << i + 1;
    EXPECT_NEAR(fp8_moments[i], bf16_moments[i], 0.05 * bf16_moments[i]) << "step " << i + 1;
  }
  EXPECT_LT(fp8_moments.back(), fp8_moments.front());
  config.training.cuda_graphs = true;
  EXPECT_EQ(run(config), fp8_moments) << "CUDA graphs changed the run";
}

TEST(GpuTrainer, StopAndResumeContinuesTheRun) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_gpu_resume_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  const std::vector<double> whole = run(gpu_config(root / "whole"));
  ASSERT_EQ(whole.size(), 6u);
  RunConfig first_half = gpu_config(root / "split");
  first_half.training.stop_at = 3;
  const std::vector<double> before = run(first_half);
  ASSERT_EQ(before.size(), 3u);
  const auto checkpoint = latest_checkpoint(root / "split");
  ASSERT_TRUE(checkpoint.has_value());
  const std::vector<double> after = run(gpu_config(root / "split"), checkpoint->string());
  ASSERT_EQ(after.size(), 3u);
  // Same batches and state, and every reduction in a fixed order (training.deterministic):
  // bit for bit.
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(before[i], whole[i]) << "step " << i + 1;
    EXPECT_EQ(after[i], whole[i + 3]) << "step " << i + 4;
  }
  EXPECT_LT(whole.back(), whole.front());
  std::filesystem::remove_all(root);
}

// A micro-batch whose logits alone need 275 GB: the batch controller halves it until the
// buffers fit, keeping the tokens per step.
TEST(GpuTrainer, HalvesTheMicroBatchWhenItDoesNotFit) {
  MOE_REQUIRE_GPU();
  RunConfig config = gpu_config("");
  ModelConfig& m = config.model;
  m.vocab_size = 262144;
  m.dim = 64;
  m.n_layers = 1;
  m.seq_len = 4096;
  m.moe.expert_hidden = 64;
  config.training.micro_batch = 128;
  config.training.global_batch_tokens = 128 * 4096;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_LT(trainer.micro_batch(), 128);
  EXPECT_EQ(trainer.micro_batch() * trainer.micro_batches_per_step(), 128);
}

}  // namespace
}  // namespace moe
