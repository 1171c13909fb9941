// training.fp8_weight_cache (GpuModelOptions::fp8_weight_cache): the fp8 experts' weights
// quantised once after they change instead of before every GEMM give the same bits as
// the per-use quantisation (docs/FP8.md, "Weight cache"), through everything that writes
// the weights between two uses: optimizer steps with two micro-batches each, a checkpoint
// restored right after a forward (the cache then holds later weights), a re-placement of
// the experts right after a forward (the slots' weights move), a forward-only pass; with
// expert recomputation and CUDA graphs; with rows padded per expert (DeepGEMM's GEMMs, w1
// and w3 cached as one gate|up operand). The resumed steps must also repeat the first pass
// bit for bit. And GpuParameterStore::weights_version moves with every weight writer.
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "core/rng.h"
#include "fp8_gemm_test_util.h"
#include "gpu_test_util.h"
#include "model/cuda/gpu_parameter_io.h"
#include "model/cuda/gpu_parameters.h"
#include "model/cuda/gpu_transformer.h"
#include "model/transformer.h"
#include "optim/cuda/gpu_optimizer.h"
#include "small_models.h"

namespace moe {
namespace {

struct CacheRun {
  std::vector<double> losses;  // ce and aux of every micro-batch and forward, in order
  std::vector<double> resumed;  // the same, of the steps repeated after the restore
  std::vector<float> grads;     // the last step's, before its optimizer step
  std::vector<float> values;    // the weights at the end
};

struct Batch {
  std::vector<int32_t> inputs, targets;
};

Batch make_batch(const ModelConfig& config, int seed) {
  CounterRng rng(static_cast<uint64_t>(seed), "fp8 cache batch");
  Batch b;
  const int64_t n = 2 * config.seq_len;
  for (int64_t i = 0; i < n; ++i) b.inputs.push_back(static_cast<int32_t>(rng.bits(i)[0] % 64));
  for (int64_t i = 0; i < n; ++i) b.targets.push_back(i + 1 < n ? b.inputs[static_cast<size_t>(i + 1)] : -1);
  return b;
}

std::vector<float> flat_values(ParameterStore<float>& params, bool grads) {
  std::vector<float> out;
  for (int id = 0; id < params.size(); ++id) {
    const float* p = grads ? params.grad(id) : params.value(id);
    out.insert(out.end(), p, p + params.numel(id));
  }
  return out;
}

CacheRun run(bool cache, ExpertRecompute recompute, bool graphs, bool padded) {
  ModelConfig config = test::small_moe_model(0.0);
  config.moe.expert_hidden = 256;  // two scale blocks along the hidden dimension
  Transformer<float> host(config, 7);
  GpuModelOptions options;
  options.fp8_experts = true;
  options.fp8_weight_cache = cache;
  options.recompute_experts = recompute;
  options.fp8_deepgemm = padded;
  GpuTransformer gpu(config, host.params(), options);
  GpuOptimizer optimizer(gpu.parameters(), host.params(), gpu.stream());
  gpu.plan(2);
  gpu.enable_graphs(graphs);
  CacheRun r;
  std::vector<double>* losses = &r.losses;
  auto record = [&](const ForwardResult& f) {
    losses->push_back(f.ce_loss);
    losses->push_back(f.aux_loss);
  };
  // One optimizer step of two micro-batches (the trainer's calls).
  auto step = [&](int s, bool keep_grads) {
    gpu.begin_gradients();
    for (int micro = 0; micro < 2; ++micro) {
      const Batch b = make_batch(config, 100 + 2 * s + micro);
      record(gpu.forward_backward(b.inputs.data(), b.targets.data(), 0.5));
    }
    if (keep_grads) {
      gpu.download_grads(host.params());
      r.grads = flat_values(host.params(), true);
    }
    optimizer.adamw_step(AdamWStep{3e-3, 0.9, 0.95, 1e-8, 0.1, s + 1}, 1.0f);
  };
  auto forward_only = [&](int seed) {
    const Batch b = make_batch(config, seed);
    record(gpu.forward(b.inputs.data(), b.targets.data()));
  };
  step(0, false);
  // A checkpoint after step 0, as the trainer saves one (expert order).
  ParameterStore<float> saved = host.params();
  std::vector<float> m, v;
  gpu.download_state(saved, m, v);
  step(1, false);
  step(2, false);
  // A forward at the current weights (a cache made from them), then the checkpoint
  // restored without an optimizer step between: steps 1 and 2 must repeat.
  forward_only(900);
  gpu.upload_state(saved, m, v);
  losses = &r.resumed;
  step(1, false);
  step(2, false);
  losses = &r.losses;
  // A re-placement right after a forward: every MoE layer's experts in reverse slot order.
  forward_only(901);
  const std::vector<int64_t> reversed = {7, 6, 5, 4, 3, 2, 1, 0};
  gpu.place_experts({{reversed}, {reversed}, {reversed}});
  step(3, false);
  forward_only(902);
  step(4, true);
  gpu.download_params(host.params());
  r.values = flat_values(host.params(), false);
  return r;
}

// Every call that can write the bf16 weights moves weights_version() (what the cache's
// staleness check reads); the reads and the gradient calls do not.
TEST(GpuParameterStoreVersion, EveryWeightWriterBumpsIt) {
  MOE_REQUIRE_GPU();
  ModelConfig config = test::small_moe_model(0.0);
  Transformer<float> host(config, 3);
  ParameterStore<float>& params = host.params();
  GpuParameterStore store(params, MomentDtype::Fp32, {}, nullptr);
  uint64_t version = store.weights_version();
  auto bumped = [&](const char* what) {
    const uint64_t now = store.weights_version();
    EXPECT_GT(now, version) << what << " did not move the weights' version";
    version = now;
  };
  (void)store.weights();
  store.zero_grads();
  download_params(store, params);
  EXPECT_EQ(store.weights_version(), version) << "reads moved the version";
  (void)store.weights_hi();
  bumped("weights_hi()");
  upload_state(store, params, {}, {});
  bumped("upload_state");
  std::vector<float> values(64, 0.5f);
  upload_range(store, Range{0, 64}, values.data(), nullptr, nullptr);
  bumped("upload_range");
  const RangeList resident = store.resident_ranges();
  store.set_resident_ranges(resident);
  bumped("set_resident_ranges");
}

class GpuFp8WeightCache : public ::testing::TestWithParam<std::tuple<ExpertRecompute, bool, bool>> {};

TEST_P(GpuFp8WeightCache, SameBitsAsQuantisingAtEachUse) {
  const auto [recompute, graphs, padded] = GetParam();
  if (padded)
    MOE_REQUIRE_DEEPGEMM();
  else
    MOE_REQUIRE_GPU();
  const CacheRun cached = run(true, recompute, graphs, padded), per_use = run(false, recompute, graphs, padded);
  ASSERT_EQ(cached.losses.size(), per_use.losses.size());
  for (size_t i = 0; i < cached.losses.size(); ++i) EXPECT_EQ(cached.losses[i], per_use.losses[i]) << "loss " << i;
  EXPECT_EQ(cached.resumed, per_use.resumed);
  EXPECT_TRUE(cached.grads == per_use.grads) << "the last step's gradients differ";
  EXPECT_TRUE(cached.values == per_use.values) << "the weights at the end differ";
  // The restored checkpoint repeats steps 1 and 2 (the 4 micro-batches after step 0's 2).
  for (const CacheRun* r : {&cached, &per_use}) {
    ASSERT_GE(r->losses.size(), 12u);
    const std::vector<double> first(r->losses.begin() + 4, r->losses.begin() + 12);
    EXPECT_EQ(r->resumed, first) << (r == &cached ? "cached" : "per use") << ": the resume differs";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuFp8WeightCache,
                         ::testing::Combine(::testing::Values(ExpertRecompute::None, ExpertRecompute::Swiglu,
                                                              ExpertRecompute::All),
                                            ::testing::Bool(), ::testing::Bool()));

}  // namespace
}  // namespace moe
