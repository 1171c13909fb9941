// GPU versions of the MoE ops: routing, its losses and statistics, the row layout
// (capacity, permute, combine) and the expert-parallel token exchange. Each is tested
// against the CPU op of the same name in moe/router.h, moe/dispatch.h and
// moe/token_exchange.h (tests/gpu/test_gpu_dispatch.cpp, test_gpu_router_backward.cpp,
// test_gpu_routing_stats.cpp); the kernels are in moe/cuda/. Declared without CUDA
// headers, as kernels/gpu_ops.h.
#pragma once
#include <cstdint>

#include "config/model_config.h"
#include "core/bf16.h"
#include "kernels/fp8_gpu_ops.h"
#include "kernels/gpu_ops.h"

namespace moe::cuda {

// Router: scores = softmax or sigmoid(logits / temperature) (fp32), then top-K of
// scores + bias (bias nullable), weights from the unbiased scores, optionally
// renormalised. Ties go to the lower expert index, as on the CPU. E <= 1024. With
// route_groups > 1 (<= 32) only experts of the route_top_groups best groups are chosen
// (moe/router.h, RouteGroups).
// temperature_1 (here and in the two functions below): when not null, a device float the
// kernels read the temperature from instead of `temperature` (moe.temperature_control
// changes it between steps: a captured CUDA graph's replays see the new value).
void router_topk(float* scores_TE, int32_t* expert_TK, float* weight_TK, const float* logits_TE,
                 const float* bias_E, int64_t T, int64_t E, int64_t K, float temperature,
                 ScoreFunc score_func, bool renormalize, Stream stream, int64_t route_groups = 0,
                 int64_t route_top_groups = 0, const float* temperature_1 = nullptr);

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
                       ScoreFunc score_func, Stream stream, const float* temperature_1 = nullptr);
// dlogits_TE (overwritten) from the combine-weight gradients, plus the aux and z-loss
// gradients with weights aux_scale = dloss * aux_coef and z_scale = dloss * z_coef (0: off).
void router_backward(float* dlogits_TE, const float* dweight_TK, const float* scores_TE, const float* logits_TE,
                     const int32_t* expert_TK, const int32_t* counts_E, int64_t T, int64_t E, int64_t K,
                     float temperature, ScoreFunc score_func, bool renormalize, float aux_scale, float z_scale,
                     Stream stream, const float* temperature_1 = nullptr);

// Capacity and row layout on the device, the same semantics as moe::assign_rows:
// walking (t, k) in order, an assignment is kept iff its expert has fewer than
// `capacity` rows. Writes row_TK (-1 = dropped), counts_E, offsets_E1 (E + 1; the kept
// row count R is offsets_E1[E], left on the device), token_of_row_R (T*K capacity) and
// adds the assignments before dropping to load_E when not null. `scratch`:
// assign_rows_scratch(T, K, E) ints. An expert < 0 (routed to another rank) gets row -1
// and is counted nowhere. E at most 1536.
// row_align > 1: each expert's rows start at a multiple of it (offsets_E1[e + 1] - offsets_E1[e]
// its count rounded up; the padding rows get no token_of_row_R entry, which then holds up to
// offsets_E1[E] rows), and kept_1, when not null, gets the rows' count without the padding.
void assign_rows(int32_t* row_TK, int32_t* counts_E, int32_t* offsets_E1, int32_t* token_of_row_R,
                 int64_t* load_E, int32_t* scratch, const int32_t* expert_TK, int64_t T, int64_t E,
                 int64_t K, int64_t capacity, Stream stream, int64_t row_align = 1, int32_t* kept_1 = nullptr);
// Rows padded per expert (assign_rows with row_align > 1): each expert's padding rows,
// [offsets_E1[e] + counts_E[e], offsets_E1[e + 1]), set to zero in rows_RD [.., D] and, where
// codes.codes_RK is not null, their codes and scales as quantising zero rows writes them
// (codes: kernels/fp8_gpu_ops.h's RowCodes). Rows of experts are not touched.
void zero_padding_rows(bf16* rows_RD, const RowCodes& codes, const int32_t* offsets_E1, const int32_t* counts_E,
                       int64_t E, int64_t D, int64_t row_align, Stream stream);
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
// The expert exchange's fp8 rows (core/fp8.h: [fp32 scale | D e4m3 codes | padding],
// fp8_row_bytes(D) bytes per row): U rows of D quantised (scale = amax / 448, codes by
// cuda_fp8.h's satfinite round-to-nearest-even conversion), and back to bf16 (decode *
// scale in fp32, rounded once). Bit-identical to quantize_row_fp8 / dequantize_row_fp8.
void quantize_rows_fp8(uint8_t* dst_UB, const bf16* src_UD, int64_t U, int64_t D, Stream stream);
void dequantize_rows_fp8(bf16* dst_UD, const uint8_t* src_UB, int64_t U, int64_t D, Stream stream);
// The home side's packing with the fp8 rows inside it: scatter_token_rows quantising each
// row as it is written (= scatter_token_rows + quantize_rows_fp8), and sum_token_rows over
// fp8 rows (= dequantize_rows_fp8 + sum_token_rows), bit for bit, one pass each.
void scatter_token_rows_fp8(uint8_t* dst_UB, const bf16* src_TD, const int32_t* pos_TP, const int32_t* tokens_P,
                            int64_t T, int P, int64_t D, Stream stream);
void sum_token_rows_fp8(bf16* dst_TD, const uint8_t* src_UB, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                        int P, int64_t D, Stream stream);
// The experts' side with the fp8 rows inside: combine_forward (received tokens' weighted
// sums of their rows) and permute_backward (not accumulating) writing fp8 rows (rows of at
// most kMaxFusedFp8Dim: a row is held in registers until its scale is known), and
// permute_forward reading them; each = the bf16 kernel + quantize/dequantize_rows_fp8 bit
// for bit.
inline constexpr int64_t kMaxFusedFp8Dim = 8192;
void combine_forward_fp8(uint8_t* dst_UB, const bf16* y_RD, const float* weight_UK, const int32_t* row_UK, int64_t U,
                         int64_t K, int64_t D, Stream stream);
void permute_backward_fp8(uint8_t* dst_UB, const bf16* dx_RD, const int32_t* row_UK, int64_t U, int64_t K, int64_t D,
                          Stream stream);
void permute_forward_fp8(bf16* x_RD, const uint8_t* src_UB, const int32_t* token_of_row_R, const int32_t* offsets_E1,
                         int64_t max_rows, int64_t E, int64_t D, Stream stream);
void sum_token_values(float* dst_TK, const float* src_UK, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                      int64_t K, int P, Stream stream);
// moe.speculative_dispatch (moe/speculative_exchange.h holds the CPU references):
// speculation_sources as moe::speculation_sources (P <= 32; tokens_P on the device), and
// the receiver's merge: rows_U[u] (U = the exact blocks' rows) <- the early row or the
// correction row source_U[u] names, of row_bytes bytes (a multiple of 4).
// starts_3P1 = [exact | early | correction] block starts, P + 1 each, per source.
void speculation_sources(int32_t* source_U, int32_t* corr_pos_TP, int32_t* corr_tokens_P, const int32_t* pos_TP,
                         const int32_t* tokens_P, const int32_t* spec_pos_TP, int64_t T, int P, Stream stream);
void merge_speculated_rows(void* rows_U, const int32_t* source_U, int64_t U, const int32_t* starts_3P1,
                           const void* spec_rows, const void* corr_rows, int64_t row_bytes, int P, Stream stream);
// out_N[i] = table[index_N[i]] (e.g. routed experts to their slots under a re-placement).
void lookup(int32_t* out_N, const int32_t* table, const int32_t* index_N, int64_t n, Stream stream);
// x_RD[r] = x_TD[token_of_row_R[r]] for r < offsets_E1[E]; launched for max_rows rows so
// the host never needs R.
void permute_forward(bf16* x_RD, const bf16* x_TD, const int32_t* token_of_row_R, const int32_t* offsets_E1,
                     int64_t max_rows, int64_t E, int64_t D, Stream stream);
// The same rows from the token side: x_RD[row_TK[t, k]] = x_TD[t] for every kept slot
// (row >= 0). Each token's row is read once instead of once per slot (the gather form
// reads it from memory again when x_TD does not fit in the L2), for a layout whose row_TK
// is the inverse of token_of_row_R (assign_rows').
void permute_forward_by_token(bf16* x_RD, const bf16* x_TD, const int32_t* row_TK, int64_t T, int64_t K, int64_t D,
                              Stream stream);
// dx_TD[t] (= or +=) the sum of dx_RD's rows of t's kept slots (fp32, bf16 out).
void permute_backward(bf16* dx_TD, const bf16* dx_RD, const int32_t* row_TK, int64_t T, int64_t K, int64_t D,
                      bool accumulate, Stream stream);
// out_TD[t] = sum over kept slots of weight * y_RD[row] (fp32 sum, bf16 out).
void combine_forward(bf16* out_TD, const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T,
                     int64_t K, int64_t D, Stream stream);
void combine_backward(bf16* dy_RD, float* dweight_TK, const bf16* dout_TD, const bf16* y_RD, const float* weight_TK,
                      const int32_t* row_TK, int64_t T, int64_t K, int64_t D, Stream stream);
// training.precision = fp8: permute_forward_by_token and combine_backward writing the rows'
// codes too (cuda::RowCodes, kernels/fp8_gpu_ops.h; offsets_E1 the experts'). D a multiple
// of 128, the bf16 rows 16-byte aligned.
void permute_forward_by_token_fp8(bf16* x_RD, const RowCodes& codes, const bf16* x_TD, const int32_t* row_TK,
                                  int64_t T, int64_t K, int64_t D, Stream stream);
void combine_backward_fp8(bf16* dy_RD, const RowCodes& codes, float* dweight_TK, const bf16* dout_TD,
                          const bf16* y_RD, const float* weight_TK, const int32_t* row_TK, int64_t T, int64_t K,
                          int64_t D, Stream stream);

}  // namespace moe::cuda
