// Token dispatch on the CPU: expert capacity and dropping, the expert-contiguous row
// layout, permute (tokens -> rows) and combine (rows -> weighted sum per token), each with
// its backward. Between router_select (moe/router.h) and the experts' grouped GEMM.
//
// Layout: the kept (token, slot) assignments become R rows, grouped by expert (expert e
// owns rows [offsets_E1[e], offsets_E1[e+1])) and, inside an expert, ordered by (t, k).
// row_TK maps each assignment to its row, or -1 when it was dropped.
//
// Sums are accumulated in double in a fixed order (per token, slots k = 0..K-1), so
// results are bit-identical for any OpenMP thread count.
#pragma once
#include <cstdint>

namespace moe {

// Most rows one expert may take. cf > 0: ceil(cf * T * K / E), where a product within
// 1e-9 (relative) of an integer counts as that integer, so that 1.1 * 100 / 11 gives 10,
// not 11; never more than T * K. cf == 0: no limit (T * K).
int64_t expert_capacity(double capacity_factor, int64_t T_, int64_t K, int64_t E);

// Capacity and layout, dropping by position: walk tokens t = 0..T-1 and, within a token,
// slots k = 0..K-1; an assignment is kept iff its expert has fewer than `capacity` rows so
// far. Writes row_TK (-1 = dropped), counts_E (kept rows per expert), offsets_E1 (E + 1
// prefix sums of counts_E) and token_of_row_R (the token of each row; the caller sizes it
// for T * K rows). Returns R, the number of kept rows. Expert index -1 marks an
// assignment routed to another rank (expert parallelism): row -1, counted nowhere. Throws
// on an expert index outside [-1, E).
int64_t assign_rows(int32_t* row_TK, int32_t* counts_E, int32_t* offsets_E1,
                    int32_t* token_of_row_R, const int32_t* expert_TK, int64_t T_, int64_t E,
                    int64_t K, int64_t capacity);

// x_RD[r] = x_TD[token_of_row_R[r]].
template <typename T>
void permute_forward(T* x_RD, const T* x_TD, const int32_t* token_of_row_R, int64_t R, int64_t D);

// dx_TD[t] = sum of dx_RD over token t's kept rows, in slot order (zero if none were
// kept); with `accumulate`, added to dx_TD instead of overwriting it.
template <typename T>
void permute_backward(T* dx_TD, const T* dx_RD, const int32_t* row_TK, int64_t T_, int64_t K,
                      int64_t D, bool accumulate);

// out_TD[t] = sum over kept slots k of weight_TK[t,k] * y_RD[row_TK[t,k]]. Overwrites
// out_TD; dropped slots contribute nothing (a token with every slot dropped gets 0).
template <typename T>
void combine_forward(T* out_TD, const T* y_RD, const T* weight_TK, const int32_t* row_TK,
                     int64_t T_, int64_t K, int64_t D);

// dy_RD[row] = weight * dout_TD[t] for every kept row (overwritten; each row belongs to
// exactly one kept assignment), dweight_TK = <dout_TD[t], y_RD[row]>, 0 for dropped slots.
template <typename T>
void combine_backward(T* dy_RD, T* dweight_TK, const T* dout_TD, const T* y_RD,
                      const T* weight_TK, const int32_t* row_TK, int64_t T_, int64_t K,
                      int64_t D);

}  // namespace moe
