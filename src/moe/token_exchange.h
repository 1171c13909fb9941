// Expert parallelism without duplicate rows (the GPU path's exchange plan). A token goes
// once to each EP rank that computes at least one of its kept assignments, with its K
// routing entries (the slot on that rank or -1, and the combine weight). That rank lays
// out the rows (assign_rows, -1 = elsewhere), runs its experts and sends back one row per
// token: the weighted sum of its experts' outputs (a partial combine). The token's home
// adds the partial rows of the ranks in rank order. The backward mirrors it: the output
// gradient goes once per token and rank; the rank sends back the sum of the token's
// input-row gradients and the combine weights' gradients (zero for slots not its own).
// With top-k > 1 this sends up to k times fewer rows than one row per assignment.
//
// Layout: rank p's block holds its tokens in token order; the blocks follow each other
// rank after rank (block p starts at tokens_P[0] + ... + tokens_P[p - 1]).
// Slots: EP rank p computes slots [first_slot_P1[p], first_slot_P1[p + 1]).
//
// These are the CPU references of the kernels in kernels/cuda/token_exchange.cu.
#pragma once
#include <cstdint>
#include <vector>

namespace moe {

// Slot bounds of equal blocks (P + 1 values: rank p computes slots [p E/P, (p + 1) E/P));
// P must divide E.
std::vector<int64_t> equal_slot_bounds(int64_t n_experts, int P);

// pos_TP[t * P + p]: token t's place in rank p's block, or -1 when none of its kept
// assignments (row_TK >= 0) has a slot (slot_TK) of rank p; tokens_P: the block sizes.
void token_blocks(int32_t* pos_TP, int32_t* tokens_P, const int32_t* row_TK, const int32_t* slot_TK,
                  const int32_t* first_slot_P1, int64_t T, int64_t K, int P);

// The routing sent with the tokens, one row of K per block row: slot_UK the slot minus
// first_slot_P1[p] for the token's kept assignments on rank p, else -1; weight_UK the
// combine weights.
void pack_routing(int32_t* slot_UK, float* weight_UK, const int32_t* pos_TP, const int32_t* tokens_P,
                  const int32_t* row_TK, const int32_t* slot_TK, const float* weight_TK, const int32_t* first_slot_P1,
                  int64_t T, int64_t K, int P);

// What each rank learns before the exchange: per peer p, the kept rows of its slots
// (counts_E[first_slot_P1[p] ..]) then its block size; peer p's part starts at
// first_slot_P1[p] + p (E + P values in all).
void pack_counts(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P, const int32_t* first_slot_P1, int P);

// dst_UD[block row of (t, p)] = src_TD[t] for every (t, p) with pos_TP >= 0.
void scatter_token_rows(float* dst_UD, const float* src_TD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                        int P, int64_t D);

// dst_TD[t] = the sum over p = 0 .. P-1 of src_UD[block row of (t, p)] (0 where none),
// added in rank order.
void sum_token_rows(float* dst_TD, const float* src_UD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                    int P, int64_t D);

}  // namespace moe
