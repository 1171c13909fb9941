#include "moe/dispatch.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace moe {
namespace {

void check_sizes(int64_t T_, int64_t K, int64_t D) {
  MOE_CHECK(T_ >= 0, "token count {} is negative", T_);
  MOE_CHECK(K >= 1, "top-k {} must be at least 1", K);
  MOE_CHECK(D >= 0, "dim {} is negative", D);
}

// Below this many element operations a loop runs on one thread: forking costs more than
// it saves (and is expensive when the cores are oversubscribed).
constexpr int64_t kMinParallelWork = 1 << 14;

}  // namespace

int64_t expert_capacity(double capacity_factor, int64_t T_, int64_t K, int64_t E) {
  MOE_CHECK(std::isfinite(capacity_factor) && capacity_factor >= 0,
            "capacity factor {} must be >= 0 (0 = no limit)", capacity_factor);
  MOE_CHECK(T_ >= 0 && K >= 1 && E >= 1, "bad shape T={} K={} E={}", T_, K, E);
  const int64_t assignments = T_ * K;
  if (capacity_factor == 0) return assignments;
  const double exact = capacity_factor * double(assignments) / double(E);
  if (exact >= double(assignments)) return assignments;
  // A factor such as 1.1 is not exact in binary; forgive that rounding before the ceiling.
  const double nearest = std::round(exact);
  const double capacity = std::abs(exact - nearest) <= 1e-9 * exact ? nearest : std::ceil(exact);
  return static_cast<int64_t>(capacity);
}

int64_t assign_rows(int32_t* row_TK, int32_t* counts_E, int32_t* offsets_E1,
                    int32_t* token_of_row_R, const int32_t* expert_TK, int64_t T_, int64_t E,
                    int64_t K, int64_t capacity) {
  check_sizes(T_, K, 0);
  MOE_CHECK(E >= 1, "expert count {} must be at least 1", E);
  MOE_CHECK(capacity >= 0, "capacity {} is negative", capacity);
  MOE_CHECK(T_ * K <= std::numeric_limits<int32_t>::max(), "T*K = {} rows exceed int32",
            T_ * K);
  const int64_t assignments = T_ * K;
  // Pass 1, in (t, k) order: keep while the expert has room; row_TK holds the position
  // inside the expert for now.
  std::fill(counts_E, counts_E + E, 0);
  for (int64_t i = 0; i < assignments; ++i) {
    const int32_t e = expert_TK[i];
    MOE_CHECK(e >= -1 && e < E, "expert index {} at token {} slot {} is outside [0, {}) (or -1: elsewhere)", e,
              i / K, i % K, E);
    if (e < 0) {
      row_TK[i] = -1;  // routed to another rank: no row here
    } else if (counts_E[e] < capacity) {
      row_TK[i] = counts_E[e]++;
    } else {
      row_TK[i] = -1;
    }
  }
  offsets_E1[0] = 0;
  for (int64_t e = 0; e < E; ++e) offsets_E1[e + 1] = offsets_E1[e] + counts_E[e];
  // Pass 2: position -> global row. Rows of an expert keep pass 1's (t, k) order.
  for (int64_t i = 0; i < assignments; ++i) {
    if (row_TK[i] < 0) continue;
    row_TK[i] += offsets_E1[expert_TK[i]];
    token_of_row_R[row_TK[i]] = static_cast<int32_t>(i / K);
  }
  return offsets_E1[E];
}

template <typename T>
void permute_forward(T* x_RD, const T* x_TD, const int32_t* token_of_row_R, int64_t R,
                     int64_t D) {
  MOE_CHECK(R >= 0 && D >= 0, "bad shape R={} D={}", R, D);
#pragma omp parallel for schedule(static) if (R * D >= kMinParallelWork)
  for (int64_t r = 0; r < R; ++r) {
    const T* src = x_TD + int64_t(token_of_row_R[r]) * D;
    std::copy(src, src + D, x_RD + r * D);
  }
}

template <typename T>
void permute_backward(T* dx_TD, const T* dx_RD, const int32_t* row_TK, int64_t T_, int64_t K,
                      int64_t D, bool accumulate) {
  check_sizes(T_, K, D);
#pragma omp parallel for schedule(static) if (T_ * K * D >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const int32_t* rows = row_TK + t * K;
    T* dx = dx_TD + t * D;
    for (int64_t d = 0; d < D; ++d) {
      double sum = accumulate ? double(dx[d]) : 0.0;
      for (int64_t k = 0; k < K; ++k)
        if (rows[k] >= 0) sum += double(dx_RD[int64_t(rows[k]) * D + d]);
      dx[d] = T(sum);
    }
  }
}

template <typename T>
void combine_forward(T* out_TD, const T* y_RD, const T* weight_TK, const int32_t* row_TK,
                     int64_t T_, int64_t K, int64_t D) {
  check_sizes(T_, K, D);
#pragma omp parallel for schedule(static) if (T_ * K * D >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const int32_t* rows = row_TK + t * K;
    const T* w = weight_TK + t * K;
    T* out = out_TD + t * D;
    for (int64_t d = 0; d < D; ++d) {
      double sum = 0;
      for (int64_t k = 0; k < K; ++k)
        if (rows[k] >= 0) sum += double(w[k]) * double(y_RD[int64_t(rows[k]) * D + d]);
      out[d] = T(sum);
    }
  }
}

template <typename T>
void combine_backward(T* dy_RD, T* dweight_TK, const T* dout_TD, const T* y_RD,
                      const T* weight_TK, const int32_t* row_TK, int64_t T_, int64_t K,
                      int64_t D) {
  check_sizes(T_, K, D);
#pragma omp parallel for schedule(static) if (T_ * K * D >= kMinParallelWork)
  for (int64_t t = 0; t < T_; ++t) {
    const T* dout = dout_TD + t * D;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t row = row_TK[t * K + k];
      if (row < 0) {
        dweight_TK[t * K + k] = T(0);
        continue;
      }
      const T* y = y_RD + int64_t(row) * D;
      T* dy = dy_RD + int64_t(row) * D;
      const double w = double(weight_TK[t * K + k]);
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        dot += double(dout[d]) * double(y[d]);
        dy[d] = T(w * double(dout[d]));
      }
      dweight_TK[t * K + k] = T(dot);
    }
  }
}

#define MOE_INSTANTIATE(T)                                                                     \
  template void permute_forward<T>(T*, const T*, const int32_t*, int64_t, int64_t);            \
  template void permute_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t,   \
                                    bool);                                                     \
  template void combine_forward<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t,   \
                                   int64_t);                                                   \
  template void combine_backward<T>(T*, T*, const T*, const T*, const T*, const int32_t*,      \
                                    int64_t, int64_t, int64_t);
MOE_INSTANTIATE(float)
MOE_INSTANTIATE(double)
#undef MOE_INSTANTIATE

}  // namespace moe
