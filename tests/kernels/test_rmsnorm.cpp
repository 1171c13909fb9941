#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/threads.h"
#include "gradcheck.h"
#include "kernels/rmsnorm.h"

namespace moe {
namespace {

using test::random_vector;

TEST(Rmsnorm, ForwardHandComputed) {
  const std::vector<double> x = {3, 4, 0, -2}, w = {1, 2};
  std::vector<double> y(4), rstd(2);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), 2, 2, 1.0);
  const double r0 = 1 / std::sqrt(12.5 + 1.0), r1 = 1 / std::sqrt(2.0 + 1.0);
  EXPECT_NEAR(rstd[0], r0, 1e-15);
  EXPECT_NEAR(rstd[1], r1, 1e-15);
  EXPECT_NEAR(y[0], 3 * r0, 1e-15);
  EXPECT_NEAR(y[1], 8 * r0, 1e-15);
  EXPECT_NEAR(y[2], 0.0, 1e-15);
  EXPECT_NEAR(y[3], -4 * r1, 1e-15);
}

TEST(Rmsnorm, GradientMatchesFiniteDifferences) {
  const int64_t T_ = 5, D = 7;
  const double eps = 1e-5;
  std::vector<double> x = random_vector(T_ * D, 1, "x");
  std::vector<double> w = random_vector(D, 1, "w");
  for (double& v : w) v += 1.0;
  const std::vector<double> probe = random_vector(T_ * D, 1, "probe");
  std::vector<double> y(T_ * D), rstd(T_), dx(T_ * D), dw(D, 0.0);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), T_, D, eps);
  rmsnorm_backward(dx.data(), dw.data(), probe.data(), x.data(), w.data(), rstd.data(), T_, D,
                   false);
  auto loss = [&] {
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), T_, D, eps);
    return test::dot(y, probe);
  };
  test::expect_gradient_close("dx", x, dx, loss);
  test::expect_gradient_close("dw", w, dw, loss);
}

TEST(Rmsnorm, AccumulateFlags) {
  const int64_t T_ = 3, D = 4;
  const std::vector<double> x = random_vector(T_ * D, 2, "x"), w = random_vector(D, 2, "w");
  const std::vector<double> dy = random_vector(T_ * D, 2, "dy");
  std::vector<double> y(T_ * D), rstd(T_);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), T_, D, 1e-6);
  std::vector<double> dx_ref(T_ * D), dw_ref(D, 0.0);
  rmsnorm_backward(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), rstd.data(), T_, D,
                   false);

  // Overwrite: whatever dx held (even NaN) is replaced.
  std::vector<double> dx(T_ * D, std::numeric_limits<double>::quiet_NaN()), dw(D, 0.0);
  rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), T_, D, false);
  EXPECT_EQ(dx, dx_ref);

  // Accumulate: dx += grad when asked; dw always accumulates.
  const std::vector<double> dx0 = random_vector(T_ * D, 2, "dx0"), dw0 = random_vector(D, 2, "dw0");
  dx = dx0;
  dw = dw0;
  rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), T_, D, true);
  for (int64_t i = 0; i < T_ * D; ++i) EXPECT_DOUBLE_EQ(dx[i], dx0[i] + dx_ref[i]);
  for (int64_t i = 0; i < D; ++i) EXPECT_DOUBLE_EQ(dw[i], dw0[i] + dw_ref[i]);
}

TEST(Rmsnorm, FloatMatchesDouble) {
  const int64_t T_ = 6, D = 45;
  const std::vector<double> x = random_vector(T_ * D, 3, "x"), w = random_vector(D, 3, "w");
  const std::vector<double> dy = random_vector(T_ * D, 3, "dy");
  std::vector<double> y(T_ * D), rstd(T_), dx(T_ * D), dw(D, 0.0);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), T_, D, 1e-5);
  rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), T_, D, false);

  const std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end()),
      dyf(dy.begin(), dy.end());
  std::vector<float> yf(T_ * D), rstdf(T_), dxf(T_ * D), dwf(D, 0.0f);
  rmsnorm_forward(yf.data(), rstdf.data(), xf.data(), wf.data(), T_, D, 1e-5);
  rmsnorm_backward(dxf.data(), dwf.data(), dyf.data(), xf.data(), wf.data(), rstdf.data(), T_, D,
                   false);
  auto near = [](double a) { return 1e-5 * std::max(1.0, std::abs(a)); };
  for (int64_t i = 0; i < T_ * D; ++i) {
    EXPECT_NEAR(yf[i], y[i], near(y[i])) << i;
    EXPECT_NEAR(dxf[i], dx[i], near(dx[i])) << i;
  }
  for (int64_t i = 0; i < D; ++i) EXPECT_NEAR(dwf[i], dw[i], near(dw[i])) << i;
}

TEST(Rmsnorm, BackwardIndependentOfThreadCount) {
  const int64_t T_ = 1000, D = 96;  // several column blocks and many tokens per thread
  const std::vector<double> xd = random_vector(T_ * D, 4, "x"), wd = random_vector(D, 4, "w");
  const std::vector<double> dyd = random_vector(T_ * D, 4, "dy");
  const std::vector<float> x(xd.begin(), xd.end()), w(wd.begin(), wd.end()),
      dy(dyd.begin(), dyd.end());
  std::vector<float> y(T_ * D), rstd(T_);
  auto run = [&](int threads, std::vector<float>& dx, std::vector<float>& dw) {
    set_num_threads(threads);
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), T_, D, 1e-5);
    dx.assign(T_ * D, 0.0f);
    dw.assign(D, 0.0f);
    rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), T_, D,
                     false);
  };
  const int saved = num_threads();
  std::vector<float> dx1, dw1, dx2, dw2;
  run(1, dx1, dw1);
  run(2, dx2, dw2);
  set_num_threads(saved);
  EXPECT_EQ(dx1, dx2);
  EXPECT_EQ(dw1, dw2);
}

}  // namespace
}  // namespace moe
