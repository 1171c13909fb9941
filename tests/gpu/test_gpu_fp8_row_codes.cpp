// Kernels that write e4m3 row codes beside the bf16 rows they write (training.precision =
// fp8: the norm before the q|k|v projection, RoPE's backward before its data gradient)
// against the plain kernel followed by quantize_rows_blockwise, which tests/gpu/
// test_gpu_fp8_gemm.cpp checks against the CPU: the same bytes everywhere, on the fused
// paths and on the fallbacks (every output starts from the same poison, so a byte written
// by one side only shows).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"

namespace moe {
namespace {

template <typename T>
void expect_same_bytes(const gpu::DeviceArray<T>& got, const gpu::DeviceArray<T>& want, const std::string& what) {
  const std::vector<T> g = to_host(got), w = to_host(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  EXPECT_EQ(std::memcmp(g.data(), w.data(), g.size() * sizeof(T)), 0) << what << " differ";
}

// Rows whose magnitudes span 2^-8 .. 2^8, so that the tiles' scales differ.
std::vector<float> spread_rows(int64_t rows, int64_t width, uint64_t seed) {
  std::vector<float> x = random_bf16_floats(rows * width, seed, "rows");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < width; ++i) x[r * width + i] = std::ldexp(x[r * width + i], static_cast<int>(r % 17) - 8);
  return x;
}

TEST(GpuFp8RowCodes, RmsNormWritesTheCodesTheQuantiserGives) {
  MOE_REQUIRE_GPU();
  // The vector path with and without the residual add, a row of one tile, and D past the
  // vector path's 8192 (the two kernels).
  struct Case {
    int64_t T, D;
    bool branch;
  };
  for (const Case c : {Case{300, 2048, true}, Case{17, 256, false}, Case{9, 128, true}, Case{5, 8320, true}}) {
    const int64_t T = c.T, D = c.D;
    auto x_d = to_device_bf16(spread_rows(T, D, 1)), branch_d = to_device_bf16(spread_rows(T, D, 2));
    auto w_d = to_device_bf16(random_bf16_floats(D, 3, "w"));
    const bf16* branch = c.branch ? branch_d.data() : nullptr;
    auto y_want = poisoned<bf16>(T * D), y_got = poisoned<bf16>(T * D);
    auto res_want = poisoned<bf16>(T * D), res_got = poisoned<bf16>(T * D);
    auto rstd_want = poisoned<float>(T), rstd_got = poisoned<float>(T);
    auto codes_want = poisoned<uint8_t>(T * D), codes_got = poisoned<uint8_t>(T * D);
    auto scales_want = poisoned<float>(T * D / 128), scales_got = poisoned<float>(T * D / 128);
    cuda::rmsnorm_forward(y_want.data(), rstd_want.data(), c.branch ? res_want.data() : nullptr, x_d.data(), branch,
                          w_d.data(), T, D, 1e-5f, nullptr);
    cuda::quantize_rows_blockwise(codes_want.data(), scales_want.data(), y_want.data(), D, nullptr, 1, T, D, nullptr);
    const cuda::RowCodes codes{codes_got.data(), scales_got.data(), nullptr, 1, T};
    cuda::rmsnorm_forward_fp8(y_got.data(), codes, rstd_got.data(), c.branch ? res_got.data() : nullptr, x_d.data(),
                              branch, w_d.data(), T, D, 1e-5f, nullptr);
    const std::string at = " (T " + std::to_string(T) + ", D " + std::to_string(D) + ")";
    expect_same_bytes(y_got, y_want, "y" + at);
    expect_same_bytes(rstd_got, rstd_want, "rstd" + at);
    expect_same_bytes(res_got, res_want, "residual" + at);
    expect_same_bytes(codes_got, codes_want, "codes" + at);
    expect_same_bytes(scales_got, scales_want, "scales" + at);
  }
  auto y_d = poisoned<bf16>(4 * 200);
  auto rstd_d = poisoned<float>(4);
  auto codes_d = poisoned<uint8_t>(4 * 200);
  auto scales_d = poisoned<float>(8);
  EXPECT_THROW(cuda::rmsnorm_forward_fp8(y_d.data(), {codes_d.data(), scales_d.data(), nullptr, 1, 4}, rstd_d.data(),
                                         nullptr, y_d.data(), nullptr, y_d.data(), 4, 200, 1e-5f, nullptr),
               Error);
}

TEST(GpuFp8RowCodes, RopeBackwardWritesTheCodesTheQuantiserGives) {
  MOE_REQUIRE_GPU();
  // (T, heads turned, heads in a row, d): the fused kernel (d = 128; with GQA's k and v
  // heads, and a row of one head), and the two kernels for d = 64.
  struct Case {
    int64_t T, N_rope, N_all, d;
  };
  for (const Case c : {Case{300, 24, 32, 128}, Case{33, 1, 1, 128}, Case{77, 3, 4, 64}}) {
    const int64_t T = c.T, ld = c.N_all * c.d;
    std::vector<int32_t> positions(T);
    CounterRng rng(4, "positions");
    for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(rng.bits(t)[0] % 512);
    auto pos_d = to_device(positions);
    auto table_d = poisoned<float>(512 * c.d);
    cuda::rope_table(table_d.data(), 512, c.d, 10000.0f, nullptr);
    const std::vector<float> rows = spread_rows(T, ld, 5);
    auto want_d = to_device_bf16(rows), got_d = to_device_bf16(rows);
    auto codes_want = poisoned<uint8_t>(T * ld), codes_got = poisoned<uint8_t>(T * ld);
    auto scales_want = poisoned<float>(T * ld / 128), scales_got = poisoned<float>(T * ld / 128);
    cuda::rope_backward(want_d.data(), pos_d.data(), table_d.data(), T, c.N_rope, c.d, nullptr, ld);
    cuda::quantize_rows_blockwise(codes_want.data(), scales_want.data(), want_d.data(), ld, nullptr, 1, T, ld, nullptr);
    cuda::rope_backward_fp8(got_d.data(), {codes_got.data(), scales_got.data(), nullptr, 1, T}, pos_d.data(),
                            table_d.data(), T, c.N_rope, c.N_all, c.d, nullptr);
    const std::string at = " (T " + std::to_string(T) + ", " + std::to_string(c.N_rope) + " of " +
                           std::to_string(c.N_all) + " heads of " + std::to_string(c.d) + ")";
    expect_same_bytes(got_d, want_d, "rows" + at);
    expect_same_bytes(codes_got, codes_want, "codes" + at);
    expect_same_bytes(scales_got, scales_want, "scales" + at);
  }
}

}  // namespace
}  // namespace moe
