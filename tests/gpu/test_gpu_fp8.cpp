// The expert exchange's fp8 rows on the GPU (cuda::quantize_rows_fp8 /
// dequantize_rows_fp8) against core/fp8.h bit for bit: every bf16 input's code, every
// code's value, random rows with their scales; and parallel.a2a_compression = fp8 over
// thread ranks on one GPU against uncompressed rows (losses close, bytes about halved).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/fp8.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "thread_trainers.h"
#include "moe/gpu_ops.h"
#include "train/synthetic.h"
#include "train/trainer.h"

namespace moe {
namespace {

std::vector<uint8_t> quantize_on_gpu(const std::vector<bf16>& x, int64_t U, int64_t D) {
  auto x_d = test::to_device(x);
  auto out_d = test::poisoned<uint8_t>(static_cast<size_t>(U * fp8_row_bytes(D)));
  cuda::quantize_rows_fp8(out_d.data(), x_d.data(), U, D, nullptr);
  return to_host(out_d);
}

std::vector<uint8_t> quantize_on_cpu(const std::vector<bf16>& x, int64_t U, int64_t D) {
  const std::vector<float> xf = test::to_float(x);
  std::vector<uint8_t> out(static_cast<size_t>(U * fp8_row_bytes(D)));
  for (int64_t u = 0; u < U; ++u) quantize_row_fp8(out.data() + u * fp8_row_bytes(D), xf.data() + u * D, D);
  return out;
}

// Every finite bf16 of magnitude <= 448 (the bit patterns 0 .. 0x43e0 and their negatives)
// in rows led by 448, so that the scale is exactly 1 and each code is the conversion of
// the value itself: the device's cvt.rn.satfinite against float_to_fp8_e4m3.
TEST(GpuFp8, EveryBf16ValueConvertsAsTheHostReference) {
  MOE_REQUIRE_GPU();
  const int64_t D = 256;
  std::vector<bf16> x;
  for (uint32_t bits = 0; bits <= 0x43e0u; ++bits)
    for (uint32_t sign : {0u, 0x8000u}) {
      if (x.size() % D == 0) x.push_back(float_to_bf16(448.0f));
      x.push_back(bf16{static_cast<uint16_t>(bits | sign)});
    }
  while (x.size() % D != 0) x.push_back(bf16{0});
  const int64_t U = static_cast<int64_t>(x.size()) / D;
  const auto gpu = quantize_on_gpu(x, U, D), cpu = quantize_on_cpu(x, U, D);
  for (int64_t u = 0; u < U; ++u) {
    float scale;
    std::memcpy(&scale, cpu.data() + u * fp8_row_bytes(D), 4);
    ASSERT_EQ(scale, 1.0f) << "row " << u;
  }
  int64_t differ = 0;
  for (size_t i = 0; i < gpu.size(); ++i) differ += gpu[i] != cpu[i];
  EXPECT_EQ(differ, 0);
}

// Every code (NaN's aside) with scale 1 and with a random scale back to bf16.
TEST(GpuFp8, EveryCodeDequantisesAsTheHostReference) {
  MOE_REQUIRE_GPU();
  const int64_t D = 256;
  std::vector<uint8_t> rows(static_cast<size_t>(2 * fp8_row_bytes(D)), 0);
  const float scales[2] = {1.0f, 0.0123f};
  for (int u = 0; u < 2; ++u) {
    uint8_t* row = rows.data() + u * fp8_row_bytes(D);
    std::memcpy(row, &scales[u], 4);
    for (int c = 0; c < 256; ++c) row[4 + c] = (c & 0x7f) == 0x7f ? 0 : static_cast<uint8_t>(c);
  }
  auto rows_d = test::to_device(rows);
  auto out_d = test::poisoned<bf16>(static_cast<size_t>(2 * D));
  cuda::dequantize_rows_fp8(out_d.data(), rows_d.data(), 2, D, nullptr);
  const auto out = to_host(out_d);
  std::vector<float> want(static_cast<size_t>(D));
  for (int u = 0; u < 2; ++u) {
    dequantize_row_fp8(want.data(), rows.data() + u * fp8_row_bytes(D), D);
    for (int64_t d = 0; d < D; ++d)
      EXPECT_EQ(out[static_cast<size_t>(u * D + d)].bits, float_to_bf16(want[static_cast<size_t>(d)]).bits)
          << "row " << u << " code " << d;
  }
}

// Random rows of several magnitudes and an odd D (padding), a row of zeros among them:
// the same bytes (scales, codes, padding), and the same values back.
TEST(GpuFp8, RandomRowsQuantiseAndDequantiseAsTheHostReference) {
  MOE_REQUIRE_GPU();
  for (int64_t D : {1, 37, 128, 1000}) {
    const int64_t U = 67;
    std::vector<float> xf;
    for (int64_t u = 0; u < U; ++u) {
      const auto row = test::random_bf16_floats(static_cast<size_t>(D), 10 + u, "fp8 rows", std::ldexp(1.0, u % 24 - 12));
      xf.insert(xf.end(), row.begin(), row.end());
    }
    std::fill(xf.begin() + 5 * D, xf.begin() + 6 * D, 0.0f);
    const auto x = test::to_bf16(xf);
    const auto gpu = quantize_on_gpu(x, U, D), cpu = quantize_on_cpu(x, U, D);
    ASSERT_EQ(gpu, cpu) << "D = " << D;
    auto rows_d = test::to_device(cpu);
    auto out_d = test::poisoned<bf16>(static_cast<size_t>(U * D));
    cuda::dequantize_rows_fp8(out_d.data(), rows_d.data(), U, D, nullptr);
    const auto out = to_host(out_d);
    std::vector<float> want(static_cast<size_t>(D));
    for (int64_t u = 0; u < U; ++u) {
      dequantize_row_fp8(want.data(), cpu.data() + u * fp8_row_bytes(D), D);
      for (int64_t d = 0; d < D; ++d)
        ASSERT_EQ(out[static_cast<size_t>(u * D + d)].bits, float_to_bf16(want[static_cast<size_t>(d)]).bits)
            << "D = " << D << " row " << u << " element " << d;
    }
  }
}

// The experts' side of the exchange with the fp8 rows inside the row kernels: combine
// and permute_backward writing fp8 rows, permute_forward reading them, bit for bit the
// bf16 kernel followed (or preceded) by quantize/dequantize_rows_fp8; kept rows scattered
// over a larger row buffer, some slots dropped (-1), a vectorised, a ragged and a wide D.
TEST(GpuFp8, ExpertSideRowKernelsWithFp8RowsMatchTheUnfusedPairs) {
  MOE_REQUIRE_GPU();
  const int64_t U = 37, K = 3, R = U * K + 5;
  const CounterRng rng(11, "combine weights");
  std::vector<int32_t> row_UK(static_cast<size_t>(U * K));
  std::vector<float> weight_UK(static_cast<size_t>(U * K));
  for (size_t i = 0; i < row_UK.size(); ++i) {
    row_UK[i] = i % 7 == 3 ? -1 : static_cast<int32_t>(i);  // distinct rows, some slots dropped
    weight_UK[i] = static_cast<float>(rng.uniform(i));
  }
  // 3 local experts over the first 100 rows, each row's token in [0, U).
  const std::vector<int32_t> offsets_E1{0, 40, 40, 100};
  std::vector<int32_t> token_of_row(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) token_of_row[static_cast<size_t>(r)] = static_cast<int32_t>((r * 5) % U);
  auto row_d = test::to_device(row_UK);
  auto weight_d = test::to_device(weight_UK);
  auto offsets_d = test::to_device(offsets_E1);
  auto token_d = test::to_device(token_of_row);
  for (int64_t D : {256, 100, 4096}) {
    SCOPED_TRACE("D " + std::to_string(D));
    const int64_t B = fp8_row_bytes(D);
    auto y_d = test::to_device_bf16(test::random_bf16_floats(static_cast<size_t>(R * D), 21, "y"));
    auto rows_d = test::poisoned<bf16>(static_cast<size_t>(U * D));
    auto want_d = test::poisoned<uint8_t>(static_cast<size_t>(U * B));
    auto got_d = test::poisoned<uint8_t>(static_cast<size_t>(U * B));
    cuda::combine_forward(rows_d.data(), y_d.data(), weight_d.data(), row_d.data(), U, K, D, nullptr);
    cuda::quantize_rows_fp8(want_d.data(), rows_d.data(), U, D, nullptr);
    cuda::combine_forward_fp8(got_d.data(), y_d.data(), weight_d.data(), row_d.data(), U, K, D, nullptr);
    EXPECT_EQ(to_host(got_d), to_host(want_d)) << "combine";
    cuda::permute_backward(rows_d.data(), y_d.data(), row_d.data(), U, K, D, false, nullptr);
    cuda::quantize_rows_fp8(want_d.data(), rows_d.data(), U, D, nullptr);
    cuda::permute_backward_fp8(got_d.data(), y_d.data(), row_d.data(), U, K, D, nullptr);
    EXPECT_EQ(to_host(got_d), to_host(want_d)) << "permute_backward";
    // want_d holds fp8 rows of U tokens: unpack them into the experts' rows both ways.
    auto received_d = test::poisoned<bf16>(static_cast<size_t>(U * D));
    auto x_want_d = test::poisoned<bf16>(static_cast<size_t>(R * D));
    auto x_got_d = test::poisoned<bf16>(static_cast<size_t>(R * D));
    cuda::dequantize_rows_fp8(received_d.data(), want_d.data(), U, D, nullptr);
    cuda::permute_forward(x_want_d.data(), received_d.data(), token_d.data(), offsets_d.data(), R, 3, D, nullptr);
    cuda::permute_forward_fp8(x_got_d.data(), want_d.data(), token_d.data(), offsets_d.data(), R, 3, D, nullptr);
    const auto want = to_host(x_want_d), got = to_host(x_got_d);
    for (size_t i = 0; i < static_cast<size_t>(100 * D); ++i) ASSERT_EQ(got[i].bits, want[i].bits) << "permute_forward " << i;
  }
}

struct RankRun {
  std::vector<double> losses;
  std::vector<int64_t> a2a_bytes;
  std::vector<int> fp8;
  std::string error;
};

// 4 thread ranks, expert parallel 4 (8 experts, 2 per rank), 2 sequences per rank.
RunConfig ep4_thread_ranks_run(int64_t steps) {
  RunConfig config = test::tiny_gpu_run(steps);
  config.model.moe.n_experts = 8;
  config.training.micro_batch = 2;  // per rank
  config.metrics.log_interval = 1000;
  config.parallel.expert_parallel = 4;
  return config;
}

std::vector<RankRun> train_ranks(const RunConfig& config, int n) {
  std::vector<RankRun> runs(static_cast<size_t>(n));
  const std::vector<std::string> errors = test::run_thread_trainers(config, n, [&](int r, Trainer& trainer) {
    RankRun& run = runs[static_cast<size_t>(r)];
    trainer.on_step = [&run](const StepStats& s) {
      run.losses.push_back(s.loss);
      run.a2a_bytes.push_back(s.a2a_bytes);
      for (const auto& layer : s.layers) run.fp8.push_back(layer.a2a_fp8);
    };
  });
  for (int r = 0; r < n; ++r) runs[static_cast<size_t>(r)].error = errors[static_cast<size_t>(r)];
  return runs;
}

// 4 thread ranks, expert parallel 4 (8 experts, 2 per rank), 30 steps: fp8 rows against
// bf16 rows. The first 5 steps' losses within 1% (the same weights; only the exchange's
// rounding differs), the last 10 steps' mean within 3% (the CPU test's bound; this model
// barely learns the task in 30 steps, 5.78 against ln 320 = 5.77, so the fp8 kernels'
// bit-exact tests above and the CPU tcp-rank test carry the learning), and the bytes per
// step between 0.45 and 0.6 of bf16's (rows of 4 + 128 bytes instead of 256, routing and
// weight gradients unchanged; the two runs route differently, so the rows differ a little).
TEST(GpuFp8, ThreadRanksTrainLikeUncompressedWithAboutHalfTheBytes) {
  MOE_REQUIRE_GPU();
  RunConfig config = ep4_thread_ranks_run(30);
  const auto none = train_ranks(config, 4);
  config.parallel.a2a_compression = A2aCompression::Fp8;
  const auto fp8 = train_ranks(config, 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(none[static_cast<size_t>(r)].error, "") << r;
    ASSERT_EQ(fp8[static_cast<size_t>(r)].error, "") << r;
  }
  ASSERT_EQ(none[0].losses.size(), 30u);
  ASSERT_EQ(fp8[0].losses.size(), 30u);
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(fp8[0].losses[i], none[0].losses[i], 0.01 * none[0].losses[i]) << i;
  double late_none = 0, late_fp8 = 0;
  for (size_t i = 20; i < 30; ++i) {
    late_none += none[0].losses[i] / 10;
    late_fp8 += fp8[0].losses[i] / 10;
  }
  EXPECT_NEAR(late_fp8, late_none, 0.03 * late_none);
  for (int flag : fp8[0].fp8) EXPECT_EQ(flag, 1);
  for (int flag : none[0].fp8) EXPECT_EQ(flag, 0);
  for (int r = 0; r < 4; ++r) {
    int64_t b_none = 0, b_fp8 = 0;
    for (size_t i = 0; i < 30; ++i) {
      b_none += none[static_cast<size_t>(r)].a2a_bytes[i];
      b_fp8 += fp8[static_cast<size_t>(r)].a2a_bytes[i];
    }
    ASSERT_GT(b_none, 0);
    const double ratio = static_cast<double>(b_fp8) / static_cast<double>(b_none);
    EXPECT_GT(ratio, 0.45) << "rank " << r;  // the runs route differently: rank 2 sent 0.48 on the H200
    EXPECT_LT(ratio, 0.6) << "rank " << r;
  }
}

// parallel.a2a_compression = auto on 4 thread ranks with a threshold every step exceeds
// (alert_comm_wait = 0): after 3 steps above it (A2aCompressionSwitch::kPatience) one MoE
// layer switches to fp8, after 3 more the other, on every rank at the same step, from the
// layers' exchange times measured with CUDA events. Until the first switch the run is
// bit-identical to an uncompressed one; once both layers send fp8, each step sends about
// half the bytes of the uncompressed run's.
TEST(GpuFp8, AutoSwitchesLayersOneByOneOnEveryRank) {
  MOE_REQUIRE_GPU();
  RunConfig config = ep4_thread_ranks_run(12);
  const auto none = train_ranks(config, 4);
  config.parallel.a2a_compression = A2aCompression::Auto;
  config.metrics.alert_comm_wait = 0.0;
  const auto automatic = train_ranks(config, 4);
  const size_t layers = 2;
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(none[static_cast<size_t>(r)].error, "") << r;
    ASSERT_EQ(automatic[static_cast<size_t>(r)].error, "") << r;
    ASSERT_EQ(automatic[static_cast<size_t>(r)].fp8.size(), 12 * layers) << r;
  }
  // Compressed layers per step: 0 for steps 1-3 (the switch follows step 3), 1 for 4-6, 2 after.
  for (size_t step = 0; step < 12; ++step) {
    int on = 0;
    for (size_t l = 0; l < layers; ++l) on += automatic[0].fp8[step * layers + l];
    EXPECT_EQ(on, step < 3 ? 0 : step < 6 ? 1 : 2) << "step " << step + 1;
    for (int r = 1; r < 4; ++r)
      for (size_t l = 0; l < layers; ++l)
        EXPECT_EQ(automatic[static_cast<size_t>(r)].fp8[step * layers + l], automatic[0].fp8[step * layers + l])
            << "rank " << r << " step " << step + 1 << " layer " << l;
  }
  for (size_t step = 0; step < 3; ++step) EXPECT_EQ(automatic[0].losses[step], none[0].losses[step]) << step;
  int64_t b_none = 0, b_auto = 0;
  for (size_t step = 6; step < 12; ++step) {
    b_none += none[0].a2a_bytes[step];
    b_auto += automatic[0].a2a_bytes[step];
  }
  ASSERT_GT(b_none, 0);
  const double ratio = static_cast<double>(b_auto) / static_cast<double>(b_none);
  EXPECT_GT(ratio, 0.45);
  EXPECT_LT(ratio, 0.6);
}

}  // namespace
}  // namespace moe
