#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "kernels/rope.h"

namespace moe {
namespace {

using test::random_vector;

TEST(Rope, HandComputedRotateHalfLayout) {
  // d = 4: pairs (0, 2) at frequency 1 and (1, 3) at frequency theta^(-1/2) = 0.1.
  const double theta = 100.0;
  std::vector<double> x = {1, 2, 3, 4};
  const std::vector<int32_t> pos = {2};
  rope_forward(x.data(), pos.data(), 1, 1, 4, theta);
  const double a0 = 2.0, a1 = 0.2;
  EXPECT_NEAR(x[0], 1 * std::cos(a0) - 3 * std::sin(a0), 1e-14);
  EXPECT_NEAR(x[2], 3 * std::cos(a0) + 1 * std::sin(a0), 1e-14);
  EXPECT_NEAR(x[1], 2 * std::cos(a1) - 4 * std::sin(a1), 1e-14);
  EXPECT_NEAR(x[3], 4 * std::cos(a1) + 2 * std::sin(a1), 1e-14);
}

TEST(Rope, PositionZeroIsIdentity) {
  const int64_t T_ = 3, N = 2, d = 8;
  const std::vector<double> x0 = random_vector(T_ * N * d, 1, "x");
  std::vector<double> x = x0;
  const std::vector<int32_t> pos = {0, 0, 0};
  rope_forward(x.data(), pos.data(), T_, N, d, 10000.0);
  EXPECT_EQ(x, x0);
}

TEST(Rope, BackwardUndoesForwardAndNormIsKept) {
  const int64_t T_ = 4, N = 3, d = 10;
  const std::vector<double> x0 = random_vector(T_ * N * d, 2, "x");
  const std::vector<int32_t> pos = {5, 1, 4000, 17};
  std::vector<double> x = x0;
  rope_forward(x.data(), pos.data(), T_, N, d, 10000.0);
  double max_moved = 0;
  for (int64_t h = 0; h < T_ * N; ++h) {
    double n0 = 0, n1 = 0;
    for (int64_t i = 0; i < d; ++i) {
      n0 += x0[h * d + i] * x0[h * d + i];
      n1 += x[h * d + i] * x[h * d + i];
      max_moved = std::max(max_moved, std::abs(x[h * d + i] - x0[h * d + i]));
    }
    EXPECT_NEAR(n1, n0, 1e-12 * n0) << "head " << h;
  }
  EXPECT_GT(max_moved, 0.1);  // it did rotate
  rope_backward(x.data(), pos.data(), T_, N, d, 10000.0);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], x0[i], 1e-13) << i;
}

TEST(Rope, GradientMatchesFiniteDifferences) {
  const int64_t T_ = 5, N = 3, d = 6;
  const std::vector<int32_t> pos = {0, 3, 1, 7, 100};
  std::vector<double> x = random_vector(T_ * N * d, 3, "x");
  const std::vector<double> probe = random_vector(T_ * N * d, 3, "probe");
  std::vector<double> dx = probe;
  rope_backward(dx.data(), pos.data(), T_, N, d, 500.0);
  std::vector<double> y;
  auto loss = [&] {
    y = x;
    rope_forward(y.data(), pos.data(), T_, N, d, 500.0);
    return test::dot(y, probe);
  };
  test::expect_gradient_close("dx", x, dx, loss);
}

TEST(Rope, FloatMatchesDouble) {
  const int64_t T_ = 6, N = 2, d = 16;
  const std::vector<int32_t> pos = {0, 1, 2, 100, 1000, 4095};
  std::vector<double> x = random_vector(T_ * N * d, 4, "x");
  std::vector<float> xf(x.begin(), x.end());
  rope_forward(x.data(), pos.data(), T_, N, d, 10000.0);
  rope_forward(xf.data(), pos.data(), T_, N, d, 10000.0);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(xf[i], x[i], 1e-5 * std::max(1.0, std::abs(x[i]))) << i;
}

TEST(Rope, RejectsOddHeadDimAndNegativePosition) {
  std::vector<double> x(10);
  const std::vector<int32_t> pos = {1, 2};
  EXPECT_THROW(rope_forward(x.data(), pos.data(), 2, 1, 5, 10000.0), Error);
  const std::vector<int32_t> neg = {1, -3};
  EXPECT_THROW(rope_backward(x.data(), neg.data(), 2, 1, 4, 10000.0), Error);
}

}  // namespace
}  // namespace moe
