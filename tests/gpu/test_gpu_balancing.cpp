// moe.bias_balancing and training.expert_grad_clip on the GPU, against the CPU path:
// - the balancing bias steers the GPU's top-k exactly as the CPU's;
// - the per-expert gradient norms and the clipped gradients are the CPU's, bit for bit,
//   on the same (downloaded) gradients;
// - in the trainer, every step's bias update is the CPU rule (bias_balance_update) applied
//   to that step's loads, and GPU and CPU runs agree: losses within bf16 tolerance, and the
//   biases exactly for every expert whose load was on the same side of the mean so far.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <memory>
#include <sstream>

#include "dist/gradient_stages.h"
#include "dist/zero_shards.h"
#include "gpu_test_util.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "moe/router.h"
#include "optim/cuda/gpu_optimizer.h"
#include "optim/grad_clip.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

ModelConfig tiny_model() {
  ModelConfig c;
  c.vocab_size = 320;
  c.dim = 64;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.seq_len = 64;
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 64;
  return c;
}

std::vector<int32_t> random_tokens(const ModelConfig& c, int64_t batch, const char* name) {
  CounterRng rng(7, name);
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < batch * c.seq_len; ++i) tokens.push_back(static_cast<int32_t>(rng.bits(i)[0] % c.vocab_size));
  return tokens;
}

// A bias of +100 makes expert 2 every token's choice and -100 keeps expert 1 idle; the
// combine weights stay the unbiased scores, so the losses still agree with the CPU's.
TEST(GpuBalancing, SelectionBiasSteersTheTopKAsOnTheCpu) {
  MOE_REQUIRE_GPU();
  ModelConfig c = tiny_model();
  c.moe.bias_balancing = true;
  const int64_t batch = 2, T = batch * c.seq_len;
  Transformer<float> cpu(c, 3);
  cpu.plan(batch);
  GpuTransformer gpu(c, cpu.params());
  gpu.plan(batch);
  const std::vector<float> bias = {0.0f, -100.0f, 100.0f, 0.25f};
  auto layers = cpu.moe_layers();
  ASSERT_EQ(layers.size(), 2u);
  layers[0]->balance_bias_E() = bias;
  gpu.routing().set_balance_bias(0, bias);
  EXPECT_EQ(gpu.routing().balance_bias(0), bias);
  EXPECT_EQ(gpu.routing().balance_bias(1), std::vector<float>(4, 0.0f));
  EXPECT_THROW(gpu.routing().set_balance_bias(2, bias), Error);
  EXPECT_THROW(gpu.routing().set_balance_bias(0, {1.0f}), Error);

  const auto inputs = random_tokens(c, batch, "inputs"), targets = random_tokens(c, batch, "targets");
  const ForwardResult want = cpu.forward(inputs.data(), targets.data());
  gpu.routing().reset_stats();
  const ForwardResult got = gpu.forward(inputs.data(), targets.data());
  const auto loads = gpu.routing().stats().load;
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0][2], T);
  EXPECT_EQ(loads[0][1], 0);
  EXPECT_EQ(layers[0]->load_E()[2], T);
  EXPECT_EQ(layers[0]->load_E()[1], 0);
  EXPECT_EQ(loads[0][0] + loads[0][3], T);
  EXPECT_NEAR(got.ce_loss, want.ce_loss, 1e-2 * want.ce_loss);
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 2e-2 * want.aux_loss + 1e-6);
}

// Each expert's norm over its slices of w1, w3, w2, as optim/grad_clip.cpp sums it.
std::vector<double> cpu_expert_norms(ParameterStore<float>& params) {
  std::vector<double> norms;
  for (int first = 0; first < params.size(); ++first) {
    const std::string& group = params.spec(first).expert_group;
    if (group.empty() || (first > 0 && params.spec(first - 1).expert_group == group)) continue;
    std::vector<int> ids;
    for (int id = first; id < params.size() && params.spec(id).expert_group == group; ++id) ids.push_back(id);
    const int64_t n_experts = params.spec(first).shape[0];
    for (int64_t e = 0; e < n_experts; ++e) {
      double sq = 0;
      for (int id : ids) {
        const int64_t per_expert = params.numel(id) / n_experts;
        sq += sum_of_squares(params.grad(id) + e * per_expert, per_expert);
      }
      norms.push_back(std::sqrt(sq));
    }
  }
  return norms;
}

TEST(GpuBalancing, ExpertNormsAndClippingMatchTheCpuBitForBit) {
  MOE_REQUIRE_GPU();
  ModelConfig c = tiny_model();
  c.n_layers = 3;
  c.first_dense_layers = 1;
  c.dense_hidden = 96;
  c.moe.n_shared_experts = 1;  // shared experts are not clipped per expert
  const int64_t batch = 2;
  Transformer<float> cpu(c, 3);
  GpuTransformer gpu(c, cpu.params());
  GpuOptimizer optimizer(gpu.parameters(), cpu.params(), gpu.stream());
  gpu.plan(batch);
  const auto inputs = random_tokens(c, batch, "inputs"), targets = random_tokens(c, batch, "targets");
  gpu.parameters().zero_grads();
  gpu.forward(inputs.data(), targets.data());
  gpu.backward(1.0);
  Transformer<float> host(c, 3);  // receives the GPU gradients
  gpu.download_grads(host.params());

  const std::vector<double> want = cpu_expert_norms(host.params());
  ASSERT_EQ(want.size(), 8u);  // 2 MoE layers x 4 experts
  const std::vector<double> norms = optimizer.clip_expert_grads(0.0);  // norms only
  ASSERT_EQ(norms.size(), want.size());
  for (size_t x = 0; x < want.size(); ++x) {
    EXPECT_GT(want[x], 0.0) << "expert " << x;
    EXPECT_EQ(norms[x], want[x]) << "expert " << x;
  }
  // A threshold between the middle norms: half the experts are clipped.
  std::vector<double> sorted = want;
  std::sort(sorted.begin(), sorted.end());
  const double max_norm = 0.5 * (sorted[3] + sorted[4]);
  EXPECT_EQ(optimizer.clip_expert_grads(max_norm), want);  // the norms before clipping

  const ClipStats stats = clip_gradients(host.params(), 0.0, max_norm);  // the CPU's clipping
  EXPECT_EQ(stats.experts_clipped, 4);
  EXPECT_EQ(stats.max_expert_norm, sorted.back());
  Transformer<float> clipped(c, 3);
  gpu.download_grads(clipped.params());
  auto& cpu_params = host.params();
  for (int id = 0; id < cpu_params.size(); ++id) {
    int64_t mismatches = 0;
    for (int64_t i = 0; i < cpu_params.numel(id); ++i)
      mismatches += clipped.params().grad(id)[i] != cpu_params.grad(id)[i];
    EXPECT_EQ(mismatches, 0) << cpu_params.spec(id).name;
  }
  // The global norm after per-expert clipping, as the CPU saw it.
  EXPECT_EQ(optimizer.grad_norm(), stats.global_norm);
  for (double norm : optimizer.clip_expert_grads(0.0)) EXPECT_LE(norm, max_norm * (1 + 1e-6));
}

// ZeRO-1 (shard_expert_clip): three ranks holding the same summed gradients, each with its
// plan's norm and update ranges, give the whole model's expert norms once their partial
// squares are added up, and clip their update ranges as the whole model clips them (the
// factor from the summed norm may differ in its last bit: relative 1e-6), leaving the
// rest of the block alone.
TEST(GpuBalancing, ShardedExpertClippingIsTheWholeClipping) {
  MOE_REQUIRE_GPU();
  ModelConfig c = tiny_model();
  c.n_layers = 3;
  c.first_dense_layers = 1;
  c.dense_hidden = 96;
  const int64_t batch = 2;
  Transformer<float> cpu(c, 3);
  GpuTransformer whole(c, cpu.params());
  GpuOptimizer whole_optimizer(whole.parameters(), cpu.params(), whole.stream());
  whole.plan(batch);
  const auto inputs = random_tokens(c, batch, "inputs"), targets = random_tokens(c, batch, "targets");
  whole.parameters().zero_grads();
  whole.forward(inputs.data(), targets.data());
  whole.backward(1.0);
  Transformer<float> unclipped(c, 3);
  whole.download_grads(unclipped.params());
  const std::vector<double> norms = whole_optimizer.clip_expert_grads(0.0);
  std::vector<double> sorted = norms;
  std::sort(sorted.begin(), sorted.end());
  const double max_norm = 0.5 * (sorted[3] + sorted[4]);
  whole_optimizer.clip_expert_grads(max_norm);
  Transformer<float> want(c, 3);
  whole.download_grads(want.params());

  const auto stages = dist::gradient_ranges_by_stage(
      cpu.params(), [&](const std::string& name) { return cpu.backward_stage_of(name); }, cpu.backward_stages());
  const int ranks = 3;
  std::vector<std::unique_ptr<GpuTransformer>> shards;
  std::vector<std::unique_ptr<GpuOptimizer>> optimizers;
  std::vector<dist::ZeroShardPlan> plans;
  std::vector<double> total(norms.size(), 0.0);
  for (int r = 0; r < ranks; ++r) {
    shards.push_back(std::make_unique<GpuTransformer>(c, cpu.params()));
    optimizers.push_back(std::make_unique<GpuOptimizer>(shards.back()->parameters(), cpu.params(), shards.back()->stream()));
    plans.push_back(dist::plan_zero_shards(stages, shards.back()->parameters().fp32_copies().ranges(), 1000, ranks, r));
    optimizers.back()->shard_expert_clip(plans.back().norm, plans.back().update);
    upload_grads(shards.back()->parameters(), unclipped.params());
    EXPECT_THROW(optimizers.back()->clip_expert_grads(0.0), Error);  // no sum over the ranks given
    // First pass: the partial squares alone (max_norm 0: nothing scaled).
    optimizers.back()->clip_expert_grads(0.0, [&](std::vector<double>& squares) {
      ASSERT_EQ(squares.size(), total.size());
      for (size_t x = 0; x < squares.size(); ++x) total[x] += squares[x];
    });
  }
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    const std::vector<double> got =
        optimizers[static_cast<size_t>(r)]->clip_expert_grads(max_norm, [&](std::vector<double>& squares) { squares = total; });
    ASSERT_EQ(got.size(), norms.size());
    for (size_t x = 0; x < norms.size(); ++x) EXPECT_NEAR(got[x], norms[x], 1e-12 * norms[x]) << "expert " << x;
    Transformer<float> clipped(c, 3);
    shards[static_cast<size_t>(r)]->download_grads(clipped.params());
    const auto& update = plans[static_cast<size_t>(r)].update;
    const auto in_update = [&](int64_t e) {
      auto it = std::upper_bound(update.begin(), update.end(), e,
                                 [](int64_t at, const Range& range) { return at < range.offset; });
      return it != update.begin() && e < std::prev(it)->end();
    };
    int64_t far = 0, moved = 0, scaled = 0;
    for (int id = 0; id < cpu.params().size(); ++id)
      for (int64_t i = 0; i < cpu.params().numel(id); ++i) {
        const float g = clipped.params().grad(id)[i], before = unclipped.params().grad(id)[i];
        if (in_update(cpu.params().offset(id) + i)) {
          far += std::abs(g - want.params().grad(id)[i]) > 1e-6f * std::abs(want.params().grad(id)[i]);
          scaled += g != before;
        } else {
          moved += g != before;
        }
      }
    EXPECT_EQ(far, 0) << "update ranges clipped differently from the whole model";
    EXPECT_EQ(moved, 0) << "elements outside the update ranges were scaled";
    EXPECT_GT(scaled, 0);  // some of this rank's experts were clipped
  }
}

RunConfig run_config(TrainingDevice device) {
  RunConfig config;
  config.model = tiny_model();
  config.training.device = device;
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
  std::vector<std::vector<float>> final_bias;  // per MoE layer, after the last step
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
  for (auto* layer : trainer.model().moe_layers()) run.final_bias.push_back(layer->balance_bias_E());
  return run;
}

// The bias a step routed with (StepStats::layers[i].bias_E); after the last one, the final.
std::vector<float> bias_at(const TrainRun& run, size_t step, size_t layer) {
  if (step == run.steps.size()) return run.final_bias[layer];
  const auto& b = run.steps[step].layers[layer].bias_E;
  return {b.begin(), b.end()};
}

TEST(GpuBalancing, TrainerBiasUpdatesFollowTheCpuRule) {
  MOE_REQUIRE_GPU();
  RunConfig config = run_config(TrainingDevice::Cuda);
  config.model.moe.bias_balancing = true;
  config.model.moe.bias_update_rate = 0.01;
  const TrainRun gpu = train(config);
  ASSERT_EQ(gpu.steps.size(), 6u);
  const int64_t E = config.model.moe.n_experts;
  bool moved = false;
  for (size_t s = 0; s < gpu.steps.size(); ++s) {
    ASSERT_FALSE(gpu.steps[s].skipped);
    ASSERT_EQ(gpu.steps[s].layers.size(), 2u);
    for (size_t l = 0; l < 2; ++l) {
      const auto& loads = gpu.steps[s].layers[l].tokens_E;
      int64_t total = 0;
      for (int64_t load : loads) total += load;
      EXPECT_EQ(total, config.training.global_batch_tokens * config.model.moe.top_k) << "step " << s + 1;
      // The step's update is the CPU's rule on the step's loads, exactly.
      std::vector<float> want = bias_at(gpu, s, l);
      if (s == 0) EXPECT_EQ(want, std::vector<float>(static_cast<size_t>(E), 0.0f));
      bias_balance_update(want.data(), loads.data(), E, config.model.moe.bias_update_rate);
      EXPECT_EQ(bias_at(gpu, s + 1, l), want) << "step " << s + 1 << " layer " << l;
      for (float b : want) moved = moved || b != 0.0f;
    }
  }
  EXPECT_TRUE(moved) << "the loads never left the mean: the test checks nothing";

  // CUDA graphs replay the forward with the bias buffer as it is at each step.
  RunConfig graphs = config;
  graphs.training.cuda_graphs = true;
  graphs.training.recompute_layers = -1;
  const TrainRun replayed = train(graphs);
  ASSERT_EQ(replayed.steps.size(), gpu.steps.size());
  for (size_t s = 0; s < gpu.steps.size(); ++s) EXPECT_EQ(replayed.steps[s].loss, gpu.steps[s].loss) << "step " << s + 1;
  EXPECT_EQ(replayed.final_bias, gpu.final_bias);

  // Against the CPU: an expert's bias is a sum of +-rate (or 0) steps, each decided by the
  // side of the mean its load fell on; while those sides agree, the biases are equal.
  config.training.device = TrainingDevice::Cpu;
  const TrainRun cpu = train(config);
  ASSERT_EQ(cpu.steps.size(), gpu.steps.size());
  int64_t compared = 0;
  for (size_t l = 0; l < 2; ++l)
    for (int64_t e = 0; e < E; ++e)
      for (size_t s = 0; s <= gpu.steps.size(); ++s) {
        EXPECT_EQ(bias_at(gpu, s, l)[e], bias_at(cpu, s, l)[e]) << "step " << s << " layer " << l << " expert " << e;
        ++compared;
        if (s == gpu.steps.size()) break;
        auto side = [&](const TrainRun& run) {
          const auto& loads = run.steps[s].layers[l].tokens_E;
          int64_t total = 0;
          for (int64_t load : loads) total += load;
          const int64_t diff = total - E * loads[static_cast<size_t>(e)];
          return (diff > 0) - (diff < 0);
        };
        if (side(gpu) != side(cpu)) break;  // from here on the biases may differ
      }
  EXPECT_GT(compared, 2 * E) << "no expert's step-1 load fell on the same side of the mean on GPU and CPU";
  for (size_t s = 0; s < gpu.steps.size(); ++s)
    EXPECT_NEAR(gpu.steps[s].loss, cpu.steps[s].loss, 3e-2 * cpu.steps[s].loss) << "step " << s + 1;
}

TEST(GpuBalancing, TrainerExpertClippingMatchesTheCpu) {
  MOE_REQUIRE_GPU();
  RunConfig config = run_config(TrainingDevice::Cuda);
  config.training.expert_grad_clip = 0.01;  // far below the experts' norms: every expert is clipped
  config.model.moe.bias_balancing = true;   // both features together
  const TrainRun gpu = train(config);
  RunConfig unclipped = config;
  unclipped.training.expert_grad_clip = 0;
  const TrainRun gpu_unclipped = train(unclipped);
  config.training.device = TrainingDevice::Cpu;
  const TrainRun cpu = train(config);
  ASSERT_EQ(gpu.steps.size(), 6u);
  ASSERT_EQ(cpu.steps.size(), 6u);
  for (size_t s = 0; s < gpu.steps.size(); ++s) {
    const StepStats &g = gpu.steps[s], &c = cpu.steps[s];
    ASSERT_FALSE(g.skipped);
    EXPECT_NEAR(g.loss, c.loss, 3e-2 * c.loss) << "step " << s + 1;
    EXPECT_NEAR(g.max_expert_grad_norm, c.max_expert_grad_norm, 0.15 * c.max_expert_grad_norm) << "step " << s + 1;
  }
  EXPECT_GT(gpu.steps[0].max_expert_grad_norm, config.training.expert_grad_clip);
  // Step 1 starts from the same weights: the global norm, taken after the experts were
  // clipped, agrees with the CPU's and is below the unclipped run's.
  EXPECT_NEAR(gpu.steps[0].grad_norm, cpu.steps[0].grad_norm, 5e-2 * cpu.steps[0].grad_norm);
  EXPECT_LT(gpu.steps[0].grad_norm, gpu_unclipped.steps[0].grad_norm);
  EXPECT_EQ(gpu_unclipped.steps[0].max_expert_grad_norm, 0.0);  // not computed when expert clipping is off
}

}  // namespace
}  // namespace moe
