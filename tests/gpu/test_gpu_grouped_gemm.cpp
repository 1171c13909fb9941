// The experts' grouped GEMMs (CUTLASS, device-side row offsets) against a CPU reference in
// double: ragged and empty experts (first, middle, last), rows dropped past the last
// expert (they must stay untouched), two sets in one launch, accumulation.
#include <gtest/gtest.h>

#include <numeric>

#include "gpu_test_util.h"
#include "kernels/gpu_ops.h"

namespace moe {
namespace {

struct GroupedCase {
  std::vector<int32_t> rows_per_expert;
  int64_t dropped_rows;  // rows of the buffer past the last expert's
  int64_t N, K;
};

class GpuGroupedGemm : public ::testing::TestWithParam<GroupedCase> {};

TEST_P(GpuGroupedGemm, ForwardTwoSetsMatchesCpu) {
  MOE_REQUIRE_GPU();
  const GroupedCase& c = GetParam();
  const int64_t E = static_cast<int64_t>(c.rows_per_expert.size()), N = c.N, K = c.K;
  const std::vector<int32_t> offsets = offsets_of(c.rows_per_expert);
  const int64_t kept = offsets[E], R = kept + c.dropped_rows;
  const auto x = random_bf16_floats(R * K, 1, "x");
  const auto w0 = random_bf16_floats(E * N * K, 2, "w0", 0.1), w1 = random_bf16_floats(E * N * K, 3, "w1", 0.1);
  auto x_d = to_device_bf16(x), w0_d = to_device_bf16(w0), w1_d = to_device_bf16(w1);
  auto offsets_d = to_device(offsets);
  auto out_d = poisoned<bf16>(R * 2 * N);  // [R, 2N]: set 0 in columns [0, N), set 1 in [N, 2N)
  cuda::ExpertGemm gemm(E);
  bf16* outs[2] = {out_d.data(), out_d.data() + N};
  const bf16* ws[2] = {w0_d.data(), w1_d.data()};
  gemm.forward(2, outs, 2 * N, x_d.data(), K, ws, offsets_d.data(), N, K, nullptr);
  const std::vector<bf16> got_bits = to_host(out_d);
  const std::vector<float> got = test::to_float(got_bits);
  std::vector<float> want(kept * 2 * N), got_kept(got.begin(), got.begin() + kept * 2 * N);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int s = 0; s < 2; ++s)
        for (int64_t n = 0; n < N; ++n) {
          const std::vector<float>& w = s == 0 ? w0 : w1;
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += double(x[r * K + k]) * w[(e * N + n) * K + k];
          want[r * 2 * N + s * N + n] = static_cast<float>(acc);
        }
  expect_close("grouped forward", got_kept, want, 1.0 / 128, 1e-3);
  expect_rows_untouched(got_bits, kept, R, 2 * N);
}

TEST_P(GpuGroupedGemm, BackwardDataMatchesCpuAndAccumulates) {
  MOE_REQUIRE_GPU();
  const GroupedCase& c = GetParam();
  const int64_t E = static_cast<int64_t>(c.rows_per_expert.size()), N = c.N, K = c.K;
  const std::vector<int32_t> offsets = offsets_of(c.rows_per_expert);
  const int64_t kept = offsets[E], R = kept + c.dropped_rows;
  const auto dy = random_bf16_floats(R * K, 4, "dy");
  const auto w = random_bf16_floats(E * K * N, 5, "w", 0.1);  // per expert [K, N]
  const auto before = random_bf16_floats(R * N, 6, "before");
  auto dy_d = to_device_bf16(dy), w_d = to_device_bf16(w);
  auto offsets_d = to_device(offsets);
  cuda::ExpertGemm gemm(E);
  for (const float beta : {0.0f, 1.0f}) {
    auto out_d = beta == 0 ? poisoned<bf16>(R * N) : to_device_bf16(before);
    gemm.backward_data(out_d.data(), N, dy_d.data(), K, w_d.data(), offsets_d.data(), N, K, beta, nullptr);
    const std::vector<bf16> got_bits = to_host(out_d);
    const std::vector<float> got = test::to_float(got_bits);
    std::vector<float> want(kept * N), got_kept(got.begin(), got.begin() + kept * N);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
        for (int64_t n = 0; n < N; ++n) {
          double acc = beta * double(before[r * N + n]);
          for (int64_t k = 0; k < K; ++k) acc += double(dy[r * K + k]) * w[(e * K + k) * N + n];
          want[r * N + n] = static_cast<float>(acc);
        }
    expect_close(beta == 0 ? "grouped dgrad" : "grouped dgrad, accumulated", got_kept, want, 1.0 / 128, 2e-3);
    if (beta == 0) expect_rows_untouched(got_bits, kept, R, N);
  }
}

TEST_P(GpuGroupedGemm, BackwardWeightTwoSetsAccumulatesFp32) {
  MOE_REQUIRE_GPU();
  const GroupedCase& c = GetParam();
  // dW_e [M, N] += a_e^T [M, rows] @ b_e [rows, N], with M = N of the case and N = K.
  const int64_t E = static_cast<int64_t>(c.rows_per_expert.size()), M = c.N, N = c.K;
  const std::vector<int32_t> offsets = offsets_of(c.rows_per_expert);
  const int64_t R = offsets[E] + c.dropped_rows;
  const auto a = random_bf16_floats(R * 2 * M, 7, "a");  // [R, 2M]: set 0 columns [0, M), set 1 [M, 2M)
  const auto b = random_bf16_floats(R * N, 8, "b");
  std::vector<float> dw0 = random_bf16_floats(E * M * N, 9, "dw0"), dw1 = random_bf16_floats(E * M * N, 10, "dw1");
  auto a_d = to_device_bf16(a), b_d = to_device_bf16(b);
  auto offsets_d = to_device(offsets);
  auto dw0_d = to_device(dw0), dw1_d = to_device(dw1);
  cuda::ExpertGemm gemm(E);
  float* dws[2] = {dw0_d.data(), dw1_d.data()};
  const bf16* as[2] = {a_d.data(), a_d.data() + M};
  gemm.backward_weight(2, dws, as, 2 * M, b_d.data(), N, offsets_d.data(), M, N, nullptr);
  for (int s = 0; s < 2; ++s) {
    const std::vector<float>& before = s == 0 ? dw0 : dw1;
    std::vector<float> want(before);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = before[(e * M + m) * N + n];
          for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) acc += double(a[r * 2 * M + s * M + m]) * b[r * N + n];
          want[(e * M + m) * N + n] = static_cast<float>(acc);
        }
    const std::vector<float> got = to_host(s == 0 ? dw0_d : dw1_d);
    expect_close(s == 0 ? "grouped wgrad set 0" : "grouped wgrad set 1", got, want, 1e-4, 1e-3);
    // Experts without rows keep their gradient bit for bit.
    for (int64_t e = 0; e < E; ++e)
      if (offsets[e + 1] == offsets[e])
        for (int64_t i = e * M * N; i < (e + 1) * M * N; ++i) ASSERT_EQ(got[i], before[i]) << "empty expert " << e;
  }
}

// One case's inputs on the device and the three GEMMs run on them (forward, data and
// weight gradients), for the tests that compare two ways of running them bit for bit.
struct GemmRun {
  std::vector<bf16> out, dx;
  std::vector<float> dw;
};

struct GemmInputs {
  int64_t E, N, K, R;
  gpu::DeviceArray<bf16> x, w, dy;
  gpu::DeviceArray<int32_t> offsets;

  GemmInputs(const GroupedCase& c, uint64_t seed)
      : E(static_cast<int64_t>(c.rows_per_expert.size())), N(c.N), K(c.K),
        R(offsets_of(c.rows_per_expert)[E] + c.dropped_rows),
        x(to_device_bf16(random_bf16_floats(R * K, seed, "x"))),
        w(to_device_bf16(random_bf16_floats(E * N * K, seed + 1, "w", 0.1))),
        dy(to_device_bf16(random_bf16_floats(R * N, seed + 2, "dy"))),
        offsets(to_device(offsets_of(c.rows_per_expert))) {}

  GemmRun run(cuda::ExpertGemm& gemm) const {
    auto out_d = poisoned<bf16>(R * N);
    bf16* out[1] = {out_d.data()};
    const bf16* ws[1] = {w.data()};
    gemm.forward(1, out, N, x.data(), K, ws, offsets.data(), N, K, nullptr);
    auto dx_d = poisoned<bf16>(R * K);
    gemm.backward_data(dx_d.data(), K, dy.data(), N, w.data(), offsets.data(), K, N, 0.0f, nullptr);
    auto dw_d = to_device(std::vector<float>(E * N * K, 0.25f));
    float* dw[1] = {dw_d.data()};
    const bf16* a[1] = {dy.data()};
    gemm.backward_weight(1, dw, a, N, x.data(), K, offsets.data(), N, K, nullptr);
    return {to_host(out_d), to_host(dx_d), to_host(dw_d)};
  }
};

void expect_same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i].bits, b[i].bits) << what << " element " << i;
}

// The kernels are persistent; on fewer multiprocessors (parallel.comm_sms) each tile is
// still computed by one CTA in the same order: the same bits.
TEST_P(GpuGroupedGemm, FewerMultiprocessorsGiveTheSameBits) {
  MOE_REQUIRE_GPU();
  const GemmInputs in(GetParam(), 11);
  cuda::ExpertGemm gemm(in.E);
  std::vector<GemmRun> runs;
  for (int sm_limit : {0, 9}) {
    gemm.set_sm_limit(sm_limit);
    runs.push_back(in.run(gemm));
  }
  expect_same_bits(runs[0].out, runs[1].out, "forward");
  EXPECT_TRUE(runs[0].dw == runs[1].dw) << "weight gradients differ on 9 multiprocessors";
}

// Room for more experts than a call runs over (an EP rank's count after a re-placement):
// set_experts(E) gives the bits of a GEMM made for E, and set_experts(0) writes nothing.
TEST_P(GpuGroupedGemm, FewerExpertsThanTheRoomGiveTheSameBits) {
  MOE_REQUIRE_GPU();
  const GemmInputs in(GetParam(), 21);
  const int64_t E = in.E, N = in.N, K = in.K, R = in.R;
  cuda::ExpertGemm exact(E), roomy(E + 5);
  roomy.set_experts(E);
  const GemmRun want = in.run(exact), got = in.run(roomy);
  expect_same_bits(got.out, want.out, "forward");
  expect_same_bits(got.dx, want.dx, "data gradient");
  EXPECT_TRUE(got.dw == want.dw) << "weight gradients differ with room for 5 more experts";
  // No experts: nothing written, not even the rows of the first expert.
  roomy.set_experts(0);
  auto out_d = poisoned<bf16>(R * N);
  bf16* out[1] = {out_d.data()};
  const bf16* w[1] = {in.w.data()};
  roomy.forward(1, out, N, in.x.data(), K, w, in.offsets.data(), N, K, nullptr);
  expect_rows_untouched(to_host(out_d), 0, R, N);
  EXPECT_THROW(roomy.set_experts(E + 6), Error);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuGroupedGemm,
    ::testing::Values(GroupedCase{{0, 37, 0, 300, 1, 129, 0}, 11, 64, 96},    // empty first, middle and last
                      GroupedCase{{512, 512, 512, 512}, 0, 256, 384},          // even, tile-aligned
                      GroupedCase{{3, 1000, 17, 0, 250, 8, 64, 1}, 40, 136, 72},  // ragged, N not a tile multiple
                      GroupedCase{std::vector<int32_t>(64, 0), 5, 32, 32},    // every expert empty
                      GroupedCase{[] {
                                    std::vector<int32_t> rows(64);
                                    for (int e = 0; e < 64; ++e) rows[e] = (e * 37) % 97;
                                    return rows;
                                  }(),
                                  0, 64, 128}));  // many small groups

}  // namespace
}  // namespace moe
