// The trainer's multi-GPU paths on one GPU: N trainers in N threads, one rank each, over
// dist::make_thread_communicators (device buffers, collectives like nccl's). Data
// parallelism (ZeRO-1), expert parallelism, and split experts re-placed by load against
// the one-GPU run of the same global batch: the same losses up to bf16 rounding and the
// per-rank aux loss; and split experts against whole experts, weight by weight.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "dist/cuda/thread_communicator.h"
#include "gpu_test_util.h"
#include "train/synthetic.h"
#include "model/transformer.h"
#include "train/trainer.h"

namespace moe {
namespace {

RunConfig thread_run(int64_t steps = 12) {
  RunConfig config = test::tiny_gpu_run(steps);
  config.training.micro_batch = 4;  // per rank; one GPU takes 8 (the same global batch)
  config.metrics.log_interval = 100;
  return config;
}

struct RankResult {
  std::vector<double> losses, grad_norms;
  std::vector<float> params;  // after the run (the host copy, every expert gathered)
  std::vector<std::string> log;
  std::string error;
};

RankResult train(const RunConfig& config, std::unique_ptr<dist::Communicator> world,
                 const std::string& resume_from = "") {
  RankResult result;
  try {
    const auto& m = config.model;
    Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                    std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2), std::move(world));
    std::ostringstream resume_log;
    if (!resume_from.empty()) trainer.resume(resume_from, resume_log);
    trainer.on_step = [&](const StepStats& stats) {
      result.losses.push_back(stats.loss);
      result.grad_norms.push_back(stats.grad_norm);
    };
    std::ostringstream log;
    trainer.run(log);
    result.log.push_back(log.str());
    auto& params = trainer.model().params();
    for (int id = 0; id < params.size(); ++id)
      result.params.insert(result.params.end(), params.value(id), params.value(id) + params.numel(id));
  } catch (const std::exception& e) {
    result.error = e.what();
  }
  return result;
}

std::vector<RankResult> train_ranks(const RunConfig& config, int n, const std::string& resume_from = "") {
  std::vector<std::unique_ptr<dist::Communicator>> worlds = dist::make_thread_communicators(n);
  std::vector<RankResult> results(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      results[static_cast<size_t>(r)] = train(config, std::move(worlds[static_cast<size_t>(r)]), resume_from);
    });
  for (auto& t : threads) t.join();
  return results;
}

RankResult one_gpu() {
  RunConfig config = thread_run();
  config.training.micro_batch *= 2;
  RankResult one = train(config, std::move(dist::make_thread_communicators(1)[0]));
  EXPECT_EQ(one.error, "");
  return one;
}

// Every rank reports the global loss and gradient norm: the one GPU's, up to bf16 rounding
// and the aux loss over each rank's own tokens. The first step's norm (the same weights
// everywhere) within 1%: every gradient summed over the ranks that computed parts of it,
// each counted once.
void expect_like_one_gpu(const std::vector<RankResult>& ranks, const RankResult& want, const char* what) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_EQ(ranks[r].error, "") << what << ", rank " << r;
    ASSERT_EQ(ranks[r].losses.size(), want.losses.size()) << what << ", rank " << r;
    for (size_t i = 0; i < want.losses.size(); ++i)
      EXPECT_NEAR(ranks[r].losses[i], want.losses[i], 0.01 * want.losses[i]) << what << ", rank " << r << ", step " << i + 1;
    EXPECT_NEAR(ranks[r].grad_norms[0], want.grad_norms[0], 0.01 * want.grad_norms[0]) << what << ", rank " << r;
  }
}

// `config`'s 2-rank run saved root/whole/step_00000003 of 6 steps: one GPU with the same
// global batch resumes it and follows the 2 ranks' steps 4-6 (`whole`) within 1%.
void expect_one_gpu_resumes(RunConfig config, const std::filesystem::path& root, const RankResult& whole) {
  config.training.micro_batch *= 2;
  config.parallel.expert_parallel = 1;
  config.parallel.split_experts = false;
  config.parallel.rebalance_interval = 0;
  config.checkpoint.dir = (root / "one").string();
  const RankResult single = train(config, std::move(dist::make_thread_communicators(1)[0]),
                                  (root / "whole" / "step_00000003").string());
  ASSERT_EQ(single.error, "");
  ASSERT_EQ(single.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(single.losses[i], whole.losses[i + 3], 0.01 * whole.losses[i + 3]) << "step " << i + 4;
}

// `config` over `n` ranks saved root/whole/step_00000003 of 6 steps (`whole`, rank 0's): the
// same layout resumes it and takes steps 4-6 bit for bit. Returns the resumed rank 0.
RankResult expect_resumes_bit_for_bit(RunConfig config, const std::filesystem::path& root, const RankResult& whole,
                                      int n) {
  config.checkpoint.dir = (root / "resumed").string();
  const std::vector<RankResult> resumed = train_ranks(config, n, (root / "whole" / "step_00000003").string());
  EXPECT_EQ(resumed[0].error, "");
  EXPECT_EQ(resumed[0].losses.size(), 3u);
  for (size_t i = 0; i < 3 && i < resumed[0].losses.size(); ++i)
    EXPECT_EQ(resumed[0].losses[i], whole.losses[i + 3]) << "step " << i + 4;
  return resumed[0];
}

TEST(GpuThreadRanks, DataAndExpertParallelTrainLikeOneGpu) {
  MOE_REQUIRE_GPU();
  const RankResult want = one_gpu();
  ASSERT_EQ(want.losses.size(), 12u);
  expect_like_one_gpu(train_ranks(thread_run(), 2), want, "data parallel (ZeRO-1)");
  RunConfig ep = thread_run();
  ep.parallel.expert_parallel = 2;
  expect_like_one_gpu(train_ranks(ep, 2), want, "expert parallel (ZeRO-1 over the shared parameters)");
  ep.parallel.zero = 0;  // ZeRO keeps experts in place, whole
  ep.parallel.split_experts = true;
  ep.parallel.rebalance_interval = 3;
  expect_like_one_gpu(train_ranks(ep, 2), want, "split experts, re-placed every 3 steps");
}

// DeepGEMM's GEMMs of `precision` (the experts' rows padded per expert to 128; what
// training.fp8_gemm_backend and bf16_gemm_backend = auto pick without expert parallelism)
// over 2 data-parallel thread ranks, against one GPU of the same global batch.
void expect_deepgemm_data_parallel_like_one_gpu(TrainingPrecision precision, const char* what) {
  RunConfig config = thread_run();
  config.training.precision = precision;
  config.training.gemm_backend(precision) = GemmBackend::DeepGemm;
  RunConfig whole = config;
  whole.training.micro_batch *= 2;
  const RankResult want = train(whole, std::move(dist::make_thread_communicators(1)[0]));
  ASSERT_EQ(want.error, "");
  ASSERT_EQ(want.losses.size(), 12u);
  expect_like_one_gpu(train_ranks(config, 2), want, what);
}

TEST(GpuThreadRanks, Fp8DeepGemmDataParallelTrainsLikeOneGpu) {
  MOE_REQUIRE_GPU();
  expect_deepgemm_data_parallel_like_one_gpu(TrainingPrecision::Fp8, "fp8 with DeepGEMM, data parallel (ZeRO-1)");
}

TEST(GpuThreadRanks, Bf16DeepGemmDataParallelTrainsLikeOneGpu) {
  MOE_REQUIRE_GPU();
  expect_deepgemm_data_parallel_like_one_gpu(TrainingPrecision::Bf16, "bf16 with DeepGEMM, data parallel (ZeRO-1)");
}

// bf16 DeepGEMM with gate|up interleaved in the bf16 weights (the default) under ZeRO-1,
// -2 and -3 (whose pools keep each rank's pieces' hi halves where the interleave put them):
// the plan cuts each w1 | w3 pair at expert slices (whole slices a piece with the
// default buckets, pieces inside slices with small ones) and gathers the new weights in the
// hi halves' order, so each rank's GEMMs read the weights the replicas (ZeRO-0) read: the
// same losses and weights bit for bit. One micro-batch per step (ZeRO-2's sums are then
// ZeRO-1's). Gathered in the parameters' order instead, the weights would be scrambled.
// ZeRO-1 and ZeRO-3 checkpoints (each rank's pieces, hi halves joined through the
// interleave) resume bit for bit.
TEST(GpuThreadRanks, Bf16DeepGemmZeroGathersTheInterleavedWeights) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_thread_zero_gate_up_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  RunConfig config = thread_run(6);
  config.training.precision = TrainingPrecision::Bf16;
  config.training.gemm_backend(TrainingPrecision::Bf16) = GemmBackend::DeepGemm;
  config.training.global_batch_tokens /= 2;
  config.parallel.zero = 0;
  const std::vector<RankResult> replicas = train_ranks(config, 2);
  ASSERT_EQ(replicas[0].error, "");
  ASSERT_EQ(replicas[0].losses.size(), 6u);
  for (const auto& [zero, bucket_mb] : {std::pair{1, 25.0}, {1, 0.02}, {2, 25.0}, {3, 25.0}, {3, 0.02}}) {
    SCOPED_TRACE(testing::Message() << "ZeRO-" << zero << ", buckets of " << bucket_mb << " MB");
    config.parallel.zero = zero;
    config.parallel.bucket_mb = bucket_mb;
    const std::vector<RankResult> sharded = train_ranks(config, 2);
    ASSERT_EQ(sharded[0].error, "");
    EXPECT_EQ(sharded[0].losses, replicas[0].losses);
    EXPECT_EQ(sharded[0].params, replicas[0].params);
    EXPECT_EQ(sharded[1].params, sharded[0].params);
  }
  config.parallel.bucket_mb = 0.02;
  config.checkpoint.interval = 3;
  for (int zero : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "checkpoint of ZeRO-" << zero);
    config.parallel.zero = zero;
    const std::filesystem::path dir = root / ("zero" + std::to_string(zero));
    config.checkpoint.dir = (dir / "whole").string();
    const std::vector<RankResult> whole = train_ranks(config, 2);
    ASSERT_EQ(whole[0].error, "");
    EXPECT_EQ(expect_resumes_bit_for_bit(config, dir, whole[0], 2).params, whole[0].params);
  }
  std::filesystem::remove_all(root);
}

// Split experts train the weights whole experts do: each hinge's partial gradients summed
// over its holders, both stepping it. A small learning rate, so that AdamW's early steps
// (about lr per weight, whatever the gradient's size) differ only where a near-zero
// gradient rounds the other way: under 2% of the hinge's weights (expert 2 of 4 in each
// layer: the first of rank 1's block, also on rank 0) a step apart (0.7% on an H200).
// Without the hinges' sum each holder steps its own part of the gradient: 5.9%.
TEST(GpuThreadRanks, SplitExpertsTrainTheWeightsOfWholeExperts) {
  MOE_REQUIRE_GPU();
  RunConfig whole = thread_run(3);
  whole.lr.peak = 1e-4;
  whole.lr.warmup_steps = 0;
  whole.parallel.expert_parallel = 2;
  whole.parallel.zero = 0;  // ZeRO keeps experts whole
  RunConfig split = whole;
  split.parallel.split_experts = true;
  const std::vector<RankResult> a = train_ranks(whole, 2), b = train_ranks(split, 2);
  for (const auto* run : {&a, &b})
    for (const RankResult& rank : *run) ASSERT_EQ(rank.error, "");
  ASSERT_EQ(a[0].params.size(), b[0].params.size());
  // The hinge's elements: expert 2 of every expert tensor.
  Transformer<float> host(whole.model, whole.training.seed);
  const auto& specs = host.params();
  size_t at = 0, far = 0, hinge = 0;
  for (int id = 0; id < specs.size(); ++id) {
    const int64_t n = specs.numel(id);
    if (!specs.spec(id).expert_group.empty()) {
      const int64_t per_expert = n / specs.spec(id).shape[0];
      for (int64_t i = 2 * per_expert; i < 3 * per_expert; ++i, ++hinge)
        far += std::fabs(static_cast<double>(a[0].params[at + static_cast<size_t>(i)]) - b[0].params[at + static_cast<size_t>(i)]) >
               whole.lr.peak / 2;
    }
    at += static_cast<size_t>(n);
  }
  ASSERT_GT(hinge, 0u);
  const double share = static_cast<double>(far) / static_cast<double>(hinge);
  std::printf("hinge weights a step apart from whole experts: %.4f\n", share);
  EXPECT_LT(share, 0.02) << far << " of the hinge's " << hinge << " weights";
  // The first step's global norm (the same weights): each hinge counted once.
  std::printf("step-1 gradient norm: whole %.6f, split %.6f\n", a[0].grad_norms[0], b[0].grad_norms[0]);
  EXPECT_NEAR(b[0].grad_norms[0], a[0].grad_norms[0], 1e-3 * a[0].grad_norms[0]);
  EXPECT_EQ(a[0].params, a[1].params) << "the ranks' gathered weights differ";
  EXPECT_EQ(b[0].params, b[1].params) << "the ranks' gathered weights differ (split)";
}

// A checkpoint keeps the experts' placement and the re-placement's state: split experts
// re-placed every 2 steps, stopped at step 3 and resumed, give the uninterrupted run's
// losses bit for bit (before the placement was recorded, the resumed run started over
// from equal blocks: close, not the same); one GPU resumes it too (close: other sums).
TEST(GpuThreadRanks, ReplacedSplitExpertsResumeWhereTheyStopped) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_thread_resume_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  RunConfig config = thread_run(6);
  config.parallel.expert_parallel = 2;
  config.parallel.zero = 0;  // ZeRO keeps experts in place, whole
  config.parallel.split_experts = true;
  config.parallel.rebalance_interval = 2;
  config.checkpoint.dir = (root / "whole").string();
  config.checkpoint.interval = 3;
  const std::vector<RankResult> whole = train_ranks(config, 2);
  ASSERT_EQ(whole[0].error, "");
  ASSERT_EQ(whole[0].losses.size(), 6u);
  expect_resumes_bit_for_bit(config, root, whole[0], 2);
  // Each rank saved its own experts (and a share of the rest): one GPU reads them all.
  expect_one_gpu_resumes(thread_run(6), root, whole[0]);
  std::filesystem::remove_all(root);
}

// ZeRO levels 0 and 1 over 2 ranks: the same sums in the same order (thread ranks add in
// rank order; a reduce-scatter's piece is the all-reduce's), the same AdamW per element,
// so the same losses bit for bit. A ZeRO-1 checkpoint (each rank its own pieces) resumes
// bit for bit on the same layout and reshards onto one GPU (within bf16 rounding of the
// other order of sums), and the gathered weights at the end are the same on both ranks.
TEST(GpuThreadRanks, ZeroCheckpointsResumeAndReshard) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_thread_zero_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  RunConfig config = thread_run(6);
  config.parallel.zero = 0;
  const std::vector<RankResult> replicas = train_ranks(config, 2);
  ASSERT_EQ(replicas[0].error, "");
  config.parallel.zero = 1;
  config.checkpoint.dir = (root / "whole").string();
  config.checkpoint.interval = 3;
  const std::vector<RankResult> whole = train_ranks(config, 2);
  ASSERT_EQ(whole[0].error, "");
  ASSERT_EQ(whole[0].losses.size(), 6u);
  EXPECT_EQ(whole[0].losses, replicas[0].losses) << "ZeRO-1 and replicas differ";
  EXPECT_EQ(whole[0].params, whole[1].params) << "the ranks' gathered weights differ";
  EXPECT_EQ(whole[0].params, replicas[0].params) << "ZeRO-1's gathered weights are not the replicas'";
  EXPECT_EQ(expect_resumes_bit_for_bit(config, root, whole[0], 2).params, whole[0].params);
  // One GPU with the same global batch from the two ranks' pieces.
  expect_one_gpu_resumes(config, root, whole[0]);
  std::filesystem::remove_all(root);
}

// ZeRO-2 (each rank keeps the gradients of its pieces only, reduce-scattering every micro-
// batch): with one micro-batch per step the sums are ZeRO-1's, bit for bit; with two the
// sums are taken per micro-batch (old sum + the ranks' new gradients) instead of once over
// the accumulated ones: the same losses within float rounding (the first step's norm to
// 1e-5: the same gradients summed in another order).
TEST(GpuThreadRanks, ZeroTwoSumsEveryMicroBatchIntoItsPieces) {
  MOE_REQUIRE_GPU();
  RunConfig config = thread_run(6);
  config.training.global_batch_tokens /= 2;  // one micro-batch per step
  const std::vector<RankResult> one = train_ranks(config, 2);
  ASSERT_EQ(one[0].error, "");
  config.parallel.zero = 2;
  const std::vector<RankResult> two = train_ranks(config, 2);
  ASSERT_EQ(two[0].error, "");
  EXPECT_EQ(two[0].losses, one[0].losses) << "ZeRO-2 with one micro-batch per step is not ZeRO-1";
  EXPECT_EQ(two[0].params, one[0].params);
  EXPECT_EQ(two[0].params, two[1].params);
  // Two micro-batches per step.
  config = thread_run(6);
  const std::vector<RankResult> one_acc = train_ranks(config, 2);
  config.parallel.zero = 2;
  const std::vector<RankResult> two_acc = train_ranks(config, 2);
  ASSERT_EQ(one_acc[0].error, "");
  ASSERT_EQ(two_acc[0].error, "");
  ASSERT_EQ(two_acc[0].losses.size(), one_acc[0].losses.size());
  for (size_t i = 0; i < one_acc[0].losses.size(); ++i) {
    EXPECT_NEAR(two_acc[0].losses[i], one_acc[0].losses[i], 1e-3 * one_acc[0].losses[i]) << "step " << i + 1;
    EXPECT_NEAR(two_acc[0].grad_norms[i], one_acc[0].grad_norms[i], 1e-2 * one_acc[0].grad_norms[i]) << "step " << i + 1;
  }
  EXPECT_NEAR(two_acc[0].grad_norms[0], one_acc[0].grad_norms[0], 1e-5 * one_acc[0].grad_norms[0]);
  EXPECT_EQ(two_acc[0].params, two_acc[1].params);
}

// ZeRO-3 (the weights too: each stage's gathered for its forward and again for its
// backward, into memory the stages two apart share): the same weights as ZeRO-2 reach every
// GEMM, so the same losses and final weights bit for bit; a checkpoint it writes resumes
// bit for bit.
TEST(GpuThreadRanks, ZeroThreeGathersEachStageAndFollowsZeroTwo) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_thread_zero3_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  RunConfig config = thread_run(6);
  config.parallel.zero = 2;
  const std::vector<RankResult> two = train_ranks(config, 2);
  ASSERT_EQ(two[0].error, "");
  config.parallel.zero = 3;
  config.checkpoint.dir = (root / "whole").string();
  config.checkpoint.interval = 3;
  config.training.val_interval = 2;  // validation forwards gather too
  const std::vector<RankResult> three = train_ranks(config, 2);
  ASSERT_EQ(three[0].error, "");
  EXPECT_EQ(three[0].losses, two[0].losses) << "ZeRO-3 is not ZeRO-2";
  EXPECT_EQ(three[0].params, two[0].params);
  EXPECT_EQ(three[0].params, three[1].params);
  expect_resumes_bit_for_bit(config, root, three[0], 2);
  std::filesystem::remove_all(root);
}

// ZeRO under expert parallelism: 4 thread ranks of EP 2 (each expert on 2 replicas) shard
// the shared parameters over all 4 and the experts over their 2 replicas. Level 1 sums
// what level 0 sums (a reduce-scatter's piece is the all-reduce's), so the same losses and
// weights bit for bit, every expert on every rank's host copy; level 2 sums per micro-batch
// (within float rounding); level 3 gathers the same weights as level 2 (bit for bit), and
// its checkpoint resumes bit for bit, and on one GPU within 1%. EP 4 (no replicas: the
// experts stepped whole) follows level 0 within float rounding.
TEST(GpuThreadRanks, ZeroUnderExpertParallelism) {
  MOE_REQUIRE_GPU();
  const auto root = std::filesystem::temp_directory_path() / ("moe_thread_ep_zero_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  RunConfig config = thread_run(6);
  config.training.micro_batch = 2;  // 4 ranks x 2: one GPU's 8
  config.parallel.expert_parallel = 2;
  std::vector<std::vector<RankResult>> by_level;
  for (int64_t zero = 0; zero <= 2; ++zero) {
    config.parallel.zero = zero;
    by_level.push_back(train_ranks(config, 4));
    ASSERT_EQ(by_level.back()[0].error, "") << "ZeRO " << zero;
    for (int r = 1; r < 4; ++r) EXPECT_EQ(by_level.back()[r].params, by_level.back()[0].params) << "ZeRO " << zero << ", rank " << r;
  }
  EXPECT_EQ(by_level[1][0].losses, by_level[0][0].losses) << "ZeRO-1 under EP is not ZeRO-0";
  EXPECT_EQ(by_level[1][0].params, by_level[0][0].params);
  for (size_t i = 0; i < by_level[0][0].losses.size(); ++i)
    EXPECT_NEAR(by_level[2][0].losses[i], by_level[0][0].losses[i], 1e-3 * by_level[0][0].losses[i]) << "step " << i + 1;
  config.parallel.zero = 3;
  config.checkpoint.dir = (root / "whole").string();
  config.checkpoint.interval = 3;
  config.training.val_interval = 2;  // validation forwards gather too
  const std::vector<RankResult> three = train_ranks(config, 4);
  ASSERT_EQ(three[0].error, "");
  EXPECT_EQ(three[0].losses, by_level[2][0].losses) << "ZeRO-3 under EP is not ZeRO-2";
  EXPECT_EQ(three[0].params, by_level[2][0].params);
  expect_resumes_bit_for_bit(config, root, three[0], 4);
  // Each rank saved its pieces of the shared parameters and of its experts: one GPU reads them all.
  RunConfig one = thread_run(6);
  one.training.micro_batch = 8;
  one.checkpoint.dir = (root / "one").string();
  const RankResult single = train(one, std::move(dist::make_thread_communicators(1)[0]),
                                  (root / "whole" / "step_00000003").string());
  ASSERT_EQ(single.error, "");
  ASSERT_EQ(single.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(single.losses[i], three[0].losses[i + 3], 0.01 * three[0].losses[i + 3]);
  std::filesystem::remove_all(root);
  // EP 4: every rank's experts its own.
  config = thread_run(6);
  config.training.micro_batch = 2;
  config.parallel.expert_parallel = 4;
  const std::vector<RankResult> ep4 = train_ranks(config, 4);
  config.parallel.zero = 3;
  const std::vector<RankResult> ep4_zero = train_ranks(config, 4);
  ASSERT_EQ(ep4[0].error, "");
  ASSERT_EQ(ep4_zero[0].error, "");
  for (size_t i = 0; i < ep4[0].losses.size(); ++i)
    EXPECT_NEAR(ep4_zero[0].losses[i], ep4[0].losses[i], 1e-3 * ep4[0].losses[i]) << "EP 4, step " << i + 1;
}

}  // namespace
}  // namespace moe
