// GPU versions of the ops (bf16 storage, fp32 math and statistics). Each is tested
// against the CPU op of the same name in kernels/<op>.h. Declared here without CUDA
// headers so host code can call them; `stream` is a cudaStream_t (nullptr: default).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "kernels/adamw_math.h"
#include "config/model_config.h"

struct CUstream_st;

namespace moe::cuda {

using Stream = CUstream_st*;

// RMSNorm, optionally fused with the residual add before it:
// residual_out = x + branch (when branch is not null; else residual_out may be null and x is used),
// y = residual_out * rstd * w, rstd = 1/sqrt(mean(residual_out^2) + eps).
void rmsnorm_forward(bf16* y_TD, float* rstd_T, bf16* residual_out_TD, const bf16* x_TD,
                     const bf16* branch_TD, const bf16* w_D, int64_t T, int64_t D, float eps,
                     Stream stream);
// dx = d rmsnorm/dx . dy (+ dresidual_TD when not null: the gradient arriving through
// the residual path); dw_D += sum over tokens (fp32, deterministic: per-block partials
// in `dw_partial_BD` of ceil(T / rows_per_block) x D floats, then summed in order).
void rmsnorm_backward(bf16* dx_TD, float* dw_D, const bf16* dy_TD, const bf16* dresidual_TD,
                      const bf16* x_TD, const bf16* w_D, const float* rstd_T, int64_t T, int64_t D,
                      float* dw_partial, Stream stream);
// Rows of tokens each block of rmsnorm_backward handles (sizes dw_partial).
int64_t rmsnorm_backward_partial_rows(int64_t T);

// act = silu(gate) * up; gate_up_TF2 holds [gate | up] per row (F each).
void swiglu_forward(bf16* act_TF, const bf16* gate_up_TF2, int64_t T, int64_t F, Stream stream);
void swiglu_backward(bf16* dgate_up_TF2, const bf16* dact_TF, const bf16* gate_up_TF2, int64_t T,
                     int64_t F, Stream stream);

// RoPE's angles: (cos, sin) of pos * theta^(-2i/d) for pos < S, i < d/2, as [S, d/2, 2] fp32.
void rope_table(float* cos_sin_Sh2, int64_t S, int64_t d, float theta, Stream stream);
// RoPE in place on [T, N, d] (rotate_half layout), positions_T per token (each < the
// table's S), angles from rope_table.
void rope_forward(bf16* x_TNd, const int32_t* positions_T, const float* cos_sin_Sh2, int64_t T, int64_t N, int64_t d,
                  Stream stream);
void rope_backward(bf16* dx_TNd, const int32_t* positions_T, const float* cos_sin_Sh2, int64_t T, int64_t N,
                   int64_t d, Stream stream);

// Cross-entropy and its gradient in one pass, from fp32 logits (the LM head's GEMM writes
// them a chunk of rows at a time, so the [T, V] fp32 logits never exist whole; bf16 logits
// would cost ~1% relative error in every gradient). loss_T gets each row's loss (0 for
// ignored targets, -1); dlogits_TV = grad_scale * (softmax - onehot) in bf16, zeros for
// ignored rows. With grad_scale = 1 / n_valid the backward only multiplies by dloss.
void cross_entropy_fused(float* loss_T, bf16* dlogits_TV, const float* logits_TV, const int32_t* targets_T,
                         int64_t T, int64_t V, float grad_scale, Stream stream);

// Router: scores = softmax or sigmoid(logits / temperature) (fp32), then top-K of
// scores + bias (bias nullable), weights from the unbiased scores, optionally
// renormalised. Ties go to the lower expert index, as on the CPU. E <= 1024. With
// route_groups > 1 (<= 32) only experts of the route_top_groups best groups are chosen
// (moe/router.h, RouteGroups).
void router_topk(float* scores_TE, int32_t* expert_TK, float* weight_TK, const float* logits_TE,
                 const float* bias_E, int64_t T, int64_t E, int64_t K, float temperature,
                 ScoreFunc score_func, bool renormalize, Stream stream, int64_t route_groups = 0,
                 int64_t route_top_groups = 0);

// One AdamW step over a flat fp32 parameter block, writing the bf16 copy used by the
// forward pass. beta1/beta2 are the config's doubles (the bias corrections use them as
// the CPU AdamW does). decay_factor = 1 - lr * weight_decay (1 for no decay); grad_scale
// multiplies the gradient first (global clipping folded in).
void adamw_step(float* param, bf16* param_bf16, const float* grad, float* m, float* v,
                int64_t count, double lr, double beta1, double beta2, float eps, float decay_factor,
                float grad_scale, int64_t step, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// Capacity and row layout on the device, the same semantics as moe::assign_rows:
// walking (t, k) in order, an assignment is kept iff its expert has fewer than
// `capacity` rows. Writes row_TK (-1 = dropped), counts_E, offsets_E1 (E + 1; the kept
// row count R is offsets_E1[E], left on the device), token_of_row_R (T*K capacity) and
// adds the assignments before dropping to load_E when not null. `scratch`:
// assign_rows_scratch(T, K, E) ints. An expert < 0 (routed to another rank) gets row -1
// and is counted nowhere. E at most 1536.
void assign_rows(int32_t* row_TK, int32_t* counts_E, int32_t* offsets_E1, int32_t* token_of_row_R,
                 int64_t* load_E, int32_t* scratch, const int32_t* expert_TK, int64_t T, int64_t E,
                 int64_t K, int64_t capacity, Stream stream);
int64_t assign_rows_scratch(int64_t T, int64_t K, int64_t E);
// Expert parallelism without duplicate rows (layout and CPU references: moe/token_exchange.h).
// The boundary cuts of a micro-batch from every home rank's kept rows per slot (counts_PE;
// E <= 1536, P <= 32), and each kept assignment's EP rank by them (-1: dropped).
void boundary_cuts(int32_t* cut_P1, const int32_t* counts_PE, const int32_t* slot_bounds_P1, bool split, int64_t E,
                   int P, Stream stream);
void route_ranks(int32_t* rank_TK, const int32_t* row_TK, const int32_t* slot_TK, const int32_t* offsets_E1,
                 const int32_t* cut_P1, int64_t T, int64_t K, int P, Stream stream);
// Token t's place in the block for EP rank p (pos_TP, -1: none) and the block sizes (P <= 32).
void token_blocks(int32_t* pos_TP, int32_t* tokens_P, const int32_t* rank_TK, int64_t T, int64_t K, int P,
                  Stream stream);
// The routing sent with the tokens: slots in the receiving rank's window (-1: elsewhere) and weights.
void pack_routing(int32_t* slot_UK, float* weight_UK, const int32_t* pos_TP, const int32_t* tokens_P,
                  const int32_t* rank_TK, const int32_t* slot_TK, const float* weight_TK,
                  const int32_t* slot_bounds_P1, int64_t T, int64_t K, int P, Stream stream);
// Per peer: the rows it gets of each slot of its window, then its block size.
void pack_counts(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P, const int32_t* slot_bounds_P1,
                 const int32_t* window_end_P, const int32_t* cut_P1, int P, Stream stream);
// dst_UD[block row of (t, p)] = src_TD[t].
void scatter_token_rows(bf16* dst_UD, const bf16* src_TD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                        int P, int64_t D, Stream stream);
// dst_TD[t] = the ranks' block rows of t added in rank order (fp32; 0 where none).
void sum_token_rows(bf16* dst_TD, const bf16* src_UD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                    int P, int64_t D, Stream stream);
void sum_token_values(float* dst_TK, const float* src_UK, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                      int64_t K, int P, Stream stream);
// out_N[i] = table[index_N[i]] (e.g. routed experts to their slots under a re-placement).
void lookup(int32_t* out_N, const int32_t* table, const int32_t* index_N, int64_t n, Stream stream);
// x_RD[r] = x_TD[token_of_row_R[r]] for r < offsets_E1[E]; launched for max_rows rows so
// the host never needs R.
void permute_forward(bf16* x_RD, const bf16* x_TD, const int32_t* token_of_row_R, const int32_t* offsets_E1,
                     int64_t max_rows, int64_t E, int64_t D, Stream stream);
void permute_backward(bf16* dx_TD, const bf16* dx_RD, const int32_t* row_TK, int64_t T, int64_t K, int64_t D,
                      bool accumulate, Stream stream);
// out_TD[t] = sum over kept slots of weight * y_RD[row] (fp32 sum, bf16 out).
void combine_forward(bf16* out_TD, const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T,
                     int64_t K, int64_t D, Stream stream);
void combine_backward(bf16* dy_RD, float* dweight_TK, const bf16* dout_TD, const bf16* y_RD, const float* weight_TK,
                      const int32_t* row_TK, int64_t T, int64_t K, int64_t D, Stream stream);

// Embedding: out_TD = table_VD[ids_T] (bf16). Backward into an fp32 table gradient,
// deterministic: the tokens are sorted by id (stable), and each id's rows are summed in
// token order. scratch from embedding_backward_scratch_bytes.
void embedding_forward(bf16* out_TD, const int32_t* ids_T, const bf16* table_VD, int64_t T, int64_t V, int64_t D,
                       Stream stream);
size_t embedding_backward_scratch_bytes(int64_t T);
void embedding_backward(float* dtable_VD, const int32_t* ids_T, const bf16* dout_TD, int64_t T, int64_t V,
                        int64_t D, void* scratch, size_t scratch_bytes, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// cuBLASLt for the dense matmuls: one handle, one workspace, algorithms cached per shape.
class Blas {
 public:
  explicit Blas(size_t workspace_bytes = size_t{32} << 20);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  // Row-major C[M,N] = alpha * op(A)[M,K] op(B)[K,N] + beta * C with bf16 A and B and
  // fp32 accumulation; C is fp32 when c_is_fp32 (weight gradients), else bf16.
  // op(A) = A ([M,K], lda) or A^T (A stored [K,M]); likewise B.
  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
            const bf16* B, int64_t ldb, float beta, void* C, bool c_is_fp32, int64_t ldc, Stream stream);
  // The multiprocessors cuBLASLt's kernels should use from now on (0: all), e.g. to leave
  // some free for NCCL kernels running beside them (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET).
  void set_sm_limit(int sms);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda

namespace moe::cuda {

// Causal grouped-query attention through cuDNN's flash attention (SDPA). q_BSHd and
// out_BSHd: [B, S, H, d]; k, v: [B, S, G, d]; stats_BHS: fp32 log-sum-exp per query
// (saved for the backward). Graphs are built on first use of a shape and cached.
class Attention {
 public:
  Attention();
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;
  // true (the default): the backward's dQ is summed in a fixed order (cuDNN's
  // deterministic algorithm, a dP workspace of B x H x S x S bf16); false: atomics, which
  // make dQ differ in its last bits from run to run.
  void set_deterministic(bool deterministic);
  void forward(bf16* out_BSHd, float* stats_BHS, const bf16* q_BSHd, const bf16* k_BSGd, const bf16* v_BSGd,
               int64_t B, int64_t S, int64_t H, int64_t G, int64_t d, float scale, Stream stream);
  // Overwrites dq, dk and dv.
  void backward(bf16* dq_BSHd, bf16* dk_BSGd, bf16* dv_BSGd, const bf16* dout_BSHd, const bf16* q_BSHd,
                const bf16* k_BSGd, const bf16* v_BSGd, const bf16* out_BSHd, const float* stats_BHS, int64_t B,
                int64_t S, int64_t H, int64_t G, int64_t d, float scale, Stream stream);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda

namespace moe::cuda {

// Routing statistics of one micro-batch ADDED to acc (E + 2 doubles, in fixed order):
// acc[e] += kept rows of expert e (counts_slot[slot_of_expert[e]]; slot_of_expert null:
// the identity), acc[E] += router entropy summed over the T tokens (moe/router.h's
// router_entropy_sum), acc[E + 1] += T. scratch: routing_stats_scratch(T) doubles.
int64_t routing_stats_scratch(int64_t T);
void accumulate_routing_stats(double* acc, double* scratch, const float* scores_TE, const int32_t* counts_slot,
                              const int32_t* slot_of_expert, int64_t T, int64_t E, Stream stream);
// Assignments per expert before capacity dropping (this micro-batch), overwritten.
void expert_counts(int32_t* counts_E, const int32_t* expert_TK, int64_t T, int64_t E, int64_t K, Stream stream);
// Per-token terms of the router losses: aux_term_t = sum_e f_e p_te (p normalised per
// token for sigmoid scores, f_e = counts_E / (T K)) and z_term_t = lse_t(logits / temperature)^2.
// aux loss = coef * E * mean_t(aux_term); z-loss = coef * mean_t(z_term).
void router_loss_terms(float* aux_term_T, float* z_term_T, const float* scores_TE, const float* logits_TE,
                       const int32_t* counts_E, int64_t T, int64_t E, int64_t K, float temperature,
                       ScoreFunc score_func, Stream stream);
// dlogits_TE (overwritten) from the combine-weight gradients, plus the aux and z-loss
// gradients with weights aux_scale = dloss * aux_coef and z_scale = dloss * z_coef (0: off).
void router_backward(float* dlogits_TE, const float* dweight_TK, const float* scores_TE, const float* logits_TE,
                     const int32_t* expert_TK, const int32_t* counts_E, int64_t T, int64_t E, int64_t K,
                     float temperature, ScoreFunc score_func, bool renormalize, float aux_scale, float z_scale,
                     Stream stream);
// *out = scale * sum(values[0..n)), summed in a fixed order by one block.
void ordered_sum(float* out, const float* values, int64_t n, float scale, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// x_RC[r, c] += bias_C[c] (fp32).
void add_bias_rows(float* x_RC, const float* bias_C, int64_t rows, int64_t cols, Stream stream);
void cast_to_bf16(bf16* out, const float* in, int64_t n, Stream stream);
void cast_to_float(float* out, const bf16* in, int64_t n, Stream stream);  // exact
// out_C[c] += sum over rows of x_RC[r, c], in row order.
void add_column_sums(float* out_C, const float* x_RC, int64_t rows, int64_t cols, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// The experts' GEMMs over the device row layout: expert e owns rows
// [offsets_E1[e], offsets_E1[e + 1]) of every row buffer. The offsets are read on the
// device (CUTLASS's Hopper grouped GEMM with device-side problem sizes), so dropless
// routing needs no host synchronisation and empty experts cost nothing. `sets` (1 or 2)
// runs that many independent expert GEMMs in one launch (the gate and up projections).
// Widths and leading dimensions must be multiples of 8 elements (16-byte TMA rows).
class ExpertGemm {
 public:
  // Room for up to max_experts experts per call; the calls run over all of them until
  // set_experts says otherwise.
  explicit ExpertGemm(int64_t max_experts);
  ~ExpertGemm();
  ExpertGemm(const ExpertGemm&) = delete;
  ExpertGemm& operator=(const ExpertGemm&) = delete;
  static constexpr int kMaxSets = 2;
  // out[s] rows of e ([rows_e, N], ld_out) = x rows of e ([rows_e, K], ld_x) @ W^T, where
  // W = w[s] + e * N * K is stored [N, K] (a Linear weight).
  void forward(int sets, bf16* const* out, int64_t ld_out, const bf16* x, int64_t ld_x, const bf16* const* w,
               const int32_t* offsets_E1, int64_t N, int64_t K, Stream stream);
  // out rows of e ([rows_e, N], ld_out) = dy rows of e ([rows_e, K], ld_dy) @ W + beta * out,
  // where W = w + e * K * N is stored [K, N].
  void backward_data(bf16* out, int64_t ld_out, const bf16* dy, int64_t ld_dy, const bf16* w,
                     const int32_t* offsets_E1, int64_t N, int64_t K, float beta, Stream stream);
  // dw[s] + e * M * N ([M, N], fp32) += (a[s] rows of e, [rows_e, M], ld_a)^T @ (b rows of e, [rows_e, N], ld_b).
  void backward_weight(int sets, float* const* dw, const bf16* const* a, int64_t ld_a, const bf16* b, int64_t ld_b,
                       const int32_t* offsets_E1, int64_t M, int64_t N, Stream stream);
  // The kernels are persistent (a CTA per multiprocessor for the whole launch), so they
  // shut out kernels on other streams, NCCL's included, until they end. From now on they
  // launch on `sms` multiprocessors rounded down to whole clusters of 2 (0 or more than
  // the device has: all of them).
  void set_sm_limit(int sms);
  // The experts the next calls run over (0 .. max_experts; 0: the calls do nothing), e.g.
  // an EP rank's count in one MoE layer after a re-placement by load.
  void set_experts(int64_t n_experts);

 private:
  struct State;
  State* state_;
};

}  // namespace moe::cuda

namespace moe::cuda {

// The multi-tensor optimizer over one contiguous parameter block (kernels/cuda/optimizer.cu).
// A segment is one parameter: its place in the block, whether weight decay applies, and
// where an fp32 copy of its values is kept (mirror_offset, -1: none). The block is walked
// in chunks of adamw_math::kNormChunk elements that never straddle two segments;
// first_chunk numbers them over all segments in order (n_chunks in all).
struct OptimizerSegment {
  int64_t offset = 0, numel = 0;
  int64_t first_chunk = 0;
  int64_t mirror_offset = -1;
  int32_t decay = 0;
  int32_t unused = 0;
};

// The fp32 master weights as bf16 hi + int16 lo halves (adamw_math::split_master), and back.
void split_master(bf16* hi, int16_t* lo, const float* x, int64_t n, Stream stream);
void join_master(float* x, const bf16* hi, const int16_t* lo, int64_t n, Stream stream);
// bf16 rounding to nearest even with adamw_math's bits (the moments), and widening.
void round_to_bf16(bf16* out, const float* in, int64_t n, Stream stream);
void widen_bf16(float* out, const bf16* in, int64_t n, Stream stream);

// The global gradient norm, the CPU's (train/grad_clip.cpp) bit for bit: per chunk an fp64
// sum of squares in element order (chunk_sq_C), per segment the chunks in order
// (segment_sq_S), then the segments in order. Writes scalars->sum_sq, ->norm and, for the
// AdamW kernel, ->grad_scale = norm > max_norm > 0 ? float(max_norm / (norm + 1e-6)) : 1
// and ->skip = the norm is not finite. Two launches, no host synchronisation.
void grad_norm(adamw_math::AdamWScalars* scalars, double* chunk_sq_C, double* segment_sq_S, const float* grads,
               const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks, double max_norm,
               Stream stream);

// AdamW over every segment in one launch, reading its scalars from device memory
// (nothing when scalars->skip): master weights as hi/lo (both rewritten), fp32
// gradients, moments in fp32 (bf16_moments false: m and v are float*) or bf16 (bf16*),
// and the fp32 mirrors refreshed. The arithmetic is adamw_math::adamw_update's.
void multi_tensor_adamw(bf16* hi, int16_t* lo, float* mirror, const float* grads, void* m, void* v, bool bf16_moments,
                        const OptimizerSegment* segments, int64_t n_segments, int64_t n_chunks,
                        const adamw_math::AdamWScalars* scalars, Stream stream);

}  // namespace moe::cuda

namespace moe::cuda {

// Per-expert gradient clipping (kernels/cuda/expert_clip.cu), train/grad_clip.cpp's order
// and rounding. A slice is one expert's part of one expert tensor (an OptimizerSegment:
// offset, numel, first_chunk); grad_norm over the slices gives their sums of squares
// (segment_sq_S). Expert x owns slices first_slice_X1[x] .. first_slice_X1[x+1] - 1:
// norm_X[x] = sqrt of their sums added in order, and factor_X[x] =
// float(max_norm / (norm + 1e-6)) where norm > max_norm > 0, else 1.
void expert_clip_factors(double* norm_X, float* factor_X, const double* slice_sq_S, const int32_t* first_slice_X1,
                         int64_t n_experts, double max_norm, Stream stream);
// grads[slice] *= factor_X[expert_of_slice_S[slice]] (fp32, as the CPU scales).
void scale_expert_slices(float* grads, const OptimizerSegment* slices, const int32_t* expert_of_slice_S,
                         int64_t n_slices, const float* factor_X, Stream stream);

}  // namespace moe::cuda
