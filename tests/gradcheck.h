// Test helpers: random fp64 inputs and central finite differences.
// Usage: make the scalar loss L = sum(out * probe) with a random `probe`, run the
// op's backward with dout = probe, then compare each analytic gradient to
// (L(x + h) - L(x - h)) / 2h evaluated in fp64.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"

namespace moe::test {

inline std::vector<double> random_vector(size_t n, uint64_t seed, const std::string& name,
                                         double scale = 1.0) {
  std::vector<double> v(n);
  CounterRng rng(seed, name);
  for (size_t i = 0; i < n; ++i) v[i] = scale * rng.normal(i);
  return v;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks `analytic` (dL/dx) against central differences of `loss` with respect to `x`.
// `x` is perturbed in place and restored. The error measure is
// |a - n| / max(1, |a|, |n|) per element, reported for the worst element.
inline void expect_gradient_close(const std::string& what, std::vector<double>& x,
                                  const std::vector<double>& analytic,
                                  const std::function<double()>& loss, double tol = 1e-6,
                                  double step = 1e-5) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  double worst = 0;
  size_t worst_index = 0;
  double worst_numeric = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + step;
    const double up = loss();
    x[i] = saved - step;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * step);
    ASSERT_TRUE(std::isfinite(analytic[i])) << what << " gradient " << i << " is not finite";
    const double err = std::abs(analytic[i] - numeric) /
                       std::max({1.0, std::abs(analytic[i]), std::abs(numeric)});
    if (err > worst) {
      worst = err;
      worst_index = i;
      worst_numeric = numeric;
    }
  }
  EXPECT_LE(worst, tol) << what << ": worst element " << worst_index << " analytic "
                        << analytic[worst_index] << " numeric " << worst_numeric;
}

}  // namespace moe::test
