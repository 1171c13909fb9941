// The FP8 GEMM tests' data and checks (tests/gpu/test_gpu_fp8_gemm.cpp,
// test_gpu_fp8_padded_gemm.cpp): inputs whose tiles each have their own power of two, so a
// scale read from the wrong place shows, and the tolerance of an fp8 GEMM against a
// reference computed from the dequantised inputs.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

// Skips where DeepGEMM's kernel (cuda::PaddedExpertGemmFp8, dense_gemm_deepgemm) cannot run.
#define MOE_REQUIRE_DEEPGEMM()                                                                  \
  do {                                                                                          \
    MOE_REQUIRE_GPU();                                                                          \
    if (!cuda::deepgemm_available()) GTEST_SKIP() << "not an sm_90 GPU of 132 SMs"; \
  } while (0)

namespace moe::test {

// Normal values whose magnitude depends on the 128-wide tile of the row (a power of two in
// 2^-5 .. 2^5), so that every tile has its own scale and a scale read from the wrong
// place shows as a factor of 2 or more.
inline std::vector<bf16> activations(int64_t R, int64_t ld, uint64_t seed) {
  CounterRng rng(seed, "fp8 activations");
  std::vector<bf16> x(static_cast<size_t>(R * ld));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < ld; ++k) {
      const int64_t i = r * ld + k;
      const int exponent = static_cast<int>((r * 7 + k / fp8::kBlock * 3) % 11) - 5;
      x[i] = float_to_bf16(static_cast<float>(std::ldexp(rng.normal(i), exponent)));
    }
  return x;
}

// Weights [E, N, K] around 0.02 whose magnitude depends on the 128 x 128 block.
inline std::vector<bf16> weights(int64_t E, int64_t N, int64_t K, uint64_t seed) {
  CounterRng rng(seed, "fp8 weights");
  std::vector<bf16> w(static_cast<size_t>(E * N * K));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = (e * N + n) * K + k;
        const int exponent = static_cast<int>((e * 5 + n / fp8::kBlock * 3 + k / fp8::kBlock * 7) % 9) - 4;
        w[i] = float_to_bf16(static_cast<float>(0.02 * std::ldexp(rng.normal(i), exponent)));
      }
  return w;
}

template <typename T>
inline void expect_same(const std::vector<T>& got, const std::vector<T>& want, size_t count, const std::string& what) {
  ASSERT_GE(got.size(), count);
  ASSERT_GE(want.size(), count);
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < count; ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && differ++ == 0) first = i;
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << count << " differ, first at " << first;
}

// |got - want| <= 2^-7 |want| (the bf16 output's rounding, with room) + 2^-9 sum|a b|: the
// tensor cores add e4m3 products with about 14 bits kept (truncated) before the promotion
// to fp32 every 128 of K, an error near 2^-11 of sum|a b| at worst on random data. A scale
// read from the wrong place is off by a factor of 2 or more (the inputs' tiles have
// different powers of two), far outside. NaN never passes.
inline void expect_gemm_close(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                       const std::vector<double>& abs_sum) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0, worst_at = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double allowed = std::ldexp(std::abs(want[i]), -7) + std::ldexp(abs_sum[i], -9) + 1e-30;
    const double ratio = std::isfinite(got[i]) ? std::abs(got[i] - want[i]) / allowed : INFINITY;
    if (!(ratio <= 1)) ++bad;
    if (!(ratio <= worst)) {
      worst = ratio;
      worst_at = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " out of tolerance; worst at " << worst_at
                     << ": got " << got[worst_at] << " want " << want[worst_at];
}

// A GEMM's outputs checked against their references in double: each output's sum over K of
// its terms (and of their magnitudes, expect_gemm_close's bound), after `initial` (an
// accumulated output's old value).
struct GemmCheck {
  std::vector<float> got;
  std::vector<double> want, abs_sum;
  template <typename Term>
  void add(float out, int64_t K, const Term& term, double initial = 0) {
    double acc = initial, mag = std::abs(initial);
    for (int64_t k = 0; k < K; ++k) {
      const double p = term(k);
      acc += p;
      mag += std::abs(p);
    }
    got.push_back(out);
    want.push_back(acc);
    abs_sum.push_back(mag);
  }
  void expect(const std::string& what) const { expect_gemm_close(what, got, want, abs_sum); }
};

}  // namespace moe::test
