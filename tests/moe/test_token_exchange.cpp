// The token exchange of GPU expert parallelism (moe/token_exchange.h) on the CPU: the
// blocks by hand, and a whole round trip over P simulated ranks (each token once per
// rank, rows laid out there with assign_rows' "elsewhere" entries, partial combines, sums
// at home) against the one-process combine and its backward.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"
#include "moe/dispatch.h"
#include "moe/token_exchange.h"

namespace moe {
namespace {

TEST(TokenExchange, BlocksByHand) {
  // 3 tokens, top-2, slots [0, 2) on rank 0 and [2, 4) on rank 1. Token 1's slot-3
  // assignment was dropped (row -1).
  const std::vector<int32_t> slot = {0, 2, 1, 3, 3, 2};
  const std::vector<int32_t> rank = {0, 1, 0, -1, 1, 1};
  const std::vector<int32_t> bounds = {0, 2, 4}, window_end = {2, 4}, cuts = {0, 2 * kSlotParts, 4 * kSlotParts};
  std::vector<int32_t> pos(6), tokens(2);
  token_blocks(pos.data(), tokens.data(), rank.data(), 3, 2, 2);
  // Rank 0: tokens 0 and 1; rank 1: tokens 0 and 2 (token 1's only slot there was dropped).
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 0, 1, -1, -1, 1}));
  EXPECT_EQ(tokens, (std::vector<int32_t>{2, 2}));
  std::vector<int32_t> routed(8);
  std::vector<float> weights(8);
  const std::vector<float> weight = {0.5f, 0.25f, 1, 2, 3, 4};
  pack_routing(routed.data(), weights.data(), pos.data(), tokens.data(), rank.data(), slot.data(), weight.data(),
               bounds.data(), 3, 2, 2);
  // Block rows: rank 0 (token 0, token 1), rank 1 (token 0, token 2); slots local to the rank.
  EXPECT_EQ(routed, (std::vector<int32_t>{0, -1, 1, -1, -1, 0, 1, 0}));
  EXPECT_EQ(weights, (std::vector<float>{0.5f, 0.25f, 1, 2, 0.5f, 0.25f, 3, 4}));
  std::vector<int32_t> counts_out(6);
  const std::vector<int32_t> counts_E = {7, 8, 9, 10};
  pack_counts(counts_out.data(), counts_E.data(), tokens.data(), bounds.data(), window_end.data(), cuts.data(), 2);
  EXPECT_EQ(counts_out, (std::vector<int32_t>{7, 8, 2, 9, 10, 2}));
  EXPECT_EQ(equal_slot_bounds(6, 3), (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_THROW(equal_slot_bounds(6, 4), Error);
  EXPECT_EQ(slot_window_ends({0, 2, 4, 6}, false), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(slot_window_ends({0, 2, 4, 6}, true), (std::vector<int64_t>{3, 5, 6}));
  EXPECT_EQ(slot_window_ends({0, 3, 3, 3}, true), (std::vector<int64_t>{3, 3, 3})) << "no slot past the last";
}

// Split experts: the boundary between two ranks moves inside the hinge slot (the first of
// the upper block) to where the global rows reach half; each home rank divides its rows
// of that slot in the same proportion, in row order.
TEST(TokenExchange, SplitCutsEvenTheRanksRows) {
  const int64_t E = 4;
  const int P = 2;
  const std::vector<int32_t> bounds = {0, 2, 4};
  // Global rows per slot {16, 0, 16, 4} = 36: half is 18 = slots 0-1 and 2 of slot 2's 16.
  const std::vector<int32_t> counts_PE = {10, 0, 8, 0, 6, 0, 8, 4};
  std::vector<int32_t> cuts(3);
  boundary_cuts(cuts.data(), counts_PE.data(), bounds.data(), /*split=*/true, E, P);
  EXPECT_EQ(cuts, (std::vector<int32_t>{0, 2 * kSlotParts + kSlotParts / 8, 4 * kSlotParts}));
  boundary_cuts(cuts.data(), counts_PE.data(), bounds.data(), /*split=*/false, E, P);
  EXPECT_EQ(cuts, (std::vector<int32_t>{0, 2 * kSlotParts, 4 * kSlotParts})) << "without split: the block edge";
  // Clamped to the hinge: all rows in slot 0 put the balance point in slot 0, the cut at
  // the hinge's start.
  const std::vector<int32_t> front = {20, 0, 1, 1, 20, 0, 1, 1};
  boundary_cuts(cuts.data(), front.data(), bounds.data(), true, E, P);
  EXPECT_EQ(cuts[1], 2 * kSlotParts);
  const std::vector<int32_t> back = {0, 0, 1, 20, 0, 0, 1, 20};
  boundary_cuts(cuts.data(), back.data(), bounds.data(), true, E, P);
  EXPECT_EQ(cuts[1], 3 * kSlotParts) << "the whole hinge to the lower rank";

  // Home rank 0's 8 rows of slot 2: 1 (8 / 8) to rank 0, 7 to rank 1, in row order.
  boundary_cuts(cuts.data(), counts_PE.data(), bounds.data(), true, E, P);
  const std::vector<int32_t> offsets = {0, 10, 10, 18, 18};
  std::vector<int32_t> slot, row;
  for (int32_t r = 0; r < 18; ++r) {
    slot.push_back(r < 10 ? 0 : 2);
    row.push_back(r);
  }
  std::vector<int32_t> rank(slot.size());
  route_ranks(rank.data(), row.data(), slot.data(), offsets.data(), cuts.data(), 9, 2, P);
  std::vector<int32_t> want(10, 0);
  want.push_back(0);
  want.insert(want.end(), 7, 1);
  EXPECT_EQ(rank, want);
  const std::vector<int32_t> window_end = {3, 4}, tokens = {5, 4}, home_counts = {10, 0, 8, 0};
  std::vector<int32_t> packed(3 + 1 + 2 + 1);
  pack_counts(packed.data(), home_counts.data(), tokens.data(), bounds.data(), window_end.data(), cuts.data(), P);
  EXPECT_EQ(packed, (std::vector<int32_t>{10, 0, 1, 5, 7, 0, 4}));
  // Shares add up at every cut, whatever the count.
  for (int64_t n : {0, 1, 3, 8, 1000})
    for (int64_t part : {-5, 0, 1, 8192, 32768, 65535, 65536, 70000})
      EXPECT_LE(rows_before(n, part), n);
}

// P ranks, unequal slot counts (one rank with none), a capacity that drops: the round trip
// gives the one-process combine, its output gradient's row gradients and weight gradients.
// With split experts, the hinge slots' rows divided between two ranks.
class TokenExchangeRoundTrip : public ::testing::TestWithParam<bool> {};

TEST_P(TokenExchangeRoundTrip, MatchesTheOneProcessCombine) {
  const bool split = GetParam();
  const int64_t T = 37, K = 3, E = 7, D = 5;
  const int P = 3;
  // Without split: rank 0 slot 0, rank 1 none, rank 2 the rest. Split: rank 0 slots 0-2
  // (2 shared with rank 1), rank 1 slots 2-4, rank 2 slots 4-6.
  const std::vector<int32_t> bounds = split ? std::vector<int32_t>{0, 2, 4, 7} : std::vector<int32_t>{0, 1, 1, 7};
  std::vector<int32_t> window_end;
  for (int64_t end : slot_window_ends(std::vector<int64_t>(bounds.begin(), bounds.end()), split))
    window_end.push_back(static_cast<int32_t>(end));
  std::mt19937 rng(5);
  std::vector<int32_t> slot(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) slot[t * K + k] = static_cast<int32_t>((t * 5 + k * 3 + rng() % 2) % E);
  std::vector<float> weight(T * K), x(T * D), dout(T * D);
  std::uniform_real_distribution<float> uniform(-1, 1);
  for (auto& v : weight) v = uniform(rng);
  for (auto& v : x) v = uniform(rng);
  for (auto& v : dout) v = uniform(rng);
  // Home: the capacity drops some assignments.
  const int64_t capacity = 12;
  std::vector<int32_t> row(T * K), counts(E), offsets(E + 1), token_of_row(T * K);
  const int64_t kept = assign_rows(row.data(), counts.data(), offsets.data(), token_of_row.data(), slot.data(), T, E,
                                   K, capacity);
  ASSERT_LT(kept, T * K) << "the case should drop";
  // "Expert" e scales its input rows by (e + 1): y_row = (e + 1) * x[token].
  std::vector<float> rows_y(kept * D);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int64_t d = 0; d < D; ++d) rows_y[r * D + d] = static_cast<float>(e + 1) * x[token_of_row[r] * D + d];
  std::vector<float> want_out(T * D), want_drows(kept * D), want_dweight(T * K);
  combine_forward(want_out.data(), rows_y.data(), weight.data(), row.data(), T, K, D);
  combine_backward(want_drows.data(), want_dweight.data(), dout.data(), rows_y.data(), weight.data(), row.data(), T, K,
                   D);

  // One home rank here: its counts are the global ones.
  std::vector<int32_t> counts_PE(static_cast<size_t>(P * E), 0), cuts(P + 1), rank(T * K);
  std::copy(counts.begin(), counts.end(), counts_PE.begin());
  boundary_cuts(cuts.data(), counts_PE.data(), bounds.data(), split, E, P);
  route_ranks(rank.data(), row.data(), slot.data(), offsets.data(), cuts.data(), T, K, P);
  std::vector<int32_t> pos(T * P), tokens(P);
  token_blocks(pos.data(), tokens.data(), rank.data(), T, K, P);
  if (!split) EXPECT_EQ(tokens[1], 0) << "a rank without slots receives nothing";
  std::vector<int32_t> packed;
  for (int p = 0; p < P; ++p) packed.resize(packed.size() + static_cast<size_t>(window_end[p] - bounds[p] + 1));
  pack_counts(packed.data(), counts.data(), tokens.data(), bounds.data(), window_end.data(), cuts.data(), P);
  std::vector<int64_t> rows_of_rank(P, 0);
  const int64_t U = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
  std::vector<float> sent_x(U * D), sent_weight(U * K), sent_dout(U * D);
  std::vector<int32_t> sent_slot(U * K);
  scatter_token_rows(sent_x.data(), x.data(), pos.data(), tokens.data(), T, P, D);
  scatter_token_rows(sent_dout.data(), dout.data(), pos.data(), tokens.data(), T, P, D);
  pack_routing(sent_slot.data(), sent_weight.data(), pos.data(), tokens.data(), rank.data(), slot.data(), weight.data(),
               bounds.data(), T, K, P);
  // Each rank: its block, rows laid out by local slot, the experts, the partial combine
  // and its backward, the row gradients summed per token (permute_backward).
  std::vector<float> partial(U * D), partial_dweight(U * K), partial_dx(U * D);
  int64_t at = 0, packed_at = 0;
  for (int p = 0; p < P; ++p) {
    const int64_t n = tokens[p], L = window_end[p] - bounds[p];
    packed_at += L + 1;
    if (n == 0) continue;
    ASSERT_GT(L, 0);
    std::vector<int32_t> local_row(n * K), local_counts(L), local_offsets(L + 1), local_token(n * K);
    const int64_t R = assign_rows(local_row.data(), local_counts.data(), local_offsets.data(), local_token.data(),
                                  sent_slot.data() + at * K, n, L, K, n * K);
    // The counts told in advance are the rows laid out here.
    for (int64_t l = 0; l < L; ++l) EXPECT_EQ(local_counts[l], packed[packed_at - L - 1 + l]) << "rank " << p;
    EXPECT_EQ(packed[packed_at - 1], n);
    rows_of_rank[p] = R;
    std::vector<float> y(R * D), drows(R * D);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t r = local_offsets[l]; r < local_offsets[l + 1]; ++r)
        for (int64_t d = 0; d < D; ++d)
          y[r * D + d] = static_cast<float>(bounds[p] + l + 1) * sent_x[(at + local_token[r]) * D + d];
    combine_forward(partial.data() + at * D, y.data(), sent_weight.data() + at * K, local_row.data(), n, K, D);
    combine_backward(drows.data(), partial_dweight.data() + at * K, sent_dout.data() + at * D, y.data(),
                     sent_weight.data() + at * K, local_row.data(), n, K, D);
    // "dx" of a row: its output gradient (the test's experts are diagonal enough).
    permute_backward(partial_dx.data() + at * D, drows.data(), local_row.data(), n, K, D, false);
    at += n;
  }
  std::vector<float> out(T * D), dweight(T * K), dx(T * D), want_dx(T * D);
  sum_token_rows(out.data(), partial.data(), pos.data(), tokens.data(), T, P, D);
  sum_token_rows(dweight.data(), partial_dweight.data(), pos.data(), tokens.data(), T, P, K);
  sum_token_rows(dx.data(), partial_dx.data(), pos.data(), tokens.data(), T, P, D);
  permute_backward(want_dx.data(), want_drows.data(), row.data(), T, K, D, false);
  for (int64_t i = 0; i < T * D; ++i) {
    ASSERT_NEAR(out[i], want_out[i], 1e-5) << "output " << i;
    ASSERT_NEAR(dx[i], want_dx[i], 1e-5) << "row gradients of token " << i / D;
  }
  for (int64_t i = 0; i < T * K; ++i) ASSERT_EQ(dweight[i], want_dweight[i]) << "weight gradient " << i;
  if (split) {
    // Both hinges divided here: some of their rows on each side.
    for (int boundary : {1, 2}) {
      const int32_t hinge = bounds[boundary];
      int64_t lower = 0, upper = 0;
      for (int64_t i = 0; i < T * K; ++i)
        if (slot[i] == hinge && rank[i] >= 0) (rank[i] < boundary ? lower : upper) += 1;
      EXPECT_GT(lower, 0) << "hinge " << hinge;
      EXPECT_GT(upper, 0) << "hinge " << hinge;
    }
    // The hinges even the ranks' rows to within a row per boundary.
    const int64_t kept_rows = std::accumulate(rows_of_rank.begin(), rows_of_rank.end(), int64_t{0});
    for (int p = 0; p < P; ++p) EXPECT_NEAR(rows_of_rank[p], kept_rows / 3.0, 2.0) << "rank " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Split, TokenExchangeRoundTrip, ::testing::Bool());

}  // namespace
}  // namespace moe
