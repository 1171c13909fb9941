// Speculative dispatch (moe.speculative_dispatch, docs/ROUTING_CACHE.md) on the CPU
// expert-parallel path, EP ranks simulated by threads (label cpu):
//   - the planning references (moe/speculative_exchange.h): early blocks by window (a
//     hinge slot sends to both ranks), and the receiver's merge of early rows and
//     corrections rebuilds exactly the blocks the exact dispatch sends, for random
//     guesses and routings;
//   - a MoE layer that speculates gives bit for bit the outputs, input gradients and
//     parameter gradients of the same layer without it, whatever the guesses (none right,
//     some, every expert guessed), over equal and re-placed slots, split experts, chunks,
//     capacity and fp8 rows, and counts its rows (used + corrected = the exact remote rows).
// Training over real ranks: tests/dist/test_parallel_mpi_training.cpp (ParallelRouteCache).
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <thread>

#include "core/rng.h"
#include "model/moe_layer.h"
#include "moe/routing_cache.h"
#include "moe/speculative_exchange.h"
#include "moe/token_exchange.h"
#include "small_moe_layer.h"
#include "thread_ranks.h"

namespace moe {
namespace {

using test::ThreadRanks;

TEST(SpeculativeBlocks, TokensGoEarlyToTheWindowsOfTheirGuesses) {
  // 3 ranks, 6 slots, split: windows [0, 3), [2, 5), [4, 6) (hinges 2 and 4).
  const std::vector<int32_t> bounds = {0, 2, 4, 6}, ends = {3, 5, 6};
  const std::vector<int32_t> guess_TQ = {0, 1,    // rank 0 only
                                         2, -1,   // the hinge: ranks 0 and 1
                                         5, 3,    // ranks 1 and 2
                                         1, 0};   // rank 0 only
  std::vector<int32_t> pos_TP(4 * 3), tokens_P(3);
  speculative_blocks(pos_TP.data(), tokens_P.data(), guess_TQ.data(), 4, 2, bounds.data(), ends.data(), 3, /*me=*/1);
  EXPECT_EQ(tokens_P, (std::vector<int32_t>{3, 0, 1}));  // nothing to me (rank 1)
  EXPECT_EQ(pos_TP, (std::vector<int32_t>{0, -1, -1, 1, -1, -1, -1, -1, 0, 2, -1, -1}));
}

// P home ranks with random exact blocks and random early blocks: what each receiver
// rebuilds from the early rows and the corrections is the exact dispatch's blocks.
TEST(SpeculativeBlocks, MergeRebuildsTheExactBlocks) {
  constexpr int P = 3;
  constexpr int64_t T = 40, rb = 3;
  const CounterRng rng(7, "speculation");
  struct Home {
    std::vector<int32_t> pos_TP, tokens_P, spec_pos_TP, spec_P, source_U, corr_pos_TP, corr_P;
    std::vector<uint8_t> rows_T;  // token t's row: bytes (home, t, byte)
  };
  std::vector<Home> homes(P);
  uint64_t draw = 0;
  for (int h = 0; h < P; ++h) {
    Home& home = homes[h];
    home.pos_TP.assign(T * P, -1);
    home.spec_pos_TP.assign(T * P, -1);
    home.tokens_P.assign(P, 0);
    home.spec_P.assign(P, 0);
    for (int64_t t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p) {
        if (rng.uniform(draw++) < 0.5) home.pos_TP[t * P + p] = home.tokens_P[p]++;
        if (p != h && rng.uniform(draw++) < 0.5) home.spec_pos_TP[t * P + p] = home.spec_P[p]++;
      }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < rb; ++b) home.rows_T.push_back(static_cast<uint8_t>(h * 64 + t + b));
    home.source_U.resize(std::accumulate(home.tokens_P.begin(), home.tokens_P.end(), size_t{0}));
    home.corr_pos_TP.resize(T * P);
    home.corr_P.resize(P);
    speculation_sources(home.source_U.data(), home.corr_pos_TP.data(), home.corr_P.data(), home.pos_TP.data(),
                        home.tokens_P.data(), home.spec_pos_TP.data(), T, P);
  }
  // The block home h sends to p under a position table (pos_TP, sizes_P), and the slice of
  // an exact block's sources.
  auto block = [&](const Home& home, const std::vector<int32_t>& pos_TP, int p, int32_t size) {
    std::vector<uint8_t> out(static_cast<size_t>(size * rb));
    for (int64_t t = 0; t < T; ++t)
      if (pos_TP[t * P + p] >= 0) std::memcpy(out.data() + pos_TP[t * P + p] * rb, home.rows_T.data() + t * rb, rb);
    return out;
  };
  SpeculationRows total;
  for (int me = 0; me < P; ++me) {
    std::vector<uint8_t> want, spec, corr;
    std::vector<int32_t> recv_P, spec_recv_P, corr_recv_P, source_U;
    for (int h = 0; h < P; ++h) {
      const Home& home = homes[h];
      const auto exact = block(home, home.pos_TP, me, home.tokens_P[me]);
      want.insert(want.end(), exact.begin(), exact.end());
      const auto early = block(home, home.spec_pos_TP, me, home.spec_P[me]);
      spec.insert(spec.end(), early.begin(), early.end());
      const auto late = block(home, home.corr_pos_TP, me, home.corr_P[me]);
      corr.insert(corr.end(), late.begin(), late.end());
      recv_P.push_back(home.tokens_P[me]);
      spec_recv_P.push_back(home.spec_P[me]);
      corr_recv_P.push_back(home.corr_P[me]);
      const int32_t start = std::accumulate(home.tokens_P.begin(), home.tokens_P.begin() + me, 0);
      source_U.insert(source_U.end(), home.source_U.begin() + start, home.source_U.begin() + start + home.tokens_P[me]);
    }
    std::vector<uint8_t> got(want.size(), 0xff);
    const SpeculationRows rows = merge_speculated_rows(got.data(), source_U.data(), recv_P.data(), spec.data(),
                                                       spec_recv_P.data(), corr.data(), corr_recv_P.data(), rb, P, me);
    EXPECT_EQ(got, want) << "receiver " << me;
    int64_t remote_exact = 0, remote_spec = 0;
    for (int h = 0; h < P; ++h)
      if (h != me) remote_exact += recv_P[h], remote_spec += spec_recv_P[h];
    EXPECT_EQ(rows.used + rows.corrected, remote_exact);
    EXPECT_EQ(rows.used + rows.wasted, remote_spec);
    total.add(rows);
    // A source naming an early row that was not sent is refused.
    if (!source_U.empty()) {
      source_U[0] = spec_recv_P[0];
      EXPECT_THROW(merge_speculated_rows(got.data(), source_U.data(), recv_P.data(), spec.data(), spec_recv_P.data(),
                                         corr.data(), corr_recv_P.data(), rb, P, me),
                   std::exception);
    }
  }
  EXPECT_GT(total.used, 0);
  EXPECT_GT(total.wasted, 0);
  EXPECT_GT(total.corrected, 0);
}

struct SpecCase {
  const char* name;
  std::vector<std::vector<int64_t>> blocks;  // experts per EP rank; empty: equal blocks
  bool split = false;
  int chunks = 1;
  double capacity_factor = 0;
  bool fp8 = false;
};

std::ostream& operator<<(std::ostream& os, const SpecCase& c) { return os << c.name; }

class SpeculativeLayer : public ::testing::TestWithParam<SpecCase> {};

TEST_P(SpeculativeLayer, SameBitsAsTheExactDispatch) {
  const SpecCase& c = GetParam();
  constexpr int P = 3;
  constexpr int64_t E = 6, K = 2, B = 2, S = 4, D = 8, V = 5;
  const ModelConfig config = test::small_moe_layer_config(E, K, c.capacity_factor);
  const ExpertSlots slots = c.blocks.empty() ? equal_expert_slots(E, P, c.split)
                                             : expert_slots_from_blocks(c.blocks, c.split);
  const int64_t T = B * S;
  ThreadRanks ranks(P);
  std::vector<std::unique_ptr<ThreadRanks::Batch>> batches;
  std::vector<std::unique_ptr<ThreadRanks::Exchange>> exchanges;
  std::vector<std::unique_ptr<test::MoELayerRig<float>>> plain, spec;
  for (int r = 0; r < P; ++r) {
    batches.push_back(std::make_unique<ThreadRanks::Batch>(ranks, r));
    exchanges.push_back(std::make_unique<ThreadRanks::Exchange>(ranks, r, c.chunks));
    exchanges.back()->set_fp8(c.fp8);
    plain.push_back(std::make_unique<test::MoELayerRig<float>>(config, T, batches.back().get(), exchanges.back().get(), &slots, 2));
    spec.push_back(std::make_unique<test::MoELayerRig<float>>(config, T, batches.back().get(), exchanges.back().get(), &slots, 2));
  }
  // Guesses: Q = K from a cache that learnt a random routing (some right), and Q = E
  // (every expert guessed: nothing to correct, most rows wasted).
  for (const int64_t Q : {K, E}) {
    SCOPED_TRACE("guessed experts " + std::to_string(Q));
    const CounterRng rng(11 + static_cast<uint64_t>(Q), "routing");
    std::vector<RoutingCache> caches;
    std::vector<std::vector<int32_t>> tokens_R, prev_R;
    for (int r = 0; r < P; ++r) {
      caches.emplace_back(E, K, Q, 1000);
      std::vector<int32_t> tokens(T), prev(T * K), next(T * K);
      for (int64_t t = 0; t < T; ++t) {
        tokens[t] = static_cast<int32_t>(rng.uniform(r * 1000 + t) * V);
        for (int64_t k = 0; k < K; ++k) {
          prev[t * K + k] = static_cast<int32_t>((t + k * 3 + r) % E);
          next[t * K + k] = static_cast<int32_t>(rng.uniform(r * 1000 + 100 + t * K + k) * E);
        }
        if (next[t * K] == next[t * K + 1]) next[t * K + 1] = (next[t * K] + 1) % E;
      }
      caches.back().observe(tokens.data(), prev.data(), next.data(), T);
      tokens_R.push_back(tokens);
      prev_R.push_back(prev);
    }
    for (int micro = 0; micro < 2; ++micro) {
      SCOPED_TRACE("micro-batch " + std::to_string(micro));
      const CounterRng inputs(4 + static_cast<uint64_t>(micro), "inputs");
      std::vector<std::vector<float>> y(P), dx(P), y_spec(P), dx_spec(P);
      std::vector<SpeculationRows> counts(P);
      std::vector<int64_t> remote_rows(P, 0);
      auto run = [&](std::vector<std::unique_ptr<test::MoELayerRig<float>>>& rigs, bool speculate,
                     std::vector<std::vector<float>>& y_R, std::vector<std::vector<float>>& dx_R) {
        std::vector<std::thread> threads;
        for (int r = 0; r < P; ++r)
          threads.emplace_back([&, r] {
            std::vector<float> x(T * D), dy(T * D);
            for (int64_t i = 0; i < T * D; ++i) {
              x[i] = static_cast<float>(inputs.normal(r * 10000 + i));
              dy[i] = static_cast<float>(inputs.normal(r * 10000 + 5000 + i));
            }
            MoELayer<float>& layer = *rigs[r]->layer;
            layer.reset_load();
            if (speculate) {
              layer.set_route_predictor(&caches[r]);
              layer.speculate(tokens_R[r].data(), prev_R[r].data());
            }
            y_R[r].resize(x.size());
            dx_R[r].resize(x.size());
            layer.forward(y_R[r].data(), x.data());
            layer.backward(dx_R[r].data(), dy.data(), x.data(), 1.0);
            if (speculate) counts[r] = layer.routing_stats().speculation;
          });
        for (auto& t : threads) t.join();
      };
      run(plain, false, y, dx);
      run(spec, true, y_spec, dx_spec);
      SpeculationRows sum;
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(y_spec[r], y[r]) << "rank " << r;
        EXPECT_EQ(dx_spec[r], dx[r]) << "rank " << r;
        for (int id = 0; id < plain[r]->params.size(); ++id)
          ASSERT_EQ(0, std::memcmp(plain[r]->params.grad(id), spec[r]->params.grad(id),
                                   static_cast<size_t>(plain[r]->params.numel(id)) * sizeof(float)))
              << "rank " << r << " " << plain[r]->params.spec(id).name;
        sum.add(counts[r]);
      }
      EXPECT_GT(sum.used, 0);
      if (Q == E) EXPECT_EQ(sum.corrected, 0) << "every expert guessed: nothing to correct";
      else EXPECT_GT(sum.corrected, 0) << "the case needs some wrong guesses";
      EXPECT_GT(sum.wasted, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SpeculativeLayer,
    ::testing::Values(SpecCase{"equal_blocks"}, SpecCase{"equal_blocks_3_chunks", {}, false, 3},
                      SpecCase{"placed_capacity_2_chunks", {{4}, {0, 5, 2}, {1, 3}}, false, 2, 0.75},
                      SpecCase{"split_placed_2_chunks", {{1, 3}, {2, 0}, {5, 4}}, true, 2},
                      SpecCase{"fp8_rows_2_chunks", {}, false, 2, 0, true},
                      SpecCase{"fp8_split_capacity", {{1, 3}, {2, 0}, {5, 4}}, true, 1, 1.0, true}),
    [](const ::testing::TestParamInfo<SpecCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace moe
