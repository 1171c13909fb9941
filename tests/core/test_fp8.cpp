// The host fp8 e4m3 conversion (core/fp8.h) against known codes, an independent
// nearest-value search, NVIDIA's host implementation in cuda_fp8.h (when the CUDA
// toolkit is there), and the exchange's row quantisation error bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "core/fp8.h"
#include "core/rng.h"

#if defined(MOE_HAVE_CUDA) && __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define MOE_TEST_NV_FP8 1
#endif

namespace moe {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TEST(Fp8E4m3, KnownCodes) {
  EXPECT_EQ(float_to_fp8_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_fp8_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3(-2.0f), 0xc0);
  EXPECT_EQ(float_to_fp8_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(1e9f), 0x7e);  // saturates
  EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half of it: tie to even (0)
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 steps: tie to even (2)
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  // 1 + 1/16 lies halfway between 1 and 1.125: to even (1); 1 + 3/16 goes up to 1.25.
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7e);  // would round to 480 (no such value): saturates
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_float(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xff)));
}

TEST(Fp8E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    const float v = fp8_e4m3_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(float_to_fp8_e4m3(v), c) << "code " << c << " value " << v;
  }
}

// Nearest finite e4m3 value by search over all of them (ties to the even code), clamped
// to +-448: an implementation independent of the bit manipulation.
uint8_t nearest_by_search(float x, const std::vector<double>& values) {
  if (std::isnan(x)) return 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (a >= 448.0) return sign | 0x7e;
  const auto hi = std::upper_bound(values.begin(), values.end(), a);  // values[c] for c = 0 .. 0x7e
  const auto c_hi = static_cast<int>(hi - values.begin()), c_lo = c_hi - 1;
  const double d_lo = a - values[static_cast<size_t>(c_lo)];
  const double d_hi = values[static_cast<size_t>(c_hi)] - a;
  const int c = d_lo < d_hi ? c_lo : d_hi < d_lo ? c_hi : (c_lo % 2 == 0 ? c_lo : c_hi);
  return sign | static_cast<uint8_t>(c);
}

// Every sign, exponent and top 11 mantissa bits, with the low 12 bits at the patterns
// around a tie (the rounding of e4m3's 3 mantissa bits looks at the 20 below them).
template <class F>
void dense_sweep(F&& check) {
  const uint32_t lows[] = {0x000, 0x001, 0x7ff, 0x800, 0x801, 0xfff};
  for (uint32_t high = 0; high < (1u << 20); ++high)
    for (uint32_t low : lows) check(from_bits((high << 12) | low));
}

TEST(Fp8E4m3, DenseSweepMatchesNearestValueSearch) {
  std::vector<double> values;
  for (int c = 0; c <= 0x7e; ++c) values.push_back(fp8_e4m3_to_float(static_cast<uint8_t>(c)));
  values.push_back(std::numeric_limits<double>::infinity());
  int64_t mismatches = 0;
  dense_sweep([&](float x) {
    if (float_to_fp8_e4m3(x) != nearest_by_search(x, values) && ++mismatches < 5)
      ADD_FAILURE() << "x = " << x << " bits " << std::hex << std::bit_cast<uint32_t>(x);
  });
  EXPECT_EQ(mismatches, 0);
}

#ifdef MOE_TEST_NV_FP8
TEST(Fp8E4m3, DenseSweepMatchesCudaHostConversion) {
  int64_t mismatches = 0;
  dense_sweep([&](float x) {
    const auto nv = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
    if (float_to_fp8_e4m3(x) != nv && !std::isnan(x) && ++mismatches < 5)
      ADD_FAILURE() << "x = " << x << " ours " << int{float_to_fp8_e4m3(x)} << " cuda " << int{nv};
  });
  EXPECT_EQ(mismatches, 0);
}
#endif

// Each element within 2^-4 of itself (e4m3's half step relative to a normal), or half a
// subnormal step of the row's scale (2^-10 scale) for the smallest.
TEST(Fp8Rows, QuantiseDequantiseErrorBound) {
  const int64_t D = 259;  // odd: the row is padded
  CounterRng rng(3, "fp8 rows");
  std::vector<uint8_t> row(static_cast<size_t>(fp8_row_bytes(D)), 0xcd);
  ASSERT_EQ(row.size(), 4u + 260u);
  for (int r = 0; r < 50; ++r) {
    const double magnitude = std::ldexp(1.0, r % 30 - 15);
    std::vector<float> x(static_cast<size_t>(D)), y(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) x[static_cast<size_t>(d)] = static_cast<float>(magnitude * rng.normal(r * D + d));
    if (r == 7) x[3] = 0.0f;
    quantize_row_fp8(row.data(), x.data(), D);
    dequantize_row_fp8(y.data(), row.data(), D);
    float scale;
    std::memcpy(&scale, row.data(), 4);
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    EXPECT_EQ(scale, amax / 448.0f);
    for (int64_t d = D; d < 260; ++d) EXPECT_EQ(row[static_cast<size_t>(4 + d)], 0) << "padding";
    for (int64_t d = 0; d < D; ++d) {
      const float a = x[static_cast<size_t>(d)], b = y[static_cast<size_t>(d)];
      const double bound = std::ldexp(std::fabs(a), -4) * (1 + 1e-6) + std::ldexp(double{scale}, -10) + 1e-30;
      EXPECT_LE(std::fabs(double{a} - b), bound) << "row " << r << " element " << d;
    }
    // The row's largest element comes back within one float rounding.
    const auto at = std::max_element(x.begin(), x.end(), [](float p, float q) { return std::fabs(p) < std::fabs(q); });
    EXPECT_NEAR(y[static_cast<size_t>(at - x.begin())], *at, std::fabs(*at) * 1e-6);
  }
  // A row of zeros: scale 0, codes 0, zeros back.
  std::vector<double> zeros(static_cast<size_t>(D), 0.0), back(static_cast<size_t>(D), 1.0);
  quantize_row_fp8(row.data(), zeros.data(), D);
  dequantize_row_fp8(back.data(), row.data(), D);
  EXPECT_TRUE(std::all_of(row.begin(), row.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](double v) { return v == 0.0; }));
}

}  // namespace
}  // namespace moe
