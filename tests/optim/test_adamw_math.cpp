// kernels/adamw_math.h on the host: the hi/lo split of fp32 master weights is exact for
// every non-NaN bit pattern and keeps NaN a NaN; bf16 rounding matches core/bf16.h; the
// shared AdamW element update is the CPU AdamW's arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/adamw_math.h"

namespace moe {
namespace {

namespace am = adamw_math;

bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// Every high half with the low halves where rounding and wrapping change, plus a
// pseudo-random sweep of the rest.
std::vector<uint32_t> bit_patterns() {
  std::vector<uint32_t> patterns;
  const uint32_t lows[] = {0x0000, 0x0001, 0x7ffe, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff, 0x1234, 0xc001};
  for (uint32_t high = 0; high < 0x10000; ++high)
    for (uint32_t low : lows) patterns.push_back(high << 16 | low);
  for (uint64_t i = 0; i < (1u << 21); ++i) patterns.push_back(static_cast<uint32_t>(i * 2654435761u + 12345u));
  return patterns;
}

TEST(MasterSplit, RoundTripsEveryNonNanPatternExactly) {
  int64_t checked = 0;
  for (uint32_t u : bit_patterns()) {
    const float x = am::bits_float(u);
    const am::MasterSplit s = am::split_master(x);
    const uint32_t back = am::float_bits(am::join_master(s.hi, s.lo));
    if (is_nan_bits(u)) {
      // NaN stays NaN of the same sign, in the joined value and in the bf16 half.
      ASSERT_TRUE(is_nan_bits(back)) << std::hex << u;
      ASSERT_EQ(back >> 31, u >> 31) << std::hex << u;
      ASSERT_TRUE((s.hi & 0x7fffu) > 0x7f80u) << std::hex << u;
      ASSERT_EQ(s.hi >> 15, u >> 31) << std::hex << u;
      continue;
    }
    ASSERT_EQ(back, u) << std::hex << u;
    // The documented formula, and hi is x rounded to nearest (ties away from zero).
    ASSERT_EQ(s.hi, static_cast<uint16_t>((u + 0x8000u) >> 16)) << std::hex << u;
    ASSERT_EQ(static_cast<uint16_t>(s.lo), static_cast<uint16_t>(u & 0xffffu)) << std::hex << u;
    const double hi_value = am::bf16_bits_to_float(s.hi);
    const uint32_t truncated = u >> 16;
    const uint16_t other = static_cast<uint16_t>(s.hi == truncated ? truncated + 1 : truncated);
    if ((u & 0x7fffffffu) < 0x7f7f0000u && std::isfinite(hi_value)) {
      const double err = std::abs(hi_value - x), other_err = std::abs(am::bf16_bits_to_float(other) - x);
      ASSERT_TRUE(err < other_err || (err == other_err && std::abs(hi_value) > std::abs(x))) << std::hex << u;
    }
    ++checked;
  }
  EXPECT_GT(checked, 2'000'000);
}

TEST(MasterSplit, EdgeCases) {
  struct Case {
    uint32_t x;
    uint16_t hi;
    int16_t lo;
  };
  const Case cases[] = {
      {0x00000000u, 0x0000, 0},        // +0
      {0x80000000u, 0x8000, 0},        // -0
      {0x00000001u, 0x0000, 1},        // smallest denormal: hi 0, lo carries it
      {0x80000001u, 0x8000, 1},        // its negative
      {0x007fffffu, 0x0080, -1},       // largest denormal rounds up to the smallest normal
      {0x3f800000u, 0x3f80, 0},        // 1
      {0x3f808000u, 0x3f81, -0x8000},  // a tie rounds away from zero
      {0xbf808000u, 0xbf81, -0x8000},  // also when negative
      {0x3f807fffu, 0x3f80, 0x7fff},   // just below the tie
      {0x7f7f7fffu, 0x7f7f, 0x7fff},   // finite hi
      {0x7f7fffffu, 0x7f80, -1},       // the largest float: hi is inf, lo brings it back
      {0xff7fffffu, 0xff80, -1},
      {0x7f800000u, 0x7f80, 0},  // inf
      {0xff800000u, 0xff80, 0},  // -inf
  };
  for (const Case& c : cases) {
    const am::MasterSplit s = am::split_master(am::bits_float(c.x));
    EXPECT_EQ(s.hi, c.hi) << std::hex << c.x;
    EXPECT_EQ(s.lo, c.lo) << std::hex << c.x;
    EXPECT_EQ(am::float_bits(am::join_master(s.hi, s.lo)), c.x) << std::hex << c.x;
  }
  // NaNs the plain formula would turn into inf (small payload) or +-0 (wrap-around).
  for (uint32_t nan : {0x7f800001u, 0x7fc00000u, 0x7fff8000u, 0x7fffffffu, 0xffc00000u, 0xffff8000u, 0xffffffffu}) {
    const am::MasterSplit s = am::split_master(am::bits_float(nan));
    EXPECT_EQ(s.hi, static_cast<uint16_t>((nan >> 16 & 0x8000u) | 0x7fc0u)) << std::hex << nan;
    EXPECT_TRUE(std::isnan(am::join_master(s.hi, s.lo))) << std::hex << nan;
  }
}

TEST(AdamWMath, Bf16RoundingIsFloatToBf16) {
  for (uint32_t u : bit_patterns()) {
    const float x = am::bits_float(u);
    ASSERT_EQ(am::bf16_bits_rne(x), float_to_bf16(x).bits) << std::hex << u;
    if (!is_nan_bits(u)) ASSERT_EQ(am::float_bits(am::round_to_bf16(x)), am::float_bits(bf16_to_float(float_to_bf16(x))));
  }
}

// The element update against the CPU AdamW's arithmetic as written before it was shared.
TEST(AdamWMath, UpdateIsTheCpuArithmetic) {
  CounterRng rng(3, "adamw_math");
  const double lr = 2e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  const int64_t step = 7;
  const am::AdamWScalars s = am::adamw_step_scalars(lr, b1, b2, eps, wd, step);
  // Kingma & Ba's efficient form: the bias corrections folded into the step size and eps.
  const float sqrt_bias2 = static_cast<float>(std::sqrt(1.0 - std::pow(b2, 7.0)));
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(b1, 7.0))) * sqrt_bias2;
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
  const float feps = static_cast<float>(eps) * sqrt_bias2;
  const float decay = static_cast<float>(1.0 - lr * wd);
  EXPECT_EQ(s.step_size, step_size);
  EXPECT_EQ(s.eps, feps);
  EXPECT_EQ(s.decay_factor, decay);
  for (uint64_t i = 0; i < 100000; ++i) {
    const float p0 = static_cast<float>(rng.normal(4 * i)), g = static_cast<float>(1e-2 * rng.normal(4 * i + 1));
    const float m0 = static_cast<float>(1e-2 * rng.normal(4 * i + 2));
    const float v0 = static_cast<float>(1e-4 * std::abs(rng.normal(4 * i + 3)));
    float m = m0, v = v0;
    const float p = am::adamw_update(p0, g, m, v, s, decay, false);
    const float want_m = fb1 * m0 + (1.0f - fb1) * g;
    const float want_v = fb2 * v0 + (1.0f - fb2) * g * g;
    const float want_p = p0 * decay - step_size * want_m / (std::sqrt(want_v) + feps);
    ASSERT_EQ(am::float_bits(m), am::float_bits(want_m)) << i;
    ASSERT_EQ(am::float_bits(v), am::float_bits(want_v)) << i;
    ASSERT_EQ(am::float_bits(p), am::float_bits(want_p)) << i;
    // bf16 moments: the same with m and v rounded when read and after the update.
    float mb = m0, vb = v0;
    const float pb = am::adamw_update(p0, g, mb, vb, s, decay, true);
    const float rm0 = bf16_to_float(float_to_bf16(m0)), rv0 = bf16_to_float(float_to_bf16(v0));
    const float want_mb = bf16_to_float(float_to_bf16(fb1 * rm0 + (1.0f - fb1) * g));
    const float want_vb = bf16_to_float(float_to_bf16(fb2 * rv0 + (1.0f - fb2) * g * g));
    ASSERT_EQ(am::float_bits(mb), am::float_bits(want_mb)) << i;
    ASSERT_EQ(am::float_bits(vb), am::float_bits(want_vb)) << i;
    ASSERT_EQ(am::float_bits(pb), am::float_bits(p0 * decay - step_size * want_mb / (std::sqrt(want_vb) + feps))) << i;
  }
  // grad_scale multiplies the gradient first, as clipping the gradients in place does.
  am::AdamWScalars clipped = s;
  clipped.grad_scale = 0.37f;
  float m1 = 0, v1 = 0, m2 = 0, v2 = 0;
  const float g = 0.123f;
  EXPECT_EQ(am::float_bits(am::adamw_update(1.0f, g, m1, v1, clipped, decay, false)),
            am::float_bits(am::adamw_update(1.0f, g * 0.37f, m2, v2, s, decay, false)));
}

// The folded bias corrections are torch's update: within a few fp32 roundings of it in
// double early on, and its bits once sqrt(1 - beta2^t) rounds to 1 (beta2 0.95: t > 338),
// where the step size is lr / (1 - beta1^t) and eps itself. bf16 moments read exactly
// (read_exact, the GPU's bf16 storage) give the bits of rounding them when read.
TEST(AdamWMath, FoldedBiasCorrectionsAreTorchsUpdate) {
  const double lr = 2e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  CounterRng rng(5, "adamw_math_late");
  for (const int64_t step : {1, 2, 7, 50, 338}) {
    const am::AdamWScalars s = am::adamw_step_scalars(lr, b1, b2, eps, wd, step);
    const double bias1 = 1 - std::pow(b1, static_cast<double>(step)), bias2 = 1 - std::pow(b2, static_cast<double>(step));
    double worst = 0;
    for (uint64_t i = 0; i < 20000; ++i) {
      float m = static_cast<float>(1e-2 * rng.normal(3 * i)), v = static_cast<float>(1e-4 * std::abs(rng.normal(3 * i + 1)));
      const float g = static_cast<float>(1e-2 * rng.normal(3 * i + 2));
      const float update = -am::adamw_update(0.0f, g, m, v, s, 1.0f, false);  // m, v: the new moments
      const double want = lr / bias1 * m / (std::sqrt(static_cast<double>(v)) / std::sqrt(bias2) + eps);
      worst = std::max(worst, std::abs(update - want) / std::abs(want));
    }
    EXPECT_LT(worst, 6e-7) << "step " << step;  // ~8 fp32 roundings of 2^-24
  }
  const am::AdamWScalars s = am::adamw_step_scalars(lr, b1, b2, eps, wd, 400);
  ASSERT_EQ(s.step_size, static_cast<float>(lr / (1.0 - std::pow(b1, 400.0))));
  ASSERT_EQ(s.eps, static_cast<float>(eps));
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2), feps = static_cast<float>(eps);
  for (uint64_t i = 0; i < 100000; ++i) {
    const float p0 = static_cast<float>(rng.normal(4 * i)), g = static_cast<float>(1e-2 * rng.normal(4 * i + 1));
    const float m0 = bf16_to_float(float_to_bf16(static_cast<float>(1e-2 * rng.normal(4 * i + 2))));
    const float v0 = bf16_to_float(float_to_bf16(static_cast<float>(1e-4 * std::abs(rng.normal(4 * i + 3)))));
    float m = m0, v = v0;
    const float p = am::adamw_update(p0, g, m, v, s, s.decay_factor, false);
    const float want_m = fb1 * m0 + (1.0f - fb1) * g, want_v = fb2 * v0 + (1.0f - fb2) * g * g;
    const float sqrt_bias2 = 1.0f;  // torch divides by it
    const float want_p = p0 * s.decay_factor - s.step_size * want_m / (std::sqrt(want_v) / sqrt_bias2 + feps);
    ASSERT_EQ(am::float_bits(p), am::float_bits(want_p)) << i;
    float mr = m0, vr = v0, me = m0, ve = v0;
    const float rounded = am::adamw_update(p0, g, mr, vr, s, s.decay_factor, true);
    const float exact = am::adamw_update(p0, g, me, ve, s, s.decay_factor, true, /*read_exact=*/true);
    ASSERT_EQ(am::float_bits(rounded), am::float_bits(exact)) << i;
    ASSERT_EQ(am::float_bits(mr), am::float_bits(me)) << i;
    ASSERT_EQ(am::float_bits(vr), am::float_bits(ve)) << i;
  }
}

}  // namespace
}  // namespace moe
