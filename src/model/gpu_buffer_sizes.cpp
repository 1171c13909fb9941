#include "model/gpu_buffer_sizes.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string_view>

#include "core/error.h"
#include "kernels/fp8_blockwise.h"
#include "kernels/gpu_ops.h"
#include "moe/dispatch.h"

namespace moe {

ExpertRowBounds expert_row_bounds(const MoEConfig& moe, int64_t tokens, int64_t ep_size, bool split_experts,
                                  int64_t local_experts_cap, int64_t row_align) {
  ExpertRowBounds b;
  const int64_t T = tokens, E = moe.n_experts, K = moe.top_k, P = std::max<int64_t>(1, ep_size);
  MOE_CHECK(row_align == 1 || P == 1, "expert rows aligned to {}: not under expert parallelism", row_align);
  b.capacity = E > 0 ? expert_capacity(moe.capacity_factor, T, K, E) : 0;
  b.max_rows = b.capacity > 0 ? std::min(T * K, E * b.capacity) : T * K;
  if (row_align > 1 && E > 0) b.max_rows = (b.max_rows + (row_align - 1) * E + 3) / 4 * 4;
  if (P == 1 || E <= 0) {
    b.max_local_experts = E;
    b.max_tokens = T;
    b.max_local_rows = b.max_rows;
    return b;
  }
  b.max_local_experts = std::min(E, std::max(E / P + (split_experts ? 1 : 0), local_experts_cap));
  b.max_tokens = P * T;
  b.max_local_rows = expert_parallel_local_rows(P, T, K, b.max_local_experts, b.capacity);
  return b;
}

int64_t expert_row_align(const TrainingConfig& training) {
  return training.gemm_backend(training.precision) == GemmBackend::DeepGemm ? 128 : 1;
}

bool interleaves_gate_up(const TrainingConfig& training) {
  return training.interleave_gate_up && training.precision == TrainingPrecision::Bf16 &&
         expert_row_align(training) > 1;
}

bool swiglu_in_gemm_fits(int64_t expert_hidden) {
  return expert_hidden > 0 && expert_hidden % cuda::PaddedExpertGemmBf16::kSwigluColumns == 0;
}

bool swiglu_in_gemm_applies(const TrainingConfig& training, int64_t expert_hidden) {
  return training.swiglu_in_gemm && interleaves_gate_up(training) && swiglu_in_gemm_fits(expert_hidden);
}

int64_t expert_parallel_local_rows(int64_t ep_size, int64_t tokens, int64_t top_k, int64_t local_experts,
                                   int64_t capacity) {
  const int64_t all = ep_size * tokens * top_k;
  return capacity > 0 ? std::min(all, ep_size * local_experts * capacity) : all;
}

SharedScratchSizes shared_scratch_sizes(int64_t tokens, int64_t vocab, int64_t dim, int64_t hidden,
                                        int64_t drows_rows, int64_t local_rows, bool dact) {
  const auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  SharedScratchSizes s;
  s.dlogits_head = tokens * vocab;
  s.drows = drows_rows * dim;
  s.dact = dact ? local_rows * hidden : 0;
  s.dgate_up = local_rows * 2 * hidden;
  s.dx = local_rows * dim;
  s.dact_at = aligned(2 * s.drows);
  s.dgate_up_at = s.dact_at + aligned(2 * s.dact);
  s.dx_at = s.dgate_up_at + aligned(2 * s.dgate_up);
  s.rows_end = s.dx_at + aligned(2 * s.dx);
  return s;
}

int64_t attention_workspace_estimate(int64_t batch, int64_t heads, int64_t seq, int64_t head_dim, AttentionDq dq,
                                     int64_t query_chunks, int64_t kv_heads) {
  const int64_t chunks = std::max<int64_t>(1, std::min(query_chunks, seq));
  const int64_t rows = seq - seq * (chunks - 1) / chunks;  // the last chunk's queries, against every key
  auto padded = [](int64_t n) { return (n + 63) / 64 * 64; };
  const int64_t dp = batch * heads * padded(rows) * padded(seq) * 2, softmax_sums = batch * heads * rows * 4;
  const int64_t dq_accumulator = batch * heads * rows * head_dim * 4;
  auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  // Chunks: our dK | dV scratch and packed stats, and the fp32 dK, dV accumulators cuDNN's
  // graphs of fewer queries than keys take beside dP (measured: cuDNN 9.14, H200).
  const int64_t scratch = chunks > 1 ? aligned(batch * seq * 2 * kv_heads * head_dim * 2) +
                                           aligned(batch * heads * rows * 4) + 2 * batch * kv_heads * seq * head_dim * 4
                                     : 0;
  if (dq == AttentionDq::Ordered) return scratch + dq_accumulator + softmax_sums;
  if (dq == AttentionDq::Workspace || dp <= (int64_t{256} << 20)) return scratch + dp + softmax_sums;
  return scratch + dq_accumulator + softmax_sums;
}

int64_t lm_head_chunk_rows(int64_t tokens, int64_t vocab_size) {
  return std::min<int64_t>(tokens, std::max<int64_t>(128, ((int64_t{64} << 20) / vocab_size) / 128 * 128));
}

std::vector<DenseGemmShape> dense_projection_gemms(const ModelConfig& c, int64_t tokens) {
  const int64_t T = tokens, D = c.dim, H = c.n_heads, d = c.head_dim();
  const int64_t qkv = c.qkv_width();
  std::vector<DenseGemmShape> gemms;
  const auto add = [&](const char* name, int64_t N, int64_t K, int64_t lda, int64_t ldc) {
    const bool data_gradient = std::string_view(name).ends_with("data gradient");
    gemms.push_back({name, data_gradient, T, N, K, lda, ldc, fp8::dense_gemm_fits(T, N, K, lda, ldc)});
  };
  if (c.n_layers <= 0) return gemms;
  add("attention q|k|v forward", qkv, D, D, qkv);
  add("attention q|k|v data gradient", D, qkv, qkv, D);
  add("attention output forward", D, H * d, H * d, D);
  add("attention output data gradient", H * d, D, D, H * d);
  // A SwiGLU FFN of hidden F: gate and up side by side in [T, 2F] (ffn_forward).
  const auto ffn = [&](const char* gate_up, const char* down, const char* down_data, const char* gate_up_data,
                       int64_t F) {
    add(gate_up, F, D, D, 2 * F);
    add(down, D, F, F, D);
    add(down_data, F, D, D, F);
    add(gate_up_data, D, F, 2 * F, D);
  };
  if (c.first_dense_layers > 0)
    ffn("dense FFN gate, up forward", "dense FFN down forward", "dense FFN down data gradient",
        "dense FFN gate, up data gradient", c.dense_hidden);
  if (c.n_layers > c.first_dense_layers && c.moe.n_shared_experts > 0)
    ffn("shared expert gate, up forward", "shared expert down forward", "shared expert down data gradient",
        "shared expert gate, up data gradient", c.moe.expert_hidden);
  return gemms;
}

Fp8ProjectionScratch fp8_projection_scratch(const ModelConfig& c, int64_t tokens) {
  Fp8ProjectionScratch s;
  for (const DenseGemmShape& g : dense_projection_gemms(c, tokens)) {
    if (!g.fp8) continue;
    s.row_codes = std::max(s.row_codes, g.M * g.K);
    s.row_scales = std::max(s.row_scales, g.M * (g.K / fp8::kBlock));
    s.weight_codes = std::max(s.weight_codes, g.N * g.K);
    s.weight_scales = std::max(s.weight_scales, fp8::blocks(g.N) * fp8::blocks(g.K));
  }
  return s;
}

std::string describe_fp8_projections(const ModelConfig& config, int64_t tokens) {
  const std::vector<DenseGemmShape> gemms = dense_projection_gemms(config, tokens);
  std::vector<std::string> bf16;
  for (const DenseGemmShape& g : gemms)
    if (!g.fp8) bf16.emplace_back(g.name);
  return fmt::format("fp8 dense projections: {} of {} GEMMs in fp8{}{} (docs/FP8.md, the fallback rule)",
                     gemms.size() - bf16.size(), gemms.size(), bf16.empty() ? "" : "; bf16: ", fmt::join(bf16, ", "));
}

Fp8ExpertWeightSizes fp8_expert_weight_sizes(int64_t local_experts, int64_t dim, int64_t hidden) {
  Fp8ExpertWeightSizes sizes;
  sizes.codes_per_copy = local_experts * dim * hidden;
  sizes.scales_per_copy = (local_experts * fp8::blocks(dim) * fp8::blocks(hidden) + 3) / 4 * 4;
  return sizes;
}

Fp8TokenColumnSizes fp8_token_column_sizes(int64_t max_local_rows, int64_t max_local_experts, int64_t dim,
                                           int64_t hidden) {
  Fp8TokenColumnSizes sizes;
  sizes.ld_t = (max_local_rows + max_local_experts * (fp8::kBlock - 1) + 15) / 16 * 16;
  const int64_t features = 3 * hidden + dim;
  sizes.codes = features * sizes.ld_t;
  sizes.scales = features * fp8::blocks(sizes.ld_t);
  return sizes;
}

}  // namespace moe
