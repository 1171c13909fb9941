// The row counts GpuTransformer::plan and its expert dispatcher size their buffers for,
// as host functions: the GPU model and the memory planner (train/memory_plan.h) call the
// same arithmetic, so the estimate follows the allocation when either changes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/training_config.h"

namespace moe {

// Whether MoE layer `moe_index` (0: the first MoE block) shares the expert rows buffers and
// refills them before its backward (training.recompute_experts and
// recompute_experts_layers, -1: every MoE layer); GpuTransformer::plan allocates by it and
// the memory plan counts by it.
constexpr bool shares_expert_rows(bool recompute_experts, int64_t recompute_experts_layers, int64_t moe_index) {
  return recompute_experts && (recompute_experts_layers < 0 || moe_index < recompute_experts_layers);
}

// Whether an MoE layer leaves its combine to the next RMSNorm, which sums the experts'
// rows itself (cuda::ResidualBranch), so that the layer stores no [T, D] ffn_out: without
// expert parallelism (its combine brings rows home by exchange) and without shared experts
// (they add into ffn_out). GpuTransformer::plan allocates by it, the memory plan counts by it.
constexpr bool combine_in_next_norm(bool expert_parallel, int64_t n_shared_experts) {
  return !expert_parallel && n_shared_experts == 0;
}

struct ExpertRowBounds {
  int64_t capacity = 0;           // rows per expert and source rank (expert_capacity: T * K when dropless)
  int64_t max_rows = 0;           // R: this rank's row layout (T * K, or fewer under a capacity)
  int64_t max_local_experts = 0;  // L: slots one rank computes at most
  int64_t max_tokens = 0;         // U: tokens a rank may receive (P * T under expert parallelism, else T)
  int64_t max_local_rows = 0;     // RL: rows this rank's experts may get (what the expert row buffers hold)
};

// A micro-batch of `tokens` tokens over an EP group of `ep_size` ranks (1: no expert
// parallelism). `local_experts_cap`: GpuModelOptions::max_local_experts (0: E / P, + 1
// with split experts). `row_align` > 1 (no expert parallelism): each expert's rows start
// at a multiple of it (expert_row_align), R holding the padding and a multiple of 4.
ExpertRowBounds expert_row_bounds(const MoEConfig& moe, int64_t tokens, int64_t ep_size, bool split_experts,
                                  int64_t local_experts_cap, int64_t row_align = 1);

// The alignment of each expert's first row in the local row layout: 128 where the run's
// precision takes DeepGEMM's GEMMs (training.fp8_gemm_backend or bf16_gemm_backend =
// deepgemm: cuda::PaddedExpertGemmFp8's or PaddedExpertGemmBf16's tiles; the padding rows
// are zero), else 1 (the rows back to back; auto not yet resolved is CUTLASS's).
int64_t expert_row_align(const TrainingConfig& training);
// training.interleave_gate_up in effect: with bf16 precision on DeepGEMM's GEMMs (the store
// then interleaves each MoE layer's w1 | w3 where model/gpu_state_layout.h gate_up_pairs
// allows it, without expert parallelism).
bool interleaves_gate_up(const TrainingConfig& training);
// The fused SwiGLU kernels' tiles take moe.expert_hidden in 128-column pieces
// (cuda::PaddedExpertGemmBf16::kSwigluColumns).
bool swiglu_in_gemm_fits(int64_t expert_hidden);
// training.swiglu_in_gemm in effect where gate|up is interleaved (and the store did interleave
// it): the fused kernels, so SwiGLU's backward writes no d act rows.
bool swiglu_in_gemm_applies(const TrainingConfig& training, int64_t expert_hidden);

// The expert-parallel dispatcher's bound on a rank's rows: every one of the P ranks sends
// it at most its T * K assignments, or `capacity` per source and local expert.
int64_t expert_parallel_local_rows(int64_t ep_size, int64_t tokens, int64_t top_k, int64_t local_experts,
                                   int64_t capacity);

// training.precision = fp8: the width of the experts' quantised-row scratch (codes of that
// many columns per row, one fp32 scale per 128): the widest operand a GEMM reads, or SwiGLU's
// backward writing d gate's and d up's codes side by side (2 x hidden).
constexpr int64_t fp8_expert_row_width(int64_t dim, int64_t hidden) { return dim > 2 * hidden ? dim : 2 * hidden; }

// training.precision = fp8 with training.fp8_weight_cache: one MoE layer's quantised
// expert weights (GpuTransformer's Fp8ExpertWeights) for `local_experts` experts of
// [hidden, dim] (w1, w3) and [dim, hidden] (w2): per tensor two copies (as stored and
// transposed) of e4m3 codes, 1 B per element, and of their fp32 128 x 128 block scales,
// each copy's scales padded to 16 bytes.
struct Fp8ExpertWeightSizes {
  int64_t codes_per_copy = 0, scales_per_copy = 0;  // elements
  int64_t bytes() const { return 2 * 3 * (codes_per_copy + 4 * scales_per_copy); }
};
Fp8ExpertWeightSizes fp8_expert_weight_sizes(int64_t local_experts, int64_t dim, int64_t hidden);

// training.fp8_weight_gradients: the experts' token-column scratch (fp8::quantize_token_columns),
// shared by the MoE layers. Codes of `ld_t` padded tokens (a bound on the padded offsets
// known before the routing: the rows + 127 per local expert, rounded to 16) for 3 x hidden
// + dim features: act, d gate and d up (written together by SwiGLU's backward), then dy
// and, after w2's weight gradient, x in the same place; one fp32 scale per feature and 128
// tokens.
struct Fp8TokenColumnSizes {
  int64_t ld_t = 0, codes = 0, scales = 0;  // scales: per feature, ld_t / 128 rounded up
  int64_t bytes() const { return codes + 4 * scales; }
};
Fp8TokenColumnSizes fp8_token_column_sizes(int64_t max_local_rows, int64_t max_local_experts, int64_t dim,
                                           int64_t hidden);

// Rows of fp32 logits the LM head computes at a time: ~256 MB, in blocks of 128 rows.
int64_t lm_head_chunk_rows(int64_t tokens, int64_t vocab_size);

// One dense projection GEMM of the model, c [M, N] (row stride ldc) = a [M, K] (row stride
// lda) @ b [N, K]^T: a forward y = x W^T (b = W) or a data gradient dx = dy W (b = W^T).
struct DenseGemmShape {
  const char* name;
  bool data_gradient;  // dx [M, N = in] = dy [M, K = out] @ W [out, in]; else y [M, N = out] = x [M, K = in] @ W^T
  int64_t M, N, K, lda, ldc;
  bool fp8;  // training.precision = fp8 runs it in fp8: fp8::dense_gemm_fits (else bf16)
};
// GpuTransformer's shared scratch (State::shared_scratch, docs/MEMORY_PLAN.md "Shared
// scratch"): from byte 0 either dlogits_head [tokens, vocab], or the MoE backward's row
// gradients (drows [drows_rows, dim] at 0, d act [local_rows, hidden], d gate|up [local_rows,
// 2 hidden], dx [local_rows, dim], each at a 256-byte boundary; no d act where SwiGLU's
// backward runs inside the down data gradient, `dact` false), or cuDNN's attention
// workspace; bf16 elements, byte offsets. The allocation is the largest of the three.
struct SharedScratchSizes {
  int64_t dlogits_head = 0, drows = 0, dact = 0, dgate_up = 0, dx = 0;  // elements
  int64_t dact_at = 0, dgate_up_at = 0, dx_at = 0;                      // bytes (drows at 0)
  int64_t rows_end = 0;                                                  // bytes
  // Without the attention workspace (attention_workspace_estimate for the planner).
  int64_t bytes() const { return dlogits_head * 2 > rows_end ? dlogits_head * 2 : rows_end; }
};
SharedScratchSizes shared_scratch_sizes(int64_t tokens, int64_t vocab, int64_t dim, int64_t hidden,
                                        int64_t drows_rows, int64_t local_rows, bool dact = true);

// cuDNN's attention workspace for `batch` sequences of `seq` tokens and `heads` query
// heads, as cudnn-frontend sizes it: the backward's dP of batch x heads x seq x seq bf16
// (seq rounded up to 64) and its softmax sums in fp32, which the deterministic dP
// decomposition (AttentionDq::Workspace) always takes and the atomic backward only up to
// 256 MB of dP (else an fp32 dQ accumulator, as the ordered deterministic backward). With
// query_chunks > 1 (Attention::set_query_chunks) the last chunk's rows against every key,
// and the chunks' dK | dV scratch of batch x seq x 2 kv_heads x head_dim bf16, a chunk's
// packed softmax stats, and cuDNN's fp32 dK, dV accumulators of such a graph.
int64_t attention_workspace_estimate(int64_t batch, int64_t heads, int64_t seq, int64_t head_dim, AttentionDq dq,
                                     int64_t query_chunks = 1, int64_t kv_heads = 0);

// Every dense projection GEMM of a micro-batch of `tokens` tokens (the calls of
// gpu_attention.cpp and GpuTransformer's ffn_forward / ffn_backward): attention's q|k|v
// and output projections; the dense FFN layers' (first_dense_layers) and the shared
// experts' gate, up and down; forward and data gradient each. Not the router or LM head.
std::vector<DenseGemmShape> dense_projection_gemms(const ModelConfig& config, int64_t tokens);

// The scratch the fp8 ones quantise into, shared by all of them (ProjectionGemms): one
// operand's rows (M x K codes, M x K / 128 scales) and one weight (N x K codes, 128 x 128
// block scales), each the largest over the GEMMs that run in fp8.
struct Fp8ProjectionScratch {
  int64_t row_codes = 0, row_scales = 0, weight_codes = 0, weight_scales = 0;
  int64_t bytes() const { return row_codes + 4 * row_scales + weight_codes + 4 * weight_scales; }
};
Fp8ProjectionScratch fp8_projection_scratch(const ModelConfig& config, int64_t tokens);

// One line for the run's log: how many projection GEMMs run in fp8 and which stay bf16.
std::string describe_fp8_projections(const ModelConfig& config, int64_t tokens);

}  // namespace moe
