// training.precision = fp8's dense projections (model/cuda/projection_gemms.h): every
// projection GEMM of a model (model/gpu_buffer_sizes.h's dense_projection_gemms: attention's
// q|k|v and output, the dense FFN's and shared expert's gate, up and down; forward and
// data gradient), run by the fp8 ProjectionGemms and by the bf16 one on the same random
// operands. Where the shape fits the dense FP8 GEMM: close to bf16 within what e4m3's
// rounding allows, and not equal (the fp8 path ran); where it does not: the bf16 path, bit
// for bit. A shape the scratch was not planned for is refused with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "expect_error.h"
#include "gpu_test_util.h"
#include "kernels/fp8_blockwise.h"
#include "model/cuda/projection_gemms.h"
#include "model/gpu_buffer_sizes.h"
#include "small_models.h"

namespace moe {
namespace {

using fp8::kBlock;
using test::poisoned;
using test::to_device;
using test::to_host;

// Normal values whose magnitude is a power of two per 128-wide tile of a row (2^-4 .. 2^4
// around `base`), so that each tile and block gets its own scale and a scale read from the
// wrong place shows as a factor of 2 or more.
std::vector<bf16> tiled(int64_t rows, int64_t cols, double base, int64_t row_block, uint64_t seed) {
  CounterRng rng(seed, "fp8 projection operand");
  std::vector<bf16> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const int exponent = static_cast<int>((r / row_block * 5 + c / kBlock * 3) % 9) - 4;
      v[static_cast<size_t>(i)] = float_to_bf16(static_cast<float>(std::ldexp(base * rng.normal(i), exponent)));
    }
  return v;
}

double f(bf16 x) { return bf16_to_float(x); }

// One GEMM of `g` through `p` into c (ldc): forward y = x W^T with w [N, K], or data
// gradient dx = dy W with w [K, N] (a [M, lda], the first K columns read).
void run_gemm(ProjectionGemms& p, const DenseGemmShape& g, bf16* c, const bf16* a, const bf16* w, bool accumulate) {
  if (g.data_gradient)
    p.backward_data(c, a, g.lda, w, g.M, g.N, g.K, accumulate, nullptr);
  else
    p.forward(c, g.ldc, a, w, g.M, g.K, g.N, accumulate, nullptr);
}

// Checks every projection GEMM of `config` on micro-batches of `tokens` tokens; returns
// how many ran in fp8.
int check_projections(const ModelConfig& config, int64_t tokens) {
  cuda::Blas blas;
  ProjectionGemms p8(blas, /*fp8=*/true), p16(blas, /*fp8=*/false);
  p8.plan(config, tokens);
  p16.plan(config, tokens);
  int in_fp8 = 0;
  uint64_t seed = 1;
  for (const DenseGemmShape& g : dense_projection_gemms(config, tokens)) {
    const std::string what = std::string(g.name) + " [" + std::to_string(g.M) + ", " + std::to_string(g.N) + ", " +
                             std::to_string(g.K) + "]";
    SCOPED_TRACE(what);
    const int64_t M = g.M, N = g.N, K = g.K, lda = g.lda, ldc = g.ldc;
    // Activations around 1 (tiles of 1 x 128), weights around 0.02 (blocks of 128 x 128),
    // the weight stored as the model holds it: [N, K] forward, [K, N] data gradient.
    const std::vector<bf16> a = tiled(M, lda, 1.0, 1, ++seed);
    const int64_t w_rows = g.data_gradient ? K : N, w_cols = g.data_gradient ? N : K;
    const std::vector<bf16> w = tiled(w_rows, w_cols, 0.02, kBlock, ++seed);
    const std::vector<bf16> before = tiled(M, ldc, 0.1, 1, ++seed);
    auto a_d = to_device(a), w_d = to_device(w);
    // The weight as GEMM-terms b[n][k] (b = W or W^T).
    const auto b = [&](int64_t n, int64_t k) { return f(w[g.data_gradient ? k * N + n : n * K + k]); };
    // e4m3 rounding of one operand value: at most 2^-4 of it (3 mantissa bits, to nearest),
    // or 2^-10 of its block's scale where it lands among e4m3's subnormals (spacing 2^-9).
    std::vector<float> a_floor(static_cast<size_t>(M * (K / kBlock)));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t kb = 0; kb < K / kBlock; ++kb) {
        float amax = 0;
        for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k)
          amax = std::max(amax, std::abs(bf16_to_float(a[m * lda + k])));
        a_floor[m * (K / kBlock) + kb] = std::ldexp(fp8::block_scale(amax), -10);
      }
    const int64_t NB = fp8::blocks(N), KB = fp8::blocks(K);
    std::vector<float> b_floor(static_cast<size_t>(NB * KB));
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        float amax = 0;
        for (int64_t n = nb * kBlock; n < std::min(N, (nb + 1) * kBlock); ++n)
          for (int64_t k = kb * kBlock; k < std::min(K, (kb + 1) * kBlock); ++k)
            amax = std::max(amax, static_cast<float>(std::abs(b(n, k))));
        b_floor[nb * KB + kb] = std::ldexp(fp8::block_scale(amax), -10);
      }
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulating" : "overwriting");
      auto c8 = accumulate ? to_device(before) : poisoned<bf16>(M * ldc);
      auto c16 = accumulate ? to_device(before) : poisoned<bf16>(M * ldc);
      run_gemm(p8, g, c8.data(), a_d.data(), w_d.data(), accumulate);
      run_gemm(p16, g, c16.data(), a_d.data(), w_d.data(), accumulate);
      const std::vector<bf16> y8 = to_host(c8), y16 = to_host(c16);
      if (!g.fp8) {  // the fallback is the bf16 path itself
        EXPECT_EQ(std::memcmp(y8.data(), y16.data(), y8.size() * sizeof(bf16)), 0) << "bf16 fallback differs";
        continue;
      }
      // |y8 - y16| <= 2^-7 |y| (both outputs' bf16 rounding) + sum_k over the operands'
      // rounding, |a_k b_k| (2^-4 + 2^-4 + 2^-8) plus the subnormal floors, + 2^-9 sum
      // |a b| (the tensor cores' truncated accumulation, tests/gpu/test_gpu_fp8_gemm.cpp),
      // with 2% room. And the relative RMS difference between 2^-7 (fp8 ran: bf16 alone
      // differs by ~2^-9) and 2^-4 (measured ~0.04 by the rounding's statistics: a
      // misplaced scale makes a tile's share wrong by a factor of 2).
      size_t bad = 0, columns_changed = 0;
      double diff2 = 0, norm2 = 0, worst = 0;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          double want = accumulate ? f(before[m * ldc + n]) : 0.0, bound = 0;
          for (int64_t k = 0; k < K; ++k) {
            const double x = f(a[m * lda + k]), y = b(n, k), p = std::abs(x * y);
            const double fx = a_floor[m * (K / kBlock) + k / kBlock], fy = b_floor[(n / kBlock) * KB + k / kBlock];
            want += x * y;
            bound += (0.125 + 0.0039 + 0.0023) * p + fx * std::abs(y) * 1.07 + fy * std::abs(x) * 1.07 + fx * fy;
          }
          const double got8 = f(y8[m * ldc + n]), got16 = f(y16[m * ldc + n]);
          const double allowed = 1.02 * (std::ldexp(std::abs(want), -7) + bound) + 1e-30;
          const double ratio = std::isfinite(got8) ? std::abs(got8 - got16) / allowed : INFINITY;
          if (!(ratio <= 1)) ++bad;
          worst = std::max(worst, std::isfinite(ratio) ? ratio : 1e30);
          const double d = got8 - got16, base = got16 - (accumulate ? f(before[m * ldc + n]) : 0.0);
          diff2 += d * d;
          norm2 += base * base;
        }
        for (int64_t n = N; n < ldc; ++n)
          columns_changed += std::memcmp(&y8[m * ldc + n], &y16[m * ldc + n], sizeof(bf16)) != 0;
      }
      EXPECT_EQ(bad, 0u) << bad << " of " << M * N << " outside e4m3's bound; worst at " << worst << " of it";
      EXPECT_EQ(columns_changed, 0u) << "columns past N written";
      const double rms = std::sqrt(diff2 / norm2);
      EXPECT_GT(rms, std::ldexp(1.0, -7)) << "fp8 and bf16 too close: did the fp8 path run?";
      EXPECT_LT(rms, std::ldexp(1.0, -4)) << "fp8 far from bf16";
      if (!accumulate) std::printf("  %-40s rms relative difference to bf16 %.4f\n", what.c_str(), rms);
    }
    in_fp8 += g.fp8 ? 1 : 0;
  }
  return in_fp8;
}

// tests/gpu/small_models.h's model: dim 128, 4 heads of 32, 2 KV heads (q|k|v 256 wide), a
// dense first layer of 192 (its down forward and gate/up data gradients have K = 192: bf16)
// and a shared expert of 128: 10 of its 12 projection GEMMs in fp8.
TEST(GpuFp8Projections, SmallModelEachProjectionCloseToBf16OrBf16BitForBit) {
  MOE_REQUIRE_GPU();
  EXPECT_EQ(check_projections(test::small_moe_model(0.0), 128), 10);
}

// Grouped-query attention whose q|k|v row is not whole 128-blocks: dim 384, 12 heads of 32,
// 3 KV heads, (12 + 2 x 3) x 32 = 576 wide. Its forward (N = 576) runs in fp8, its data
// gradient (K = 576) in bf16; a dense FFN of 256 entirely in fp8.
TEST(GpuFp8Projections, GroupedQueryAttentionWithAPartialQkvBlock) {
  MOE_REQUIRE_GPU();
  ModelConfig c = test::small_moe_model(0.0);
  c.dim = 384;
  c.n_heads = 12;
  c.n_kv_heads = 3;
  c.dense_hidden = 256;
  c.moe.n_shared_experts = 0;
  EXPECT_EQ(check_projections(c, 128), 7);
}

// Micro-batches of 126 tokens (not a multiple of 4, the TMA rows of the row scales): every
// projection stays bf16, bit for bit, and there is no scratch.
TEST(GpuFp8Projections, TokensNotAMultipleOfFourStayBf16) {
  MOE_REQUIRE_GPU();
  EXPECT_EQ(check_projections(test::small_moe_model(0.0), 126), 0);
}

// reserve_sms (NCCL beside the GEMMs): the fp8 projections on 16 multiprocessors give the
// same bits as on all of them (each output tile is summed in the same order).
TEST(GpuFp8Projections, FewerMultiprocessorsGiveTheSameBits) {
  MOE_REQUIRE_GPU();
  const ModelConfig config = test::small_moe_model(0.0);
  const int64_t T = 512;
  cuda::Blas blas;
  ProjectionGemms all(blas, true), few(blas, true);
  all.plan(config, T);
  few.plan(config, T);
  few.set_sm_limit(16);
  for (const DenseGemmShape& g : dense_projection_gemms(config, T)) {
    if (!g.fp8) continue;
    SCOPED_TRACE(g.name);
    const std::vector<bf16> a = tiled(g.M, g.lda, 1.0, 1, 5), w = tiled(g.N, g.K, 0.02, kBlock, 6);
    auto a_d = to_device(a), w_d = to_device(w);
    auto c_all = poisoned<bf16>(g.M * g.ldc), c_few = poisoned<bf16>(g.M * g.ldc);
    run_gemm(all, g, c_all.data(), a_d.data(), w_d.data(), false);
    run_gemm(few, g, c_few.data(), a_d.data(), w_d.data(), false);
    const std::vector<bf16> y_all = to_host(c_all), y_few = to_host(c_few);
    EXPECT_EQ(std::memcmp(y_all.data(), y_few.data(), y_all.size() * sizeof(bf16)), 0);
  }
}

// A projection shape the scratch was not planned for (here K = 512 on the small model,
// whose largest fp8 K is 256) is refused with one line, never written past the scratch.
TEST(GpuFp8Projections, AShapeWithoutPlannedScratchIsRefused) {
  MOE_REQUIRE_GPU();
  cuda::Blas blas;
  ProjectionGemms p8(blas, true);
  p8.plan(test::small_moe_model(0.0), 128);
  gpu::DeviceArray<bf16> x(128 * 512), w(128 * 512), y(128 * 128);
  test::expect_one_line_error<Error>(
      [&] { p8.forward(y.data(), 128, x.data(), w.data(), 128, 512, 128, false, nullptr); },
      {"fp8 projections", "no scratch planned", "[128, 512]"});
}

}  // namespace
}  // namespace moe
