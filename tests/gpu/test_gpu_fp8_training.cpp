// training.precision = fp8 on the GPU model (GpuModelOptions::fp8_experts): the experts'
// forward and data-gradient GEMMs in fp8 (docs/FP8.md). Against the bf16 model from the
// same weights: the losses and gradients close but not identical (the fp8 path runs);
// reruns and expert recomputation bit-identical (it is deterministic); a short training
// run's loss falls as bf16's does.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "gpu_test_util.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "optim/cuda/gpu_optimizer.h"
#include "small_models.h"

namespace moe {
namespace {

struct Fp8Run {
  std::vector<double> losses;  // ce per micro-batch (or per step)
  std::vector<float> grads;    // after the micro-batches of the first step
};

// `steps` optimizer steps of two micro-batches each on fixed random batches (the same for
// every run); the gradients of the first step are kept.
Fp8Run run(bool fp8, int steps, ExpertRecompute recompute = ExpertRecompute::None) {
  const ModelConfig config = test::small_moe_model(0.0);
  Transformer<float> host(config, 7);
  GpuModelOptions options;
  options.fp8_experts = fp8;
  options.recompute_experts = recompute;
  GpuTransformer gpu(config, host.params(), options);
  GpuOptimizer optimizer(gpu.parameters(), host.params(), gpu.stream());
  gpu.plan(2);
  Fp8Run r;
  for (int step = 0; step < steps; ++step) {
    gpu.parameters().zero_grads();
    double loss = 0;
    for (int micro = 0; micro < 2; ++micro) {
      CounterRng rng(100 + micro, "fp8 batch");
      std::vector<int32_t> inputs, targets;
      // A learnable batch: each target is the next input token.
      for (int64_t i = 0; i < 2 * config.seq_len; ++i)
        inputs.push_back(static_cast<int32_t>(rng.bits(i)[0] % 64));
      for (int64_t i = 0; i < 2 * config.seq_len; ++i)
        targets.push_back(i + 1 < 2 * config.seq_len ? inputs[static_cast<size_t>(i + 1)] : -1);
      loss += gpu.forward_backward(inputs.data(), targets.data(), 0.5).ce_loss / 2;
    }
    r.losses.push_back(loss);
    if (step == 0) {
      gpu.download_grads(host.params());
      auto& params = host.params();
      for (int id = 0; id < params.size(); ++id)
        r.grads.insert(r.grads.end(), params.grad(id), params.grad(id) + params.numel(id));
    }
    optimizer.adamw_step(AdamWStep{3e-3, 0.9, 0.95, 1e-8, 0.0, step + 1}, 1.0f);
  }
  return r;
}

TEST(GpuFp8Experts, OneStepIsCloseToBf16ButNotIdentical) {
  MOE_REQUIRE_GPU();
  const Fp8Run bf16 = run(false, 1), fp8 = run(true, 1);
  ASSERT_TRUE(std::isfinite(fp8.losses[0]));
  EXPECT_NE(fp8.losses[0], bf16.losses[0]) << "the fp8 path did not run";
  EXPECT_NEAR(fp8.losses[0], bf16.losses[0], 0.01 * bf16.losses[0]);
  // The whole gradient: relative distance ||g8 - g16|| / ||g16|| of a few percent (e4m3
  // keeps 3 mantissa bits; the weight gradients are bf16 GEMMs of the fp8 path's rows).
  ASSERT_EQ(fp8.grads.size(), bf16.grads.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < bf16.grads.size(); ++i) {
    ASSERT_TRUE(std::isfinite(fp8.grads[i])) << i;
    diff += (double(fp8.grads[i]) - bf16.grads[i]) * (double(fp8.grads[i]) - bf16.grads[i]);
    norm += double(bf16.grads[i]) * bf16.grads[i];
  }
  EXPECT_GT(diff, 0.0);
  // Measured 0.178 on the H200 (2026-12-02); a scale read from the wrong place moves it
  // by a factor of 2 or more (each tile's scale is its own power of two).
  EXPECT_LT(std::sqrt(diff / norm), 0.3) << "fp8 gradients far from bf16's";
}

TEST(GpuFp8Experts, RerunsAndExpertRecomputationAreBitIdentical) {
  MOE_REQUIRE_GPU();
  const Fp8Run first = run(true, 2), again = run(true, 2), recomputed = run(true, 2, ExpertRecompute::All);
  EXPECT_EQ(again.losses, first.losses);
  EXPECT_TRUE(again.grads == first.grads) << "an fp8 rerun's gradients differ";
  EXPECT_EQ(recomputed.losses, first.losses);
  EXPECT_TRUE(recomputed.grads == first.grads) << "recompute_experts = all changes the fp8 gradients";
}

TEST(GpuFp8Experts, TrainingLossFallsLikeBf16) {
  MOE_REQUIRE_GPU();
  const int steps = 30;
  const Fp8Run bf16 = run(false, steps), fp8 = run(true, steps);
  for (double loss : fp8.losses) ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LT(fp8.losses.back(), 0.8 * fp8.losses.front()) << "fp8 training did not learn";
  // This tiny model all but memorises the task (bf16 ends at 0.24 of ~5.8): fp8's noise
  // leaves it at 0.49 after 30 steps (H200, 2026-12-02), so the bound is on what was
  // learnt, not on the last bits of it; the 1,000-step run of a 160 M model
  // (bench/fp8_quality.sh) is the quality measurement.
  EXPECT_LT(fp8.losses.back(), bf16.losses.back() + 0.1 * bf16.losses.front());
}

}  // namespace
}  // namespace moe
