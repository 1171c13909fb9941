// The GPU model's glue kernels (bias rows, casts, column sums, batched row sums) against CPU
// loops on random inputs, at sizes from empty to the bench models' router shapes.
#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"

namespace moe {
namespace {

struct GlueCase {
  int64_t rows, cols;
};

class GpuGlue : public ::testing::TestWithParam<GlueCase> {};

TEST_P(GpuGlue, ColumnSumsAccumulateLikeCpu) {
  MOE_REQUIRE_GPU();
  const auto [rows, cols] = GetParam();
  const auto x = random_bf16_floats(rows * cols, 1, "x");
  const auto before = random_bf16_floats(cols, 2, "before");
  auto x_d = to_device(x), out_d = to_device(before);
  auto partial_d = poisoned<float>(static_cast<size_t>(std::max<int64_t>(1, cuda::column_sums_partial_count(rows, cols))));
  cuda::add_column_sums(out_d.data(), x_d.data(), rows, cols, partial_d.data(), nullptr);
  std::vector<float> want(before);
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += x[r * cols + c];
    want[c] = static_cast<float>(want[c] + sum);
  }
  // fp32 sums of up to 16k unit normals: the order differs from the double reference.
  expect_close("column sums", to_host(out_d), want, 1e-5, 1e-5 * std::sqrt(static_cast<double>(rows) + 1));
  // Deterministic: the same inputs give the same bits.
  auto again_d = to_device(before);
  cuda::add_column_sums(again_d.data(), x_d.data(), rows, cols, partial_d.data(), nullptr);
  EXPECT_TRUE(to_host(again_d) == to_host(out_d));
}

TEST_P(GpuGlue, BiasRowsAndCastMatchCpu) {
  MOE_REQUIRE_GPU();
  const auto [rows, cols] = GetParam();
  const auto x = random_bf16_floats(rows * cols, 3, "x");
  const auto bias = random_bf16_floats(cols, 4, "bias");
  auto x_d = to_device(x), bias_d = to_device(bias);
  cuda::add_bias_rows(x_d.data(), bias_d.data(), rows, cols, nullptr);
  std::vector<float> want(x);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) want[r * cols + c] += bias[c];
  expect_close("bias rows", to_host(x_d), want, 0, 0);
  auto cast_d = test::poisoned<bf16>(rows * cols);
  cuda::cast_to_bf16(cast_d.data(), x_d.data(), rows * cols, nullptr);
  std::vector<float> rounded(want.size());
  for (size_t i = 0; i < want.size(); ++i) rounded[i] = bf16_to_float(float_to_bf16(want[i]));
  expect_close("cast", test::to_float(to_host(cast_d)), rounded, 0, 0);
  auto widened_d = test::poisoned<float>(rows * cols);
  cuda::cast_to_float(widened_d.data(), cast_d.data(), rows * cols, nullptr);
  expect_close("cast back", to_host(widened_d), rounded, 0, 0);
}

// The attention's query chunks add earlier chunks' dK, dV rows into the later ones': the
// first `rows` rows of each of B batches of S rows, row strides wider than cols (the
// heads' [.., ld] layout), in fp32 rounded to bf16 once; the rows past `rows`, the columns
// past cols and dst's padding stay as they were.
TEST(GpuGlue, BatchedRowsAddLikeCpuAndLeaveTheRestAlone) {
  MOE_REQUIRE_GPU();
  struct Case {
    int64_t B, S, rows, cols, ld_dst, ld_src;
  };
  for (const Case& c : {Case{1, 4, 4, 8, 8, 8}, Case{3, 37, 20, 64, 96, 80}, Case{8, 256, 129, 128, 384, 128},
                        Case{2, 9, 7, 13, 15, 13}, Case{2, 5, 0, 16, 16, 16}}) {
    SCOPED_TRACE(testing::Message() << "B " << c.B << " S " << c.S << " rows " << c.rows << " cols " << c.cols);
    const auto dst = random_bf16_floats(static_cast<size_t>(c.B * c.S * c.ld_dst), 5, "dst");
    const auto src = random_bf16_floats(static_cast<size_t>(c.B * c.S * c.ld_src), 6, "src");
    auto dst_d = test::to_device_bf16(dst), src_d = test::to_device_bf16(src);
    cuda::add_batched_rows(dst_d.data(), c.ld_dst, src_d.data(), c.ld_src, c.B, c.S, c.rows, c.cols, nullptr);
    std::vector<float> want(dst);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t k = 0; k < c.cols; ++k) {
          float& out = want[static_cast<size_t>((b * c.S + r) * c.ld_dst + k)];
          out = bf16_to_float(float_to_bf16(out + src[static_cast<size_t>((b * c.S + r) * c.ld_src + k)]));
        }
    expect_close("batched rows", test::to_host_float(dst_d), want, 0, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuGlue,
                         ::testing::Values(GlueCase{0, 8}, GlueCase{3, 5}, GlueCase{1000, 64}, GlueCase{16384, 8},
                                           GlueCase{32768, 64}, GlueCase{513, 100}));

}  // namespace
}  // namespace moe
