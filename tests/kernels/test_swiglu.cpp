#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.h"
#include "kernels/swiglu.h"

namespace moe {
namespace {

using test::random_vector;

TEST(Swiglu, ForwardHandComputed) {
  const std::vector<double> gate = {0.0, 1.0, -2.0}, up = {5.0, 2.0, 3.0};
  std::vector<double> act(3);
  swiglu_forward(act.data(), gate.data(), up.data(), 3);
  EXPECT_EQ(act[0], 0.0);
  EXPECT_NEAR(act[1], 1.0 / (1.0 + std::exp(-1.0)) * 2.0, 1e-15);
  EXPECT_NEAR(act[2], -2.0 / (1.0 + std::exp(2.0)) * 3.0, 1e-15);
}

TEST(Swiglu, GradientMatchesFiniteDifferences) {
  const int64_t n = 11;
  std::vector<double> gate = random_vector(n, 1, "gate", 3.0);
  std::vector<double> up = random_vector(n, 1, "up");
  const std::vector<double> probe = random_vector(n, 1, "probe");
  std::vector<double> act(n), dgate(n, NAN), dup(n, NAN);
  swiglu_backward(dgate.data(), dup.data(), probe.data(), gate.data(), up.data(), n);
  auto loss = [&] {
    swiglu_forward(act.data(), gate.data(), up.data(), n);
    return test::dot(act, probe);
  };
  test::expect_gradient_close("dgate", gate, dgate, loss);
  test::expect_gradient_close("dup", up, dup, loss);
}

TEST(Swiglu, ExtremeGatesStayFinite) {
  // silu(x) -> 0 for x -> -inf and -> x for x -> +inf; so do its derivatives (0 and 1).
  for (float x : {-1000.0f, -100.0f, 100.0f, 1000.0f}) {
    const float up = 2.0f, dact = 1.0f;
    float act = NAN, dgate = NAN, dup = NAN;
    swiglu_forward(&act, &x, &up, 1);
    swiglu_backward(&dgate, &dup, &dact, &x, &up, 1);
    const bool positive = x > 0;
    EXPECT_FLOAT_EQ(act, positive ? x * up : 0.0f) << x;
    EXPECT_FLOAT_EQ(dgate, positive ? up : 0.0f) << x;
    EXPECT_FLOAT_EQ(dup, positive ? x : 0.0f) << x;
  }
}

TEST(Swiglu, FloatMatchesDouble) {
  const int64_t n = 257;
  const std::vector<double> gate = random_vector(n, 2, "gate", 4.0), up = random_vector(n, 2, "up");
  const std::vector<double> dact = random_vector(n, 2, "dact");
  std::vector<double> act(n), dgate(n), dup(n);
  swiglu_forward(act.data(), gate.data(), up.data(), n);
  swiglu_backward(dgate.data(), dup.data(), dact.data(), gate.data(), up.data(), n);
  const std::vector<float> gf(gate.begin(), gate.end()), uf(up.begin(), up.end()),
      df(dact.begin(), dact.end());
  std::vector<float> actf(n), dgatef(n), dupf(n);
  swiglu_forward(actf.data(), gf.data(), uf.data(), n);
  swiglu_backward(dgatef.data(), dupf.data(), df.data(), gf.data(), uf.data(), n);
  auto near = [](double a) { return 1e-5 * std::max(1.0, std::abs(a)); };
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(actf[i], act[i], near(act[i])) << i;
    EXPECT_NEAR(dgatef[i], dgate[i], near(dgate[i])) << i;
    EXPECT_NEAR(dupf[i], dup[i], near(dup[i])) << i;
  }
}

}  // namespace
}  // namespace moe
