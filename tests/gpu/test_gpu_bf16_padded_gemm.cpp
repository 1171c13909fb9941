// PaddedExpertGemmBf16 (DeepGEMM's bf16 kernel over rows padded per expert to 128) against
// fp64 references of the same bf16 inputs: ragged experts with empty ones (first, middle,
// last), rows past the last expert, N with an odd count of 256-wide tiles (the kernel
// without 2-CTA clusters), two sets, many small groups; our gate|up kernel with SwiGLU in
// its epilogue against the forward and swiglu_forward bit for bit, and the down projection's
// data gradient with SwiGLU's backward against backward_data and swiglu_backward; the data gradient
// written and added; the weight gradient of every expert (empty ones zeroed). Skipped where the kernel
// cannot run (deepgemm_available(): an sm_90 GPU with 132 multiprocessors).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "expect_error.h"
#include "fp8_gemm_test_util.h"
#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"

namespace moe {
namespace {

using test::activations;
using test::weights;

struct PaddedCase {
  std::vector<int32_t> rows_per_expert;
  int64_t rows_after;  // rows of the buffers past the last expert's padded end
  int64_t N, K;
};

// The padded dispatch's layout: expert e's rows [P[e], P[e + 1]), its routed rows first and
// zero rows up to the next multiple of 128; R rows in the buffers (a multiple of 4).
struct PaddedShape {
  int64_t E, N, K;
  std::vector<int32_t> P;
  int64_t R;
  std::vector<bool> routed;  // per row of R: an expert's routed row (else padding or past the end)
};
PaddedShape shape_of(const PaddedCase& c) {
  PaddedShape s{static_cast<int64_t>(c.rows_per_expert.size()), c.N, c.K, {0}, 0, {}};
  for (int32_t rows : c.rows_per_expert) s.P.push_back(s.P.back() + (rows + 127) / 128 * 128);
  s.R = (s.P.back() + c.rows_after + 3) / 4 * 4;
  s.routed.assign(static_cast<size_t>(s.R), false);
  for (int64_t e = 0; e < s.E; ++e)
    for (int32_t r = 0; r < c.rows_per_expert[e]; ++r) s.routed[static_cast<size_t>(s.P[e] + r)] = true;
  return s;
}

// Rows [R, width] whose padding rows (and rows past the experts) are zero, as the dispatch
// leaves them.
std::vector<bf16> padded_rows(const PaddedShape& s, int64_t width, uint64_t seed) {
  std::vector<bf16> x = activations(s.R, width, seed);
  for (int64_t r = 0; r < s.R; ++r)
    if (!s.routed[static_cast<size_t>(r)]) std::fill_n(x.begin() + r * width, width, bf16{});
  return x;
}

double f(bf16 v) { return bf16_to_float(v); }

class GpuPaddedExpertGemmBf16 : public ::testing::TestWithParam<PaddedCase> {};

TEST_P(GpuPaddedExpertGemmBf16, ForwardTwoSetsMatchesTheReference) {
  MOE_REQUIRE_DEEPGEMM();
  const PaddedShape s = shape_of(GetParam());
  const int64_t E = s.E, N = s.N, K = s.K, R = s.R;
  const std::vector<bf16> x = padded_rows(s, K, 31);
  const std::vector<bf16> w[2] = {weights(E, N, K, 32), weights(E, N, K, 33)};
  auto x_d = to_device(x), w0_d = to_device(w[0]), w1_d = to_device(w[1]);
  auto P_d = to_device(s.P);
  auto out_d = poisoned<bf16>(R * 2 * N);  // [R, 2N]: set 0 in columns [0, N), set 1 in [N, 2N)
  cuda::PaddedExpertGemmBf16 gemm(E);
  bf16* outs[2] = {out_d.data(), out_d.data() + N};
  const bf16* ws[2] = {w0_d.data(), w1_d.data()};
  gemm.forward(2, outs, 2 * N, x_d.data(), K, ws, P_d.data(), R, N, K, nullptr);
  const std::vector<bf16> got = to_host(out_d);
  test::GemmCheck check;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = s.P[e]; r < s.P[e + 1]; ++r)
      for (int set = 0; set < 2; ++set)
        for (int64_t n = 0; n < N; ++n)
          check.add(bf16_to_float(got[static_cast<size_t>(r * 2 * N + set * N + n)]), K,
                    [&](int64_t k) { return f(x[r * K + k]) * f(w[set][(e * N + n) * K + k]); });
  check.expect("padded bf16 grouped forward");
  expect_rows_untouched(got, s.P[E], R, 2 * N);
  // No experts: nothing written.
  gemm.set_experts(0);
  auto none_d = poisoned<bf16>(R * 2 * N);
  bf16* none[2] = {none_d.data(), none_d.data() + N};
  gemm.forward(2, none, 2 * N, x_d.data(), K, ws, P_d.data(), R, N, K, nullptr);
  expect_rows_untouched(to_host(none_d), 0, R, 2 * N);
}

TEST_P(GpuPaddedExpertGemmBf16, BackwardDataWrittenThenAddedMatchesTheReference) {
  MOE_REQUIRE_DEEPGEMM();
  // out [rows, N] = dy [rows, K] @ W_e (+ out), W_e [K, N] as stored.
  const PaddedShape s = shape_of(GetParam());
  const int64_t E = s.E, N = s.N, K = s.K, R = s.R;
  const std::vector<bf16> dy = padded_rows(s, K, 34);
  const std::vector<bf16> w = weights(E, K, N, 35);
  const std::vector<bf16> dy2 = padded_rows(s, K, 36);
  const std::vector<bf16> w2 = weights(E, K, N, 37);
  auto dy_d = to_device(dy), w_d = to_device(w), dy2_d = to_device(dy2), w2_d = to_device(w2);
  auto P_d = to_device(s.P);
  cuda::PaddedExpertGemmBf16 gemm(E);
  auto out_d = poisoned<bf16>(R * N);
  gemm.backward_data(out_d.data(), N, dy_d.data(), K, w_d.data(), P_d.data(), R, N, K, 0.0f, nullptr);
  const std::vector<bf16> first = to_host(out_d);
  gemm.backward_data(out_d.data(), N, dy2_d.data(), K, w2_d.data(), P_d.data(), R, N, K, 1.0f, nullptr);
  const std::vector<bf16> sum = to_host(out_d);
  test::GemmCheck written, added;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = s.P[e]; r < s.P[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const size_t i = static_cast<size_t>(r * N + n);
        written.add(bf16_to_float(first[i]), K, [&](int64_t k) { return f(dy[r * K + k]) * f(w[(e * K + k) * N + n]); });
        added.add(bf16_to_float(sum[i]), K, [&](int64_t k) { return f(dy2[r * K + k]) * f(w2[(e * K + k) * N + n]); },
                  f(first[i]));
      }
  written.expect("padded bf16 grouped dgrad");
  added.expect("padded bf16 grouped dgrad added");
  expect_rows_untouched(sum, s.P[E], R, N);
}

TEST_P(GpuPaddedExpertGemmBf16, BackwardWeightMatchesTheReferenceAndZeroesEmptyExperts) {
  MOE_REQUIRE_DEEPGEMM();
  // dw[set] [E, M, N]: expert e's = a[set] rows of e ^T @ b rows of e; here M = N_case, N = K_case.
  const PaddedShape s = shape_of(GetParam());
  const int64_t E = s.E, M = s.N, N = s.K, R = s.R;
  if (M % 128 != 0) GTEST_SKIP() << "the weight gradient takes M in whole 128-row tiles";
  const std::vector<bf16> a = padded_rows(s, 2 * M, 38);  // two sets side by side: [R, 2M]
  const std::vector<bf16> b = padded_rows(s, N, 39);
  auto a_d = to_device(a), b_d = to_device(b);
  auto P_d = to_device(s.P);
  auto dw0_d = poisoned<bf16>(E * M * N), dw1_d = poisoned<bf16>(E * M * N);
  cuda::PaddedExpertGemmBf16 gemm(E);
  bf16* dw[2] = {dw0_d.data(), dw1_d.data()};
  const bf16* as[2] = {a_d.data(), a_d.data() + M};
  gemm.backward_weight(2, dw, as, 2 * M, b_d.data(), N, P_d.data(), R, M, N, nullptr);
  const std::vector<bf16> got[2] = {to_host(dw0_d), to_host(dw1_d)};
  test::GemmCheck check;
  for (int set = 0; set < 2; ++set)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t m = 0; m < M; m += 7)
        for (int64_t n = 0; n < N; n += 5) {
          const int64_t rows = s.P[e + 1] - s.P[e];
          check.add(bf16_to_float(got[set][static_cast<size_t>((e * M + m) * N + n)]), rows, [&](int64_t k) {
            const int64_t r = s.P[e] + k;
            return f(a[r * 2 * M + set * M + m]) * f(b[r * N + n]);
          });
        }
  check.expect("padded bf16 grouped wgrad");
  for (int set = 0; set < 2; ++set)
    for (int64_t e = 0; e < E; ++e)
      if (s.P[e + 1] == s.P[e]) {
        size_t nonzero = 0;
        for (int64_t i = e * M * N; i < (e + 1) * M * N; ++i) nonzero += got[set][static_cast<size_t>(i)].bits != 0;
        EXPECT_EQ(nonzero, 0u) << "set " << set << ": expert " << e << " has no rows, its gradient must be zero";
      }
}

TEST_P(GpuPaddedExpertGemmBf16, RerunsGiveTheSameBits) {
  MOE_REQUIRE_DEEPGEMM();
  const PaddedShape s = shape_of(GetParam());
  const int64_t E = s.E, N = s.N, K = s.K, R = s.R;
  auto x_d = to_device(padded_rows(s, K, 40)), w_d = to_device(weights(E, N, K, 41));
  auto P_d = to_device(s.P);
  cuda::PaddedExpertGemmBf16 gemm(E);
  std::vector<bf16> runs[2];
  for (auto& run : runs) {
    auto out_d = poisoned<bf16>(R * N);
    bf16* outs[1] = {out_d.data()};
    const bf16* ws[1] = {w_d.data()};
    gemm.forward(1, outs, N, x_d.data(), K, ws, P_d.data(), R, N, K, nullptr);
    run = to_host(out_d);
  }
  test::expect_same(runs[0], runs[1], runs[0].size(), "padded bf16 forward rerun");
}

// Our gate|up kernel with SwiGLU in its epilogue: gate|up as DeepGEMM's forward writes it
// over the interleaved [w1_e; w3_e] weights (N = 2F), and act as swiglu_forward writes it
// from that gate|up, both bit for bit; rows past the experts untouched.
TEST_P(GpuPaddedExpertGemmBf16, ForwardSwigluIsTheForwardThenSwigluBitForBit) {
  MOE_REQUIRE_DEEPGEMM();
  const PaddedShape s = shape_of(GetParam());
  const int64_t E = s.E, F = s.N / 2, K = s.K, R = s.R;
  if (F % cuda::PaddedExpertGemmBf16::kSwigluColumns != 0) GTEST_SKIP() << "F = " << F << ": not in 128-column tiles";
  auto x_d = to_device(padded_rows(s, K, 50)), w_d = to_device(weights(E, 2 * F, K, 51));
  auto P_d = to_device(s.P);
  cuda::PaddedExpertGemmBf16 gemm(E);
  auto want_gate_up = poisoned<bf16>(R * 2 * F), want_act = poisoned<bf16>(R * F);
  bf16* outs[1] = {want_gate_up.data()};
  const bf16* ws[1] = {w_d.data()};
  gemm.forward(1, outs, 2 * F, x_d.data(), K, ws, P_d.data(), R, 2 * F, K, nullptr);
  cuda::swiglu_forward(want_act.data(), want_gate_up.data(), s.P[E], F, nullptr);
  auto gate_up = poisoned<bf16>(R * 2 * F), act = poisoned<bf16>(R * F);
  gemm.forward_swiglu(gate_up.data(), act.data(), x_d.data(), K, w_d.data(), P_d.data(), R, F, K, nullptr);
  const std::vector<bf16> got_gate_up = to_host(gate_up), got_act = to_host(act);
  test::expect_same(got_gate_up, to_host(want_gate_up), static_cast<size_t>(s.P[E] * 2 * F), "fused gate|up");
  test::expect_same(got_act, to_host(want_act), static_cast<size_t>(s.P[E] * F), "fused act");
  expect_rows_untouched(got_gate_up, s.P[E], R, 2 * F);
  expect_rows_untouched(got_act, s.P[E], R, F);
  // A rerun: the same bits.
  auto again = poisoned<bf16>(R * F);
  gemm.forward_swiglu(gate_up.data(), again.data(), x_d.data(), K, w_d.data(), P_d.data(), R, F, K, nullptr);
  test::expect_same(to_host(again), got_act, static_cast<size_t>(s.P[E] * F), "fused act rerun");
  // No experts: nothing written.
  gemm.set_experts(0);
  auto none = poisoned<bf16>(R * F);
  gemm.forward_swiglu(gate_up.data(), none.data(), x_d.data(), K, w_d.data(), P_d.data(), R, F, K, nullptr);
  expect_rows_untouched(to_host(none), 0, R, F);
}

// Our down-projection data gradient with SwiGLU's backward fused in: d gate|up and act as
// backward_data then swiglu_backward write them, bit for bit, with and without act; rows
// past the experts untouched. The case's N is F here, its K the data gradient's (D).
TEST_P(GpuPaddedExpertGemmBf16, BackwardDataSwigluIsTheDataGradientThenSwigluBitForBit) {
  MOE_REQUIRE_DEEPGEMM();
  const PaddedShape s = shape_of(GetParam());
  const int64_t E = s.E, F = s.N, K = s.K, R = s.R;
  if (F % cuda::PaddedExpertGemmBf16::kSwigluColumns != 0) GTEST_SKIP() << "F = " << F << ": not in 128-column tiles";
  auto dy_d = to_device(padded_rows(s, K, 60)), w2_d = to_device(weights(E, K, F, 61));
  auto gate_up_d = to_device(padded_rows(s, 2 * F, 62));
  auto P_d = to_device(s.P);
  cuda::PaddedExpertGemmBf16 gemm(E);
  auto dact = poisoned<bf16>(R * F), want_dgate_up = poisoned<bf16>(R * 2 * F), want_act = poisoned<bf16>(R * F);
  gemm.backward_data(dact.data(), F, dy_d.data(), K, w2_d.data(), P_d.data(), R, F, K, 0.0f, nullptr);
  cuda::swiglu_backward(want_dgate_up.data(), dact.data(), gate_up_d.data(), s.P[E], F, nullptr, want_act.data());
  const std::vector<bf16> want_g = to_host(want_dgate_up), want_a = to_host(want_act);
  for (const bool with_act : {true, false}) {
    auto dgate_up = poisoned<bf16>(R * 2 * F), act = poisoned<bf16>(R * F);
    gemm.backward_data_swiglu(dgate_up.data(), with_act ? act.data() : nullptr, dy_d.data(), K, w2_d.data(),
                              gate_up_d.data(), P_d.data(), R, F, K, nullptr);
    const std::vector<bf16> got_g = to_host(dgate_up), got_a = to_host(act);
    test::expect_same(got_g, want_g, static_cast<size_t>(s.P[E] * 2 * F), "fused d gate|up");
    expect_rows_untouched(got_g, s.P[E], R, 2 * F);
    if (with_act) {
      test::expect_same(got_a, want_a, static_cast<size_t>(s.P[E] * F), "fused act");
      expect_rows_untouched(got_a, s.P[E], R, F);
    } else {
      expect_rows_untouched(got_a, 0, R, F);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuPaddedExpertGemmBf16,
    ::testing::Values(PaddedCase{{0, 37, 0, 300, 1, 129, 0}, 12, 512, 384},  // empty first, middle and last
                      PaddedCase{{256, 256, 256, 256}, 0, 256, 256},         // even, tile-aligned
                      PaddedCase{{130, 7, 300}, 4, 768, 192},                // N: 3 tiles (no clusters)
                      PaddedCase{{90, 0, 260}, 0, 384, 192},  // weight gradient: 3 row tiles (no clusters)
                      PaddedCase{std::vector<int32_t>(16, 0), 8, 128, 128},  // every expert empty
                      // K = 2048 and 1024: the fused SwiGLU backward's math warps take 16 and
                      // 32 rows of a tile (32 at the K above too)
                      PaddedCase{{200, 57}, 0, 256, 2048}, PaddedCase{{129, 0, 300}, 4, 384, 1024},
                      PaddedCase{[] {
                                   std::vector<int32_t> rows(64);
                                   for (int e = 0; e < 64; ++e) rows[e] = (e * 37) % 97;
                                   return rows;
                                 }(),
                                 0, 512, 256}));  // many small groups

TEST(GpuPaddedExpertGemmBf16Shapes, RefusesWhatItCannotRun) {
  MOE_REQUIRE_DEEPGEMM();
  cuda::PaddedExpertGemmBf16 gemm(2);
  bf16* outs[1] = {nullptr};
  const bf16* ws[1] = {nullptr};
  test::expect_one_line_error<Error>(
      [&] { gemm.forward(1, outs, 64, nullptr, 200, ws, nullptr, 128, 64, 200, nullptr); },
      {"200", "multiple of 64"});
  test::expect_one_line_error<Error>(
      [&] { gemm.backward_data(nullptr, 64, nullptr, 64, nullptr, nullptr, 130, 64, 64, 0.0f, nullptr); },
      {"130 rows", "multiple of 4"});
  test::expect_one_line_error<Error>(
      [&] { gemm.backward_data(nullptr, 64, nullptr, 64, nullptr, nullptr, 128, 64, 64, 0.5f, nullptr); },
      {"beta 0.5"});
  test::expect_one_line_error<Error>(
      [&] { gemm.forward_swiglu(nullptr, nullptr, nullptr, 64, nullptr, nullptr, 128, 192, 64, nullptr); },
      {"F = 192", "multiple of 128"});
  test::expect_one_line_error<Error>(
      [&] { gemm.backward_data_swiglu(nullptr, nullptr, nullptr, 64, nullptr, nullptr, nullptr, 128, 320, 64, nullptr); },
      {"F = 320", "multiple of 128"});
  test::expect_one_line_error<Error>([&] { cuda::PaddedExpertGemmBf16 too_many(257); }, {"257 experts", "1 to 256"});
}

}  // namespace
}  // namespace moe
