// Every CUDA kernel against the CPU op of the same name, on fresh random inputs
// (rounded to bf16 so both sides see the same values), with poisoned outputs, at
// several sizes including ragged ones. Tolerances are bf16's: the GPU stores bf16,
// the CPU reference computes in fp32 on the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cross_entropy.h"
#include "kernels/gpu_ops.h"
#include "moe/gpu_ops.h"
#include "optim/gpu_ops.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "model/parameters.h"
#include "moe/router.h"
#include "optim/adamw.h"

namespace moe {
namespace {

struct Size2 {
  int64_t rows, cols;
};

class GpuRmsNorm : public ::testing::TestWithParam<std::tuple<Size2, bool>> {};

TEST_P(GpuRmsNorm, ForwardAndBackwardMatchCpu) {
  MOE_REQUIRE_GPU();
  const auto [size, with_residual] = GetParam();
  const int64_t T = size.rows, D = size.cols;
  const float eps = 1e-5f;
  auto x = random_bf16_floats(T * D, 1, "x", 2.0);
  auto branch = random_bf16_floats(T * D, 2, "branch");
  auto w = random_bf16_floats(D, 3, "w", 0.5);
  auto dy = random_bf16_floats(T * D, 4, "dy");
  auto dres = random_bf16_floats(T * D, 5, "dres");
  // CPU reference on what the GPU normalises: the bf16-rounded residual sum.
  std::vector<float> residual = x;
  if (with_residual)
    for (int64_t i = 0; i < T * D; ++i) residual[i] = bf16_to_float(float_to_bf16(x[i] + branch[i]));
  std::vector<float> y_ref(T * D), rstd_ref(T), dx_ref(T * D), dw_ref(D, 0.25f);
  rmsnorm_forward<float>(y_ref.data(), rstd_ref.data(), residual.data(), w.data(), T, D, eps);
  rmsnorm_backward<float>(dx_ref.data(), dw_ref.data(), dy.data(), residual.data(), w.data(), rstd_ref.data(), T, D,
                          false);
  if (with_residual)
    for (int64_t i = 0; i < T * D; ++i) dx_ref[i] += dres[i];

  auto x_d = to_device_bf16(x), branch_d = to_device_bf16(branch), w_d = to_device_bf16(w);
  auto y_d = poisoned<bf16>(T * D), res_d = poisoned<bf16>(T * D);
  auto rstd_d = poisoned<float>(T);
  cuda::rmsnorm_forward(y_d.data(), rstd_d.data(), with_residual ? res_d.data() : nullptr, x_d.data(),
                        with_residual ? branch_d.data() : nullptr, w_d.data(), T, D, eps, nullptr);
  expect_close("y", to_host_float(y_d), y_ref, kBf16Rtol, 1e-2);
  expect_close("rstd", to_host(rstd_d), rstd_ref, 1e-4, 0);
  if (with_residual) expect_close("residual", to_host_float(res_d), residual, 0, 0);

  auto dy_d = to_device_bf16(dy), dres_d = to_device_bf16(dres);
  const auto& normed_input = with_residual ? res_d : x_d;
  auto dx_d = poisoned<bf16>(T * D);
  auto dw_d = to_device(std::vector<float>(D, 0.25f));  // accumulates onto what is there
  gpu::DeviceArray<float> partial(cuda::rmsnorm_backward_partial_rows(T) * D);
  cuda::rmsnorm_backward(dx_d.data(), dw_d.data(), dy_d.data(), with_residual ? dres_d.data() : nullptr,
                         normed_input.data(), w_d.data(), rstd_d.data(), T, D, partial.data(), nullptr);
  expect_close("dx", to_host_float(dx_d), dx_ref, kBf16Rtol, 2e-2);
  expect_close("dw", to_host(dw_d), dw_ref, 1e-3, 1e-3 * std::sqrt(static_cast<double>(T)));
  // Deterministic: the same inputs give the same bits (the weight gradient's fixed-order sums).
  auto dx_again_d = poisoned<bf16>(T * D);
  auto dw_again_d = to_device(std::vector<float>(D, 0.25f));
  cuda::rmsnorm_backward(dx_again_d.data(), dw_again_d.data(), dy_d.data(), with_residual ? dres_d.data() : nullptr,
                         normed_input.data(), w_d.data(), rstd_d.data(), T, D, partial.data(), nullptr);
  EXPECT_TRUE(to_host(dw_again_d) == to_host(dw_d));
  EXPECT_TRUE(to_host_float(dx_again_d) == to_host_float(dx_d));
}

INSTANTIATE_TEST_SUITE_P(Sizes, GpuRmsNorm,
                         // 16-byte vector path (D % 8 == 0, D <= 8192) and the scalar one (D = 100, 8200);
                         // 3,000 rows: 94 partial rows, three groups of the weight gradient's first sums.
                         ::testing::Combine(::testing::Values(Size2{1, 64}, Size2{37, 1000}, Size2{300, 2048},
                                                              Size2{64, 4096}, Size2{45, 100}, Size2{3, 8200},
                                                              Size2{3000, 1024}),
                                            ::testing::Bool()));

class GpuSwiglu : public ::testing::TestWithParam<Size2> {};

TEST_P(GpuSwiglu, ForwardAndBackwardMatchCpu) {
  MOE_REQUIRE_GPU();
  const int64_t T = GetParam().rows, F = GetParam().cols;
  auto gate_up = random_bf16_floats(T * 2 * F, 1, "gate_up", 2.0);
  auto dact = random_bf16_floats(T * F, 2, "dact");
  std::vector<float> gate(T * F), up(T * F);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t f = 0; f < F; ++f) {
      gate[t * F + f] = gate_up[t * 2 * F + f];
      up[t * F + f] = gate_up[t * 2 * F + F + f];
    }
  std::vector<float> act_ref(T * F), dgate_ref(T * F), dup_ref(T * F);
  swiglu_forward<float>(act_ref.data(), gate.data(), up.data(), T * F);
  swiglu_backward<float>(dgate_ref.data(), dup_ref.data(), dact.data(), gate.data(), up.data(), T * F);

  auto gate_up_d = to_device_bf16(gate_up), dact_d = to_device_bf16(dact);
  auto act_d = poisoned<bf16>(T * F), dgu_d = poisoned<bf16>(T * 2 * F);
  cuda::swiglu_forward(act_d.data(), gate_up_d.data(), T, F, nullptr);
  cuda::swiglu_backward(dgu_d.data(), dact_d.data(), gate_up_d.data(), T, F, nullptr);
  expect_close("act", to_host_float(act_d), act_ref, kBf16Rtol, 1e-3);
  auto dgu = to_host_float(dgu_d);
  std::vector<float> dgate(T * F), dup(T * F);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t f = 0; f < F; ++f) {
      dgate[t * F + f] = dgu[t * 2 * F + f];
      dup[t * F + f] = dgu[t * 2 * F + F + f];
    }
  expect_close("dgate", dgate, dgate_ref, kBf16Rtol, 1e-3);
  expect_close("dup", dup, dup_ref, kBf16Rtol, 1e-3);
  // The backward that also refills act (rows whose forward is recomputed): swiglu_forward's
  // act and the same gradients, bit for bit.
  auto act2_d = poisoned<bf16>(T * F), dgu2_d = poisoned<bf16>(T * 2 * F);
  cuda::swiglu_backward(dgu2_d.data(), dact_d.data(), gate_up_d.data(), T, F, nullptr, act2_d.data());
  EXPECT_TRUE(to_host_float(act2_d) == to_host_float(act_d));
  EXPECT_TRUE(to_host_float(dgu2_d) == dgu);
}

// Gates where exp(-g) is huge or infinite (the branch-free reciprocal of swiglu_math.cuh
// scales 1 + exp(-g) >= 2^126 into range and maps +inf to 0): finite, and as the CPU's
// 1 / (1 + exp(-g)) gives them; the vector path (F = 16) and the scalar one (F = 13).
TEST(GpuSwigluEdges, HugeNegativeAndPositiveGatesMatchCpu) {
  MOE_REQUIRE_GPU();
  const std::vector<float> gates = {-1e30f, -1e4f, -200.0f, -100.0f, -89.0f, -88.5f, -88.0f, -87.5f,
                                    -87.0f, -60.0f, -1.0f,  0.0f,    1.0f,   60.0f,  100.0f, 1e4f};
  // F = 16 takes the vector kernel (its first 8 gates all past the sigmoid's plain range, the
  // next 8 mixed), F = 13 the scalar one: the same bits for the same gate.
  std::vector<std::vector<float>> outputs;
  for (int64_t F : {16, 13}) {
    SCOPED_TRACE("F = " + std::to_string(F));
    std::vector<float> gate_up(2 * F), gate(F), up(F, 1.5f), dact(F, 0.5f);
    for (int64_t f = 0; f < F; ++f) {
      gate[f] = bf16_to_float(float_to_bf16(gates[static_cast<size_t>(f)]));  // as the device reads them
      gate_up[f] = gate[f];
      gate_up[F + f] = up[f];
    }
    std::vector<float> act_ref(F), dgate_ref(F), dup_ref(F);
    swiglu_forward<float>(act_ref.data(), gate.data(), up.data(), F);
    swiglu_backward<float>(dgate_ref.data(), dup_ref.data(), dact.data(), gate.data(), up.data(), F);
    auto gate_up_d = to_device_bf16(gate_up), dact_d = to_device_bf16(dact);
    auto act_d = poisoned<bf16>(F), dgu_d = poisoned<bf16>(2 * F);
    cuda::swiglu_forward(act_d.data(), gate_up_d.data(), 1, F, nullptr);
    cuda::swiglu_backward(dgu_d.data(), dact_d.data(), gate_up_d.data(), 1, F, nullptr);
    const auto act = to_host_float(act_d), dgu = to_host_float(dgu_d);
    for (int64_t f = 0; f < F; ++f) {
      SCOPED_TRACE("gate " + std::to_string(gate[f]));
      ASSERT_TRUE(std::isfinite(act[f]) && std::isfinite(dgu[f]) && std::isfinite(dgu[F + f]));
      EXPECT_NEAR(act[f], act_ref[f], 1e-2f * std::fabs(act_ref[f]) + 1e-30f);
      EXPECT_NEAR(dgu[f], dgate_ref[f], 1e-2f * std::fabs(dgate_ref[f]) + 1e-30f);
      EXPECT_NEAR(dgu[F + f], dup_ref[f], 1e-2f * std::fabs(dup_ref[f]) + 1e-30f);
    }
    std::vector<float> out(act.begin(), act.begin() + 13);
    out.insert(out.end(), dgu.begin(), dgu.begin() + 13);
    out.insert(out.end(), dgu.begin() + F, dgu.begin() + F + 13);
    outputs.push_back(out);
  }
  EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[1].data(), outputs[0].size() * sizeof(float)), 0)
      << "the vector and scalar kernels differ";
}

// Scalar path (F % 8 != 0) and 16-byte vector path.
INSTANTIATE_TEST_SUITE_P(Sizes, GpuSwiglu, ::testing::Values(Size2{1, 1}, Size2{33, 513}, Size2{7, 64},
                                                             Size2{1024, 5632}));

TEST(GpuRope, ForwardAndBackwardMatchCpu) {
  MOE_REQUIRE_GPU();
  // d/2 % 8 != 0 takes the pair-by-pair kernel, the others the 16-byte vector one.
  for (auto [T, N, d] : {std::tuple<int64_t, int64_t, int64_t>{5, 3, 8}, {7, 2, 36}, {4096, 4, 128}, {1000, 16, 64}}) {
    auto x = random_bf16_floats(T * N * d, 1, "x");
    std::vector<int32_t> positions(T);
    CounterRng rng(2, "positions");
    for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(rng.bits(t)[0] % 4096);
    std::vector<float> fwd_ref = x, bwd_ref = x;
    rope_forward<float>(fwd_ref.data(), positions.data(), T, N, d, 10000.0);
    rope_backward<float>(bwd_ref.data(), positions.data(), T, N, d, 10000.0);
    auto pos_d = to_device(positions);
    auto table_d = poisoned<float>(4096 * d);
    cuda::rope_table(table_d.data(), 4096, d, 10000.0f, nullptr);
    auto fwd_d = to_device_bf16(x), bwd_d = to_device_bf16(x);
    cuda::rope_forward(fwd_d.data(), pos_d.data(), table_d.data(), T, N, d, nullptr);
    cuda::rope_backward(bwd_d.data(), pos_d.data(), table_d.data(), T, N, d, nullptr);
    expect_close("rope forward", to_host_float(fwd_d), fwd_ref, kBf16Rtol, 2e-2);
    expect_close("rope backward", to_host_float(bwd_d), bwd_ref, kBf16Rtol, 2e-2);
  }
}

// The fused q|k|v rows: N heads at the start of rows `ld` elements apart (the q and k heads
// of [T, (H + 2G) d]) turn like packed [T, N, d]; the rest of each row (v) is not touched.
TEST(GpuRope, RowStrideMatchesCpuAndLeavesTheRestAlone) {
  MOE_REQUIRE_GPU();
  // (T, N, d, ld): vector path (d/2 % 8 == 0, ld % 8 == 0), then the pair-by-pair one
  // for d/2 % 8 != 0 and for a row stride that breaks 16-byte alignment.
  for (auto [T, N, d, ld] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{300, 6, 64, 8 * 64}, {77, 3, 128, 4 * 128},
                             {33, 5, 36, 7 * 36}, {50, 2, 64, 2 * 64 + 4}}) {
    auto rows = random_bf16_floats(T * ld, 1, "rows");
    std::vector<int32_t> positions(T);
    CounterRng rng(2, "positions");
    for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(rng.bits(t)[0] % 512);
    std::vector<float> packed(T * N * d);
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(rows.begin() + t * ld, N * d, packed.begin() + t * N * d);
    std::vector<float> fwd_ref = packed, bwd_ref = packed;
    rope_forward<float>(fwd_ref.data(), positions.data(), T, N, d, 10000.0);
    rope_backward<float>(bwd_ref.data(), positions.data(), T, N, d, 10000.0);
    auto pos_d = to_device(positions);
    auto table_d = poisoned<float>(512 * d);
    cuda::rope_table(table_d.data(), 512, d, 10000.0f, nullptr);
    auto fwd_d = to_device_bf16(rows), bwd_d = to_device_bf16(rows);
    cuda::rope_forward(fwd_d.data(), pos_d.data(), table_d.data(), T, N, d, nullptr, ld);
    cuda::rope_backward(bwd_d.data(), pos_d.data(), table_d.data(), T, N, d, nullptr, ld);
    for (auto [device, ref, what] : {std::tuple{&fwd_d, &fwd_ref, "strided rope forward"},
                                     {&bwd_d, &bwd_ref, "strided rope backward"}}) {
      const std::vector<float> got = to_host_float(*device);
      std::vector<float> heads(T * N * d);
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(got.begin() + t * ld, N * d, heads.begin() + t * N * d);
        for (int64_t i = N * d; i < ld; ++i)
          ASSERT_EQ(got[t * ld + i], rows[t * ld + i]) << what << ": row " << t << " element " << i << " moved";
      }
      expect_close(what, heads, *ref, kBf16Rtol, 2e-2);
    }
  }
}

class GpuCrossEntropy : public ::testing::TestWithParam<Size2> {};

TEST_P(GpuCrossEntropy, FusedLossAndGradientMatchCpu) {
  MOE_REQUIRE_GPU();
  const int64_t T = GetParam().rows, V = GetParam().cols;
  const auto logits = random_bf16_floats(T * V, 1, "logits", 3.0);
  std::vector<int32_t> targets(T);
  CounterRng rng(2, "targets");
  for (int64_t t = 0; t < T; ++t) targets[t] = t % 7 == 3 ? -1 : static_cast<int32_t>(rng.bits(t)[0] % V);
  const int64_t n_valid = std::count_if(targets.begin(), targets.end(), [](int32_t x) { return x >= 0; });
  std::vector<float> lse_ref(T), dlogits_ref(T * V);
  cross_entropy_forward<float>(lse_ref.data(), logits.data(), targets.data(), T, V);
  cross_entropy_backward<float>(dlogits_ref.data(), logits.data(), lse_ref.data(), targets.data(), T, V, 1.0);
  // The loss against fp64: a serial fp32 sum of 131,072 exponentials is itself ~1e-5 off.
  std::vector<double> logits64(logits.begin(), logits.end()), lse64(T);
  const double loss_ref = cross_entropy_forward<double>(lse64.data(), logits64.data(), targets.data(), T, V);

  auto logits_d = to_device(logits);  // fp32, as the LM head writes them
  auto targets_d = to_device(targets);
  auto loss_d = poisoned<float>(T);
  auto dlogits_d = poisoned<bf16>(T * V);
  cuda::cross_entropy_fused(loss_d.data(), dlogits_d.data(), logits_d.data(), targets_d.data(), T, V,
                            1.0f / static_cast<float>(std::max<int64_t>(1, n_valid)), nullptr);
  auto loss = to_host(loss_d);
  for (int64_t t = 0; t < T; ++t)
    if (targets[t] < 0) EXPECT_EQ(loss[t], 0.0f) << "ignored row " << t;
  const double loss_mean = std::accumulate(loss.begin(), loss.end(), 0.0) / static_cast<double>(std::max<int64_t>(1, n_valid));
  EXPECT_NEAR(loss_mean, loss_ref, 1e-5 * std::abs(loss_ref) + 1e-7);
  expect_close("dlogits", to_host_float(dlogits_d), dlogits_ref, kBf16Rtol, 1e-7);
}

// V % 4 != 0 takes the plain kernel; the others a cluster of CTAs a row, each holding a
// part in shared memory: two parts (1,028: V / 4 odd, parts of 129 and 128 float4s; 4: one
// part empty), four (32,000 and 50,304: parts <= 56 KB; 131,072 and 131,076: the fewest that
// fit) or eight (65,536: 32 KB parts). (A row past eight CTAs' shared memory, V > ~460 K,
// also takes the plain kernel.)
INSTANTIATE_TEST_SUITE_P(Sizes, GpuCrossEntropy, ::testing::Values(Size2{1, 2}, Size2{17, 257}, Size2{64, 32000},
                                                                   Size2{9, 50304}, Size2{5, 1028}, Size2{3, 65536},
                                                                   Size2{2, 131072}, Size2{2, 131076},
                                                                   Size2{2, 131074}, Size2{3, 4}));

struct RouterCase {
  int64_t T, E, K;
  ScoreFunc f;
  bool renormalize, bias;
  float temperature;
  int64_t groups = 0, top_groups = 0;  // group-limited routing (RouteGroups)
};

class GpuRouter : public ::testing::TestWithParam<RouterCase> {};

TEST_P(GpuRouter, ScoresAndTopKMatchCpu) {
  MOE_REQUIRE_GPU();
  const RouterCase c = GetParam();
  // Router math is fp32 (logits come from an fp32 linear): full-precision random inputs,
  // which also keeps exact ties rare.
  auto random_floats = [](size_t n, const char* name, double scale) {
    CounterRng rng(7, name);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(scale * rng.normal(i));
    return v;
  };
  auto logits = random_floats(c.T * c.E, "logits", 1.0);
  auto bias = random_floats(c.E, "bias", 0.01);
  std::vector<float> scores_ref(c.T * c.E), weight_ref(c.T * c.K);
  std::vector<int32_t> expert_ref(c.T * c.K);
  router_scores_forward<float>(scores_ref.data(), logits.data(), c.T, c.E, c.temperature, c.f);
  const RouteGroups groups{c.groups, c.top_groups};
  router_select<float>(expert_ref.data(), weight_ref.data(), scores_ref.data(), c.bias ? bias.data() : nullptr, c.T,
                       c.E, c.K, c.renormalize, groups);

  auto logits_d = to_device(logits), bias_d = to_device(bias);
  auto scores_d = poisoned<float>(c.T * c.E), weight_d = poisoned<float>(c.T * c.K);
  auto expert_d = poisoned<int32_t>(c.T * c.K);
  cuda::router_topk(scores_d.data(), expert_d.data(), weight_d.data(), logits_d.data(),
                    c.bias ? bias_d.data() : nullptr, c.T, c.E, c.K, c.temperature, c.f, c.renormalize, nullptr,
                    c.groups, c.top_groups);
  expect_close("scores", to_host(scores_d), scores_ref, 1e-5, 1e-7);
  auto expert = to_host(expert_d);
  auto weight = to_host(weight_d);
  // A choice may differ only where the CPU's K-th and (K+1)-th keys (or, with groups, the
  // last taken and first left group sums) are a few roundings apart (GPU and CPU expf
  // differ in the last bits).
  auto close = [](float a, float b) { return a - b <= 4e-6f * std::abs(a) + 1e-7f; };
  int64_t near_ties = 0, mismatches = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<float> keys(c.E);
    for (int64_t e = 0; e < c.E; ++e) keys[e] = scores_ref[t * c.E + e] + (c.bias ? bias[e] : 0.0f);
    bool near_tie = false;
    if (groups.on()) {
      const int64_t per_group = c.E / c.groups;
      std::vector<std::pair<float, int64_t>> sums;  // (-sum, group): ascending = the CPU's order
      for (int64_t g = 0; g < c.groups; ++g) {
        std::vector<float> in(keys.begin() + g * per_group, keys.begin() + (g + 1) * per_group);
        std::sort(in.begin(), in.end(), std::greater<>());
        sums.push_back({-(per_group == 1 ? in[0] : in[0] + in[1]), g});
      }
      std::sort(sums.begin(), sums.end());
      near_tie = c.top_groups < c.groups && close(-sums[c.top_groups - 1].first, -sums[c.top_groups].first);
      // Candidates: the experts of the groups the CPU takes.
      std::vector<float> candidates;
      for (int64_t m = 0; m < c.top_groups; ++m) {
        const int64_t g = sums[m].second;
        candidates.insert(candidates.end(), keys.begin() + g * per_group, keys.begin() + (g + 1) * per_group);
      }
      keys = candidates;
    }
    std::sort(keys.begin(), keys.end(), std::greater<>());
    near_tie = near_tie || (c.K < static_cast<int64_t>(keys.size()) && close(keys[c.K - 1], keys[c.K]));
    near_ties += near_tie;
    for (int64_t k = 0; k < c.K; ++k) {
      const bool same = expert[t * c.K + k] == expert_ref[t * c.K + k];
      if (!same && !near_tie) ++mismatches;
      if (same) EXPECT_NEAR(weight[t * c.K + k], weight_ref[t * c.K + k], 1e-5) << "token " << t;
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_LE(near_ties, std::max<int64_t>(2, c.T / 100));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuRouter,
    ::testing::Values(RouterCase{1, 8, 2, ScoreFunc::Softmax, true, false, 1.0f},
                      RouterCase{1000, 8, 2, ScoreFunc::Softmax, false, true, 0.3f},
                      RouterCase{4097, 128, 2, ScoreFunc::Softmax, true, false, 0.3f},
                      RouterCase{999, 64, 8, ScoreFunc::Sigmoid, true, true, 1.0f},
                      RouterCase{100, 1024, 4, ScoreFunc::Softmax, true, true, 1.0f},
                      RouterCase{33, 5, 5, ScoreFunc::Sigmoid, false, false, 0.5f},
                      RouterCase{2000, 64, 8, ScoreFunc::Sigmoid, true, true, 1.0f, 8, 4},
                      RouterCase{999, 128, 2, ScoreFunc::Softmax, true, false, 0.3f, 16, 1},
                      RouterCase{500, 32, 4, ScoreFunc::Softmax, false, true, 1.0f, 32, 4}));

TEST(GpuAdamW, MatchesCpuAdamWBitForBit) {
  MOE_REQUIRE_GPU();
  const int64_t n = 100003;
  ParameterStore<float> params;
  const int w = params.add({"w", Shape{n}, Init::Normal, 0.5});
  params.allocate(1);
  OptimizerConfig config;
  config.weight_decay = 0.1;
  AdamW cpu(config, params);
  auto param_d = to_device(std::vector<float>(params.value(w), params.value(w) + n));
  gpu::DeviceArray<float> m_d(n), v_d(n);
  m_d.fill_bytes(0);
  v_d.fill_bytes(0);
  auto bf16_d = poisoned<bf16>(n);
  for (int64_t step = 1; step <= 3; ++step) {
    auto grad = random_bf16_floats(n, 10 + step, "grad", 0.1);
    std::copy(grad.begin(), grad.end(), params.grad(w));
    const double lr = 1e-3 * static_cast<double>(step);
    cpu.step(lr);
    auto grad_d = to_device(grad);
    cuda::adamw_step(param_d.data(), bf16_d.data(), grad_d.data(), m_d.data(), v_d.data(), n, lr,
                     config.beta1, config.beta2, static_cast<float>(config.eps), static_cast<float>(1.0 - lr * config.weight_decay), 1.0f, step,
                     nullptr);
  }
  auto param = to_host(param_d);
  std::vector<float> want(params.value(w), params.value(w) + n);
  EXPECT_TRUE(param == want) << "first element: gpu " << param[0] << " cpu " << want[0];
  std::vector<float> rounded(n);
  for (int64_t i = 0; i < n; ++i) rounded[i] = bf16_to_float(float_to_bf16(want[i]));
  expect_close("bf16 copy", test::to_float(to_host(bf16_d)), rounded, 0, 0);
}

}  // namespace
}  // namespace moe
