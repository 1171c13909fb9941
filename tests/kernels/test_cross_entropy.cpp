#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "kernels/cross_entropy.h"

namespace moe {
namespace {

using test::random_vector;

TEST(CrossEntropy, HandComputedWithIgnoredRow) {
  const int64_t T_ = 3, V = 3;
  const std::vector<double> logits = {1, 2,  3,  //
                                      0, 0,  0,  //
                                      7, -9, 4};
  const std::vector<int32_t> targets = {2, 0, -1};
  std::vector<double> lse(T_);
  const double loss = cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(lse[0], lse0, 1e-14);
  EXPECT_NEAR(lse[1], std::log(3.0), 1e-14);
  EXPECT_NEAR(loss, ((lse0 - 3.0) + std::log(3.0)) / 2.0, 1e-14);  // mean over 2, not 3

  std::vector<double> dlogits(T_ * V, NAN);
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), T_, V, 1.0);
  EXPECT_NEAR(dlogits[3], (1.0 / 3 - 1.0) / 2, 1e-15);
  EXPECT_NEAR(dlogits[4], (1.0 / 3) / 2, 1e-15);
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dlogits[2 * V + v], 0.0) << "ignored row";
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  const int64_t T_ = 5, V = 7;
  const double dloss = 1.7;
  const std::vector<int32_t> targets = {3, -1, 0, 6, 3};
  std::vector<double> logits = random_vector(T_ * V, 1, "logits", 2.0);
  std::vector<double> lse(T_), dlogits(T_ * V);
  cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), T_, V, dloss);
  auto loss = [&] {
    return dloss * cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  };
  test::expect_gradient_close("dlogits", logits, dlogits, loss);
}

TEST(CrossEntropy, IgnoredRowsDoNotChangeTheLoss) {
  const int64_t T_ = 4, V = 5;
  const std::vector<int32_t> targets = {1, -1, -1, 4};
  std::vector<double> logits = random_vector(T_ * V, 2, "logits");
  std::vector<double> lse(T_);
  const double before = cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  for (int64_t v = 0; v < V; ++v) logits[1 * V + v] += 10.0 * static_cast<double>(v);
  const double after = cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  EXPECT_EQ(before, after);

  const std::vector<int32_t> none = {-1, -1, -1, -1};
  EXPECT_EQ(cross_entropy_forward(lse.data(), logits.data(), none.data(), T_, V), 0.0);
  std::vector<double> dlogits(T_ * V, NAN);
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), none.data(), T_, V, 1.0);
  EXPECT_EQ(dlogits, std::vector<double>(T_ * V, 0.0));
}

TEST(CrossEntropy, BackwardInPlaceMatchesSeparateBuffer) {
  const int64_t T_ = 6, V = 33;
  const std::vector<int32_t> targets = {0, 32, -1, 5, 5, 17};
  const std::vector<double> logits_d = random_vector(T_ * V, 3, "logits", 3.0);
  std::vector<float> logits(logits_d.begin(), logits_d.end()), lse(T_), dlogits(T_ * V);
  cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), T_, V, 0.5);
  cross_entropy_backward(logits.data(), logits.data(), lse.data(), targets.data(), T_, V, 0.5);
  EXPECT_EQ(logits, dlogits);
}

TEST(CrossEntropy, LargeLogitsAreStable) {
  // A constant shift of a row changes neither the loss nor the gradient.
  const int64_t T_ = 2, V = 4;
  const std::vector<int32_t> targets = {2, 1};
  const std::vector<float> base = {0.5f, -1.0f, 2.0f, 0.0f, 1.0f, 1.5f, -0.5f, 0.25f};
  std::vector<float> shifted = base;
  for (float& x : shifted) x += 1000.0f;
  std::vector<float> lse(T_), d0(T_ * V), d1(T_ * V);
  const double l0 = cross_entropy_forward(lse.data(), base.data(), targets.data(), T_, V);
  cross_entropy_backward(d0.data(), base.data(), lse.data(), targets.data(), T_, V, 1.0);
  const double l1 = cross_entropy_forward(lse.data(), shifted.data(), targets.data(), T_, V);
  cross_entropy_backward(d1.data(), shifted.data(), lse.data(), targets.data(), T_, V, 1.0);
  ASSERT_TRUE(std::isfinite(l1));
  EXPECT_NEAR(l1, l0, 1e-4);
  for (int64_t i = 0; i < T_ * V; ++i) EXPECT_NEAR(d1[i], d0[i], 1e-4) << i;
}

TEST(CrossEntropy, TargetOutOfRangeThrowsNamingThePosition) {
  const int64_t T_ = 3, V = 4;
  std::vector<double> logits(T_ * V, 0.0), lse(T_), dlogits(T_ * V);
  for (int32_t bad : {4, -2}) {
    const std::vector<int32_t> targets = {0, bad, 1};
    try {
      cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
      ADD_FAILURE() << "no error for target " << bad;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("target " + std::to_string(bad) + " at position 1"), std::string::npos)
          << what;
    }
    EXPECT_THROW(cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(),
                                        T_, V, 1.0),
                 Error);
  }
}

TEST(CrossEntropy, FloatMatchesDouble) {
  const int64_t T_ = 7, V = 50;
  std::vector<int32_t> targets(T_);
  for (int64_t t = 0; t < T_; ++t) targets[t] = static_cast<int32_t>((t * 13) % V);
  targets[3] = -1;
  const std::vector<double> logits = random_vector(T_ * V, 4, "logits", 3.0);
  std::vector<double> lse(T_), dlogits(T_ * V);
  const double loss = cross_entropy_forward(lse.data(), logits.data(), targets.data(), T_, V);
  cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), T_, V, 2.0);
  const std::vector<float> logits_f(logits.begin(), logits.end());
  std::vector<float> lse_f(T_), dlogits_f(T_ * V);
  const double loss_f = cross_entropy_forward(lse_f.data(), logits_f.data(), targets.data(), T_, V);
  cross_entropy_backward(dlogits_f.data(), logits_f.data(), lse_f.data(), targets.data(), T_, V,
                         2.0);
  EXPECT_NEAR(loss_f, loss, 1e-5 * std::abs(loss));
  for (int64_t i = 0; i < T_ * V; ++i)
    EXPECT_NEAR(dlogits_f[i], dlogits[i], 1e-5 * std::max(1.0, std::abs(dlogits[i]))) << i;
}

}  // namespace
}  // namespace moe
