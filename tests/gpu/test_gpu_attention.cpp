// cuDNN flash attention against the CPU attention op (which keeps the full softmax),
// forward and backward, with grouped-query heads and a ragged sequence length; and in a
// workspace of its caller's (the GPU model's shared scratch) against its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "expect_error.h"
#include "gpu_test_util.h"
#include "kernels/attention.h"
#include "kernels/gpu_ops.h"
#include "model/gpu_buffer_sizes.h"

namespace moe {
namespace {

struct AttentionCase {
  int64_t B, S, H, G, d;
};

class GpuAttention : public ::testing::TestWithParam<AttentionCase> {};

// Tolerance scaled to the largest reference value: flash attention sums in a different
// order and rounds P to bf16 before P @ V.
void expect_close_scaled(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  double max_abs = 0;
  for (float w : want) max_abs = std::max(max_abs, static_cast<double>(std::abs(w)));
  expect_close(what, got, want, 1.0 / 64, 1e-2 * max_abs);
}

// The forward and backward of `attention` on random inputs (seeds seed .. seed + 3), into
// poisoned outputs.
struct AttentionResults {
  std::vector<bf16> out, dq, dk, dv;
  std::vector<float> stats;
};
AttentionResults run_attention(cuda::Attention& attention, const AttentionCase& c, uint64_t seed) {
  const auto [B, S, H, G, d] = c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto q = to_device_bf16(random_bf16_floats(B * S * H * d, seed, "q"));
  auto k = to_device_bf16(random_bf16_floats(B * S * G * d, seed + 1, "k"));
  auto v = to_device_bf16(random_bf16_floats(B * S * G * d, seed + 2, "v"));
  auto dout = to_device_bf16(random_bf16_floats(B * S * H * d, seed + 3, "dout"));
  auto out = poisoned<bf16>(B * S * H * d), dq = poisoned<bf16>(B * S * H * d);
  auto dk = poisoned<bf16>(B * S * G * d), dv = poisoned<bf16>(B * S * G * d);
  auto stats = poisoned<float>(B * H * S);
  attention.forward(out.data(), stats.data(), q.data(), k.data(), v.data(), B, S, H, G, d, scale, nullptr);
  attention.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                     stats.data(), B, S, H, G, d, scale, nullptr);
  return {to_host(out), to_host(dq), to_host(dk), to_host(dv), to_host(stats)};
}

// The CPU op's gradients for run_attention's inputs (its seeds seed .. seed + 3), checked
// against `got` with the flash-attention tolerance.
void expect_backward_matches_cpu(const AttentionCase& c, uint64_t seed, const AttentionResults& got,
                                 const std::string& what) {
  const auto [B, S, H, G, d] = c;
  auto q = random_bf16_floats(B * S * H * d, seed, "q"), k = random_bf16_floats(B * S * G * d, seed + 1, "k");
  auto v = random_bf16_floats(B * S * G * d, seed + 2, "v"), dout = random_bf16_floats(B * S * H * d, seed + 3, "dout");
  std::vector<float> out_ref(B * S * H * d), probs(B * H * S * S), dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size());
  attention_forward<float>(out_ref.data(), probs.data(), q.data(), k.data(), v.data(), B, S, H, G, d);
  attention_backward<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(), k.data(), v.data(),
                            probs.data(), B, S, H, G, d);
  expect_close_scaled(what + " dq", test::to_float(got.dq), dq_ref);
  expect_close_scaled(what + " dk", test::to_float(got.dk), dk_ref);
  expect_close_scaled(what + " dv", test::to_float(got.dv), dv_ref);
}

TEST_P(GpuAttention, ForwardAndBackwardMatchCpu) {
  MOE_REQUIRE_GPU();
  const auto [B, S, H, G, d] = GetParam();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto q = random_bf16_floats(B * S * H * d, 1, "q"), k = random_bf16_floats(B * S * G * d, 2, "k");
  auto v = random_bf16_floats(B * S * G * d, 3, "v"), dout = random_bf16_floats(B * S * H * d, 4, "dout");
  std::vector<float> out_ref(B * S * H * d), probs(B * H * S * S), dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size());
  attention_forward<float>(out_ref.data(), probs.data(), q.data(), k.data(), v.data(), B, S, H, G, d);
  attention_backward<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(), k.data(), v.data(),
                            probs.data(), B, S, H, G, d);

  cuda::Attention attention;
  auto q_d = to_device_bf16(q), k_d = to_device_bf16(k), v_d = to_device_bf16(v), dout_d = to_device_bf16(dout);
  auto out_d = poisoned<bf16>(out_ref.size());
  auto stats_d = poisoned<float>(B * H * S);
  attention.forward(out_d.data(), stats_d.data(), q_d.data(), k_d.data(), v_d.data(), B, S, H, G, d, scale, nullptr);
  expect_close_scaled("out", to_host_float(out_d), out_ref);
  for (float s : to_host(stats_d)) ASSERT_TRUE(std::isfinite(s));

  auto dq_d = poisoned<bf16>(q.size()), dk_d = poisoned<bf16>(k.size()), dv_d = poisoned<bf16>(v.size());
  attention.backward(dq_d.data(), dk_d.data(), dv_d.data(), dout_d.data(), q_d.data(), k_d.data(), v_d.data(),
                     out_d.data(), stats_d.data(), B, S, H, G, d, scale, nullptr);
  expect_close_scaled("dq", to_host_float(dq_d), dq_ref);
  expect_close_scaled("dk", to_host_float(dk_d), dk_ref);
  expect_close_scaled("dv", to_host_float(dv_d), dv_ref);
}

// q, k and v read from one [B S, (H + 2G) d] buffer of q|k|v rows (the GPU model's fused
// projection) and dq, dk, dv written into one such buffer: the same results as packed
// tensors, within the same tolerance of the CPU op, and every element of the gradient
// buffer written.
TEST_P(GpuAttention, FusedQkvRowsMatchCpu) {
  MOE_REQUIRE_GPU();
  const auto [B, S, H, G, d] = GetParam();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t T = B * S, N = (H + 2 * G) * d;
  auto q = random_bf16_floats(T * H * d, 1, "q"), k = random_bf16_floats(T * G * d, 2, "k");
  auto v = random_bf16_floats(T * G * d, 3, "v"), dout = random_bf16_floats(T * H * d, 4, "dout");
  std::vector<float> out_ref(T * H * d), probs(B * H * S * S), dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size());
  attention_forward<float>(out_ref.data(), probs.data(), q.data(), k.data(), v.data(), B, S, H, G, d);
  attention_backward<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(), k.data(), v.data(),
                            probs.data(), B, S, H, G, d);
  // Token t's row: q heads, k heads, v heads.
  auto interleave = [&](const std::vector<float>& qs, const std::vector<float>& ks, const std::vector<float>& vs) {
    std::vector<float> rows(T * N);
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(qs.begin() + t * H * d, H * d, rows.begin() + t * N);
      std::copy_n(ks.begin() + t * G * d, G * d, rows.begin() + t * N + H * d);
      std::copy_n(vs.begin() + t * G * d, G * d, rows.begin() + t * N + (H + G) * d);
    }
    return rows;
  };
  auto part = [&](const std::vector<float>& rows, int64_t first, int64_t width) {
    std::vector<float> out(T * width);
    for (int64_t t = 0; t < T; ++t) std::copy_n(rows.begin() + t * N + first, width, out.begin() + t * width);
    return out;
  };

  cuda::Attention attention;
  auto qkv_d = to_device_bf16(interleave(q, k, v)), dout_d = to_device_bf16(dout);
  const bf16* qp = qkv_d.data();
  auto out_d = poisoned<bf16>(out_ref.size());
  auto stats_d = poisoned<float>(B * H * S);
  attention.forward(out_d.data(), stats_d.data(), qp, qp + H * d, qp + (H + G) * d, B, S, H, G, d, scale, nullptr, N,
                    N);
  expect_close_scaled("out", to_host_float(out_d), out_ref);

  auto dqkv_d = poisoned<bf16>(T * N);
  bf16* dp = dqkv_d.data();
  attention.backward(dp, dp + H * d, dp + (H + G) * d, dout_d.data(), qp, qp + H * d, qp + (H + G) * d, out_d.data(),
                     stats_d.data(), B, S, H, G, d, scale, nullptr, N, N);
  const std::vector<float> dqkv = to_host_float(dqkv_d);
  for (float x : dqkv) ASSERT_TRUE(std::isfinite(x)) << "a gradient element left unwritten (poisoned)";
  expect_close_scaled("dq", part(dqkv, 0, H * d), dq_ref);
  expect_close_scaled("dk", part(dqkv, H * d, G * d), dk_ref);
  expect_close_scaled("dv", part(dqkv, (H + G) * d, G * d), dv_ref);
}

// Attention::use_workspace (the GPU model's shared scratch, docs/MEMORY_PLAN.md): in a
// poisoned workspace of workspace_bytes() the forward and the deterministic backward give
// the bits of the run in its own workspace; the workspace holds at least the dP the memory
// plan counts for it; one byte less is refused with a one-line error.
TEST(GpuAttentionWorkspace, SharedWorkspaceGivesTheSameBitsAndRefusesTooLittle) {
  MOE_REQUIRE_GPU();
  const AttentionCase shape{2, 257, 4, 2, 64};
  const auto [B, S, H, G, d] = shape;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  cuda::Attention own;
  const AttentionResults want = run_attention(own, shape, 1);

  cuda::Attention shared;
  const size_t bytes = shared.workspace_bytes(B, S, H, G, d, scale);
  const int64_t padded = (S + 63) / 64 * 64;
  EXPECT_GE(static_cast<int64_t>(bytes), B * H * padded * padded * 2) << "the deterministic backward's dP";
  EXPECT_LE(static_cast<int64_t>(bytes),
            attention_workspace_estimate(B, H, S, d, AttentionDq::Workspace) + (int64_t{8} << 20))
      << "the memory plan's estimate";
  gpu::DeviceArray<char> workspace(bytes);
  workspace.fill_bytes(0xff);
  shared.use_workspace(workspace.data(), workspace.size());
  const AttentionResults got = run_attention(shared, shape, 1);
  EXPECT_TRUE(same_bits(got.out, want.out));
  EXPECT_TRUE(same_bits(got.stats, want.stats));
  EXPECT_TRUE(same_bits(got.dq, want.dq));
  EXPECT_TRUE(same_bits(got.dk, want.dk));
  EXPECT_TRUE(same_bits(got.dv, want.dv));

  cuda::Attention small;
  ASSERT_GT(bytes, 0u);
  small.use_workspace(workspace.data(), bytes - 1);
  test::expect_one_line_error<Error>([&] { run_attention(small, shape, 1); },
                                     {"attention", "bytes of workspace", std::to_string(bytes - 1)});
}

// AttentionDq::Ordered (training.deterministic_attention = ordered). Where cuDNN >= 9.25
// runs on a Hopper GPU: the backward matches the CPU op as the workspace form does, a long
// sequence's backward (64 key/value tiles adding into each query tile's dQ) gives the same
// bits run after run, and its workspace is the fp32 dQ accumulator's the memory plan
// counts, far below dP's. Elsewhere the first backward is refused with one line.
TEST(GpuAttentionOrderedDq, MatchesCpuRerunsBitForBitAndNeedsNoDp) {
  MOE_REQUIRE_GPU();
  cuda::Attention attention;
  attention.set_dq(AttentionDq::Ordered);
  if (!cuda::Attention::ordered_dq_runs()) {
    test::expect_one_line_error<Error>([&] { run_attention(attention, AttentionCase{1, 128, 2, 2, 64}, 1); },
                                       {"training.deterministic_attention = ordered", "cuDNN >= 9.25"});
    return;
  }
  const auto matches_cpu = [&](const AttentionCase& c) {
    expect_backward_matches_cpu(c, 1, run_attention(attention, c, 1), "ordered");
  };
  matches_cpu(AttentionCase{2, 320, 4, 2, 64});
  matches_cpu(AttentionCase{1, 256, 4, 4, 128});
  // A head dim past the engine's tiles: it runs and matches, or the refusal names the setting,
  // the shape and the way out in one line.
  const AttentionCase wide{1, 128, 2, 2, 256};
  try {
    matches_cpu(wide);
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const char* part : {"training.deterministic_attention = ordered", "head dim 256", "use \"workspace\""})
      EXPECT_NE(message.find(part), std::string::npos) << message;
  }
  const AttentionCase long_sequence{4, 4096, 8, 8, 64};
  const AttentionResults first = run_attention(attention, long_sequence, 7);
  const AttentionResults second = run_attention(attention, long_sequence, 7);
  EXPECT_TRUE(same_bits(first.dq, second.dq)) << "dq differs between two runs";
  EXPECT_TRUE(same_bits(first.dk, second.dk));
  EXPECT_TRUE(same_bits(first.dv, second.dv));
  const auto [B, S, H, G, d] = long_sequence;
  const int64_t bytes = static_cast<int64_t>(attention.workspace_bytes(B, S, H, G, d, 1.0f / 8));
  EXPECT_LE(bytes, attention_workspace_estimate(B, H, S, d, AttentionDq::Ordered) + (int64_t{8} << 20));
  EXPECT_LT(bytes, B * H * S * S * 2 / 8) << "no dP workspace";
}

// Attention::set_query_chunks (training.attention_query_chunks): the backward in 2, 3 and 4
// query chunks, each against the keys up to its last query, matches the CPU op as the one
// call does (ragged chunks of a ragged sequence, grouped-query heads, head dims 64 and 128);
// reruns give the same bits; in a poisoned shared workspace of workspace_bytes() it gives
// the bits of its own; its dP workspace is below the one call's.
TEST(GpuAttentionQueryChunks, MatchCpuRerunBitForBitAndNeedLessWorkspace) {
  MOE_REQUIRE_GPU();
  for (const AttentionCase& c : {AttentionCase{2, 257, 4, 2, 64}, AttentionCase{1, 1024, 16, 8, 128}}) {
    const auto [B, S, H, G, d] = c;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    cuda::Attention whole;
    const size_t whole_bytes = whole.workspace_bytes(B, S, H, G, d, scale);
    for (const int64_t chunks : {2, 3, 4}) {
      const std::string what = fmt::format("S {} d {}, {} chunks:", S, d, chunks);
      cuda::Attention attention;
      attention.set_query_chunks(chunks);
      const AttentionResults first = run_attention(attention, c, 5);
      expect_backward_matches_cpu(c, 5, first, what);
      const AttentionResults again = run_attention(attention, c, 5);
      EXPECT_TRUE(same_bits(first.dq, again.dq)) << what;
      EXPECT_TRUE(same_bits(first.dk, again.dk)) << what;
      EXPECT_TRUE(same_bits(first.dv, again.dv)) << what;

      cuda::Attention shared;
      shared.set_query_chunks(chunks);
      const size_t bytes = shared.workspace_bytes(B, S, H, G, d, scale);
      if (S >= 1024) EXPECT_LT(bytes, whole_bytes) << what << " a chunk's dP is a part of the whole one's";
      EXPECT_LE(static_cast<int64_t>(bytes),
                attention_workspace_estimate(B, H, S, d, AttentionDq::Workspace, chunks, G) + (int64_t{8} << 20))
          << what << " the memory plan's estimate";
      gpu::DeviceArray<char> workspace(bytes);
      workspace.fill_bytes(0xff);
      shared.use_workspace(workspace.data(), workspace.size());
      const AttentionResults got = run_attention(shared, c, 5);
      EXPECT_TRUE(same_bits(got.dq, first.dq)) << what;
      EXPECT_TRUE(same_bits(got.dk, first.dk)) << what;
      EXPECT_TRUE(same_bits(got.dv, first.dv)) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttention,
                         ::testing::Values(AttentionCase{2, 128, 4, 2, 64}, AttentionCase{2, 257, 4, 4, 64},
                                           AttentionCase{1, 1024, 16, 8, 128}, AttentionCase{3, 96, 8, 1, 128}));

}  // namespace
}  // namespace moe
