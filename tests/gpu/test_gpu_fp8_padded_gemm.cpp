// PaddedExpertGemmFp8 (DeepGEMM's m-grouped fp8 GEMM over rows padded per expert) against
// the reference computed from the dequantised inputs, as ExpertGemmFp8 is tested: ragged
// experts with empty ones (first, middle, last), the last expert's end not aligned, rows
// past it, N with an odd count of 128-wide tiles (the kernel without the 2-CTA clusters)
// and an edge tile, two sets, many small groups; and the same product as ExpertGemmFp8's
// over the packed rows, within the tolerance. Skipped where the kernel cannot run
// (available(): an sm_90 GPU with 132 multiprocessors).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "expect_error.h"
#include "fp8_gemm_test_util.h"
#include "gpu_test_util.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/fp8_gpu_ops.h"

namespace moe {
namespace {

using fp8::kBlock;
using test::activations;
using test::weights;

struct PaddedCase {
  std::vector<int32_t> rows_per_expert;
  int64_t rows_after;  // rows of the buffers past the last expert's end
  int64_t N, K;
};

// Expert e's rows [P[e], P[e + 1]): its rows, then up to the next multiple of 128 (the last
// expert's end unaligned, as a dispatch without padding after the last expert leaves it).
std::vector<int32_t> padded_offsets(const std::vector<int32_t>& rows) {
  std::vector<int32_t> P(rows.size() + 1, 0);
  for (size_t e = 0; e < rows.size(); ++e) {
    const int32_t end = P[e] + rows[e];
    P[e + 1] = e + 1 < rows.size() ? (end + 127) / 128 * 128 : end;
  }
  return P;
}

// A case's sizes: expert offsets P, R rows (a multiple of 4), S weight scales, and the rows
// the kernel writes (the last expert's end rounded up to 128).
struct PaddedShape {
  int64_t E, N, K, KB;
  std::vector<int32_t> P;
  int64_t R, S, written;
};
PaddedShape shape_of(const PaddedCase& c) {
  PaddedShape s{static_cast<int64_t>(c.rows_per_expert.size()), c.N, c.K, c.K / kBlock, padded_offsets(c.rows_per_expert),
                0, 0, 0};
  const int64_t end = s.P[s.E];
  s.R = (end + c.rows_after + 3) / 4 * 4;
  s.S = s.E * fp8::blocks(s.N) * s.KB;
  s.written = std::min<int64_t>(s.R, (end + 127) / 128 * 128);
  return s;
}

class GpuPaddedExpertGemmFp8 : public ::testing::TestWithParam<PaddedCase> {};

TEST_P(GpuPaddedExpertGemmFp8, ForwardTwoSetsMatchesTheDequantisedReference) {
  MOE_REQUIRE_DEEPGEMM();
  const auto [E, N, K, KB, P, R, S, written] = shape_of(GetParam());
  const std::vector<bf16> x = activations(R, K, 21);
  const std::vector<bf16> w[2] = {weights(E, N, K, 22), weights(E, N, K, 23)};
  auto x_d = to_device(x), w0_d = to_device(w[0]), w1_d = to_device(w[1]);
  auto P_d = to_device(P);
  auto xq_d = poisoned<uint8_t>(R * K);
  auto xs_d = poisoned<float>(R * KB);
  cuda::quantize_rows_blockwise(xq_d.data(), xs_d.data(), x_d.data(), K, nullptr, 1, R, K, nullptr);
  gpu::DeviceArray<uint8_t> wq_d[2] = {gpu::DeviceArray<uint8_t>(E * N * K), gpu::DeviceArray<uint8_t>(E * N * K)};
  gpu::DeviceArray<float> ws_d[2] = {gpu::DeviceArray<float>(S), gpu::DeviceArray<float>(S)};
  cuda::quantize_weight_blocks(wq_d[0].data(), ws_d[0].data(), nullptr, nullptr, w0_d.data(), E, N, K, nullptr);
  cuda::quantize_weight_blocks(wq_d[1].data(), ws_d[1].data(), nullptr, nullptr, w1_d.data(), E, N, K, nullptr);
  auto out_d = poisoned<bf16>(R * 2 * N);  // [R, 2N]: set 0 in columns [0, N), set 1 in [N, 2N)
  cuda::PaddedExpertGemmFp8 gemm(E);
  bf16* outs[2] = {out_d.data(), out_d.data() + N};
  const uint8_t* wq[2] = {wq_d[0].data(), wq_d[1].data()};
  const float* ws[2] = {ws_d[0].data(), ws_d[1].data()};
  gemm.forward(2, outs, 2 * N, xq_d.data(), xs_d.data(), wq, ws, P_d.data(), R, N, K, nullptr);
  const std::vector<bf16> got_bits = to_host(out_d);
  std::vector<uint8_t> xq(R * K);
  std::vector<float> xs(R * KB), xf(R * K);
  fp8::quantize_rows_blockwise(xq.data(), xs.data(), x.data(), K, nullptr, 1, R, K);
  fp8::dequantize_rows_blockwise(xf.data(), xq.data(), xs.data(), nullptr, 1, R, K);
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
    for (int64_t r = P[e]; r < P[e + 1]; ++r)
      for (int s = 0; s < 2; ++s)
        for (int64_t n = 0; n < N; ++n)
          check.add(bf16_to_float(got_bits[static_cast<size_t>(r * 2 * N + s * N + n)]), K,
                    [&](int64_t k) { return double(xf[r * K + k]) * wf[s][(e * N + n) * K + k]; });
  check.expect("padded fp8 grouped forward");
  expect_rows_untouched(got_bits, written, R, 2 * N);
  // No experts: nothing written.
  gemm.set_experts(0);
  auto none_d = poisoned<bf16>(R * 2 * N);
  bf16* none[2] = {none_d.data(), none_d.data() + N};
  gemm.forward(2, none, 2 * N, xq_d.data(), xs_d.data(), wq, ws, P_d.data(), R, N, K, nullptr);
  expect_rows_untouched(to_host(none_d), 0, R, 2 * N);
}

TEST_P(GpuPaddedExpertGemmFp8, BackwardDataMatchesTheDequantisedReference) {
  MOE_REQUIRE_DEEPGEMM();
  // out [rows, N] = dy [rows, K] @ W_e, W_e [K, N] given as its quantised transpose.
  const auto [E, N, K, KB, P, R, S, written] = shape_of(GetParam());
  const std::vector<bf16> dy = activations(R, K, 24);
  const std::vector<bf16> w = weights(E, K, N, 25);  // [E, K, N]
  auto dy_d = to_device(dy), w_d = to_device(w);
  auto P_d = to_device(P);
  auto dyq_d = poisoned<uint8_t>(R * K);
  auto dys_d = poisoned<float>(R * KB);
  cuda::quantize_rows_blockwise(dyq_d.data(), dys_d.data(), dy_d.data(), K, nullptr, 1, R, K, nullptr);
  gpu::DeviceArray<uint8_t> wtq_d(E * N * K);
  gpu::DeviceArray<float> wts_d(S);
  cuda::quantize_weight_blocks(nullptr, nullptr, wtq_d.data(), wts_d.data(), w_d.data(), E, K, N, nullptr);
  std::vector<uint8_t> dyq(R * K), wq(E * K * N);
  std::vector<float> dys(R * KB), ws(S), dyf(R * K), wf(E * K * N);
  fp8::quantize_rows_blockwise(dyq.data(), dys.data(), dy.data(), K, nullptr, 1, R, K);
  fp8::dequantize_rows_blockwise(dyf.data(), dyq.data(), dys.data(), nullptr, 1, R, K);
  fp8::quantize_weight_blocks(wq.data(), ws.data(), nullptr, nullptr, w.data(), E, K, N);
  fp8::dequantize_weight_blocks(wf.data(), wq.data(), ws.data(), E, K, N);
  cuda::PaddedExpertGemmFp8 gemm(E);
  auto out_d = poisoned<bf16>(R * N);
  gemm.backward_data(out_d.data(), N, dyq_d.data(), dys_d.data(), wtq_d.data(), wts_d.data(), P_d.data(), R, N, K,
                     nullptr);
  const std::vector<bf16> got_bits = to_host(out_d);
  test::GemmCheck check;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = P[e]; r < P[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n)
        check.add(bf16_to_float(got_bits[static_cast<size_t>(r * N + n)]), K,
                  [&](int64_t k) { return double(dyf[r * K + k]) * wf[(e * K + k) * N + n]; });
  check.expect("padded fp8 grouped dgrad");
  expect_rows_untouched(got_bits, written, R, N);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuPaddedExpertGemmFp8,
    ::testing::Values(PaddedCase{{0, 37, 0, 300, 1, 129, 0}, 11, 256, 384},  // empty first, middle and last
                      PaddedCase{{256, 256, 256, 256}, 0, 256, 256},         // even, tile-aligned
                      PaddedCase{{3, 1000, 17, 0, 250, 8, 64, 1}, 40, 136, 128},  // N: 2 tiles, an edge one
                      PaddedCase{{130, 7, 300}, 5, 384, 256},                // N: 3 tiles (no clusters)
                      PaddedCase{std::vector<int32_t>(16, 0), 5, 128, 128},  // every expert empty
                      PaddedCase{[] {
                                   std::vector<int32_t> rows(64);
                                   for (int e = 0; e < 64; ++e) rows[e] = (e * 37) % 97;
                                   return rows;
                                 }(),
                                 0, 128, 256}));  // many small groups

TEST(GpuPaddedExpertGemmFp8Shapes, RefusesWhatItCannotRun) {
  MOE_REQUIRE_DEEPGEMM();
  cuda::PaddedExpertGemmFp8 gemm(2);
  bf16* outs[1] = {nullptr};
  const uint8_t* wq[1] = {nullptr};
  const float* ws[1] = {nullptr};
  test::expect_one_line_error<Error>(
      [&] { gemm.forward(1, outs, 64, nullptr, nullptr, wq, ws, nullptr, 128, 64, 200, nullptr); },
      {"K = 200", "multiple of 128"});
  test::expect_one_line_error<Error>(
      [&] { gemm.backward_data(nullptr, 64, nullptr, nullptr, nullptr, nullptr, nullptr, 130, 64, 128, nullptr); },
      {"R = 130", "multiple of 4"});
  test::expect_one_line_error<Error>([&] { cuda::PaddedExpertGemmFp8 too_many(257); }, {"257 experts", "1 to 256"});
}

}  // namespace
}  // namespace moe
