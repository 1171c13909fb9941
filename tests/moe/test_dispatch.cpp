// Dispatch ops: expert capacity, row assignment (dropping by position), permute, combine.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "moe/dispatch.h"

namespace moe {
namespace {

using test::dot;
using test::expect_gradient_close;
using test::random_vector;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Layout {
  std::vector<int32_t> row_TK, counts_E, offsets_E1, token_of_row_R;
  int64_t R = 0;
};

Layout layout_of(const std::vector<int32_t>& expert_TK, int64_t T_, int64_t E, int64_t K,
                 int64_t capacity) {
  Layout l;
  l.row_TK.assign(T_ * K, 12345);
  l.counts_E.assign(E, 12345);
  l.offsets_E1.assign(E + 1, 12345);
  l.token_of_row_R.assign(T_ * K, -7);
  l.R = assign_rows(l.row_TK.data(), l.counts_E.data(), l.offsets_E1.data(),
                    l.token_of_row_R.data(), expert_TK.data(), T_, E, K, capacity);
  l.token_of_row_R.resize(l.R);
  return l;
}

// ---------------------------------------------------------------------------------------
// Capacity

TEST(Capacity, ExpertCapacityValues) {
  EXPECT_EQ(expert_capacity(1.25, 10, 2, 4), 7);   // ceil(6.25)
  EXPECT_EQ(expert_capacity(1.0, 8, 2, 4), 4);     // exact
  EXPECT_EQ(expert_capacity(1.1, 100, 1, 11), 10); // 1.1 * 100 / 11 is 10.000000000000002
  EXPECT_EQ(expert_capacity(0.01, 10, 1, 4), 1);   // never 0 for a positive factor
  EXPECT_EQ(expert_capacity(0.0, 10, 2, 4), 20);   // no limit
  EXPECT_EQ(expert_capacity(100.0, 10, 2, 4), 20); // no more than T*K
  EXPECT_EQ(expert_capacity(1.0, 0, 2, 4), 0);
  EXPECT_THROW(expert_capacity(-1.0, 10, 2, 4), Error);
  EXPECT_THROW(expert_capacity(std::nan(""), 10, 2, 4), Error);
}

// T = 5, E = 3, K = 2, hand-built routing.
const std::vector<int32_t> kRouting = {0, 1,   // t0
                                       0, 2,   // t1
                                       1, 0,   // t2
                                       0, 1,   // t3
                                       2, 0};  // t4

TEST(Capacity, DropsByPositionAndGroupsByExpert) {
  const Layout l = layout_of(kRouting, 5, 3, 2, /*capacity=*/2);
  // Expert 0 is asked by (t0,k0) (t1,k0) (t2,k1) (t3,k0) (t4,k1): the first two stay.
  // Expert 1 by (t0,k1) (t2,k0) (t3,k1): the first two stay. Expert 2 by (t1,k1) (t4,k0).
  EXPECT_EQ(l.R, 6);
  EXPECT_EQ(l.counts_E, (std::vector<int32_t>{2, 2, 2}));
  EXPECT_EQ(l.offsets_E1, (std::vector<int32_t>{0, 2, 4, 6}));
  // Rows: e0 {(t0,k0), (t1,k0)}, e1 {(t0,k1), (t2,k0)}, e2 {(t1,k1), (t4,k0)}.
  EXPECT_EQ(l.row_TK, (std::vector<int32_t>{0, 2,  1, 4,  3, -1,  -1, -1,  5, -1}));
  EXPECT_EQ(l.token_of_row_R, (std::vector<int32_t>{0, 1, 0, 2, 1, 4}));
}

TEST(Capacity, CapacityOneAndZero) {
  Layout l = layout_of(kRouting, 5, 3, 2, 1);
  EXPECT_EQ(l.R, 3);
  EXPECT_EQ(l.row_TK, (std::vector<int32_t>{0, 1,  -1, 2,  -1, -1,  -1, -1,  -1, -1}));
  EXPECT_EQ(l.token_of_row_R, (std::vector<int32_t>{0, 0, 1}));
  l = layout_of(kRouting, 5, 3, 2, 0);
  EXPECT_EQ(l.R, 0);
  EXPECT_EQ(l.offsets_E1, (std::vector<int32_t>{0, 0, 0, 0}));
  for (int32_t r : l.row_TK) EXPECT_EQ(r, -1);
}

TEST(Capacity, ZeroFactorDropsNothing) {
  const Layout l = layout_of(kRouting, 5, 3, 2, expert_capacity(0.0, 5, 2, 3));
  EXPECT_EQ(l.R, 10);
  EXPECT_EQ(l.counts_E, (std::vector<int32_t>{5, 3, 2}));
  EXPECT_EQ(l.offsets_E1, (std::vector<int32_t>{0, 5, 8, 10}));
  // Expert 0's rows in token order, then expert 1's, then expert 2's.
  EXPECT_EQ(l.token_of_row_R, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 2, 3, 1, 4}));
  EXPECT_EQ(l.row_TK, (std::vector<int32_t>{0, 5,  1, 8,  6, 2,  3, 7,  9, 4}));
}

TEST(Capacity, ExpertWithoutTokensAndBadIndices) {
  const std::vector<int32_t> routing = {2, 0, 0, 2};  // T = 2, K = 2, E = 4: experts 1, 3 idle
  const Layout l = layout_of(routing, 2, 4, 2, 8);
  EXPECT_EQ(l.counts_E, (std::vector<int32_t>{2, 0, 2, 0}));
  EXPECT_EQ(l.offsets_E1, (std::vector<int32_t>{0, 2, 2, 4, 4}));
  EXPECT_EQ(l.row_TK, (std::vector<int32_t>{2, 0, 1, 3}));
  EXPECT_THROW(layout_of({0, 4}, 1, 4, 2, 8), Error);
  EXPECT_THROW(layout_of({-2, 0}, 1, 4, 2, 8), Error);
  // -1: routed to another rank (expert parallelism's receiving side): no row, not counted.
  const Layout elsewhere = layout_of({-1, 2, 2, -1}, 2, 4, 2, 8);
  EXPECT_EQ(elsewhere.row_TK, (std::vector<int32_t>{-1, 0, 1, -1}));
  EXPECT_EQ(elsewhere.counts_E, (std::vector<int32_t>{0, 0, 2, 0}));
  EXPECT_THROW(layout_of({0, 1}, 1, 4, 2, -1), Error);
}

// ---------------------------------------------------------------------------------------
// Permute

TEST(Permute, ForwardCopiesRowsAndBackwardIsItsAdjoint) {
  const int64_t T_ = 5, K = 2, D = 3;
  const Layout l = layout_of(kRouting, T_, 3, K, 2);
  const auto x = random_vector(T_ * D, 71, "x");
  std::vector<double> x_RD(l.R * D, kNaN);
  permute_forward(x_RD.data(), x.data(), l.token_of_row_R.data(), l.R, D);
  for (int64_t r = 0; r < l.R; ++r)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(x_RD[r * D + d], x[l.token_of_row_R[r] * D + d]);

  // <permute(x), g> = <x, permute_backward(g)>, and token 3 (all dropped) gets exactly 0.
  const auto g = random_vector(l.R * D, 72, "g");
  std::vector<double> dx(T_ * D, kNaN);
  permute_backward(dx.data(), g.data(), l.row_TK.data(), T_, K, D, false);
  EXPECT_NEAR(dot(x_RD, g), dot(x, dx), 1e-14);
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dx[3 * D + d], 0.0);
  // Token 0 kept both slots: rows 0 and 2 summed.
  EXPECT_EQ(dx[0], g[0 * D] + g[2 * D]);

  // Accumulating adds onto what is there.
  std::vector<double> acc(T_ * D, 1.5);
  permute_backward(acc.data(), g.data(), l.row_TK.data(), T_, K, D, true);
  for (int64_t i = 0; i < T_ * D; ++i) EXPECT_NEAR(acc[i], 1.5 + dx[i], 1e-15);
}

// ---------------------------------------------------------------------------------------
// Combine

TEST(Combine, ForwardOverwritesAndSkipsDroppedSlots) {
  const int64_t T_ = 5, K = 2, D = 2;
  const Layout l = layout_of(kRouting, T_, 3, K, 2);
  const std::vector<double> y = {1, 2,  3, 4,  5, 6,  7, 8,  9, 10,  11, 12};
  const std::vector<double> w = {0.5, 0.25,  1, 2,  3, 100,  100, 100,  -1, 100};
  std::vector<double> out(T_ * D, kNaN);
  combine_forward(out.data(), y.data(), w.data(), l.row_TK.data(), T_, K, D);
  // t0: 0.5*row0 + 0.25*row2; t1: 1*row1 + 2*row4; t2: 3*row3; t3: nothing; t4: -1*row5.
  EXPECT_EQ(out, (std::vector<double>{0.5 + 1.25, 1 + 1.5,  3 + 18, 4 + 20,  21, 24,  0, 0,
                                      -11, -12}));
}

TEST(Combine, BackwardMatchesFiniteDifferences) {
  const int64_t T_ = 5, K = 2, D = 4;
  const Layout l = layout_of(kRouting, T_, 3, K, 2);
  auto y = random_vector(l.R * D, 81, "y");
  auto w = random_vector(T_ * K, 82, "w");
  const auto probe = random_vector(T_ * D, 83, "probe");
  std::vector<double> out(T_ * D);
  auto loss = [&] {
    combine_forward(out.data(), y.data(), w.data(), l.row_TK.data(), T_, K, D);
    return dot(out, probe);
  };
  std::vector<double> dy(l.R * D, kNaN), dw(T_ * K, kNaN);
  combine_backward(dy.data(), dw.data(), probe.data(), y.data(), w.data(), l.row_TK.data(), T_,
                   K, D);
  for (int64_t i = 0; i < T_ * K; ++i)
    if (l.row_TK[i] < 0) {
      EXPECT_EQ(dw[i], 0.0) << "dropped slot " << i;
    }
  expect_gradient_close("dy", y, dy, loss);
  expect_gradient_close("dweight", w, dw, loss);
}

}  // namespace
}  // namespace moe
