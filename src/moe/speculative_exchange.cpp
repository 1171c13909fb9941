#include "moe/speculative_exchange.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace moe {

void speculative_blocks(int32_t* spec_pos_TP, int32_t* spec_tokens_P, const int32_t* pred_slot_TQ, int64_t T,
                        int64_t Q, const int32_t* slot_bounds_P1, const int32_t* window_end_P, int P, int me) {
  std::fill(spec_tokens_P, spec_tokens_P + P, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < P; ++p) {
      bool guessed = false;
      for (int64_t q = 0; q < Q && !guessed && p != me; ++q) {
        const int32_t s = pred_slot_TQ[t * Q + q];
        guessed = s >= slot_bounds_P1[p] && s < window_end_P[p];
      }
      spec_pos_TP[t * P + p] = guessed ? spec_tokens_P[p]++ : -1;
    }
}

void speculation_sources(int32_t* source_U, int32_t* corr_pos_TP, int32_t* corr_tokens_P, const int32_t* pos_TP,
                         const int32_t* tokens_P, const int32_t* spec_pos_TP, int64_t T, int P) {
  std::vector<int64_t> start(static_cast<size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) start[static_cast<size_t>(p) + 1] = start[static_cast<size_t>(p)] + tokens_P[p];
  std::fill(corr_tokens_P, corr_tokens_P + P, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int p = 0; p < P; ++p) {
      const int32_t pos = pos_TP[t * P + p], early = spec_pos_TP[t * P + p];
      corr_pos_TP[t * P + p] = pos >= 0 && early < 0 ? corr_tokens_P[p]++ : -1;
      if (pos >= 0) source_U[start[static_cast<size_t>(p)] + pos] = early >= 0 ? early : -corr_pos_TP[t * P + p] - 1;
    }
}

SpeculationRows merge_speculated_rows(void* rows_U, const int32_t* source_U, const int32_t* recv_tokens_P,
                                      const void* spec_rows, const int32_t* spec_recv_P, const void* corr_rows,
                                      const int32_t* corr_recv_P, int64_t row_bytes, int P, int me) {
  SpeculationRows counts;
  auto* to = static_cast<char*>(rows_U);
  const auto* spec = static_cast<const char*>(spec_rows);
  const auto* corr = static_cast<const char*>(corr_rows);
  const auto bytes = static_cast<size_t>(row_bytes);
  int64_t u = 0;
  for (int p = 0; p < P; ++p) {
    int64_t used = 0, corrected = 0;
    for (int32_t i = 0; i < recv_tokens_P[p]; ++i, ++u) {
      const int32_t s = source_U[u];
      if (s >= 0) {
        MOE_CHECK(s < spec_recv_P[p], "speculative dispatch: row {} from rank {} names early row {} of {}", i, p, s,
                  spec_recv_P[p]);
        std::memcpy(to + u * row_bytes, spec + s * row_bytes, bytes);
        ++used;
      } else {
        MOE_CHECK(-s - 1 < corr_recv_P[p], "speculative dispatch: row {} from rank {} names correction {} of {}", i, p,
                  -s - 1, corr_recv_P[p]);
        std::memcpy(to + u * row_bytes, corr + (-s - 1) * row_bytes, bytes);
        ++corrected;
      }
    }
    MOE_CHECK(corrected == corr_recv_P[p], "speculative dispatch: {} correction rows from rank {}, {} used", corr_recv_P[p],
              p, corrected);
    spec += spec_recv_P[p] * row_bytes;
    corr += corr_recv_P[p] * row_bytes;
    if (p == me) continue;
    counts.used += used;
    counts.wasted += spec_recv_P[p] - used;
    counts.corrected += corrected;
  }
  return counts;
}

}  // namespace moe
