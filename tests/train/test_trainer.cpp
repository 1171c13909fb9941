#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <vector>

#include "core/threads.h"
#include "synthetic.h"
#include "optim/adamw.h"
#include "optim/grad_clip.h"
#include "optim/lr_schedule.h"
#include "moe/temperature_control.h"
#include "train/trainer.h"

namespace moe {
namespace {


std::unique_ptr<Trainer> make_trainer(const RunConfig& config) {
  const auto& m = config.model;
  return std::make_unique<Trainer>(config,
                                   std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                                   std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
}

TEST(Trainer, LearnsSyntheticLookBackTask) {
  set_num_threads(0);
  RunConfig config = test::lookback_config();
  auto trainer = make_trainer(config);
  std::ostringstream log;
  TrainSummary summary = trainer->run(log);
  EXPECT_NEAR(summary.val_loss_start, std::log(16.0), 0.2) << log.str();
  EXPECT_LT(summary.val_loss_end, 0.05) << log.str();
  EXPECT_EQ(summary.steps, 150);
  EXPECT_EQ(summary.tokens, 150 * 512);
  EXPECT_NE(log.str().find("summary: steps=150 tokens=76800 seconds="), std::string::npos) << log.str();
}

// Same seed, any thread count: bit-identical losses and weights.
TEST(Trainer, BitIdenticalAcrossRunsAndThreadCounts) {
  RunConfig config = test::lookback_config();
  config.training.steps = 4;
  config.model.moe.capacity_factor = 1.0;
  config.model.moe.bias_balancing = true;
  config.training.expert_grad_clip = 0.05;
  auto run = [&](int threads) {
    set_num_threads(threads);
    auto trainer = make_trainer(config);
    std::vector<double> losses;
    for (int64_t step = 0; step < config.training.steps; ++step)
      losses.push_back(trainer->train_step(step).loss);
    auto& params = trainer->model().params();
    std::vector<float> weights;
    for (int id = 0; id < params.size(); ++id)
      weights.insert(weights.end(), params.value(id), params.value(id) + params.numel(id));
    return std::make_pair(losses, weights);
  };
  const auto one = run(1), two = run(2), again = run(2);
  set_num_threads(0);
  EXPECT_EQ(one.first, two.first);
  EXPECT_EQ(two.first, again.first);
  EXPECT_TRUE(one.second == two.second);
  EXPECT_TRUE(two.second == again.second);
}

// Accumulating 4 micro-batches of 4 sequences gives the gradient of one batch of 16.
TEST(Trainer, GradientAccumulationMatchesOneBigBatch) {
  RunConfig config = test::lookback_config();
  config.training.global_batch_tokens = 16 * 16;
  config.model.moe.aux_loss_coef = 0;  // aux loss is per micro-batch by definition
  config.model.moe.z_loss_coef = 0.01;
  config.training.grad_clip = 0;
  auto gradients = [&](int64_t micro_batch) {
    config.training.micro_batch = micro_batch;
    auto trainer = make_trainer(config);
    trainer->train_step(0);
    auto& params = trainer->model().params();
    std::vector<double> grads;
    for (int id = 0; id < params.size(); ++id)
      grads.insert(grads.end(), params.grad(id), params.grad(id) + params.numel(id));
    return grads;
  };
  const auto accumulated = gradients(4), whole = gradients(16);
  ASSERT_EQ(accumulated.size(), whole.size());
  double max_abs = 0, max_err = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(whole[i]));
    max_err = std::max(max_err, std::abs(whole[i] - accumulated[i]));
  }
  EXPECT_GT(max_abs, 1e-3);
  EXPECT_LT(max_err, 1e-5 * max_abs);
}

// Router weights and bias of zero: every token's scores are uniform over the E experts,
// so the step's router entropy is exactly log E per token (softmax and sigmoid).
TEST(Trainer, UniformRouterEntropyIsLogExperts) {
  for (ScoreFunc score : {ScoreFunc::Softmax, ScoreFunc::Sigmoid}) {
    RunConfig config = test::lookback_config();
    config.model.moe.score_func = score;
    auto trainer = make_trainer(config);
    auto& params = trainer->model().params();
    for (int id = 0; id < params.size(); ++id)
      if (params.spec(id).name.find(".router.") != std::string::npos)
        std::fill(params.value(id), params.value(id) + params.numel(id), 0.0f);
    const StepStats stats = trainer->train_step(0);
    ASSERT_EQ(stats.layers.size(), 2u);
    for (const LayerRouting& layer : stats.layers) EXPECT_NEAR(layer.router_entropy, std::log(4.0), 1e-12);
  }
}

// Bias balancing: after a step every expert's bias moved by bias_update_rate towards the
// mean load of that step (up below the mean, down above it); the next step reports it.
TEST(Trainer, BalancingBiasFollowsTheStepsLoad) {
  RunConfig config = test::lookback_config();
  config.model.moe.bias_balancing = true;
  config.model.moe.bias_update_rate = 0.125;  // exact in float
  auto trainer = make_trainer(config);
  const StepStats first = trainer->train_step(0);
  const auto layers = trainer->model().moe_layers();
  ASSERT_EQ(layers.size(), first.layers.size());
  int moved = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<int64_t>& load = first.layers[i].tokens_E;  // dropless: every assignment is kept
    int64_t total = 0;
    for (int64_t l : load) total += l;
    EXPECT_EQ(total, 512 * 2);  // the step's tokens x top-2
    EXPECT_EQ(first.layers[i].bias_E, std::vector<double>(4, 0.0));  // reported before the update
    std::vector<float> want;
    for (int64_t l : load) {
      const int64_t diff = total - 4 * l;  // sign of (mean - load)
      want.push_back(diff > 0 ? 0.125f : diff < 0 ? -0.125f : 0.0f);
      moved += diff != 0;
    }
    EXPECT_EQ(layers[i]->balance_bias_E(), want) << "layer " << i;
  }
  EXPECT_GT(moved, 0);
  const StepStats second = trainer->train_step(1);
  for (size_t i = 0; i < layers.size(); ++i) {
    std::vector<double> want;
    for (int64_t l : first.layers[i].tokens_E) {
      const int64_t diff = 1024 - 4 * l;
      want.push_back(diff > 0 ? 0.125 : diff < 0 ? -0.125 : 0.0);
    }
    EXPECT_EQ(second.layers[i].bias_E, want);
  }
}

// moe.temperature_control: after each step every MoE layer's temperature is the
// controller's rule applied to that step's loads (the same loads the metrics report), with
// the aux-loss direction (down) here; the next step reports and routes with it.
TEST(Trainer, RouterTemperatureFollowsTheStepsLoad) {
  RunConfig config = test::lookback_config();
  config.model.moe.temperature_control = true;
  config.model.moe.temperature_gain = 0.5;
  config.metrics.alert_imbalance = 0.0;  // any imbalance moves it
  auto trainer = make_trainer(config);
  const auto layers = trainer->model().moe_layers();
  std::vector<std::vector<float>> want(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) want[i] = layers[i]->temperature_state();
  int moved = 0;
  for (int64_t step = 0; step < 3; ++step) {
    const StepStats stats = trainer->train_step(step);
    ASSERT_EQ(stats.layers.size(), layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      EXPECT_EQ(stats.layers[i].temperature, want[i][0]) << "reported: the temperature the step routed with";
      const std::vector<int64_t>& load = stats.layers[i].tokens_E;  // dropless: every assignment
      temperature_control_update(want[i].data(), load.data(), static_cast<int64_t>(load.size()),
                                 TemperatureControl{0.0, 0.5, config.model.moe.temperature_min,
                                                    config.model.moe.temperature_max, 1.0, -1});
      EXPECT_EQ(layers[i]->temperature_state(), want[i]) << "layer " << i << " step " << step;
      moved += want[i][0] != 1.0f;
    }
  }
  EXPECT_GT(moved, 0);
  for (auto* layer : layers) EXPECT_LT(layer->temperature(), 1.0);  // imbalanced, aux loss: down
}

// Every evaluation reads the same held-out sequences: the same weights give the same loss.
TEST(Trainer, ValidationOfTheSameWeightsIsRepeatable) {
  RunConfig config = test::lookback_config();
  auto trainer = make_trainer(config);
  trainer->train_step(0);
  const double first = trainer->validate();
  EXPECT_EQ(trainer->validate(), first);
  EXPECT_EQ(trainer->validate(), first);
}

TEST(LrSchedule, WarmupThenCosineToFloor) {
  LrConfig lr;
  lr.peak = 1.0;
  lr.warmup_steps = 10;
  lr.min_ratio = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(lr, 0, 110), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(lr, 4, 110), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(lr, 9, 110), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(lr, 10, 110), 1.0);
  EXPECT_NEAR(learning_rate(lr, 60, 111), 0.55, 1e-12);  // halfway (50 of 100 decay steps): mean of peak and floor
  // Known values of the cosine, 0.1 + 0.9 * (1 + cos(pi * p)) / 2 at p = (step - 10) / 99:
  // p = 1/3 gives 0.775 and p = 2/3 gives 0.325 (a linear decay: 0.7 and 0.4).
  EXPECT_NEAR(learning_rate(lr, 43, 110), 0.775, 1e-12);
  EXPECT_NEAR(learning_rate(lr, 76, 110), 0.325, 1e-12);
  // 100 decay steps: p = 1/4 at step 35, 0.1 + 0.45 * (1 + sqrt(1/2)) = 0.868198 (linear: 0.775).
  EXPECT_NEAR(learning_rate(lr, 35, 111), 0.1 + 0.45 * (1 + std::sqrt(0.5)), 1e-12);
  EXPECT_NEAR(learning_rate(lr, 85, 111), 0.1 + 0.45 * (1 - std::sqrt(0.5)), 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(lr, 109, 110), 0.1);
  for (int64_t s = 11; s < 110; ++s) EXPECT_LT(learning_rate(lr, s, 110), learning_rate(lr, s - 1, 110));
}

TEST(AdamW, MatchesHandComputedStepAndSkipsDecayOnNorms) {
  ParameterStore<float> params;
  const int w = params.add({"w", Shape{2}, Init::Zeros, 0, /*decay=*/true});
  const int n = params.add({"norm", Shape{1}, Init::Ones, 0, /*decay=*/false});
  params.allocate(0);
  params.value(w)[0] = 1.0f;
  params.value(w)[1] = -2.0f;
  params.grad(w)[0] = 0.5f;
  params.grad(w)[1] = 0.0f;
  params.grad(n)[0] = -1.0f;
  OptimizerConfig config;
  config.beta1 = 0.9;
  config.beta2 = 0.99;
  config.eps = 1e-8;
  config.weight_decay = 0.1;
  AdamW adamw(config, params);
  adamw.step(0.01);
  // Step 1: m_hat = g, v_hat = g^2, so the update is lr * sign(g) (plus decay lr*wd*p).
  EXPECT_NEAR(params.value(w)[0], 1.0 * (1 - 0.001) - 0.01, 1e-6);
  EXPECT_NEAR(params.value(w)[1], -2.0 * (1 - 0.001), 1e-6);
  EXPECT_NEAR(params.value(n)[0], 1.0 + 0.01, 1e-6);  // no decay on norms
  // Step 2 with the same gradient: m = g(0.9*0.1+0.1)... bias-corrected m_hat = g again.
  adamw.step(0.01);
  EXPECT_NEAR(params.value(n)[0], 1.02, 1e-5);
}

TEST(GradClip, PerExpertThenGlobal) {
  ParameterStore<float> params;
  const int w1 = params.add({"moe.experts.w1", Shape{3, 2}, Init::Zeros, 0, true, "moe.experts"});
  const int w2 = params.add({"moe.experts.w2", Shape{3, 1}, Init::Zeros, 0, true, "moe.experts"});
  const int dense = params.add({"dense", Shape{1}, Init::Zeros});
  params.allocate(0);
  // Expert 0: norm 5 (3, 4 | 0); expert 1: norm 0.5; expert 2: norm 12 (0, 0 | 12).
  float g1[] = {3, 4, 0.3f, 0.4f, 0, 0};
  float g2[] = {0, 0, 12};
  std::copy(g1, g1 + 6, params.grad(w1));
  std::copy(g2, g2 + 3, params.grad(w2));
  params.grad(dense)[0] = 1.0f;
  ClipStats stats = clip_gradients(params, /*global=*/0, /*expert=*/1.0);
  EXPECT_NEAR(stats.max_expert_norm, 12.0, 1e-6);
  EXPECT_EQ(stats.experts_clipped, 2);
  EXPECT_NEAR(params.grad(w1)[0], 0.6, 1e-5);
  EXPECT_NEAR(params.grad(w1)[1], 0.8, 1e-5);
  EXPECT_FLOAT_EQ(params.grad(w1)[2], 0.3f);  // under the limit: untouched
  EXPECT_NEAR(params.grad(w2)[2], 1.0, 1e-5);
  EXPECT_NEAR(stats.global_norm, std::sqrt(1.0 + 0.25 + 1.0 + 1.0), 1e-5);
  stats = clip_gradients(params, /*global=*/0.5, /*expert=*/0);
  double sq = 0;
  for (int id = 0; id < params.size(); ++id)
    for (int64_t i = 0; i < params.numel(id); ++i) sq += params.grad(id)[i] * params.grad(id)[i];
  EXPECT_TRUE(stats.global_clipped);
  EXPECT_NEAR(std::sqrt(sq), 0.5, 1e-5);
}

// Thresholds on both sides of 1, each between an expert's norm and its square, so that
// comparing the squared norm (or clipping to the squared threshold) gives other values.
TEST(GradClip, PerExpertThresholdsAboveAndBelowOne) {
  ParameterStore<float> params;
  const int w1 = params.add({"moe.experts.w1", Shape{4, 2}, Init::Zeros, 0, true, "moe.experts"});
  const int w2 = params.add({"moe.experts.w2", Shape{4, 1}, Init::Zeros, 0, true, "moe.experts"});
  const int dense = params.add({"dense", Shape{1}, Init::Zeros});
  params.allocate(0);
  // Expert norms: 1.0 (0.6, 0.8 | 0), 1.5 (1.2, 0 | 0.9), 0.5 (0.3, 0.4 | 0), 3 (0, 0 | 3).
  const float g1[] = {0.6f, 0.8f, 1.2f, 0, 0.3f, 0.4f, 0, 0};
  const float g2[] = {0, 0.9f, 0, 3};
  auto load = [&] {
    std::copy(g1, g1 + 8, params.grad(w1));
    std::copy(g2, g2 + 4, params.grad(w2));
    params.grad(dense)[0] = 2.0f;
  };
  auto expert = [&](int e) {
    return std::vector<float>{params.grad(w1)[2 * e], params.grad(w1)[2 * e + 1], params.grad(w2)[e]};
  };
  auto expect_expert = [&](int e, std::vector<double> want) {
    const std::vector<float> got = expert(e);
    for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << "expert " << e << " element " << i;
  };
  // 2.0: only the expert of norm 3 is clipped (1.5 < 2 although 1.5^2 > 2), to 3 * 2 / (3 + 1e-6).
  load();
  ClipStats stats = clip_gradients(params, /*global=*/0, /*expert=*/2.0);
  EXPECT_EQ(stats.experts_clipped, 1);
  EXPECT_NEAR(stats.max_expert_norm, 3.0, 1e-6);
  expect_expert(0, {0.6, 0.8, 0});
  expect_expert(1, {1.2, 0, 0.9});
  expect_expert(2, {0.3, 0.4, 0});
  expect_expert(3, {0, 0, 2.0 * 3 / (3 + 1e-6)});
  EXPECT_FLOAT_EQ(params.grad(dense)[0], 2.0f);  // dense weights are not per-expert clipped
  EXPECT_NEAR(stats.global_norm, std::sqrt(1.0 + 2.25 + 0.25 + 4.0 + 4.0), 1e-5);
  // 0.4: every expert is clipped (0.5 > 0.4 although 0.5^2 < 0.4), each to norm 0.4.
  load();
  stats = clip_gradients(params, /*global=*/0, /*expert=*/0.4);
  EXPECT_EQ(stats.experts_clipped, 4);
  expect_expert(0, {0.24, 0.32, 0});
  expect_expert(1, {0.32, 0, 0.24});
  expect_expert(2, {0.24, 0.32, 0});
  expect_expert(3, {0, 0, 0.4});
  EXPECT_NEAR(stats.global_norm, std::sqrt(4 * 0.16 + 4.0), 1e-5);
  // Global clipping to 0.5 after it: every gradient scaled by 0.5 / 2.154066.
  load();
  stats = clip_gradients(params, /*global=*/0.5, /*expert=*/0.4);
  EXPECT_TRUE(stats.global_clipped);
  const double factor = 0.5 / std::sqrt(4 * 0.16 + 4.0);
  expect_expert(1, {0.32 * factor, 0, 0.24 * factor});
  EXPECT_NEAR(params.grad(dense)[0], 2.0 * factor, 1e-6);
}

}  // namespace
}  // namespace moe
