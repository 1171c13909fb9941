// The FP8 GEMMs with blockwise scaling (kernels/fp8_gpu_ops.h): the quantisation kernels
// against the CPU reference (kernels/fp8_blockwise.h) bit for bit, and each GEMM against
// an fp32-or-better reference computed from the dequantised inputs (the same codes and
// scales), on ragged experts with empty ones, rows past the last expert, partial tiles,
// edge blocks, two sets, accumulation; K not a multiple of 128 refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>

#include "core/error.h"
#include "core/rng.h"
#include "expect_error.h"
#include "fp8_gemm_test_util.h"
#include "gpu_test_util.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe {
namespace {

using fp8::kBlock;
using test::activations;
using test::expect_gemm_close;
using test::expect_same;
using test::weights;

// ---------------------------------------------------------------------------------------
// Quantisation kernels against the CPU reference.

// Both kernel paths: 16-byte loads (row stride a multiple of 8, rows 16-byte aligned) and
// 8-byte ones (stride K + 4, or the rows starting 8 bytes past a 16-byte boundary); and the
// tiles' expert found by the tile's lanes together in one round (8 experts), in several
// (40: lanes of 16 take three rounds, of 32 two), or by one lane's binary search (70).
TEST(GpuFp8Quantize, RowsMatchTheCpuBitForBit) {
  MOE_REQUIRE_GPU();
  auto many = [](int n) {
    std::vector<int32_t> rows(static_cast<size_t>(n));
    for (int e = 0; e < n; ++e) rows[static_cast<size_t>(e)] = e % 5 == 2 ? 0 : (e * 37) % 23 + 1;
    return rows;
  };
  for (const std::vector<int32_t>& rows : {std::vector<int32_t>{0, 5, 130, 0, 1, 64, 0, 300}, many(40), many(70)}) {
    for (const int64_t ld : {int64_t{384 + 64}, int64_t{384 + 4}})
      for (const int64_t shift : {0, 4}) {
        const std::vector<int32_t> offsets = offsets_of(rows);
        const int64_t E = static_cast<int64_t>(rows.size()), kept = offsets[E], R = kept + 7, K = 384, KB = 3;
        auto offsets_d = to_device(offsets);
        std::vector<bf16> x = activations(R, ld, 1);
        x[3 * ld + 5] = float_to_bf16(INFINITY);  // saturates to 448 * scale 1
        for (int64_t k = 0; k < kBlock; ++k) x[10 * ld + k] = bf16{0};  // a tile of zeros: scale 1, codes 0
        std::vector<bf16> shifted(static_cast<size_t>(shift), bf16{0});
        shifted.insert(shifted.end(), x.begin(), x.end());
        auto x_d = to_device(shifted);
        for (const bool grouped : {true, false}) {
          std::vector<uint8_t> want_codes(R * K, 0xff);
          std::vector<float> want_scales(R * KB);
          std::memset(want_scales.data(), 0xff, want_scales.size() * sizeof(float));
          fp8::quantize_rows_blockwise(want_codes.data(), want_scales.data(), x.data(), ld,
                                       grouped ? offsets.data() : nullptr, E, R, K);
          auto codes_d = poisoned<uint8_t>(R * K);
          auto scales_d = poisoned<float>(R * KB);
          cuda::quantize_rows_blockwise(codes_d.data(), scales_d.data(), x_d.data() + shift, ld,
                                        grouped ? offsets_d.data() : nullptr, E, R, K, nullptr);
          const std::string what = std::string(grouped ? "grouped rows" : "one group") + ", " + std::to_string(E) +
                                   " experts, stride " + std::to_string(ld) + ", shift " + std::to_string(shift);
          // All R * K entries: the rows past offsets[E] must still hold the poison on both sides.
          expect_same(to_host(codes_d), want_codes, R * K, what + " codes");
          expect_same(to_host(scales_d), want_scales, R * KB, what + " scales");
        }
      }
  }
}

TEST(GpuFp8Quantize, WeightBlocksAndTheirTransposeMatchTheCpuBitForBit) {
  MOE_REQUIRE_GPU();
  // Edge blocks along N and K; K not a multiple of 8 and N not a multiple of 4 (the
  // bytewise paths); whole blocks over several experts; and (shift 4: the weights 8 bytes
  // past a 16-byte boundary) the bytewise loads on a shape that would take the vector ones.
  for (const auto& [E, N, K, shift] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{3, 200, 136, 0}, {2, 256, 384, 0}, {1, 8, 1000, 0},
        {2, 130, 258, 0}, {1, 127, 129, 0}, {4, 384, 256, 0}, {2, 256, 384, 4}}) {
    const int64_t S = E * fp8::blocks(N) * fp8::blocks(K);
    const std::vector<bf16> w = weights(E, N, K, 2);
    std::vector<uint8_t> codes(E * N * K), codes_t(E * K * N);
    std::vector<float> scales(S), scales_t(S);
    fp8::quantize_weight_blocks(codes.data(), scales.data(), codes_t.data(), scales_t.data(), w.data(), E, N, K);
    std::vector<bf16> shifted(static_cast<size_t>(shift), bf16{0});
    shifted.insert(shifted.end(), w.begin(), w.end());
    auto w_shifted_d = to_device(shifted);
    const bf16* w_at = w_shifted_d.data() + shift;
    auto codes_d = poisoned<uint8_t>(E * N * K), codes_t_d = poisoned<uint8_t>(E * K * N);
    auto scales_d = poisoned<float>(S), scales_t_d = poisoned<float>(S);
    cuda::quantize_weight_blocks(codes_d.data(), scales_d.data(), codes_t_d.data(), scales_t_d.data(), w_at, E,
                                 N, K, nullptr);
    const std::string what = "[" + std::to_string(E) + ", " + std::to_string(N) + ", " + std::to_string(K) +
                             "], shift " + std::to_string(shift);
    expect_same(to_host(codes_d), codes, codes.size(), what + " codes");
    expect_same(to_host(codes_t_d), codes_t, codes_t.size(), what + " transposed codes");
    expect_same(to_host(scales_d), scales, scales.size(), what + " scales");
    expect_same(to_host(scales_t_d), scales_t, scales_t.size(), what + " transposed scales");
    // The transposed copy alone (the data gradients' use): the same bits.
    auto only_t_d = poisoned<uint8_t>(E * K * N);
    auto only_ts_d = poisoned<float>(S);
    cuda::quantize_weight_blocks(nullptr, nullptr, only_t_d.data(), only_ts_d.data(), w_at, E, N, K, nullptr);
    expect_same(to_host(only_t_d), codes_t, codes_t.size(), what + " transposed codes alone");
    expect_same(to_host(only_ts_d), scales_t, scales_t.size(), what + " transposed scales alone");
    // The copy as stored alone (the forward's use without the weight cache).
    auto only_d = poisoned<uint8_t>(E * N * K);
    auto only_s_d = poisoned<float>(S);
    cuda::quantize_weight_blocks(only_d.data(), only_s_d.data(), nullptr, nullptr, w_at, E, N, K, nullptr);
    expect_same(to_host(only_d), codes, codes.size(), what + " codes alone");
    expect_same(to_host(only_s_d), scales, scales.size(), what + " scales alone");
  }
  // W1 and W3 placed as one gate|up operand (fp8::gate_up_part), as the padded experts'
  // weight cache writes them: the CPU's bits, every byte between the parts written.
  for (const auto& [E, F, D] : {std::tuple<int64_t, int64_t, int64_t>{3, 256, 384}, {2, 128, 1000}}) {
    const int64_t C = E * 2 * F * D, S = E * 2 * fp8::blocks(F) * fp8::blocks(D);
    std::vector<uint8_t> codes(C, 0xee), codes_t(C, 0xee);
    std::vector<float> scales(S, -1.0f), scales_t(S, -1.0f);
    auto codes_d = poisoned<uint8_t>(C), codes_t_d = poisoned<uint8_t>(C);
    auto scales_d = poisoned<float>(S), scales_t_d = poisoned<float>(S);
    for (int part = 0; part < 2; ++part) {
      const std::vector<bf16> w = weights(E, F, D, 3 + part);
      const fp8::GateUpPart p = fp8::gate_up_part(part, false, F, D), t = fp8::gate_up_part(part, true, F, D);
      fp8::quantize_weight_blocks(codes.data() + p.codes_offset, scales.data() + p.scales_offset,
                                  codes_t.data() + t.codes_offset, scales_t.data() + t.scales_offset, w.data(), E, F,
                                  D, p.place, t.place);
      auto w_d = to_device(w);
      cuda::quantize_weight_blocks(codes_d.data() + p.codes_offset, scales_d.data() + p.scales_offset,
                                   codes_t_d.data() + t.codes_offset, scales_t_d.data() + t.scales_offset, w_d.data(),
                                   E, F, D, nullptr, p.place, t.place);
    }
    const std::string what = "gate|up [" + std::to_string(E) + ", 2 x " + std::to_string(F) + ", " +
                             std::to_string(D) + "]";
    expect_same(to_host(codes_d), codes, codes.size(), what + " codes");
    expect_same(to_host(codes_t_d), codes_t, codes_t.size(), what + " transposed codes");
    expect_same(to_host(scales_d), scales, scales.size(), what + " scales");
    expect_same(to_host(scales_t_d), scales_t, scales_t.size(), what + " transposed scales");
    // The two parts tile both scale grids (a scale is a positive power of two).
    EXPECT_EQ(std::count(scales.begin(), scales.end(), -1.0f) + std::count(scales_t.begin(), scales_t.end(), -1.0f), 0)
        << what;
  }
}

// SwiGLU fused with the quantisation of its output: act bit for bit swiglu_forward's, the
// codes and scales bit for bit the CPU's quantisation of that act, over ragged experts
// with empty ones and rows past the last (act still written there, codes not); without
// act (null) the same codes and the act buffer untouched.
// Row r's gates: past the sigmoid's plain range (1 + exp(-g) >= 2^126 from g < -87.3) in
// some groups of 8, mixed in others, plain in the rest (swiglu_sigmoid_n's two paths).
void set_edge_gates(std::vector<bf16>& gate_up_RF2, int64_t r, int64_t F) {
  const float gates[] = {-1e30f, -1e4f, -200.0f, -100.0f, -89.0f, -88.5f, -88.0f, -87.5f,  // all past it
                         -87.0f, -60.0f, -1.0f,  0.0f,    -95.0f, 60.0f,  100.0f, 1e4f,    // one
                         -87.0f, -60.0f, -1.0f,  0.0f,    1.0f,   60.0f,  100.0f, 1e4f};   // none
  for (int64_t f = 0; f < F; ++f) gate_up_RF2[static_cast<size_t>(r * 2 * F + f)] = float_to_bf16(gates[f % 24]);
}

TEST(GpuFp8Quantize, SwigluFusedWithTheQuantisationMatchesBoth) {
  MOE_REQUIRE_GPU();
  const std::vector<int32_t> rows = {3, 0, 70, 1, 0, 40};
  const std::vector<int32_t> offsets = offsets_of(rows);
  const int64_t E = static_cast<int64_t>(rows.size()), R = offsets[E] + 5, F = 256, FB = 2;
  // Gate and up with a magnitude per 128 columns and row (act's tiles get their own scales).
  std::vector<bf16> gate_up = activations(R, 2 * F, 3);
  for (int64_t f = 0; f < 2 * F; ++f) gate_up[static_cast<size_t>(7 * 2 * F + f)] = bf16{0};  // a row of zeros
  set_edge_gates(gate_up, 2, F);
  auto gate_up_d = to_device(gate_up);
  auto offsets_d = to_device(offsets);
  auto act_d = poisoned<bf16>(R * F);
  cuda::swiglu_forward(act_d.data(), gate_up_d.data(), R, F, nullptr);
  const std::vector<bf16> act = to_host(act_d);
  std::vector<uint8_t> want_codes(R * F, 0xff);
  std::vector<float> want_scales(R * FB);
  std::memset(want_scales.data(), 0xff, want_scales.size() * sizeof(float));
  fp8::quantize_rows_blockwise(want_codes.data(), want_scales.data(), act.data(), F, offsets.data(), E, R, F);
  for (const bool write_act : {true, false}) {
    auto fused_act_d = poisoned<bf16>(R * F);
    auto codes_d = poisoned<uint8_t>(R * F);
    auto scales_d = poisoned<float>(R * FB);
    cuda::swiglu_forward_fp8(write_act ? fused_act_d.data() : nullptr, codes_d.data(), scales_d.data(),
                             gate_up_d.data(), offsets_d.data(), E, R, F, nullptr);
    const std::string what = write_act ? "with act" : "without act";
    expect_same(to_host(codes_d), want_codes, R * F, what + ": codes");
    expect_same(to_host(scales_d), want_scales, R * FB, what + ": scales");
    const std::vector<bf16> fused_act = to_host(fused_act_d);
    if (write_act) {
      expect_same(fused_act, act, R * F, "act");
    } else {
      size_t written = 0;
      for (const bf16& v : fused_act) written += v.bits != 0xffff;
      EXPECT_EQ(written, 0u) << "act written though not asked for";
    }
  }
}

// SwiGLU's backward fused with the quantisation of d gate and d up: the bf16 gradients bit
// for bit swiglu_backward's (every row), each one's codes and scales bit for bit the CPU's
// quantisation of those bf16 values (rows below the last expert's only), d up's after d
// gate's in the scratch.
TEST(GpuFp8Quantize, SwigluBackwardFusedWithTheQuantisationMatchesBoth) {
  MOE_REQUIRE_GPU();
  const std::vector<int32_t> rows = {2, 0, 65, 1, 0, 37};
  const std::vector<int32_t> offsets = offsets_of(rows);
  const int64_t E = static_cast<int64_t>(rows.size()), R = offsets[E] + 3, F = 384, FB = 3;
  std::vector<bf16> gate_up = activations(R, 2 * F, 5);
  const std::vector<bf16> dact = activations(R, F, 6);
  for (int64_t f = 0; f < 2 * F; ++f) gate_up[static_cast<size_t>(4 * 2 * F + f)] = bf16{0};  // zero gradients
  set_edge_gates(gate_up, 1, F);
  auto gate_up_d = to_device(gate_up);
  auto dact_d = to_device(dact);
  auto offsets_d = to_device(offsets);
  auto want_d = poisoned<bf16>(R * 2 * F);
  cuda::swiglu_backward(want_d.data(), dact_d.data(), gate_up_d.data(), R, F, nullptr);
  const std::vector<bf16> want = to_host(want_d);
  std::vector<uint8_t> want_codes(2 * R * F, 0xff);
  std::vector<float> want_scales(2 * R * FB);
  std::memset(want_scales.data(), 0xff, want_scales.size() * sizeof(float));
  for (int64_t s = 0; s < 2; ++s)
    fp8::quantize_rows_blockwise(want_codes.data() + s * R * F, want_scales.data() + s * R * FB, want.data() + s * F,
                                 2 * F, offsets.data(), E, R, F);
  auto got_d = poisoned<bf16>(R * 2 * F);
  auto codes_d = poisoned<uint8_t>(2 * R * F);
  auto scales_d = poisoned<float>(2 * R * FB);
  cuda::swiglu_backward_fp8(got_d.data(), codes_d.data(), scales_d.data(), dact_d.data(), gate_up_d.data(),
                            offsets_d.data(), E, R, F, nullptr);
  expect_same(to_host(got_d), want, want.size(), "d gate | d up");
  expect_same(to_host(codes_d), want_codes, want_codes.size(), "codes");
  expect_same(to_host(scales_d), want_scales, want_scales.size(), "scales");
  // One group (rows padded per expert): d gate | d up as one [R, 2F] operand, every row.
  std::vector<uint8_t> whole_codes(2 * R * F);
  std::vector<float> whole_scales(2 * R * FB);
  fp8::quantize_rows_blockwise(whole_codes.data(), whole_scales.data(), want.data(), 2 * F, nullptr, 1, R, 2 * F);
  auto one_codes_d = poisoned<uint8_t>(2 * R * F);
  auto one_scales_d = poisoned<float>(2 * R * FB);
  cuda::swiglu_backward_fp8(got_d.data(), one_codes_d.data(), one_scales_d.data(), dact_d.data(), gate_up_d.data(),
                            nullptr, 1, R, F, nullptr);
  expect_same(to_host(one_codes_d), whole_codes, whole_codes.size(), "one group's codes");
  expect_same(to_host(one_scales_d), whole_scales, whole_scales.size(), "one group's scales");
  EXPECT_THROW(cuda::swiglu_backward_fp8(got_d.data(), codes_d.data(), scales_d.data(), dact_d.data(),
                                         gate_up_d.data(), offsets_d.data(), E, R, 200, nullptr),
               Error);
}

// The weight gradients' operands: padded offsets and the transposing quantiser bit for bit
// the CPU's (ragged experts with empty ones, a last expert of one row, rows past the last,
// a feature count that ends inside a 128-block), columns past the padded tokens untouched;
// with one scale per feature and with one per 128 x 128 block (ColumnScales::Block).
class GpuFp8TokenColumns : public ::testing::TestWithParam<fp8::ColumnScales> {};

TEST_P(GpuFp8TokenColumns, MatchTheCpu) {
  MOE_REQUIRE_GPU();
  const fp8::ColumnScales kind = GetParam();
  const std::vector<int32_t> rows = {3, 0, 130, 128, 0, 1};
  const std::vector<int32_t> offsets = offsets_of(rows);
  const int64_t E = static_cast<int64_t>(rows.size()), R = offsets[E] + 4, W = 200, ld_x = 208;
  const int64_t ld_t = (R + E * 127 + 15) / 16 * 16;
  std::vector<bf16> x = activations(R, ld_x, 11);
  x[static_cast<size_t>(7 * ld_x + 150)] = float_to_bf16(-90.0f);  // the second feature block's amax
  const std::vector<int64_t> P_E1 = fp8::padded_token_offsets(offsets.data(), E);
  std::vector<uint8_t> want_codes(static_cast<size_t>(W * ld_t), 0xff);
  const int64_t scales_per_block = kind == fp8::ColumnScales::Block ? fp8::blocks(W) : W;
  std::vector<float> want_scales(static_cast<size_t>(P_E1.back() / kBlock * scales_per_block));
  std::memset(want_scales.data(), 0xff, want_scales.size() * sizeof(float));
  fp8::quantize_token_columns(want_codes.data(), ld_t, want_scales.data(), x.data(), ld_x, offsets.data(), E, W, kind);
  auto x_d = to_device(x);
  auto offsets_d = to_device(offsets);
  gpu::DeviceArray<int64_t> P_d(static_cast<size_t>(E + 1));
  cuda::padded_token_offsets(P_d.data(), offsets_d.data(), E, nullptr);
  EXPECT_EQ(to_host(P_d), P_E1);
  auto codes_d = poisoned<uint8_t>(W * ld_t);
  auto scales_d = poisoned<float>(want_scales.size());
  cuda::quantize_token_columns(codes_d.data(), ld_t, scales_d.data(), x_d.data(), ld_x, offsets_d.data(), P_d.data(), E,
                               R, W, nullptr, kind);
  expect_same(to_host(codes_d), want_codes, want_codes.size(), "codes");
  expect_same(to_host(scales_d), want_scales, want_scales.size(), "scales");
  EXPECT_THROW(cuda::quantize_token_columns(codes_d.data(), ld_t - 16 * 64, scales_d.data(), x_d.data(), ld_x,
                                            offsets_d.data(), P_d.data(), E, R, W, nullptr),
               Error);
}

INSTANTIATE_TEST_SUITE_P(Scales, GpuFp8TokenColumns,
                         ::testing::Values(fp8::ColumnScales::PerFeature, fp8::ColumnScales::Block));

// SwiGLU's backward for the fp8 weight gradients: d gate's and d up's row codes and scales
// those of swiglu_backward_fp8 bit for bit (rows below offsets[E]); the token columns of
// act, d gate and d up those of the CPU's quantize_token_columns over swiglu_forward's and
// swiglu_backward's bf16 outputs (ragged experts, empty ones, one past 128 rows).
// act's columns with per-feature and with block scales (ColumnScales::Block).
class GpuFp8SwigluColumns : public ::testing::TestWithParam<fp8::ColumnScales> {};

TEST_P(GpuFp8SwigluColumns, MatchTheUnfusedPath) {
  MOE_REQUIRE_GPU();
  const fp8::ColumnScales act_kind = GetParam();
  const std::vector<int32_t> rows = {2, 0, 165, 1, 0, 37};
  const std::vector<int32_t> offsets = offsets_of(rows);
  const int64_t E = static_cast<int64_t>(rows.size()), R = offsets[E] + 3, F = 384, FB = 3;
  const int64_t ld_t = (R + E * 127 + 15) / 16 * 16;
  std::vector<bf16> gate_up = activations(R, 2 * F, 7);
  const std::vector<bf16> dact = activations(R, F, 8);
  for (int64_t f = 0; f < 2 * F; ++f) gate_up[static_cast<size_t>(4 * 2 * F + f)] = bf16{0};  // zero gradients
  set_edge_gates(gate_up, 1, F);
  auto gate_up_d = to_device(gate_up);
  auto dact_d = to_device(dact);
  auto offsets_d = to_device(offsets);
  // The unfused path: bf16 act and d gate | d up, the row codes, and on the CPU the columns.
  auto act_d = poisoned<bf16>(R * F), dgu_d = poisoned<bf16>(R * 2 * F);
  cuda::swiglu_forward(act_d.data(), gate_up_d.data(), R, F, nullptr);
  auto want_codes_d = poisoned<uint8_t>(2 * R * F);
  auto want_scales_d = poisoned<float>(2 * R * FB);
  cuda::swiglu_backward_fp8(dgu_d.data(), want_codes_d.data(), want_scales_d.data(), dact_d.data(), gate_up_d.data(),
                            offsets_d.data(), E, R, F, nullptr);
  const std::vector<bf16> act = to_host(act_d), dgu = to_host(dgu_d);
  const std::vector<int64_t> P_E1 = fp8::padded_token_offsets(offsets.data(), E);
  const int64_t blocks = (ld_t + kBlock - 1) / kBlock;
  std::vector<uint8_t> want_columns(static_cast<size_t>(3 * F * ld_t), 0xff);
  std::vector<float> want_column_scales(static_cast<size_t>(3 * F * blocks));
  std::memset(want_column_scales.data(), 0xff, want_column_scales.size() * sizeof(float));
  const bf16* sources[3] = {act.data(), dgu.data(), dgu.data() + F};
  const int64_t ld_sources[3] = {F, 2 * F, 2 * F};
  for (int o = 0; o < 3; ++o)
    fp8::quantize_token_columns(want_columns.data() + o * F * ld_t, ld_t, want_column_scales.data() + o * F * blocks,
                                sources[o], ld_sources[o], offsets.data(), E, F,
                                o == 0 ? act_kind : fp8::ColumnScales::PerFeature);
  auto P_d = to_device(P_E1);
  auto codes_d = poisoned<uint8_t>(2 * R * F);
  auto scales_d = poisoned<float>(2 * R * FB);
  auto columns_d = poisoned<uint8_t>(3 * F * ld_t);
  auto column_scales_d = poisoned<float>(3 * F * blocks);
  cuda::swiglu_backward_fp8_columns(codes_d.data(), scales_d.data(), columns_d.data(), column_scales_d.data(), ld_t,
                                    dact_d.data(), gate_up_d.data(), offsets_d.data(), P_d.data(), E, R, F, nullptr,
                                    act_kind);
  // Rows below offsets[E] only (neither kernel writes the others), in both sets.
  const int64_t kept = offsets[E];
  const std::vector<uint8_t> codes = to_host(codes_d), want_codes = to_host(want_codes_d);
  const std::vector<float> scales = to_host(scales_d), want_scales = to_host(want_scales_d);
  for (int64_t set = 0; set < 2; ++set) {
    const std::vector<uint8_t> got(codes.begin() + set * R * F, codes.begin() + set * R * F + kept * F);
    const std::vector<uint8_t> want(want_codes.begin() + set * R * F, want_codes.begin() + set * R * F + kept * F);
    expect_same(got, want, want.size(), "row codes of set " + std::to_string(set));
    const std::vector<float> got_s(scales.begin() + set * R * FB, scales.begin() + set * R * FB + kept * FB);
    const std::vector<float> want_s(want_scales.begin() + set * R * FB, want_scales.begin() + set * R * FB + kept * FB);
    expect_same(got_s, want_s, want_s.size(), "row scales of set " + std::to_string(set));
  }
  // Each operand's columns up to the padded tokens, and its scales.
  const std::vector<uint8_t> columns = to_host(columns_d);
  const std::vector<float> column_scales = to_host(column_scales_d);
  for (int o = 0; o < 3; ++o) {
    std::vector<uint8_t> got, want;
    for (int64_t f = 0; f < F; ++f)
      for (int64_t t = 0; t < P_E1.back(); ++t) {
        const size_t at = static_cast<size_t>((o * F + f) * ld_t + t);
        got.push_back(columns[at]);
        want.push_back(want_columns[at]);
      }
    expect_same(got, want, want.size(), "token columns of operand " + std::to_string(o));
    const int64_t per_token_block = o == 0 && act_kind == fp8::ColumnScales::Block ? FB : F;
    const size_t n = static_cast<size_t>(P_E1.back() / kBlock * per_token_block),
                 base = static_cast<size_t>(o * F * blocks);
    const std::vector<float> got_s(column_scales.begin() + base, column_scales.begin() + base + n);
    const std::vector<float> want_s(want_column_scales.begin() + base, want_column_scales.begin() + base + n);
    expect_same(got_s, want_s, n, "token column scales of operand " + std::to_string(o));
  }
  // Rows padded per expert (RowScales::OneGroup): the row codes as swiglu_backward_fp8 with
  // no offsets lays them out (d gate | d up one [R, 2F] operand), rows below offsets[E].
  auto one_codes_d = poisoned<uint8_t>(2 * R * F), want_one_codes_d = poisoned<uint8_t>(2 * R * F);
  auto one_scales_d = poisoned<float>(2 * R * FB), want_one_scales_d = poisoned<float>(2 * R * FB);
  cuda::swiglu_backward_fp8(dgu_d.data(), want_one_codes_d.data(), want_one_scales_d.data(), dact_d.data(),
                            gate_up_d.data(), nullptr, 1, R, F, nullptr);
  cuda::swiglu_backward_fp8_columns(one_codes_d.data(), one_scales_d.data(), columns_d.data(), column_scales_d.data(),
                                    ld_t, dact_d.data(), gate_up_d.data(), offsets_d.data(), P_d.data(), E, R, F,
                                    nullptr, act_kind, fp8::RowScales::OneGroup);
  const std::vector<uint8_t> one_codes = to_host(one_codes_d), want_one_codes = to_host(want_one_codes_d);
  const std::vector<float> one_scales = to_host(one_scales_d), want_one_scales = to_host(want_one_scales_d);
  expect_same(std::vector<uint8_t>(one_codes.begin(), one_codes.begin() + kept * 2 * F),
              std::vector<uint8_t>(want_one_codes.begin(), want_one_codes.begin() + kept * 2 * F), kept * 2 * F,
              "one group's row codes");
  for (int64_t kb = 0; kb < 2 * FB; ++kb)
    expect_same(std::vector<float>(one_scales.begin() + kb * R, one_scales.begin() + kb * R + kept),
                std::vector<float>(want_one_scales.begin() + kb * R, want_one_scales.begin() + kb * R + kept), kept,
                "one group's row scales, block " + std::to_string(kb));
  EXPECT_THROW(cuda::swiglu_backward_fp8_columns(codes_d.data(), scales_d.data(), columns_d.data(),
                                                 column_scales_d.data(), ld_t - 16 * 64, dact_d.data(),
                                                 gate_up_d.data(), offsets_d.data(), P_d.data(), E, R, F, nullptr),
               Error);
}

INSTANTIATE_TEST_SUITE_P(ActScales, GpuFp8SwigluColumns,
                         ::testing::Values(fp8::ColumnScales::PerFeature, fp8::ColumnScales::Block));

// The fp8 weight-gradient GEMM against the CPU's blockwise arithmetic on the same codes
// (expect_gemm_close's bound, sum |a b| from the codes' magnitudes): fp32 and bf16
// gradients, beta 0 (experts without tokens zeroed) and beta 1 (added).
// b's scales per feature and per 128 x 128 block (ColumnScales::Block: the forward's
// kernel type, the design for the weight GEMMs' B side).
class GpuExpertWeightGemmFp8 : public ::testing::TestWithParam<fp8::ColumnScales> {};

TEST_P(GpuExpertWeightGemmFp8, MatchesTheCpuOnTokenColumns) {
  MOE_REQUIRE_GPU();
  const fp8::ColumnScales b_kind = GetParam();
  const std::vector<int32_t> rows = {70, 0, 300, 1};
  const std::vector<int32_t> offsets = offsets_of(rows);
  const int64_t E = static_cast<int64_t>(rows.size()), R = offsets[E], M = 256, N = 256;
  const int64_t ld_t = (R + E * 127 + 15) / 16 * 16;
  const std::vector<bf16> dy = activations(R, M, 21), x = activations(R, N, 22);
  const std::vector<int64_t> P_E1 = fp8::padded_token_offsets(offsets.data(), E);
  std::vector<uint8_t> a(static_cast<size_t>(M * ld_t)), b(static_cast<size_t>(N * ld_t));
  const int64_t b_scales = b_kind == fp8::ColumnScales::Block ? fp8::blocks(N) : N;
  std::vector<float> sa(static_cast<size_t>(P_E1.back() / kBlock * M)),
      sb(static_cast<size_t>(P_E1.back() / kBlock * b_scales));
  fp8::quantize_token_columns(a.data(), ld_t, sa.data(), dy.data(), M, offsets.data(), E, M);
  fp8::quantize_token_columns(b.data(), ld_t, sb.data(), x.data(), N, offsets.data(), E, N, b_kind);
  std::vector<float> want(static_cast<size_t>(E * M * N)), abs_sum(want.size());
  fp8::weight_gradient_token_columns(want.data(), a.data(), sa.data(), b.data(), sb.data(), ld_t, P_E1, M, N, false,
                                     b_kind);
  // The same sums over |a| |b|: an e4m3 code's magnitude is its low 7 bits.
  std::vector<uint8_t> a_abs = a, b_abs = b;
  for (uint8_t& c : a_abs) c &= 0x7f;
  for (uint8_t& c : b_abs) c &= 0x7f;
  fp8::weight_gradient_token_columns(abs_sum.data(), a_abs.data(), sa.data(), b_abs.data(), sb.data(), ld_t, P_E1, M,
                                     N, false, b_kind);
  const std::vector<double> want_d(want.begin(), want.end()), abs_d(abs_sum.begin(), abs_sum.end());
  std::vector<double> want2_d(want_d), abs2_d(abs_d);
  for (double& v : want2_d) v *= 2;
  for (double& v : abs2_d) v *= 2;
  auto a_d = to_device(a), b_d = to_device(b);
  auto sa_d = to_device(sa), sb_d = to_device(sb);
  auto P_d = to_device(P_E1);
  cuda::ExpertWeightGemmFp8 gemm(E);
  auto dw_d = poisoned<float>(E * M * N);
  gemm.run(dw_d.data(), a_d.data(), sa_d.data(), b_d.data(), sb_d.data(), ld_t, P_d.data(), E, M, N, 0.0f, nullptr,
           b_kind);
  const std::vector<float> once = to_host(dw_d);
  expect_gemm_close("fp8 weight gradients", once, want_d, abs_d);
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(once[static_cast<size_t>(M * N + i)], 0.0f) << "expert 1 not zeroed";
  gemm.run(dw_d.data(), a_d.data(), sa_d.data(), b_d.data(), sb_d.data(), ld_t, P_d.data(), E, M, N, 1.0f, nullptr,
           b_kind);
  std::vector<float> twice = to_host(dw_d);
  expect_gemm_close("fp8 weight gradients, accumulated", twice, want2_d, abs2_d);
  auto dw16_d = poisoned<bf16>(E * M * N);
  gemm.run(dw16_d.data(), a_d.data(), sa_d.data(), b_d.data(), sb_d.data(), ld_t, P_d.data(), E, M, N, 0.0f, nullptr,
           b_kind);
  const std::vector<bf16> got16 = to_host(dw16_d);
  std::vector<float> got16_f(got16.size());
  for (size_t i = 0; i < got16.size(); ++i) got16_f[i] = bf16_to_float(got16[i]);
  expect_gemm_close("fp8 weight gradients, bf16", got16_f, want_d, abs_d);
}

INSTANTIATE_TEST_SUITE_P(BScales, GpuExpertWeightGemmFp8,
                         ::testing::Values(fp8::ColumnScales::PerFeature, fp8::ColumnScales::Block));

// ---------------------------------------------------------------------------------------
// The experts' grouped FP8 GEMM.

struct Fp8Case {
  std::vector<int32_t> rows_per_expert;
  int64_t dropped_rows;  // rows of the buffers past the last expert's
  int64_t N, K;
};

class GpuExpertGemmFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(GpuExpertGemmFp8, ForwardTwoSetsMatchesTheDequantisedReference) {
  MOE_REQUIRE_GPU();
  const Fp8Case& c = GetParam();
  const int64_t E = static_cast<int64_t>(c.rows_per_expert.size()), N = c.N, K = c.K, KB = K / kBlock;
  const std::vector<int32_t> offsets = offsets_of(c.rows_per_expert);
  const int64_t kept = offsets[E], R = kept + c.dropped_rows, S = E * fp8::blocks(N) * KB;
  const std::vector<bf16> x = activations(R, K, 3);
  const std::vector<bf16> w[2] = {weights(E, N, K, 4), weights(E, N, K, 5)};
  // The GPU path: quantise on the device, then the GEMM.
  auto x_d = to_device(x), w0_d = to_device(w[0]), w1_d = to_device(w[1]);
  auto offsets_d = to_device(offsets);
  auto xq_d = poisoned<uint8_t>(R * K);
  auto xs_d = poisoned<float>(R * KB);
  cuda::quantize_rows_blockwise(xq_d.data(), xs_d.data(), x_d.data(), K, offsets_d.data(), E, R, K, nullptr);
  gpu::DeviceArray<uint8_t> wq_d[2] = {gpu::DeviceArray<uint8_t>(E * N * K), gpu::DeviceArray<uint8_t>(E * N * K)};
  gpu::DeviceArray<float> ws_d[2] = {gpu::DeviceArray<float>(S), gpu::DeviceArray<float>(S)};
  cuda::quantize_weight_blocks(wq_d[0].data(), ws_d[0].data(), nullptr, nullptr, w0_d.data(), E, N, K, nullptr);
  cuda::quantize_weight_blocks(wq_d[1].data(), ws_d[1].data(), nullptr, nullptr, w1_d.data(), E, N, K, nullptr);
  auto out_d = poisoned<bf16>(R * 2 * N);  // [R, 2N]: set 0 in columns [0, N), set 1 in [N, 2N)
  cuda::ExpertGemmFp8 gemm(E);
  bf16* outs[2] = {out_d.data(), out_d.data() + N};
  const uint8_t* wq[2] = {wq_d[0].data(), wq_d[1].data()};
  const float* ws[2] = {ws_d[0].data(), ws_d[1].data()};
  gemm.forward(2, outs, 2 * N, xq_d.data(), xs_d.data(), wq, ws, offsets_d.data(), N, K, nullptr);
  const std::vector<bf16> got_bits = to_host(out_d);
  // The reference: the CPU's quantisation (the same bits, tested above), dequantised, in double.
  std::vector<uint8_t> xq(R * K);
  std::vector<float> xs(R * KB), xf(R * K);
  fp8::quantize_rows_blockwise(xq.data(), xs.data(), x.data(), K, offsets.data(), E, R, K);
  fp8::dequantize_rows_blockwise(xf.data(), xq.data(), xs.data(), offsets.data(), E, R, K);
  std::vector<float> wf[2];
  for (int s = 0; s < 2; ++s) {
    std::vector<uint8_t> wq_host(E * N * K);
    std::vector<float> ws_host(S);
    wf[s].resize(E * N * K);
    fp8::quantize_weight_blocks(wq_host.data(), ws_host.data(), nullptr, nullptr, w[s].data(), E, N, K);
    fp8::dequantize_weight_blocks(wf[s].data(), wq_host.data(), ws_host.data(), E, N, K);
  }
  test::GemmCheck check;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int s = 0; s < 2; ++s)
        for (int64_t n = 0; n < N; ++n)
          check.add(bf16_to_float(got_bits[static_cast<size_t>(r * 2 * N + s * N + n)]), K,
                    [&](int64_t k) { return double(xf[r * K + k]) * wf[s][(e * N + n) * K + k]; });
  check.expect("fp8 grouped forward");
  expect_rows_untouched(got_bits, kept, R, 2 * N);
  // Fewer multiprocessors (each tile still one CTA's work in the same order) and room for
  // more experts than the call runs over: the same bits. No experts: nothing written.
  gemm.set_sm_limit(9);
  cuda::ExpertGemmFp8 roomy(E + 3);
  roomy.set_experts(E);
  for (cuda::ExpertGemmFp8* other : {&gemm, &roomy}) {
    auto again_d = poisoned<bf16>(R * 2 * N);
    bf16* again[2] = {again_d.data(), again_d.data() + N};
    other->forward(2, again, 2 * N, xq_d.data(), xs_d.data(), wq, ws, offsets_d.data(), N, K, nullptr);
    expect_same(to_host(again_d), got_bits, got_bits.size(),
                other == &gemm ? "on 8 multiprocessors" : "with room for 3 more experts");
  }
  roomy.set_experts(0);
  auto none_d = poisoned<bf16>(R * 2 * N);
  bf16* none[2] = {none_d.data(), none_d.data() + N};
  roomy.forward(2, none, 2 * N, xq_d.data(), xs_d.data(), wq, ws, offsets_d.data(), N, K, nullptr);
  expect_rows_untouched(to_host(none_d), 0, R, 2 * N);
}

TEST_P(GpuExpertGemmFp8, BackwardDataMatchesTheDequantisedReferenceAndAccumulates) {
  MOE_REQUIRE_GPU();
  const Fp8Case& c = GetParam();
  // out [rows, N] = dy [rows, K] @ W_e, W_e [K, N]: the Linear weight [K, N] of a forward
  // over N inputs, given to the GEMM as its quantised transpose.
  const int64_t E = static_cast<int64_t>(c.rows_per_expert.size()), N = c.N, K = c.K, KB = K / kBlock;
  const std::vector<int32_t> offsets = offsets_of(c.rows_per_expert);
  const int64_t kept = offsets[E], R = kept + c.dropped_rows, S = E * fp8::blocks(N) * KB;
  const std::vector<bf16> dy = activations(R, K, 6);
  const std::vector<bf16> w = weights(E, K, N, 7);  // [E, K, N]
  const std::vector<float> before = random_bf16_floats(R * N, 8, "before");
  auto dy_d = to_device(dy), w_d = to_device(w);
  auto offsets_d = to_device(offsets);
  auto dyq_d = poisoned<uint8_t>(R * K);
  auto dys_d = poisoned<float>(R * KB);
  cuda::quantize_rows_blockwise(dyq_d.data(), dys_d.data(), dy_d.data(), K, offsets_d.data(), E, R, K, nullptr);
  gpu::DeviceArray<uint8_t> wq_d(E * K * N), wtq_d(E * N * K);
  gpu::DeviceArray<float> ws_d(S), wts_d(S);
  cuda::quantize_weight_blocks(wq_d.data(), ws_d.data(), wtq_d.data(), wts_d.data(), w_d.data(), E, K, N, nullptr);
  std::vector<uint8_t> dyq(R * K), wq(E * K * N);
  std::vector<float> dys(R * KB), ws(S), dyf(R * K), wf(E * K * N);
  fp8::quantize_rows_blockwise(dyq.data(), dys.data(), dy.data(), K, offsets.data(), E, R, K);
  fp8::dequantize_rows_blockwise(dyf.data(), dyq.data(), dys.data(), offsets.data(), E, R, K);
  fp8::quantize_weight_blocks(wq.data(), ws.data(), nullptr, nullptr, w.data(), E, K, N);
  fp8::dequantize_weight_blocks(wf.data(), wq.data(), ws.data(), E, K, N);
  cuda::ExpertGemmFp8 gemm(E);
  for (const float beta : {0.0f, 1.0f}) {
    auto out_d = beta == 0 ? poisoned<bf16>(R * N) : to_device_bf16(before);
    gemm.backward_data(out_d.data(), N, dyq_d.data(), dys_d.data(), wtq_d.data(), wts_d.data(), offsets_d.data(), N,
                       K, beta, nullptr);
    const std::vector<bf16> got_bits = to_host(out_d);
    test::GemmCheck check;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
        for (int64_t n = 0; n < N; ++n)
          check.add(
              bf16_to_float(got_bits[r * N + n]), K,
              [&](int64_t k) { return double(dyf[r * K + k]) * wf[(e * K + k) * N + n]; },
              beta * double(before[r * N + n]));
    check.expect(beta == 0 ? "fp8 grouped dgrad" : "fp8 grouped dgrad, accumulated");
    if (beta == 0) expect_rows_untouched(got_bits, kept, R, N);
  }
}

TEST(GpuExpertGemmFp8Shapes, RefusesKThatIsNotAMultipleOf128) {
  MOE_REQUIRE_GPU();
  cuda::ExpertGemmFp8 gemm(2);
  bf16* outs[1] = {nullptr};
  const uint8_t* wq[1] = {nullptr};
  const float* ws[1] = {nullptr};
  test::expect_one_line_error<Error>(
      [&] { gemm.forward(1, outs, 64, nullptr, nullptr, wq, ws, nullptr, 64, 200, nullptr); },
      {"K = 200", "multiple of 128"});
  test::expect_one_line_error<Error>(
      [&] { gemm.backward_data(nullptr, 64, nullptr, nullptr, nullptr, nullptr, nullptr, 64, 96, 0.0f, nullptr); },
      {"K = 96", "multiple of 128"});
  cuda::DenseGemmFp8 dense;
  test::expect_one_line_error<Error>(
      [&] { dense.gemm(nullptr, 64, nullptr, nullptr, nullptr, nullptr, 64, 64, 160, 0.0f, nullptr); },
      {"K = 160", "multiple of 128"});
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuExpertGemmFp8,
    ::testing::Values(Fp8Case{{0, 37, 0, 300, 1, 129, 0}, 11, 256, 384},      // empty first, middle and last
                      Fp8Case{{256, 256, 256, 256}, 0, 256, 256},              // even, tile-aligned
                      Fp8Case{{3, 1000, 17, 0, 250, 8, 64, 1}, 40, 136, 128},  // ragged, N with an edge block
                      Fp8Case{std::vector<int32_t>(16, 0), 5, 128, 128},       // every expert empty
                      Fp8Case{[] {
                                std::vector<int32_t> rows(64);
                                for (int e = 0; e < 64; ++e) rows[e] = (e * 37) % 97;
                                return rows;
                              }(),
                              0, 128, 256}));  // many small groups

// ---------------------------------------------------------------------------------------
// The dense FP8 GEMM.

// CUTLASS's kernel, and DeepGEMM's (use_deepgemm: beta 0 through dense_gemm_deepgemm, beta 1
// still CUTLASS's) where it runs.
TEST(GpuDenseGemmFp8, MatchesTheDequantisedReferenceForwardAndDataGradient) {
  MOE_REQUIRE_GPU();
  for (const bool deepgemm : {false, true}) {
    if (deepgemm && !cuda::deepgemm_available()) continue;
    cuda::DenseGemmFp8 dense;
    dense.use_deepgemm(deepgemm);
    // M not a tile multiple, N with an edge block, ldc past N; then more shapes through the
    // same object (an odd count of row tiles: DeepGEMM without its 2-CTA clusters).
    for (const auto& [M, N, K, ldc] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{200, 136, 512, 144},
                                       {1024, 384, 256, 384},
                                       {300, 256, 256, 264}}) {
      const int64_t KB = K / kBlock, S = fp8::blocks(N) * KB;
      const std::vector<bf16> a = activations(M, K, 9);
      // B [N, K] as the transposed copy of a [K, N] weight (the data gradient's operand), so
      // both outputs of the weight quantisation are exercised.
      const std::vector<bf16> w_KN = weights(1, K, N, 10);
      const std::vector<float> before = random_bf16_floats(M * ldc, 11, "before");
      auto a_d = to_device(a), w_d = to_device(w_KN);
      auto aq_d = poisoned<uint8_t>(M * K);
      auto as_d = poisoned<float>(M * KB);
      cuda::quantize_rows_blockwise(aq_d.data(), as_d.data(), a_d.data(), K, nullptr, 1, M, K, nullptr);
      gpu::DeviceArray<uint8_t> wq_d(K * N), wtq_d(N * K);
      gpu::DeviceArray<float> ws_d(S), wts_d(S);
      cuda::quantize_weight_blocks(wq_d.data(), ws_d.data(), wtq_d.data(), wts_d.data(), w_d.data(), 1, K, N, nullptr);
      std::vector<uint8_t> aq(M * K), wq(K * N);
      std::vector<float> as(M * KB), ws(S), af(M * K), wf(K * N);
      fp8::quantize_rows_blockwise(aq.data(), as.data(), a.data(), K, nullptr, 1, M, K);
      fp8::dequantize_rows_blockwise(af.data(), aq.data(), as.data(), nullptr, 1, M, K);
      fp8::quantize_weight_blocks(wq.data(), ws.data(), nullptr, nullptr, w_KN.data(), 1, K, N);
      fp8::dequantize_weight_blocks(wf.data(), wq.data(), ws.data(), 1, K, N);
      for (const float beta : {0.0f, 1.0f}) {
        auto c_d = beta == 0 ? poisoned<bf16>(M * ldc) : to_device_bf16(before);
        dense.gemm(c_d.data(), ldc, aq_d.data(), as_d.data(), wtq_d.data(), wts_d.data(), M, N, K, beta, nullptr);
        const std::vector<bf16> got_bits = to_host(c_d);
        test::GemmCheck check;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n)
            check.add(
                bf16_to_float(got_bits[m * ldc + n]), K,
                [&](int64_t k) { return double(af[m * K + k]) * wf[k * N + n]; }, beta * double(before[m * ldc + n]));
        check.expect(std::string(deepgemm ? "DeepGEMM " : "") + "dense fp8 [" + std::to_string(M) + ", " +
                     std::to_string(N) + ", " + std::to_string(K) + "] beta " + std::to_string(beta));
        // Columns [N, ldc) are not the GEMM's: untouched.
        size_t changed = 0;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = N; n < ldc; ++n)
            changed += beta == 0 ? got_bits[m * ldc + n].bits != 0xffff
                                 : bf16_to_float(got_bits[m * ldc + n]) != before[m * ldc + n];
        EXPECT_EQ(changed, 0u) << "columns past N written";
      }
    }
  }
}

}  // namespace
}  // namespace moe
