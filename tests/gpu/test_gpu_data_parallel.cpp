// GPU data parallel over NCCL with a world of one GPU (label gpu): the gradient
// all-reduce in buckets leaves the block bit for bit as it was, and a training run with
// parallel.backend = nccl gives the plain GPU run's losses and weights, with the
// gradient-sync latency and the communication wait reported per step. Multi-GPU runs
// (`moe launch --nproc-per-node N -- train ... --parallel.backend=nccl`) have their own issue.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/gpu.h"
#include "core/rng.h"
#include "dist/communicator.h"
#include "dist/cuda/gpu_data_parallel.h"
#include "dist/zero_shards.h"
#include "gpu_test_util.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

// n standard-normal gradients keyed by (seed, name).
std::vector<float> random_grads(int64_t n, uint64_t seed, const char* name) {
  CounterRng rng(seed, name);
  std::vector<float> grads(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) grads[static_cast<size_t>(i)] = static_cast<float>(rng.normal(static_cast<uint64_t>(i)));
  return grads;
}

TEST(GpuDataParallel, AllReduceOverOneRankIsTheIdentity) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // An odd count and 0.4 MB buckets: several buckets, the last one short.
  const int64_t n = 300007;
  std::vector<float> host = random_grads(n, 7, "dp.grads");
  host[3] = -0.0f;
  host[5] = 1e-40f;  // a denormal survives too
  gpu::DeviceArray<float> grads(static_cast<size_t>(n));
  grads.upload(host.data(), host.size());
  {
    dist::GpuDataParallel dp(dist::make_world_communicator(CommBackend::Nccl), stream, grads.data(), n, 0.4);
    ASSERT_EQ(dp.size(), 1);
    ASSERT_EQ(dp.buckets().size(), 4u);  // 0.4e6 / 4 = 100000 -> 99968 (aligned) per bucket, then 103
    int64_t covered = 0;
    for (const auto& [offset, count] : dp.buckets()) {
      EXPECT_EQ(offset, covered);
      EXPECT_EQ(offset % 64, 0);
      covered += count;
    }
    EXPECT_EQ(covered, n);

    dp.all_reduce_grads();
    std::vector<float> back(host.size());
    grads.download(back.data(), back.size());
    EXPECT_TRUE(same_bits(back, host));
    const dist::CommStats stats = dp.take_stats();
    EXPECT_GT(stats.grad_sync_s, 0.0);
    EXPECT_GE(stats.wait_s, stats.grad_sync_s);
    EXPECT_EQ(dp.take_stats().grad_sync_s, 0.0);  // taken

    double values[3] = {1.0 / 3.0, -2.5e300, 17.0};
    dp.sum(values, 3);
    EXPECT_EQ(values[0], 1.0 / 3.0);
    EXPECT_EQ(values[1], -2.5e300);
    EXPECT_EQ(dp.sum(17.0), 17.0);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The overlapped form: stages launched one by one (ranges longer than a bucket split),
// then finished; over one rank the block comes back as it was. Ranges that overlap or
// leave the block are refused.
TEST(GpuDataParallel, OverlappedStagesOverOneRankAreTheIdentity) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t n = 250048;
  const std::vector<float> host = random_grads(n, 8, "dp.stages");
  gpu::DeviceArray<float> grads(static_cast<size_t>(n));
  grads.upload(host.data(), host.size());
  {
    dist::GpuDataParallel dp(dist::make_world_communicator(CommBackend::Nccl), stream, grads.data(), n, 0.4);
    EXPECT_FALSE(dp.overlaps());
    EXPECT_THROW(dp.set_stage_ranges({{{0, 128}}, {{64, n - 64}}}), Error);  // an overlap
    EXPECT_THROW(dp.set_stage_ranges({{{0, 64}}, {{128, n}}}), Error);       // past the block's end
    // Stage 0 the end of the block, stage 1 the middle (longer than one bucket), stage 2 the start.
    dp.set_stage_ranges({{{200000, n - 200000}}, {{64, 199936}}, {{0, 64}}});
    EXPECT_TRUE(dp.overlaps());
    for (int stage = 0; stage < 3; ++stage) dp.launch_stage(stage);
    EXPECT_THROW(dp.launch_stage(3), Error);
    dp.finish_overlapped();
    std::vector<float> back(host.size());
    grads.download(back.data(), back.size());
    EXPECT_TRUE(same_bits(back, host));
    const dist::CommStats stats = dp.take_stats();
    EXPECT_GT(stats.grad_sync_s, 0.0);
    EXPECT_GE(stats.grad_sync_s, stats.wait_s);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// parallel.grad_reduce_dtype = bf16: over one rank the sum is the identity on the bf16
// values, so each element comes back rounded to bf16 (to nearest even) and nothing else,
// whether summed after the backward or stage by stage (buckets alternating between the two
// side-stream lanes).
TEST(GpuDataParallel, Bf16SumOverOneRankRoundsEachGradientOnce) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t n = 300007;
  const std::vector<float> host = random_grads(n, 9, "dp.bf16");
  std::vector<float> rounded(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rounded[static_cast<size_t>(i)] = bf16_to_float(float_to_bf16(host[static_cast<size_t>(i)]));
  ASSERT_FALSE(same_bits(host, rounded));  // the rounding is visible
  gpu::DeviceArray<float> grads(static_cast<size_t>(n));
  for (bool overlapped : {false, true}) {
    SCOPED_TRACE(overlapped ? "stage by stage" : "after the backward");
    grads.upload(host.data(), host.size());
    dist::GpuDataParallel dp(dist::make_world_communicator(CommBackend::Nccl), stream, grads.data(), n, 0.4, dist::DType::bf16);
    if (overlapped) {
      dp.set_stage_ranges({{{200000, n - 200000}}, {{64, 199936}}, {{0, 64}}});
      for (int stage = 0; stage < 3; ++stage) dp.launch_stage(stage);
      dp.finish_overlapped();
    } else {
      dp.all_reduce_grads();
    }
    std::vector<float> back(host.size());
    grads.download(back.data(), back.size());
    EXPECT_TRUE(same_bits(back, rounded));
    EXPECT_GT(dp.take_stats().grad_sync_s, 0.0);
  }
  EXPECT_THROW(dist::GpuDataParallel(dist::make_world_communicator(CommBackend::Nccl), stream, grads.data(), n, 0.4,
                                     dist::DType::f64),
               Error);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ZeRO-1 over one rank: each bucket's reduce-scatter and all-gather in place are the
// identity (fp32 sums: the block unchanged; bf16 sums: every element rounded once), the
// stage-by-stage gathers are waited for stage by stage, and a plan for another rank count
// is refused. (Over 2+ GPUs: bench/multi_gpu.sh's correctness and resume sections.)
TEST(GpuDataParallel, ZeroShardsOverOneRankAreTheIdentity) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t n = 300016;
  const std::vector<float> host = random_grads(n, 10, "dp.zero");
  std::vector<float> rounded(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rounded[static_cast<size_t>(i)] = bf16_to_float(float_to_bf16(host[static_cast<size_t>(i)]));
  // Stage 0 the end (not a whole unit: a replicated tail), 1 the middle with a range kept
  // whole inside, 2 the start.
  const std::vector<RangeList> stages = {{{200000, n - 200000}}, {{64, 199936}}, {{0, 64}}};
  gpu::DeviceArray<float> grads(static_cast<size_t>(n));
  for (dist::DType dtype : {dist::DType::f32, dist::DType::bf16}) {
    SCOPED_TRACE(dtype == dist::DType::f32 ? "fp32 sums" : "bf16 sums");
    grads.upload(host.data(), host.size());
    dist::GpuDataParallel dp(dist::make_world_communicator(CommBackend::Nccl), stream, grads.data(), n, 0.4, dtype);
    EXPECT_THROW(dp.set_zero_plan(dist::plan_zero_shards(stages, {}, dp.bucket_elems(), 2, 0), true), Error);
    dist::ZeroShardPlan plan = dist::plan_zero_shards(stages, {{1024, 48}}, dp.bucket_elems(), 1, 0);
    ASSERT_FALSE(plan.sharded[1].empty());
    dp.set_zero_plan(std::move(plan), /*overlap=*/true);
    ASSERT_NE(dp.zero_plan(), nullptr);
    for (int stage = 0; stage < 3; ++stage) dp.launch_stage(stage);
    dp.finish_overlapped();
    std::vector<float> back(host.size());
    grads.download(back.data(), back.size());
    EXPECT_TRUE(same_bits(back, dtype == dist::DType::f32 ? host : rounded));
    EXPECT_GT(dp.take_stats().grad_sync_s, 0.0);
    // The gathers, on the gradient block as a stand-in for the weights (any bytes).
    grads.upload(host.data(), host.size());
    dp.gather_pieces_by_stage(grads.data(), dist::DType::f32, dist::GpuDataParallel::Layout::Parameters);
    EXPECT_TRUE(dp.gathers_pending());
    for (int stage = 3; stage-- > 0;) dp.wait_stage(stage);
    EXPECT_FALSE(dp.gathers_pending());
    dp.gather_pieces(grads.data(), dist::DType::bf16, dist::GpuDataParallel::Layout::Parameters);
    grads.download(back.data(), back.size());
    EXPECT_TRUE(same_bits(back, host));
    EXPECT_GT(dp.take_stats().wait_s, 0.0);  // the joined gather is communication wait
    EXPECT_EQ(dp.sum(2.5), 2.5);             // host sums on their own communicator
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

RunConfig tiny_config() {
  // The all-reduce follows the second micro-batch of each step.
  RunConfig config = test::tiny_gpu_run(10);
  config.training.val_batches = 1;
  config.training.grad_clip = 0.5;  // clipping on the reduced gradients' norm
  config.parallel.bucket_mb = 0.01;  // many buckets
  return config;
}

struct RunResult {
  std::vector<double> losses, grad_norms, grad_sync_ms, comm_wait, step_s;
  std::vector<std::vector<std::pair<std::string, double>>> phase_ms;
  std::vector<float> weights;
  double val_loss_end = 0;
  std::string log;
};

RunResult train(const RunConfig& config) {
  const auto& m = config.model;
  Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                  std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  EXPECT_TRUE(trainer.on_gpu());
  EXPECT_EQ(trainer.world_size(), 1);
  RunResult run;
  trainer.on_step = [&](const StepStats& s) {
    run.losses.push_back(s.loss);
    run.grad_norms.push_back(s.grad_norm);
    run.grad_sync_ms.push_back(s.grad_sync_ms);
    run.comm_wait.push_back(s.time.comm_wait);
    run.step_s.push_back(s.time.step);
    run.phase_ms.push_back(s.phase_ms);
  };
  std::ostringstream log;
  run.val_loss_end = trainer.run(log).val_loss_end;
  run.log = log.str();
  const auto& params = trainer.model().params();
  run.weights.assign(params.values_data(), params.values_data() + params.storage_numel());
  return run;
}

// The same 10 steps through the data-parallel backend over one NCCL rank: an all-reduce
// over one rank is the identity and every weight is exactly 1, so the run is the plain
// GPU run bit for bit, unless the plain run itself is not repeatable (cuDNN's attention
// backward may sum in another order): then within rounding.
TEST(GpuDataParallel, OneRankNcclRunMatchesThePlainGpuRun) {
  MOE_REQUIRE_GPU();
  RunConfig config = tiny_config();
  const RunResult plain = train(config);
  const RunResult again = train(config);
  config.parallel.backend = CommBackend::Nccl;
  const RunResult nccl = train(config);
  ASSERT_EQ(plain.losses.size(), 10u);
  ASSERT_EQ(nccl.losses.size(), 10u);
  const bool repeatable = plain.losses == again.losses && same_bits(plain.weights, again.weights);
  if (repeatable) {
    EXPECT_EQ(nccl.losses, plain.losses);
    EXPECT_EQ(nccl.grad_norms, plain.grad_norms);
    EXPECT_TRUE(same_bits(nccl.weights, plain.weights));
    EXPECT_EQ(nccl.val_loss_end, plain.val_loss_end);
  } else {
    std::cout << "note: two plain GPU runs differ (non-deterministic kernels); comparing within rounding\n";
    for (size_t i = 0; i < plain.losses.size(); ++i) {
      EXPECT_NEAR(nccl.losses[i], plain.losses[i], 1e-3 * plain.losses[i]) << "step " << i + 1;
      EXPECT_NEAR(nccl.grad_norms[i], plain.grad_norms[i], 1e-2 * plain.grad_norms[i]) << "step " << i + 1;
    }
  }
  EXPECT_EQ(nccl.losses.front(), plain.losses.front());  // before any update: always the same
  EXPECT_LT(nccl.losses.back(), nccl.losses.front());
  for (size_t i = 0; i < nccl.losses.size(); ++i) {
    EXPECT_EQ(plain.grad_sync_ms[i], 0.0);
    EXPECT_GT(nccl.grad_sync_ms[i], 0.0) << "step " << i + 1;
    // The host waits at least for the loss weights' sum (the all-reduce overlaps the backward).
    EXPECT_GT(nccl.comm_wait[i], 0.0) << "step " << i + 1;
  }
}

// metrics.phase_times: every step reports the model stream's time per phase (the GPU
// model's phase names, each once, none negative, of the order of the step's time, not
// the run's), and the console prints them; off, nothing is reported.
TEST(GpuDataParallel, PhaseTimesSplitEachStep) {
  MOE_REQUIRE_GPU();
  RunConfig config = tiny_config();
  config.metrics.log_interval = 5;
  const RunResult off = train(config);
  for (const auto& phases : off.phase_ms) EXPECT_TRUE(phases.empty());
  EXPECT_EQ(off.log.find("phases (ms):"), std::string::npos);
  config.metrics.phase_times = true;
  const RunResult on = train(config);
  ASSERT_EQ(on.phase_ms.size(), 10u);
  for (size_t i = 0; i < on.phase_ms.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "step " << i + 1);
    double sum = 0;
    std::vector<std::string> names;
    for (const auto& [phase, ms] : on.phase_ms[i]) {
      EXPECT_GE(ms, 0.0) << phase;
      sum += ms;
      names.push_back(phase);
    }
    for (const char* expected : {"attention", "experts", "optimizer"})
      EXPECT_EQ(std::count(names.begin(), names.end(), expected), 1) << expected;
    EXPECT_GT(sum, 0.0);
    // This step's, not the run's so far (an interval may reach back into the gap before it).
    EXPECT_LE(sum, on.step_s[i] * 1e3 * 2.0 + 5.0);
  }
  EXPECT_NE(on.log.find("phases (ms): attention"), std::string::npos) << on.log;
}

std::string config_error(const RunConfig& config) {
  const auto& m = config.model;
  try {
    Trainer trainer(config, std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 1),
                    std::make_unique<test::LookBackTask>(m.vocab_size, m.seq_len, 2));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(GpuDataParallel, RefusesWhatItDoesNotDo) {
  MOE_REQUIRE_GPU();
  RunConfig config = tiny_config();
  config.parallel.backend = CommBackend::Nccl;
  config.parallel.expert_parallel = 2;
  EXPECT_NE(config_error(config).find("needs a launch of a multiple of 2 ranks"), std::string::npos)
      << config_error(config);
  config.training.cuda_graphs = true;
  EXPECT_NE(config_error(config).find("cannot run inside CUDA graphs"), std::string::npos) << config_error(config);
  config.training.cuda_graphs = false;
  config.training.recompute_experts = ExpertRecompute::Swiglu;
  EXPECT_NE(config_error(config).find("needs training.recompute_experts = none"), std::string::npos)
      << config_error(config);
  config.training.recompute_experts = ExpertRecompute::None;
  config.parallel.expert_parallel = 3;
  EXPECT_NE(config_error(config).find("must divide moe.n_experts"), std::string::npos) << config_error(config);
  // ZeRO under expert parallelism keeps experts where they are, whole.
  config.parallel.expert_parallel = 2;
  config.parallel.zero = 1;
  config.parallel.split_experts = true;
  EXPECT_NE(config_error(config).find("does not split experts"), std::string::npos) << config_error(config);
  config.parallel.split_experts = false;
  config.parallel.rebalance_interval = 4;
  EXPECT_NE(config_error(config).find("set parallel.rebalance_interval = 0 or parallel.zero = 0"), std::string::npos)
      << config_error(config);
  config.parallel.rebalance_interval = 0;
  config.parallel.expert_parallel = 1;
  config.training.device = TrainingDevice::Cpu;
  EXPECT_NE(config_error(config).find("parallel.backend = nccl trains on the GPU"), std::string::npos)
      << config_error(config);
}

}  // namespace
}  // namespace moe
