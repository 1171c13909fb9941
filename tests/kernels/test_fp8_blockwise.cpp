// The blockwise fp8 quantisation's CPU reference (kernels/fp8_blockwise.h): the
// power-of-two scale rule, round trips within e4m3's rounding, the scale layouts (the
// grouping by expert moves scales, never codes), the transposed weight copy (exactly the
// transpose), edge blocks, K that is not a multiple of 128 refused, and the token columns
// of the weight gradients with their GEMM.
#include "kernels/fp8_blockwise.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"
#include "core/rng.h"
#include "expect_error.h"

namespace moe {
namespace {

using fp8::kBlock;

std::vector<bf16> random_bf16(size_t n, uint64_t seed, const char* name, double scale) {
  CounterRng rng(seed, name);
  std::vector<bf16> v(n);
  // Normal values times a per-element power of two in [2^-6, 2^6]: tiles of very different ranges.
  for (size_t i = 0; i < n; ++i)
    v[i] = float_to_bf16(static_cast<float>(scale * rng.normal(i) * std::ldexp(1.0, static_cast<int>(i / 128 % 13) - 6)));
  return v;
}

// e4m3 keeps 3 mantissa bits (relative error <= 2^-4 in its normal range, subnormal steps
// of 2^-9 before the scale).
void expect_round_trip(float got, float want, float scale, const std::string& where) {
  const float allowed = std::max(std::fabs(want) * 0.0625f, scale * std::ldexp(1.0f, -10));
  ASSERT_LE(std::fabs(got - want), allowed) << where << ": " << got << " vs " << want << " scale " << scale;
}

TEST(Fp8Blockwise, ScaleIsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(fp8::block_scale(448.0f), 1.0f);
  EXPECT_EQ(fp8::block_scale(448.5f), 2.0f);
  EXPECT_EQ(fp8::block_scale(224.0f), 0.5f);
  EXPECT_EQ(fp8::block_scale(1.0f), std::ldexp(1.0f, -8));
  EXPECT_EQ(fp8::block_scale(0.0f), 1.0f);
  EXPECT_EQ(fp8::block_scale(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(fp8::block_scale(std::numeric_limits<float>::quiet_NaN()), 1.0f);
  EXPECT_EQ(fp8::block_scale(1e-40f), std::ldexp(1.0f, -126));  // subnormal amax: clamped
  EXPECT_EQ(fp8::block_scale(1e-37f), std::ldexp(1.0f, -126));
  EXPECT_EQ(fp8::block_scale(-3.0f), 1.0f);
  EXPECT_EQ(fp8::block_scale(std::numeric_limits<float>::max()), std::ldexp(1.0f, 120));
  // Every exponent, the mantissas around 1.75 (where amax / 2^e crosses 448): the smallest
  // power of two 2^e >= 2^-126 with amax / 2^e <= 448, as computed in double.
  for (uint32_t biased = 0; biased < 255; ++biased)
    for (const uint32_t mantissa : {0u, 1u, 0x5fffffu, 0x600000u, 0x600001u, 0x7fffffu}) {
      const float amax = std::bit_cast<float>(biased << 23 | mantissa);
      if (amax == 0.0f) continue;
      int e = -126;
      while (double(amax) / std::ldexp(1.0, e) > 448.0) ++e;
      ASSERT_EQ(fp8::block_scale(amax), std::ldexp(1.0f, e)) << "biased " << biased << " mantissa " << mantissa;
      ASSERT_EQ(fp8::block_scale(-amax), 1.0f);
    }
  CounterRng rng(1, "amax");
  for (int i = 0; i < 10000; ++i) {
    const float amax = static_cast<float>(std::ldexp(rng.uniform(i), static_cast<int>(i % 200) - 100));
    const float scale = fp8::block_scale(amax);
    int exponent = 0;
    ASSERT_EQ(std::frexp(scale, &exponent), 0.5f) << "a power of two";
    ASSERT_LE(amax / scale, 448.0f) << amax;
    if (scale > std::ldexp(1.0f, -126)) ASSERT_GT(amax / (scale / 2), 448.0f) << amax << ": not the smallest";
  }
}

// block_scale_inverse is the quotient 1 / scale bit for bit, for every scale block_scale
// returns (each exponent, and the scales of zero, non-finite and subnormal maxima).
TEST(Fp8Blockwise, ScaleInverseIsTheQuotient) {
  for (int e = -126; e <= 120; ++e) {
    const float scale = std::ldexp(1.0f, e);
    ASSERT_EQ(std::bit_cast<uint32_t>(fp8::block_scale_inverse(scale)), std::bit_cast<uint32_t>(1.0f / scale)) << e;
  }
  CounterRng rng(2, "amax");
  for (int i = 0; i < 10000; ++i) {
    const float amax = static_cast<float>(std::ldexp(rng.uniform(i), static_cast<int>(i % 300) - 150));
    const float scale = fp8::block_scale(amax);
    ASSERT_EQ(fp8::block_scale_inverse(scale), 1.0f / scale) << amax;
  }
  for (float amax : {0.0f, -1.0f, 1e-45f, std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                     std::numeric_limits<float>::quiet_NaN()})
    EXPECT_EQ(fp8::block_scale_inverse(fp8::block_scale(amax)), 1.0f / fp8::block_scale(amax)) << amax;
}

TEST(Fp8Blockwise, RowsRoundTripAndTheirScalesAreTight) {
  const int64_t R = 37, K = 384, KB = K / kBlock, ld = K + 16;
  const std::vector<bf16> x = random_bf16(static_cast<size_t>(R * ld), 2, "x", 3.0);
  std::vector<uint8_t> codes(R * K);
  std::vector<float> scales(R * KB), back(R * K);
  fp8::quantize_rows_blockwise(codes.data(), scales.data(), x.data(), ld, nullptr, 1, R, K);
  fp8::dequantize_rows_blockwise(back.data(), codes.data(), scales.data(), nullptr, 1, R, K);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t kb = 0; kb < KB; ++kb) {
      // One group of R rows: scale(r, kb) at kb * R + r.
      const float scale = scales[kb * R + r];
      float amax = 0;
      for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k) {
        const float want = bf16_to_float(x[r * ld + k]);
        amax = std::max(amax, std::fabs(want));
        expect_round_trip(back[r * K + k], want, scale, "row " + std::to_string(r));
      }
      EXPECT_EQ(scale, fp8::block_scale(amax));
      EXPECT_GT(amax / scale, 224.0f) << "the tile's largest value uses the top binade";
    }
}

TEST(Fp8Blockwise, GroupingByExpertMovesScalesNotCodes) {
  // Ragged experts, empty ones first, in the middle and last, and rows past the last expert.
  const std::vector<int32_t> rows = {0, 5, 130, 0, 1, 64, 0};
  std::vector<int32_t> offsets(rows.size() + 1, 0);
  std::partial_sum(rows.begin(), rows.end(), offsets.begin() + 1);
  const int64_t E = static_cast<int64_t>(rows.size()), kept = offsets[E], R = kept + 3, K = 256, KB = 2;
  const std::vector<bf16> x = random_bf16(static_cast<size_t>(R * K), 3, "x", 1.0);
  std::vector<uint8_t> grouped(R * K, 0xAB), whole(R * K);
  std::vector<float> grouped_scales(R * KB, -1.0f), whole_scales(R * KB);
  fp8::quantize_rows_blockwise(grouped.data(), grouped_scales.data(), x.data(), K, offsets.data(), E, R, K);
  fp8::quantize_rows_blockwise(whole.data(), whole_scales.data(), x.data(), K, nullptr, 1, R, K);
  for (int64_t i = 0; i < kept * K; ++i) ASSERT_EQ(grouped[i], whole[i]) << i;
  for (int64_t i = kept * K; i < R * K; ++i) ASSERT_EQ(grouped[i], 0xAB) << "row past the last expert written";
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int64_t kb = 0; kb < KB; ++kb)
        ASSERT_EQ(grouped_scales[(offsets[e] * KB) + kb * rows[e] + (r - offsets[e])], whole_scales[kb * R + r])
            << "expert " << e << " row " << r;
  for (int64_t i = kept * KB; i < R * KB; ++i) ASSERT_EQ(grouped_scales[i], -1.0f) << "scale past the last expert";
  std::vector<float> back(R * K);
  fp8::dequantize_rows_blockwise(back.data(), grouped.data(), grouped_scales.data(), offsets.data(), E, R, K);
  for (int64_t i = 0; i < kept * K; ++i)
    expect_round_trip(back[i], bf16_to_float(x[i]), whole_scales[(i % K) / kBlock * R + i / K],
                      "grouped row element " + std::to_string(i));
}

TEST(Fp8Blockwise, WeightBlocksAndTheirTransposeAgree) {
  // Edge blocks in both directions (200 = 128 + 72, 136 = 128 + 8).
  const int64_t E = 3, N = 200, K = 136, NB = 2, KB = 2;
  const std::vector<bf16> w = random_bf16(static_cast<size_t>(E * N * K), 4, "w", 0.02);
  std::vector<uint8_t> codes(E * N * K), codes_t(E * K * N);
  std::vector<float> scales(E * NB * KB), scales_t(E * NB * KB), back(E * N * K);
  fp8::quantize_weight_blocks(codes.data(), scales.data(), codes_t.data(), scales_t.data(), w.data(), E, N, K);
  fp8::dequantize_weight_blocks(back.data(), codes.data(), scales.data(), E, N, K);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        float amax = 0;
        for (int64_t n = nb * kBlock; n < std::min(N, (nb + 1) * kBlock); ++n)
          for (int64_t k = kb * kBlock; k < std::min(K, (kb + 1) * kBlock); ++k)
            amax = std::max(amax, std::fabs(bf16_to_float(w[(e * N + n) * K + k])));
        EXPECT_EQ(scales[(e * KB + kb) * NB + nb], fp8::block_scale(amax)) << e << " " << nb << " " << kb;
        EXPECT_EQ(scales_t[(e * NB + nb) * KB + kb], scales[(e * KB + kb) * NB + nb]);
      }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        ASSERT_EQ(codes_t[(e * K + k) * N + n], codes[(e * N + n) * K + k]) << e << " " << n << " " << k;
        expect_round_trip(back[(e * N + n) * K + k], bf16_to_float(w[(e * N + n) * K + k]),
                          scales[(e * KB + k / kBlock) * NB + n / kBlock], "weight");
      }
  }
  // The transposed copy is what quantising W^T directly gives (as [E, K, N] with [E][NB][KB] scales).
  std::vector<bf16> wt(E * K * N);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) wt[(e * K + k) * N + n] = w[(e * N + n) * K + k];
  std::vector<uint8_t> direct(E * K * N);
  std::vector<float> direct_scales(E * NB * KB);
  fp8::quantize_weight_blocks(direct.data(), direct_scales.data(), nullptr, nullptr, wt.data(), E, K, N);
  EXPECT_EQ(direct, codes_t);
  EXPECT_EQ(direct_scales, scales_t);
  // The transposed copy alone, and neither copy refused.
  std::vector<uint8_t> only_t(E * K * N);
  std::vector<float> only_ts(E * NB * KB);
  fp8::quantize_weight_blocks(nullptr, nullptr, only_t.data(), only_ts.data(), w.data(), E, N, K);
  EXPECT_EQ(only_t, codes_t);
  EXPECT_EQ(only_ts, scales_t);
  EXPECT_THROW(fp8::quantize_weight_blocks(nullptr, nullptr, nullptr, nullptr, w.data(), E, N, K), Error);
}

// W1 and W3 written as one gate|up operand (fp8::gate_up_part: the padded experts' GEMMs
// over N = 2F and K = 2F) are exactly what quantising the per-expert concatenation
// [W1_e; W3_e] [2F, D] whole gives, both copies; places that overlap are refused.
TEST(Fp8Blockwise, GateUpPartsAreTheConcatenationQuantisedWhole) {
  const int64_t E = 3, F = 256, D = 384, FB = 2, DB = 3;
  const std::vector<bf16> w1 = random_bf16(static_cast<size_t>(E * F * D), 5, "w1", 0.02);
  const std::vector<bf16> w3 = random_bf16(static_cast<size_t>(E * F * D), 6, "w3", 0.5);
  std::vector<bf16> w13(static_cast<size_t>(E * 2 * F * D));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < F * D; ++i) {
      w13[e * 2 * F * D + i] = w1[e * F * D + i];
      w13[e * 2 * F * D + F * D + i] = w3[e * F * D + i];
    }
  const int64_t C = E * 2 * F * D, S = E * 2 * FB * DB;
  std::vector<uint8_t> whole(C), whole_t(C);
  std::vector<float> whole_s(S), whole_ts(S);
  fp8::quantize_weight_blocks(whole.data(), whole_s.data(), whole_t.data(), whole_ts.data(), w13.data(), E, 2 * F, D);
  std::vector<uint8_t> parts(C, 0xee), parts_t(C, 0xee);
  std::vector<float> parts_s(S, -1.0f), parts_ts(S, -1.0f);
  for (int part = 0; part < 2; ++part) {
    const fp8::GateUpPart stored = fp8::gate_up_part(part, false, F, D), t = fp8::gate_up_part(part, true, F, D);
    fp8::quantize_weight_blocks(parts.data() + stored.codes_offset, parts_s.data() + stored.scales_offset,
                                parts_t.data() + t.codes_offset, parts_ts.data() + t.scales_offset,
                                (part == 0 ? w1 : w3).data(), E, F, D, stored.place, t.place);
  }
  EXPECT_EQ(parts, whole);
  EXPECT_EQ(parts_t, whole_t);
  EXPECT_EQ(parts_s, whole_s);
  EXPECT_EQ(parts_ts, whole_ts);
  // Rows narrower than the copy, and experts closer than their rows, are refused.
  std::vector<uint8_t> codes(C);
  std::vector<float> scales(S);
  EXPECT_THROW(fp8::quantize_weight_blocks(codes.data(), scales.data(), nullptr, nullptr, w1.data(), E, F, D,
                                           {0, D - 8, 0, 0}),
               Error);
  EXPECT_THROW(fp8::quantize_weight_blocks(nullptr, nullptr, codes.data(), scales.data(), w1.data(), E, F, D, {},
                                           {F * D - 1, 0, 0, 0}),
               Error);
  EXPECT_THROW(fp8::quantize_weight_blocks(codes.data(), scales.data(), nullptr, nullptr, w1.data(), E, F, D,
                                           {0, 0, 0, FB - 1}),
               Error);
}

// Token columns (the weight gradients' operands): each expert's rows transposed into its
// own columns, padded to 128 with zero codes; one scale per feature and 128 tokens, the
// tight power of two of that block's values; rows past the last expert ignored.
TEST(Fp8Blockwise, TokenColumnsTransposeEachExpertPaddedTo128) {
  const std::vector<int32_t> rows = {3, 0, 130, 128, 1};
  std::vector<int32_t> offsets(rows.size() + 1, 0);
  std::partial_sum(rows.begin(), rows.end(), offsets.begin() + 1);
  const int64_t E = static_cast<int64_t>(rows.size()), W = 40, ld = W + 8, R = offsets[E] + 2;
  const std::vector<int64_t> P_E1 = fp8::padded_token_offsets(offsets.data(), E);
  EXPECT_EQ(P_E1, (std::vector<int64_t>{0, 128, 128, 384, 512, 640}));
  const int64_t P = P_E1.back() + 64;  // the codes' row stride: a bound past the padded tokens
  const std::vector<bf16> x = random_bf16(static_cast<size_t>(R * ld), 7, "columns", 2.0);
  std::vector<uint8_t> codes(static_cast<size_t>(W * P), 0x7f);  // e4m3's NaN: never a finite value's code
  std::vector<float> scales(static_cast<size_t>(P_E1.back() / kBlock * W), -1.0f);
  fp8::quantize_token_columns(codes.data(), P, scales.data(), x.data(), ld, offsets.data(), E, W);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = offsets[e], n = rows[e], P_e = P_E1[e];
    for (int64_t tb = 0; tb < fp8::blocks(n); ++tb)
      for (int64_t f = 0; f < W; ++f) {
        float amax = 0.0f;
        for (int64_t t = tb * kBlock; t < std::min(n, (tb + 1) * kBlock); ++t)
          amax = std::max(amax, std::fabs(bf16_to_float(x[(first + t) * ld + f])));
        const float scale = scales[fp8::token_column_scale_index(P_e, tb, f, W)];
        ASSERT_EQ(scale, fp8::block_scale(amax)) << "expert " << e << " block " << tb << " feature " << f;
        for (int64_t t = tb * kBlock; t < (tb + 1) * kBlock; ++t) {
          const uint8_t code = codes[f * P + P_e + t];
          if (t >= n) {
            ASSERT_EQ(code, 0) << "padding of expert " << e;
            continue;
          }
          const float want = bf16_to_float(x[(first + t) * ld + f]);
          expect_round_trip(fp8_e4m3_to_float(code) * scale, want, scale, "expert " + std::to_string(e));
        }
      }
  }
  for (int64_t f = 0; f < W; ++f)
    for (int64_t t = 0; t < P; ++t)
      ASSERT_EQ(codes[f * P + t] == 0x7f, t >= P_E1.back()) << "feature " << f << " token " << t;
  for (const float sc : scales) ASSERT_GT(sc, 0.0f) << "a scale left unwritten";
}

// The weight gradient's operands over experts `offsets` (E + 1 values): dy [R, N] and x [R,
// K] random, their token columns a (per-feature scales) and b (b_kind's scales).
struct WeightGradientOperands {
  std::vector<int64_t> P_E1;
  int64_t P = 0;
  std::vector<bf16> dy, x;
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;
};
WeightGradientOperands weight_gradient_operands(const std::vector<int32_t>& offsets, int64_t N, int64_t K,
                                                uint64_t seed, fp8::ColumnScales b_kind) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, R = offsets.back();
  WeightGradientOperands o;
  o.P_E1 = fp8::padded_token_offsets(offsets.data(), E);
  o.P = o.P_E1.back();
  o.dy = random_bf16(static_cast<size_t>(R * N), seed, "dy", 0.5);
  o.x = random_bf16(static_cast<size_t>(R * K), seed + 1, "x", 1.5);
  o.a.resize(static_cast<size_t>(N * o.P));
  o.b.resize(static_cast<size_t>(K * o.P));
  o.sa.resize(static_cast<size_t>(o.P / kBlock * N));
  o.sb.resize(static_cast<size_t>(o.P / kBlock * (b_kind == fp8::ColumnScales::Block ? fp8::blocks(K) : K)));
  fp8::quantize_token_columns(o.a.data(), o.P, o.sa.data(), o.dy.data(), N, offsets.data(), E, N);
  fp8::quantize_token_columns(o.b.data(), o.P, o.sb.data(), o.x.data(), K, offsets.data(), E, K, b_kind);
  return o;
}

// The weight gradient from token columns: dW_e = dy_e^T x_e over the expert's own tokens
// only (padding and other experts add nothing), the blockwise arithmetic against fp64 sums
// of the dequantised values, and close to the unquantised product; an expert without rows
// gets zeros, or keeps what it had when accumulating. Known answer: dy = 1, x = 2.
TEST(Fp8Blockwise, WeightGradientFromTokenColumns) {
  const std::vector<int32_t> rows = {5, 0, 140};
  const std::vector<int32_t> offsets = {0, 5, 5, 145};
  const int64_t E = 3, R = 145, N = 24, K = 40;
  auto [P_E1, P, dy, x, a, b, sa, sb] = weight_gradient_operands(offsets, N, K, 8, fp8::ColumnScales::PerFeature);
  std::vector<float> dw(static_cast<size_t>(E * N * K), 7.0f);
  fp8::weight_gradient_token_columns(dw.data(), a.data(), sa.data(), b.data(), sb.data(), P, P_E1, N, K, false);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        double dequantised = 0, exact = 0, magnitude = 0;
        for (int64_t t = 0; t < rows[e]; ++t) {
          const int64_t tb = t / kBlock, c = P_E1[e] + t;
          dequantised += static_cast<double>(fp8_e4m3_to_float(a[n * P + c]) *
                                             sa[fp8::token_column_scale_index(P_E1[e], tb, n, N)]) *
                         (fp8_e4m3_to_float(b[k * P + c]) * sb[fp8::token_column_scale_index(P_E1[e], tb, k, K)]);
          const double g = bf16_to_float(dy[(offsets[e] + t) * N + n]), v = bf16_to_float(x[(offsets[e] + t) * K + k]);
          exact += g * v;
          magnitude += std::fabs(g * v);
        }
        const float got = dw[(e * N + n) * K + k];
        ASSERT_NEAR(got, dequantised, 1e-5 * magnitude + 1e-30) << "expert " << e << " [" << n << ", " << k << "]";
        ASSERT_NEAR(got, exact, 0.125 * magnitude + 1e-30) << "expert " << e;
        if (rows[e] == 0) ASSERT_EQ(got, 0.0f);
      }
  std::vector<float> kept = dw;
  fp8::weight_gradient_token_columns(dw.data(), a.data(), sa.data(), b.data(), sb.data(), P, P_E1, N, K, true);
  for (size_t i = 0; i < dw.size(); ++i) {
    const int64_t e = static_cast<int64_t>(i) / (N * K);
    if (rows[e] == 0) ASSERT_EQ(dw[i], kept[i]);
    else ASSERT_NEAR(dw[i], 2 * kept[i], 1e-6 * std::fabs(kept[i]) + 1e-30);
  }
  const std::vector<bf16> ones(static_cast<size_t>(R * N), float_to_bf16(1.0f)), twos(static_cast<size_t>(R * K), float_to_bf16(2.0f));
  fp8::quantize_token_columns(a.data(), P, sa.data(), ones.data(), N, offsets.data(), E, N);
  fp8::quantize_token_columns(b.data(), P, sb.data(), twos.data(), K, offsets.data(), E, K);
  fp8::weight_gradient_token_columns(dw.data(), a.data(), sa.data(), b.data(), sb.data(), P, P_E1, N, K, false);
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(dw[(e * N + 3) * K + 5], 2.0f * static_cast<float>(rows[e]));
}

// Block-scaled token columns (ColumnScales::Block, the design for the weight GEMMs' B side):
// one scale per 128 features and 128 tokens (an edge block of 72 features here), at least
// every feature's own scale and equal to the one of the feature holding the block's max,
// codes within the block scale's rounding, padding zero; the layout's every scale written.
TEST(Fp8Blockwise, TokenColumnBlocksShareOneScalePer128Features) {
  const std::vector<int32_t> rows = {3, 0, 130};
  const std::vector<int32_t> offsets = {0, 3, 3, 133};
  const int64_t E = 3, W = 200, R = 133, FB = fp8::blocks(W);
  const std::vector<int64_t> P_E1 = fp8::padded_token_offsets(offsets.data(), E);
  const int64_t P = P_E1.back();
  std::vector<bf16> x = random_bf16(static_cast<size_t>(R * W), 10, "block columns", 1.0);
  x[static_cast<size_t>(5 * W + 17)] = float_to_bf16(300.0f);  // an outlier: its block's scale follows it
  std::vector<uint8_t> codes(static_cast<size_t>(W * P), 0x7f), feature_codes(codes.size());
  std::vector<float> scales(static_cast<size_t>(P / kBlock * FB), -1.0f), feature_scales(static_cast<size_t>(P / kBlock * W));
  fp8::quantize_token_columns(codes.data(), P, scales.data(), x.data(), W, offsets.data(), E, W, fp8::ColumnScales::Block);
  fp8::quantize_token_columns(feature_codes.data(), P, feature_scales.data(), x.data(), W, offsets.data(), E, W);
  for (const float sc : scales) ASSERT_GT(sc, 0.0f) << "a scale left unwritten";
  for (int64_t e = 0; e < E; ++e)
    for (int64_t tb = 0; tb < fp8::blocks(rows[e]); ++tb)
      for (int64_t fb = 0; fb < FB; ++fb) {
        const float scale = scales[fp8::token_column_block_scale_index(P_E1[e], tb, fb * kBlock, W)];
        float amax = 0.0f, widest = 0.0f;
        for (int64_t f = fb * kBlock; f < std::min(W, (fb + 1) * kBlock); ++f) {
          const float own = feature_scales[fp8::token_column_scale_index(P_E1[e], tb, f, W)];
          ASSERT_GE(scale, own) << "feature " << f;
          widest = std::max(widest, own);
          for (int64_t t = tb * kBlock; t < std::min<int64_t>(rows[e], (tb + 1) * kBlock); ++t) {
            const float v = bf16_to_float(x[(offsets[e] + t) * W + f]);
            amax = std::max(amax, std::fabs(v));
            expect_round_trip(fp8_e4m3_to_float(codes[f * P + P_E1[e] + t]) * scale, v, scale, "block");
          }
          for (int64_t t = rows[e]; t < fp8::blocks(rows[e]) * kBlock; ++t) ASSERT_EQ(codes[f * P + P_E1[e] + t], 0);
        }
        ASSERT_EQ(scale, fp8::block_scale(amax)) << "expert " << e << " token block " << tb << " feature block " << fb;
        ASSERT_EQ(scale, widest);
      }
  // Row 5 is expert 2's third token: its first token block, feature block 0.
  EXPECT_EQ(scales[fp8::token_column_block_scale_index(P_E1[2], 0, 17, W)], fp8::block_scale(300.0f));
  EXPECT_LT(feature_scales[fp8::token_column_scale_index(P_E1[2], 0, 18, W)], fp8::block_scale(300.0f));
}

// The weight gradient with block-scaled B: the GEMM reference is the per-feature one with
// each feature's scale its block's (bit for bit), and the fp64 sum of the dequantised values.
TEST(Fp8Blockwise, WeightGradientWithBlockScaledB) {
  const std::vector<int32_t> offsets = {0, 5, 5, 145};
  const int64_t E = 3, N = 24, K = 160;
  const auto [P_E1, P, dy, x, a, b, sa, sb] = weight_gradient_operands(offsets, N, K, 11, fp8::ColumnScales::Block);
  std::vector<float> dw(static_cast<size_t>(E * N * K)), expanded_dw(dw.size());
  fp8::weight_gradient_token_columns(dw.data(), a.data(), sa.data(), b.data(), sb.data(), P, P_E1, N, K, false,
                                     fp8::ColumnScales::Block);
  std::vector<float> expanded(static_cast<size_t>(P / kBlock * K));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t tb = 0; tb < (P_E1[e + 1] - P_E1[e]) / kBlock; ++tb)
      for (int64_t k = 0; k < K; ++k)
        expanded[fp8::token_column_scale_index(P_E1[e], tb, k, K)] =
            sb[fp8::token_column_block_scale_index(P_E1[e], tb, k, K)];
  fp8::weight_gradient_token_columns(expanded_dw.data(), a.data(), sa.data(), b.data(), expanded.data(), P, P_E1, N, K,
                                     false);
  EXPECT_EQ(dw, expanded_dw);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        double dequantised = 0, magnitude = 0;
        for (int64_t t = 0; t < offsets[e + 1] - offsets[e]; ++t) {
          const int64_t tb = t / kBlock, c = P_E1[e] + t;
          const double term = static_cast<double>(fp8_e4m3_to_float(a[n * P + c]) *
                                                  sa[fp8::token_column_scale_index(P_E1[e], tb, n, N)]) *
                              (fp8_e4m3_to_float(b[k * P + c]) * sb[fp8::token_column_block_scale_index(P_E1[e], tb, k, K)]);
          dequantised += term;
          magnitude += std::fabs(term);
        }
        ASSERT_NEAR(dw[(e * N + n) * K + k], dequantised, 1e-5 * magnitude + 1e-30) << "expert " << e;
      }
}

TEST(Fp8Blockwise, RefusesKThatIsNotAMultipleOf128) {
  std::vector<bf16> x(200);
  std::vector<uint8_t> codes(200);
  std::vector<float> scales(2);
  test::expect_one_line_error<Error>(
      [&] { fp8::quantize_rows_blockwise(codes.data(), scales.data(), x.data(), 200, nullptr, 1, 1, 200); },
      {"K = 200", "multiple of 128"});
}

// The rule that sends a dense projection to fp8 or keeps it bf16 (the model's fallback,
// docs/FP8.md): every constraint of DenseGemmFp8 and of the row quantisation on its own.
TEST(Fp8Blockwise, DenseGemmFitsOnlyTheShapesTheDenseKernelTakes) {
  EXPECT_TRUE(fp8::dense_gemm_fits(128, 576, 384, 384, 576));   // GQA q|k|v forward: N of 4.5 blocks is fine
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 384, 576, 576, 384));  // its data gradient: K = 576 is not
  EXPECT_TRUE(fp8::dense_gemm_fits(4, 8, 128, 128, 8));
  EXPECT_FALSE(fp8::dense_gemm_fits(126, 256, 128, 128, 256));  // M: TMA rows of the [KB][M] scales
  EXPECT_FALSE(fp8::dense_gemm_fits(0, 256, 128, 128, 256));
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 196, 128, 128, 200));  // N
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 192, 128, 128, 196));  // ldc
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 192, 128, 128, 128));  // ldc < N
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 192, 128, 132, 192));  // lda
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 192, 128, 64, 192));   // lda < K
  EXPECT_TRUE(fp8::dense_gemm_fits(128, 192, 128, 384, 384));   // FFN gate (ld 2F) beside up
  EXPECT_FALSE(fp8::dense_gemm_fits(128, 192, 200, 200, 192));  // K
}

}  // namespace
}  // namespace moe
