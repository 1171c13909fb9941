#include "moe/token_exchange.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace moe {

namespace {

std::vector<int64_t> block_starts(const int32_t* tokens_P, int P) {
  std::vector<int64_t> start(static_cast<size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) start[static_cast<size_t>(p) + 1] = start[static_cast<size_t>(p)] + tokens_P[p];
  return start;
}

// visit(t, p, u) for every token t in rank p's block, u its row in the blocks.
template <typename Visit>
void for_each_block_row(const int32_t* pos_TP, const int32_t* tokens_P, int64_t T, int P, Visit visit) {
  const std::vector<int64_t> start = block_starts(tokens_P, P);
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < P; ++p) {
      const int32_t pos = pos_TP[t * P + p];
      if (pos >= 0) visit(t, p, start[static_cast<size_t>(p)] + pos);
    }
}

}  // namespace

std::vector<int64_t> equal_slot_bounds(int64_t n_experts, int P) {
  MOE_CHECK(P >= 1, "expert slots: {} EP ranks", P);
  MOE_CHECK(n_experts % P == 0 && n_experts > 0, "expert slots: {} experts do not split over {} EP ranks", n_experts, P);
  std::vector<int64_t> bounds(static_cast<size_t>(P) + 1);
  for (int p = 0; p <= P; ++p) bounds[static_cast<size_t>(p)] = p * (n_experts / P);
  return bounds;
}

void token_blocks(int32_t* pos_TP, int32_t* tokens_P, const int32_t* row_TK, const int32_t* slot_TK,
                  const int32_t* first_slot_P1, int64_t T, int64_t K, int P) {
  MOE_CHECK(P >= 1 && T >= 0 && K >= 1, "token blocks: T={} K={} P={}", T, K, P);
  for (int p = 0; p < P; ++p) {
    int32_t next = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool here = false;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t slot = slot_TK[t * K + k];
        here |= row_TK[t * K + k] >= 0 && slot >= first_slot_P1[p] && slot < first_slot_P1[p + 1];
      }
      pos_TP[t * P + p] = here ? next++ : -1;
    }
    tokens_P[p] = next;
  }
}

void pack_routing(int32_t* slot_UK, float* weight_UK, const int32_t* pos_TP, const int32_t* tokens_P,
                  const int32_t* row_TK, const int32_t* slot_TK, const float* weight_TK, const int32_t* first_slot_P1,
                  int64_t T, int64_t K, int P) {
  for_each_block_row(pos_TP, tokens_P, T, P, [&](int64_t t, int p, int64_t u) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t slot = slot_TK[t * K + k];
      const bool here = row_TK[t * K + k] >= 0 && slot >= first_slot_P1[p] && slot < first_slot_P1[p + 1];
      slot_UK[u * K + k] = here ? slot - first_slot_P1[p] : -1;
      weight_UK[u * K + k] = weight_TK[t * K + k];
    }
  });
}

void pack_counts(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P, const int32_t* first_slot_P1, int P) {
  for (int p = 0; p < P; ++p) {
    int32_t* part = out + first_slot_P1[p] + p;
    for (int32_t slot = first_slot_P1[p]; slot < first_slot_P1[p + 1]; ++slot) *part++ = counts_E[slot];
    *part = tokens_P[p];
  }
}

void scatter_token_rows(float* dst_UD, const float* src_TD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                        int P, int64_t D) {
  for_each_block_row(pos_TP, tokens_P, T, P, [&](int64_t t, int, int64_t u) {
    for (int64_t d = 0; d < D; ++d) dst_UD[u * D + d] = src_TD[t * D + d];
  });
}

void sum_token_rows(float* dst_TD, const float* src_UD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T,
                    int P, int64_t D) {
  std::fill(dst_TD, dst_TD + T * D, 0.0f);
  for_each_block_row(pos_TP, tokens_P, T, P, [&](int64_t t, int, int64_t u) {
    for (int64_t d = 0; d < D; ++d) dst_TD[t * D + d] += src_UD[u * D + d];  // ranks in order for each token
  });
}

}  // namespace moe
