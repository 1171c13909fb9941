// Speculative dispatch (moe.speculative_dispatch, docs/ROUTING_CACHE.md): the planning of
// the rows a home rank sends before its router has chosen, from guessed experts, and how
// the receiver rebuilds the exact dispatch's blocks from them and the corrections. The
// CPU references of what a GPU version would run; model/expert_parallel_dispatcher.cpp
// drives them. Blocks as in moe/token_exchange.h: rank p's block holds its tokens in
// token order, blocks rank after rank.
#pragma once
#include <cstdint>

namespace moe {

// The speculative blocks: token t goes early to rank p != me when one of its Q guessed
// slots pred_slot_TQ (slots, not experts; -1 ignored) lies in p's window
// [slot_bounds_P1[p], window_end_P[p]) (with split experts a hinge slot is in two
// windows: the token goes to both). spec_pos_TP[t * P + p]: its row in p's speculative
// block or -1; spec_tokens_P: the block sizes (0 for me).
void speculative_blocks(int32_t* spec_pos_TP, int32_t* spec_tokens_P, const int32_t* pred_slot_TQ, int64_t T,
                        int64_t Q, const int32_t* slot_bounds_P1, const int32_t* window_end_P, int P, int me);

// Where each row of the exact blocks (pos_TP, tokens_P: token_blocks) comes from:
// source_U[u] = its row in the speculative block to the same rank (spec_pos_TP) when the
// token went there early, else -1 - c for the c-th row of the correction block to that
// rank. corr_pos_TP / corr_tokens_P: the correction blocks (the exact rows not sent
// early, token order), whose rows follow the same layout as the exact blocks.
void speculation_sources(int32_t* source_U, int32_t* corr_pos_TP, int32_t* corr_tokens_P, const int32_t* pos_TP,
                         const int32_t* tokens_P, const int32_t* spec_pos_TP, int64_t T, int P);

// Counts of one speculative dispatch (remote ranks only: rows a rank sends itself are
// never speculative and cost no exchange).
struct SpeculationRows {
  int64_t used = 0;       // sent early and part of the exact dispatch
  int64_t wasted = 0;     // sent early, not chosen (dropped by the receiver)
  int64_t corrected = 0;  // chosen but not guessed: sent after the router
  void add(const SpeculationRows& o) {
    used += o.used;
    wasted += o.wasted;
    corrected += o.corrected;
  }
};

// The receiver's merge, on rows of `row_bytes` bytes: rows_U (U = the exact blocks'
// rows from every source, recv_tokens_P[p] from p) gets, row by row, the speculative row
// or the correction row source_U names, from spec_rows (spec_recv_P[p] rows from source p,
// blocks one after another) and corr_rows (corr_recv_P[p] from p). Checks every index;
// returns the counts for the sources other than me.
SpeculationRows merge_speculated_rows(void* rows_U, const int32_t* source_U, const int32_t* recv_tokens_P,
                                      const void* spec_rows, const int32_t* spec_recv_P, const void* corr_rows,
                                      const int32_t* corr_recv_P, int64_t row_bytes, int P, int me);

}  // namespace moe
