// Expert parallelism without duplicate rows (the exchange plan of the CPU and GPU paths). A token goes
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
//
// Slots and ranks: slot_bounds_P1 (P + 1 values, 0 .. E) cut the slots into one block per
// rank. Rank p holds the window [slot_bounds_P1[p], window_end_P[p]): its block, and with
// split experts also the first slot of the next block (a "hinge" slot, held by both).
// Which rank computes an assignment follows boundary cuts in fixed point (cut_P1, in
// 1 / kSlotParts of a slot; cut 0 = 0, cut P = E * kSlotParts): rank p takes the part
// [cut_P1[p], cut_P1[p + 1]) of the slot line. A boundary at a block edge takes whole
// slots; a boundary inside a hinge slot divides that slot's rows at every home rank in
// the same proportion (rows in their layout order: the first share to the lower rank).
//
// These are the CPU references of the kernels in moe/cuda/token_exchange.cu, and the CPU
// path's exchange (model/expert_parallel_dispatcher.h) runs on them.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#ifndef MOE_HOST_DEVICE
#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOE_HOST_DEVICE inline
#endif
#endif

namespace moe {

inline constexpr int64_t kSlotParts = 65536;

// Slot bounds of equal blocks (P + 1 values: rank p computes slots [p E/P, (p + 1) E/P));
// P must divide E.
std::vector<int64_t> equal_slot_bounds(int64_t n_experts, int P);
// The windows' ends: the block's end, plus the next block's first slot with split experts.
std::vector<int64_t> slot_window_ends(const std::vector<int64_t>& slot_bounds_P1, bool split);

// Of a slot's n rows at one home rank, how many lie before `part` (in 1 / kSlotParts of
// the slot, from its start): the rounded share, 0 at or below 0, n at or above a slot.
MOE_HOST_DEVICE int64_t rows_before(int64_t n, int64_t part) {
  return part <= 0 ? 0 : part >= kSlotParts ? n : (n * part + kSlotParts / 2) / kSlotParts;
}

// Where the boundaries fall in the rows (P + 1 values from 0 to the total), for the rows
// before each slot (rows_before_S1, E + 1 prefix sums). Without split experts, at the
// block edges. With them, boundary p (1 .. P - 1) may fall anywhere inside its hinge slot
// slot_bounds_P1[p] (when that is a slot): the places that make the busiest rank's rows
// the fewest (the smallest bound M for which walking the boundaries, each as far as M
// rows past the last and its hinge allow, ends in reach of the total), so every rank
// computes the same number of rows when the hinges can absorb the imbalance.
std::vector<int64_t> balanced_boundaries(const std::vector<int64_t>& rows_before_S1,
                                         const std::vector<int64_t>& slot_bounds_P1, bool split);

// The boundary cuts of one micro-batch (P + 1 values): balanced_boundaries of the global
// rows (counts_PE summed over the P home ranks, kept rows per slot), each turned into its
// place inside its slot.
void boundary_cuts(int32_t* cut_P1, const int32_t* counts_PE, const int32_t* slot_bounds_P1, bool split, int64_t E,
                   int P);

// rank_TK: the EP rank computing each kept assignment (row_TK >= 0; -1 when dropped):
// the rank whose part of the slot line holds the assignment's place among its slot's rows
// (row_TK - offsets_E1[slot], of offsets_E1[slot + 1] - offsets_E1[slot]).
void route_ranks(int32_t* rank_TK, const int32_t* row_TK, const int32_t* slot_TK, const int32_t* offsets_E1,
                 const int32_t* cut_P1, int64_t T, int64_t K, int P);

// pos_TP[t * P + p]: token t's place in rank p's block, or -1 when none of its
// assignments goes to rank p (rank_TK); tokens_P: the block sizes.
void token_blocks(int32_t* pos_TP, int32_t* tokens_P, const int32_t* rank_TK, int64_t T, int64_t K, int P);

// The routing sent with the tokens, one row of K per block row: slot_UK the slot minus
// slot_bounds_P1[p] (its place in rank p's window) for the token's assignments going to
// rank p, else -1; weight_UK the combine weights. (W: float, or the CPU model's type.)
template <typename W>
void pack_routing(int32_t* slot_UK, W* weight_UK, const int32_t* pos_TP, const int32_t* tokens_P,
                  const int32_t* rank_TK, const int32_t* slot_TK, const W* weight_TK,
                  const int32_t* slot_bounds_P1, int64_t T, int64_t K, int P);

// What each rank learns before the exchange: per peer p, the rows it gets of each slot of
// its window (of the kept rows counts_E, cut by cut_P1) then its block size; peer p's part
// starts after the parts (window + 1 values) of the peers before it.
void pack_counts(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P, const int32_t* slot_bounds_P1,
                 const int32_t* window_end_P, const int32_t* cut_P1, int P);

// dst_UD[block row of (t, p)] = src_TD[t] for every (t, p) with pos_TP >= 0. (T: float,
// or double for the CPU model in double.)
template <typename T>
void scatter_token_rows(T* dst_UD, const T* src_TD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T_,
                        int P, int64_t D);

// dst_TD[t] = the sum over p = 0 .. P-1 of src_UD[block row of (t, p)] (0 where none),
// added in rank order, in T.
template <typename T>
void sum_token_rows(T* dst_TD, const T* src_UD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T_, int P,
                    int64_t D);

// Chunk c of C of a block of n token rows: rows [n c / C, n (c + 1) / C) of the block
// (parallel.a2a_chunks on the CPU: chunk c of every block travels as one exchange).
inline std::pair<int64_t, int64_t> chunk_of_block(int64_t n, int64_t c, int64_t C) {
  return {n * c / C, n * (c + 1) / C};
}

// The receiving rank's rows for what it received: U tokens in blocks by source
// (tokens_P[p] from source p, one after the other), their routing slot_UK (a slot of its
// L-slot window, or -1). Chunk c of every source's block (chunk_of_block), source by
// source, is laid out as assign_rows lays out one block without capacity: rows by slot,
// each slot's rows in that token order; chunk c's rows follow chunk c - 1's. With one
// chunk this is assign_rows over all U tokens: the GPU's layout.
struct ReceivedRows {
  std::vector<int32_t> row_UK;          // each received assignment's row (-1: another rank's slot)
  std::vector<int32_t> token_of_row_R;  // the received token u of each row
  std::vector<int32_t> offsets_CL1;     // chunk c, slot l: rows [offsets_CL1[c (L+1) + l], offsets_CL1[c (L+1) + l + 1])
  std::vector<int64_t> rows_L;          // rows of each slot, over all chunks
};
ReceivedRows lay_out_received(const int32_t* slot_UK, const std::vector<int32_t>& tokens_P, int64_t L, int64_t K,
                              int64_t chunks);

}  // namespace moe
