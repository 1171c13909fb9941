#include "moe/token_exchange.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "moe/dispatch.h"

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

std::vector<int64_t> slot_window_ends(const std::vector<int64_t>& slot_bounds_P1, bool split) {
  MOE_CHECK(slot_bounds_P1.size() >= 2, "expert slots: {} slot bounds", slot_bounds_P1.size());
  const size_t P = slot_bounds_P1.size() - 1;
  const int64_t E = slot_bounds_P1.back();
  std::vector<int64_t> ends(P);
  for (size_t p = 0; p < P; ++p)
    ends[p] = p + 1 < P && split ? std::min(E, slot_bounds_P1[p + 1] + 1) : slot_bounds_P1[p + 1];
  return ends;
}

std::vector<int64_t> balanced_boundaries(const std::vector<int64_t>& rows_before_S1,
                                         const std::vector<int64_t>& slot_bounds_P1, bool split) {
  const size_t P = slot_bounds_P1.size() - 1;
  const int64_t E = static_cast<int64_t>(rows_before_S1.size()) - 1, total = rows_before_S1.back();
  auto edge = [&](size_t p, int64_t extra) {
    return rows_before_S1[static_cast<size_t>(std::min(slot_bounds_P1[p] + extra, E))];
  };
  std::vector<int64_t> at(P + 1, 0);
  // Walks the boundaries each as far as `most` rows past the last allows: whether the
  // last rank then has at most `most` too.
  auto walk = [&](int64_t most) {
    for (size_t p = 1; p < P; ++p) at[p] = std::max(edge(p, 0), std::min(edge(p, split ? 1 : 0), at[p - 1] + most));
    at[P] = total;
    for (size_t p = 1; p <= P; ++p)
      if (at[p] - at[p - 1] > most) return false;
    return true;
  };
  int64_t low = (total + static_cast<int64_t>(P) - 1) / static_cast<int64_t>(P), high = std::max<int64_t>(total, low);
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (walk(mid)) high = mid;
    else low = mid + 1;
  }
  walk(low);
  return at;
}

void boundary_cuts(int32_t* cut_P1, const int32_t* counts_PE, const int32_t* slot_bounds_P1, bool split, int64_t E,
                   int P) {
  std::vector<int64_t> before(static_cast<size_t>(E) + 1, 0), bounds(slot_bounds_P1, slot_bounds_P1 + P + 1);
  for (int64_t s = 0; s < E; ++s) {
    int64_t rows = 0;
    for (int p = 0; p < P; ++p) rows += counts_PE[p * E + s];
    before[static_cast<size_t>(s) + 1] = before[static_cast<size_t>(s)] + rows;
  }
  const std::vector<int64_t> at = balanced_boundaries(before, bounds, split);
  cut_P1[0] = 0;
  cut_P1[P] = static_cast<int32_t>(E * kSlotParts);
  for (int p = 1; p < P; ++p) {
    // Inside slot bounds[p] (the hinge, or the edge's slot): the share of its rows before.
    const int64_t slot = bounds[static_cast<size_t>(p)];
    const int64_t rows = slot < E ? before[static_cast<size_t>(slot) + 1] - before[static_cast<size_t>(slot)] : 0;
    const int64_t into = rows > 0 ? (at[static_cast<size_t>(p)] - before[static_cast<size_t>(slot)]) * kSlotParts / rows : 0;
    cut_P1[p] = static_cast<int32_t>(slot * kSlotParts + into);
  }
}

void route_ranks(int32_t* rank_TK, const int32_t* row_TK, const int32_t* slot_TK, const int32_t* offsets_E1,
                 const int32_t* cut_P1, int64_t T, int64_t K, int P) {
  for (int64_t i = 0; i < T * K; ++i) {
    const int32_t row = row_TK[i], slot = slot_TK[i];
    if (row < 0) {
      rank_TK[i] = -1;
      continue;
    }
    const int64_t n = offsets_E1[slot + 1] - offsets_E1[slot], place = row - offsets_E1[slot];
    int p = 0;
    while (p + 1 < P && rows_before(n, cut_P1[p + 1] - int64_t{slot} * kSlotParts) <= place) ++p;
    rank_TK[i] = p;
  }
}

void token_blocks(int32_t* pos_TP, int32_t* tokens_P, const int32_t* rank_TK, int64_t T, int64_t K, int P) {
  MOE_CHECK(P >= 1 && T >= 0 && K >= 1, "token blocks: T={} K={} P={}", T, K, P);
  for (int p = 0; p < P; ++p) {
    int32_t next = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool here = false;
      for (int64_t k = 0; k < K; ++k) here |= rank_TK[t * K + k] == p;
      pos_TP[t * P + p] = here ? next++ : -1;
    }
    tokens_P[p] = next;
  }
}

template <typename W>
void pack_routing(int32_t* slot_UK, W* weight_UK, const int32_t* pos_TP, const int32_t* tokens_P,
                  const int32_t* rank_TK, const int32_t* slot_TK, const W* weight_TK,
                  const int32_t* slot_bounds_P1, int64_t T, int64_t K, int P) {
  for_each_block_row(pos_TP, tokens_P, T, P, [&](int64_t t, int p, int64_t u) {
    for (int64_t k = 0; k < K; ++k) {
      slot_UK[u * K + k] = rank_TK[t * K + k] == p ? slot_TK[t * K + k] - slot_bounds_P1[p] : -1;
      weight_UK[u * K + k] = weight_TK[t * K + k];
    }
  });
}

void pack_counts(int32_t* out, const int32_t* counts_E, const int32_t* tokens_P, const int32_t* slot_bounds_P1,
                 const int32_t* window_end_P, const int32_t* cut_P1, int P) {
  for (int p = 0; p < P; ++p) {
    for (int32_t slot = slot_bounds_P1[p]; slot < window_end_P[p]; ++slot) {
      const int64_t start = int64_t{slot} * kSlotParts;
      *out++ = static_cast<int32_t>(rows_before(counts_E[slot], cut_P1[p + 1] - start) -
                                    rows_before(counts_E[slot], cut_P1[p] - start));
    }
    *out++ = tokens_P[p];
  }
}

template <typename T>
void scatter_token_rows(T* dst_UD, const T* src_TD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T_,
                        int P, int64_t D) {
  for_each_block_row(pos_TP, tokens_P, T_, P, [&](int64_t t, int, int64_t u) {
    for (int64_t d = 0; d < D; ++d) dst_UD[u * D + d] = src_TD[t * D + d];
  });
}

template <typename T>
void sum_token_rows(T* dst_TD, const T* src_UD, const int32_t* pos_TP, const int32_t* tokens_P, int64_t T_, int P,
                    int64_t D) {
  std::fill(dst_TD, dst_TD + T_ * D, T(0));
  for_each_block_row(pos_TP, tokens_P, T_, P, [&](int64_t t, int, int64_t u) {
    for (int64_t d = 0; d < D; ++d) dst_TD[t * D + d] += src_UD[u * D + d];  // ranks in order for each token
  });
}

ReceivedRows lay_out_received(const int32_t* slot_UK, const std::vector<int32_t>& tokens_P, int64_t L, int64_t K,
                              int64_t chunks) {
  MOE_CHECK(L >= 0 && K >= 1 && chunks >= 1, "received rows: L={} K={} chunks={}", L, K, chunks);
  const size_t P = tokens_P.size();
  std::vector<int64_t> start(P + 1, 0);
  for (size_t p = 0; p < P; ++p) start[p + 1] = start[p] + tokens_P[p];
  const int64_t U = start[P];
  ReceivedRows out;
  out.row_UK.assign(static_cast<size_t>(U * K), -1);
  out.rows_L.assign(static_cast<size_t>(L), 0);
  out.offsets_CL1.assign(static_cast<size_t>(chunks * (L + 1)), 0);
  std::vector<int32_t> slot, row, counts(static_cast<size_t>(L)), offsets(static_cast<size_t>(L) + 1), token;
  std::vector<int64_t> u_of;  // the chunk's i-th token: its u
  int32_t first_row = 0;      // where chunk c's rows start
  for (int64_t c = 0; c < chunks; ++c) {
    slot.clear();
    u_of.clear();
    for (size_t p = 0; p < P; ++p) {
      const auto [lo, hi] = chunk_of_block(tokens_P[p], c, chunks);
      for (int64_t u = start[p] + lo; u < start[p] + hi; ++u) {
        u_of.push_back(u);
        slot.insert(slot.end(), slot_UK + u * K, slot_UK + (u + 1) * K);
      }
    }
    const auto n = static_cast<int64_t>(u_of.size());
    int32_t* chunk_offsets = out.offsets_CL1.data() + c * (L + 1);
    if (L == 0 || n == 0) {  // a window without slots receives nothing
      std::fill(chunk_offsets, chunk_offsets + L + 1, first_row);
      continue;
    }
    row.resize(static_cast<size_t>(n * K));
    token.resize(static_cast<size_t>(n * K));
    const int64_t rows =
        assign_rows(row.data(), counts.data(), offsets.data(), token.data(), slot.data(), n, L, K, n * K);
    for (int64_t l = 0; l <= L; ++l) chunk_offsets[l] = first_row + offsets[static_cast<size_t>(l)];
    for (int64_t l = 0; l < L; ++l) out.rows_L[static_cast<size_t>(l)] += counts[static_cast<size_t>(l)];
    for (int64_t i = 0; i < n * K; ++i)
      if (row[static_cast<size_t>(i)] >= 0)
        out.row_UK[static_cast<size_t>(u_of[static_cast<size_t>(i / K)] * K + i % K)] = first_row + row[static_cast<size_t>(i)];
    for (int64_t r = 0; r < rows; ++r)
      out.token_of_row_R.push_back(static_cast<int32_t>(u_of[static_cast<size_t>(token[static_cast<size_t>(r)])]));
    first_row += static_cast<int32_t>(rows);
  }
  return out;
}

template void pack_routing<float>(int32_t*, float*, const int32_t*, const int32_t*, const int32_t*, const int32_t*,
                                  const float*, const int32_t*, int64_t, int64_t, int);
template void pack_routing<double>(int32_t*, double*, const int32_t*, const int32_t*, const int32_t*, const int32_t*,
                                   const double*, const int32_t*, int64_t, int64_t, int);
template void scatter_token_rows<float>(float*, const float*, const int32_t*, const int32_t*, int64_t, int, int64_t);
template void scatter_token_rows<double>(double*, const double*, const int32_t*, const int32_t*, int64_t, int,
                                         int64_t);
template void sum_token_rows<float>(float*, const float*, const int32_t*, const int32_t*, int64_t, int, int64_t);
template void sum_token_rows<double>(double*, const double*, const int32_t*, const int32_t*, int64_t, int, int64_t);

}  // namespace moe
