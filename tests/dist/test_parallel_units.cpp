// The pieces of data and expert parallelism that run in one process (label cpu): expert
// placement, per-rank data slices and the MoE layer's global-micro-batch statistics (aux
// loss, z-loss, capacity) with ranks simulated by threads (tests/model/thread_ranks.h).
// ZeRO-1: test_zero_optimizer.cpp; training across real ranks: test_parallel_mpi_training.cpp
// (label mpi).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include <optional>
#include <thread>

#include "core/rng.h"
#include "dist/expert_exchange.h"
#include "data/rank_sliced_source.h"
#include "train/backends/parallel_cpu_backend.h"
#include "dist/single_communicator.h"
#include "model/moe_layer.h"
#include "moe/expert_placement.h"
#include "train/synthetic.h"
#include "model/thread_ranks.h"

namespace moe {
namespace {

TEST(ExpertPlacement, ContiguousBlocksAndExplicitMaps) {
  const auto blocks = ExpertPlacement::contiguous(8, 4);
  EXPECT_EQ(blocks.rank_of(5), 2);
  EXPECT_EQ(blocks.slot_of(5), 1);
  EXPECT_EQ(blocks.experts_of(3), (std::vector<int64_t>{6, 7}));
  const ExpertPlacement round_robin({0, 1, 0, 1, 0, 1}, 2);
  EXPECT_EQ(round_robin.experts_of(1), (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(round_robin.slot_of(4), 2);
  EXPECT_FALSE(blocks == round_robin);
  EXPECT_THROW(ExpertPlacement::contiguous(6, 4), Error);
  EXPECT_THROW(ExpertPlacement({0, 2}, 2), Error);
}

// The GPU's per-layer re-placement: a layer whose balanced placement lowers its busiest
// rank moves (a collapsed layer: the hot expert alone), a layer already as good as it gets
// keeps its placement (ties do not move), and the summed busiest loads say what changed.
TEST(ExpertPlacement, RebalanceLayersMovesOnlyWhatImproves) {
  const std::vector<std::vector<int64_t>> blocks = {{0, 1, 2, 3}, {4, 5, 6, 7}};
  const std::vector<std::vector<int64_t>> load = {
      {700, 100, 100, 100, 100, 100, 100, 100},  // collapsed onto expert 0
      {10, 10, 10, 10, 10, 10, 10, 10},          // even: the blocks are already best
  };
  const LayerPlacements next = rebalance_layers(load, {blocks, blocks}, 2, 1, 7);
  EXPECT_TRUE(next.moves);
  EXPECT_EQ(next.experts_of_rank[0], (std::vector<std::vector<int64_t>>{{0}, {1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(next.experts_of_rank[1], blocks);
  EXPECT_EQ(next.busiest_before, 1000 + 40);
  EXPECT_EQ(next.busiest_after, 700 + 40);
  // Placed again on the same loads: nothing left to gain.
  const LayerPlacements again = rebalance_layers(load, next.experts_of_rank, 2, 1, 7);
  EXPECT_FALSE(again.moves);
  EXPECT_EQ(again.experts_of_rank, next.experts_of_rank);
  EXPECT_EQ(again.busiest_before, again.busiest_after);
  // Equal counts (no cap): the hot expert's rank must take three more, no better than the
  // blocks (1000 either way), so nothing moves.
  const LayerPlacements equal = rebalance_layers({load[0]}, {blocks}, 2, 1, 0);
  EXPECT_FALSE(equal.moves);
  EXPECT_EQ(equal.experts_of_rank[0], blocks);
  EXPECT_EQ(equal.busiest_after, 1000);
  EXPECT_THROW(rebalance_layers(load, {blocks}, 2, 1, 7), Error);  // two layers' loads, one placement
}

// Split experts: the heaviest experts start the blocks after the first (hinges, each
// counted half on both sides), the rest go to the least loaded rank; a rank's load is then
// its share as far as the hinges allow. A collapsed layer (one expert with 70% of the
// load) over 4 ranks: whole experts leave a rank with 980 of 1400; one hinge per boundary
// (room for 3 experts per window) shares it by two ranks (550 each at best); with room
// for 5, it spans two boundaries and three ranks share it (about 367 each).
TEST(ExpertPlacement, HingedPlacementEvensTheRanks) {
  const std::vector<int64_t> load = {980, 60, 60, 60, 60, 60, 60, 60};  // 1400, 350 per rank of 4
  const auto blocks = hinged_placement(load, 4, 1, 0);
  ASSERT_EQ(blocks.size(), 4u);
  EXPECT_EQ(blocks[1].front(), 0) << "the hot expert is the first hinge";
  for (size_t r = 0; r < blocks.size(); ++r) {
    const size_t window = blocks[r].size() + (r + 1 < blocks.size() ? 1 : 0);
    EXPECT_LE(window, 3u) << "room: E / P + 1 per window";
  }
  const std::vector<int64_t> loads = split_rank_loads(load, blocks, true);
  EXPECT_EQ(std::accumulate(loads.begin(), loads.end(), int64_t{0}), 1400);
  // The hot expert is split between ranks 0 and 1 only: together they take at most 980 +
  // rank 0's others, the rest even.
  EXPECT_LE(*std::max_element(loads.begin(), loads.end()), 550);
  const std::vector<int64_t> whole = split_rank_loads(load, blocks, false);
  EXPECT_GE(*std::max_element(whole.begin(), whole.end()), 980) << "without the split the hinge counts whole";
  const auto wide = hinged_placement(load, 4, 1, 5);
  EXPECT_TRUE(wide[1].empty()) << "rank 1 holds only a middle part of expert 0";
  EXPECT_EQ(wide[2].front(), 0) << "the last rank sharing expert 0 holds its slot";
  for (size_t r = 0; r < wide.size(); ++r) EXPECT_LE(wide[r].size() + (r + 1 < wide.size() ? 1 : 0), 5u);
  const std::vector<int64_t> wide_loads = split_rank_loads(load, wide, true);
  EXPECT_EQ(std::accumulate(wide_loads.begin(), wide_loads.end(), int64_t{0}), 1400);
  EXPECT_LE(*std::max_element(wide_loads.begin(), wide_loads.end()), 370);
  // 8 ranks, room for 2 (E / P + 1): the hot expert spans only as many boundaries as leave
  // room for the others (3 ranks share it), still well under two-way hinges' 490.
  const auto tight = hinged_placement(load, 8, 1, 0);
  for (size_t r = 0; r < tight.size(); ++r) EXPECT_LE(tight[r].size() + (r + 1 < tight.size() ? 1 : 0), 2u);
  const std::vector<int64_t> tight_loads = split_rank_loads(load, tight, true);
  EXPECT_EQ(std::accumulate(tight_loads.begin(), tight_loads.end(), int64_t{0}), 1400);
  EXPECT_LE(*std::max_element(tight_loads.begin(), tight_loads.end()), 400);
  // Re-placement with split: from equal blocks the busiest rank drops from 1160 (expert 0
  // and its block) to what the hinges leave.
  const std::vector<std::vector<int64_t>> equal = {{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  const LayerPlacements next = rebalance_layers({load}, {equal}, 4, 1, 0, /*split=*/true);
  EXPECT_TRUE(next.moves);
  EXPECT_EQ(next.experts_of_rank[0], blocks);
  EXPECT_LT(next.busiest_after, next.busiest_before);
  // Even loads: the hinges cut every rank to the exact share.
  const std::vector<int64_t> even(8, 100);
  const auto even_loads = split_rank_loads(even, hinged_placement(even, 4, 1, 0), true);
  EXPECT_EQ(even_loads, (std::vector<int64_t>{200, 200, 200, 200}));
  // Groups: each hinge is an expert of the group whose block it starts.
  const auto grouped = hinged_placement(load, 4, 2, 0);
  for (size_t r = 1; r < 4; ++r) EXPECT_EQ(grouped[r].front() / 4, static_cast<int64_t>(r / 2)) << "rank " << r;
  for (size_t r = 0; r < 4; ++r)
    for (size_t i = r > 0 ? 1 : 0; i < grouped[r].size(); ++i) EXPECT_EQ(grouped[r][i] / 4, static_cast<int64_t>(r / 2));
}

// Dynamic load balancing's placement: the same number of experts per rank, the heaviest
// experts apart, and a spread no worse than the contiguous blocks on random loads.
TEST(ExpertPlacement, BalancedByLoad) {
  // Two hot experts in the first block: contiguous puts 90 + 80 on rank 0.
  const std::vector<int64_t> load = {90, 80, 5, 5, 4, 3, 2, 1};
  const auto balanced = ExpertPlacement::balanced(load, 2);
  EXPECT_EQ(balanced.experts_of(0), (std::vector<int64_t>{0, 4, 6, 7}));  // 90, 4, 2, 1
  EXPECT_EQ(balanced.experts_of(1), (std::vector<int64_t>{1, 2, 3, 5}));  // 80, 5, 5, 3
  EXPECT_EQ(balanced.rank_loads(load), (std::vector<int64_t>{97, 93}));
  EXPECT_EQ(ExpertPlacement::contiguous(8, 2).rank_loads(load), (std::vector<int64_t>{180, 10}));
  // Equal loads: experts in id order, each to the emptiest rank, ties to the lower rank.
  const auto even = ExpertPlacement::balanced(std::vector<int64_t>(8, 7), 4);
  EXPECT_EQ(even.experts_of(0), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(even.experts_of(3), (std::vector<int64_t>{3, 7}));
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const int ranks = 1 << (trial % 4);
    std::vector<int64_t> random(static_cast<size_t>(ranks * (1 + trial % 5)));
    for (auto& l : random) l = static_cast<int64_t>(rng() % 1000);
    const auto placed = ExpertPlacement::balanced(random, ranks);
    for (int r = 0; r < ranks; ++r)
      EXPECT_EQ(placed.experts_of(r).size(), random.size() / static_cast<size_t>(ranks));
    const auto mine = placed.rank_loads(random);
    const auto blocks = ExpertPlacement::contiguous(static_cast<int64_t>(random.size()), ranks).rank_loads(random);
    EXPECT_LE(*std::max_element(mine.begin(), mine.end()), *std::max_element(blocks.begin(), blocks.end()) +
                                                               *std::max_element(random.begin(), random.end()) / 3);
  }
  EXPECT_THROW(ExpertPlacement::balanced({1, 2, 3}, 2), Error);
  // One hot expert (a collapsed router): with equal counts its rank also takes the next
  // three; with room for up to 7 it stays alone and the loads are even.
  const std::vector<int64_t> hot = {700, 100, 100, 100, 100, 100, 100, 100};
  EXPECT_EQ(ExpertPlacement::balanced(hot, 2).rank_loads(hot), (std::vector<int64_t>{1000, 400}));
  const auto uneven = ExpertPlacement::balanced(hot, 2, 1, 7);
  EXPECT_EQ(uneven.experts_of(0), (std::vector<int64_t>{0}));
  EXPECT_EQ(uneven.experts_of(1), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(uneven.rank_loads(hot), (std::vector<int64_t>{700, 700}));
  EXPECT_EQ(uneven.slot_of(7), 6);
  // A cap between: rank 1 fills its 5 slots, rank 0 takes what is left.
  EXPECT_EQ(ExpertPlacement::balanced(hot, 2, 1, 5).experts_of(1).size(), 5u);
  EXPECT_THROW(ExpertPlacement::balanced(hot, 2, 1, 3), Error);  // 2 x 3 < 8
  // Groups: experts 0-3 (group 0) stay on ranks 0-1, experts 4-7 on ranks 2-3, each group
  // balanced over its ranks; without groups expert 2 of group 0 goes to rank 2.
  const std::vector<int64_t> grouped_load = {90, 80, 5, 5, 4, 3, 2, 1};
  const auto kept = ExpertPlacement::balanced(grouped_load, 4, 2);
  for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(kept.rank_of(e) / 2, e / 4) << "expert " << e;
  EXPECT_EQ(kept.rank_loads(grouped_load), (std::vector<int64_t>{95, 85, 5, 5}));
  const auto free = ExpertPlacement::balanced(grouped_load, 4);
  EXPECT_EQ(free.rank_of(2), 2);
  EXPECT_THROW(ExpertPlacement::balanced(grouped_load, 4, 3), Error);
}

TEST(RankSlicedSource, RanksReadDisjointSlicesOfTheOneStream) {
  constexpr int64_t S = 8, world = 3, batch = 2, batches = 2;
  test::LookBackTask whole(16, S, 5);
  std::vector<int32_t> in_all(batch * world * batches * S), tgt_all(in_all.size());
  whole.next_batch(batch * world * batches, in_all.data(), tgt_all.data());
  for (int rank = 0; rank < world; ++rank) {
    RankSlicedSource source(std::make_unique<test::LookBackTask>(16, S, 5), S, rank, world);
    for (int64_t k = 0; k < batches; ++k) {
      std::vector<int32_t> in(batch * S), tgt(batch * S);
      source.next_batch(batch, in.data(), tgt.data());
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t global = (k * batch + b) * world + rank;  // sequence index in the one stream
        for (int64_t s = 0; s < S; ++s) {
          EXPECT_EQ(in[b * S + s], in_all[global * S + s]) << rank << " " << k << " " << b;
          EXPECT_EQ(tgt[b * S + s], tgt_all[global * S + s]);
        }
      }
    }
  }
}


using LayerRig = test::MoELayerRig<double>;

// N ranks of B sequences each against one layer over the N * B sequences (rank r's
// sequence b is global sequence b * N + r): outputs, losses, drops, input gradients and
// the sum of the ranks' parameter gradients.
void expect_global_micro_batch(ScoreFunc score_func, double capacity_factor) {
  ModelConfig config;
  config.dim = 8;
  config.seq_len = 4;
  config.moe.n_experts = 4;
  config.moe.top_k = 2;
  config.moe.expert_hidden = 6;
  config.moe.n_shared_experts = 1;
  config.moe.score_func = score_func;
  config.moe.capacity_factor = capacity_factor;
  config.moe.aux_loss_coef = 0.1;
  config.moe.z_loss_coef = 0.01;
  constexpr int N = 3;
  constexpr int64_t B = 2, S = 4, D = 8;
  const int64_t T_local = B * S, T_global = N * T_local;
  const CounterRng rng(4, "inputs");
  std::vector<double> x(T_global * D), dy(T_global * D);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = rng.normal(i);
    dy[i] = rng.normal(i + x.size());
  }
  LayerRig one(config, T_global, nullptr);
  std::vector<double> y(x.size()), dx(x.size());
  const MoEForwardStats want = one.layer->forward(y.data(), x.data());
  one.layer->backward(dx.data(), dy.data(), x.data(), 1.0);
  // The global row of a rank's local token.
  auto global_row = [&](int r, int64_t t) { return ((t / S) * N + r) * S + t % S; };

  test::ThreadRanks batch(N);
  std::vector<std::unique_ptr<test::ThreadRanks::Batch>> members;
  std::vector<std::unique_ptr<LayerRig>> rigs;
  for (int r = 0; r < N; ++r) {
    members.push_back(std::make_unique<test::ThreadRanks::Batch>(batch, r));
    rigs.push_back(std::make_unique<LayerRig>(config, T_local, members.back().get()));
  }
  const auto passes = test::forward_backward_on_ranks(rigs, x, dy, T_local, D, global_row);

  int64_t dropped = 0;
  for (int r = 0; r < N; ++r) {
    const test::RankPass<double>& got = passes[r];
    EXPECT_NEAR(got.stats.aux_loss, want.aux_loss, 1e-12);
    EXPECT_NEAR(got.stats.z_loss, want.z_loss, 1e-12);
    dropped += got.stats.dropped;
    for (int64_t t = 0; t < T_local; ++t)
      for (int64_t d = 0; d < D; ++d) {
        EXPECT_NEAR(got.y[t * D + d], y[global_row(r, t) * D + d], 1e-12);
        EXPECT_NEAR(got.dx[t * D + d], dx[global_row(r, t) * D + d], 1e-12);
      }
  }
  EXPECT_EQ(dropped, want.dropped);
  if (capacity_factor > 0) EXPECT_GT(want.dropped, 0) << "the case needs capacity to drop";
  for (int id = 0; id < one.params.size(); ++id)
    for (int64_t i = 0; i < one.params.numel(id); ++i) {
      double sum = 0;
      for (int r = 0; r < N; ++r) sum += rigs[r]->params.grad(id)[i];
      EXPECT_NEAR(sum, one.params.grad(id)[i], 1e-12) << one.params.spec(id).name << " " << i;
    }
}

TEST(MoEGlobalMicroBatch, RanksReproduceOneLayerDropless) { expect_global_micro_batch(ScoreFunc::Softmax, 0.0); }
TEST(MoEGlobalMicroBatch, RanksReproduceOneLayerWithCapacity) { expect_global_micro_batch(ScoreFunc::Sigmoid, 0.75); }

}  // namespace
}  // namespace moe
