// The CPU path's expert parallelism (model/expert_parallel_dispatcher.h) with EP ranks
// simulated by threads (label cpu). Two kinds of check:
//   - P ranks reproduce one layer over the whole micro-batch (outputs, input gradients,
//     losses, drops, the ranks' parameter gradients summed), in double, over two
//     micro-batches, for equal and re-placed slots, split experts (hinges, a hinge shared
//     by three ranks), chunks and capacity; each rank computes the rows the cuts give it
//     (balanced_boundaries of the global kept rows), so with a hot hinge expert the
//     busiest rank takes the least the hinges allow, and the cuts move between the
//     micro-batches;
//   - the messages: what each peer receives and the partial combines it returns are
//     exactly (bit for bit) what moe/token_exchange.h's reference functions give for the
//     same routing, so the CPU path and the GPU kernels (tested against the same
//     functions, tests/gpu/test_gpu_dispatch.cpp) share one oracle.
// Training over real ranks: tests/dist/test_parallel_mpi_training.cpp (label mpi).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <thread>

#include "core/rng.h"
#include "kernels/matmul.h"
#include "kernels/swiglu.h"
#include "model/moe_layer.h"
#include "moe/dispatch.h"
#include "moe/router.h"
#include "moe/token_exchange.h"
#include "small_moe_layer.h"
#include "thread_ranks.h"

namespace moe {
namespace {

using test::ThreadRanks;

template <typename T>
using LayerRig = test::MoELayerRig<T>;

struct EpCase {
  const char* name;
  std::vector<std::vector<int64_t>> blocks;  // experts per EP rank; empty: equal blocks
  bool split = false;
  int chunks = 1;
  double capacity_factor = 0;
  int hot_expert = -1;
  bool mean_reachable = false;  // the hinges can give every rank the mean
};

std::ostream& operator<<(std::ostream& os, const EpCase& c) { return os << c.name; }

class ExpertParallelLayer : public ::testing::TestWithParam<EpCase> {};

// P ranks of B sequences each (rank r's sequence b is global sequence b * P + r) against
// one layer over the P * B sequences.
TEST_P(ExpertParallelLayer, RanksReproduceOneLayer) {
  const EpCase& c = GetParam();
  constexpr int P = 3;
  constexpr int64_t E = 6, K = 2, B = 2, S = 4, D = 8;
  const ModelConfig config = test::small_moe_layer_config(E, K, c.capacity_factor);
  const ExpertSlots slots = c.blocks.empty() ? equal_expert_slots(E, P, c.split)
                                             : expert_slots_from_blocks(c.blocks, c.split);
  const int64_t T_local = B * S, T_global = P * T_local;
  auto global_row = [&](int r, int64_t t) { return ((t / S) * P + r) * S + t % S; };
  LayerRig<double> one(config, T_global, nullptr, nullptr, nullptr, c.hot_expert);
  ThreadRanks ranks(P);
  std::vector<std::unique_ptr<ThreadRanks::Batch>> batches;
  std::vector<std::unique_ptr<ThreadRanks::Exchange>> exchanges;
  std::vector<std::unique_ptr<LayerRig<double>>> rigs;
  for (int r = 0; r < P; ++r) {
    batches.push_back(std::make_unique<ThreadRanks::Batch>(ranks, r));
    exchanges.push_back(std::make_unique<ThreadRanks::Exchange>(ranks, r, c.chunks));
    rigs.push_back(std::make_unique<LayerRig<double>>(config, T_local, batches.back().get(), exchanges.back().get(),
                                                      &slots, c.hot_expert));
  }
  // Two micro-batches (gradients accumulate over both), each checked on its own; with
  // split experts the cuts move between them.
  std::vector<std::vector<int32_t>> cuts_of_micro_batch;
  for (int micro = 0; micro < 2; ++micro) {
    SCOPED_TRACE("micro-batch " + std::to_string(micro));
    const CounterRng rng(4 + static_cast<uint64_t>(micro), "inputs");
    std::vector<double> x(T_global * D), dy(T_global * D);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = rng.normal(i);
      dy[i] = rng.normal(i + x.size());
    }
    one.layer->reset_load();
    std::vector<double> y(x.size()), dx(x.size());
    const MoEForwardStats want = one.layer->forward(y.data(), x.data());
    one.layer->backward(dx.data(), dy.data(), x.data(), 1.0);

    const auto passes = test::forward_backward_on_ranks(rigs, x, dy, T_local, D, global_row);

    int64_t dropped = 0, rows = 0;
    for (int r = 0; r < P; ++r) {
      const test::RankPass<double>& got = passes[r];
      EXPECT_NEAR(got.stats.aux_loss, want.aux_loss, 1e-12);
      EXPECT_NEAR(got.stats.z_loss, want.z_loss, 1e-12);
      dropped += got.stats.dropped;
      rows += got.stats.expert_rows;
      for (int64_t t = 0; t < T_local; ++t)
        for (int64_t d = 0; d < D; ++d) {
          ASSERT_NEAR(got.y[t * D + d], y[global_row(r, t) * D + d], 1e-12) << "rank " << r << " token " << t;
          ASSERT_NEAR(got.dx[t * D + d], dx[global_row(r, t) * D + d], 1e-12) << "rank " << r << " token " << t;
        }
    }
    EXPECT_EQ(dropped, want.dropped);
    EXPECT_EQ(rows, want.expert_rows) << "every kept row computed once";
    if (c.capacity_factor > 0) EXPECT_GT(want.dropped, 0) << "the case needs capacity to drop";
    for (int id = 0; id < one.params.size(); ++id)
      for (int64_t i = 0; i < one.params.numel(id); ++i) {
        double sum = 0;
        for (int r = 0; r < P; ++r) sum += rigs[r]->params.grad(id)[i];
        ASSERT_NEAR(sum, one.params.grad(id)[i], 1e-12) << one.params.spec(id).name << " " << i;
      }
    // Who computed what: the rows each rank's window took, against the cuts' balance over
    // the global kept rows per slot (balanced_boundaries). Each of the P home ranks rounds
    // its share of a hinge (rows_before) and the cut is floored to 1 / kSlotParts, so a
    // rank may be off by up to P / 2 + 1 rows at each of its two boundaries.
    std::vector<int64_t> before_S1 = {0};
    std::vector<int32_t> counts_S;
    for (int64_t expert : slots.expert_of_slot) {
      counts_S.push_back(static_cast<int32_t>(one.layer->routing_stats().kept_E[static_cast<size_t>(expert)]));
      before_S1.push_back(before_S1.back() + counts_S.back());
    }
    const std::vector<int64_t> at = balanced_boundaries(before_S1, slots.first_slot_P1, c.split);
    const double rounding = P + 2;
    int64_t busiest = 0, bound = 0, busiest_whole = 0;
    for (int p = 0; p < P; ++p) {
      EXPECT_NEAR(static_cast<double>(passes[p].stats.expert_rows), static_cast<double>(at[p + 1] - at[p]), rounding)
          << "rank " << p;
      busiest = std::max(busiest, passes[p].stats.expert_rows);
      bound = std::max(bound, at[p + 1] - at[p]);
      busiest_whole =
          std::max(busiest_whole, before_S1[slots.first_slot_P1[p + 1]] - before_S1[slots.first_slot_P1[p]]);
    }
    if (!c.split) EXPECT_EQ(busiest, busiest_whole) << "whole experts: the blocks' rows";
    if (c.split) EXPECT_NEAR(static_cast<double>(busiest), static_cast<double>(bound), rounding);
    if (c.split && c.hot_expert >= 0 && c.capacity_factor == 0)  // (capacity caps the hot expert itself)
      EXPECT_LT(busiest, busiest_whole) << "the hinges should take load off the hot expert's block";
    if (c.mean_reachable) EXPECT_EQ(bound, (rows + P - 1) / P) << "the hinges can even the ranks";
    // The cuts of the global counts (one home holding them all gives every home's cuts).
    std::vector<int32_t> cuts(P + 1), counts_PE(static_cast<size_t>(P * E), 0);
    std::copy(counts_S.begin(), counts_S.end(), counts_PE.begin());
    const std::vector<int32_t> first(slots.first_slot_P1.begin(), slots.first_slot_P1.end());
    boundary_cuts(cuts.data(), counts_PE.data(), first.data(), c.split, E, P);
    cuts_of_micro_batch.push_back(cuts);
  }
  if (c.split && c.hot_expert >= 0 && c.capacity_factor == 0)
    EXPECT_NE(cuts_of_micro_batch[0], cuts_of_micro_batch[1]) << "the hinges should move with the micro-batch";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ExpertParallelLayer,
    ::testing::Values(EpCase{"equal_blocks"}, EpCase{"equal_blocks_3_chunks", {}, false, 3},
                      EpCase{"placed", {{4}, {0, 5, 2}, {1, 3}}},
                      EpCase{"placed_capacity_2_chunks", {{4}, {0, 5, 2}, {1, 3}}, false, 2, 0.75},
                      EpCase{"split_equal_hot", {}, true, 1, 0, 2},
                      EpCase{"split_placed_hot_2_chunks", {{1, 3}, {2, 0}, {5, 4}}, true, 2, 0, 2},
                      EpCase{"split_wide_hinge_hot", {{0, 1}, {}, {2, 3, 4, 5}}, true, 1, 0, 2, true},
                      EpCase{"split_capacity_3_chunks", {{1, 3}, {2, 0}, {5, 4}}, true, 3, 1.0, 2}),
    [](const ::testing::TestParamInfo<EpCase>& info) { return std::string(info.param.name); });

// What each peer receives and returns in one forward, against the reference functions on
// the same routing: 3 ranks, split experts over re-placed slots, a hot hinge expert, one
// chunk (the GPU's layout), float as in training, top-3 (so that a token's partials from
// three ranks make their order matter). Bit for bit: the same functions on the same
// values in the same grouping.
TEST(ExpertParallelMessages, PeersGetAndReturnWhatTheReferencesSay) {
  constexpr int P = 3;
  constexpr int64_t E = 6, K = 3, B = 2, S = 4, D = 8, F = 6, T = B * S;
  const ModelConfig config = test::small_moe_layer_config(E, K, 0, /*shared_experts=*/0);
  const ExpertSlots slots = expert_slots_from_blocks({{1, 3}, {2, 0}, {5, 4}}, /*split=*/true);
  ThreadRanks ranks(P);
  std::vector<std::unique_ptr<ThreadRanks::Batch>> batches;
  std::vector<std::unique_ptr<ThreadRanks::Exchange>> exchanges;
  std::vector<std::unique_ptr<LayerRig<float>>> rigs;
  std::vector<std::vector<float>> x(P), y(P);
  const CounterRng rng(7, "inputs");
  for (int r = 0; r < P; ++r) {
    batches.push_back(std::make_unique<ThreadRanks::Batch>(ranks, r));
    exchanges.push_back(std::make_unique<ThreadRanks::Exchange>(ranks, r, 1));
    exchanges.back()->recording = true;
    rigs.push_back(std::make_unique<LayerRig<float>>(config, T, batches.back().get(), exchanges.back().get(), &slots,
                                                     /*hot_expert=*/2));
    for (int64_t i = 0; i < T * D; ++i) x[r].push_back(static_cast<float>(rng.normal(static_cast<uint64_t>(r * T * D + i))));
    y[r].resize(static_cast<size_t>(T * D));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) threads.emplace_back([&, r] { rigs[r]->layer->forward(y[r].data(), x[r].data()); });
  for (auto& t : threads) t.join();

  // The reference: each home's routing (the router functions on its tokens), its plan...
  ParameterStore<float>& params = rigs[0]->params;  // every rank holds the same weights
  const float* router_w = params.value(params.find("layers.0.moe.router.weight"));
  const float* router_b = params.value(params.find("layers.0.moe.router.bias"));
  const float* w1 = params.value(params.find("layers.0.moe.experts.w1"));
  const float* w3 = params.value(params.find("layers.0.moe.experts.w3"));
  const float* w2 = params.value(params.find("layers.0.moe.experts.w2"));
  const std::vector<int32_t> slot_of = slot_of_expert(slots);
  const std::vector<int32_t> first(slots.first_slot_P1.begin(), slots.first_slot_P1.end()),
      window_end(slots.window_end_P.begin(), slots.window_end_P.end());
  struct Home {
    std::vector<int32_t> slot, row, counts, offsets, rank, pos, tokens, packed_counts, routed;
    std::vector<float> weight, rows;
  };
  std::vector<Home> homes(P);
  std::vector<int32_t> counts_PE;
  for (int h = 0; h < P; ++h) {
    Home& home = homes[h];
    std::vector<float> logits(T * E), scores(T * E);
    std::vector<int32_t> expert(T * K), token_of_row(T * K);
    home.weight.resize(T * K);
    linear_forward<float>(logits.data(), x[h].data(), router_w, router_b, T, D, E);
    router_scores_forward<float>(scores.data(), logits.data(), T, E, config.moe.temperature, config.moe.score_func);
    router_select<float>(expert.data(), home.weight.data(), scores.data(), nullptr, T, E, K, config.moe.renormalize);
    for (int32_t e : expert) home.slot.push_back(slot_of[static_cast<size_t>(e)]);
    home.row.resize(T * K);
    home.counts.resize(E);
    home.offsets.resize(E + 1);
    assign_rows(home.row.data(), home.counts.data(), home.offsets.data(), token_of_row.data(), home.slot.data(), T, E, K,
                T * K);
    counts_PE.insert(counts_PE.end(), home.counts.begin(), home.counts.end());
  }
  std::vector<int32_t> cuts(P + 1);
  boundary_cuts(cuts.data(), counts_PE.data(), first.data(), true, E, P);
  ASSERT_NE(cuts[1] % kSlotParts, 0) << "the case should divide a hinge";
  int64_t three_peers = 0;
  for (Home& home : homes) {
    home.rank.resize(T * K);
    route_ranks(home.rank.data(), home.row.data(), home.slot.data(), home.offsets.data(), cuts.data(), T, K, P);
    home.pos.resize(T * P);
    home.tokens.resize(P);
    token_blocks(home.pos.data(), home.tokens.data(), home.rank.data(), T, K, P);
    for (int64_t t = 0; t < T; ++t)
      three_peers += std::count_if(home.pos.begin() + t * P, home.pos.begin() + (t + 1) * P, [](int32_t v) { return v >= 0; }) == 3;
    int64_t words = 0;
    for (int p = 0; p < P; ++p) words += window_end[p] - first[p] + 1;
    home.packed_counts.resize(static_cast<size_t>(words));
    pack_counts(home.packed_counts.data(), home.counts.data(), home.tokens.data(), first.data(), window_end.data(),
                cuts.data(), P);
    const int64_t sent = std::accumulate(home.tokens.begin(), home.tokens.end(), int64_t{0});
    home.routed.resize(static_cast<size_t>(sent * K));
    std::vector<float> weights(static_cast<size_t>(sent * K));
    pack_routing(home.routed.data(), weights.data(), home.pos.data(), home.tokens.data(), home.rank.data(),
                 home.slot.data(), home.weight.data(), first.data(), T, K, P);
    home.weight = weights;  // now per block row
    home.rows.resize(static_cast<size_t>(sent * D));
  }
  ASSERT_GT(three_peers, 0) << "the case should send some tokens to all three ranks";
  for (int h = 0; h < P; ++h)
    scatter_token_rows(homes[h].rows.data(), x[h].data(), homes[h].pos.data(), homes[h].tokens.data(), T, P, D);

  // ... and each peer's messages: its part of every home's, homes in rank order.
  auto bytes_of = [](const auto& values, int64_t first_value, int64_t count) {
    const char* p = reinterpret_cast<const char*>(values.data() + first_value);
    return std::vector<char>(p, p + count * static_cast<int64_t>(sizeof(values[0])));
  };
  auto append = [](std::vector<char>& to, const std::vector<char>& more) { to.insert(to.end(), more.begin(), more.end()); };
  std::vector<std::vector<float>> partial_of_peer(P);
  for (int q = 0; q < P; ++q) {
    SCOPED_TRACE("peer " + std::to_string(q));
    const int64_t L = window_end[q] - first[q];
    std::vector<char> want_counts, want_slots, want_weights, want_rows;
    std::vector<int32_t> slot_UK;
    std::vector<float> weight_UK, x_UD;
    for (int h = 0; h < P; ++h) {
      const Home& home = homes[h];
      int64_t at_count = 0, at_token = 0;
      for (int p = 0; p < q; ++p) {
        at_count += window_end[p] - first[p] + 1;
        at_token += home.tokens[p];
      }
      const int64_t n = home.tokens[q];
      append(want_counts, bytes_of(home.packed_counts, at_count, L + 1));
      append(want_slots, bytes_of(home.routed, at_token * K, n * K));
      append(want_weights, bytes_of(home.weight, at_token * K, n * K));
      append(want_rows, bytes_of(home.rows, at_token * D, n * D));
      slot_UK.insert(slot_UK.end(), home.routed.begin() + at_token * K, home.routed.begin() + (at_token + n) * K);
      weight_UK.insert(weight_UK.end(), home.weight.begin() + at_token * K, home.weight.begin() + (at_token + n) * K);
      x_UD.insert(x_UD.end(), home.rows.begin() + at_token * D, home.rows.begin() + (at_token + n) * D);
    }
    const int64_t U = static_cast<int64_t>(slot_UK.size()) / K;
    ASSERT_GT(U, 0);
    // The peer's experts on its rows (assign_rows without capacity, slot by slot), then
    // the partial combine over its entries.
    std::vector<int32_t> row(U * K), counts(L), offsets(L + 1), token(U * K);
    const int64_t R = assign_rows(row.data(), counts.data(), offsets.data(), token.data(), slot_UK.data(), U, L, K, U * K);
    std::vector<float> x_rows(R * D), gate(R * F), up(R * F), act(R * F), y_rows(R * D);
    permute_forward<float>(x_rows.data(), x_UD.data(), token.data(), R, D);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t r = offsets[l], n = offsets[l + 1] - offsets[l], e = slots.expert_of_slot[first[q] + l];
      if (n == 0) continue;
      linear_forward<float>(gate.data() + r * F, x_rows.data() + r * D, w1 + e * F * D, nullptr, n, D, F);
      linear_forward<float>(up.data() + r * F, x_rows.data() + r * D, w3 + e * F * D, nullptr, n, D, F);
      swiglu_forward<float>(act.data() + r * F, gate.data() + r * F, up.data() + r * F, n * F);
      linear_forward<float>(y_rows.data() + r * D, act.data() + r * F, w2 + e * D * F, nullptr, n, F, D);
    }
    partial_of_peer[q].resize(static_cast<size_t>(U * D));
    combine_forward<float>(partial_of_peer[q].data(), y_rows.data(), weight_UK.data(), row.data(), U, K, D);

    const auto& got = exchanges[q]->received;
    ASSERT_EQ(got.size(), 6u) << "gather, counts, slots, weights, rows, results";
    EXPECT_EQ(got[0].bytes, bytes_of(counts_PE, 0, P * E)) << "every rank's kept rows per slot";
    EXPECT_EQ(got[1].bytes, want_counts) << "rows per window slot and block sizes (pack_counts)";
    EXPECT_EQ(got[2].bytes, want_slots) << "routing: window slots (pack_routing)";
    EXPECT_EQ(got[3].bytes, want_weights) << "routing: combine weights (pack_routing)";
    EXPECT_EQ(got[4].what, "rows");
    EXPECT_EQ(got[4].bytes, want_rows) << "token rows (scatter_token_rows)";
    EXPECT_EQ(got[5].what, "results");
    EXPECT_EQ(got[5].bytes, bytes_of(partial_of_peer[q], 0, U * D)) << "partial combines";
  }
  // Home: the partials it got back summed in rank order (sum_token_rows).
  for (int h = 0; h < P; ++h) {
    const Home& home = homes[h];
    std::vector<float> blocks;
    for (int p = 0; p < P; ++p) {
      int64_t at = 0;  // home h's block in peer p's received tokens
      for (int g = 0; g < h; ++g) at += homes[g].tokens[p];
      blocks.insert(blocks.end(), partial_of_peer[p].begin() + at * D,
                    partial_of_peer[p].begin() + (at + home.tokens[p]) * D);
    }
    std::vector<float> want(T * D);
    sum_token_rows(want.data(), blocks.data(), home.pos.data(), home.tokens.data(), T, P, D);
    EXPECT_EQ(y[h], want) << "home " << h;
  }
}

}  // namespace
}  // namespace moe
