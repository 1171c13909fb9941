// training.deterministic (the default): two GPU runs of the same config give the same
// losses, gradient norms and weights, bit for bit (also when two of them share the GPU
// at once), with dropless and capacity routing,
// with and without CUDA graphs and recomputation; and a stopped run resumed from its
// checkpoint continues bit for bit; the dropless mode again with the ordered attention
// backward where cuDNN has it. MOE_TEST_NONDETERMINISTIC=1 runs the same tests with
// training.deterministic = false, to see that they catch cuDNN's atomic attention backward.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"
#include "train/checkpoint.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

struct Mode {
  const char* name;
  double capacity_factor;
  bool graphs_and_recompute;
  bool ordered_attention = false;  // training.deterministic_attention = ordered (cuDNN >= 9.25)
};

RunConfig determinism_config(const Mode& mode) {
  RunConfig config = test::tiny_gpu_run(8);
  ModelConfig& m = config.model;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.seq_len = 1024;  // many key/value tiles per query tile: where atomic dQ sums race
  m.moe.n_experts = 8;
  m.moe.top_k = 2;
  m.moe.capacity_factor = mode.capacity_factor;
  config.training.micro_batch = 4;
  config.training.global_batch_tokens = 2 * 4 * 1024;  // 2 micro-batches
  config.training.cuda_graphs = mode.graphs_and_recompute;
  config.training.recompute_layers = mode.graphs_and_recompute ? -1 : 0;
  config.training.deterministic = std::getenv("MOE_TEST_NONDETERMINISTIC") == nullptr;
  if (mode.ordered_attention && config.training.deterministic)
    config.training.deterministic_attention = DeterministicAttention::Ordered;
  return config;
}

struct RunRecord {
  std::vector<double> losses, grad_norms;
  std::vector<std::vector<float>> weights;
  int64_t dropped = 0;
};

RunRecord train(const RunConfig& config, const std::string& resume_from = "") {
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_TRUE(trainer.on_gpu());
  RunRecord record;
  trainer.on_step = [&](const StepStats& stats) {
    record.losses.push_back(stats.loss);
    record.grad_norms.push_back(stats.grad_norm);
    for (const LayerRouting& layer : stats.layers) record.dropped += layer.dropped;
  };
  std::ostringstream log;
  if (!resume_from.empty()) trainer.resume(resume_from, log);
  trainer.run(log);
  auto& params = trainer.model().params();
  for (int id = 0; id < params.size(); ++id)
    record.weights.emplace_back(params.value(id), params.value(id) + params.numel(id));
  return record;
}

// Bitwise: memcmp, so -0/+0 and NaN payloads count too.
void expect_identical(const RunRecord& a, const RunRecord& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)), 0)
        << what << ": loss of step " << i + 1 << " " << a.losses[i] << " vs " << b.losses[i];
    EXPECT_EQ(std::memcmp(&a.grad_norms[i], &b.grad_norms[i], sizeof(double)), 0)
        << what << ": grad norm of step " << i + 1 << " " << a.grad_norms[i] << " vs " << b.grad_norms[i];
  }
  ASSERT_EQ(a.weights.size(), b.weights.size());
  size_t differing_tensors = 0;
  for (size_t id = 0; id < a.weights.size(); ++id)
    differing_tensors += a.weights[id].size() != b.weights[id].size() ||
                         std::memcmp(a.weights[id].data(), b.weights[id].data(), a.weights[id].size() * sizeof(float)) != 0;
  EXPECT_EQ(differing_tensors, 0u) << what << ": parameter tensors not bit-identical";
}

class GpuDeterminism : public ::testing::TestWithParam<Mode> {};

// One run alone, then two at once on the same GPU (their kernels interleave, so any
// reduction whose order follows the timing of thread blocks, e.g. atomics, sums in
// another order there): all three bit-identical. With CUDA graphs the runs go one after
// the other: a stream being captured cannot share the process with another thread's
// copies on the legacy default stream, which synchronise with it.
TEST_P(GpuDeterminism, RunsAloneAndConcurrentAreBitIdentical) {
  MOE_REQUIRE_GPU();
  if (GetParam().ordered_attention && !cuda::Attention::ordered_dq_runs())
    GTEST_SKIP() << "the ordered attention backward needs cuDNN >= 9.25 on sm_90 (GpuAttentionOrderedDq checks "
                    "its refusal)";
  const RunConfig config = determinism_config(GetParam());
  const RunRecord first = train(config);
  RunRecord second, third;
  if (config.training.cuda_graphs) {
    second = train(config);
    third = train(config);
  } else {
    std::thread other([&] { third = train(config); });
    second = train(config);
    other.join();
  }
  ASSERT_EQ(first.losses.size(), 8u);
  expect_identical(first, second, std::string(GetParam().name) + " (second run)");
  expect_identical(first, third, std::string(GetParam().name) + " (third run)");
  if (config.model.moe.capacity_factor > 0) EXPECT_GT(first.dropped, 0) << "the capacity mode should drop";
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuDeterminism,
                         ::testing::Values(Mode{"dropless", 0.0, false}, Mode{"capacity", 1.25, false},
                                           Mode{"dropless_graphs_recompute", 0.0, true},
                                           Mode{"capacity_graphs_recompute", 1.25, true},
                                           Mode{"dropless_ordered_attention", 0.0, false, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// Stopped at step 3 and resumed: the resumed steps and the final weights are the
// uninterrupted run's, bit for bit.
TEST(GpuDeterminismResume, ResumedRunContinuesBitForBit) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_gpu_determinism_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  RunConfig config = determinism_config(Mode{"capacity", 1.25, false});
  config.checkpoint.dir = (root / "whole").string();
  const RunRecord whole = train(config);
  config.checkpoint.dir = (root / "split").string();
  config.training.stop_at = 3;
  const RunRecord before = train(config);
  ASSERT_EQ(before.losses.size(), 3u);
  config.training.stop_at = 0;
  const auto checkpoint = latest_checkpoint(root / "split");
  ASSERT_TRUE(checkpoint.has_value());
  RunRecord after = train(config, checkpoint->string());
  after.losses.insert(after.losses.begin(), before.losses.begin(), before.losses.end());
  after.grad_norms.insert(after.grad_norms.begin(), before.grad_norms.begin(), before.grad_norms.end());
  expect_identical(whole, after, "stopped at 3 and resumed");
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace moe
