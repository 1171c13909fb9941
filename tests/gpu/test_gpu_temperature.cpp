// moe.temperature_control on the GPU, against the CPU path:
// - each MoE layer's router reads its own temperature from device memory: with different
//   temperatures per layer the GPU's losses are the CPU's (bf16 tolerance), and the
//   z-loss (which depends on 1/t) moves when one layer's temperature does;
// - a captured CUDA graph's replays see a temperature set after the capture: graphs on
//   and off give the same bits before and after the change;
// - in the trainer, every step's temperature update is the CPU rule
//   (temperature_control_update) on that step's loads, graphs on and off agree bit for
//   bit, and the GPU's temperatures equal the CPU run's while their loads agree.
#include <gtest/gtest.h>

#include <memory>
#include <sstream>

#include "gpu_test_util.h"
#include "small_models.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "moe/temperature_control.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

std::vector<int32_t> tokens(const ModelConfig& c, int64_t batch, uint64_t seed) {
  CounterRng rng(seed, "temperature");
  std::vector<int32_t> t;
  for (int64_t i = 0; i < batch * c.seq_len; ++i) t.push_back(static_cast<int32_t>(rng.bits(i)[0] % c.vocab_size));
  return t;
}

ModelConfig controlled_model() {
  ModelConfig c = test::small_moe_model(0.0);  // 3 MoE layers after a dense one
  c.moe.temperature_control = true;
  c.moe.z_loss_coef = 0.01;
  return c;
}

TEST(GpuTemperature, PerLayerTemperaturesMatchTheCpu) {
  MOE_REQUIRE_GPU();
  const ModelConfig c = controlled_model();
  const int64_t batch = 2;
  Transformer<float> cpu(c, 5);
  // Router weights x 8: logits of order 1 (at init they are ~0.2, where the temperature
  // barely moves the losses and the check below could not tell t from 1).
  for (int64_t l = c.first_dense_layers; l < c.n_layers; ++l) {
    const int id = cpu.params().find("layers." + std::to_string(l) + ".moe.router.weight");
    ASSERT_GE(id, 0);
    float* w = cpu.params().value(id);
    for (int64_t i = 0; i < cpu.params().numel(id); ++i) w[i] *= 8.0f;
  }
  cpu.plan(batch);
  GpuTransformer gpu(c, cpu.params());
  gpu.plan(batch);
  const auto inputs = tokens(c, batch, 1), targets = tokens(c, batch, 2);
  gpu.routing().reset_stats();
  const ForwardResult at_one = gpu.forward(inputs.data(), targets.data());
  const std::vector<float> temperatures = {0.5f, 2.0f, 0.75f};
  auto layers = cpu.moe_layers();
  ASSERT_EQ(layers.size(), temperatures.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    EXPECT_EQ(gpu.routing().temperature(i), 1.0f);
    layers[i]->temperature_state()[0] = temperatures[i];
    gpu.routing().set_temperature(i, temperatures[i]);
    EXPECT_EQ(gpu.routing().temperature(i), temperatures[i]);
  }
  EXPECT_THROW(gpu.routing().set_temperature(3, 1.0f), Error);
  EXPECT_THROW(gpu.routing().set_temperature(0, 0.0f), Error);
  const ForwardResult want = cpu.forward(inputs.data(), targets.data());
  gpu.routing().reset_stats();
  const ForwardResult got = gpu.forward(inputs.data(), targets.data());
  EXPECT_NEAR(got.ce_loss, want.ce_loss, 1e-2 * want.ce_loss);
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 2e-2 * want.aux_loss + 1e-6);
  EXPECT_NEAR(got.z_loss, want.z_loss, 2e-2 * want.z_loss + 1e-7);
  // The temperatures are read: t = 0.5 on one layer changes the z-loss by far more.
  EXPECT_GT(std::abs(got.z_loss - at_one.z_loss), 0.1 * at_one.z_loss);
}

// forward_backward with graphs: captured at t = 1, replayed after layer 0 went to 0.5.
std::vector<ForwardResult> graph_run(bool graphs, std::vector<float>* grads) {
  const ModelConfig c = controlled_model();
  Transformer<float> host(c, 5);
  GpuTransformer gpu(c, host.params());
  gpu.plan(2);
  gpu.enable_graphs(graphs);
  const auto inputs = tokens(c, 2, 3), targets = tokens(c, 2, 4);
  std::vector<ForwardResult> losses;
  gpu.parameters().zero_grads();
  losses.push_back(gpu.forward_backward(inputs.data(), targets.data(), 1.0));
  gpu.routing().set_temperature(0, 0.5f);
  gpu.parameters().zero_grads();
  losses.push_back(gpu.forward_backward(inputs.data(), targets.data(), 1.0));
  gpu.download_grads(host.params());
  auto& params = host.params();
  for (int id = 0; id < params.size(); ++id) grads->insert(grads->end(), params.grad(id), params.grad(id) + params.numel(id));
  return losses;
}

TEST(GpuTemperature, GraphReplaysSeeTheNewTemperature) {
  MOE_REQUIRE_GPU();
  std::vector<float> eager_grads, graph_grads;
  const auto eager = graph_run(false, &eager_grads), replayed = graph_run(true, &graph_grads);
  ASSERT_EQ(eager.size(), 2u);
  EXPECT_NE(eager[1].z_loss, eager[0].z_loss);  // the change is visible: the test can fail
  for (size_t i = 0; i < eager.size(); ++i) {
    EXPECT_EQ(replayed[i].ce_loss, eager[i].ce_loss) << "call " << i;
    EXPECT_EQ(replayed[i].aux_loss, eager[i].aux_loss) << "call " << i;
    EXPECT_EQ(replayed[i].z_loss, eager[i].z_loss) << "call " << i;
  }
  EXPECT_TRUE(graph_grads == eager_grads);
}

RunConfig run_config(TrainingDevice device, bool graphs) {
  RunConfig config;
  config.model = test::small_moe_model(0.0);
  config.model.moe.temperature_control = true;
  config.model.moe.temperature_gain = 0.5;
  config.metrics.alert_imbalance = 0.0;
  config.training.device = device;
  config.training.cuda_graphs = graphs;
  config.training.micro_batch = 8;
  config.training.global_batch_tokens = 1024;  // 2 micro-batches
  config.training.steps = 6;
  config.training.val_batches = 1;
  config.training.val_interval = 0;
  config.lr.peak = 3e-3;
  config.lr.warmup_steps = 2;
  return config;
}

struct TrainRun {
  std::vector<StepStats> steps;
  std::vector<std::vector<float>> final_state;  // per MoE layer, after the last step
};

TrainRun train(const RunConfig& config) {
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_EQ(trainer.on_gpu(), config.training.device == TrainingDevice::Cuda);
  TrainRun run;
  trainer.on_step = [&](const StepStats& stats) { run.steps.push_back(stats); };
  std::ostringstream log;
  trainer.run(log);
  for (auto* layer : trainer.model().moe_layers()) run.final_state.push_back(layer->temperature_state());
  return run;
}

TEST(GpuTemperature, TrainerFollowsTheCpuRuleWithAndWithoutGraphs) {
  MOE_REQUIRE_GPU();
  const RunConfig config = run_config(TrainingDevice::Cuda, false);
  const TrainRun gpu = train(config);
  ASSERT_EQ(gpu.steps.size(), 6u);
  const MoEConfig& mc = config.model.moe;
  const size_t L = gpu.final_state.size();
  std::vector<std::vector<float>> state(L, std::vector<float>(kTemperatureStateSize));
  for (auto& s : state) temperature_state_init(s.data(), mc.temperature);
  for (const StepStats& step : gpu.steps) {
    ASSERT_EQ(step.layers.size(), L);
    for (size_t l = 0; l < L; ++l) {
      EXPECT_EQ(step.layers[l].temperature, state[l][0]) << "step " << step.step << " layer " << l;
      const auto& loads = step.layers[l].tokens_E;  // dropless: the loads the rule read
      temperature_control_update(state[l].data(), loads.data(), static_cast<int64_t>(loads.size()),
                                 TemperatureControl{0.0, mc.temperature_gain, mc.temperature_min, mc.temperature_max,
                                                    mc.temperature, -1});
    }
  }
  EXPECT_EQ(gpu.final_state, state);
  for (const auto& s : state) EXPECT_NE(s[0], 1.0f) << "the temperature never moved: the test checks nothing";

  const TrainRun replayed = train(run_config(TrainingDevice::Cuda, true));
  ASSERT_EQ(replayed.steps.size(), gpu.steps.size());
  for (size_t s = 0; s < gpu.steps.size(); ++s) EXPECT_EQ(replayed.steps[s].loss, gpu.steps[s].loss) << "step " << s + 1;
  EXPECT_EQ(replayed.final_state, gpu.final_state);

  // Against the CPU: the same rule on the same loads gives the same temperatures, as long
  // as the loads agree (bf16 can route a token differently).
  const TrainRun cpu = train(run_config(TrainingDevice::Cpu, false));
  ASSERT_EQ(cpu.steps.size(), gpu.steps.size());
  size_t compared = 0;
  for (size_t s = 0; s < gpu.steps.size(); ++s) {
    bool same_loads = true;
    for (size_t l = 0; l < L; ++l) {
      EXPECT_EQ(gpu.steps[s].layers[l].temperature, cpu.steps[s].layers[l].temperature) << "step " << s + 1;
      same_loads = same_loads && gpu.steps[s].layers[l].tokens_E == cpu.steps[s].layers[l].tokens_E;
    }
    ++compared;
    if (!same_loads) break;
    EXPECT_NEAR(gpu.steps[s].loss, cpu.steps[s].loss, 3e-2 * cpu.steps[s].loss) << "step " << s + 1;
  }
  EXPECT_GE(compared, 1u);
}

}  // namespace
}  // namespace moe
