// Execution modes of the GPU step that must not change a single bit: activation
// recomputation (per layer), CUDA graph replay, the expert-parallel path over one rank and
// re-placed experts (slots relabelled, weights moved, also between micro-batches), in
// dropless and capacity routing, against the plain eager step on the same model and
// batches: losses, gradients, loads, per-expert norms, and an AdamW step's weights and
// moments.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>

#include "gpu_test_util.h"
#include "small_models.h"
#include "model/cuda/gpu_transformer.h"
#include "model/cuda/loopback_exchange.h"
#include "model/transformer.h"
#include "optim/cuda/gpu_optimizer.h"

namespace moe {
namespace {

ModelConfig mode_config(double capacity_factor) { return test::small_moe_model(capacity_factor); }

struct Batch {
  std::vector<int32_t> inputs, targets;
};

Batch make_batch(const ModelConfig& c, int64_t batch, uint64_t seed, bool some_ignored) {
  Batch b;
  CounterRng rng(seed, "tokens");
  for (int64_t i = 0; i < batch * c.seq_len; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.bits(i)[0] % c.vocab_size));
    b.targets.push_back(some_ignored && i % 7 == 3 ? -1 : static_cast<int32_t>(rng.bits(i)[1] % c.vocab_size));
  }
  return b;
}

struct RunResult {
  std::vector<ForwardResult> losses;
  std::vector<float> grads;
  std::vector<std::vector<int64_t>> load;
  std::vector<double> expert_norms;
  std::vector<float> values, m, v;  // after one AdamW step
};

// Per MoE layer, the experts of each rank (one rank here), in slot order.
using Placement = std::vector<std::vector<std::vector<int64_t>>>;

// Expert parallelism over one rank (LoopbackExpertExchange): the exchange is a copy, so
// the expert-parallel path (count exchange, host plan, gathers to and from the
// expert-major rows, local offsets) must give the plain step's bits.
using OneRankExchange = LoopbackExpertExchange;

// How a step starts its gradients. write_first: as training does (begin_gradients: the
// expert gradients written by the first backward, not zeroed), three steps of the same
// micro-batches, each starting from gradient blocks filled with NaN bytes (what is not
// written or zeroed shows), the last one read back; so a CUDA graph of a first micro-batch
// is captured and replayed. balance_bias: set on every MoE layer (moe.bias_balancing).
struct StepStart {
  bool write_first = false;
  std::vector<float> balance_bias;
};

// What the MoE layers recompute (GpuModelOptions::recompute_experts), in how many of them.
struct ExpertRows {
  ExpertRecompute recompute = ExpertRecompute::None;
  int64_t layers = -1;  // recompute_experts_layers
  ExpertRows(ExpertRecompute r = ExpertRecompute::None, int64_t n = -1) : recompute(r), layers(n) {}
};

// Three micro-batches accumulated (the last with ignored targets: a new graph), then the
// gradients and expert loads read back.
// With placements: the first before micro-batch 0, the second (if any) before micro-batch 2,
// when gradients have been accumulated (they move with their experts).
RunResult run(const ModelConfig& config, int64_t recompute_layers, bool graphs,
              ExpertRows expert_rows = {},
              std::shared_ptr<GpuExpertExchange> exchange = nullptr, const std::vector<Placement>& placements = {},
              const StepStart& start = {}) {
  Transformer<float> host(config, 11);
  GpuModelOptions options;
  options.recompute_layers = recompute_layers;
  options.recompute_experts = expert_rows.recompute;
  options.recompute_experts_layers = expert_rows.layers;
  options.expert_exchange = exchange;
  GpuTransformer gpu(config, host.params(), options);
  GpuOptimizer optimizer(gpu.parameters(), host.params(), gpu.stream());
  gpu.plan(2);
  gpu.enable_graphs(graphs);
  if (!start.balance_bias.empty())
    for (size_t l = 0; l < gpu.expert_layout().size(); ++l) gpu.routing().set_balance_bias(l, start.balance_bias);
  RunResult r;
  for (int step = 0; step < (start.write_first ? 3 : 1); ++step) {
    r.losses.clear();
    gpu.routing().reset_stats();
    if (start.write_first) {
      MOE_CUDA_CHECK(cudaMemset(gpu.parameters().grads(), 0xff,
                                static_cast<size_t>(gpu.parameters().storage_numel()) * sizeof(float)));
      gpu.begin_gradients();
    } else {
      gpu.parameters().zero_grads();
    }
    for (int micro = 0; micro < 3; ++micro) {
      const size_t placement = micro == 0 ? 0 : micro == 2 ? 1 : 2;
      if (placement < placements.size()) {
        gpu.place_experts(placements[placement]);
        for (size_t l = 0; l < placements[placement].size(); ++l)
          EXPECT_EQ(expert_blocks(gpu.expert_layout()[l].slots), placements[placement][l]);
      }
      const Batch b = make_batch(config, 2, 20 + micro, micro == 2);
      r.losses.push_back(gpu.forward_backward(b.inputs.data(), b.targets.data(), 1.0 / 3));
    }
  }
  gpu.download_grads(host.params());
  auto& params = host.params();
  for (int id = 0; id < params.size(); ++id)
    r.grads.insert(r.grads.end(), params.grad(id), params.grad(id) + params.numel(id));
  r.load = gpu.routing().stats().load;
  r.expert_norms = to_expert_order(gpu.expert_layout(), optimizer.clip_expert_grads(0.0));
  optimizer.adamw_step(AdamWStep{1e-3, 0.9, 0.95, 1e-8, 0.1, 1}, 1.0f);
  gpu.download_state(params, r.m, r.v);
  for (int id = 0; id < params.size(); ++id)
    r.values.insert(r.values.end(), params.value(id), params.value(id) + params.numel(id));
  return r;
}

void expect_identical(const RunResult& got, const RunResult& want, const char* what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i].ce_loss, want.losses[i].ce_loss) << what << " micro-batch " << i;
    EXPECT_EQ(got.losses[i].aux_loss, want.losses[i].aux_loss) << what << " micro-batch " << i;
    EXPECT_EQ(got.losses[i].z_loss, want.losses[i].z_loss) << what << " micro-batch " << i;
    EXPECT_EQ(got.losses[i].dropped, want.losses[i].dropped) << what << " micro-batch " << i;
    EXPECT_TRUE(std::isfinite(got.losses[i].ce_loss));
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  size_t differing = 0;
  for (size_t i = 0; i < got.grads.size(); ++i) differing += got.grads[i] != want.grads[i] || std::isnan(got.grads[i]);
  EXPECT_EQ(differing, 0u) << what << ": gradients differ";
  EXPECT_EQ(got.load, want.load) << what << ": tokens per expert differ (counted twice?)";
  EXPECT_EQ(got.expert_norms, want.expert_norms) << what << ": per-expert norms differ";
  EXPECT_TRUE(got.values == want.values) << what << ": weights after AdamW differ";
  EXPECT_TRUE(got.m == want.m && got.v == want.v) << what << ": moments after AdamW differ";
}

class GpuStepModes : public ::testing::TestWithParam<double> {};

TEST_P(GpuStepModes, RecomputeAndGraphsAreBitIdenticalToTheEagerStep) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = mode_config(GetParam());
  const RunResult eager = run(config, 0, false);
  if (GetParam() > 0) {
    int64_t dropped = 0;
    for (const ForwardResult& f : eager.losses) dropped += f.dropped;
    EXPECT_GT(dropped, 0) << "the capacity case should drop tokens";
  }
  expect_identical(run(config, -1, false), eager, "recompute all layers");
  expect_identical(run(config, 2, false), eager, "recompute the first two layers");
  expect_identical(run(config, 0, true), eager, "CUDA graph");
  expect_identical(run(config, -1, true), eager, "CUDA graph with recompute");
  expect_identical(run(config, 0, false, ExpertRecompute::Swiglu), eager, "recompute expert rows and SwiGLU");
  expect_identical(run(config, 0, false, ExpertRecompute::All), eager, "recompute the experts' gate|up too");
  expect_identical(run(config, 2, false, ExpertRecompute::All), eager, "recompute experts and the first two layers");
  expect_identical(run(config, 0, true, ExpertRecompute::Swiglu), eager, "CUDA graph with expert recompute");
  // recompute_experts_layers: the first MoE layers share the rows, the later keep theirs.
  expect_identical(run(config, 0, false, {ExpertRecompute::Swiglu, 1}), eager, "SwiGLU recomputed in one MoE layer");
  expect_identical(run(config, 2, true, {ExpertRecompute::All, 2}), eager,
                   "gate|up recomputed in two MoE layers, two layers recomputed whole, CUDA graph");
  auto exchange = std::make_shared<OneRankExchange>();
  expect_identical(run(config, 0, false, ExpertRecompute::None, exchange), eager, "expert parallelism over one rank");
  // Per MoE layer and micro-batch: counts, tokens, their slots and weights out and the
  // partial combines back in the forward; output gradients out, row gradients and weight
  // gradients back in the backward.
  EXPECT_EQ(exchange->calls(), 3 * 3 * 8);
  expect_identical(run(config, 2, false, ExpertRecompute::None, std::make_shared<OneRankExchange>()), eager,
                   "expert parallelism with the first two layers recomputed");
  // Re-placed experts (three MoE layers of 8): reversed, shuffled, kept; then another
  // placement between micro-batches.
  const std::vector<int64_t> identity = {0, 1, 2, 3, 4, 5, 6, 7};
  const Placement first = {{{7, 6, 5, 4, 3, 2, 1, 0}}, {{3, 0, 6, 1, 7, 2, 5, 4}}, {identity}};
  const Placement second = {{{1, 0, 3, 2, 5, 4, 7, 6}}, {identity}, {{4, 5, 6, 7, 0, 1, 2, 3}}};
  expect_identical(run(config, 0, false, ExpertRecompute::None, nullptr, {first, second}), eager, "re-placed experts");
  expect_identical(run(config, -1, true, ExpertRecompute::Swiglu, nullptr, {first, second}), eager,
                   "re-placed experts in a CUDA graph with recompute");
  expect_identical(run(config, 0, false, ExpertRecompute::None, std::make_shared<OneRankExchange>(), {second, first}),
                   eager, "re-placed experts under expert parallelism over one rank");
}

// No zeroing pass (begin_gradients): the step's first backward writes the expert and dense
// projection gradients with beta 0 and zeroes the experts without rows; every result is
// the memset + beta 1 step's, bit for bit (0 + x = x), in every mode, from NaN-filled
// gradients (the model has a dense layer and a shared expert).
TEST_P(GpuStepModes, WritingTheFirstMicroBatchsGradientsIsBitIdenticalToZeroing) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = mode_config(GetParam());
  const RunResult eager = run(config, 0, false);
  const StepStart write{true, {}};
  expect_identical(run(config, 0, false, ExpertRecompute::None, nullptr, {}, write), eager, "written, eager");
  expect_identical(run(config, 0, true, ExpertRecompute::None, nullptr, {}, write), eager, "written, CUDA graphs");
  expect_identical(run(config, -1, true, ExpertRecompute::All, nullptr, {}, write), eager,
                   "written, CUDA graphs and recompute");
  expect_identical(run(config, 2, false, ExpertRecompute::Swiglu, nullptr, {}, write), eager,
                   "written, recompute");
  expect_identical(run(config, 0, false, ExpertRecompute::None, std::make_shared<OneRankExchange>(), {}, write), eager,
                   "written, expert parallelism over one rank");
  const std::vector<int64_t> identity = {0, 1, 2, 3, 4, 5, 6, 7};
  const Placement first = {{{7, 6, 5, 4, 3, 2, 1, 0}}, {{3, 0, 6, 1, 7, 2, 5, 4}}, {identity}};
  const Placement second = {{{1, 0, 3, 2, 5, 4, 7, 6}}, {identity}, {{4, 5, 6, 7, 0, 1, 2, 3}}};
  expect_identical(run(config, 0, true, ExpertRecompute::None, nullptr, {first, second}, write), eager,
                   "written, re-placed experts in CUDA graphs");
  // The LM head's GEMM writes the tied embedding's gradient before its scatter adds; the
  // router bias accumulates (zeroed).
  ModelConfig tied = config;
  tied.tie_embeddings = true;
  tied.moe.router_bias = true;
  expect_identical(run(tied, 0, true, ExpertRecompute::None, nullptr, {}, write), run(tied, 0, false),
                   "written, tied embeddings and router bias");
}

// Experts no token reaches (a balancing bias far below the scores): with beta 0 the grouped
// GEMM writes nothing for them, so a kernel zeroes them; the same bits as the memset.
TEST_P(GpuStepModes, EmptyExpertsEndWithZeroGradientsWithoutTheMemset) {
  MOE_REQUIRE_GPU();
  ModelConfig config = mode_config(GetParam());
  config.moe.bias_balancing = true;
  StepStart zeroed;
  zeroed.balance_bias = {0, -100, 0, 0, 0, -100, 0, -100};
  const RunResult eager = run(config, 0, false, ExpertRecompute::None, nullptr, {}, zeroed);
  for (const std::vector<int64_t>& layer : eager.load)
    for (int64_t e : {1, 5, 7}) ASSERT_EQ(layer[static_cast<size_t>(e)], 0) << "expert " << e << " got tokens";
  StepStart write = zeroed;
  write.write_first = true;
  expect_identical(run(config, 0, false, ExpertRecompute::None, nullptr, {}, write), eager, "empty experts, eager");
  expect_identical(run(config, 0, true, ExpertRecompute::None, nullptr, {}, write), eager, "empty experts, graphs");
}

TEST(GpuExpertPlacement, BadPlacementsAreRefusedBeforeAnythingMoves) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = mode_config(0.0);
  Transformer<float> host(config, 11);
  GpuTransformer gpu(config, host.params());
  const std::vector<int64_t> identity = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_THROW(gpu.place_experts({{identity}, {identity}, {identity}}), Error);  // before plan()
  gpu.plan(2);
  ASSERT_EQ(gpu.expert_layout().size(), 3u);
  EXPECT_EQ(expert_blocks(gpu.expert_layout()[0].slots), (std::vector<std::vector<int64_t>>{identity}));
  EXPECT_THROW(gpu.place_experts({{identity}, {identity}}), Error);  // two layers of three
  EXPECT_THROW(gpu.place_experts({{identity}, {identity}, {{0, 1, 2, 3, 4, 5, 6, 6}}}), Error);  // 6 twice
  EXPECT_THROW(gpu.place_experts({{identity}, {identity}, {{0, 1, 2, 3, 4, 5, 6}}}), Error);     // 7 missing
  EXPECT_THROW(gpu.place_experts({{identity}, {identity}, {identity, {}}}), Error);              // two ranks of one
  EXPECT_EQ(expert_blocks(gpu.expert_layout()[2].slots), (std::vector<std::vector<int64_t>>{identity}));
}

TEST(GpuExpertParallel, RefusesGraphsAndExpertRecompute) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = mode_config(0.0);
  Transformer<float> host(config, 11);
  GpuModelOptions options;
  options.expert_exchange = std::make_shared<OneRankExchange>();
  options.recompute_experts = ExpertRecompute::Swiglu;
  GpuTransformer gpu(config, host.params(), options);
  EXPECT_THROW(gpu.enable_graphs(true), Error);
  EXPECT_THROW(gpu.plan(2), Error);
}

INSTANTIATE_TEST_SUITE_P(Routing, GpuStepModes, ::testing::Values(0.0, 1.0));

}  // namespace
}  // namespace moe
