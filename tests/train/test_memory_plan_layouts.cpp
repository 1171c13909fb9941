// The memory planner's layout search (train/memory_plan.h): which layouts fit a budget,
// their order, and the refusal's one line with its suggestion.
#include "train/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "config/run_config.h"
#include "core/error.h"
#include "core/rng.h"
#include "expect_error.h"
#include "kernels/fp8_blockwise.h"
#include "model/gpu_buffer_sizes.h"
#include "model/transformer.h"
#include "memory_plan_test_config.h"

namespace moe {
namespace {

using test::small_config;

TEST(MemoryPlan, RefusalNamesTheLargestAndALayoutThatFits) {
  RunConfig c = small_config();
  c.model.moe.n_experts = 1;  // no expert parallelism to choose: ZeRO is the first way out
  c.model.moe.top_k = 1;
  c.training.micro_batch = 1;
  MemoryLayout layout = configured_layout(c, 4, 4);
  layout.zero = 1;
  const int64_t zero1 = estimate_memory(c, layout).total();
  layout.zero = 0;
  const MemoryEstimate zero0 = estimate_memory(c, layout);
  ASSERT_GT(zero0.total(), zero1);
  EXPECT_NO_THROW(check_memory_fits(c, 4, 4, 1, zero0.total()));
  test::expect_one_line_error<ConfigError>([&] { check_memory_fits(c, 4, 4, 1, zero1); },
                                           {"exceeds", "largest: " + zero0.largest().name,
                                            "; parallel.zero = 1 over 4 GPUs fits"});
  // Nothing fits on one GPU: the fewest GPUs (doubling) on which a layout does (48
  // layers: state enough that spreading it outweighs NCCL's buffers).
  c.model.n_layers = 48;
  MemoryLayout spread = configured_layout(c, 8, 8), alone = configured_layout(c, 1, 1);
  spread.zero = 2;  // the highest level the GPU offers
  spread.recompute_layers = alone.recompute_layers = -1;
  const int64_t budget = estimate_memory(c, spread).total();
  ASSERT_GT(estimate_memory(c, alone).total(), budget);
  test::expect_one_line_error<ConfigError>([&] { check_memory_fits(c, 1, 1, 1, budget); },
                                           {"no layout fits on 1 GPU:", "GPUs with"});
  test::expect_one_line_error<ConfigError>([&] { check_memory_fits(c, 1, 1, 1, budget); }, {"8 GPUs with"});
  // Thread ranks on one GPU add up.
  const int64_t one_rank = estimate_memory(c, configured_layout(c, 2, 2)).total();
  EXPECT_NO_THROW(check_memory_fits(c, 2, 2, 1, one_rank));
  test::expect_one_line_error<ConfigError>([&] { check_memory_fits(c, 2, 2, 2, one_rank); }, {"2 thread ranks"});
}

// A long sequence's deterministic attention: the dP workspace (B x H x S x S bf16) is the
// largest buffer; where no layout with it fits, recomputation included, the plan offers the
// ordered backward (its fp32 dQ accumulator instead), and the refusal names that setting.
// Ordered dQ is the last resort (4.6x the attention backward's time, measured): a layout
// that recomputes ranks before it.
TEST(MemoryPlan, LongSequencesFitWithTheOrderedAttentionBackward) {
  RunConfig c = small_config();
  c.model.seq_len = 16384;
  c.training.micro_batch = 1;
  c.training.global_batch_tokens = 16384 * 8;
  MemoryLayout workspace = configured_layout(c, 1, 1);
  ASSERT_FALSE(workspace.ordered_attention);
  MemoryLayout ordered = workspace;
  ordered.ordered_attention = true;
  const MemoryEstimate dp = estimate_memory(c, workspace), accumulator = estimate_memory(c, ordered);
  EXPECT_EQ(dp.largest().name, "shared scratch");
  EXPECT_EQ(dp.shared_scratch, attention_workspace_estimate(1, 4, 16384, 128, AttentionDq::Workspace));
  ASSERT_LT(accumulator.total(), dp.total());
  // The smallest layout with the dP workspace: the most recomputation.
  int64_t smallest_workspace = dp.total();
  for (const LayoutFit& fit : layouts_that_fit(c, 1, 1, dp.total())) {
    EXPECT_FALSE(fit.layout.ordered_attention);
    smallest_workspace = std::min(smallest_workspace, fit.estimate.total());
  }
  ASSERT_LT(smallest_workspace, dp.total());
  // Where it fits, it comes first although the ordered backward fits without recomputation.
  ASSERT_LE(accumulator.total(), smallest_workspace);
  std::vector<LayoutFit> fits = layouts_that_fit(c, 1, 1, smallest_workspace);
  ASSERT_FALSE(fits.empty());
  EXPECT_FALSE(fits.front().layout.ordered_attention);
  EXPECT_TRUE(fits.front().layout.recompute_layers != 0 || fits.front().layout.recompute_experts != ExpertRecompute::None);
  EXPECT_TRUE(std::any_of(fits.begin(), fits.end(), [&](const LayoutFit& f) { return f.layout == ordered; }));
  EXPECT_TRUE(std::is_partitioned(fits.begin(), fits.end(), [](const LayoutFit& f) { return !f.layout.ordered_attention; }));
  // SwiGLU recomputed with the dP workspace fits: found and first, although the ordered
  // backward fits with nothing recomputed (which once ended the search for expert recompute).
  MemoryLayout swiglu_rows = workspace;
  swiglu_rows.recompute_experts = ExpertRecompute::Swiglu;
  swiglu_rows.recompute_experts_layers = -1;
  const int64_t swiglu_budget = estimate_memory(c, swiglu_rows).total();
  ASSERT_LT(swiglu_budget, dp.total());
  ASSERT_LE(accumulator.total(), swiglu_budget);
  fits = layouts_that_fit(c, 1, 1, swiglu_budget);
  ASSERT_FALSE(fits.empty());
  EXPECT_EQ(fits.front().layout, swiglu_rows);
  // The refusal suggests recomputing too, not the ordered backward, even where that changes
  // more settings: with SwiGLU recomputed, recomputing whole layers changes two (there is
  // no whole-layer SwiGLU choice), the ordered backward one.
  RunConfig swiglu = c;
  swiglu.training.recompute_experts = ExpertRecompute::Swiglu;
  MemoryLayout swiglu_ordered = configured_layout(swiglu, 1, 1);
  swiglu_ordered.ordered_attention = true;
  int64_t smallest_swiglu = estimate_memory(swiglu, configured_layout(swiglu, 1, 1)).total();
  for (const LayoutFit& fit : layouts_that_fit(swiglu, 1, 1, smallest_swiglu))
    if (!fit.layout.ordered_attention) smallest_swiglu = std::min(smallest_swiglu, fit.estimate.total());
  ASSERT_LE(estimate_memory(swiglu, swiglu_ordered).total(), smallest_swiglu);
  try {
    check_memory_fits(swiglu, 1, 1, 1, smallest_swiglu);
    ADD_FAILURE() << "the configured layout fits";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("training.recompute_layers = -1, training.recompute_experts"), std::string::npos)
        << message;
    EXPECT_EQ(message.find("ordered"), std::string::npos) << message;
  }
  // A byte less: only the ordered backward fits, with the least recomputation (none).
  fits = layouts_that_fit(c, 1, 1, smallest_workspace - 1);
  ASSERT_FALSE(fits.empty());
  EXPECT_EQ(fits.front().layout, ordered);
  for (const LayoutFit& fit : fits) EXPECT_TRUE(fit.layout.ordered_attention);
  test::expect_one_line_error<ConfigError>(
      [&] { check_memory_fits(c, 1, 1, 1, smallest_workspace - 1); },
      {"largest: shared scratch", "training.deterministic_attention = \"ordered\" (cuDNN >= 9.25, Hopper; a slower backward) over 1 GPU fits"});
  // Configured ordered: it fits as it is; without determinism there is no dP to save.
  c.training.deterministic_attention = DeterministicAttention::Ordered;
  EXPECT_EQ(configured_layout(c, 1, 1), ordered);
  EXPECT_NO_THROW(check_memory_fits(c, 1, 1, 1, accumulator.total()));
  c.training.deterministic_attention = DeterministicAttention::Workspace;
  c.training.deterministic = false;
  EXPECT_FALSE(configured_layout(c, 1, 1).ordered_attention);
  for (const LayoutFit& fit : layouts_that_fit(c, 1, 1, dp.total())) EXPECT_FALSE(fit.layout.ordered_attention);
}

TEST(MemoryPlan, OnlyTheSmallestHalvedMicroBatchMustFit) {
  RunConfig c = small_config();
  c.training.micro_batch = 4;
  EXPECT_EQ(smallest_halved_micro_batch(4), 1);
  EXPECT_EQ(smallest_halved_micro_batch(6), 3);
  MemoryLayout smallest = configured_layout(c, 1, 1);
  smallest.micro_batch = 1;
  const int64_t budget = estimate_memory(c, smallest).total();
  EXPECT_LT(budget, estimate_memory(c, configured_layout(c, 1, 1)).total());
  EXPECT_NO_THROW(check_memory_fits(c, 1, 1, 1, budget));
  EXPECT_THROW(check_memory_fits(c, 1, 1, 1, budget - 1), ConfigError);
}

// tests/gpu/test_gpu_trainer.cpp's GpuTrainer.HalvesTheMicroBatchWhenItDoesNotFit: its
// micro-batch of 128 cannot fit (275 GB of logits), its halving to 1 can, so the refusal
// leaves the halving to the allocation.
TEST(MemoryPlan, TheHalvingTestIsLeftToTheAllocation) {
  RunConfig c;
  ModelConfig& m = c.model;
  m.vocab_size = 262144;
  m.dim = 64;
  m.n_layers = 1;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.seq_len = 4096;
  m.moe.n_experts = 4;
  m.moe.expert_hidden = 64;
  c.training.micro_batch = 128;
  c.training.global_batch_tokens = 128 * 4096;
  const int64_t h200 = static_cast<int64_t>((141.0 - kMemoryReserveGb) * 1e9);
  EXPECT_GT(estimate_memory(c, configured_layout(c, 1, 1)).total(), int64_t{275} * 1000 * 1000 * 1000);
  EXPECT_NO_THROW(check_memory_fits(c, 1, 1, 1, h200));
}

TEST(MemoryPlan, LayoutsThatFitComeBestFirst) {
  const RunConfig c = small_config();
  const int64_t budget = estimate_memory(c, configured_layout(c, 4, 4)).total();
  const std::vector<LayoutFit> fits = layouts_that_fit(c, 4, 4, budget);
  ASSERT_FALSE(fits.empty());
  EXPECT_EQ(fits.front().layout, configured_layout(c, 4, 4));  // no recompute, ZeRO 0, micro-batch 4, EP 1
  for (const LayoutFit& f : fits) {
    EXPECT_LE(f.estimate.total(), budget);
    EXPECT_EQ(c.training.global_batch_tokens % (4 * f.layout.micro_batch * 256), 0);
    if (f.layout.expert_parallel > 1) EXPECT_EQ(f.layout.recompute_experts, ExpertRecompute::None);
  }
  EXPECT_EQ(layout_changes(fits.front().layout, fits.back().layout).empty(), fits.size() == 1);
}

// Expert recomputation among the fitting layouts is in the fewest first MoE layers that fit
// (training.recompute_experts_layers), and not offered where nothing recomputed fits.
TEST(MemoryPlan, ExpertRecomputeTakesTheFewestMoELayersThatFit) {
  RunConfig c = small_config();
  c.model.n_layers = 8;
  c.training.micro_batch = 4;
  c.training.global_batch_tokens = 4 * 256;
  auto layout = [&](ExpertRecompute experts, int64_t moe_layers) {
    MemoryLayout l = configured_layout(c, 1, 1);
    l.recompute_experts = experts;
    l.recompute_experts_layers = moe_layers;
    return l;
  };
  std::vector<int64_t> swiglu(9);
  for (int64_t n = 1; n <= 8; ++n) swiglu[n] = estimate_memory(c, layout(ExpertRecompute::Swiglu, n)).total();
  const int64_t none = estimate_memory(c, layout(ExpertRecompute::None, -1)).total();
  // One recomputed layer shares its rows with no other: the memory of none; each more saves.
  ASSERT_EQ(swiglu[1], none);
  for (int64_t n = 2; n <= 8; ++n) ASSERT_LT(swiglu[n], swiglu[n - 1]) << n << " layers share one set of rows";
  const int64_t budget = swiglu[3];  // 3 layers fit, 2 do not
  bool found = false;
  for (const LayoutFit& f : layouts_that_fit(c, 1, 1, budget)) {
    if (f.layout.micro_batch != 4 || f.layout.recompute_layers != 0) continue;
    EXPECT_NE(f.layout.recompute_experts, ExpertRecompute::None) << "nothing recomputed does not fit";
    if (f.layout.recompute_experts == ExpertRecompute::Swiglu) {
      EXPECT_EQ(f.layout.recompute_experts_layers, 3);
      EXPECT_EQ(f.estimate.total(), swiglu[3]);
      EXPECT_EQ(layout_changes(configured_layout(c, 1, 1), f.layout),
                "training.recompute_experts = \"swiglu\", training.recompute_experts_layers = 3");
      found = true;
    }
  }
  EXPECT_TRUE(found);
  // Where nothing recomputed fits, no expert recomputation is listed at that micro-batch.
  for (const LayoutFit& f : layouts_that_fit(c, 1, 1, none))
    if (f.layout.micro_batch == 4 && f.layout.recompute_layers == 0)
      EXPECT_EQ(f.layout.recompute_experts, ExpertRecompute::None);
}

// The bench models on one H200 (BENCHMARKS.md: "device memory in use" after the timed
// steps, defaults): the estimate within 10% of the measured peak, and the refusal quiet.
}  // namespace
}  // namespace moe
