// kernels/cuda/exact_math.cuh: the branch-free fast paths of the square root, the division
// (AdamW's vector form) and the reciprocal (SwiGLU's sigmoid) give nvcc's IEEE bits wherever
// they are taken (docs/DETERMINISM.md): millions of bit patterns over every exponent, and
// the operands AdamW divides.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"

namespace moe {
namespace {

// A float from random bits with its biased exponent drawn from [lo, hi].
float with_exponent(uint32_t bits, uint32_t lo, uint32_t hi) {
  const uint32_t exponent = lo + (bits >> 9) % (hi - lo + 1);
  return std::bit_cast<float>((bits & 0x807fffffu) | (exponent << 23));
}

TEST(GpuExactMath, FastPathsGiveTheIeeeBits) {
  MOE_REQUIRE_GPU();
  constexpr int64_t kPerKind = 1 << 22;
  std::vector<float> a, b;
  CounterRng rng(5, "exact math");
  for (int64_t i = 0; i < kPerKind; ++i) {
    const auto r = rng.bits(static_cast<uint64_t>(i));
    // Any bits (zeros, subnormals, infinities and NaNs included: the checks must refuse them).
    a.push_back(std::bit_cast<float>(r[0]));
    b.push_back(std::bit_cast<float>(r[1]));
    // Exponents around and inside the fast ranges, positive for the square root.
    a.push_back(std::fabs(with_exponent(r[2], 20, 240)));
    b.push_back(with_exponent(r[3], 60, 194));
    // AdamW's operands: step_size x m (tiny to moderate) over sqrt(v) + eps.
    const float m = with_exponent(r[2], 60, 130), v = std::fabs(with_exponent(r[3], 40, 130));
    a.push_back(1e-3f * m);
    b.push_back(std::sqrt(v) + 1e-8f);
  }
  auto a_d = test::to_device(a), b_d = test::to_device(b);
  auto counts_d = test::to_device(std::vector<unsigned long long>(6, 0));
  cuda::exact_math_mismatches(counts_d.data(), a_d.data(), b_d.data(), static_cast<int64_t>(a.size()), nullptr);
  const auto counts = test::to_host(counts_d);
  EXPECT_EQ(counts[0], 0u) << "square roots differ from __fsqrt_rn";
  EXPECT_EQ(counts[1], 0u) << "quotients differ from __fdiv_rn";
  // Both fast paths ran on most of the structured inputs.
  EXPECT_GT(counts[2], static_cast<unsigned long long>(kPerKind)) << "sqrt's fast path hardly taken";
  EXPECT_GT(counts[3], static_cast<unsigned long long>(kPerKind)) << "the division's fast path hardly taken";
  EXPECT_EQ(counts[4], 0u) << "reciprocals differ from 1.0f / b";
  EXPECT_GT(counts[5], static_cast<unsigned long long>(kPerKind)) << "the reciprocal's fast path hardly taken";
  std::printf("  fast paths taken: sqrt %llu, division %llu of %zu\n", counts[2], counts[3], a.size());
}

}  // namespace
}  // namespace moe
