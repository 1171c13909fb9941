// GpuParameterStore's ZeRO layout as host code (model/gpu_state_layout.h): the packed
// optimizer state's offsets and which ranges keep memory of their own when a block is
// shared by stages.
#include "model/gpu_state_layout.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "kernels/adamw_math.h"
#include "model/transformer.h"

namespace moe {
namespace {

// The fp32 copies' one owner: every MoE layer's router bias (none in a dense first layer),
// in order; none without router biases.
TEST(GpuStateLayout, Fp32CopiesAreTheMoeLayersRouterBiases) {
  ModelConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.n_layers = 3;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.seq_len = 8;
  c.first_dense_layers = 1;
  c.dense_hidden = 64;
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 32;
  c.moe.router_bias = true;
  const ParameterStore<float> specs = Transformer<float>::parameter_specs(c);
  std::vector<int> expected;
  for (int id = 0; id < specs.size(); ++id)
    if (specs.spec(id).name.find("router.bias") != std::string::npos) expected.push_back(id);
  ASSERT_EQ(expected.size(), 2u) << "layers 1 and 2 are MoE";
  EXPECT_EQ(fp32_copy_ids(specs), expected);
  for (const int id : expected) EXPECT_EQ(specs.numel(id), 4);
  c.moe.router_bias = false;
  EXPECT_TRUE(fp32_copy_ids(Transformer<float>::parameter_specs(c)).empty());
}

TEST(GpuStateLayout, PackedRangesKeepTheirOffsetModuloSixteen) {
  // [16, +10) at 0; [40, +30) at the next multiple of 16 (16) plus 40 % 16 = 8: 24;
  // [100, +3) at 64 + 4 = 68 (after 54, 64 is the next multiple); 71 rounds to 80.
  const PackedState packed = packed_state_layout({{16, 10}, {40, 30}, {100, 3}});
  EXPECT_EQ(packed.at, (std::vector<int64_t>{0, 24, 68}));
  EXPECT_EQ(packed.total, 80);
  EXPECT_EQ(packed_state_layout({}).total, 0);
}

TEST(GpuStateLayout, SharingByStagesKeepsTheEndsAndTheEdges) {
  // Stage 3 (the embedding) [0, 100), stage 2 [100, 200), stage 1 [200, 260) and
  // [300, 340), stage 0 (the head) [260, 300).
  const std::vector<RangeList> stages = {{{260, 40}}, {{200, 60}, {300, 40}}, {{100, 100}}, {{0, 100}}};
  const StageSharing sharing = share_by_stages({{150, 10}}, stages);
  // Own: the kept [150, 160), stages 0 and 3 whole, the first and last element of each
  // middle range (100, 199; 200, 259; 300, 339), merged.
  EXPECT_EQ(sharing.own, (RangeList{{0, 101}, {150, 10}, {199, 2}, {259, 42}, {339, 1}}));
  ASSERT_EQ(sharing.groups.size(), 2u);
  EXPECT_EQ(sharing.groups[0], (RangeList{{201, 58}, {301, 38}}));  // stage 1, pool 1
  EXPECT_EQ(sharing.groups[1], (RangeList{{101, 49}, {160, 39}}));  // stage 2, pool 0
  EXPECT_EQ(sharing.pools, (std::vector<int>{1, 0}));
  EXPECT_THROW(share_by_stages({}, {{{0, 1}}, {{1, 1}}}), Error);  // two stages: nothing in between
  EXPECT_EQ(byte_ranges({{3, 2}}, 4), (RangeList{{12, 8}}));
}

// Interleaved gate|up (training.interleave_gate_up): every element of w1 | w3 lands on its
// own hi slot, w1_e then w3_e, and the runs cover a range in order, each back to back in
// both orders and inside one expert slice.
TEST(GpuStateLayout, InterleavedGateUpIsAPermutationCutIntoExpertRuns) {
  const HiInterleave pair{100, 3, 4};  // w1 [3 experts x 4] at 100, w3 at 112, up to 124
  std::vector<int64_t> seen;
  for (int64_t i = pair.first; i < pair.end(); ++i) seen.push_back(pair.hi_offset(i));
  // w1_0 (100..103) -> 100..103, w3_0 (112..115) -> 104..107, w1_1 -> 108..111, ...
  EXPECT_EQ(seen, (std::vector<int64_t>{100, 101, 102, 103, 108, 109, 110, 111, 116, 117, 118, 119,
                                        104, 105, 106, 107, 112, 113, 114, 115, 120, 121, 122, 123}));
  EXPECT_THROW(pair.hi_offset(124), Error);
  const HiInterleave later{200, 2, 8};
  for (const Range r : {Range{0, 300}, Range{98, 9}, Range{101, 14}, Range{120, 90}, Range{50, 10}, Range{210, 1}}) {
    const std::vector<HiRun> runs = hi_runs({pair, later}, r);
    int64_t at = r.offset;
    for (const HiRun& run : runs) {
      ASSERT_EQ(run.offset, at);
      ASSERT_GT(run.count, 0);
      for (int64_t k = 0; k < run.count; ++k) {
        const int64_t i = run.offset + k;
        const int64_t want = i >= pair.first && i < pair.end()     ? pair.hi_offset(i)
                             : i >= later.first && i < later.end() ? later.hi_offset(i)
                                                                   : i;
        ASSERT_EQ(run.hi + k, want) << "element " << i;
      }
      at += run.count;
    }
    EXPECT_EQ(at, r.end());
  }
  EXPECT_EQ(hi_runs({pair}, {10, 20}).size(), 1u);    // outside: one run in place
  EXPECT_EQ(hi_runs({pair}, {98, 9}).size(), 3u);     // 98..99 in place, w1_0 100..103, w1_1 104..106
  EXPECT_EQ(hi_runs({pair}, {0, 300}).size(), 8u);    // before, 6 slices, after
  // hi_ranges: the same elements' hi halves, merged (w1_1 and w3_0 of `pair` are adjacent
  // in hi: 104..111), and every element of a range once.
  EXPECT_EQ(hi_ranges({pair}, {{104, 4}, {112, 4}}), (RangeList{{104, 8}}));
  EXPECT_EQ(hi_ranges({pair}, {{90, 20}}), (RangeList{{90, 14}, {108, 4}, {116, 2}}));
  EXPECT_EQ(hi_ranges({pair, later}, {{0, 300}}), (RangeList{{0, 300}}));
  EXPECT_EQ(hi_ranges({}, {{5, 3}, {1, 2}}), (RangeList{{1, 2}, {5, 3}}));
}

// gate_up_pairs: each MoE layer's w1 | w3 a pair when w3 follows w1 with as many elements
// and an expert's slice is a multiple of a norm chunk; otherwise none at all (the store
// keeps one layout for every layer).
TEST(GpuStateLayout, GateUpPairsOnlyWhereEveryLayerAllowsThem) {
  const int64_t slice = adamw_math::kNormChunk * 2;  // an expert's F x D
  const Range w1a{0, 4 * slice}, w3a{4 * slice, 4 * slice}, w1b{12 * slice, 4 * slice}, w3b{16 * slice, 4 * slice};
  const std::vector<HiInterleave> pairs = gate_up_pairs({{w1a, w3a}, {w1b, w3b}}, 4);
  ASSERT_EQ(pairs.size(), 2u);
  EXPECT_EQ(pairs[1].first, w1b.offset);
  EXPECT_EQ(pairs[1].experts, 4);
  EXPECT_EQ(pairs[1].per_expert, slice);
  EXPECT_EQ(pairs[0].end(), w3a.end());
  EXPECT_TRUE(gate_up_pairs({{w1a, w3a}, {w1b, {w3b.offset + 16, w3b.count}}}, 4).empty()) << "w3 not after w1";
  EXPECT_TRUE(gate_up_pairs({{w1a, w3a}}, 3).empty()) << "the experts do not divide w1";
  const Range odd{0, 4 * (slice + 16)};
  EXPECT_TRUE(gate_up_pairs({{odd, {odd.end(), odd.count}}}, 4).empty()) << "a slice off the norm's chunks";
  EXPECT_TRUE(gate_up_pairs({{w1a, w3a}}, 0).empty());
}

}  // namespace
}  // namespace moe
