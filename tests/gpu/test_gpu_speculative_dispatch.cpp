// moe.speculative_dispatch on the GPU (docs/ROUTING_CACHE.md): the plan and merge kernels
// against their CPU references (moe/speculative_exchange.h) on random inputs, and the
// trainer over thread ranks on one GPU, speculating against the exact dispatch: the same
// losses and weights bit for bit (bf16 and fp8 rows, EP 2 and EP 4, data x expert
// parallelism, re-placed split experts, validation), with the speculation's counts
// reported on the layers after the first.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/gpu.h"
#include "gpu_test_util.h"
#include "thread_trainers.h"
#include "moe/gpu_ops.h"
#include "moe/speculative_exchange.h"
#include "moe/token_exchange.h"
#include "train/trainer.h"

namespace moe {
namespace {

// Random exact blocks (each token to a random subset of the ranks) and random early
// blocks (a random subset too, never to `me`).
struct RandomBlocks {
  int64_t T;
  int P, me;
  std::vector<int32_t> pos_TP, tokens_P, spec_pos_TP, spec_tokens_P;
  RandomBlocks(int64_t tokens, int ranks, int rank, uint32_t seed) : T(tokens), P(ranks), me(rank) {
    std::mt19937 rng(seed);
    pos_TP.assign(static_cast<size_t>(T * P), -1);
    spec_pos_TP.assign(static_cast<size_t>(T * P), -1);
    tokens_P.assign(static_cast<size_t>(P), 0);
    spec_tokens_P.assign(static_cast<size_t>(P), 0);
    for (int64_t t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p) {
        if (rng() % 3 == 0) pos_TP[static_cast<size_t>(t * P + p)] = tokens_P[static_cast<size_t>(p)]++;
        if (p != me && rng() % 2 == 0) spec_pos_TP[static_cast<size_t>(t * P + p)] = spec_tokens_P[static_cast<size_t>(p)]++;
      }
  }
  int64_t rows() const {
    int64_t n = 0;
    for (int32_t b : tokens_P) n += b;
    return n;
  }
};

TEST(GpuSpeculativeDispatch, SourcesKernelMatchesTheCpu) {
  MOE_REQUIRE_GPU();
  for (const auto& [T, P] : {std::pair<int64_t, int>{1, 1}, {777, 2}, {3001, 4}, {2048, 7}}) {
    const RandomBlocks b(T, P, P - 1, static_cast<uint32_t>(T + P));
    const int64_t U = b.rows();
    std::vector<int32_t> source(static_cast<size_t>(U)), corr_pos(static_cast<size_t>(T * P)),
        corr_tokens(static_cast<size_t>(P));
    speculation_sources(source.data(), corr_pos.data(), corr_tokens.data(), b.pos_TP.data(), b.tokens_P.data(),
                        b.spec_pos_TP.data(), T, P);
    gpu::DeviceArray<int32_t> pos_d(b.pos_TP.size()), tokens_d(b.tokens_P.size()), spec_d(b.spec_pos_TP.size()),
        source_d(static_cast<size_t>(std::max<int64_t>(U, 1))), corr_pos_d(corr_pos.size()), corr_tokens_d(corr_tokens.size());
    pos_d.upload(b.pos_TP.data(), b.pos_TP.size());
    tokens_d.upload(b.tokens_P.data(), b.tokens_P.size());
    spec_d.upload(b.spec_pos_TP.data(), b.spec_pos_TP.size());
    cuda::speculation_sources(source_d.data(), corr_pos_d.data(), corr_tokens_d.data(), pos_d.data(), tokens_d.data(),
                              spec_d.data(), T, P, nullptr);
    std::vector<int32_t> got_source(source.size()), got_corr_pos(corr_pos.size()), got_corr_tokens(corr_tokens.size());
    source_d.download(got_source.data(), got_source.size());
    corr_pos_d.download(got_corr_pos.data(), got_corr_pos.size());
    corr_tokens_d.download(got_corr_tokens.data(), got_corr_tokens.size());
    EXPECT_EQ(got_source, source) << T << " tokens, " << P << " ranks";
    EXPECT_EQ(got_corr_pos, corr_pos);
    EXPECT_EQ(got_corr_tokens, corr_tokens);
  }
}

TEST(GpuSpeculativeDispatch, MergeKernelMatchesTheCpu) {
  MOE_REQUIRE_GPU();
  // bf16 rows of 96, fp8 rows of 128 (4 + 128 bytes), odd widths in words.
  for (const int64_t row_bytes : {int64_t{192}, int64_t{132}, int64_t{4}}) {
    const int P = 3, me = 1;
    const int64_t T = 501;
    // The sender side of each source q: its own random blocks; the receiver (me) gets
    // block `me` of each source.
    std::vector<int32_t> recv_P(P), spec_recv_P(P), corr_recv_P(P), source_U;
    for (int q = 0; q < P; ++q) {
      const RandomBlocks b(T, P, q, static_cast<uint32_t>(17 * q + row_bytes));
      std::vector<int32_t> source(static_cast<size_t>(b.rows())), corr_pos(static_cast<size_t>(T * P)), corr_tokens(P);
      speculation_sources(source.data(), corr_pos.data(), corr_tokens.data(), b.pos_TP.data(), b.tokens_P.data(),
                          b.spec_pos_TP.data(), T, P);
      int64_t start = 0;
      for (int p = 0; p < me; ++p) start += b.tokens_P[static_cast<size_t>(p)];
      source_U.insert(source_U.end(), source.begin() + start, source.begin() + start + b.tokens_P[static_cast<size_t>(me)]);
      recv_P[static_cast<size_t>(q)] = b.tokens_P[static_cast<size_t>(me)];
      spec_recv_P[static_cast<size_t>(q)] = b.spec_tokens_P[static_cast<size_t>(me)];
      corr_recv_P[static_cast<size_t>(q)] = corr_tokens[static_cast<size_t>(me)];
    }
    int64_t U = 0, S = 0, C = 0;
    for (int q = 0; q < P; ++q) {
      U += recv_P[static_cast<size_t>(q)];
      S += spec_recv_P[static_cast<size_t>(q)];
      C += corr_recv_P[static_cast<size_t>(q)];
    }
    std::mt19937 rng(7);
    std::vector<uint8_t> spec(static_cast<size_t>(S * row_bytes)), corr(static_cast<size_t>(C * row_bytes));
    for (auto& v : spec) v = static_cast<uint8_t>(rng());
    for (auto& v : corr) v = static_cast<uint8_t>(rng());
    std::vector<uint8_t> want(static_cast<size_t>(U * row_bytes));
    const SpeculationRows counts = merge_speculated_rows(want.data(), source_U.data(), recv_P.data(), spec.data(),
                                                         spec_recv_P.data(), corr.data(), corr_recv_P.data(), row_bytes,
                                                         P, me);
    EXPECT_GT(counts.used, 0);
    EXPECT_GT(counts.corrected, 0);
    std::vector<int32_t> starts(static_cast<size_t>(3 * (P + 1)), 0);
    for (int q = 0; q < P; ++q) {
      starts[static_cast<size_t>(q + 1)] = starts[static_cast<size_t>(q)] + recv_P[static_cast<size_t>(q)];
      starts[static_cast<size_t>(P + 2 + q)] = starts[static_cast<size_t>(P + 1 + q)] + spec_recv_P[static_cast<size_t>(q)];
      starts[static_cast<size_t>(2 * P + 3 + q)] =
          starts[static_cast<size_t>(2 * P + 2 + q)] + corr_recv_P[static_cast<size_t>(q)];
    }
    gpu::DeviceArray<uint8_t> spec_d(spec.size()), corr_d(corr.size()), rows_d(want.size());
    gpu::DeviceArray<int32_t> source_d(source_U.size()), starts_d(starts.size());
    spec_d.upload(spec.data(), spec.size());
    corr_d.upload(corr.data(), corr.size());
    source_d.upload(source_U.data(), source_U.size());
    starts_d.upload(starts.data(), starts.size());
    cuda::merge_speculated_rows(rows_d.data(), source_d.data(), U, starts_d.data(), spec_d.data(), corr_d.data(),
                                row_bytes, P, nullptr);
    std::vector<uint8_t> got(want.size());
    rows_d.download(got.data(), got.size());
    EXPECT_EQ(got, want) << "rows of " << row_bytes << " bytes";
  }
}

struct RankRun {
  std::vector<double> losses;
  std::vector<float> params;
  std::vector<std::vector<LayerRouting>> layers;  // per step
  std::string error;
};

std::vector<RankRun> train_ranks(const RunConfig& config, int n, int ranks_per_node) {
  std::vector<RankRun> runs(static_cast<size_t>(n));
  const auto run_of = [&runs](int r) -> RankRun& { return runs[static_cast<size_t>(r)]; };
  const std::vector<std::string> errors = test::run_thread_trainers(
      config, n,
      [&](int r, Trainer& trainer) {
        trainer.on_step = [&run = run_of(r)](const StepStats& stats) {
          run.losses.push_back(stats.loss);
          run.layers.push_back(stats.layers);
        };
      },
      [&](int r, Trainer& trainer) {
        auto& params = trainer.model().params();
        for (int id = 0; id < params.size(); ++id)
          run_of(r).params.insert(run_of(r).params.end(), params.value(id), params.value(id) + params.numel(id));
      },
      ranks_per_node);
  for (int r = 0; r < n; ++r) run_of(r).error = errors[static_cast<size_t>(r)];
  return runs;
}

RunConfig speculation_run() {
  RunConfig config = test::tiny_gpu_run(6);
  config.model.n_layers = 3;
  config.model.moe.n_experts = 8;
  config.model.moe.route_cache = true;
  config.training.val_interval = 3;  // validation forwards dispatch exactly
  config.metrics.log_interval = 100;
  return config;
}

// The run speculating against the same run without: bit for bit, and counts that add up.
void expect_speculation_changes_no_bit(RunConfig config, int ranks, const std::string& what, int ranks_per_node = 0) {
  config.model.moe.speculative_dispatch = false;
  const std::vector<RankRun> exact = train_ranks(config, ranks, ranks_per_node);
  config.model.moe.speculative_dispatch = true;
  const std::vector<RankRun> spec = train_ranks(config, ranks, ranks_per_node);
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(exact[static_cast<size_t>(r)].error, "") << what;
    ASSERT_EQ(spec[static_cast<size_t>(r)].error, "") << what;
    EXPECT_EQ(spec[static_cast<size_t>(r)].losses, exact[static_cast<size_t>(r)].losses) << what << ", rank " << r;
    EXPECT_EQ(spec[static_cast<size_t>(r)].params, exact[static_cast<size_t>(r)].params) << what << ", rank " << r;
  }
  const RankRun& run = spec[0];
  ASSERT_EQ(run.layers.size(), 6u);
  int64_t used = 0;
  for (size_t s = 0; s < run.layers.size(); ++s) {
    ASSERT_EQ(run.layers[s].size(), 3u);
    EXPECT_EQ(run.layers[s][0].spec_rows_used, -1) << "the first MoE layer has nothing to guess from";
    EXPECT_GE(run.layers[s][0].a2a_dispatch_wait_ms, 0);
    for (size_t l = 1; l < 3; ++l) {
      const LayerRouting& layer = run.layers[s][l];
      EXPECT_GE(layer.spec_rows_used, 0) << what;
      EXPECT_GE(layer.spec_rows_wasted, 0);
      EXPECT_GE(layer.spec_rows_corrected, 0);
      EXPECT_GE(layer.a2a_dispatch_wait_ms, 0);
      used += layer.spec_rows_used;
      for (int r = 1; r < ranks; ++r) {  // summed over the ranks: every rank reports the same
        EXPECT_EQ(spec[static_cast<size_t>(r)].layers[s][l].spec_rows_used, layer.spec_rows_used);
        EXPECT_EQ(spec[static_cast<size_t>(r)].layers[s][l].spec_rows_corrected, layer.spec_rows_corrected);
      }
      EXPECT_EQ(exact[0].layers[s][l].spec_rows_used, -1);
    }
  }
  EXPECT_GT(used, 0) << what << ": no row went early";
}

TEST(GpuSpeculativeDispatch, TwoRanksSameBitsAsTheExactDispatch) {
  MOE_REQUIRE_GPU();
  RunConfig config = speculation_run();
  config.training.micro_batch = 4;
  config.parallel.expert_parallel = 2;
  expect_speculation_changes_no_bit(config, 2, "EP 2");
  config.parallel.a2a_compression = A2aCompression::Fp8;
  expect_speculation_changes_no_bit(config, 2, "EP 2, fp8 rows");
  config.parallel.a2a_compression = A2aCompression::None;
  config.model.moe.route_cache_predict = 4;
  config.parallel.split_experts = true;  // split experts are not sharded by ZeRO on the GPU
  config.parallel.zero = 0;
  config.parallel.rebalance_interval = 2;
  expect_speculation_changes_no_bit(config, 2, "EP 2, re-placed split experts, 4 guesses");
}

TEST(GpuSpeculativeDispatch, FourRanksSameBitsAsTheExactDispatch) {
  MOE_REQUIRE_GPU();
  RunConfig config = speculation_run();
  config.training.micro_batch = 2;
  config.parallel.expert_parallel = 4;
  expect_speculation_changes_no_bit(config, 4, "EP 4");
  config.parallel.expert_parallel = 2;
  config.parallel.zero = 1;
  expect_speculation_changes_no_bit(config, 4, "DP 2 x EP 2, ZeRO-1");
}

// Two simulated nodes of two ranks: the early rows, corrections and sources all go through
// the hierarchical all-to-all (intra-node, then inter-node) and its shared scratch.
TEST(GpuSpeculativeDispatch, HierarchicalExchangeOverTwoNodesSameBits) {
  MOE_REQUIRE_GPU();
  RunConfig config = speculation_run();
  config.training.micro_batch = 2;
  config.parallel.expert_parallel = 4;
  config.parallel.all_to_all = AllToAllKind::Hierarchical;
  expect_speculation_changes_no_bit(config, 4, "EP 4 over 2 nodes, hierarchical", 2);
  config.parallel.a2a_compression = A2aCompression::Fp8;
  expect_speculation_changes_no_bit(config, 4, "EP 4 over 2 nodes, hierarchical, fp8 rows", 2);
}

}  // namespace
}  // namespace moe
